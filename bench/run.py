"""The benchmark command: ``python -m bench.run [--quick] [--only a,b] [--json PATH]``.

Prints a markdown table per section, writes the results as JSON (default
``bench/results/latest.json``) and the markdown next to it (``.md``). See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import footprint, launch, layers, realistic, scale, teardown, throughput
from ._common import MARK_ENV, REPO, live_children, machine_info, sweep_marked
from ._context import Context
from ._report import render
from ._targets import targets

SECTIONS = (
    "launch",
    "throughput",
    "large",
    "teardown",
    "scale",
    "fdlimit",
    "footprint",
    "layers",
    "realistic",
)
RUNNERS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "throughput": throughput.run,
    "teardown": teardown.run,
    "scale": scale.run,
    "fdlimit": scale.run_fdlimit,
    "footprint": footprint.run,
    "layers": layers.run,
    "realistic": realistic.run,
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="smoke run: a few episodes, seconds")
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "latest.json")
    p.add_argument(
        "--skip-fresh",
        action="store_true",
        help="realistic: leave out the fresh-start mode (its episodes take ~3 s each)",
    )
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a new temp dir)")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.only) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s): {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def _section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        result = fn()
    except Exception as exc:  # one broken section must not lose the others
        traceback.print_exc()
        return {name: {"error": f"{type(exc).__name__}: {exc}"}}
    print(f"[bench] {name} done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return result if name == "launch" else {name: result}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # SIGTERM unwinds like Ctrl-C, so every finally (and isolate's own teardown) runs.
    signal.signal(signal.SIGTERM, _interrupt)
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="isolate-bench-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = Context(
        run_id=secrets.token_hex(6), workdir=workdir, quick=args.quick, skip_fresh=args.skip_fresh
    )
    results: dict[str, Any] = {"machine": machine_info(), "quick": args.quick, "sections": {}}
    started = time.monotonic()
    os.environ[MARK_ENV] = ctx.run_id  # inherited by every process the run starts
    try:
        if "launch" in args.only or "large" in args.only:
            with_large = "large" in args.only
            results["sections"].update(
                _section("launch", lambda: launch.run(ctx, with_large=with_large))
            )
        for name in SECTIONS:
            if name in RUNNERS and name in args.only:
                results["sections"].update(_section(name, lambda n=name: RUNNERS[n](ctx)))
    finally:
        # Everything this run started must be gone, whatever happened above.
        leftovers = sweep_marked(ctx.run_id)
        children = live_children()
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    results["leftovers"] = leftovers
    results["live_children_at_end"] = children
    results["elapsed_s"] = time.monotonic() - started
    results["targets"] = targets(results["sections"])
    markdown = render(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    args.json.with_suffix(".md").write_text(markdown + "\n")
    print(markdown)
    print(f"JSON: {args.json}\nMarkdown: {args.json.with_suffix('.md')}")
    failed = any("error" in s for s in results["sections"].values())
    return 1 if failed or leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
