"""Teardown when the process that called run_episode dies or stops: SIGKILLed, it takes the
tree with it (at every level, a zombie leader too) and cuts a long kill grace short; stopped,
it leaves the shim to keep its own deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .. import _internals
from ..conftest import (
    SLOW,
    Agents,
    both_starts,
    episode_processes,
    live_children,
    record_pid_sh,
    remove_dead_parents_leaves,
    wait_for,
)
from ._trees import (
    PARENT,
    TREE_AGENT,
    TREE_PIDS,
    ZOMBIE_LEADER,
    all_gone,
    combination,
    level,
    recorded,
    tree,
)

__all__ = ["combination", "level"]  # fixtures, used by name

pytestmark = pytest.mark.anyio


@both_starts
def test_parent_killed_takes_the_tree_with_it(agents: Agents, tmp_path: Path) -> None:
    """SIGKILL the process that called run_episode: the shim sees EOF on its stdin and the
    whole tree, SIGTERM-ignoring setsid daemon included, is gone within 2 s."""
    spec = agents.spec(TREE_AGENT, kill_grace=5.0, timeout=120.0)
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), spec.model_dump_json()]
    )
    try:
        wait_for(lambda: (agents.pids / "ready").exists(), 20.0, "the tree to be ready")
        pids = recorded(agents)
        assert len(pids) == TREE_PIDS
        os.kill(parent.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        parent.wait()
        wait_for(lambda: not agents.left(), 2.0, "the tree to die")
        assert time.monotonic() - killed_at <= 2.0 * SLOW
        # The shim itself exits right after its tree: wait for it too, boundedly. (A
        # template's processes are re-parented to this process: a dying one shows no
        # environment, so they are waited for as its descendants.)
        marker = f"PID_DIR={agents.pids}".encode()
        wait_for(lambda: not episode_processes(marker), 2.0, "the shim to exit")
        wait_for(lambda: not live_children(), 2.0 * SLOW, "the template to exit")
    finally:
        parent.kill()
        parent.wait()
    # The dead parent's cgroup leaves stay until an isolate process starts and removes them.
    remove_dead_parents_leaves()


@both_starts
def test_parent_killed_takes_the_tree_with_it_at_every_level(agents: Agents, level: str) -> None:
    spec = agents.spec(TREE_AGENT, kill_grace=5.0, timeout=120.0, containment=level)
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), spec.model_dump_json()]
    )
    groups = _internals.cgroups()
    roots = [r for r in [groups.v2, *groups.v1.values()] if r is not None]
    owners: list[Path] = []
    try:
        wait_for(lambda: (agents.pids / "ready").exists(), 20.0, "the tree to be ready")
        seen = tree(agents)
        assert len(seen) > TREE_PIDS
        # Found while the parent lives: once it is dead, any isolate process that starts on
        # this machine (a concurrent test run's, say) may clean its leaf before we look.
        owners = [
            p for root in roots for p in root.iterdir() if p.name.startswith(f"{parent.pid}.")
        ]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: all_gone(seen), 2.0, "the tree, shim included, to die")
    finally:
        parent.kill()
        parent.wait()
    if "cgroup" in _internals.layers(level):
        # The dead parent's leaf stays until an isolate process starts and cleans it.
        assert owners, "the parent's cgroup leaf"
        _internals.clean_stale(roots)
        assert not any(owner.exists() for owner in owners)


# A child that takes SIGTERM (and says so in a file) but does not die of it.
STUBBORN_AGENT = r"""
import os, subprocess, sys, time

STUBBORN = (
    "import os, signal, time\n"
    "d = os.environ['PID_DIR']\n"
    "signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(d, 'term'), 'w').close())\n"
    "open(os.path.join(d, 'ready'), 'w').close()\n"
    "while True:\n"
    "    time.sleep(1)\n"
)

def run(data):
    subprocess.Popen([sys.executable, "-c", STUBBORN])
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "ready")):
        time.sleep(0.01)
    time.sleep(300)
