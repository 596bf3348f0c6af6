"""Forks of a template parked ahead of demand (``isolate.park``): an episode's start is a
hand-over. What a parked fork holds, how the pool refills, and how its forks end."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import isolate
from isolate.workflow import SWEAgentWorkflow

from . import _internals
from .cancellation._shims import SILENT_SHIM
from .conftest import (
    Agents,
    cancelled_once,
    episode_processes,
    is_gone,
    remove_dead_parents_leaves,
    wait_for,
    wait_until,
)
from .test_cli import URL
from .test_templates import (
    TEMP_AGENT,
    drop_in_agent,
    fresh_after_no_fork,
    refusing_agent,
    slow_to_fork,
    template_processes,
)

pytestmark = pytest.mark.anyio

SECRET = "sk-parked-3f9a1c7d5e"

AGENT = """
import errno
import json
import os
def run(data, key=None):
    return 1.0, {"pid": os.getpid(), "cgroup": open("/proc/self/cgroup").read(),
                 "key": os.environ.get("API_KEY", "")}
"""


def pool() -> _internals.Pool:
    (template,) = _internals.started_templates()
    assert template.pool is not None
    return template.pool


def parked() -> list[_internals.Forked]:
    return list(pool().parked)


def parked_leaves() -> list[Path]:
    return [d for f in parked() if f.leaves is not None for d in f.leaves.dirs.values()]


def has_cgroups() -> bool:
    return _internals.layer_problem("cgroup") is None


@pytest.fixture(params=["default", "pairs"])
def mode(request: pytest.FixtureRequest) -> str:
    """``default``: the template's forks as it makes them (each the episode's worker itself,
    where each has a cgroup leaf); ``pairs``: each fork a shim's supervisor that forks its
    worker ahead, as where there is no leaf."""
    return str(request.param)


async def park_in(mode: str, spec: isolate.EpisodeSpec, n: int) -> int:
    """``isolate.park`` with the template's forks made as ``mode`` says."""
    if mode == "pairs":
        await isolate.park(spec, 0)  # the template, started
        (template,) = _internals.started_templates()
        template.forks_alone = False
    return await isolate.park(spec, n)


async def test_episodes_take_parked_forks_and_the_pool_refills(agents: Agents) -> None:
    spec = agents.spec(AGENT, preload=True)
    assert await isolate.park(spec, 3) == 3
    before = {f.pid for f in parked()}
    assert len(before) == 3
    started: list[int] = []
    outcomes: list[isolate.EpisodeOutcome] = []

    async def one() -> None:
        outcomes.append(await isolate.run_episode(spec, {}, on_start=started.append))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
    assert [(o.status, o.start, o.killed) for o in outcomes] == [("ok", "template", 0)] * 3
    assert set(started) == before  # each took a parked fork
    if has_cgroups():  # in the leaf it was parked in, not the template's
        assert all("/parked." in o.info["cgroup"] for o in outcomes)
        assert not any("/template." in o.info["cgroup"] for o in outcomes)
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 3))
    assert not {f.pid for f in parked()} & before


async def test_a_hand_over_from_an_empty_pool_takes_nothing_and_holds_no_fd(
    agents: Agents,
) -> None:
    spec = agents.spec(AGENT, preload=True)
    assert await isolate.park(spec, 0) == 0
    (template,) = _internals.started_templates()
    before = sorted(os.listdir("/proc/self/fd"))
    assert _internals.start_parked(template, "none-parked", "tag") is None
    assert sorted(os.listdir("/proc/self/fd")) == before
    outcome = await isolate.run_episode(spec, {})  # forked on demand, in its own leaf
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    if has_cgroups():
        assert "/parked." not in outcome.info["cgroup"]


async def test_a_parked_pair_holds_no_secret_and_no_handshake(agents: Agents, mode: str) -> None:
    spec = agents.spec(AGENT, preload=True)
    await park_in(mode, spec, 2)
    outcome = await isolate.run_episode(
        spec, {}, secrets={"key": SECRET}, secret_env={"API_KEY": SECRET}
    )
    assert (outcome.status, outcome.start, outcome.info["key"]) == ("ok", "template", "[secret]")
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 2))
    (template,) = _internals.started_templates()
    for forked in parked():
        alone = mode == "default" and has_cgroups() and "pidns" in outcome.containment
        assert forked.alone == alone
        procs = await anyio.to_thread.run_sync(parked_procs, forked)
        fork = procs[0]
        for pid in (p.pid for p in procs):
            environ = await anyio.Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = await anyio.Path(f"/proc/{pid}/cmdline").read_bytes()
            assert SECRET.encode() not in environ + cmdline
            # Tagged as its template, not as any episode; no channel yet (stdin is /dev/null,
            # where a handed-over fork's is its episode's socket), in the fork's session.
            assert f"{isolate.EPISODE_ENV}={template.name}".encode() in environ.split(b"\0")
            assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
            assert os.getsid(pid) == fork.pid  # a session of its own already
        assert fork.children() == procs[1:]  # its worker forked ahead, if any, and no other
        assert procs[-1].children() == []


