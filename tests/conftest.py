"""Test toolkit: real processes only. Agents are small files written to tmp_path; processes
they start write pid files; every test proves afterwards that no process of it is left."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import isolate
from isolate._core import containment as _containment
from isolate._core import templates as _templates
from isolate._core.tree import has_live_thread

# The skip summary line, and no skipped containment test on CI (see tests/_skips.py);
# pytester, to prove that.
pytest_plugins = ["tests._skips", "pytester"]

# CI machines are slower and shared: scale every bounded wait.
SLOW = 3.0 if os.environ.get("CI") else 1.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    end = time.monotonic() + timeout * SLOW
    delay = 0.005
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout * SLOW:.1f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


async def wait_until(predicate: Callable[[], Any], seconds: float = 10.0) -> None:
    """Async ``wait_for``: poll a file-system condition from inside an event loop."""
    with anyio.fail_after(seconds * SLOW):
        while not predicate():  # noqa: ASYNC110 - the condition is a file, not an event
            await anyio.sleep(0.01)


def is_gone(pid: int, create_time: float | None = None) -> bool:
    """Gone means: no such pid, no live thread (a zombie whose every thread exited), or the pid
    now belongs to a newer process. A process whose main thread exited reads as a zombie while
    its other threads run on: it is not gone."""
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 0.01:
            return True
        return proc.status() == psutil.STATUS_ZOMBIE and not has_live_thread(pid)
    except psutil.NoSuchProcess:
        return True


def episode_processes(marker: bytes = b"") -> list[psutil.Process]:
    """Live processes on the machine that carry an isolate episode tag in their environment
    (and ``marker``, when given)."""
    needle = f"{isolate.EPISODE_ENV}=".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        environ = b"\0" + environ  # every entry between NULs: a marker can name a whole entry
        if b"\0" + needle in environ and marker in environ:
            try:
                proc = psutil.Process(int(name))
                if proc.status() != psutil.STATUS_ZOMBIE or has_live_thread(proc.pid):
                    found.append(proc)
            except psutil.Error:
                continue
    return found


def live_children() -> list[psutil.Process]:
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE or has_live_thread(proc.pid):
                out.append(proc)
        except psutil.Error:
            continue
    return out


_PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture(scope="session", autouse=True)
def subreaper() -> bool:
    """Make the test process a child subreaper (Linux), as the shim's supervisor is: every
    process the run starts stays its descendant, even one that double-forks and setsid()s away
    from an episode whose supervisor died, or that drops every environment tag. Without it such
    a process is re-parented to PID 1 and no scan can tell it from anyone else's."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


