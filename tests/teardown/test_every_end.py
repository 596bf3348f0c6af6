"""Teardown however the episode ends: a timeout, a normal return that leaves processes behind,
stopped processes, a zombie leader; at the default containment and at every combination. No
process the episode started is left, and the outcome counts what was killed."""

from __future__ import annotations

import anyio
import psutil
import pytest

import isolate

from ..conftest import (
    SLOW,
    Agents,
    both_starts,
    from_template,
    record_pid_sh,
)
from ._trees import (
    TREE_AGENT,
    TREE_PIDS,
    ZOMBIE_LEADER,
    all_gone,
    combination,
    level,
    needs,
    recorded,
    shims,
    snapshot_when_ready,
    tree,
)

__all__ = ["combination", "level"]  # fixtures, used by name

pytestmark = pytest.mark.anyio


@both_starts
async def test_timeout_kills_the_whole_tree(agents: Agents) -> None:
    spec = agents.spec(TREE_AGENT, timeout=4.0, kill_grace=1.0)
    outcome = await isolate.run_episode(spec, {"instance_id": "tree"})
    assert outcome.status == "timeout", outcome.summary()
    assert outcome.error is not None
    assert "4 s" in outcome.error.message
    pids = recorded(agents)
    assert len(pids) == TREE_PIDS, pids
    assert not agents.left()
    # The worker, cancelled, exits by itself; the other ten are killed.
    assert outcome.cleanup == "finished"
    assert outcome.killed >= TREE_PIDS - 1
    assert outcome.duration_s <= spec.timeout + spec.kill_grace + 1.0 * SLOW


@both_starts
async def test_leftovers_after_a_normal_return_are_killed_and_counted(agents: Agents) -> None:
    spec = agents.spec(
        TREE_AGENT.replace("time.sleep(300)\n", "return 1.0\n"), kill_grace=0.5, timeout=30.0
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    pids = recorded(agents)
    assert len(pids) == TREE_PIDS
    assert not agents.left()
    # Everything but the worker, which exited by itself.
    assert outcome.killed == TREE_PIDS - 1
    # SIGTERM-ignoring leftovers cost one grace period, not the episode's timeout.
    assert outcome.duration_s < 0.5 + 3.0 * SLOW


@both_starts
@pytest.mark.parametrize("cancel_grace", [0.0, 30.0])
async def test_stopped_processes_still_die(agents: Agents, cancel_grace: float) -> None:
    """A stopped agent is woken to be cancelled, and cleans up; without cancellation it is
    killed with its stopped child."""
    spec = agents.spec(
        f"""
        import os, signal, subprocess, time
        def run(data):
            subprocess.Popen(["sh", "-c", '{record_pid_sh("stopped")}; kill -STOP $$; sleep 300'])
            with open(os.path.join(os.environ["PID_DIR"], "worker"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGSTOP)
        """,
        timeout=2.0,
        kill_grace=1.0,
        cancel_grace=cancel_grace,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout"
    pids = agents.pid_files()
    assert set(pids) == {"stopped", "worker"}
    assert not agents.left()
    if cancel_grace:
        assert (outcome.cleanup, outcome.killed) == ("finished", 1), outcome.summary()
    else:
        assert (outcome.cleanup, outcome.killed) == (None, 2), outcome.summary()


async def test_timeout_kills_the_whole_tree_at_every_combination(
    agents: Agents, combination: str
) -> None:
    level = combination
    spec = agents.spec(TREE_AGENT, timeout=3.0, kill_grace=0.5, containment=level)
    seen: list[psutil.Process] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(snapshot_when_ready, agents, seen)
        outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert outcome.containment == level
    # The tree, and the shim where the worker has one (and for pidns its PID 1).
    assert len(seen) >= TREE_PIDS + shims(outcome.start == "template")
    assert all_gone(seen)
    assert outcome.cleanup == "finished"  # the worker, cancelled, exited by itself
    assert outcome.killed >= TREE_PIDS - 1
    assert outcome.duration_s <= spec.timeout + spec.kill_grace + 1.0 * SLOW


@from_template
@pytest.mark.parametrize("requested", ["session", "auto"])
async def test_timeout_kills_the_whole_tree_of_a_fork(agents: Agents, requested: str) -> None:
    """The same teardown for an episode forked from a template (the other layers: cancel)."""
    await test_timeout_kills_the_whole_tree_at_every_combination(agents, needs(requested))


@both_starts
async def test_leftovers_after_a_normal_return_are_killed(agents: Agents, level: str) -> None:
    code = TREE_AGENT.replace("time.sleep(300)\n", "return 1.0\n")
    spec = agents.spec(code, kill_grace=0.5, containment=level)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.containment == level
    assert len([n for n in agents.pid_files() if n != "ready"]) == TREE_PIDS
    assert tree(agents) == []
    assert outcome.killed == TREE_PIDS - 1  # all but the worker, which returned


async def test_a_zombie_leader_does_not_outlive_a_normal_end(
    agents: Agents, combination: str
) -> None:
    spec = agents.spec(ZOMBIE_LEADER, kill_grace=0.5, containment=combination)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.reward == 1.0  # the leader did read as a zombie with a live thread
    assert outcome.containment == combination
    assert tree(agents) == []
    assert outcome.killed >= 1
    # The agent was done at once: teardown, not the parent's deadline, ended the episode.
    assert outcome.duration_s <= spec.kill_grace + 5.0 * SLOW


async def test_a_zombie_leader_does_not_outlive_a_timeout(agents: Agents, combination: str) -> None:
    spec = agents.spec(
        ZOMBIE_LEADER, timeout=3.0, kill_grace=0.5, cancel_grace=1.0, containment=combination
    )
    outcome = await isolate.run_episode(spec, {"hang": True})
    assert outcome.status == "timeout", outcome.summary()
    assert (agents.pids / "ready").exists()
    assert tree(agents) == []
    assert outcome.duration_s <= spec.timeout + spec.cancel_grace + spec.kill_grace + 1.0 * SLOW
