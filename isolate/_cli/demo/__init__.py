"""``isolate demo``: three real episodes against a scripted LLM on 127.0.0.1.

1. ``demo__calc-1``: the example agent asks the LLM, runs bash, applies a patch, passes the
   eval script: ``ok``, reward 1.0. The server accepts only this episode's key, so the reward
   proves the key went through the handshake.
2. ``demo__hang-1``: the LLM tells the agent to start a background tree and hang: ``timeout``;
   the agent is cancelled first, its clean-up is cut short after 2 s, and nothing of the tree
   is left.
3. ``demo__calc-1`` with a key the server was never given: ``agent_error`` (HTTP 401).

The agent (``agent_root/``) and the records (``records/``) live next to this file, so that the
demo runs from any install; a clone links them as ``examples/agent_root`` and
``examples/records``. ``isolate scripted-llm`` serves the same scripts for ``isolate run``.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import anyio
from pydantic import SecretStr

from agent_shim.shim_wire import EPISODE_ENV

from ..._core.episode.launcher import run_episode
from ..._core.model.outcome import EpisodeOutcome
from ..._core.system.tree import is_alive, pids_with_env
from ...workflow import default_log_dir, episode_kwargs, episode_spec
from .scripted_llm import ScriptedLLM, demo_script

#: The demo's agent checkout and its records, shipped inside the package.
AGENT_ROOT = Path(__file__).resolve().parent / "agent_root"
RECORDS = Path(__file__).resolve().parent / "records"


def load_records() -> dict[str, dict[str, Any]]:
    """The demo records (``records/*.json``) by instance id."""
    records = (json.loads(p.read_text()) for p in sorted(RECORDS.glob("*.json")))
    return {r["instance_id"]: r for r in records}


def demo_setup() -> tuple[dict[str, dict[str, Any]], Path]:
    """The demo records by instance id, and the log directory."""
    log_dir = Path(default_log_dir()).absolute() / "demo"
    return load_records(), log_dir


def left_behind(outcome: EpisodeOutcome) -> int:
    import psutil

    procs = []
    for pid in pids_with_env(EPISODE_ENV, outcome.episode_id):  # the demo's ids are its own
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return sum(is_alive(p) for p in procs)


async def demo() -> int:
    root = AGENT_ROOT
    records, log_dir = await anyio.to_thread.run_sync(demo_setup)
    runs = [
        ("demo__calc-1", 120.0, True, "ok", "a real agent loop: LLM, bash, git apply, eval"),
        ("demo__hang-1", 3.0, True, "timeout", "the agent hangs with a background tree"),
        ("demo__calc-1", 120.0, False, "agent_error", "a key the LLM server was never given"),
    ]
    rows = []
    expected_all = True
    with ScriptedLLM() as llm:
        print(f"isolate demo: scripted LLM at {llm.base_url}, logs in {log_dir}\n")
        for instance_id, timeout, register, expected, what in runs:
            key = SecretStr("sk-demo-" + secrets.token_urlsafe(18))
            if register:
                llm.add_session(key, demo_script(instance_id))
            kwargs = episode_kwargs({"agent_type": "swe"}, llm.base_url)
            kwargs["result_dir"] = str(log_dir)
            # A short cancel_grace: the hung agent's bash thread never lets its clean-up
            # finish, and the demo shows that being cut short without a 30 s wait.
            spec = episode_spec({"kill_grace": 1.0, "cancel_grace": 2.0}, root, timeout, log_dir)
            print(f"  {instance_id}: {what} ...", flush=True)
            outcome = await run_episode(
                spec, records[instance_id], kwargs=kwargs, secrets={"override_api_key": key}
            )
            left = await anyio.to_thread.run_sync(left_behind, outcome)
            served = llm.served(key) if register else 0
            ok = outcome.status == expected and left == 0
            expected_all = expected_all and ok
            detail = outcome.error.message if outcome.error else f"info {outcome.info}"
            rows.append((instance_id, outcome, served, left, ok, detail))
            print(f"    -> {outcome.summary()}", flush=True)
        rejected = llm.rejected

    print()
    header = f"{'episode':<14} {'status':<12} {'reward':>6} {'seconds':>8} {'killed':>6} "
    header += f"{'left':>4} {'LLM replies':>11}  as expected"
    print(header)
    print("-" * len(header))
    for instance_id, outcome, served, left, ok, _ in rows:
        reward = "-" if outcome.reward is None else f"{outcome.reward:g}"
        print(
            f"{instance_id:<14} {outcome.status:<12} {reward:>6} {outcome.duration_s:>8.2f} "
            f"{outcome.killed:>6} {left:>4} {served:>11}  {'yes' if ok else 'NO'}"
        )
    print(f"\nrequests the LLM server rejected for a wrong key: {rejected}")
    print("isolate demo: " + ("all as expected" if expected_all else "UNEXPECTED RESULTS"))
    return 0 if expected_all else 1
