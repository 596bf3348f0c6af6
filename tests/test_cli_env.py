"""The command line passes the environment as the drop-in does, hands ``--secret-env`` over
without putting it on argv or into a bundle, and doctor names what the agent will not see."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from .conftest import Agents
from .test_batch import batch_args, record, write_records
from .test_cli import bundles, cli_env, isolate_cli, run_args, write_record


def agent_report(
    agents: Agents, instance_id: str = "cli-1", result_dir: Path | None = None
) -> dict[str, str]:
    """The scripted agent's os.environ, from the report it writes into result_dir (by
    default the log directory, as ``isolate run`` makes it)."""
    path = (result_dir or agents.logs) / f"{instance_id}.json"
    environ: dict[str, str] = json.loads(path.read_text())["environ"]
    return environ


def test_run_passes_the_environment_and_secret_env(agents: Agents) -> None:
    value = "e2b-" + secrets.token_hex(12)
    env = cli_env(
        E2B_API_KEY=value, HF_HOME="/data/hf", PYTHONPATH="/trainer/areal", GH_TOKEN="gh-x"
    )
    rec = write_record(agents, report=True)
    args = run_args(agents, rec, "--secret-env", "E2B_API_KEY")
    proc = isolate_cli(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    seen = agent_report(agents)
    assert seen["E2B_API_KEY"] == value
    assert seen["HF_HOME"] == "/data/hf"
    assert "PYTHONPATH" not in seen
    assert "GH_TOKEN" not in seen
    [bundle] = bundles(agents)
    assert json.loads((bundle / "secret_env.json").read_text()) == ["E2B_API_KEY"]
    for path in bundle.iterdir():  # record, spec, kwargs, outcome, log: names, never the value
        assert value.encode() not in path.read_bytes()
    [log] = bundle.glob("*.log")
    first = log.read_text().splitlines()[0]
    assert "GH_TOKEN" in first
    assert "PYTHONPATH" in first
    assert "E2B_API_KEY" not in first

    # A replay looks the names up again, in its own environment.
    again = "e2b-" + secrets.token_hex(12)
    replay = isolate_cli(
        "run",
        "--replay",
        str(bundle),
        "--no-endpoint-check",
        "--log-dir",
        str(agents.logs),
        env=cli_env(E2B_API_KEY=again),
    )
    assert replay.returncode == 0, replay.stderr
    assert agent_report(agents)["E2B_API_KEY"] == again


def test_secret_env_that_is_not_set_is_a_usage_error(agents: Agents) -> None:
    rec = write_record(agents)
    proc = isolate_cli(*run_args(agents, rec, "--secret-env", "NOT_SET_ANYWHERE_2"))
    assert proc.returncode == 2
    assert "--secret-env: environment variable NOT_SET_ANYWHERE_2 is not set" in proc.stderr


def test_batch_hands_secret_env_to_every_episode(agents: Agents, tmp_path: Path) -> None:
    value = "e2b-" + secrets.token_hex(12)
    records = write_records(
        tmp_path / "r.jsonl", [record(agents, f"b-{i}", report=True) for i in range(2)]
    )
    out = tmp_path / "out.jsonl"
    args = batch_args(agents, records, out, "--secret-env", "E2B_API_KEY")
    proc = isolate_cli(*args, env=cli_env(BATCH_KEY="k", E2B_API_KEY=value))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # A batch's result_dir is its run's directory, beside the run's bundles.
    run_dir = agents.logs / json.loads((tmp_path / "out.run.json").read_text())["run_id"]
    reports = [agent_report(agents, f"b-{i}", run_dir)["E2B_API_KEY"] for i in range(2)]
    assert reports == [value] * 2
    assert value not in out.read_text()


def test_doctor_lists_what_is_withheld_and_why() -> None:
    env = cli_env(
        PYTHONPATH="/trainer/areal",
        VIRTUAL_ENV="/trainer/venv",
        E2B_API_KEY="e2b-doctor-value",
        HF_HOME="/data/hf",
    )
    proc = isolate_cli("doctor", "--agent-root", str(Path(__file__).parent), env=env)
    lines = proc.stdout.splitlines()
    assert any("are withheld from the agent" in ln for ln in lines), proc.stdout
    reasons = dict(ln.strip().split(": ", 1) for ln in lines if ln.startswith("          "))
    assert reasons["PYTHONPATH"].startswith("steers Python")
    assert reasons["VIRTUAL_ENV"] == "activates the trainer's virtualenv"
    assert reasons["E2B_API_KEY"].startswith("looks like a credential: pass it with secret_env")
    assert "HF_HOME" not in reasons
    assert "e2b-doctor-value" not in proc.stdout + proc.stderr
