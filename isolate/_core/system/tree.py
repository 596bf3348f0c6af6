"""Finding and killing every process of an episode, on the parent side.

An episode's processes are found three ways, because each alone can miss some: the shim's
descendants (complete while the subreaper shim lives), members of the shim's session (which
outlive it), and, on Linux, processes whose environment carries the episode tag (which catch
a process that left both, after the shim died). At the cgroup level the episode's leaves
are a fourth, authoritative source, and SIGKILL starts with ``cgroup.kill``; the scans stay as
a safety net. Processes are identified by pid *and* creation time, so a recycled pid is never
signalled. A process counts as gone only when none of its threads can run: one whose main
thread exited (``pthread_exit``) reads as a zombie while its other threads run on.

These scans read /proc and are run in a worker thread, never on the event loop.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable

import psutil

from agent_shim.shim_wire import EPISODE_TAG_ENV

from .procfs import ns_pids
from .reaping import SWEEP_GIVE_UP_S, Box, Reaper, is_alive, key, processes

__all__ = ["Box", "ProcessTree", "is_alive", "pids_with_env", "tagged"]

_Key = tuple[int, float]


def _session_members(sid: int) -> list[int]:
    found: list[int] = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                found.append(pid)
        except OSError:
            continue
    return found


def pids_with_env(name: str, value: str) -> list[int]:
    """Pids whose exec-time environment holds ``name=value`` exactly (Linux; elsewhere [])."""
    needle = f"{name}={value}\0".encode()
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if environ.startswith(needle) or b"\0" + needle in environ:
            found.append(int(entry))
    return found


def tagged(tag: str) -> list[int]:
    """Pids whose initial environment carries this episode's tag (``EPISODE_TAG_ENV``)."""
    return pids_with_env(EPISODE_TAG_ENV, tag)


class ProcessTree:
    """The processes of one episode, and how to kill them (with a :class:`Reaper`)."""

    def __init__(
        self,
        shim: psutil.Process | Callable[[], psutil.Process | None] | None,
        sid: int,
        tag: str | None,
        box: Box | None = None,
        shim_counts: bool = False,
    ) -> None:
        """``tag`` None: no scan for the environment tag (a template's forks carry its
        tag, and must not be taken for its own processes). ``shim_counts``: the top process
        is the agent's own (a template's fork that is its own worker), counted when killed.
        ``shim``: the top process, or a function that finds it when first asked (None once
        it is gone)."""
        self._shim: psutil.Process | None = None
        self._find_shim: Callable[[], psutil.Process | None] | None = None
        if callable(shim):
            self._find_shim = shim
        else:
            self._shim = shim
        self.shim_counts = shim_counts
        self.sid = sid
        self.tag = tag  # the episode's EPISODE_TAG_ENV
        self.box = box
        self._reaper = Reaper(self.live, box=box, stop_first=True, counted=self._counted)

    @property
    def shim(self) -> psutil.Process | None:
        find = self._find_shim
        if find is not None:
            self._shim, self._find_shim = find(), None
        return self._shim

    def live(self) -> list[psutil.Process]:
        """Every live process of the episode, the shim (and its PID 1) last. Blocking: run in a
        thread."""
        found: dict[_Key, psutil.Process] = {}

        def add(procs: Iterable[psutil.Process]) -> None:
            for proc in procs:
                try:
                    found.setdefault(key(proc), proc)
                except psutil.Error:
                    continue

        if self.shim is not None and is_alive(self.shim):
            try:
                add(self.shim.children(recursive=True))
            except psutil.Error:
                pass
        if self.box is not None:
            add(processes(self.box.members()))
        add(processes(_session_members(self.sid)))
        if self.tag is not None:
            add(processes(tagged(self.tag)))
        live = [p for p in found.values() if is_alive(p)]
        shim_pid = self.shim.pid if self.shim is not None else -1
        # The shim last: its descendants die first, rather than being orphaned to an init
        # that may reap them late. Its PID 1 in a namespace just before it: signalled first,
        # it would start its own teardown, and what it reaps first was never counted here.
        live.sort(key=lambda p: (p.pid == shim_pid, p.pid == shim_pid or _is_pid_1(p.pid)))
        return live

    def _counted(self, proc: psutil.Process) -> bool:
        """Whether a killed process counts: not the shim, nor its PID 1 in a namespace."""
        if self.shim_counts:
            return True
        return (self.shim is None or proc.pid != self.shim.pid) and not _is_pid_1(proc.pid)

    def signal(self, procs: list[psutil.Process], sig: signal.Signals) -> int:
        """Send ``sig`` (followed by SIGCONT, so stopped processes act on it); return how many
        processes other than the shim (and its PID 1, in a namespace) were signalled for the
        first time."""
        return self._reaper.signal(procs, sig)

    async def kill(self, grace: float, term_deadline: float | None = None) -> int:
        """SIGTERM everything, SIGKILL what is left after ``grace`` seconds (each round
        stopped first, so that nothing forks meanwhile), until nothing is left or
        :data:`~isolate._core.system.reaping.SWEEP_GIVE_UP_S` past the SIGKILL. ``term_deadline``
        (monotonic) continues an earlier, interrupted teardown. Returns how many processes
        other than the shim had to be signalled."""
        if term_deadline is None:
            term_deadline = time.monotonic() + grace
        reaped = await self._reaper.kill_async(term_deadline, SWEEP_GIVE_UP_S)
        return reaped.killed


def _is_pid_1(pid: int) -> bool:
    """Whether ``pid`` is PID 1 of a PID namespace below ours: the shim's supervisor."""
    levels = ns_pids(pid)
    return levels is not None and len(levels) > 1 and levels[-1] == 1
