"""``isolate doctor``: check an agent checkout and interpreter without running an episode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio

from agent_shim.shim_wire import LAYERS, PROTOCOL_VERSION

from .._core import containment as _containment
from .._core import templates as _templates
from .._core.containment import sandbox as _sandbox
from .._core.episode.launcher import run_episode
from .._core.model.config import EpisodeSpec
from .._core.model.errors import SetupProblem
from .._core.system.env import PASSTHROUGH_ENV, split_env
from .._core.system.shim import shim_path
from ..workflow import ENTRYPOINT, default_agent_root, resolve_agent_root

#: The keyword arguments SWEAgentWorkflow passes; the entrypoint must accept them.
WORKFLOW_KWARGS = (
    "agent_type",
    "agent_config",
    "result_dir",
    "override_api_key",
    "override_base_url",
    "override_llm_model",
    "override_opencode_provider",
    "override_codex_provider",
)
PACKAGES = ("pydantic", "openai", "litellm")
IMPORT_TIMEOUT_S = 60.0
#: The oldest interpreter the shim supports.
OLDEST = (3, 9)
#: At most this many of the last lines of a failed inspection's stderr are shown.
STDERR_LINES = 60

# Runs under the agent's interpreter (stdlib only, 3.9+): imports the entrypoint without
# calling it, as an episode's shim would, and answers in one JSON line on a private copy of
# stdout.
_INSPECT = r"""
import importlib, importlib.metadata, importlib.util, inspect, json, os, sys
answer = os.dup(1)
os.dup2(2, 1)  # whatever the agent's modules print at import goes to stderr
root, entry, kwargs, packages, shim = sys.argv[1:6]
kwargs = kwargs.split(",")
report = {"version": list(sys.version_info[:3])}
# Where this interpreter looks for the shim's bytecode, and what it accepts there.
report["shim_pyc"] = [importlib.util.cache_from_source(shim), importlib.util.MAGIC_NUMBER.hex()]
# The shim's own loader, so that what imports here imports in an episode.
sys.path.insert(0, os.path.dirname(shim))
import shim as episode_shim
del sys.path[0], sys.modules["shim"]
try:
    target = episode_shim.load_part("worker").load_entrypoint(entry, root)
    report["import"] = None
    try:
        sig = inspect.signature(target)
        report["signature"] = str(sig)
        report["async"] = inspect.iscoroutinefunction(target)
        try:
            sig.bind({}, **{k: None for k in kwargs})
            report["binds"] = None
        except TypeError as exc:
            report["binds"] = str(exc)
    except (TypeError, ValueError) as exc:
        report["signature"] = None
        report["binds"] = "no signature: %s" % exc
except BaseException as exc:
    report["import"] = "%s: %s" % (type(exc).__name__, exc)
versions = {}
for name in packages.split(","):
    try:
        versions[name] = importlib.metadata.version(name)
    except Exception:
        versions[name] = None
