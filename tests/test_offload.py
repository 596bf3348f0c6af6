"""Promise: the episodes' blocking calls run off the event loop as a worker-thread trip each
would run them (values, exceptions, context variables, a cancellation that waits for the
call's end), but a burst of them shares one worker thread, and a call that hangs holds up the
others for ``STUCK_S`` at most."""

from __future__ import annotations

import contextvars
import sys
import threading

import anyio
import anyio.lowlevel
import pytest

from isolate._core.system import offload

from .conftest import wait_for

pytestmark = pytest.mark.anyio

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


def _fail() -> None:
    raise KeyError("from the thread")


async def test_values_exceptions_and_context_as_a_thread_trip() -> None:
    assert await offload.call(sum, [1, 2, 3]) == 6
    with pytest.raises(KeyError, match="from the thread"):
        await offload.call(_fail)
    WHO.set("the caller")
    assert await offload.call(WHO.get) == "the caller"
    assert await offload.call(threading.get_ident) != threading.get_ident()


async def test_a_burst_runs_in_order_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload, "STUCK_S", 60.0)  # no second thread, however slow the machine
    ran: list[tuple[int, int]] = []

    def note(i: int) -> int:
        ran.append((i, threading.get_ident()))
        return i * i

    results: dict[int, int] = {}

    async def one(i: int) -> None:
        results[i] = await offload.call(note, i)

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)
    assert results == {i: i * i for i in range(200)}
    assert [i for i, _ in ran] == list(range(200))
    assert len({thread for _, thread in ran}) == 1


class Blocking:
    """A call that says it has started, blocks until ``release`` is set, then appends ``note``
    to ``notes`` and returns it."""

    def __init__(self, notes: list[str], note: str) -> None:
        self.notes, self.note = notes, note
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self) -> str:
        self.started.set()
        self.release.wait(60)
        self.notes.append(self.note)
        return self.note

    async def entered(self) -> None:
        """Until the call runs (in its worker thread)."""
        await anyio.to_thread.run_sync(self.started.wait, 60)


async def test_a_hung_call_holds_up_the_others_for_stuck_s_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(offload, "STUCK_S", 0.05)
    hung: list[str] = []
    hang = Blocking(hung, "released")

    async def first() -> None:
        assert await offload.call(hang) == "released"

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await hang.entered()
        with anyio.fail_after(30):
            assert await offload.call(lambda: "behind it") == "behind it"
        assert hung == []  # done while the first still hangs
        hang.release.set()
    assert hung == ["released"]


async def test_a_cancelled_caller_waits_for_its_call_to_end() -> None:
    order: list[str] = []
    slow = Blocking(order, "call ended")

    async def caller() -> None:
        try:
            await offload.call(slow)
        finally:
            order.append("caller back")

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await slow.entered()
            scope.cancel()
            with anyio.CancelScope(shield=True):
                for _ in range(20):  # rounds of the event loop in which the caller could return
                    await anyio.lowlevel.checkpoint()
                assert order == []
                slow.release.set()
    assert scope.cancelled_caught
    assert order == ["call ended", "caller back"]


async def test_an_already_cancelled_caller_runs_nothing() -> None:
    ran: list[str] = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        await offload.call(ran.append, "ran")
    assert scope.cancelled_caught
    assert ran == []


async def test_the_worker_thread_ends_once_no_call_comes() -> None:
    worker = await offload.call(threading.get_ident)
    wait_for(
        lambda: (
            not any(
                t.ident == worker and t.is_alive() and _runs_offload(t)
                for t in threading.enumerate()
            )
        ),
        timeout=10,
        what="the worker thread to stop running calls",
    )


def _runs_offload(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``_Queue.work`` now."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == "work" and "offload" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def test_on_trio() -> None:
    async def main() -> tuple[int, bool]:
        elsewhere = await offload.call(threading.get_ident) != threading.get_ident()
        return await offload.call(sum, [4, 5]), elsewhere

    assert anyio.run(main, backend="trio") == (9, True)
