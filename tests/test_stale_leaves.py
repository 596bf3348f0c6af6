"""The stale-leaf clean-up, called in this process on a root of its own.

Every isolate process removes, once at its start, the cgroup leaves of isolate parents that
died: it must remove those, kill what is left in them, and touch nothing else: not a live
parent's leaves, and not a leaf whose shim is still tearing its episode down after its parent
died. The end-to-end test (``test_containment``) runs the clean-up in a new process; this one
calls it here, on a root nothing else uses, so every case is checked in one call."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from isolate._core.containment import leaves as _leaves

from . import _internals
from .conftest import wait_for
from .teardown._trees import needs

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def shim_stand_in(session: bool = True) -> subprocess.Popen[bytes]:
    """A sleeper whose command line names agent_shim, once the kernel shows that command line:
    Popen returns when the exec has begun, and ``/proc/PID/cmdline`` reads empty for a moment
    after that."""
    proc = subprocess.Popen([*SLEEPER, "agent_shim"], start_new_session=session)
    wait_for(lambda: b"agent_shim" in Path(f"/proc/{proc.pid}/cmdline").read_bytes(), what="exec")
    return proc


def cgroups_here() -> _internals.Cgroups:
    """This machine's cgroup trees; skip, with the reason, where the cgroup layer is missing."""
    needs("cgroup")
    return _leaves.cgroups()


def _root_of_our_own() -> Path:
    groups = cgroups_here()
    base = groups.v2 if groups.v2 is not None else next(iter(groups.v1.values()))
    # Not <pid>.<start>: no other isolate process takes it for an owner of its own.
    return base / f"stale-test.{secrets.token_hex(4)}"


def _into(leaf: Path, proc: subprocess.Popen[bytes]) -> None:
    leaf.mkdir(parents=True)
    (leaf / "cgroup.procs").write_text(str(proc.pid))


def _remove(path: Path) -> None:
    if not path.is_dir():
        return
    for child in [p for p in path.iterdir() if p.is_dir()]:
        _remove(child)
    path.rmdir()


@pytest.fixture
def root() -> Iterator[Path]:
    path = _root_of_our_own()
    path.mkdir()
    try:
        yield path
    finally:
        _remove(path)


def test_only_the_leaves_of_dead_owners_go_and_what_is_in_them_is_killed(root: Path) -> None:
    gone = subprocess.Popen(["sleep", "60"])
    gone_owner = f"{gone.pid}.{_internals.start_time(gone.pid)}"
    gone.kill()
    gone.wait()
    me = f"{os.getpid()}.{_internals.start_time(os.getpid())}"
    # The same pid with another start: the owner is dead, its pid reused by this process.
    reused = f"{os.getpid()}.{(_internals.start_time(os.getpid()) or 0) + 1}"
    procs = {name: subprocess.Popen(SLEEPER) for name in ("mine", "orphan", "nested")}
    # A shim whose parent died: the session leader running agent_shim, cleaning up by itself.
    procs["shim"] = shim_stand_in()
    try:
        _into(root / me / "episode.live", procs["mine"])
        _into(root / gone_owner / "episode.crashed", procs["orphan"])
        _into(root / gone_owner / "episode.nested" / "made-by-the-agent", procs["nested"])
        (root / gone_owner / "episode.empty").mkdir()
        _into(root / reused / "episode.tearing-down", procs["shim"])

        removed = _leaves.clean_stale([root])

        assert removed == 3  # crashed, nested, empty
        assert procs["orphan"].wait(timeout=10) == -signal.SIGKILL
        assert procs["nested"].wait(timeout=10) == -signal.SIGKILL
        assert not (root / gone_owner).exists()  # its last leaf went: the owner goes too
        # A live owner's leaf stays, and what is in it runs on.
        assert (root / me / "episode.live").is_dir()
        assert procs["mine"].poll() is None
        # So does the leaf of a shim that is still tearing its episode down, and its owner.
        assert (root / reused / "episode.tearing-down").is_dir()
        assert procs["shim"].poll() is None
        # A second pass finds nothing more to remove.
        assert _leaves.clean_stale([root]) == 0
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_a_dead_owners_leaf_whose_session_leader_is_no_shim_goes(root: Path) -> None:
    """Only a session leader running agent_shim keeps a dead owner's leaf: an agent's own
    ``setsid`` process does not, nor does a shim that is not a session leader."""
    me_dead = f"{os.getpid()}.{(_internals.start_time(os.getpid()) or 0) + 1}"
    leader = subprocess.Popen(SLEEPER, start_new_session=True)
    not_leader = shim_stand_in(session=False)
    try:
        _into(root / me_dead / "episode.setsid", leader)
        _into(root / me_dead / "episode.no-session", not_leader)
        assert _leaves.clean_stale([root]) == 2
        assert leader.wait(timeout=10) == -signal.SIGKILL
        assert not_leader.wait(timeout=10) == -signal.SIGKILL
        assert not (root / me_dead).exists()
    finally:
        for proc in (leader, not_leader):
            proc.kill()
            proc.wait()


