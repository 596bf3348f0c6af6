"""The one exception tree of isolate.

::

    IsolateError
    ├── ArgumentError (also ValueError)     bad arguments to run_episode
    └── EpisodeError                        an outcome turned into an exception
        ├── AgentError                      status "agent_error"
        ├── EpisodeCrashed                  status "crashed"
        ├── EpisodeTimeout (also TimeoutError)  status "timeout"
        ├── ProtocolError                   status "protocol_error"
        └── SetupError                      status "setup_error"

Inside the launcher, a set-up step that fails raises :class:`SetupProblem`; ``run_episode``
catches it once and returns the ``setup_error`` outcome, so it never reaches the caller.

``run_episode`` itself returns an :class:`EpisodeOutcome` for everything that happens to an
episode; these are raised by ``EpisodeOutcome.raise_for_status()`` and by the AReaL workflow.
Invalid specs raise pydantic's ``ValidationError`` (a ``ValueError``) at construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .outcome import EpisodeOutcome


class IsolateError(Exception):
    """Base class of every error isolate raises."""


class ArgumentError(IsolateError, ValueError):
    """An argument of ``run_episode`` is invalid (for example a key in both kwargs and secrets)."""


class EpisodeError(IsolateError):
    """An episode ended without a reward; ``outcome`` holds everything known about it."""

    def __init__(self, outcome: EpisodeOutcome) -> None:
        super().__init__(outcome.summary())
        self.outcome = outcome


class AgentError(EpisodeError):
    """The entrypoint raised; the child's traceback is in ``outcome.error``."""


class EpisodeCrashed(EpisodeError):
    """The episode's process died without a result (signal, ``os._exit``, OOM)."""


class EpisodeTimeout(EpisodeError, TimeoutError):
    """The deadline passed and the episode's process tree was killed."""


class ProtocolError(EpisodeError):
    """The child sent no valid result frame, a malformed one, or spoke another protocol version."""


class SetupError(EpisodeError):
    """The episode could not start: interpreter, agent root or entrypoint missing."""


class SetupProblem(IsolateError):
    """Internal: a set-up step cannot be done here (a limit, a layer, a sandbox, the fd budget,
    a cgroup); the message says why, and becomes the outcome's ``error.message``."""
