"""Cancellation at each point of an episode: around the spawn, during the run (at every level),
during the kill grace after a timeout, while queued at the start gate; and an error of the
caller's own in ``on_start``. The cancellation (or the error) reaches the caller unchanged,
after a teardown that leaves no process."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import anyio
import psutil
import pytest

import isolate

from .. import _internals
from ..conftest import (
    SLOW,
    Agents,
    both_starts,
    cancelled_once,
    is_gone,
    wait_until,
)
from ..teardown._trees import (
    TREE_AGENT,
    TREE_PIDS,
    all_gone,
    level,
    recorded,
    shims,
    snapshot_when_ready,
)
from ._shims import SILENT_SHIM, TERM_NOTING_SHIM

__all__ = ["level"]  # a fixture, used by name

pytestmark = pytest.mark.anyio


@both_starts
@pytest.mark.parametrize("point", ["before the spawn", "at the spawn", "while the tree grows"])
async def test_cancel_around_spawn(agents: Agents, point: str) -> None:
    """Cancelled at each point of the start, by an event rather than a delay: the point is
    reached (the shim started or not, part of the tree built), and nothing is left."""
    spec = agents.spec(TREE_AGENT)
    started: list[int] = []

    def on_start(pid: int) -> None:
        started.append(pid)
        if point == "at the spawn":
            scope.cancel()

    async def cancel_once_a_pid_is_recorded() -> None:
        await wait_until(lambda: bool(recorded(agents)), 20.0)
        scope.cancel()

    with anyio.CancelScope() as scope:
        if point == "before the spawn":
            scope.cancel()
        async with anyio.create_task_group() as tg:
            if point == "while the tree grows":
                tg.start_soon(cancel_once_a_pid_is_recorded)
            await isolate.run_episode(spec, {}, on_start=on_start)
        pytest.fail("run_episode returned instead of being cancelled")
    assert scope.cancelled_caught
    assert len(started) == (0 if point == "before the spawn" else 1)
    if point == "while the tree grows":
        assert 0 < len(recorded(agents)) <= TREE_PIDS
    assert all(is_gone(pid) for pid in started)  # the shim: a host pid at every level
    assert agents.left() == []


@both_starts
async def test_cancel_during_the_run(agents: Agents) -> None:
    spec = agents.spec(TREE_AGENT, kill_grace=1.0)
    started = time.monotonic()
    ready = (agents.pids / "ready").exists
    cancelled_at, _ = await cancelled_once(spec, lambda: wait_until(ready))
    pids = recorded(agents)
    assert len(pids) == TREE_PIDS
    assert not agents.left()
    # Teardown took one grace period (the tree ignores SIGTERM) and little more.
    assert time.monotonic() - cancelled_at <= spec.kill_grace + 1.0 * SLOW
    assert cancelled_at > started


@both_starts
async def test_cancel_during_the_run_at_every_level(agents: Agents, level: str) -> None:
    spec = agents.spec(TREE_AGENT, kill_grace=0.5, containment=level)
    seen: list[psutil.Process] = []
    cancelled_at, _ = await cancelled_once(spec, lambda: snapshot_when_ready(agents, seen))
    assert len(seen) >= TREE_PIDS + shims(forked=True)
    assert all_gone(seen)
    # One grace period (the tree ignores SIGTERM) and little more.
    assert time.monotonic() - cancelled_at <= spec.kill_grace + 1.0 * SLOW


async def test_cancel_during_the_grace_period(agents: Agents, tmp_path: Path) -> None:
    """Cancel while teardown waits out the grace period after a timeout: the cancellation
    propagates, and the grace period is not restarted. The SIGTERM the shim noted proves the
    timeout fired first; the cancel comes half the grace later, so a restart would take the
    whole grace period again from there."""
    shim = tmp_path / "term_noting_shim.py"
    shim.write_text(TERM_NOTING_SHIM)
    grace = 4.0
    # No cancel first: the fake shim would not answer it, and this is about the kill grace.
    spec = agents.spec("def run(data):\n    pass\n", timeout=1.0, kill_grace=grace, cancel_grace=0)
    term_seen = cancelled_at = 0.0
    async with anyio.create_task_group() as tg:

        async def cancel_mid_grace() -> None:
            nonlocal term_seen, cancelled_at
            await wait_until((agents.pids / "term").exists, 20.0)
            term_seen = time.monotonic()
            await anyio.sleep_until(term_seen + grace / 2)  # the scenario, not a wait for state
            cancelled_at = time.monotonic()
            tg.cancel_scope.cancel()

        tg.start_soon(cancel_mid_grace)
        await _internals.run_with_shim(spec, {}, shim)
        pytest.fail("run_episode returned instead of being cancelled")
    assert tg.cancel_scope.cancelled_caught
    assert term_seen > 0.0  # the timeout's SIGTERM came before the cancel
    assert agents.left() == []
    # What was left of the grace (half of it) and the SIGKILL sweep; a restart: all of it.
    assert time.monotonic() - cancelled_at < grace / 2 + 1.0 * SLOW


async def test_cancel_while_queued_for_start(agents: Agents, tmp_path: Path) -> None:
    """More episodes than the start gate admits, cancelled while the rest wait their turn:
    exactly as many started as the gate admits (none said hello, so no place came free),
    every one is cancelled cleanly, and nothing is left."""
    shim = tmp_path / "silent_shim.py"
    shim.write_text(SILENT_SHIM)
    spec = agents.spec("def run(data):\n    pass\n")
    started: list[int] = []
    with anyio.CancelScope() as scope:
        admitted = int(_internals.starting_gate().total_tokens)
        async with anyio.create_task_group() as tg:
            for _ in range(admitted + 8):
                tg.start_soon(
                    functools.partial(
                        _internals.run_with_shim, spec, {}, shim, on_start=started.append
                    )
                )
            await wait_until(lambda: len(started) >= admitted, 30.0)
            scope.cancel()
    assert scope.cancelled_caught
    assert len(started) == admitted  # the rest were queued
    assert all(is_gone(pid) for pid in started)
    assert agents.left() == []


async def test_an_error_in_on_start_still_tears_the_tree_down(agents: Agents) -> None:
    """Not a cancellation: an exception of the caller's own (here from ``on_start``) inside
    run_episode propagates unchanged, after the same teardown."""
    spec = agents.spec(TREE_AGENT)
    started: list[int] = []

    def on_start(pid: int) -> None:
        started.append(pid)
        raise LookupError("the caller's own bug")

    with pytest.raises(LookupError, match="the caller's own bug"):
        await isolate.run_episode(spec, {}, on_start=on_start)
    assert len(started) == 1
    assert is_gone(started[0])
    assert agents.left() == []
