"""A template's pool sized from its episodes' bursts, where no caller sized it
(``isolate.park``): as many forks parked as the most of its episodes that ran at once in the
last burst, so that the next burst starts with hand-overs."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import psutil
import pytest

import isolate

from . import _internals
from .conftest import Agents, is_gone, wait_for, wait_until

pytestmark = pytest.mark.anyio

HOLDING = """
import os, time
def run(data):
    if "go" in data:
        open(data["started"] + str(os.getpid()), "w").close()
        for _ in range(6000):
            if os.path.exists(data["go"]):
                break
            time.sleep(0.01)
    return 1.0
"""


def pool() -> _internals.Pool:
    (template,) = _internals.started_templates()
    assert template.pool is not None
    return template.pool


def parked_pids() -> set[int]:
    return {f.pid for f in pool().parked}


async def burst(spec: isolate.EpisodeSpec, n: int, box: Path, fill: int | None = None) -> list[int]:
    """Start ``n`` episodes at once, wait until each runs, let the pool refill meanwhile to
    ``fill`` (default ``n``; all of them still running), then let them end; the pids they
    started with."""
    await anyio.Path(box).mkdir()
    data = {"started": str(box / "started."), "go": str(box / "go")}
    pids: list[int] = []
    outcomes: list[isolate.EpisodeOutcome] = []

    async def one() -> None:
        outcomes.append(await isolate.run_episode(spec, data, on_start=pids.append))

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(one)
        await wait_until(lambda: len(list(box.glob("started.*"))) == n, 30.0)
        want = n if fill is None else fill
        await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(pool().parked) >= want))
        (box / "go").touch()
    assert [(o.status, o.start) for o in outcomes] == [("ok", "template")] * n
    return pids


def test_a_burst_is_measured_by_the_most_episodes_running_at_once() -> None:
    size = _internals.Burst()
    assert size.size() == 0
    for _ in range(3):
        size.began()
    size.ended()
    size.began()  # 3 at once still
    assert size.size() == 3
    for _ in range(3):
        size.ended()
    assert (size.running, size.size()) == (0, 3)  # over: the next step needs as many
    size.began()
    assert size.size() == 3  # a smaller burst going on does not shrink it
    size.ended()
    assert size.size() == 1  # once it is over, it does


async def test_the_next_burst_starts_from_forks_parked_after_the_last(
    agents: Agents, tmp_path: Path
) -> None:
    spec = agents.spec(HOLDING, preload=True)
    first = await burst(spec, 3, tmp_path / "first")
    assert pool().target == 3
    ahead = parked_pids()
    assert len(ahead) == 3
    assert not ahead & set(first)
    second = await burst(spec, 3, tmp_path / "second")
    assert set(second) == ahead  # hand-overs, not forks made on demand
    await isolate.close_templates()
    assert agents.left() == []


async def test_a_smaller_burst_shrinks_the_pool_once_it_is_over(
    agents: Agents, tmp_path: Path
) -> None:
    spec = agents.spec(HOLDING, preload=True)
    await burst(spec, 3, tmp_path / "three")
    ahead = [psutil.Process(pid) for pid in parked_pids()]
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    assert pool().target == 1
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(pool().parked) == 1))
    ended = [p for p in ahead if p.pid not in parked_pids()]
    assert len(ended) == 2  # one taken by the episode, one beyond the new size
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: all(is_gone(p.pid, p.create_time()) for p in ended))
    )
    await isolate.close_templates()
    assert agents.left() == []


async def test_a_pool_sized_by_park_does_not_follow_the_bursts(
    agents: Agents, tmp_path: Path
) -> None:
    spec = agents.spec(HOLDING, preload=True)
    assert await isolate.park(spec, 1) == 1
    box = tmp_path / "box"
    box.mkdir()
    data = {"started": str(box / "started."), "go": str(box / "go")}
    outcomes: list[isolate.EpisodeOutcome] = []

    async def one() -> None:
        outcomes.append(await isolate.run_episode(spec, data))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
        await wait_until(lambda: len(list(box.glob("started.*"))) == 3, 30.0)
        assert pool().target == 1
        (box / "go").touch()
    assert [(o.status, o.start) for o in outcomes] == [("ok", "template")] * 3
    assert pool().target == 1
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(pool().parked) == 1))
    await isolate.close_templates()
    assert agents.left() == []


async def test_a_pool_sized_to_zero_by_park_parks_nothing_after_a_burst(
    agents: Agents, tmp_path: Path
) -> None:
    spec = agents.spec(HOLDING, preload=True)
    assert await isolate.park(spec, 0) == 0
    outcomes = [await isolate.run_episode(spec, {}) for _ in range(2)]
    assert [(o.status, o.start) for o in outcomes] == [("ok", "template")] * 2
    assert (pool().target, list(pool().parked)) == (0, [])
    await isolate.close_templates()
    assert agents.left() == []


async def test_a_pool_sized_from_bursts_holds_a_bounded_share_of_the_fd_budget(
    agents: Agents, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the share made such that two parked forks' fds are all it may hold, a burst of
    three leaves a pool of two, counted in the budget."""
    budget = _internals.fd_budget()
    per_fork = _internals.template_pool.PARKED_FDS
    share = budget.capacity // (per_fork * 2)
    monkeypatch.setattr(_internals.template_sizing, "_FD_SHARE", share)
    assert budget.capacity // (share * per_fork) == 2
    spec = agents.spec(HOLDING, preload=True)
    await burst(spec, 2, tmp_path / "two")
    await burst(spec, 3, tmp_path / "three", fill=2)
    assert pool().target == 2
    assert pool().hold is not None
    assert pool().hold.fds == 2 * per_fork
    await isolate.close_templates()
    assert agents.left() == []


