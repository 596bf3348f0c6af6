"""The live progress bar of ``isolate batch`` on a terminal, drawn with rich. Imported only
when stderr is a terminal; without rich installed the view prints plain lines instead."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class Bar:
    """A bar with rate and ETA, and under it the counts per status (``counts()``, in rich
    markup), on stderr."""

    def __init__(
        self, total: int, completed: int, counts: Callable[[], str], interval: float
    ) -> None:
        self._progress = Progress(
            TextColumn("[bold]isolate batch"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self._task = self._progress.add_task("batch", total=total, completed=completed, rate="")
        # The counts get a line of their own: on the bar's line they would be cut short.
        self._live = Live(
            Group(self._progress, _Counts(counts)),
            console=Console(stderr=True),
            refresh_per_second=1 / interval,
        )

    def start(self) -> None:
        self._live.start()

    def stop(self) -> None:
        self._live.stop()

    def update(self, completed: int, rate: float) -> None:
        self._progress.update(self._task, completed=completed, rate=f"{rate:.2f}/s")

    def print(self, text: str) -> None:
        """A line above the bar."""
        self._live.console.print(escape(text))


class _Counts:
    """The line under the bar, drawn afresh at every refresh."""

    def __init__(self, counts: Callable[[], str]) -> None:
        self.counts = counts

    def __rich__(self) -> Text:
        return Text.from_markup(self.counts())
