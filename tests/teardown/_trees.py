"""What the files of ``tests/teardown`` share, and other test files import: the containment
levels and combinations (``needs`` skips, with the reason, where this machine lacks one; the
fixtures ``level`` and ``combination``, which a test file imports and names in its
``__all__``), the processes of a test's episodes seen from the host, the agent that builds a
tree of ten processes, the zombie leader, and a parent process that runs one episode."""

from __future__ import annotations

from pathlib import Path

import anyio
import psutil
import pytest

from .. import _internals
from ..conftest import (
    Agents,
    is_gone,
    wait_until,
)

#: Each layer alone, session, and what ``auto`` picks here (the default).
LEVELS = [*_internals.LAYERS, "session", "auto"]
COMBINATIONS = list(_internals.COMBINATIONS)


def needs(name: str) -> str:
    """Skip, with the reason, unless this machine provides containment ``name``; the
    combination it stands for (``auto``: the one it picks here)."""
    if name == "auto":
        found = _internals.resolve("auto", None)
        return found[0]
    problem = _internals.containment_problem(name)
    if problem is not None:
        pytest.skip(f"containment {name!r} is not available here: {problem}")
    return name


@pytest.fixture(params=LEVELS)
def level(request: pytest.FixtureRequest) -> str:
    """Each containment layer alone, session, and the default; the combination used."""
    return needs(request.param)


@pytest.fixture(params=COMBINATIONS)
def combination(request: pytest.FixtureRequest) -> str:
    """Every combination of containment layers in turn."""
    return needs(request.param)


def tree(agents: Agents, marker: str = "") -> list[psutil.Process]:
    """Live processes of this test's episodes (host view, any level) by their environment,
    which at the pidns level is the only sure way: recorded pids are the namespace's."""
    return [p for p in agents.left() if marker in _environ(p)]


def _environ(proc: psutil.Process) -> str:
    try:
        return Path(f"/proc/{proc.pid}/environ").read_text(errors="replace")
    except OSError:
        return ""


def all_gone(procs: list[psutil.Process]) -> bool:
    return all(is_gone(p.pid, p.create_time()) for p in procs)


def shims(forked: bool) -> int:
    """How many processes of an episode are above its worker: none for a template's fork that
    is its own worker (where the template's forks are: cgroup leaves and a PID namespace),
    else at least the shim's supervisor."""
    alone = forked and all(t.forks_alone for t in _internals.started_templates())
    return 0 if alone else 1


async def snapshot_when_ready(agents: Agents, into: list[psutil.Process]) -> None:
    await wait_until((agents.pids / "ready").exists, 20.0)
    into.extend(await anyio.to_thread.run_sync(tree, agents))


# An agent that builds a tree of 10 recorded processes, then hangs:
#   3 sleeps backgrounded by a shell that has already exited (orphans),
#   a shell with a sleeping child (2),
#   4 Python children that ignore SIGTERM,
#   1 daemon that double-forked, called setsid() and ignores SIGTERM.
TREE_AGENT = r"""
import os, signal, subprocess, sys, time

REC = 'echo $$ > "$PID_DIR/$N.tmp"; mv "$PID_DIR/$N.tmp" "$PID_DIR/$N"'
BACKGROUND = "for i in 1 2 3; do N=bg-$i sh -c '%s; exec sleep 300' & done" % REC
CHAIN = "N=shell; %s; N=shell-child sh -c '%s; exec sleep 300'; sleep 300" % (REC, REC)
IGNORER = (
    "import os, signal, time, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(os.path.join(os.environ['PID_DIR'], sys.argv[1]), 'w').write(str(os.getpid())); "
    "time.sleep(300)"
)

def record(name):
    pid_dir = os.environ["PID_DIR"]
    with open(os.path.join(pid_dir, name + ".tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(pid_dir, name + ".tmp"), os.path.join(pid_dir, name))

def daemon():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            record("daemon")
            while True:
                time.sleep(1)
        os._exit(0)

def build_tree():
    subprocess.run(["sh", "-c", BACKGROUND], check=True)  # the shell exits at once
    subprocess.Popen(["sh", "-c", CHAIN])
    for i in range(4):
        subprocess.Popen([sys.executable, "-c", IGNORER, "ignorer-%d" % i])
    daemon()
    record("worker")
    while len([n for n in os.listdir(os.environ["PID_DIR"]) if not n.endswith(".tmp")]) < 11:
        time.sleep(0.01)
    open(os.path.join(os.environ["PID_DIR"], "ready"), "w").close()

def run(data):
    build_tree()
    time.sleep(300)
"""

TREE_PIDS = 11  # the ten above and the worker


def recorded(agents: Agents) -> dict[str, int]:
    """The pids the tree recorded: as its own PID namespace numbers them, where it has one."""
    return {k: v for k, v in agents.pid_files().items() if k != "ready"}


PARENT = """
import anyio, isolate, sys
spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
anyio.run(isolate.run_episode, spec, {})
"""


# A process whose main thread exits (pthread_exit) while another thread runs on: its state
# letter reads Z, psutil calls it a zombie, and it cannot be reaped, yet it runs. It ignores
# SIGTERM, so only SIGKILL (or cgroup.kill, or the namespace's end) takes it.
ZOMBIE_LEADER = r"""
import ctypes, os, signal, subprocess, sys, threading, time

LEADER = (
    "import ctypes, signal, threading, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "threading.Thread(target=time.sleep, args=(3600,)).start(); "
    "ctypes.CDLL(None).pthread_exit(None)"
)

def state(pid):
    stat = open("/proc/%d/stat" % pid).read()
    return stat[stat.rfind(")") + 2]

def run(data):
    child = subprocess.Popen([sys.executable, "-c", LEADER])
    for _ in range(1000):
        if state(child.pid) == "Z" and len(os.listdir("/proc/%d/task" % child.pid)) >= 2:
            break
        time.sleep(0.01)
    else:
        return 0.0  # never became a running zombie: the test below fails on the reward
    open(os.path.join(os.environ["PID_DIR"], "ready"), "w").close()
    if data.get("hang"):
        time.sleep(300)
    return 1.0
"""
