"""``isolate report RESULTS.jsonl``: what a results file of ``isolate batch`` says, without
running anything. The last line of each unit (instance, sample) is its result, as for a
resume; the earlier lines are its earlier attempts.

Exit status: 0; 1 the plot could not be written; 2 bad usage, or a file that is not a
results file (each said in one line).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from ..._core.model.outcome import STATUSES
from ..install import install_line
from ..options import UsageError
from .io import BatchError, ResultLines, is_final, read_results, unit_of
from .runmeta import meta_path, read_meta
from .selection import PassAtK, pass_at_ks, pass_lines
from .view import (
    counted,
    gave_up_words,
    mean_reward,
    percentile,
    resolved,
    samples_of,
    table,
    zero_rewards,
)

#: At most this many results of a failure group are listed in the text; --json lists all.
SHOWN_PER_GROUP = 10
#: A line written before ``node`` or ``containment`` was recorded.
NOT_RECORDED = "(not recorded)"
COLORS = {
    "ok": "#2ca02c",
    "agent_error": "#e6a100",
    "crashed": "#d62728",
    "timeout": "#9467bd",
    "protocol_error": "#8c564b",
    "setup_error": "#7f7f7f",
}


def report_command(args: argparse.Namespace) -> int:
    if len(args.results) > 2:
        raise UsageError("give one results file, or two to compare")
    if len(args.results) == 2:
        return _compare_command(args)
    args.results = args.results[0]
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401 - only whether it is there, before any work
        except ImportError:
            raise UsageError(f"--plot needs matplotlib: {install_line('report')}") from None
    lines = _read(args.results)
    found = build(args.results, lines)
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print(render(found))
    if args.plot is not None:
        try:
            results = list(lines.last.values())
            plot(results, lines.entries, args.plot, args.results.name)
        except OSError as exc:
            print(f"isolate: error: cannot write {args.plot}: {exc.strerror}", file=sys.stderr)
            return 1
        print(f"isolate: wrote {args.plot}", file=sys.stderr)
    return 0


def _read(path: Path) -> ResultLines:
    """The lines of a results file for a report, or the UsageError that says what it is."""
    try:
        lines = read_results(path)
    except BatchError as exc:
        raise UsageError(str(exc)) from None
    if not lines.entries:
        raise UsageError(f"{path} holds no result line of isolate batch")
    if lines.partial:
        print(
            f"isolate: ignored a partial last line of {path} ({len(lines.partial)} "
            "bytes): a driver was stopped while writing it, or is writing it now",
            file=sys.stderr,
        )
    return lines


def _compare_command(args: argparse.Namespace) -> int:
    if args.plot is not None:
        raise UsageError("--plot draws one results file; give one")
    a, b = args.results
    found = compare((a, _read(a)), (b, _read(b)))
    print(json.dumps(found, indent=2) if args.json else render_comparison(found))
    return 0


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def finished_at(entry: dict[str, Any]) -> datetime | None:
    """When the attempt of ``entry`` ended (UTC), if its line says so."""
    text = entry.get("finished_at")
    if not isinstance(text, str):
        return None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _started(entry: dict[str, Any]) -> datetime | None:
    end, duration = finished_at(entry), _number(entry.get("duration_s"))
    return end - timedelta(seconds=duration) if end and duration is not None else None


def _stamp(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _group_key(
    entry: dict[str, Any],
) -> tuple[str, str | None, int | None, str | None, str | None]:
    """What a failure is grouped by: its status, then its error type, exit code or signal,
    then the infrastructure that failed it (``infra_kind``)."""
    error = entry.get("error") if isinstance(entry.get("error"), dict) else None
    kind = error.get("type") if error else None
    code = entry.get("exit_code")
    signal = entry.get("signal")
    return (
        str(entry["status"]),
        str(kind) if kind is not None else None,
        code if isinstance(code, int) and not isinstance(code, bool) else None,
        str(signal) if signal else None,
        str(entry["infra_kind"]) if entry.get("infra_kind") else None,
    )


def _breakdown(entries: list[dict[str, Any]], field: str) -> dict[str, dict[str, int]]:
    """Per value of ``field`` (a node, a containment): its results by status."""
    found: dict[str, Counter[str]] = defaultdict(Counter)
    for entry in entries:
        found[str(entry.get(field) or NOT_RECORDED)][entry["status"]] += 1
    return {name: {s: n[s] for s in STATUSES if n[s]} for name, n in sorted(found.items())}


def build(path: Path, lines: ResultLines) -> dict[str, Any]:
    """The report, as the JSON object ``--json`` prints; the text is drawn from it."""
    results = list(lines.last.values())
    final = [e for e in results if is_final(e)]
    counts = Counter(e["status"] for e in results)
    with_samples = any("sample" in e for e in lines.entries)
    per_instance = samples_of(final)
    instances = {str(e["instance_id"]) for e in results}
    sizes = Counter(str(e["instance_id"]) for e in results)
    durations = sorted(d for e in results if (d := _number(e.get("duration_s"))) is not None)
    times = sorted(t for e in results if (t := finished_at(e)) is not None)
    not_final = Counter(e["status"] for e in results if not is_final(e))
    return {
        "file": str(path),
        "lines": len(lines.entries),
        "earlier_attempts": len(lines.entries) - len(results),
        "partial_line_bytes": len(lines.partial),
        "instances": len(instances),
        "samples": (
            {"min": min(sizes.values()), "max": max(sizes.values())} if with_samples else None
        ),
        "results": len(results),
        "counts": {s: counts[s] for s in STATUSES if counts[s]},
        "not_final": {s: not_final[s] for s in STATUSES if not_final[s]},
        "final": len(final),
        "final_counts": {s: n for s in STATUSES if (n := sum(e["status"] == s for e in final))},
        "mean_reward": (
            sum(mean_reward(e.get("reward")) for e in final) / len(final) if final else None
        ),
        "resolved": sum(resolved(e) for e in final),
        "pass_at_k": _passes(per_instance),
        "duration_s": (
            {
                "p50": percentile(durations, 0.5),
                "p95": percentile(durations, 0.95),
                "max": durations[-1],
            }
            if durations
            else None
        ),
        "finished": (
            {
                "first": _stamp(times[0]),
                "last": _stamp(times[-1]),
                "span_s": (times[-1] - times[0]).total_seconds(),
            }
            if times
            else None
        ),
        **outcome_ids(results),
        "run": read_meta(path),
        "failures": _failures(results),
        "nodes": _breakdown(results, "node"),
        "containment": _breakdown(results, "containment"),
    }


def unit_key(entry: dict[str, Any]) -> str:
    """How a result is named in the lists and comparisons: its instance id, and ``#sample``
    for a line with a sample (``--samples``)."""
    sample = entry.get("sample")
    return str(entry["instance_id"]) + (f"#{sample}" if sample is not None else "")


def verdict(entry: dict[str, Any]) -> str:
    """``resolved`` (a final ``ok`` with every reward at least 1), ``unresolved`` (a final
    ``ok`` with less), or ``error`` (any other status, or a line that is not final)."""
    if is_final(entry) and entry["status"] == "ok":
        return "resolved" if resolved(entry) else "unresolved"
    return "error"


def outcome_ids(results: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The ids of the resolved, unresolved and error results, each list sorted."""
    found: dict[str, list[str]] = {"resolved": [], "unresolved": [], "error": []}
    for entry in results:
        found[verdict(entry)].append(unit_key(entry))
    return {f"{name}_ids": sorted(ids) for name, ids in found.items()}


