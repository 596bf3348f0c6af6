"""What ``isolate batch`` shows: live progress on stderr (a rich bar on a terminal when rich is
installed, plain lines otherwise) and the summary, plain text, on stdout at the end."""

from __future__ import annotations

import math
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from ..._core.model.outcome import STATUSES
from ..._core.system import admission
from ..options import preload_warning
from .io import Unit, unit_of
from .runmeta import meta_path
from .selection import pass_at_ks, pass_lines

if TYPE_CHECKING:
    from .bar import Bar

_STYLE = {
    "ok": "green",
    "agent_error": "yellow",
    "crashed": "red",
    "timeout": "magenta",
    "protocol_error": "red",
    "setup_error": "red",
}
#: Seconds between progress refreshes: the bar, or a plain line.
BAR_INTERVAL_S = 0.5
PLAIN_INTERVAL_S = 30.0


class View:
    """Progress of one run: ``done`` instances already have a final result (resumed)."""

    def __init__(self, total: int, done: Counter[str], interval: float | None) -> None:
        self.total = total
        self.counts = Counter(done)
        self.resumed = sum(done.values())
        self.finished = 0
        """Instances finished in this run."""
        self.retried = 0
        """Attempts of this run that got another attempt, counted when that one starts."""
        self.infra_retried = 0
        """Of them, infrastructure failures (``infra``: a Ray worker or node lost, the driver
        stopped mid-attempt)."""
        self.cut = 0
        """Attempts this run's interrupt cut short (``DriverStopped``): the next run runs
        them again."""
        self.infra_kinds: Counter[str] = Counter()
        """The error types of this run's infrastructure failures."""
        self._awaiting: dict[Unit, bool] = {}
        """Units whose latest line is not final (another attempt is due): whether it was an
        infrastructure failure."""
        self.infra_left = 0
        """Units this run left to the next one after an infrastructure error (an endpoint's,
        an entrypoint's signature): not final, no attempt left now."""
        self.running = 0
        self.preload_refused: set[str] = set()
        """Why --preload gave no template, each said once."""
        self.start = time.monotonic()
        self._given_interval = interval
        self.interval = interval or PLAIN_INTERVAL_S
        self._bar: Bar | None = None

    def __enter__(self) -> View:
        self.start = time.monotonic()
        # rich is not a dependency: off a terminal it is never imported, and on a terminal
        # without it the progress is the plain lines.
        if sys.stderr.isatty():
            try:
                from .bar import Bar
            except ImportError:
                self.note(f"progress every {self.interval:g} s; pip install rich for a live bar")
            else:
                self.interval = self._given_interval or BAR_INTERVAL_S
                self._bar = Bar(
                    self.total, self.resumed, lambda: self.counts_text(markup=True), self.interval
                )
                self._bar.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._refresh()
            self._bar.stop()

    def finished_entry(self, entry: dict[str, Any], again: bool = True) -> None:
        """Count a line written; ``again``: whether its unit gets another attempt now."""
        reason = entry.get("preload_refused")
        if reason and reason not in self.preload_refused:
            self.preload_refused.add(reason)
            self.note(preload_warning(reason))
        if entry["final"]:
            self.counts[entry["status"]] += 1
            self.finished += 1
        elif entry["status"] == "setup_error":
            self.counts["setup_error"] += 1  # not final, but shown: it runs again next time
        elif _kind(entry) == "DriverStopped":
            self.cut += 1  # no attempt follows in this run: the next run's
        elif not again:
            self.infra_left += 1  # the infrastructure's, not final: the next run runs it
        else:
            self._awaiting[unit_of(entry)] = bool(entry.get("infra"))
        if entry.get("infra"):
            self.infra_kinds[_infra_kind(entry)] += 1
        self._refresh()

    def started(self, unit: Unit) -> None:
        """An attempt at ``unit`` starts: a retry when its latest line asked for another."""
        self.running += 1
        if unit in self._awaiting:
            self.retried += 1
            self.infra_retried += self._awaiting.pop(unit)

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.print(f"isolate: {text}")
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
        fds = admission.waiting()  # of those running: under the open-file limit, not yet started
        if fds:
            parts.append(f"waiting for file descriptors {fds}")
        if self.retried:
            parts.append(f"retried {self.retried}")
        if self.infra_retried:
            parts.append(f"infra {self.infra_retried}")
        if self.infra_left:
            parts.append(f"infra, runs again {self.infra_left}")
        return ", ".join(parts)

    def _refresh(self) -> None:
        if self._bar is not None:
            self._bar.update(self.resumed + self.finished, self.rate())

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
            if self._bar is not None:
                self._refresh()
            else:
                self.note(self.line())


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile of sorted ``values``."""
    return values[max(0, math.ceil(share * len(values)) - 1)]


def mean_reward(reward: Any) -> float:
    """A reward as one number: a dict of rewards is their mean; no reward (a failure) is 0."""
    if isinstance(reward, dict):
        values = [float(v) for v in reward.values() if _is_number(v)]
        return sum(values) / len(values) if values else 0.0
    return float(reward) if _is_number(reward) else 0.0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def resolved(entry: dict[str, Any]) -> bool:
    """Resolved: ``ok`` with a reward of at least 1 (each of them, for a dict of rewards)."""
    reward = entry.get("reward")
    if entry["status"] != "ok" or reward is None:
        return False
    values = list(reward.values()) if isinstance(reward, dict) else [reward]
    return bool(values) and all(_is_number(v) and v >= 1.0 for v in values)


def table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    """Rows as aligned columns, a rule under the first; columns in ``right`` right-aligned."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = (
            cell.rjust(w) if c in right else cell.ljust(w)
            for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        lines.append(" " + "  ".join(cells).rstrip())
    rule = " " + "-" * (sum(widths) + 2 * (len(widths) - 1))
    return [lines[0], rule, *lines[1:]]


