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

from __future__ import annotations

import errno
import os
import re
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agent_shim.shim_wire import LAYERS

from .config import Limits
from .procfs import start_time
from .shim import probe

#: What ``auto`` tries, strongest first: the PID namespace is the wall, Landlock the wall where
#: there is no namespace; the cgroup adds teardown in one write and tree-wide limits.
AUTO: tuple[str, ...] = (
    "cgroup+pidns",
    "pidns",
    "cgroup+landlock",
    "landlock",
    "cgroup",
    "session",
)
#: Every containment value but ``auto``: each combination of layers, and ``session``.
COMBINATIONS: tuple[str, ...] = tuple(
    "+".join(layer for i, layer in enumerate(LAYERS) if mask >> i & 1) for mask in range(1, 8)
) + ("session",)

_CAP_SYS_ADMIN = 21
#: How long teardown waits for ``populated 0`` after ``cgroup.kill`` (seconds).
_EMPTY_WAIT_S = 2.0
_V1 = ("pids", "memory")

_probe_lock = threading.Lock()
_probed: dict[str, object] = {}
#: Guards our per-parent directories: created by the first leaf, removed after the last.
_dir_lock = threading.Lock()


@dataclass(frozen=True)
class Cgroups:
    """Where this process may create episode leaves (each an ``isolate`` directory)."""

    v2: Path | None
    """``<own cgroup v2 directory>/isolate``; None when there is no cgroup level."""
    v2_controllers: frozenset[str]
    """Which of ``memory``/``pids`` leaves under ``v2`` get."""
    v1: dict[str, Path]
    """``memory``/``pids`` -> ``<own v1 cgroup directory>/isolate``, where writable."""
    problem: str | None
    """Why there is no cgroup level, or None."""

    def controller(self, name: str) -> Literal["v2", "v1"] | None:
        if name in self.v2_controllers:
            return "v2"
        return "v1" if name in self.v1 else None


# --- probes -----------------------------------------------------------------------------------


def _unescape(text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root, mount point, super options) of every mount, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3:
                options = set(tail[2].split(","))
                out.append((tail[0], _unescape(fields[3]), _unescape(fields[4]), options))
    return out


def _own_cgroups() -> dict[str, str]:
    """Our cgroup path per hierarchy: ``""`` for v2, a controller name for each v1 one."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                out[name] = path
    return out


def _join(mount_root: str, mount_point: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` under a mount of the hierarchy rooted at ``mount_root``."""
    if mount_root == "/":
        return Path(mount_point + path.rstrip("/"))
    if path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
        return Path(mount_point + path[len(mount_root) :].rstrip("/"))
    return None


def _writable_root(base: Path) -> tuple[Path | None, str | None]:
    """Create ``base/isolate`` and prove a leaf can be made and removed under it."""
    root = base / "isolate"
    probe = root / f"probe.{os.getpid()}.{secrets.token_hex(3)}"
    try:
        root.mkdir(exist_ok=True)
        probe.mkdir()
    except OSError as exc:
        return None, f"cgroup tree {base} is not writable ({exc.strerror or exc})"
    try:
        if base.joinpath("cgroup.controllers").exists() and not (probe / "cgroup.kill").exists():
            return None, "the kernel has no cgroup.kill (Linux 5.14 or later needed)"
        return root, None
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


def _probe_cgroups() -> Cgroups:
    try:
        mounts = _mounts()
        own = _own_cgroups()
    except OSError as exc:
        return Cgroups(None, frozenset(), {}, f"cannot read /proc ({exc.strerror or exc})")
    v1: dict[str, Path] = {}
    for name in _V1:
        for fstype, root, point, options in mounts:
            if fstype == "cgroup" and name in options and name in own:
                base = _join(root, point, own[name])
                found = _writable_root(base)[0] if base is not None else None
                if found is not None:
                    v1[name] = found
                    break
    v2_mounts = [(root, point) for fstype, root, point, _ in mounts if fstype == "cgroup2"]
    if not v2_mounts:
        return Cgroups(None, frozenset(), v1, "no cgroup v2 tree is mounted")
    if "" not in own:
        return Cgroups(None, frozenset(), v1, "this process is in no cgroup v2 group")
    problem = "no cgroup v2 mount shows this process's group"
    for root, point in v2_mounts:
        base = _join(root, point, own[""])
        if base is None:
            continue
        found, problem_here = _writable_root(base)
        if found is None:
            problem = problem_here or problem
            continue
        return Cgroups(found, _enable_v2_controllers(found), v1, None)
    return Cgroups(None, frozenset(), v1, problem)


