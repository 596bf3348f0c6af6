"""Secrets travel only in the handshake: never in an environment, argv, outcome, repr or log."""

from __future__ import annotations

import hashlib
import os
import secrets as _secrets
from pathlib import Path

import anyio
import pytest
from pydantic import SecretStr

import isolate

from .conftest import Agents, wait_for, wait_until

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
    for text in (repr(outcome), str(outcome), outcome.model_dump_json(), outcome.stderr_tail):
        assert key not in text
    assert outcome.log_path is not None
    log = outcome.log_path.read_bytes()
    assert b"the agent logs its key" in log
    assert key.encode() not in log


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
    allowed |= {"TERM", "PID_DIR", isolate.EPISODE_ENV}
    unexpected = [n for n in outcome.info if n not in allowed and not n.startswith("LC_")]
    # The interpreter itself may add a few (e.g. LC_CTYPE coercion); nothing else.
    assert unexpected == [], unexpected


def test_wait_for_is_bounded(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="timed out"):
        wait_for(lambda: False, 0.05, "nothing")
