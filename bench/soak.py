"""Soak: many mixed episodes at high concurrency, exact accounting, nothing left behind.

    python -m bench.soak [--episodes 1000] [--concurrency 64] [--containment auto] [--json F]

Injects a known mix of episode kinds (below), runs them all through ``run_episode`` at the
given concurrency, and checks that each status count and each ``outcome.cleanup`` count equals
what was injected, that every clean-up and every normal exit left its mark, and that no
process, zombie, fd, temporary file, cgroup leaf or log handle is left afterwards. Prints
the figures; exits 1 if any check failed. Not part of CI (the tests run a short version).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import psutil

import isolate
from isolate._core import containment as _containment
from isolate._core.episode import launcher as _launcher
from isolate._core.system.tree import pids_with_env

#: kind -> (agent body, status it must end with). Each body defines ``run(data)``.
KINDS: dict[str, tuple[str, str]] = {
    "ok": ("def run(data):\n    return 1.0\n", "ok"),
    "raise": ("def run(data):\n    raise ValueError('injected')\n", "agent_error"),
    "system_exit": ("import sys\ndef run(data):\n    sys.exit(3)\n", "agent_error"),
    "sigsegv": (
        "import os, signal\ndef run(data):\n    os.kill(os.getpid(), signal.SIGSEGV)\n",
        "crashed",
    ),
    "os_exit": ("import os\ndef run(data):\n    os._exit(7)\n", "crashed"),
    "timeout_tree": (
        """
        import os, signal, subprocess, sys, time
        DAEMON = (
            "import os, signal, time\\n"
            "if os.fork(): os._exit(0)\\n"
            "os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)\\n"
        )
        def run(data):
            subprocess.Popen(["sleep", "300"])
            subprocess.run([sys.executable, "-c", DAEMON])
            time.sleep(300)
        """,
        "timeout",
    ),
    "stdout_spam": (
        """
        import os, sys
        def run(data):
            line = "spam " * 40 + "\\n"
            for i in range(20000):
                print(line, end="")
                if i % 1000 == 0:
                    os.write(1, line.encode())
            return 1.0
        """,
        "ok",
    ),
    "stderr_10mb": (
        """
        import sys
        def run(data):
            block = "e" * 1023 + "\\n"
            for _ in range(10 * 1024):
                sys.stderr.write(block)
            return 1.0
        """,
        "ok",
    ),
    # Timeouts whose agents clean up (cancel first): one whose async clean-up runs a command
    # and leaves a mark, one whose sync clean-up hangs and is cut short at cancel_grace.
    "timeout_cleanup": (
        """
        import asyncio, os, subprocess
        async def run(data):
            try:
                await asyncio.sleep(300)
            finally:
                me = os.environ["ISOLATE_EPISODE_ID"]
                mark = os.path.join(os.environ["SOAK_MARKS"], "cleaned." + me)
                subprocess.run(["sh", "-c", 'echo released > "$0"', mark], check=True)
        """,
        "timeout",
    ),
    "timeout_cut_short": (
        """
        import time
        def run(data):
            try:
                time.sleep(300)
            finally:
                time.sleep(300)
        """,
        "timeout",
    ),
    # A normal exit loses nothing: a buffered file never closed, an atexit hook.
    "ok_exit": (
        """
        import atexit, os
        def run(data):
            marks, me = os.environ["SOAK_MARKS"], os.environ["ISOLATE_EPISODE_ID"]
            f = open(os.path.join(marks, "exited." + me), "w")
            f.write("buffered")
            atexit.register(lambda: open(os.path.join(marks, "atexit." + me), "w").close())
            return 1.0
        """,
        "ok",
    ),
    # Started through a wrapper that reads nothing for a while, then becomes the real shim;
    # the record is 1 MB, so the parent's handshake write fills the pipe and has to wait.
    "slow_reader": ("def run(data):\n    return float(len(data['blob']) > 0)\n", "ok"),
}

SLOW_READER = """
import os, sys, time
time.sleep(0.3)
os.execv(sys.executable, [sys.executable, "-I", {shim!r}])
"""
MARK = "ISOLATE_SOAK_RUN"
#: kind -> the ``outcome.cleanup`` it must end with (None for every kind not listed).
CLEANUP = {
    "timeout_tree": "finished",
    "timeout_cleanup": "finished",
    "timeout_cut_short": "cut short",
}


def plan(episodes: int, seed: int, only: list[str] | None = None) -> list[str]:
    """Kinds in a shuffled order, as evenly spread as ``episodes`` allows."""
    kinds = [k for _, k in zip(range(episodes), _cycle(only or list(KINDS)), strict=False)]
    random.Random(seed).shuffle(kinds)
    return kinds


def _cycle(items: list[str]) -> Any:
    while True:
        yield from items


# --- what is left -----------------------------------------------------------------------------


def marked_processes(run_id: str) -> list[int]:
    """Live processes whose environment carries this soak run's mark."""
    found = []
    for pid in pids_with_env(MARK, run_id):
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except psutil.Error:
            continue
    return found