def _enable_v2_controllers(root: Path) -> frozenset[str]:
    """Enable memory and pids for our subtree where the tree above delegates them to us."""
    try:
        offered = set((root / "cgroup.controllers").read_text().split()) & set(_V1)
    except OSError:
        return frozenset()
    enabled = set()
    for name in sorted(offered):
        try:
            (root / "cgroup.subtree_control").write_text(f"+{name}")
            enabled.add(name)
        except OSError:
            continue
    return frozenset(enabled)


def _has_cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def needs_userns() -> bool:
    """A PID namespace without CAP_SYS_ADMIN needs a user namespace around it."""
    return not _has_cap_sys_admin()


def _probe_pidns() -> str | None:
    """Run the shim's own namespace set-up once in a short-lived child; None if it works."""
    if not sys.platform.startswith("linux"):
        return "PID namespaces exist only on Linux"
    found = probe("--probe-pidns", *(["userns"] if needs_userns() else []))
    return None if found.problem is None else f"namespaces not permitted: {found.problem}"


@dataclass(frozen=True)
class LandlockProbe:
    """What the shim found when it entered a scoped Landlock domain in a probe process. (The
    kernel's ABI version is :func:`sandbox.landlock_abi`, asked in this process.)"""

    problem: str | None
    """Why there is no landlock layer, or None."""
    environ_readable: bool = False
    """Whether the domain could still read its parent's ``/proc/PID/environ`` (and maps)."""


def _probe_landlock() -> LandlockProbe:
    """Enter a scoped domain in a short-lived shim and signal its parent from there."""
    if not sys.platform.startswith("linux"):
        return LandlockProbe("Landlock exists only on Linux")
    done = probe("--probe-landlock")
    found = dict(re.findall(r"^(\w+) (\S+)$", done.stdout, re.M))
    if done.problem is None:
        return LandlockProbe(None, found.get("environ") == "readable")
    return LandlockProbe(done.problem)


def landlock() -> LandlockProbe:
    """This machine's Landlock, as the shim sees it (probed once)."""
    with _probe_lock:
        found = _probed.get("landlock")
        if not isinstance(found, LandlockProbe):
            found = _probed["landlock"] = _probe_landlock()
        return found


def cgroups() -> Cgroups:
    """What this process can do with cgroups (probed once; stale leaves cleaned on the way)."""
    with _probe_lock:
        key = f"cgroups.{os.getpid()}"
        found = _probed.get(key)
        if not isinstance(found, Cgroups):
            found = _probe_cgroups()
            roots = [found.v2] if found.v2 is not None else []
            clean_stale(roots + list(found.v1.values()))
            _probed[key] = found
        return found


def pidns_problem() -> str | None:
    """Why this machine gives us no PID namespace, or None (probed once)."""
    with _probe_lock:
        if "pidns" not in _probed:
            _probed["pidns"] = _probe_pidns()
        problem = _probed["pidns"]
        return problem if isinstance(problem, str) else None


def layers(containment: str) -> tuple[str, ...]:
    """``"cgroup+pidns"`` -> ``("cgroup", "pidns")``; ``"session"`` -> ``()``."""
    return () if containment in ("session", "auto") else tuple(containment.split("+"))


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


#: The capabilities a root agent keeps (Docker's default set); every other one is dropped from
#: all five sets before the agent's code runs, and an unprivileged trainer's agent has none.
KEPT_CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "NET_BIND_SERVICE",
    "NET_RAW",
    "SYS_CHROOT",
    "MKNOD",
    "AUDIT_WRITE",
    "SETFCAP",
)


def seccomp_available() -> bool:
    """Whether this kernel filters syscalls (seccomp), which the worker uses: ``Seccomp:`` in
    /proc/self/status."""
    try:
        with open("/proc/self/status") as f:
            return any(line.startswith("Seccomp:") for line in f)
    except OSError:
        return False


def remedy(layer: str) -> str:
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
class Plan:
    """How one episode's limits are enforced at one level."""

    writes: dict[str, dict[str, str]] = field(default_factory=dict)
    """Leaf (``v2``, ``pids``, ``memory``) -> file -> value."""
    rlimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    """``RLIMIT_*`` name -> (soft, hard), set in the worker before the agent is imported."""


