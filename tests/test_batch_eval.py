"""The evaluation options of ``isolate batch``: ``--samples`` (and pass@k), ``--limit``,
``--instance-ids``, ``--shard``; real drivers running real no-op episodes."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from .conftest import Agents
from .test_batch import batch_args, env, record, results, write_records
from .test_cli import isolate_cli

# Resolves by its behaviour: always, never, or on the first sample of its record to get
# here (a file created with O_EXCL: exactly one sample wins, however many run at once).
SAMPLED_AGENT = """
import os

def run(data, **kwargs):
    b = data.get("behaviour") or {}
    if b.get("first_only"):
        path = os.path.join(os.environ["PID_DIR"], "won-" + data["instance_id"])
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return 0.0
        return 1.0
    return float(b.get("reward", 1.0))
"""


def sampled_args(agents: Agents, records: Path, out: Path, *extra: str) -> list[str]:
    (agents.root / "sampled_agent.py").write_text(textwrap.dedent(SAMPLED_AGENT))
    args = batch_args(agents, records, out, "--entrypoint", "sampled_agent:run", *extra)
    args[args.index("--agent-root") + 1] = str(agents.root)
    return args


def pass_at(stdout: str) -> dict[int, str]:
    """The summary's pass@k lines: k -> the value as printed."""
    return {int(k): v for k, v in re.findall(r"^pass@(\d+) +(\d\.\d{3})", stdout, re.M)}


def test_samples_give_each_sample_its_episode_and_pass_at_k(agents: Agents) -> None:
    records = write_records(
        agents.tmp / "records.jsonl",
        [
            record(agents, "always", reward=1.0),
            record(agents, "never", reward=0.0),
            record(agents, "once", first_only=True),
        ],
    )
    out = agents.tmp / "results.jsonl"
    args = sampled_args(agents, records, out, "--samples", "3", "--concurrency", "4")
    proc = isolate_cli(*args, env=env())
    assert proc.returncode == 0, proc.stderr
    entries = results(out)
    assert sorted((e["instance_id"], e["sample"]) for e in entries) == [
        (i, s) for i in ("always", "never", "once") for s in range(3)
    ]
    assert all((e["status"], e["attempt"], e["final"]) == ("ok", 1, True) for e in entries)
    ids = [e["episode_id"] for e in entries]
    assert len(set(ids)) == 9
    for entry in entries:
        assert entry["episode_id"].startswith(f"{entry['instance_id']}.s{entry['sample']}.")
        assert Path(entry["log_path"]).parent.name == entry["episode_id"]  # a bundle each
    rewards = {
        i: sorted(e["reward"] for e in entries if e["instance_id"] == i)
        for i in ("always", "never", "once")
    }
    assert rewards == {"always": [1.0] * 3, "never": [0.0] * 3, "once": [0.0, 0.0, 1.0]}
    assert proc.stdout.startswith("isolate batch: 3 instances x 3 samples, 9 run now")
    assert re.search(r"^resolved +4/9 ", proc.stdout, re.M), proc.stdout
    # Per instance 1 - C(n-c, k) / C(n, k), n = 3; c = 3, 0, 1; averaged.
    assert pass_at(proc.stdout) == {1: "0.444", 2: "0.556", 3: "0.667"}, proc.stdout
    assert "pass@1       0.444  (3 instances, 3 samples each)" in proc.stdout

    # The report of the file says the same.
    report = isolate_cli("report", str(out), "--json", env=env())
    assert report.returncode == 0, report.stderr
    values = {p["k"]: p["value"] for p in json.loads(report.stdout)["pass_at_k"]["values"]}
    assert values == pytest.approx({1: 4 / 9, 2: 5 / 9, 3: 2 / 3})

    # A rerun with more samples runs only the new ones: resume goes by instance and sample.
    more = sampled_args(agents, records, out, "--samples", "4", "--concurrency", "4")
    again = isolate_cli(*more, env=env())
    assert again.returncode == 0, again.stderr
    assert "resuming: 9 of 12 samples already have a final result" in again.stderr
    new = results(out)[9:]
    assert sorted((e["instance_id"], e["sample"]) for e in new) == [
        ("always", 3),
        ("never", 3),
        ("once", 3),
    ]
    # n = 4: c = 4, 0, 1. pass@2 of "once": 1 - C(3,2)/C(4,2) = 0.5.
    assert pass_at(again.stdout) == {1: "0.417", 2: "0.500", 4: "0.667"}, again.stdout
    # And a rerun of the same command has nothing to do.
    done = isolate_cli(*more, env=env())
    assert done.returncode == 0, done.stderr
    assert "resuming: 12 of 12 samples already have a final result" in done.stderr
    assert len(results(out)) == 12