def _dead_owner(index: int) -> str:
    """The name of an owner that is dead: this process's pid with another start time."""
    return f"{os.getpid()}.{(_internals.start_time(os.getpid()) or 0) + 1 + index}"


def _make_until(make: Callable[[int], object], done: Callable[[], bool], most: int = 24) -> int:
    """Call ``make`` until ``done``: each case below needs one thing listed before another,
    and the kernel lists a cgroup's children in the order of a hash of their names, and
    ``cgroup.procs`` in an order of its own. Returns how many were made."""
    for index in range(most):
        make(index)
        if done():
            return index + 1
    raise AssertionError(f"not done after making {most}")


def _listed_before(listing: list[str], some: Iterable[str], others: Iterable[str]) -> bool:
    """Whether one of ``some`` is listed before one of ``others``."""
    places = {name: i for i, name in enumerate(listing)}
    return min(places[s] for s in some) < max(places[o] for o in others)


def _dirs(path: Path) -> list[str]:
    return [p.name for p in path.iterdir() if p.is_dir()]


def test_a_root_that_cannot_be_listed_does_not_keep_the_next_one_from_its_clean_up(
    root: Path,
) -> None:
    (root / _dead_owner(0) / "episode.empty").mkdir(parents=True)
    assert _leaves.clean_stale([root / "no-such-root", root]) == 1
    assert _dirs(root) == []


def test_every_dead_owner_goes_also_when_a_live_one_is_listed_before_it(root: Path) -> None:
    live: list[subprocess.Popen[bytes]] = []
    live_owners: list[str] = []
    dead_owners: list[str] = []

    def owners(index: int) -> None:
        live.append(subprocess.Popen(SLEEPER))
        live_owners.append(f"{live[-1].pid}.{_internals.start_time(live[-1].pid)}")
        dead_owners.append(_dead_owner(index))
        for owner in (live_owners[-1], dead_owners[-1]):
            (root / owner / "episode").mkdir(parents=True)

    try:
        _make_until(owners, lambda: _listed_before(_dirs(root), live_owners, dead_owners))
        assert _leaves.clean_stale([root]) == len(dead_owners)
        assert sorted(_dirs(root)) == sorted(live_owners)
    finally:
        for proc in live:
            proc.kill()
            proc.wait()


def test_a_shims_leaf_or_one_that_cannot_go_does_not_keep_the_leaves_after_it(
    root: Path,
) -> None:
    """In a dead owner's directory: the leaf of a shim still tearing down stays; so does one
    that cannot be removed (a v1 cgroup made inside it holds a process: EBUSY). Every other
    leaf goes, wherever it is listed."""
    groups = cgroups_here()
    if "pids" not in groups.v1:
        pytest.skip("no cgroup v1 pids hierarchy here: no v1 leaf for the clean-up to meet")
    v1_root = groups.v1["pids"] / root.name
    owner = v1_root / _dead_owner(0)
    shim = shim_stand_in()
    held = subprocess.Popen(SLEEPER)
    try:
        _into(owner / "episode.shim", shim)
        _into(owner / "episode.stuck" / "made-inside", held)

        made: list[str] = []

        def empty(index: int) -> None:
            made.append(f"episode.empty-{index}")
            (owner / made[-1]).mkdir()

        for first in ("episode.shim", "episode.stuck"):
            _make_until(
                lambda _: empty(len(made)),
                lambda first=first: _listed_before(_dirs(owner), [first], made),
            )
        assert _leaves.clean_stale([v1_root]) == len(made)
        assert sorted(_dirs(owner)) == ["episode.shim", "episode.stuck"]
        assert shim.poll() is None
    finally:
        for proc in (shim, held):
            proc.kill()
            proc.wait()
        _remove(v1_root)


def test_a_shim_listed_after_an_agents_process_still_keeps_its_leaf(root: Path) -> None:
    leaf = root / _dead_owner(0) / "episode.tearing-down"
    procs = [subprocess.Popen(SLEEPER)]
    shim = shim_stand_in()
    procs.append(shim)
    try:
        _into(leaf, procs[0])
        (leaf / "cgroup.procs").write_text(str(shim.pid))

        def agent(index: int) -> None:
            procs.append(subprocess.Popen(SLEEPER))
            (leaf / "cgroup.procs").write_text(str(procs[-1].pid))

        def listed() -> bool:
            others = [str(p.pid) for p in procs if p is not shim]
            return _listed_before(
                (leaf / "cgroup.procs").read_text().split(), others, [str(shim.pid)]
            )

        if not listed():
            _make_until(agent, listed)
        assert _leaves.clean_stale([root]) == 0
        assert leaf.is_dir()
        assert all(proc.poll() is None for proc in procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
