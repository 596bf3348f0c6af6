"""Promise: a template's import is the agent's code and runs inside the wall a fresh episode
gets. The hostile agent of ``_attacks.HOSTILE`` runs its attacks at import time, in the
template, against a stand-in trainer with a unique marker, and each result must be what it is
in a fresh episode at the same containment: refused (the same layers answer). Then what the
import may start and what survives a template:

- daemons the import forks: refused (a template must have one thread and no child), killed.
- what the template starts late: dies with it (its PID namespace, its cgroup leaf).
- the parent's death: takes the template and what it started (``PR_SET_PDEATHSIG``, PID 1).
- writes and reads of the sandboxed import: only what an episode may (the sandbox's mounts and
  Landlock rules are made before the import).
- episodes of one template: cannot reach each other (each fork's own Landlock domain), nor
  each other's System V objects (each fork's own IPC namespace, in a user namespace of its
  own, where the trainer is root); an import that enters namespaces of its own is refused.
- PID 1 of the template's namespace: ends it only on a SIGTERM from outside (the parent's
  death); the import's is ignored, and an episode cannot signal it.
- a refused template is not tried again for the next episode."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import isolate
from isolate import EPISODE_ENV

from .. import _internals
from ..conftest import (
    MARKS,
    NOBODY,
    Agents,
    episode_processes,
    is_gone,
    remove_dead_parents_leaves,
    wait_for,
)
from ..teardown._trees import needs, tree
from ..test_templates import template_processes
from ._attacks import (
    HOSTILE,
    assert_forked,
    cap_findings,
    compare,
    expected_caps,
    expected_findings,
    host_mnt,
    hostile_as_nobody,
    nobody_parent,
    standin,
)

pytestmark = [pytest.mark.anyio]
__all__ = ["standin"]  # a fixture, used by name


#: The hostile agent, attacking once more at import: what it finds goes to import.json.
AT_IMPORT = """
import json as _json
_found = run(_json.loads(os.environ["HOSTILE_DATA"]))[1]
with open(os.path.join(os.environ["PID_DIR"], "import.json"), "w") as _f:
    _json.dump(_found, _f)
