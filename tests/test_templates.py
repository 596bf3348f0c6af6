"""Preloaded templates (``EpisodeSpec.preload``): what a fork shares, and a template's life.

Everything ``run_episode`` promises with a fresh start is also run with ``preload=True`` by the
suites that use ``@both_starts``; these tests are about the template itself."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import psutil
import pytest

import isolate
from isolate._cli.batch.job import RecordPlan
from isolate._cli.main import build_parser
from isolate._cli.main import main as cli_main
from isolate.workflow import SWEAgentWorkflow, episode_spec

from . import _internals
from .conftest import (
    SLOW,
    Agents,
    episode_processes,
    is_gone,
    own_zombies,
    remove_dead_parents_leaves,
    wait_for,
    wait_until,
)
from .test_cli import URL, cli_env, isolate_cli

pytestmark = pytest.mark.anyio

PY39 = Path.home() / ".pyenv/versions/3.9.18/bin/python3.9"


def template_processes(agents: Agents, parent: int | None = None) -> list[psutil.Process]:
    """The live importers of this test's templates (the processes holding the agent's code),
    started by ``parent`` (default: this process). A template is three processes in one
    session: the parent's child, with a PID namespace its PID 1, and the importer; its forks
    have sessions of their own."""
    procs = []
    for proc in episode_processes(f"PID_DIR={agents.pids}".encode()):
        try:
            if "--template" in proc.cmdline():
                procs.append((proc, proc.ppid(), os.getsid(proc.pid)))
        except (psutil.Error, OSError):
            continue
    outers = {proc.pid for proc, ppid, _ in procs if ppid == (parent or os.getpid())}
    inits = {proc.pid for proc, _, _ in procs if _is_namespace_init(proc.pid)}
    # The importer's parent is the outer process or PID 1; a fork's, before it has a session
    # of its own, is the importer.
    return [
        proc
        for proc, ppid, sid in procs
        if sid in outers and proc.pid not in outers | inits and ppid in outers | inits
    ]


def _is_namespace_init(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("NSpid:") and line.split()[-1] == "1" for line in f)
    except OSError:
        return False


COUNTING = """
import os, time
with open(os.path.join(os.environ["PID_DIR"], "imports"), "a") as f:
    f.write("%d\\n" % os.getpid())
time.sleep(0.3)  # a slow import, as a real agent's
"""


def imports(agents: Agents) -> int:
    path = agents.pids / "imports"
    return len(path.read_text().split()) if path.exists() else 0


async def test_a_module_level_mutation_is_invisible_to_the_next_episode(agents: Agents) -> None:
    spec = agents.spec(
        """
        import os
        SEEN = []
        def run(data):
            SEEN.append(data["i"])
            return float(len(SEEN)), {"seen": SEEN}
        """,
        preload=True,
    )
    outcomes = [await isolate.run_episode(spec, {"i": i}) for i in range(3)]
    assert [o.start for o in outcomes] == ["template"] * 3
    assert [o.reward for o in outcomes] == [1.0, 1.0, 1.0]
    assert [o.info["seen"] for o in outcomes] == [[0], [1], [2]]


async def test_two_episodes_draw_different_random_values(agents: Agents) -> None:
    spec = agents.spec(
        """
        import random
        AT_IMPORT = random.random()  # drawn once, in the template
        def run(data):
            return 1.0, {"draw": random.random(), "at_import": AT_IMPORT}
        """,
        preload=True,
    )
    outcomes: list[isolate.EpisodeOutcome] = []

    async def one() -> None:
        outcomes.append(await isolate.run_episode(spec, {}))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    assert [o.start for o in outcomes] == ["template"] * 4
    assert len({o.info["draw"] for o in outcomes}) == 4  # reseeded in each fork
    assert len({o.info["at_import"] for o in outcomes}) == 1  # the module was imported once


async def test_concurrent_first_episodes_import_the_agent_once(agents: Agents) -> None:
    spec = agents.spec(COUNTING + "def run(data):\n    return data['i']\n", preload=True)
    outcomes: dict[int, isolate.EpisodeOutcome] = {}

    async def one(i: int) -> None:
        outcomes[i] = await isolate.run_episode(spec, {"i": i})

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    assert {i: (o.status, o.reward, o.start) for i, o in outcomes.items()} == {
        i: ("ok", float(i), "template") for i in range(8)
    }
    assert imports(agents) == 1
    assert len(template_processes(agents)) == 1


async def test_a_template_killed_mid_run_is_replaced(agents: Agents) -> None:
    """The episode in flight ends as it would have; the next one gets a new template."""
    spec = agents.spec(
        COUNTING
        + """
