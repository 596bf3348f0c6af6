"""``isolate demo --agent mini-swe-agent``: a third-party agent, contained, timed out and scored.

mini-swe-agent's own loop (``DefaultAgent``, ``LitellmModel`` with its bash tool,
``LocalEnvironment``) runs in ``agent_root/mini_swe_demo.py`` against the scripted LLM, which
answers in that agent's tool-call format:

1. ``demo__calc-1`` fresh: a new interpreter imports mini-swe-agent and litellm, the agent reads
   the file, fixes it with ``sed``, checks it and submits; the eval passes: ``ok``, reward 1.0.
2. the same, preloaded: the first episode of a template, which imported the agent once.
3. the same again: a fork of that template; no import at all.
4. ``demo__hang-1`` preloaded: the agent's command starts a background tree and hangs; at the
   deadline the episode is cancelled, then killed with its tree: ``timeout``, nothing left.

Each episode's line gives its seconds and where they went (import, each model call and command).
Needs mini-swe-agent (the ``mini-swe-agent`` extra): ``pip install 'mini-swe-agent>=2.4,<3'``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import secrets
import sys
from pathlib import Path
from typing import Any

import anyio
from pydantic import SecretStr

from ..._core.episode.launcher import run_episode
from ..._core.model.config import EpisodeSpec
from ..._core.model.outcome import EpisodeOutcome
from ..._core.templates import close_templates
from ..install import install_line
from . import AGENT_ROOT, demo_setup, left_behind
from .scripted_llm import ScriptedLLM, demo_script

ENTRYPOINT = "mini_swe_demo:run"
INSTALL = install_line("mini-swe-agent")

#: (record, preload, timeout in s, expected status, what the line says)
_RUNS = [
    ("demo__calc-1", False, 120.0, "ok", "fresh: a new interpreter imports the agent"),
    ("demo__calc-1", True, 120.0, "ok", "preloaded: the template imports the agent once"),
    ("demo__calc-1", True, 120.0, "ok", "preloaded: a fork of the template, no import"),
    ("demo__hang-1", True, 5.0, "timeout", "preloaded: the agent's command hangs with a tree"),
]


def installed() -> str | None:
    """mini-swe-agent's version in this interpreter, or None when it is not installed."""
    if importlib.util.find_spec("minisweagent") is None:
        return None
    try:
        return importlib.metadata.version("mini-swe-agent")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def _spec(preload: bool, timeout: float, log_dir: Path) -> EpisodeSpec:
    return EpisodeSpec(
        agent_root=AGENT_ROOT,
        entrypoint=ENTRYPOINT,
        python=sys.executable,
        timeout=timeout,
        log_dir=log_dir,
        preload=preload,
        # The hung command never lets the agent's clean-up finish: cut it short after 2 s.
        cancel_grace=2.0,
        kill_grace=1.0,
    )


def _where(outcome: EpisodeOutcome) -> str:
    """Where the episode's seconds went, from what the agent reported."""
    info = outcome.info if isinstance(outcome.info, dict) else {}
    parts = ["a fork of the template" if outcome.start == "template" else "a new interpreter"]
    if "import_s" in info:
        if info.get("imported") == "here":
            parts.append(f"imported mini-swe-agent + litellm in {info['import_s']:.2f} s")
        else:
            parts.append(f"no import (the template's took {info['import_s']:.2f} s)")
    steps = info.get("step_s")
    if isinstance(steps, list) and steps:
        times = " ".join(f"{s:.2f}" for s in steps if isinstance(s, int | float))
        parts.append(f"{len(steps)} steps (model call + command): {times} s")
    return "; ".join(parts)


async def mini_demo() -> int:
    """Run the four episodes; 0 when all end as expected, 1 otherwise, 2 without the extra."""
    version = installed()
    if version is None:
        print(
            f"isolate demo: error: mini-swe-agent is not installed for {sys.executable}: {INSTALL}",
            file=sys.stderr,
        )
        return 2
    records, log_dir = await anyio.to_thread.run_sync(demo_setup)
    log_dir = log_dir.parent / "demo-mini-swe-agent"
    rows: list[tuple[str, str, EpisodeOutcome, int, bool]] = []
    try:
        with ScriptedLLM() as llm:
            print(
                f"isolate demo: mini-swe-agent {version} against a scripted LLM at "
                f"{llm.base_url}, logs in {log_dir}\n"
            )
            for n, (instance_id, preload, timeout, expected, what) in enumerate(_RUNS, 1):
                key = SecretStr("sk-demo-" + secrets.token_urlsafe(18))
                llm.add_session(key, demo_script(instance_id, "mini-swe-agent"))
                kwargs: dict[str, Any] = {
                    "override_base_url": llm.base_url,
                    "result_dir": str(log_dir),
                }
                print(f"  {n}. {instance_id}, {what} ...", flush=True)
                outcome = await run_episode(
                    _spec(preload, timeout, log_dir),
                    records[instance_id],
                    kwargs=kwargs,
                    secrets={"override_api_key": key},
                )
                left = await anyio.to_thread.run_sync(left_behind, outcome)
                # The server answers only this episode's key: its replies prove the key arrived.
                replied = llm.served(key) >= (4 if expected == "ok" else 1)
                ok = outcome.status == expected and left == 0 and replied
                rows.append((instance_id, "preloaded" if preload else "fresh", outcome, left, ok))
                print(f"     -> {outcome.summary()}")
                print(f"        {_where(outcome)}", flush=True)
    finally:
        await close_templates()
    return _table(rows)


def _table(rows: list[tuple[str, str, EpisodeOutcome, int, bool]]) -> int:
    header = f"{'episode':<14} {'start':<10} {'status':<8} {'reward':>6} {'seconds':>8} "
    header += f"{'killed':>6} {'left':>4}  as expected"
    print("\n" + header + "\n" + "-" * len(header))
    for instance_id, start, outcome, left, ok in rows:
        reward = "-" if outcome.reward is None else f"{outcome.reward:g}"
        print(
            f"{instance_id:<14} {start:<10} {outcome.status:<8} {reward:>6} "
            f"{outcome.duration_s:>8.2f} {outcome.killed:>6} {left:>4}  {'yes' if ok else 'NO'}"
        )
    expected_all = all(ok for *_, ok in rows)
    print("isolate demo: " + ("all as expected" if expected_all else "UNEXPECTED RESULTS"))
    return 0 if expected_all else 1
