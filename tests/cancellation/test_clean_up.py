"""Cancel first, then terminate: at every early end the agent is cancelled inside its own process
and its clean-up runs (shown by a marker file the clean-up writes), bounded by cancel_grace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import isolate

from .. import _internals
from ..conftest import (
    SLOW,
    Agents,
    cancelled_once,
    episode_processes,
    remove_dead_parents_leaves,
    wait_for,
    wait_until,
)
from ..teardown._trees import needs

pytestmark = pytest.mark.anyio

PY39 = os.path.expanduser("~/.pyenv/versions/3.9.18/bin/python3.9")
PY310 = os.path.expanduser("~/.pyenv/versions/3.10.13/bin/python3.10")
PY313 = os.path.expanduser("~/.pyenv/versions/3.13.0/bin/python3.13")


def interpreters(*paths: str) -> list[object]:
    """This Python and each of ``paths``, skipped (with the reason) where it is missing."""
    found: list[object] = [pytest.param(sys.executable, id="project")]
    for path in paths:
        name = os.path.basename(path)
        missing = pytest.mark.skip(reason=f"{path} is not installed")
        found.append(pytest.param(path, id=name, marks=() if os.path.exists(path) else missing))
    return found


def levels() -> list[Any]:
    """Each containment layer alone, session, and the strongest combination here (auto), each
    skipped (with the reason) where this machine lacks it."""
    found: list[Any] = []
    for name in [*_internals.LAYERS, "session", "auto"]:
        problem = None if name == "auto" else _internals.containment_problem(name)
        marks = pytest.mark.skip(reason=f"containment {name!r}: {problem}") if problem else ()
        found.append(pytest.param(name, id=name, marks=marks))
    return found


# Each agent writes "ready" once it waits, and the clean-up writes "cleaned" (with what it saw).
HELPERS = """
import asyncio, os, signal, subprocess, sys, time

def mark(name, text=""):
    path = os.path.join(os.environ["PID_DIR"], name)
    with open(path + ".tmp", "w") as f:
        f.write(text or str(os.getpid()))
    os.rename(path + ".tmp", path)
"""

ASYNC_SLEEP = (
    HELPERS
    + """
async def run(data, **kwargs):
    try:
        mark("ready")
        await asyncio.sleep(300)
    finally:
        mark("cleaned", "async")
"""
)

SYNC_SLEEP = (
    HELPERS
    + """
def run(data):
    try:
        mark("ready")
        time.sleep(300)
    finally:
        mark("cleaned", "sync")
"""
)


@pytest.mark.parametrize("level", levels())
async def test_async_clean_up_runs_at_timeout(agents: Agents, level: str) -> None:
    spec = agents.spec(ASYNC_SLEEP, timeout=1.0, kill_grace=0.5, containment=level)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    if level != "auto":
        assert outcome.containment == level
    assert (agents.pids / "cleaned").read_text() == "async"
    assert outcome.cleanup == "finished"
    assert "clean-up finished" in outcome.summary()
    assert "CancelledError" in outcome.stderr_tail  # the agent's side of it is in the log
    assert outcome.duration_s < 2.0 + 2.0 * SLOW


@pytest.mark.parametrize("python", interpreters(PY39, PY310, PY313))
@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_clean_up_runs_under_every_python(agents: Agents, python: str, kind: str) -> None:
    """Python < 3.11 handles SIGINT in asyncio.run differently: the same outcome everywhere."""
    spec = agents.spec(
        ASYNC_SLEEP if kind == "async" else SYNC_SLEEP, timeout=1.0, kill_grace=0.5, python=python
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert (agents.pids / "cleaned").read_text() == kind
    assert outcome.cleanup == "finished"


NESTED_ASYNCIO_RUN = (
    HELPERS
    + """
async def main():
    try:
        mark("ready")
        await asyncio.sleep(300)
    finally:
        mark("cleaned", "nested")

def run(data):
    return asyncio.run(main())
"""
)


@pytest.mark.parametrize("python", interpreters(PY39))
async def test_a_sync_entrypoint_running_its_own_event_loop_cleans_up(
    agents: Agents, python: str
) -> None:
    """A sync wrapper around asyncio.run, as many agents have: its coroutine's finally runs."""
    spec = agents.spec(NESTED_ASYNCIO_RUN, timeout=1.0, kill_grace=0.5, python=python)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert (agents.pids / "cleaned").read_text() == "nested"
    assert outcome.cleanup == "finished"


