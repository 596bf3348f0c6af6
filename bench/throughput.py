"""Item 2: throughput of no-op episodes at several concurrencies, isolate against the bare
interpreter floor (``python -I -c pass`` through ``anyio.open_process``), interleaved.

For each batch: episodes per second (wall) and CPU seconds of the parent per episode (every
thread of the parent; children's CPU is not counted).
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import anyio

import isolate

from ._common import MARK_ENV, cpu_seconds, paired_ratio, summary
from ._context import Context
from .launch import NOOP_AGENT

CONTENDERS = ("isolate", "bare")


async def _batch(one: Any, total: int, concurrency: int) -> tuple[float, float]:
    """Run ``total`` episodes, at most ``concurrency`` at a time; (episodes/s, CPU s/episode)."""
    limit = anyio.Semaphore(concurrency)

    async def guarded() -> None:
        async with limit:
            await one()

    cpu0, t0 = cpu_seconds(), time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(total):
            tg.start_soon(guarded)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    return total / wall, cpu / total


async def _main(ctx: Context) -> dict[str, Any]:
    agent_root = ctx.workdir / "throughput_agent"
    agent_root.mkdir(exist_ok=True)
    (agent_root / "noop_agent.py").write_text(NOOP_AGENT)
    spec = isolate.EpisodeSpec(
        agent_root=agent_root,
        entrypoint="noop_agent:run",
        timeout=120.0,
        kill_grace=1.0,
        env={MARK_ENV: ctx.run_id},
    )
    failures: list[str] = []
    seen: set[str] = set()

    async def one_isolate() -> None:
        outcome = await isolate.run_episode(spec, {"instance_id": "noop"})
        if outcome.status != "ok":
            failures.append(outcome.summary())
        seen.add(str(outcome.containment))

    async def one_bare() -> None:
        null = subprocess.DEVNULL
        cmd = [sys.executable, "-I", "-c", "pass"]
        async with await anyio.open_process(cmd, stdin=null, stdout=null, stderr=null) as proc:
            if await proc.wait() != 0:
                failures.append("bare interpreter failed")

    ones = {"isolate": one_isolate, "bare": one_bare}
    if ctx.quick:
        levels, reps = {1: 3, 4: 8}, 1
    else:
        levels, reps = {1: 16, 16: 96, 128: 256}, 3
    await _batch(one_isolate, 2, 2)  # warm-up: imports, thread pool
    await _batch(one_bare, 2, 2)
    eps: dict[int, dict[str, list[float]]] = {c: {n: [] for n in CONTENDERS} for c in levels}
    cpu: dict[int, dict[str, list[float]]] = {c: {n: [] for n in CONTENDERS} for c in levels}
    for r in range(reps):
        for concurrency, total in levels.items():
            order = CONTENDERS if r % 2 == 0 else tuple(reversed(CONTENDERS))
            for name in order:
                rate, per = await _batch(ones[name], total, concurrency)
                eps[concurrency][name].append(rate)
                cpu[concurrency][name].append(per)
    rows: dict[str, Any] = {}
    for concurrency, total in levels.items():
        for name in CONTENDERS:
            rows[f"{name}@{concurrency}"] = {
                "concurrency": concurrency,
                "episodes": total,
                "contender": name,
                "eps": summary(eps[concurrency][name]),
                "cpu_s": summary(cpu[concurrency][name]),
                "eps_ratio": paired_ratio(eps[concurrency][name], eps[concurrency]["bare"]),
                "cpu_ratio": paired_ratio(cpu[concurrency][name], cpu[concurrency]["bare"]),
            }
    return {
        "baseline": "bare",
        "reps": reps,
        "containment": sorted(seen),
        "rows": rows,
        "failures": failures[:5],
    }


def run(ctx: Context) -> dict[str, Any]:
    result: dict[str, Any] = anyio.run(_main, ctx)
    return result
