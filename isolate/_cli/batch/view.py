"""What ``isolate batch`` shows: live progress on stderr (a rich bar on a terminal, plain lines
elsewhere) and the summary on stdout at the end."""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import anyio
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from ..._core.outcome import STATUSES

_STYLE = {
    "ok": "green",
    "agent_error": "yellow",
    "crashed": "red",
    "timeout": "magenta",
    "protocol_error": "red",
    "setup_error": "red",
}


class View:
    """Progress of one run: ``done`` instances already have a final result (resumed)."""

    def __init__(self, total: int, done: Counter[str], interval: float | None) -> None:
        self.total = total
        self.counts = Counter(done)
        self.resumed = sum(done.values())
        self.finished = 0
        """Instances finished in this run."""
        self.retried = 0
        """Attempts of this run that got another attempt."""
        self.running = 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.interval = interval or (0.5 if self.tty else 30.0)
        self._progress: Progress | None = None
        self._live: Live | None = None
        self._task = TaskID(0)

    def __enter__(self) -> View:
        self.start = time.monotonic()
        if self.tty:
            self._progress = Progress(
                TextColumn("[bold]isolate batch"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task(
                "batch", total=self.total, completed=self.resumed, rate=""
            )
            # The counts get a line of their own: on the bar's line they would be cut short.
            self._live = Live(
                Group(self._progress, _Counts(self)),
                console=Console(stderr=True),
                refresh_per_second=1 / self.interval,
            )
            self._live.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._refresh()
            self._live.stop()

    def finished_entry(self, entry: dict[str, Any]) -> None:
        if entry["final"]:
            self.counts[entry["status"]] += 1
            self.finished += 1
        else:
            self.retried += 1
        self._refresh()

    def note(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(f"isolate: {escape(text)}")
        else:
            print(f"isolate: {text}", file=sys.stderr, flush=True)

    def rate(self) -> float:
        return self.finished / max(time.monotonic() - self.start, 1e-9)

    def counts_text(self, markup: bool) -> str:
        parts = []
        for status in STATUSES:
            if self.counts[status]:
                text = f"{status} {self.counts[status]}"
                parts.append(f"[{_STYLE[status]}]{text}[/]" if markup else text)
        parts.append(f"running {self.running}")
        if self.retried:
            parts.append(f"retried {self.retried}")
        return ", ".join(parts)

    def _refresh(self) -> None:
        if self._progress is not None:
            self._progress.update(
                self._task, completed=self.resumed + self.finished, rate=f"{self.rate():.2f}/s"
            )

    def line(self) -> str:
        done = self.resumed + self.finished
        share = 100.0 * done / self.total if self.total else 100.0
        rate = self.rate()
        eta = _clock((self.total - done) / rate) if rate > 0 else "?"
        return (
            f"{done}/{self.total} ({share:.0f}%), {rate:.2f} episodes/s, "
            f"ETA {eta} | {self.counts_text(markup=False)}"
        )

    async def ticker(self) -> None:
        """Redraw the bar (counts of running episodes change without a result) or print a
        plain line, every ``interval`` seconds."""
        while True:
            await anyio.sleep(self.interval)
            if self._live is not None:
                self._refresh()
            else:
                self.note(self.line())


class _Counts:
    """The line under the bar, drawn afresh at every refresh."""

    def __init__(self, view: View) -> None:
        self.view = view

    def __rich__(self) -> Text:
        return Text.from_markup(self.view.counts_text(markup=True))


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile of sorted ``values``."""
    return values[max(0, math.ceil(share * len(values)) - 1)]


def _mean_reward(reward: Any) -> float:
    if isinstance(reward, dict):
        return sum(reward.values()) / len(reward) if reward else 0.0
    return float(reward or 0.0)


def _resolved(entry: dict[str, Any]) -> bool:
    reward = entry["reward"]
    if entry["status"] != "ok" or reward is None:
        return False
    values = reward.values() if isinstance(reward, dict) else [reward]
    return bool(values) and all(v >= 1.0 for v in values)


def summary(
    console: Console, ids: Iterable[str], final: dict[str, dict[str, Any]], view: View
) -> None:
    """The end-of-run report over every instance of the records file, resumed ones included.
    ``final`` maps an instance id to its final result line."""
    ids = list(ids)
    entries = [final[i] for i in ids if i in final]
    counts = Counter(e["status"] for e in entries)
    elapsed = time.monotonic() - view.start
    console.print(
        f"isolate batch: {len(ids)} instances, {view.finished} run now in {elapsed:.1f} s "
        f"({view.rate():.2f}/s), {view.resumed} before, {view.retried} retried"
    )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("status")
    table.add_column("count", justify="right")
    table.add_column("share", justify="right")
    rows: list[tuple[str, int]] = [(s, counts[s]) for s in STATUSES if counts[s]]
    if len(ids) > len(entries):
        rows.append(("no result", len(ids) - len(entries)))
    for status, count in rows:
        share = f"{100.0 * count / len(ids):.1f}%"
        table.add_row(f"[{_STYLE.get(status, 'bold')}]{status}[/]", str(count), share)
    table.add_row("[bold]total[/]", str(len(ids)), "100.0%" if ids else "-")
    console.print(table)
    if not entries:
        return
    mean = sum(_mean_reward(e["reward"]) for e in entries) / len(entries)
    resolved = sum(_resolved(e) for e in entries)
    durations = sorted(float(e["duration_s"]) for e in entries)
    facts = Table.grid(padding=(0, 2))
    facts.add_row("mean reward", f"{mean:.3f} over {len(entries)} results (failures count 0)")
    facts.add_row("resolved", f"{resolved}/{len(ids)} ({100.0 * resolved / len(ids):.1f}%)")
    p50, p95 = percentile(durations, 0.5), percentile(durations, 0.95)
    facts.add_row("duration", f"p50 {p50:.2f} s, p95 {p95:.2f} s")
    slowest = sorted(entries, key=lambda e: -float(e["duration_s"]))[:5]
    for n, e in enumerate(slowest):
        text = f"{escape(e['instance_id'])}  {float(e['duration_s']):.2f} s  {e['status']}"
        facts.add_row("slowest" if n == 0 else "", text)
    console.print(facts)