def parked_procs(forked: _internals.Forked) -> list[psutil.Process]:
    """A parked fork, and its worker if it forks one (forked once the parent has moved the
    fork into its leaf); the last of them runs the episode."""
    fork = psutil.Process(forked.pid)
    if forked.alone:
        return [fork]
    kids = wait_for(fork.children, what="the worker forked ahead")
    return [fork, kids[0]]


def innermost_pid(pid: int) -> int:
    """The pid of ``pid`` in its own PID namespace (the template's, where it has one)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(f"no NSpid for {pid}")


MARKED = """
import errno
import json
import os
def run(data):
    # Called: the episode's code runs. A marker named by the caller's pid in its namespace.
    open(os.path.join(os.environ["PID_DIR"], "called.%d" % os.getpid()), "w").close()
    return 1.0, {"pid": os.getpid(), "cgroup": open("/proc/self/cgroup").read()}
"""


async def test_the_worker_waits_in_the_leaf_and_runs_nothing_before_its_episode(
    agents: Agents, mode: str
) -> None:
    spec = agents.spec(MARKED, preload=True)
    await park_in(mode, spec, 2)
    groups = [await anyio.to_thread.run_sync(parked_procs, f) for f in parked()]
    ahead = {innermost_pid(procs[-1].pid) for procs in groups}
    for procs in groups:
        fork, worker = procs[0], procs[-1]
        assert len(procs) == 1 or worker.ppid() == fork.pid
        cgroup = await anyio.Path(f"/proc/{worker.pid}/cgroup").read_text()
        assert cgroup == await anyio.Path(f"/proc/{fork.pid}/cgroup").read_text()  # its leaf
        if has_cgroups():
            assert "/parked." in cgroup
    assert list(agents.pids.glob("called.*")) == []  # nothing of the episode ran yet
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    assert outcome.info["pid"] in ahead  # the worker that waited ran it
    assert [p.name for p in agents.pids.glob("called.*")] == [f"called.{outcome.info['pid']}"]
    if has_cgroups():
        assert "/parked." in outcome.info["cgroup"]


async def test_a_parked_worker_killed_from_outside_is_replaced_with_its_fork(
    agents: Agents,
) -> None:
    spec = agents.spec(AGENT, preload=True)
    await park_in("pairs", spec, 1)
    (victim,) = parked()
    _, worker = await anyio.to_thread.run_sync(parked_procs, victim)
    worker.kill()
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: victim.has_exited()))
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: [f.pid for f in parked()] not in ([], [victim.pid]))
    )
    _, fresh = await anyio.to_thread.run_sync(parked_procs, parked()[0])
    assert fresh.pid != worker.pid
    assert not parked()[0].has_exited()


SLEEPER = """
import os, time
def mark(name, text):
    with open(os.path.join(os.environ["PID_DIR"], name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(os.environ["PID_DIR"], name + ".tmp"),
              os.path.join(os.environ["PID_DIR"], name))
def run(data):
    try:
        mark("ready", str(os.getpid()))
        time.sleep(300)
    finally:
        mark("cleaned", "yes")
"""


async def test_a_burst_beyond_the_pool_takes_its_forks_and_the_pool_refills_to_its_size(
    agents: Agents,
) -> None:
    spec = agents.spec(AGENT, preload=True)
    await isolate.park(spec, 4)
    before = {f.pid for f in parked()}
    started: list[int] = []
    outcomes: list[isolate.EpisodeOutcome] = []

    async def one() -> None:
        outcomes.append(await isolate.run_episode(spec, {}, on_start=started.append))

    async with anyio.create_task_group() as tg:
        for _ in range(7):
            tg.start_soon(one)
    assert [(o.status, o.start) for o in outcomes] == [("ok", "template")] * 7
    assert before <= set(started)  # the parked ones first, the rest forked (or parked) anew
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 4))
    assert not {f.pid for f in parked()} & set(started)


async def test_no_refill_between_hand_overs_within_the_quiet_period(agents: Agents) -> None:
    spec = agents.spec(AGENT, preload=True)
    await isolate.park(spec, 4)
    pool().quiet_s = 600.0  # hand-overs a test makes are closer together than this
    made = pool().made
    for _ in range(2):
        outcome = await isolate.run_episode(spec, {})
        assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    assert (pool().taken, pool().made, len(parked())) == (2, made, 2)  # not refilled
    pool().quiet_s = _internals.QUIET_MS / 1000
    pool().resize(4)  # wakes its thread: quiet long enough now
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 4))
    assert pool().made == made + 2


@pytest.mark.parametrize("parked_ahead", [1, 0], ids=["from the pool", "forked on demand"])
async def test_a_fork_passes_the_start_gate_that_fresh_starts_wait_at(
    agents: Agents, tmp_path: Path, parked_ahead: int
) -> None:
    """The start gate bounds interpreters starting at once; a template's fork starts none:
    with every place held by fresh shims that never say hello, a fork still starts and ends."""
    spec = agents.spec(AGENT, preload=True)
    await isolate.park(spec, parked_ahead)
    shim = tmp_path / "silent_shim.py"
    shim.write_text(SILENT_SHIM)
    silent = agents.spec("def run(data):\n    pass\n")
    held: list[int] = []
    with anyio.CancelScope() as scope:
        admitted = int(_internals.starting_gate().total_tokens)
        async with anyio.create_task_group() as tg:
            for _ in range(admitted):
                tg.start_soon(
                    functools.partial(
                        _internals.run_with_shim, silent, {}, shim, on_start=held.append
                    )
                )
            await wait_until(lambda: len(held) == admitted, 30.0)
            assert _internals.starting_gate().available_tokens == 0
            with anyio.fail_after(60):
                outcome = await isolate.run_episode(spec, {})
            scope.cancel()
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    assert outcome.timings.start_wait_s == 0.0
    assert all(is_gone(pid) for pid in held)
    await isolate.close_templates()  # the pool refilled behind the fork it took
    assert agents.left() == []


async def test_a_fresh_start_after_a_fork_that_did_not_come_waits_at_the_start_gate(
    agents: Agents, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An episode whose template does not fork it starts fresh, an interpreter like any other:
    with every place at the gate held, it waits there (a burst whose template died must not
    start hundreds of interpreters at once), and starts once a place is free."""
    spec = agents.spec(AGENT, preload=True)
    importer = await slow_to_fork(spec, monkeypatch)
    shim = tmp_path / "silent_shim.py"
    shim.write_text(SILENT_SHIM)
    silent = agents.spec("def run(data):\n    pass\n")
    held: list[int] = []
    outcomes: list[isolate.EpisodeOutcome] = []

    async def episode() -> None:
        outcomes.append(await isolate.run_episode(spec, {}))

    gate = _internals.starting_gate()
    importer.suspend()  # SIGSTOP: it answers no fork request
    try:
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as holders:
                async with anyio.create_task_group() as holding:
                    for _ in range(int(gate.total_tokens)):
                        holding.start_soon(
                            functools.partial(
                                _internals.run_with_shim, silent, {}, shim, on_start=held.append
                            )
                        )
                    await wait_until(lambda: len(held) == gate.total_tokens, 30.0)
                    tg.start_soon(episode)
                    # Its fork request times out; then it waits for a place.
                    await wait_until(lambda: gate.statistics().tasks_waiting == 1, 30.0)
                    assert outcomes == []
                    holders.cancel()
    finally:
        importer.resume()
    outcome = fresh_after_no_fork(outcomes)
    assert outcome.timings.start_wait_s > 0.0
    assert all(is_gone(pid) for pid in held)
    monkeypatch.undo()
    await isolate.close_templates()
    assert agents.left() == []


async def test_a_pool_not_yet_empty_waits_for_the_quiet_period_however_low(
    agents: Agents,
) -> None:
    spec = agents.spec(AGENT, preload=True)
    await isolate.park(spec, 8)
    pool().quiet_s = 600.0  # never quiet: a burst going on
    made = pool().made
    for _ in range(7):  # one left: the burst's forks are not slowed by the refill's
        outcome = await isolate.run_episode(spec, {})
        assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    assert (pool().taken, pool().made, len(parked())) == (7, made, 1)


async def test_an_empty_pool_parks_none_while_an_episode_waits_for_a_fork_on_demand(
    agents: Agents,
) -> None:
    """The template serves one request at a time: while an episode waits for its fork (here
    from a suspended importer), an empty pool asks for none, and parks once it has its fork."""
    spec = agents.spec(AGENT, preload=True)
    await isolate.park(spec, 0)  # the template started, its pool empty
    (template,) = _internals.started_templates()
    importer = psutil.Process(template.pid)
    outcomes: list[isolate.EpisodeOutcome] = []

    async def episode() -> None:
        outcomes.append(await isolate.run_episode(spec, {}))

    importer.suspend()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(episode)
            await wait_until(lambda: template.asking == 1, 10.0)
            assert await isolate.park(spec, 1, wait=False) == 0
            assert pool()._quiet_left(time.monotonic()) is None  # until woken
            importer.resume()
    finally:
        importer.resume()
    assert [(o.status, o.start) for o in outcomes] == [("ok", "template")]
    assert template.asking == 0
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 1))


