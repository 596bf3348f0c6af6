"""The episodes' blocking calls, off the event loop, in one worker thread that stays while
calls come.

Each episode makes a few blocking calls on its way: it prepares its wall, opens its log, is
spawned or handed to a parked fork, and is cleaned up. One worker-thread trip per call costs
little alone; in a burst of hundreds of episodes started at once, hundreds of trips take turns
at the GIL, and the parent spent 0.8 ms of CPU per episode on them (512 hand-overs from a
pool). Here the calls of one event loop queue up, and one worker thread runs them in order,
giving each caller its value as soon as it has one. It waits ``LINGER_S`` for the next call
before it ends. A call that blocks for long (a file system that hangs) holds up those behind
it for ``STUCK_S`` at most: then another thread starts beside it.

``await call(func, *args)`` is ``anyio.to_thread.run_sync(func, *args)`` for a ``func`` that
needs nothing of the event loop (the worker thread is not anyio's: no ``anyio.from_thread``):
it runs with the caller's context variables; once queued it runs to its end, and the caller's
cancellation waits until it has. Works on asyncio and trio.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from anyio.lowlevel import RunVar, checkpoint_if_cancelled

__all__ = ["LINGER_S", "STUCK_S", "call"]

_T = TypeVar("_T")

#: How long, in seconds, a worker thread waits for the next call before it ends.
LINGER_S = 0.5
#: After this many seconds without a call started or ended while calls wait, another worker
#: thread starts beside the busy ones.
STUCK_S = 0.25


class _Call:
    """One queued call; its event is set (in the event loop) once it has run."""

    __slots__ = ("args", "context", "done", "error", "event", "func", "started", "value")

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args
        self.context = contextvars.copy_context()
        self.event = anyio.Event()
        self.started = self.done = False
        self.value: Any = None
        self.error: BaseException | None = None


class _Queue:
    """The calls of one event loop, and the worker threads that run them."""

    def __init__(self, soon: Callable[[Callable[[], object]], object]) -> None:
        self.soon = soon  # runs a callback in the event loop, from any thread, without waiting
        self.lock = threading.Condition()
        self.calls: deque[_Call] = deque()
        self.threads = 0  # worker threads that will look at ``calls`` again
        self.idle = 0  # of which waiting for a call
        self.progress = time.monotonic()  # a call started or ended
        self.ready: list[_Call] = []  # run, not yet given back
        self.flushing = False

    def put(self, item: _Call) -> bool:
        """Queue ``item``; True if the caller must start a worker thread."""
        with self.lock:
            self.calls.append(item)
            return self._another()

    def stuck(self, item: _Call) -> bool:
        """Whether ``item`` still waits behind busy threads that made no progress of late; if
        so, the caller starts another."""
        with self.lock:
            return not item.started and self._another()

    def _another(self) -> bool:
        """With the lock held and calls queued: wake a waiting worker thread if there is one;
        else whether the caller must start one (none runs, or those running made no progress
        for ``STUCK_S``), counted at once."""
        if self.idle:
            self.lock.notify()
            return False
        if self.threads and time.monotonic() - self.progress <= STUCK_S:
            return False
        self.threads += 1
        self.progress = time.monotonic()
        return True

    def start(self) -> None:
        threading.Thread(target=self.work, name="isolate offload", daemon=True).start()

    def work(self) -> None:
        """A worker thread: run calls until none has come for ``LINGER_S``."""
        while True:
            with self.lock:
                if not self.calls:
                    self.idle += 1
                    self.lock.wait(LINGER_S)
                    self.idle -= 1
                if not self.calls:
                    self.threads -= 1
                    return
                item = self.calls.popleft()
                item.started = True
                self.progress = time.monotonic()
            try:
                item.value = item.context.run(item.func, *item.args)
            except BaseException as exc:  # given back to the caller, as a thread trip would
                item.error = exc
            item.done = True
            with self.lock:
                self.progress = time.monotonic()
                self.ready.append(item)
                if self.flushing:
                    continue
                self.flushing = True
            try:
                self.soon(self.flush)
            except RuntimeError:  # the event loop is closed: nobody waits any more
                return

    def flush(self) -> None:
        """In the event loop: wake the callers whose calls have run."""
        with self.lock:
            ready, self.ready, self.flushing = self.ready, [], False
        for item in ready:
            item.event.set()


def _soon() -> Callable[[Callable[[], object]], object]:
    """This event loop's thread-safe way to run a callback soon."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:  # trio is imported, but this loop is asyncio's
            pass
        else:
            return token.run_sync_soon  # type: ignore[no-any-return]
    return asyncio.get_running_loop().call_soon_threadsafe


_QUEUE: RunVar[_Queue] = RunVar("isolate_offload")


def _queue() -> _Queue:
    try:
        return _QUEUE.get()
    except LookupError:
        queue = _Queue(_soon())
        _QUEUE.set(queue)
        return queue


async def call(func: Callable[..., _T], *args: Any) -> _T:
    """``func(*args)`` in a worker thread, queued behind this event loop's other calls; its
    value, or its exception raised here."""
    await checkpoint_if_cancelled()
    queue = _queue()
    mine = _Call(func, args)
    with anyio.CancelScope(shield=True):
        if queue.put(mine):
            queue.start()
        while not mine.done:
            with anyio.move_on_after(STUCK_S):
                await mine.event.wait()
            if not mine.done and queue.stuck(mine):
                queue.start()
    if mine.error is not None:
        raise mine.error
    return mine.value  # type: ignore[no-any-return]
