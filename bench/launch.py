"""Items 1 and 2b: launch overhead of a no-op episode, from a small and from a large parent.

Each parent is a separate worker process started with ``python -c`` (so ``multiprocessing``'s
spawn children do not re-import a heavy ``__main__``), optionally holding touched ballast
memory. The orchestrator asks the two workers for one round at a time, alternately; within a
round every contender runs ``k`` sequential episodes, in an order that rotates per round.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import anyio

import isolate

from . import _noop
from ._common import MARK_ENV, REPO, paired_ratio, rss_bytes, summary
from ._context import Context

CONTENDERS = ("isolate", "bare", "mp_spawn", "ppe_fresh", "pool_shared", "inprocess")
BASELINE = "bare"
NOOP_AGENT = "def run(data, **kwargs):\n    return 1.0\n"


# --- worker side: runs inside the measured parent ---------------------------------------------


class _Parent:
    def __init__(self, agent_root: Path, run_id: str) -> None:
        self.spec = isolate.EpisodeSpec(
            agent_root=agent_root,
            entrypoint="noop_agent:run",
            timeout=60.0,
            kill_grace=1.0,
            env={MARK_ENV: run_id},
        )
        self.spawn = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(max_workers=2)  # AReaL subproc: default (fork) context
        self.pool_env = {"OPENAI_API_KEY": "sk-bench", "OPENAI_BASE_URL": "http://127.0.0.1:1"}

    async def isolate(self, k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            outcome = await isolate.run_episode(self.spec, {"instance_id": "noop"})
            if outcome.status != "ok":
                raise RuntimeError(f"no-op episode failed: {outcome.summary()}")
        return time.perf_counter() - t0

    async def bare(self, k: int) -> float:
        cmd = [sys.executable, "-I", "-c", "pass"]
        t0 = time.perf_counter()
        for _ in range(k):
            null = subprocess.DEVNULL
            async with await anyio.open_process(cmd, stdin=null, stdout=null, stderr=null) as p:
                if await p.wait() != 0:
                    raise RuntimeError("bare interpreter failed")
        return time.perf_counter() - t0

    def _mp_one(self) -> None:
        reader, writer = self.spawn.Pipe(duplex=False)
        proc = self.spawn.Process(target=_noop.mp_episode, args=(writer,))
        proc.start()
        writer.close()
        try:
            if reader.recv() != 1.0:
                raise RuntimeError("multiprocessing episode returned a wrong value")
        finally:
            reader.close()
            proc.join()

    async def mp_spawn(self, k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            await anyio.to_thread.run_sync(self._mp_one)
        return time.perf_counter() - t0

    @staticmethod
    def _ppe_batch(k: int) -> float:
        # A fresh executor per sample: a replacement worker spawned in the background while
        # other contenders run would otherwise hide the spawn cost.
        t0 = time.perf_counter()
        with ProcessPoolExecutor(max_workers=1, max_tasks_per_child=1) as ex:
            for _ in range(k):
                if ex.submit(_noop.run, {}).result() != 1.0:
                    raise RuntimeError("pool episode returned a wrong value")
            elapsed = time.perf_counter() - t0  # excludes the final shutdown
        return elapsed

    async def ppe_fresh(self, k: int) -> float:
        return await anyio.to_thread.run_sync(self._ppe_batch, k)

    async def pool_shared(self, k: int) -> float:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        for _ in range(k):
            await loop.run_in_executor(self.pool, _noop.areal_task, self.pool_env, {})
        return time.perf_counter() - t0

    async def inprocess(self, k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            await asyncio.wait_for(_noop.coroutine({}), 60.0)  # the seed's mode
        return time.perf_counter() - t0

    async def round(self, k: int, index: int) -> dict[str, float]:
        order = CONTENDERS[index % len(CONTENDERS) :] + CONTENDERS[: index % len(CONTENDERS)]
        out = {}
        for name in order:
            out[name] = await getattr(self, name)(k) / k
        return out


def _ballast(mib: int) -> bytearray:
    buf = bytearray(mib << 20)
    pages = len(range(0, len(buf), 4096))
    buf[::4096] = b"\x01" * pages  # touch every page: resident, not just reserved
    return buf


async def _serve(agent_root: Path, run_id: str, out: Any) -> None:
    parent = _Parent(agent_root, run_id)
    try:
        await parent.round(1, 0)  # warm-up: imports, page cache, pool workers, resource tracker
        out.write(json.dumps({"ready": True, "rss": rss_bytes()}) + "\n")
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            if cmd.get("quit"):
                return
            result = await parent.round(cmd["k"], cmd["index"])
            out.write(json.dumps({"times": result, "rss": rss_bytes()}) + "\n")
    finally:
        parent.pool.shutdown(wait=True, cancel_futures=True)


def worker_main() -> None:
    """Entry point of a measuring parent: ``python -c ... <ballast MiB> <agent root> <run id>``."""
    mib, agent_root, run_id = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # nothing any child prints can reach the command channel
    ballast = _ballast(mib)
    anyio.run(_serve, agent_root, run_id, out)
    del ballast


# --- orchestrator side ------------------------------------------------------------------------


class _Worker:
    def __init__(self, ctx: Context, mib: int, agent_root: Path) -> None:
        code = "from bench.launch import worker_main; worker_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(mib), str(agent_root), ctx.run_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
            text=True,
        )
        self.mib = mib

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"launch worker ({self.mib} MiB) died: exit {self.proc.wait()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def run(ctx: Context, with_large: bool = True) -> dict[str, Any]:
    """Sections ``launch`` (small parent) and, with ``with_large``, ``large``."""
    rounds, k = (2, 1) if ctx.quick else (11, 4)
    large_mib = 64 if ctx.quick else 4096
    agent_root = ctx.workdir / "launch_agent"
    agent_root.mkdir(exist_ok=True)
    (agent_root / "noop_agent.py").write_text(NOOP_AGENT)
    workers = {"small": _Worker(ctx, 0, agent_root)}
    if with_large:
        workers["large"] = _Worker(ctx, large_mib, agent_root)
    times: dict[str, dict[str, list[float]]] = {p: {c: [] for c in CONTENDERS} for p in workers}
    rss: dict[str, list[int]] = {p: [] for p in workers}
    try:
        for label, worker in workers.items():
            rss[label].append(worker._reply()["rss"])  # the ready line, after the warm-up
        for index in range(rounds):
            labels = list(workers) if index % 2 == 0 else list(reversed(workers))
            for label in labels:
                reply = workers[label].ask(k=k, index=index)
                rss[label].append(reply["rss"])
                for name, value in reply["times"].items():
                    times[label][name].append(value)
    finally:
        for worker in workers.values():
            worker.close()
    out: dict[str, Any] = {}
    for label in workers:
        rows = {}
        for name in CONTENDERS:
            rows[name] = summary(times[label][name])
            rows[name]["samples"] = times[label][name]
            rows[name]["ratio"] = paired_ratio(times[label][name], times[label][BASELINE])
        out["launch" if label == "small" else "large"] = {
            "unit": "s/episode",
            "baseline": BASELINE,
            "rounds": rounds,
            "episodes_per_sample": k,
            "parent_rss_mib": max(rss[label]) / 2**20,
            "rows": rows,
        }
    if with_large:
        out["large"]["ballast_mib"] = large_mib
        out["large"]["vs_small"] = {
            name: paired_ratio(times["large"][name], times["small"][name]) for name in CONTENDERS
        }
    return out