"""


def test_the_parents_death_cuts_a_long_kill_grace_short(agents: Agents) -> None:
    """The deadline passed and the shim's teardown waits out a 60-s ``kill_grace`` for a child
    that takes SIGTERM and lives on; the parent is SIGKILLed then. With nobody left to report
    to, the shim cuts the grace to a second and kills the tree."""
    spec = agents.spec(STUBBORN_AGENT, timeout=1.0, cancel_grace=0.5, kill_grace=60.0)
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), spec.model_dump_json()]
    )
    try:
        wait_for(lambda: (agents.pids / "term").exists(), 30.0 * SLOW, "the teardown's SIGTERM")
        assert agents.left() != []  # the child outlived its SIGTERM
        os.kill(parent.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        parent.wait()
        wait_for(lambda: not agents.left(), 20.0, "the tree to die")
        # The second the shim gives it, and its SIGKILL; not the 60 s of the grace.
        assert time.monotonic() - killed_at <= 1.0 + 2.0 * SLOW
        marker = f"PID_DIR={agents.pids}".encode()
        wait_for(lambda: not episode_processes(marker), 2.0 * SLOW, "the shim to exit")
    finally:
        parent.kill()
        parent.wait()
    remove_dead_parents_leaves()


STOPPABLE_PARENT = """
import anyio, isolate, sys
spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
outcome = anyio.run(isolate.run_episode, spec, {})
print(outcome.status, outcome.error.message if outcome.error else "")
"""


def test_the_shim_keeps_its_own_deadline_while_the_parent_is_stopped(agents: Agents) -> None:
    """SIGSTOP the process that called run_episode: its pipe stays open, so only the shim's
    own deadline (timeout + kill_grace + 2 s) can end the episode, and it does."""
    spec = agents.spec(
        f"""
        import subprocess, time
        def run(data):
            subprocess.Popen(["sh", "-c", '{record_pid_sh("child")}; exec sleep 300'])
            time.sleep(300)
        """,
        timeout=3.0,
        kill_grace=0.5,
    )
    shim_deadline = spec.timeout + spec.kill_grace + _internals.prepare.SHIM_DEADLINE_MARGIN_S
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(STOPPABLE_PARENT), spec.model_dump_json()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: "child" in agents.pid_files(), 20.0, "the agent's child")
        os.kill(parent.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert agents.left()  # the tree is alive while the parent is stopped
        wait_for(lambda: not agents.left(), shim_deadline + 5.0, "the shim to end its tree")
        # Not before the parent's own deadline could have fired (it could not: stopped).
        assert time.monotonic() - stopped_at >= spec.timeout - 1.0
        os.kill(parent.pid, signal.SIGCONT)
        out, _ = parent.communicate(timeout=20 * SLOW)
    finally:
        parent.kill()
        parent.wait()
    assert parent.returncode == 0
    assert out.startswith("timeout "), out


def test_a_zombie_leader_does_not_outlive_the_parent(agents: Agents, combination: str) -> None:
    spec = agents.spec(
        ZOMBIE_LEADER, timeout=120.0, kill_grace=5.0, cancel_grace=1.0, containment=combination
    )
    hang = textwrap.dedent(PARENT).replace("spec, {})", 'spec, {"hang": True})')
    assert hang != textwrap.dedent(PARENT)
    parent = subprocess.Popen([sys.executable, "-c", hang, spec.model_dump_json()])
    try:
        wait_for(lambda: (agents.pids / "ready").exists(), 20.0, "the zombie leader")
        seen = tree(agents)
        assert seen
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        # The shim's bound after its parent's death: the agent's clean-up, then 2 s.
        wait_for(lambda: not tree(agents), spec.cancel_grace + 2.0, "the episode to end")
        assert all_gone(seen)
    finally:
        parent.kill()
        parent.wait()
    if "cgroup" in _internals.layers(combination):
        groups = _internals.cgroups()
        _internals.clean_stale([r for r in [groups.v2, *groups.v1.values()] if r is not None])
