"""Configuration of an episode: :class:`EpisodeSpec`."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from agent_shim.shim_wire import EPISODE_VARS, LAYERS, canonical_containment

from .sandbox_config import Sandbox

#: Environment names a child inherits from the parent by default. Patterns use fnmatch syntax.
DEFAULT_INHERIT_ENV: tuple[str, ...] = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TMPDIR",
    "TERM",
)

_ENTRYPOINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_ENV_NAME = re.compile(r"^[^=\x00]+$")


def is_env_name(name: str) -> bool:
    """Can a process environment hold a variable of this name (no ``=``, no NUL, not empty)?"""
    return bool(_ENV_NAME.match(name))


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number of seconds")
    return value


Seconds = Annotated[float, AfterValidator(_finite)]


def check_containment(value: str) -> str:
    """``auto``, ``session``, or layers joined by ``+``; returned in the order of LAYERS."""
    if value == "auto":
        return value
    found = canonical_containment(value)
    if found is None:
        raise ValueError(
            f"containment must be 'auto', 'session', or layers joined by '+' "
            f"({', '.join(LAYERS)}), each once; got {value!r}"
        )
    return found


Containment = Annotated[str, AfterValidator(check_containment)]


class Limits(BaseModel):
    """Resource limits of one episode. None means no limit. Each is enforced by the strongest
    mechanism the episode's containment level offers (docs/containment.md, "Resource
    limits")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    memory_bytes: int | None = Field(default=None, ge=1024 * 1024)
    """Memory of the whole tree (cgroup), else of each process (``RLIMIT_DATA``), in bytes."""
    max_processes: int | None = Field(default=None, ge=1)
    """Processes and threads the agent may have at once (``pids.max``, or ``RLIMIT_NPROC``
    inside an unprivileged user namespace)."""
    cpu_seconds: int | None = Field(default=None, ge=1)
    """CPU seconds each process may use (``RLIMIT_CPU``: SIGXCPU, then SIGKILL 1 s later)."""
    open_files: int | None = Field(default=None, ge=8)
    """Open file descriptors per process (``RLIMIT_NOFILE``)."""
    core_dumps: bool = True
    """False sets ``RLIMIT_CORE`` to 0: a crashing agent leaves no core file."""
    log_bytes: int | None = Field(default=None, ge=0)
    """Bytes of the episode's log kept on disk; past it the log is cut (noted once) while the
    in-memory tail keeps updating."""


class EpisodeSpec(BaseModel):
    """How to run episodes of one agent. Immutable; share one spec across many episodes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_root: Path | None = None
    """Directory put first on the child's ``sys.path`` (the agent checkout)."""
    entrypoint: str = "aweagent.lifecycle:run_agent_with_reward"
    """``module:function`` called as ``fn(data, **kwargs, **secrets)``; sync or async."""
    python: str = Field(default_factory=lambda: sys.executable)
    """The child's interpreter (any Python >= 3.9); an agent virtualenv's ``bin/python``."""
    timeout: Seconds = Field(default=1800.0, gt=0)
    """Wall-clock seconds from spawn until the whole tree is killed and the status is timeout."""
    kill_grace: Seconds = Field(default=5.0, ge=0)
    """Seconds between SIGTERM and SIGKILL during teardown."""
    cancel_grace: Seconds = Field(default=30.0, ge=0)
    """Seconds the agent gets to clean up after it is cancelled inside its own process, at an
    early end (deadline, cancellation, parent's death), before SIGTERM; 0: no cancellation."""
    exit_grace: Seconds = Field(default=10.0, ge=0)
    """Seconds the agent's process gets to exit the normal way (atexit, flushes, finalizers,
    non-daemon threads) after its result; then it is killed and the result stands."""
    cwd: Path | None = None
    """Working directory of the child; default: the parent's."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables added to the child's environment (after ``inherit_env``)."""
    inherit_env: tuple[str, ...] = DEFAULT_INHERIT_ENV
    """Names (fnmatch patterns) copied from the parent's environment; ``!PATTERN`` excludes
    what a pattern would pass. Secret-looking names (``*_API_KEY``, ``*_TOKEN``, ``*SECRET*``,
    ``*PASSWORD*``) pass only when named exactly; an exact name beats every exclusion."""
    log_dir: Path | None = None
    """Directory for the per-episode stderr log file; None keeps only the in-memory tail."""
    stderr_tail_bytes: int = Field(default=64 * 1024, ge=0)
    """How many of the last stderr bytes the outcome keeps."""
    max_frame_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest protocol frame accepted from the child, in bytes; at most ``max_info_bytes``
    + 8 MiB is, whatever this says."""
    max_info_bytes: int = Field(default=1024 * 1024, ge=0)
    """Largest JSON ``info`` (the entrypoint's extra) kept, in bytes; larger is truncated."""
    containment: Containment = "auto"
    """Layers that combine, e.g. ``cgroup+pidns`` (of ``cgroup``, ``pidns``, ``landlock``), or
    ``session`` alone (docs/containment.md); ``auto`` picks the strongest combination this
    machine provides. A layer the machine cannot provide is a ``setup_error`` that says why."""
    limits: Limits | None = None
    """Resource limits; an episode that hits one ends ``crashed`` with a ``reason``."""
    sandbox: Sandbox | None = None
    """What the agent may read, write and connect to (see docs/sandbox.md); None: whatever
    its user may."""
    preload: bool | tuple[str, ...] = False
    """Fork episodes from a template that imported the entrypoint's module once (True), and
    these modules too (a tuple of names); False starts each episode fresh. See
    docs/templates.md."""

    @model_validator(mode="after")
    def _check_limits(self) -> EpisodeSpec:
        layers = self.containment.split("+")
        if (
            "cgroup" not in layers
            and "pidns" not in layers
            and self.containment != "auto"
            and self.limits is not None
            and self.limits.max_processes is not None
        ):
            # RLIMIT_NPROC counts every process of the user (and root ignores it): no
            # per-episode process limit exists without a pids cgroup or a user namespace.
            raise ValueError(
                "limits.max_processes needs containment 'cgroup' or 'pidns', "
                f"not containment={self.containment!r}"
            )
        return self

    @field_validator("preload")
    @classmethod
    def _check_preload(cls, value: bool | tuple[str, ...]) -> bool | tuple[str, ...]:
        if isinstance(value, tuple):
            for name in value:
                if not all(part.isidentifier() for part in name.split(".")):
                    raise ValueError(f"preload: {name!r} is not a module name")
            return value or False
        return value

    @field_validator("entrypoint")
    @classmethod
    def _check_entrypoint(cls, value: str) -> str:
        if not _ENTRYPOINT.match(value):
            raise ValueError(f"entrypoint must look like 'package.module:function', got {value!r}")
        return value

    @field_validator("python")
    @classmethod
    def _check_python(cls, value: str) -> str:
        if not value or "\x00" in value:
            raise ValueError("python must be a path to an interpreter")
        return value

    @field_validator("env")
    @classmethod
    def _check_env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, item in value.items():
            if not _ENV_NAME.match(name) or "\x00" in item:
                raise ValueError(f"env: invalid variable {name!r} (no '=' or NUL allowed)")
            if name in EPISODE_VARS:
                raise ValueError(f"env: {name} is set by isolate itself")
        return value

    @field_validator("inherit_env")
    @classmethod
    def _check_inherit(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not name.removeprefix("!") or "=" in name or "\x00" in name:
                raise ValueError(f"inherit_env: invalid name {name!r}")
        return value