@pytest.mark.parametrize(
    "blocked",
    [
        "time.sleep(300)",
        "os.read(os.pipe()[0], 1)",
        "subprocess.Popen(['sleep', '300']).wait()",
        "os.kill(os.getpid(), signal.SIGSTOP)",
    ],
    ids=["sleep", "read", "subprocess.wait", "stopped"],
)
async def test_a_sync_agent_is_interrupted_wherever_it_waits(agents: Agents, blocked: str) -> None:
    code = (
        HELPERS
        + f"""
def run(data):
    try:
        mark("ready")
        {blocked}
    finally:
        mark("cleaned", "yes")
"""
    )
    spec = agents.spec(code, timeout=1.0, kill_grace=0.5)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert (agents.pids / "cleaned").read_text() == "yes"
    assert outcome.cleanup == "finished"


async def test_clean_up_runs_at_cancellation_of_the_caller(agents: Agents) -> None:
    spec = agents.spec(ASYNC_SLEEP, kill_grace=1.0)
    # The caller still learns how the episode ended, after the teardown.
    _, outcome = await cancelled_once(spec, lambda: wait_until((agents.pids / "ready").exists))
    assert (agents.pids / "cleaned").read_text() == "async"
    assert outcome.status == "timeout"
    assert outcome.error is not None
    assert outcome.error.message.startswith("cancelled after ")
    assert outcome.cleanup == "finished"
    assert outcome.pid is not None


async def test_on_end_gets_the_outcome_that_run_episode_returns(agents: Agents) -> None:
    ended: list[isolate.EpisodeOutcome] = []
    spec = agents.spec("def run(data):\n    return 1.0\n")
    outcome = await isolate.run_episode(spec, {}, on_end=ended.append)
    assert outcome.status == "ok"
    assert ended == [outcome]


async def test_the_clean_up_may_start_processes_and_its_own_keep_running(agents: Agents) -> None:
    """Only the worker is told: a subprocess it started is still alive during its clean-up,
    and the clean-up can run a command of its own."""
    code = (
        HELPERS
        + """
def run(data):
    child = subprocess.Popen(["sleep", "300"])
    try:
        mark("ready")
        time.sleep(300)
    finally:
        alive = child.poll() is None
        out = subprocess.run(["sh", "-c", "echo released"], capture_output=True, text=True)
        mark("cleaned", "%s %s" % (alive, out.stdout.strip()))
"""
    )
    spec = agents.spec(code, timeout=1.0, kill_grace=0.5)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert (agents.pids / "cleaned").read_text() == "True released"
    assert outcome.cleanup == "finished"
    assert outcome.killed == 1  # the sleep, once the clean-up had finished


HANGS = (
    HELPERS
    + """
def run(data):
    try:
        mark("ready")
        time.sleep(300)
    finally:
        subprocess.Popen(["sleep", "300"])
        mark("cleaning")
        time.sleep(300)
"""
)

SWALLOWS_SYNC = (
    HELPERS
    + """
def run(data):
    mark("ready")
    while True:
        try:
            time.sleep(300)
        except KeyboardInterrupt:
            mark("swallowed")
"""
)

SWALLOWS_ASYNC = (
    HELPERS
    + """
async def run(data):
    mark("ready")
    while True:
        try:
            await asyncio.sleep(300)
        except asyncio.CancelledError:
            mark("swallowed")
"""
)


@pytest.mark.parametrize("python", interpreters(PY39))
@pytest.mark.parametrize(
    "code", [HANGS, SWALLOWS_SYNC, SWALLOWS_ASYNC], ids=["hangs", "sync", "async"]
)
async def test_a_clean_up_that_does_not_end_is_cut_short(
    agents: Agents, code: str, python: str
) -> None:
    spec = agents.spec(code, timeout=1.0, cancel_grace=1.0, kill_grace=0.5, python=python)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert outcome.cleanup == "cut short"
    assert "clean-up cut short" in outcome.summary()
    assert {"cleaning", "swallowed"} & set(os.listdir(agents.pids))
    bound = spec.timeout + spec.cancel_grace + spec.kill_grace
    assert outcome.duration_s <= bound + 2.5 * SLOW, outcome.summary()
    assert not episode_processes(f"PID_DIR={agents.pids}".encode())


@pytest.mark.parametrize("python", interpreters(PY39))
async def test_a_result_after_cancellation_is_still_a_timeout(agents: Agents, python: str) -> None:
    code = (
        HELPERS
        + """
def run(data):
    try:
        time.sleep(300)
    except KeyboardInterrupt:
        mark("caught")
        return 1.0
"""
    )
    spec = agents.spec(code, timeout=1.0, kill_grace=0.5, python=python)
    outcome = await isolate.run_episode(spec, {})
    assert (agents.pids / "caught").exists()
    assert outcome.status == "timeout", outcome.summary()
    assert outcome.reward is None
    assert outcome.cleanup == "finished"


