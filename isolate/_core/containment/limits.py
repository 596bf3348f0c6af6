"""Resource limits: how ``Limits`` become cgroup values and rlimits (a :class:`LimitPlan`), and
which containment a request resolves to. Blocking."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.config import Limits
from ..model.errors import SetupProblem
from .leaves import cgroups
from .probes import AUTO, Cgroups, landlock, layers, needs_userns, pidns_problem


def layer_problem(layer: str) -> str | None:
    """Why containment layer ``layer`` is not available here, or None (probed once)."""
    if layer == "cgroup":
        return cgroups().problem
    if layer == "pidns":
        return pidns_problem()
    if layer == "landlock":
        return landlock().problem
    return None


def problem(containment: str) -> str | None:
    """Why the combination ``containment`` is not available here, or None."""
    for layer in layers(containment):
        found = layer_problem(layer)
        if found is not None:
            return f"{layer}: {found}"
    return None


# --- limits -----------------------------------------------------------------------------------


def size(n: int) -> str:
    """``536870912`` -> ``"512 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


#: Bytes above ``memory_bytes`` of the hard ``RLIMIT_DATA``. After a MemoryError the worker
#: raises its soft limit to the hard one to format and send the report, which at the soft
#: limit could itself fail. An agent could take this room too: 16 MiB a process, at most.
REPORT_ROOM = 16 * 1024 * 1024


@dataclass
class LimitPlan:
    """How one episode's limits are enforced at one level."""

    writes: dict[str, dict[str, str]] = field(default_factory=dict)
    """Leaf (``v2``, ``pids``, ``memory``) -> file -> value."""
    rlimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    """``RLIMIT_*`` name -> (soft, hard), set in the worker before the agent is imported."""


def plan_limits(containment: str, limits: Limits | None, groups: Cgroups | None) -> LimitPlan:
    """The mechanisms for ``limits`` under ``containment``; SetupProblem when one limit cannot
    be enforced there. ``groups``: where leaves go, when the combination has the cgroup layer."""
    out = LimitPlan()
    if limits is None:
        return out
    on = layers(containment)
    if "cgroup" not in on:
        groups = None
    if limits.memory_bytes is not None:
        n = str(limits.memory_bytes)
        where = groups.controller("memory") if groups else None
        if where == "v2":
            out.writes["v2"] = {"memory.max": n, "memory.swap.max": "0", "memory.oom.group": "1"}
        elif where == "v1":
            out.writes["memory"] = {"memory.limit_in_bytes": n, "memory.memsw.limit_in_bytes": n}
        else:
            # Per process: a tree of N processes may use N times this. The hard limit leaves
            # the worker room to report its MemoryError (see REPORT_ROOM).
            out.rlimits["RLIMIT_DATA"] = (limits.memory_bytes, limits.memory_bytes + REPORT_ROOM)
    if limits.max_processes is not None:
        # The supervisor counts too, and with a PID namespace in a user namespace its outer
        # half (the relay; a privileged parent starts the supervisor in its namespace).
        n = str(limits.max_processes + 1 + ("pidns" in on and needs_userns()))
        where = groups.controller("pids") if groups else None
        if where is not None:
            out.writes.setdefault("v2" if where == "v2" else "pids", {})["pids.max"] = n
        elif "pidns" in on and needs_userns():
            # Counted per user namespace since Linux 5.14: it binds this episode only.
            count = limits.max_processes + 2
            out.rlimits["RLIMIT_NPROC"] = (count, count)
        elif "cgroup" in on:
            raise SetupProblem(
                "limits.max_processes needs a pids cgroup controller, and none is writable"
            )
        elif "pidns" in on:
            raise SetupProblem(
                f"limits.max_processes at containment {containment!r} needs a user namespace, "
                "which a privileged parent does not use (RLIMIT_NPROC does not bind it): add "
                "the 'cgroup' layer"
            )
        else:
            raise SetupProblem(
                "limits.max_processes needs the containment layer 'cgroup' or 'pidns'"
            )
    if limits.cpu_seconds is not None:
        # SIGXCPU at the limit, SIGKILL a second later if the agent ignores it.
        out.rlimits["RLIMIT_CPU"] = (limits.cpu_seconds, limits.cpu_seconds + 1)
    if limits.open_files is not None:
        out.rlimits["RLIMIT_NOFILE"] = (limits.open_files, limits.open_files)
    if not limits.core_dumps:
        out.rlimits["RLIMIT_CORE"] = (0, 0)
    return out


def resolve(requested: str, limits: Limits | None) -> tuple[str, LimitPlan]:
    """The combination to use and its limit plan; SetupProblem saying why the requested one
    cannot be had. Blocking (probes run on first use)."""
    candidates = AUTO if requested == "auto" else (requested,)
    first_problem = None
    for containment in candidates:
        missing = problem(containment)
        if missing is not None:
            missing = f"containment {containment!r} is not available: {missing}"
        else:
            groups = cgroups() if "cgroup" in layers(containment) else None
            try:
                return containment, plan_limits(containment, limits, groups)
            except SetupProblem as exc:
                missing = f"containment {containment!r} cannot enforce the limits: {exc}"
        first_problem = first_problem or missing
    assert first_problem is not None
    raise SetupProblem(first_problem)
