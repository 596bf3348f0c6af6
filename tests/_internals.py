"""The few internals of isolate the tests need, in one place. Each is a probe of what this
machine provides, a view of state no public API shows, or a hook a test sets; a test that does
only what a user can do imports ``isolate`` instead. A refactor of the internals changes this
file, not the tests.

The one other way a test reaches an internal module is as the unit it tests: such files are
listed, each with its module, in ``tests/test_architecture.py`` (``UNIT_UNDER_TEST``)."""

from __future__ import annotations

import os as _os
import stat as _stat

from isolate._core import containment as _containment
from isolate._core import templates as _templates
from isolate._core.containment import leaves as _leaves
from isolate._core.containment import limits as _limits
from isolate._core.containment import probes as _probes
from isolate._core.containment import sandbox as _sandbox
from isolate._core.episode import child as _child
from isolate._core.episode import frames as _frames
from isolate._core.episode import launcher as _launcher
from isolate._core.episode import prepare as _prepare
from isolate._core.episode import protocol as _protocol
from isolate._core.episode import redact as _redact
from isolate._core.episode import tail as _tail
from isolate._core.episode import watch as _watch
from isolate._core.model import errors as _errors
from isolate._core.system import admission as _admission
from isolate._core.system import env as _env
from isolate._core.system import procfs as _procfs
from isolate._core.system import tree as _tree
from isolate._core.templates import pool as _template_pool
from isolate._core.templates import process as _template_process
from isolate._core.templates import registry as _template_registry
from isolate._core.templates import sizing as _template_sizing

# -- Containment: what this machine provides.
# Why a containment cannot run on this machine, or None: a test skips with the reason.
containment_problem = _containment.problem
# Why one layer cannot run here, or None: a test of that layer skips with the reason.
layer_problem = _containment.layer_problem
# The layers a combination stands for on this machine (``auto`` resolved): what a test expects.
layers = _containment.layers
# The layers and their combinations, and the order ``auto`` tries them: what a test runs over.
LAYERS = _containment.LAYERS
COMBINATIONS = _containment.COMBINATIONS
AUTO = _containment.AUTO
# What a containment level resolves to here, with its limit plan: the combination a test expects.
resolve = _containment.resolve
# What a set-up step raises when it cannot be done here (a limit, a layer): a test expects it.
SetupProblem = _errors.SetupProblem
# Whether a PID namespace here needs a user namespace (the parent lacks CAP_SYS_ADMIN).
needs_userns = _containment.needs_userns
# The modules that ask ``needs_userns`` (the launcher's name, the limit plan's): a test replaces it.
needs_userns_askers = (_containment, _limits)
# What each probe found, by name: a test puts a machine without cgroup controllers in it.
probed = _probes._probed
# What the Landlock probe found here (whether another process's environ stays readable).
landlock = _containment.landlock
# This kernel's Landlock ABI (0 without Landlock): a test skips what the kernel cannot enforce.
landlock_abi = _sandbox.landlock_abi
# Why a user namespace cannot be made here, or None: the sandbox's network tests need one.
userns_problem = _sandbox.userns_problem
# The capabilities the shim keeps for a root agent, compared with the kernel's own names.
KEPT_CAPABILITIES = _containment.KEPT_CAPABILITIES
# The machine's mounts as the probes read them: the cgroup mounts a test takes away.
mounts = _probes._mounts
# Whether the cgroup v2 mount lacks ``favordynmods``, and whether moving into a leaf waits for
# RCU on it: what the command line's start-up time depends on here.
lacks_favordynmods = _probes.lacks_favordynmods
move_waits_for_rcu = _containment.move_waits_for_rcu

# -- Cgroup leaves: the state teardown leaves on disk.
# The machine's cgroup hierarchies (the v2 root, the v1 ones), and their type.
cgroups = _containment.cgroups
Cgroups = _containment.Cgroups
# One episode's leaves: a test makes its own to put processes in.
Leaves = _containment.Leaves
# Removes the leaves of dead owners under the roots, as each start of isolate does.
clean_stale = _containment.clean_stale
# The directory name of this process's leaves (``<pid>.<start time>``) under a root.
owner_name = _leaves._owner_name
# A leaf's processes, whether it is populated, its kill, its removal: the check that a test
# left no leaf, and its clean-up.
leaf_procs = _leaves._procs
leaf_populated = _leaves._populated
kill_leaf = _leaves._kill_leaf
remove_leaf = _leaves._rmdir_tree
# Removes a sandbox's private temporary directory: a test takes one away under a template.
remove_tmpdir = _sandbox.remove_tmpdir
# What a sandbox would be made of for a spec: a test compares the network plan it names.
plan_sandbox = _sandbox.plan_sandbox

