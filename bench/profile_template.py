"""Where a template fork's launch goes: ``python -m bench.profile_template [-n N] [--agent M]``.

Not part of the benchmark table. Linux, as root, with tracefs: the kernel's own events
(``sched_process_fork``, ``sched_process_exit``, ``cgroup_attach_task``) and markers the parent
writes at its steps give one timeline per no-op episode, on one clock, for the parent, the
template, the fork and the fork's worker alike; the phases are the medians over N episodes
(after three to warm up). ``--agent`` names a module to import in the template too (say
``litellm``, installed in this interpreter): forks and exits cost with the size of the image.
``--park N`` keeps N forks parked (``isolate.park``), refilled before each episode: the
episode takes one, and has no template fork or cgroup move of its own (those phases are then
missing, and the total is the median of the episodes' own).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import psutil

import isolate
from isolate._core import templates as _templates
from isolate._core.episode import child as _child
from isolate._core.templates import process as _process

TRACING = Path("/sys/kernel/tracing")
EVENTS = ("sched/sched_process_fork", "sched/sched_process_exit", "cgroup/cgroup_attach_task")

#: (phase, from step, to step), in the order they happen.
PHASES = [
    ("parent: run_episode to the fork request", "start", "request"),
    ("template: the request to the fork", "request", "forked"),
    ("parent: the fork to its pid in hand", "forked", "reply"),
    ("parent: the move into the episode's leaf", "move", "moved"),
    ("fork: the handshake to its worker's fork", "handshake", "worker"),
    ("worker: its fork to its exit", "worker", "worker exit"),
    ("worker forked ahead: the handshake to its exit", "handshake", "worker exit"),
    ("fork: its worker's exit to its own", "worker exit", "fork exit"),
    ("fork, its own worker: the handshake to its exit", "handshake", "fork exit"),
    ("parent: the fork's exit to knowing its status", "fork exit", "status"),
    ("parent: its status to run_episode's return", "status", "end"),
    ("total", "start", "end"),
]


class Marks:
    """The parent's markers in the trace."""

    def __init__(self) -> None:
        self.file = (TRACING / "trace_marker").open("w", buffering=1)

    def __call__(self, text: str) -> None:
        self.file.write(text + "\n")


def _instrument(mark: Marks) -> None:
    """Markers around the parent's steps, by wrapping them in this process only."""
    fork, move, write = _process.Template.fork, _child.move, _child.write_some
    wait_exit = _process.Forked.wait_exit

    def marked_fork(self: Any, *a: Any, **k: Any) -> Any:
        mark(f"importer {self.importer}")  # the process whose fork is the episode's
        mark("request")
        forked = fork(self, *a, **k)
        mark("reply")
        mark(f"fork {forked.pid}")  # a parked one was not forked after the request
        for child in psutil.Process(forked.pid).children():
            mark(f"ahead {child.pid}")  # a parked fork's worker, forked before the request
        return forked

    def marked_move(*a: Any, **k: Any) -> Any:
        mark("move")
        try:
            return move(*a, **k)
        finally:
            mark("moved")

    def marked_write(*a: Any, **k: Any) -> Any:
        mark("handshake")
        return write(*a, **k)

    async def marked_wait(self: Any) -> None:
        await wait_exit(self)
        mark("status")

    _process.Template.fork = marked_fork  # type: ignore[method-assign]
    _child.move = marked_move
    _child.write_some = marked_write
    _process.Forked.wait_exit = marked_wait  # type: ignore[method-assign]


def _tracing(on: bool) -> None:
    value = "1" if on else "0"
    for event in EVENTS:
        (TRACING / "events" / event / "enable").write_text(value)
    (TRACING / "tracing_on").write_text(value)


_LINE = re.compile(r"-(\d+)\s+\[\d+\]\s+\S+\s+(\d+\.\d+): (\S+): (.*)$")


