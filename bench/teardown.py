"""Item 3: from the deadline to no process of the episode left, for a 20-process tree.

Contenders: isolate (spec timeout T), pebble (``ProcessPool.schedule(timeout=T)``) and
``anyio.open_process`` cancelled after T. Each once with a tree that honours SIGTERM and once
with a tree that ignores it. A separate watcher process (``_watch.py``) polls /proc and says
when the last process was gone; survivors are counted from the pid files a moment after the
call returned, then killed. Configurations run round-robin.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

import isolate

try:  # the optional "bench" dependency group; without it the pebble rows are skipped
    import pebble
except ImportError:  # pragma: no cover - depends on the environment
    pebble = None

from isolate._core.system.tree import pids_with_env

from . import _treebuild
from ._common import MARK_ENV, kill_all, read_pid_files, summary
from ._context import Context

HERE = Path(__file__).resolve().parent
SETTLE_S = 0.25  # after the call returned: time for stragglers before survivors are counted


class _Watch:
    def __init__(self, pid_dir: Path, by_env: bool = False) -> None:
        """``by_env``: the tree may be in a PID namespace (isolate's default): find its
        processes by their environment, not by the pids they recorded."""
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                str(HERE / "_watch.py"),
                str(pid_dir),
                str(_treebuild.TREE_SIZE),
                *(["env"] if by_env else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def add(self, pid: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"pid {pid}\n")
        self.proc.stdin.flush()

    def stop(self) -> dict[str, Any]:
        out, _ = self.proc.communicate("stop\n", timeout=30)
        result: dict[str, Any] = json.loads(out)
        return result


def _deadline_from_start(pid_dir: Path, timeout: float) -> float | None:
    try:
        return float((pid_dir / "_start").read_text()) + timeout
    except (OSError, ValueError):
        return None


async def _isolate(ctx: Context, pid_dir: Path, ignore: bool, t: float, grace: float) -> dict:
    spec = isolate.EpisodeSpec(
        agent_root=ctx.workdir / "tree_agent",
        entrypoint="treebuild:isolate_entry",
        timeout=t,
        kill_grace=grace,
        env={"PID_DIR": str(pid_dir), MARK_ENV: ctx.run_id},
    )
    watch = _Watch(pid_dir, by_env=True)
    deadline = time.monotonic() + t
    outcome = await isolate.run_episode(spec, {"ignore_term": ignore}, on_start=watch.add)
    returned = time.monotonic()
    await anyio.sleep(SETTLE_S)
    seen = await anyio.to_thread.run_sync(watch.stop)
    return {
        "deadline": deadline,
        "returned": returned,
        "return_s": outcome.duration_s - t,
        "status": outcome.status,
        "killed": outcome.killed,
        "containment": str(outcome.containment),
        "watch": seen,
    }


async def _pebble(ctx: Context, pid_dir: Path, ignore: bool, t: float, grace: float) -> dict:
    watch = _Watch(pid_dir)
    pool = pebble.ProcessPool(max_workers=1)
    try:
        future = pool.schedule(_treebuild.pebble_entry, args=(str(pid_dir), ignore), timeout=t)
        error = await anyio.to_thread.run_sync(lambda: future.exception(timeout=t + 30))
        returned = time.monotonic()
        await anyio.sleep(SETTLE_S)
        seen = await anyio.to_thread.run_sync(watch.stop)
    finally:
        pool.stop()
        await anyio.to_thread.run_sync(lambda: pool.join(timeout=10))
    deadline = _deadline_from_start(pid_dir, t)
    return {
        "deadline": deadline,
        "returned": returned,
        "return_s": returned - deadline if deadline else None,
        "status": type(error).__name__ if error else "ok",
        "watch": seen,
    }


async def _anyio(ctx: Context, pid_dir: Path, ignore: bool, t: float, grace: float) -> dict:
    script = ctx.workdir / "tree_agent" / "treebuild.py"
    cmd = [sys.executable, "-I", str(script), str(pid_dir), "ignore" if ignore else "term"]
    null = subprocess.DEVNULL
    watch = _Watch(pid_dir)
    deadline = time.monotonic() + t
    with anyio.move_on_after(t) as scope:
        async with await anyio.open_process(cmd, stdin=null, stdout=null, stderr=null) as proc:
            await proc.wait()
    returned = time.monotonic()
    await anyio.sleep(SETTLE_S)
    seen = await anyio.to_thread.run_sync(watch.stop)
    return {
        "deadline": deadline,
        "returned": returned,
        "return_s": returned - deadline,
        "status": "cancelled" if scope.cancelled_caught else "exited",
        "watch": seen,
    }


CONTENDERS = {"isolate": _isolate, "pebble": _pebble, "anyio": _anyio}
if pebble is None:
    del CONTENDERS["pebble"]


async def _one(ctx: Context, name: str, ignore: bool, t: float, grace: float, n: int) -> dict:
    pid_dir = ctx.workdir / "teardown" / f"{name}-{'ignore' if ignore else 'term'}-{n}"
    pid_dir.mkdir(parents=True)
    try:
        run = await CONTENDERS[name](ctx, pid_dir, ignore, t, grace)
    finally:
        # Whatever happened: nothing of this tree may outlive the run. Every process of it
        # carries PID_DIR; isolate's recorded pids may be a PID namespace's: never kill by them.
        pids = pids_with_env("PID_DIR", str(pid_dir))
        if name != "isolate":
            pids += read_pid_files(pid_dir).values()
        await anyio.to_thread.run_sync(kill_all, [(pid, None) for pid in pids])
    seen = run.pop("watch")
    deadline = run["deadline"]
    run["complete"] = seen["ready_at"] is not None and (
        deadline is None or seen["ready_at"] < deadline
    )
    run["gone_s"] = seen["gone_at"] - deadline if seen["gone_at"] and deadline else None
    run["survivors"] = len(seen["alive"])
    run["survivor_names"] = sorted(seen["alive"])
    run["tracked"] = len(seen["tracked"])
    return run


async def _main(ctx: Context) -> dict[str, Any]:
    rounds, t, grace = (1, 0.8, 0.3) if ctx.quick else (5, 1.5, 1.0)
    configs = [(n, ig) for ig in (False, True) for n in CONTENDERS]
    if ctx.quick:  # pebble's SIGTERM->SIGKILL wait is 3 s, anyio SIGKILLs either way
        configs = [c for c in configs if c not in (("pebble", True), ("anyio", True))]
    agent_root = ctx.workdir / "tree_agent"
    agent_root.mkdir(exist_ok=True)
    shutil.copy(HERE / "_treebuild.py", agent_root / "treebuild.py")
    runs: dict[str, list[dict]] = {f"{n}/{'ignore' if ig else 'term'}": [] for n, ig in configs}
    for r in range(rounds):
        for n, ig in configs[r % len(configs) :] + configs[: r % len(configs)]:
            runs[f"{n}/{'ignore' if ig else 'term'}"].append(await _one(ctx, n, ig, t, grace, r))
    rows = {}
    for key, items in runs.items():
        gone = [x["gone_s"] for x in items if x["gone_s"] is not None]
        ret = [x["return_s"] for x in items if x["return_s"] is not None]
        rows[key] = {
            "gone": summary(gone),
            "return": summary(ret),
            "survivors": summary([x["survivors"] for x in items]),
            "never_gone": sum(x["gone_s"] is None for x in items),
            "incomplete_trees": sum(not x["complete"] for x in items),
            "runs": items,
        }
    levels = sorted({x["containment"] for x in runs.get("isolate/term", []) if "containment" in x})
    return {
        "unit": "s after deadline",
        "timeout": t,
        "kill_grace": grace,
        "tree": 20,
        "containment": levels,
        "skipped": [] if pebble else ["pebble (not installed: pip install -e '.[bench]')"],
        "rows": rows,
    }


def run(ctx: Context) -> dict[str, Any]:
    os.environ[MARK_ENV] = ctx.run_id  # pebble's forked workers and anyio children inherit it
    result: dict[str, Any] = anyio.run(_main, ctx)
    return result
