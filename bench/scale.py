"""Item 4: many concurrent episodes that each sleep while writing to stderr.

A ticker task in the parent sleeps 5 ms at a time and records how late it wakes (event-loop
lag), from the first spawn to the last outcome; it also samples RSS and open fds. Afterwards:
fds and zombie children left over.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

import isolate

from ._common import (
    MARK_ENV,
    open_fds,
    percentile,
    rss_bytes,
    summary,
    zombie_children,
)
from ._context import Context

AGENT = """
import os, time

def run(data, **kwargs):
    chunks = data["bytes"] // 65536
    line = b"x" * 65535 + b"\\n"
    pause = data["seconds"] / chunks
    for _ in range(chunks):
        os.write(2, line)
        time.sleep(pause)
    return 1.0
"""
TICK_S = 0.005


async def _one_run(
    spec: isolate.EpisodeSpec, episodes: int, data: dict, tag: str
) -> dict[str, Any]:
    lags: list[float] = []
    peak = {"rss": 0, "fds": 0}
    outcomes: list[isolate.EpisodeOutcome] = []
    done = anyio.Event()

    async def ticker() -> None:
        n = 0
        while not done.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(TICK_S)
            lags.append(time.perf_counter() - t0 - TICK_S)
            n += 1
            if n % 10 == 0:
                peak["rss"] = max(peak["rss"], rss_bytes())
                peak["fds"] = max(peak["fds"], open_fds())

    async def one(i: int) -> None:
        outcomes.append(await isolate.run_episode(spec, data, episode_id=f"scale-{tag}-{i}"))

    fds0, rss0 = open_fds(), rss_bytes()
    t0 = time.perf_counter()
    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker)
        async with anyio.create_task_group() as tg:
            for i in range(episodes):
                tg.start_soon(one, i)
        done.set()
    wall = time.perf_counter() - t0
    peak["rss"] = max(peak["rss"], rss_bytes())
    # fds are closed when run_episode returns; give stragglers (thread pool) a moment.
    end = time.monotonic() + 5.0
    while open_fds() > fds0 and time.monotonic() < end:  # noqa: ASYNC110 - polling a count
        await anyio.sleep(0.05)
    statuses: dict[str, int] = {}
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    result = {
        "wall_s": wall,
        "lag_p50_ms": 1000 * (percentile(lags, 50) or 0.0),
        "lag_p99_ms": 1000 * (percentile(lags, 99) or 0.0),
        "lag_max_ms": 1000 * max(lags, default=0.0),
        "ticks": len(lags),
        "rss_peak_growth_kib_per_episode": (peak["rss"] - rss0) / 1024 / episodes,
        "rss_after_growth_kib_per_episode": (rss_bytes() - rss0) / 1024 / episodes,
        "fds_before": fds0,
        "fds_peak": peak["fds"],
        "fds_left": open_fds() - fds0,
        "zombies_left": len(zombie_children()),
        "statuses": statuses,
        "log_bytes": sum(o.log_path.stat().st_size for o in outcomes if o.log_path),
    }
    for o in outcomes:  # 1 MiB each: do not fill the disk over several runs
        if o.log_path is not None:
            o.log_path.unlink(missing_ok=True)
    return result


async def _main(ctx: Context) -> dict[str, Any]:
    if ctx.quick:
        episodes, seconds, size, reps = 10, 0.5, 128 * 1024, 1
    else:
        episodes, seconds, size, reps = 200, 2.0, 1 << 20, 3
    agent_root = ctx.workdir / "scale_agent"
    agent_root.mkdir(exist_ok=True)
    (agent_root / "scale_agent.py").write_text(AGENT)
    spec = isolate.EpisodeSpec(
        agent_root=agent_root,
        entrypoint="scale_agent:run",
        timeout=300.0,
        kill_grace=1.0,
        log_dir=ctx.workdir / "scale_logs",
        env={MARK_ENV: ctx.run_id},
    )
    data = {"seconds": seconds, "bytes": size}
    # Warm-up: imports, anyio's thread pool, the allocator's arenas.
    await _one_run(spec, min(episodes, 8), {"seconds": 0.1, "bytes": 65536}, "warm")
    runs = [await _one_run(spec, episodes, data, str(r)) for r in range(reps)]
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {
        "episodes": episodes,
        "sleep_s": seconds,
        "stderr_bytes": size,
        "rows": {k: summary([r[k] for r in runs]) for k in keys},
        "runs": runs,
    }


def run(ctx: Context) -> dict[str, Any]:
    result: dict[str, Any] = anyio.run(_main, ctx)
    return result
