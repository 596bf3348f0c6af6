"""Killing processes and waiting until none is left: the one loop the parent side uses for it.

The episode's sweep (:class:`isolate._core.system.tree.ProcessTree`), a template's close (the
importer's leftovers, the rest of its session), a cgroup leaf's removal and the clean-up of
stale leaves all hand a :class:`Reaper` what to kill and call :meth:`Reaper.kill` (blocking)
or :meth:`Reaper.kill_async` (on an event loop, each round in a worker thread).

The contract:

- **What is killed**: the live processes ``find`` returns, scanned again each round, so what
  was forked since the last round is found too; and, when a ``box`` (a cgroup leaf) is
  given, everything in it, all at once (``box.kill()``: ``cgroup.kill``), including what no
  scan sees. ``find`` returns the box's members too when they are to be counted or reported.
- **How**: optionally SIGTERM first (each process once, woken with SIGCONT) until a deadline;
  then, each round, SIGSTOP to every process found (with ``stop_first``: none of them forks
  while the others are killed), SIGKILL to each, and ``box.kill()``.
- **Until**: a round finds no live process and the box is not populated (``gone``), or the
  time given is spent. Between rounds it polls, never sleeping a fixed time as a wait: the
  first pause is :data:`POLL_FIRST_S`, doubled each round up to :data:`POLL_MAX_S`.
- **What it returns**: a :class:`Reaped`: how many processes were signalled for the first
  time (each counted once by pid and start time, over every call of the same reaper, and
  only if ``counted`` says so), the pids still alive when it gave up, and whether nothing is
  left.

A process is identified by pid *and* creation time, so a recycled pid is never signalled,
and counts as gone only when none of its threads can run: one whose main thread exited
(``pthread_exit``) reads as a zombie while its other threads run on.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import anyio
import psutil

from .procfs import has_live_thread

#: The first pause after a kill round, before the next scan (seconds). SIGKILL acts at once:
#: the first check comes soon.
POLL_FIRST_S = 0.002
#: The longest pause between two rounds (seconds): each round may scan all of /proc.
POLL_MAX_S = 0.05
#: How long :meth:`Reaper.kill` keeps killing before it hands back what is left (seconds).
GIVE_UP_S = 2.0
#: How long the episode's sweep keeps killing once SIGKILL is due (seconds): longer, for a
#: process stuck in the kernel (uninterruptible I/O) that SIGKILL takes only when it returns.
SWEEP_GIVE_UP_S = 10.0

_Key = tuple[int, float]


class Box(Protocol):
    """Something that holds processes and kills them all at once (a cgroup leaf)."""

    def members(self) -> list[int]: ...

    def populated(self) -> bool: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class Reaped:
    """What one :meth:`Reaper.kill` did."""

    #: Processes signalled for the first time in this call (and counted).
    killed: int
    #: Pids found alive in the last round, when it gave up; empty once ``gone``.
    left: tuple[int, ...]
    #: Nothing is left: no live process found, the box (if any) not populated.
    gone: bool


def is_alive(proc: psutil.Process) -> bool:
    """True unless the process has no live thread, or its pid now belongs to another process."""
    try:
        if not proc.is_running():
            return False
        if proc.status() != psutil.STATUS_ZOMBIE:
            return True
    except psutil.Error:
        return False
    return has_live_thread(proc.pid)


def processes(pids: Iterable[int]) -> list[psutil.Process]:
    """A ``psutil.Process`` for each pid that names a process now."""
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return out


def key(proc: psutil.Process) -> _Key:
    """A process's identity: pid and creation time. Raises ``psutil.Error`` once it is gone."""
    return proc.pid, proc.create_time()


def _safe_key(proc: psutil.Process) -> _Key | None:
    try:
        return key(proc)
    except psutil.Error:
        return None


