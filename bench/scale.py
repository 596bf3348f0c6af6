"""Item 4: many concurrent episodes that each sleep while writing to stderr.

A ticker task in the parent sleeps 5 ms at a time and records how late it wakes (event-loop
lag), from the first spawn to the last outcome; it also samples RSS and open fds. The event
loop thread's own CPU time and run-queue wait (``/proc/thread-self/schedstat``) tell a loop
that was *blocked* (CPU busy) from one that was *starved* (runnable, but the CPUs were taken).

Side by side, in alternating runs: isolate (stderr logged to a file) and the same body as bare
``python -I`` children through ``anyio.open_process`` (stderr drained and dropped).

``run_fdlimit`` (section ``fdlimit``): 1,000 concurrent sleeping episodes in a fresh process
at this machine's open-file limit, and the same under ``ulimit -n 1024`` (soft and hard), where
the fd budget makes most of them wait (``bench/_fdlimit_worker.py``).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from typing import Any

import anyio

import isolate

from ._common import (
    MARK_ENV,
    REPO,
    open_fds,
    paired_ratio,
    percentile,
    rss_bytes,
    summary,
    zombie_children,
)
from ._context import Context

AGENT = """
import os, time

def work(seconds, size):
    chunks = max(1, size // 65536)
    line = b"x" * 65535 + b"\\n"
    for _ in range(chunks):
        os.write(2, line)
        time.sleep(seconds / chunks)

def run(data, **kwargs):
    work(data["seconds"], data["bytes"])
    return 1.0
"""
BARE = "import sys; sys.path.insert(0, sys.argv[1]); import scale_agent as a; a.work({}, {})"
TICK_S = 0.005
CONTENDERS = ("isolate", "bare")


def _loop_thread_sched() -> tuple[float, float]:
    """(CPU seconds, seconds runnable but waiting for a CPU) of the calling thread."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, waiting = f.read().split()[:2]
    return int(on_cpu) / 1e9, int(waiting) / 1e9


async def _one_run(episodes: int, one: Any) -> dict[str, Any]:
    lags: list[float] = []
    peak = {"rss": 0, "fds": 0}
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

    fds0, rss0 = open_fds(), rss_bytes()
    sched0, cpu0, t0 = _loop_thread_sched(), time.process_time(), time.perf_counter()
    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker)
        async with anyio.create_task_group() as tg:
            for i in range(episodes):
                tg.start_soon(one, i)
        done.set()
    wall, cpu, sched1 = time.perf_counter() - t0, time.process_time() - cpu0, _loop_thread_sched()
    peak["rss"] = max(peak["rss"], rss_bytes())
    # fds are closed when an episode returns; give stragglers (thread pool) a moment.
    end = time.monotonic() + 5.0
    while open_fds() > fds0 and time.monotonic() < end:  # noqa: ASYNC110 - polling a count
        await anyio.sleep(0.05)
    return {
        "wall_s": wall,
        "lag_p50_ms": 1000 * (percentile(lags, 50) or 0.0),
        "lag_p99_ms": 1000 * (percentile(lags, 99) or 0.0),
        "lag_max_ms": 1000 * max(lags, default=0.0),
        "ticks": len(lags),
        "loop_thread_cpu_s": sched1[0] - sched0[0],
        "loop_thread_runqueue_wait_s": sched1[1] - sched0[1],
        "parent_cpu_ms_per_episode": 1000 * cpu / episodes,
        "rss_peak_growth_kib_per_episode": (peak["rss"] - rss0) / 1024 / episodes,
        "rss_after_growth_kib_per_episode": (rss_bytes() - rss0) / 1024 / episodes,
        "fds_peak": peak["fds"],
        "fds_left": open_fds() - fds0,
        "zombies_left": len(zombie_children()),
    }


