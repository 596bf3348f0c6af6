"""An episode's cgroup leaves, called in this process: members, populated, kill, wait_empty.

The parent's sweep falls back on these when no scan sees a process the leaf still holds; the
end-to-end tests rarely reach that, since the shim kills its tree first."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import pytest

from isolate._core.containment.leaves import Leaves

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