report["packages"] = versions
os.write(answer, (json.dumps(report) + "\n").encode())
"""


#: What a root agent keeps, in words.
KEPT = ", ".join(_containment.KEPT_CAPABILITIES) + (
    " (NET_BIND_SERVICE only in a network namespace of its own: Sandbox(network=...))"
)
MOVE_HINT = (
    "cgroup: each fresh episode's move into its leaf waits for an RCU grace period (1-20 ms\n"
    "on a 2-core VM) unless another move came within one; it overlaps the interpreter's\n"
    "start-up, and shows where that start is faster (a plain venv). The\n"
    "cgroup2 mount option favordynmods (Linux 6.0+; as root, for the whole machine:\n"
    "mount -o remount,favordynmods <its mount>) takes it off, at some cost to every fork\n"
    "and exit. isolate leaves the option to the machine."
)


class _Report:
    def __init__(self) -> None:
        self.failed = False

    def line(self, verdict: str, text: str) -> None:
        """One verdict; the lines after the first of ``text`` are indented under it."""
        if verdict == "FAIL":
            self.failed = True
        first, *rest = text.splitlines() or [""]
        print("\n".join([f"  {verdict:<5} {first}", *(f"        {ln}".rstrip() for ln in rest)]))

    def end(self) -> int:
        """The last line; the exit status: 0 when every check passed, else 1."""
        print("isolate doctor: " + ("problems found" if self.failed else "all checks passed"))
        return 1 if self.failed else 0


def _inspect(python: str, root: Path, entrypoint: str) -> dict[str, Any] | str:
    """Import the entrypoint under ``python``; the report, or what went wrong."""
    argv = [python, "-I", "-c", _INSPECT, str(root), entrypoint, ",".join(WORKFLOW_KWARGS)]
    argv += [",".join(PACKAGES), str(shim_path())]
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
    except OSError as exc:
        return f"cannot start {python}: {exc.strerror or exc}"
    try:
        out, err = proc.communicate(timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"importing {entrypoint} took longer than {IMPORT_TIMEOUT_S:g} s"
    lines = out.decode("utf-8", "replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        # All of it: a wrapper such as a pyenv shim says why on its first line, not its last.
        said = err.decode("utf-8", "replace").rstrip().splitlines()
        if not said:
            return f"{python} exited with {proc.returncode} and wrote nothing to stderr"
        shown = said[-STDERR_LINES:]
        if len(said) > len(shown):
            shown.insert(0, f"[{len(said) - len(shown)} earlier lines not shown]")
        return f"{python} exited with {proc.returncode}; its stderr:\n" + "\n".join(shown)
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def _usable_bytecode(pyc: Path, magic: bytes, source: Path) -> bool:
    """Would an interpreter with this magic number load ``pyc`` instead of compiling?"""
    try:
        with open(pyc, "rb") as f:
            head = f.read(16)
        st = source.stat()
    except OSError:
        return False
    flags, mtime, size = (int.from_bytes(head[i : i + 4], "little") for i in (4, 8, 12))
    if head[:4] != magic:
        return False
    # flags != 0: checked against a hash of the source (or not at all), not its time stamp
    return flags != 0 or (mtime, size) == (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)


def _withheld(report: _Report) -> None:
    """The variables of this environment the drop-in's rule keeps from the agent, and why."""
    _, withheld = split_env(os.environ, PASSTHROUGH_ENV)
    if not withheld:
        report.line("info", "the agent sees every variable of this environment")
        return
    report.line(
        "info",
        f"{len(withheld)} variable(s) of this environment are withheld from the agent "
        "(SWEAgentWorkflow, isolate run/batch; econfig inherit_env overrides, secret_env / "
        "--secret-env hands credentials over):",
    )
    for name, reason in sorted(withheld.items()):
        print(f"          {name}: {reason}")


#: How a fresh shim gets its PID namespace, by whether the parent needs a user namespace.
PIDNS_HOW = {
    False: "privileged: a fresh shim starts as PID 1 of its namespace",
    True: "in a user namespace, the shim outside it as a relay",
}


def _containment_report(report: _Report, requested: str) -> str | None:
    """Each layer, the combination ``requested`` resolves to, and what an agent could still do
    to the trainer there; the combination, or None when it cannot be had."""
    for layer in LAYERS:
        problem = _containment.layer_problem(layer)
        if problem is not None:
            report.line("warn", f"layer {layer}: not available: {problem}")
            continue
        if layer == "cgroup":
            groups = _containment.cgroups()
            controllers = [c for c in ("memory", "pids") if groups.controller(c)]
            how = f"leaves under {groups.v2}; controllers: {', '.join(controllers) or 'none'}"
        elif layer == "pidns":
            how = PIDNS_HOW[_containment.needs_userns()]
        else:
            how = f"Landlock ABI {_sandbox.landlock_abi()}, scoped signals"
        report.line("ok", f"layer {layer}: available ({how})")
        v2 = _containment.cgroups().v2 if layer == "cgroup" else None
        if v2 is not None and _containment.move_waits_for_rcu(v2):
            report.line("info", MOVE_HINT)
    try:
        used = _containment.resolve(requested, None)[0]
    except SetupProblem as exc:
        report.line("FAIL", str(exc))
        return None
    report.line("ok", f"containment {requested}" + (f": {used}" if used != requested else ""))
    if "pidns" in _containment.layers(used):
        report.line("ok", f"at {used} the episode's world is built for it: {WORLD}")
    caveat = root_caveat(used)
    if caveat is not None:
        report.line("warn", caveat)
    if os.geteuid() == 0:
        report.line("ok", f"capabilities: a root agent keeps only {KEPT}; no other, ever")
    else:
        report.line("ok", "capabilities: the agent has none")
    if _containment.seccomp_available():
        report.line(
            "ok", "syscall filter: mounts, new namespaces, other processes' memory and fds refused"
        )
    else:
        report.line("warn", "syscall filter: this kernel has no seccomp; the rest still holds")
    left = exposure(used)
    if not left:
        report.line(
            "ok", f"at {used} an agent sees, signals and ptraces only its own episode's processes"
        )
        return used
    report.line("warn", f"at {used} an agent can still, whatever it runs:")
    for what in left:
        print(f"          - {what}")
    best = _containment.resolve("auto", None)[0]  # "session" at the least: it never fails
    if not exposure(best):
        report.line("info", f"containment 'auto' here is {best}, which closes all of that")
        return used
    for layer in ("pidns", "landlock", "cgroup"):
        if layer not in _containment.layers(used) and _containment.layer_problem(layer):
            report.line("info", f"to add {layer}: {layer_remedy(layer)}")
    return used


