"""One running episode, from its spawn to its last process: the pipes, the deadline, cancel
first, then the tree's teardown."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from agent_shim.shim_wire import CANCEL

from .. import containment as _containment
from ..network.netserve import EpisodeNetwork
from ..system import offload as _offload
from ..system.tree import ProcessTree
from .child import Child, write_some
from .episode_log import EpisodeLog
from .frames import Frames
from .redact import Redactor

#: How long after the shim exits its pipes may take to reach EOF (seconds). Normally at once:
#: every writer is dead by then. Only a process that escaped everything could hold them longer.
_DRAIN_S = 1.0
#: Bytes per read of a pipe: a Linux pipe holds 64 KiB, so larger reads return no more. Asking
#: for 256 KiB made each read allocate and shrink a 256 KiB buffer: 200 episodes writing at once
#: then cost the parent ~30 KiB more RSS each.
_READ_CHUNK = 64 * 1024
#: stderr chunks larger than this are scrubbed in a worker thread (bytes): ~0.1 ms of work at
#: the scrubber's usual pace, up to ~4 ms for one a hostile child crafted.
_BIG_STDERR_CHUNK = 16 * 1024
#: How much longer than ``cancel_grace`` the parent waits for the shim to report how the
#: agent's clean-up went, before it terminates the tree itself (seconds). The shim counts the
#: grace itself and reports at once; this only matters for a shim that cannot answer.
_CANCEL_MARGIN_S = 0.5
#: How long past ``kill_grace`` the parent waits for a swept shim to exit (seconds): longer only
#: for a process stuck in the kernel (D state).
_SHIM_STUCK_S = 10.0
#: After that report the shim terminates the tree itself (SIGTERM, kill_grace, SIGKILL) and
#: counts what it killed; the parent gives it this long beyond kill_grace before it takes over
#: (seconds).
_SHIM_TEARDOWN_MARGIN_S = 1.0


@dataclass(frozen=True)
class Graces:
    """The spec's times, in seconds."""

    timeout: float
    kill_grace: float
    cancel_grace: float
    exit_grace: float


