"""Containment: after an episode ends, however it ends, no process it started is left."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

import isolate

from . import _internals
from .conftest import (
    SLOW,
    Agents,
    both_starts,
    episode_processes,
    is_gone,
    live_children,
    record_pid_sh,
    remove_dead_parents_leaves,
    wait_for,
    wait_until,
)

pytestmark = pytest.mark.anyio

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


@both_starts
async def test_timeout_kills_the_whole_tree(agents: Agents) -> None:
    spec = agents.spec(TREE_AGENT, timeout=4.0, kill_grace=1.0)
    outcome = await isolate.run_episode(spec, {"instance_id": "tree"})
    assert outcome.status == "timeout", outcome.summary()
    assert outcome.error is not None
    assert "4 s" in outcome.error.message
    pids = recorded(agents)
    assert len(pids) == TREE_PIDS, pids
    assert not agents.left()
    # The worker, cancelled, exits by itself; the other ten are killed.
    assert outcome.cleanup == "finished"
    assert outcome.killed >= TREE_PIDS - 1
    assert outcome.duration_s <= spec.timeout + spec.kill_grace + 1.0 * SLOW


@both_starts
async def test_leftovers_after_a_normal_return_are_killed_and_counted(agents: Agents) -> None:
    spec = agents.spec(
        TREE_AGENT.replace("time.sleep(300)\n", "return 1.0\n"), kill_grace=0.5, timeout=30.0
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    pids = recorded(agents)
    assert len(pids) == TREE_PIDS
    assert not agents.left()
    # Everything but the worker, which exited by itself.
    assert outcome.killed == TREE_PIDS - 1
    # SIGTERM-ignoring leftovers cost one grace period, not the episode's timeout.
    assert outcome.duration_s < 0.5 + 3.0 * SLOW


@both_starts
@pytest.mark.parametrize("cancel_grace", [0.0, 30.0])
async def test_stopped_processes_still_die(agents: Agents, cancel_grace: float) -> None:
    """A stopped agent is woken to be cancelled, and cleans up; without cancellation it is
    killed with its stopped child."""
    spec = agents.spec(
        f"""
        import os, signal, subprocess, time
        def run(data):
            subprocess.Popen(["sh", "-c", '{record_pid_sh("stopped")}; kill -STOP $$; sleep 300'])
            with open(os.path.join(os.environ["PID_DIR"], "worker"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGSTOP)
        """,
        timeout=2.0,
        kill_grace=1.0,
        cancel_grace=cancel_grace,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout"
    pids = agents.pid_files()
    assert set(pids) == {"stopped", "worker"}
    assert not agents.left()
    if cancel_grace:
        assert (outcome.cleanup, outcome.killed) == ("finished", 1), outcome.summary()
    else:
        assert (outcome.cleanup, outcome.killed) == (None, 2), outcome.summary()


@both_starts
@pytest.mark.parametrize("point", ["before the spawn", "at the spawn", "while the tree grows"])
async def test_cancel_around_spawn(agents: Agents, point: str) -> None:
    """Cancelled at each point of the start, by an event rather than a delay: the point is
    reached (the shim started or not, part of the tree built), and nothing is left."""
    spec = agents.spec(TREE_AGENT)
    started: list[int] = []

    def on_start(pid: int) -> None:
        started.append(pid)
        if point == "at the spawn":
            scope.cancel()

    async def cancel_once_a_pid_is_recorded() -> None:
        await wait_until(lambda: bool(recorded(agents)), 20.0)
        scope.cancel()

    with anyio.CancelScope() as scope:
        if point == "before the spawn":
            scope.cancel()
        async with anyio.create_task_group() as tg:
            if point == "while the tree grows":
                tg.start_soon(cancel_once_a_pid_is_recorded)
            await isolate.run_episode(spec, {}, on_start=on_start)
        pytest.fail("run_episode returned instead of being cancelled")
    assert scope.cancelled_caught
    assert len(started) == (0 if point == "before the spawn" else 1)
    if point == "while the tree grows":
        assert 0 < len(recorded(agents)) <= TREE_PIDS
    assert all(is_gone(pid) for pid in started)  # the shim: a host pid at every level
    assert agents.left() == []


@both_starts
async def test_cancel_during_the_run(agents: Agents) -> None:
    spec = agents.spec(TREE_AGENT, kill_grace=1.0)
    started = time.monotonic()
    cancelled_at = 0.0
    async with anyio.create_task_group() as tg:

        async def cancel_when_ready() -> None:
            nonlocal cancelled_at
            await wait_until((agents.pids / "ready").exists)
            cancelled_at = time.monotonic()
            tg.cancel_scope.cancel()

        tg.start_soon(cancel_when_ready)
        await isolate.run_episode(spec, {})
        pytest.fail("run_episode returned instead of being cancelled")
    assert tg.cancel_scope.cancelled_caught
    pids = recorded(agents)
    assert len(pids) == TREE_PIDS
    assert not agents.left()
    # Teardown took one grace period (the tree ignores SIGTERM) and little more.
    assert time.monotonic() - cancelled_at <= spec.kill_grace + 1.0 * SLOW
    assert cancelled_at > started


# A shim that says hello, then notes SIGTERM in a file and carries on: the parent's teardown
# has to wait out the whole grace period for it (the real shim's supervisor cuts its own
# subtree's grace short when it is terminated itself).
TERM_NOTING_SHIM = """\
import json, os, signal, sys, time
hs = json.loads(sys.stdin.buffer.readline())
pid_dir = os.environ["PID_DIR"]
signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(pid_dir, "term"), "w").close())
hello = {"t": "hello", "nonce": hs["nonce"], "protocol": 1, "pid": os.getpid(),
         "python": "3", "subreaper": False}
