"""The real command line, driven in subprocesses (and a pseudo-terminal)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pty
import py_compile
import re
import select
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from isolate._cli.batch.job import RecordPlan
from isolate._cli.doctor import _usable_bytecode
from isolate._cli.main import build_parser

from . import _internals
from .conftest import SLOW, Agents, wait_for

SCRIPTED = Path(__file__).resolve().parents[1] / "examples" / "scripted_agent"
URL = "http://127.0.0.1:9/v1"


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "LOG_DIR")}
    env.update(extra)
    return env


def write_record(agents: Agents, instance_id: str = "cli-1", **behaviour: Any) -> Path:
    path = agents.tmp / f"{instance_id}.json"
    record = {
        "instance_id": instance_id,
        "problem_statement": "x",
        "behaviour": behaviour,
        # The record's econfig plays the workflow's part: PID_DIR marks this test's processes.
        "econfig": {"env": {"PID_DIR": str(agents.pids)}},
    }
    path.write_text(json.dumps(record))
    return path


def isolate_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "isolate", *args],
        capture_output=True,
        text=True,
        env=env or cli_env(),
        timeout=timeout * SLOW,
        stdin=subprocess.DEVNULL,
    )


def run_args(agents: Agents, record: Path, *extra: str) -> list[str]:
    return [
        "run",
        str(record),
        "--agent-root",
        str(SCRIPTED),
        "--base-url",
        URL,
        "--no-endpoint-check",  # URL is a closed port: the scripted agent never calls it
        "--log-dir",
        str(agents.logs),
        "--kill-grace",
        "0.5",
        *extra,
    ]


def bundles(agents: Agents) -> list[Path]:
    return sorted(p for p in agents.logs.iterdir() if p.is_dir())


@pytest.mark.parametrize("command", ["run", "batch", "report", "doctor", "demo", "scripted-llm"])
def test_every_command_says_what_it_does_in_its_help(command: str) -> None:
    """Not only the usage line: a description, and the exit statuses where it has several."""
    done = isolate_cli(command, "--help")
    assert done.returncode == 0, done.stderr
    usage, _, rest = done.stdout.partition("\n\n")
    description = rest.split("\n\noptions:")[0].split("\n\npositional arguments:")[0]
    description = " ".join(description.split())  # as wrapped to the terminal's width
    assert usage.startswith(f"usage: isolate {command}")
    assert len(description.split()) >= 8, done.stdout
    if command in ("run", "doctor", "demo"):
        assert "Exit status" in description, description


def test_run_ok_prints_the_outcome_and_leaves_a_bundle(agents: Agents, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-cli-file-key\n")
    record = write_record(agents, report=True, key_digest=True, print="agent says hi")
    proc = isolate_cli(*run_args(agents, record, "--api-key-file", str(key_file)))
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert outcome["status"] == "ok"
    assert outcome["reward"] == 1.0
    assert "isolate: episode cli-1." in proc.stderr
    assert "ok, reward 1.0" in proc.stderr
    [bundle] = bundles(agents)
    names = {p.name for p in bundle.iterdir()}
    assert {"record.json", "spec.json", "kwargs.json", "outcome.json"} <= names
    assert any(n.endswith(".log") for n in names)
    assert json.loads((bundle / "record.json").read_text())["instance_id"] == "cli-1"
    assert json.loads((bundle / "kwargs.json").read_text())["override_base_url"] == URL
    report = json.loads((agents.logs / "cli-1.json").read_text())
    assert report["key_digest"] == hashlib.sha256(b"sk-cli-file-key").hexdigest()
    for path in bundle.iterdir():
        assert b"sk-cli-file-key" not in path.read_bytes()
    assert "sk-cli-file-key" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("behaviour", "extra", "status", "code"),
    [
        ({"raise": "boom"}, [], "agent_error", 10),
        ({"crash": "segv"}, [], "crashed", 11),
        ({"sleep": 60}, ["--timeout", "1"], "timeout", 12),
        ({"reward": "nan"}, [], "protocol_error", 13),
        ({}, ["--entrypoint", "nowhere.lifecycle:run"], "setup_error", 14),
    ],
)
def test_exit_status_per_outcome(
    agents: Agents, behaviour: dict[str, Any], extra: list[str], status: str, code: int
) -> None:
    record = write_record(agents, **behaviour)
    proc = isolate_cli(*run_args(agents, record, *extra))
    assert proc.returncode == code, proc.stderr
    assert json.loads(proc.stdout)["status"] == status
    assert status in proc.stderr


def test_api_key_from_env_name(agents: Agents) -> None:
    record = write_record(agents, report=True, key_digest=True)
    env = cli_env(MY_KEY="sk-from-my-env")
    proc = isolate_cli(*run_args(agents, record, "--api-key-env", "MY_KEY"), env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((agents.logs / "cli-1.json").read_text())
    assert report["key_digest"] == hashlib.sha256(b"sk-from-my-env").hexdigest()
    assert report["env_has_key"] is False


def test_there_is_no_api_key_option(agents: Agents) -> None:
    record = write_record(agents)
    proc = isolate_cli(*run_args(agents, record, "--api-key", "sk-never-on-argv"))
    assert proc.returncode == 2
    assert "unrecognized arguments: --api-key" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run"], "give RECORD.json or --replay DIR"),
        (["run", "/nonexistent/record.json", "--base-url", URL], "cannot read"),
        (["run", "{record}"], "--base-url is required"),
        (["run", "{record}", "--base-url", URL, "--timeout", "-1"], "timeout"),
        (
            ["run", "{record}", "--base-url", URL, "--timeout", "nan"],
            "argument --timeout: must be a finite number of seconds greater than 0, not 'nan'",
        ),
        (
            ["run", "{record}", "--base-url", URL, "--kill-grace", "inf"],
            "argument --kill-grace: must be a finite number of seconds of 0 or more, not 'inf'",
        ),
        (
            ["run", "{record}", "--base-url", URL, "--cancel-grace", "-1"],
            "argument --cancel-grace: must be a finite number of seconds of 0 or more, not '-1'",
        ),
        (
            ["run", "{record}", "--base-url", URL, "--exit-grace", "nan"],
            "argument --exit-grace: must be a finite number of seconds of 0 or more, not 'nan'",
        ),
        (["run", "--replay", "{tmp}", "--cancel-grace", "1"], "drop --cancel-grace"),
        (
            ["run", "{record}", "--base-url", URL, "--status-interval", "0"],
            "argument --status-interval: must be a finite number of seconds greater than 0",
        ),
        (
            ["run", "{record}", "--base-url", "not-a-url"],
            "--base-url 'not-a-url' is not an http(s) URL",
        ),
        (["run", "{record}", "--base-url", "http://h:port/v1"], "is not an http(s) URL"),
        # The flag, not the spec's field, is named.
        (
            ["run", "{record}", "--base-url", URL, "--entrypoint", "no-colon"],
            "error: --entrypoint: entrypoint must look like 'package.module:function'",
        ),
        (
            ["run", "{bad_grace}", "--base-url", URL, "--kill-grace", "1"],
            "error: econfig.kill_grace: Input should be greater than or equal to 0",
        ),
        (
            # The key is read last, once the rest of the command is known to be right.
            ["run", "{record}", "--agent-root", str(SCRIPTED), "--base-url", URL]
            + ["--no-endpoint-check", "--api-key-env", "NOT_SET_ANYWHERE"],
            "not set",
        ),
        (["run", "--replay", "{tmp}", "--agent-type", "cc"], "drop --agent-type"),
        (["run", "--replay", "{tmp}"], "not a replay bundle"),
    ],
)
def test_usage_errors(agents: Agents, args: list[str], message: str) -> None:
    record = write_record(agents)
    bad_grace = agents.tmp / "bad-grace.json"
    bad_grace.write_text(json.dumps({"instance_id": "g", "econfig": {"kill_grace": -1}}))
    args = [a.format(record=record, tmp=agents.tmp, bad_grace=bad_grace) for a in args]
    proc = isolate_cli(*args, "--log-dir", str(agents.logs))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not agents.logs.exists()  # refused before anything started


def test_the_dummy_key_is_not_announced_before_an_unrelated_error(agents: Agents) -> None:
    """No key option and no terminal: the agent root that does not exist is the one line."""
    record = write_record(agents)
    missing = agents.tmp / "no-such-root"
    args = ["run", str(record), "--base-url", URL, "--agent-root", str(missing)]
    proc = isolate_cli(*args, "--log-dir", str(agents.logs))
    assert proc.returncode == 2
    assert proc.stderr == (
        f"isolate: error: agent root {missing} does not exist: give the agent's checkout with "
        "--agent-root (or AWEAGENT_ROOT in the environment)\n"
    )


def test_invalid_json_record(agents: Agents) -> None:
    bad = agents.tmp / "bad.json"
    bad.write_text("{not json")
    proc = isolate_cli("run", str(bad), "--base-url", URL)
    assert proc.returncode == 2
    assert "is not valid JSON" in proc.stderr


def test_grace_flags_set_the_spec_and_the_record_overrides_them(agents: Agents) -> None:
    plain = write_record(agents)
    own = write_record(agents, "own")
    record = json.loads(own.read_text())
    record["econfig"]["cancel_grace"] = 4
    own.write_text(json.dumps(record))
    flags = ("--cancel-grace", "1.5", "--exit-grace", "0.25")
    for record in (plain, own):
        proc = isolate_cli(*run_args(agents, record, *flags))
        assert proc.returncode == 0, proc.stderr
    graces = {}
    for bundle in bundles(agents):
        spec = json.loads((bundle / "spec.json").read_text())
        name = json.loads((bundle / "record.json").read_text())["instance_id"]
        graces[name] = (spec["cancel_grace"], spec["exit_grace"])
    assert graces == {"cli-1": (1.5, 0.25), "own": (4.0, 0.25)}


def test_replay_reruns_the_bundle_with_a_new_key(agents: Agents) -> None:
    record = write_record(agents, report=True, key_digest=True, reward=0.5)
    first = isolate_cli(
        *run_args(agents, record, "--agent-type", "cc", "--api-key-env", "K"),
        env=cli_env(K="sk-first"),
    )
    assert first.returncode == 0, first.stderr
    [bundle] = bundles(agents)
    replay = isolate_cli(
        "run",
        "--replay",
        str(bundle),
        "--no-endpoint-check",
        "--log-dir",
        str(agents.logs),
        "--api-key-env",
        "K",
        env=cli_env(K="sk-second"),
    )
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["reward"] == 0.5
    assert len(bundles(agents)) == 2
    report = json.loads((agents.logs / "cli-1.json").read_text())
    assert report["kwargs"]["agent_type"] == "cc"
    assert report["key_digest"] == hashlib.sha256(b"sk-second").hexdigest()


def test_replay_without_a_key_option_says_it_uses_dummy(agents: Agents) -> None:
    record = write_record(agents, report=True, key_digest=True)
    first = isolate_cli(*run_args(agents, record, "--api-key-env", "K"), env=cli_env(K="sk-1"))
    assert first.returncode == 0, first.stderr
    assert "dummy" not in first.stderr
    [bundle] = bundles(agents)
    replay = isolate_cli(
        "run", "--replay", str(bundle), "--no-endpoint-check", "--log-dir", str(agents.logs)
    )
    assert replay.returncode == 0, replay.stderr
    assert (
        "isolate: no API key given (--api-key-file, --api-key-env, OPENAI_API_KEY) and stdin "
        'is not a terminal to ask on: using "dummy"'
    ) in replay.stderr
    report = json.loads((agents.logs / "cli-1.json").read_text())
    assert report["key_digest"] == hashlib.sha256(b"dummy").hexdigest()


def test_help_tells_what_the_demo_runs() -> None:
    proc = isolate_cli("--help")
    assert proc.returncode == 0
    assert "run real episodes against a scripted LLM" in proc.stdout


def test_plain_status_lines_when_not_a_terminal(agents: Agents) -> None:
    record = write_record(agents, sleep=1.5, spawn=2)
    proc = isolate_cli(*run_args(agents, record, "--status-interval", "0.2"))
    assert proc.returncode == 0, proc.stderr
    status = [ln for ln in proc.stderr.splitlines() if " procs | " in ln]
    assert status, proc.stderr
    # Shim, worker, two sleeps, and with a PID namespace in a user namespace its relay (the
    # shim's outer half; a privileged parent starts the shim as PID 1 itself).
    auto = _internals.resolve("auto", None)
    count = 4 + ("pidns" in _internals.layers(auto[0]) and _internals.needs_userns())
    assert any(f" {count} procs | " in ln for ln in status)
    assert "\r" not in proc.stderr


def _read_until(fd: int, needle: bytes, timeout: float) -> bytes:
    out = b""
    end = time.monotonic() + timeout * SLOW
    while needle not in out:
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no {needle!r} in {out!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            out += chunk
    return out


def test_key_prompt_on_a_terminal_does_not_echo(agents: Agents) -> None:
    record = write_record(agents, report=True, key_digest=True, sleep=1.2)
    main, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "isolate", *run_args(agents, record)],
        stdin=secondary,
        stdout=subprocess.PIPE,
        stderr=secondary,
        env=cli_env(),
        start_new_session=True,
    )
    os.close(secondary)
    try:
        seen = _read_until(main, b"API key (not echoed): ", 20.0)
        os.write(main, b"sk-typed-at-the-prompt\n")
        seen += _read_until(main, b"isolate: replay with", 30.0)
        assert proc.wait(timeout=30 * SLOW) == 0
        assert proc.stdout is not None
        outcome = json.loads(proc.stdout.read())
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
        os.close(main)
    assert b"sk-typed-at-the-prompt" not in seen
    assert outcome["status"] == "ok"
    assert b" procs | " in seen  # the live status line, redrawn in place
    assert b"\r\x1b[2K" in seen
    report = json.loads((agents.logs / "cli-1.json").read_text())
    assert report["key_digest"] == hashlib.sha256(b"sk-typed-at-the-prompt").hexdigest()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_tears_the_episode_down(agents: Agents, sig: signal.Signals) -> None:
    record = write_record(agents, spawn=3, sleep=120)
    proc = subprocess.Popen(
        [sys.executable, "-m", "isolate", *run_args(agents, record)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    try:
        pids = agents.wait_pids(3, timeout=20.0)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20 * SLOW)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert b"interrupted" in err
    assert out == b""
    assert len(pids) == 3
    wait_for(lambda: not agents.left(), 2.0, "children gone")
    # The interrupted episode's outcome is kept in its bundle, as a finished one's is.
    kept = _outcome_file(err)
    outcome = json.loads(kept.read_text())
    assert outcome["status"] == "timeout"
    assert outcome["error"]["message"].startswith("cancelled after ")
    assert outcome["killed"] >= 3
    assert outcome["log_path"] == str(kept.parent / f"{outcome['episode_id']}.log")


def _outcome_file(stderr: bytes) -> Path:
    """The outcome file the interrupted run named on stderr."""
    found = re.search(rb"^isolate: outcome (.+/outcome\.json)$", stderr, re.MULTILINE)
    assert found, stderr
    return Path(found.group(1).decode())


def test_ctrl_c_says_what_it_waits_for_and_a_second_one_kills_at_once(agents: Agents) -> None:
    """The agent's clean-up would take 60 s, within a --cancel-grace of 90: the first Ctrl-C
    says so and how to skip it; the second kills the episode at once."""
    record = write_record(agents, spawn=2, sleep=120, slow_cleanup=60)
    proc = subprocess.Popen(
        [sys.executable, "-m", "isolate", *run_args(agents, record, "--cancel-grace", "90")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    try:
        agents.wait_pids(2, timeout=20.0)
        proc.send_signal(signal.SIGINT)
        assert proc.stderr is not None
        seen = b""
        while b"interrupt again" not in seen:
            line = proc.stderr.readline()
            assert line, seen
            seen += line
        assert b"gets up to 90 s to clean up (--cancel-grace)" in seen
        assert proc.poll() is None  # waiting for the clean-up
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20 * SLOW)  # not the 60 s of the clean-up
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert proc.returncode == 130, err
    assert b"killing the episode's processes now" in err
    assert out == b""
    outcome = json.loads(_outcome_file(err).read_text())
    assert outcome["cleanup"] == "cut short"
    # The agent's worker and its two sleepers, killed by the second Ctrl-C, are counted.
    assert outcome["killed"] >= 3, outcome
    assert f"{outcome['killed']} killed" in err.decode()
    wait_for(lambda: not agents.left(), 2.0 * SLOW, "the episode's processes gone")


def test_doctor_on_a_good_checkout() -> None:
    proc = isolate_cli("doctor", "--agent-root", str(SCRIPTED))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
    assert "shim speaks protocol 1" in proc.stdout
    assert "the shim starts from its cached bytecode" in proc.stdout
    assert "aweagent.lifecycle:run_agent_with_reward imports (async" in proc.stdout
    assert "accepts (data, **the workflow's keyword arguments)" in proc.stdout
    assert "pydantic 2." in proc.stdout  # this interpreter has pydantic


def test_doctor_tells_whether_a_move_into_a_leaf_waits_for_a_grace_period() -> None:
    lacks = _internals.lacks_favordynmods
    plain = ("cgroup2", "/", "/sys/fs/cgroup/unified", {"rw", "nsdelegate"})
    favoured = ("cgroup2", "/", "/sys/fs/cgroup", {"rw", "favordynmods"})
    v1 = ("cgroup", "/", "/sys/fs/cgroup/pids", {"rw", "pids"})
    assert lacks(Path("/sys/fs/cgroup/unified/a/isolate"), [favoured, plain, v1]) is True
    assert lacks(Path("/sys/fs/cgroup/a/isolate"), [favoured, v1]) is False
    assert lacks(Path("/sys/fs/cgroup/unifiedx/isolate"), [plain]) is None
    assert lacks(Path("/srv/isolate"), [favoured, plain, v1]) is None
    # What the doctor says is what this machine's mount says.
    v2 = _internals.cgroups().v2
    waits = v2 is not None and bool(_internals.move_waits_for_rcu(v2))
    proc = isolate_cli("doctor", "--agent-root", str(SCRIPTED))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("cgroup2 mount option favordynmods" in proc.stdout) is waits, proc.stdout


def test_doctor_under_a_bare_interpreter(bare_venv: Path) -> None:
    proc = isolate_cli("doctor", "--agent-root", str(SCRIPTED), "--python", str(bare_venv))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pydantic not installed, openai not installed, litellm not installed" in proc.stdout


def test_a_missing_agent_root_names_the_flag(tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"instance_id": "x", "problem_statement": "p"}))
    missing = tmp_path / "nowhere"
    env = {k: v for k, v in cli_env().items() if not k.endswith("AGENT_ROOT")}
    logs = tmp_path / "logs"
    proc = isolate_cli(
        "run", str(record), "--agent-root", str(missing), "--base-url", URL, "--log-dir",
        str(logs), env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"isolate: error: agent root {missing} does not exist: give the agent's checkout with "
        "--agent-root (or AWEAGENT_ROOT in the environment)"
    )
    assert not logs.exists()  # refused before anything started


def test_doctor_refuses_a_malformed_entrypoint_as_run_does() -> None:
    proc = isolate_cli("doctor", "--entrypoint", "foo")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == (
        "isolate doctor: error: argument --entrypoint: entrypoint must look like "
        "'package.module:function', got 'foo'"
    )


def test_doctor_tells_stale_shim_bytecode(tmp_path: Path) -> None:
    source = tmp_path / "shim.py"
    source.write_text("X = 1\n")
    pyc = Path(py_compile.compile(str(source), doraise=True))
    magic = importlib.util.MAGIC_NUMBER
    assert _usable_bytecode(pyc, magic, source)
    assert not _usable_bytecode(pyc, b"\x00\x00\r\n", source)  # another Python's
    assert not _usable_bytecode(tmp_path / "missing.pyc", magic, source)
    source.write_text("X = 22\n")  # edited after compiling: Python would compile again
    assert not _usable_bytecode(pyc, magic, source)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--agent-root", "/nonexistent/root"], "agent root /nonexistent/root does not exist"),
        (["--agent-root", __file__], f"agent root {__file__} is not a directory"),
        (
            ["--agent-root", str(SCRIPTED), "--entrypoint", "aweagent.lifecycle:nope"],
            "does not import",
        ),
        (["--agent-root", str(SCRIPTED), "--entrypoint", "os.path:join"], "does not accept"),
        # the shim's own loader: what an episode could not call, doctor does not pass either
        (["--agent-root", str(SCRIPTED), "--entrypoint", "os:sep"], "os:sep is a str, not a"),
        (["--agent-root", str(SCRIPTED), "--python", "/nonexistent/python"], "cannot start"),
    ],
)
def test_doctor_failures(args: list[str], message: str) -> None:
    proc = isolate_cli("doctor", *args)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout
    assert message in proc.stdout


def test_doctor_stops_quietly_when_its_reader_goes_away() -> None:
    # `isolate doctor | head -1`, without the shell's timing: the reader closes after a line.
    proc = subprocess.Popen(
        [sys.executable, "-m", "isolate", "doctor", "--agent-root", str(SCRIPTED)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(PYTHONUNBUFFERED="1"),  # each line written as printed, as on a terminal
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith(b"isolate doctor: ")
    proc.stdout.close()
    _, err = proc.communicate(timeout=60 * SLOW)
    assert proc.returncode == 141, err  # 128 + SIGPIPE, as `head` users expect
    assert err == b""


def test_doctor_shows_all_a_failing_interpreter_said(tmp_path: Path) -> None:
    # As a pyenv shim for a version that is not selected: the reason is the first line.
    python = tmp_path / "python3.7"
    python.write_text(
        "#!/bin/sh\n"
        "echo 'pyenv: python3.7: command not found' >&2\n"
        "echo >&2\n"
        "echo 'Note: See pyenv help global for tips.' >&2\n"
        "exit 127\n"
    )
    python.chmod(0o755)
    proc = isolate_cli("doctor", "--agent-root", str(SCRIPTED), "--python", str(python))
    assert proc.returncode == 1
    assert f"FAIL  interpreter: {python} exited with 127; its stderr:" in proc.stdout
    assert "        pyenv: python3.7: command not found\n" in proc.stdout
    assert "        Note: See pyenv help global for tips.\n" in proc.stdout
    assert proc.stdout.endswith("isolate doctor: problems found\n")


def test_doctor_stops_at_an_interpreter_older_than_3_9() -> None:
    python = Path("~/.pyenv/versions/3.8.18/bin/python3.8").expanduser()
    if not python.exists():
        pytest.skip(f"{python} is not installed")
    proc = isolate_cli("doctor", "--agent-root", str(SCRIPTED), "--python", str(python))
    assert proc.returncode == 1
    verdicts = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.startswith("  ")]
    assert verdicts == ["ok", "FAIL", "skip"], proc.stdout  # no check after it claims ok
    assert "is Python 3.8.18; the shim needs 3.9+" in proc.stdout


def test_scripted_llm_on_a_taken_port_says_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = isolate_cli("scripted-llm", "--port", str(port))
    assert proc.returncode == 1
    assert f"isolate scripted-llm: error: cannot listen on 127.0.0.1:{port}: " in proc.stderr
    assert "Traceback" not in proc.stderr
    bad = isolate_cli("scripted-llm", "--port", "70000")
    assert bad.returncode == 2
    assert "argument --port: '70000' is not a port number (0 to 65535)" in bad.stderr


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    proc = isolate_cli("demo", env=cli_env(LOG_DIR=str(tmp_path / "logs")), timeout=120.0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all as expected" in proc.stdout
    lines = {
        ln.split()[0] + ln.split()[1]: ln
        for ln in proc.stdout.splitlines()
        if ln.startswith("demo__")
    }
    assert "demo__calc-1ok" in lines
    assert "demo__hang-1timeout" in lines
    assert "demo__calc-1agent_error" in lines
    assert "rejected for a wrong key: 1" in proc.stdout


def test_console_script_help() -> None:
    # The entry point pip wrote for this environment, not `python -m isolate`.
    script = Path(sysconfig.get_path("scripts")) / "isolate"
    assert script.is_file()
    proc = subprocess.run(
        [str(script), "run", "--help"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60 * SLOW,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: isolate run ")
    for code in (
        "10 agent_error",
        "11 crashed",
        "12 timeout",
        "13 protocol_error",
        "14 setup_error",
    ):
        assert code in proc.stdout.replace("\n", " ").replace("  ", " ")


def test_run_with_the_sandbox(agents: Agents) -> None:

    if _internals.landlock_abi() < 3:
        pytest.skip("the default Sandbox() needs Landlock ABI 3 here")
    extra_dir = agents.tmp / "extra"
    extra_dir.mkdir()
    record = write_record(agents, report=True, reward=0.25)
    proc = isolate_cli(
        *run_args(agents, record, "--sandbox-write", str(extra_dir)), env=cli_env(LOG_DIR="")
    )
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert outcome["reward"] == 0.25
    enforced = "\n".join(outcome["sandbox"]["enforced"])
    assert str(extra_dir) in enforced
    # The episode's own result_dir and working directory, in its bundle: not the log dir.
    bundle = agents.logs.resolve() / outcome["episode_id"]
    writes = next(ln for ln in enforced.splitlines() if ln.startswith("writes: only "))
    writable = writes.removeprefix("writes: only ").split(" and /dev/null")[0].split(", ")
    assert str(bundle / "result") in writable
    assert str(bundle / "work") in writable
    assert str(agents.logs.resolve()) not in writable
    assert outcome["sandbox"]["missing"] == []
    assert (bundle / "result" / "cli-1.json").exists()
    spec = json.loads((bundle / "spec.json").read_text())
    assert spec["cwd"] == str(bundle / "work")


def test_run_with_an_allow_list_reaches_the_base_url_through_the_proxy(agents: Agents) -> None:
    record = write_record(agents, report=True, reward=0.5)
    proc = isolate_cli(*run_args(agents, record, "--network", "api.example.com"))
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert outcome["reward"] == 0.5
    port = urlsplit(URL).port
    line = f"network: only through the proxy, to api.example.com, 127.0.0.1:{port}"
    assert line in outcome["sandbox"]["enforced"]
    assert outcome["sandbox"]["refused"] == {}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--network", "http://api.example.com"], "--network: "),
        (["--network", "none", "--network", "api.example.com"], "cannot be combined"),
    ],
)
def test_a_bad_network_flag_is_refused_before_anything_starts(
    agents: Agents, flags: list[str], message: str
) -> None:
    record = write_record(agents)
    proc = isolate_cli(*run_args(agents, record, *flags))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not agents.logs.exists()  # nothing started: not even the log directory


@pytest.mark.parametrize("command", ["run", "batch"])
@pytest.mark.parametrize("where", ["a file", "under /proc"])
def test_a_log_dir_that_cannot_be_written_is_one_line_and_exit_2(
    agents: Agents, command: str, where: str
) -> None:
    record = write_record(agents)
    afile = agents.tmp / "afile"
    afile.write_text("")
    log_dir = str(afile) if where == "a file" else "/proc/nope"
    args = run_args(agents, record, "--log-dir", log_dir)
    if command == "batch":
        records = agents.tmp / "records.jsonl"
        records.write_text(json.dumps(json.loads(record.read_text())) + "\n")
        args = ["batch", str(records), "--out", str(agents.tmp / "out.jsonl"), *args[2:]]
    proc = isolate_cli(*args)
    assert proc.returncode == 2, proc.stderr
    error = f"isolate: error: --log-dir {log_dir}: "
    assert [line for line in proc.stderr.splitlines() if "Traceback" in line] == []
    assert error in proc.stderr
    assert ("not a directory" if where == "a file" else "No such file") in proc.stderr


def test_a_records_own_timeout_wins_over_the_flag(agents: Agents) -> None:
    record = write_record(agents, sleep=60)
    data = json.loads(record.read_text())
    data["econfig"]["timeout"] = 1
    record.write_text(json.dumps(data))
    started = time.monotonic()
    proc = isolate_cli(*run_args(agents, record, "--timeout", "300", "--cancel-grace", "1"))
    assert proc.returncode == 12, proc.stderr
    # The record's 1 s, half of it for the teardown (docs/cancellation.md): the agent's 0.5 s.
    assert "no result within 0.5 s" in json.loads(proc.stdout)["error"]["message"]
    assert time.monotonic() - started < 30 * SLOW


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-3, "econfig.timeout: Input should be greater than 0"),
        ("soon", "econfig.timeout must be a number of seconds, got 'soon'"),
    ],
)
def test_a_records_invalid_timeout_is_named(agents: Agents, value: Any, message: str) -> None:
    argv = ["run", "r.json", "--agent-root", str(SCRIPTED), "--base-url", URL, "--timeout", "5"]
    plan = RecordPlan(build_parser().parse_args(argv))
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.build({"instance_id": "x", "econfig": {"timeout": value}})
    # The agent's time and its teardown (docs/cancellation.md) make up the timeout.
    for spec, timeout in (
        (plan.build({"instance_id": "x", "econfig": {"timeout": 7}})[0], 7),
        (plan.build({"instance_id": "x"})[0], 5),
    ):
        assert spec.timeout + spec.cancel_grace + spec.kill_grace == pytest.approx(timeout)


@pytest.mark.parametrize(
    ("tamper", "said"),
    [
        ("spec.json", "spec.json was changed after it ran"),
        ("record.json", "record.json was changed after it ran"),
        ("secret_env.json", "secret_env.json was added after it ran"),
    ],
)
def test_replay_refuses_a_bundle_changed_after_it_ran(
    agents: Agents, tamper: str, said: str
) -> None:
    record = write_record(agents, reward=0.5)
    first = isolate_cli(*run_args(agents, record))
    assert first.returncode == 0, first.stderr
    [bundle] = bundles(agents)
    path = bundle / tamper
    if path.exists():
        data = json.loads(path.read_text())
        if tamper == "spec.json":
            data.update(python="/tmp/planted-script", sandbox=None, containment="session")
        else:
            data["behaviour"] = {"reward": 1.0}
        path.write_text(json.dumps(data, indent=2) + "\n")
    else:
        path.write_text('["OPENAI_API_KEY"]\n')
    replay = isolate_cli("run", "--replay", str(bundle), "--log-dir", str(agents.logs))
    assert replay.returncode == 2, replay.stderr
    errors = [ln for ln in replay.stderr.splitlines() if ln.startswith("isolate: error:")]
    assert errors == [f"isolate: error: {bundle} is not replayed: {said} (digest.json)"]
    assert "Traceback" not in replay.stderr
    assert len(bundles(agents)) == 1  # nothing ran


def test_install_lines_name_what_the_extras_install() -> None:
    """The lines printed for an optional part install the extra's own requirements (the
    distribution is not published under its name): the same as pyproject.toml's extras."""
    import tomllib

    from isolate._cli.install import EXTRAS, install_line

    project = tomllib.loads((SCRIPTED.parents[1] / "pyproject.toml").read_text())["project"]
    extras = {k: tuple(v) for k, v in project["optional-dependencies"].items()}
    assert {k: extras[k] for k in EXTRAS} == EXTRAS
    assert install_line("report") == f"{sys.executable} -m pip install 'matplotlib>=3.7'"
    for command in (["batch", "--help"], ["report", "--help"], ["demo", "--help"]):
        proc = isolate_cli(*command)
        assert "episode-isolate[" not in proc.stdout
    text = " ".join(isolate_cli("batch", "--help").stdout.split())
    assert "pip install 'ray>=2.9'" in text