async def _main(ctx: Context) -> dict[str, Any]:
    if ctx.quick:
        episodes, seconds, size, reps = 10, 0.5, 128 * 1024, 1
    else:
        episodes, seconds, size, reps = 200, 2.0, 1 << 20, 3
    agent_root = ctx.workdir / "scale_agent"
    agent_root.mkdir(exist_ok=True)
    (agent_root / "scale_agent.py").write_text(AGENT)
    log_dir = ctx.workdir / "scale_logs"
    spec = isolate.EpisodeSpec(
        agent_root=agent_root,
        entrypoint="scale_agent:run",
        timeout=300.0,
        kill_grace=1.0,
        log_dir=log_dir,
        env={MARK_ENV: ctx.run_id},
    )
    data = {"seconds": seconds, "bytes": size}
    problems: list[str] = []
    logged = {"bytes": 0}
    levels: set[str] = set()

    async def one_isolate(i: int) -> None:
        outcome = await isolate.run_episode(spec, data, episode_id=f"scale-{i}")
        if outcome.status != "ok":
            problems.append(outcome.summary())
        levels.add(str(outcome.containment))
        if outcome.log_path is not None:  # 1 MiB each: do not fill the disk over the runs
            logged["bytes"] += outcome.log_path.stat().st_size
            outcome.log_path.unlink()

    cmd = [sys.executable, "-I", "-c", BARE.format(seconds, size), str(agent_root)]

    async def one_bare(i: int) -> None:
        null = subprocess.DEVNULL
        async with await anyio.open_process(cmd, stdin=null, stdout=null) as proc:
            assert proc.stderr is not None
            async for _ in proc.stderr:
                pass
            if await proc.wait() != 0:
                problems.append(f"bare child exited {proc.returncode}")

    ones = {"isolate": one_isolate, "bare": one_bare}
    # Warm-up: imports, anyio's thread pool, the allocator's arenas.
    for name in CONTENDERS:
        await _one_run(min(episodes, 8), ones[name])
    logged["bytes"] = 0
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    for r in range(reps):
        for name in CONTENDERS if r % 2 == 0 else tuple(reversed(CONTENDERS)):
            runs[name].append(await _one_run(episodes, ones[name]))
    keys = list(runs["isolate"][0])
    rows = {
        key: {name: summary([run[key] for run in runs[name]]) for name in CONTENDERS}
        | {
            "ratio": paired_ratio(
                [run[key] for run in runs["isolate"]], [run[key] for run in runs["bare"]]
            )
        }
        for key in keys
    }
    return {
        "episodes": episodes,
        "sleep_s": seconds,
        "stderr_bytes": size,
        "reps": reps,
        "containment": sorted(levels),
        "logged_bytes_per_episode": logged["bytes"] / (episodes * reps),
        "problems": problems[:5],
        "statuses_ok": not problems,
        "rows": rows,
        "runs": runs,
    }


def run(ctx: Context) -> dict[str, Any]:
    result: dict[str, Any] = anyio.run(_main, ctx)
    return result


# --- fdlimit: 1,000 concurrent episodes, at the default open-file limit and under ulimit -n 1024

#: Sets the interpreter's own RLIMIT_NOFILE (soft and hard), then becomes the worker.
_LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "n > 0 and resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def run_fdlimit(ctx: Context) -> dict[str, Any]:
    """The same N sleeping episodes in two fresh processes, side by side: one at this machine's
    open-file limit (which isolate raises to the hard limit), one under ``ulimit -n 1024``."""
    if ctx.quick:
        episodes, seconds, low = 24, 0.5, 64
    else:
        episodes, seconds, low = 1000, 60.0, 1024
    limits = {"default": 0, f"ulimit -n {low}": low}
    runs: dict[str, Any] = {}
    for name, limit in limits.items():
        cfg = {
            "workdir": str(ctx.workdir / f"fdlimit-{limit}"),
            "episodes": episodes,
            "seconds": seconds,
            "env": {MARK_ENV: ctx.run_id},
        }
        proc = subprocess.run(
            [sys.executable, "-c", _LIMITED, str(limit), "-m", "bench._fdlimit_worker"]
            + [json.dumps(cfg)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=episodes * seconds + 600,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{name} run failed: {proc.stderr[-2000:]}")
        runs[name] = json.loads(proc.stdout.splitlines()[-1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {
        "episodes": episodes,
        "sleep_s": seconds,
        "low_limit": low,
        "machine_limit": [soft, hard],
        "runs": runs,
    }