async def test_an_empty_pool_refills_without_a_quiet_period(agents: Agents) -> None:
    spec = agents.spec(AGENT, preload=True)
    await isolate.park(spec, 4)
    pool().quiet_s = 600.0  # never quiet: a steady stream of episodes
    made = pool().made
    for _ in range(4):  # the fourth empties it
        outcome = await isolate.run_episode(spec, {})
        assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 1))
    assert pool().made == made + 1  # one, not more while not quiet
    (waiting,) = parked()
    started: list[int] = []
    outcome = await isolate.run_episode(spec, {}, on_start=started.append)
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    assert started == [waiting.pid]  # the next of the stream from the pool, not forked anew


async def test_a_pool_episode_times_out_with_its_clean_up_as_before(
    agents: Agents, mode: str
) -> None:
    spec = agents.spec(SLEEPER, preload=True, timeout=1.0, kill_grace=0.5)
    await park_in(mode, spec, 1)
    await anyio.to_thread.run_sync(parked_procs, parked()[0])
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("timeout", "template"), outcome.summary()
    assert (agents.pids / "cleaned").read_text() == "yes"
    assert outcome.cleanup == "finished"


async def test_a_pool_episode_cancelled_by_its_caller_cleans_up_as_before(
    agents: Agents, mode: str
) -> None:
    spec = agents.spec(SLEEPER, preload=True, kill_grace=1.0)
    await park_in(mode, spec, 1)
    await anyio.to_thread.run_sync(parked_procs, parked()[0])
    _, outcome = await cancelled_once(spec, lambda: wait_until((agents.pids / "ready").exists))
    assert (agents.pids / "cleaned").read_text() == "yes"
    assert (outcome.status, outcome.start, outcome.cleanup) == ("timeout", "template", "finished")
    assert outcome.error is not None
    assert outcome.error.message.startswith("cancelled after ")
    await isolate.close_templates()
    assert agents.left() == []