def children(zombies: bool) -> list[int]:
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if (proc.status() == psutil.STATUS_ZOMBIE) == zombies:
                out.append(proc.pid)
        except psutil.Error:
            continue
    return out


def open_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return out


def cgroup_leaves() -> list[str]:
    """This process's cgroup leaves (its per-parent directories and what is in them)."""
    groups = _containment.cgroups()
    roots = [r for r in [groups.v2, *groups.v1.values()] if r is not None]
    mine = [root / _containment.leaves._owner_name() for root in roots]
    return [str(p) for d in mine if d.exists() for p in [d, *d.iterdir()] if p.is_dir()]


def state(run_id: str, work: Path) -> dict[str, Any]:
    fds = open_fds()
    return {
        "processes": len(marked_processes(run_id)) + len(children(zombies=False)),
        "zombies": len(children(zombies=True)),
        "fds": len(fds),
        "log_handles": sum(1 for f in fds if f.endswith(".log")),
        "temp_entries": len(os.listdir(work / "parent-tmp")),
        "cgroup_leaves": len(cgroup_leaves()),
        "rss_mib": psutil.Process().memory_info().rss / 2**20,
    }


# --- the run ----------------------------------------------------------------------------------


async def soak(
    episodes: int,
    concurrency: int,
    containment: str,
    work: Path,
    seed: int,
    only: list[str] | None = None,
) -> dict[str, Any]:
    run_id = f"{os.getpid()}.{seed}"
    root = work / "agents"
    root.mkdir()
    for kind, (body, _) in KINDS.items():
        (root / f"soak_{kind}.py").write_text(textwrap.dedent(body))
    (work / "cwd").mkdir()
    (work / "marks").mkdir()
    (work / "parent-tmp").mkdir()
    tempfile.tempdir = str(work / "parent-tmp")  # anything isolate itself left would show
    wrapper = work / "slow_reader_shim.py"
    wrapper.write_text(SLOW_READER.format(shim=str(isolate.shim_path())))
    blob = "b" * 1_000_000

    base = isolate.EpisodeSpec(
        agent_root=root,
        entrypoint="soak_ok:run",
        timeout=120.0,
        kill_grace=0.5,
        cwd=work / "cwd",
        log_dir=work / "logs",
        stderr_tail_bytes=4096,  # the outcomes are all kept: keep the parent's RSS about isolate
        env={MARK: run_id, "TMPDIR": str(work / "episode-tmp"), "SOAK_MARKS": str(work / "marks")},
        containment=containment,  # type: ignore[arg-type]
        limits=isolate.Limits(core_dumps=False, log_bytes=256 * 1024),
    )
    specs = {
        kind: base.model_copy(
            update={"entrypoint": f"soak_{kind}:run"}
            | ({"timeout": 2.0} if kind.startswith("timeout") else {})
            | ({"cancel_grace": 1.0} if kind == "timeout_cut_short" else {})
        )
        for kind in KINDS
    }
    kinds = plan(episodes, seed, only)
    limiter = anyio.Semaphore(concurrency)
    results: list[tuple[str, isolate.EpisodeOutcome]] = []
    lags: list[float] = []
    done = anyio.Event()

    async def one(i: int, kind: str) -> None:
        async with limiter:
            episode_id = f"soak-{i:04d}-{kind}"
            if kind == "slow_reader":
                outcome = await _launcher._run_with_shim(
                    specs[kind], {"blob": blob}, wrapper, episode_id=episode_id
                )
            else:
                outcome = await isolate.run_episode(specs[kind], {}, episode_id=episode_id)
            results.append((kind, outcome))

    async def ticker() -> None:
        while not done.is_set():
            start = time.monotonic()
            await anyio.sleep(0.01)
            lags.append(time.monotonic() - start - 0.01)

    (work / "episode-tmp").mkdir()
    before = state(run_id, work)
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with anyio.create_task_group() as episodes_tg:
            for i, kind in enumerate(kinds):
                episodes_tg.start_soon(one, i, kind)
        done.set()
    wall = time.monotonic() - started
    after = await anyio.to_thread.run_sync(_settled, run_id, work, before)
    marks = Counter(name.split(".")[0] for name in os.listdir(work / "marks"))
    figures = report(kinds, results, wall, lags, before, after, episodes, concurrency)
    figures["marks"] = dict(marks)
    # Each clean-up that finished left its mark; each normal exit flushed its file and ran
    # its atexit hook.
    expected = {
        "cleaned": kinds.count("timeout_cleanup"),
        "exited": kinds.count("ok_exit"),
        "atexit": kinds.count("ok_exit"),
    }
    unflushed = [
        name
        for name in os.listdir(work / "marks")
        if name.startswith("exited.")
        and "atexit" not in name
        and (work / "marks" / name).read_text() != "buffered"
    ]
    figures["marks_expected"] = expected
    figures["exact"] = (
        figures["exact"] and {k: marks.get(k, 0) for k in expected} == expected and not unflushed
    )
    return figures


