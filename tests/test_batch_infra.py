"""``isolate batch --backend ray``: a lost Ray worker is an infrastructure failure, recorded as
one (``infra: true``), retried under ``--retries-infra`` and counted apart in the summary."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psutil

from . import test_batch
from .conftest import (
    SLOW,
    Agents,
    episode_processes,
    remove_dead_parents_leaves,
    wait_for,
)
from .test_batch import (
    KEY,
    flaky_args,
    line_count,
    ray_processes,
    record,
    results,
    start,
    write_records,
)
from .test_cli import cli_env

ray_tmp = test_batch.ray_tmp  # the fixture


ANSI = re.compile(r"\x1b\[")


def _kill_worker_mid_episode(
    agents: Agents, ray_tmp: Path, *extra: str
) -> tuple[list[dict[str, Any]], str]:
    """Run w-0 (holding) and w-1 on a local Ray instance, kill the Ray worker running w-0 once
    w-1 has a line; the result lines and the driver's stdout."""
    hold = agents.tmp / "hold"
    hold.touch()
    records = write_records(
        agents.tmp / "records.jsonl",
        [record(agents, "w-0", hold=str(hold)), record(agents, "w-1")],
    )
    out = agents.tmp / "results.jsonl"
    args = flaky_args(agents, records, out, "--retries", "0", *extra)
    args += ["--backend", "ray", "--ray-local-cpus", "2"]
    driver = start(args, agents.tmp, cli_env(BATCH_KEY=KEY, RAY_TMPDIR=str(ray_tmp)))
    try:
        started = lambda: list(agents.pids.glob("holding-w-0")) and line_count(out)  # noqa: E731
        wait_for(started, 40, "w-0 to hold and w-1 to finish")
        tree = episode_processes(f"PID_DIR={agents.pids}".encode())
        pids = {p.pid for p in tree}
        [top] = [p for p in tree if p.ppid() not in pids]
        worker = psutil.Process(top.ppid())
        # Only a process of this test's own Ray instance is killed.
        assert worker.pid in ray_processes(ray_tmp) or str(ray_tmp) in str(worker.environ())
        hold.unlink()  # a second attempt returns at once
        worker.kill()
        code = driver.wait(timeout=40 * SLOW)
        assert code == 0, (agents.tmp / "driver.err").read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    wait_for(lambda: not ray_processes(ray_tmp), 10, "the Ray instance to stop")
    remove_dead_parents_leaves()
    return results(out), (agents.tmp / "driver.out").read_text()


def _check_lost(lost: dict[str, Any], agents: Agents) -> None:
    assert lost["status"] == "crashed"
    assert lost["infra"] is True
    assert lost["error"]["type"] == "WorkerCrashedError"
    assert lost["duration_s"] > 0.1  # measured by the driver, from submission to the loss
    assert lost["episode_id"].startswith("w-0.")
    log = Path(lost["log_path"])
    assert log == agents.logs.absolute() / lost["episode_id"] / f"{lost['episode_id']}.log"
    assert log.is_file()  # the attempt had started writing it
    assert lost["containment"] is None  # the attempt never reported one
    assert lost["containment_asked"] == "auto"
    assert re.fullmatch(r"ray:[0-9a-f]{20,}@\d+\.\d+\.\d+\.\d+", lost["node"]), lost["node"]


def test_a_lost_ray_worker_is_infra_and_retried_apart_from_retries(
    agents: Agents, ray_tmp: Path
) -> None:
    entries, stdout = _kill_worker_mid_episode(agents, ray_tmp)
    seen = sorted((e["instance_id"], e["attempt"], e["status"], e["final"]) for e in entries)
    # --retries 0, yet the lost attempt runs again: --retries-infra (default 3) covers it.
    assert seen == [
        ("w-0", 1, "crashed", False),
        ("w-0", 2, "ok", True),
        ("w-1", 1, "ok", True),
    ]
    by = {(e["instance_id"], e["attempt"]): e for e in entries}
    lost, again = by[("w-0", 1)], by[("w-0", 2)]
    _check_lost(lost, agents)
    assert (again["infra"], again["infra_failures"]) == (False, 1)
    assert again["episode_id"] != lost["episode_id"]
    assert again["node"] == lost["node"]  # one node: the same Ray node id ran both
    assert by[("w-1", 1)]["infra"] is False
    assert re.search(r"^infra\s+1 \(retried\);", stdout, re.M), stdout
    assert "1 retried" in stdout
    assert not ANSI.search(stdout), stdout  # Ray's own output is not in the summary


def test_with_retries_infra_0_a_lost_worker_is_final(agents: Agents, ray_tmp: Path) -> None:
    entries, stdout = _kill_worker_mid_episode(agents, ray_tmp, "--retries-infra", "0")
    seen = sorted((e["instance_id"], e["attempt"], e["status"], e["final"]) for e in entries)
    assert seen == [("w-0", 1, "crashed", True), ("w-1", 1, "ok", True)]
    [lost] = [e for e in entries if e["instance_id"] == "w-0"]
    _check_lost(lost, agents)
    assert lost["infra_failures"] == 1
    assert re.search(r"^infra\s+1 \(final\);", stdout, re.M), stdout
    assert re.search(r"^ crashed\s+1\s", stdout, re.M), stdout
    assert not ANSI.search(stdout), stdout
