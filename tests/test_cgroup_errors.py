"""Errors of the cgroup layer, each made by the kernel for real: a leaf that cannot be created,
a cgroup the shim cannot join, a leaf that cannot be removed. Each ends as an outcome that says
so; none leaves a process behind."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
from pathlib import Path

import anyio
import pytest

import isolate

from . import _internals
from .conftest import Agents, own_leaves, wait_until
from .test_protocol import frames_of, marker_agent, run_real_shim

pytestmark = pytest.mark.anyio


def v2_root() -> Path:
    groups = _internals.cgroups()
    if groups.v2 is None:
        pytest.skip(f"containment 'cgroup' is not available here: {groups.problem}")
    return groups.v2


async def test_a_leaf_that_cannot_be_created_is_a_setup_error(agents: Agents) -> None:
    # No descendants allowed below this process's directory: mkdir of the leaf gets EAGAIN.
    owner = v2_root() / _internals.owner_name()
    made = not owner.exists()
    owner.mkdir(exist_ok=True)
    limit = owner / "cgroup.max.descendants"
    try:
        await anyio.Path(limit).write_text("0")
        spec = agents.spec("def run(d):\n    return 1.0\n", containment="cgroup")
        outcome = await isolate.run_episode(spec, {}, episode_id="no-room")
    finally:
        await anyio.Path(limit).write_text("max")
        if made:
            owner.rmdir()
    assert outcome.status == "setup_error", outcome.summary()
    assert outcome.error is not None
    assert f"cannot create cgroup {owner}/no-room." in outcome.error.message
    assert outcome.pid is None  # nothing was started


@pytest.mark.parametrize("pool", [1, 0])
async def test_a_templates_episode_makes_its_leaf_only_without_a_parked_fork(
    agents: Agents, pool: int
) -> None:
    # No room for one more cgroup below this process's directory once the template and its
    # pool are there: a parked fork's leaf is the episode's, and one forked on demand cannot
    # make its own.
    owner = v2_root() / _internals.owner_name()
    spec = agents.spec("def run(d):\n    return 1.0\n", containment="cgroup", preload=True)
    assert await isolate.park(spec, pool) == pool
    limit = owner / "cgroup.max.descendants"
    stat = dict(line.split() for line in (owner / "cgroup.stat").read_text().splitlines())
    try:
        await anyio.Path(limit).write_text(stat["nr_descendants"])
        outcome = await isolate.run_episode(spec, {}, episode_id="no-room")
    finally:
        await anyio.Path(limit).write_text("max")
    if pool:
        assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
        return
    assert outcome.status == "setup_error", outcome.summary()
    assert outcome.error is not None
    assert f"cannot create cgroup {owner}/no-room." in outcome.error.message
    assert (outcome.containment, outcome.pid) == ("cgroup", None)  # nothing was started


def test_the_shim_says_when_it_cannot_join_its_cgroup(agents: Agents, tmp_path: Path) -> None:
    hs, marker = marker_agent(agents)
    hs.update(containment="cgroup", cgroups=[str(tmp_path / "not-a-cgroup")])
    done = run_real_shim(tmp_path, json.dumps(hs).encode() + b"\n")
    assert done.returncode == 2, done.stderr
    hello, error = frames_of(done.stdout)
    assert (hello["t"], error["t"], error["kind"]) == ("hello", "error", "setup")
    assert error["type"] == "ContainmentError"
    assert error["message"].startswith(f"cannot join cgroup {tmp_path / 'not-a-cgroup'}: ")
    assert not marker.exists()  # the agent was never imported


# The agent makes a cgroup of its own inside its leaf, and the test (root, outside the episode:
# the agent itself can mount nothing) mounts a directory on it: the kernel refuses to remove a
# mount point (EBUSY), so neither the nested cgroup nor the leaf can go.
NESTER = """
import os, time
def run(data):
    path = open("/proc/self/cgroup").read().split("0::", 1)[1].split()[0]
    mount = next(l.split()[1] for l in open("/proc/self/mounts") if l.split()[2] == "cgroup2")
    leaf = mount + path
    os.mkdir(os.path.join(leaf, "nested"))
    with open(data["leaf_file"] + ".tmp", "w") as f:
        f.write(leaf)
    os.rename(data["leaf_file"] + ".tmp", data["leaf_file"])
    while not os.path.exists(data["mounted"]):
        time.sleep(0.01)
    return 1.0, {"leaf": leaf}
