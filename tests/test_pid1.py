"""Promise: a privileged parent starts a fresh shim as PID 1 of a PID namespace of its own
(``system.pidns``), and nothing else changes namespace: not the thread that started it, once
the start is over, nor any other thread's children, nor the trainer. The episode has no relay
outside its namespace; a shim ended before its hello ends at once, though PID 1 takes no
SIGTERM it has no handler for. An unprivileged parent cannot make the namespace, and says so;
its shim keeps a relay, which ends an episode as PID 1 would (run here as root, by
``run_with_shim(..., pid1=False)``). Real processes and threads; each test proves nothing of
its episodes is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import anyio
import pytest

import isolate
from isolate._core.system import pidns

from . import _internals
from .conftest import SLOW, Agents, as_nobody, nobody, wait_for

__all__ = ["nobody"]  # a fixture, used by name

pytestmark = pytest.mark.skipif(
    _internals.needs_userns(), reason="a PID namespace of the parent's needs CAP_SYS_ADMIN"
)


def _ns(path: str) -> str:
    return os.readlink(path)


def _nspid(pid: int) -> list[str]:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return line.split()[1:]
    raise AssertionError(f"no NSpid line for {pid}")


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def _end(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def test_the_first_child_is_pid_1_and_the_thread_comes_back() -> None:
    """In a thread: the child started in the block is PID 1 of a new namespace; the thread's
    children after the block are born in its own again, as are another thread's meanwhile."""
    found: dict[str, object] = {}
    inside, others_started = threading.Event(), threading.Event()

    def starter() -> None:
        found["own before"] = _ns("/proc/thread-self/ns/pid_for_children")
        with pidns.born_in_new():
            first = _sleeper()
            found["during"] = _ns("/proc/thread-self/ns/pid_for_children")
            inside.set()
            others_started.wait(30)
        found["own after"] = _ns("/proc/thread-self/ns/pid_for_children")
        after = _sleeper()
        found["first"], found["after"] = first, after

    def other() -> None:
        inside.wait(30)
        found["other"] = _sleeper()
        others_started.set()

    threads = [threading.Thread(target=starter), threading.Thread(target=other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    first, after, other_child = found["first"], found["after"], found["other"]
    assert isinstance(first, subprocess.Popen)
    assert isinstance(after, subprocess.Popen)
    assert isinstance(other_child, subprocess.Popen)
    try:
        mine = _ns("/proc/self/ns/pid")
        assert _nspid(first.pid)[-1] == "1"
        assert len(_nspid(first.pid)) == 2
        assert _ns(f"/proc/{first.pid}/ns/pid") == found["during"] != mine
        for child in (after, other_child):
            assert _nspid(child.pid) == [str(child.pid)]
            assert _ns(f"/proc/{child.pid}/ns/pid") == mine
        assert found["own before"] == found["own after"] == mine
        assert _ns("/proc/self/ns/pid_for_children") == mine  # the main thread never moved
    finally:
        _end(first, after, other_child)


def test_a_failed_start_in_the_block_leaves_the_thread_at_home() -> None:
    with pytest.raises(FileNotFoundError):
        with pidns.born_in_new():
            subprocess.Popen(["/nonexistent/isolate-pid1-test"])
    assert _ns("/proc/thread-self/ns/pid_for_children") == _ns("/proc/self/ns/pid")
    child = _sleeper()
    try:
        assert _nspid(child.pid) == [str(child.pid)]
    finally:
        _end(child)


BORN = """
import threading
from isolate._core.model.errors import SetupProblem
from isolate._core.system import pidns

def start():
    try:
        with pidns.born_in_new():
            print("made")
    except SetupProblem as exc:
        print(exc)

thread = threading.Thread(target=start)
thread.start()
thread.join()
"""


def test_an_unprivileged_parent_cannot_and_says_so(nobody: tuple[str, dict[str, str]]) -> None:
    python, env = nobody
    out = as_nobody([python, "-c", BORN], env={**os.environ, **env}, timeout=60 * SLOW)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "cannot make a PID namespace for the shim: Operation not permitted"
    )
    # The control: this process, which holds CAP_SYS_ADMIN, can.
    done = subprocess.run([sys.executable, "-c", BORN], capture_output=True, text=True)
    assert done.stdout.strip() == "made", done.stderr


@pytest.mark.anyio
async def test_the_shim_is_pid_1_and_no_relay_runs(agents: Agents) -> None:
    """The process the parent started is PID 1 of the episode's namespace, and the episode's
    processes are the shim and its worker, PIDs 1 and 2: none outside the namespace."""
    spec = agents.spec("import time\ndef run(data):\n    time.sleep(60)\n    return 1.0\n")
    at_start: list[list[str]] = []
    seen: list[list[str]] = []

    def on_start(pid: int) -> None:
        at_start.append(_nspid(pid))

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: isolate.run_episode(spec, {}, on_start=on_start))
        await anyio.to_thread.run_sync(
            wait_for, lambda: len(agents.left()) >= 2, 30 * SLOW, "the shim and its worker"
        )
        seen.extend(_nspid(proc.pid) for proc in agents.left())
        tg.cancel_scope.cancel()
    assert len(at_start) == 1
    assert at_start[0][1:] == ["1"]
    assert sorted(ns[1:] for ns in seen) == [["1"], ["2"]]
    assert agents.left() == []


