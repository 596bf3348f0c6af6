"""The public surface: exported names, import hygiene, spec validation, argument errors,
what an outcome shows and raises, and that the launcher runs on trio as well as asyncio."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import ValidationError

import isolate

from .conftest import SLOW, Agents

# --- exported names ---------------------------------------------------------------------------

EXPORTED = [
    "AgentError",
    "ArgumentError",
    "DEFAULT_INHERIT_ENV",
    "EPISODE_ENV",
    "EPISODE_TAG_ENV",
    "EpisodeCrashed",
    "EpisodeError",
    "EpisodeOutcome",
    "EpisodeSpec",
    "EpisodeTimeout",
    "ErrorInfo",
    "IsolateError",
    "Limits",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "STATUSES",
    "Sandbox",
    "SandboxReport",
    "SetupError",
    "Status",
    "Timings",
    "close_templates",
    "park",
    "run_episode",
    "shim_path",
]


def test_all_is_pinned() -> None:
    assert isolate.__all__ == EXPORTED


def test_all_is_sorted() -> None:
    assert sorted(isolate.__all__) == isolate.__all__


@pytest.mark.parametrize("name", EXPORTED)
def test_every_exported_name_resolves(name: str) -> None:
    assert getattr(isolate, name) is not None


def test_import_has_no_side_effect(tmp_path: Path) -> None:
    # A fresh interpreter in an empty directory: no thread, no file, no output.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    report = tmp_path / "report.json"
    code = textwrap.dedent(
        f"""
        import json, sys, threading
        import isolate
        with open({str(report)!r}, "w") as f:
            json.dump({{"threads": threading.active_count(), "file": isolate.__file__}}, f)
        """
    )
    repo = Path(isolate.__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "PYTHONPATH")}
    env["PYTHONPATH"] = str(repo)
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        cwd=cwd,
        env=env,
        timeout=30 * SLOW,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b""
    assert done.stderr == b""
    assert list(cwd.iterdir()) == []
    result = json.loads(report.read_text())
    assert result["threads"] == 1
    assert Path(result["file"]).resolve() == Path(isolate.__file__).resolve()


# --- EpisodeSpec ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("entrypoint", "aweagent.lifecycle"),
        ("entrypoint", "aweagent.lifecycle:run agent"),
        ("entrypoint", "awe agent:run"),
        ("entrypoint", ":run"),
        ("entrypoint", "mod:"),
        ("timeout", 0),
        ("timeout", -1.0),
        ("timeout", math.nan),
        ("timeout", math.inf),
        ("kill_grace", -0.5),
        ("kill_grace", math.nan),
        ("kill_grace", math.inf),
        ("env", {"A=B": "x"}),
        ("env", {"A": "x\x00y"}),
        ("env", {"": "x"}),
        ("env", {isolate.EPISODE_ENV: "mine"}),
        ("env", {isolate.EPISODE_TAG_ENV: "mine"}),
    ],
)
def test_spec_rejects_an_invalid_field(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        isolate.EpisodeSpec(**{field: value})
    assert [err["loc"][0] for err in info.value.errors()] == [field]
    assert field in str(info.value)


def test_spec_rejects_an_unknown_field() -> None:
    with pytest.raises(ValidationError) as info:
        isolate.EpisodeSpec(timeuot=5)  # type: ignore[call-arg]
    (error,) = info.value.errors()
    assert error["loc"] == ("timeuot",)
    assert error["type"] == "extra_forbidden"


def test_spec_is_frozen() -> None:
    spec = isolate.EpisodeSpec()
    with pytest.raises(ValidationError) as info:
        spec.timeout = 5.0  # type: ignore[misc]
    assert "timeout" in str(info.value)
    assert spec.timeout == 1800.0


def test_spec_defaults() -> None:
    spec = isolate.EpisodeSpec()
    assert spec.entrypoint == "aweagent.lifecycle:run_agent_with_reward"
    assert spec.timeout == 1800.0
    assert spec.kill_grace == 5.0
    assert spec.python == sys.executable
    assert spec.agent_root is None
    assert spec.env == {}


def test_spec_accepts_valid_values() -> None:
    # The rejections above are about the values, not about the fields being unsettable.
    spec = isolate.EpisodeSpec(
        entrypoint="pkg.sub.mod:Cls.method",
        timeout=0.001,
        kill_grace=0,
        env={"A": "x=y", "LC_ALL": "C"},
    )
    assert spec.entrypoint == "pkg.sub.mod:Cls.method"
    assert spec.kill_grace == 0


# --- run_episode argument errors --------------------------------------------------------------

ARGUMENT_ERRORS = {
    "key in kwargs and secrets": (
        {},
        {"kwargs": {"api_key": "public"}, "secrets": {"api_key": "sk-arg-SECRET-1"}},
        "api_key",
    ),
    "data not JSON": (object(), {}, "JSON"),
    "NaN in kwargs": ({}, {"kwargs": {"x": math.nan}}, "JSON"),
    "kwarg name not an identifier": ({}, {"kwargs": {"not an identifier": 1}}, "identifier"),
    "secret name not an identifier": ({}, {"secrets": {"1key": "sk-arg-SECRET-2"}}, "1key"),
    "secret not a str": ({}, {"secrets": {"api_key": 987654321}}, "api_key"),
    "secret as bytes": ({}, {"secrets": {"api_key": b"sk-arg-SECRET-3"}}, "bytes"),
    "episode_id with a slash": ({}, {"episode_id": "../escape"}, "episode_id"),
    "episode_id with a space": ({}, {"episode_id": "a b"}, "episode_id"),
    "episode_id too long": ({}, {"episode_id": "x" * 201}, "episode_id"),
}
# Every secret value above; none may appear in any message.
ARGUMENT_SECRETS = ("sk-arg-SECRET-1", "sk-arg-SECRET-2", "987654321", "sk-arg-SECRET-3")


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(ARGUMENT_ERRORS))
async def test_run_episode_argument_error(tmp_path: Path, case: str) -> None:
    data, arguments, named = ARGUMENT_ERRORS[case]
    # An "interpreter" that leaves a mark if anything gets as far as starting it.
    marker = tmp_path / "started"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ntouch {marker}\n")
    python.chmod(0o755)
    spec = isolate.EpisodeSpec(python=str(python), log_dir=tmp_path / "logs", timeout=5)
    started: list[int] = []

    with pytest.raises(isolate.ArgumentError) as info:
        await isolate.run_episode(spec, data, on_start=started.append, **arguments)

    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert named in message
    for secret in ARGUMENT_SECRETS:
        assert secret not in message
        assert secret not in repr(info.value)
    assert started == []
    assert not marker.exists()
    assert not (tmp_path / "logs").exists()


# --- EpisodeOutcome ---------------------------------------------------------------------------

SECRET = "sk-test-SECRET-123"


@pytest.mark.anyio
async def test_outcome_never_shows_the_secret(agents: Agents) -> None:
    spec = agents.spec(
        """
        import sys

        def run(data, override_api_key):
            print("stdout key", override_api_key)
            sys.stderr.write("stderr key " + override_api_key + "\\n")
            return 1.0, {"echo": override_api_key, override_api_key: [override_api_key]}
        """
    )
    outcome = await isolate.run_episode(
        spec, {"instance_id": "s"}, secrets={"override_api_key": SECRET}
    )
    assert outcome.status == "ok", outcome.summary()
    assert outcome.reward == 1.0
    # The agent did get the key, and it came back masked everywhere.
    assert outcome.info == {"echo": "[secret]", "[secret]": ["[secret]"]}
    assert "stderr key [secret]" in outcome.stderr_tail
    assert "stdout key [secret]" in outcome.stderr_tail
    for text in (repr(outcome), str(outcome), outcome.model_dump_json(), outcome.summary()):
        assert SECRET not in text
    assert outcome.log_path is not None
    assert SECRET.encode() not in outcome.log_path.read_bytes()


def make_outcome(status: str, **fields: Any) -> isolate.EpisodeOutcome:
    error = None if status == "ok" else isolate.ErrorInfo(type="T", message=f"{status} happened")
    return isolate.EpisodeOutcome(status=status, error=error, episode_id="e1", **fields)


def test_raise_for_status_returns_self_when_ok() -> None:
    outcome = make_outcome("ok", reward=0.5)
    assert outcome.raise_for_status() is outcome


@pytest.mark.parametrize(
    ("status", "error"),
    [
        ("agent_error", isolate.AgentError),
        ("crashed", isolate.EpisodeCrashed),
        ("timeout", isolate.EpisodeTimeout),
        ("protocol_error", isolate.ProtocolError),
        ("setup_error", isolate.SetupError),
    ],
)
def test_raise_for_status_raises_the_matching_error(
    status: str, error: type[isolate.EpisodeError]
) -> None:
    outcome = make_outcome(status)
    with pytest.raises(error) as info:
        outcome.raise_for_status()
    assert type(info.value) is error
    assert isinstance(info.value, isolate.EpisodeError)
    assert isinstance(info.value, isolate.IsolateError)
    assert info.value.outcome is outcome
    assert f"{status} happened" in str(info.value)


def test_every_status_is_covered() -> None:
    assert set(isolate.STATUSES) == {
        "ok",
        "agent_error",
        "crashed",
        "timeout",
        "protocol_error",
        "setup_error",
    }


def test_exception_tree() -> None:
    assert issubclass(isolate.EpisodeTimeout, TimeoutError)
    assert issubclass(isolate.ArgumentError, ValueError)
    assert issubclass(isolate.ArgumentError, isolate.IsolateError)
    assert not issubclass(isolate.ArgumentError, isolate.EpisodeError)
    for error in (
        isolate.AgentError,
        isolate.EpisodeCrashed,
        isolate.ProtocolError,
        isolate.SetupError,
    ):
        assert not issubclass(error, TimeoutError)


@pytest.mark.parametrize(
    ("fields", "words", "not_words"),
    [
        ({"signal": "SIGSEGV"}, "killed by SIGSEGV", ("-11", "exited")),
        ({"exit_code": 3}, "exited with 3", ("killed by",)),
    ],
)
def test_summary_reads_like_words(
    fields: dict[str, Any], words: str, not_words: tuple[str, ...]
) -> None:
    outcome = make_outcome("crashed", **fields)
    assert outcome.exit_description == words
    summary = outcome.summary()
    assert words in summary
    assert "crashed happened" in summary
    for word in not_words:
        assert word not in summary


def test_the_summary_names_the_containment_only_of_an_episode_that_started() -> None:
    before = make_outcome("setup_error", containment="session")  # no process, no pid
    assert before.summary() == (
        "episode e1: setup_error: T: setup_error happened (exit unknown, 0.00 s, 0 killed)"
    )
    started = make_outcome("crashed", pid=42, signal="SIGKILL", containment="cgroup+pidns")
    assert started.summary().endswith(
        "killed by SIGKILL, 0.00 s, 0 killed, containment cgroup+pidns)"
    )


# --- another backend --------------------------------------------------------------------------


def test_runs_on_trio(agents: Agents) -> None:
    spec = agents.spec("def run(data):\n    return data['x'] * 2, {'seen': data}\n")

    async def main() -> isolate.EpisodeOutcome:
        import trio

        trio.lowlevel.current_trio_token()  # raises unless trio really runs this
        return await isolate.run_episode(spec, {"x": 0.25})

    outcome = anyio.run(main, backend="trio")
    assert outcome.status == "ok", outcome.summary()
    assert outcome.reward == 0.5
    assert outcome.info == {"seen": {"x": 0.25}}


def test_the_version_is_the_installed_ones_and_the_command_line_says_it() -> None:
    from importlib.metadata import version

    assert isolate.__version__ == version("episode-isolate")
    done = subprocess.run(
        [sys.executable, "-m", "isolate", "--version"], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (0, f"isolate {isolate.__version__}\n")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        isolate.nope  # noqa: B018
