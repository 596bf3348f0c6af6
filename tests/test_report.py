"""``isolate report``: the results file of a real batch, hand-written files for the edge
cases, ``--json``, ``--plot``, and the files it refuses."""

from __future__ import annotations

import json
import shlex
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from isolate._cli.batch.io import Results

from . import _internals
from .conftest import SLOW, Agents
from .test_batch import batch_args, env, record, results, write_records
from .test_cli import cli_env, isolate_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SETUP = {"type": "SetupError", "message": "s"}


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return isolate_cli("report", *args, env=cli_env())


def report_json(path: Path) -> dict[str, Any]:
    proc = report(str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    found: dict[str, Any] = json.loads(proc.stdout)
    return found


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def line(instance_id: str, attempt: int, status: str, **fields: Any) -> dict[str, Any]:
    """A result line as ``isolate batch`` writes one (the fields a report reads)."""
    entry: dict[str, Any] = {
        "instance_id": instance_id,
        "attempt": attempt,
        "final": status != "setup_error",
        "status": status,
        "reward": 1.0 if status == "ok" else None,
        "duration_s": 1.0,
        "exit_code": 0 if status == "ok" else None,
        "signal": None,
        "error": None,
        "log_path": f"/logs/{instance_id}.{attempt}/{instance_id}.log",
        "node": "node-a",
        "containment": "cgroup",
        "finished_at": "2026-01-01T10:00:00Z",
    }
    entry.update(fields)
    return entry


@pytest.fixture
def batch_results(agents: Agents) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A real batch of five no-op episodes: two ok (one resolved), an agent error, a crash,
    and a timeout of its own after 1 s; its results file and its run."""
    slow = record(agents, "r-timeout", sleep=60)
    slow["econfig"]["timeout"] = 1  # the record's own timeout wins over --timeout
    lines = [
        record(agents, "r-ok", reward=1.0),
        record(agents, "r-half", reward=0.5),
        record(agents, "r-raise", **{"raise": "boom"}),
        record(agents, "r-exit", crash="exit"),
        slow,
    ]
    records = write_records(agents.tmp / "records.jsonl", lines)
    out = agents.tmp / "results.jsonl"
    proc = isolate_cli(*batch_args(agents, records, out, "--timeout", "30"), env=env())
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_the_report_of_a_real_batch(
    agents: Agents, batch_results: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    out, batch = batch_results
    # The batch's summary ends with where everything is, and the command to report on it.
    tail = batch.stdout.splitlines()[-4:]
    meta = json.loads((agents.tmp / "results.run.json").read_text())
    run_id = meta["run_id"]
    assert tail == [
        f"run          {run_id} ({agents.tmp / 'results.run.json'})",
        f"results      {out}",
        f"logs         {agents.logs.absolute() / run_id} (a replay bundle per attempt)",
        f"report       isolate report {shlex.quote(str(out))}",
    ]
    command = shlex.split(tail[3].split(None, 1)[1])
    assert command[:2] == ["isolate", "report"]
    proc = report(*command[2:])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    text = proc.stdout
    assert text.startswith(f"isolate report: {out}: 5 instances, 5 results from 5 lines")
    for status, count in [("ok", 2), ("agent_error", 1), ("crashed", 1), ("timeout", 1)]:
        assert f"\n {status:<11}  {count:>5}   {100 * count / 5:.1f}%\n" in text, text
    assert "\nresolved     1/5 (20.0%)\n" in text
    assert (
        "mean reward  0.300 over 5 final results, counting the 3 failed results "
        "(agent_error 1, crashed 1, timeout 1) as 0\n" in text
    )
    assert (
        f"\nrun          {run_id}: started {meta['started_at']} on {socket.gethostname()}\n" in text
    )
    assert "\nresolved (1)     r-ok\n" in text
    assert "\nunresolved (1)   r-half\n" in text
    assert "\nerror (3)        r-exit, r-raise, r-timeout\n" in text
    assert "pass@" not in text  # one sample each
    assert "failures: 3 results in 3 groups" in text
    by_id = {e["instance_id"]: e for e in results(out)}
    assert "  agent_error  RuntimeError, exit 1  (1)\n    e.g. boom\n" in text
    assert "  crashed  EpisodeCrashed, exit 3  (1)\n" in text
    assert "  timeout  EpisodeTimeout" in text
    for failed in ("r-raise", "r-exit", "r-timeout"):
        assert f"    {failed}  " in text
        assert by_id[failed]["log_path"] in text
        assert Path(by_id[failed]["log_path"]).is_file()
    for passed in ("r-ok", "r-half"):
        assert f"    {passed}  " not in text
    host = socket.gethostname()
    auto = _internals.resolve("auto", None)
    assert f"\n {host}  " in text
    assert f"\n {auto[0]}  " in text

    found = report_json(out)
    assert found["file"] == str(out)
    assert (found["lines"], found["results"], found["instances"]) == (5, 5, 5)
    assert found["earlier_attempts"] == 0
    assert found["counts"] == {"ok": 2, "agent_error": 1, "crashed": 1, "timeout": 1}
    assert found["not_final"] == {}
    assert found["resolved"] == 1
    assert found["mean_reward"] == pytest.approx(0.3)
    assert found["pass_at_k"] is None
    assert found["resolved_ids"] == ["r-ok"]
    assert found["unresolved_ids"] == ["r-half"]
    assert found["error_ids"] == ["r-exit", "r-raise", "r-timeout"]
    assert found["run"] == meta
    assert found["samples"] is None
    groups = {(g["status"], g["error_type"]): g for g in found["failures"]}
    assert set(groups) == {
        ("agent_error", "RuntimeError"),
        ("crashed", "EpisodeCrashed"),
        ("timeout", "EpisodeTimeout"),
    }
    assert groups[("crashed", "EpisodeCrashed")]["exit_code"] == 3
    for (status, _), group in groups.items():
        [result] = group["results"]
        assert by_id[result["instance_id"]]["status"] == status
        assert result["log_path"] == by_id[result["instance_id"]]["log_path"]
        assert result["episode_id"] == by_id[result["instance_id"]]["episode_id"]
    assert found["nodes"] == {host: found["counts"]}
    assert found["containment"] == {auto[0]: found["counts"]}
    assert found["duration_s"]["max"] == max(e["duration_s"] for e in by_id.values())
    # The timeout's episode: the agent's share of its 1 s, its teardown in the rest
    # (docs/cancellation.md, "The deadline of an econfig episode").
    assert found["duration_s"]["max"] >= 0.5
    assert found["finished"]["first"] <= found["finished"]["last"]

    png = agents.tmp / "plots" / "results.png"
    png.parent.mkdir()
    before = out.read_bytes()
    proc = report(str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == text  # the same report, and the plot beside it
    assert f"isolate: wrote {png}" in proc.stderr
    assert png.stat().st_size > 10_000
    assert png_size(png) == (1200, 480)
    assert out.read_bytes() == before  # a report changes nothing


def test_last_line_wins_and_what_is_not_final(tmp_path: Path) -> None:
    path = write_records(
        tmp_path / "results.jsonl",
        [
            # Resumed: a crash with a retry left, then the retry's result.
            line("a", 1, "crashed", final=False, exit_code=3, error={"type": "X", "message": "m"}),
            line("a", 2, "ok", finished_at="2026-01-01T10:05:00Z", duration_s=2.5),
            line("b", 1, "ok", reward=0.5, node="node-b"),
            # A setup error is never final: it runs again.
            line(
                "c", 1, "setup_error", log_path=None, error={"type": "SetupError", "message": "s"}
            ),
            # Written before node and containment were recorded.
            {"instance_id": "d", "attempt": 1, "final": True, "status": "agent_error"},
        ],
    )
    found = report_json(path)
    assert (found["lines"], found["results"], found["earlier_attempts"]) == (5, 4, 1)
    assert found["counts"] == {"ok": 2, "agent_error": 1, "setup_error": 1}
    assert found["not_final"] == {"setup_error": 1}
    assert found["final"] == 3
    assert found["resolved"] == 1  # a: reward 1; b: 0.5
    assert found["mean_reward"] == pytest.approx(0.5)  # (1 + 0.5 + 0) / 3 final results
    assert [g["status"] for g in found["failures"]] == ["agent_error", "setup_error"]
    assert "crashed" not in json.dumps(found["failures"])  # a's crash was not its result
    setup = found["failures"][1]
    assert setup["results"] == [
        {
            "instance_id": "c",
            "sample": None,
            "attempt": 1,
            "final": False,
            "message": "s",
            "log_path": None,
            "episode_id": None,
            "gave_up_after_runs": None,
        }
    ]
    assert found["nodes"] == {
        "(not recorded)": {"agent_error": 1},
        "node-a": {"ok": 1, "setup_error": 1},
        "node-b": {"ok": 1},
    }
    assert found["finished"] == {
        "first": "2026-01-01T10:00:00Z",
        "last": "2026-01-01T10:05:00Z",
        "span_s": 300.0,
    }
    assert found["duration_s"] == {"p50": 1.0, "p95": 2.5, "max": 2.5}

    text = report(str(path)).stdout
    assert "4 instances, 4 results from 5 lines (1 earlier attempt)" in text
    assert "not final    1 (setup_error 1): a rerun of the batch runs them again" in text
    assert "  setup_error  SetupError  (1)\n    e.g. s\n    c  no log\n" in text
    assert "finished     2026-01-01T10:00:00Z to 2026-01-01T10:05:00Z (5m00s)" in text


def test_samples_give_pass_at_k(tmp_path: Path) -> None:
    rewards = {"p": [1.0, 0.0, 0.0], "q": [1.0, 1.0, 1.0], "r": [0.0, 0.0, 0.0]}
    lines = []
    for instance_id, values in rewards.items():
        for sample, reward in enumerate(values):
            lines.append(line(instance_id, 1, "ok", sample=sample, reward=reward))
    # A sample that crashed and was retried counts once, by its last line.
    lines.insert(1, line("p", 1, "crashed", sample=1, final=False, exit_code=3))
    lines[2]["attempt"] = 2
    path = write_records(tmp_path / "results.jsonl", lines)
    found = report_json(path)
    assert found["samples"] == {"min": 3, "max": 3}
    assert found["resolved"] == 4
    # 1 - C(n-c, k) / C(n, k) per instance, averaged: p has c=1, q c=3, r c=0, of n=3.
    expected = {1: (1 / 3 + 1 + 0) / 3, 2: (2 / 3 + 1 + 0) / 3, 3: (1 + 1 + 0) / 3}
    assert [p["k"] for p in found["pass_at_k"]["values"]] == [1, 2, 3]
    for p in found["pass_at_k"]["values"]:
        assert p["value"] == pytest.approx(expected[p["k"]])
        assert p["instances"] == 3
    text = report(str(path)).stdout
    assert "3 instances x 3 samples, 9 results from 10 lines (1 earlier attempt)" in text
    assert "pass@1       0.444  (3 instances, 3 samples each)\n" in text
    assert "pass@2       0.556\n" in text
    assert "pass@3       0.667\n" in text

    # An instance with fewer samples counts only for the k it has enough samples for.
    more = [*lines, line("s", 1, "ok", sample=0, reward=1.0)]
    found = report_json(write_records(tmp_path / "more.jsonl", more))
    values = {p["k"]: p for p in found["pass_at_k"]["values"]}
    assert values[1]["value"] == pytest.approx((1 / 3 + 1 + 0 + 1) / 4)
    assert values[1]["instances"] == 4
    assert values[3]["value"] == pytest.approx(expected[3])
    assert values[3]["instances"] == 3


def test_one_instance_is_one_instance(tmp_path: Path) -> None:
    path = write_records(tmp_path / "results.jsonl", [line("a", 1, "ok")])
    proc = report(str(path))
    assert proc.returncode == 0, proc.stderr
    expected = f"isolate report: {path}: 1 instance, 1 result from 1 line (0 earlier attempts)"
    assert proc.stdout.startswith(expected + "\n"), proc.stdout


def test_a_partial_last_line_is_ignored_and_left_alone(tmp_path: Path) -> None:
    path = write_records(tmp_path / "results.jsonl", [line("a", 1, "ok")])
    with open(path, "a") as f:
        f.write('{"instance_id": "b", "attempt": 1, "fin')
    before = path.read_bytes()
    proc = report(str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["results"] == 1
    assert "ignored a partial last line" in proc.stderr
    assert path.read_bytes() == before


def test_a_report_reads_while_a_batch_holds_the_file(tmp_path: Path) -> None:
    path = write_records(tmp_path / "results.jsonl", [line("a", 1, "ok")])
    writer = Results(path)
    writer.open()  # the lock a running batch holds
    try:
        writer.append(line("b", 1, "agent_error"))
        found = report_json(path)
    finally:
        writer.close()
    assert found["counts"] == {"ok": 1, "agent_error": 1}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read {path}: No such file or directory"),
        (b"", "{path} holds no result line of isolate batch"),
        (b"not json\n", "{path}:1 is not a result line of isolate batch (not JSON)"),
        (b"[1, 2]\n", "{path}:1 is not a result line of isolate batch (a JSON list"),
        (
            b'{"instance_id": "x", "problem_statement": "y"}\n',
            '{path}:1 is not a result line of isolate batch (no "attempt" or "status": '
            "a records file?)",
        ),
        (
            json.dumps(line("a", 1, "ok")).encode() + b'\n{"instance_id": "b", "attempt": 1, '
            b'"status": "great"}\n',
            "{path}:2 is not a result line of isolate batch (\"status\" 'great'",
        ),
        (
            json.dumps(line("a", 1, "ok", sample=-1)).encode() + b"\n",
            '{path}:1 is not a result line of isolate batch ("sample" is not an integer',
        ),
        (PNG_MAGIC, "{path}:1 is not a result line of isolate batch (not JSON)"),
    ],
    ids=["missing", "empty", "not-json", "not-object", "records", "status", "sample", "png"],
)
def test_what_is_not_a_results_file_exits_2(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "results.jsonl"
    if content is not None:
        path.write_bytes(content)
    proc = report(str(path))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"isolate: error: {message.format(path=path)}"), proc.stderr


def test_a_directory_exits_2(tmp_path: Path) -> None:
    proc = report(str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr == f"isolate: error: cannot read {tmp_path}: Is a directory\n"


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path: Path) -> None:
    path = write_records(tmp_path / "results.jsonl", [line("a", 1, "ok")])
    png = tmp_path / "plot.png"
    # A None entry in sys.modules makes every import of the package fail, as if absent.
    code = (
        "import sys; sys.modules['matplotlib'] = None; from isolate._cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "report", str(path), "--plot", str(png)],
        capture_output=True,
        text=True,
        env=cli_env(),
        stdin=subprocess.DEVNULL,
        timeout=60 * SLOW,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        f"isolate: error: --plot needs matplotlib: {sys.executable} -m pip install "
        "'matplotlib>=3.7'\n"
    )
    assert proc.stdout == ""
    assert not png.exists()


def test_a_plot_that_cannot_be_written_exits_1(tmp_path: Path) -> None:
    path = write_records(tmp_path / "results.jsonl", [line("a", 1, "ok")])
    target = tmp_path / "no-such-dir" / "plot.png"
    proc = report(str(path), "--plot", str(target))
    assert proc.returncode == 1
    assert f"isolate: error: cannot write {target}: No such file or directory" in proc.stderr
    assert "isolate report:" in proc.stdout  # the report itself was printed


def test_a_plot_of_lines_without_times_or_durations(tmp_path: Path) -> None:
    path = write_records(
        tmp_path / "results.jsonl",
        [{"instance_id": "a", "attempt": 1, "final": True, "status": "crashed"}],
    )
    png = tmp_path / "plot.png"
    proc = report(str(path), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png_size(png) == (1200, 480)