def _failures(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results that are not ``ok``, in groups of one status, error type, exit code and
    signal: by status, then the biggest group first."""
    groups: dict[
        tuple[str, str | None, int | None, str | None, str | None], list[dict[str, Any]]
    ] = {}
    for entry in sorted(results, key=unit_of):
        if entry["status"] != "ok":
            groups.setdefault(_group_key(entry), []).append(entry)
    order: dict[str, int] = {s: n for n, s in enumerate(STATUSES)}
    failures = []
    for key in sorted(groups, key=lambda k: (order[k[0]], -len(groups[k]), str(k))):
        status, kind, code, signal, infra = key
        failures.append(
            {
                "status": status,
                "error_type": kind,
                "exit_code": code,
                "signal": signal,
                "infra": infra,
                "count": len(groups[key]),
                "results": [_failure(e) for e in groups[key]],
            }
        )
    return failures


def _passes(per_instance: dict[str, tuple[int, int]]) -> dict[str, Any] | None:
    """pass@k over the instances with a final result: ``per_instance`` holds each one's
    number of final samples (n) and of resolved ones (c)."""
    found = pass_at_ks(per_instance.values())
    if not found:
        return None
    sizes = [n for n, _ in per_instance.values()]
    return {
        "instances": len(per_instance),
        "samples_min": min(sizes),
        "samples_max": max(sizes),
        "values": [{"k": p.k, "value": p.value, "instances": p.instances} for p in found],
    }


def _failure(entry: dict[str, Any]) -> dict[str, Any]:
    error = entry.get("error") if isinstance(entry.get("error"), dict) else None
    return {
        "instance_id": entry["instance_id"],
        "sample": entry.get("sample"),
        "attempt": entry["attempt"],
        "final": is_final(entry),
        "message": error.get("message") if error else None,
        "log_path": entry.get("log_path"),
        "episode_id": entry.get("episode_id"),
        # An episode's own infrastructure error that is final: the runs it ended (--infra-runs).
        "gave_up_after_runs": (
            int(entry.get("infra_runs") or 0)
            if is_final(entry) and entry.get("infra_kind")
            else None
        ),
    }


def _group_title(group: dict[str, Any]) -> str:
    parts = [group["error_type"]] if group["error_type"] else []
    if group["exit_code"] is not None:
        parts.append(f"exit {group['exit_code']}")
    if group["signal"]:
        parts.append(str(group["signal"]))
    if group.get("infra"):
        parts.append(f"infra: {group['infra']}")
    gave = [r["gave_up_after_runs"] for r in group["results"] if r.get("gave_up_after_runs")]
    if gave:
        parts.append(gave_up_words(len(gave), max(gave)))
    detail = ", ".join(parts) or "no error recorded"
    return f"  {group['status']}  {detail}  ({group['count']})"


def _label(result: dict[str, Any]) -> str:
    sample = result["sample"]
    return str(result["instance_id"]) + (f"#{sample}" if sample is not None else "")


def _span(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    if hours:
        return f"{hours}h{rest // 60:02d}m"
    return f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest} s"


def _shorten(text: str, width: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _status_table(name: str, rows: dict[str, dict[str, int]]) -> list[str]:
    statuses = [s for s in STATUSES if any(s in counts for counts in rows.values())]
    cells: list[tuple[str, ...]] = [(name, "results", *statuses)]
    for value, counts in rows.items():
        cells.append((value, str(sum(counts.values())), *(str(counts.get(s, 0)) for s in statuses)))
    return table(cells, right=set(range(1, len(statuses) + 2)))


def render(found: dict[str, Any]) -> str:
    """The text of a report built by :func:`build`."""
    total = found["results"]
    what = counted(found["instances"], "instance")
    if found["samples"]:
        low, high = found["samples"]["min"], found["samples"]["max"]
        what += f" x {counted(low, 'sample')}" if low == high else f" x {low}-{high} samples"
    lines = [
        f"isolate report: {found['file']}: {what}, {counted(total, 'result')} from "
        f"{counted(found['lines'], 'line')} "
        f"({counted(found['earlier_attempts'], 'earlier attempt')})",
        *_run_lines(found["run"], Path(found["file"])),
        "",
    ]
    cells: list[tuple[str, ...]] = [("status", "count", "share")]
    cells += [(s, str(n), f"{100.0 * n / total:.1f}%") for s, n in found["counts"].items()]
    cells.append(("total", str(total), "100.0%"))
    lines += table(cells, right={1, 2})
    lines.append("")
    facts: list[tuple[str, str]] = []
    if found["mean_reward"] is not None:
        failed = {s: n for s, n in found["final_counts"].items() if s != "ok"}
        text = f"{found['mean_reward']:.3f} over {counted(found['final'], 'final result')}"
        text += ", " + zero_rewards(failed)
        facts.append(("mean reward", text))
    share = 100.0 * found["resolved"] / total
    facts.append(("resolved", f"{found['resolved']}/{total} ({share:.1f}%)"))
    lines += [f"{name:<11}  {text}" for name, text in facts]
    passes = found["pass_at_k"]
    if passes:
        rows = [PassAtK(**p) for p in passes["values"]]
        lines += pass_lines(
            rows, passes["instances"], [passes["samples_min"], passes["samples_max"]]
        )
    facts = []
    if found["duration_s"]:
        d = found["duration_s"]
        text = f"p50 {d['p50']:.2f} s, p95 {d['p95']:.2f} s, max {d['max']:.2f} s"
        facts.append(("duration", text))
    if found["finished"]:
        f = found["finished"]
        facts.append(("finished", f"{f['first']} to {f['last']} ({_span(f['span_s'])})"))
    if found["not_final"]:
        counts = ", ".join(f"{s} {n}" for s, n in found["not_final"].items())
        text = f"{sum(found['not_final'].values())} ({counts}): "
        text += "a rerun of the batch runs them again"
        facts.append(("not final", text))
    lines += [f"{name:<11}  {text}" for name, text in facts]
    lines += ["", *id_lines(found)]
    if found["failures"]:
        lines += _failure_lines(found["failures"])
    lines += ["", *_status_table("node", found["nodes"])]
    lines += ["", *_status_table("containment", found["containment"])]
    return "\n".join(lines)


def id_lines(found: dict[str, Any]) -> list[str]:
    """The ids of the resolved, unresolved and error results, wrapped."""
    lines = []
    for name in ("resolved", "unresolved", "error"):
        ids = found[f"{name}_ids"]
        lines += _wrapped(f"{name} ({len(ids)})", ids)
    return lines


def _wrapped(title: str, ids: list[str], indent: int = 17) -> list[str]:
    """``title`` in a column of ``indent``, then the ids, wrapped at 100 columns."""
    head = f"{title:<{indent - 2}}  "
    if not ids:
        return [head + "-"]
    return textwrap.wrap(
        ", ".join(ids),
        width=100,
        initial_indent=head,
        subsequent_indent=" " * indent,
        break_on_hyphens=False,
        break_long_words=False,
    )


def _run_lines(run: dict[str, Any] | None, results: Path) -> list[str]:
    """What the run's metadata says: its id, start, host, isolate's version, the agent and
    the endpoint; or that there is none."""
    if run is None:
        return [f"run          no metadata ({meta_path(results).name} is missing)"]
    agent = run.get("agent") or {}
    endpoint = run.get("endpoint") or {}
    resumed = len(run.get("resumed") or [])
    commit = agent.get("commit")
    at = f" at {commit[:12]}{' (dirty)' if agent.get('dirty') else ''}" if commit else ""
    lines = [
        f"run          {run['run_id']}: started {run.get('started_at')} on {run.get('host')}"
        + (f", resumed {resumed}x" if resumed else ""),
        f"isolate      {run.get('isolate_version')}",
        f"agent        {agent.get('root')}{at}, {agent.get('entrypoint')}, "
        f"python {agent.get('python')}",
        f"endpoint     {endpoint.get('base_url') or 'per record'}"
        + (f", model {endpoint['model']}" if endpoint.get("model") else ""),
    ]
    return lines


def _failure_lines(failures: list[dict[str, Any]]) -> list[str]:
    """Each group of failures: its title, a message of its, and where the logs of the first
    few are."""
    failed = sum(g["count"] for g in failures)
    lines = ["", f"failures: {counted(failed, 'result')} in {counted(len(failures), 'group')}"]
    for group in failures:
        lines.append(_group_title(group))
        messages = Counter(r["message"] for r in group["results"] if r["message"])
        if messages:
            lines.append(f"    e.g. {_shorten(messages.most_common(1)[0][0])}")
        shown = group["results"][:SHOWN_PER_GROUP]
        width = max(len(_label(r)) for r in shown)
        for result in shown:
            where = result["log_path"] or "no log"
            lines.append(f"    {_label(result):<{width}}  {where}")
        if group["count"] > len(shown):
            lines.append(f"    ... and {group['count'] - len(shown)} more (--json lists every one)")
    return lines


def plot(
    results: list[dict[str, Any]], lines: list[dict[str, Any]], path: Path, title: str
) -> None:
    """A PNG of two panels: the results by end time, stacked by status (cumulative), and the
    duration of the results of each status (a box, and each result as a dot). ``lines``:
    every line, earlier attempts too, for when the first attempt started."""
    from matplotlib.figure import Figure

    statuses = [s for s in STATUSES if any(e["status"] == s for e in results)]
    fig = Figure(figsize=(12, 4.8), dpi=100, layout="constrained")
    over_time, durations = fig.subplots(1, 2, width_ratios=(3, 2))
    fig.suptitle(f"{title}: {len(results)} results")
    _plot_over_time(over_time, results, lines, statuses)
    _plot_durations(durations, results, statuses)
    fig.savefig(path, format="png")


def _plot_over_time(
    axes: Any, results: list[dict[str, Any]], lines: list[dict[str, Any]], statuses: Sequence[str]
) -> None:
    """The results by end time, stacked by status, cumulative."""
    timed = sorted(
        (when, str(e["status"])) for e in results if (when := finished_at(e)) is not None
    )
    axes.set_title("results by end time, cumulative")
    axes.set_ylabel("results")
    if not timed:
        axes.text(0.5, 0.5, "no line says when it finished", ha="center", transform=axes.transAxes)
        return
    times = sorted({when for when, _ in timed})
    # From when the first of them started, as near as the lines tell.
    first = min(min(_started(e) or times[0] for e in lines), times[0])
    span = (times[-1] - first).total_seconds()
    unit, scale = ("seconds", 1.0) if span < 120 else ("minutes", 60.0)
    if span >= 2 * 3600:
        unit, scale = "hours", 3600.0
    lead = max(1.0, span / 50) / scale
    xs = [0.0, *((when - first).total_seconds() / scale for when in times)]
    stacks: dict[str, list[int]] = {s: [0] for s in statuses}
    seen: Counter[str] = Counter()
    at = 0
    for when in times:
        while at < len(timed) and timed[at][0] == when:
            seen[timed[at][1]] += 1
            at += 1
        for s in statuses:
            stacks[s].append(seen[s])
    xs.append(xs[-1] + lead)  # the last level, drawn as wide as the first step
    for s in statuses:
        stacks[s].append(seen[s])
    axes.stackplot(
        xs,
        *(stacks[s] for s in statuses),
        labels=statuses,
        colors=[COLORS[s] for s in statuses],
        step="post",
        alpha=0.85,
    )
    axes.set_xlim(xs[0], xs[-1])
    axes.set_xlabel(f"{unit} since the first attempt started, {_stamp(first)}")
    axes.legend(loc="upper left", fontsize="small")


def _plot_durations(axes: Any, results: list[dict[str, Any]], statuses: Sequence[str]) -> None:
    """The duration of the results of each status: a box, and each result as a dot."""
    import random

    axes.set_title("duration by status")
    axes.set_ylabel("seconds")
    timed_statuses = []
    values = []
    for s in statuses:
        found = [d for e in results if e["status"] == s and (d := _number(e.get("duration_s")))]
        if found:
            timed_statuses.append(s)
            values.append(found)
    if not values:
        axes.text(0.5, 0.5, "no line says how long it ran", ha="center", transform=axes.transAxes)
        return
    positions = list(range(1, len(values) + 1))
    axes.boxplot(values, positions=positions, widths=0.5, showfliers=False)
    jitter = random.Random(0)  # the same picture for the same file
    for position, status, found in zip(positions, timed_statuses, values, strict=True):
        xs_dots = [position + jitter.uniform(-0.18, 0.18) for _ in found]
        axes.scatter(xs_dots, found, s=12, color=COLORS[status], alpha=0.7, zorder=3)
    names = [f"{s}\n({len(v)})" for s, v in zip(timed_statuses, values, strict=True)]
    axes.set_xticks(positions, names)
    low = min(min(v) for v in values)
    high = max(max(v) for v in values)
    if low > 0 and high / low > 30:
        axes.set_yscale("log")


#: Metadata fields that differ between any two runs, left out of a comparison's differences.
_ALWAYS_DIFFERENT = {"run_id", "results", "started_at", "resumed", "log_dir", "records.path"}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{"agent.commit": ...}``."""
    if not isinstance(value, dict):
        return {prefix: value}
    found: dict[str, Any] = {}
    for key, item in value.items():
        found.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)))
    return found


