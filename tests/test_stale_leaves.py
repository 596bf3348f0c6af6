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
from collections.abc import Iterator
from pathlib import Path

import pytest

from isolate._core import containment as _containment
from isolate._core import procfs

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def cgroups_here() -> _containment.Cgroups:
    """This machine's cgroup trees; skip, with the reason, where the cgroup layer is missing."""
    problem = _containment.problem("cgroup")
    if problem is not None:
        pytest.skip(f"containment 'cgroup' is not available here: {problem}")
    return _containment.cgroups()


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
    gone_owner = f"{gone.pid}.{procfs.start_time(gone.pid)}"
    gone.kill()
    gone.wait()
    me = f"{os.getpid()}.{procfs.start_time(os.getpid())}"
    # The same pid with another start: the owner is dead, its pid reused by this process.
    reused = f"{os.getpid()}.{(procfs.start_time(os.getpid()) or 0) + 1}"
    procs = {name: subprocess.Popen(SLEEPER) for name in ("mine", "orphan", "nested")}
    # A shim whose parent died: the session leader running agent_shim, cleaning up by itself.
    procs["shim"] = subprocess.Popen([*SLEEPER, "agent_shim"], start_new_session=True)
    try:
        _into(root / me / "episode.live", procs["mine"])
        _into(root / gone_owner / "episode.crashed", procs["orphan"])
        _into(root / gone_owner / "episode.nested" / "made-by-the-agent", procs["nested"])
        (root / gone_owner / "episode.empty").mkdir()
        _into(root / reused / "episode.tearing-down", procs["shim"])

        removed = _containment.leaves.clean_stale([root])

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
        assert _containment.leaves.clean_stale([root]) == 0
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_a_dead_owners_leaf_whose_session_leader_is_no_shim_goes(root: Path) -> None:
    """Only a session leader running agent_shim keeps a dead owner's leaf: an agent's own
    ``setsid`` process does not, nor does a shim that is not a session leader."""
    me_dead = f"{os.getpid()}.{(procfs.start_time(os.getpid()) or 0) + 1}"
    leader = subprocess.Popen(SLEEPER, start_new_session=True)
    not_leader = subprocess.Popen([*SLEEPER, "agent_shim"])
    try:
        _into(root / me_dead / "episode.setsid", leader)
        _into(root / me_dead / "episode.no-session", not_leader)
        assert _containment.leaves.clean_stale([root]) == 2
        assert leader.wait(timeout=10) == -signal.SIGKILL
        assert not_leader.wait(timeout=10) == -signal.SIGKILL
        assert not (root / me_dead).exists()
    finally:
        for proc in (leader, not_leader):
            proc.kill()
            proc.wait()
