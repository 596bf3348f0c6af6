"""Preloaded templates (``EpisodeSpec.preload``): episodes forked from a shim that imported the
agent once.

A template is a shim process under the agent's interpreter that imported the entrypoint's
module (and ``spec.preload``) and never runs an episode; the child side, and the messages, are
in ``agent_shim/shim_template.py``. For each episode the parent hands the template the child's
end of the episode's channel socket, a stderr pipe and a reply socket (SCM_RIGHTS); the
template forks, and the fork runs the shim exactly as a fresh start does. So the handshake, the
protocol and the EOF watch stay as they are; only the exit status comes another way: from the
template, the fork's parent, on the reply socket.

One template per key: everything a fork inherits (interpreter, agent root, entrypoint,
environment, working directory, containment, preload list). Episodes that need a template while
it starts wait for it. A template that cannot be used (not importable, a thread running after
import, a socket open) is refused for its key until :func:`close_templates`: its episodes start
fresh, with the reason in their logs. One that dies is replaced by the next episode.

A template keeps forks parked ahead of demand, each in a cgroup leaf of its own, waiting for its
hand-over (``pool``): as many as its episodes' last burst (``burst``), or as :func:`park` says.

The parts: ``process`` (one template and its forks), ``pool`` (its parked forks), ``burst``
(how many to park), ``sizing`` (the pool following them),
``namespaces`` (each fork's own user, IPC and UTS namespaces),
``registry`` (the templates of this process, by key).
"""

from .burst import Burst
from .forked import Forked, TemplateGone, pidfd_pid
from .namespaces import shared as shared_by_forks
from .pool import MAX_PARKED, QUIET_MS, Pool
from .process import Template
from .registry import (
    acquire,
    close_all,
    close_templates,
    park,
    preload_list,
    remedy,
    started_templates,
    try_start,
    unusable,
)
from .sizing import began, ended

__all__ = [
    "Burst",
    "Forked",
    "MAX_PARKED",
    "Pool",
    "QUIET_MS",
    "Template",
    "TemplateGone",
    "acquire",
    "began",
    "close_all",
    "close_templates",
    "ended",
    "park",
    "pidfd_pid",
    "preload_list",
    "try_start",
    "remedy",
    "shared_by_forks",
    "started_templates",
    "unusable",
]
