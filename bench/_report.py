"""Markdown for a results dict: one table per section, then the targets."""

from __future__ import annotations

from typing import Any

LABELS = {
    "isolate": "isolate (`run_episode`)",
    "bare": "bare `python -I -c pass` (floor)",
    "mp_spawn": "`multiprocessing` spawn, Process per episode",
    "ppe_fresh": "`ProcessPoolExecutor(max_tasks_per_child=1)`",
    "pool_shared": "shared `ProcessPoolExecutor` + env (AReaL subproc)",
    "inprocess": "in-process coroutine (seed)",
}


def _n(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "—" if x is None else f"{x * scale:.{digits}f}"


def _range(s: dict[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    if not s or s.get("median") is None:
        return "—"
    return (
        f"{_n(s['median'], scale, digits)} "
        f"({_n(s['min'], scale, digits)}–{_n(s['max'], scale, digits)})"
    )


def _ratio(s: dict[str, Any]) -> str:
    if not s or s.get("median") is None:
        return "—"
    m, lo, hi = s["median"], s["min"], s["max"]
    d = 3 if m < 0.1 else 2
    return f"{m:.{d}f}× ({lo:.{d}f}–{hi:.{d}f})"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


def machine_line(m: dict[str, Any]) -> str:
    load = "/".join(str(x) for x in m.get("loadavg_at_start", []))
    return (
        f"Run {m['date']} · Linux {m['kernel']} · {m['cpu']} · {m['cores']} cores · "
        f"Python {m['python']} · load average at start {load}"
    )


def _launch(res: dict[str, Any], large: dict[str, Any] | None) -> list[str]:
    head = ["contender", "ms/episode: median (min–max)", "× floor: median (min–max)"]
    if large:
        mib = large["ballast_mib"]
        size = f"{mib / 1024:g} GiB" if mib >= 1024 else f"{mib} MiB"
        head += [f"{size} parent: ms/episode", "× floor", f"{size} / small parent"]
    rows = []
    for name, row in res["rows"].items():
        line = [LABELS.get(name, name), _range(row, 1000, 2), _ratio(row["ratio"])]
        if large:
            big = large["rows"][name]
            line += [_range(big, 1000, 2), _ratio(big["ratio"]), _ratio(large["vs_small"][name])]
        rows.append(line)
    note = (
        f"{res['rounds']} rounds × {res['episodes_per_sample']} sequential episodes per sample; "
        f"contenders and parents interleaved round-robin. Small parent RSS "
        f"{res['parent_rss_mib']:.0f} MiB"
    )
    if large:
        note += f", large parent RSS {large['parent_rss_mib']:.0f} MiB"
    return ["## 1 + 2b. Launch overhead of a no-op episode (sequential)", "", note + ".", ""] + (
        _table(head, rows)
    )


def _throughput(res: dict[str, Any]) -> list[str]:
    head = [
        "contender @ concurrency",
        "episodes",
        "episodes/s: median (min–max)",
        "× floor",
        "parent CPU ms/episode",
        "× floor",
    ]
    rows = [
        [
            f"{r['contender']} @ {r['concurrency']}",
            str(r["episodes"]),
            _range(r["eps"]),
            _ratio(r["eps_ratio"]),
            _range(r["cpu_s"], 1000, 2),
            _ratio(r["cpu_ratio"]),
        ]
        for r in res["rows"].values()
    ]
    return ["## 2. Throughput of no-op episodes", "", f"{res['reps']} repetitions.", ""] + (
        _table(head, rows)
    )


def _teardown(res: dict[str, Any]) -> list[str]:
    head = [
        "contender / tree",
        "deadline → no process left, ms",
        "deadline → call returned, ms",
        "survivors: median (max)",
        "runs never cleared",
        "runs",
    ]
    rows = []
    for key, r in res["rows"].items():
        name, mode = key.split("/")
        what = "honours SIGTERM" if mode == "term" else "ignores SIGTERM"
        rows.append(
            [
                f"{name}, tree {what}",
                _range(r["gone"], 1000),
                _range(r["return"], 1000),
                f"{_n(r['survivors']['median'], 1, 0)} ({_n(r['survivors']['max'], 1, 0)})",
                str(r["never_gone"]),
                str(len(r["runs"])),
            ]
        )
    note = (
        f"Tree of {res['tree']} processes; deadline {res['timeout']:g} s; isolate "
        f"kill_grace {res['kill_grace']:g} s; pebble waits 3 s between SIGTERM and SIGKILL. "
        "Survivors counted 0.3 s after the call returned, then killed."
    )
    return ["## 3. Teardown", "", note, ""] + _table(head, rows)


def _scale(res: dict[str, Any]) -> list[str]:
    head = ["metric", "median", "min", "max"]
    rows = [
        [k, _n(s["median"], 1, 2), _n(s["min"], 1, 2), _n(s["max"], 1, 2)]
        for k, s in res["rows"].items()
    ]
    note = (
        f"{res['episodes']} concurrent episodes, each {res['sleep_s']:g} s asleep while writing "
        f"{res['stderr_bytes'] // 1024} KiB to stderr (logged to a file); "
        f"{len(res['runs'])} run(s)."
    )
    return ["## 4. Scale", "", note, ""] + _table(head, rows)


def _footprint(res: dict[str, Any]) -> list[str]:
    head = ["process", "RSS KiB", "× bare", "USS KiB", "× bare", "PSS KiB", "× bare"]
    rows = []
    for who, r in res["rows"].items():
        line = [who]
        for f in ("rss", "uss", "pss"):
            line += [_range(r[f], 1, 0), _ratio(r[f]["ratio"])]
        rows.append(line)
    note = f"Median (min–max) of {res['reps']} episode(s) of a no-op agent held open."
    return ["## 5. Child footprint", "", note, ""] + _table(head, rows)


def targets(sections: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(what: str, value: float | None, limit: float, shown: str, le: bool = True) -> None:
        met = value is not None and (value <= limit if le else value < limit)
        out.append({"target": what, "value": value, "limit": limit, "shown": shown, "met": met})

    if "rows" in sections.get("launch", {}):
        rows = sections["launch"]["rows"]
        add("launch ≤ 1.25 × floor", rows["isolate"]["ratio"]["median"], 1.25,
            _ratio(rows["isolate"]["ratio"]))  # fmt: skip
        for other in ("mp_spawn", "ppe_fresh"):
            value = rows["isolate"]["median"] / rows[other]["median"]
            add(f"launch faster than {other}", value, 1.0, f"{value:.2f}× of it", le=False)
    if "vs_small" in sections.get("large", {}):
        s = sections["large"]["vs_small"]["isolate"]
        mib = sections["large"]["ballast_mib"]
        add(f"launch from a {mib} MiB parent ≤ 1.10 × small parent", s["median"], 1.10, _ratio(s))
    if "rows" in sections.get("teardown", {}):
        td = sections["teardown"]
        for mode, limit in (("term", 0.1), ("ignore", td["kill_grace"] + 0.1)):
            r = td["rows"].get(f"isolate/{mode}")
            if r is None:
                continue
            worst = None if r["never_gone"] else r["gone"]["max"]
            add(f"teardown, tree {mode}: ≤ {limit * 1000:.0f} ms (worst run)", worst, limit,
                _range(r["gone"], 1000) + " ms")  # fmt: skip
            add(f"teardown, tree {mode}: zero survivors", r["survivors"]["max"], 0,
                f"max {r['survivors']['max']}")  # fmt: skip
    if "rows" in sections.get("scale", {}):
        r = sections["scale"]["rows"]
        add("scale: loop lag p99 ≤ 20 ms", r["lag_p99_ms"]["max"], 20.0,
            _range(r["lag_p99_ms"], 1, 2) + " ms")  # fmt: skip
        add("scale: RSS ≤ 200 KiB per episode", r["rss_peak_growth_kib_per_episode"]["max"], 200,
            _range(r["rss_peak_growth_kib_per_episode"]) + " KiB")  # fmt: skip
        left = max(r["fds_left"]["max"], 0) + r["zombies_left"]["max"]
        add("scale: no fd or zombie left", left, 0, f"fds {r['fds_left']['max']:+.0f}, "
            f"zombies {r['zombies_left']['max']:.0f}")  # fmt: skip
    return out


def render(results: dict[str, Any]) -> str:
    lines = ["# isolate benchmarks" + (" (quick smoke run)" if results["quick"] else ""), ""]
    lines += [machine_line(results["machine"]), ""]
    s = results["sections"]
    for name, fn in (
        ("throughput", _throughput),
        ("teardown", _teardown),
        ("scale", _scale),
        ("footprint", _footprint),
    ):
        if name == "throughput" and ("launch" in s or "large" in s):
            launch = s.get("launch")
            if launch and "rows" in launch:
                lines += _launch(launch, s.get("large") if "rows" in s.get("large", {}) else None)
        if name in s and "rows" in s[name]:
            lines += fn(s[name])
    for name, sec in s.items():
        if "error" in sec:
            lines += [f"**{name} failed:** `{sec['error']}`", ""]
    lines += ["## Targets", ""]
    rows = [[t["target"], t["shown"], "yes" if t["met"] else "**no**"] for t in results["targets"]]
    lines += _table(["target", "measured", "met"], rows)
    if results.get("leftovers"):
        lines += [f"**Processes left by the run and killed:** {results['leftovers']}", ""]
    return "\n".join(lines)
