"""Items 1 and 2b: launch overhead of a no-op episode, from a small and from a large parent.

Each parent is a separate process (``_launch_worker``), optionally holding touched ballast
memory. The orchestrator asks the two parents for one round at a time, alternately, so the
small and the large parent see the same moments of a shared machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

from ._common import REPO, paired_ratio, summary
from ._context import Context
from ._launch_worker import CONTENDERS, EXIT_PAIRS, HARDENING_PAIRS

BASELINE = "bare"
#: The plain-venv contenders are compared with that venv's own bare interpreter.
BASELINES = {"isolate_plain": "bare_plain", "bare_plain": "bare_plain"}
NOOP_AGENT = "def run(data, **kwargs):\n    return 1.0\n"


def pair_costs(times: dict[str, list[float]], pairs: dict[str, str]) -> dict[str, Any]:
    """For each contender against its pair, round by round: the ratio and the extra seconds."""
    found = {}
    for name, old in pairs.items():
        new_t, old_t = times[name], times[old]
        found[name] = {
            "ratio": paired_ratio(new_t, old_t),
            "extra_s": summary([a - b for a, b in zip(new_t, old_t, strict=False)]),
        }
    return found


def plain_venv(path: Path) -> Path:
    """A venv without packages: how fast an interpreter starts where site has little to do
    (this project's venv spends ~12 ms in site, on its editable install's finder)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    return path / "bin" / "python"


class _Worker:
    def __init__(self, ctx: Context, mib: int, agent_root: Path, plain: Path) -> None:
        code = "from bench._launch_worker import worker_main; worker_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(mib), str(agent_root), ctx.run_id, str(plain)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
            text=True,
        )
        self.mib = mib

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"launch worker ({self.mib} MiB) died: exit {self.proc.wait()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def run(ctx: Context, with_large: bool = True) -> dict[str, Any]:
    """Sections ``launch`` (small parent) and, with ``with_large``, ``large``."""
    rounds, k = (2, 1) if ctx.quick else (11, 4)
    large_mib = 64 if ctx.quick else 4096
    agent_root = ctx.workdir / "launch_agent"
    agent_root.mkdir(exist_ok=True)
    (agent_root / "noop_agent.py").write_text(NOOP_AGENT)
    plain = plain_venv(ctx.workdir / "plain_venv")
    workers = {"small": _Worker(ctx, 0, agent_root, plain)}
    if with_large:
        workers["large"] = _Worker(ctx, large_mib, agent_root, plain)
    times: dict[str, dict[str, list[float]]] = {p: {c: [] for c in CONTENDERS} for p in workers}
    rss: dict[str, list[int]] = {p: [] for p in workers}
    levels: set[str] = set()
    try:
        for label, worker in workers.items():
            rss[label].append(worker._reply()["rss"])  # the ready line, after the warm-up
        for index in range(rounds):
            labels = list(workers) if index % 2 == 0 else list(reversed(workers))
            for label in labels:
                reply = workers[label].ask(k=k, index=index)
                rss[label].append(reply["rss"])
                levels.update(reply["containment"])
                for name, value in reply["times"].items():
                    times[label][name].append(value)
    finally:
        for worker in workers.values():
            worker.close()
    out: dict[str, Any] = {}
    for label in workers:
        rows = {}
        for name in CONTENDERS:
            rows[name] = summary(times[label][name])
            rows[name]["samples"] = times[label][name]
            baseline = BASELINES.get(name, BASELINE)
            rows[name]["ratio"] = paired_ratio(times[label][name], times[label][baseline])

        # What the worker's normal exit costs: the same episode against os._exit, per round.
        exit_cost = pair_costs(times[label], EXIT_PAIRS)
        # What the wall against a hostile agent costs: the same episode without it.
        hardening_cost = pair_costs(times[label], HARDENING_PAIRS)
        out["launch" if label == "small" else "large"] = {
            "unit": "s/episode",
            "baseline": BASELINE,
            "rounds": rounds,
            "episodes_per_sample": k,
            "parent_rss_mib": max(rss[label]) / 2**20,
            "containment": sorted(levels),
            "rows": rows,
            "exit_cost": exit_cost,
            "hardening_cost": hardening_cost,
        }
    if with_large:
        out["large"]["ballast_mib"] = large_mib
        out["large"]["vs_small"] = {
            name: paired_ratio(times["large"][name], times["small"][name]) for name in CONTENDERS
        }
    return out
