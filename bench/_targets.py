"""The issue's performance targets, judged from a results dict."""

from __future__ import annotations

from typing import Any

from ._report import _range, _ratio


def targets(sections: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(
        what: str, value: float | None, limit: float, shown: str, le: bool = True, ge: bool = False
    ) -> None:
        met = value is not None and (
            value >= limit if ge else value <= limit if le else value < limit
        )
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
        r = {k: v["isolate"] for k, v in sections["scale"]["rows"].items()}
        add("scale: loop lag p99 ≤ 20 ms (median run)", r["lag_p99_ms"]["median"], 20.0,
            _range(r["lag_p99_ms"], 1, 2) + " ms")  # fmt: skip
        rss = r["rss_peak_growth_kib_per_episode"]
        add("scale: RSS ≤ 200 KiB per episode (median run)", rss["median"], 200,
            _range(rss) + " KiB")  # fmt: skip
        left = max(r["fds_left"]["max"], 0) + r["zombies_left"]["max"]
        add("scale: no fd or zombie left (any run)", left, 0, f"fds {r['fds_left']['max']:+.0f}, "
            f"zombies {r['zombies_left']['max']:.0f}")  # fmt: skip
    if "runs" in sections.get("fdlimit", {}):
        fd = sections["fdlimit"]
        n = fd["episodes"]
        for name, run in fd["runs"].items():
            add(f"fdlimit `{name}`: {n}/{n} ok", n - run["ok"], 0, f"{run['ok']}/{n}")
            p99 = run["lag_ms"]["p99"]
            add(f"fdlimit `{name}`: loop lag p99 ≤ 20 ms", p99, 20.0, f"{p99:.1f} ms")
            left = max(run["fds_left"], 0) + run["zombies_left"]
            add(f"fdlimit `{name}`: no fd or zombie left", left, 0,
                f"fds {run['fds_left']:+d}, zombies {run['zombies_left']}")  # fmt: skip
        default = fd["runs"].get("default")
        if default is not None:
            rss = default["rss_growth_kib_per_episode"]
            add(f"fdlimit `default`: ≤ 64 KiB parent RSS per episode ({n} at once)", rss, 64.0,
                f"{rss:.1f} KiB")  # fmt: skip
    if "fresh" in sections.get("realistic", {}).get("rows", {}):
        rows = sections["realistic"]["rows"]
        fresh, tmpl = rows["fresh"], rows["template"]
        launch = tmpl["launch"]["median"]
        add("realistic: template launch ≤ 50 ms", launch, 0.050, f"{launch * 1000:.1f} ms")
        n = max(int(k) for k in tmpl["pss_kib"])
        t_pss, f_pss = tmpl["pss_kib"][n], fresh["pss_kib"].get(n)
        share = t_pss / f_pss if f_pss else None
        shown = f"{share:.0%} of fresh" if share is not None else "fresh not run"
        add(f"realistic: PSS at {n} ≤ 25% of fresh", share, 0.25, shown)
        gain = tmpl["throughput"] / fresh["throughput"]
        add("realistic: throughput ≥ 10× fresh", 10.0 / gain, 1.0, f"{gain:.1f}×")
    if "ratios" in sections.get("realistic", {}).get("compare", {}):
        cmp = sections["realistic"]["compare"]
        vs, c = cmp["ratios"]["template/forkserver"], cmp["counts"]
        for key, what, limit, ge in (
            ("launch", "template launch ≤ 1.5× stdlib forkserver", 1.5, False),
            ("throughput", f"template throughput of 1-s episodes at concurrency "
             f"{c['concurrency']} ≥ 0.95× forkserver", 0.95, True),
            ("pss_kib", f"template PSS per episode at {c['held']} held ≤ 1.3× forkserver",
             1.3, False),
        ):  # fmt: skip
            add(f"realistic: {what}", vs[key]["median"], limit, _ratio(vs[key]), ge=ge)
    return out
