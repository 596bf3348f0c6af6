"""The soak in miniature (``python -m bench.soak``): every kind of episode at once, exact
accounting of statuses, and nothing left behind: no process, zombie, fd, temporary file,
cgroup leaf or log handle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.soak import KINDS

from .conftest import SLOW

REPO = Path(__file__).resolve().parent.parent


def test_a_short_soak_accounts_for_every_episode_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    episodes = 4 * len(KINDS) + 4  # every kind at least four times
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--episodes",
            str(episodes),
            "--concurrency",
            "16",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60 * SLOW,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "accounting: exact" in done.stdout
    figures = json.loads(out.read_text())
    assert figures["episodes"] == episodes
    assert sum(figures["got"].values()) == episodes
    assert figures["got"] == figures["injected"]
    # Timeouts whose agents clean up (cancel first), counted by outcome.cleanup, and the marks
    # their clean-ups and the normal exits left.
    assert figures["cleanup_got"] == figures["cleanup_injected"]
    assert set(figures["cleanup_got"]) == {"finished", "cut short", "None"}
    assert figures["marks"] == figures["marks_expected"]
    assert figures["marks"]["cleaned"] >= 4
    assert set(figures["got"]) == {"ok", "agent_error", "crashed", "timeout"}
    assert figures["wrong"] == []
    assert figures["left"] == {
        "processes": 0,
        "zombies": 0,
        "fds": 0,
        "log_handles": 0,
        "temp_entries": 0,
        "cgroup_leaves": 0,
    }
    assert set(figures["median_s"]) == set(KINDS)
    # Teardown had work to do: at least each worker whose clean-up was cut short (and, unless
    # the machine was too slow for them to start in time, a sleep and a setsid daemon for each
    # timeout_tree; cancelled workers that finished their clean-up exit by themselves).
    assert figures["killed"] >= figures["cleanup_got"]["cut short"]
    # Logs are capped (limits.log_bytes) although some episodes wrote 10 MB.
    logs = list((tmp_path / "work" / "logs").iterdir())
    assert len(logs) == episodes
    assert max(p.stat().st_size for p in logs) < 256 * 1024 + 1024
