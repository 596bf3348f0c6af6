"""The fd budget, called in this process: who is admitted when, what is given back, the wait
after EMFILE, the soft limit's raise, and the words of each problem.

``tests/test_admission.py`` runs whole episodes under a low limit in a Python of its own;
these tests call the budget directly on this process's own event loop, with the budget's
capacity set by the test, and restore the soft limit they change."""

from __future__ import annotations

import errno
import logging
import os
import resource
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from isolate._core.model.errors import SetupProblem
from isolate._core.system import admission
from isolate._core.system.admission import Cost

from .conftest import SLOW, wait_until

EMFILE = OSError(errno.EMFILE, "Too many open files")


def _budget(room: int) -> admission._Budget:
    """This loop's budget, with ``room`` fds left for episodes."""
    budget = admission._budget()
    budget.capacity = budget.used + room
    return budget


@pytest.mark.anyio
async def test_episodes_are_admitted_first_come_first_served_and_none_overtakes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budget = _budget(10)
    caplog.set_level(logging.DEBUG, logger="isolate")
    first = await admission.admit("first", Cost(peak=6, steady=5))
    assert first.wait_s == 0.0
    order: list[str] = []
    waited: dict[str, float] = {}

    async def admit(name: str, cost: int) -> None:
        ticket = await admission.admit(name, Cost(peak=cost, steady=cost))
        order.append(name)
        waited[name] = ticket.wait_s
        ticket.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(admit, "big", 6)
        await wait_until(lambda: admission.waiting() == 1)
        tg.start_soon(admit, "small", 3)  # would fit beside the first; it waits behind "big"
        await wait_until(lambda: admission.waiting() == 2)
        assert budget.used == 6
        first.started()  # the spawn's fds are closed: 1 of its 6 back, still no room for "big"
        assert budget.used == 5
        await anyio.sleep(0.05)
        assert order == []
        first.release()
    assert order == ["big", "small"]
    assert budget.used == 0
    assert admission.waiting() == 0
    assert all(0.05 <= waited[name] < 60 for name in order), waited
    said = [r.getMessage() for r in caplog.records]
    capacity, describe = budget.capacity, budget.describe()
    assert said == [
        f"episode big waits for file descriptors: 6 of {capacity} in use by episodes, "
        f"0 waiting; {describe}",
        f"episode small waits for file descriptors: 6 of {capacity} in use by episodes, "
        f"1 waiting; {describe}",
        f"episode big admitted after {waited['big']:.2f} s",
        f"episode small admitted after {waited['small']:.2f} s",
    ]


@pytest.mark.anyio
async def test_episodes_that_fit_at_once_add_up_and_wait_for_nothing() -> None:
    budget = _budget(20)
    tickets = [await admission.admit(f"e{i}", Cost(peak=6, steady=3)) for i in range(3)]
    assert budget.used == 18
    assert [t.wait_s for t in tickets] == [0.0, 0.0, 0.0]
    for ticket in tickets:
        ticket.release()
    assert budget.used == 0


@pytest.mark.anyio
async def test_a_waiter_cancelled_at_the_head_of_the_line_lets_the_ones_behind_it_in() -> None:
    budget = _budget(10)
    first = await admission.admit("first", Cost(peak=6, steady=6))
    admitted: list[str] = []
    big_scope = anyio.CancelScope()

    async def big() -> None:
        with big_scope:
            await admission.admit("big", Cost(peak=6, steady=6))
            admitted.append("big")

    async def small() -> None:
        ticket = await admission.admit("small", Cost(peak=3, steady=3))
        admitted.append("small")
        ticket.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(big)
        await wait_until(lambda: admission.waiting() == 1)
        tg.start_soon(small)
        await wait_until(lambda: admission.waiting() == 2)
        big_scope.cancel()
    assert admitted == ["small"]
    first.release()
    assert budget.used == 0
    assert list(budget.queue) == []


@pytest.mark.anyio
async def test_a_waiter_cancelled_behind_another_takes_nothing_with_it() -> None:
    budget = _budget(10)
    first = await admission.admit("first", Cost(peak=6, steady=6))
    admitted: list[str] = []
    scope = anyio.CancelScope()

    async def ahead() -> None:
        ticket = await admission.admit("ahead", Cost(peak=9, steady=9))
        admitted.append("ahead")
        ticket.release()

    async def behind() -> None:
        with scope:
            await admission.admit("behind", Cost(peak=6, steady=6))
            admitted.append("behind")

    async with anyio.create_task_group() as tg:
        tg.start_soon(ahead)
        await wait_until(lambda: admission.waiting() == 1)
        tg.start_soon(behind)
        await wait_until(lambda: admission.waiting() == 2)
        scope.cancel()
        await wait_until(lambda: admission.waiting() == 1)
        first.release()
    assert admitted == ["ahead"]
    assert budget.used == 0
    assert list(budget.queue) == []


