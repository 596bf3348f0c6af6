"""How often one episode's code crosses between isolate's modules: ``python -m tools.crossings``.

Runs one no-op episode started fresh, then (with a template started and warmed by one episode
first) one forked from a preloaded template, each traced with ``sys.setprofile`` in every
thread of this process. A *crossing* is a call from a function of one module of ``isolate``
into a function of another; a *return to a module left* is the return from such a call. Calls
within a module, and calls into the standard library or third-party packages, are not
counted. Prints, per episode: the modules entered, the crossings, the returns, and the module
pairs with the most crossings.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import anyio

import isolate

AGENT = "def run(data):\n    return 1.0\n"


class Tracer:
    """Counts crossings between modules of ``isolate`` in every thread while it is on."""

    def __init__(self) -> None:
        self.on = False
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.returns = 0
        self.entered: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event not in ("call", "return"):
            return
        mine = _module(frame)
        if mine is None:
            return
        caller = frame.f_back
        while caller is not None and _module(caller) is None:
            caller = caller.f_back  # through the standard library and anyio, to our code
        theirs = _module(caller) if caller is not None else None
        if theirs is None or theirs == mine:
            return
        with self._lock:
            if event == "call":
                self.calls[(theirs, mine)] += 1
                self.entered.add(mine)
            else:
                self.returns += 1

    def report(self, title: str) -> None:
        total = sum(self.calls.values())
        print(
            f"{title}: {len(self.entered)} modules entered, {total} crossings, "
            f"{self.returns} returns to a module left"
        )
        for (a, b), n in self.calls.most_common(8):
            print(f"  {n:3d}  {a} -> {b}")


def _module(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if not isinstance(name, str) or not name.startswith("isolate"):
        return None
    return name.removeprefix("isolate.")


async def _traced(tracer: Tracer, spec: isolate.EpisodeSpec) -> isolate.EpisodeOutcome:
    tracer.on = True
    try:
        return await isolate.run_episode(spec, {})
    finally:
        tracer.on = False


async def _main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="crossings."))
    (root / "agent.py").write_text(AGENT)
    fresh = isolate.EpisodeSpec(agent_root=root, entrypoint="agent:run")
    forked = fresh.model_copy(update={"preload": True})
    await isolate.run_episode(fresh, {})  # probes, imports: not counted
    await isolate.run_episode(forked, {})  # the template started
    try:
        for title, spec, start in (("fresh", fresh, "fresh"), ("template", forked, "template")):
            tracer = Tracer()
            sys.setprofile(tracer)
            threading.setprofile(tracer)
            try:
                outcome = await _traced(tracer, spec)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
            assert (outcome.status, outcome.start) == ("ok", start), outcome.summary()
            tracer.report(f"{title} ({outcome.containment})")
    finally:
        await isolate.close_templates()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.crossings")
    anyio.run(_main, parser.parse_args(argv))


if __name__ == "__main__":
    main()
