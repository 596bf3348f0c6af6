"""Promise: an agent cannot signal, trace, read or kill the trainer, its supervisor or a
sibling episode, nor see them. Real attacks on a stand-in trainer at every containment
combination this machine provides, and broad ones (``pkill``) where a PID namespace makes them
safe. Which layer answers:

- signals, ``ptrace``, ``/proc/PID/{environ,mem}`` of the trainer: the PID namespace (``pidns``:
  no pid to name, ``ENOENT``/``ESRCH``); Landlock's scope (``landlock``: ``EPERM``/``EACCES``);
  nothing at ``cgroup`` and ``session``, where the test checks what doctor says is exposed.
- ``pkill`` of every shim or python from one episode: the PID namespace; the sibling runs on.
- listing processes (``/proc``, ``ps``): the PID namespace shows PID 1 and the agent only.
- the supervisor's memory and fds: ``test_privileges.py``."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import isolate
from isolate._cli import doctor as _doctor

from .. import _internals
from ..conftest import SLOW, Agents, wait_until
from ..teardown._trees import needs, tree
from ._attacks import WALLED, combination

pytestmark = pytest.mark.anyio
__all__ = ["combination"]  # a fixture, used by name


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
    on = _internals.layers(combination)
    if "pidns" in on:  # the trainer's pid means nothing in the agent's namespace
        return {"environ": "ENOENT", "mem": "ENOENT", "ptrace": "ESRCH", "pkill": 1}, True
    if "landlock" in on:
        readable = _internals.landlock().environ_readable and os.geteuid() != 0
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


async def test_the_pidns_agent_sees_only_its_namespace(agents: Agents) -> None:
    needs("pidns")
    spec = agents.spec(
        """
        import os, subprocess
        def run(data):
            subprocess.run(["true"])
            return 1.0, {"pid": os.getpid(), "proc": sorted(int(p) for p in os.listdir("/proc")
                                                           if p.isdigit())}
        """,
        containment="pidns",
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.info == {"pid": 2, "proc": [1, 2]}  # its PID 1 and itself, nothing else