@pytest.mark.anyio
async def test_a_waiter_cancelled_just_after_it_was_admitted_gives_its_fds_back() -> None:
    budget = _budget(10)
    first = await admission.admit("first", Cost(peak=6, steady=6))
    scope = anyio.CancelScope()

    async def waiter() -> None:
        with scope:
            await admission.admit("late", Cost(peak=6, steady=6))
            pytest.fail("admitted, though cancelled before it was granted")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await wait_until(lambda: admission.waiting() == 1)
        scope.cancel()  # cancelled while it waits, and in the same step ...
        first.release()  # ... granted its 6 fds, before it runs again
        assert budget.used == 6
    assert budget.used == 0  # it gave them back as its wait ended in the cancellation


@pytest.mark.anyio
async def test_a_ticket_gives_back_the_spawns_surplus_once_and_the_rest_once() -> None:
    budget = _budget(20)
    ticket = await admission.admit("one", Cost(peak=7, steady=4))
    assert (ticket.held, budget.used, ticket.wait_s) == (7, 7, 0.0)
    ticket.started()
    ticket.started()
    assert (ticket.held, budget.used) == (4, 4)
    ticket.release()
    ticket.release()
    assert (ticket.held, budget.used) == (0, 0)


@pytest.mark.anyio
async def test_held_fds_count_at_once_even_past_the_room_and_are_given_back_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budget = _budget(5)
    budget.used = 2
    with caplog.at_level(logging.DEBUG, logger="isolate"):
        hold = admission.hold_fds(8, "a test's hold")
    assert [r.getMessage() for r in caplog.records] == [
        "a test's hold holds 8 file descriptors of the episodes' budget"
    ]
    budget.used -= 2
    assert budget.used == 8  # never waits, even past the room
    assert (hold.fds, hold.what) == (8, "a test's hold")
    hold.release()
    hold.release()
    assert budget.used == 0


@pytest.mark.anyio
@pytest.mark.parametrize(("raise_value", "soft"), [("1", 512), ("0", 512), ("0", None)])
async def test_an_episode_that_can_never_fit_names_its_need_the_budget_and_the_fix(
    raise_value: str, soft: int | None, soft_limit: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the raise turned off and a hard limit above the soft one, it also says that
    isolate would raise the soft limit; not with the soft limit at the hard one."""
    _, hard = soft_limit
    if hard == resource.RLIM_INFINITY or hard <= 600:
        pytest.skip(f"a hard RLIMIT_NOFILE of {hard} leaves no soft limit below it")
    budget = _budget(5)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft or hard, hard))
    monkeypatch.setenv(admission.RAISE_ENV, raise_value)
    with pytest.raises(SetupProblem) as raised:
        await admission.admit("huge", Cost(peak=6, steady=3))
    assert budget.limit == (soft or hard)  # it followed a lowered limit before it gave up
    expected = (
        f"too few file descriptors for one episode: it needs 6, and {budget.describe()}; "
        f"{admission._FIX}"
    )
    if raise_value == "0" and soft is not None:
        expected += (
            f"; or unset {admission.RAISE_ENV}, so isolate raises the soft limit to the hard one"
        )
    assert str(raised.value) == expected
    assert budget.used == 0
    assert list(budget.queue) == []


@pytest.mark.anyio
async def test_an_episode_fits_a_room_of_exactly_its_peak_and_not_one_less() -> None:
    budget = _budget(6)
    ticket = await admission.admit("exact", Cost(peak=6, steady=3))
    ticket.release()
    budget.capacity -= 1
    with pytest.raises(SetupProblem, match="it needs 6"):
        await admission.admit("one more", Cost(peak=6, steady=3))
    assert budget.used == 0


@pytest.mark.anyio
async def test_the_budget_describes_itself_in_numbers() -> None:
    budget = admission._budget()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert budget.limit == soft
    assert budget.reserve == max(16, min(256, soft // 8))
    assert budget.capacity == soft - budget.others - budget.reserve
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    assert budget.describe() == (
        f"the open-file limit (RLIMIT_NOFILE) is {soft} (hard {hard_text}); "
        f"{budget.others} fds were open before the first episode and {budget.reserve} are kept "
        f"in reserve, which leaves {budget.capacity} for episodes"
    )
    budget.capacity = -3
    assert "which leaves 0 for episodes" in budget.describe()


@pytest.fixture
def soft_limit() -> Iterator[tuple[int, int]]:
    """This process's soft and hard RLIMIT_NOFILE, restored after the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        yield soft, hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.anyio
async def test_the_budget_follows_a_soft_limit_changed_after_it_was_sized(
    soft_limit: tuple[int, int],
) -> None:
    soft, hard = soft_limit
    budget = admission._budget()
    before = budget.capacity
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 100, hard))
    budget._resize()
    assert (budget.limit, budget.capacity) == (soft - 100, before - 100)
    budget._resize()
    assert budget.capacity == before - 100


