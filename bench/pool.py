"""Episodes from parked forks (``isolate.park``) against forks made on demand and against the
stdlib's forkserver: ``python -m bench.pool [--python P] [--imports CODE] [-n N] [--burst B]
[--rounds R]``.

Not part of the benchmark table. One template, at the default containment, and the stdlib
``multiprocessing`` forkserver with the same agent module preloaded, a ``Process`` per episode
(bench/_fork_arms.py, run by the agent's interpreter, a new fork server each round); the arms
alternate in rounds, their order turning. Figures: the no-op launch round trip (``run_episode``
to its return, one at a time, medians of N, and its part until the entrypoint's first line;
with the pool refilled before each, each parked fork's worker forked), and a burst of B
one-second episodes started at once, from a pool of B so filled: the time from the first
request until all have started (their first line) and until all have returned. Each round's
ratio of a template arm to the forkserver, and their median: the round trip, the time until
all have started, and the burst's overhead (until all returned, less the 1 s they hold).

The ``asked`` arm asks for its pool without waiting for it (``park(spec, n, wait=False)``, as
econfig ``park`` does in the AReaL drop-in): its round trips are a sequence with a pool of 4
that refills as it can (not before each), and its burst is the second of two RL steps: a
burst that asked for a pool of its size as it started, then the next one right after it
returned (and the first step's figures beside).

The ``bursts`` arm is the default, a pool nobody asked for, sized from the last burst: a
template of its own each round, its round trips a sequence (its pool of one refilling behind
each), and two RL steps, the second's figures (the first's beside).

``--network``: the template's episodes under ``Sandbox(network=["127.0.0.1:9"])``, each fork in
a network namespace of its own with the parent's proxy (the forkserver's processes share the
machine's network); with ``--fresh N``, N such episodes started fresh too (no ``preload``),
one at a time, their round trip's median beside the template's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import anyio
import psutil

import isolate
from isolate._core import templates as _templates

from ._context import Context
from .realistic import _fork_arm

AGENT = """
import time
%s
def run(data):
    first_line = time.time()
    time.sleep(data.get("sleep", 0.0))
    return 1.0, {"first_line": first_line}
"""


async def _filled(n: int) -> None:
    """Until the template's pool holds ``n`` again (refilled after hand-overs), each parked
    fork with its worker forked ahead."""
    while True:
        templates = _templates.started_templates()
        pool = templates[0].pool if templates else None
        if pool is None or (len(pool.parked) >= n and all(map(_has_worker, list(pool.parked)))):
            return
        await anyio.sleep(0.005)


def _has_worker(forked: _templates.Forked) -> bool:
    """Whether the parked fork is ready: its own worker, or one that has forked its worker."""
    if forked.alone:
        return True
    try:
        return bool(psutil.Process(forked.pid).children())
    except psutil.Error:
        return False


async def _round_trips(spec: isolate.EpisodeSpec, n: int, parked: int) -> tuple[float, float]:
    """Medians, in ms, of the round trip and of its part until the entrypoint's first line."""
    times, firsts = [], []
    for _ in range(n):
        await _filled(parked)
        started, t0 = time.monotonic(), time.time()
        outcome = await isolate.run_episode(spec, {})
        times.append((time.monotonic() - started) * 1000)
        assert (outcome.status, outcome.start) == ("ok", "template"), (
            outcome.summary(),
            outcome.preload_refused,
        )
        firsts.append((outcome.info["first_line"] - t0) * 1000)
    return statistics.median(times), statistics.median(firsts)


async def _burst(spec: isolate.EpisodeSpec, n: int) -> tuple[float, float]:
    """(seconds until all ``n`` started, until all returned) for ``n`` one-second episodes."""
    firsts: list[float] = []
    t0 = time.time()

    async def one() -> None:
        outcome = await isolate.run_episode(spec, {"sleep": 1.0})
        assert (outcome.status, outcome.start) == ("ok", "template"), (
            outcome.summary(),
            outcome.preload_refused,
        )
        firsts.append(outcome.info["first_line"])

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(one)
    return max(firsts) - t0, time.time() - t0


def _kib(pid: int, path: str, field: str) -> int:
    for line in Path(f"/proc/{pid}/{path}").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


