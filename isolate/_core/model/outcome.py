"""What happened to an episode: :class:`EpisodeOutcome`."""

from __future__ import annotations

import signal as _signal
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from . import errors as _errors
from .sandbox_config import SandboxReport

Cleanup = Literal["finished", "cut short"]

Status = Literal["ok", "agent_error", "crashed", "timeout", "protocol_error", "setup_error"]

STATUSES: tuple[Status, ...] = (
    "ok",
    "agent_error",
    "crashed",
    "timeout",
    "protocol_error",
    "setup_error",
)


def signal_name(number: int) -> str:
    """``9`` -> ``"SIGKILL"``; unknown numbers read ``"signal 77"``."""
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(exit_code: int | None, signal: str | None) -> str:
    """Read an exit like a word: ``killed by SIGKILL``, ``exited with 3``."""
    if signal is not None:
        return f"killed by {signal}"
    if exit_code is not None:
        return f"exited with {exit_code}"
    return "exit unknown"


class ErrorInfo(BaseModel):
    """An error reported by the child or found by the parent."""

    model_config = ConfigDict(frozen=True)

    type: str
    """Exception type name, e.g. ``ValueError``, or a short label for parent-side errors."""
    message: str
    """One-line description; never contains a secret."""
    traceback: str = Field(default="", repr=False)
    """The child's formatted traceback, when there is one."""


class Timings(BaseModel):
    """Where an episode's time went before its agent ran (seconds). All of it is part of
    ``duration_s``: queueing tells itself apart from a slow start."""

    model_config = ConfigDict(frozen=True)

    admission_s: float = 0.0
    """Waiting for file descriptors: the fd budget, and retries after ``EMFILE``/``ENFILE``."""
    start_wait_s: float = 0.0
    """Waiting for a start slot: at most max(4, 2 × CPUs) interpreters start at once (a
    template's fork starts none, and waits for no slot)."""
    start_s: float | None = None
    """From spawn to the shim's ``hello`` (the interpreter's start-up); None without one."""


class EpisodeOutcome(BaseModel):
    """Everything known about one finished episode. Contains no secret."""

    model_config = ConfigDict(frozen=True)

    status: Status
    """``ok``, ``agent_error``, ``crashed``, ``timeout``, ``protocol_error`` or ``setup_error``."""
    reward: float | dict[str, float] | None = None
    """The reward (``ok`` only): a float, or a mapping of completion id to reward."""
    info: Any = None
    """The entrypoint's extra value (JSON; non-JSON values as ``repr``; size-capped)."""
    exit_code: int | None = None
    """Exit code of the agent's process, when it exited normally."""
    signal: str | None = None
    """Name of the signal that ended the agent's process, e.g. ``"SIGSEGV"``."""
    pid: int | None = None
    """Pid of the episode's top process (the shim supervisor)."""
    duration_s: float = 0.0
    """Wall-clock seconds from the start of ``run_episode`` to the end of teardown."""
    stderr_tail: str = Field(default="", repr=False)
    """The last bytes of the episode's stderr (and stdout), decoded as UTF-8."""
    log_path: Path | None = None
    """The per-episode log file, when ``spec.log_dir`` is set."""
    error: ErrorInfo | None = None
    """What went wrong, for every status but ``ok``."""
    killed: int = 0
    """How many processes of the episode teardown had to signal (leftovers included)."""
    episode_id: str = ""
    """Identifier of this episode: log file name stem and the child's ISOLATE_EPISODE_ID."""
    containment: str = "session"
    """Containment actually used: its layers joined by ``+`` (``cgroup+pidns``), or
    ``session``."""
    reason: str | None = None
    """The resource limit the episode hit, e.g. ``memory limit 512 MiB`` (status crashed)."""
    oom_kills: int | None = None
    """Processes of the episode the kernel OOM-killed; None where no cgroup counts them."""
    timings: Timings = Timings()
    """Waits and start-up inside ``duration_s``: fd admission, start slot, interpreter start."""
    cleanup: Cleanup | None = None
    """After the agent was cancelled (see ``EpisodeSpec.cancel_grace``): ``"finished"`` if it
    exited within the grace, ``"cut short"`` if it had to be terminated; None: not cancelled."""
    sandbox: SandboxReport | None = None
    """What the episode's sandbox enforced (and what it could not); None without one."""
    start: Literal["fresh", "template"] = "fresh"
    """How the episode's process began: a new interpreter, or a fork of a preloaded template."""
    infra: str | None = None
    """For an ``agent_error`` that is not the agent's: the infrastructure that failed it,
    ``"endpoint unreachable"`` (refused, reset, DNS), ``"endpoint error"`` (a 5xx from the
    endpoint or a proxy) or ``"entrypoint signature"`` (the entrypoint could not be called with
    the arguments given); None otherwise. ``status`` stays ``agent_error``."""
    preload_refused: str | None = None
    """Why this episode started fresh although ``spec.preload`` asked for a template (refused
    at import, say ``thread 'x' running after import``, or gone); None otherwise."""

    @property
    def exit_description(self) -> str:
        """The process exit in words: ``killed by SIGSEGV``, ``exited with 3``."""
        return describe_exit(self.exit_code, self.signal)

    def summary(self) -> str:
        """One line for logs and exception messages, e.g. ``episode x.3f2a: ok, reward 1.0
        (exited with 0, 0.05 s, 0 killed, containment cgroup+pidns)``."""
        text = f"episode {self.episode_id}: {self.status}"
        if self.status == "ok":
            text += f", reward {self.reward}"
        elif self.error is not None:
            text += f": {self.error.type}: {self.error.message}"
        if self.infra is not None:
            text += f" [infra: {self.infra}]"
        text += f" ({self.exit_description}, {self.duration_s:.2f} s, {self.killed} killed"
        if self.pid is not None:  # before any process there is no containment to speak of
            text += f", containment {self.containment}"
        return text + (f", clean-up {self.cleanup})" if self.cleanup is not None else ")")

    def raise_for_status(self) -> EpisodeOutcome:
        """Return self if ``ok``, else raise the matching :class:`EpisodeError`."""
        if self.status == "ok":
            return self
        raise _ERRORS[self.status](self)


_ERRORS: dict[str, type[_errors.EpisodeError]] = {
    "agent_error": _errors.AgentError,
    "crashed": _errors.EpisodeCrashed,
    "timeout": _errors.EpisodeTimeout,
    "protocol_error": _errors.ProtocolError,
    "setup_error": _errors.SetupError,
}
