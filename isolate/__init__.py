"""isolate: run each agent episode in its own fresh Python process, get the whole tree back.

::

    spec = isolate.EpisodeSpec(agent_root="/path/to/agent", timeout=1800)
    outcome = await isolate.run_episode(spec, record, secrets={"override_api_key": key})

See docs/api.md for the failure taxonomy and docs/protocol.md for the wire protocol.
"""

from agent_shim.shim_wire import EPISODE_ENV, EPISODE_TAG_ENV, PROTOCOL_VERSION

from ._core.episode.launcher import run_episode
from ._core.model.config import DEFAULT_INHERIT_ENV, EpisodeSpec, Limits
from ._core.model.errors import (
    AgentError,
    ArgumentError,
    EpisodeCrashed,
    EpisodeError,
    EpisodeTimeout,
    IsolateError,
    ProtocolError,
    SetupError,
)
from ._core.model.outcome import STATUSES, EpisodeOutcome, ErrorInfo, Status, Timings
from ._core.model.sandbox_config import Sandbox, SandboxReport
from ._core.system.shim import shim_path
from ._core.templates import close_templates, park

__all__ = [
    "AgentError",
    "ArgumentError",
    "DEFAULT_INHERIT_ENV",
    "EPISODE_ENV",
    "EPISODE_TAG_ENV",
    "EpisodeCrashed",
    "EpisodeError",
    "EpisodeOutcome",
    "EpisodeSpec",
    "EpisodeTimeout",
    "ErrorInfo",
    "IsolateError",
    "Limits",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "STATUSES",
    "Sandbox",
    "SandboxReport",
    "SetupError",
    "Status",
    "Timings",
    "close_templates",
    "park",
    "run_episode",
    "shim_path",
]


def __getattr__(name: str) -> str:
    # Looked up on first use, not at import: reading the installed metadata costs a few ms.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("episode-isolate")
        except PackageNotFoundError:  # imported from a checkout that was never installed
            return "0+unknown"
    raise AttributeError(f"module 'isolate' has no attribute {name!r}")
