"""Admission by file-descriptor budget: episodes wait for fds instead of failing with EMFILE.

Every episode holds a few fds in this process (its pipes, a pidfd, its log). Under a common
``ulimit -n 1024`` a few hundred concurrent episodes exhaust the table, and the next spawn fails
with ``Too many open files``. So, per event loop:

- the first use in a process raises the soft ``RLIMIT_NOFILE`` to the hard limit (as Ray and
  many servers do; ``ISOLATE_RAISE_NOFILE=0`` turns it off), and episodes get the soft limit
  the process had before, so agents see the limit they would have seen without isolate;
- a budget is sized from the soft limit, the fds already open and a reserve for the rest of the
  process; an episode is admitted (FIFO) when its fds fit, else it waits;
- an ``EMFILE``/``ENFILE`` that still happens (something else in the process took the fds)
  makes the episode wait for room and retry, not fail;
- only an episode that could never fit (a budget below one episode) is an error.

The API, for the launcher and for other parts that hold fds (templates)::

    cost = episode_fds(spec)        # Cost(peak, steady): fds one episode holds here
    ticket = await admit(episode_id, cost)   # waits its turn; SetupProblem if it never fits
    ticket.started()                # the spawn's temporary fds are closed: keep only `steady`
    problem = await ticket.starved(exc, give_up_after)  # after EMFILE/ENFILE: wait, then retry
    ticket.release()                # every fd of the episode is closed
    held = hold_fds(n, "template x")  # fds outside any episode (a template's control socket
    held.release()                    # and pipes): counted at once, never waits
    waiting()                       # episodes waiting for fds now, every loop (progress lines)

``hold_fds`` never waits, so a template that episodes are waiting for cannot deadlock with
them; while holds push the budget over, new episodes wait. An episode that holds more or fewer
fds in this process than a fresh one (a fork of a template, say) states it in ``episode_fds``.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.lowlevel import RunVar

from ..model.errors import SetupProblem

logger = logging.getLogger("isolate")

#: Set to 0 (or false/no/off) to keep the soft RLIMIT_NOFILE as it is.
RAISE_ENV = "ISOLATE_RAISE_NOFILE"

#: What one episode holds in this process once started: our end of the socket that is the
#: child's stdin and stdout, of its stderr pipe, and a pidfd to wait on; plus its log file,
#: when it has one. tests/test_admission.py counts them against a running episode.
_STEADY_FDS = 3
#: What it holds at most while it is being spawned: both ends of that socket, of the stderr
#: pipe and of subprocess's exec-error pipe (the pidfd comes after they are closed).
_SPAWN_FDS = 6
#: How long a starved episode waits at most before it tries again (seconds): room can also come
#: from fds that something else in the process closes, which no event tells us about.
_RETRY_MAX_S = 1.0


@dataclass(frozen=True)
class Cost:
    """File descriptors one episode holds in this process."""

    peak: int
    """While it is being spawned."""
    steady: int
    """Once started, until it ends."""


def episode_fds(spec: Any) -> Cost:
    """What an episode of ``spec`` (an EpisodeSpec) holds in this process."""
    log = 1 if spec.log_dir is not None else 0
    # A fork of a template: a reply socket from its template besides the pipes and the pidfd.
    forked = 1 if getattr(spec, "preload", False) else 0
    return Cost(peak=_SPAWN_FDS + log, steady=_STEADY_FDS + log + forked)


def exhausted(exc: BaseException) -> bool:
    """Whether ``exc`` says the fd table (this process's, or the system's) is full."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


# --- the soft limit ---------------------------------------------------------------------------

_original_soft: int | None = None
"""The soft RLIMIT_NOFILE before we raised it; None until the first use (or if not raised)."""
_raised_checked = False