def _preload_report(
    report: _Report, root: Path, python: str, entrypoint: str, containment: str
) -> None:
    """Whether a preloaded template of this agent would be used, walled in at
    ``containment``, or why it is refused."""
    spec = EpisodeSpec(
        agent_root=root,
        python=python,
        entrypoint=entrypoint,
        containment=containment,
        inherit_env=PASSTHROUGH_ENV,  # the drop-in's: what the trainer's environment passes
        preload=True,
        timeout=IMPORT_TIMEOUT_S,
    )
    refused, seconds = anyio.run(_templates.try_start, spec)
    if refused is None:
        report.line("ok", f"a preloaded template imports it in {seconds:.2f} s and can be forked")
        try:
            level = _containment.resolve(containment, None)[0]
        except SetupProblem:
            return  # resolved as the template's was: not reached
        report.line("info", _templates.shared_by_forks(level))
        return
    report.line("FAIL", f"preload refused: {refused}; episodes with preload would start fresh")
    fix = _templates.remedy(refused)
    if fix is not None:
        report.line("info", fix)


def _root_report(report: _Report, root: Path, *, given: bool) -> None:
    """Whether the agent root exists; what to pass when the default was not there."""
    if root.is_dir():
        report.line("ok", f"agent root {root} exists")
    elif not given and root == default_agent_root():
        report.line(
            "FAIL",
            "no agent root given: pass --agent-root DIR, the agent's checkout (or set "
            f"AWEAGENT_ROOT)\nthe default, {root}, is a checkout of AReaL-SWEAgent beside a "
            "clone of isolate; there is none",
        )
    else:
        what = "is not a directory" if root.exists() else "does not exist"
        report.line("FAIL", f"agent root {root} {what} (--agent-root, AWEAGENT_ROOT)")


