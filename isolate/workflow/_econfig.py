"""AReaL's ``econfig`` as the workflow and the command line read it: one model, checked once."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from .._core.model.config import is_env_name
from .._core.network.allowlist import parse_rules
from .._core.templates import MAX_PARKED

#: The econfig keys that name the agent root, first one set wins.
ROOT_KEYS = ("agent_root", "aweagent_root", "swe_agent_root")
#: Upstream's newer econfig keys, forwarded as ``override_<key>`` when present (and only then:
#: an older AReaL-SWEAgent does not accept them).
UPSTREAM_OVERRIDES = (
    "harness_timeout",
    "eval_timeout",
    "session_idle_timeout",
    "session_poll_interval",
    "terminal_exit_grace",
    "opencode_config",
    "max_tokens",
    "max_completion_tokens",
)


def plain(value: Any) -> Any:
    """A config value as plain JSON containers (AReaL's econfig may hold OmegaConf ones)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [plain(v) for v in value]
    return value


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


def _names(value: Any, key: str, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"econfig.{key} must be a list of {what}, got {value!r}")
    return tuple(value)


class EConfig(BaseModel):
    """The keys of ``econfig`` that isolate reads; AReaL's others are kept, unread.

    The keys that become :class:`~isolate.EpisodeSpec` fields (``kill_grace``, ``env``,
    ``containment``, ``limits``, ...) are the spec's to check, with its messages; this model
    checks the rest, each with a message that names its key.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    agent_root: Path | None = None
    """The agent's checkout: the first of ``agent_root``, ``aweagent_root``, ``swe_agent_root``."""
    agent_type: str = "swe"
    """Stripped and lower-cased; blank is a ValueError when an episode's kwargs are built."""
    agent_config: str | None = None
    llm_model: str | None = None
    opencode_provider: str | None = None
    codex_provider: str | None = None
    sandbox_backend: str | None = None
    """Upstream's ``aenv`` or ``e2b``, lower-cased; forwarded only when set."""
    python: str | None = None
    timeout: float | None = None
    """Seconds per episode; overrides the workflow's argument."""
    kill_grace: Any = 5.0
    cancel_grace: Any = 30.0
    exit_grace: Any = 10.0
    env: Any = None
    inherit_env: tuple[str, ...] | None = None
    containment: Any = "auto"
    limits: Any = None
    preload: bool | tuple[str, ...] = False
    park: int = 0
    """Forks of the template kept parked ahead of demand (``isolate.park``); needs ``preload``."""
    secret_env: tuple[str, ...] = ()
    """Names of this process's variables handed to the agent by ``run_episode(secret_env=)``."""
    sandbox: Any = None
    """True, or a dict of :class:`~isolate.Sandbox`'s fields (Sandbox checks them)."""
    sandbox_network: str | tuple[str, ...] | None = None
    on_crash: Literal["zero", "raise"] = "zero"

    @classmethod
    def of(cls, econfig: Mapping[str, Any] | EConfig) -> EConfig:
        """The model of ``econfig``; a ValueError that names each bad key."""
        if isinstance(econfig, EConfig):
            return econfig
        try:
            return cls.model_validate(dict(econfig))
        except ValidationError as exc:
            raise ValueError("; ".join(_said(e) for e in exc.errors())) from None

    def get(self, key: str, default: Any = None) -> Any:
        """A key as econfig gave it (unread keys included), else ``default``."""
        extra = self.model_extra or {}
        if key in self.model_fields_set or key in extra:
            return getattr(self, key, extra.get(key))
        return default

    @model_validator(mode="before")
    @classmethod
    def _root(cls, data: Any) -> Any:
        if isinstance(data, dict):
            first = next((data[k] for k in ROOT_KEYS if data.get(k)), None)
            data = {k: v for k, v in data.items() if k not in ROOT_KEYS}
            if first is not None:
                data["agent_root"] = first
        return data

    @field_validator("agent_root")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser().absolute()

    @field_validator(
        "agent_config", "llm_model", "opencode_provider", "codex_provider", "python", mode="before"
    )
    @classmethod
    def _text(cls, value: Any) -> str | None:
        return str(value) if value else None  # unset, empty or None: the next source counts

    @field_validator("agent_type", mode="before")
    @classmethod
    def _agent_type(cls, value: Any) -> str:
        # Blank stays blank: a record's own econfig may still set it; episode_kwargs checks.
        return str(value or "swe").strip().lower()

    @field_validator("sandbox_backend", mode="before")
    @classmethod
    def _backend(cls, value: Any) -> str | None:
        backend = None if value is None else str(value).strip().lower()
        if backend not in (None, "aenv", "e2b"):
            raise ValueError(f"econfig.sandbox_backend must be 'aenv' or 'e2b', got {value!r}")
        return backend

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, value: Any) -> float | None:
        if value is None:
            return None
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"econfig.timeout must be a number of seconds, got {value!r}"
            ) from None

    @field_validator("inherit_env", mode="before")
    @classmethod
    def _inherit_env(cls, value: Any) -> tuple[str, ...] | None:
        return _names(value, "inherit_env", "names")

    @field_validator("preload", mode="before")
    @classmethod
    def _preload(cls, value: Any) -> bool | tuple[str, ...]:
        value = plain(value)
        if isinstance(value, list | tuple):
            return tuple(value)
        if not isinstance(value, bool):
            raise ValueError(
                f"econfig.preload must be a bool or a list of module names, got {value!r}"
            )
        return value

    @field_validator("park", mode="before")
    @classmethod
    def _park(cls, value: Any) -> int:
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PARKED:
            raise ValueError(f"econfig.park must be an int from 0 to {MAX_PARKED}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _park_needs_preload(self) -> EConfig:
        if self.park and not self.preload:
            raise ValueError("econfig.park needs econfig.preload: without it no template is forked")
        return self

    @field_validator("secret_env", mode="before")
    @classmethod
    def _secret_env(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            kind = type(value).__name__
            raise ValueError(f"econfig.secret_env must be a list of variable names, got {kind}")
        for name in value:
            if not isinstance(name, str) or not is_env_name(name):
                raise ValueError(f"econfig.secret_env: invalid variable name {name!r}")
        return tuple(value)

    @field_validator("sandbox_network", mode="before")
    @classmethod
    def _network(cls, value: Any) -> str | tuple[str, ...] | None:
        value = plain(value)
        return None if value is None else network_of(value, "econfig.sandbox_network")

    @field_validator("on_crash", mode="before")
    @classmethod
    def _on_crash(cls, value: Any) -> Any:
        if value not in ("zero", "raise"):
            raise ValueError(f"econfig.on_crash must be 'zero' or 'raise', got {value!r}")
        return value

    @model_validator(mode="after")
    def _secret_env_alone(self) -> EConfig:
        both = sorted(set(self.secret_env) & set(self.env or {}))
        if both:
            raise ValueError(f"econfig.secret_env and econfig.env both set {', '.join(both)}")
        return self

    def secret_env_values(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """``secret_env``'s names with their values from ``environ`` (default: this process's
        environment); a ValueError naming those not set."""
        environ = os.environ if environ is None else environ
        missing = [name for name in self.secret_env if name not in environ]
        if missing:
            raise ValueError(
                f"econfig.secret_env: not set in the environment: {', '.join(missing)}"
            )
        return {name: environ[name] for name in self.secret_env}


def _said(error: Any) -> str:
    """One problem of a ValidationError: a validator's own message names its key already."""
    if error["type"] == "value_error":
        return str(error["msg"]).removeprefix("Value error, ")
    where = ".".join(map(str, error["loc"]))
    return f"econfig.{where}: {error['msg']}"
