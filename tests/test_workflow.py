"""The AReaL drop-in matches the in-process seed row by row, and adds isolation."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import isolate
from isolate.workflow import (
    PASSTHROUGH_ENV,
    SWEAgentWorkflow,
    default_agent_root,
    episode_spec,
    sandbox_of,
)

from . import _internals
from .conftest import SLOW, Agents, record_pid_sh

pytestmark = pytest.mark.anyio

SCRIPTED = Path(__file__).resolve().parents[1] / "examples" / "scripted_agent"
ENV_NAMES = (
    "AWEAGENT_ROOT",
    "SWE_AGENT_ROOT",
    "SWEAGENT_ROOT",
    "LLM_MODEL",
    "OPENCODE_PROVIDER",
    "CODEX_PROVIDER",
    "OPENAI_API_KEY",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every test starts without the workflow's env variables, and with LOG_DIR in tmp_path."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOG_DIR", str(tmp_path / "logs"))
    return tmp_path / "logs"


def econfig(agents: Agents, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "agent_root": str(SCRIPTED),
        "kill_grace": 0.5,
        "env": {"PID_DIR": str(agents.pids)},
    }
    base.update(extra)
    return base


def record(instance_id: str = "repo__issue-1", **behaviour: Any) -> dict[str, Any]:
    return {"instance_id": instance_id, "problem_statement": "fix it", "behaviour": behaviour}


def report(logs: Path, instance_id: str = "repo__issue-1") -> dict[str, Any]:
    """What the scripted agent received (it writes this into result_dir)."""
    data: dict[str, Any] = json.loads((logs / f"{instance_id}.json").read_text())
    return data


URL = "http://127.0.0.1:9/v1"


# --- 1. timeout -------------------------------------------------------------------------------


def test_econfig_timeout_overrides_the_argument() -> None:
    assert SWEAgentWorkflow(econfig={"agent_root": str(SCRIPTED)}, timeout=12).timeout == 12
    wf = SWEAgentWorkflow(econfig={"agent_root": str(SCRIPTED), "timeout": 7}, timeout=12)
    assert wf.timeout == 7


# --- 2. agent root ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "env", "expected"),
    [
        (
            {"agent_root": "a", "aweagent_root": "b", "swe_agent_root": "c"},
            {"AWEAGENT_ROOT": "d"},
            "a",
        ),
        ({"aweagent_root": "b", "swe_agent_root": "c"}, {"AWEAGENT_ROOT": "d"}, "b"),
        ({"swe_agent_root": "c"}, {"AWEAGENT_ROOT": "d"}, "c"),
        ({}, {"AWEAGENT_ROOT": "d", "SWE_AGENT_ROOT": "e", "SWEAGENT_ROOT": "f"}, "d"),
        ({}, {"SWE_AGENT_ROOT": "e", "SWEAGENT_ROOT": "f"}, "e"),
        ({}, {"SWEAGENT_ROOT": "f"}, "f"),
    ],
)
def test_agent_root_resolution_order(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    keys: dict[str, str],
    env: dict[str, str],
    expected: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    wf = SWEAgentWorkflow(econfig={k: str(tmp_path / v) for k, v in keys.items()})
    assert wf.agent_root == tmp_path / expected


def test_agent_root_defaults_to_the_sibling_checkout() -> None:
    wf = SWEAgentWorkflow()
    assert wf.agent_root == default_agent_root()
    assert wf.agent_root.name == "AReaL-SWEAgent"
    assert wf.agent_root.parent == Path(isolate.__file__).resolve().parent.parent.parent


def test_missing_agent_root_warns_at_construction(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="AReaL-SWEAgent"):
        SWEAgentWorkflow(econfig={"agent_root": str(tmp_path / "missing")})
    text = caplog.text
    assert str(tmp_path / "missing") in text
    for way in ("econfig.agent_root", "AWEAGENT_ROOT", "AReaL-SWEAgent at"):
        assert way in text


async def test_agent_root_reaches_the_child_not_the_parent_sys_path(
    agents: Agents, clean_env: Path
) -> None:
    before = list(sys.path)
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    assert await wf.run(record(report=True), base_url=URL) == 1.0
    assert sys.path == before
    assert "aweagent" not in sys.modules


# --- 3, 4, 5. agent type, config, model and providers ---------------------------------------


@pytest.mark.parametrize(
    ("settings", "agent_type", "agent_config"),
    [
        ({}, "swe", "1_0_0/min-swe-agent-train-top1"),
        ({"agent_type": "  CC "}, "cc", "train_cc_time3600"),
        ({"agent_type": "oh"}, "oh", "eval_oh"),
        ({"agent_type": "opencode"}, "opencode", "eval_opencode"),
        ({"agent_type": "codex"}, "codex", "eval_codex"),
        ({"agent_type": "mine"}, "mine", "mine"),
        ({"agent_type": "mine", "swe_agent_config": "s"}, "mine", "s"),
        ({"agent_type": "cc", "cc_agent_config": "c", "swe_agent_config": "s"}, "cc", "c"),
        ({"agent_type": "cc", "agent_config": "a", "cc_agent_config": "c"}, "cc", "a"),
    ],
)
async def test_agent_type_and_config(
    agents: Agents, clean_env: Path, settings: dict[str, str], agent_type: str, agent_config: str
) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents, **settings))
    await wf.run(record(report=True), base_url=URL)
    kwargs = report(clean_env)["kwargs"]
    assert kwargs["agent_type"] == agent_type
    assert kwargs["agent_config"] == agent_config


async def test_empty_agent_type_is_a_value_error_in_run(agents: Agents, clean_env: Path) -> None:
    # As the seed: checked in run, on the econfig merged with the record's own.
    wf = SWEAgentWorkflow(econfig=econfig(agents, agent_type="   "))  # no raise here
    with pytest.raises(ValueError, match="agent_type must not be empty"):
        await wf.run(record(), base_url=URL)
    valid = SWEAgentWorkflow(econfig=econfig(agents))
    with pytest.raises(ValueError, match="agent_type must not be empty"):
        await valid.run({**record(), "econfig": {"agent_type": " "}}, base_url=URL)
    assert not (clean_env / "isolate").exists()  # no episode started, so no episode log
    # A record's econfig may set the type itself.
    assert await wf.run({**record(report=True), "econfig": {"agent_type": " OH"}}, base_url=URL)
    assert report(clean_env)["kwargs"]["agent_type"] == "oh"
    assert list((clean_env / "isolate").glob("*.log"))


async def test_model_and_providers_from_econfig_then_env(
    agents: Agents, clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    await wf.run(record(report=True), base_url=URL)
    kwargs = report(clean_env)["kwargs"]
    assert kwargs["override_llm_model"] is None
    assert kwargs["override_opencode_provider"] is None
    assert kwargs["override_codex_provider"] is None

    monkeypatch.setenv("LLM_MODEL", "env-model")
    monkeypatch.setenv("OPENCODE_PROVIDER", "env-oc")
    monkeypatch.setenv("CODEX_PROVIDER", "env-codex")
    await wf.run(record(report=True), base_url=URL)
    kwargs = report(clean_env)["kwargs"]
    assert (kwargs["override_llm_model"], kwargs["override_opencode_provider"]) == (
        "env-model",
        "env-oc",
    )
    assert kwargs["override_codex_provider"] == "env-codex"

    wf = SWEAgentWorkflow(
        econfig=econfig(agents, llm_model="m", opencode_provider="oc", codex_provider="cx")
    )
    await wf.run(record(report=True), base_url=URL)
    kwargs = report(clean_env)["kwargs"]
    assert (kwargs["override_llm_model"], kwargs["override_opencode_provider"]) == ("m", "oc")
    assert kwargs["override_codex_provider"] == "cx"


# --- 6. per-record econfig --------------------------------------------------------------------


async def test_record_econfig_overrides_for_that_record_only(
    agents: Agents, clean_env: Path
) -> None:
    config = econfig(agents, agent_type="cc")
    frozen = json.dumps(config, sort_keys=True)
    wf = SWEAgentWorkflow(econfig=config)
    data = record(report=True)
    data["econfig"] = {"agent_type": "oh", "llm_model": "per-record"}
    await wf.run(data, base_url=URL)
    kwargs = report(clean_env)["kwargs"]
    assert (kwargs["agent_type"], kwargs["override_llm_model"]) == ("oh", "per-record")
    assert json.dumps(wf.econfig, sort_keys=True) == frozen
    await wf.run(record(report=True), base_url=URL)
    assert report(clean_env)["kwargs"]["agent_type"] == "cc"


# --- 7, 8. base_url, api_key, the call ------------------------------------------------------


async def test_base_url_is_required(agents: Agents) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    with pytest.raises(ValueError, match="base_url is required"):
        await wf.run(record(), api_key="k")


@pytest.mark.parametrize("source", ["kwarg", "env", "default"])
async def test_api_key_sources(
    agents: Agents, clean_env: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    extra: dict[str, Any] = {"base_url": URL, "http_client": object()}
    if source == "kwarg":
        extra["api_key"] = "sk-from-kwarg"
        monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
        expected = "sk-from-kwarg"
    elif source == "env":
        monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
        expected = "sk-from-env"
    else:
        expected = "dummy"
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    assert await wf.run(record(report=True, key_digest=True), **extra) == 1.0
    got = report(clean_env)
    assert got["key_digest"] == hashlib.sha256(expected.encode()).hexdigest()
    assert got["env_has_key"] is False


async def test_the_child_gets_every_keyword(agents: Agents, clean_env: Path) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents, llm_model="m"))
    await wf.run(record(report=True), base_url=URL, api_key="k")
    assert report(clean_env)["kwargs"] == {
        "agent_type": "swe",
        "agent_config": "1_0_0/min-swe-agent-train-top1",
        "result_dir": str(clean_env),
        "override_base_url": URL,
        "override_llm_model": "m",
        "override_opencode_provider": None,
        "override_codex_provider": None,
    }


async def test_result_dir_defaults_to_dot_logs(
    agents: Agents, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("LOG_DIR")
    monkeypatch.chdir(tmp_path)
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    await wf.run(record(report=True), base_url=URL)
    assert report(tmp_path / "logs")["kwargs"]["result_dir"] == "./logs"


# --- 9, 10, 11. outcomes ----------------------------------------------------------------------


async def test_timeout_kills_the_tree_and_raises_timeout_error(
    agents: Agents, caplog: pytest.LogCaptureFixture
) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents, timeout=1.5))
    with (
        caplog.at_level(logging.INFO, logger="AReaL-SWEAgent"),
        pytest.raises(TimeoutError) as info,
    ):
        await wf.run(record("slow-1", spawn=3, sleep=60), base_url=URL)
    assert isinstance(info.value, isolate.EpisodeTimeout)
    # The agent, cancelled, exits by itself; its three sleeps are killed.
    assert info.value.outcome.cleanup == "finished"
    assert info.value.outcome.killed >= 3
    assert len(agents.pid_files()) == 3  # the control: the children did start
    assert agents.left() == []
    assert "TIMEOUT: Instance slow-1 exceeded 1.5s (elapsed: " in caplog.text
    assert "Discarding trajectory" in caplog.text
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("episode {")]
    assert json.loads(lines[0].removeprefix("episode "))["cleanup"] == "finished"


#: How late past its timeout ``run`` may answer (seconds; docs/cancellation.md).
LATE_BOUND_S = 2.0

#: An agent that starts a grandchild and hangs; cancelled, it cleans up for ``cleanup_s``
#: (awaiting, as a remote sandbox's clean-up does), then writes ``marker``.
HANGING_AGENT = f"""
import asyncio, os, subprocess