"""


#: The combinations a template is used at here (the others start fresh: see unusable()).
TEMPLATE_COMBINATIONS = ("session", "cgroup", "landlock", "pidns", "cgroup+pidns", "auto")


def needs_template(combination: str) -> str:
    """Skip unless this machine provides ``combination``; it, as given (``auto`` too)."""
    needs(combination)
    return combination


@pytest.fixture(params=TEMPLATE_COMBINATIONS)
def combination(request: pytest.FixtureRequest) -> str:
    return needs_template(request.param)


def import_findings(agents: Agents) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((agents.pids / "import.json").read_text())
    return found


async def test_the_import_is_refused_everything_a_fresh_episode_is(
    agents: Agents, standin: subprocess.Popen[bytes], combination: str
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the root agent's attacks: the trainer here is not root")
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("the attacks use x86_64 Linux system call numbers")
    scratch = agents.tmp / "scratch"
    scratch.mkdir()
    data = {"trainer": standin.pid, "host_mnt": host_mnt(), "scratch": str(scratch)}
    data["binaries"] = True
    spec = agents.spec(
        HOSTILE + AT_IMPORT,
        containment=combination,
        preload=True,
        exit_grace=2.0,
        timeout=120.0,
        env={"PID_DIR": str(agents.pids), "HOSTILE_DATA": json.dumps(data)},
    )
    outcome = await isolate.run_episode(spec, data)
    assert (outcome.status, outcome.reward, outcome.start) == ("ok", 0.25, "template"), (
        outcome.summary() + "\n" + outcome.stderr_tail[-3000:]
    )
    found = import_findings(agents)
    expected = expected_findings(combination, root=True)
    assert {**compare(found, expected), **cap_findings(found, root=True)} == {
        **expected,
        **expected_caps(root=True, found=found),
    }
    if "pidns" in _internals.layers(outcome.containment):
        assert max(found["pids"]) < 100, found["pids"]  # only its own namespace's
    assert standin.poll() is None
    assert not await anyio.Path(scratch).is_mount()
    await isolate.close_templates()
    assert template_processes(agents) == []
    assert tree(agents) == []


ENVIRON_READER = """
import os
def read(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return "read %d bytes" % len(f.read())
    except OSError as exc:
        return type(exc).__name__
with open(os.path.join(os.environ["PID_DIR"], "import.txt"), "w") as f:
    f.write(read(int(os.environ["TRAINER"])))
def run(data):
    return 1.0, read(data["trainer"])
"""


async def test_the_import_reads_the_trainers_environment_exactly_as_an_episode_would(
    agents: Agents, standin: subprocess.Popen[bytes], combination: str
) -> None:
    """The stand-in trainer's environment holds a unique marker: the import gets what a fresh
    episode's agent gets (refused wherever there is a wall), never more."""
    env = {"PID_DIR": str(agents.pids), "TRAINER": str(standin.pid)}
    data = {"trainer": standin.pid}
    fresh = await isolate.run_episode(
        agents.spec(ENVIRON_READER, containment=combination, env=env), data
    )
    assert (fresh.status, fresh.start) == ("ok", "fresh"), fresh.summary()
    (agents.pids / "import.txt").unlink()
    forked = await isolate.run_episode(
        agents.spec(ENVIRON_READER, containment=combination, env=env, preload=True), data
    )
    assert (forked.status, forked.start) == ("ok", "template"), forked.summary()
    at_import = (agents.pids / "import.txt").read_text()
    assert at_import == fresh.info == forked.info
    layers = _internals.layers(fresh.containment)
    if "pidns" in layers:
        assert at_import == "FileNotFoundError"  # not in its /proc at all
    elif "landlock" in layers:
        assert at_import == "PermissionError"
    await isolate.close_templates()


PARENT = """
import anyio, json, os, sys
import isolate

work = sys.argv[1]

async def main():
    data = {
        "trainer": os.getpid(),
        "host_mnt": os.stat("/proc/self/ns/mnt").st_ino,
        "scratch": os.path.join(work, "scratch"),
        "binaries": False,
    }
    spec = isolate.EpisodeSpec(
        agent_root=os.path.join(work, "agent_root"),
        entrypoint="hostile:run",
        timeout=60.0,
        kill_grace=1.0,
        exit_grace=2.0,
        log_dir=os.path.join(work, "logs"),
        cwd=work,
        preload=True,
        env={"PID_DIR": os.path.join(work, "pids"), "HOSTILE_DATA": json.dumps(data)},
    )
    outcome = await isolate.run_episode(spec, data)
    await isolate.close_templates()
    print(json.dumps({"uid": os.getuid(), "outcome": json.loads(outcome.model_dump_json())}))

anyio.run(main)
"""


def test_the_unprivileged_trainers_import_has_no_capability_and_is_refused() -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("the attacks use x86_64 Linux system call numbers")
    prefix = "isolate-template-nobody-"
    with hostile_as_nobody(prefix, HOSTILE + AT_IMPORT, PARENT) as (work, report):
        outcome = report["outcome"]
        assert (outcome["status"], outcome["reward"], outcome["start"]) == (
            "ok",
            0.25,
            "template",
        ), (outcome["error"], outcome["preload_refused"], outcome["stderr_tail"][-2000:])
        assert outcome["containment"] == "pidns"  # auto, for nobody: pidns in a userns
        found = json.loads((work / "pids" / "import.json").read_text())
        expected = expected_findings("pidns", root=False)
        assert {**compare(found, expected), **cap_findings(found, root=False)} == {
            **expected,
            **expected_caps(root=False, found=found),
        }
        assert episode_processes(f"PID_DIR={work}/pids".encode()) == []


DAEMON = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(os.path.join(os.environ["PID_DIR"], "daemon.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(os.environ["PID_DIR"], "daemon.tmp"),
                  os.path.join(os.environ["PID_DIR"], "daemon"))
        time.sleep(300)
    os._exit(0)
os.wait()
while not os.path.exists(os.path.join(os.environ["PID_DIR"], "daemon")):
    time.sleep(0.01)
"""


def tagged_daemons(agents: Agents) -> list[psutil.Process]:
    """Live processes of the test whose command line is the template's (a daemon the import
    forked) and that are neither a template's own process nor a fork of one."""
    own = {pid for t in _internals.started_templates() for pid in t.own_pids()}
    return [p for p in episode_processes(f"PID_DIR={agents.pids}".encode()) if p.pid not in own]


@pytest.mark.parametrize("combination", ["cgroup+pidns", "pidns", "session"])
async def test_a_daemon_the_import_forked_is_refused_and_killed(
    agents: Agents, combination: str
) -> None:
    needs_template(combination)
    spec = agents.spec(
        DAEMON + "def run(data):\n    return 1.0\n", containment=combination, preload=True
    )
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "fresh"), outcome.summary()
    assert outcome.preload_refused is not None
    assert "running after import" in outcome.preload_refused
    # The fresh start forked one too; its teardown took it. Nothing is left of either.
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: not tagged_daemons(agents), 5.0, "no daemon")
    )
    await isolate.close_templates()
    assert template_processes(agents) == []


