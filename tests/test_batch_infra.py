"""``isolate batch --backend ray``: a lost Ray worker or node is an infrastructure failure,
recorded as one (``infra: true``), retried under ``--retries-infra`` and counted apart in the
summary."""

from __future__ import annotations

import json
import re
import secrets
import socket
import subprocess
import sys
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
    # In the bundle of its attempt, under the run's id.
    run_id = json.loads((agents.tmp / "results.run.json").read_text())["run_id"]
    bundle = agents.logs.absolute() / run_id / lost["episode_id"]
    assert log == bundle / f"{lost['episode_id']}.log"
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


def _ray_start(ray: Path, env: dict[str, str], *args: str) -> None:
    proc = subprocess.run(
        [str(ray), "start", "--num-cpus", "1", "--node-ip-address", "127.0.0.1", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=90 * SLOW,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _cluster(ray_tmp: Path) -> list[psutil.Process]:
    """The processes of this test's cluster: its RAY_TMPDIR in their environment or their
    arguments (the agents a raylet starts have only the latter)."""
    found = []
    for proc in psutil.process_iter():
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if _env_of(proc).get("RAY_TMPDIR") == str(ray_tmp) or str(ray_tmp) in cmdline:
            found.append(proc)
    return _with_descendants(found)


def _with_descendants(procs: list[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and everything below them: a raylet's agents carry none of its marks."""
    found = {p.pid: p for p in procs}
    for proc in procs:
        try:
            found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.Error:
            continue
    return list(found.values())


def _kill_each(procs: list[psutil.Process]) -> None:
    """SIGKILL each; one may exit as the others die (a worker whose raylet went)."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            continue


def _stop_cluster(ray_tmp: Path) -> None:
    """Kill this test's cluster, found by its RAY_TMPDIR: never another Ray."""
    procs = _cluster(ray_tmp)
    _kill_each(procs)
    psutil.wait_procs(procs, timeout=10 * SLOW)
    wait_for(lambda: not _cluster(ray_tmp), 10, "the Ray cluster to stop")


def test_a_lost_ray_node_is_named_retried_under_its_own_budget_and_counted_apart(
    agents: Agents, ray_tmp: Path
) -> None:
    """Two Ray nodes on this machine (two raylets of one cluster), one attempt held on each;
    the second node's raylet is SIGKILLed. The attempt it ran is a NodeDiedError line that
    names that node, and runs again on the other under --retries-infra."""
    marker = f"isolate-second-node-{secrets.token_hex(6)}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(32)
    ray_env = cli_env(RAY_TMPDIR=str(ray_tmp), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    ray = Path(sys.executable).parent / "ray"
    hold = agents.tmp / "hold"
    hold.touch()
    records = write_records(
        agents.tmp / "records.jsonl",
        [record(agents, f"n-{i}", hold=str(hold)) for i in range(2)],
    )
    out = agents.tmp / "results.jsonl"
    args = flaky_args(agents, records, out, "--retries", "0", "--concurrency", "2")
    args += ["--backend", "ray", "--ray-address", f"127.0.0.1:{port}", "--ray-num-cpus", "1"]
    driver = None
    try:
        _ray_start(
            ray,
            ray_env,
            "--head",
            "--port",
            str(port),
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
        )
        _ray_start(
            ray,
            {**ray_env, "ISOLATE_TEST_NODE": marker},
            "--address",
            f"127.0.0.1:{port}",
            "--disable-usage-stats",
        )
        driver = start(args, agents.tmp, {**ray_env, "BATCH_KEY": KEY})
        holding = lambda: len(list(agents.pids.glob("holding-n-*"))) == 2  # noqa: E731
        wait_for(holding, 90, "an attempt held on each node")
        # The node goes as a machine would: its raylet, its workers, its agents, at once.
        node = _with_descendants(
            [p for p in psutil.process_iter() if _env_of(p).get("ISOLATE_TEST_NODE") == marker]
        )
        assert "raylet" in {_name(p) for p in node}, node
        _kill_each(node)
        wait_for(lambda: line_count(out) >= 1, 90, "the lost attempt's line")
        hold.unlink()  # the attempt left, and the next one, return at once
        code = driver.wait(timeout=120 * SLOW)
        assert code == 0, (agents.tmp / "driver.err").read_text()
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait()
        _stop_cluster(ray_tmp)
        remove_dead_parents_leaves()
    entries = results(out)
    stdout = (agents.tmp / "driver.out").read_text()
    lost = [e for e in entries if e["infra"]]
    assert len(lost) == 1, entries
    [lost_entry] = lost
    assert lost_entry["status"] == "crashed"
    assert lost_entry["final"] is False
    assert lost_entry["error"]["type"] in ("NodeDiedError", "WorkerCrashedError"), lost_entry
    assert lost_entry["duration_s"] > 0.1
    assert Path(lost_entry["log_path"]).is_file()
    lost_node = lost_entry["node"]
    assert re.fullmatch(r"ray:[0-9a-f]{20,}@\d+\.\d+\.\d+\.\d+", lost_node), lost_node
    by = {(e["instance_id"], e["attempt"]): e for e in entries}
    again = by[(lost_entry["instance_id"], 2)]
    other = by[({"n-0": "n-1", "n-1": "n-0"}[lost_entry["instance_id"]], 1)]
    assert (again["status"], again["final"], again["infra_failures"]) == ("ok", True, 1)
    assert (other["status"], other["final"], other["infra"]) == ("ok", True, False)
    # The attempt on the lost node ran there; the others on the node that is left.
    assert other["node"] != lost_node
    assert again["node"] == other["node"]
    assert len(entries) == 3
    assert re.search(r"^infra\s+1 \(retried\);", stdout, re.M), stdout
    assert not ANSI.search(stdout), stdout


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""  # gone meanwhile


def _env_of(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except psutil.Error:
        return {}
