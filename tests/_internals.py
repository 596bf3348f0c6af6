"""The few internals of isolate the tests need, in one place. Each is a probe of what this
machine provides or a view of state no public API shows; a test that does only what a user can
do imports ``isolate`` instead. A refactor of the internals changes this file, not the tests."""

from __future__ import annotations

from isolate._core import containment as _containment
from isolate._core import templates as _templates
from isolate._core.containment import probes as _probes
from isolate._core.containment import sandbox as _sandbox

# Why a containment cannot run on this machine, or None: a test skips with the reason.
containment_problem = _containment.problem
# The layers a combination stands for on this machine (``auto`` resolved): what a test expects.
layers = _containment.layers
# What the Landlock probe found here (whether another process's environ stays readable).
landlock = _containment.landlock
# This kernel's Landlock ABI (0 without Landlock): a test skips what the kernel cannot enforce.
landlock_abi = _sandbox.landlock_abi
# The capabilities the shim keeps for a root agent, compared with the kernel's own names.
KEPT_CAPABILITIES = _containment.KEPT_CAPABILITIES
# The machine's mounts as the probes read them: the cgroup mounts a test takes away.
mounts = _probes._mounts
# The templates of this process: their pids are not the agent's, and their count is checked.
started_templates = _templates.started_templates