def _side(path: Path, lines: ResultLines) -> dict[str, Any]:
    results = list(lines.last.values())
    run = read_meta(path)
    return {
        "file": str(path),
        "run_id": run["run_id"] if run else None,
        "results": len(results),
        "resolved": sum(verdict(e) == "resolved" for e in results),
        "counts": dict(Counter(e["status"] for e in results)),
    }


def compare(a: tuple[Path, ResultLines], b: tuple[Path, ResultLines]) -> dict[str, Any]:
    """Two results files, result by result (instance id, and sample): which each solved,
    which changed status, which only one has, and where their runs' metadata differ."""
    last_a = {unit_key(e): e for e in a[1].last.values()}
    last_b = {unit_key(e): e for e in b[1].last.values()}
    both = sorted(set(last_a) & set(last_b))
    groups: dict[str, list[str]] = {
        "solved_by_both": [],
        "solved_by_a_only": [],
        "solved_by_b_only": [],
        "solved_by_neither": [],
    }
    changes = []
    for key in both:
        ea, eb = last_a[key], last_b[key]
        solved = (verdict(ea) == "resolved", verdict(eb) == "resolved")
        name = {(True, True): "both", (True, False): "a_only", (False, True): "b_only"}
        groups["solved_by_" + name.get(solved, "neither")].append(key)
        if ea["status"] != eb["status"]:
            changes.append({"id": key, "a": ea["status"], "b": eb["status"]})
    meta_a, meta_b = _flat(read_meta(a[0]) or {}), _flat(read_meta(b[0]) or {})
    differences = [
        {"field": name, "a": meta_a.get(name), "b": meta_b.get(name)}
        for name in sorted(set(meta_a) | set(meta_b))
        if name not in _ALWAYS_DIFFERENT and meta_a.get(name) != meta_b.get(name)
    ]
    return {
        "a": _side(*a),
        "b": _side(*b),
        "in_both": len(both),
        **groups,
        "status_changes": changes,
        "only_in_a": sorted(set(last_a) - set(last_b)),
        "only_in_b": sorted(set(last_b) - set(last_a)),
        "metadata_differences": differences,
    }


