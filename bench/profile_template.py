"""Where a template fork's launch goes: ``python -m bench.profile_template [-n N] [--agent M]``.

Not part of the benchmark table. Linux, as root, with tracefs: the kernel's own events
(``sched_process_fork``, ``sched_process_exit``, ``cgroup_attach_task``) and markers the parent
writes at its steps give one timeline per no-op episode, on one clock, for the parent, the
template, the fork and the fork's worker alike; the phases are the medians over N episodes
(after three to warm up). ``--agent`` names a module to import in the template too (say
``litellm``, installed in this interpreter): forks and exits cost with the size of the image.
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

import isolate
from isolate._core import child as _child
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
    ("fork: its worker's exit to its own", "worker exit", "fork exit"),
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
        mark("request")
        try:
            return fork(self, *a, **k)
        finally:
            mark("reply")

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
    fork_pid = worker_pid = None
    for line in trace.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        pid, at, event, rest = int(m[1]), float(m[2]), m[3], m[4]
        if event == "tracing_mark_write":
            if rest == "start":
                steps, fork_pid, worker_pid = {"start": at}, None, None
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
            if fork_pid is None and "request" in steps:
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


async def _run(n: int, root: Path) -> tuple[str, list[dict[str, float]]]:
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
    _instrument(mark)
    (TRACING / "trace").write_text("")
    _tracing(True)
    try:
        for _ in range(n):
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
        containment, episodes = anyio.run(_run, args.n, root)
    complete = [e for e in episodes if all(a in e and b in e for _, a, b in PHASES)]
    agent = args.agent or "none"
    print(f"## A template fork's no-op episode, {started}, containment {containment}")
    print(f"agent module imported: {agent}; {len(complete)} of {args.n} episodes complete")
    print(f"(median ms; python {sys.version.split()[0]})\n")
    for name, a, b in PHASES:
        if complete:
            value = statistics.median((e[b] - e[a]) * 1000 for e in complete)
            print(f"{name:50s} {value:8.2f}")


if __name__ == "__main__":
    main()