LATE_DAEMON = """
import os, signal, subprocess, sys
def later(*_):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
signal.signal(signal.SIGUSR1, later)
def run(data):
    return 1.0
"""


@pytest.mark.parametrize("combination", ["cgroup+pidns", "pidns", "cgroup"])
async def test_what_the_template_starts_late_dies_with_it(agents: Agents, combination: str) -> None:
    """After the fork-safety check the agent's code still runs in the template (here a signal
    handler its import installed), and starts a process in a session of its own: it dies with
    the template, at close_templates() and when the parent is killed."""
    needs_template(combination)
    spec = agents.spec(LATE_DAEMON, containment=combination, preload=True)
    await isolate.park(spec, 0)  # no fork parked: the template's only child is its daemon
    first = await isolate.run_episode(spec, {})
    assert (first.status, first.start) == ("ok", "template"), first.summary()
    (template,) = _internals.started_templates()
    os.kill(template.pid, signal.SIGUSR1)
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: tagged_daemons(agents), 5.0, "the late process")
    )
    (late,) = tagged_daemons(agents)
    await isolate.close_templates()
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: is_gone(late.pid, late.create_time()), 5.0, "it to die")
    )
    assert template_processes(agents) == []
    assert tagged_daemons(agents) == []


def _sleeps(proc: psutil.Process) -> bool:
    """Whether ``proc`` runs LATE_DAEMON's ``sleep`` (not the template's program)."""
    try:
        return "time.sleep(300)" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


PARENT_OF_A_TEMPLATE = """
import anyio, isolate, sys
spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
async def main():
    outcome = await isolate.run_episode(spec, {})
    print(outcome.start, flush=True)
    await anyio.sleep(300)
anyio.run(main)
"""


@pytest.mark.parametrize("combination", ["cgroup+pidns", "pidns", "cgroup", "session"])
def test_the_parents_death_takes_the_template_and_what_it_started(
    agents: Agents, combination: str
) -> None:
    needs_template(combination)
    # After the parent's death, the template cancels what leads a session of its own below it
    # as it cancels its forks (the late process among them), and waits up to cancel_grace for
    # it: one that has not taken its SIGINT by then is killed. A short grace bounds that.
    spec = agents.spec(LATE_DAEMON, containment=combination, preload=True, cancel_grace=1.0)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_OF_A_TEMPLATE, spec.model_dump_json()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "template"
        (template,) = template_processes(agents, parent.pid)
        tag = f"PID_DIR={agents.pids}".encode()
        own = {p.pid for p in episode_processes(tag)}  # the template's (its episode is over)
        template.send_signal(signal.SIGUSR1)

        def late() -> list[psutil.Process]:
            # Once it runs its own program: before its exec, the child of subprocess shares
            # the template's memory and environment, and is not yet what the import started.
            return [p for p in episode_processes(tag) if p.pid not in own and _sleeps(p)]

        wait_for(late, 5.0, "the late process")
        seen = [p for p in episode_processes(tag) if p.pid in own] + late()
        assert len(seen) == len(own) + 1
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: all(is_gone(p.pid, p.create_time()) for p in seen), 5.0, "all to die")
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    remove_dead_parents_leaves()