@pytest.fixture
def ten(agents: Agents) -> Path:
    """Ten no-op records, t-0 to t-9."""
    return write_records(
        agents.tmp / "records.jsonl", [record(agents, f"t-{i}") for i in range(10)]
    )


def run_ids(agents: Agents, records: Path, name: str, *extra: str) -> list[str]:
    """The instance ids a batch with ``extra`` ran, in the order of its results file."""
    out = agents.tmp / f"{name}.jsonl"
    proc = isolate_cli(*batch_args(agents, records, out, *extra), env=env())
    assert proc.returncode == 0, proc.stderr
    entries = results(out)
    assert all("sample" not in e for e in entries)  # only with --samples
    assert re.search(rf"^isolate batch: {len(entries)} instances, ", proc.stdout, re.M)
    return [e["instance_id"] for e in entries]


def test_limit_and_instance_ids(agents: Agents, ten: Path) -> None:
    assert sorted(run_ids(agents, ten, "limit", "--limit", "3")) == ["t-0", "t-1", "t-2"]
    chosen = run_ids(agents, ten, "ids", "--instance-ids", "t-7,t-2,t-5")
    assert sorted(chosen) == ["t-2", "t-5", "t-7"]
    # Ids first, then the shard of what is left (positions 1, 3, 5), then the limit.
    combined = run_ids(
        agents,
        ten,
        "combined",
        *("--instance-ids", "t-1,t-2,t-3,t-4,t-5,t-6", "--shard", "1/2", "--limit", "2"),
    )
    assert sorted(combined) == ["t-2", "t-4"]


def test_shards_cover_every_record_once(agents: Agents, ten: Path) -> None:
    shards = [sorted(run_ids(agents, ten, f"shard-{i}", "--shard", f"{i}/3")) for i in range(3)]
    assert shards[0] == ["t-0", "t-3", "t-6", "t-9"]
    assert shards[1] == ["t-1", "t-4", "t-7"]
    assert shards[2] == ["t-2", "t-5", "t-8"]
    every = [i for shard in shards for i in shard]
    assert sorted(every) == sorted(f"t-{i}" for i in range(10))
    assert len(every) == len(set(every))


def test_an_unknown_instance_id_stops_the_run_before_anything(agents: Agents, ten: Path) -> None:
    out = agents.tmp / "out.jsonl"
    args = batch_args(agents, ten, out, "--instance-ids", "t-1,nope,t-2,zzz")
    proc = isolate_cli(*args, env=env())
    assert proc.returncode == 2
    assert proc.stderr == (
        f"isolate: error: --instance-ids: no valid record of {ten} has instance_id 'nope', "
        "'zzz'; nothing was run\n"
    )
    assert not out.exists()
    assert not agents.logs.exists()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--samples", "0"),
        ("--samples", "three"),
        ("--limit", "0"),
        ("--limit", "-1"),
        ("--limit", "1.5"),
        ("--shard", "2/2"),
        ("--shard", "3/2"),
        ("--shard", "-1/2"),
        ("--shard", "0/0"),
        ("--shard", "1"),
        ("--shard", "a/b"),
        ("--instance-ids", ""),
        ("--instance-ids", " , "),
    ],
)
def test_invalid_values_exit_2_naming_the_flag(
    agents: Agents, ten: Path, flag: str, value: str
) -> None:
    out = agents.tmp / "out.jsonl"
    proc = isolate_cli(*batch_args(agents, ten, out), f"{flag}={value}", env=env())
    assert proc.returncode == 2
    assert f"argument {flag}: " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
    assert not agents.logs.exists()


def test_the_report_of_sampled_lines_names_each_sample(agents: Agents) -> None:
    records = write_records(
        agents.tmp / "records.jsonl", [record(agents, "x", **{"raise": "boom"})]
    )
    out = agents.tmp / "results.jsonl"
    proc = isolate_cli(*batch_args(agents, records, out, "--samples", "2"), env=env())
    assert proc.returncode == 0, proc.stderr
    report = isolate_cli("report", str(out), env=env())
    assert report.returncode == 0, report.stderr
    by_sample: dict[Any, str] = {e["sample"]: e["log_path"] for e in results(out)}
    for sample, log in by_sample.items():
        assert re.search(rf"^    x#{sample}  {re.escape(log)}$", report.stdout, re.M)
    assert "pass@1       0.000  (1 instance, 2 samples each)" in report.stdout