def run(data):
    open(os.path.join(os.environ["PID_DIR"], "running"), "w").close()
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "go")):
        time.sleep(0.01)
    return 7.0
""",
        preload=True,
    )
    result: list[isolate.EpisodeOutcome] = []

    async def kill_template_then_release() -> None:
        await wait_until((agents.pids / "running").exists)
        (template,) = template_processes(agents)
        template.kill()
        await anyio.to_thread.run_sync(lambda: wait_for(lambda: is_gone(template.pid)))
        (agents.pids / "go").touch()

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_template_then_release)
        result.append(await isolate.run_episode(spec, {}))
    (first,) = result
    assert (first.status, first.reward, first.start) == ("ok", 7.0, "template"), first.summary()
    # The fork is the agent's own process and the importer its parent, dead before it could
    # report the exit status: PID 1 of the template's namespace reaped the fork and said it.
    assert first.exit_code == 0

    second = await isolate.run_episode(spec, {})
    assert (second.status, second.reward, second.start) == ("ok", 7.0, "template")
    assert "killed by SIGKILL; starting a new one (restart 1)" in second.stderr_tail
    assert imports(agents) == 2
    assert len(template_processes(agents)) == 1


async def test_a_template_killed_between_episodes_is_replaced(agents: Agents) -> None:
    spec = agents.spec(COUNTING + "def run(data):\n    return 1.0\n", preload=True)
    first = await isolate.run_episode(spec, {})
    assert first.start == "template"
    for proc in template_processes(agents):
        proc.send_signal(signal.SIGSEGV)
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: not template_processes(agents)))
    second = await isolate.run_episode(spec, {})
    # A fresh start says why in the tail (a replacement refused, say): shown if it fails.
    said = f"{second.summary()}\n{second.stderr_tail}"
    assert (second.status, second.start) == ("ok", "template"), said
    assert "killed by SIGSEGV; starting a new one (restart 1)" in second.stderr_tail, said


THREAD_AT_IMPORT = """
import threading, time
threading.Thread(target=time.sleep, args=(60,), name="cost-map-retry", daemon=True).start()
def run(data):
    return 1.0
