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
    "isolate_plain": "isolate, agent in a plain venv",
    "bare_plain": "bare `python -I -c pass`, plain venv (its floor)",
    "isolate_os_exit": "isolate, worker leaves by `os._exit` (no normal exit)",
    "isolate_heavy": "isolate, agent importing asyncio, json, logging, http, …",
    "isolate_heavy_os_exit": "same agent, worker leaves by `os._exit`",
    "isolate_unhardened": "isolate, worker without its hardening (syscall filter, capabilities)",
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
    code = m.get("code") or {}
    commit = code.get("commit") or "?"
    if code.get("uncommitted"):
        commit += f" + {len(code['uncommitted'])} uncommitted file(s) in isolate/, agent_shim/"
    return (
        f"Run {m['date']} · Linux {m['kernel']} · {m['cpu']} · {m['cores']} cores · "
        f"Python {m['python']} · load average at start {load} · code {commit}"
    )


def _levels(res: dict[str, Any]) -> str:
    levels = res.get("containment") or ["?"]
    return f"isolate containment: {', '.join(levels)}"


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
    note = f"{_levels(res)}. {note}"
    if large:
        note += f", large parent RSS {large['parent_rss_mib']:.0f} MiB"
    plain = (
        "The plain-venv rows run under a fresh `python -m venv` without packages, whose `site` "
        "takes ~2 ms (this project's venv spends ~12 ms there, in its editable install's "
        "finder, which the floor pays too); their × floor is against that venv's own bare "
        "interpreter."
    )
    head_lines = ["## 1 + 2b. Launch overhead of a no-op episode (sequential)", "", note + ".", ""]
    tail = [plain, ""] if "isolate_plain" in res["rows"] else []
    return head_lines + _table(head, rows) + tail + _exit_cost(res) + _hardening_cost(res)


def _exit_cost(res: dict[str, Any]) -> list[str]:
    """The normal exit's price: each episode against the same with ``os._exit``."""
    return _pair_costs(
        res.get("exit_cost"),
        "The worker's normal exit after its result (atexit hooks, flushed files, finalizers, "
        "joined threads, bounded by `exit_grace`), priced against the same episode with a shim "
        "whose worker leaves by `os._exit` as it once did:",
        "the `os._exit` one",
    )


def _hardening_cost(res: dict[str, Any]) -> list[str]:
    """The wall's price: each episode against the same with a shim that skips the hardening."""
    return _pair_costs(
        res.get("hardening_cost"),
        "The worker's hardening before the agent's import (a syscall filter, capabilities "
        "dropped), priced against the same episode with a shim that skips it:",
        "the unhardened one",
    )


def _pair_costs(costs: dict[str, Any] | None, intro: str, other: str) -> list[str]:
    """One line per contender: its extra ms and its ratio against ``other``, round by round."""
    if not costs:
        return []
    lines = [intro, ""]
    for name, cost in costs.items():
        lines.append(
            f"- {LABELS.get(name, name)}: +{_range(cost['extra_s'], 1000, 2)} ms per episode, "
            f"{_ratio(cost['ratio'])} of {other}"
        )
    return lines + [""]


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
    note = f"{res['reps']} repetitions, interleaved; {_levels(res)}."
    return ["## 2. Throughput of no-op episodes", "", note, ""] + (_table(head, rows))


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
        f"Survivors counted 0.25 s after the call returned, then killed; {_levels(res)}."
    )
    if res.get("skipped"):
        note += f" Skipped: {', '.join(res['skipped'])}."
    return ["## 3. Teardown", "", note, ""] + _table(head, rows)


_NO_RATIO = {"rss_after_growth_kib_per_episode", "fds_left", "zombies_left"}


def _scale(res: dict[str, Any]) -> list[str]:
    head = [
        "metric",
        "isolate: median (min–max)",
        "bare children: median (min–max)",
        "isolate / bare",
    ]
    rows = [
        [
            k,
            _range(r["isolate"], 1, 2),
            _range(r["bare"], 1, 2),
            "—" if k in _NO_RATIO else _ratio(r["ratio"]),
        ]
        for k, r in res["rows"].items()
    ]
    note = (
        f"{res['episodes']} concurrent episodes, each {res['sleep_s']:g} s asleep while writing "
        f"{res['stderr_bytes'] // 1024} KiB to stderr; {res['reps']} run(s) per contender, "
        "alternating. isolate logs stderr to a file "
        f"({res['logged_bytes_per_episode'] / 1024:.0f} KiB per episode); the bare children "
        f"run the same body under `anyio.open_process`, stderr drained and dropped; "
        f"{_levels(res)}."
    )
    return ["## 4. Scale", "", note, ""] + _table(head, rows)


