"""The /proc readers on their own, on real processes: a live one, a zombie, one reaped, one
whose main thread exited while another runs on, one whose command name holds parentheses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from isolate._core.system import procfs

from .conftest import wait_for

# Its main thread exits (pthread_exit) while a second thread sleeps on: the process's state
# (its main thread's) reads Z, yet it runs.
ZOMBIE_LEADER = (
    "import ctypes, threading, time; "
    "threading.Thread(target=time.sleep, args=(3600,)).start(); "
    "ctypes.CDLL(None).pthread_exit(None)"
)


def state(pid: int, task: int | None = None) -> bytes | None:
    fields = procfs.stat_fields(pid, task)
    return fields[0] if fields else None


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def zombie() -> Iterator[subprocess.Popen[bytes]]:
    """A child that exited and is not reaped yet."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_for(lambda: state(proc.pid) == b"Z", 10.0, "the child to exit")
        yield proc
    finally:
        proc.wait()


@pytest.fixture
def zombie_leader() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", ZOMBIE_LEADER])
    try:
        wait_for(
            lambda: state(proc.pid) == b"Z" and len(os.listdir(f"/proc/{proc.pid}/task")) >= 2,
            10.0,
            "the main thread to exit while the other runs",
        )
        yield proc
    finally:
        proc.kill()
        proc.wait()


def reaped_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_process(sleeper: subprocess.Popen[bytes]) -> None:
    fields = procfs.stat_fields(sleeper.pid)
    assert fields is not None
    assert fields[0] in (b"R", b"S", b"D")
    assert procfs.parent_pid(sleeper.pid) == os.getpid()
    assert not procfs.exited(sleeper.pid)
    assert procfs.has_live_thread(sleeper.pid)
    # The start time: clock ticks since boot, on psutil's clock (seconds since the epoch).
    ticks = procfs.start_time(sleeper.pid)
    assert ticks is not None
    since_boot = psutil.Process(sleeper.pid).create_time() - psutil.boot_time()
    assert abs(ticks / os.sysconf("SC_CLK_TCK") - since_boot) < 0.05
    mine = procfs.start_time(os.getpid())
    assert mine is not None
    assert mine <= ticks  # this process started first


def test_a_zombie(zombie: subprocess.Popen[bytes]) -> None:
    assert procfs.exited(zombie.pid)
    assert not procfs.has_live_thread(zombie.pid)
    assert procfs.start_time(zombie.pid) is None
    assert procfs.parent_pid(zombie.pid) == os.getpid()  # still readable until reaped


def test_a_process_that_was_reaped() -> None:
    pid = reaped_pid()
    assert procfs.stat_fields(pid) is None
    assert procfs.stat_fields(pid, pid) is None
    assert procfs.start_time(pid) is None
    assert procfs.parent_pid(pid) is None
    assert procfs.exited(pid)
    assert not procfs.has_live_thread(pid)


def test_a_leader_that_exited_before_its_thread(zombie_leader: subprocess.Popen[bytes]) -> None:
    pid = zombie_leader.pid
    assert procfs.exited(pid)  # its state is its main thread's
    assert procfs.start_time(pid) is None
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    assert [state(pid, t) for t in tids].count(b"Z") == 1
    assert procfs.has_live_thread(pid)  # and yet it runs
    zombie_leader.kill()
    wait_for(lambda: not procfs.has_live_thread(pid), 10.0, "every thread to exit")
    assert procfs.exited(pid)


def test_a_command_name_with_parentheses_and_spaces(tmp_path: Path) -> None:
    """The fields follow the name's last ')': a name may hold ') R (' and more."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    named = tmp_path / "a) Z 1 (b"
    named.symlink_to(sleep)
    proc = subprocess.Popen([str(named), "60"])
    try:
        wait_for(lambda: psutil.Process(proc.pid).name() == named.name, 10.0, "the exec")
        fields = procfs.stat_fields(proc.pid)
        assert fields is not None
        assert fields[0] in (b"R", b"S", b"D")
        assert not procfs.exited(proc.pid)
        assert procfs.parent_pid(proc.pid) == os.getpid()
        assert procfs.start_time(proc.pid) is not None
    finally:
        proc.kill()
        proc.wait()