"""


async def test_a_thread_running_after_import_means_a_fresh_start_with_the_reason(
    agents: Agents,
) -> None:
    spec = agents.spec(THREAD_AT_IMPORT, preload=True)
    reason = "preload refused: thread 'cost-map-retry' running after import"
    for _ in range(2):  # refused once, for every episode of the spec
        outcome = await isolate.run_episode(spec, {})
        assert (outcome.status, outcome.start) == ("ok", "fresh"), outcome.summary()
        assert reason in outcome.stderr_tail
        assert outcome.log_path is not None
        assert reason in outcome.log_path.read_text()
    assert template_processes(agents) == []


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("import socket\nKEPT = socket.socket()\n", "socket open after import"),
        ("raise ImportError('no such thing')\n", "cannot import"),
    ],
    ids=["socket", "unimportable"],
)
async def test_an_unusable_template_means_a_fresh_start(
    agents: Agents, code: str, reason: str
) -> None:
    spec = agents.spec(code + "def run(data):\n    return 1.0\n", preload=True)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.start == "fresh"
    assert f"preload refused: {reason}" in outcome.stderr_tail
    if "raise" in code:  # the fresh start says what a fresh start says
        assert outcome.status == "setup_error"
        assert outcome.error is not None
        assert "no such thing" in outcome.error.message
    else:
        assert outcome.status == "ok", outcome.summary()


async def test_the_preload_list_is_imported_once_in_the_template(agents: Agents) -> None:
    (agents.root / "extra.py").write_text(COUNTING)
    spec = agents.spec(
        "import sys\ndef run(data):\n    return 1.0, 'extra' in sys.modules\n",
        preload=("extra", "json"),
    )
    outcomes = [await isolate.run_episode(spec, {}) for _ in range(2)]
    assert [(o.start, o.info) for o in outcomes] == [("template", True)] * 2
    assert imports(agents) == 1


async def test_close_templates_leaves_no_template_and_episodes_run_on(agents: Agents) -> None:
    spec = agents.spec(
        """
        import os, time
        def run(data):
            open(os.path.join(os.environ["PID_DIR"], "running"), "w").close()
            while not os.path.exists(os.path.join(os.environ["PID_DIR"], "go")):
                time.sleep(0.01)
            return 2.0
        """,
        preload=True,
    )
    result: list[isolate.EpisodeOutcome] = []
    outers: list[subprocess.Popen[bytes]] = []

    async def close_then_release() -> None:
        await wait_until((agents.pids / "running").exists)
        templates = template_processes(agents)
        assert len(templates) == 1
        outers.extend(t.popen for t in _internals.started_templates())
        await isolate.close_templates()
        assert all(is_gone(p.pid, p.create_time()) for p in templates)
        (agents.pids / "go").touch()

    async with anyio.create_task_group() as tg:
        tg.start_soon(close_then_release)
        result.append(await isolate.run_episode(spec, {}))
    assert (result[0].status, result[0].reward) == ("ok", 2.0), result[0].summary()
    assert template_processes(agents) == []
    assert _internals.started_templates() == []
    # The last fork's end finishes the closed template in a thread of its own: its outer
    # process is killed and reaped there, soon after (no zombie of it is left either way).
    assert len(outers) == 1
    await wait_until(lambda: outers[0].returncode is not None, 5.0)
    assert own_zombies() == []


DAEMON_AGENT = """
import os, time
def run(data):
    if os.fork() == 0:  # a daemon: its parent exits, so it is re-parented above the episode
        if os.fork() == 0:
            with open(os.path.join(os.environ["PID_DIR"], "daemon"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(300)
        os._exit(0)
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "daemon")):
        time.sleep(0.01)
    daemon = int(open(os.path.join(os.environ["PID_DIR"], "daemon")).read())
    open(os.path.join(os.environ["PID_DIR"], "running"), "w").close()
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "go")):
        time.sleep(0.01)
    try:
        os.kill(daemon, 0)
    except ProcessLookupError:
        return 0.0
    return 1.0