@pytest.mark.anyio
async def test_a_shim_ended_before_its_hello_ends_at_once(agents: Agents) -> None:
    """An interpreter that never starts (a stand-in that sleeps, as PID 1 of the namespace)
    meets its deadline with no handler of the shim's set: PID 1 takes no SIGTERM, and it is
    not left to wait out a kill_grace of 60 s."""
    slow = agents.tmp / "slow-python"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    spec = agents.spec("def run(data):\n    return 1.0\n", python=str(slow), timeout=1.0)
    spec = spec.model_copy(update={"kill_grace": 60.0})
    started = time.monotonic()
    outcome = await isolate.run_episode(spec, {})
    took = time.monotonic() - started
    assert outcome.status == "timeout", outcome.summary()
    assert took < 20 * SLOW, took
    assert agents.left() == []


SLEEPS = "import time\ndef run(data):\n    time.sleep(60)\n    return 1.0\n"


@pytest.mark.anyio
@pytest.mark.parametrize("pid1", [True, False], ids=["as PID 1", "with its relay"])
@pytest.mark.parametrize("victim", ["the parent's child", "PID 1"])
async def test_a_supervisor_killed_from_outside_reads_as_killed(
    agents: Agents, pid1: bool, victim: str
) -> None:
    """SIGKILL from outside (the OOM killer, an operator) to the shim's process or to PID 1:
    the episode reads as killed by SIGKILL either way, with a relay too (which dies of what
    killed PID 1), and nothing is left."""
    spec = agents.spec(SLEEPS)
    shim: list[int] = []
    outcomes: list[isolate.EpisodeOutcome] = []

    async def run() -> None:
        boot = _internals.shim_boot()
        outcomes.append(
            await _internals.run_with_shim(spec, {}, boot, on_start=shim.append, pid1=pid1)
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        count = 2 if pid1 else 3  # the relay, outside the namespace
        await anyio.to_thread.run_sync(
            wait_for, lambda: len(agents.left()) == count, 30 * SLOW, "the episode's processes"
        )
        found = {proc.pid: _nspid(proc.pid) for proc in agents.left()}
        assert (found[shim[0]][1:] == ["1"]) is pid1
        target = (
            shim[0]
            if victim == "the parent's child"
            else next(pid for pid, ns in found.items() if ns[1:] == ["1"])
        )
        os.kill(target, signal.SIGKILL)
    outcome = outcomes[0]
    assert outcome.status == "crashed", outcome.summary()
    assert outcome.signal == "SIGKILL", outcome.summary()
    assert outcome.exit_code is None
    assert agents.left() == []