@pytest.mark.skipif(not _internals.landlock_abi(), reason="the sandbox needs Landlock")
async def test_the_sandboxed_import_writes_and_reads_only_what_an_episode_may(
    agents: Agents,
) -> None:
    outside = agents.tmp / "outside"
    outside.mkdir()
    hidden = agents.tmp / "hidden"
    hidden.write_text("trainer-only")
    code = f"""
import json, os
found = {{}}
try:
    open({str(outside / "written")!r}, "w").close()
    found["write outside"] = "written"
except OSError as exc:
    found["write outside"] = type(exc).__name__
try:
    found["read hidden"] = open({str(hidden)!r}).read() or "empty"
except OSError as exc:
    found["read hidden"] = type(exc).__name__
import tempfile
path = os.path.join(tempfile.gettempdir(), "at-import")
open(path, "w").close()
found["write TMPDIR"] = "written"
with open(os.path.join(os.environ["PID_DIR"], "import.json"), "w") as f:
    json.dump(found, f)
def run(data):
    sibling = [p for p in os.listdir(os.path.dirname(os.environ["TMPDIR"]))]
    return 1.0, {{"tmp": os.environ["TMPDIR"], "under": sibling}}
"""
    sandbox = isolate.Sandbox(hide=(str(hidden),), write=(agents.pids,))
    spec = agents.spec(code, preload=True, sandbox=sandbox)
    outcomes = [await isolate.run_episode(spec, {}) for _ in range(2)]
    for outcome in outcomes:
        assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    found = import_findings(agents)
    assert found["write outside"] in ("PermissionError", "OSError"), found
    assert found["read hidden"] in ("empty", "PermissionError"), found
    assert found["write TMPDIR"] == "written"
    assert not (outside / "written").exists()
    # Each episode's TMPDIR lives under the template's, and is its own.
    tmps = [Path(o.info["tmp"]) for o in outcomes]
    assert tmps[0] != tmps[1]
    assert tmps[0].parent == tmps[1].parent
    assert len(_internals.started_templates()) == 1
    await isolate.close_templates()
    assert not tmps[0].parent.exists()


def test_a_control_message_is_never_cut() -> None:
    import socket as _socket

    from agent_shim.shim_wire import MAX_CONTROL_BYTES, receive_message, send_message

    mine, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    with mine, theirs:
        with pytest.raises(ValueError, match="pass what is larger as a file"):
            send_message(mine, {"x": "a" * MAX_CONTROL_BYTES})
        mine.sendmsg([b'{"x": "' + b"a" * MAX_CONTROL_BYTES + b'"}'])  # as a broken peer might
        with pytest.raises(ValueError, match="longer than"):
            receive_message(theirs)


@pytest.mark.skipif(not _internals.landlock_abi(), reason="the sandbox needs Landlock")
async def test_a_sandbox_whose_rules_outgrow_a_control_message(agents: Agents) -> None:
    """Hiding a file in a directory of 3,000 carves a rule for each of its neighbours: the
    template's wall is far larger than a control message, and reaches it whole."""
    crowded = agents.tmp / "crowded"
    crowded.mkdir()
    for i in range(3000):
        (crowded / f"neighbour-{i:04d}.txt").write_text("x")
    (crowded / "secret").write_text("trainer-only")
    code = f"""
def run(data):
    try:
        return 1.0, open({str(crowded / "secret")!r}).read() or "empty"
    except OSError as exc:
        return 1.0, type(exc).__name__
"""
    spec = agents.spec(code, preload=True, sandbox=isolate.Sandbox(hide=(str(crowded / "secret"),)))
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template"), (
        outcome.summary(),
        outcome.preload_refused,
    )
    assert outcome.info in ("empty", "PermissionError", "FileNotFoundError")
    await isolate.close_templates()


SIBLING = """
import os, signal, subprocess, time
def run(data):
    pids = os.environ["PID_DIR"]
    if data["name"] == "victim":
        # A process it exec'd: dumpable, with the episode's environment.
        child = subprocess.Popen(["sleep", "60"])
        with open(os.path.join(pids, "victim.tmp"), "w") as f:
            f.write(str(child.pid))
        os.rename(os.path.join(pids, "victim.tmp"), os.path.join(pids, "victim"))
        while not os.path.exists(os.path.join(pids, "done")):
            time.sleep(0.01)
        alive = child.poll() is None
        child.kill()
        child.wait()
        return 1.0, {"alive": alive}
    while not os.path.exists(os.path.join(pids, "victim")):
        time.sleep(0.01)
    victim = int(open(os.path.join(pids, "victim")).read())
    found = {"seen": os.path.exists("/proc/%d" % victim)}
    for sig in (0, signal.SIGKILL):
        try:
            os.kill(victim, sig)
            found[str(sig)] = "sent"
        except OSError as exc:
            found[str(sig)] = type(exc).__name__
    try:
        found["environ"] = len(open("/proc/%d/environ" % victim, "rb").read())
    except OSError as exc:
        found["environ"] = type(exc).__name__
    open(os.path.join(pids, "done"), "w").close()
    return 1.0, found
"""


