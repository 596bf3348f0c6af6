"""Section ``layers``: launch latency of a no-op episode at every containment combination this
machine provides, side by side with the bare interpreter, in one parent.

The default changed from ``cgroup`` to ``cgroup+pidns`` (``auto``); this says what each layer
costs. Every round runs each contender ``k`` times in a row, in an order that rotates per
round; ratios are per round (against the floor, and against ``cgroup``, the old default).
Beside wall time, the CPU time of the episode's processes (user + system, from
``RUSAGE_CHILDREN``): on a loaded machine it says what a layer costs where wall time wobbles.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import anyio

import isolate
from isolate._core import containment as _containment

from ._common import MARK_ENV, bare_launches, paired_ratio, summary
from ._context import Context

NOOP_AGENT = "def run(data, **kwargs):\n    return 1.0\n"
BARE = "bare"
OLD_DEFAULT = "cgroup"


async def _episodes(spec: isolate.EpisodeSpec, k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        outcome = await isolate.run_episode(spec, {"instance_id": "noop"})
        if outcome.status != "ok" or outcome.containment != spec.containment:
            raise RuntimeError(f"no-op episode at {spec.containment}: {outcome.summary()}")
    return time.perf_counter() - t0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def _measure(
    ctx: Context, combos: list[str], rounds: int, k: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    root = ctx.workdir / "layers_agent"
    root.mkdir(exist_ok=True)
    (root / "noop_agent.py").write_text(NOOP_AGENT)
    base = isolate.EpisodeSpec(
        agent_root=root, entrypoint="noop_agent:run", timeout=60.0, kill_grace=1.0,
        env={MARK_ENV: ctx.run_id},
    )  # fmt: skip
    specs = {c: base.model_copy(update={"containment": c}) for c in combos}
    names = [BARE, *combos]
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up: probes, page cache, the shim's bytecode
        await (bare_launches(1) if name == BARE else _episodes(specs[name], 1))
    for index in range(rounds):
        order = names[index % len(names) :] + names[: index % len(names)]
        for name in order:
            before = _children_cpu()
            spent = await (bare_launches(k) if name == BARE else _episodes(specs[name], k))
            times[name].append(spent / k)
            cpu[name].append((_children_cpu() - before) / k)
    return times, cpu


def run(ctx: Context) -> dict[str, Any]:
    rounds, k = (2, 1) if ctx.quick else (15, 4)
    combos, skipped = [], {}
    for combo in _containment.COMBINATIONS:
        problem = _containment.problem(combo)
        if problem is None:
            combos.append(combo)
        else:
            skipped[combo] = problem
    auto = _containment.resolve("auto", None)
    times, cpu = anyio.run(_measure, ctx, combos, rounds, k)
    rows = {}
    for name, samples in times.items():
        rows[name] = summary(samples)
        rows[name]["samples"] = samples
        rows[name]["ratio"] = paired_ratio(samples, times[BARE])
        rows[name]["cpu"] = summary(cpu[name])
        if OLD_DEFAULT in times:
            rows[name]["vs_old_default"] = paired_ratio(samples, times[OLD_DEFAULT])
    return {
        "unit": "s/episode",
        "rounds": rounds,
        "episodes_per_sample": k,
        "auto": auto[0] if isinstance(auto, tuple) else None,
        "old_default": OLD_DEFAULT,
        "skipped": skipped,
        "rows": rows,
    }