async def test_close_templates_kills_parked_forks_and_removes_their_leaves(
    agents: Agents, mode: str
) -> None:
    spec = agents.spec(AGENT, preload=True)
    await park_in(mode, spec, 3)
    procs = [p for f in parked() for p in await anyio.to_thread.run_sync(parked_procs, f)]
    assert len(procs) == (3 if parked()[0].alone else 6)  # each fork, with its worker if any
    leaves = parked_leaves()
    assert len(leaves) == (3 if has_cgroups() else 0)
    await isolate.close_templates()
    assert all(is_gone(p.pid, p.create_time()) for p in procs)
    assert not any(leaf.exists() for leaf in leaves)
    assert agents.left() == []
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: not episode_processes(f"PID_DIR={agents.pids}".encode()))
    )


async def test_a_parked_fork_killed_from_outside_is_replaced(agents: Agents, mode: str) -> None:
    spec = agents.spec(AGENT, preload=True)
    await park_in(mode, spec, 1)
    (victim,) = parked()
    procs = await anyio.to_thread.run_sync(parked_procs, victim)
    os.kill(victim.pid, signal.SIGKILL)
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: victim.has_exited()))
    # Its worker forked ahead, if any, dies with it.
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: all(is_gone(p.pid, p.create_time()) for p in procs))
    )
    # The episode that would have taken it takes another, or a fork of its own.
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: [f.pid for f in parked()] not in ([], [victim.pid]))
    )
    assert not parked()[0].has_exited()


async def test_a_template_that_dies_takes_its_parked_forks_and_the_next_refills(
    agents: Agents, mode: str
) -> None:
    spec = agents.spec(AGENT, preload=True)
    await park_in(mode, spec, 2)
    procs = [psutil.Process(f.pid) for f in parked()]
    leaves = parked_leaves()
    for forked in parked():  # each in a session of its own, no longer the template's
        procs += (await anyio.to_thread.run_sync(parked_procs, forked))[1:]
    (importer,) = template_processes(agents)
    importer.kill()
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: all(is_gone(p.pid, p.create_time()) for p in procs))
    )
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: not any(p.exists() for p in leaves)))
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    assert "starting a new one (restart 1)" in outcome.stderr_tail
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 2))


async def test_park_zero_empties_the_pool(agents: Agents) -> None:
    spec = agents.spec(AGENT, preload=True)
    await isolate.park(spec, 2)
    procs = [psutil.Process(f.pid) for f in parked()]
    assert await isolate.park(spec, 0) == 0
    assert parked() == []
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: all(is_gone(p.pid, p.create_time()) for p in procs))
    )
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template")


async def test_park_without_waiting_returns_before_its_forks_which_follow(agents: Agents) -> None:
    """``wait=False``: back once the pool is sized, with its template stopped and so no fork
    parked; the forks follow once it goes on, and episodes take them."""
    spec = agents.spec(AGENT, preload=True)
    assert await isolate.park(spec, 0) == 0  # the template started, no fork parked
    (template,) = _internals.started_templates()
    importer = psutil.Process(template.pid)
    importer.suspend()
    try:
        with anyio.fail_after(5):  # it would wait for the forks, well past that
            assert await isolate.park(spec, 2, wait=False) == 0
        assert pool().target == 2
        assert parked() == []
    finally:
        importer.resume()
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 2))
    before = {f.pid for f in parked()}
    started: list[int] = []
    outcome = await isolate.run_episode(spec, {}, on_start=started.append)
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    assert set(started) <= before