# -- Processes, as /proc shows them.
# A process's start time (with its pid, the name of its leaves and of its sandbox directory).
start_time = _procfs.start_time
# Whether any thread of a process still runs: a zombie leader with live threads is not a zombie.
has_live_thread = _procfs.has_live_thread
# The pids whose environment carries a tag: the processes a test started, wherever they went.
pids_with_env = _tree.pids_with_env

# -- Templates of this process.
# The templates of this process: their pids are not the agent's, and their count is checked.
started_templates = _templates.started_templates
# A template's parked fork handed an episode in the event loop, or None when the pool has none
# (then the episode asks the template, in a thread): a test calls it on an empty pool.
start_parked = _child.start_parked


def templates_logs() -> tuple[set[int], set[tuple[int, int]]]:
    """The pids of the running templates' own processes, and (st_dev, st_ino) of each one's
    log file where it has one: the stderr of its processes, and of every fork of it (and the
    worker a parked fork forked ahead) from its birth until it is handed an episode."""
    own: set[int] = set()
    logs: set[tuple[int, int]] = set()
    for template in started_templates():
        own |= template.own_pids()
        if template.importer is None:
            continue
        try:
            found = _os.stat(f"/proc/{template.importer}/fd/2")
        except OSError:
            continue
        if _stat.S_ISREG(found.st_mode):
            logs.add((found.st_dev, found.st_ino))
    return own, logs


def writes_to(pid: int, logs: set[tuple[int, int]]) -> bool:
    """Whether the stderr of process ``pid`` is one of ``logs``."""
    try:
        found = _os.stat(f"/proc/{pid}/fd/2")
    except OSError:
        return False
    return (found.st_dev, found.st_ino) in logs


# Closes every template, from outside an event loop: the session's end.
close_all = _templates.close_all
# A template's pool of parked forks and a fork: what a test counts and inspects.
Pool = _templates.Pool
# How many episodes of a template run at once: the size of a pool no caller sized.
Burst = _templates.Burst
Forked = _templates.Forked
# How long a pool waits, quiet, before it refills, and how many forks it parks at most.
QUIET_MS = _templates.QUIET_MS
MAX_PARKED = _templates.MAX_PARKED
# The module of one template and its forks: a test shortens its fork timeout.
template_process = _template_process
# A pool sized from bursts: the share of the fd budget it may hold.
template_sizing = _template_sizing
# The pool's module: its memory floor (``MIN_AVAILABLE``) and ``memory_problem``.
template_pool = _template_pool
# What the template code takes from the shim's wire to read a message: the wire's own function.
template_receivers = (_template_process.receive_message, _template_registry.receive_message)

# -- The launcher's hooks.
# Runs an episode with a shim of the test's (a fake that breaks the protocol, say).
run_with_shim = _launcher._run_with_shim
# The shim run_episode starts: run_with_shim with it and ``pid1=False`` starts it with its relay.
shim_boot = _launcher.boot_path
# The gate that bounds how many episodes start at once: a test fills it.
starting_gate = _launcher._starting_gate
# The module of the shim's deadline margin: a test reads it, one lowers it.
prepare = _prepare

# -- The fd budget.
# How many episodes wait for fds, an episode's cost, the budget, a hold that takes fds, and the
# variable that turns off raising the open-file limit.
admission_waiting = _admission.waiting
episode_fds = _admission.episode_fds
fd_budget = _admission._budget
hold_fds = _admission.hold_fds
Hold = _admission.Hold
RAISE_ENV = _admission.RAISE_ENV

# -- The protocol and what the parent keeps of it.
# The frames, built by hand where a test hands the parent a frame of its own.
Frame = _protocol.Frame
Hello = _protocol.Hello
Result = _protocol.Result
Done = _protocol.Done
ErrorFrame = _protocol.ErrorFrame
# Reads one line into a frame or noise: a test checks what each frame keeps.
parse_line = _protocol.parse_line
# Cleans a frame's JSON values of secrets, keys included: the redactor's use of it.
clean_json = _protocol._clean_json
# The module of the two above: a test replaces the cleaning to see its net catch a leak.
protocol = _protocol
# The protocol module as the parent's frame reader calls it: a test records its ``parse_line``.
frames_protocol = _frames.proto
# The parent's reading of frames off the channel, and the most ignored lines it notes.
Frames = _frames.Frames
MAX_NOTED = _frames.MAX_NOTED
# The parent's redactor of secrets and its mask: what a test expects in their place.
Redactor = _redact.Redactor
MASK = _redact.MASK
# The kept tail of the agent's stderr.
Tail = _tail.Tail
# The word the watcher writes to cancel: the wire's own.
CANCEL = _watch.CANCEL
# The environment filter: what reaches the agent of a parent's environment.
split_env = _env.split_env