@pytest.mark.parametrize("combination", ["cgroup+pidns", "pidns"])
async def test_episodes_of_one_template_cannot_reach_each_other(
    agents: Agents, combination: str
) -> None:
    """Two episodes forked from one template share its PID namespace: the attacker sees the
    victim's pid, and cannot signal it or read its environment."""
    needs_template(combination)
    spec = agents.spec(SIBLING, containment=combination, preload=True)
    results: dict[str, isolate.EpisodeOutcome] = {}

    async def one(name: str) -> None:
        results[name] = await isolate.run_episode(spec, {"name": name})

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "victim")
        tg.start_soon(one, "attacker")
    victim, attacker = results["victim"], results["attacker"]
    assert (victim.status, victim.reward, victim.start) == ("ok", 1.0, "template"), victim.summary()
    assert (attacker.status, attacker.start) == ("ok", "template"), attacker.summary()
    assert victim.info == {"alive": True}
    assert attacker.info == {
        "seen": True,
        "0": "PermissionError",
        "9": "PermissionError",
        "environ": "PermissionError",
    }, attacker.info
    await isolate.close_templates()
    assert template_processes(agents) == []


# Sends PID 1 of the template's namespace SIGTERM at import (the importer may: it is in no
# Landlock domain without the ``landlock`` layer) and waits until PID 1 has taken it; its
# episode tries the same.
SIGTERM_TO_PID_1 = """
import os, signal, time

def pending(pid):
    with open("/proc/%d/status" % pid) as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines())
    return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)

def send(sig):
    try:
        os.kill(1, sig)
        return "sent"
    except OSError as exc:
        return type(exc).__name__

AT_IMPORT = send(signal.SIGTERM)
end = time.monotonic() + 10.0
while pending(1) & (1 << (signal.SIGTERM - 1)) and time.monotonic() < end:
    time.sleep(0.01)
TAKEN = not pending(1) & (1 << (signal.SIGTERM - 1))

def run(data):
    return 1.0, {"import": AT_IMPORT, "taken": TAKEN, "0": send(0), "15": send(signal.SIGTERM)}
"""


@pytest.mark.parametrize("combination", ["cgroup+pidns", "pidns"])
async def test_only_the_parents_death_makes_pid_1_end_the_template(
    agents: Agents, combination: str
) -> None:
    """PID 1 cancels the episodes and ends the namespace on SIGTERM from outside it (the outer
    process, at the parent's death) only: the import's SIGTERM changes nothing, and an episode
    cannot signal PID 1 at all (its Landlock domain)."""
    needs_template(combination)
    spec = agents.spec(SIGTERM_TO_PID_1, containment=combination, preload=True)
    first = await isolate.run_episode(spec, {})
    assert (first.status, first.start) == ("ok", "template"), first.summary()
    assert first.info == {
        "import": "sent",
        "taken": True,
        "0": "PermissionError",
        "15": "PermissionError",
    }, first.info
    (template,) = _internals.started_templates()
    second = await isolate.run_episode(spec, {})
    assert (second.status, second.start) == ("ok", "template"), second.summary()
    assert _internals.started_templates() == [template]
    assert template.alive()
    await isolate.close_templates()
    assert template_processes(agents) == []