def test_help_points_at_pages_that_exist() -> None:
    """The pointers of the help texts name files of docs/, not a README section."""
    root = SCRIPTED.parents[1]
    for command in ("run", "batch", "doctor"):
        text = " ".join(isolate_cli(command, "--help").stdout.split())
        assert "README" not in text
        for page in re.findall(r"docs/[a-z_]+\.md", text):
            assert (root / page).is_file(), page
    assert "'none': its own loopback only, the LLM endpoint unreachable too" in " ".join(
        isolate_cli("run", "--help").stdout.split()
    )


def test_a_bare_doctor_says_what_to_pass_for_the_agent_root() -> None:
    """Without --agent-root or AWEAGENT_ROOT, the default (a sibling checkout of a clone) is
    not there: the failure says what to pass, not only a path."""
    from isolate.workflow import default_agent_root

    if default_agent_root().is_dir():
        pytest.skip("a sibling checkout of AReaL-SWEAgent is here")
    env = {k: v for k, v in cli_env().items() if not k.endswith("AGENT_ROOT")}
    proc = isolate_cli("doctor", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "\n  FAIL  no agent root given: pass --agent-root DIR, the agent's checkout (or set "
        f"AWEAGENT_ROOT)\n        the default, {default_agent_root()}, is a checkout of "
        "AReaL-SWEAgent beside a clone of isolate; there is none\n"
    ) in proc.stdout