def doctor(
    agent_root: Path | None,
    python: str | None,
    entrypoint: str | None,
    containment: str = "auto",
    preload: bool = False,
) -> int:
    """Print one verdict per check; return 0 when every check passed, else 1."""
    python = python or sys.executable
    entrypoint = entrypoint or ENTRYPOINT
    root = resolve_agent_root({"agent_root": str(agent_root) if agent_root else None})
    report = _Report()
    print(f"isolate doctor: {entrypoint} in {root} under {python}")

    _root_report(report, root, given=agent_root is not None)
    found = _inspect(python, root, entrypoint)
    if isinstance(found, str):
        report.line("FAIL", f"interpreter: {found}")
        return report.end()
    version = ".".join(map(str, found["version"]))
    if tuple(found["version"]) < OLDEST:
        report.line("FAIL", f"interpreter {python} is Python {version}; the shim needs 3.9+")
        # What passed under it would say nothing: episodes are not supported there at all.
        report.line("skip", "the shim, bytecode and entrypoint checks: they need Python 3.9+")
        return report.end()
    report.line("ok", f"interpreter {python} starts: Python {version}")

    used = _containment_report(report, containment)
    _shim_report(report, python, used or "session", found["shim_pyc"])
    if found["import"] is not None:
        report.line("FAIL", f"{entrypoint} does not import: {found['import']}")
    else:
        kind = "async" if found.get("async") else "sync"
        report.line("ok", f"{entrypoint} imports ({kind} {found.get('signature')})")
        if found.get("binds") is None:
            report.line("ok", "it accepts (data, **the workflow's keyword arguments)")
        else:
            # A failure for the drop-in, which passes every keyword; the command line passes
            # only those the entrypoint accepts.
            report.line(
                "FAIL",
                f"it does not accept the workflow's arguments: {found['binds']} (SWEAgentWorkflow "
                "passes them all; isolate run and batch pass only those it accepts, and --kwargs)",
            )
        if preload:
            _preload_report(report, root, python, entrypoint, containment)

    versions = ", ".join(f"{n} {v or 'not installed'}" for n, v in found["packages"].items())
    report.line("info", f"packages seen by the agent: {versions}")
    _withheld(report)
    for text in sandbox_lines():
        report.line("info", text)
    return report.end()


def _shim_report(report: _Report, python: str, containment: str, pyc_magic: list[str]) -> None:
    """One episode of ``builtins:float`` at ``containment``, and whether the shim's cached
    bytecode is usable by the agent's interpreter."""
    spec = EpisodeSpec(
        python=python,
        entrypoint="builtins:float",
        timeout=60.0,
        kill_grace=1.0,
        containment=containment,
    )
    shim = anyio.run(run_episode, spec, 1.0)
    if shim.status == "ok":
        report.line(
            "ok",
            f"shim speaks protocol {PROTOCOL_VERSION} ({shim.duration_s:.2f} s round trip, "
            f"containment {shim.containment})",
        )
    else:
        report.line("FAIL", f"shim: {shim.summary()}")
    pyc, magic = pyc_magic
    if _usable_bytecode(Path(pyc), bytes.fromhex(magic), shim_path()):
        report.line("ok", f"the shim starts from its cached bytecode ({pyc})")
    else:
        report.line(
            "info",
            f"no up-to-date bytecode of the shim at {pyc}, and its directory is not writable "
            f"for episodes: each one compiles shim.py (about 5 ms more per start). Once, as "
            f"the owner: {python} -m compileall {shim_path()}",
        )


def layer_remedy(layer: str) -> str:
    """How to give this machine the containment layer ``layer``."""
    if layer == "pidns":
        return (
            "PID namespaces: allow user namespaces (sysctl user.max_user_namespaces > 0; "
            "kernel.unprivileged_userns_clone=1 on Debian/Ubuntu kernels; "
            "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 23.10+), or give the "
            "trainer CAP_SYS_ADMIN; in Docker, a seccomp profile that allows unshare and clone "
            "(--security-opt seccomp=unconfined, or the default one with --cap-add SYS_ADMIN)"
        )
    if layer == "cgroup":
        return (
            "a delegated cgroup v2 subtree the trainer may write: systemd-run --scope -p "
            "Delegate=yes (--user for a user session), Docker --cgroupns=private with "
            "/sys/fs/cgroup mounted rw, or a Kubernetes pod with cgroup v2 and a writable "
            "/sys/fs/cgroup"
        )
    return (
        "Landlock ABI 6 (Linux 6.12 or later) enabled: CONFIG_SECURITY_LANDLOCK=y and "
        "'landlock' in the kernel's lsm= list (cat /sys/kernel/security/lsm); in a "
        "container, a seccomp profile that allows the landlock_* system calls"
    )


# --- what each layer leaves an agent able to do ----------------------------------------------