def _fdlimit(res: dict[str, Any]) -> list[str]:
    runs = res["runs"]
    names = list(runs)

    def limit(run: dict[str, Any]) -> str:
        soft, hard = run["limit_at_start"]
        return f"{soft} / {hard} → {run['limit_in_run'][0]}"

    rows = [
        ["RLIMIT_NOFILE soft / hard → in the run", *[limit(runs[n]) for n in names]],
        ["episodes ok", *[f"{runs[n]['ok']}/{runs[n]['episodes']}" for n in names]],
        ["all started, s", *[_n(runs[n]["all_started_s"], 1, 1) for n in names]],
        ["wall, s", *[_n(runs[n]["wall_s"], 1, 1) for n in names]],
        ["episodes running at once, peak", *[str(runs[n]["running_peak"]) for n in names]],
        ["episodes waiting for fds, peak", *[str(runs[n]["waiting_peak"]) for n in names]],
        ["loop lag p50 / p99 / max, ms", *[
            " / ".join(_n(runs[n]["lag_ms"][k], 1, 1) for k in ("p50", "p99", "max"))
            for n in names]],
        ["peak fds", *[str(runs[n]["fds_peak"]) for n in names]],
        ["fds per running episode (peak)", *[_n(runs[n]["fds_per_running_episode"], 1, 2)
                                             for n in names]],
        ["parent RSS growth per episode, KiB", *[_n(runs[n]["rss_growth_kib_per_episode"])
                                                 for n in names]],
        ["… divided by the episodes running at the peak, KiB",
         *[_n(runs[n]["rss_growth_kib_per_running_episode"]) for n in names]],
        ["admission wait p50 / p99 / max, s", *[
            " / ".join(_n(runs[n]["admission_s"][k], 1, 2) for k in ("p50", "p99", "max"))
            for n in names]],
        ["start-slot wait p50 / p99, s", *[
            " / ".join(_n(runs[n]["start_wait_s"][k], 1, 2) for k in ("p50", "p99"))
            for n in names]],
        ["spawn → hello p50 / p99, ms", *[
            " / ".join(_n(runs[n]["start_s"][k], 1000, 0) for k in ("p50", "p99"))
            for n in names]],
        ["fds / zombies left", *[f"{runs[n]['fds_left']} / {runs[n]['zombies_left']}"
                                 for n in names]],
        ["load average before → after (1 min)", *[
            f"{runs[n]['loadavg_before'][0]:.1f} → {runs[n]['loadavg_after'][0]:.1f}"
            for n in names]],
    ]  # fmt: skip
    levels = sorted({lv for n in names for lv in runs[n]["containment"]})
    note = (
        f"{res['episodes']} concurrent episodes, each {res['sleep_s']:g} s asleep (a line of "
        "stderr before and after, logged to a file), in a fresh process per column, one run "
        f"each; isolate containment: {', '.join(levels)}."
    )
    head = ["metric", *[f"`{n}`" for n in names]]
    return ["## 4b. Past the open-file limit", "", note, ""] + _table(head, rows)


def _footprint(res: dict[str, Any]) -> list[str]:
    head = ["process", "RSS KiB", "× bare", "USS KiB", "× bare", "PSS KiB", "× bare"]
    rows = []
    for who, r in res["rows"].items():
        line = [who]
        for f in ("rss", "uss", "pss"):
            line += [_range(r[f], 1, 0), _ratio(r[f]["ratio"])]
        rows.append(line)
    procs = "/".join(str(n) for n in res.get("episode_processes", []))
    note = (
        f"Median (min–max) of {res['reps']} episode(s) of a no-op agent held open; {_levels(res)}"
        f"; {procs} processes per episode (the shim and its descendants)."
    )
    return ["## 5. Child footprint", "", note, ""] + _table(head, rows)


def _layers(res: dict[str, Any]) -> list[str]:
    head = ["containment", "ms/episode: median (min–max)", "× floor", f"× {res['old_default']}"]
    head.append("child CPU ms/episode")
    rows = []
    for name, r in res["rows"].items():
        label = "bare `python -I -c pass` (floor)" if name == "bare" else f"`{name}`"
        if name == res.get("auto"):
            label += " (auto here)"
        ratios = [_ratio(r["ratio"]), _ratio(r.get("vs_old_default", {}))]
        rows.append([label, _range(r, 1000, 2), *ratios, _range(r.get("cpu", {}), 1000, 1)])
    note = (
        f"{res['rounds']} rounds × {res['episodes_per_sample']} sequential no-op episodes per "
        f"sample, every combination this machine provides, interleaved round-robin in one parent."
    )
    lines = ["## 6. Launch latency per containment combination", "", note, ""]
    lines += _table(head, rows)
    for name, why in res.get("skipped", {}).items():
        lines += [f"- `{name}` not measured: {why}"]
    return lines + ([""] if res.get("skipped") else [])


