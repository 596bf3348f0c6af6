"""``isolate batch``: real drivers in subprocesses, real episodes, real signals."""

from __future__ import annotations

import json
import os
import pty
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest

from isolate._cli.batch import parse_size
from isolate._cli.batch.scheduler import RetryPolicy

from . import _internals
from .conftest import (
    SLOW,
    Agents,
    episode_processes,
    is_gone,
    remove_dead_parents_leaves,
    wait_for,
)
from .test_cli import SCRIPTED, URL, cli_env, isolate_cli

# Unique per run: a scan of /proc must not find another test session's drivers.
KEY = f"sk-batch-{secrets.token_hex(12)}"

# A test agent for what the scripted one cannot do: fail the first N attempts of a record
# (attempts are counted in a file), and hold while a file exists.
FLAKY_AGENT = """
import os, time

def run(data, **kwargs):
    b = data.get("behaviour") or {}
    pids = os.environ["PID_DIR"]
    with open(os.path.join(pids, "attempts-" + data["instance_id"]), "a") as f:
        f.write("x")
        count = f.tell()
    if count <= b.get("crash_first", 0):
        os._exit(3)
    if b.get("hold"):
        open(os.path.join(pids, "holding-" + data["instance_id"]), "w").close()
        while os.path.exists(b["hold"]):
            time.sleep(0.02)
    return float(b.get("reward", 1.0))
"""


def record(agents: Agents, instance_id: str, **behaviour: Any) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "behaviour": behaviour,
        # Marks this test's processes for the conftest sweep check.
        "econfig": {"env": {"PID_DIR": str(agents.pids)}},
    }


def write_records(path: Path, lines: list[Any]) -> Path:
    """Records as JSON lines; a str is written as is (for malformed lines)."""
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.write_text(text)
    return path


def batch_args(agents: Agents, records: Path, out: Path, *extra: str) -> list[str]:
    return [
        "batch",
        str(records),
        "--out",
        str(out),
        "--agent-root",
        str(SCRIPTED),
        "--base-url",
        URL,
        "--log-dir",
        str(agents.logs),
        "--kill-grace",
        "0.2",
        "--api-key-env",
        "BATCH_KEY",
        "--no-endpoint-check",  # URL is a closed port: these agents never call it
        *extra,
    ]


def flaky_args(agents: Agents, records: Path, out: Path, *extra: str) -> list[str]:
    (agents.root / "flaky_agent.py").write_text(textwrap.dedent(FLAKY_AGENT))
    args = batch_args(agents, records, out, "--entrypoint", "flaky_agent:run", *extra)
    args[args.index("--agent-root") + 1] = str(agents.root)
    return args


def env() -> dict[str, str]:
    return cli_env(BATCH_KEY=KEY)


