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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
from pydantic import SecretStr

from .._core.containment.sandbox import ports_of_url
from .._core.episode.launcher import run_episode
from .._core.model.config import EpisodeSpec
from .._core.model.errors import IsolateError
from .._core.model.outcome import EpisodeOutcome
from .._core.model.sandbox_config import Sandbox
from .._core.network.allowlist import rule_for_url
from .._core.system.env import PASSTHROUGH_ENV
from .._core.templates import park, remedy
from ._econfig import UPSTREAM_OVERRIDES, EConfig, plain

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
_ROOT_ENV = ("AWEAGENT_ROOT", "SWE_AGENT_ROOT", "SWEAGENT_ROOT")

#: An econfig as a mapping (AReaL's dict, or OmegaConf's) or as its checked model.
Econfig = Mapping[str, Any] | EConfig


def default_log_dir() -> str:
    """Where episodes write their results and logs unless told: env ``LOG_DIR``, else
    ``./logs`` (AReaL's convention; the command line's bundles go there too)."""
    return os.environ.get("LOG_DIR", "./logs")


def default_agent_root() -> Path:
    """The sibling checkout: ``../AReaL-SWEAgent`` next to this project's root."""
    project_root = Path(__file__).resolve().parents[2]
    return project_root.parent / "AReaL-SWEAgent"


def resolve_agent_root(econfig: Econfig) -> Path:
    """econfig ``agent_root`` → ``aweagent_root`` → ``swe_agent_root``; else env
    ``AWEAGENT_ROOT`` → ``SWE_AGENT_ROOT`` → ``SWEAGENT_ROOT``; else the sibling checkout."""
    root = EConfig.of(econfig).agent_root
    if root is not None:
        return root
    for name in _ROOT_ENV:
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser().absolute()
    return default_agent_root()


def episode_kwargs(econfig: Econfig, base_url: str) -> dict[str, Any]:
    """The keyword arguments of ``run_agent_with_reward`` except the api key (a secret): the
    seed's, plus upstream's newer keys where econfig has them. ValueError for a blank
    ``agent_type``."""
    cfg = EConfig.of(econfig)
    agent_type = cfg.agent_type
    if not agent_type:
        raise ValueError("econfig.agent_type must not be empty")  # the seed's check, in run
    agent_config = (
        cfg.agent_config
        or cfg.get(f"{agent_type}_agent_config")
        or cfg.get("swe_agent_config")
        or _DEFAULT_AGENT_CONFIGS.get(agent_type)
        or agent_type
    )
    kwargs = {
        "agent_type": agent_type,
        "agent_config": str(agent_config),
        "result_dir": default_log_dir(),
        "override_base_url": base_url,
        "override_llm_model": cfg.llm_model or os.environ.get("LLM_MODEL") or None,
        "override_opencode_provider": (
            cfg.opencode_provider or os.environ.get("OPENCODE_PROVIDER") or None
        ),
        "override_codex_provider": cfg.codex_provider or os.environ.get("CODEX_PROVIDER") or None,
    }
    if "sandbox_backend" in cfg.model_fields_set:
        kwargs["sandbox_backend"] = cfg.sandbox_backend or "aenv"  # upstream's default
    extra = cfg.model_extra or {}
    for key in UPSTREAM_OVERRIDES:
        if key in extra:
            kwargs[f"override_{key}"] = plain(extra[key])
    return kwargs


def episode_secret_env(
    econfig: Econfig, environ: Mapping[str, str] | None = None
) -> dict[str, SecretStr]:
    """econfig ``secret_env``'s names with their values from ``environ`` (default: this
    process's environment)."""
    values = EConfig.of(econfig).secret_env_values(environ)
    return {name: SecretStr(value) for name, value in values.items()}


def timeout_of(econfig: Econfig, default: float) -> float:
    """econfig ``timeout`` (seconds), else ``default``."""
    timeout = EConfig.of(econfig).timeout
    return default if timeout is None else timeout


def sandbox_of(
    econfig: Econfig, result_dir: str | None = None, base_url: str | None = None
) -> Sandbox | None:
    """econfig ``sandbox`` (True, or a dict of Sandbox's fields) and ``sandbox_network``
    (Sandbox's ``network``; alone, it means a default sandbox with it), with the episode's
    ``result_dir`` writable and ``base_url`` reachable: its port added to ``connect`` when
    that is set, the endpoint to ``network`` when that is an allow-list."""
    cfg = EConfig.of(econfig)
    raw, network = cfg.sandbox, cfg.sandbox_network
    if (raw is None or raw is False) and network is None:
        return None
    box = Sandbox() if raw is True or raw is None or raw is False else Sandbox.model_validate(raw)
    update: dict[str, Any] = {}
    if network is not None:
        update["network"] = network
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


#: The largest part of an episode's timeout its teardown (``cancel_grace`` + ``kill_grace``)
#: may take; larger graces are scaled down to fit it.
TEARDOWN_SHARE = 0.5


def within_timeout(spec: EpisodeSpec) -> EpisodeSpec:
    """``spec`` with its teardown inside its ``timeout``: the agent is cancelled
    ``cancel_grace + kill_grace`` seconds before the end, both graces scaled down in proportion
    when together they exceed :data:`TEARDOWN_SHARE` of ``timeout``
    (docs/cancellation.md, "The deadline of an econfig episode")."""
    graces = spec.cancel_grace + spec.kill_grace
    scale = min(1.0, TEARDOWN_SHARE * spec.timeout / graces) if graces > 0 else 1.0
    cancel_grace, kill_grace = spec.cancel_grace * scale, spec.kill_grace * scale
    update = {
        "timeout": spec.timeout - cancel_grace - kill_grace,
        "cancel_grace": cancel_grace,
        "kill_grace": kill_grace,
    }
    return EpisodeSpec.model_validate({**spec.model_dump(), **update})


