"""Item 5: memory of an episode's own processes (the shim and its descendants: the forked
worker, and with containment ``pidns`` the namespace's init) for a no-op agent, against a bare
``python -I`` interpreter. RSS counts shared pages in full; USS is what a process alone holds
(freed when it exits); PSS splits shared pages among the sharers. The shim's processes share
pages copy-on-write, so their USS sum is below what the episode frees as a whole.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import anyio
import psutil

import isolate

from ._common import MARK_ENV, paired_ratio, summary
from ._context import Context

AGENT = """
import os, time

def run(data, **kwargs):
    open(os.path.join(data["dir"], "ready"), "w").close()
    end = time.monotonic() + 60
    while not os.path.exists(os.path.join(data["dir"], "release")) and time.monotonic() < end:
        time.sleep(0.005)
    return 1.0
"""
BARE = "import sys; sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"
FIELDS = ("rss", "uss", "pss")


def _mem(pid: int) -> dict[str, int]:
    info = psutil.Process(pid).memory_full_info()
    return {f: getattr(info, f) for f in FIELDS}


async def _isolate(ctx: Context, spec: isolate.EpisodeSpec, n: int) -> dict[str, Any]:
    """Memory of the shim (the process isolate spawned) and of all its descendants (the
    worker; with containment pidns also the namespace's init), taken while the agent waits."""
    box = ctx.workdir / "footprint" / str(n)
    box.mkdir(parents=True)
    shim: list[int] = []
    measured: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:

        async def episode() -> None:
            outcome = await isolate.run_episode(spec, {"dir": str(box)}, on_start=shim.append)
            if outcome.status != "ok":
                raise RuntimeError(outcome.summary())
            measured["containment"] = str(outcome.containment)

        tg.start_soon(episode)
        with anyio.fail_after(60):
            while not (box / "ready").exists():  # noqa: ASYNC110 - the signal is a file
                await anyio.sleep(0.005)
        top = psutil.Process(shim[0])
        below = [_mem(p.pid) for p in top.children(recursive=True)]
        measured["shim"] = _mem(top.pid)
        measured["descendants"] = {f: sum(m[f] for m in below) for f in FIELDS}
        measured["processes"] = 1 + len(below)
        (box / "release").touch()
    measured["total"] = {f: measured["shim"][f] + measured["descendants"][f] for f in FIELDS}
    return measured


async def _bare() -> dict[str, int]:
    cmd = [sys.executable, "-I", "-c", BARE]
    async with await anyio.open_process(cmd, stderr=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None
        assert proc.stdin is not None
        with anyio.fail_after(60):
            await proc.stdout.receive()
        measured = _mem(proc.pid)
        await proc.stdin.aclose()
        await proc.wait()
    return measured


async def _main(ctx: Context) -> dict[str, Any]:
    reps = 1 if ctx.quick else 7
    agent_root = ctx.workdir / "footprint_agent"
    agent_root.mkdir(exist_ok=True)
    (agent_root / "waiting_agent.py").write_text(AGENT)
    spec = isolate.EpisodeSpec(
        agent_root=agent_root,
        entrypoint="waiting_agent:run",
        timeout=120.0,
        kill_grace=1.0,
        env={MARK_ENV: ctx.run_id},
    )
    samples: dict[str, dict[str, list[float]]] = {
        who: {f: [] for f in FIELDS} for who in ("bare", "shim", "descendants", "total")
    }
    levels: set[str] = set()
    processes: set[int] = set()
    for n in range(reps):
        bare = await _bare()
        ours = await _isolate(ctx, spec, n)
        levels.add(ours["containment"])
        processes.add(ours["processes"])
        for f in FIELDS:
            samples["bare"][f].append(bare[f] / 1024)
            for who in ("shim", "descendants", "total"):
                samples[who][f].append(ours[who][f] / 1024)
    rows = {}
    for who, by_field in samples.items():
        rows[who] = {
            f: dict(summary(v), ratio=paired_ratio(v, samples["bare"][f]))
            for f, v in by_field.items()
        }
    return {
        "unit": "KiB",
        "baseline": "bare",
        "reps": reps,
        "containment": sorted(levels),
        "episode_processes": sorted(processes),
        "rows": rows,
    }


def run(ctx: Context) -> dict[str, Any]:
    result: dict[str, Any] = anyio.run(_main, ctx)
    return result
