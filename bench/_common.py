"""Shared helpers: statistics, machine description, and /proc-based process bookkeeping."""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import anyio

from isolate._core.system.tree import pids_with_env

REPO = Path(__file__).resolve().parent.parent
#: Every process a benchmark starts carries this variable (value: the run id), so the final
#: sweep can find and kill anything that escaped, wherever it was re-parented to.
MARK_ENV = "ISOLATE_BENCH_RUN"
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- statistics -------------------------------------------------------------------------------


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and count of ``samples`` (empty: all None)."""
    if not samples:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def paired_ratio(values: Sequence[float], baseline: Sequence[float]) -> dict[str, Any]:
    """Summary of per-round ratios ``values[i] / baseline[i]``: rounds ran side by side, so a
    noisy moment on the shared machine hits both sides of a ratio."""
    ratios = [v / b for v, b in zip(values, baseline, strict=False) if v > 0 and b > 0]
    return summary(ratios)


def percentile(samples: Sequence[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# --- the machine ------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "kernel": platform.release(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "loadavg_at_start": [round(x, 2) for x in load],
        "code": code_state(),
    }


def code_state() -> dict[str, Any]:
    """The commit measured, and whether the launcher's files differ from it."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    dirty = git("status", "--porcelain", "--", "isolate", "agent_shim").splitlines()
    return {"commit": git("rev-parse", "--short", "HEAD") or None, "uncommitted": dirty}


# --- this process -----------------------------------------------------------------------------


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def cpu_seconds() -> float:
    """CPU time of this process, every thread included (nanosecond clock, not ticks)."""
    return time.process_time()


# --- other processes --------------------------------------------------------------------------


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks) of ``pid``, or None if there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2 :].split()
    return rest[0].decode(), int(rest[1]), int(rest[19])


def is_live(pid: int, start: int | None = None) -> bool:
    """Alive means: exists, is not a zombie, and (if ``start`` is given) is the same process."""
    stat = proc_stat(pid)
    if stat is None or stat[0] in "ZX":
        return False
    return start is None or stat[2] == start


def live_children() -> list[int]:
    """Non-zombie processes whose parent is this process."""
    me = os.getpid()
    return [pid for pid, ppid, state in _table() if ppid == me and state not in "ZX"]


def zombie_children() -> list[int]:
    me = os.getpid()
    return [pid for pid, ppid, state in _table() if ppid == me and state == "Z"]


def _table() -> Iterable[tuple[int, int, str]]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat is not None:
                yield int(name), stat[1], stat[0]


def read_pid_files(directory: Path) -> dict[str, int]:
    """name -> pid for every complete pid file (written to ``.tmp`` then renamed)."""
    out: dict[str, int] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        if name.endswith(".tmp") or name.startswith("_"):
            continue
        try:
            out[name] = int((directory / name).read_text().strip())
        except (OSError, ValueError):
            continue
    return out


def kill_all(pids: Iterable[tuple[int, int | None]]) -> int:
    """SIGKILL every live (pid, start) pair; returns how many were alive."""
    alive = 0
    for pid, start in pids:
        if is_live(pid, start):
            alive += 1
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    return alive


def marked_pids(run_id: str) -> list[int]:
    """Live processes (other than this one) whose exec-time environment carries the run mark."""
    me = os.getpid()
    return [p for p in pids_with_env(MARK_ENV, run_id) if p != me and is_live(p)]


def sweep_marked(run_id: str, wait: float = 3.0) -> list[int]:
    """Kill every process of this run that is still alive; return the pids that were.
    Processes that exit by themselves within ``wait`` seconds (a resource tracker noticing its
    parent is gone) are not counted."""
    end = time.monotonic() + wait
    left = marked_pids(run_id)
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = marked_pids(run_id)
    kill_all((pid, None) for pid in left)
    return left


async def bare_launches(k: int) -> float:
    """Seconds for ``k`` bare ``python -I -c pass`` spawns and waits in a row: the floor."""
    cmd = [sys.executable, "-I", "-c", "pass"]
    null = subprocess.DEVNULL
    t0 = time.perf_counter()
    for _ in range(k):
        async with await anyio.open_process(cmd, stdin=null, stdout=null, stderr=null) as p:
            if await p.wait() != 0:
                raise RuntimeError("bare interpreter failed")
    return time.perf_counter() - t0
