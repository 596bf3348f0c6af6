"""The measuring parent of the launch benchmark (items 1 and 2b), run as its own process:
``python -c "from bench._launch_worker import worker_main; worker_main()" MIB ROOT RUN_ID PY``,
PY being the interpreter of a plain venv (no packages) for the ``*_plain`` contenders.

``-c`` keeps ``multiprocessing``'s spawn children from re-importing a heavy ``__main__``. The
process holds MIB of touched ballast, then answers one JSON command line per round on stdin
with one JSON line on the original stdout: per-episode seconds of every contender, each
running ``k`` sequential no-op episodes, in an order that rotates per round.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import anyio

import isolate
from isolate._core.episode import launcher as _launcher

from . import _noop
from ._common import MARK_ENV, rss_bytes

CONTENDERS = (
    "isolate",
    "bare",
    "mp_spawn",
    "ppe_fresh",
    "pool_shared",
    "inprocess",
    "isolate_plain",
    "bare_plain",
    "isolate_os_exit",
    "isolate_heavy",
    "isolate_heavy_os_exit",
    "isolate_unhardened",
)
#: Pairs that price the worker's normal exit after its result (atexit, flushes, finalizers):
#: the same episode with a shim whose worker leaves by ``os._exit`` instead, as it once did.
EXIT_PAIRS = {"isolate": "isolate_os_exit", "isolate_heavy": "isolate_heavy_os_exit"}
#: The pair that prices the worker's hardening before the agent's import (syscall filter,
#: capabilities dropped): the same episode with a shim that skips it.
HARDENING_PAIRS = {"isolate": "isolate_unhardened"}
#: An agent module that imports what a small real agent does before it runs.
HEAVY_AGENT = (
    "import asyncio, json, logging, email.message, http.client, decimal, dataclasses, typing\n"
    "def run(data, **kwargs):\n    return 1.0\n"
)


def os_exit_shim(workdir: Path) -> Path:
    """A copy of the shim whose worker leaves by ``os._exit`` right after its final frame
    (telling its supervisor, as the worker's normal exit does)."""
    return shim_variant(
        workdir, "os_exit_shim", {"    leave_worker(code, tell)\n": "    exit_worker(code, tell)\n"}
    )


def unhardened_shim(workdir: Path) -> Path:
    """A copy of the shim that skips the worker's hardening (and the supervisor's preparation
    of it): what an episode cost before the wall against a hostile agent."""
    return shim_variant(
        workdir,
        "unhardened_shim",
        {
            "        problem = harden(own_network=network)\n": "        problem = None\n",
            '        load_part("seccomp")\n': "        pass\n",
        },
    )


def shim_variant(workdir: Path, name: str, changes: dict[str, str]) -> Path:
    """A copy of the shim in ``workdir/name.PID`` with each line of ``changes`` replaced; its
    boot.py. One per process: launch workers started together make theirs at once."""
    source = Path(isolate.shim_path()).parent
    target = workdir / f"{name}.{os.getpid()}"
    shutil.copytree(
        source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    for old, new in changes.items():
        # The one file of the shim (shim.py or a part) with that line, once.
        found = [p for p in sorted(target.glob("shim*.py")) if p.read_text().count(old) == 1]
        if len(found) != 1:
            raise RuntimeError(f"{old.strip()!r} is not where bench expects it in the shim")
        found[0].write_text(found[0].read_text().replace(old, new))
    return target / "boot.py"


class _Parent:
    def __init__(self, agent_root: Path, run_id: str, plain_python: str) -> None:
        self.spec = isolate.EpisodeSpec(
            agent_root=agent_root,
            entrypoint="noop_agent:run",
            timeout=60.0,
            kill_grace=1.0,
            env={MARK_ENV: run_id},
        )
        self.plain_python = plain_python
        self.plain_spec = self.spec.model_copy(update={"python": plain_python})
        (agent_root / "heavy_agent.py").write_text(HEAVY_AGENT)
        self.heavy_spec = self.spec.model_copy(update={"entrypoint": "heavy_agent:run"})
        self.os_exit_shim = os_exit_shim(agent_root.parent)
        self.unhardened_shim = unhardened_shim(agent_root.parent)
        self.spawn = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(max_workers=2)  # AReaL subproc: default (fork) context
        self.pool_env = {"OPENAI_API_KEY": "sk-bench", "OPENAI_BASE_URL": "http://127.0.0.1:1"}
        self.containment: set[str] = set()

    async def isolate(self, k: int) -> float:
        return await self._episodes(self.spec, k)

    async def isolate_plain(self, k: int) -> float:
        return await self._episodes(self.plain_spec, k)

    async def isolate_os_exit(self, k: int) -> float:
        return await self._episodes(self.spec, k, self.os_exit_shim)

    async def isolate_unhardened(self, k: int) -> float:
        return await self._episodes(self.spec, k, self.unhardened_shim)

    async def isolate_heavy(self, k: int) -> float:
        return await self._episodes(self.heavy_spec, k)

    async def isolate_heavy_os_exit(self, k: int) -> float:
        return await self._episodes(self.heavy_spec, k, self.os_exit_shim)

    async def bare(self, k: int) -> float:
        return await self._bare(sys.executable, k)

    async def bare_plain(self, k: int) -> float:
        return await self._bare(self.plain_python, k)

    async def _episodes(self, spec: isolate.EpisodeSpec, k: int, shim: Path | None = None) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            if shim is None:
                outcome = await isolate.run_episode(spec, {"instance_id": "noop"})
            else:
                outcome = await _launcher._run_with_shim(
                    spec, {"instance_id": "noop"}, shim, pid1=True
                )
            if outcome.status != "ok":
                raise RuntimeError(f"no-op episode failed: {outcome.summary()}")
            self.containment.add(str(outcome.containment))
        return time.perf_counter() - t0

    async def _bare(self, python: str, k: int) -> float:
        cmd = [python, "-I", "-c", "pass"]
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


async def _serve(agent_root: Path, run_id: str, plain_python: str, out: Any) -> None:
    parent = _Parent(agent_root, run_id, plain_python)
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
            reply = {"times": result, "rss": rss_bytes(), "containment": sorted(parent.containment)}
            out.write(json.dumps(reply) + "\n")
    finally:
        parent.pool.shutdown(wait=True, cancel_futures=True)


def worker_main() -> None:
    """Entry point of a measuring parent: ``python -c ... <ballast MiB> <agent root> <run id>
    <plain venv python>``."""
    mib, agent_root, run_id, plain = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # nothing any child prints can reach the command channel
    ballast = _ballast(mib)
    anyio.run(_serve, agent_root, run_id, plain, out)
    del ballast
