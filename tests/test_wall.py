"""The wall between an agent and the rest of the machine: real attacks on a stand-in trainer at
every containment combination this machine provides, broad attacks on sibling episodes where
a PID namespace makes them safe, and what doctor says is left."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import isolate
from isolate._cli import doctor as _doctor
from isolate._core import containment as _containment

from .conftest import SLOW, Agents, wait_until
from .test_cli import SCRIPTED
from .test_containment import COMBINATIONS, needs, tree

pytestmark = pytest.mark.anyio

# What a careless (or hostile) agent does to a process it found. Each result is a word: what
# happened, or the errno name of the refusal.
ATTACKER = """
import ctypes, errno, os, signal, subprocess

def attempt(fn):
    try:
        return fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def read_environ(pid, marker):
    with open("/proc/%d/environ" % pid, "rb") as f:
        return "read, key in it" if marker.encode() in f.read() else "read, no key"

def read_mem(pid):
    with open("/proc/%d/mem" % pid, "rb") as mem:
        with open("/proc/%d/maps" % pid) as maps:
            start = next(int(l.split("-")[0], 16) for l in maps if l.split()[1][0] == "r")
        mem.seek(start)
        return "read %d bytes" % len(mem.read(16))

def ptrace(pid):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
        return errno.errorcode[ctypes.get_errno()]
    os.waitpid(pid, 0)
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    return "attached"

def kill(pid):
    os.kill(pid, signal.SIGKILL)
    return "sent"

def run(data):
    pid, marker = data["pid"], data["marker"]
    found = {
        "environ": attempt(lambda: read_environ(pid, marker)),
        "mem": attempt(lambda: read_mem(pid)),
        "ptrace": attempt(lambda: ptrace(pid)),
    }
    found["pkill"] = subprocess.run(["pkill", "-9", "-f", marker]).returncode
    found["kill"] = attempt(lambda: kill(pid))
    return 1.0, found
"""


@pytest.fixture
def trainer() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A stand-in trainer: a unique marker on its command line and, as a credential, in its
    environment (the real trainer is the test runner: never the target)."""
    marker = f"standin{secrets.token_hex(6)}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time, sys; time.sleep(120)", marker],
        env={"PATH": os.environ["PATH"], f"TRAINER_KEY_{marker}": "x"},
    )
    yield proc, marker
    proc.kill()
    proc.wait()


def expected_attack(combination: str) -> tuple[dict[str, Any], bool]:
    """What each attack gives at ``combination``, and whether the stand-in survives."""
    on = _containment.layers(combination)
    if "pidns" in on:  # the trainer's pid means nothing in the agent's namespace
        return {"environ": "ENOENT", "mem": "ENOENT", "ptrace": "ESRCH", "pkill": 1}, True
    if "landlock" in on:
        readable = _containment.landlock().environ_readable and os.geteuid() != 0
        environ = "read, key in it" if readable else "EACCES"
        return {"environ": environ, "mem": "EACCES", "ptrace": "EPERM", "kill": "EPERM"}, True
    # No wall: what doctor warns about, every part of it true.
    exposure = _doctor.exposure(combination)
    if os.geteuid() == 0:
        # A root agent without CAP_SYS_PTRACE holds fewer capabilities than the root trainer:
        # the kernel refuses it the trainer's environ and memory, not the signal (CAP_KILL).
        assert not [w for w in exposure if "environ" in w or "ptrace" in w], exposure
        return {"environ": "EACCES", "mem": "EACCES", "ptrace": "EPERM", "pkill": 0}, False
    ptrace = "attached" if any("ptrace" in w for w in exposure) else "EPERM"
    return {
        "environ": "read, key in it",
        "mem": "read 16 bytes",
        "ptrace": ptrace,
        "pkill": 0,
    }, False


@pytest.fixture(params=COMBINATIONS)
def combination(request: pytest.FixtureRequest) -> str:
    return needs(request.param)


