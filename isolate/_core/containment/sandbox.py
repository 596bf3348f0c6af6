"""The optional file-system and network sandbox of an episode: :class:`Sandbox`, and the plan
the shim's worker enforces (``agent_shim/shim_sandbox.py``) before it imports the agent.

Landlock allows, it never subtracts: a rule on a directory grants its rights to everything
beneath. So "read everything but ``~/.ssh``" is built by *carving*: every directory above a
hidden path gets a rule for each of its entries but the way down to that path, and none for
itself (only listing). Writable paths get full rights. What Landlock cannot express (a
read-only ``.git/hooks`` inside a writable working directory, a hidden path inside a writable
one) is done with mounts, where the episode has a mount namespace; where it has none, it is
reported as missing.

Rules are computed here, in the parent's worker thread, and sent in the handshake as
``[path, kind]`` pairs; kinds are ``rd``/``rf`` (read a directory tree / a file), ``wd``/``wf``
(read and write), ``dev`` (a device: read, write, ioctl). Mounts are ``[op, path]`` pairs: ``pin``
(bind a directory onto itself: it can no longer be renamed or removed), ``ro`` (bind read-only
onto itself), ``hide-dir`` (an empty read-only tmpfs over it) and ``hide-file`` (``/dev/null``
over it, read-only).
"""

from __future__ import annotations

import importlib
import os
import pwd
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model.errors import SetupProblem
from ..model.sandbox_config import Sandbox, SandboxReport
from ..system.procfs import start_time
from ..system.shim import probe
from . import sandbox_plan
from .sandbox_plan import SandboxPlan, under


