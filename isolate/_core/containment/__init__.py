"""Containment layers and resource limits, on the parent side.

Layers combine (``cgroup+pidns``); ``auto`` takes the first combination of :data:`AUTO` this
machine provides, probed once per process:

``cgroup``
    One cgroup v2 leaf per episode, under ``<own cgroup>/isolate/<pid>.<start>/``. The shim
    joins it before it creates any process; teardown writes ``cgroup.kill`` and waits for
    ``populated 0``. Memory and process limits use the v2 ``memory``/``pids`` controllers where
    they are enabled for our subtree; on a hybrid host (v2 without them, v1 hierarchies
    mounted) the v1 ``memory``/``pids`` hierarchies get a leaf of their own.
``pidns``
    The shim's supervisor is PID 1 of a new PID namespace (in a new user namespace when the
    parent lacks CAP_SYS_ADMIN), with a /proc of its own: the agent sees and can signal only
    its own episode, and when the supervisor dies the kernel kills every process in it.
``landlock``
    The worker enters a Landlock domain (ABI 6+) scoped for signals and abstract unix
    sockets: nothing the agent runs can signal, ptrace or read the memory of a process
    outside its episode. The wall where namespaces are not permitted.
``session`` (no layer)
    Own session, subreaper shim, parent-side sweep (see ``_tree``); under every combination.

All functions here block: call them through ``anyio.to_thread.run_sync``.
"""

from agent_shim.shim_wire import LAYERS

from .leaves import Leaves, cgroups, clean_stale
from .limits import REPORT_ROOM, LimitPlan, layer_problem, plan_limits, problem, resolve, size
from .probes import (
    AUTO,
    COMBINATIONS,
    KEPT_CAPABILITIES,
    Cgroups,
    LandlockProbe,
    landlock,
    layers,
    move_waits_for_rcu,
    needs_userns,
    own_limit_cgroups,
    pidns_problem,
    seccomp_available,
)

__all__ = [
    "AUTO",
    "COMBINATIONS",
    "KEPT_CAPABILITIES",
    "LAYERS",
    "REPORT_ROOM",
    "Cgroups",
    "LandlockProbe",
    "Leaves",
    "LimitPlan",
    "cgroups",
    "clean_stale",
    "landlock",
    "layer_problem",
    "layers",
    "move_waits_for_rcu",
    "needs_userns",
    "own_limit_cgroups",
    "pidns_problem",
    "plan_limits",
    "problem",
    "resolve",
    "seccomp_available",
    "size",
]