def _realistic(res: dict[str, Any]) -> list[str]:
    modes = {"fresh": "fresh start", "template": "preloaded template", "inprocess": "in-process"}
    counts = res["counts"]
    head = ["figure", *(modes[m] for m in modes if m in res["rows"])]
    rows_in = [res["rows"][m] for m in modes if m in res["rows"]]

    def pss(r: dict[str, Any], n: int) -> str:
        value = r["pss_kib"].get(n, r["pss_kib"].get(str(n)))
        return "not run (memory)" if value is None else f"{value / 1024:.1f} MiB"

    rows = [
        ["first episode (template: its start; in-process: the import), s"]
        + [f"{r['first_episode_s']:.2f}" for r in rows_in],
        ["run_episode → entrypoint's first line, ms"]
        + [_range(r["first_line"], 1000) for r in rows_in],
        ["launch latency (no-op episode round trip), ms"]
        + [_range(r["launch"], 1000) for r in rows_in],
        ["parent + child CPU per episode, ms"]
        + [f"{r['cpu_per_episode'] * 1000:.0f}" for r in rows_in],
    ]
    for n in counts["pss"]:
        rows.append([f"PSS per episode, {n} at once"] + [pss(r, n) for r in rows_in])
    rows.append(
        [f"throughput of 1-s episodes at concurrency {counts['concurrency']}, episodes/s"]
        + [f"{r['throughput']:.2f} ({r['throughput_episodes']} episodes)" for r in rows_in]
    )
    note = (
        f"Agent: {res['agent']}; {counts['seq']} sequential episodes after a first one; "
        f"{_levels(res)}."
    )
    lines = ["## 7. A realistic agent: fresh, template, in-process", "", note, ""]
    return lines + _table(head, rows) + _compare(res.get("compare"))


COMPARE_LABELS = {
    "template": "preloaded template",
    "forkserver": "stdlib forkserver",
    "floor": "`os.fork()` floor",
}


def _compare(cmp: dict[str, Any] | None) -> list[str]:
    """The template against the stdlib forkserver and a bare fork, round by round."""
    if not cmp or "arms" not in cmp:
        return []
    c, arms, ratios = cmp["counts"], cmp["arms"], cmp["ratios"]
    figures = (
        ("launch", "launch latency (no-op round trip), ms", 1000.0, 1),
        ("cpu_per_episode", "CPU per episode, ms", 1000.0, 1),
        ("pss_kib", f"PSS per episode, {c['held']} held, MiB", 1 / 1024, 2),
        ("throughput", f"1-s episodes/s at concurrency {c['concurrency']}", 1.0, 2),
    )
    head = ["figure", *(COMPARE_LABELS[a] for a in arms)]
    head += ["template / forkserver", "template / floor", "forkserver / floor"]
    rows = []
    for key, label, scale, digits in figures:
        rows.append(
            [label]
            + [_range(arms[a][key], scale, digits) for a in arms]
            + [_ratio(ratios[p][key]) for p in ("template/forkserver", "template/floor",
                                               "forkserver/floor")]
        )  # fmt: skip
    rows.append(
        ["start (until the first episode is back), s"]
        + [_range(arms[a]["start_s"], 1, 2) for a in arms]
        + ["", "", ""]
    )
    left = sorted({p for a in arms.values() for p in a["left"]})
    note = (
        f"{c['rounds']} rounds, each starting each contender anew (order rotated per round: "
        f"{'; '.join(', '.join(o) for o in cmp['orders'])}); per round {c['seq']} sequential "
        f"no-op episodes after a warm-up, {c['held']} held at once, {c['throughput']} 1-s "
        f"episodes at concurrency {c['concurrency']}. Launch: every episode of every round; the "
        "other figures: one value per round; ratios: per round, then the median (min–max). "
        f"Load average {cmp['loadavg_before'][0]:.2f} before, {cmp['loadavg_after'][0]:.2f} "
        f"after. Processes left: {left or 'none'}."
    )
    return ["### The template against the stdlib forkserver and a bare fork", "", note, ""] + (
        _table(head, rows)
    )


def render(results: dict[str, Any]) -> str:
    lines = ["# isolate benchmarks" + (" (quick smoke run)" if results["quick"] else ""), ""]
    lines += [machine_line(results["machine"]), ""]
    s = results["sections"]
    for name, fn in (
        ("throughput", _throughput),
        ("teardown", _teardown),
        ("scale", _scale),
        ("fdlimit", _fdlimit),
        ("footprint", _footprint),
        ("layers", _layers),
        ("realistic", _realistic),
    ):
        if name == "throughput" and ("launch" in s or "large" in s):
            launch = s.get("launch")
            if launch and "rows" in launch:
                lines += _launch(launch, s.get("large") if "rows" in s.get("large", {}) else None)
        if name in s and ("rows" in s[name] or "runs" in s[name]):
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
