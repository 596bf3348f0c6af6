"""One run of the ``fdlimit`` section, in a process of its own (its open-file limit set by the
caller): N concurrent episodes that sleep, timed from the first launch to the last outcome.

``python -m bench._fdlimit_worker CONFIG_JSON`` prints one JSON line of figures.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

import isolate

from ._common import open_fds, percentile, rss_bytes, zombie_children

AGENT = """
import os, sys, time

def run(data, **kwargs):
    sys.stderr.write("episode %d starts\\n" % data["i"])
    time.sleep(data["seconds"])
    sys.stderr.write("episode %d ends\\n" % data["i"])
    return 1.0
"""
TICK_S = 0.005


def _stats(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values, default=None),
    }


async def _main(cfg: dict[str, Any]) -> dict[str, Any]:
    workdir = Path(cfg["workdir"])
    root = workdir / "fdlimit_agent"
    root.mkdir(parents=True, exist_ok=True)
    (root / "fdlimit_agent.py").write_text(AGENT)
    spec = isolate.EpisodeSpec(
        agent_root=root,
        entrypoint="fdlimit_agent:run",
        timeout=cfg["seconds"] * 20 + 120,
        kill_grace=1.0,
        log_dir=workdir / "fdlimit_logs",
        env=cfg["env"],
    )
    limit_at_start = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Warm-up: imports, anyio's thread pool, the fd budget (sized here, before the run).
    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(isolate.run_episode, spec, {"i": -1, "seconds": 0.0})
    n = cfg["episodes"]
    lags: list[float] = []
    peak = {"rss": 0, "fds": 0, "running": 0, "waiting": 0}
    running = 0
    started: list[float] = []
    outcomes: list[isolate.EpisodeOutcome] = []
    done = anyio.Event()
    from isolate._core.system import admission

    async def ticker() -> None:
        ticks = 0
        while not done.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(TICK_S)
            lags.append(time.perf_counter() - t0 - TICK_S)
            ticks += 1
            if ticks % 10 == 0:
                peak["rss"] = max(peak["rss"], rss_bytes())
                peak["fds"] = max(peak["fds"], open_fds())
                peak["waiting"] = max(peak["waiting"], admission.waiting())

    async def one(i: int) -> None:
        nonlocal running
        began: list[float] = []

        def on_start(pid: int) -> None:
            nonlocal running
            began.append(time.monotonic())
            running += 1
            peak["running"] = max(peak["running"], running)

        data = {"i": i, "seconds": cfg["seconds"]}
        outcome = await isolate.run_episode(spec, data, episode_id=f"fd-{i}", on_start=on_start)
        running -= len(began)
        started.extend(began)
        outcomes.append(outcome)
        if outcome.log_path is not None:
            outcome.log_path.unlink(missing_ok=True)

    fds0, rss0, load0 = open_fds(), rss_bytes(), os.getloadavg()
    t0 = time.monotonic()
    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker)
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
        done.set()
    wall = time.monotonic() - t0
    end = time.monotonic() + 5.0
    while open_fds() > fds0 and time.monotonic() < end:  # noqa: ASYNC110 - polling a count
        await anyio.sleep(0.05)
    statuses = Counter(o.status for o in outcomes)
    growth = peak["rss"] - rss0
    return {
        "episodes": n,
        "sleep_s": cfg["seconds"],
        "limit_at_start": list(limit_at_start),
        "limit_in_run": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "ok": statuses["ok"],
        "statuses": dict(statuses),
        "problems": [o.summary() for o in outcomes if o.status != "ok"][:5],
        "wall_s": wall,
        "all_started_s": (max(started) - t0) if len(started) == n else None,
        "lag_ms": {k: 1000 * v if v is not None else None for k, v in _stats(lags).items()},
        "fds_peak": peak["fds"],
        "fds_per_running_episode": (peak["fds"] - fds0) / max(peak["running"], 1),
        "running_peak": peak["running"],
        "waiting_peak": peak["waiting"],
        "rss_growth_kib_per_episode": growth / 1024 / n,
        "rss_growth_kib_per_running_episode": growth / 1024 / max(peak["running"], 1),
        "admission_s": _stats([o.timings.admission_s for o in outcomes]),
        "start_wait_s": _stats([o.timings.start_wait_s for o in outcomes]),
        "start_s": _stats([o.timings.start_s for o in outcomes if o.timings.start_s is not None]),
        "containment": sorted({o.containment for o in outcomes}),
        "fds_left": open_fds() - fds0,
        "zombies_left": len(zombie_children()),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    cfg = json.loads(sys.argv[1])
    result = anyio.run(_main, cfg)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