async def run_agent_with_reward(data, **kwargs):
    try:
        subprocess.Popen(["sh", "-c", {record_pid_sh("grandchild") + "; exec sleep 300"!r}])
        while not os.path.exists(os.path.join(os.environ["PID_DIR"], "grandchild")):
            await asyncio.sleep(0.01)
        await asyncio.sleep(3600)
    finally:
        await asyncio.sleep(data["cleanup_s"])
        with open(data["marker"], "w") as f:
            f.write("cleaned")
    return 1.0, {{}}
"""


@pytest.mark.parametrize(
    ("limit", "cancel_grace", "cleanup_s", "cleanup"),
    [(4.0, 30.0, 3600.0, "cut short"), (6.0, 2.0, 0.2, "finished")],
    ids=["clean-up hangs, grace past the timeout", "clean-up fits"],
)
async def test_timeout_raises_within_the_timeout_whatever_cancel_grace(
    agents: Agents,
    tmp_path: Path,
    limit: float,
    cancel_grace: float,
    cleanup_s: float,
    cleanup: str,
) -> None:
    root = tmp_path / "hanging"
    (root / "aweagent").mkdir(parents=True)
    (root / "aweagent" / "__init__.py").write_text("")
    (root / "aweagent" / "lifecycle.py").write_text(HANGING_AGENT)
    marker = tmp_path / "cleaned"
    settings = econfig(agents, agent_root=str(root), timeout=limit, cancel_grace=cancel_grace)
    wf = SWEAgentWorkflow(econfig=settings)
    data = dict(record("hang-1"), cleanup_s=cleanup_s, marker=str(marker))
    called = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        await wf.run(data, base_url=URL)
    late = time.monotonic() - called - limit
    assert late < LATE_BOUND_S * SLOW, f"raised {late:.1f} s after the timeout"
    assert isinstance(info.value, isolate.EpisodeTimeout)
    assert list(agents.pid_files()) == ["grandchild"]  # the control: the tree had started
    assert agents.left() == []
    assert info.value.outcome.cleanup == cleanup
    assert marker.exists() == (cleanup == "finished")


async def test_econfig_cancel_grace_reaches_the_episode(agents: Agents) -> None:
    """cancel_grace=0 from econfig: the old teardown, no clean-up, SIGTERM at the deadline."""
    wf = SWEAgentWorkflow(econfig=econfig(agents, timeout=1.0, cancel_grace=0, exit_grace=2.5))
    with pytest.raises(TimeoutError) as info:
        await wf.run(record("slow-2", sleep=60), base_url=URL)
    assert isinstance(info.value, isolate.EpisodeTimeout)
    assert info.value.outcome.cleanup is None
    assert info.value.outcome.signal == "SIGTERM"
    spec = episode_spec(econfig(agents, cancel_grace=7, exit_grace=2.5), SCRIPTED, 100.0, None)
    assert (spec.cancel_grace, spec.exit_grace) == (7.0, 2.5)


@pytest.mark.parametrize(
    ("timeout", "graces", "expected"),
    [
        (100.0, (7.0, 0.5), (92.5, 7.0, 0.5)),  # the teardown fits: the agent gets the rest
        (10.0, (7.0, 1.0), (5.0, 4.375, 0.625)),  # half the timeout at most, in proportion
        (10.0, (0.0, 0.0), (10.0, 0.0, 0.0)),
    ],
)
def test_the_teardown_fits_in_the_timeout(
    timeout: float, graces: tuple[float, float], expected: tuple[float, float, float]
) -> None:
    settings = {"cancel_grace": graces[0], "kill_grace": graces[1]}
    spec = episode_spec(settings, SCRIPTED, timeout, None)
    assert (spec.timeout, spec.cancel_grace, spec.kill_grace) == pytest.approx(expected)


async def test_agent_error_is_zero_with_the_traceback_logged(
    agents: Agents, caplog: pytest.LogCaptureFixture
) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    with caplog.at_level(logging.ERROR, logger="AReaL-SWEAgent"):
        reward = await wf.run(record("bad-1", **{"raise": "agent blew up"}), base_url=URL)
    assert reward == 0.0
    assert "[bad-1] Episode error: RuntimeError: agent blew up" in caplog.text
    assert "Traceback (most recent call last)" in caplog.text
    assert "lifecycle.py" in caplog.text


@pytest.mark.parametrize("value", [1, 0.25, True])
async def test_returns_a_float(agents: Agents, value: object) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    reward = await wf.run(record(reward=value), base_url=URL)
    assert type(reward) is float
    assert reward == float(value)  # type: ignore[arg-type]


# --- what isolation adds ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("on_crash", "crash"), [("zero", "segv"), ("zero", "exit"), ("raise", "segv")]
)
async def test_on_crash(agents: Agents, on_crash: str, crash: str) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents, on_crash=on_crash))
    if on_crash == "zero":
        assert await wf.run(record(crash=crash), base_url=URL) == 0.0
    else:
        with pytest.raises(isolate.EpisodeCrashed, match="killed by SIGSEGV"):
            await wf.run(record(crash=crash), base_url=URL)


def test_on_crash_is_validated() -> None:
    with pytest.raises(ValueError, match="on_crash"):
        SWEAgentWorkflow(econfig={"agent_root": str(SCRIPTED), "on_crash": "ignore"})


async def test_setup_error_always_raises(tmp_path: Path) -> None:
    wf = SWEAgentWorkflow(econfig={"agent_root": str(tmp_path)})  # no aweagent package in it
    with pytest.raises(isolate.SetupError, match="aweagent"):
        await wf.run(record(), base_url=URL)


async def test_protocol_error_always_raises(agents: Agents) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    with pytest.raises(isolate.ProtocolError, match="nan"):
        await wf.run(record(reward="nan"), base_url=URL)


async def test_agent_interpreter_from_econfig(
    agents: Agents, clean_env: Path, bare_venv: Path
) -> None:
    """The conflicting-dependencies case: the agent runs under its own interpreter, a venv
    without pydantic or isolate."""
    wf = SWEAgentWorkflow(econfig=econfig(agents, python=str(bare_venv)))
    await wf.run(record(report=True), base_url=URL)
    assert report(clean_env)["python"] == str(bare_venv)


async def test_env_and_inherit_env(
    agents: Agents, clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FROM_PARENT", "p")
    monkeypatch.setenv("NOT_LISTED", "n")
    cfg = econfig(agents, inherit_env=["PATH", "FROM_*"])
    cfg["env"]["EXTRA"] = "e"
    wf = SWEAgentWorkflow(econfig=cfg)
    await wf.run(record(report=True), base_url=URL)
    env = report(clean_env)["environ"]
    assert (env.get("FROM_PARENT"), env.get("EXTRA"), env.get("NOT_LISTED")) == ("p", "e", None)


async def test_logs_per_episode_and_one_structured_line(
    agents: Agents, clean_env: Path, caplog: pytest.LogCaptureFixture
) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    with caplog.at_level(logging.INFO, logger="AReaL-SWEAgent"):
        await wf.run(record("django__django-1", print="hello from the agent"), base_url=URL)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("episode {")]
    assert len(lines) == 1
    fields = json.loads(lines[0].removeprefix("episode "))
    assert fields["instance_id"] == "django__django-1"
    assert fields["status"] == "ok"
    assert fields["reward"] == 1.0
    assert fields["exit"] == "exited with 0"
    assert fields["killed"] == 0
    assert fields["cleanup"] is None
    log = Path(fields["log"])
    assert log.parent == clean_env / "isolate"
    assert log.name.startswith("django__django-1.")
    assert "hello from the agent" in await anyio.Path(log).read_text()


@pytest.mark.slow
async def test_32_concurrent_rollouts_each_get_their_own_key(
    agents: Agents, clean_env: Path
) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    keys = {
        f"inst-{i}": f"sk-rollout-{i}-{hashlib.md5(str(i).encode()).hexdigest()}" for i in range(32)
    }
    rewards: dict[str, float] = {}

    async def one(instance_id: str) -> None:
        reward = await wf.run(
            record(instance_id, report=True, key_digest=True, sleep=0.3),
            base_url=URL,
            api_key=keys[instance_id],
        )
        assert isinstance(reward, float)
        rewards[instance_id] = reward

    async with anyio.create_task_group() as tg:
        for instance_id in keys:
            tg.start_soon(one, instance_id)
    assert rewards == {i: 1.0 for i in keys}
    for instance_id, key in keys.items():
        got = report(clean_env, instance_id)
        assert got["key_digest"] == hashlib.sha256(key.encode()).hexdigest()
        assert got["env_has_key"] is False
        assert not any(k in json.dumps(got["environ"]) for k in keys.values())


@pytest.mark.parametrize("level", ["session", "auto"])
async def test_containment_and_limits_from_econfig(
    agents: Agents, clean_env: Path, caplog: pytest.LogCaptureFixture, level: str
) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents, containment=level, limits={"open_files": 77}))
    with caplog.at_level(logging.INFO, logger="AReaL-SWEAgent"):
        assert await wf.run(record("lim-1", report=True), base_url=URL) == 1.0
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("episode {")]
    used = json.loads(line.removeprefix("episode "))["containment"]
    expected = _internals.resolve(level, None)
    assert used == expected[0]
    assert report(clean_env, "lim-1")["nofile"] == 77


def test_invalid_limits_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="limits"):
        SWEAgentWorkflow(econfig={"agent_root": str(SCRIPTED), "limits": {"open_files": -1}})


# --- the deployment's environment -------------------------------------------------------------

DEPLOYMENT = {
    "AENV_SYSTEM_URL": "http://aenv.internal:8080",
    "SWEBENCH_EVAL_ENV": "prod",
    "HF_HOME": "/data/hf",
    "HTTPS_PROXY": "http://proxy.internal:3128",
    "NO_PROXY": "localhost,127.0.0.1",
}
TRAINER_ONLY = {
    "PYTHONPATH": "/trainer/areal",
    "PYTHONSAFEPATH": "safe-path-on",
    "VIRTUAL_ENV": "/trainer/venv",
    "CONDA_PREFIX": "/opt/conda/envs/trainer",
    "CONDA_DEFAULT_ENV": "conda-env-of-the-trainer",
    "LD_PRELOAD": "libisolate-test-not-there.so",
    "E2B_API_KEY": "e2b-of-the-trainer",
    "REMOTE_PROXY_API_KEY": "proxy-key-of-the-trainer",
}


def episode_log(caplog: pytest.LogCaptureFixture) -> Path:
    """The log file named by the last episode's structured line."""
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("episode {")]
    return Path(json.loads(lines[-1].removeprefix("episode "))["log"])


