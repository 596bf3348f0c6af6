"""One episode's cgroup leaves: made, joined, killed, emptied, removed; and the leaves of
dead parents, cleaned up. Blocking."""

from __future__ import annotations

import errno
import os
import re
import secrets
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ..model.errors import SetupProblem
from ..system.procfs import start_time
from ..system.reaping import GIVE_UP_S, Reaper, processes
from .probes import Cgroups, once, per_process, probe_cgroups

#: Guards our per-parent directories: created by the first leaf, removed after the last.
_dir_lock = threading.Lock()

# --- one episode's cgroup leaves --------------------------------------------------------------


def _owner_name() -> str:
    """This process's directory name under the cgroups' ``isolate``: its pid and start time
    (read once per process)."""
    pid = os.getpid()
    return per_process("owner", lambda: f"{pid}.{start_time(pid)}")


_active: dict[Path, int] = {}


class Leaves:
    """The cgroup leaves of one episode: created before spawn, removed after teardown."""

    def __init__(
        self, groups: Cgroups, episode_id: str, writes: Mapping[str, Mapping[str, str]]
    ) -> None:
        """``writes``: leaf (``v2``, ``pids``, ``memory``) -> file -> value, as planned."""
        assert groups.v2 is not None
        self.writes = writes
        self.name = f"{episode_id}.{secrets.token_hex(4)}"
        roots = {"v2": groups.v2}
        for name in ("pids", "memory"):
            if name in writes:
                roots[name] = groups.v1[name]
        self.parents = {kind: root / _owner_name() for kind, root in roots.items()}
        self.dirs: dict[str, Path] = {}
        #: :meth:`create` was called (the leaves may be gone since).
        self.made = False

    def create(self) -> None:
        """Make the leaves and write the limits; SetupProblem if one cannot be made. The
        caller removes what was made either way (:meth:`remove`)."""
        self.made = True
        for kind, parent in self.parents.items():
            leaf = parent / self.name
            with _dir_lock:
                try:
                    parent.mkdir(exist_ok=True)
                    if kind == "v2" and self.writes.get("v2"):
                        wanted = " ".join(f"+{c}" for c in ("memory", "pids"))
                        _write_each(parent / "cgroup.subtree_control", wanted.split())
                    leaf.mkdir()
                except OSError as exc:
                    raise SetupProblem(
                        f"cannot create cgroup {leaf}: {exc.strerror or exc}"
                    ) from None
                _active[parent] = _active.get(parent, 0) + 1
            self.dirs[kind] = leaf
            for name, value in self.writes.get(kind, {}).items():
                path = leaf / name
                if not path.exists() and name in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
                    continue  # no swap accounting here: nothing to cap
                try:
                    path.write_text(value)
                except OSError as exc:
                    problem = f"cannot write {value} to {path}: {exc.strerror or exc}"
                    raise SetupProblem(problem) from None

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

    def wait_empty(self, seconds: float = GIVE_UP_S) -> bool:
        """Kill and wait until no process is left in any leaf; False if some still are."""
        return Reaper(lambda: processes(self.members()), box=self).kill(seconds).gone

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
            if "pids.max" in self.writes.get(kind, {}) and kind in self.dirs:
                return _counter(self.dirs[kind] / "pids.events", "max") or 0
        return 0

    def remove(self) -> str | None:
        """Remove the leaves (and our parent directory once it is empty); a problem or None.
        An empty leaf goes with one rmdir, which the kernel refuses while a process or a cgroup
        is in it; what is left is killed, then removed with the cgroups made inside it."""
        self._remove_each(Path.rmdir)
        problem = None
        if self.dirs and not self.wait_empty():
            problem = f"processes still in {self.dirs.get('v2')}"
        removed = self._remove_each(_rmdir_tree)
        return problem or removed

    def _remove_each(self, remove: Callable[[Path], None]) -> str | None:
        """``remove(leaf)`` for each leaf left, and forget those that went (so, after the last,
        our parent directory); the first refusal in words, or None."""
        problem = None
        for kind, leaf in list(self.dirs.items()):
            with _dir_lock:
                try:
                    remove(leaf)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    problem = problem or f"cannot remove {leaf}: {exc.strerror or exc}"
                    continue
                self._forget(kind)
        return problem

    def _forget(self, kind: str) -> None:
        """``kind``'s leaf is gone; so is our parent directory after its last leaf. Under
        ``_dir_lock``."""
        parent = self.parents[kind]
        del self.dirs[kind]
        _active[parent] = _active.get(parent, 1) - 1
        if _active[parent] <= 0:
            _active.pop(parent, None)
            try:
                parent.rmdir()
            except OSError:
                pass  # a leaf we did not make, or one left behind: the next start cleans


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


class _Leaf:
    """One leaf by its path, as a :class:`~isolate._core.system.reaping.Box`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def members(self) -> list[int]:
        return _procs(self.path)

    def populated(self) -> bool:
        return _populated(self.path)

    def kill(self) -> None:
        _kill_leaf(self.path)


def _empty(leaf: Path) -> bool:
    """Kill what is in ``leaf`` until it is empty (for at most ``GIVE_UP_S``); whether it is."""
    box = _Leaf(leaf)
    return Reaper(lambda: processes(box.members()), box=box).kill().gone


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
                _empty(leaf)
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


def cgroups() -> Cgroups:
    """What this process can do with cgroups (probed once; stale leaves cleaned on the way)."""
    return once(f"cgroups.{os.getpid()}", _probe_and_clean)


def _probe_and_clean() -> Cgroups:
    found = probe_cgroups()
    clean_stale(([found.v2] if found.v2 is not None else []) + list(found.v1.values()))
    return found