async def test_every_fd_is_back_after_a_template_died_under_a_burst(
    agents: Agents, tmp_path: Path
) -> None:
    """A burst of two sizes the pool at two; the template dies during a burst of one, the next
    episode starts a new template (the dead one's fds given back), and only then the burst of
    one ends, which shrinks a pool sized from bursts: the dead template's counts nothing
    again, and every fd is back in the budget at the end."""
    budget = _internals.fd_budget()
    before = budget.used
    spec = agents.spec(HOLDING, preload=True)
    await burst(spec, 2, tmp_path / "two")
    (dead,) = _internals.started_templates()
    box = tmp_path / "one"
    await anyio.Path(box).mkdir()
    data = {"started": str(box / "started."), "go": str(box / "go")}
    outcomes: list[isolate.EpisodeOutcome] = []

    async def one() -> None:
        outcomes.append(await isolate.run_episode(spec, data))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        await wait_until(lambda: len(list(box.glob("started.*"))) == 1, 30.0)
        assert dead.pool is not None
        assert dead.pool.target == 2
        assert dead.importer is not None
        os.kill(dead.importer, signal.SIGKILL)
        await anyio.to_thread.run_sync(lambda: wait_for(lambda: not dead.alive()))
        after = await isolate.run_episode(spec, {})
        assert (after.status, after.start) == ("ok", "template"), after.summary()
        assert "starting a new one (restart 1)" in after.stderr_tail
        assert dead.released
        (box / "go").touch()
    assert [o.status for o in outcomes] == ["ok"], outcomes[0].summary()
    assert dead.pool.hold is None or dead.pool.hold.fds == 0
    await isolate.close_templates()
    assert budget.used == before
    assert agents.left() == []


@pytest.mark.parametrize("combination", ["session", "auto"])
async def test_a_closed_pool_returns_once_every_parked_fork_and_worker_is_gone(
    agents: Agents, combination: str
) -> None:
    """At ``session`` each parked fork has forked its worker ahead; at ``auto`` the fork is its
    own worker where cgroups and a PID namespace allow. Killed, a process of the image takes
    milliseconds to exit: the pool's close (``close_templates()``'s first step) returns after,
    not before."""
    spec = agents.spec(HOLDING, preload=True, containment=combination)
    assert await isolate.park(spec, 4) == 4
    forks = [psutil.Process(pid) for pid in parked_pids()]
    procs = forks + [child for fork in forks for child in fork.children()]
    await anyio.to_thread.run_sync(pool().close)
    assert [p.pid for p in procs if not is_gone(p.pid, p.create_time())] == []
    await isolate.close_templates()
    assert agents.left() == []