sys.stdout.write(json.dumps(hello) + "\\n")
sys.stdout.flush()
while True:
    time.sleep(1)
"""


async def test_cancel_during_the_grace_period(agents: Agents, tmp_path: Path) -> None:
    """Cancel while teardown waits out the grace period after a timeout: the cancellation
    propagates, and the grace period is not restarted. The SIGTERM the shim noted proves the
    timeout fired first; the cancel comes half the grace later, so a restart would take the
    whole grace period again from there."""
    shim = tmp_path / "term_noting_shim.py"
    shim.write_text(TERM_NOTING_SHIM)
    grace = 4.0
    # No cancel first: the fake shim would not answer it, and this is about the kill grace.
    spec = agents.spec("def run(data):\n    pass\n", timeout=1.0, kill_grace=grace, cancel_grace=0)
    term_seen = cancelled_at = 0.0
    async with anyio.create_task_group() as tg:

        async def cancel_mid_grace() -> None:
            nonlocal term_seen, cancelled_at
            await wait_until((agents.pids / "term").exists, 20.0)
            term_seen = time.monotonic()
            await anyio.sleep_until(term_seen + grace / 2)  # the scenario, not a wait for state
            cancelled_at = time.monotonic()
            tg.cancel_scope.cancel()

        tg.start_soon(cancel_mid_grace)
        await _internals.run_with_shim(spec, {}, shim)
        pytest.fail("run_episode returned instead of being cancelled")
    assert tg.cancel_scope.cancelled_caught
    assert term_seen > 0.0  # the timeout's SIGTERM came before the cancel
    assert agents.left() == []
    # What was left of the grace (half of it) and the SIGKILL sweep; a restart: all of it.
    assert time.monotonic() - cancelled_at < grace / 2 + 1.0 * SLOW


PARENT = """
import anyio, isolate, sys
spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
anyio.run(isolate.run_episode, spec, {})
"""


@both_starts
def test_parent_killed_takes_the_tree_with_it(agents: Agents, tmp_path: Path) -> None:
    """SIGKILL the process that called run_episode: the shim sees EOF on its stdin and the
    whole tree, SIGTERM-ignoring setsid daemon included, is gone within 2 s."""
    spec = agents.spec(TREE_AGENT, kill_grace=5.0, timeout=120.0)
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), spec.model_dump_json()]
    )
    try:
        wait_for(lambda: (agents.pids / "ready").exists(), 20.0, "the tree to be ready")
        pids = recorded(agents)
        assert len(pids) == TREE_PIDS
        os.kill(parent.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        parent.wait()
        wait_for(lambda: not agents.left(), 2.0, "the tree to die")
        assert time.monotonic() - killed_at <= 2.0 * SLOW
        # The shim itself exits right after its tree: wait for it too, boundedly. (A
        # template's processes are re-parented to this process: a dying one shows no
        # environment, so they are waited for as its descendants.)
        marker = f"PID_DIR={agents.pids}".encode()
        wait_for(lambda: not episode_processes(marker), 2.0, "the shim to exit")
        wait_for(lambda: not live_children(), 2.0 * SLOW, "the template to exit")
    finally:
        parent.kill()
        parent.wait()
    # The dead parent's cgroup leaves stay until an isolate process starts and removes them.
    remove_dead_parents_leaves()


# A child that takes SIGTERM (and says so in a file) but does not die of it.
STUBBORN_AGENT = r"""
import os, subprocess, sys, time

STUBBORN = (
    "import os, signal, time\n"
    "d = os.environ['PID_DIR']\n"
    "signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(d, 'term'), 'w').close())\n"
    "open(os.path.join(d, 'ready'), 'w').close()\n"
    "while True:\n"
    "    time.sleep(1)\n"
)

def run(data):
    subprocess.Popen([sys.executable, "-c", STUBBORN])
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "ready")):
        time.sleep(0.01)
    time.sleep(300)
