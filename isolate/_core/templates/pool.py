"""Forks of one template parked ahead of demand (``isolate.park``, or sized from its bursts:
``sizing``): each forked, moved into a cgroup leaf of its own made ahead with the episodes'
limits, told so, then forking its worker there, and waiting for its hand-over, so that an
episode's start is a hand-over: no fork and no cgroup move on its critical path.

A parked fork and its worker hold no secret and have run none of an episode's code: the
handshake comes after the hand-over, as a fork's does. A thread of the pool's own refills it
up to its size once no hand-over has come for ``QUIET_MS`` (once it is empty: once no episode
waits for a fork made on demand), replaces a parked fork that died (or whose worker did),
and, should the template die, kills the parked forks and removes their leaves;
:meth:`Pool.close` does the same at ``close_templates()``.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections import deque
from pathlib import Path

from agent_shim.shim_wire import send_message

from .. import containment as _containment
from ..model.errors import SetupProblem
from ..system import admission as _admission
from ..system.procfs import parent_pid
from ..system.reaping import GIVE_UP_S
from .forked import Forked, TemplateGone, readable
from .process import Template

#: The most forks one template keeps parked: each, with its worker forked ahead, holds two
#: copies of its page tables (~0.4 MiB each for a 200 MB image) and three of the parent's fds.
MAX_PARKED = 1024
#: What a parked fork holds of the parent's fds: its pidfd, reply and hand-over sockets.
PARKED_FDS = 3
#: After a failed park, how long the pool waits before it tries again (seconds).
_RETRY_S = 1.0
#: The share of memory and of process numbers a pool leaves free: it parks no fork while the
#: machine's ``MemAvailable`` is below this share of ``MemTotal``, nor while the room left under
#: a memory or pids limit of the trainer's cgroup (or one above it) is below this share of the
#: limit.
MIN_AVAILABLE = 0.10
#: How long after the last hand-over the pool waits before it parks a fork (ms): its two forks
#: of the image would run beside the episodes being started, and those of a burst come closer
#: together than this.
QUIET_MS = 20.0


class _Closed(Exception):
    """The pool is closed, or its template gone: its thread ends."""


class Pool:
    """The parked forks of one template, kept at ``target`` by a thread of its own."""

    def __init__(self, template: Template) -> None:
        self.template = template
        self.target = 0
        self.parked: deque[Forked] = deque()
        self.closed = False
        #: Why the last park failed, until one succeeds.
        self.problem: str | None = None
        self.hold: _admission.Hold | None = None
        #: The quiet period after a hand-over before a refill, in seconds.
        self.quiet_s = QUIET_MS / 1000
        #: Hand-overs (forks taken) and forks parked so far; when the last was taken.
        self.taken = 0
        self.made = 0
        self.last_taken = -float("inf")
        #: Forks out of the pool that its thread ends (killed, leaves removed): dead, or beyond
        #: the target.
        self._ending: list[Forked] = []
        #: Its thread waits with a timeout: it looks at the pool again by itself.
        self._timed = False
        self._changed = threading.Condition()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="isolate-park", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:  # no thread can be started now
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    def resize(self, n: int) -> None:
        """Keep ``n`` forks parked from now on; parked ones beyond ``n`` end in its thread."""
        with self._changed:
            self.target = n
            self._ending += [self.parked.pop() for _ in range(max(0, len(self.parked) - n))]
        self.wake()

    def take(self) -> Forked | None:
        """A live parked fork, or None; the pool refills behind it."""
        found = None
        with self._changed:
            while self.parked and found is None:
                forked = self.parked.popleft()
                if forked.has_exited():
                    self._ending.append(forked)  # the pool's thread removes its leaf
                else:
                    found = forked
            if found is not None:
                self.taken += 1
                self.last_taken = time.monotonic()
            # Its thread, waiting for the quiet after a hand-over, looks again then anyway:
            # woken at each of a burst's hand-overs, it would take the GIL from them.
            woken = not self._timed
        if woken:
            self.wake()
        return found

    def filled(self) -> bool:
        with self._changed:
            return self.closed or len(self.parked) >= self.target

    def release_fds(self) -> None:
        """Give the pool's fds back to the budget; in the event loop."""
        if self.hold is not None:
            self.hold.release()
            self.hold = None

    def close(self) -> None:
        """Kill the parked forks and remove their leaves; blocking."""
        with self._changed:
            self.closed = True
            gone = list(self.parked) + self._ending
            self.parked.clear()
            self._ending = []
            self._changed.notify_all()
        self.wake()
        _end(gone)
        if threading.current_thread() is not self._thread:
            self._thread.join(_RETRY_S + 2.0)

    def wake(self) -> None:
        """Have its thread look again (a change, or its template's forks asked for on demand
        are done)."""
        with self._changed:
            if self._wake_w < 0:
                return  # its thread has ended
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # woken already

    def _run(self) -> None:
        suspects: set[int] = set()
        try:
            while True:
                suspects = self._step(suspects)
        except _Closed:
            pass
        finally:
            self.close()
            with self._changed:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1

    def _step(self, suspects: set[int]) -> set[int]:
        """Replace the dead (``suspects``: pidfds that were readable), park one if short, else
        wait for a change; the pidfds readable now. Raises _Closed."""
        with self._changed:
            if self.closed:
                raise _Closed
            dead, self._ending = self._ending, []
            dead += [f for f in self.parked if f.pidfd in suspects and f.has_exited()]
            for forked in dead:
                if forked in self.parked:
                    self.parked.remove(forked)
            short = len(self.parked) < self.target
            wait = self._quiet_left(time.monotonic()) if short else None
            if short and self.problem is not None:
                wait = _RETRY_S
            self._timed = wait is not None
            fds = [f.pidfd for f in self.parked if f.pidfd is not None]
        _end(dead)
        if not self.template.alive() or self.template.closing:
            raise _Closed  # the template died: its parked forks go with the pool
        if short and self.problem is None and wait == 0.0:
            self._park_one()
            return set()
        poller = select.poll()
        for fd in [self._wake_r, *fds]:
            poller.register(fd, select.POLLIN)
        if self.template.importer_fd is not None:
            poller.register(self.template.importer_fd, select.POLLIN)
        ready = {fd for fd, _ in poller.poll(None if wait is None else wait * 1000)}
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        if short:
            self.problem = None  # try again
        return ready

    def _quiet_left(self, now: float) -> float | None:
        """How long the pool, short, waits before it parks one (0.0: at once; None: until
        woken): the rest of the quiet period after the last hand-over, unless it is empty.
        While a burst takes its forks, the refill's forks would take the CPU its hand-overs
        need. Empty, it parks once no episode waits for a fork made on demand: the template
        serves one request at a time, and the rest of a burst larger than the pool would wait
        behind the refill's; a stream that never pauses finds one parked at a time. Under
        ``_changed``."""
        if not self.parked:
            return 0.0 if self.template.asking == 0 else None
        return max(0.0, self.last_taken + self.quiet_s - now)

    def _park_one(self) -> None:
        template, leaves = self.template, None
        try:
            short = memory_problem() or pids_problem()
            if short is not None:
                raise SetupProblem(short)
            if template.leaves is not None:
                leaves = _containment.Leaves(
                    _containment.cgroups(), "parked", template.leaves.writes
                )
                leaves.create()
            forked = template.park()
        except (SetupProblem, TemplateGone, OSError) as exc:  # OSError: EMFILE, say
            if leaves is not None:
                leaves.remove()
            with self._changed:
                self.problem = str(exc)
                self._changed.notify_all()
            return
        forked.leaves = leaves
        problem = leaves.move(forked.pid) if leaves is not None else None
        if problem is None:
            problem = _moved(forked)
        with self._changed:
            keep = problem is None and not self.closed and len(self.parked) < self.target
            if keep:
                self.parked.append(forked)
                self.made += 1
            self.problem = problem
            self._changed.notify_all()
        if not keep:
            _end([forked])