def plan(containment: str, limits: Limits | None, groups: Cgroups | None) -> Plan | str:
    """The mechanisms for ``limits`` under ``containment``, or why one limit cannot be
    enforced there. ``groups``: where leaves go, when the combination has the cgroup layer."""
    out = Plan()
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
        # The supervisor counts too, and with a PID namespace its outer half (the relay).
        n = str(limits.max_processes + 1 + ("pidns" in on))
        where = groups.controller("pids") if groups else None
        if where is not None:
            out.writes.setdefault("v2" if where == "v2" else "pids", {})["pids.max"] = n
        elif "pidns" in on and needs_userns():
            # Counted per user namespace since Linux 5.14: it binds this episode only.
            count = limits.max_processes + 2
            out.rlimits["RLIMIT_NPROC"] = (count, count)
        elif "cgroup" in on:
            return "limits.max_processes needs a pids cgroup controller, and none is writable"
        elif "pidns" in on:
            return (
                f"limits.max_processes at containment {containment!r} needs a user namespace, "
                "which a privileged parent does not use (RLIMIT_NPROC does not bind it): add "
                "the 'cgroup' layer"
            )
        else:
            return "limits.max_processes needs the containment layer 'cgroup' or 'pidns'"
    if limits.cpu_seconds is not None:
        # SIGXCPU at the limit, SIGKILL a second later if the agent ignores it.
        out.rlimits["RLIMIT_CPU"] = (limits.cpu_seconds, limits.cpu_seconds + 1)
    if limits.open_files is not None:
        out.rlimits["RLIMIT_NOFILE"] = (limits.open_files, limits.open_files)
    if not limits.core_dumps:
        out.rlimits["RLIMIT_CORE"] = (0, 0)
    return out


def resolve(requested: str, limits: Limits | None) -> tuple[str, Plan] | str:
    """The combination to use and its limit plan, or why the requested one cannot be had.
    Blocking (probes run on first use)."""
    candidates = AUTO if requested == "auto" else (requested,)
    first_problem = None
    for containment in candidates:
        missing = problem(containment)
        if missing is not None:
            missing = f"containment {containment!r} is not available: {missing}"
        else:
            groups = cgroups() if "cgroup" in layers(containment) else None
            how = plan(containment, limits, groups)
            if isinstance(how, Plan):
                return containment, how
            missing = f"containment {containment!r} cannot enforce the limits: {how}"
        first_problem = first_problem or missing
    assert first_problem is not None
    return first_problem


# --- one episode's cgroup leaves --------------------------------------------------------------


def _owner_name() -> str:
    return f"{os.getpid()}.{start_time(os.getpid())}"


_active: dict[Path, int] = {}


