"""Event-loop lag while an agent floods its frame channel with tiny lines.

    python -m bench.flood [--seconds 2] [--rounds 3]

One episode at a time, per flood form: the agent finds the shim's private frame channel and
writes lines that are not frames of the episode (``{}``, ``x``, a frame of a nonce one
character off) as fast as it can for ``--seconds``, then returns. Meanwhile a ticker task in
the parent sleeps 1 ms at a time and records how late it wakes. Per form: lag p50 / p99 / max
(ms, over all rounds), and the lines the parent read per second. Target: p99 ≤ 20 ms.
"""

from __future__ import annotations

import argparse
import re
import secrets
import tempfile
import time
from pathlib import Path

import anyio

import isolate

from ._common import MARK_ENV, machine_info, percentile, sweep_marked

AGENT = """
import os, sys, time

def run(data, **kwargs):
    caller = sys._getframe(1)  # the shim's worker, which holds the channel
    while "channel" not in caller.f_locals:
        caller = caller.f_back
    chan = caller.f_locals["channel"]
    wrong = chan.nonce[:-1] + ("1" if chan.nonce[-1] == "0" else "0")
    line = data["line"].replace("@WRONG@", wrong).encode() + b"\\n"
    block = memoryview(line * (65536 // len(line)))
    end = time.monotonic() + data["seconds"]
    while time.monotonic() < end:
        view = block
        while view:
            view = view[os.write(chan.fd, view) :]
    return 1.0
"""
FORMS = {
    "{}": "{}",
    "x": "x",
    "wrong nonce": '{"nonce":"@WRONG@"}',
    "result, wrong nonce": '{"t":"result","nonce":"@WRONG@","reward":0.0}',
}
TICK_S = 0.001
COUNTED = re.compile(r"\[isolate\] (\d+) more stdout lines ignored")


async def _episode(spec: isolate.EpisodeSpec, data: dict[str, object]) -> tuple[list[float], int]:
    """The ticker's lags (seconds) during one episode, and the lines the parent noted or
    counted as not frames."""
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(TICK_S)
            lags.append(time.perf_counter() - start - TICK_S)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        outcome = await isolate.run_episode(spec, data)
        tg.cancel_scope.cancel()
    if outcome.status != "ok" or outcome.log_path is None:
        raise RuntimeError(outcome.summary() + "\n" + outcome.stderr_tail[-2000:])
    log = outcome.log_path.read_text()
    outcome.log_path.unlink()
    found = COUNTED.search(log)
    return lags, (int(found[1]) if found else 0) + log.count("[isolate] ignored stdout line")


async def _measure(seconds: float, rounds: int, work: Path, run_id: str) -> None:
    root = work / "agent"
    root.mkdir()
    (root / "flood_bench_agent.py").write_text(AGENT)
    spec = isolate.EpisodeSpec(
        agent_root=root,
        entrypoint="flood_bench_agent:run",
        timeout=60 + 10 * seconds,
        kill_grace=1,
        log_dir=work / "logs",
        env={MARK_ENV: run_id},
    )
    await _episode(spec, {"line": "{}", "seconds": 0.1})  # warm-up
    print(f"bench.flood: {rounds} rounds of {seconds:g} s per form; machine: {machine_info()}")
    print(f"{'form':<22} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'lines/s':>12}")
    for name, line in FORMS.items():
        lags: list[float] = []
        lines = 0
        for _ in range(rounds):
            got, counted = await _episode(spec, {"line": line, "seconds": seconds})
            lags += got
            lines += counted
        p50, p99 = percentile(lags, 50) or 0.0, percentile(lags, 99) or 0.0
        rate = lines / (rounds * seconds)
        print(
            f"{name:<22} {1e3 * p50:>8.2f} {1e3 * p99:>8.2f} {1e3 * max(lags):>8.2f} {rate:>12,.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    run_id = secrets.token_hex(8)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-flood.") as work:
            anyio.run(_measure, args.seconds, args.rounds, Path(work), run_id)
    finally:
        left = sweep_marked(run_id)
        if left:
            print(f"killed {len(left)} processes left behind: {left}")


if __name__ == "__main__":
    main()
