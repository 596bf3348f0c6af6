"""Launch overhead of the sandbox: the same no-op episode with and without ``Sandbox()``.

    python -m bench.sandbox [--rounds 40] [--containment auto]

Episodes run one at a time, the contenders interleaved round-robin so they see the same
moments of a shared machine: no sandbox, ``Sandbox()``, ``Sandbox(connect=[443])``. The
working directory is a git checkout (so the ``.git`` mounts are made) and ``HOME`` is this
user's real one (so the carving lists the real home). Also timed alone: the parent's part
(``sandbox.make_tmpdir_and_plan``: the plan, the TMPDIR), and its clean-up. Target: ≤ 5 ms
over no sandbox.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

import isolate
from isolate._core.containment import sandbox as _sandbox

from ._common import machine_info

NOOP = "def run(data, **kwargs):\n    return 1.0\n"


def _median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.2f} ms"


async def _episode(spec: isolate.EpisodeSpec) -> float:
    start = time.perf_counter()
    outcome = await isolate.run_episode(spec, {})
    elapsed = time.perf_counter() - start
    if outcome.status != "ok":
        raise RuntimeError(outcome.summary() + "\n" + outcome.stderr_tail[-2000:])
    return elapsed


async def _rounds(
    contenders: dict[str, isolate.EpisodeSpec], rounds: int
) -> tuple[dict[str, list[float]], isolate.EpisodeOutcome]:
    for spec in contenders.values():  # warm-up: probes, bytecode caches
        await _episode(spec)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for index in range(rounds):
        order = list(contenders) if index % 2 == 0 else list(reversed(contenders))
        for name in order:
            times[name].append(await _episode(contenders[name]))
    return times, await isolate.run_episode(contenders["Sandbox()"], {})


def measure(rounds: int, containment: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-sandbox.") as work:
        root = Path(work) / "agent"
        root.mkdir()
        (root / "noop_bench_agent.py").write_text(NOOP)
        checkout = Path(work) / "checkout"
        checkout.mkdir()
        subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
        base = isolate.EpisodeSpec(
            agent_root=root,
            entrypoint="noop_bench_agent:run",
            cwd=checkout,
            timeout=30,
            kill_grace=1,
            containment=containment,  # type: ignore[arg-type]
        )
        contenders = {
            "none": base,
            "Sandbox()": base.model_copy(update={"sandbox": isolate.Sandbox()}),
            "Sandbox(connect=[443])": base.model_copy(
                update={"sandbox": isolate.Sandbox(connect=[443])}
            ),
        }
        times, outcome = anyio.run(_rounds, contenders, rounds)
        assert outcome.sandbox is not None

        made, remove = [], []
        env = {"HOME": os.environ.get("HOME", "/")}
        for _ in range(rounds):
            start = time.perf_counter()
            found = _sandbox.make_tmpdir_and_plan(
                isolate.Sandbox(),
                episode_id="bench",
                cwd=str(checkout),
                child_env=env,
                mountns=True,
                can_unshare=False,
            )
            made.append(time.perf_counter() - start)
            start = time.perf_counter()
            _sandbox.remove_tmpdir(found.tmpdir)
            remove.append(time.perf_counter() - start)

    print(
        f"bench.sandbox: {rounds} rounds, containment {outcome.containment}, "
        f"Landlock ABI {outcome.sandbox.landlock_abi}, Python {sys.version.split()[0]}"
    )
    print(f"machine: {machine_info()}")
    print(f"rules {len(found.plan.rules)}, mounts {len(found.plan.mounts)}")
    none = statistics.median(times["none"])
    print(f"{'contender':<24} {'median':>10} {'min':>10} {'over none':>10}")
    for name, samples in times.items():
        over = (statistics.median(samples) - none) * 1e3
        print(
            f"{name:<24} {_median_ms(samples):>10} {min(samples) * 1e3:>7.2f} ms {over:>+7.2f} ms"
        )
    print(
        f"the parent's part (plan + TMPDIR): {_median_ms(made)}; TMPDIR removal: "
        f"{_median_ms(remove)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--containment", default="auto")
    args = parser.parse_args()
    measure(args.rounds, args.containment)


if __name__ == "__main__":
    main()