class _Pause:
    """The pause between two rounds: :data:`POLL_FIRST_S`, doubled up to :data:`POLL_MAX_S`;
    back to the first once SIGKILL is due; never past the moment it is due."""

    def __init__(self) -> None:
        self.delay = POLL_FIRST_S
        self.killing = False

    def next(self, term_until: float | None) -> float:
        now = time.monotonic()
        if term_until is None or now >= term_until:
            if not self.killing:
                self.killing, self.delay = True, POLL_FIRST_S
            step = self.delay
        else:
            step = min(self.delay, term_until - now)
        self.delay = min(self.delay * 2, POLL_MAX_S)
        return max(step, 0.0)


class Reaper:
    """Kills what ``find`` returns and what ``box`` holds, round after round, until nothing is
    left (see the module's contract). Blocking but :meth:`kill_async`; one per set of
    processes, so that each is counted once over every call."""

    def __init__(
        self,
        find: Callable[[], list[psutil.Process]],
        *,
        box: Box | None = None,
        stop_first: bool = False,
        counted: Callable[[psutil.Process], bool] | None = None,
    ) -> None:
        self.find = find
        self.box = box
        self.stop_first = stop_first
        self.counted = counted
        self._signalled: set[_Key] = set()
        self._killed = 0
        self._left: tuple[int, ...] = ()

    def signal(self, procs: list[psutil.Process], sig: signal.Signals) -> int:
        """Send ``sig`` to each (a SIGTERM, say, followed by SIGCONT, so that a stopped
        process acts on it); return how many were signalled for the first time and counted."""
        new = 0
        for proc in procs:
            try:
                ident = key(proc)
                proc.send_signal(sig)
            except psutil.Error:
                continue
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                # Only now: woken first, a stopped process could run on (and, say, send a
                # result) before the signal arrives; woken now, it meets it pending.
                try:
                    proc.send_signal(signal.SIGCONT)
                except psutil.Error:
                    pass  # the signal already took it
            if ident not in self._signalled:
                self._signalled.add(ident)
                if self.counted is None or self.counted(proc):
                    new += 1
        self._killed += new
        return new

    def round(self, term_until: float | None = None) -> bool:
        """One scan and one round of signals: SIGTERM to what was not signalled yet while
        ``term_until`` (monotonic) is ahead, else SIGSTOP (with ``stop_first``) and SIGKILL
        to all, and the box killed. True when nothing was left to signal."""
        live = [p for p in self.find() if is_alive(p)]
        self._left = tuple(p.pid for p in live)
        if not live:
            if self.box is None or not self.box.populated():
                return True
            self.box.kill()  # nothing any scan can see, yet the box is not empty: all of it
        if term_until is not None and time.monotonic() < term_until:
            self.signal([p for p in live if _safe_key(p) not in self._signalled], signal.SIGTERM)
            return False
        if self.stop_first:
            self.signal(live, signal.SIGSTOP)
        self.signal(live, signal.SIGKILL)
        if self.box is not None:
            self.box.kill()  # then all at once: whatever was forked since the scan dies too
        return False

    def kill(self, seconds: float = GIVE_UP_S) -> Reaped:
        """SIGKILL until nothing is left, for at most ``seconds``. Blocking."""
        before, end, pause = self._killed, time.monotonic() + seconds, _Pause()
        while not self.round():
            if time.monotonic() > end:
                return Reaped(self._killed - before, self._left, False)
            time.sleep(pause.next(None))
        return Reaped(self._killed - before, (), True)

    async def kill_async(
        self, term_until: float | None = None, seconds: float = SWEEP_GIVE_UP_S
    ) -> Reaped:
        """SIGTERM until ``term_until`` (monotonic; None: none), then SIGKILL until nothing
        is left, for at most ``seconds`` past ``term_until``. Each round runs in a worker
        thread; the pauses are the event loop's."""
        before, pause = self._killed, _Pause()
        end = (term_until if term_until is not None else time.monotonic()) + seconds
        while not await anyio.to_thread.run_sync(self.round, term_until):
            if time.monotonic() > end:
                return Reaped(self._killed - before, self._left, False)
            await anyio.sleep(pause.next(term_until))
        return Reaped(self._killed - before, (), True)