async def test_an_error_during_clean_up_goes_to_the_log_not_the_status(agents: Agents) -> None:
    code = (
        HELPERS
        + """
def run(data):
    try:
        time.sleep(300)
    finally:
        raise RuntimeError("release failed: sandbox-17")
"""
    )
    spec = agents.spec(code, timeout=1.0, kill_grace=0.5)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert outcome.error is not None
    assert outcome.error.type == "EpisodeTimeout"
    assert outcome.log_path is not None
    assert "release failed: sandbox-17" in outcome.log_path.read_text()


async def test_cancel_grace_zero_is_the_old_teardown(agents: Agents) -> None:
    spec = agents.spec(SYNC_SLEEP, timeout=1.0, kill_grace=0.5, cancel_grace=0)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert not (agents.pids / "cleaned").exists()  # SIGTERM's default action: no finally
    assert outcome.cleanup is None
    assert outcome.signal == "SIGTERM"
    assert "clean-up" not in outcome.summary()


async def test_no_cleanup_value_when_the_agent_was_not_cancelled(agents: Agents) -> None:
    spec = agents.spec("def run(data):\n    return 1.0\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.cleanup is None


async def test_after_its_clean_up_the_cancelled_agent_exits_the_normal_way(agents: Agents) -> None:
    """atexit hooks and unclosed files of a cancelled agent are not lost either."""
    code = (
        HELPERS
        + """
import atexit
def run(data):
    trajectory = open(os.path.join(os.environ["PID_DIR"], "trajectory"), "w")
    trajectory.write("steps so far")  # buffered, never closed
    globals()["kept"] = trajectory
    atexit.register(mark, "atexit", "ran")
    time.sleep(300)
"""
    )
    spec = agents.spec(code, timeout=1.0, kill_grace=0.5)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert outcome.cleanup == "finished"
    assert (agents.pids / "atexit").read_text() == "ran"
    assert (agents.pids / "trajectory").read_text() == "steps so far"


# --- the parent's death and Ctrl-C ------------------------------------------------------------

PARENT = """
import anyio, isolate, sys
spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
anyio.run(isolate.run_episode, spec, {})
"""


@pytest.mark.parametrize(
    ("python", "level"),
    [pytest.param(sys.executable, p.values[0], id=p.id, marks=p.marks) for p in levels()]
    + [pytest.param(PY39, "auto", id="python3.9")],
)
def test_clean_up_runs_after_the_parent_is_killed(agents: Agents, python: str, level: str) -> None:
    code = (
        HELPERS
        + """
def run(data):
    child = subprocess.Popen(["sleep", "300"])
    mark("child", str(child.pid))
    try:
        mark("ready")
        time.sleep(300)
    finally:
        time.sleep(0.1)  # a release that takes a moment
        mark("cleaned", str(child.poll() is None))
"""
    )
    if not os.path.exists(python):
        pytest.skip(f"{python} is not installed")
    spec = agents.spec(
        code, timeout=120.0, kill_grace=1.0, cancel_grace=10.0, python=python, containment=level
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), spec.model_dump_json()]
    )
    try:
        wait_for(lambda: (agents.pids / "ready").exists(), 20.0, "the agent to be ready")
        os.kill(parent.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        parent.wait()
        if "cgroup" in _internals.layers(level):
            # The next isolate to start cleans the dead parent's leaves: not this one, whose
            # shim is still at work.
            groups = _internals.cgroups()
            _internals.clean_stale(r for r in [groups.v2, *groups.v1.values()] if r)
        wait_for(lambda: (agents.pids / "cleaned").exists(), 5.0, "the clean-up")
        assert (agents.pids / "cleaned").read_text() == "True"
        marker = f"PID_DIR={agents.pids}".encode()
        # The child too (its recorded pid is the namespace's at pidns: judge by the env tag).
        wait_for(lambda: not episode_processes(marker), 3.0, "the episode to be gone")
        # The clean-up's 0.1 s, then the old bound of the parent's death (2 s).
        assert time.monotonic() - killed_at <= 0.1 + 2.0 * SLOW
    finally:
        parent.kill()
        parent.wait()
    # Now that the shim is done, the next start removes the dead parent's leaves.
    remove_dead_parents_leaves()


# Runs one episode from a preloaded template, its forks each the episode's worker ("alone", the
# default where episodes have cgroup leaves and a PID namespace) or a shim's supervisor and its
# worker ("pairs", as where they have not).
PARENT_OF_A_TEMPLATE = """
import anyio, isolate, sys
from tests import _internals
spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
async def main():
    if sys.argv[2] == "pairs":
        await isolate.park(spec, 0)  # the template, started
        (template,) = _internals.started_templates()
        template.forks_alone = False
    await isolate.run_episode(spec, {})
anyio.run(main)
"""

# Says in "ready" whether it is a template's fork, and whether it is the fork itself (a fork
# leads a session of its own; a pair's worker is its child).
FORKED = """
def where():
    with open("/proc/self/cmdline", "rb") as f:
        template = b"--template" in f.read()
    return "%s %s" % (template, os.getsid(0) == os.getpid())
"""


def kill_the_parent_of_a_template(
    agents: Agents,
    code: str,
    mode: str,
    grace: float,
    python: str = sys.executable,
    containment: str = "cgroup+pidns",
) -> float:
    """Run ``code`` as a template's episode under a parent process, at ``containment``; once
    it is ready, SIGKILL the parent and wait until no process of the test is left (the
    template's included): the seconds that took."""
    needs(containment)
    spec = agents.spec(
        HELPERS + FORKED + code,
        timeout=120.0,
        kill_grace=1.0,
        cancel_grace=grace,
        containment=containment,
        preload=True,
        python=python,
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT_OF_A_TEMPLATE), spec.model_dump_json(), mode],
        cwd=Path(__file__).resolve().parents[2],  # where ``tests`` is importable
    )
    try:
        wait_for(lambda: (agents.pids / "ready").exists(), 30.0, "the agent to be ready")
        assert (agents.pids / "ready").read_text() == f"True {mode == 'alone'}"
        os.kill(parent.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        parent.wait()
        marker = f"PID_DIR={agents.pids}".encode()
        wait_for(lambda: not episode_processes(marker), grace + 5.0, "the template to be gone")
        took = time.monotonic() - killed_at
    finally:
        parent.kill()
        parent.wait()
    remove_dead_parents_leaves()
    return took


#: How a template's episode is run: its forks ``alone`` or in ``pairs``, its containment (with a
#: PID namespace, or without one: then always pairs) and its Python.
TEMPLATE_RUNS = [
    pytest.param("alone", "cgroup+pidns", sys.executable, id="alone"),
    pytest.param("pairs", "cgroup+pidns", sys.executable, id="pairs"),
    pytest.param("pairs", "cgroup", sys.executable, id="cgroup"),
    pytest.param("pairs", "session", sys.executable, id="session"),
]


@pytest.mark.parametrize(
    ("mode", "containment", "python"),
    [
        *TEMPLATE_RUNS,
        pytest.param(
            "alone",
            "cgroup+pidns",
            PY39,
            id="alone-python3.9",
            marks=pytest.mark.skipif(not os.path.exists(PY39), reason=f"{PY39} is not installed"),
        ),
    ],
)
def test_clean_up_runs_after_the_parent_of_a_template_is_killed(
    agents: Agents, mode: str, containment: str, python: str
) -> None:
    """The template's PID 1 (without a PID namespace, its outer process) cancels its episodes
    and gives them ``cancel_grace`` before it kills what is left."""
    code = """
def run(data):
    child = subprocess.Popen(["sleep", "300"])
    try:
        mark("ready", where())
        time.sleep(300)
    finally:
        time.sleep(0.1)  # a release that takes a moment
        mark("cleaned", str(child.poll() is None))
"""
    took = kill_the_parent_of_a_template(agents, code, mode, 10.0, python, containment)
    assert (agents.pids / "cleaned").read_text() == "True"  # its subprocess still there
    # The clean-up's 0.1 s, then the bound of a fresh episode (2 s), far below cancel_grace.
    assert took <= 0.1 + 2.0 * SLOW


@pytest.mark.parametrize(("mode", "containment", "python"), TEMPLATE_RUNS)
def test_a_template_episode_that_ignores_sigint_ends_after_the_parents_death(
    agents: Agents, mode: str, containment: str, python: str
) -> None:
    """Cut short at ``cancel_grace``: gone by then, plus the margin of the template's outer
    process (1 s) and the teardown's."""
    code = """
def run(data):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mark("ready", where())
    time.sleep(300)
"""
    took = kill_the_parent_of_a_template(agents, code, mode, 2.0, python, containment)
    assert 2.0 <= took <= 2.0 + 1.0 + 1.0 * SLOW


def test_clean_up_runs_at_ctrl_c_of_isolate_run(agents: Agents) -> None:
    spec = agents.spec(ASYNC_SLEEP)
    record = agents.tmp / "record.json"
    record.write_text(json.dumps({"instance_id": "ctrl-c", "econfig": {"env": spec.env}}))
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "LOG_DIR")}
    args = ["--agent-root", str(agents.root), "--entrypoint", spec.entrypoint]
    args += ["--base-url", "http://127.0.0.1:9/v1", "--no-endpoint-check"]
    args += ["--log-dir", str(agents.logs)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "isolate", "run", str(record), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        wait_for(lambda: (agents.pids / "ready").exists(), 20.0, "the agent to be ready")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20 * SLOW)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert (agents.pids / "cleaned").read_text() == "async"
    logs = list(Path(agents.logs).rglob("*.log"))
    assert any("clean-up finished" in p.read_text() for p in logs), logs