@pytest.mark.anyio
async def test_an_episode_that_fits_only_in_a_raised_soft_limit_is_admitted_at_once(
    soft_limit: tuple[int, int],
) -> None:
    soft, hard = soft_limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 100, hard))
    budget = admission._budget()
    budget._resize()
    budget.capacity = budget.used + 10
    held = await admission.admit("held", Cost(peak=5, steady=5))
    assert not budget.fits(7)  # it would fit the room when empty: no resize for its size alone
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # 100 more: seen when it waits
    ticket = await admission.admit("late", Cost(peak=7, steady=7))
    assert ticket.wait_s == 0.0
    assert admission.waiting() == 0
    assert list(budget.queue) == []
    assert (budget.used, budget.capacity, budget.limit) == (12, 110, soft)
    ticket.release()
    held.release()
    assert budget.used == 0


@pytest.mark.anyio
async def test_after_emfile_an_episode_waits_for_fds_given_back_then_gives_up_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    budget = _budget(20)
    other = await admission.admit("other", Cost(peak=6, steady=6))
    ticket = await admission.admit("starved", Cost(peak=6, steady=6))
    monkeypatch.setattr(admission, "_RETRY_MAX_S", 3600.0)  # only a release can wake it
    result: list[str | None] = []

    async def starve() -> None:
        result.append(await ticket.starved(EMFILE, give_up_after=3600.0))

    with caplog.at_level(logging.DEBUG, logger="isolate"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(starve)
            await wait_until(lambda: admission.waiting() == 1)
            other.release()
    assert [r.getMessage() for r in caplog.records] == [
        "episode starved: [Errno 24] Too many open files; waiting for file descriptors to be freed"
    ]
    assert result == [None]
    assert admission.waiting() == 0
    assert 0 < ticket.wait_s < 3600
    # Out of patience: the problem says what was waited for, the budget and the fix.
    ticket.wait_s = 12.4
    problem = await ticket.starved(EMFILE, give_up_after=12.0)
    assert problem == (
        f"no file descriptor became free in 12 s (Too many open files); {budget.describe()}; "
        f"something else in this process holds the rest: close what holds them, or "
        f"{admission._FIX}"
    )
    ticket.wait_s = 12.0  # patience ends at exactly its length, too
    assert (await ticket.starved(EMFILE, give_up_after=12.0) or "").startswith(
        "no file descriptor became free in 12 s"
    )
    ticket.release()


@pytest.mark.anyio
async def test_a_starved_episode_waits_no_longer_than_its_patience_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(admission, "_RETRY_MAX_S", 3600.0)
    _budget(20)
    ticket = await admission.admit("starved", Cost(peak=6, steady=6))
    ticket.wait_s = 9.9
    with anyio.fail_after(10 * SLOW):  # nothing is given back: only its patience ends it
        assert await ticket.starved(EMFILE, give_up_after=10.0) is None
    assert ticket.wait_s >= 9.9
    ticket.release()


def test_the_reserve_is_an_eighth_of_the_limit_within_16_and_256() -> None:
    assert [admission._reserve(n) for n in (64, 1024, 1030, 1032, 2048, 4096, 1 << 20)] == [
        16,
        128,
        128,
        129,
        256,
        256,
        256,
    ]


def test_the_fds_open_before_are_counted_without_the_count_s_own() -> None:
    def is_open(fd: int) -> bool:
        try:
            os.fstat(fd)
        except OSError:
            return False
        return True

    # Listed while the listing's own fd was open; that one is closed by now.
    assert admission._open_fds() == sum(is_open(int(fd)) for fd in os.listdir("/proc/self/fd"))


def test_a_budget_is_sized_from_the_soft_limit_not_the_hard_one(
    soft_limit: tuple[int, int],
) -> None:
    _, hard = soft_limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard - 100, hard))
    assert admission._Budget().limit == hard - 100


