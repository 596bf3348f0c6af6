"""mini-swe-agent on a demo record: the real agent loop, its own model and environment classes.

``run(data, override_base_url=..., override_api_key=..., ...)`` writes the record's
``repo_files`` into a fresh directory, runs mini-swe-agent's ``DefaultAgent`` with its
``LitellmModel`` (bash as a tool call) against ``override_base_url``, then the record's
``eval_script`` there. It returns ``(reward, info)``: 1.0 when the eval passes, and in ``info``
the agent's exit status, its model calls and the seconds each step took.

Importing this module imports mini-swe-agent and litellm: a fresh episode pays for that each
time, a preloaded template once for all its episodes. ``info["import_s"]`` says how long it took
and ``info["imported"]`` where: ``"here"``, or ``"before the fork"`` in a template's episode.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

# Set before the imports below read them: litellm would fetch its cost map from the network at
# import, and mini-swe-agent prints a banner and makes a config folder in the home directory.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
os.environ.setdefault(
    "MSWEA_GLOBAL_CONFIG_DIR", os.path.join(tempfile.gettempdir(), f"mini-swe-agent-{os.getuid()}")
)

_IMPORT_START = time.monotonic()
_IMPORT_PID = os.getpid()

import litellm  # noqa: E402
import yaml  # type: ignore[import-untyped]  # noqa: E402  (a dependency of mini-swe-agent)
from minisweagent import package_dir  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402

_IMPORT_S = round(time.monotonic() - _IMPORT_START, 3)
# litellm prints a provider list to stderr for a model name it has no price for.
litellm.suppress_debug_info = True

#: Model calls before the agent is stopped: the demo's scripts need four.
STEP_LIMIT = 10


class _TimedAgent(DefaultAgent):
    """``DefaultAgent`` that keeps the seconds each step (model call and command) took."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_s: list[float] = []

    def step(self) -> list[dict[str, Any]]:
        start = time.monotonic()
        try:
            return super().step()
        finally:
            self.step_s.append(round(time.monotonic() - start, 3))


def _write_repo(files: dict[str, str]) -> Path:
    repo = Path(tempfile.mkdtemp(prefix="mini-swe-demo-"))
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return repo


def run(
    data: dict[str, Any],
    *,
    override_base_url: str,
    override_api_key: str,
    override_llm_model: str | None = None,
    **_: Any,
) -> tuple[float, dict[str, Any]]:
    config = yaml.safe_load((package_dir / "config" / "mini.yaml").read_text())
    repo = _write_repo(data["repo_files"])
    model = LitellmModel(
        # "openai/" makes litellm speak the OpenAI protocol to any compatible endpoint.
        model_name="openai/" + (override_llm_model or "scripted"),
        model_kwargs={
            "api_base": override_base_url,
            "api_key": override_api_key,
            "drop_params": True,
        },
        observation_template=config["model"]["observation_template"],
        format_error_template=config["model"]["format_error_template"],
    )
    env = LocalEnvironment(cwd=str(repo), env=config["environment"]["env"], timeout=60)
    agent = _TimedAgent(
        model,
        env,
        system_template=config["agent"]["system_template"],
        instance_template=config["agent"]["instance_template"],
        step_limit=STEP_LIMIT,
        cost_limit=0,
    )
    exit_info = agent.run(data["problem_statement"])
    passed = subprocess.run(["bash", "-c", data["eval_script"]], cwd=repo, check=False)
    info = {
        "import_s": _IMPORT_S,
        "imported": "here" if os.getpid() == _IMPORT_PID else "before the fork",
        "exit_status": exit_info.get("exit_status", ""),
        "model_calls": agent.n_calls,
        "step_s": agent.step_s,
        "eval_exit_code": passed.returncode,
    }
    return (1.0 if passed.returncode == 0 else 0.0), info