#: A System V segment made by one episode of a template, looked for by its siblings: by key,
#: in /proc/sysvipc/shm, and attached, while it lives and after its episode ended. Run in
#: plain processes too (the control), with PID_DIR set.
SYSV = (
    MARKS
    + r"""
import ctypes, errno, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
IPC_CREAT, SHM_RDONLY = 0o1000, 0o10000
FAILED = ctypes.c_void_p(-1).value



def look(key, size):
    keys = [int(line.split()[0]) for line in open("/proc/sysvipc/shm").readlines()[1:]]
    found = {"listed": key in keys, "read": None}
    found["dev shm"] = os.path.exists("/dev/shm/isolate-sysv-%d" % key)
    queue = libc.mq_open(b"/isolate-sysv-%d" % key, os.O_RDONLY)
    if queue >= 0:
        os.close(queue)
    found["queue"] = queue >= 0 or os.path.exists("/dev/mqueue/isolate-sysv-%d-file" % key)
    pty = os.path.join(os.environ["PID_DIR"], "pty")
    found["pty"] = os.path.exists(pty) and open(pty).read() in os.listdir("/dev/pts")
    shmid = libc.shmget(key, 0, 0)
    address = libc.shmat(shmid, None, SHM_RDONLY) if shmid >= 0 else FAILED
    if address not in (FAILED, None):
        found["read"] = ctypes.string_at(address, size).decode()
    return found


def creat(path):
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def attempt(call, path):
    try:
        call(path)
        return "done"
    except OSError as exc:
        return errno.errorcode[exc.errno]


def run(data):
    key, secret, role = data["key"], data["credential"], data["role"]
    if role == "writer":
        shmid = libc.shmget(key, 4096, IPC_CREAT | 0o600)
        address = libc.shmat(shmid, None, 0)
        ctypes.memmove(address, secret.encode(), len(secret))
        with open("/dev/shm/isolate-sysv-%d" % key, "w") as f:
            f.write(secret)  # POSIX shared memory: a file there
        # A POSIX message queue (Landlock refuses them, mq_open and /dev/mqueue alike), and
        # one made through the file system.
        libc.mq_open(b"/isolate-sysv-%d" % key, os.O_CREAT | os.O_RDWR, 0o600, None)
        if os.path.isdir("/dev/mqueue") and not data.get("dev"):
            creat("/dev/mqueue/isolate-sysv-%d-file" % key)
        terminal, pty = os.openpty()  # a terminal: its name in /dev/pts
        with open(os.path.join(os.environ["PID_DIR"], "pty"), "w") as f:
            f.write(os.path.basename(os.ttyname(pty)))
        mark("written")
        wait("checked")
        ids = open("/proc/self/uid_map").read().split()
        info = {"own": look(key, len(secret)), "uid_map": ids}
        if data.get("dev"):  # what the rule on /dev that a sandbox's fork gets leaves open
            info["dev"] = [attempt(f, p) for f, p in ((creat, "/dev/x"), (os.unlink, "/dev/zero"))]
        return 1.0, info
    if role == "sibling":
        wait("written")
        found = look(key, len(secret))
        mark("checked")
        return 1.0, {"sibling": found}
    return 1.0, {"later": look(key, len(secret))}
"""
)


def test_the_system_v_attack_reaches_a_segment_from_a_plain_process(tmp_path: Path) -> None:
    """The control: two plain processes of one IPC namespace, as the episodes below try."""
    (tmp_path / "sysv.py").write_text(SYSV)
    key = 0x154_0000 + os.getpid() % 0xFFFF
    data = {"key": key, "credential": f"sk-sysv-{os.urandom(8).hex()}"}
    script = "import json, sys, sysv; print(json.dumps(sysv.run(json.loads(sys.argv[1]))[1]))"
    env = {**os.environ, "PID_DIR": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    run = [sys.executable, "-c", script]
    try:
        writer = subprocess.Popen(
            [*run, json.dumps({**data, "role": "writer"})], env=env, stdout=subprocess.PIPE
        )
        sibling = subprocess.run(
            [*run, json.dumps({**data, "role": "sibling"})], env=env, capture_output=True
        )
        out, _ = writer.communicate(timeout=30)
        found = {"listed": True, "read": data["credential"], "dev shm": True}
        found |= {"queue": True, "pty": True}
        assert json.loads(sibling.stdout)["sibling"] == found
        assert json.loads(out)["own"]["read"] == data["credential"]
    finally:
        subprocess.run(["ipcrm", "-M", str(key)], capture_output=True)
        ctypes.CDLL(None).mq_unlink(b"/isolate-sysv-%d" % key)
        Path(f"/dev/shm/isolate-sysv-{key}").unlink(missing_ok=True)


@pytest.mark.parametrize("sandboxed", [False, True], ids=["plain", "sandbox"])
@pytest.mark.parametrize("combination", ["cgroup+pidns", "pidns"])
async def test_episodes_of_one_template_share_no_system_v_object(
    agents: Agents, combination: str, sandboxed: bool
) -> None:
    """Each fork of a template makes IPC and UTS namespaces of its own, in a user namespace
    that maps every id to itself, and a mount namespace with its own ``/dev/shm`` (under a
    sandbox, mounted by the template's outer process): a segment one episode made is not
    listed, found by its key or attached by a sibling forked from the same template, nor by a
    later one; nor is the file it made in ``/dev/shm``. Under a sandbox, whose Landlock rule
    for it is on ``/dev``, nothing else in ``/dev`` can be made or removed."""
    needs_template(combination)
    if os.geteuid() != 0:
        pytest.skip("root's: each id mapped to itself (nobody's: the test below)")
    box = isolate.Sandbox(write=(str(agents.pids),)) if sandboxed else None
    spec = agents.spec(SYSV, containment=combination, preload=True, sandbox=box)
    key = 0x155_0000 + os.getpid() % 0xFFFF
    data = {"key": key, "credential": f"sk-sysv-{os.urandom(8).hex()}", "dev": sandboxed}
    results: dict[str, isolate.EpisodeOutcome] = {}

    async def one(role: str) -> None:
        results[role] = await isolate.run_episode(spec, {**data, "role": role})

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "writer")
        tg.start_soon(one, "sibling")
    await one("later")
    for outcome in results.values():
        assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    absent = {"listed": False, "read": None, "dev shm": False, "queue": False, "pty": False}
    own = {"listed": True, "read": data["credential"], "dev shm": True, "pty": True}
    own["queue"] = not sandboxed  # Landlock refuses POSIX message queues (mq_open, /dev/mqueue)
    expected = {"own": own, "uid_map": ["0", "0", "4294967295"]}
    assert results["writer"].info == expected | ({"dev": ["EROFS", "EROFS"]} if sandboxed else {})
    assert results["sibling"].info == {"sibling": absent}
    assert results["later"].info == {"later": absent}
    (template,) = _internals.started_templates()
    assert template.own_namespaces
    await isolate.close_templates()
    assert template_processes(agents) == []