async def test_attacks_on_the_trainer(
    agents: Agents, trainer: tuple[subprocess.Popen[bytes], str], combination: str
) -> None:
    if not shutil.which("pkill"):
        pytest.skip("needs pkill")
    stand_in, marker = trainer
    spec = agents.spec(ATTACKER, containment=combination)
    outcome = await isolate.run_episode(spec, {"pid": stand_in.pid, "marker": marker})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.containment == combination
    expected, survives = expected_attack(combination)
    found = dict(outcome.info)
    assert {k: found[k] for k in expected} == expected
    if survives:
        assert stand_in.poll() is None, "the stand-in trainer was killed"
    else:
        assert stand_in.wait(timeout=10 * SLOW) == -9  # killed by the agent's pkill -9 -f


# --- broad attacks: only where the PID namespace makes them safe ------------------------------

# Refuses to attack unless it is inside a PID namespace whose PID 1 is the shim: should the
# wall be missing, the attack would reach the test runner and every process of the machine.
BROAD = """
import os, subprocess, time

def inside_the_wall():
    with open("/proc/1/cmdline", "rb") as f:
        return b"agent_shim" in f.read() and os.getpid() < 100

def run(data):
    if not inside_the_wall():
        raise RuntimeError("no PID namespace around this episode: not attacking")
    open(os.path.join(os.environ["PID_DIR"], data["name"]), "w").close()
    subprocess.run(data["argv"])
    time.sleep(30)  # the attack takes this episode down too
"""

SIBLING = """
import os, time

def run(data):
    open(os.path.join(os.environ["PID_DIR"], "sibling"), "w").close()
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "release")):
        time.sleep(0.01)
    return 1.0
"""

WALLED = [c for c in COMBINATIONS if "pidns" in _containment.layers(c)]


@pytest.mark.parametrize("combination", WALLED)
async def test_pkill_in_one_episode_leaves_its_sibling_running_to_ok(
    agents: Agents, trainer: tuple[subprocess.Popen[bytes], str], combination: str
) -> None:
    needs(combination)
    if not shutil.which("pkill"):
        pytest.skip("needs pkill")
    stand_in, _ = trainer
    sibling = agents.spec(SIBLING, containment=combination)
    attacker = agents.spec(BROAD, containment=combination, timeout=20.0)
    attacks = {"shims": ["pkill", "-9", "-f", "agent_shim"], "pythons": ["pkill", "python"]}
    outcomes: dict[str, isolate.EpisodeOutcome] = {}

    async def one(name: str, spec: isolate.EpisodeSpec, data: dict[str, Any]) -> None:
        outcomes[name] = await isolate.run_episode(spec, data)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "sibling", sibling, {})
        await wait_until((agents.pids / "sibling").exists)
        async with anyio.create_task_group() as attackers:
            for name, argv in attacks.items():
                attackers.start_soon(one, name, attacker, {"name": name, "argv": argv})
        (agents.pids / "release").touch()
    for name in attacks:
        # The attack ran, and took down its own episode: it reached what it could see.
        assert (agents.pids / name).exists()
        assert outcomes[name].status == "crashed", outcomes[name].summary()
    assert outcomes["sibling"].status == "ok", outcomes["sibling"].summary()
    assert outcomes["sibling"].reward == 1.0
    assert stand_in.poll() is None
    assert tree(agents) == []