class Leaves:
    """The cgroup leaves of one episode: created before spawn, removed after teardown."""

    def __init__(self, groups: Cgroups, episode_id: str, how: Plan) -> None:
        assert groups.v2 is not None
        self.plan = how
        self.name = f"{episode_id}.{secrets.token_hex(4)}"
        roots = {"v2": groups.v2}
        for name in ("pids", "memory"):
            if name in how.writes:
                roots[name] = groups.v1[name]
        self.parents = {kind: root / _owner_name() for kind, root in roots.items()}
        self.dirs: dict[str, Path] = {}

    def create(self) -> str | None:
        """Make the leaves and write the limits; a problem, or None."""
        for kind, parent in self.parents.items():
            leaf = parent / self.name
            with _dir_lock:
                try:
                    parent.mkdir(exist_ok=True)
                    if kind == "v2" and self.plan.writes.get("v2"):
                        wanted = " ".join(f"+{c}" for c in ("memory", "pids"))
                        _write_each(parent / "cgroup.subtree_control", wanted.split())
                    leaf.mkdir()
                except OSError as exc:
                    return f"cannot create cgroup {leaf}: {exc.strerror or exc}"
                _active[parent] = _active.get(parent, 0) + 1
            self.dirs[kind] = leaf
            for name, value in self.plan.writes.get(kind, {}).items():
                path = leaf / name
                if not path.exists() and name in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
                    continue  # no swap accounting here: nothing to cap
                try:
                    path.write_text(value)
                except OSError as exc:
                    return f"cannot write {value} to {path}: {exc.strerror or exc}"
        return None

    def join(self) -> list[str]:
        """Directories whose ``cgroup.procs`` the shim writes itself into (unless in already)."""
        return [str(d) for d in self.dirs.values()]

    def move(self, pid: int) -> str | None:
        """Put process ``pid`` (the shim, before it has read its handshake) into the leaves."""
        for leaf in self.dirs.values():
            try:
                (leaf / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                return None  # already dead: its exit status tells why
            except OSError as exc:
                return f"cannot move the shim into cgroup {leaf}: {exc.strerror or exc}"
        return None

    def members(self) -> list[int]:
        """Pids in the episode's leaves."""
        pids: set[int] = set()
        for leaf in self.dirs.values():
            pids.update(_procs(leaf))
        return sorted(pids)

    def populated(self) -> bool:
        leaf = self.dirs.get("v2")
        return leaf is not None and _populated(leaf)

    def kill(self) -> None:
        """SIGKILL every process of the episode at once."""
        if "v2" in self.dirs:
            _kill_leaf(self.dirs["v2"])  # everything in one go
            if self.populated():
                return
        # Only a process that left the v2 leaf (but not a v1 one) is still around.
        for kind, leaf in self.dirs.items():
            if kind != "v2":
                _kill_leaf(leaf)

    def wait_empty(self, seconds: float = _EMPTY_WAIT_S) -> bool:
        """Kill and wait until no process is left in any leaf; False if some still are."""
        end = time.monotonic() + seconds
        delay = 0.001
        while self.populated() or self.members():
            if time.monotonic() > end:
                return False
            self.kill()
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True

    def oom_kills(self) -> int | None:
        """OOM kills in the episode, where a memory controller counts them."""
        if "memory" in self.dirs:
            return _counter(self.dirs["memory"] / "memory.oom_control", "oom_kill")
        if "v2" in self.dirs:  # present where the v2 memory controller is on for the leaf
            return _counter(self.dirs["v2"] / "memory.events", "oom_kill")
        return None

    def pids_limit_hits(self) -> int:
        """Forks refused by ``pids.max``."""
        for kind in ("pids", "v2"):
            if "pids.max" in self.plan.writes.get(kind, {}) and kind in self.dirs:
                return _counter(self.dirs[kind] / "pids.events", "max") or 0
        return 0

    def remove(self) -> str | None:
        """Remove the leaves (and our parent directory once it is empty); a problem or None."""
        problem = None
        if not self.wait_empty():
            problem = f"processes still in {self.dirs.get('v2')}"
        for kind, leaf in list(self.dirs.items()):
            parent = self.parents[kind]
            with _dir_lock:
                try:
                    _rmdir_tree(leaf)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    problem = problem or f"cannot remove {leaf}: {exc.strerror or exc}"
                    continue
                del self.dirs[kind]
                _active[parent] = _active.get(parent, 1) - 1
                if _active[parent] <= 0:
                    _active.pop(parent, None)
                    try:
                        parent.rmdir()
                    except OSError:
                        pass  # a leaf we did not make, or one left behind: the next start cleans
        return problem


def _write_each(path: Path, values: Iterable[str]) -> None:
    for value in values:
        try:
            path.write_text(value)
        except OSError:
            continue  # not offered here: that controller's limit falls back or was refused


def _rmdir_tree(leaf: Path) -> None:
    """Remove ``leaf`` and the cgroups made inside it (a root agent, or a container runtime,
    may make some), deepest first: rmdir refuses a cgroup that has children. Raises OSError."""
    for where, children, _ in os.walk(leaf, topdown=False):
        for child in children:
            os.rmdir(os.path.join(where, child))
    leaf.rmdir()


def _procs(leaf: Path) -> list[int]:
    try:
        return [int(p) for p in (leaf / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _shim_alive(leaf: Path) -> bool:
    """Whether the episode's shim is still in the leaf: after its parent's death it cancels
    the agent, waits for its clean-up (cancel_grace) and kills the rest, leaving the leaf empty.
    The shim is the one session leader running agent_shim (the parent starts it in a session
    of its own); the agent's processes forked from it lead no session of the shim's."""
    for pid in _procs(leaf):
        try:
            if os.getsid(pid) != pid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"agent_shim" in f.read() and start_time(pid) is not None:
                    return True
        except OSError:
            continue
    return False


def _populated(leaf: Path) -> bool:
    return bool(_counter(leaf / "cgroup.events", "populated"))


def _counter(path: Path, name: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _kill_leaf(leaf: Path) -> None:
    kill_file = leaf / "cgroup.kill"
    if kill_file.exists():
        try:
            kill_file.write_text("1")
            return
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return
    # A v1 leaf: no cgroup.kill; signal each member (pids stay in cgroup.procs until they die).
    for pid in _procs(leaf):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def clean_stale(roots: Iterable[Path]) -> int:
    """Remove the leaves of isolate parents that are dead (pid + start time no longer alive),
    killing what is left in them. Returns how many leaves were removed."""
    removed = 0
    for root in roots:
        try:
            owners = [p for p in root.iterdir() if re.fullmatch(r"\d+\.\d+", p.name)]
        except OSError:
            continue
        for owner in owners:
            pid, start = (int(x) for x in owner.name.split("."))
            if start_time(pid) == start:
                continue
            for leaf in [p for p in owner.iterdir() if p.is_dir()]:
                if _shim_alive(leaf):
                    continue  # tearing its episode down by itself: its agent is cleaning up
                end = time.monotonic() + _EMPTY_WAIT_S
                while (_populated(leaf) or _procs(leaf)) and time.monotonic() < end:
                    _kill_leaf(leaf)
                    time.sleep(0.005)
                try:
                    _rmdir_tree(leaf)
                    removed += 1
                except OSError:
                    continue
            try:
                owner.rmdir()
            except OSError:
                continue
    return removed
