"""Runs that can be told apart and compared: a batch run's id, its bundles under it, its
metadata beside the results (and no secret in it), and ``isolate report A B``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from .conftest import SLOW, Agents
from .test_batch import KEY, batch_args, env, record, results, write_records
from .test_cli import SCRIPTED, cli_env, isolate_cli

RUN_ID = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{6}$")


def _batch(agents: Agents, name: str, lines: list[dict[str, Any]], *extra: str) -> Path:
    records = write_records(agents.tmp / f"{name}.records.jsonl", lines)
    out = agents.tmp / f"{name}.jsonl"
    proc = isolate_cli(*batch_args(agents, records, out, *extra), env=env())
    assert proc.returncode == 0, proc.stderr
    return out


def _head(path: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip()


def test_a_run_has_an_id_its_bundles_under_it_and_metadata_without_secrets(
    agents: Agents,
) -> None:
    secret = "sv-" + KEY[-12:]
    password = "pw-" + KEY[-10:]
    url = f"http://user:{password}@127.0.0.1:9/v1"
    lines = [record(agents, "m-1", reward=1.0), record(agents, "m-2", reward=0.0)]
    records = write_records(agents.tmp / "records.jsonl", lines)
    out = agents.tmp / "results.jsonl"
    args = batch_args(agents, records, out, "--secret-env", "RUN_SECRET", "--llm-model", "m-x")
    args[args.index("--base-url") + 1] = url
    proc = isolate_cli(*args, env=cli_env(BATCH_KEY=KEY, RUN_SECRET=secret))
    assert proc.returncode == 0, proc.stderr

    meta_file = agents.tmp / "results.run.json"
    text = meta_file.read_text()
    for value in (KEY, secret, password):
        assert value not in text
    for value in (KEY, secret):  # the agent may echo its endpoint; its secrets are scrubbed
        assert value not in out.read_text()
    meta = json.loads(text)
    run_id = meta["run_id"]
    assert RUN_ID.match(run_id), run_id
    assert meta["results"] == str(out)
    assert meta["isolate_version"]
    assert meta["host"]
    assert meta["started_at"].endswith("Z")
    assert meta["driver"]["python"] == sys.executable
    assert meta["agent"]["root"] == str(SCRIPTED)
    assert meta["agent"]["commit"] == _head(SCRIPTED)
    assert isinstance(meta["agent"]["dirty"], bool)
    assert meta["endpoint"] == {"base_url": "http://user:***@127.0.0.1:9/v1", "model": "m-x"}
    assert meta["records"]["path"] == str(records)
    assert meta["records"]["chosen"] == 2
    assert meta["spec"]["kill_grace"] == 0.2
    assert meta["kwargs"]["override_llm_model"] == "m-x"
    assert meta["secret_env"] == ["RUN_SECRET"]
    assert meta["resumed"] == []
    assert f"\nrun          {run_id} ({meta_file})\n" in proc.stdout

    # Every bundle is under the run's id, and a line's paths say so.
    run_dir = agents.logs.absolute() / run_id
    assert meta["log_dir"] == str(run_dir)
    assert sorted(p.name for p in agents.logs.iterdir()) == [run_id]
    entries = results(out)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(e["episode_id"] for e in entries)
    for entry in entries:
        assert Path(entry["log_path"]).parent.parent == run_dir

    # A resume is the same run: the same id and directory, and what it ran with is added.
    lines.append(record(agents, "m-3", reward=1.0))
    write_records(records, lines)
    again = isolate_cli(*args, env=cli_env(BATCH_KEY=KEY, RUN_SECRET=secret))
    assert again.returncode == 0, again.stderr
    meta = json.loads(meta_file.read_text())
    assert meta["run_id"] == run_id
    [resumed] = meta["resumed"]
    assert resumed["records"]["chosen"] == 3
    assert sorted(p.name for p in agents.logs.iterdir()) == [run_id]
    assert len(list(run_dir.iterdir())) == 3
    for value in (KEY, secret, password):
        assert value not in meta_file.read_text()

    # A replay of one of its bundles, from another directory and without --log-dir, leaves
    # its own bundle beside it, in the run's directory.
    elsewhere = agents.tmp / "elsewhere"
    elsewhere.mkdir()
    bundle = Path(entries[0]["log_path"]).parent
    replay = subprocess.run(
        [sys.executable, "-m", "isolate", "run", "--replay", str(bundle), "--no-endpoint-check"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=cli_env(RUN_SECRET=secret),
        timeout=60 * SLOW,
        stdin=subprocess.DEVNULL,
    )
    assert replay.returncode == 0, replay.stderr
    assert len(list(run_dir.iterdir())) == 4
    assert list(elsewhere.iterdir()) == []
    assert f"bundle {run_dir}/" in replay.stderr


def test_two_runs_compared_instance_by_instance(agents: Agents) -> None:
    a = _batch(
        agents,
        "a",
        [
            record(agents, "c-1", reward=1.0),  # solved by A only
            record(agents, "c-2", reward=0.0),  # solved by B only
            record(agents, "c-3", **{"raise": "boom"}),  # agent_error, then solved by B
            record(agents, "c-4", reward=1.0),  # solved by both
            record(agents, "c-5", reward=1.0),  # only in A
        ],
    )
    b = _batch(
        agents,
        "b",
        [
            record(agents, "c-1", reward=0.5),
            record(agents, "c-2", reward=1.0),
            record(agents, "c-3", reward=1.0),
            record(agents, "c-4", reward=1.0),
            record(agents, "c-6", reward=0.0),  # only in B
        ],
        "--llm-model",
        "model-b",
    )
    # Each on its own: which it resolved, which not, which ended in an error.
    proc = isolate_cli("report", str(a), "--json", env=cli_env())
    assert proc.returncode == 0, proc.stderr
    alone = json.loads(proc.stdout)
    assert alone["resolved_ids"] == ["c-1", "c-4", "c-5"]
    assert alone["unresolved_ids"] == ["c-2"]
    assert alone["error_ids"] == ["c-3"]

    proc = isolate_cli("report", str(a), str(b), "--json", env=cli_env())
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    run_a = json.loads((agents.tmp / "a.run.json").read_text())["run_id"]
    run_b = json.loads((agents.tmp / "b.run.json").read_text())["run_id"]
    assert (found["a"]["run_id"], found["b"]["run_id"]) == (run_a, run_b)
    assert (found["a"]["resolved"], found["b"]["resolved"]) == (3, 3)
    assert found["in_both"] == 4
    assert found["solved_by_both"] == ["c-4"]
    assert found["solved_by_a_only"] == ["c-1"]
    assert found["solved_by_b_only"] == ["c-2", "c-3"]
    assert found["solved_by_neither"] == []
    assert found["status_changes"] == [{"id": "c-3", "a": "agent_error", "b": "ok"}]
    assert (found["only_in_a"], found["only_in_b"]) == (["c-5"], ["c-6"])
    differences = {d["field"]: (d["a"], d["b"]) for d in found["metadata_differences"]}
    assert differences["endpoint.model"] == (None, "model-b")

    text = isolate_cli("report", str(a), str(b), env=cli_env())
    assert text.returncode == 0, text.stderr
    for expected in [
        f"isolate report: {a} (A) vs {b} (B)\n",
        f"\n A  run {run_a}: resolved 3/5 (60.0%)\n",
        f"\n B  run {run_b}: resolved 3/5 (60.0%)\n",
        "\nin both            4\n",
        "\nsolved by both (1)     c-4\n",
        "\nsolved by A only (1)   c-1\n",
        "\nsolved by B only (2)   c-2, c-3\n",
        "\nsolved by neither (0)  -\n",
        "\nonly in A (1)          c-5\n",
        "\nonly in B (1)          c-6\n",
        "\nflips                  3 (solved by A only 1, by B only 2)\n",
        "\nstatus changes (1)\n  c-3  agent_error -> ok\n",
        "\n  endpoint.model: None -> 'model-b'\n",
    ]:
        assert expected in text.stdout, text.stdout


def test_report_takes_one_or_two_files(agents: Agents) -> None:
    out = _batch(agents, "one", [record(agents, "o-1", reward=1.0)])
    three = isolate_cli("report", str(out), str(out), str(out), env=cli_env())
    assert (three.returncode, three.stderr) == (
        2,
        "isolate: error: give one results file, or two to compare\n",
    )
    plot = isolate_cli("report", str(out), str(out), "--plot", "x.png", env=cli_env())
    assert (plot.returncode, plot.stderr) == (
        2,
        "isolate: error: --plot draws one results file; give one\n",
    )
