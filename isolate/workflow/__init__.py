"""AReaL drop-in: ``SWEAgentWorkflow`` with every episode in its own process.

Swap one import::

    from isolate.workflow import SWEAgentWorkflow

Same constructor, same ``run``, same results as AReaL's in-process workflow; the agent checkout
is imported only in the child, under its own interpreter if ``econfig["python"]`` says so. The
agent sees the trainer's environment minus credential-like and interpreter-steering names
(:data:`PASSTHROUGH_ENV`); credentials its SDKs read from the environment go by econfig
``secret_env``.

What each outcome becomes (``econfig["on_crash"]`` picks the ``crashed`` row):

========================  ====================================================
``ok``                    ``float(reward)`` (a ``{id: reward}`` mapping as is)
``agent_error``           ``0.0``, the child's traceback logged (as AReaL does)
``crashed``               ``0.0`` (``on_crash="zero"``), or raises EpisodeCrashed
``timeout``               raises :class:`~isolate.EpisodeTimeout`, a TimeoutError
``protocol_error``        raises :class:`~isolate.ProtocolError`
``setup_error``           raises :class:`~isolate.SetupError`
========================  ====================================================
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from .._core.allowlist import parse_rules, rule_for_url
from .._core.config import EpisodeSpec, is_env_name
from .._core.env import PASSTHROUGH_ENV
from .._core.launcher import run_episode
from .._core.outcome import EpisodeOutcome
from .._core.sandbox import Sandbox, ports_of_url
from .._core.templates import remedy

__all__ = ["PASSTHROUGH_ENV", "SWEAgentWorkflow", "resolve_agent_root"]

logger = logging.getLogger("AReaL-SWEAgent")

ENTRYPOINT = "aweagent.lifecycle:run_agent_with_reward"

_DEFAULT_AGENT_CONFIGS = {
    "swe": "1_0_0/min-swe-agent-train-top1",
    "cc": "train_cc_time3600",
    "oh": "eval_oh",
    "opencode": "eval_opencode",
    "codex": "eval_codex",
}
#: The econfig keys that name the agent root, first found wins.
ROOT_KEYS = ("agent_root", "aweagent_root", "swe_agent_root")
_ROOT_ENV = ("AWEAGENT_ROOT", "SWE_AGENT_ROOT", "SWEAGENT_ROOT")
_ON_CRASH = ("zero", "raise")
_SANDBOX_BACKENDS = ("aenv", "e2b")
#: Upstream's newer econfig keys, forwarded as ``override_<key>`` when present (and only then:
#: an older AReaL-SWEAgent does not accept them).
_UPSTREAM_OVERRIDES = (
    "harness_timeout",
    "eval_timeout",
    "session_idle_timeout",
    "session_poll_interval",
    "terminal_exit_grace",
    "opencode_config",
    "max_tokens",
    "max_completion_tokens",
)


def default_log_dir() -> str:
    """Where episodes write their results and logs unless told: env ``LOG_DIR``, else
    ``./logs`` (AReaL's convention; the command line's bundles go there too)."""
    return os.environ.get("LOG_DIR", "./logs")


def default_agent_root() -> Path:
    """The sibling checkout: ``../AReaL-SWEAgent`` next to this project's root."""
    project_root = Path(__file__).resolve().parents[2]
    return project_root.parent / "AReaL-SWEAgent"


def resolve_agent_root(econfig: dict[str, Any]) -> Path:
    """econfig ``agent_root`` → ``aweagent_root`` → ``swe_agent_root``; else env
    ``AWEAGENT_ROOT`` → ``SWE_AGENT_ROOT`` → ``SWEAGENT_ROOT``; else the sibling checkout."""
    for key in ROOT_KEYS:
        if econfig.get(key):
            return Path(econfig[key]).expanduser().absolute()
    for name in _ROOT_ENV:
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser().absolute()
    return default_agent_root()


def agent_type_of(econfig: dict[str, Any]) -> str:
    agent_type = str(econfig.get("agent_type") or "swe").strip().lower()
    if not agent_type:
        raise ValueError("econfig.agent_type must not be empty")
    return agent_type


def agent_config_of(econfig: dict[str, Any], agent_type: str) -> str:
    return str(
        econfig.get("agent_config")
        or econfig.get(f"{agent_type}_agent_config")
        or econfig.get("swe_agent_config")
        or _DEFAULT_AGENT_CONFIGS.get(agent_type)
        or agent_type
    )


def _from_env(econfig: dict[str, Any], key: str, env: str) -> str | None:
    value = econfig.get(key) or os.environ.get(env) or None
    return None if value is None else str(value)


