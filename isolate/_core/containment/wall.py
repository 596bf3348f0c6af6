"""An episode's wall, planned in one place for a fresh start, a template and a template's fork:
the containment layers, the cgroup leaves with the limits written into them, whether a PID
namespace needs a user namespace, and the sandbox with its private TMPDIR.

Blocking (probes run on first use, leaves and TMPDIRs are made): call it from a worker thread.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import containment as _containment
from ..model.config import EpisodeSpec
from . import sandbox as _sandbox

#: The variables that name the sandbox's TMPDIR, the only place the agent may write temporary
#: files. A template's fork sets its own (the handshake's ``temp_env``).
TEMP_ENV = ("TMPDIR", "TMP", "TEMP")


@dataclass(frozen=True)
class Wall:
    """What an episode, or a template walled in as its episodes are, enters; made by
    :meth:`Plan.make`. Its leaves and TMPDIR are the caller's to remove."""

    containment: str
    """The combination of layers, resolved (``cgroup+pidns``, ``session``)."""
    rlimits: dict[str, tuple[int, int]]
    """``RLIMIT_*`` name -> (soft, hard), set in the worker before the agent is imported."""
    userns: bool | None
    """With a PID namespace: whether it needs a user namespace; else None."""
    leaves: _containment.Leaves | None
    sandbox: _sandbox.PreparedSandbox | None
    in_template: bool = False
    """The sandbox is a template fork's, carved from the template's (its mounts are those)."""

    @property
    def layers(self) -> tuple[str, ...]:
        return _containment.layers(self.containment)

    def temp_env(self) -> dict[str, str]:
        """TMPDIR, TMP and TEMP naming the sandbox's TMPDIR; empty without a sandbox."""
        if self.sandbox is None:
            return {}
        return {name: self.sandbox.tmpdir for name in TEMP_ENV}

    def exec_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with :meth:`temp_env` over it: the sandbox's TMPDIR is the only place the
        process may write."""
        return {**env, **self.temp_env()}

    def template_message(self) -> dict[str, Any]:
        """What a template's importer enters before it imports."""
        wall: dict[str, Any] = {"containment": self.containment}
        if self.leaves is not None:
            wall["cgroups"] = self.leaves.join()
        if self.userns is not None:
            wall["userns"] = self.userns
        if self.sandbox is not None:
            wall["sandbox"] = self.sandbox.handshake
        return wall

    def for_fork(self, spec: EpisodeSpec, episode_id: str, under: Wall) -> Wall:
        """This wall with its sandbox made again under the template's (``under``), whose
        mounts are the fork's. Removes nothing; raises SetupProblem."""
        assert spec.sandbox is not None
        assert under.sandbox is not None
        sandbox = _make_sandbox(spec, episode_id, "", under=under.sandbox.tmpdir)
        return dataclasses.replace(self, sandbox=sandbox, in_template=True)


@dataclass(frozen=True)
class Plan:
    """The wall decided for a spec, before anything is made: made by :func:`plan`, the one
    place that resolves a spec's containment for a fresh start and a template alike."""

    containment: str
    """The combination of layers, resolved (``cgroup+pidns``, ``session``)."""
    limits: _containment.LimitPlan
    groups: _containment.Cgroups | None
    """Where its leaves go, with the cgroup layer; else None."""
    userns: bool | None
    """With a PID namespace: whether it needs a user namespace; else None."""

    @property
    def layers(self) -> tuple[str, ...]:
        return _containment.layers(self.containment)

    def make(self, spec: EpisodeSpec, name: str, leaves_later: bool = False) -> Wall:
        """The wall of ``name`` (an episode's id, or a template's name): its leaves made with
        the limits written, its sandbox's TMPDIR made. ``leaves_later``: the leaves named, not
        made (a template's episode may adopt a parked fork's instead:
        :meth:`~isolate._core.containment.Leaves.create` them if not). Raises SetupProblem,
        with what it made removed."""
        leaves = None
        if self.groups is not None:
            leaves = _containment.Leaves(self.groups, name, self.limits.writes)
        try:
            if leaves is not None and not leaves_later:
                leaves.create()
            sandbox = None
            if spec.sandbox is not None:
                sandbox = _make_sandbox(spec, name, self.containment)
        except BaseException:
            if leaves is not None:
                leaves.remove()
            raise
        return Wall(self.containment, dict(self.limits.rlimits), self.userns, leaves, sandbox)


def plan(spec: EpisodeSpec, containment: str | None = None) -> Plan:
    """The wall for ``spec``: its containment resolved from ``spec.containment`` (``auto``:
    the first combination this machine gives), or ``containment`` when it was resolved for
    this spec already (a template's, its episodes'); the limits planned for it. Makes nothing;
    raises SetupProblem."""
    how = None
    if containment is None:
        containment, how = _containment.resolve(spec.containment, spec.limits)
    on = _containment.layers(containment)
    groups = _containment.cgroups() if "cgroup" in on else None
    if how is None:
        how = _containment.plan_limits(containment, spec.limits, groups)
    userns = _containment.needs_userns() if "pidns" in on else None
    return Plan(containment, how, groups, userns)


def _make_sandbox(
    spec: EpisodeSpec, name: str, containment: str, under: str | None = None
) -> _sandbox.PreparedSandbox:
    """The private TMPDIR and the rules the worker enforces; raises SetupProblem. Under a
    template (``under``: its TMPDIR) the fork's mounts are the template's."""
    assert spec.sandbox is not None
    fork = under is not None
    return _sandbox.make_tmpdir_and_plan(
        spec.sandbox,
        episode_id=name,
        cwd=str(spec.cwd) if spec.cwd is not None else os.getcwd(),
        child_env=spec.env,  # its HOME, if it sets one; homes() adds ours
        mountns=fork or "pidns" in _containment.layers(containment),
        can_unshare=not fork and not _containment.needs_userns(),
        under=under,
    )