@pytest.fixture(autouse=True)
def no_process_left(subreaper: bool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fail the test if any process it started outlives it, or a cgroup leaf of its episodes.

    Authoritative: with the test process as subreaper, every live descendant is one of this
    run's processes, in a PID namespace or not, tagged or not; at the cgroup level every leaf
    this process made must be removed. Where there is no subreaper, processes whose PID_DIR lies
    under this run's temporary directory (see :class:`Agents`) are this run's too; the trailing
    slash keeps ``pytest-1`` from matching a concurrent run's ``pytest-12``."""
    marker = run_marker(tmp_path_factory.getbasetemp())
    yield
    left = {p.pid: p for p in episode_processes(marker) + live_children()}
    leaves = own_leaves()
    _reap_orphans()
    if left:
        described = [f"{p.pid} {_cmd(p)}" for p in left.values()]
        for proc in left.values():
            try:
                proc.kill()
            except psutil.Error:
                pass
        pytest.fail(f"processes left behind: {described}")
    if leaves:
        pytest.fail(f"cgroup leaves left behind: {[str(p) for p in leaves]}")


def run_marker(basetemp: Path) -> bytes:
    """What the environment of a process of this run holds: PID_DIR under ``basetemp``."""
    return f"\0PID_DIR={basetemp}/".encode()


def own_leaves() -> list[Path]:
    """Cgroup leaves of episodes this process started that still exist."""
    groups = _containment.cgroups()
    roots = [r for r in [groups.v2, *groups.v1.values()] if r is not None]
    found: list[Path] = []
    for root in roots:
        try:
            found += [p for p in (root / _containment._owner_name()).iterdir() if p.is_dir()]
        except OSError:
            continue  # no episode of this process used this root
    return found


def _reap_orphans() -> None:
    """Reap the zombies of orphans re-parented to the test process. Its own children are
    waited for by whoever started them, by the end of the test."""
    for proc in psutil.Process().children():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(proc.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            continue


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return "?"


class Agents:
    """Write agent modules into a fresh agent root and build specs for them."""

    def __init__(self, tmp_path: Path, *, preload: bool = False) -> None:
        self.preload = preload
        self.root = tmp_path / "agent_root"
        self.root.mkdir()
        self.pids = tmp_path / "pids"
        self.pids.mkdir()
        self.logs = tmp_path / "logs"
        self.tmp = tmp_path
        self._n = 0

    def spec(self, code: str, *, function: str = "run", **overrides: Any) -> isolate.EpisodeSpec:
        """A spec whose entrypoint is ``function`` in a new module holding ``code``."""
        self._n += 1
        module = f"agent_{self._n}"
        (self.root / f"{module}.py").write_text(textwrap.dedent(code))
        fields: dict[str, Any] = {
            "agent_root": self.root,
            "entrypoint": f"{module}:{function}",
            "timeout": 30.0,
            "kill_grace": 1.0,
            "log_dir": self.logs,
            "env": {"PID_DIR": str(self.pids)},
        }
        if self.preload:
            fields["preload"] = True
        fields.update(overrides)
        return isolate.EpisodeSpec(**fields)

    def left(self) -> list[psutil.Process]:
        """Live processes of this test's episodes, by the PID_DIR in their environment. Judge
        by this, not by recorded pids: inside a PID namespace those are the namespace's
        numbers, and on the host they name unrelated processes. Running templates
        (``preload``) are not an episode's."""
        templates = {t.pid for t in _templates.started_templates()}
        procs = episode_processes(f"\0PID_DIR={self.pids}\0".encode())
        return [p for p in procs if p.pid not in templates]

    def pid_files(self) -> dict[str, int]:
        """The pids recorded so far. A ``.tmp`` file is a record being written: it may be
        empty, or renamed between the listing and the read."""
        found = {}
        for path in self.pids.iterdir():
            if path.suffix == ".tmp":
                continue
            text = path.read_text()
            if text.strip():
                found[path.name] = int(text)
        return found

    def wait_pids(self, count: int, timeout: float = 10.0) -> dict[str, int]:
        return wait_for(
            lambda: (lambda d: d if len(d) >= count else None)(self.pid_files()),
            timeout,
            f"{count} pid files",
        )


@pytest.fixture(scope="session")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a fresh virtualenv with nothing installed: no isolate, no pydantic,
    no pip."""
    path = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "bin" / "python"


@pytest.fixture
def agents(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Agents]:
    """Agents whose specs start fresh, or (``@both_starts``) also from a preloaded template."""
    start = getattr(request, "param", "fresh")
    agents = Agents(tmp_path, preload=start == "template")
    yield agents
    _templates.close_all()
    if agents.preload:
        # Proof that the template path ran: every episode's log says it was forked.
        logs = [p.read_text() for p in agents.logs.glob("*.log") if p.name[:9] != "template."]
        assert not [log for log in logs if "starts fresh" in log]
        ended = [log for log in logs if "[isolate] episode " in log]  # its summary line
        assert all("forked from template." in log for log in ended)


#: Run a test with a fresh start and with a preloaded template (``EpisodeSpec.preload``).
both_starts = pytest.mark.parametrize("agents", ["fresh", "template"], indirect=True)
#: Run a test with a preloaded template only.
from_template = pytest.mark.parametrize("agents", ["template"], indirect=True)


# A shell snippet that records its own pid under $PID_DIR/<name>; for agents' grandchildren.
def record_pid_sh(name: str) -> str:
    return f'echo $$ > "$PID_DIR/{name}.tmp" && mv "$PID_DIR/{name}.tmp" "$PID_DIR/{name}"'


PYTHON = sys.executable