"""


def _mount_on(path: Path, source: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(str(source).encode(), str(path).encode(), None, 4096, None) != 0:  # MS_BIND
        raise OSError(ctypes.get_errno(), f"mount --bind {source} {path}")


def _remove(leaf: Path) -> None:
    _unmount(leaf / "nested")
    (leaf / "nested").rmdir()
    leaf.rmdir()


def _unmount(path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(str(path).encode(), 0) != 0:
        raise OSError(ctypes.get_errno(), f"umount {path}")


async def test_a_leaf_that_cannot_be_removed_is_noted_and_the_outcome_stands(
    agents: Agents,
) -> None:
    v2_root()
    empty = agents.tmp / "empty"
    empty.mkdir()
    spec = agents.spec(NESTER, containment="cgroup")
    leaf_file, mounted = agents.tmp / "leaf", agents.tmp / "mounted"
    data = {"leaf_file": str(leaf_file), "mounted": str(mounted)}
    leaf: Path | None = None

    async def mount_when_made() -> None:
        nonlocal leaf
        await wait_until(leaf_file.exists)
        leaf = Path(leaf_file.read_text())
        _mount_on(leaf / "nested", empty)
        mounted.touch()

    async with anyio.create_task_group() as tg:
        tg.start_soon(mount_when_made)
        outcome = await isolate.run_episode(spec, data)
    try:
        assert isinstance(outcome.info, dict)
        assert Path(outcome.info["leaf"]) == leaf
        assert outcome.status == "ok", outcome.summary()
        assert leaf is not None
        assert leaf in own_leaves()  # left behind, as noted
        assert outcome.log_path is not None
        log = outcome.log_path.read_text()
        assert f"[isolate] cgroup clean-up: cannot remove {leaf}: " in log
        assert "the next start of isolate removes it" in log
    finally:
        if leaf is not None:
            _remove(leaf)
    assert agents.left() == []


async def test_auto_refuses_limits_that_no_combination_can_enforce(
    agents: Agents, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine whose cgroups offer no pids controller, to a privileged parent: the first
    combination is available but cannot bound the processes, nor can any after it (the process
    limit is the one limit a combination can fail, and then all fail alike), so auto says why
    the first could not; the episode is a setup error, never an unbounded run."""
    real = _internals.cgroups()
    v2_root()
    bare = dataclasses.replace(real, v2_controllers=frozenset(), v1={})
    monkeypatch.setitem(_internals.probed, f"cgroups.{os.getpid()}", bare)
    for where in _internals.needs_userns_askers:  # the launcher's name, and the plan's
        monkeypatch.setattr(where, "needs_userns", lambda: False)
    first = _internals.AUTO[0]
    assert _internals.containment_problem(first) is None  # available: only the limit stops it
    found = (
        f"containment {first!r} cannot enforce the limits: limits.max_processes needs a pids "
        "cgroup controller, and none is writable"
    )
    with pytest.raises(_internals.SetupProblem) as raised:
        _internals.resolve("auto", isolate.Limits(max_processes=8))
    assert str(raised.value) == found
    spec = agents.spec("def run(d):\n    return 1.0\n", limits=isolate.Limits(max_processes=8))
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error", outcome.summary()
    assert outcome.error is not None
    assert outcome.error.message == found
    # The same machine without the limit: auto's first choice, as always.
    assert _internals.resolve("auto", None)[0] == first
