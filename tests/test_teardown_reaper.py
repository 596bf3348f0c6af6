"""Teardown's one parent-side loop, the reaper, called in this process: what it is given dies,
what that forks meanwhile dies too, and nothing is left afterwards.

Each test starts its processes with a tag of its own in their environment and judges "nothing
left" by that tag: whatever the processes forked, double-forked or walked away to carries it."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from isolate._core.system.reaping import Reaper, is_alive, processes

from . import _internals
from .conftest import is_gone
from .test_stale_leaves import cgroups_here

MARK = "ISOLATE_TEST_REAPER_MARK"

# Double-forks a grandchild into a session of its own, prints its pid, and sleeps.
DOUBLE_FORK = """
import os, time
r, w = os.pipe()
child = os.fork()
if child == 0:
    if os.fork() == 0:
        os.setsid()
        os.write(w, b"%d\\n" % os.getpid())
        time.sleep(300)
    os._exit(0)
os.waitpid(child, 0)
print(os.read(r, 64).decode().strip(), flush=True)
time.sleep(300)
"""

# Forks without end: children that live a little while, at most 32 of them at a time.
FORKER = """
import os, time
live = set()
forked = 0
while True:
    while live:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        live.discard(pid)
    if len(live) < 32:
        pid = os.fork()
        if pid == 0:
            time.sleep(0.2)
            os._exit(0)
        live.add(pid)
        forked += 1
        if forked == 40:
            print("forking", flush=True)
    else:
        time.sleep(0.001)
"""

# Forks and exits, generation after generation: a pid that keeps moving.
WALKER = """
import os, time
generation = 0
while True:
    if os.fork() != 0:
        os._exit(0)
    generation += 1
    if generation == 10:
        print("walking", flush=True)
    time.sleep(0.001)
"""

SLEEPER = "import time; print('sleeping', flush=True); time.sleep(300)"

# Before a program: wait for a line on stdin (sent once the process is in its leaf).
GATE = "import sys; sys.stdin.readline()\n"


class Tagged:
    """Processes started with this test's tag; whatever carries it is killed after the test."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(8)
        self.popens: list[subprocess.Popen[bytes]] = []

    def start(self, code: str, *, gated: bool = False) -> subprocess.Popen[bytes]:
        """Start ``code``; ``gated``: it waits for :meth:`go` first."""
        proc = subprocess.Popen(
            [sys.executable, "-c", GATE + code if gated else code],
            env={MARK: self.tag},
            stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        self.popens.append(proc)
        return proc

    @staticmethod
    def go(proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()

    def live(self) -> list[psutil.Process]:
        """Every live process carrying the tag."""
        return [p for p in processes(_internals.pids_with_env(MARK, self.tag)) if is_alive(p)]


@pytest.fixture
def tagged() -> Iterator[Tagged]:
    started = Tagged()
    try:
        yield started
    finally:
        for proc in started.live():
            try:
                proc.kill()
            except psutil.Error:
                pass
        for popen in started.popens:
            popen.kill()
            popen.wait(timeout=10)
            for stream in (popen.stdin, popen.stdout):
                if stream is not None:
                    stream.close()


def _line(proc: subprocess.Popen[bytes]) -> bytes:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def test_a_tree_with_a_double_forked_grandchild_is_killed_whole(tagged: Tagged) -> None:
    top = tagged.start(DOUBLE_FORK)
    grandchild = int(_line(top))
    assert sorted(p.pid for p in tagged.live()) == sorted([top.pid, grandchild])
    reaped = Reaper(tagged.live).kill()
    assert (reaped.killed, reaped.left, reaped.gone) == (2, (), True)
    assert top.wait(timeout=10) == -signal.SIGKILL
    assert is_gone(grandchild)
    assert tagged.live() == []


def test_a_process_that_forks_in_a_loop_is_stopped_and_killed_with_all_it_forked(
    tagged: Tagged,
) -> None:
    forker = tagged.start(FORKER)
    assert _line(forker) == b"forking"
    reaped = Reaper(tagged.live, stop_first=True).kill()
    assert reaped.gone
    assert reaped.left == ()
    assert reaped.killed >= 2  # the forker and at least one of its children
    assert forker.wait(timeout=10) == -signal.SIGKILL
    assert tagged.live() == []


def test_a_leaf_is_killed_whole_even_a_pid_that_keeps_moving(tagged: Tagged) -> None:
    leaves = _internals.Leaves(cgroups_here(), f"reaper-{tagged.tag}", {})
    try:
        leaves.create()
        # Each in the leaf before it runs: whatever it forks is in the leaf too.
        started = [tagged.start(code, gated=True) for code in (WALKER, SLEEPER, FORKER)]
        walker, sleeper, forker = started
        for proc in started:
            assert leaves.move(proc.pid) is None
            tagged.go(proc)
        assert [_line(proc) for proc in started] == [b"walking", b"sleeping", b"forking"]
        reaped = Reaper(lambda: processes(leaves.members()), box=leaves).kill()
        assert (reaped.left, reaped.gone) == ((), True)
        assert not leaves.populated()
        assert leaves.members() == []
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert forker.wait(timeout=10) == -signal.SIGKILL
        assert walker.wait(timeout=10) == 0  # its first generation left at once
        assert tagged.live() == []
    finally:
        assert leaves.remove() is None


def test_what_is_left_when_time_runs_out_is_named_and_each_process_counted_once(
    tagged: Tagged,
) -> None:
    sleeper = tagged.start(SLEEPER)
    assert _line(sleeper) == b"sleeping"  # its environment readable: the exec is done
    reaper = Reaper(tagged.live)
    # No time at all: one round of SIGKILL, then what that round found is handed back.
    first = reaper.kill(seconds=-1.0)
    assert (first.killed, first.left, first.gone) == (1, (sleeper.pid,), False)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    again = reaper.kill()
    assert (again.killed, again.left, again.gone) == (0, (), True)
    assert tagged.live() == []