async def test_park_refuses_a_wait_that_is_not_a_bool(agents: Agents) -> None:
    spec = agents.spec(AGENT, preload=True)
    with pytest.raises(isolate.ArgumentError, match="park: wait must be a bool, got 'no'"):
        await isolate.park(spec, 2, wait="no")  # type: ignore[arg-type]
    assert _internals.started_templates() == []


WORKFLOW_AGENT = """
import json, os
def run_agent_with_reward(data, **kw):
    with open(os.path.join(os.environ["PID_DIR"], f"ran.{os.getpid()}"), "w") as f:
        f.write(json.dumps(data))
    return 1.0
"""


async def test_the_workflow_parks_what_econfig_park_asks_for(agents: Agents) -> None:
    """econfig ``park``: the drop-in's first episode of a template asks for its pool; the
    episodes of the next step take its forks."""
    drop_in_agent(agents, WORKFLOW_AGENT)
    econfig = {
        "agent_root": str(agents.root),
        "preload": True,
        "park": 3,
        "env": {"PID_DIR": str(agents.pids)},
    }
    wf = SWEAgentWorkflow(econfig=econfig, timeout=30)
    assert await wf.run({"instance_id": "w-0"}, base_url=URL) == 1.0
    assert pool().target == 3
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 3))
    before = {innermost_pid(f.pid) for f in parked()}  # as its agent's getpid() says

    async def one(i: int) -> None:
        assert await wf.run({"instance_id": f"w-{i}"}, base_url=URL) == 1.0

    async with anyio.create_task_group() as tg:
        for i in range(1, 4):
            tg.start_soon(one, i)
    ran = {int(p.name.split(".")[1]) for p in agents.pids.glob("ran.*")}
    assert before <= ran  # each parked fork ran an episode of the step
    assert pool().target == 3


async def test_the_workflow_runs_on_when_econfig_park_gets_no_template(
    agents: Agents, caplog: pytest.LogCaptureFixture
) -> None:
    refusing_agent(agents)
    econfig = {"agent_root": str(agents.root), "preload": True, "park": 2}
    econfig["env"] = {"PID_DIR": str(agents.pids)}
    wf = SWEAgentWorkflow(econfig=econfig, timeout=30)
    with caplog.at_level("WARNING", logger="AReaL-SWEAgent"):
        assert await wf.run({"instance_id": "w-0"}, base_url=URL) == 1.0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("econfig.park")]
    assert len(said) == 1, said
    assert said[0].startswith("econfig.park: park: no template for this spec: "), said[0]
    assert _internals.started_templates() == []


async def test_the_workflow_times_out_as_before_while_econfig_park_waits_for_a_template(
    agents: Agents,
) -> None:
    """The first episode waits for its template's start, within its own timeout: a template
    slower than that is a timeout, as without ``park`` (the template is not kept: the start
    it waited for is ended); a later episode asks for the pool again."""
    drop_in_agent(agents, "import time\ntime.sleep(3)\n" + WORKFLOW_AGENT)
    econfig = {
        "agent_root": str(agents.root),
        "preload": True,
        "park": 2,
        "timeout": 1.0,
        "kill_grace": 0.2,
        "cancel_grace": 0.2,
        "env": {"PID_DIR": str(agents.pids)},
    }
    wf = SWEAgentWorkflow(econfig=econfig)
    with pytest.raises(isolate.EpisodeTimeout):
        await wf.run({"instance_id": "w-0"}, base_url=URL)
    # A record with time for the template's start: the same template (the graces fit in
    # either timeout, unscaled), whose pool is asked for again.
    record = {"instance_id": "w-1", "econfig": {"timeout": 30.0}}
    assert await wf.run(record, base_url=URL) == 1.0
    assert pool().target == 2


def test_econfig_park_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="econfig.park needs econfig.preload"):
        SWEAgentWorkflow(econfig={"park": 2})
    with pytest.raises(ValueError, match="econfig.park must be an int from 0 to 1024, got -1"):
        SWEAgentWorkflow(econfig={"park": -1, "preload": True})