def results(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def final(path: Path) -> dict[str, dict[str, Any]]:
    return {e["instance_id"]: e for e in results(path) if e["final"]}


def start(args: list[str], tmp: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A driver in the background, its output in files (a pipe could fill up and block it)."""
    with open(tmp / "driver.out", "w") as out, open(tmp / "driver.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "isolate", *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            text=True,
            env=env or cli_env(BATCH_KEY=KEY),
        )


def stderr_on_a_terminal(
    argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 60.0
) -> tuple[int, str, str]:
    """Run ``argv`` with stderr on a pseudo-terminal and stdout in a file, as a user at a
    terminal who redirects the summary; its exit status, stdout and what the terminal got."""
    main, secondary = pty.openpty()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=secondary
        )
        os.close(secondary)
        seen = b""
        end = time.monotonic() + timeout * SLOW
        try:
            while time.monotonic() < end:
                if select.select([main], [], [], 0.5)[0]:
                    try:
                        chunk = os.read(main, 65536)
                    except OSError:  # EIO: the last writer closed the terminal
                        break
                    if not chunk:
                        break
                    seen += chunk
            code = proc.wait(timeout=10 * SLOW)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(main)
        out.seek(0)
        return code, out.read().decode(), seen.decode("utf-8", "replace")


def line_count(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


# --- the whole command ----------------------------------------------------------------------


def test_mixed_batch_with_exact_accounting(agents: Agents) -> None:
    plan = (
        [("ok", {"reward": [1.0, 0.0, 0.5][i % 3]}) for i in range(22)]
        + [("agent_error", {"raise": "boom"})] * 8
        + [("crashed", {"crash": ["segv", "exit"][i % 2]}) for i in range(7)]
        + [("protocol_error", {"reward": "nan"})] * 3
        + [("timeout", {"sleep": 60, "spawn": 1})] * 5
    )
    lines: list[Any] = [record(agents, f"m-{i}", **b) for i, (_, b) in enumerate(plan)]
    malformed = {
        '{"instance_id": "cut-short", ': "not valid JSON",
        "[1, 2]": "not a JSON object",
        '{"problem_statement": "no id"}': 'no "instance_id"',
        json.dumps({"instance_id": "m-3"}): "duplicate instance_id 'm-3' (first on line 4)",
        json.dumps({"instance_id": "bad-grace", "econfig": {"kill_grace": -1}}): "kill_grace",
    }
    for n, text in enumerate(malformed):
        lines.insert(5 + 9 * n, text)
    records = write_records(agents.tmp / "records.jsonl", lines)
    out = agents.tmp / "results.jsonl"
    args = batch_args(agents, records, out, "--retries", "1", "--timeout", "3")
    args += ["--concurrency", "8", "--status-interval", "0.5"]

    refused = isolate_cli(*args, env=env())
    assert refused.returncode == 2, refused.stderr
    for n, expected in enumerate(malformed.values()):
        assert f"records.jsonl:{6 + 9 * n}: " in refused.stderr
        assert expected in refused.stderr
    assert "5 invalid record(s)" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not out.exists()
    assert not agents.logs.exists()

    proc = isolate_cli(*args, "--skip-invalid", env=env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("isolate: skipping ") == 5
    entries = results(out)
    by_id = final(out)
    assert len(by_id) == 45
    expected_status = {f"m-{i}": status for i, (status, _) in enumerate(plan)}
    assert {i: e["status"] for i, e in by_id.items()} == expected_status
    assert Counter(e["status"] for e in by_id.values()) == {
        "ok": 22,
        "agent_error": 8,
        "crashed": 7,
        "protocol_error": 3,
        "timeout": 5,
    }
    # One retry for crashed and protocol_error only; every attempt is a line of its own.
    attempts = Counter(e["instance_id"] for e in entries)
    for instance_id, status in expected_status.items():
        assert attempts[instance_id] == (2 if status in ("crashed", "protocol_error") else 1)
    assert len(entries) == 45 + 7 + 3
    for i, (status, behaviour) in enumerate(plan):
        entry = by_id[f"m-{i}"]
        assert entry["attempt"] == attempts[f"m-{i}"]
        if status == "ok":
            assert entry["reward"] == behaviour["reward"]
        assert Path(entry["log_path"]).is_file()
    assert by_id["m-30"]["signal"] == "SIGSEGV"
    assert by_id["m-31"]["exit_code"] == 3
    assert all(isinstance(e["killed"], int) for e in entries)
    auto = _internals.resolve("auto", None)
    assert {e["containment"] for e in entries} == {auto[0]}
    assert f"containment  {auto[0]} ({len(by_id)})" in proc.stdout
    assert all(
        e["error"]["type"] == "EpisodeTimeout" for e in by_id.values() if e["status"] == "timeout"
    )
    # The summary, and plain progress lines (not a terminal).
    assert " total " in proc.stdout
    assert "45" in proc.stdout
    assert "8/45 (17.8%)" in proc.stdout  # resolved: reward 1
    assert "episodes/s" in proc.stderr
    assert "\r" not in proc.stderr
    # The key went to the agents (they ran) and nowhere else.
    for path in [out, *agents.logs.rglob("*")]:
        assert not path.is_file() or KEY.encode() not in path.read_bytes()
    assert KEY not in proc.stdout + proc.stderr


def test_driver_killed_halfway_then_resumed(agents: Agents) -> None:
    records = write_records(
        agents.tmp / "records.jsonl",
        [record(agents, f"k-{i}", sleep=0.3, spawn=1) for i in range(40)],
    )
    out = agents.tmp / "results.jsonl"
    driver = start(batch_args(agents, records, out, "--concurrency", "6"), agents.tmp)
    wait_for(lambda: line_count(out) >= 20, 30, "half of the results")
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    before = out.read_bytes()
    assert len(results(out)) < 40
    # Each shim sees its stdin close and kills its tree (the agent and its sleep 300).
    marker = f"PID_DIR={agents.pids}".encode()
    wait_for(lambda: not episode_processes(marker), 3, "the episodes of the killed driver")

    # Resumed through another path to the same file: its lost attempts are found all the same.
    via = agents.tmp / "via"
    via.symlink_to(agents.tmp, target_is_directory=True)
    resume = batch_args(agents, records, via / out.name, "--concurrency", "6")
    proc = isolate_cli(*resume, env=env())
    assert proc.returncode == 0, proc.stderr
    assert "isolate: resuming: " in proc.stderr
    entries = results(out)
    assert out.read_bytes().startswith(before)  # nothing written before was touched
    finals = {e["instance_id"]: e for e in entries if e["final"]}
    assert sorted(finals) == sorted(f"k-{i}" for i in range(40))
    assert {e["status"] for e in finals.values()} == {"ok"}
    # The attempts in flight at the kill are on record, from their bundles: an infrastructure
    # failure with its true duration and log, or the outcome of one that had just ended.
    recovered = [e for e in entries if e.get("recovered")]
    assert recovered, proc.stderr
    assert f"{len(recovered)} attempt(s) of an earlier run had no line" in proc.stderr
    assert all(e["attempt"] == 1 for e in recovered)
    for entry in recovered:
        if entry["status"] == "ok":
            assert entry["final"]
            continue
        assert entry["status"] == "crashed"
        assert entry["infra"] is True
        assert entry["final"] is False
        assert entry["error"]["type"] == "DriverStopped"
        # From its start to its log's last write: 0 for one killed before it wrote any.
        assert 0 <= entry["duration_s"] < 30
        assert entry["log_path"] is None or Path(entry["log_path"]).is_file()
        again = finals[entry["instance_id"]]
        assert (again["attempt"], again["infra_failures"]) == (2, 1)
    others = [e for e in entries if not e.get("recovered")]
    assert {(e["status"], e["final"]) for e in others} == {("ok", True)}
    # A third run finds nothing lost and nothing to do.
    third = isolate_cli(*batch_args(agents, records, out, "--concurrency", "6"), env=env())
    assert third.returncode == 0, third.stderr
    assert "had no line" not in third.stderr
    assert len(results(out)) == len(entries)


def test_a_partial_last_line_is_dropped_and_its_episode_runs_again(agents: Agents) -> None:
    records = write_records(
        agents.tmp / "records.jsonl", [record(agents, f"p-{i}") for i in range(3)]
    )
    out = agents.tmp / "results.jsonl"
    assert isolate_cli(*batch_args(agents, records, out), env=env()).returncode == 0
    kept = [line for line in out.read_text().splitlines() if '"p-1"' not in line]
    out.write_text("\n".join(kept) + '\n{"instance_id": "p-1", "attempt": 1, "fin')

    proc = isolate_cli(*batch_args(agents, records, out), env=env())
    assert proc.returncode == 0, proc.stderr
    assert "ignored a partial last line" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(e["instance_id"] for e in results(out)) == ["p-0", "p-1", "p-2"]

    # A broken line anywhere else is not ours to guess about: stop, and say where.
    lines = out.read_text().splitlines()
    out.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    proc = isolate_cli(*batch_args(agents, records, out), env=env())
    assert proc.returncode == 2
    assert "results.jsonl:2 is not a result line" in proc.stderr


def test_retries_are_for_infrastructure_failures_and_each_attempt_is_recorded(
    agents: Agents,
) -> None:
    records = write_records(
        agents.tmp / "records.jsonl",
        [
            record(agents, "flaky", crash_first=1),
            record(agents, "always", crash_first=99),
            record(agents, "slow", hold=str(agents.tmp)),  # the directory exists: a timeout
        ],
    )
    out = agents.tmp / "results.jsonl"
    args = flaky_args(agents, records, out, "--retries", "2", "--retry-timeouts")
    proc = isolate_cli(*args, "--timeout", "2", env=env())
    assert proc.returncode == 0, proc.stderr
    seen = [(e["instance_id"], e["attempt"], e["status"], e["final"]) for e in results(out)]
    assert sorted(seen) == [
        ("always", 1, "crashed", False),
        ("always", 2, "crashed", False),
        ("always", 3, "crashed", True),
        ("flaky", 1, "crashed", False),
        ("flaky", 2, "ok", True),
        ("slow", 1, "timeout", False),
        ("slow", 2, "timeout", False),
        ("slow", 3, "timeout", True),
    ]
    assert all(e["exit_code"] == 3 for e in results(out) if e["status"] == "crashed")

    # agent_error is the agent's answer, never retried; a rerun has nothing to do.
    errors = write_records(agents.tmp / "errors.jsonl", [record(agents, "err", **{"raise": "x"})])
    err_out = agents.tmp / "errors-results.jsonl"
    batch = batch_args(agents, errors, err_out, "--retries", "3")
    assert isolate_cli(*batch, env=env()).returncode == 0
    assert [(e["attempt"], e["status"]) for e in results(err_out)] == [(1, "agent_error")]
    again = isolate_cli(*batch, env=env())
    assert "1 of 1 instances already have a final result" in again.stderr
    assert len(results(err_out)) == 1


def test_ctrl_c_tears_down_exits_130_and_the_next_run_resumes(agents: Agents) -> None:
    hold = agents.tmp / "hold"
    hold.touch()
    lines = [record(agents, f"q-{i}") for i in range(3)]
    lines += [record(agents, f"h-{i}", hold=str(hold)) for i in range(4)]
    records = write_records(agents.tmp / "records.jsonl", lines)
    out = agents.tmp / "results.jsonl"
    args = flaky_args(agents, records, out, "--concurrency", "4")
    driver = start(args, agents.tmp)
    holding = lambda: list(agents.pids.glob("holding-*"))  # noqa: E731
    wait_for(lambda: len(holding()) == 4 and line_count(out) == 3, 30, "4 holding episodes")
    driver.send_signal(signal.SIGINT)
    assert driver.wait(timeout=10 * SLOW) == 130
    stderr = (agents.tmp / "driver.err").read_text()
    assert "interrupted: launching no more; tearing down 4 running episode(s)" in stderr
    assert "Traceback" not in stderr
    # Torn down before the driver exited, not later by the shims' own watchdog.
    assert not episode_processes(f"PID_DIR={agents.pids}".encode())
    # The cut attempts are on record as the driver's doing, not the agent's.
    cut = [e for e in results(out) if e["instance_id"].startswith("h-")]
    assert sorted(e["instance_id"] for e in results(out)) == [
        *(f"h-{i}" for i in range(4)),
        *(f"q-{i}" for i in range(3)),
    ]
    for entry in cut:
        assert (entry["status"], entry["infra"], entry["final"]) == ("crashed", True, False)
        assert entry["error"]["type"] == "DriverStopped"
        assert entry["error"]["message"].startswith(
            "the driver was interrupted while this attempt ran (cancelled after "
        )
        assert Path(entry["outcome_path"]).is_file()
    # The summary says they were cut short, not retried, and by what.
    summary = (agents.tmp / "driver.out").read_text()
    assert ", 0 retried, 4 cut short\n" in summary, summary
    infra = "infra        4 (cut short by the interrupt: the next run runs them again); "
    assert f"\n{infra}the driver stopped, not the agent\n" in summary, summary

    hold.unlink()
    proc = isolate_cli(*args, env=env())
    assert proc.returncode == 0, proc.stderr
    assert "3 of 7 instances already have a final result" in proc.stderr
    assert "had no line" not in proc.stderr  # each cut attempt already has its line
    assert sorted((e["instance_id"], e["attempt"], e["status"]) for e in results(out)) == sorted(
        [(f"q-{i}", 1, "ok") for i in range(3)]
        + [(f"h-{i}", 1, "crashed") for i in range(4)]
        + [(f"h-{i}", 2, "ok") for i in range(4)]
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--ray-address", "auto"], "--ray-address needs --backend ray"),
        (["--backend", "ray", "--ray-memory", "lots"], "not a size"),
        (["--api-key-env", "NOT_SET_ANYWHERE"], "not set"),
        # Once, as a usage error, not once per record as an invalid record.
        (["--base-url", "nope"], "isolate: error: --base-url 'nope' is not an http(s) URL"),
        (["--entrypoint", "x"], "isolate: error: --entrypoint: entrypoint must look like"),
        (["--timeout", "nan"], "argument --timeout: must be a finite number of seconds"),
        (["--status-interval", "nan"], "argument --status-interval: must be a finite number"),
    ],
)
def test_usage_errors(agents: Agents, extra: list[str], message: str) -> None:
    lines = [record(agents, "u-1"), record(agents, "u-2")]
    records = write_records(agents.tmp / "records.jsonl", lines)
    out = agents.tmp / "out.jsonl"
    proc = isolate_cli(*batch_args(agents, records, out), *extra, env=env())
    assert proc.returncode == 2
    assert proc.stderr.count(message) == 1
    assert "invalid record" not in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()  # nothing ran: no results file either
    assert not agents.logs.exists()


def test_ray_that_does_not_import_is_one_line_and_leaves_no_results_file(agents: Agents) -> None:
    broken = agents.tmp / "broken"
    (broken / "ray").mkdir(parents=True)
    (broken / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    records = write_records(agents.tmp / "records.jsonl", [record(agents, "r-1")])
    out = agents.tmp / "out.jsonl"
    environ = env()
    environ["PYTHONPATH"] = f"{broken}{os.pathsep}{environ.get('PYTHONPATH', '')}"
    proc = isolate_cli(*batch_args(agents, records, out), "--backend", "ray", env=environ)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"isolate: error: --backend ray needs Ray: {sys.executable} -m pip install 'ray>=2.9' "
        "(no ray here)"
    )
    assert not out.exists()


def test_setup_errors_are_not_final_and_each_cause_is_shown_once(agents: Agents) -> None:
    records = write_records(
        agents.tmp / "records.jsonl", [record(agents, f"s-{i}") for i in range(3)]
    )
    out = agents.tmp / "results.jsonl"
    missing = agents.tmp / "no-such-python"
    args = batch_args(agents, records, out, "--python", str(missing))
    proc = isolate_cli(*args, env=env())
    assert proc.returncode == 1, proc.stderr
    # The records say what the summary says: not final, so the next run tries them again.
    assert [(e["status"], e["final"]) for e in results(out)] == [("setup_error", False)] * 3
    assert "setup_error (runs again)      3" in proc.stdout
    cause = f"SetupError: interpreter {missing} does not exist"
    assert proc.stdout.count(cause) == 1
    assert f"3 x  {cause}" in proc.stdout
    assert "3 instance(s) without a final result" in proc.stderr
    again = isolate_cli(*args, env=env())
    assert again.returncode == 1
    assert "already have a final result" not in again.stderr
    assert sorted(e["attempt"] for e in results(out)) == [1, 1, 1, 2, 2, 2]


def test_on_a_terminal_with_rich_a_live_bar(agents: Agents) -> None:
    pytest.importorskip("rich")  # a dev extra: the bar is drawn only where it is installed
    records = write_records(
        agents.tmp / "records.jsonl", [record(agents, f"b-{i}", sleep=0.3) for i in range(4)]
    )
    args = batch_args(agents, records, agents.tmp / "out.jsonl", "--status-interval", "0.1")
    code, stdout, terminal = stderr_on_a_terminal(
        [sys.executable, "-m", "isolate", *args], cwd=agents.tmp, env=env()
    )
    assert code == 0, terminal
    assert "isolate batch" in terminal
    assert "4/4" in terminal
    assert "ETA" in terminal
    assert "\x1b[" in terminal  # drawn in place, not printed line by line
    assert "pip install rich" not in terminal
    assert "episodes/s" not in terminal  # no plain lines beside the bar
    assert " total " in stdout


def test_off_a_terminal_batch_never_imports_rich(agents: Agents) -> None:
    records = write_records(agents.tmp / "records.jsonl", [record(agents, "n-1")])
    args = batch_args(agents, records, agents.tmp / "out.jsonl", "--status-interval", "0.1")
    code = (
        "import sys; from isolate._cli import main; status = main(sys.argv[1:]); "
        "assert 'rich' not in sys.modules, 'rich was imported'; sys.exit(status)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env(),
        stdin=subprocess.DEVNULL,
        timeout=60 * SLOW,
    )
    assert proc.returncode == 0, proc.stderr
    assert " total " in proc.stdout


def test_missing_records_file(agents: Agents) -> None:
    args = batch_args(agents, agents.tmp / "nope.jsonl", agents.tmp / "out.jsonl")
    proc = isolate_cli(*args, env=env())
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr


def test_retry_policy_and_sizes() -> None:
    policy = RetryPolicy(retries=1, retry_timeouts=False)
    assert policy.again("crashed", 1)
    assert policy.again("protocol_error", 1)
    assert not policy.again("crashed", 2)
    assert not policy.again("agent_error", 1)
    assert not policy.again("timeout", 1)
    assert RetryPolicy(retries=1, retry_timeouts=True).again("timeout", 1)
    assert policy.done({"status": "ok", "attempt": 1})
    assert policy.done({"status": "crashed", "attempt": 2})
    assert not policy.done({"status": "crashed", "attempt": 1})
    assert not policy.done({"status": "setup_error", "attempt": 5})  # the run's fault: again
    assert not policy.done(None)
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("1000") == 1000


# --- Ray ------------------------------------------------------------------------------------


@pytest.fixture
def ray_tmp() -> Any:
    pytest.importorskip("ray")
    # Short: Ray's unix sockets live below it, and a socket path has at most 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ray_processes(ray_tmp: Path) -> list[int]:
    """Processes of the Ray instance whose files are under ``ray_tmp``."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(ray_tmp) in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc.info["pid"])
    return found


def processes_holding(secret: bytes, driver: int) -> list[int]:
    """Processes whose environment or argv holds ``secret``, except the driver (the key is in
    its exec-time environment on purpose) and its forks that have not exec'd yet (they show
    the driver's environment until they do)."""
    try:
        driver_cmdline = Path(f"/proc/{driver}/cmdline").read_bytes()
    except OSError:
        return []
    holders = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == driver:
            continue
        try:
            if Path(f"/proc/{name}/cmdline").read_bytes() == driver_cmdline:
                continue
            if any(
                secret in Path(f"/proc/{name}/{p}").read_bytes() for p in ("environ", "cmdline")
            ):
                holders.append(int(name))
        except OSError:
            continue
    return holders


def run_ray_driver(args: list[str], tmp: Path, ray_tmp: Path) -> subprocess.Popen[str]:
    """A Ray driver with the key in its own environment, as OPENAI_API_KEY: no process it
    starts may have it."""
    ray_env = cli_env(OPENAI_API_KEY=KEY, RAY_TMPDIR=str(ray_tmp))
    args = [a for a in args if a not in ("--api-key-env", "BATCH_KEY")]
    driver = start([*args, "--backend", "ray", "--ray-local-cpus", "2"], tmp, ray_env)
    scanned = False
    started: set[psutil.Process] = set()
    try:
        while driver.poll() is None:
            if ray_processes(ray_tmp):
                assert processes_holding(KEY.encode(), driver.pid) == []
                scanned = True
            try:
                started.update(psutil.Process(driver.pid).children(recursive=True))
            except psutil.Error:
                pass
            time.sleep(0.2)
    finally:
        if driver.poll() is None:
            driver.send_signal(signal.SIGINT)
            driver.wait(timeout=30 * SLOW)
    assert scanned
    # ray.shutdown() stopped the whole instance (gcs, raylet, workers) with the driver.
    wait_for(lambda: all(is_gone(p.pid, p.create_time()) for p in started), 5, "Ray to stop")
    assert not ray_processes(ray_tmp)
    for path in ray_tmp.rglob("*"):
        if path.is_file() and not path.is_socket():
            assert KEY.encode() not in path.read_bytes(), path
    return driver


def test_ray_backend_writes_what_the_local_backend_writes(agents: Agents, ray_tmp: Path) -> None:
    records = write_records(
        agents.tmp / "records.jsonl",
        [
            record(agents, "r-ok", reward=1.0, sleep=1.0),  # Ray is up a while: scan it
            record(agents, "r-half", reward=0.5),
            record(agents, "r-raise", **{"raise": "boom"}),
            record(agents, "r-segv", crash="segv"),
            record(agents, "r-nan", reward="nan"),
            record(agents, "r-timeout", sleep=60, spawn=1),
        ],
    )
    local, remote = agents.tmp / "local.jsonl", agents.tmp / "ray.jsonl"
    options = ("--retries", "1", "--timeout", "3")
    assert isolate_cli(*batch_args(agents, records, local, *options), env=env()).returncode == 0

    driver = run_ray_driver(batch_args(agents, records, remote, *options), agents.tmp, ray_tmp)
    assert driver.returncode == 0, (agents.tmp / "driver.err").read_text()

    def essence(path: Path) -> list[tuple[Any, ...]]:
        keys = ("instance_id", "attempt", "final", "status", "reward", "signal", "exit_code")
        for e in (entries := results(path)):
            if e["status"] == "timeout":  # SIGTERM or SIGKILL: whether it died within the grace
                e["signal"] = e["exit_code"] = None
        return sorted(tuple(e[k] for k in keys) for e in entries)

    assert essence(remote) == essence(local)
    assert len(results(remote)) == 8  # two attempts each for r-segv and r-nan
    for entry in results(remote):
        assert Path(entry["log_path"]).is_file()
    assert KEY.encode() not in remote.read_bytes()
    assert "resolved" in (agents.tmp / "driver.out").read_text()


def test_ray_worker_death_costs_a_retry_not_the_batch(agents: Agents, ray_tmp: Path) -> None:
    hold = agents.tmp / "hold"
    hold.touch()
    records = write_records(
        agents.tmp / "records.jsonl",
        [record(agents, "w-0", hold=str(hold)), record(agents, "w-1")],
    )
    out = agents.tmp / "results.jsonl"
    args = flaky_args(agents, records, out, "--retries", "1")
    args += ["--backend", "ray", "--ray-local-cpus", "2"]
    driver = start(args, agents.tmp, cli_env(BATCH_KEY=KEY, RAY_TMPDIR=str(ray_tmp)))
    try:
        started = lambda: list(agents.pids.glob("holding-w-0")) and line_count(out)  # noqa: E731
        wait_for(started, 40, "w-0 to hold and w-1 to finish")
        tree = episode_processes(f"PID_DIR={agents.pids}".encode())
        pids = {p.pid for p in tree}
        [top] = [p for p in tree if p.ppid() not in pids]
        worker = psutil.Process(top.ppid())
        assert "ray" in worker.name().lower() or "ray" in " ".join(worker.cmdline())
        hold.unlink()  # the second attempt returns at once
        worker.kill()
        assert driver.wait(timeout=30 * SLOW) == 0, (agents.tmp / "driver.err").read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    wait_for(lambda: not ray_processes(ray_tmp), 5, "the Ray instance to stop")
    # The killed worker's cgroup leaves stay until an isolate process starts and removes them.
    remove_dead_parents_leaves()
    seen = sorted((e["instance_id"], e["attempt"], e["status"]) for e in results(out))
    assert seen == [("w-0", 1, "crashed"), ("w-0", 2, "ok"), ("w-1", 1, "ok")]
    [died] = [e for e in results(out) if e["attempt"] == 1 and e["instance_id"] == "w-0"]
    assert died["error"]["type"] == "WorkerCrashedError"


INFO_AGENT = """
import os

def run(data, **kwargs):
    with open(os.path.join(os.environ["PID_DIR"], "attempts-" + data["instance_id"]), "a") as f:
        f.write("x")
        if f.tell() == 1 and data["behaviour"].get("crash_first"):
            os._exit(3)
    size = data["behaviour"].get("size", 10)
    return 0.5, {"trajectory": ["step"] * 3, "text": "y" * size}
"""


def test_every_attempt_keeps_its_outcome(agents: Agents) -> None:
    (agents.root / "info_agent.py").write_text(textwrap.dedent(INFO_AGENT))
    lines = [
        record(agents, "small"),
        record(agents, "large", size=100_000),
        record(agents, "again", crash_first=True),
    ]
    records = write_records(agents.tmp / "records.jsonl", lines)
    out = agents.tmp / "results.jsonl"
    args = batch_args(agents, records, out, "--entrypoint", "info_agent:run", "--retries", "1")
    args[args.index("--agent-root") + 1] = str(agents.root)
    proc = isolate_cli(*args, env=env())
    assert proc.returncode == 0, proc.stderr
    by_id: dict[str, list[dict[str, Any]]] = {}
    for entry in results(out):
        by_id.setdefault(entry["instance_id"], []).append(entry)
    (small,) = by_id["small"]
    assert small["info"] == {"trajectory": ["step"] * 3, "text": "y" * 10}
    outcome = json.loads(Path(small["outcome_path"]).read_text())
    assert (outcome["status"], outcome["info"]) == ("ok", small["info"])
    (large,) = by_id["large"]
    assert large["info"] is None  # over 64 KiB: in its outcome file only
    assert json.loads(Path(large["outcome_path"]).read_text())["info"]["text"] == "y" * 100_000
    first, second = by_id["again"]
    assert (first["status"], second["status"]) == ("crashed", "ok")
    assert first["outcome_path"] != second["outcome_path"]  # a bundle each
    assert json.loads(Path(first["outcome_path"]).read_text())["exit_code"] == 3
    assert second["info"]["trajectory"] == ["step"] * 3


# A sandboxed agent that wants another grade: it appends forged final lines to the results,
# rewrites the other episodes' bundles (spec.json: its own script, no sandbox), plants a file
# beside the results, and forges a "lost" attempt (a bundle with attempt.json and an ok
# outcome) and its own outcome.json, for the next run to record. Each attempt's word is kept in
# its info.
FORGER = """
import errno, glob, json, os

def attempt(fn):
    try:
        fn()
        return "done"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, type(exc).__name__)

def run(data, **kwargs):
    b = data["behaviour"]
    forged = json.dumps({"instance_id": "f-0", "final": True, "status": "ok", "reward": 1.0})

    def append():
        with open(b["results"], "a") as f:
            f.write(forged + "\\n")

    def rewrite():
        for spec in glob.glob(os.path.join(b["logs"], "**", "spec.json"), recursive=True):
            with open(spec, "w") as f:
                f.write(json.dumps({"python": "/tmp/evil", "sandbox": None}))

    def plant():
        with open(os.path.join(os.path.dirname(b["results"]), "planted"), "w") as f:
            f.write("x")

    def lost():
        fake = os.path.join(b["logs"], data["instance_id"] + ".forged")
        os.makedirs(fake)
        attempt = {"results": b["results"], "instance_id": data["instance_id"], "sample": None}
        with open(os.path.join(fake, "attempt.json"), "w") as f:
            f.write(json.dumps(attempt))

    def own_outcome():
        bundle = os.path.dirname(kwargs["result_dir"])
        with open(os.path.join(bundle, "outcome.json"), "w") as f:
            f.write(json.dumps({"status": "ok", "reward": 1.0}))

    found = {"append": attempt(append), "rewrite": attempt(rewrite), "plant": attempt(plant)}
    found.update(lost=attempt(lost), own_outcome=attempt(own_outcome))
    with open(os.path.join(kwargs["result_dir"], "mine.txt"), "w") as f:
        f.write("legitimate")
    found["cwd"] = attempt(lambda: open("scratch.txt", "w").close())
    return 0.0, found
"""


def test_a_sandboxed_agent_cannot_touch_the_results_or_the_bundles(agents: Agents) -> None:

    if _internals.landlock_abi() < 3:
        pytest.skip("the default Sandbox() needs Landlock ABI 3 here")
    (agents.root / "forger.py").write_text(textwrap.dedent(FORGER))
    out = agents.tmp / "results.jsonl"
    behaviour = {"results": str(out), "logs": str(agents.logs)}
    lines = [record(agents, f"f-{i}", **behaviour) for i in range(3)]
    records = write_records(agents.tmp / "records.jsonl", lines)
    args = batch_args(agents, records, out, "--entrypoint", "forger:run", "--sandbox")
    args[args.index("--agent-root") + 1] = str(agents.root)
    proc = isolate_cli(*args, env=env())
    assert proc.returncode == 0, proc.stderr
    entries = results(out)
    assert sorted((e["instance_id"], e["reward"]) for e in entries) == [
        (f"f-{i}", 0.0) for i in range(3)
    ]
    for entry in entries:
        # The sandbox's read-only view answers first (EROFS); Landlock (EACCES) stands behind.
        assert entry["info"] == {
            "append": "EROFS",
            "rewrite": "EROFS",
            "plant": "EROFS",
            "lost": "EROFS",
            "own_outcome": "EROFS",
            "cwd": "done",  # its own working directory, in its bundle
        }, entry
        bundle = Path(entry["outcome_path"]).parent
        assert (bundle / "result" / "mine.txt").read_text() == "legitimate"
        assert (bundle / "work" / "scratch.txt").exists()
        spec = json.loads((bundle / "spec.json").read_text())
        assert spec["sandbox"] is not None
        assert "evil" not in spec["python"]
    assert not (agents.tmp / "planted").exists()
    assert not list(agents.logs.rglob("*.forged"))
    assert re.search(r"^resolved +0/3 ", proc.stdout, re.M), proc.stdout
    # A rerun finds no lost attempt to record, and nothing to do.
    again = isolate_cli(*args, env=env())
    assert again.returncode == 0, again.stderr
    assert "had no line" not in again.stderr
    assert len(results(out)) == 3


def test_a_finished_line_is_on_disk_before_the_next_record_starts(agents: Agents) -> None:
    # The system calls of the driver and all it starts, in order: the write of the first
    # record's result line, its fsync, then the exec of the next record's shim.
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed")
    records = write_records(
        agents.tmp / "records.jsonl", [record(agents, f"s-{i}", reward=1.0) for i in range(2)]
    )
    out = agents.tmp / "results.jsonl"
    trace = agents.tmp / "trace"
    args = batch_args(agents, records, out, "--concurrency", "1")
    command = [strace, "-f", "-qq", "-e", "trace=openat,write,fsync,execve", "-s", "64"]
    proc = subprocess.run(
        [*command, "-o", str(trace), sys.executable, "-m", "isolate", *args],
        capture_output=True,
        text=True,
        env=env(),
        timeout=120 * SLOW,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    # "PID call(...) = result", one a line (-qq: no resumed halves split across lines).
    calls = [ln.split(" ", 1)[1].lstrip() for ln in trace.read_text().splitlines() if " " in ln]
    opened = [c for c in calls if c.startswith("openat(") and f'"{out}"' in c]
    fd = opened[-1].rsplit("= ", 1)[1]
    first = next(i for i, c in enumerate(calls) if c.startswith(f'write({fd}, "{{\\"instance'))
    fsyncs = [i for i, c in enumerate(calls[first:], first) if c.startswith(f"fsync({fd})")]
    assert fsyncs, "the results file is never fsynced after the first line"
    synced = fsyncs[0]
    shims = [
        i
        for i, c in enumerate(calls)
        if c.startswith("execve(") and "boot.py" in c and "--probe" not in c
    ]
    assert '"instance_id": "s-0"' in calls[first].replace("\\", "")
    assert [i for i in shims if first < i < synced] == []
    assert len([i for i in shims if i > synced]) == 1  # the second record's shim
    assert [e["instance_id"] for e in results(out)] == ["s-0", "s-1"]
