"""Secrets travel only in the handshake: never in an environment, argv, outcome, repr or log."""

from __future__ import annotations

import hashlib
import os
import re
import secrets as _secrets
import sys
from pathlib import Path

import anyio
import pytest
from pydantic import SecretStr

import isolate

from . import _internals
from .conftest import Agents, both_starts, wait_for, wait_until

pytestmark = pytest.mark.anyio


def proc_files_containing(needle: bytes) -> list[str]:
    """Every /proc/*/environ and /proc/*/cmdline on the machine that contains ``needle``."""
    hits = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        for part in ("environ", "cmdline"):
            try:
                with open(f"/proc/{name}/{part}", "rb") as f:
                    if needle in f.read():
                        hits.append(f"/proc/{name}/{part}")
            except OSError:
                continue
    return hits


def nowhere_but_masked(outcome: isolate.EpisodeOutcome, secret: str) -> bytes:
    """Assert ``secret`` is in no text of the outcome nor in its log; the log's bytes."""
    for text in (repr(outcome), str(outcome), outcome.model_dump_json(), outcome.stderr_tail):
        assert secret not in text
    assert outcome.log_path is not None
    log = outcome.log_path.read_bytes()
    assert secret.encode() not in log
    return log


WAITING_AGENT = """
import hashlib, os, subprocess, time
def run(data, *, api_key, **kw):
    # A shell the agent starts must not see the key either.
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(os.environ["PID_DIR"], "up"), "w") as f:
        f.write(str(child.pid))
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "go")):
        time.sleep(0.01)
    child.kill()
    child.wait()
    print("the agent logs its key:", api_key)
    return 1.0, {"digest": hashlib.sha256(api_key.encode()).hexdigest(), "echo": api_key}
"""


@both_starts
@pytest.mark.parametrize("as_secretstr", [False, True])
async def test_secret_never_leaves_the_handshake(agents: Agents, as_secretstr: bool) -> None:
    key = "sk-live-" + _secrets.token_hex(16)
    spec = agents.spec(WAITING_AGENT)
    found_during: list[str] = []

    async def scan_then_release() -> None:
        await wait_until(lambda: (agents.pids / "up").exists())
        found_during.extend(proc_files_containing(key.encode()))
        (agents.pids / "go").touch()

    secret: str | SecretStr = SecretStr(key) if as_secretstr else key
    async with anyio.create_task_group() as tg:
        tg.start_soon(scan_then_release)
        outcome = await isolate.run_episode(spec, {}, secrets={"api_key": secret})

    assert found_during == [], "the secret is visible in /proc"
    assert outcome.status == "ok", outcome.summary()
    # The child got the key itself ...
    assert outcome.info["digest"] == hashlib.sha256(key.encode()).hexdigest()
    # ... and nothing it sends back carries it.
    assert key not in outcome.info["echo"]
    assert outcome.info["echo"] == "[secret]"
    assert b"the agent logs its key" in nowhere_but_masked(outcome, key)


@both_starts
async def test_secret_in_a_traceback_is_scrubbed(agents: Agents) -> None:
    key = "sk-" + _secrets.token_hex(20)
    spec = agents.spec(
        """
        def run(data, *, api_key):
            raise PermissionError("Incorrect API key provided: " + api_key)
        """
    )
    outcome = await isolate.run_episode(spec, {}, secrets={"api_key": key})
    assert outcome.status == "agent_error"
    assert outcome.error is not None
    assert "Incorrect API key provided: [secret]" in outcome.error.message
    assert key not in outcome.error.message + outcome.error.traceback + outcome.stderr_tail
    assert outcome.log_path is not None
    assert key.encode() not in outcome.log_path.read_bytes()


# Where the 200-character cut of a reward's repr falls in the escaped form of a short secret
# (14 characters, "Zq" + 5 hex + a backslash + 6 hex; in a repr 15, the backslash doubled):
# after 1, 7 (before the backslash), 8 (between the two of its repr), 9 (after them) and 14
# characters of that form.
@pytest.mark.parametrize("into", [1, 7, 8, 9, 14])
async def test_a_short_secret_across_the_cut_of_a_rewards_repr_never_shows(
    agents: Agents, into: int
) -> None:
    key = "Zq" + _secrets.token_hex(3)[:5] + "\\" + _secrets.token_hex(3)
    assert len(repr(key)) == 2 + 15
    pad = 200 - len("{'k': '") - into
    spec = agents.spec(
        f"""
        def run(data, *, api_key):
            return {{"k": "x" * {pad} + api_key + "y" * 10}}
        """
    )
    outcome = await isolate.run_episode(spec, {}, secrets={"api_key": key})
    assert outcome.status == "protocol_error"
    assert outcome.error is not None
    # The repr is cut before the secret, never through it nor through its escaping.
    assert outcome.error.message == (
        "the entrypoint returned a dict ({'k': '" + "x" * pad + "); expected a number, "
        "(reward, extra) or {completion_id: reward}"
    )
    log = nowhere_but_masked(outcome, key)
    for text in (outcome.model_dump_json(), outcome.stderr_tail, log.decode()):
        assert "Zq" not in text  # no piece of it: "Zq" starts the key, hex and "x" never do