def episode_spec(
    econfig: Econfig,
    agent_root: Path,
    timeout: float,
    log_dir: Path | None,
    sandbox: Sandbox | None = None,
) -> EpisodeSpec:
    """The spec for one episode from the isolation keys of ``econfig``, its teardown inside
    ``timeout`` (seconds; see :func:`within_timeout`)."""
    cfg = EConfig.of(econfig)
    spec = EpisodeSpec(
        agent_root=agent_root,
        entrypoint=ENTRYPOINT,
        python=cfg.python or sys.executable,
        timeout=timeout,
        kill_grace=cfg.kill_grace,
        cancel_grace=cfg.cancel_grace,
        exit_grace=cfg.exit_grace,
        env=dict(cfg.env or {}),
        inherit_env=PASSTHROUGH_ENV if cfg.inherit_env is None else cfg.inherit_env,
        log_dir=log_dir,
        containment=cfg.containment,
        limits=cfg.limits,
        sandbox=sandbox if sandbox is not None else sandbox_of(cfg),
        preload=cfg.preload,
    )
    return within_timeout(spec)


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
            module names), ``park`` (forks of the template kept parked ahead of demand,
            asked for at its first episode; needs ``preload``), ``secret_env`` (names of
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
        # Fail fast on bad settings rather than on the first episode.
        cfg = EConfig.of(econfig)
        self.timeout = timeout_of(cfg, timeout)
        self.agent_root = resolve_agent_root(cfg)
        self._preload_refused: set[str] = set()  # each reason warned about once
        self._parked: set[str] = set()  # the specs whose template econfig.park asked a pool of
        episode_spec(cfg, self.agent_root, self.timeout, None)
        episode_secret_env(cfg)
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

        **Timeout:** returns or raises within the timeout (seconds, from this call) plus
        about 2 s, whatever ``cancel_grace`` is: the agent is cancelled early enough that its
        clean-up and the tree's teardown end by then (docs/cancellation.md).
        """
        called = anyio.current_time()
        base_url = extra_kwargs.get("base_url")
        if base_url is None:
            raise ValueError("base_url is required for SWEAgentWorkflow")
        api_key = extra_kwargs.get("api_key", os.getenv("OPENAI_API_KEY", "dummy"))

        econfig = self.econfig.copy()
        if "econfig" in data:
            econfig.update(data["econfig"])
        cfg = EConfig.of(econfig)
        kwargs = episode_kwargs(cfg, str(base_url))
        instance_id = str(data.get("instance_id", "unknown"))
        log_dir = Path(kwargs["result_dir"]) / "isolate"
        # A record's econfig timeout counts for that record, as its other keys do (AReaL's
        # in-process workflow ignores it; a per-record deadline that is silently dropped is
        # worse than one that applies).
        box = sandbox_of(cfg, kwargs["result_dir"], str(base_url))
        timeout = timeout_of(cfg, self.timeout)
        spec = episode_spec(cfg, self.agent_root, timeout, log_dir, box)
        logger.info(
            "Starting %s episode: instance_id=%s, config=%s",
            kwargs["agent_type"],
            instance_id,
            kwargs["agent_config"],
        )
        ended: list[EpisodeOutcome] = []
        # The agent's time counts from this call, as under the seed's wait_for: a wait for a
        # start slot or a template is part of it. Cancelled, the episode ends as at its own
        # deadline, its teardown inside the timeout (see within_timeout).
        if cfg.park:
            with anyio.CancelScope(deadline=called + spec.timeout):
                await self._park(spec, cfg, api_key)
        with anyio.CancelScope(deadline=called + spec.timeout):
            await run_episode(
                spec,
                data,
                kwargs=kwargs,
                secrets={"override_api_key": api_key},
                secret_env=episode_secret_env(cfg),
                on_end=ended.append,
            )
        outcome = ended[0]  # on_end runs however the episode ended
        self._log_outcome(instance_id, outcome)
        elapsed = anyio.current_time() - called
        return self._reward(instance_id, outcome, cfg.on_crash, timeout, elapsed)

    async def _park(self, spec: EpisodeSpec, cfg: EConfig, api_key: str) -> None:
        """econfig ``park``: at the first episode of a template, ask for its pool; that episode
        waits for the template's start (as it would anyway), not for the forks."""
        key = spec.model_dump_json(exclude={"timeout"})
        if key in self._parked:
            return
        self._parked.add(key)
        try:
            await park(
                spec,
                cfg.park,
                secrets={"override_api_key": api_key},
                secret_env=episode_secret_env(cfg),
                wait=False,
            )
        except IsolateError as exc:
            logger.warning("econfig.park: %s: episodes fork on demand or start fresh", exc)
        except anyio.get_cancelled_exc_class():
            self._parked.discard(key)  # the deadline came first: the next episode asks again
            raise

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
        self,
        instance_id: str,
        outcome: EpisodeOutcome,
        on_crash: str,
        timeout: float,
        elapsed: float,
    ) -> dict[str, float] | float:
        if outcome.status == "ok":
            assert outcome.reward is not None
            logger.info(
                "Finished episode: instance_id=%s, reward=%s, elapsed=%.1fs",
                instance_id,
                outcome.reward,
                elapsed,
            )
            return outcome.reward if isinstance(outcome.reward, dict) else float(outcome.reward)
        if outcome.status == "timeout":
            logger.error(
                "TIMEOUT: Instance %s exceeded %ss (elapsed: %.1fs). Discarding trajectory.",
                instance_id,
                timeout,
                elapsed,
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