def _settled(run_id: str, work: Path, before: dict[str, Any]) -> dict[str, Any]:
    """The state after the run, given a moment for pool threads and fds to wind down."""
    end = time.monotonic() + 5.0
    while True:
        after = state(run_id, work)
        clean = after["fds"] <= before["fds"] and not after["processes"] and not after["zombies"]
        if clean or time.monotonic() > end:
            return after
        time.sleep(0.05)


def report(
    kinds: list[str],
    results: list[tuple[str, isolate.EpisodeOutcome]],
    wall: float,
    lags: list[float],
    before: dict[str, Any],
    after: dict[str, Any],
    episodes: int,
    concurrency: int,
) -> dict[str, Any]:
    injected = Counter(KINDS[k][1] for k in kinds)
    got = Counter(o.status for _, o in results)
    wrong = [
        f"{o.episode_id}: expected {KINDS[k][1]}, clean-up {CLEANUP.get(k)}, got {o.summary()}"
        for k, o in results
        if (o.status, o.cleanup) != (KINDS[k][1], CLEANUP.get(k))
    ]
    cleanup_injected = Counter(str(CLEANUP.get(k)) for k in kinds)
    cleanup_got = Counter(str(o.cleanup) for _, o in results)
    durations: dict[str, list[float]] = {}
    for kind, outcome in results:
        durations.setdefault(kind, []).append(outcome.duration_s)
    left = {
        "processes": after["processes"],
        "zombies": after["zombies"],
        "fds": max(0, after["fds"] - before["fds"]),
        "log_handles": after["log_handles"],
        "temp_entries": after["temp_entries"],
        "cgroup_leaves": after["cgroup_leaves"],
    }
    ordered_lags = sorted(lags) or [0.0]
    return {
        "episodes": episodes,
        "concurrency": concurrency,
        "containment": sorted({o.containment for _, o in results}),
        "wall_s": wall,
        "episodes_per_s": episodes / wall if wall else 0.0,
        "injected": dict(injected),
        "got": dict(got),
        "cleanup_injected": dict(cleanup_injected),
        "cleanup_got": dict(cleanup_got),
        "exact": (
            injected == got
            and cleanup_injected == cleanup_got
            and not wrong
            and len(results) == episodes
        ),
        "wrong": wrong[:20],
        "median_s": {k: statistics.median(v) for k, v in sorted(durations.items())},
        "loop_lag_p99_ms": 1000 * ordered_lags[int(0.99 * (len(ordered_lags) - 1))],
        "loop_lag_max_ms": 1000 * ordered_lags[-1],
        "killed": sum(o.killed for _, o in results),
        "before": before,
        "after": after,
        "left": left,
        "clean": not any(left.values()),
    }