def _episodes(trace: str) -> list[dict[str, float]]:
    """Each episode's steps (seconds on the trace clock), from the trace's text."""
    found: list[dict[str, float]] = []
    steps: dict[str, float] | None = None
    fork_pid = worker_pid = importer = None
    for line in trace.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        pid, at, event, rest = int(m[1]), float(m[2]), m[3], m[4]
        if event == "tracing_mark_write":
            if rest == "start":
                steps, fork_pid, worker_pid = {"start": at}, None, None
            elif rest.startswith("fork ") and steps is not None:
                if fork_pid != int(rest[5:]):  # a parked fork; what forked was the refill
                    fork_pid = int(rest[5:])
                    steps.pop("forked", None)
            elif rest.startswith("importer ") and rest[9:].isdigit():
                importer = int(rest[9:])
            elif rest.startswith("ahead ") and steps is not None:
                worker_pid = int(rest[6:])
            elif steps is not None:
                steps.setdefault(rest, at)
                if rest == "end":
                    found.append(steps)
                    steps = None
            continue
        if steps is None:
            continue
        fields = dict(re.findall(r"(\w+)=(\S+)", rest))
        if event == "sched_process_fork":
            child = int(fields["child_pid"])
            if fork_pid is None and "request" in steps and pid == importer:
                fork_pid = child
                steps["forked"] = at
            elif pid == fork_pid and worker_pid is None:
                worker_pid = child
                steps["worker"] = at
        elif event == "sched_process_exit" and fields.get("group_dead") == "true":
            if int(fields["pid"]) == worker_pid:
                steps["worker exit"] = at
            elif int(fields["pid"]) == fork_pid:
                steps["fork exit"] = at
    return found


async def _refilled(n: int) -> None:
    while n:
        (template,) = _templates.started_templates()
        if template.pool is not None and len(template.pool.parked) >= n:
            return
        await anyio.sleep(0.005)


async def _run(n: int, root: Path, park: int) -> tuple[str, list[dict[str, float]]]:
    spec = isolate.EpisodeSpec(
        agent_root=root,
        entrypoint="noop_agent:run",
        timeout=60,
        preload=True,
        # litellm would fetch its cost map in a thread at import: no template then.
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    mark = Marks()
    for _ in range(3):
        outcome = await isolate.run_episode(spec, {})
    if park:
        await isolate.park(spec, park)
    _instrument(mark)
    (TRACING / "trace").write_text("")
    _tracing(True)
    try:
        for _ in range(n):
            await _refilled(park)
            mark("start")
            outcome = await isolate.run_episode(spec, {})
            mark("end")
            if outcome.status != "ok" or outcome.start != "template":
                why = outcome.preload_refused or outcome.summary()
                raise SystemExit(f"not a template's ok episode: {why}")
    finally:
        _tracing(False)
        await isolate.close_templates()
    return outcome.containment or "?", _episodes((TRACING / "trace").read_text())


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile_template")
    p.add_argument("-n", type=int, default=30, help="episodes measured (30)")
    p.add_argument("--agent", default="", help="a module the template imports as well")
    p.add_argument("--park", type=int, default=0, help="forks kept parked (isolate.park)")
    args = p.parse_args()
    if not (TRACING / "trace_marker").exists():
        raise SystemExit(
            f"no tracefs at {TRACING}: as root, `mount -t tracefs nodev {TRACING}` first"
        )
    with tempfile.TemporaryDirectory(prefix="isolate-profile-") as tmp:
        root = Path(tmp)
        head = f"import {args.agent}\n" if args.agent else ""
        (root / "noop_agent.py").write_text(head + "def run(data, **kwargs):\n    return 1.0\n")
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        containment, episodes = anyio.run(_run, args.n, root, args.park)
    # Parked: no fork, no move, and the worker forked ahead; else no worker forked ahead. A
    # fork that is its own worker (where forks have leaves and a PID namespace) forks none.
    alone = not any("worker exit" in e for e in episodes)
    gone = {"forked", "move", "moved", "worker"} if args.park else set()
    gone |= {"worker", "worker exit"} if alone else set()
    needed = [(a, b) for name, a, b in PHASES if not {a, b} & gone]
    if not alone:
        needed.remove(("handshake", "fork exit"))
        if not args.park:
            needed.remove(("handshake", "worker exit"))
    complete = [e for e in episodes if all(a in e and b in e for a, b in needed)]
    agent = args.agent or "none"
    print(f"## A template fork's no-op episode, {started}, containment {containment}")
    print(f"agent module imported: {agent}; parked: {args.park}")
    print(f"{len(complete)} of {args.n} episodes complete")
    print(f"(median ms; python {sys.version.split()[0]})\n")
    for name, a, b in PHASES:
        if complete and (a, b) in needed:
            value = statistics.median((e[b] - e[a]) * 1000 for e in complete)
            print(f"{name:50s} {value:8.2f}")


if __name__ == "__main__":
    main()