def _moved(forked: Forked) -> str | None:
    """Tell a parked fork that it is in its leaves (or that it has none): it forks its worker
    now, born there. A problem or None."""
    assert forked.hand is not None
    try:
        send_message(forked.hand, {"t": "moved", "alone": forked.alone})
    except OSError as exc:
        return f"the parked fork {forked.pid} is gone ({exc.strerror})"
    return None


def _end(forks: list[Forked]) -> None:
    """Kill parked forks and the workers they forked ahead, wait until each has exited
    (``GIVE_UP_S`` in all at most: a process of a big image takes milliseconds to tear its
    memory down), close what the parent holds of them, remove their leaves."""
    below = [fd for forked in forks for fd in _children_pidfds(forked)]
    for forked in forks:
        forked.kill()
    for fd in below:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass  # gone already
    end = time.monotonic() + GIVE_UP_S
    for fd in [f.pidfd for f in forks if f.pidfd is not None] + below:
        readable(fd, max(0.0, end - time.monotonic()))
    for fd in below:
        os.close(fd)
    for forked in forks:
        forked.close()


def _children_pidfds(forked: Forked) -> list[int]:
    """Pidfds of the children of a live parked fork (the worker it forked ahead), each checked
    to be its child while it still lives (its pid is then its own); none where pidfds or the
    kernel's list of children are missing."""
    pid, pidfd = forked.pid, forked.pidfd
    if pidfd is None or readable(pidfd, 0):
        return []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids = [int(word) for word in f.read().split()]
    except (OSError, ValueError):
        return []
    fds = []
    for child in pids:
        try:
            fd = os.pidfd_open(child)
        except OSError:
            continue
        if parent_pid(child) == pid and not readable(pidfd, 0):
            fds.append(fd)
        else:
            os.close(fd)
    return fds