class EpisodeWatch:
    """Watches one started child, from the parent, until nothing of its episode is left.

    ``run`` is the normal path: handshake out, pipes read, the child's exit or the deadline,
    then the sweep. ``abort`` is the path after the caller's cancellation or an unexpected
    error: the same end, with pumps of its own. Either leaves what it saw for the verdict:
    ``timed_out``, ``killed``, the cgroup counters.
    """

    def __init__(
        self,
        *,
        child: Child,
        channel: int,
        tree: ProcessTree,
        handshake: memoryview,
        frames: Frames,
        log: EpisodeLog,
        redact: Redactor,
        graces: Graces,
        leaves: _containment.Leaves | None,
        network: EpisodeNetwork | None,
        at_hello: Callable[[], object] | None,
    ) -> None:
        self.child, self.channel, self.tree = child, channel, tree
        self.frames, self.log, self.redact, self.graces = frames, log, redact, graces
        self.leaves, self.network = leaves, network
        self._at_hello = at_hello  # once the shim said hello (its start-up is over), if given
        self.handshake = handshake  # what is still to be written of it
        self.timed_out = False
        self.killed = 0  # what the parent's sweeps killed
        self.swept_live = False  # a sweep ran while the shim was alive: its own count is ours
        self.oom_kills: int | None = None
        self.pids_limit_hits = 0
        self.leaves_problem: str | None = None  # from removing the leaves, once removed
        self._term_deadline: float | None = None  # when the sweep's SIGKILL is due
        self._cancel_until: float | None = None  # set once the agent was asked to cancel

    # --- the normal path --------------------------------------------------------------------

    async def run(self, deadline: float) -> None:
        """Until the episode is over; ``deadline`` is ``time.monotonic()`` seconds."""
        stdout_eof, stderr_eof = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            if self.handshake:  # the rest, as the socket takes it
                tg.start_soon(self._write_handshake)
            if self._at_hello is not None:
                tg.start_soon(self._hello_seen)
            self._pumps(tg, stdout_eof, stderr_eof)
            if self.network is not None:
                tg.start_soon(self.network.serve)
            with anyio.move_on_after(deadline - time.monotonic()):
                await self._wait_exit()
            if self.child.returncode is None:
                # Deadline. A final frame that made it in time still counts.
                self.timed_out = self.frames.final is None
                await self._end_early()
                # The sweep took the tree; a shim stuck in the kernel is not waited for forever.
                with anyio.move_on_after(self.graces.kill_grace + _SHIM_STUCK_S):
                    await self.child.wait_exit()
            # The done frame is written before the shim exits: read stdout to EOF first.
            with anyio.move_on_after(_DRAIN_S):
                await stdout_eof.wait()
            if not (self._clean_exit() and await self._settled()):
                await self._sweep(live=False)
                await self._read_counters()
            with anyio.move_on_after(_DRAIN_S):
                await stderr_eof.wait()
            tg.cancel_scope.cancel()

    async def abort(self) -> None:
        """Teardown after cancellation or an unexpected error: cancel the agent, kill the
        tree, reap the shim."""
        # The pumps went with the cancelled task group: the agent's clean-up must not block on
        # a full pipe, and the shim's report must be read.
        async with anyio.create_task_group() as tg:
            self._pumps(tg, anyio.Event(), anyio.Event())
            await self._end_early()
            tg.cancel_scope.cancel()
        with anyio.move_on_after(self.graces.kill_grace + _SHIM_STUCK_S):
            await self.child.wait_exit()

    async def _wait_exit(self) -> None:
        """Until the child exits. For a fork that is its own worker, once its final frame is
        out its exit may take ``exit_grace`` seconds (a shim's supervisor bounds a worker's
        so); then it is killed, and its result stands."""
        if not self.child.alone:
            await self.child.wait_exit()
            return

        async def bound() -> None:
            await self.frames.final_seen.wait()
            await anyio.sleep(self.graces.exit_grace)
            self.log.note(
                f"the agent's exit took longer than exit_grace ({self.graces.exit_grace:g} s): "
                "killed; its result stands"
            )
            self.child.kill()

        async with anyio.create_task_group() as tg:
            tg.start_soon(bound)
            await self.child.wait_exit()
            tg.cancel_scope.cancel()

    def _clean_exit(self) -> bool:
        """The shim exited after killing and reaping everything below it, as a subreaper; a
        fork that is its own worker: it exited, and its leaf (``_settled``) says the rest."""
        hello, done = self.frames.hello, self.frames.done
        if self.child.alone:
            return self.child.returncode is not None and hello is not None
        return (
            self.child.returncode == 0
            and hello is not None
            and hello.subreaper
            and done is not None
            and done.why == "exited"
        )

    async def _settled(self) -> bool:
        """After a clean exit: is the episode over, nothing left to sweep? At the cgroup level,
        if the leaf is empty, also read its counters and remove it, in one worker-thread trip."""
        leaves = self.leaves
        if leaves is None:
            return True

        def settle() -> bool:
            if leaves.populated():
                return False
            self.oom_kills, self.pids_limit_hits = leaves.oom_kills(), leaves.pids_limit_hits()
            self.leaves_problem = leaves.remove()
            return True

        return await _offload.call(settle)

    async def _read_counters(self) -> None:
        leaves = self.leaves
        if leaves is not None:
            self.oom_kills, self.pids_limit_hits = await _offload.call(
                lambda: (leaves.oom_kills(), leaves.pids_limit_hits())
            )

    # --- ending it early --------------------------------------------------------------------

    async def _sweep(self, *, live: bool) -> None:
        if self._term_deadline is None:
            self._term_deadline = time.monotonic() + self.graces.kill_grace
        self.swept_live = self.swept_live or live
        self.killed += await self.tree.kill(self.graces.kill_grace, self._term_deadline)

    async def _end_early(self) -> None:
        """Cancel first, then terminate: the agent cleans up (``cancel_grace``), then the tree
        gets SIGTERM, ``kill_grace``, SIGKILL, until nothing is left."""
        if self.frames.final is None:
            await self._cancel()
        if self.frames.hello is None and self.child.pid1 and self.child.returncode is None:
            # The shim says hello before it forks the worker: without its hello, the agent has
            # not started (or, its hello still unread, has just started, and ends now rather
            # than a moment later). As PID 1 of its namespace the shim takes no SIGTERM until
            # its handler is set and would wait out kill_grace: end it at once. The kernel
            # ends whatever else is in the namespace with it.
            self.child.kill()
        if self.frames.cleanup_seen.is_set() and self.child.returncode is None:
            # The shim answered: it terminates the tree itself and says what it killed.
            with anyio.move_on_after(self.graces.kill_grace + _SHIM_TEARDOWN_MARGIN_S):
                await self.child.wait_exit()
            if self.child.returncode is None and self._term_deadline is None:
                self._term_deadline = time.monotonic()  # the grace is spent: SIGKILL at once
        await self._sweep(live=self.child.returncode is None)

    async def _cancel(self) -> None:
        """Cancel first: ask the shim to cancel the agent inside its process, then wait until
        the shim says how its clean-up went (``cancel_grace`` at most) or exits. Only once the
        agent is running and has sent no final frame; resumes an earlier, interrupted wait."""
        if self._cancel_until is None and not self._ask_cancel():
            return
        assert self._cancel_until is not None
        if self.child.alone:
            with anyio.move_on_after(self._cancel_until - time.monotonic()):
                await self.child.wait_exit()
                self.frames.cleaned_up()
            self.frames.cut_short()
            return
        with anyio.move_on_after(self._cancel_until - time.monotonic()):
            async with anyio.create_task_group() as tg:

                async def exited() -> None:
                    await self.child.wait_exit()
                    tg.cancel_scope.cancel()

                tg.start_soon(exited)
                await self.frames.cleanup_seen.wait()
                tg.cancel_scope.cancel()
        # Unless the shim said within the grace: it was killed (a second Ctrl-C) before it
        # could, or did not answer; the agent was asked to clean up and was not seen to finish.
        self.frames.cut_short()

    def _ask_cancel(self) -> bool:
        """Write the cancel request, when there is an agent to cancel; True once written."""
        grace = self.graces.cancel_grace
        if (
            grace <= 0
            or self.frames.final is not None
            or self.frames.hello is None  # the agent may not be running: nothing to cancel
            or self.handshake  # not all of it written: the shim cannot have started it
            or self.child.returncode is not None
        ):
            return False
        if self.child.alone:
            # The agent's own process: SIGINT cancels it (shim_cancel.py), as the shim's
            # supervisor does it; SIGCONT after, so that a stopped one wakes with it pending.
            self.child.signal(signal.SIGINT)
            self.child.signal(signal.SIGCONT)
            self._cancel_until = time.monotonic() + grace
            self.log.note(f"cancelling the agent; it has {grace:g} s to clean up")
            return True
        try:
            os.write(self.channel, CANCEL)
        except OSError:
            return False  # the shim is gone: its exit says how the episode ended
        try:
            os.kill(self.child.pid, signal.SIGCONT)  # a stopped shim could not act on it
        except OSError:
            pass
        self._cancel_until = time.monotonic() + grace + _CANCEL_MARGIN_S
        self.log.note(f"cancelling the agent; it has {grace:g} s to clean up")
        return True

    async def _hello_seen(self) -> None:
        await self.frames.said_hello.wait()
        assert self._at_hello is not None
        self._at_hello()

    # --- the pipes --------------------------------------------------------------------------

    async def _write_handshake(self) -> None:
        while True:
            self.handshake = write_some(self.channel, self.handshake)
            if not self.handshake:
                break
            await anyio.wait_writable(self.channel)
        # The socket stays open: its EOF is how the shim learns that the parent died.

    def _pumps(
        self, tg: anyio.abc.TaskGroup, stdout_eof: anyio.Event, stderr_eof: anyio.Event
    ) -> None:
        read = self.network.recv if self.network is not None else os.read
        tg.start_soon(_pump, self.channel, read, self.frames.feed, stdout_eof, self.frames.at_eof)
        tg.start_soon(_pump, self.child.stderr_fd(), os.read, self._on_stderr, stderr_eof, None)

    async def _on_stderr(self, chunk: bytes) -> None:
        if self.redact and len(chunk) > _BIG_STDERR_CHUNK:
            # A child that writes pieces of its key at every offset makes the scrubber slow:
            # off the event loop, where the interpreter's switch interval bounds the lag.
            scrubbed = await anyio.to_thread.run_sync(self.redact.stream, chunk)
        else:
            scrubbed = self.redact.stream(chunk)
        self.log.keep_stderr(scrubbed)


async def _pump(
    fd: int,
    read: Callable[[int, int], bytes],
    sink: Callable[[bytes], Awaitable[None]],
    eof: anyio.Event,
    at_eof: Callable[[], Awaitable[None]] | None,
) -> None:
    try:
        while True:
            try:
                chunk = read(fd, _READ_CHUNK)
            except BlockingIOError:
                await anyio.wait_readable(fd)
                continue
            except ConnectionResetError:
                break  # the child closed the socket with our handshake unread: EOF too
            if not chunk:
                if at_eof is not None:
                    await at_eof()
                break
            await sink(chunk)
            # A child that writes without pause must not starve the event loop.
            await anyio.lowlevel.checkpoint()
    finally:
        eof.set()