@pytest.mark.parametrize("sandboxed", [False, True], ids=["plain", "sandbox"])
def test_an_unprivileged_trainers_template_episodes_share_no_system_v_object(
    sandboxed: bool,
) -> None:
    """As ``nobody`` (a template in a user namespace of its own): each fork makes user, IPC,
    UTS and mount namespaces of its own, and its id is mapped, by the fork itself or, under a
    sandbox, whose Landlock rules keep it from its maps in /proc, by the template's outer
    process, which mounts its /dev/pts, /dev/shm and /dev/mqueue too."""
    parent = nobody_parent(
        "isolate.Sandbox(write=(pids,))" if sandboxed else "None",
        ("writer", "sibling"),
        later=("later",),
        data='{"key": 0x156_0000 + os.getpid() % 0xFFFF, "credential": "sk-sysv-"'
        f' + os.urandom(8).hex(), "dev": {sandboxed}}}',
    )
    with hostile_as_nobody("isolate-sysv-nobody-", SYSV, parent) as (work, report):
        outcomes = report["outcomes"]
        assert_forked(outcomes)
        absent = {"listed": False, "read": None, "dev shm": False, "queue": False, "pty": False}
        own = {"listed": True, "read": report["data"]["credential"], "dev shm": True, "pty": True}
        own["queue"] = not sandboxed  # Landlock refuses POSIX message queues
        writer = {"own": own, "uid_map": [str(NOBODY), str(NOBODY), "1"]}
        if sandboxed:
            writer["dev"] = ["EROFS", "EROFS"]
        assert outcomes["writer"]["info"] == writer
        assert outcomes["sibling"]["info"] == {"sibling": absent}
        assert outcomes["later"]["info"] == {"later": absent}
        assert episode_processes(f"PID_DIR={work}/pids".encode()) == []


#: A sibling's memory, tried: the victim makes its worker dumpable (as a fork whose ids the
#: template maps is, until its handshake) and waits; the attacker opens its /proc/PID/mem and
#: reads its environ. Each says what it found.
DUMPABLE_SIBLING = (
    MARKS
    + r"""
import ctypes, errno, os


def attempt(call):
    try:
        call()
        return "done"
    except OSError as exc:
        return errno.errorcode[exc.errno]


def run(data):
    pid_dir = os.environ["PID_DIR"]
    if data["role"] == "victim":
        ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
        with open(os.path.join(pid_dir, "victim.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(pid_dir, "victim.tmp"), os.path.join(pid_dir, "victim"))
        wait("attacked")
        return 1.0, {"victim": os.getpid()}
    wait("victim")
    victim = int(open(os.path.join(pid_dir, "victim")).read())
    found = {
        "mem": attempt(lambda: os.close(os.open("/proc/%d/mem" % victim, os.O_RDONLY))),
        "mem rw": attempt(lambda: os.close(os.open("/proc/%d/mem" % victim, os.O_RDWR))),
        "environ": attempt(lambda: open("/proc/%d/environ" % victim, "rb").read()),
    }
    mark("attacked")
    return 1.0, found
"""
)


