"""Where the launch time of a no-op episode goes: ``python -m bench.profile_launch [-n N]``.

Not part of the benchmark table. Four views:

1. phases: timestamps around the launcher's stages (by wrapping its functions and methods of
   its parts in this process only), median over N sequential no-op episodes;
2. the child's imports: ``python -X importtime -I agent_shim/boot.py`` (no handshake: it stops
   right after its imports), top-level modules by cumulative time;
3. whole episodes with other child programs (``_run_with_shim``), interleaved with the real
   one: ``shim.py`` run as a script (compiled on every start, as before ``boot.py``); and the
   cost of the supervisor's whole-/proc scan, which it now runs only when a child is left;
4. with ``--pyinstrument`` (``pip install pyinstrument``): a profile of the parent.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio

import isolate
from isolate._core.episode import child as _child
from isolate._core.episode import frames as _frames
from isolate._core.episode import launcher as _launcher

from .launch import NOOP_AGENT

STAMPS: dict[str, list[float]] = defaultdict(list)
_current: dict[str, float] = {}


def _stamp(name: str) -> None:
    if name not in _current:
        _current[name] = time.perf_counter()


def _wrap(cls: Any, method: str, before: str | None, after: str | None) -> None:
    original = getattr(cls, method)
    if _is_async(original):

        @functools.wraps(original)
        async def awrapper(self: Any, *a: Any, **k: Any) -> Any:
            if before:
                _stamp(before)
            try:
                return await original(self, *a, **k)
            finally:
                if after:
                    _stamp(after)

        setattr(cls, method, awrapper)
    else:

        @functools.wraps(original)
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            if before:
                _stamp(before)
            try:
                return original(self, *a, **k)
            finally:
                if after:
                    _stamp(after)

        setattr(cls, method, wrapper)


def _is_async(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def _instrument() -> None:
    # The launcher's stages are module functions: wrapped there, they are called wrapped.
    _wrap(_launcher, "prepare_episode", "prepare", "prepared")  # the name the launcher calls
    _wrap(_launcher, "_spawn", "spawn", "spawned")
    _wrap(_child.Fresh, "wait_exit", None, "exit seen")
    _wrap(_launcher, "_close_child", "close", None)
    on_frame = _frames.Frames._frame

    def frame_stamp(self: Any, frame: Any) -> None:
        _stamp(f"frame {frame.t}")
        on_frame(self, frame)

    _frames.Frames._frame = frame_stamp  # type: ignore[method-assign]


async def _phases(spec: isolate.EpisodeSpec, n: int) -> dict[str, float]:
    order = [
        "start",
        "prepare",
        "prepared",
        "spawn",
        "spawned",
        "frame hello",
        "frame result",
        "frame done",
        "exit seen",
        "close",
        "returned",
    ]
    for _ in range(n):
        _current.clear()
        _stamp("start")
        outcome = await isolate.run_episode(spec, {})
        _stamp("returned")
        assert outcome.status == "ok", outcome.summary()
        for a, b in zip(order, order[1:], strict=False):
            if a in _current and b in _current:
                STAMPS[f"{a} → {b}"].append(_current[b] - _current[a])
        STAMPS["total"].append(_current["returned"] - _current["start"])
    return {k: statistics.median(v) for k, v in STAMPS.items()}


def _importtime(shim: Path) -> tuple[float, list[tuple[str, int]]]:
    cmd = [sys.executable, "-X", "importtime", "-I", str(shim)]
    err = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True).stderr
    top: list[tuple[str, int]] = []
    children: list[tuple[str, int]] = []  # importtime prints a module's imports before it
    for line in err.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( +)(\S+)", line)
        if not m:
            continue
        name, us, depth = m.group(4), int(m.group(2)), len(m.group(3))
        if depth == 3:
            children.append((name, us))
        elif depth == 1:
            top.append((name, us))
            if name == "shim":
                top += [(f"shim > {child}", child_us) for child, child_us in children]
            children = []
    total = sum(c for name, c in top if ">" not in name)
    return total / 1e6, sorted(top, key=lambda x: -x[1])


async def _compare(spec: isolate.EpisodeSpec, shims: dict[str, Path], n: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in shims}
    for _ in range(n):
        for name, shim in shims.items():
            t0 = time.perf_counter()
            outcome = await _launcher._run_with_shim(spec, {}, shim, pid1=True)
            times[name].append(time.perf_counter() - t0)
            assert outcome.status == "ok", outcome.summary()
    return {name: statistics.median(v) for name, v in times.items()}


def _proc_scan_cost(shim: Path, n: int = 50) -> tuple[float, int]:
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import shim; "
        "table = shim.load_part('supervisor').process_table; "
        "t = time.perf_counter(); [table() for _ in range(int(sys.argv[2]))]; "
        "print((time.perf_counter() - t) / int(sys.argv[2]), len(table()))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code, str(shim.parent), str(n)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), int(out[1])


async def _main(n: int, use_pyinstrument: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="isolate-profile-") as tmp:
        root = Path(tmp)
        (root / "noop_agent.py").write_text(NOOP_AGENT)
        spec = isolate.EpisodeSpec(agent_root=root, entrypoint="noop_agent:run", timeout=60)
        shim = isolate.shim_path()
        boot = shim.with_name("boot.py")

        await isolate.run_episode(spec, {})  # warm-up
        print(f"## Parent-side phases (median of {n} no-op episodes, ms)\n")
        _instrument()
        for name, value in (await _phases(spec, n)).items():
            print(f"{name:32s} {value * 1000:8.2f}")

        total, top = _importtime(boot)
        print(f"\n## Child imports (python -X importtime -I boot.py): {total * 1000:.1f} ms\n")
        for name, us in top[:12]:
            print(f"{name:40s} {us / 1000:8.2f} ms")

        variants = {"boot.py (what run_episode starts)": boot, "shim.py as a script": shim}
        print(f"\n## Whole no-op episode per child program, interleaved (median of {n}, ms)\n")
        for name, value in (await _compare(spec, variants, n)).items():
            print(f"{name:32s} {value * 1000:8.2f}")
        cost, procs = _proc_scan_cost(shim)
        print(
            f"\nsupervisor's process_table() (at an episode's end, only if a child is left): "
            f"{cost * 1000:.2f} ms with {procs} processes on the machine"
        )

        if use_pyinstrument:
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0002, async_mode="enabled")
            with profiler:
                for _ in range(n):
                    await isolate.run_episode(spec, {})
            print(profiler.output_text(unicode=True, show_all=False))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile_launch")
    p.add_argument("-n", type=int, default=30)
    p.add_argument("--pyinstrument", action="store_true")
    args = p.parse_args()
    anyio.run(_main, args.n, args.pyinstrument)


if __name__ == "__main__":
    main()