"""


def test_the_parents_death_cuts_a_long_kill_grace_short(agents: Agents) -> None:
    """The deadline passed and the shim's teardown waits out a 60-s ``kill_grace`` for a child
    that takes SIGTERM and lives on; the parent is SIGKILLed then. With nobody left to report
    to, the shim cuts the grace to a second and kills the tree."""
    spec = agents.spec(STUBBORN_AGENT, timeout=1.0, cancel_grace=0.5, kill_grace=60.0)
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), spec.model_dump_json()]
    )
    try:
        wait_for(lambda: (agents.pids / "term").exists(), 30.0 * SLOW, "the teardown's SIGTERM")
        assert agents.left() != []  # the child outlived its SIGTERM
        os.kill(parent.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        parent.wait()
        wait_for(lambda: not agents.left(), 20.0, "the tree to die")
        # The second the shim gives it, and its SIGKILL; not the 60 s of the grace.
        assert time.monotonic() - killed_at <= 1.0 + 2.0 * SLOW
        marker = f"PID_DIR={agents.pids}".encode()
        wait_for(lambda: not episode_processes(marker), 2.0 * SLOW, "the shim to exit")
    finally:
        parent.kill()
        parent.wait()
    remove_dead_parents_leaves()


# A shim that reads its handshake and never says hello: it holds its place at the start gate.
SILENT_SHIM = "import sys, time\nsys.stdin.buffer.readline()\ntime.sleep(300)\n"


async def test_cancel_while_queued_for_start(agents: Agents, tmp_path: Path) -> None:
    """More episodes than the start gate admits, cancelled while the rest wait their turn:
    exactly as many started as the gate admits (none said hello, so no place came free),
    every one is cancelled cleanly, and nothing is left."""
    shim = tmp_path / "silent_shim.py"
    shim.write_text(SILENT_SHIM)
    spec = agents.spec("def run(data):\n    pass\n")
    started: list[int] = []
    with anyio.CancelScope() as scope:
        admitted = int(_internals.starting_gate().total_tokens)
        async with anyio.create_task_group() as tg:
            for _ in range(admitted + 8):
                tg.start_soon(
                    functools.partial(
                        _internals.run_with_shim, spec, {}, shim, on_start=started.append
                    )
                )
            await wait_until(lambda: len(started) >= admitted, 30.0)
            scope.cancel()
    assert scope.cancelled_caught
    assert len(started) == admitted  # the rest were queued
    assert all(is_gone(pid) for pid in started)
    assert agents.left() == []


async def test_an_error_in_on_start_still_tears_the_tree_down(agents: Agents) -> None:
    """Not a cancellation: an exception of the caller's own (here from ``on_start``) inside
    run_episode propagates unchanged, after the same teardown."""
    spec = agents.spec(TREE_AGENT)
    started: list[int] = []

    def on_start(pid: int) -> None:
        started.append(pid)
        raise LookupError("the caller's own bug")

    with pytest.raises(LookupError, match="the caller's own bug"):
        await isolate.run_episode(spec, {}, on_start=on_start)
    assert len(started) == 1
    assert is_gone(started[0])
    assert agents.left() == []


STOPPABLE_PARENT = """
import anyio, isolate, sys
spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
outcome = anyio.run(isolate.run_episode, spec, {})
print(outcome.status, outcome.error.message if outcome.error else "")
"""


def test_the_shim_keeps_its_own_deadline_while_the_parent_is_stopped(agents: Agents) -> None:
    """SIGSTOP the process that called run_episode: its pipe stays open, so only the shim's
    own deadline (timeout + kill_grace + 2 s) can end the episode, and it does."""
    spec = agents.spec(
        f"""
        import subprocess, time
        def run(data):
            subprocess.Popen(["sh", "-c", '{record_pid_sh("child")}; exec sleep 300'])
            time.sleep(300)
        """,
        timeout=3.0,
        kill_grace=0.5,
    )
    shim_deadline = spec.timeout + spec.kill_grace + _internals.prepare.SHIM_DEADLINE_MARGIN_S
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(STOPPABLE_PARENT), spec.model_dump_json()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: "child" in agents.pid_files(), 20.0, "the agent's child")
        os.kill(parent.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert agents.left()  # the tree is alive while the parent is stopped
        wait_for(lambda: not agents.left(), shim_deadline + 5.0, "the shim to end its tree")
        # Not before the parent's own deadline could have fired (it could not: stopped).
        assert time.monotonic() - stopped_at >= spec.timeout - 1.0
        os.kill(parent.pid, signal.SIGCONT)
        out, _ = parent.communicate(timeout=20 * SLOW)
    finally:
        parent.kill()
        parent.wait()
    assert parent.returncode == 0
    assert out.startswith("timeout "), out