async def _footprint(spec: isolate.EpisodeSpec, n: int) -> dict[str, list[float]]:
    """What one of ``n`` parked forks costs with its worker forked ahead: their own pages
    (USS; PSS would share the image's out among the forks), and their page tables (KiB)."""
    await isolate.park(spec, n)
    template = _templates.started_templates()[0]  # the spec's: the first started
    assert template.pool is not None
    pairs = []
    for forked in template.pool.parked:
        fork = psutil.Process(forked.pid)
        while not forked.alone and not fork.children():  # noqa: ASYNC110 - once in its leaf
            await anyio.sleep(0.005)
        pairs.append([forked.pid] + [c.pid for c in fork.children()])
    uss = [
        sum(
            _kib(pid, "smaps_rollup", "Private_Clean") + _kib(pid, "smaps_rollup", "Private_Dirty")
            for pid in pids
        )
        for pids in pairs
    ]
    pte = [sum(_kib(pid, "status", "VmPTE") for pid in pids) for pids in pairs]
    await isolate.park(spec, 0)
    return {
        f"parked fork ({n} parked): own pages (USS), KiB": [statistics.mean(uss)],
        f"parked fork ({n} parked): page tables, KiB": [statistics.mean(pte)],
    }


async def _fresh(spec: isolate.EpisodeSpec, n: int) -> list[float]:
    """Round trips, in ms, of ``n`` episodes of ``spec`` started fresh, one at a time."""
    fresh = spec.model_copy(update={"preload": False})
    times = []
    for _ in range(n):
        started = time.monotonic()
        outcome = await isolate.run_episode(fresh, {})
        assert (outcome.status, outcome.start) == ("ok", "fresh"), outcome.summary()
        times.append((time.monotonic() - started) * 1000)
    return times


ARMS = ("forkserver", "no pool", "pool", "asked", "bursts")


async def _template_arm(
    spec: isolate.EpisodeSpec, arm: str, args: argparse.Namespace, r: int
) -> dict[str, float]:
    if arm == "asked":
        return await _asked_arm(spec, args)
    if arm == "bursts":
        return await _bursts_arm(spec, args, r)
    parked = 4 if arm == "pool" else 0
    await isolate.park(spec, parked)
    rt, first = await _round_trips(spec, args.n, parked)
    await isolate.park(spec, args.burst if arm == "pool" else 0)
    await _filled(args.burst if arm == "pool" else 0)  # their workers forked too
    started, returned = await _burst(spec, args.burst)
    await isolate.park(spec, 0)  # no refill beside the next arm
    return {"launch": rt, "first": first, "started": started, "returned": returned}


async def _asked_arm(spec: isolate.EpisodeSpec, args: argparse.Namespace) -> dict[str, float]:
    """A pool asked for without waiting (``park(..., wait=False)``, as econfig ``park`` does),
    never waited for: the round trips of a sequence, with a pool of 4 that refills as it
    can; then two RL steps, a burst asked for a pool of its size as it starts, and the next
    burst right after it returned: the second's figures."""
    await isolate.park(spec, 4, wait=False)
    rt, first = await _round_trips(spec, args.n, 0)
    await isolate.park(spec, 0)
    await isolate.park(spec, args.burst, wait=False)
    return {"launch": rt, "first": first, **await _two_steps(spec, args.burst)}


async def _two_steps(spec: isolate.EpisodeSpec, n: int) -> dict[str, float]:
    """Two bursts of ``n``, the second right after the first returned: the second's figures,
    the first's beside; the pool emptied after, ``park(spec, 0)``."""
    started1, returned1 = await _burst(spec, n)
    started, returned = await _burst(spec, n)
    await isolate.park(spec, 0)
    return {
        "started": started,
        "returned": returned,
        "first step: started": started1,
        "first step: returned": returned1,
    }


async def _bursts_arm(
    spec: isolate.EpisodeSpec, args: argparse.Namespace, r: int
) -> dict[str, float]:
    """The default: a pool nobody asked for, sized from the bursts. A template of its own each
    round (one that ``park`` never sized): its round trips a sequence, then two RL steps, the
    second's figures. Its pool is emptied after, ``park(spec, 0)``."""
    own = spec.model_copy(update={"env": {**spec.env, "BENCH_BURSTS_ROUND": str(r)}})
    for _ in range(3):  # warm: the template starts
        await isolate.run_episode(own, {})
    rt, first = await _round_trips(own, args.n, 0)
    return {"launch": rt, "first": first, **await _two_steps(own, args.burst)}