async def test_no_fork_is_parked_while_memory_is_short_and_the_pool_fills_after(
    agents: Agents, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the pool's memory floor (here all of the machine's memory, which no machine has
    available) ``park`` says why and parks nothing, episodes fork on demand; once memory is
    there again, the pool fills."""
    monkeypatch.setattr(_internals.template_pool, "MIN_AVAILABLE", 1.0)
    spec = agents.spec(AGENT, preload=True)
    with pytest.raises(
        isolate.IsolateError,
        match=r"park: cannot park a fork of template\.\w+: the machine has \d+ MiB of memory "
        r"available, below the 100% of its \d+ MiB that parked forks leave free",
    ):
        await isolate.park(spec, 2)
    assert parked() == []
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    monkeypatch.setattr(_internals.template_pool, "MIN_AVAILABLE", 0.1)
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: len(parked()) == 2))


@contextlib.contextmanager
def own_cgroup(tmp_path: Path, controller: str, name: str) -> Iterator[Path]:
    """A cgroup made for the test where this process makes its leaves of ``controller``
    (skips where it has none); removed after, with those made in it, once they are empty."""
    found = _internals.cgroups()
    kind = found.controller(controller)
    if kind is None:
        pytest.skip(f"no {controller} cgroup controller this process may use")
    root = found.v2 if kind == "v2" else found.v1[controller]
    assert root is not None
    where = root / f"{name}.{os.getpid()}.{tmp_path.name}"
    where.mkdir()
    try:
        yield where
    finally:
        for group in sorted([where, *where.glob("*/")], reverse=True):  # deepest first
            if group.is_dir():
                wait_for(lambda g=group: not (g / "cgroup.procs").read_text().strip())
                group.rmdir()


@contextlib.contextmanager
def moved_in(where: Path, code: str, *args: str) -> Iterator[str]:
    """Run ``code`` (with ``args``), move it into cgroup ``where`` before it reads its first
    line, and give the line it prints then; it is killed after."""
    with subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,  # it may import the tests' helpers
    ) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            (where / "cgroup.procs").write_text(str(proc.pid))
            proc.stdin.write("go\n")
            proc.stdin.flush()
            yield proc.stdout.readline()
        finally:
            proc.kill()


HOG = """
import sys
sys.stdin.readline()  # in its cgroup first
held = bytearray(int(sys.argv[1]) << 20)
held[::4096] = b"x" * len(held[::4096])  # every page touched: charged to its cgroup
print("held", flush=True)
sys.stdin.read()
"""


def test_a_cgroup_near_its_memory_limit_is_short_of_memory(tmp_path: Path) -> None:
    """A real cgroup with a 128 MiB limit: empty it has room; with a process holding 120 MiB in
    it (~122 MiB charged), less than the floor's 10% is left, and the problem names the cgroup
    and its limit."""
    with own_cgroup(tmp_path, "memory", "memtest") as where:
        v2 = (where / "memory.max").exists()
        (where / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(128 << 20))
        assert _internals.template_pool.memory_problem([where]) is None
        with moved_in(where, HOG, "120") as said:
            assert said == "held\n"
            problem = _internals.template_pool.memory_problem([where])
    assert problem is not None
    assert re.fullmatch(
        rf"cgroup {re.escape(str(where))} has \d+ MiB of its 128 MiB memory limit left, "
        r"below the 10% that parked forks leave free",
        problem,
    ), problem


THREADS = """
import sys, threading
sys.stdin.readline()  # in its cgroup first
stop = threading.Event()
for _ in range(int(sys.argv[1])):
    threading.Thread(target=stop.wait, daemon=True).start()  # an error below ends it
if sys.argv[2:] == ["floor"]:  # what the pool's floor says from in here
    from tests import _internals
    print(_internals.template_pool.pids_problem(), flush=True)
else:
    print("running", flush=True)
sys.stdin.read()
stop.set()
"""


def test_a_cgroup_near_its_pids_limit_leaves_no_room_for_a_parked_fork(tmp_path: Path) -> None:
    """A real cgroup with ``pids.max`` 20: empty it has room; with a process of 19 threads in
    it (each counts), one is left, below the floor's 10%, and the problem names the cgroup."""
    with own_cgroup(tmp_path, "pids", "pidstest") as where:
        (where / "pids.max").write_text("20")
        assert _internals.template_pool.pids_problem([where]) is None
        with moved_in(where, THREADS, "18") as said:
            assert said == "running\n"
            assert (where / "pids.current").read_text().strip() == "19"
            problem = _internals.template_pool.pids_problem([where])
    assert problem == (
        f"cgroup {where} has room for 1 of its 20 processes, below the 10% that parked "
        "forks leave free"
    )


def test_the_pids_floor_reads_the_limit_of_a_cgroup_above_the_trainers(tmp_path: Path) -> None:
    """A trainer in a cgroup without a limit, below one with ``pids.max`` 20 (a container's,
    say): with 19 of its threads counted there, its own floor names the cgroup above."""
    with own_cgroup(tmp_path, "pids", "pidsabove") as above:
        own = above / "trainer"
        own.mkdir()
        (above / "pids.max").write_text("20")
        with moved_in(own, THREADS, "18", "floor") as said:
            assert (own / "pids.max").read_text().strip() == "max"
    assert said.strip() == (
        f"cgroup {above} has room for 1 of its 20 processes, below the 10% that parked "
        "forks leave free"
    )


