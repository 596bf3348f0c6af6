"""The open-file limit: the soft limit is raised, episodes wait for fds instead of failing,
EMFILE at spawn means wait and retry, and an episode that can never fit says why.

Low limits are set in a test-spawned Python (it sets its own RLIMIT_NOFILE, then execs the
driver below), never in the test runner and never by the library."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import isolate

from . import _internals
from .conftest import SLOW, Agents, wait_until

# Runs N episodes at once in this process and prints what happened as one JSON line.
DRIVER = r"""
import json, logging, os, resource, sys, time
import anyio, isolate
from isolate._core.system import admission

cfg = json.loads(sys.argv[1])
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)

def fds():
    return len(os.listdir("/proc/self/fd")) - 1

async def main():
    spec = isolate.EpisodeSpec(**cfg["spec"])
    out = {"soft_before": cfg["soft_before"], "outcomes": [], "peak_fds": 0, "peak_waiting": 0}
    if cfg.get("warm"):  # size the budget first, with a table that is not yet full
        await isolate.run_episode(spec, {"i": -1})
    out["fds_before"] = fds()
    hogs = []
    if cfg.get("hog"):
        try:
            while True:
                hogs.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
    done = anyio.Event()

    async def watch():
        while not done.is_set():
            out["peak_fds"] = max(out["peak_fds"], fds() if not hogs else 0)
            out["peak_waiting"] = max(out["peak_waiting"], admission.waiting())
            if hogs and admission.waiting():
                await anyio.sleep(0.3)  # starved for a while: then give the fds back
                for fd in hogs:
                    os.close(fd)
                hogs.clear()
            await anyio.sleep(0.01)

    async def one(i):
        o = await isolate.run_episode(spec, {"i": i})
        out["outcomes"].append(json.loads(o.model_dump_json(include={
            "status", "reward", "error", "duration_s", "timings"})))

    async with anyio.create_task_group() as outer:
        outer.start_soon(watch)
        async with anyio.create_task_group() as tg:
            for i in range(cfg["n"]):
                tg.start_soon(one, i)
        done.set()
    out["soft_after"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    end = time.monotonic() + 5
    while fds() > out["fds_before"] and time.monotonic() < end:
        await anyio.sleep(0.02)
    out["fds_after"] = fds()
    print(json.dumps(out))

anyio.run(main)
"""

# Sets this interpreter's own limit, then becomes the driver (same pid, limit inherited).
LIMITED = (
    "import os, resource, sys; soft, hard = map(int, sys.argv[1:3]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])"
)

AGENT = """
import resource, time
def run(data):
    time.sleep(data.get("sleep", 0.2))
    return float(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def drive(
    agents: Agents,
    limit: tuple[int, int],
    n: int,
    *,
    env: dict[str, str] | None = None,
    log: bool = True,
    **cfg: Any,
) -> tuple[dict[str, Any], str]:
    spec = agents.spec(AGENT, timeout=60.0)
    fields = json.loads(spec.model_dump_json(include={"agent_root", "entrypoint", "env"}))
    if log:
        fields["log_dir"] = str(agents.logs)
    cfg = {"n": n, "spec": fields, "soft_before": limit[0], **cfg}
    driver = agents.tmp / "driver.py"
    driver.write_text(DRIVER)
    soft, hard = map(str, limit)
    proc = subprocess.run(
        [sys.executable, "-c", LIMITED, soft, hard, str(driver), json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=120 * SLOW,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


def statuses(result: dict[str, Any]) -> list[str]:
    return [o["status"] for o in result["outcomes"]]


def test_more_episodes_than_the_budget_all_end_ok_under_ulimit_64(agents: Agents) -> None:
    # 64 fds, 16 in reserve, ~9 open: room for 5 episodes with a log (7 fds each, while
    # spawning) to 9 (4 each, once started). 24 at once must queue, and all end ok.
    result, log = drive(agents, (64, 64), 24)
    assert statuses(result) == ["ok"] * 24, result["outcomes"]
    assert all(o["reward"] == 64.0 for o in result["outcomes"])
    waited = [o["timings"]["admission_s"] for o in result["outcomes"]]
    assert result["peak_waiting"] > 0
    assert sum(w > 0 for w in waited) >= 8  # the budget held them back
    assert result["peak_fds"] <= 64 - 16  # the reserve was left alone
    for o in result["outcomes"]:  # the wait is part of the duration, and reported on its own
        t = o["timings"]
        assert o["duration_s"] >= t["admission_s"] + t["start_wait_s"] + t["start_s"]
    assert result["fds_after"] == result["fds_before"]
    assert "waits for file descriptors" in log
    assert "admitted after" in log
    assert "Too many open files" not in log


@pytest.mark.parametrize("log", [True, False], ids=["log-open", "spawn"])
def test_emfile_means_wait_and_retry(agents: Agents, log: bool) -> None:
    # The budget is sized, then something else takes every free fd: the next episode's log
    # open (or spawn) fails with EMFILE; it waits, and starts once the fds are back.
    result, stderr = drive(agents, (64, 64), 1, warm=True, hog=True, log=log)
    assert statuses(result) == ["ok"], result["outcomes"]
    assert result["outcomes"][0]["timings"]["admission_s"] >= 0.25
    assert "waiting for file descriptors to be freed" in stderr
    assert result["fds_after"] == result["fds_before"]


def test_an_episode_that_can_never_fit_names_the_limit_and_the_fix(agents: Agents) -> None:
    result, _ = drive(agents, (24, 24), 2)
    assert statuses(result) == ["setup_error"] * 2
    message = result["outcomes"][0]["error"]["message"]
    assert "RLIMIT_NOFILE) is 24 (hard 24)" in message
    assert "it needs 7" in message
    assert "ulimit -n" in message


def test_the_soft_limit_is_raised_and_episodes_keep_the_old_one(agents: Agents) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < 256:
        pytest.skip(f"the hard open-file limit here is {hard}")
    result, log = drive(agents, (64, hard), 2)
    assert statuses(result) == ["ok", "ok"]
    assert result["soft_after"] == hard
    assert [o["reward"] for o in result["outcomes"]] == [64.0, 64.0]  # the agent's view
    assert f"from 64 to {hard}" in log
    assert all(o["timings"]["admission_s"] == 0 for o in result["outcomes"])


def test_the_raise_can_be_turned_off(agents: Agents) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    result, log = drive(agents, (64, hard), 1, env={_internals.RAISE_ENV: "0"})
    assert statuses(result) == ["ok"]
    assert result["soft_after"] == 64
    assert "stays as it is" in log


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.anyio
@pytest.mark.parametrize("log", [True, False], ids=["with-log", "without-log"])
async def test_fds_per_episode_are_what_the_budget_counts(agents: Agents, log: bool) -> None:
    """The budget's figure is the truth: count the parent's fds while an episode runs."""
    flag = agents.tmp / "running"
    spec = agents.spec(
        f"""
        import os, time
        def run(data):
            open({str(flag)!r}, "w").close()
            while os.path.exists({str(flag)!r}):
                time.sleep(0.01)
            return 1.0
        """,
        **({} if log else {"log_dir": None}),
    )
    await isolate.run_episode(agents.spec(AGENT), {})  # thread pool and budget exist
    before = open_fds()
    during: list[int] = []

    async def count_then_release() -> None:
        await wait_until(flag.exists)
        during.append(open_fds())
        flag.unlink()

    async with anyio.create_task_group() as tg:
        tg.start_soon(count_then_release)
        outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert during[0] - before == _internals.episode_fds(spec).steady == (4 if log else 3)
    assert outcome.timings.start_s is not None
    assert outcome.timings.start_s > 0


def test_batch_progress_says_waiting_for_file_descriptors(agents: Agents, tmp_path: Path) -> None:
    from .test_batch import KEY, batch_args, env, final, record, write_records

    records = write_records(
        tmp_path / "r.jsonl", [record(agents, f"w-{i}", sleep=0.5) for i in range(20)]
    )
    out = tmp_path / "out.jsonl"
    args = batch_args(agents, records, out, "--concurrency", "20", "--status-interval", "0.1")
    proc = subprocess.run(
        [sys.executable, "-c", LIMITED, "64", "64", "-m", "isolate", *args],
        capture_output=True,
        text=True,
        timeout=120 * SLOW,
        env=env(),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {e["status"] for e in final(out).values()} == {"ok"}
    assert max(e["admission_s"] for e in final(out).values()) > 0
    assert len(final(out)) == 20
    assert "waiting for file descriptors" in proc.stderr
    assert KEY not in proc.stderr + proc.stdout


@pytest.mark.anyio
async def test_held_fds_count_and_a_cancelled_wait_gives_its_place_back(agents: Agents) -> None:
    """``hold_fds`` (a template's control socket, say) shrinks what episodes may take at once;
    an episode cancelled while it waits for admission leaves nothing behind in the budget."""
    spec = agents.spec(AGENT)
    assert (await isolate.run_episode(spec, {})).status == "ok"  # this loop's budget exists
    budget = _internals.fd_budget()
    waiting_before = _internals.admission_waiting()
    hold = _internals.hold_fds(budget.capacity - budget.used - 1, "test hold")
    with anyio.move_on_after(0.3 * SLOW):
        await isolate.run_episode(spec, {})
        pytest.fail("admitted despite the hold")
    assert _internals.admission_waiting() == waiting_before  # the cancelled one left the queue
    outcome: list[isolate.EpisodeOutcome] = []

    async def run() -> None:
        outcome.append(await isolate.run_episode(spec, {}))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await wait_until(lambda: _internals.admission_waiting() > waiting_before)
        await anyio.sleep(0.2)
        hold.release()
    assert outcome[0].status == "ok", outcome[0].summary()
    assert outcome[0].timings.admission_s >= 0.2
    assert budget.used == 0