@pytest.mark.parametrize("plain", [True, False], ids=["control", "episodes"])
def test_a_sibling_cannot_reach_a_dumpable_fork_of_the_same_template(plain: bool) -> None:
    """As ``nobody``, under a sandbox: the window in which a fork is dumpable, for the
    template's outer process to map its ids, opens nothing to a sibling. Each fork is in a
    user namespace of its own and holds no capability in a sibling's, which the kernel's
    ptrace check wants of processes in different ones; each worker is in a Landlock domain of
    its own, which may not trace a process outside it; /proc is read-only. The control: two
    plain processes of the same user, where the attacker reads and writes the victim."""
    box = "isolate.Sandbox(write=(pids,))"
    parent = nobody_parent(box, ("victim", "attacker"), plain=plain)
    with hostile_as_nobody("isolate-dumpable-", DUMPABLE_SIBLING, parent) as (work, report):
        outcomes = report["outcomes"]
        if not plain:
            assert_forked(outcomes)
        found = outcomes["attacker"]["info"]
        if plain:
            assert found == {"mem": "done", "mem rw": "done", "environ": "done"}
        else:  # the read-only /proc answers a write first; the ptrace check the rest
            assert found == {"mem": "EACCES", "mem rw": "EROFS", "environ": "EACCES"}
        assert episode_processes(f"PID_DIR={work}/pids".encode()) == []


#: Import code that moves the template into namespaces of its own (the one unshare its filter
#: allows, for its forks: user, IPC, UTS and, without a sandbox, mount): the forks would share
#: them.
UNSHARE_AT_IMPORT = """
import ctypes, os
_done = ctypes.CDLL(None).unshare(0x10000000 | 0x08000000 | 0x04000000 | 0x00020000) == 0
with open(os.path.join(os.environ["PID_DIR"], "unshared"), "a") as f:
    f.write(str(_done) + "\\n")
def run(data):
    return 1.0
"""


async def test_an_import_that_enters_namespaces_of_its_own_is_refused(agents: Agents) -> None:
    needs_template("cgroup+pidns")
    spec = agents.spec(UNSHARE_AT_IMPORT, containment="cgroup+pidns", preload=True)
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "fresh"), outcome.summary()
    assert outcome.preload_refused == (
        "the import entered namespaces of its own: its forks would share them"
    )
    # Done in the template (its filter allows it, for its forks); refused in the fresh start.
    assert (agents.pids / "unshared").read_text().split() == ["True", "False"]
    await isolate.close_templates()
    assert template_processes(agents) == []


# Records each import of the agent's module with the environment tag of the process that
# imports it (a template's name, or the episode's id), and keeps a thread running after import:
# no template can be forked from it.
REFUSED_AT_IMPORT = f"""
import os, threading, time
with open(os.path.join(os.environ["PID_DIR"], "imports"), "a") as f:
    f.write(os.environ[{EPISODE_ENV!r}] + "\\n")
threading.Thread(target=time.sleep, args=(60,), name="cost-map-retry", daemon=True).start()
def run(data):
    return 1.0
"""


async def test_a_refused_template_is_not_tried_again_for_the_next_episode(agents: Agents) -> None:
    spec = agents.spec(REFUSED_AT_IMPORT, preload=True)
    reason = "thread 'cost-map-retry' running after import"
    outcomes = [await isolate.run_episode(spec, {}) for _ in range(2)]
    for outcome in outcomes:
        assert (outcome.status, outcome.start) == ("ok", "fresh"), outcome.summary()
        assert outcome.preload_refused == reason
        assert f"preload refused: {reason}; this episode starts fresh" in outcome.stderr_tail
    imports = (agents.pids / "imports").read_text().split()
    templates = [tag for tag in imports if tag.startswith("template.")]
    assert len(templates) == 1, imports  # one template started, for both episodes
    assert sorted(set(imports) - set(templates)) == sorted(o.episode_id for o in outcomes)
    assert "started (pid" not in outcomes[1].stderr_tail