def sandbox_backend_of(econfig: dict[str, Any]) -> str:
    """econfig ``sandbox_backend`` stripped and lower-cased (upstream's default ``aenv``)."""
    value = econfig.get("sandbox_backend")
    backend = "aenv" if value is None else str(value).strip().lower()
    if backend not in _SANDBOX_BACKENDS:
        raise ValueError(f"econfig.sandbox_backend must be 'aenv' or 'e2b', got {value!r}")
    return backend


def _plain(value: Any) -> Any:
    """A config value as plain JSON containers (AReaL's econfig may hold OmegaConf ones)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]
    return value


def episode_kwargs(econfig: dict[str, Any], base_url: str) -> dict[str, Any]:
    """The keyword arguments of ``run_agent_with_reward`` except the api key (a secret): the
    seed's, plus upstream's newer keys where econfig has them."""
    agent_type = agent_type_of(econfig)
    kwargs = {
        "agent_type": agent_type,
        "agent_config": agent_config_of(econfig, agent_type),
        "result_dir": default_log_dir(),
        "override_base_url": base_url,
        "override_llm_model": _from_env(econfig, "llm_model", "LLM_MODEL"),
        "override_opencode_provider": _from_env(econfig, "opencode_provider", "OPENCODE_PROVIDER"),
        "override_codex_provider": _from_env(econfig, "codex_provider", "CODEX_PROVIDER"),
    }
    if "sandbox_backend" in econfig:
        kwargs["sandbox_backend"] = sandbox_backend_of(econfig)
    for key in _UPSTREAM_OVERRIDES:
        if key in econfig:
            kwargs[f"override_{key}"] = _plain(econfig[key])
    return kwargs


def secret_env_names(econfig: dict[str, Any]) -> list[str]:
    """econfig ``secret_env``: a list of variable names (checked, not looked up)."""
    names = econfig.get("secret_env")
    if names is None:
        return []
    if isinstance(names, str | bytes) or not isinstance(names, Sequence):
        raise ValueError(
            f"econfig.secret_env must be a list of variable names, got {type(names).__name__}"
        )
    for name in names:
        if not isinstance(name, str) or not is_env_name(name):
            raise ValueError(f"econfig.secret_env: invalid variable name {name!r}")
    return list(names)


def episode_secret_env(
    econfig: dict[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, SecretStr]:
    """econfig ``secret_env``'s names with their values from ``environ`` (default: this
    process's environment)."""
    environ = os.environ if environ is None else environ
    names = secret_env_names(econfig)
    missing = [name for name in names if name not in environ]
    if missing:
        raise ValueError(f"econfig.secret_env: not set in the environment: {', '.join(missing)}")
    both = sorted(set(names) & set(econfig.get("env") or {}))
    if both:
        raise ValueError(f"econfig.secret_env and econfig.env both set {', '.join(both)}")
    return {name: SecretStr(environ[name]) for name in names}


def inherit_env_of(econfig: dict[str, Any]) -> tuple[str, ...]:
    """econfig ``inherit_env``, else :data:`PASSTHROUGH_ENV` (the trainer's environment minus
    credential-like and interpreter-steering names)."""
    names = econfig.get("inherit_env")
    if names is None:
        return PASSTHROUGH_ENV
    if isinstance(names, str | bytes) or not isinstance(names, Sequence):
        raise ValueError(f"econfig.inherit_env must be a list of names, got {names!r}")
    return tuple(names)


def timeout_of(econfig: dict[str, Any], default: float) -> float:
    """econfig ``timeout`` (seconds), else ``default``."""
    value = econfig.get("timeout", default)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"econfig.timeout must be a number of seconds, got {value!r}") from None


def sandbox_of(
    econfig: dict[str, Any], result_dir: str | None = None, base_url: str | None = None
) -> Sandbox | None:
    """econfig ``sandbox`` (True, or a dict of Sandbox's fields) and ``sandbox_network``
    (Sandbox's ``network``; alone, it means a default sandbox with it), with the episode's
    ``result_dir`` writable and ``base_url`` reachable: its port added to ``connect`` when
    that is set, the endpoint to ``network`` when that is an allow-list."""
    raw = econfig.get("sandbox")
    network = _plain(econfig.get("sandbox_network"))
    if (raw is None or raw is False) and network is None:
        return None
    box = Sandbox() if raw is True or raw is None or raw is False else Sandbox.model_validate(raw)
    update: dict[str, Any] = {}
    if network is not None:
        update["network"] = network_of(network, "econfig.sandbox_network")
    allowed = update.get("network", box.network)
    if isinstance(allowed, tuple) and base_url is not None:
        endpoint = rule_for_url(base_url)
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        update["network"] = (*allowed, f"{host}:{endpoint.port}")
    if result_dir is not None:
        path = Path(result_dir).expanduser().absolute()
        try:
            path.mkdir(parents=True, exist_ok=True)  # the agent could not make it itself
        except OSError as exc:
            raise ValueError(f"cannot create result_dir {path}: {exc.strerror or exc}") from None
        update["write"] = (*box.write, path)
    port = ports_of_url(base_url) if base_url is not None else None
    if box.connect is not None and port is not None:
        update["connect"] = (*box.connect, port)
    return Sandbox.model_validate({**box.model_dump(), **update}) if update else box