@both_starts
async def test_secret_split_across_writes_is_scrubbed(agents: Agents) -> None:
    key = "sk-" + _secrets.token_hex(20)
    spec = agents.spec(
        """
        import os
        def run(data, *, api_key):
            for ch in api_key:  # one write per byte: the parent reads it in many chunks
                os.write(2, ch.encode())
            os.write(2, b"\\n")
            return 1.0
        """
    )
    outcome = await isolate.run_episode(spec, {}, secrets={"api_key": key})
    assert outcome.status == "ok"
    assert outcome.log_path is not None
    log = outcome.log_path.read_bytes()
    assert key.encode() not in log
    assert b"[secret]" in log


@both_starts
async def test_parent_credentials_do_not_leak_into_the_child(
    agents: Agents, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "parent-" + name)
    monkeypatch.setenv("HARMLESS_SETTING", "visible")
    spec = agents.spec(
        "import os\ndef run(data):\n    return 1.0, dict(os.environ)\n",
        inherit_env=(*isolate.DEFAULT_INHERIT_ENV, "HARMLESS_*", "*"),
        env={"EXPLICIT": "yes"},
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    env = outcome.info
    assert env["HARMLESS_SETTING"] == "visible"  # the wildcard works ...
    assert env["EXPLICIT"] == "yes"
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"):
        assert name not in env  # ... but never for credentials
    assert env[isolate.EPISODE_ENV] == outcome.episode_id


async def test_credential_named_exactly_is_inherited(
    agents: Agents, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf-on-purpose")
    spec = agents.spec(
        "import os\ndef run(data):\n    return 1.0, {'t': os.environ.get('HF_TOKEN')}\n",
        inherit_env=("PATH", "HF_TOKEN"),
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.info == {"t": "hf-on-purpose"}


async def test_default_environment_is_an_allow_list(agents: Agents) -> None:
    spec = agents.spec("import os\ndef run(data):\n    return 1.0, sorted(os.environ)\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    allowed = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR"}
    allowed |= {"TERM", "PID_DIR", isolate.EPISODE_ENV, isolate.EPISODE_TAG_ENV}
    unexpected = [n for n in outcome.info if n not in allowed and not n.startswith("LC_")]
    # The interpreter itself may add a few (e.g. LC_CTYPE coercion); nothing else.
    assert unexpected == [], unexpected


def test_wait_for_is_bounded(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="timed out"):
        wait_for(lambda: False, 0.05, "nothing")


# --- secret_env: credentials an SDK reads from the environment ---------------------------------

SECRET_ENV_AGENT = """
import hashlib, os, subprocess, sys, time
def digest(text):
    return hashlib.sha256(text.encode()).hexdigest()
def run(data):
    value = os.environ["SANDBOX_CONF"]
    open(os.path.join(os.environ["PID_DIR"], "up"), "w").close()
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "go")):
        time.sleep(0.01)
    print("the SDK logs its key:", value)
    # What the agent starts inherits os.environ, the variable with it (docs/secrets.md says so).
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('SANDBOX_CONF', ''))"],
        capture_output=True, text=True,
    ).stdout.strip()
    return 1.0, {"digest": digest(value), "child": digest(child), "echo": value}
"""


PY39 = Path("~/.pyenv/versions/3.9.18/bin/python3.9").expanduser()


@pytest.mark.parametrize(
    "interpreter",
    [
        pytest.param(Path(sys.executable), id="this"),
        pytest.param(
            PY39, id="3.9", marks=pytest.mark.skipif(not PY39.exists(), reason=f"no {PY39}")
        ),
    ],
)
@both_starts
async def test_secret_env_reaches_the_agent_and_no_proc_file(
    agents: Agents, monkeypatch: pytest.MonkeyPatch, interpreter: Path
) -> None:
    value = "e2b-" + _secrets.token_hex(16)
    # The parent has a variable of that name too, and passes everything: neither its value
    # nor the secret may reach an exec environment.
    monkeypatch.setenv("SANDBOX_CONF", "parent-value")
    spec = agents.spec(SECRET_ENV_AGENT, inherit_env=("*",), python=str(interpreter))
    found_during: list[str] = []
    parent_value_in: list[str] = []

    async def scan_then_release() -> None:
        await wait_until(lambda: (agents.pids / "up").exists())
        found_during.extend(proc_files_containing(value.encode()))
        parent_value_in.extend(proc_files_containing(b"SANDBOX_CONF=parent-value"))
        (agents.pids / "go").touch()

    async with anyio.create_task_group() as tg:
        tg.start_soon(scan_then_release)
        outcome = await isolate.run_episode(spec, {}, secret_env={"SANDBOX_CONF": SecretStr(value)})

    assert found_during == [], "the secret_env value is visible in /proc"
    assert parent_value_in == [], "the parent's variable of that name was passed"
    assert outcome.status == "ok", outcome.summary()
    digest = hashlib.sha256(value.encode()).hexdigest()
    assert outcome.info["digest"] == digest  # the agent got it ...
    assert outcome.info["child"] == digest  # ... and so does what it starts
    assert outcome.info["echo"] == "[secret]"
    assert b"the SDK logs its key: [secret]" in nowhere_but_masked(outcome, value)


@both_starts
async def test_secret_env_in_an_error_is_scrubbed(agents: Agents) -> None:
    value = "e2b-" + _secrets.token_hex(16)
    spec = agents.spec(
        """
        import os
        def run(data):
            raise PermissionError("401 for key " + os.environ["E2B_API_KEY"])
        """
    )
    outcome = await isolate.run_episode(spec, {}, secret_env={"E2B_API_KEY": value})
    assert outcome.status == "agent_error"
    assert outcome.error is not None
    assert outcome.error.message == "401 for key [secret]"
    assert value not in outcome.error.traceback + outcome.stderr_tail


@pytest.mark.parametrize(
    ("secret_env", "message"),
    [
        ({"A=B": "v"}, "invalid variable name 'A=B'"),
        ({"": "v"}, "invalid variable name ''"),
        ({isolate.EPISODE_ENV: "v"}, "invalid variable name"),
        ({isolate.EPISODE_TAG_ENV: "v"}, "invalid variable name"),
        ({"E2B_API_KEY": 42}, "must be a str or SecretStr, not int"),
        ({"E2B_API_KEY": "sk-\0-x"}, "the value of E2B_API_KEY contains a NUL byte"),
        ({"PID_DIR": "v"}, "in both secret_env and spec.env: PID_DIR"),
    ],
)
async def test_bad_secret_env_is_an_argument_error(
    agents: Agents, secret_env: dict[str, object], message: str
) -> None:
    spec = agents.spec("def run(data):\n    return 1.0\n")
    with pytest.raises(isolate.ArgumentError, match=re.escape(message)) as info:
        await isolate.run_episode(spec, {}, secret_env=secret_env)  # type: ignore[arg-type]
    assert "sk-" not in str(info.value)  # the value is never echoed


async def test_a_parent_variable_holding_a_secret_is_withheld_and_named_in_the_log(
    agents: Agents, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "sk-" + _secrets.token_hex(16)
    monkeypatch.setenv("LLM_KEY", key)  # not credential-like by name; named exactly, even
    monkeypatch.setenv("OPENAI_API_KEY", "sk-parent")
    monkeypatch.setenv("VISIBLE_SETTING", "yes")
    spec = agents.spec(
        "import os\ndef run(data, **kw):\n    return 1.0, sorted(os.environ)\n",
        inherit_env=("*", "LLM_KEY", "!VISIBLE_*"),
    )
    outcome = await isolate.run_episode(spec, {}, secrets={"api_key": key})
    assert outcome.status == "ok", outcome.summary()
    assert "LLM_KEY" not in outcome.info
    assert "OPENAI_API_KEY" not in outcome.info
    assert "VISIBLE_SETTING" not in outcome.info
    assert outcome.log_path is not None
    first = outcome.log_path.read_text().splitlines()[0]
    assert first.startswith("[isolate] withheld from the agent's environment: ")
    assert "LLM_KEY (holds a secret of this episode)" in first
    assert "OPENAI_API_KEY" in first
    # (the machine may have credential-like variables of its own in the same group)
    assert re.search(r"OPENAI_API_KEY[^;]* \(looks like a credential\)", first)
    assert "VISIBLE_SETTING (excluded by inherit_env '!VISIBLE_*')" in first
    assert key not in first
    assert "sk-parent" not in first


def test_an_empty_exclusion_is_rejected() -> None:
    with pytest.raises(ValueError, match="inherit_env: invalid name '!'"):
        isolate.EpisodeSpec(inherit_env=("*", "!"))


@pytest.mark.parametrize(
    ("inherit", "passed", "withheld"),
    [
        # an exact name beats an exclusion and the credential rule; a pattern does not
        (
            ("*", "!PYTHON*", "PYTHONPATH", "HF_TOKEN"),
            {"PYTHONPATH", "HF_TOKEN", "HOME"},
            {"A_KEY_TOKEN", "PYTHONHOME"},
        ),
        (("H*",), {"HOME"}, {"HF_TOKEN"}),
        (("PATH",), set(), set()),  # names not asked for are not reported
        (("*", "!*"), set(), {"HOME", "HF_TOKEN", "A_KEY_TOKEN", "PYTHONPATH", "PYTHONHOME"}),
    ],
)
def test_split_env_rules(inherit: tuple[str, ...], passed: set[str], withheld: set[str]) -> None:
    parent = {
        "HOME": "/h",
        "HF_TOKEN": "t",
        "A_KEY_TOKEN": "k",
        "PYTHONPATH": "/p",
        "PYTHONHOME": "/ph",
    }
    for _ in range(2):  # the second time from the cache of verdicts
        env, held = _internals.split_env(parent, inherit)
        assert (set(env), set(held)) == (passed, withheld)
        assert all(env[n] == parent[n] for n in env)
        parent = {k: v + "2" for k, v in parent.items()}  # values are never cached
