"""An episode's cgroup leaves, called in this process: members, populated, kill, wait_empty.

The parent's sweep falls back on these when no scan sees a process the leaf still holds; the
end-to-end tests rarely reach that, since the shim kills its tree first."""

from __future__ import annotations

import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from isolate._core.containment.leaves import Leaves

from . import _internals
from .conftest import wait_for
from .test_stale_leaves import SLEEPER, cgroups_here


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(SLEEPER) for _ in range(3)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_kill_takes_every_process_of_the_leaf_at_once(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    leaves = Leaves(cgroups_here(), "leaf-kill", {})
    made = []
    try:
        leaves.create()
        made = list(leaves.dirs.values())
        for proc in sleepers:
            assert leaves.move(proc.pid) is None
        assert leaves.members() == sorted(p.pid for p in sleepers)
        assert leaves.populated()
        leaves.kill()
        assert [p.wait(timeout=10) for p in sleepers] == [-signal.SIGKILL] * 3
        assert leaves.wait_empty()
        assert not leaves.populated()
        assert leaves.members() == []
    finally:
        assert leaves.remove() is None
    assert made
    assert not any(d.exists() for d in made)


def test_kill_reaches_a_process_that_left_the_v2_leaf_but_not_its_v1_one(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    groups = cgroups_here()
    if "pids" not in groups.v1:
        pytest.skip("no cgroup v1 pids hierarchy here: the limits are all in the v2 leaf")
    leaves = Leaves(groups, "leaf-kill-v1", {"pids": {"pids.max": "100"}})
    try:
        leaves.create()
        stays, leaves_v2 = sleepers[0], sleepers[1]
        assert leaves.move(stays.pid) is None
        assert leaves.move(leaves_v2.pid) is None
        # As an agent that could write cgroup.procs might: out of the v2 leaf, to its parent.
        (leaves.dirs["v2"].parent / "cgroup.procs").write_text(str(leaves_v2.pid))
        assert leaves.members() == sorted([stays.pid, leaves_v2.pid])
        assert leaves.wait_empty()
        assert stays.wait(timeout=10) == -signal.SIGKILL
        assert leaves_v2.wait(timeout=10) == -signal.SIGKILL
        assert sleepers[2].poll() is None  # never in a leaf: untouched
    finally:
        assert leaves.remove() is None


def _v1_child_holding(leaf: Path, proc: subprocess.Popen[bytes]) -> Path:
    """A cgroup made inside a v1 leaf, holding ``proc``: the v1 leaf then cannot be removed
    (rmdir of a v1 cgroup with a task in it is EBUSY), though nothing is left in the leaf's
    own ``cgroup.procs`` and v1 has no ``populated`` to say so."""
    child = leaf / "made-inside"
    child.mkdir()
    (child / "cgroup.procs").write_text(str(proc.pid))
    return child


def _v1_groups() -> _internals.Cgroups:
    groups = cgroups_here()
    missing = [name for name in ("pids", "memory") if name not in groups.v1]
    if missing:
        pytest.skip(f"no cgroup v1 {' or '.join(missing)} hierarchy here: no v1 leaves to remove")
    return groups


def _own_owner(leaves: Leaves, tag: str) -> Leaves:
    """Give ``leaves`` an owner directory of this test's own: this process's own directory
    stays for as long as any leaf of it could not be removed, which an earlier test of the
    same process may have made on purpose. The name is no owner's (no ``<pid>.<start>``), so
    no stale-leaf clean-up of another run takes it."""
    leaves.parents = {
        kind: parent.with_name(f"{parent.name}.{tag}-{secrets.token_hex(4)}")
        for kind, parent in leaves.parents.items()
    }
    return leaves


def test_the_owner_directory_stays_while_one_of_its_leaves_does_and_goes_after_the_last() -> None:
    first = _own_owner(Leaves(cgroups_here(), "owner-first", {}), "owner")
    second = Leaves(cgroups_here(), "owner-second", {})
    second.parents = first.parents
    owner = first.parents["v2"]
    try:
        first.create()
        second.create()
        assert first.remove() is None
        assert owner.is_dir()  # the second episode's leaf is still in it
        assert second.dirs["v2"].is_dir()
        assert second.remove() is None
        assert not owner.exists()
    finally:
        first.remove()
        second.remove()


def test_cgroups_made_inside_a_leaf_two_deep_go_with_it() -> None:
    leaves = Leaves(cgroups_here(), "nested-two", {})
    try:
        leaves.create()
        leaf = leaves.dirs["v2"]
        (leaf / "outer" / "inner").mkdir(parents=True)  # as a root agent could
        (leaf / "beside").mkdir()
        assert leaves.remove() is None
        assert not leaf.exists()
    finally:
        leaves.remove()


def test_a_leaf_that_cannot_be_removed_is_named_and_the_leaves_after_it_still_go(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    # The leaves are v2, pids, memory, in that order; the pids one cannot be removed.
    leaves = _own_owner(
        Leaves(_v1_groups(), "stuck-pids", {"pids": {"pids.max": "100"}, "memory": {}}), "stuck"
    )
    child = None
    try:
        leaves.create()
        assert list(leaves.dirs) == ["v2", "pids", "memory"]
        pids_leaf, memory_leaf = leaves.dirs["pids"], leaves.dirs["memory"]
        child = _v1_child_holding(pids_leaf, sleepers[0])
        assert leaves.remove() == f"cannot remove {pids_leaf}: Device or resource busy"
        assert pids_leaf.is_dir()
        assert not memory_leaf.exists()  # the one after the stuck leaf went all the same
        assert not leaves.parents["memory"].exists()  # and so did its owner directory
        assert list(leaves.dirs) == ["pids"]  # what is left for the next remove
    finally:
        if child is not None:
            sleepers[0].kill()
            sleepers[0].wait()
        assert leaves.remove() is None
    assert not any(p.exists() for p in leaves.parents.values())


@pytest.fixture
def frozen(
    sleepers: list[subprocess.Popen[bytes]],
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A sleeper frozen by the v1 freezer: SIGKILL, and so ``cgroup.kill``, cannot end it
    until it is thawed. Yields the process and the freezer cgroup's state file."""
    root = Path("/sys/fs/cgroup/freezer")
    if not (root / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 freezer hierarchy here: nothing keeps a process from SIGKILL")
    group = root / f"leaf-kill-test.{secrets.token_hex(4)}"
    group.mkdir()
    proc = sleepers[0]
    state = group / "freezer.state"
    try:
        (group / "cgroup.procs").write_text(str(proc.pid))
        yield proc, state
    finally:
        state.write_text("THAWED")
        proc.kill()
        proc.wait()
        group.rmdir()


def _freeze(state: Path) -> None:
    state.write_text("FROZEN")
    wait_for(lambda: state.read_text().strip() == "FROZEN", what="the sleeper frozen")


def test_processes_that_outlive_the_kill_are_named_and_the_other_leaves_still_go(
    frozen: tuple[subprocess.Popen[bytes], Path],
) -> None:
    proc, state = frozen
    leaves = _own_owner(Leaves(_v1_groups(), "frozen", {"pids": {"pids.max": "100"}}), "frozen")
    try:
        leaves.create()
        v2_leaf, pids_leaf = leaves.dirs["v2"], leaves.dirs["pids"]
        assert leaves.move(proc.pid) is None
        # Out of the pids leaf again: only the v2 leaf holds it.
        (leaves.parents["pids"].parent / "cgroup.procs").write_text(str(proc.pid))
        _freeze(state)
        assert not leaves.wait_empty(0.2)
        assert leaves.remove() == f"processes still in {v2_leaf}"
        assert v2_leaf.is_dir()
        assert not pids_leaf.exists()  # the leaf after the one it could not remove went
        assert list(leaves.dirs) == ["v2"]
        state.write_text("THAWED")  # the kill it was sent lands now
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        state.write_text("THAWED")
        assert leaves.remove() is None
    assert not any(p.exists() for p in leaves.parents.values())
