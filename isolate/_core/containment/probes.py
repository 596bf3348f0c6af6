"""What containment this machine provides: cgroup trees, namespaces, Landlock, seccomp;
each probed once per process. Blocking."""

from __future__ import annotations

import os
import re
import secrets
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from agent_shim.shim_wire import LAYERS

from ..system.shim import probe

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
_V1 = ("pids", "memory")

_probe_lock = threading.Lock()
_probed: dict[str, object] = {}
_T = TypeVar("_T")


_per_process: dict[tuple[str, int], object] = {}


def per_process(key: str, make: Callable[[], _T]) -> _T:
    """What ``make()`` returned the first time ``key`` was asked for in this process (a fork
    asks again), without a lock: for cheap reads that a probe, holding :func:`once`'s, may ask
    too, and that an episode's start must not wait behind a probe for."""
    mine = (key, os.getpid())
    if mine not in _per_process:
        _per_process[mine] = make()
    return _per_process[mine]  # type: ignore[return-value]


def once(key: str, make: Callable[[], _T]) -> _T:
    """What ``make()`` returned the first time ``key`` was asked for in this process (one
    probe at a time: a second caller waits for the first)."""
    with _probe_lock:
        if key not in _probed:
            _probed[key] = make()
        return _probed[key]  # type: ignore[return-value]


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


def probe_cgroups() -> Cgroups:
    """Where this process may create leaves, probed now (``leaves.cgroups`` keeps it)."""
    try:
        mounts = _mounts()
        own = _own_cgroups()
    except OSError as exc:
        return Cgroups(None, frozenset(), {}, f"cannot read /proc ({exc.strerror or exc})")
    v1: dict[str, Path] = {}
    for name in _V1:
        for base in _bases(mounts, own, name):
            found = _writable_root(base)[0]
            if found is not None:
                v1[name] = found
                break
    v2_mounts = [(root, point) for fstype, root, point, _ in mounts if fstype == "cgroup2"]
    if not v2_mounts:
        return Cgroups(None, frozenset(), v1, "no cgroup v2 tree is mounted")
    if "" not in own:
        return Cgroups(None, frozenset(), v1, "this process is in no cgroup v2 group")
    problem = "no cgroup v2 mount shows this process's group"
    for base in _bases(mounts, own, ""):
        found, problem_here = _writable_root(base)
        if found is None:
            problem = problem_here or problem
            continue
        return Cgroups(found, _enable_v2_controllers(found), v1, None)
    return Cgroups(None, frozenset(), v1, problem)


def _bases(
    mounts: list[tuple[str, str, str, set[str]]], own: dict[str, str], name: str
) -> Iterator[Path]:
    """This process's group in hierarchy ``name`` (``""``: v2; else a v1 controller), one
    directory per mount that shows it."""
    for base, _ in _bases_at(mounts, own, name):
        yield base


def _bases_at(
    mounts: list[tuple[str, str, str, set[str]]], own: dict[str, str], name: str
) -> Iterator[tuple[Path, Path]]:
    """:func:`_bases`, each with the mount point it is under."""
    if name not in own:
        return
    for fstype, root, point, options in mounts:
        if fstype == ("cgroup2" if name == "" else "cgroup") and (name == "" or name in options):
            base = _join(root, point, own[name])
            if base is not None:
                yield base, Path(point)


def own_limit_cgroups(controller: str) -> list[Path]:
    """This process's own groups that may hold a limit of ``controller`` (``memory``,
    ``pids``), writable or not, and the groups above each up to its mount (a container's
    limit may sit there): its v2 group and its v1 group of that controller, each from the
    first mount that shows it (probed once); none where ``/proc`` cannot be read."""
    return once(f"{controller}-cgroups.{os.getpid()}", lambda: _own_cgroups_of(controller))


def _own_cgroups_of(controller: str) -> list[Path]:
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError:
        return []
    found: list[Path] = []
    for name in ("", controller):
        for base, point in _bases_at(mounts, own, name):
            if base.is_dir():
                found += [base, *(up for up in base.parents if point in (up, *up.parents))]
                break
    return found


def move_waits_for_rcu(v2: Path) -> bool | None:
    """Whether moving a process into a leaf under ``v2`` waits for an RCU grace period: the
    cgroup v2 mount that shows ``v2`` lacks the ``favordynmods`` option (Linux 6.0 and later),
    which keeps the lock a move takes ready for writers. None where no such mount is found."""
    try:
        return lacks_favordynmods(v2, _mounts())
    except OSError:
        return None


def lacks_favordynmods(v2: Path, mounts: list[tuple[str, str, str, set[str]]]) -> bool | None:
    """:func:`move_waits_for_rcu` on these mounts (``_mounts()``: fstype, root, mount point,
    super options)."""
    path = str(v2)
    found = [
        (point, options)
        for fstype, _, point, options in mounts
        if fstype == "cgroup2" and (path == point or path.startswith(point.rstrip("/") + "/"))
    ]
    if not found:
        return None
    _, options = max(found, key=lambda mount: len(mount[0]))
    return "favordynmods" not in options


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
    """Whether this process has CAP_SYS_ADMIN (read once, as the probes are)."""
    return per_process("cap_sys_admin", _read_cap_sys_admin)


def _read_cap_sys_admin() -> bool:
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
    return once("landlock", _probe_landlock)


def pidns_problem() -> str | None:
    """Why this machine gives us no PID namespace, or None (probed once)."""
    return once("pidns", _probe_pidns)


def layers(containment: str) -> tuple[str, ...]:
    """``"cgroup+pidns"`` -> ``("cgroup", "pidns")``; ``"session"`` -> ``()``."""
    return () if containment in ("session", "auto") else tuple(containment.split("+"))


#: The capabilities a root agent keeps (Docker's default set less NET_RAW, MKNOD and SETFCAP,
#: which act on the machine's loopback, devices and files; NET_BIND_SERVICE only in a network
#: namespace of the episode's own); every other one is dropped from all five sets before the
#: agent's code runs, and an unprivileged trainer's agent has none.
KEPT_CAPABILITIES = (
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "NET_BIND_SERVICE",
    "SYS_CHROOT",
    "AUDIT_WRITE",
)


def seccomp_available() -> bool:
    """Whether this kernel filters syscalls (seccomp), which the worker uses: ``Seccomp:`` in
    /proc/self/status."""
    try:
        with open("/proc/self/status") as f:
            return any(line.startswith("Seccomp:") for line in f)
    except OSError:
        return False