def show(figures: dict[str, Any]) -> None:
    print(
        f"soak: {figures['episodes']} episodes at concurrency {figures['concurrency']}, "
        f"containment {', '.join(figures['containment'])}: {figures['wall_s']:.1f} s "
        f"({figures['episodes_per_s']:.1f} episodes/s)"
    )
    print(f"{'status':<16}{'injected':>9}{'got':>6}")
    for status in isolate.STATUSES:
        n, m = figures["injected"].get(status, 0), figures["got"].get(status, 0)
        if n or m:
            print(f"{status:<16}{n:>9}{m:>6}")
    print(f"{'clean-up':<16}{'injected':>9}{'got':>6}")
    for value in ("finished", "cut short", "None"):
        n, m = figures["cleanup_injected"].get(value, 0), figures["cleanup_got"].get(value, 0)
        if n or m:
            print(f"{value:<16}{n:>9}{m:>6}")
    if "marks" in figures:
        expected, marks = figures["marks_expected"], figures["marks"]
        print(
            f"clean-ups that left their mark: {marks.get('cleaned', 0)} of "
            f"{expected['cleaned']}; normal exits: files flushed {marks.get('exited', 0)}, "
            f"atexit hooks run {marks.get('atexit', 0)}, of {expected['exited']}"
        )
    print("accounting: " + ("exact" if figures["exact"] else "WRONG"))
    for line in figures["wrong"]:
        print(f"  {line}")
    print(
        "median seconds per kind: "
        + ", ".join(f"{k} {v:.2f}" for k, v in figures["median_s"].items())
    )
    print(
        f"event-loop lag: p99 {figures['loop_lag_p99_ms']:.1f} ms, "
        f"max {figures['loop_lag_max_ms']:.1f} ms; processes killed by teardown: "
        f"{figures['killed']}"
    )
    b, a = figures["before"], figures["after"]
    print(f"parent RSS: {b['rss_mib']:.0f} MiB before, {a['rss_mib']:.0f} MiB after")
    print(
        "left behind: "
        + ", ".join(f"{k} {v}" for k, v in figures["left"].items())
        + ("  (clean)" if figures["clean"] else "  (NOT CLEAN)")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--containment", default="auto", choices=["auto", *_containment.COMBINATIONS]
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", help=f"comma-separated subset of: {', '.join(KINDS)}")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--workdir", type=Path, help="keep agents and logs here (kept)")
    args = parser.parse_args(argv)
    only = args.kinds.split(",") if args.kinds else None
    if only and not set(only) <= set(KINDS):
        parser.error(f"--kinds: unknown {sorted(set(only) - set(KINDS))}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="isolate-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        figures = anyio.run(
            soak, args.episodes, args.concurrency, args.containment, work, args.seed, only
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    show(figures)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if figures["exact"] and figures["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
