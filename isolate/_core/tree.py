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
from collections.abc import Iterable
from typing import Protocol

import anyio
import psutil

from agent_shim.shim_wire import EPISODE_ENV

from .procfs import has_live_thread

_Key = tuple[int, float]


class Box(Protocol):
    """Something that holds every process of an episode (its cgroup leaves)."""

    def members(self) -> list[int]: ...

    def populated(self) -> bool: ...

    def kill(self) -> None: ...


def _key(proc: psutil.Process) -> _Key:
    return proc.pid, proc.create_time()


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


def tagged(episode_id: str) -> list[int]:
    """Pids whose initial environment carries this episode's tag."""
    return pids_with_env(EPISODE_ENV, episode_id)


class ProcessTree:
    """The processes of one episode, and how to kill them."""

    def __init__(
        self,
        shim: psutil.Process | None,
        sid: int,
        episode_id: str | None,
        box: Box | None = None,
    ) -> None:
        """``episode_id`` None: no scan for the environment tag (a template's forks carry its
        tag, and must not be taken for its own processes)."""
        self.shim = shim
        self.sid = sid
        self.episode_id = episode_id
        self.box = box
        self._signalled: set[_Key] = set()

    def live(self) -> list[psutil.Process]:
        """Every live process of the episode, the shim (and its PID 1) last. Blocking: run in a
        thread."""
        found: dict[_Key, psutil.Process] = {}

        def add(procs: Iterable[psutil.Process]) -> None:
            for proc in procs:
                try:
                    found.setdefault(_key(proc), proc)
                except psutil.Error:
                    continue

        if self.shim is not None and is_alive(self.shim):
            try:
                add(self.shim.children(recursive=True))
            except psutil.Error:
                pass
        if self.box is not None:
            add(_procs(self.box.members()))
        add(_procs(_session_members(self.sid)))
        if self.episode_id is not None:
            add(_procs(tagged(self.episode_id)))
        live = [p for p in found.values() if is_alive(p)]
        shim_pid = self.shim.pid if self.shim is not None else -1
        # The shim last: its descendants die first, rather than being orphaned to an init
        # that may reap them late. Its PID 1 in a namespace just before it: signalled first,
        # it would start its own teardown, and what it reaps first was never counted here.
        live.sort(key=lambda p: (p.pid == shim_pid, p.pid == shim_pid or _is_pid_1(p.pid)))
        return live

    def signal(self, procs: list[psutil.Process], sig: signal.Signals) -> int:
        """Send ``sig`` (followed by SIGCONT, so stopped processes act on it); return how many
        processes other than the shim (and its PID 1, in a namespace) were signalled for the
        first time."""
        new = 0
        for proc in procs:
            try:
                key = _key(proc)
                proc.send_signal(sig)
            except psutil.Error:
                continue
            if sig != signal.SIGKILL:
                # Only now: woken first, a stopped process could run on (and, say, send a
                # result) before the signal arrives; woken now, it meets it pending.
                try:
                    proc.send_signal(signal.SIGCONT)
                except psutil.Error:
                    pass  # the signal already took it
            if key not in self._signalled:
                self._signalled.add(key)
                if (self.shim is None or proc.pid != self.shim.pid) and not _is_pid_1(proc.pid):
                    new += 1
        return new

    async def kill(self, grace: float, term_deadline: float | None = None) -> int:
        """SIGTERM everything, SIGKILL what is left after ``grace`` seconds, until nothing is
        left. ``term_deadline`` (monotonic) continues an earlier, interrupted teardown.
        Returns how many processes other than the shim had to be signalled."""
        if term_deadline is None:
            term_deadline = time.monotonic() + grace
        give_up = term_deadline + 10.0
        killed = 0
        delay = 0.002
        kill_sent = False
        while True:
            live = await anyio.to_thread.run_sync(self.live)
            if time.monotonic() > give_up:
                return killed
            if not live:
                if self.box is None or not await anyio.to_thread.run_sync(self.box.populated):
                    return killed
                # Nothing any scan can see, yet the leaf is not empty: kill it whole.
                await anyio.to_thread.run_sync(self.box.kill)
            sig = signal.SIGTERM if time.monotonic() < term_deadline else signal.SIGKILL
            if sig == signal.SIGTERM:
                fresh = [p for p in live if _safe_key(p) not in self._signalled]
                killed += await anyio.to_thread.run_sync(self.signal, fresh, sig)
            else:
                killed += await anyio.to_thread.run_sync(self.signal, live, sig)
                if not kill_sent:
                    kill_sent, delay = True, 0.002  # SIGKILL acts at once: confirm it soon
                if self.box is not None:
                    # Then all at once: whatever was forked since the scan dies too.
                    await anyio.to_thread.run_sync(self.box.kill)
            # Each poll scans all of /proc: back off to 50 ms, but never sleep past the moment
            # SIGKILL is due.
            now = time.monotonic()
            step = delay if now >= term_deadline else min(delay, term_deadline - now)
            await anyio.sleep(max(step, 0.0))
            delay = min(delay * 2, 0.05)


def _is_pid_1(pid: int) -> bool:
    """Whether ``pid`` is PID 1 of a PID namespace below ours: the shim's supervisor."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    numbers = line.split()[1:]
                    return len(numbers) > 1 and numbers[-1] == "1"
    except OSError:
        pass
    return False


def _safe_key(proc: psutil.Process) -> _Key | None:
    try:
        return _key(proc)
    except psutil.Error:
        return None


def _procs(pids: Iterable[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return out
