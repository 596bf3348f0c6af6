"""The benchmark suite in --quick mode, so it cannot rot: every section runs (a few episodes,
a 64 MiB "large" parent, 10 episodes at scale), writes sane JSON and leaves nothing behind.
Only the shape and sanity of the figures are checked here, never the performance targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from . import _internals
from .conftest import SLOW

REPO = Path(__file__).resolve().parent.parent
SECTIONS = (
    "launch",
    "large",
    "throughput",
    "teardown",
    "scale",
    "fdlimit",
    "footprint",
    "layers",
    "realistic",
)


def _positive(summary: dict[str, Any]) -> bool:
    return summary["n"] > 0 and summary["min"] > 0 and summary["median"] > 0


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--json", str(out), "--workdir", str(tmp)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90 * SLOW,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert str(out) in proc.stdout
    assert "| isolate (`run_episode`) |" in proc.stdout
    assert out.with_suffix(".md").read_text().startswith("# isolate benchmarks")
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_every_section_ran(results: dict[str, Any]) -> None:
    assert results["quick"] is True
    for name in SECTIONS:
        assert name in results["sections"], name
        assert "error" not in results["sections"][name], results["sections"][name]
    assert results["leftovers"] == []
    assert results["live_children_at_end"] == []
    for name in ("launch", "throughput", "teardown", "scale", "footprint"):
        assert results["sections"][name]["containment"], name  # the level isolate used
    machine = results["machine"]
    assert machine["cores"] >= 1
    assert machine["python"].count(".") == 2


def test_launch_figures(results: dict[str, Any]) -> None:
    for parent in ("launch", "large"):
        rows = results["sections"][parent]["rows"]
        for name, row in rows.items():
            assert _positive(row), (parent, name)
            assert _positive(row["ratio"]), (parent, name)
        assert rows["bare"]["ratio"]["median"] == pytest.approx(1.0)
        assert rows["isolate"]["median"] > rows["inprocess"]["median"]
        # The normal exit's price, against the same episode whose worker uses os._exit.
        for name in ("isolate", "isolate_heavy"):
            cost = results["sections"][parent]["exit_cost"][name]
            assert _positive(cost["ratio"]), (parent, name)
            assert cost["extra_s"]["n"] == len(rows[name]["samples"])
        hardening = results["sections"][parent]["hardening_cost"]["isolate"]
        assert _positive(hardening["ratio"]), parent
        assert hardening["extra_s"]["n"] == len(rows["isolate"]["samples"])
    large = results["sections"]["large"]
    assert large["parent_rss_mib"] > results["sections"]["launch"]["parent_rss_mib"] + 48
    assert _positive(large["vs_small"]["isolate"])


def test_throughput_figures(results: dict[str, Any]) -> None:
    section = results["sections"]["throughput"]
    assert section["failures"] == []
    assert {r["contender"] for r in section["rows"].values()} == {"isolate", "bare"}
    for row in section["rows"].values():
        assert _positive(row["eps"])
        assert _positive(row["cpu_s"])


def test_teardown_figures(results: dict[str, Any]) -> None:
    rows = results["sections"]["teardown"]["rows"]
    for mode in ("term", "ignore"):
        row = rows[f"isolate/{mode}"]
        assert row["survivors"]["max"] == 0
        for run in row["runs"]:
            assert run["status"] == "timeout"
            assert run["survivors"] == 0
            assert run["return_s"] > 0
    # The baselines leave grandchildren behind: that is the point of the comparison.
    # (pebble is in the optional "bench" group; without it its rows are skipped, not failed.)
    for baseline in ("pebble/term", "anyio/term"):
        if baseline in rows:
            assert rows[baseline]["survivors"]["median"] > 0
    assert "anyio/term" in rows


def test_scale_figures(results: dict[str, Any]) -> None:
    section = results["sections"]["scale"]
    assert section["statuses_ok"], section["problems"]
    assert section["logged_bytes_per_episode"] >= section["stderr_bytes"]
    for name in ("isolate", "bare"):
        for run in section["runs"][name]:
            assert run["zombies_left"] == 0
            assert run["fds_left"] <= 0
            assert run["ticks"] > 0
            assert run["wall_s"] >= section["sleep_s"]


def test_fdlimit_figures(results: dict[str, Any]) -> None:
    section = results["sections"]["fdlimit"]
    low = section["runs"][f"ulimit -n {section['low_limit']}"]
    assert low["limit_in_run"][0] == section["low_limit"]
    for run in section["runs"].values():
        assert run["ok"] == section["episodes"], run["problems"]
        assert run["fds_left"] <= 0
        assert run["zombies_left"] == 0
        assert run["fds_peak"] > 0
    # Under the low limit the budget holds episodes back; they wait, none fails.
    assert low["waiting_peak"] > 0
    assert low["admission_s"]["max"] > 0
    assert low["fds_peak"] <= section["low_limit"]


def test_footprint_figures(results: dict[str, Any]) -> None:
    rows = results["sections"]["footprint"]["rows"]
    for who in ("bare", "shim", "descendants", "total"):
        for field in ("rss", "uss", "pss"):
            assert _positive(rows[who][field]), (who, field)
    assert rows["total"]["rss"]["median"] > rows["shim"]["rss"]["median"]


def test_layers_figures(results: dict[str, Any]) -> None:
    section = results["sections"]["layers"]
    measured = set(section["rows"]) - {"bare"}
    assert measured | set(section["skipped"]) == set(_internals.COMBINATIONS)
    assert section["auto"] in measured
    for name, row in section["rows"].items():
        assert _positive(row), name
        assert _positive(row["ratio"]), name


def test_realistic_figures(results: dict[str, Any]) -> None:
    """The stand-in sleeps 0.3 s at import: a fresh start pays it every time, a fork never
    (how fast a fork is, is the benchmark's to say, not this test's)."""
    rows = results["sections"]["realistic"]["rows"]
    assert rows["template"]["start"] == "template"
    assert rows["fresh"]["start"] == "fresh"
    assert rows["fresh"]["first_line"]["min"] > 0.3
    assert rows["template"]["first_line"]["median"] < rows["fresh"]["first_line"]["min"]
    for mode in ("fresh", "template", "inprocess"):
        assert _positive(rows[mode]["launch"]), mode
        assert rows[mode]["throughput"] > 0, mode
        assert all(v > 0 for v in rows[mode]["pss_kib"].values()), mode


def test_realistic_compare(results: dict[str, Any]) -> None:
    """The template against the stdlib forkserver and a bare fork, in rotated rounds: every
    figure there, every paired ratio computed, and no process of theirs left. (The driver
    itself fails if the fork server did not preload the agent.)"""
    cmp = results["sections"]["realistic"]["compare"]
    rounds = cmp["counts"]["rounds"]
    assert len({tuple(o) for o in cmp["orders"]}) == rounds  # the order rotates
    for arm in ("template", "forkserver", "floor"):
        row = cmp["arms"][arm]
        assert len(row["rounds"]) == rounds, arm
        for figure in ("launch", "first_line", "cpu_per_episode", "pss_kib", "throughput"):
            assert _positive(row[figure]), (arm, figure)
        assert row["launch"]["n"] == rounds * cmp["counts"]["seq"], arm
        assert row["left"] == [], arm
    for pair in ("template/forkserver", "template/floor", "forkserver/floor"):
        for figure, ratio in cmp["ratios"][pair].items():
            assert ratio["n"] == rounds, (pair, figure)
            assert ratio["median"] > 0, (pair, figure)


def test_targets_listed(results: dict[str, Any]) -> None:
    names = [t["target"] for t in results["targets"]]
    assert any(n.startswith("launch ≤") for n in names)
    assert any(n.startswith("teardown") for n in names)
    assert any(n.startswith("scale") for n in names)
    assert sum("forkserver" in n for n in names) == 3


def test_every_shim_copy_the_benches_make_still_finds_its_lines(tmp_path: Path) -> None:
    """The benches that price a part of the shim run a copy with lines replaced; a line that
    moved or changed in the shim fails here, not only when that bench next runs."""
    from bench import world
    from bench._launch_worker import os_exit_shim, shim_variant, unhardened_shim

    made = [
        shim_variant(tmp_path, "before_world", world.BEFORE),
        unhardened_shim(tmp_path),
        os_exit_shim(tmp_path),
    ]
    assert [p.name for p in made] == ["boot.py"] * 3
    assert all(p.is_file() for p in made)