def network_of(value: Any, name: str) -> str | tuple[str, ...]:
    """A sandbox's ``network`` from config: ``"none"`` or a list of ``host[:port]`` entries;
    a ValueError that names ``name``."""
    if value == "none":
        return "none"
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be 'none' or a list of 'host[:port]', got {value!r}")
    try:
        parse_rules(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return tuple(value)


def episode_spec(
    econfig: dict[str, Any],
    agent_root: Path,
    timeout: float,
    log_dir: Path | None,
    sandbox: Sandbox | None = None,
) -> EpisodeSpec:
    """The spec for one episode from the isolation keys of ``econfig``."""
    return EpisodeSpec(
        agent_root=agent_root,
        entrypoint=ENTRYPOINT,
        python=str(econfig.get("python") or sys.executable),
        timeout=timeout,
        kill_grace=float(econfig.get("kill_grace", 5.0)),
        cancel_grace=float(econfig.get("cancel_grace", 30.0)),
        exit_grace=float(econfig.get("exit_grace", 10.0)),
        env=dict(econfig.get("env") or {}),
        inherit_env=inherit_env_of(econfig),
        log_dir=log_dir,
        containment=econfig.get("containment", "auto"),
        limits=econfig.get("limits"),
        sandbox=sandbox if sandbox is not None else sandbox_of(econfig),
        preload=preload_of(econfig),
    )


def preload_of(econfig: dict[str, Any]) -> bool | tuple[str, ...]:
    """econfig ``preload``: a bool, or a list of module names to import in the template too."""
    value = _plain(econfig.get("preload", False))
    if isinstance(value, list | tuple):
        return tuple(value)
    if not isinstance(value, bool):
        raise ValueError(f"econfig.preload must be a bool or a list of module names, got {value!r}")
    return value


class SWEAgentWorkflow:
    """AReaL-SWEAgent workflow for AReaL proxy mode, one fresh process per episode.

    Args:
        econfig: as AReaL's (``agent_type``, ``agent_config``, ``*_agent_config``,
            ``agent_root`` / ``aweagent_root`` / ``swe_agent_root``, ``llm_model``,
            ``opencode_provider``, ``codex_provider``, ``timeout``; upstream's
            ``sandbox_backend``, ``harness_timeout``, ``eval_timeout``,
            ``session_idle_timeout``, ``session_poll_interval``, ``terminal_exit_grace``,
            ``opencode_config``, ``max_tokens``, ``max_completion_tokens``, forwarded only
            when present), plus ``python`` (the agent's interpreter), ``kill_grace``,
            ``cancel_grace`` and ``exit_grace`` (seconds, as EpisodeSpec's), ``env``,
            ``inherit_env`` (default :data:`PASSTHROUGH_ENV`), ``containment``,
            ``limits`` and ``preload`` (as EpisodeSpec's; ``preload`` a bool or a list of
            module names), ``secret_env`` (names of
            variables of this process passed as ``run_episode(secret_env=...)``), ``sandbox``
            (True, or a dict of :class:`~isolate.Sandbox`'s fields; ``result_dir`` is added
            to ``write``, and ``base_url``'s port to ``connect`` when that is set),
            ``sandbox_network`` (Sandbox's ``network``, ``base_url`` added to a list) and
            ``on_crash`` (``"zero"`` or ``"raise"``).
        gen_args: unused, as in AReaL (token limits come from the agent's config).
        timeout: seconds per episode; ``econfig["timeout"]`` overrides it, and a record's
            ``data["econfig"]["timeout"]`` overrides both for that record.
    """

    def __init__(
        self,
        econfig: dict[str, Any] | None = None,
        gen_args: dict[str, Any] | None = None,
        timeout: float = 1800.0,
    ) -> None:
        if econfig is None:
            econfig = {}
        self.econfig = econfig
        self.gen_args = gen_args or {}
        self.timeout = timeout_of(econfig, timeout)
        self.agent_root = resolve_agent_root(econfig)
        self._preload_refused: set[str] = set()  # each reason warned about once
        if econfig.get("on_crash", "zero") not in _ON_CRASH:
            raise ValueError(
                f"econfig.on_crash must be 'zero' or 'raise', got {econfig['on_crash']!r}"
            )
        # Fail fast on bad isolation settings rather than on the first episode.
        episode_spec(econfig, self.agent_root, self.timeout, None)
        episode_secret_env(econfig)
        if "sandbox_backend" in econfig:
            sandbox_backend_of(econfig)
        # Warn now, not mid-training, when the checkout is missing.
        if not self.agent_root.is_dir():
            logger.warning(
                "AReaL-SWEAgent root does not exist: %s. Set econfig.agent_root (or "
                "econfig.aweagent_root / econfig.swe_agent_root), the AWEAGENT_ROOT (or "
                "SWE_AGENT_ROOT / SWEAGENT_ROOT) env var, or check out AReaL-SWEAgent at %s.",
                self.agent_root,
                default_agent_root(),
            )

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> dict[str, float] | float:
        """Run one episode in a fresh process and return its reward.

        ``extra_kwargs``: ``base_url`` (required) and ``api_key`` (default: env
        ``OPENAI_API_KEY``, else ``"dummy"``), as AReaL's proxy passes them; ``http_client``
        is accepted and ignored (a client cannot cross a process boundary).

        Raises ValueError without ``base_url``, :class:`~isolate.EpisodeTimeout` (a
        TimeoutError) on timeout, :class:`~isolate.SetupError` / ``ProtocolError`` when the
        agent checkout is broken, and ``EpisodeCrashed`` when ``on_crash="raise"``.
        """
        base_url = extra_kwargs.get("base_url")
        if base_url is None:
            raise ValueError("base_url is required for SWEAgentWorkflow")
        api_key = extra_kwargs.get("api_key", os.getenv("OPENAI_API_KEY", "dummy"))

        econfig = self.econfig.copy()
        if "econfig" in data:
            econfig.update(data["econfig"])
        kwargs = episode_kwargs(econfig, str(base_url))
        instance_id = str(data.get("instance_id", "unknown"))
        log_dir = Path(kwargs["result_dir"]) / "isolate"
        # A record's econfig timeout counts for that record, as its other keys do (AReaL's
        # in-process workflow ignores it; a per-record deadline that is silently dropped is
        # worse than one that applies).
        box = sandbox_of(econfig, kwargs["result_dir"], str(base_url))
        timeout = timeout_of(econfig, self.timeout)
        spec = episode_spec(econfig, self.agent_root, timeout, log_dir, box)
        logger.info(
            "Starting %s episode: instance_id=%s, config=%s",
            kwargs["agent_type"],
            instance_id,
            kwargs["agent_config"],
        )
        outcome = await run_episode(
            spec,
            data,
            kwargs=kwargs,
            secrets={"override_api_key": api_key},
            secret_env=episode_secret_env(econfig),
        )
        self._log_outcome(instance_id, outcome)
        return self._reward(instance_id, outcome, econfig.get("on_crash", "zero"), spec.timeout)

    def _log_outcome(self, instance_id: str, outcome: EpisodeOutcome) -> None:
        # One structured line per episode, for grepping a night's run.
        record = {
            "instance_id": instance_id,
            "status": outcome.status,
            "reward": outcome.reward,
            "duration_s": round(outcome.duration_s, 3),
            "exit": outcome.exit_description,
            "killed": outcome.killed,
            "cleanup": outcome.cleanup,
            "containment": outcome.containment,
            "log": str(outcome.log_path) if outcome.log_path else None,
        }
        logger.info("episode %s", json.dumps(record))
        reason = outcome.preload_refused
        if reason is not None and reason not in self._preload_refused:
            self._preload_refused.add(reason)
            fix = remedy(reason)
            logger.warning(
                "econfig.preload gave no template (%s): episodes start fresh.%s",
                reason,
                f" {fix[0].upper()}{fix[1:]}" if fix else "",
            )

    def _reward(
        self, instance_id: str, outcome: EpisodeOutcome, on_crash: str, timeout: float
    ) -> dict[str, float] | float:
        if outcome.status == "ok":
            assert outcome.reward is not None
            logger.info(
                "Finished episode: instance_id=%s, reward=%s, elapsed=%.1fs",
                instance_id,
                outcome.reward,
                outcome.duration_s,
            )
            return outcome.reward if isinstance(outcome.reward, dict) else float(outcome.reward)
        if outcome.status == "timeout":
            logger.error(
                "TIMEOUT: Instance %s exceeded %ss (elapsed: %.1fs). Discarding trajectory.",
                instance_id,
                timeout,
                outcome.duration_s,
            )
        elif outcome.status == "agent_error" or (
            outcome.status == "crashed" and on_crash == "zero"
        ):
            error = outcome.error
            logger.error(
                "[%s] Episode error: %s: %s\n%s",
                instance_id,
                error.type if error else outcome.status,
                error.message if error else outcome.exit_description,
                error.traceback if error else "",
            )
            return 0.0
        outcome.raise_for_status()
        raise AssertionError("unreachable: raise_for_status returned for a failed outcome")