def memory_problem(dirs: list[Path] | None = None) -> str | None:
    """Why no fork may be parked now for want of memory, or None: the machine's
    ``MemAvailable`` below ``MIN_AVAILABLE`` of its ``MemTotal``, or the room under the memory
    limit of a cgroup in ``dirs`` (default: the trainer's own and those above, v2 and v1)
    below that share of the limit. Blocking."""
    total, available = _meminfo()
    if total and available is not None and available < MIN_AVAILABLE * total:
        return (
            f"the machine has {available >> 20} MiB of memory available, below the "
            f"{MIN_AVAILABLE:.0%} of its {total >> 20} MiB that parked forks leave free"
        )
    short = _short_cgroup("memory", _MEMORY_FILES, dirs)
    if short is None:
        return None
    where, limit, used = short
    return (
        f"cgroup {where} has {max(0, limit - used) >> 20} MiB of its {limit >> 20} MiB "
        f"memory limit left, below the {MIN_AVAILABLE:.0%} that parked forks leave free"
    )


def pids_problem(dirs: list[Path] | None = None) -> str | None:
    """Why no fork may be parked now for want of process numbers, or None: the room under the
    ``pids.max`` of a cgroup in ``dirs`` (default: the trainer's own and those above) below
    ``MIN_AVAILABLE`` of that limit, which the running episodes' processes count against too.
    Blocking."""
    short = _short_cgroup("pids", _PIDS_FILES, dirs)
    if short is None:
        return None
    where, limit, used = short
    return (
        f"cgroup {where} has room for {max(0, limit - used)} of its {limit} processes, "
        f"below the {MIN_AVAILABLE:.0%} that parked forks leave free"
    )


def _short_cgroup(
    controller: str, files: tuple[tuple[str, str], ...], dirs: list[Path] | None
) -> tuple[Path, int, int] | None:
    """The first cgroup of ``dirs`` (default: the trainer's own that may limit
    ``controller``) whose room under its limit is below ``MIN_AVAILABLE`` of it: (where,
    limit, usage); None if none is."""
    for where in _containment.own_limit_cgroups(controller) if dirs is None else dirs:
        limit, used = _cgroup_room(where, files)
        if limit is not None and used is not None and limit - used < MIN_AVAILABLE * limit:
            return where, limit, used
    return None


def _meminfo() -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in bytes, each None where not known."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    found[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found.get("MemTotal"), found.get("MemAvailable")


#: A v1 limit this large is no limit (the kernel's "unlimited" is ~2**63, page-aligned).
_NO_LIMIT = 1 << 60
#: (limit, usage) files of a cgroup's memory: v2's, then v1's.
_MEMORY_FILES = (
    ("memory.max", "memory.current"),
    ("memory.limit_in_bytes", "memory.usage_in_bytes"),
)
#: The same of its process numbers, named alike in v2 and v1.
_PIDS_FILES = (("pids.max", "pids.current"),)


def _cgroup_room(where: Path, files: tuple[tuple[str, str], ...]) -> tuple[int | None, int | None]:
    """(limit, usage) of cgroup directory ``where``, from the first pair of ``files`` it has;
    (None, None) without a limit ("max", or a v1 "unlimited")."""
    for limit_file, usage_file in files:
        try:
            limit_text = (where / limit_file).read_text().strip()
            used = int((where / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if not limit_text.isdigit() or int(limit_text) >= _NO_LIMIT:  # v2 says "max"
            return None, None
        return int(limit_text), used
    return None, None