def raise_limit_once() -> None:
    """The first time in a process: raise the soft RLIMIT_NOFILE to the hard limit, unless
    ``ISOLATE_RAISE_NOFILE=0``."""
    global _raised_checked, _original_soft
    if _raised_checked:
        return
    _raised_checked = True
    if not _raise_wanted():
        logger.debug("%s=%s: the open-file limit stays as it is", RAISE_ENV, os.environ[RAISE_ENV])
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        logger.debug("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
        return
    _original_soft = soft
    logger.debug(
        "raised the soft open-file limit (RLIMIT_NOFILE) from %d to %d, the hard limit; "
        "episodes keep %d; %s=0 turns this off",
        soft,
        target,
        soft,
        RAISE_ENV,
    )


def _raise_wanted() -> bool:
    return os.environ.get(RAISE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def child_rlimits(rlimits: dict[str, list[int]]) -> dict[str, list[int]]:
    """``rlimits`` (name -> [soft, hard]) with the soft fd limit this process had before we
    raised it, unless they set ``RLIMIT_NOFILE`` (``limits.open_files``): some programs loop
    over every possible fd, or use select()."""
    if _original_soft is not None and "RLIMIT_NOFILE" not in rlimits:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return {**rlimits, "RLIMIT_NOFILE": [_original_soft, hard]}
    return rlimits


# --- the budget -------------------------------------------------------------------------------


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # listdir's own fd
    except OSError:
        return 3


def _reserve(limit: int) -> int:
    """fds kept for the rest of the process: the trainer's own files and sockets, and the
    worker threads' brief opens of /proc and cgroup files while episodes end."""
    return max(16, min(256, limit // 8))


class _Waiter:
    def __init__(self, cost: int) -> None:
        self.cost = cost
        self.event = anyio.Event()
        self.granted = False


class _Budget:
    """The fds episodes of one event loop may hold at once, and who waits for them."""

    def __init__(self) -> None:
        self.limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.others = _open_fds()
        self.reserve = _reserve(self.limit)
        self.capacity = self.limit - self.others - self.reserve
        self.used = 0
        self.queue: deque[_Waiter] = deque()
        self.freed = anyio.Event()  # set (and replaced) whenever fds are given back

    def describe(self) -> str:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        return (
            f"the open-file limit (RLIMIT_NOFILE) is {self.limit} (hard {_limit_text(hard)}); "
            f"{self.others} fds were open before the first episode and {self.reserve} are kept "
            f"in reserve, which leaves {max(self.capacity, 0)} for episodes"
        )

    def _resize(self) -> None:
        """Follow a soft limit that someone changed since."""
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit != self.limit:
            self.capacity += limit - self.limit
            self.limit = limit

    def fits(self, cost: int) -> bool:
        return self.used + cost <= self.capacity

    async def take(self, cost: int) -> float:
        """Wait until ``cost`` fds fit (first come, first served); the seconds waited."""
        if not self.queue and self.fits(cost):
            self.used += cost
            return 0.0
        self._resize()
        if not self.queue and self.fits(cost):
            self.used += cost
            return 0.0
        waiter = _Waiter(cost)
        self.queue.append(waiter)
        started = time.monotonic()
        _count_waiting(+1)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.give(cost)
            else:
                self.queue.remove(waiter)
                self._wake()  # it may have held up smaller ones behind it
            raise
        finally:
            _count_waiting(-1)
        return time.monotonic() - started

    def give(self, cost: int) -> None:
        self.used -= cost
        self.freed.set()
        self.freed = anyio.Event()
        self._wake()

    def _wake(self) -> None:
        while self.queue and self.fits(self.queue[0].cost):
            waiter = self.queue.popleft()
            waiter.granted = True
            self.used += waiter.cost
            waiter.event.set()


_BUDGET: RunVar[_Budget] = RunVar("isolate_fd_budget")
_waiting = 0
_waiting_lock = threading.Lock()  # event loops in several threads may count at once


def _count_waiting(change: int) -> None:
    global _waiting
    with _waiting_lock:
        _waiting += change


def _budget() -> _Budget:
    try:
        return _BUDGET.get()
    except LookupError:
        raise_limit_once()
        budget = _Budget()
        _BUDGET.set(budget)
        return budget


def capacity() -> int:
    """The fds the episodes of this event loop may hold at once; in the event loop."""
    return max(0, _budget().capacity)


def waiting() -> int:
    """Episodes waiting for file descriptors right now, in every event loop of the process.
    Safe to call from any thread."""
    return _waiting


class Ticket:
    """An episode's share of the budget, from admission until :meth:`release`."""

    def __init__(self, budget: _Budget, episode_id: str, cost: Cost) -> None:
        self.budget, self.episode_id, self.cost = budget, episode_id, cost
        self.held = 0
        self.wait_s = 0.0
        """Seconds spent waiting for fds: for admission, and after EMFILE/ENFILE."""

    def started(self) -> None:
        """The spawn is over: give back what only the spawn needed."""
        surplus = self.held - self.cost.steady
        if surplus > 0:
            self.held -= surplus
            self.budget.give(surplus)

    async def starved(self, exc: OSError, give_up_after: float) -> str | None:
        """After ``exc`` (EMFILE or ENFILE): wait until fds are given back (or a second has
        passed), then the caller retries. A problem once it has waited ``give_up_after``
        seconds in all."""
        if self.wait_s >= give_up_after:
            return (
                f"no file descriptor became free in {self.wait_s:.0f} s ({exc.strerror}); "
                f"{self.budget.describe()}; something else in this process holds the rest: "
                f"close what holds them, or {_FIX}"
            )
        logger.debug(
            "episode %s: %s; waiting for file descriptors to be freed", self.episode_id, exc
        )
        _count_waiting(+1)
        started = time.monotonic()
        try:
            with anyio.move_on_after(min(_RETRY_MAX_S, give_up_after - self.wait_s)):
                await self.budget.freed.wait()
        finally:
            _count_waiting(-1)
            self.wait_s += time.monotonic() - started
        return None

    def release(self) -> None:
        """Every fd of the episode is closed."""
        held, self.held = self.held, 0
        if held:
            self.budget.give(held)


_FIX = (
    "raise the limit where the trainer starts (`ulimit -n 65536`, LimitNOFILE= in a systemd "
    "unit, nofile in /etc/security/limits.conf)"
)


async def admit(episode_id: str, cost: Cost) -> Ticket:
    """Wait until the episode's fds fit the budget; SetupProblem if they never can."""
    budget = _budget()
    if cost.peak > budget.capacity:
        budget._resize()
    if cost.peak > budget.capacity:
        problem = f"too few file descriptors for one episode: it needs {cost.peak}, and "
        problem += f"{budget.describe()}; {_FIX}"
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if not _raise_wanted() and hard > budget.limit:
            problem += f"; or unset {RAISE_ENV}, so isolate raises the soft limit to the hard one"
        raise SetupProblem(problem)
    ticket = Ticket(budget, episode_id, cost)
    if budget.queue or not budget.fits(cost.peak):
        logger.debug(
            "episode %s waits for file descriptors: %d of %d in use by episodes, %d waiting; %s",
            episode_id,
            budget.used,
            budget.capacity,
            len(budget.queue),
            budget.describe(),
        )
    ticket.wait_s = await budget.take(cost.peak)
    ticket.held = cost.peak
    if ticket.wait_s > 0:
        logger.debug("episode %s admitted after %.2f s", episode_id, ticket.wait_s)
    return ticket


class Hold:
    """fds outside any episode, counted in the budget until :meth:`release`."""

    def __init__(self, budget: _Budget, fds: int, what: str) -> None:
        self.budget, self.fds, self.what = budget, fds, what

    def release(self) -> None:
        fds, self.fds = self.fds, 0
        if fds:
            self.budget.give(fds)


def hold_fds(fds: int, what: str) -> Hold:
    """Count ``fds`` held for ``what`` (e.g. a template's control socket) in this event loop's
    budget, at once and without waiting. Call from inside the event loop."""
    budget = _budget()
    budget.used += fds
    logger.debug("%s holds %d file descriptors of the episodes' budget", what, fds)
    return Hold(budget, fds, what)


def _limit_text(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)