async def test_the_agent_sees_the_deployment_but_not_the_trainer_interpreter_or_keys(
    agents: Agents,
    clean_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name, value in {**DEPLOYMENT, **TRAINER_ONLY}.items():
        monkeypatch.setenv(name, value)
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    with caplog.at_level(logging.INFO, logger="AReaL-SWEAgent"):
        assert await wf.run(record(report=True), base_url=URL) == 1.0
    env = report(clean_env)["environ"]
    assert {name: env.get(name) for name in DEPLOYMENT} == DEPLOYMENT
    assert [name for name in TRAINER_ONLY if name in env] == []
    # The first line isolate writes into the episode's log names them, never their values.
    first = episode_log(caplog).read_text().splitlines()[0]
    assert first.startswith("[isolate] withheld from the agent's environment: ")
    for name in TRAINER_ONLY:
        assert name in first
    for value in TRAINER_ONLY.values():
        assert value not in first


async def test_econfig_inherit_env_overrides_the_passthrough(
    agents: Agents, clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {**DEPLOYMENT, **TRAINER_ONLY}.items():
        monkeypatch.setenv(name, value)
    cfg = econfig(agents, inherit_env=[*PASSTHROUGH_ENV, "PYTHONPATH", "E2B_API_KEY"])
    wf = SWEAgentWorkflow(econfig=cfg)
    await wf.run(record(report=True), base_url=URL)
    env = report(clean_env)["environ"]
    assert (env.get("PYTHONPATH"), env.get("E2B_API_KEY")) == (
        "/trainer/areal",
        "e2b-of-the-trainer",
    )
    assert env.get("HF_HOME") == "/data/hf"
    assert "VIRTUAL_ENV" not in env


@pytest.mark.parametrize("bad", ["PATH", {"PATH": 1}])
def test_inherit_env_must_be_a_list(bad: object) -> None:
    with pytest.raises(ValueError, match="inherit_env must be a list"):
        SWEAgentWorkflow(econfig={"agent_root": str(SCRIPTED), "inherit_env": bad})


async def test_secret_env_from_the_trainer_environment(
    agents: Agents,
    clean_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    value = "e2b-" + hashlib.sha256(b"x").hexdigest()[:24]
    monkeypatch.setenv("E2B_API_KEY", value)
    wf = SWEAgentWorkflow(econfig=econfig(agents, secret_env=["E2B_API_KEY"]))
    with caplog.at_level(logging.INFO, logger="AReaL-SWEAgent"):
        await wf.run(record(report=True, print="E2B key is " + value), base_url=URL)
    # The agent has it in os.environ (and wrote it into its own report: its choice).
    assert report(clean_env)["environ"]["E2B_API_KEY"] == value
    log = episode_log(caplog).read_text()
    assert "E2B key is [secret]" in log
    assert value not in log
    assert "E2B_API_KEY" not in log.splitlines()[0]  # delivered, not withheld


@pytest.mark.parametrize(
    ("secret_env", "message"),
    [
        (["NOT_SET_ANYWHERE_1"], "not set in the environment: NOT_SET_ANYWHERE_1"),
        ("E2B_API_KEY", "secret_env must be a list of variable names, got str"),
        (["A=B"], "invalid variable name 'A=B'"),
        (["HOME"], "econfig.secret_env and econfig.env both set HOME"),
    ],
)
def test_bad_secret_env_fails_at_construction(secret_env: object, message: str) -> None:
    cfg = {"agent_root": str(SCRIPTED), "secret_env": secret_env, "env": {"HOME": "/h"}}
    with pytest.raises(ValueError, match=re.escape(message)):
        SWEAgentWorkflow(econfig=cfg)


# --- upstream's newer econfig keys ------------------------------------------------------------

UPSTREAM = {
    "harness_timeout": 222.0,
    "eval_timeout": 111.0,
    "session_idle_timeout": None,
    "session_poll_interval": 7.0,
    "terminal_exit_grace": 11.0,
    "opencode_config": {"tools": {"task": False}},
    "max_tokens": 32768,
    "max_completion_tokens": 4096,
}


@pytest.mark.parametrize("where", ["econfig", "record"])
async def test_upstream_keys_are_forwarded(agents: Agents, clean_env: Path, where: str) -> None:
    keys = {"sandbox_backend": " E2B ", **UPSTREAM}
    data = record(report=True)
    if where == "econfig":
        wf = SWEAgentWorkflow(econfig=econfig(agents, **keys))
    else:
        wf = SWEAgentWorkflow(econfig=econfig(agents))
        data["econfig"] = keys
    await wf.run(data, base_url=URL)
    kwargs = report(clean_env)["kwargs"]
    assert kwargs["sandbox_backend"] == "e2b"
    assert {k: kwargs[f"override_{k}"] for k in UPSTREAM} == UPSTREAM


async def test_upstream_keys_are_absent_when_unset(agents: Agents, clean_env: Path) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents, max_tokens=10))
    await wf.run(record(report=True), base_url=URL)
    kwargs = report(clean_env)["kwargs"]
    assert kwargs["override_max_tokens"] == 10
    present = [k for k in ("sandbox_backend", *(f"override_{k}" for k in UPSTREAM)) if k in kwargs]
    assert present == ["override_max_tokens"]


def test_sandbox_backend_is_validated_at_construction() -> None:
    with pytest.raises(ValueError, match="sandbox_backend must be 'aenv' or 'e2b', got 'local'"):
        SWEAgentWorkflow(econfig={"agent_root": str(SCRIPTED), "sandbox_backend": "local"})


async def test_sandbox_backend_of_a_record_is_validated(agents: Agents) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    data = record()
    data["econfig"] = {"sandbox_backend": "docker"}
    with pytest.raises(ValueError, match="'aenv' or 'e2b'"):
        await wf.run(data, base_url=URL)


async def test_a_reward_mapping_is_returned_as_it_is(agents: Agents) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    reward = await wf.run(record("map-1", reward={"c1": 1.0, "c2": 0.25}), base_url=URL)
    assert reward == {"c1": 1.0, "c2": 0.25}


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"limits": {"open_files": -1}}, "open_files"),
        ({"containment": "walls"}, "containment"),
        ({"timeout": "soon"}, "econfig.timeout"),
        ({"timeout": -1}, "timeout"),
    ],
    ids=["limits", "containment", "timeout not a number", "timeout negative"],
)
async def test_an_invalid_per_record_econfig_fails_before_anything_starts(
    agents: Agents, clean_env: Path, bad: dict[str, Any], says: str
) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents))
    data = dict(record("bad-1", spawn=1), econfig=bad)
    with pytest.raises(ValueError, match=says):
        await wf.run(data, base_url=URL)
    assert agents.pid_files() == {}  # the agent never ran
    assert not (clean_env / "isolate").exists()  # nor did an episode start