def render_comparison(found: dict[str, Any]) -> str:
    """The text of a comparison built by :func:`compare`."""
    lines = [f"isolate report: {found['a']['file']} (A) vs {found['b']['file']} (B)", ""]
    for side in ("a", "b"):
        s = found[side]
        share = 100.0 * s["resolved"] / s["results"] if s["results"] else 0.0
        lines.append(
            f" {side.upper()}  run {s['run_id'] or '(no metadata)'}: resolved "
            f"{s['resolved']}/{s['results']} ({share:.1f}%)"
        )
    lines += ["", f"in both            {found['in_both']}"]
    width = 23
    for name, title in [
        ("solved_by_both", "solved by both"),
        ("solved_by_a_only", "solved by A only"),
        ("solved_by_b_only", "solved by B only"),
        ("solved_by_neither", "solved by neither"),
        ("only_in_a", "only in A"),
        ("only_in_b", "only in B"),
    ]:
        ids = found[name]
        lines += _wrapped(f"{title} ({len(ids)})", ids, width)
    lost, gained = len(found["solved_by_a_only"]), len(found["solved_by_b_only"])
    lines.append(
        f"{'flips':<{width - 2}}  {lost + gained} (solved by A only {lost}, by B only {gained})"
    )
    changes = found["status_changes"]
    lines += ["", f"status changes ({len(changes)})"]
    if changes:
        col = max(len(c["id"]) for c in changes)
        lines += [f"  {c['id']:<{col}}  {c['a']} -> {c['b']}" for c in changes]
    differences = found["metadata_differences"]
    lines += ["", f"run metadata differences ({len(differences)})"]
    lines += [f"  {d['field']}: {d['a']!r} -> {d['b']!r}" for d in differences]
    return "\n".join(lines)