@pytest.mark.parametrize("n", [-1, 1.5, True, "2", None, _internals.MAX_PARKED + 1])
async def test_a_bad_size_is_refused_before_anything_starts(agents: Agents, n: object) -> None:
    spec = agents.spec(AGENT, preload=True)
    with pytest.raises(isolate.ArgumentError, match="park: n must be an int from 0 to 1024"):
        await isolate.park(spec, n)  # type: ignore[arg-type]
    assert _internals.started_templates() == []


async def test_park_needs_a_spec_with_preload(agents: Agents) -> None:
    spec = agents.spec(AGENT)
    with pytest.raises(isolate.ArgumentError, match="no preload"):
        await isolate.park(spec, 2)
    assert _internals.started_templates() == []


async def test_park_says_why_no_template_can_be_used(agents: Agents) -> None:
    spec = agents.spec("raise ImportError('nope')\ndef run(data):\n    return 1.0\n", preload=True)
    with pytest.raises(isolate.IsolateError, match="park: no template for this spec: cannot"):
        await isolate.park(spec, 2)
    await wait_until(lambda: not template_processes(agents))


@pytest.mark.skipif(not _internals.landlock_abi(), reason="the sandbox needs Landlock")
async def test_sandboxed_episodes_from_parked_forks(agents: Agents) -> None:
    spec = agents.spec(TEMP_AGENT, preload=True, sandbox=isolate.Sandbox())
    await isolate.park(spec, 2)
    outcomes = [await isolate.run_episode(spec, {}) for _ in range(3)]
    for outcome in outcomes:
        assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
        assert outcome.info["env"] == outcome.info["tempfile"]  # its own, not the template's
    assert len({o.info["env"] for o in outcomes}) == 3


PARENT = """
import anyio, isolate, os, sys
async def main():
    spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
    await isolate.park(spec, 2)
    open(sys.argv[2], "w").close()
    await anyio.sleep(300)
anyio.run(main)
"""


def test_the_parents_death_ends_its_parked_forks(agents: Agents) -> None:
    spec = agents.spec(AGENT, preload=True)
    ready = agents.tmp / "parked"
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), spec.model_dump_json(), str(ready)]
    )
    try:
        wait_for(ready.exists, 20.0, "the forks to be parked")
        seen = episode_processes(f"PID_DIR={agents.pids}".encode())
        assert len(seen) >= 5  # the template (three processes) and two parked forks
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: all(is_gone(p.pid, p.create_time()) for p in seen), 3.0, "all to die")
    finally:
        parent.kill()
        parent.wait()
    remove_dead_parents_leaves()


async def test_a_large_handshake_reaches_the_parked_worker_whole(agents: Agents, mode: str) -> None:
    code = "import os\ndef run(data):\n    return 1.0, {'n': len(data['x']), 'pid': os.getpid()}\n"
    spec = agents.spec(code, preload=True)
    await park_in(mode, spec, 1)
    worker = (await anyio.to_thread.run_sync(parked_procs, parked()[0]))[-1]
    ahead = innermost_pid(worker.pid)
    outcome = await isolate.run_episode(spec, {"x": "y" * (3 << 20)})  # many packets
    assert (outcome.status, outcome.start, outcome.info["n"]) == ("ok", "template", 3 << 20)
    assert outcome.info["pid"] == ahead


PY39 = os.path.expanduser("~/.pyenv/versions/3.9.18/bin/python3.9")


@pytest.mark.skipif(not os.path.exists(PY39), reason=f"{PY39} is not installed")
async def test_a_parked_pair_under_python_3_9(agents: Agents, mode: str) -> None:
    spec = agents.spec(MARKED, preload=True, python=PY39)
    await park_in(mode, spec, 1)
    worker = (await anyio.to_thread.run_sync(parked_procs, parked()[0]))[-1]
    ahead = innermost_pid(worker.pid)
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start, outcome.info["pid"]) == ("ok", "template", ahead)


# Parks 4 forks, takes every free fd, asks the template for a fork (EMFILE), gives the fds
# back, runs an episode, closes the templates; prints what it saw as one JSON line.
EMFILE_DRIVER = """
import errno, json, os, socket, sys, anyio, isolate
from tests import _internals

async def main():
    spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
    await isolate.park(spec, 4)
    (template,) = _internals.started_templates()
    pool = template.pool
    pool.quiet_s = 3600.0  # 3 of 4 left, not empty: no refill meanwhile
    out = {"parked": sorted(f.pid for f in pool.parked)}
    ours, theirs = socket.socketpair()
    hogs = []
    try:
        while True:
            hogs.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        template.fork("emfile", "emfile", theirs.fileno())
        out["errno"] = None
    except OSError as exc:
        out["errno"] = exc.errno
    finally:
        for fd in hogs:
            os.close(fd)
    ours.close()
    theirs.close()
    out["parked_after"] = sorted(f.pid for f in pool.parked)
    out["forks_after"] = sorted(f.pid for f in template.forks)
    outcome = await isolate.run_episode(spec, {})
    out["outcome"] = [outcome.status, outcome.start]
    out["pids"] = sorted(template.own_pids())
    await isolate.close_templates()
    out["forks_left"] = len(template.forks)
    out["outer_code"] = template.popen.returncode
    print(json.dumps(out))

anyio.run(main)
"""