async def test_a_per_record_timeout_counts_for_that_record(
    agents: Agents, caplog: pytest.LogCaptureFixture
) -> None:
    wf = SWEAgentWorkflow(econfig=econfig(agents), timeout=600.0)
    data = dict(record("short-1", spawn=1, sleep=60), econfig={"timeout": 1.0})
    with (
        caplog.at_level(logging.INFO, logger="AReaL-SWEAgent"),
        pytest.raises(TimeoutError) as info,
    ):
        await wf.run(data, base_url=URL)
    assert isinstance(info.value, isolate.EpisodeTimeout)
    assert info.value.outcome.duration_s < 1.0 + 0.5 + 5.0 * SLOW  # not the workflow's 600 s
    assert "TIMEOUT: Instance short-1 exceeded 1.0s" in caplog.text
    assert agents.left() == []
    # Another record of the same workflow keeps the workflow's timeout.
    assert await wf.run(record("long-1", sleep=1.5), base_url=URL) == 1.0


async def test_sandbox_from_econfig_writes_result_dir_and_allows_base_url(
    agents: Agents, clean_env: Path
) -> None:
    if _internals.landlock_abi() < 4:
        pytest.skip("the sandbox's TCP rules need Landlock ABI 4")
    wf = SWEAgentWorkflow(econfig=econfig(agents, sandbox={"connect": [22]}))
    assert await wf.run(record("box-1", report=True), base_url=URL) == 1.0
    assert report(clean_env, "box-1")["kwargs"]["result_dir"] == str(clean_env)
    box = sandbox_of({"sandbox": {"connect": [22]}}, str(clean_env), "http://127.0.0.1:9/v1")
    assert box is not None
    assert box.connect == (9, 22)
    assert box.write == (clean_env,)
    assert sandbox_of({"sandbox": True}, None, URL) == isolate.Sandbox()  # connect None stays
    assert sandbox_of({}, str(clean_env), URL) is None


def test_invalid_sandbox_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="connect"):
        SWEAgentWorkflow(econfig={"agent_root": str(SCRIPTED), "sandbox": {"connect": [0]}})


def test_every_bad_key_is_named_at_construction() -> None:
    bad = {
        "agent_root": str(SCRIPTED),
        "timeout": "soon",
        "preload": "yes",
        "on_crash": "explode",
        "secret_env": "KEY",
        "sandbox_backend": "local",
        "sandbox_network": "everything",
        "inherit_env": "HOME",
    }
    with pytest.raises(ValueError, match="econfig") as caught:
        SWEAgentWorkflow(econfig=bad)
    said = str(caught.value)
    for key in bad.keys() - {"agent_root"}:
        assert f"econfig.{key}" in said, (key, said)
    assert len(said.splitlines()) == 1  # one line, as the command line prints it
