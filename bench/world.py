"""What the episode's world costs: a no-op episode's launch with the world PID 1 builds (IPC,
UTS and cgroup namespaces, its own /dev and devpts, the read-only cgroup view and kernel files)
against the same shim building only what came before it (PID and mount namespaces, /proc, a
/dev/shm), side by side with the bare interpreter.

    python -m bench.world [--rounds 20] [-k 5] [--containment cgroup+pidns]

Every round runs each arm ``k`` episodes in a row, in an order that rotates per round; the
ratio and the difference of the two shims are per round. A template pays for its world once, at
its start (its PID 1 and its importer build it); a fork pays nothing more.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

import isolate
from isolate._core.episode import launcher as _launcher

from ._common import MARK_ENV, bare_launches, machine_info, paired_ratio, sweep_marked
from ._launch_worker import shim_variant

NOOP_AGENT = "def run(data, **kwargs):\n    return 1.0\n"

#: The shim without the world: the namespaces, /proc and /dev/shm PID 1 had before it.
BEFORE = {
    "    flags = shim.CLONE_NEWNS | shim.CLONE_NEWIPC | shim.CLONE_NEWUTS\n": (
        "    flags = shim.CLONE_NEWNS\n"
    ),
    "    flags |= shim.CLONE_NEWCGROUP if cgroupns else 0\n": "",
    "    problem = private_dev(mount)\n": (
        '    problem = mount(b"tmpfs", b"/dev/shm", b"tmpfs", QUIET, b"mode=1777")\n'
    ),
    "    problem = cgroup_view(mount) if cgroupns else None\n": "    problem = None\n",
    "    problem = guard_kernel_files(mount) if guard else None\n": "    problem = None\n",
}


async def _episodes(spec: isolate.EpisodeSpec, shim: Path | None, k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        if shim is None:
            outcome = await isolate.run_episode(spec, {})
        else:
            outcome = await _launcher._run_with_shim(spec, {}, shim, pid1=True)
        if outcome.status != "ok" or outcome.containment != spec.containment:
            raise RuntimeError(f"no-op episode: {outcome.summary()}")
    return time.perf_counter() - t0


async def _measure(work: Path, run_id: str, rounds: int, k: int, containment: str) -> None:
    root = work / "agent_root"
    root.mkdir()
    (root / "noop_agent.py").write_text(NOOP_AGENT)
    spec = isolate.EpisodeSpec(
        agent_root=root,
        entrypoint="noop_agent:run",
        containment=containment,
        timeout=60.0,
        kill_grace=1.0,
        env={MARK_ENV: run_id},
    )
    before = shim_variant(work, "shim_before_world", BEFORE)
    compile_all = [sys.executable, "-m", "compileall", "-q", str(before.parent)]
    await anyio.run_process(compile_all)
    arms = {
        "bare": lambda: bare_launches(k),
        "before": lambda: _episodes(spec, before, k),
        "world": lambda: _episodes(spec, None, k),
    }
    for arm in arms.values():  # warm up: caches, bytecode, the containment probe
        await arm()
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(await arms[name]() / k)
    info = machine_info()
    print(f"machine: {info.get('cpu')}, {info.get('cores')} cores; {containment}; ")
    print(f"{rounds} rounds of {k} episodes per arm, interleaved\n")
    print("| arm | median per launch (ms) |")
    print("|---|---|")
    for name, values in times.items():
        print(f"| {name} | {1e3 * statistics.median(values):.2f} |")
    ratio = paired_ratio(times["world"], times["before"])
    diffs = [w - b for w, b in zip(times["world"], times["before"], strict=True)]
    print(
        f"\nworld / before: median {ratio['median']:.3f} "
        f"(rounds {ratio['min']:.3f}-{ratio['max']:.3f}); "
        f"difference median {1e3 * statistics.median(diffs):+.2f} ms per launch"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--containment", default="cgroup+pidns")
    args = parser.parse_args()
    run_id = secrets.token_hex(8)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-world.") as work:
            anyio.run(_measure, Path(work), run_id, args.rounds, args.k, args.containment)
    finally:
        left = sweep_marked(run_id)
        if left:
            print(f"killed {len(left)} processes left behind: {left}")


if __name__ == "__main__":
    main()