def unit_label(entry: dict[str, Any]) -> str:
    """An instance id, and its sample when the line has one: ``django-1#2``."""
    if "sample" in entry:
        return f"{entry['instance_id']}#{entry['sample']}"
    return str(entry["instance_id"])


def report_hint(results: Path) -> str:
    """The command that reports on ``results``, as a shell would take it."""
    return f"isolate report {shlex.quote(str(results))}"


def samples_of(entries: Iterable[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """Per instance id: how many samples have a final result (n), how many resolved (c)."""
    found: dict[str, tuple[int, int]] = {}
    for entry in entries:
        n, c = found.get(str(entry["instance_id"]), (0, 0))
        found[str(entry["instance_id"])] = (n + 1, c + resolved(entry))
    return found


def summary(
    out: TextIO,
    units: Iterable[Unit],
    final: dict[Unit, dict[str, Any]],
    setup_errors: dict[Unit, dict[str, Any]],
    view: View,
    *,
    samples: int | None,
    results: Path,
    log_dir: Path,
    run: str | None = None,
) -> None:
    """The end-of-run report over every unit (instance, sample) the run covers, resumed ones
    included. ``final`` maps a unit to its final result line; ``setup_errors`` the units whose
    latest line is a setup error (not final: they run again), each cause shown once.
    An infrastructure error of an episode (``infra_kind``) among ``setup_errors`` is a row
    of its kind. ``samples``: the ``--samples`` given, if any. It ends with where the results
    and logs are, and the command that reports on them."""
    units = list(units)
    entries = [final[u] for u in units if u in final]
    elapsed = time.monotonic() - view.start
    what = counted(len({i for i, _ in units}), "instance")
    if samples is not None:
        what += f" x {counted(samples, 'sample')}"
    lines = [
        f"isolate batch: {what}, {view.finished} run now in {elapsed:.1f} s "
        f"({view.rate():.2f}/s), {view.resumed} before, {view.retried} retried"
        + (f", {view.cut} cut short" if view.cut else ""),
        "",
    ]
    lines += _status_table(units, entries, final, setup_errors)
    facts = _facts(units, entries) if entries else []
    more: list[str] = []
    if entries:
        per_instance = samples_of(entries)
        more = pass_lines(
            pass_at_ks(per_instance.values()),
            len(per_instance),
            (n for n, _ in per_instance.values()),
        )
    facts += _infra_facts(view, units, entries, final, setup_errors)
    where = (
        [("run", f"{run} ({meta_path(results)})")] if run and meta_path(results).exists() else []
    )
    where += [
        ("results", str(results)),
        ("logs", f"{log_dir} (a replay bundle per attempt)"),
        ("report", report_hint(results)),
    ]
    if facts:
        lines.append("")
    lines += [f"{name:<11}  {text}" for name, text in facts[:2]]
    lines += more
    lines += [f"{name:<11}  {text}" for name, text in facts[2:]]
    lines += ["", *(f"{name:<11}  {text}" for name, text in where)]
    print("\n".join(lines), file=out, flush=True)


def _status_table(
    units: list[Unit],
    entries: list[dict[str, Any]],
    final: dict[Unit, dict[str, Any]],
    setup_errors: dict[Unit, dict[str, Any]],
) -> list[str]:
    """The count of each status (setup errors and units without a result too), and each
    distinct cause of a setup error."""
    counts = Counter(e["status"] for e in entries)
    rows: list[tuple[str, int]] = [(s, counts[s]) for s in STATUSES if counts[s]]
    setup = [
        u
        for u in units
        if u not in final and u in setup_errors and setup_errors[u]["status"] == "setup_error"
    ]
    if setup:
        rows.append(("setup_error (runs again)", len(setup)))
    infra = Counter(
        f"infra: {setup_errors[u]['infra_kind']} (runs again)"
        for u in units
        if u not in final and u not in setup and (setup_errors.get(u) or {}).get("infra_kind")
    )
    rows += sorted(infra.items())
    missing = len(units) - len(entries) - len(setup) - sum(infra.values())
    if missing:
        rows.append(("no result", missing))
    cells: list[tuple[str, ...]] = [("status", "count", "share")]
    cells += [(s, str(n), f"{100.0 * n / len(units):.1f}%") for s, n in rows]
    cells.append(("total", str(len(units)), "100.0%" if units else "-"))
    lines = table(cells, right={1, 2})
    if setup:
        causes = Counter(_cause(setup_errors[u]) for u in setup)
        lines += ["", f"setup errors ({len(causes)} distinct; fix them, then rerun):"]
        lines += [f"  {n:>4} x  {cause}" for cause, n in causes.most_common()]
    return lines


def _infra_facts(
    view: View,
    units: list[Unit],
    entries: list[dict[str, Any]],
    final: dict[Unit, dict[str, Any]],
    latest: dict[Unit, dict[str, Any]],
) -> list[tuple[str, str]]:
    """The rows on infrastructure failures: ``infra``, those retried, cut short by the
    interrupt and final (a Ray worker, node or the driver lost, an endpoint); ``not final``,
    the units an episode's own infrastructure error left to the next run."""
    facts = []
    infra_final = [e for e in entries if e.get("infra")]
    counts = (
        (view.infra_retried, "retried"),
        (view.cut, "cut short by the interrupt: the next run runs them again"),
        (len(infra_final), "final"),
    )
    parts = [f"{n} ({what})" for n, what in counts if n]
    if parts:
        kinds = set(view.infra_kinds) | {_infra_kind(e) for e in infra_final}
        facts.append(("infra", ", ".join(parts) + "; " + _infra_cause(kinds)))
    mine = set(units)
    left = Counter(
        str(e["infra_kind"])
        for u, e in latest.items()
        if u not in final and e.get("infra_kind") and u in mine
    )
    if left:
        text = ", ".join(f"{n} {kind}" for kind, n in sorted(left.items()))
        facts.append(("not final", f"{text}: not the agent's; the next run runs them again"))
    gave = [int(e.get("infra_runs") or 0) for e in entries if e.get("infra_kind")]
    if gave:
        facts.append(
            ("gave up", gave_up_words(len(gave), max(gave)) + "; --rerun infra runs again")
        )
    return facts


def gave_up_words(count: int, runs: int) -> str:
    """What ``count`` final results of an episode's own infrastructure error say: the runs
    (at most ``runs``) that ended with one before the batch gave up on them."""
    return (
        f"{count} gave up after infrastructure failures in {runs} runs (--infra-runs): "
        "final with their last status"
    )


def _facts(units: list[Unit], entries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, text) rows over the final results: reward, resolved, durations, containment,
    how the episodes started, the slowest."""
    mean = sum(mean_reward(e["reward"]) for e in entries) / len(entries)
    failed = Counter(e["status"] for e in entries if e["status"] != "ok")
    failed = Counter({s: failed[s] for s in STATUSES if failed[s]})
    done = sum(resolved(e) for e in entries)
    durations = sorted(float(e["duration_s"]) for e in entries)
    p50, p95 = percentile(durations, 0.5), percentile(durations, 0.95)
    facts = [
        (
            "mean reward",
            f"{mean:.3f} over {counted(len(entries), 'result')}, {zero_rewards(failed)}",
        ),
        ("resolved", f"{done}/{len(units)} ({100.0 * done / len(units):.1f}%)"),
        ("duration", f"p50 {p50:.2f} s, p95 {p95:.2f} s"),
    ]
    # Results written before containment was recorded have none.
    used = Counter(str(e["containment"]) for e in entries if e.get("containment"))
    if used:
        facts.append(("containment", ", ".join(f"{c} ({n})" for c, n in sorted(used.items()))))
    starts = Counter(str(e["start"]) for e in entries if e.get("start"))
    if starts["template"] or any(e.get("preload_refused") for e in entries):
        # With --preload: how many episodes got a template, and why the others did not.
        why = Counter(str(e["preload_refused"]) for e in entries if e.get("preload_refused"))
        text = f"template {starts['template']}, fresh {starts['fresh']}"
        if why:
            text += " (" + "; ".join(f"{r}: {n}" for r, n in why.most_common()) + ")"
        facts.append(("start", text))
    slowest = sorted(entries, key=lambda e: -float(e["duration_s"]))[:5]
    for n, e in enumerate(slowest):
        text = f"{unit_label(e)}  {float(e['duration_s']):.2f} s  {e['status']}"
        facts.append(("slowest" if n == 0 else "", text))
    return facts


def zero_rewards(failed: dict[str, int]) -> str:
    """How the mean counts the results that ended without a reward: ``counting the 6 failed
    results (timeout 6) as 0``; ``failed``: their count per status."""
    if not sum(failed.values()):
        return "none of them failed"
    parts = ", ".join(f"{status} {n}" for status, n in failed.items())
    return f"counting the {counted(sum(failed.values()), 'failed result')} ({parts}) as 0"


def _kind(entry: dict[str, Any]) -> str | None:
    error = entry.get("error")
    return str(error.get("type")) if isinstance(error, dict) and error.get("type") else None


def _infra_kind(entry: dict[str, Any]) -> str:
    """An infrastructure failure's kind: the episode's own (an endpoint, a signature), else
    its error's type (a Ray worker or node lost, the driver stopped)."""
    return str(entry.get("infra_kind") or _kind(entry) or "unknown")


#: Infrastructure failures an episode itself reports (``outcome.infra``), in words.
_EPISODE_INFRA = ("endpoint unreachable", "endpoint error", "entrypoint signature")


def _infra_cause(kinds: set[str]) -> str:
    """What the infrastructure failures of these kinds were, in words."""
    causes = [kind for kind in _EPISODE_INFRA if kind in kinds]
    if kinds - {"DriverStopped", *_EPISODE_INFRA}:
        causes.append("a Ray worker or node lost")
    if "DriverStopped" in kinds:
        causes.append("the driver stopped")
    return " or ".join(causes) + ", not the agent"


def _cause(entry: dict[str, Any]) -> str:
    error = entry.get("error") or {}
    return f"{error.get('type', 'SetupError')}: {error.get('message', 'no message')}"


def counted(n: int, noun: str) -> str:
    """``1 instance``, ``2 instances``."""
    return f"{n} {noun}{'s' * (n != 1)}"