def homes(child_env: dict[str, str]) -> list[str]:
    """Every directory ``~`` can mean to an agent: its HOME, the parent's, the password one."""
    found = [child_env.get("HOME"), os.environ.get("HOME")]
    try:
        found.append(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        pass
    out: list[str] = []
    for home in found:
        if home and home.startswith("/"):
            real = os.path.realpath(home)
            if real not in out:
                out.append(real)
    return out


def hidden_paths(sandbox: Sandbox, home_dirs: Iterable[str]) -> list[str]:
    """The real paths to hide (existing or not: a path created later stays hidden)."""
    out: list[str] = []
    for path in Sandbox.DEFAULT_HIDE + sandbox.hide:
        expanded = [path] if path.startswith("/") else [h + path[1:] for h in home_dirs]
        for one in expanded:
            for real in {os.path.normpath(one), os.path.realpath(one)}:
                if real not in out and real != "/":
                    out.append(real)
    return out


def plan_sandbox(
    sandbox: Sandbox,
    *,
    cwd: str,
    tmpdir: str,
    home_dirs: list[str],
    abi: int,
    mountns: bool,
    can_unshare: bool,
) -> SandboxPlan:
    """The rules and mounts for one episode (``sandbox_plan.from_paths``, with its hidden paths).
    Blocking."""
    return sandbox_plan.from_paths(
        hidden_paths(sandbox, home_dirs),
        [os.path.realpath(cwd), os.path.realpath(tmpdir), *map(os.path.realpath, sandbox.write)],
        sandbox.network,
        sandbox.connect,
        abi=abi,
        mountns=mountns,
        can_unshare=can_unshare,
    )


def write_paths_problem(sandbox: Sandbox, cwd: str) -> str | None:
    """A ``write`` path that does not exist (the agent could not create it either), or a
    writable path that would open the whole machine: ``/``, or a parent of the home."""
    for path in sandbox.write:
        if not path.exists():
            return f"sandbox write path {path} does not exist"
    writable = [("the working directory", cwd)] + [("write path", str(p)) for p in sandbox.write]
    for what, where in writable:
        real = os.path.realpath(where)
        if real == "/" or any(under(home, real) and home != real for home in homes({})):
            return (
                f"sandbox: {what} {real} would make everything beneath it writable, the home "
                "included; give the episode a working directory of its own (EpisodeSpec.cwd)"
            )
    return None


def ports_of_url(url: str) -> int | None:
    """The TCP port a URL connects to: explicit, else 80/443 by scheme."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        if parts.port is not None:
            return parts.port
    except ValueError:
        return None
    return {"http": 80, "https": 443}.get(parts.scheme)


_abi_lock = threading.Lock()
_abi: list[int] = []


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none), asked once per process through the shim's
    own wrapper (``agent_shim/shim_landlock.py``)."""
    with _abi_lock:
        if not _abi:
            module = importlib.import_module("agent_shim.shim_landlock")
            _abi.append(int(module.abi()))
        return _abi[0]


@dataclass
class PreparedSandbox:
    """One episode's sandbox, ready to spawn: the handshake part and the private TMPDIR."""

    plan: SandboxPlan
    tmpdir: str
    handshake: dict[str, Any]

    def report(
        self, missing_in_child: Iterable[str], abi: int, refused: Mapping[str, int] | None = None
    ) -> SandboxReport:
        missing = list(self.plan.missing) + [m for m in missing_in_child if m]
        return SandboxReport(
            landlock_abi=abi,
            mounts=bool(self.plan.mounts) or self.plan.unshare_mounts,
            enforced=tuple(self.plan.enforced),
            missing=tuple(dict.fromkeys(missing)),
            tmpdir=Path(self.tmpdir),
            refused=dict(refused or {}),
        )


def make_tmpdir_and_plan(
    sandbox: Sandbox,
    *,
    episode_id: str,
    cwd: str,
    child_env: dict[str, str],
    mountns: bool,
    can_unshare: bool,
    under: str | None = None,
) -> PreparedSandbox:
    """Make the private TMPDIR (in ``under``, a template's, if given) and the plan;
    SetupProblem when the machine cannot enforce the profile and ``best_effort`` is off.
    Blocking."""
    problem = write_paths_problem(sandbox, cwd)
    if problem is not None:
        raise SetupProblem(problem)
    abi = landlock_abi()
    if under is None and not _swept:
        _swept.append(True)
        sweep_stale_tmpdirs(tempfile.gettempdir())
    # The parent's pid and start time in the name: should it die, the next isolate process
    # knows whose this was.
    tmpdir = tempfile.mkdtemp(prefix=f"isolate-{episode_id}.o{_owner()}.", dir=under)
    try:
        found = plan_sandbox(
            sandbox,
            cwd=cwd,
            tmpdir=tmpdir,
            home_dirs=homes(child_env),
            abi=abi,
            mountns=mountns,
            can_unshare=can_unshare,
        )
    except BaseException:
        remove_tmpdir(tmpdir)
        raise
    if found.missing and not sandbox.best_effort:
        remove_tmpdir(tmpdir)
        raise SetupProblem(
            "sandbox: this machine cannot enforce "
            + "; ".join(found.missing)
            + " (Sandbox(best_effort=True) runs without it)"
        )
    return PreparedSandbox(found, tmpdir, found.handshake(sandbox.best_effort))


#: A TMPDIR whose parent is dead is removed by the next isolate process that makes one, once it
#: is this old (seconds): the dead parent's episodes may still be cleaning up in it.
STALE_TMPDIR_S = 300.0
_swept: list[bool] = []
_STALE = re.compile(r"isolate-.+\.o(\d+)-(\d+)\.[^.]+")


def _owner() -> str:
    return f"{os.getpid()}-{start_time(os.getpid())}"


def sweep_stale_tmpdirs(where: str, min_age: float = STALE_TMPDIR_S) -> int:
    """Remove the TMPDIRs in ``where`` of isolate parents that are dead (pid and start time no
    longer alive), at least ``min_age`` seconds old; how many. Blocking."""
    removed = 0
    try:
        entries = list(os.scandir(where))
    except OSError:
        return 0
    for entry in entries:
        found = _STALE.fullmatch(entry.name)
        if found is None or start_time(int(found[1])) == int(found[2]):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if time.time() - entry.stat(follow_symlinks=False).st_mtime < min_age:
                continue
        except OSError:
            continue
        remove_tmpdir(entry.path)
        removed += 1
    return removed


def remove_tmpdir(path: str) -> None:
    """Remove an episode's TMPDIR, whatever modes the agent left on what is inside."""
    try:
        os.rmdir(path)  # most often empty: one system call instead of rmtree's walk
        return
    except FileNotFoundError:
        return
    except OSError:
        pass

    def retry(func: Any, name: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(name), 0o700)
            if os.path.isdir(name) and not os.path.islink(name):
                os.chmod(name, 0o700)
                shutil.rmtree(name, ignore_errors=True)
            else:
                func(name)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)


def userns_problem() -> str | None:
    """Why this machine gives an unprivileged process no user namespace, or None. Blocking."""
    return probe("--probe-pidns", "userns").problem


def network_problem() -> str | None:
    """Why an episode cannot have a network of its own here, or None. Blocking."""
    if not sys.platform.startswith("linux"):
        return "network namespaces exist only on Linux"
    return probe("--probe-net").problem