"""


async def test_closing_a_template_spares_what_its_running_episodes_started(
    agents: Agents,
) -> None:
    """Closing kills what the template's import left, not the episodes' own processes: a
    daemon an episode double-forked (re-parented to the importer, where a fork is its own
    worker) lives until its episode ends, then goes with its leaf."""
    spec = agents.spec(DAEMON_AGENT, preload=True)
    result: list[isolate.EpisodeOutcome] = []

    async def close_then_release() -> None:
        await wait_until((agents.pids / "running").exists)
        await isolate.close_templates()
        (agents.pids / "go").touch()

    async with anyio.create_task_group() as tg:
        tg.start_soon(close_then_release)
        result.append(await isolate.run_episode(spec, {}))
    (outcome,) = result
    assert (outcome.status, outcome.reward) == ("ok", 1.0), outcome.summary()
    assert outcome.killed >= 1  # the daemon, by the episode's sweep
    # Its importer, its parent, killed by the close: PID 1 reaped it and said how it ended.
    assert outcome.exit_code == 0
    assert agents.left() == []


PARENT = """
import anyio, isolate, sys
spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
anyio.run(isolate.run_episode, spec, {})
"""


def test_the_parents_death_takes_template_and_episode_with_it(agents: Agents) -> None:
    spec = agents.spec(
        """
        import os, time
        def run(data):
            open(os.path.join(os.environ["PID_DIR"], "running"), "w").close()
            time.sleep(300)
        """,
        preload=True,
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT), spec.model_dump_json()]
    )
    try:
        wait_for(lambda: (agents.pids / "running").exists(), 20.0, "the episode to run")
        seen = episode_processes(f"PID_DIR={agents.pids}".encode())
        assert len(template_processes(agents, parent.pid)) == 1
        assert len(seen) >= 3  # the template, the supervisor, the worker
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: all(is_gone(p.pid, p.create_time()) for p in seen), 3.0, "all to die")
    finally:
        parent.kill()
        parent.wait()
    # The dead parent's cgroup leaves stay until an isolate process starts and removes them.
    remove_dead_parents_leaves()


async def test_a_template_under_python_3_9(agents: Agents) -> None:
    if not PY39.exists():
        pytest.skip(f"no Python 3.9 at {PY39}")
    spec = agents.spec(
        "import sys\ndef run(data):\n    return 1.0, sys.version_info[:2]\n",
        python=str(PY39),
        preload=True,
    )
    outcomes = [await isolate.run_episode(spec, {}) for _ in range(2)]
    assert [(o.status, o.start, o.info) for o in outcomes] == [("ok", "template", [3, 9])] * 2


async def test_the_template_has_a_cgroup_leaf_of_its_own(agents: Agents) -> None:
    problem = _internals.layer_problem("cgroup")
    if problem is not None:
        pytest.skip(f"containment 'cgroup' is not available here: {problem}")
    spec = agents.spec(
        "import os\ndef run(data):\n    return 1.0, open('/proc/self/cgroup').read()\n",
        containment="cgroup",
        preload=True,
    )
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start, outcome.killed) == ("ok", "template", 0)
    (template,) = template_processes(agents)
    leaf = await anyio.Path(f"/proc/{template.pid}/cgroup").read_text()
    assert "/template." in leaf
    assert outcome.episode_id in outcome.info  # the episode ran in its own leaf
    assert "/template." not in outcome.info


async def test_the_template_log_keeps_what_the_agent_printed_at_import(agents: Agents) -> None:
    spec = agents.spec("print('loading the agent')\ndef run(data):\n    return 1.0\n", preload=True)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.start == "template"
    (log,) = agents.logs.glob("template.*.log")
    assert "loading the agent" in log.read_text()
    assert "loading the agent" not in outcome.stderr_tail  # the episode's log is its own


async def test_waiting_for_a_template_counts_in_the_timeout(agents: Agents) -> None:
    spec = agents.spec(
        "import time\ntime.sleep(30)\ndef run(data):\n    return 1.0\n",
        preload=True,
        timeout=0.5,
    )
    started = time.monotonic()
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout"
    assert time.monotonic() - started < 0.5 + 2.0 * SLOW
    assert template_processes(agents) == []  # the half-started template is gone


async def test_close_templates_while_one_is_importing(agents: Agents) -> None:
    spec = agents.spec(
        """
        import sys, time
        if "--template" in sys.argv:
            time.sleep(60)  # only the template's import hangs
        def run(data):
            return 1.0
        """,
        preload=True,
    )
    result: list[isolate.EpisodeOutcome] = []

    async def one() -> None:
        result.append(await isolate.run_episode(spec, {}))

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        await wait_until(lambda: bool(template_processes(agents)))
        started = time.monotonic()
        await isolate.close_templates()
        assert time.monotonic() - started < 1.0 * SLOW
        assert template_processes(agents) == []
    (outcome,) = result
    assert (outcome.status, outcome.start) == ("ok", "fresh"), outcome.summary()
    assert "preload refused" in outcome.stderr_tail


async def test_a_template_counts_in_the_fd_budget(agents: Agents) -> None:
    spec = agents.spec("def run(data):\n    return 1.0\n", preload=True)
    budget = _internals.fd_budget()
    before = budget.used
    outcome = await isolate.run_episode(spec, {})
    assert outcome.start == "template"
    # Its control and life sockets and its pidfd, while it runs; and those of the one fork its
    # pool parks, sized from that episode.
    parked = _internals.template_pool.PARKED_FDS
    assert budget.used == before + 3 + parked
    await isolate.close_templates()
    assert budget.used == before


# --- where preload is set: econfig, the command line, and what doctor says ---------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, False), (True, True), (False, False), (["litellm", "json"], ("litellm", "json"))],
)
def test_econfig_preload(tmp_path: Path, value: object, expected: object) -> None:
    econfig = {} if value is None else {"preload": value}
    assert episode_spec(econfig, tmp_path, 10.0, None).preload == expected


def test_econfig_preload_must_be_a_bool_or_a_list(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="econfig.preload must be a bool or a list"):
        episode_spec({"preload": "yes"}, tmp_path, 10.0, None)


@pytest.mark.parametrize("flag", [[], ["--preload"]])
def test_the_preload_flag_reaches_the_spec(tmp_path: Path, flag: list[str]) -> None:
    argv = ["run", "r.json", "--agent-root", str(tmp_path), "--base-url", "http://x", *flag]
    spec, _ = RecordPlan(build_parser().parse_args(argv)).build({"instance_id": "x"})
    assert spec.preload is bool(flag)


def drop_in_agent(agents: Agents, lifecycle: str) -> None:
    """``aweagent.lifecycle`` (the drop-in's entrypoint package) in the agent root, with
    ``lifecycle`` as its source."""
    package = agents.root / "aweagent"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "lifecycle.py").write_text(lifecycle)


def test_doctor_preload_names_the_thread_and_the_fix(
    agents: Agents, capsys: pytest.CaptureFixture[str]
) -> None:
    drop_in_agent(
        agents,
        THREAD_AT_IMPORT.replace("cost-map-retry", "litellm-model-cost-map-retry")
        + "def run_agent_with_reward(data, **kw):\n    return 1.0\n",
    )
    assert cli_main(["doctor", "--agent-root", str(agents.root), "--preload"]) == 1
    out = capsys.readouterr().out
    reason = "preload refused: thread 'litellm-model-cost-map-retry' running after import"
    assert reason in out
    assert "LITELLM_LOCAL_MODEL_COST_MAP=True" in out


def test_doctor_preload_on_a_forkable_agent(
    agents: Agents, capsys: pytest.CaptureFixture[str]
) -> None:
    drop_in_agent(
        agents,
        "def run_agent_with_reward(data, **kw):\n    return 1.0\n",
    )
    assert cli_main(["doctor", "--agent-root", str(agents.root), "--preload"]) == 0
    out = capsys.readouterr().out
    assert "a preloaded template imports it in" in out
    # What its forks share, as this machine builds them (root, with a PID namespace, here).
    own = "each has user, IPC, UTS and mount namespaces, and a /dev/shm, of its own"
    if os.geteuid() == 0 and _internals.layer_problem("pidns") is None:
        assert own in out


# --- a refused template, said where users look ------------------------------------------------

LITELLM_LIKE = THREAD_AT_IMPORT.replace("cost-map-retry", "litellm-model-cost-map-retry")
LITELLM_REASON = "thread 'litellm-model-cost-map-retry' running after import"


def refusing_agent(agents: Agents) -> None:
    """aweagent.lifecycle (the drop-in's entrypoint) and agent_refused:run, both refused."""
    drop_in_agent(
        agents,
        LITELLM_LIKE + "def run_agent_with_reward(data, **kw):\n    return 1.0\n",
    )
    (agents.root / "agent_refused.py").write_text(
        LITELLM_LIKE.replace("def run(data)", "def run(data, **kw)")
    )


def refused_preload_args(agents: Agents) -> list[str]:
    """What run and batch share: the refusing agent, with --preload."""
    return [
        "--agent-root",
        str(agents.root),
        "--entrypoint",
        "agent_refused:run",
        "--base-url",
        URL,
        "--no-endpoint-check",  # URL is a closed port: this agent never calls it
        "--preload",
        "--log-dir",
        str(agents.logs),
    ]


async def test_the_outcome_says_why_preload_gave_no_template(agents: Agents) -> None:
    spec = agents.spec(THREAD_AT_IMPORT, preload=True)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.preload_refused == "thread 'cost-map-retry' running after import"
    used = await isolate.run_episode(
        agents.spec("def run(data):\n    return 1.0\n", preload=True), {}
    )
    assert (used.start, used.preload_refused) == ("template", None)
    fresh = await isolate.run_episode(agents.spec("def run(data):\n    return 1.0\n"), {})
    assert (fresh.start, fresh.preload_refused) == ("fresh", None)  # preload never asked


def test_run_says_once_why_preload_gave_no_template(agents: Agents) -> None:
    refusing_agent(agents)
    record = agents.tmp / "r.json"
    record.write_text(
        json.dumps({"instance_id": "r-1", "econfig": {"env": {"PID_DIR": str(agents.pids)}}})
    )
    done = isolate_cli("run", str(record), *refused_preload_args(agents))
    assert done.returncode == 0, done.stderr
    warnings = [ln for ln in done.stderr.splitlines() if "--preload gave no template" in ln]
    assert warnings == [
        f"isolate: warning: --preload gave no template ({LITELLM_REASON}); episodes start fresh. "
        "Litellm starts that thread at import unless LITELLM_LOCAL_MODEL_COST_MAP=True is in "
        "the agent's environment (econfig env, EpisodeSpec.env)"
    ]
    assert json.loads(done.stdout)["preload_refused"] == LITELLM_REASON


def test_batch_says_once_why_preload_gave_no_template_and_counts_starts(agents: Agents) -> None:
    refusing_agent(agents)
    records = agents.tmp / "records.jsonl"
    econfig = {"env": {"PID_DIR": str(agents.pids)}}
    records.write_text(
        "".join(json.dumps({"instance_id": f"b-{i}", "econfig": econfig}) + "\n" for i in range(3))
    )
    out = agents.tmp / "results.jsonl"
    done = isolate_cli(
        "batch",
        str(records),
        "--out",
        str(out),
        *refused_preload_args(agents),
        "--api-key-env",
        "BATCH_KEY",
        env=cli_env(BATCH_KEY="sk-batch-preload"),
    )
    assert done.returncode == 0, done.stderr
    warnings = [ln for ln in done.stderr.splitlines() if "--preload gave no template" in ln]
    assert len(warnings) == 1, done.stderr
    assert LITELLM_REASON in warnings[0]
    assert f"start        template 0, fresh 3 ({LITELLM_REASON}: 3)" in done.stdout + done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(e["start"], e["preload_refused"]) for e in lines] == [("fresh", LITELLM_REASON)] * 3


async def test_the_workflow_warns_once_why_preload_gave_no_template(
    agents: Agents, caplog: pytest.LogCaptureFixture
) -> None:
    refusing_agent(agents)
    econfig = {
        "agent_root": str(agents.root),
        "preload": True,
        "env": {"PID_DIR": str(agents.pids)},
    }
    wf = SWEAgentWorkflow(econfig=econfig, timeout=30)
    with caplog.at_level("WARNING", logger="AReaL-SWEAgent"):
        for i in range(2):
            assert await wf.run({"instance_id": f"w-{i}"}, base_url=URL) == 1.0
    warnings = [r.getMessage() for r in caplog.records if "gave no template" in r.getMessage()]
    assert len(warnings) == 1
    assert LITELLM_REASON in warnings[0]
    assert "LITELLM_LOCAL_MODEL_COST_MAP=True" in warnings[0]


DAEMON_AT_IMPORT = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(os.path.join(os.environ["PID_DIR"], "daemon"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)
    os._exit(0)
os.wait()
def run(data):
    return 1.0
"""


async def test_a_process_the_import_started_means_a_fresh_start_and_is_killed(
    agents: Agents,
) -> None:
    spec = agents.spec(DAEMON_AT_IMPORT, preload=True)
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "fresh"), outcome.summary()
    assert outcome.preload_refused is not None
    assert re.fullmatch(
        r"process \d+ \(python3?[\d.]*\) running after import: it would outlive its episodes",
        outcome.preload_refused,
    ), outcome.preload_refused
    # The fresh start ran the import too, and its episode's teardown took that daemon; the
    # template's was killed at the refusal. Two daemons were started, none is left.
    await wait_until(lambda: (agents.pids / "daemon").exists())
    await anyio.to_thread.run_sync(lambda: wait_for(lambda: not agents.left(), 5.0, "no daemon"))
    await isolate.close_templates()
    assert template_processes(agents) == []


async def test_close_templates_kills_what_is_left_in_the_templates_session(
    agents: Agents,
) -> None:
    # The agent's code can still run in the template after the fork-safety check (here a
    # signal handler its import installed): what it starts there is killed with the template.
    code = (
        "import os, signal, subprocess, sys\n"
        "def later(*_):\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "signal.signal(signal.SIGUSR1, later)\n"
        "def run(data):\n    return 1.0\n"
    )
    spec = agents.spec(code, preload=True)
    first = await isolate.run_episode(spec, {})
    assert (first.status, first.start) == ("ok", "template"), first.summary()
    (template,) = _internals.started_templates()
    os.kill(template.pid, signal.SIGUSR1)  # the agent's code runs in the template, late
    await anyio.to_thread.run_sync(
        lambda: wait_for(lambda: psutil.Process(template.pid).children(), 5.0, "the leftover")
    )
    leftover = psutil.Process(template.pid).children()[0]
    await isolate.close_templates()
    assert is_gone(leftover.pid, leftover.create_time())
    assert template_processes(agents) == []


TEMP_AGENT = """
import os, tempfile
AT_IMPORT = tempfile.gettempdir()  # cached by tempfile, in the template: the first episode's
def run(data):
    path = os.path.join(tempfile.gettempdir(), "mine")
    with open(path, "w") as f:
        f.write("x")
    return 1.0, {"env": os.environ["TMPDIR"], "tempfile": tempfile.gettempdir()}
"""


@pytest.mark.skipif(not _internals.landlock_abi(), reason="the sandbox needs Landlock")
async def test_sandboxed_episodes_of_one_agent_share_one_template(agents: Agents) -> None:
    spec = agents.spec(TEMP_AGENT, preload=True, sandbox=isolate.Sandbox())
    outcomes = [await isolate.run_episode(spec, {}) for _ in range(5)]
    for outcome in outcomes:
        assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
        assert outcome.info["env"] == outcome.info["tempfile"]  # its own, not the template's
    assert len({o.info["env"] for o in outcomes}) == 5
    assert len(_internals.started_templates()) == 1
    # Each removed at its teardown.
    left = await anyio.to_thread.run_sync(
        lambda: [o for o in outcomes if Path(o.info["env"]).exists()]
    )
    assert left == []


READER = """
import os
def run(data):
    out = {}
    for name, call in (("read", lambda: open(data["file"]).read()),
                       ("listing", lambda: os.listdir(data["dir"]))):
        try:
            out[name] = call()
        except OSError as exc:
            out[name] = "denied: %s" % exc.strerror
    return 1.0, out
"""


@pytest.mark.skipif(not _internals.landlock_abi(), reason="the sandbox needs Landlock")
async def test_specs_that_differ_only_in_what_they_hide_do_not_share_a_template(
    agents: Agents, tmp_path: Path
) -> None:
    """The sandbox is part of a template's key: an episode of the spec that hides a directory
    runs from a template of its own, not from the one built for the spec that does not."""
    private = tmp_path / "private"
    private.mkdir()
    (private / "key.txt").write_text("SECRET-1d2c")
    data = {"file": str(private / "key.txt"), "dir": str(private)}
    plain = agents.spec(READER, preload=True, sandbox=isolate.Sandbox())
    hiding = plain.model_copy(update={"sandbox": isolate.Sandbox(hide=[str(private)])})
    first = await isolate.run_episode(plain, data)
    assert (first.status, first.start) == ("ok", "template"), first.summary()
    assert first.info == {"read": "SECRET-1d2c", "listing": ["key.txt"]}
    second = await isolate.run_episode(hiding, data)
    assert (second.status, second.start) == ("ok", "template"), second.summary()
    assert "SECRET" not in str(second.info)
    assert second.info["listing"] in ([], "denied: Permission denied"), second.info
    assert len(_internals.started_templates()) == 2
    # And the other way round: the plain spec still reads from its own template.
    again = await isolate.run_episode(plain, data)
    assert again.info == first.info
    assert len(_internals.started_templates()) == 2


@pytest.mark.skipif(not _internals.landlock_abi(), reason="the sandbox needs Landlock")
async def test_a_fork_whose_set_up_fails_says_it_began_from_the_template(agents: Agents) -> None:
    """A fork that cannot be set up (its sandbox's TMPDIR goes in its template's, removed
    here) ends as a set-up error that says it was forked: no ``start == "fresh"`` with no
    reason while the template runs."""
    spec = agents.spec(TEMP_AGENT, preload=True, sandbox=isolate.Sandbox())
    first = await isolate.run_episode(spec, {})
    assert (first.status, first.start) == ("ok", "template"), first.summary()
    (template,) = _internals.started_templates()
    assert template.wall.sandbox is not None
    await anyio.to_thread.run_sync(_internals.remove_tmpdir, template.wall.sandbox.tmpdir)
    assert not await anyio.to_thread.run_sync(os.path.exists, template.wall.sandbox.tmpdir)
    second = await isolate.run_episode(spec, {})
    assert (second.status, second.start) == ("setup_error", "template"), second.summary()
    assert second.error is not None
    assert "cannot make the fork's sandbox" in second.error.message
    assert second.preload_refused is None
    assert template.alive()


WAITING_AGENT = """
import os, time
def run(data):
    if "go" in data:
        open(data["started"], "w").close()
        for _ in range(6000):
            if os.path.exists(data["go"]):
                break
            time.sleep(0.01)
    return 1.0
"""


def fresh_after_no_fork(outcomes: list[isolate.EpisodeOutcome]) -> isolate.EpisodeOutcome:
    """The one outcome of ``outcomes``, ``ok`` and started fresh, saying that its template did
    not answer within 0.2 s (``slow_to_fork``)."""
    (outcome,) = outcomes
    assert (outcome.status, outcome.start) == ("ok", "fresh"), outcome.summary()
    assert outcome.preload_refused is not None
    assert "did not fork (no answer within 0.2 s)" in outcome.preload_refused
    return outcome


async def slow_to_fork(
    spec: isolate.EpisodeSpec, monkeypatch: pytest.MonkeyPatch
) -> psutil.Process:
    """The importer of ``spec``'s template, started by a first episode (``ok``), with the
    parent's wait for a fork cut to 0.2 s: suspended, it answers no fork request in time. No
    fork is parked ahead (``park(spec, 0)``): each episode asks for its own."""
    await isolate.park(spec, 0)
    first = await isolate.run_episode(spec, {})
    assert (first.status, first.start) == ("ok", "template"), first.summary()
    (template,) = _internals.started_templates()
    monkeypatch.setattr(_internals.template_process, "_FORK_TIMEOUT_S", 0.2)
    return psutil.Process(template.pid)


async def test_a_fork_that_comes_too_late_gets_no_channel_of_the_fresh_start(
    agents: Agents, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A template that does not answer a fork request in time: the episode starts fresh and
    says why; the fork the template makes once it goes on holds no end of the fresh shim's
    channel (it would read what the parent sends that shim, a cancel request say): it gets
    EOF and ends while the episode still runs."""
    spec = agents.spec(WAITING_AGENT, preload=True)
    importer = await slow_to_fork(spec, monkeypatch)
    (template,) = _internals.started_templates()
    started, go = tmp_path / "started", tmp_path / "go"
    data = {"started": str(started), "go": str(go)}
    outcomes: list[isolate.EpisodeOutcome] = []

    async def second() -> None:
        outcomes.append(await isolate.run_episode(spec, data))

    importer.suspend()  # SIGSTOP: it answers no fork request
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            # The fresh shim has read its handshake once its agent runs.
            await anyio.to_thread.run_sync(wait_for, started.exists, 30.0, "the fresh episode")
            importer.resume()
            monkeypatch.undo()
            # The template answers in turn: once this one is forked, so was the late one.
            third = await isolate.run_episode(spec, {})
            assert (third.status, third.start) == ("ok", "template"), third.summary()
            await anyio.to_thread.run_sync(
                wait_for, lambda: all(map(_gone, importer.children())), 10.0, "the late fork"
            )
            await anyio.to_thread.run_sync(go.touch)
    finally:
        importer.resume()
    outcome = fresh_after_no_fork(outcomes)
    assert template.alive()
    assert outcome.log_path is not None
    log = await anyio.to_thread.run_sync(Path(outcome.log_path).read_text)
    assert "did not fork (no answer within 0.2 s); this episode starts fresh" in log


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