@pytest.mark.parametrize("combination", WALLED)
async def test_the_agent_sees_only_its_own_episode(agents: Agents, combination: str) -> None:
    needs(combination)
    spec = agents.spec(
        """
        import os, subprocess
        def run(data):
            ps = subprocess.run(["ps", "-e", "-o", "pid="], capture_output=True, text=True)
            mine = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            return 1.0, {"pid": os.getpid(), "proc": mine, "ps": ps.stdout.split()}
        """,
        containment=combination,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    # Its PID 1 (the supervisor), itself, and ps while it ran: nothing else.
    assert outcome.info["pid"] == 2
    assert outcome.info["proc"] == [1, 2]
    assert outcome.info["ps"] == ["1", "2", "3"]


# --- a machine without the stronger layers ----------------------------------------------------

# Makes the landlock_* system calls fail with ENOSYS for this process and all it starts, as on
# a kernel without Landlock, then runs the command in argv.
NO_LANDLOCK = r"""
import ctypes, os, struct, sys
ALLOW, ENOSYS = 0x7FFF0000, 0x00050000 | 38
program = [
    (0x20, 0, 0, 0),  # load the system call number
    (0x35, 0, 2, 444),  # < landlock_create_ruleset: allow
    (0x25, 1, 0, 446),  # > landlock_restrict_self: allow
    (0x06, 0, 0, ENOSYS),
    (0x06, 0, 0, ALLOW),
]
code = b"".join(struct.pack("HBBI", *op) for op in program)
buf = ctypes.create_string_buffer(code)
fprog = struct.pack("HxxxxxxQ", len(program), ctypes.addressof(buf))
fbuf = ctypes.create_string_buffer(fprog)
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p] + [ctypes.c_ulong] * 2
assert libc.prctl(38, 1, None, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.addressof(fbuf), 0, 0) == 0, ctypes.get_errno()  # SECCOMP filter
os.execv(sys.argv[1], sys.argv[1:])
"""

# Run as root: a mount namespace with every cgroup tree read-only, then a user namespace that
# allows no further ones and no CAP_SYS_ADMIN: no cgroup layer, no PID namespace.
WITHOUT_NAMESPACES = """
set -e
for point in $CGROUP_MOUNTS; do mount -o remount,bind,ro "$point"; done
exec unshare --user --map-root-user sh -c '
    echo 0 > /proc/sys/user/max_user_namespaces
    exec setpriv --inh-caps=-sys_admin --bounding-set=-sys_admin "$@"' sh "$@"
"""


@pytest.mark.parametrize("landlock", [False, True], ids=["nothing", "landlock only"])
def test_without_the_stronger_layers_episodes_run_and_doctor_says_what_is_missing(
    tmp_path: Path, landlock: bool
) -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv to take the layers away for real")
    if landlock:
        needs("landlock")
    script = tmp_path / "without.sh"
    script.write_text(WITHOUT_NAMESPACES)
    mounts = [p for t, _, p, _ in _containment.probes._mounts() if t in ("cgroup", "cgroup2")]
    command = [sys.executable, "-m", "isolate", "doctor", "--agent-root", str(SCRIPTED)]
    if not landlock:
        command = [sys.executable, "-c", NO_LANDLOCK, *command]
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", str(script), *command],
        capture_output=True,
        text=True,
        timeout=120 * SLOW,
        env={**os.environ, "CGROUP_MOUNTS": " ".join(mounts)},
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr  # a weaker layer is a warning, not a failure
    assert "warn  layer cgroup: not available: cgroup tree" in out
    assert "warn  layer pidns: not available: namespaces not permitted" in out
    used = "landlock" if landlock else "session"
    assert f"ok    containment auto: {used}\n" in out
    assert f"containment {used})" in out  # the shim's round trip ran there
    assert f"warn  at {used} an agent can still, whatever it runs:" in out
    # Root inside that user namespace is the host's root: its file access is not walled.
    assert "warn  the trainer runs as root, and so does the agent" in out
    assert "info  to add pidns: PID namespaces: allow user namespaces" in out
    assert "info  to add cgroup: a delegated cgroup v2 subtree" in out
    if landlock:
        assert "ok    layer landlock: available" in out
        assert "kill the trainer" not in out
        assert "to add landlock" not in out
    else:
        assert "warn  layer landlock: not available: the kernel has no Landlock" in out
        assert "- kill the trainer and every sibling episode" in out
        assert "info  to add landlock: Landlock ABI 6" in out


# Bits of linux/capability.h, for the names doctor and the README give.
CAPABILITY_BITS = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "NET_BIND_SERVICE": 10,
    "SYS_CHROOT": 18,
    "AUDIT_WRITE": 29,
}


def test_the_parent_names_the_capabilities_the_shim_keeps() -> None:
    import agent_shim.shim

    named = sorted(CAPABILITY_BITS[name] for name in _containment.KEPT_CAPABILITIES)
    assert named == sorted(agent_shim.shim.load_part("worker").KEPT_CAPABILITIES)
    assert sum(1 << bit for bit in named) == 0x200404FB  # as docs/containment.md gives CapEff