def _yama_scope() -> int | None:
    """Yama's ptrace_scope (1: only descendants; 2: only CAP_SYS_PTRACE; 3: none), or None."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def exposure(containment: str) -> list[str]:
    """What an agent can still do to the trainer and to sibling episodes under
    ``containment``, in plain words; empty when none of it. Probes Landlock if needed."""
    on = _containment.layers(containment)
    if "pidns" in on:
        return []  # nothing outside its namespace is visible to it, let alone reachable
    left = []
    if "landlock" in on:
        left.append(
            "see every process of the machine (ps, /proc) and their command lines; it cannot "
            "signal, ptrace or read the memory of any outside its episode"
        )
        # As root, the agent lacks capabilities the trainer has: the kernel refuses it too.
        if _containment.landlock().environ_readable and os.geteuid() != 0:
            left.append(
                "read the trainer's /proc/PID/environ and maps: every credential the trainer "
                "was started with (WANDB_API_KEY, HF_TOKEN, ...); Landlock does not refuse them"
            )
        return left
    left.append(
        "kill the trainer and every sibling episode: pkill -f python, killall python, kill -9 -1"
    )
    if os.geteuid() == 0:
        # A root agent keeps no CAP_SYS_PTRACE, and the kernel lets a process read another's
        # environ or memory only if it holds every capability that one holds.
        return left
    left.append(
        "read the trainer's /proc/PID/environ: every credential it was started with "
        "(WANDB_API_KEY, HF_TOKEN, OPENAI_API_KEY)"
    )
    scope = _yama_scope()
    if scope is None or scope == 0:
        yama = "no Yama here" if scope is None else f"Yama ptrace_scope {scope}"
        left.append(f"ptrace the trainer and read its memory, every episode's key with it ({yama})")
    return left


#: What PID 1 of an episode's namespaces builds (docs/containment.md, "The episode's world").
WORLD = (
    "PID, mount, IPC, UTS and cgroup namespaces; its own /proc and /dev (six devices, a devpts "
    "and /dev/shm of its own); /sys, /proc/sys and /proc/sysrq-trigger read-only; a read-only "
    "view of its own cgroup only"
)


def root_caveat(used: str) -> str | None:
    """What no layer walls off when the trainer, and so the agent, runs as root at
    combination ``used``; else None."""
    if os.geteuid() != 0:
        return None
    if "pidns" in _containment.layers(used):
        return (
            "the trainer runs as root, and so does the agent: it can still read and write every "
            "file of the machine that root can (Sandbox() makes the rest a read-only view); for "
            "untrusted agents run the trainer as an unprivileged user"
        )
    return (
        "the trainer runs as root, and so does the agent: no layer walls off root's file "
        "access, so it can still write 1 into the trainer's cgroup.kill under /sys/fs/cgroup or "
        "reboot the machine through /proc/sysrq-trigger; for untrusted agents run the trainer "
        "as an unprivileged user"
    )


def sandbox_lines() -> list[str]:
    """What this machine can enforce of a sandbox, for ``isolate doctor``. Blocking."""
    abi = _sandbox.landlock_abi()
    if abi == 0:
        landlock = "none: Sandbox() is a setup_error here (best_effort runs it unconfined)"
    else:
        lacks = ["truncate() rules (ABI 3)"] if abi < 3 else []
        lacks += ["TCP connect rules (ABI 4)"] if abi < 4 else []
        landlock = f"ABI {abi}" + (f", without {' and '.join(lacks)}" if lacks else "")
    userns = _sandbox.userns_problem()
    mountns = _containment.pidns_problem() is None or not _containment.needs_userns()
    return [
        f"sandbox: Landlock {landlock}",
        "sandbox: user namespaces " + ("available" if userns is None else f"not: {userns}"),
        "sandbox: mount namespaces "
        + (
            "available (a read-only view outside the writable paths, a /dev of its own; hidden "
            "paths read as empty; .git/hooks, .git/config, rc files read-only)"
            if mountns
            else "not available: no read-only view (Landlock refuses writes, not chmod or chown), "
            "a checkout's .git and rc files cannot be made read-only"
        ),
        "sandbox: network isolation " + _network_line(),
    ]


def _network_line() -> str:
    problem = _sandbox.network_problem()
    if problem is None:
        return "available (Sandbox(network=...): a namespace of its own, an egress proxy)"
    return (
        f"not available: {problem}; Sandbox(network=...) is a setup_error here. Run as root, "
        "or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
        "or kernel.apparmor_restrict_unprivileged_userns=0)"
    )