def run_under_256_fds(driver: str, spec: isolate.EpisodeSpec) -> dict[str, Any]:
    """Run ``driver`` (a script given the spec as JSON) in a process whose open-file limit is
    256; the JSON line it printed last."""
    limit = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
    limit += "os.execv(sys.executable, [sys.executable, '-c', *sys.argv[1:]])"
    proc = subprocess.run(
        [sys.executable, "-c", limit, textwrap.dedent(driver), spec.model_dump_json()],
        cwd=Path(__file__).resolve().parents[1],  # where ``tests`` is importable
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return out


def test_emfile_at_the_hand_over_leaks_no_parked_fork(agents: Agents) -> None:
    # EMFILE when the fork's stderr pipe is made: no parked fork is taken (the pool stays
    # whole, the episode waits for fds), and close_templates() ends the template whole.
    out = run_under_256_fds(EMFILE_DRIVER, agents.spec(AGENT, preload=True))
    assert out["errno"] == errno.EMFILE
    assert out["outcome"] == ["ok", "template"]
    # Nothing of the template's is left: no fork it still waits for, its outer process reaped.
    assert (out["forks_left"], out["outer_code"] is not None) == (0, True)
    assert [pid for pid in out["pids"] + out["parked"] if not is_gone(pid)] == []
    assert episode_processes(f"PID_DIR={agents.pids}".encode()) == []
    assert len(out["parked"]) == 4
    assert out["parked_after"] == out["parked"] == out["forks_after"]  # none taken


# Parks 2 forks, takes every free fd, asks for a third (its refill meets EMFILE), waits until
# the pool has said so, gives the fds back; prints what it saw as one JSON line.
REFILL_EMFILE_DRIVER = """
import json, os, sys, time, anyio, isolate
from tests import _internals

async def main():
    spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
    await isolate.park(spec, 2)
    (template,) = _internals.started_templates()
    pool = template.pool
    pool.quiet_s = 0.0
    hogs = []
    try:
        while True:
            hogs.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    pool.resize(3)
    end = time.monotonic() + 20.0
    while pool.problem is None and pool._thread.is_alive() and time.monotonic() < end:
        await anyio.sleep(0.01)
    out = {"problem": pool.problem, "alive_during": pool._thread.is_alive()}
    for fd in hogs:
        os.close(fd)
    end = time.monotonic() + 30.0
    while len(pool.parked) < 3 and pool._thread.is_alive() and time.monotonic() < end:
        await anyio.sleep(0.02)
    out["parked"] = len(pool.parked)
    out["alive_after"] = pool._thread.is_alive()
    outcome = await isolate.run_episode(spec, {})
    out["outcome"] = [outcome.status, outcome.start]
    await isolate.close_templates()
    out["outer_code"] = template.popen.returncode
    print(json.dumps(out))

anyio.run(main)
"""


def test_a_refill_that_meets_emfile_tries_again(agents: Agents) -> None:
    # Out of fds while refilling, the pool says why and tries again; it does not end (which
    # would leave the template's episodes forking on demand for good).
    spec = agents.spec(AGENT, preload=True)
    out = run_under_256_fds(REFILL_EMFILE_DRIVER, spec)
    assert "Too many open files" in (out["problem"] or ""), out
    assert (out["alive_during"], out["alive_after"], out["parked"]) == (True, True, 3), out
    assert out["outcome"] == ["ok", "template"]
    assert out["outer_code"] is not None
    assert episode_processes(f"PID_DIR={agents.pids}".encode()) == []


async def test_a_parked_fork_whose_hand_over_fails_ends_as_a_dead_pair(
    agents: Agents, mode: str
) -> None:
    # Its hand-over socket closed on the parent's side: the send fails (or the fork, at EOF
    # there, is dead by the time it is taken); either way it is killed with its worker, its
    # leaves removed, and the episode takes a fork of its own.
    spec = agents.spec(AGENT, preload=True)
    await park_in(mode, spec, 1)
    pool().quiet_s = 3600.0
    (victim,) = parked()
    procs = await anyio.to_thread.run_sync(parked_procs, victim)
    leaves = parked_leaves()
    assert victim.hand is not None
    victim.hand.close()
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: all(is_gone(p.pid, p.create_time()) for p in procs))
    )
    (template,) = _internals.started_templates()
    assert victim not in template.forks
    assert not any(leaf.exists() for leaf in leaves)
    await isolate.close_templates()
    assert template.popen.returncode is not None
    assert agents.left() == []