def _forkserver_arm(root: Path, args: argparse.Namespace, r: int) -> dict[str, float]:
    ctx = Context(run_id="pool", workdir=root, quick=False)
    counts = {"seq": args.n, "burst": args.burst}
    raw = _fork_arm(ctx, args.python, root, "forkserver", counts, f"forkserver-{r}")
    if raw["left"]:
        raise RuntimeError(f"the forkserver arm left processes: {raw['left']}")
    return {
        "launch": statistics.median(raw["launch"]) * 1000,
        "first": statistics.median(raw["first_line"]) * 1000,
        "started": raw["burst_started"],
        "returned": raw["burst_returned"],
    }


LABELS = {
    "launch": "launch round trip, ms",
    "first": "launch to the first line, ms",
    "started": "burst {b}, all started, s",
    "returned": "burst {b}, all returned, s",
}


def _ratios(runs: dict[str, list[dict[str, float]]], b: int) -> dict[str, list[float]]:
    """Per round, each template arm against the forkserver of the same round."""
    out: dict[str, list[float]] = {}
    base = runs["forkserver"]
    for arm in ARMS[1:]:
        for mine, theirs in zip(runs[arm], base, strict=True):
            for key, name in (
                ("launch", "launch round trip"),
                ("started", f"burst {b}, all started"),
            ):
                out.setdefault(f"{arm} / forkserver: {name}", []).append(mine[key] / theirs[key])
            out.setdefault(f"{arm} / forkserver: burst {b}, overhead past 1 s", []).append(
                (mine["returned"] - 1.0) / (theirs["returned"] - 1.0)
            )
    return out


async def _main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-pool."))
    (root / "agent.py").write_text(textwrap.dedent(AGENT % args.imports))
    spec = isolate.EpisodeSpec(
        agent_root=root,
        entrypoint="agent:run",
        python=args.python,
        preload=True,
        timeout=600,
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        sandbox=isolate.Sandbox(network=["127.0.0.1:9"]) if args.network else None,
    )
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    figures: dict[str, list[float]] = {}
    load = [os.getloadavg()[0]]
    started_at = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    try:
        for _ in range(3):  # warm: the template starts
            await isolate.run_episode(spec, {})
        for r in range(args.rounds):
            for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:
                if arm == "forkserver":
                    row = await anyio.to_thread.run_sync(_forkserver_arm, root, args, r)
                else:
                    row = await _template_arm(spec, arm, args, r)
                runs[arm].append(row)
                load.append(os.getloadavg()[0])
        await isolate.park(spec, 0)
        figures.update(await _footprint(spec, 16))
        if args.fresh:
            figures["fresh: launch round trip, ms"] = await _fresh(spec, args.fresh)
    finally:
        await isolate.close_templates()
    for arm in ARMS:
        for key, label in LABELS.items():
            figures[f"{arm}: {label.format(b=args.burst)}"] = [row[key] for row in runs[arm]]
    for arm in ("asked", "bursts"):
        for key in ("first step: started", "first step: returned"):
            figures[f"{arm}: burst {args.burst}, {key}, s"] = [row[key] for row in runs[arm]]
    figures.update(_ratios(runs, args.burst))
    print(
        f"{started_at}–{time.strftime('%H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
        f"load (1 min) {min(load):.2f}–{max(load):.2f}, python {args.python}, "
        f"imports {args.imports!r}{', Sandbox(network=...)' if args.network else ''}"
    )
    for name, values in sorted(figures.items()):
        shown = ", ".join(f"{v:.3g}" for v in values)
        print(f"{name}: median {statistics.median(values):.3g} (rounds {shown})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pool")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--imports", default="", help="code the agent's module runs at import")
    parser.add_argument("-n", type=int, default=20, help="round trips per arm and round")
    parser.add_argument("--burst", type=int, default=32, help="episodes in a burst")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--network", action="store_true", help="Sandbox(network=[...])")
    parser.add_argument("--fresh", type=int, default=0, help="fresh round trips, one at a time")
    args = parser.parse_args(argv)
    anyio.run(_main, args)


if __name__ == "__main__":
    main()