def test_a_full_fd_table_is_emfile_or_enfile_and_nothing_else() -> None:
    assert admission.exhausted(EMFILE)
    assert admission.exhausted(OSError(errno.ENFILE, "Too many open files in system"))
    assert not admission.exhausted(OSError(errno.EACCES, "Permission denied"))
    assert not admission.exhausted(ValueError(errno.EMFILE))


def test_what_an_episode_holds_here_by_log_and_by_start() -> None:
    def spec(log_dir: Path | None, preload: bool) -> SimpleNamespace:
        return SimpleNamespace(log_dir=log_dir, preload=preload)

    assert admission.episode_fds(spec(None, False)) == Cost(peak=6, steady=3)
    assert admission.episode_fds(spec(Path("logs"), False)) == Cost(peak=7, steady=4)
    assert admission.episode_fds(spec(None, True)) == Cost(peak=6, steady=4)
    assert admission.episode_fds(spec(Path("logs"), True)) == Cost(peak=7, steady=5)


@pytest.fixture
def unraised(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a process that has not raised its limit yet."""
    monkeypatch.setattr(admission, "_raised_checked", False)
    monkeypatch.setattr(admission, "_original_soft", None)


@pytest.mark.usefixtures("unraised")
def test_the_first_use_raises_the_soft_limit_to_the_hard_one_once_and_says_so(
    soft_limit: tuple[int, int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, hard = soft_limit
    if hard == resource.RLIM_INFINITY or hard <= 600:
        pytest.skip(f"a hard RLIMIT_NOFILE of {hard} leaves no soft limit below it to raise")
    monkeypatch.delenv(admission.RAISE_ENV, raising=False)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    with caplog.at_level(logging.DEBUG, logger="isolate"):
        admission.raise_limit_once()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    assert admission._original_soft == 512
    assert [r.getMessage() for r in caplog.records] == [
        f"raised the soft open-file limit (RLIMIT_NOFILE) from 512 to {hard}, the hard limit; "
        f"episodes keep 512; {admission.RAISE_ENV}=0 turns this off"
    ]
    # Episodes get the limit the process had before, unless they set one of their own.
    assert admission.child_rlimits({}) == {"RLIMIT_NOFILE": [512, hard]}
    assert admission.child_rlimits({"RLIMIT_AS": [1, 2]}) == {
        "RLIMIT_AS": [1, 2],
        "RLIMIT_NOFILE": [512, hard],
    }
    assert admission.child_rlimits({"RLIMIT_NOFILE": [64, 64]}) == {"RLIMIT_NOFILE": [64, 64]}
    # Once per process: a limit lowered again later stays.
    resource.setrlimit(resource.RLIMIT_NOFILE, (600, hard))
    admission.raise_limit_once()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (600, hard)
    assert admission._original_soft == 512


@pytest.mark.usefixtures("unraised")
@pytest.mark.parametrize("value", ["0", "false", "No", " OFF "])
def test_the_raise_turned_off_leaves_the_limit_and_says_why(
    value: str,
    soft_limit: tuple[int, int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, hard = soft_limit
    if hard == resource.RLIM_INFINITY or hard <= 600:
        pytest.skip(f"a hard RLIMIT_NOFILE of {hard} leaves no soft limit below it to raise")
    monkeypatch.setenv(admission.RAISE_ENV, value)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    with caplog.at_level(logging.DEBUG, logger="isolate"):
        admission.raise_limit_once()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (512, hard)
    assert admission._original_soft is None
    assert admission.child_rlimits({}) == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"{admission.RAISE_ENV}={value}: the open-file limit stays as it is"
    ]


@pytest.mark.usefixtures("unraised")
@pytest.mark.parametrize("value", ["1", "yes", "", "anything"])
def test_any_other_value_raises_it(
    value: str, soft_limit: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, hard = soft_limit
    if hard == resource.RLIM_INFINITY or hard <= 600:
        pytest.skip(f"a hard RLIMIT_NOFILE of {hard} leaves no soft limit below it to raise")
    monkeypatch.setenv(admission.RAISE_ENV, value)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    admission.raise_limit_once()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)


@pytest.mark.usefixtures("unraised")
def test_a_soft_limit_at_the_hard_one_is_left_as_it_is(
    soft_limit: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(admission.RAISE_ENV, raising=False)
    _, hard = soft_limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    admission.raise_limit_once()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    assert admission._original_soft is None
