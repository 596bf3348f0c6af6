"""Test toolkit: real processes only. Agents are small files written to tmp_path; processes
they start write pid files; every test proves afterwards that no process of it is left, no
zombie isolate failed to reap, and no cgroup leaf of the run (docs/testing.md)."""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import hypothesis
import psutil
import pytest

import isolate

# The plugin below, imported here first: marked for assertion rewriting before that import.
pytest.register_assert_rewrite("tests._skips")
from . import _internals  # noqa: E402
from ._skips import _is_containment, _reason, on_ci  # noqa: E402

# The skip summary line, and no skipped containment test on CI (see tests/_skips.py; the
# hooks below fail the other skips on CI); pytester, to prove that.
pytest_plugins = ["tests._skips", "pytester"]


def _slow() -> float:
    """How much slower than the development machine this one may be: every wall-clock bound
    of the suite is multiplied by it. ``ISOLATE_TEST_SLOW`` sets it (say 4 on a loaded machine);
    by default 3 on CI (slower and shared), else 1."""
    value = os.environ.get("ISOLATE_TEST_SLOW", "").strip()
    if not value:
        return 3.0 if on_ci() else 1.0
    try:
        factor = float(value)
    except ValueError:
        raise pytest.UsageError(f"ISOLATE_TEST_SLOW must be a number, got {value!r}") from None
    if not factor >= 1.0:
        raise pytest.UsageError(f"ISOLATE_TEST_SLOW must be at least 1, got {value!r}")
    return factor


#: The factor of every wall-clock bound: a wait's timeout, a duration's upper bound.
SLOW = _slow()

# Hypothesis's deadline per example (200 ms unless a test sets its own) is one as well.
# On CI the examples are derived from each test's name, not drawn afresh: a red run is red again
# on a rerun and on a laptop (``--hypothesis-profile=isolate-ci``), and a green one stays green.
# Elsewhere every run draws new examples, and a failure prints the seed that reproduces it.
_DEADLINE = datetime.timedelta(seconds=0.2 * SLOW)
hypothesis.settings.register_profile("isolate", deadline=_DEADLINE)
hypothesis.settings.register_profile(
    "isolate-ci", deadline=_DEADLINE, derandomize=True, database=None, print_blob=True
)
hypothesis.settings.load_profile("isolate-ci" if on_ci() else "isolate")


# --- skips on CI --------------------------------------------------------------------------------

#: What a test may skip for on CI: a program that the README's test command (``make test``,
#: which installs the project and its dev extras into .venv, nothing else) does not install,
#: each a pattern its skip reasons match, with the package that brings it. Every other skip
#: on CI is a failure: a dev extra that did not import (rich, Ray), a kernel feature, root, a
#: containment layer (tests/_skips.py) all mean the machine is not the one CI promises.
CI_MAY_LACK: dict[str, tuple[str, str]] = {
    "other Pythons": (
        r"python ?3\.\d+|Python 3\.\d+|this Python version|no interpreter the unprivileged",
        "CPython 3.8, 3.9, 3.10, 3.13 (pyenv builds) and the system's python3, for the agent's "
        "interpreter: make test makes only the project's .venv",
    ),
    "pkill": (r"\bpkill\b", "procps"),
    "unshare, setpriv, mount": (r"\b(unshare|setpriv|mount)\b", "util-linux"),
    "kernel headers": (r"\bkernel headers\b", "linux-libc-dev, for the system call numbers"),
    "strace": (r"\bstrace\b", "strace, to watch the batch driver's system calls"),
}
_MAY_LACK = re.compile("|".join(f"(?:{pattern})" for pattern, _ in CI_MAY_LACK.values()))


def ci_skip_allowed(reason: str) -> bool:
    """Whether a test may skip on CI for ``reason``: it names a program CI_MAY_LACK lists."""
    return _MAY_LACK.search(reason) is not None


def _fail_skip_on_ci(report: pytest.TestReport | pytest.CollectReport, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"skipped on CI (CI={os.environ.get('CI')}), for a reason that names no program "
        f"make test leaves out (tests/conftest.py, CI_MAY_LACK): {reason}"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome: Any = yield
    report: pytest.TestReport = outcome.get_result()
    if not (report.skipped and on_ci()) or hasattr(report, "wasxfail"):
        return
    reason = _reason(report)
    if not _is_containment(item, reason) and not ci_skip_allowed(reason):
        _fail_skip_on_ci(report, reason)  # a containment skip: tests/_skips.py fails it


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A whole module skipped (``allow_module_level``) counts the same; collection then stops
    with the error, as for any module that fails to collect."""
    outcome: Any = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and on_ci():
        reason = _reason(report)  # type: ignore[arg-type]
        if not ci_skip_allowed(reason):
            _fail_skip_on_ci(report, reason)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's bound on each test (``timeout`` in pyproject.toml) is a wall-clock
    bound too: scaled by SLOW, unless given on the command line or by a test's own marker."""
    if SLOW == 1.0 or config.getoption("timeout", None) is not None:
        return
    base = float(config.getini("timeout") or 0)
    if base <= 0:
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(base * SLOW))


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


async def cancelled_once(
    spec: isolate.EpisodeSpec, ready: Callable[[], Awaitable[object]]
) -> tuple[float, isolate.EpisodeOutcome]:
    """Run an episode of ``spec`` and cancel its caller once ``ready()`` has returned:
    ``run_episode`` must not return. When the cancellation came (``time.monotonic()``), and the
    outcome ``on_end`` gave after the teardown."""
    ended: list[isolate.EpisodeOutcome] = []
    cancelled_at = 0.0
    async with anyio.create_task_group() as tg:

        async def cancel_when_ready() -> None:
            nonlocal cancelled_at
            await ready()
            cancelled_at = time.monotonic()
            tg.cancel_scope.cancel()

        tg.start_soon(cancel_when_ready)
        await isolate.run_episode(spec, {}, on_end=ended.append)
        pytest.fail("run_episode returned instead of being cancelled")
    assert tg.cancel_scope.cancelled_caught
    (outcome,) = ended
    return cancelled_at, outcome


def is_gone(pid: int, create_time: float | None = None) -> bool:
    """Gone means: no such pid, no live thread (a zombie whose every thread exited), or the pid
    now belongs to a newer process. A process whose main thread exited reads as a zombie while
    its other threads run on: it is not gone."""
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 0.01:
            return True
        return proc.status() == psutil.STATUS_ZOMBIE and not _internals.has_live_thread(pid)
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
                if proc.status() != psutil.STATUS_ZOMBIE or _internals.has_live_thread(proc.pid):
                    found.append(proc)
            except psutil.Error:
                continue
    return found


def live_children() -> list[psutil.Process]:
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE or _internals.has_live_thread(proc.pid):
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
    """Fail the test if any process it started outlives it, if isolate left a zombie of its
    own, or if a cgroup leaf of this run is left on disk; then clean each up, so the next test
    starts clean.

    Authoritative: with the test process as subreaper, every live descendant is one of this
    run's processes, in a PID namespace or not, tagged or not. Where there is no subreaper,
    processes whose PID_DIR lies under this run's temporary directory (see :class:`Agents`) are
    this run's too; the trailing slash keeps ``pytest-1`` from matching a concurrent run's
    ``pytest-12``. A zombie child of the test process is isolate's own when the process that
    started it (see :func:`own_zombies`) ran the shim or isolate; other zombie children are
    orphans re-parented to the subreaper, reaped here in silence. Leaves: see
    :func:`run_leaves`."""
    basetemp = tmp_path_factory.getbasetemp()
    marker = run_marker(basetemp)
    yield
    left = {p.pid: p for p in episode_processes(marker) + live_children()}
    described = [f"{p.pid} {_cmd(p)}" for p in left.values()]
    zombies = own_zombies()  # before the kills below make more
    for proc in left.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    try:
        wait_for(lambda: all(_dead(p) for p in left.values()), 10.0, "the leftovers to die")
    except AssertionError as exc:
        described.append(str(exc))
    _reap_zombies()
    leaves = run_leaves(basetemp)
    for leaf in leaves:
        _remove_leaf(leaf)
    problems = []
    if left:
        problems.append(f"processes left behind: {described}")
    if zombies:
        problems.append(f"zombies isolate left unreaped: {zombies}")
    if leaves:
        problems.append(f"cgroup leaves left behind: {[str(p) for p in leaves]}")
    if problems:
        pytest.fail("; ".join(problems))


def run_marker(basetemp: Path) -> bytes:
    """What the environment of a process of this run holds: PID_DIR under ``basetemp``."""
    return f"\0PID_DIR={basetemp}/".encode()


def _cgroup_roots() -> list[Path]:
    groups = _internals.cgroups()
    return [r for r in [groups.v2, *groups.v1.values()] if r is not None]


def remove_dead_parents_leaves() -> None:
    """Remove the cgroup leaves of isolate parents that died without removing them, as the
    next isolate process to start does: for a test that killed one (no_process_left fails a
    test that leaves them)."""
    _internals.clean_stale(_cgroup_roots())


def own_leaves() -> list[Path]:
    """Cgroup leaves of episodes this process started that still exist."""
    found: list[Path] = []
    for root in _cgroup_roots():
        try:
            found += [p for p in (root / _internals.owner_name()).iterdir() if p.is_dir()]
        except OSError:
            continue  # no episode of this process used this root
    return found


#: The test process's start, in clock ticks since boot: what a cgroup owner's name records.
_SESSION_START = _internals.start_time(os.getpid()) or 0
#: Leaves of dead owners already judged (by path): the basetemp scan runs once per leaf.
_judged: dict[Path, bool] = {}


def run_leaves(basetemp: Path) -> list[Path]:
    """Cgroup leaves of this test run still on disk, whoever made them: this process, an
    isolate CLI or script it started, or any process below those.

    A leaf is ``<root>/isolate/<owner pid>.<owner start>/<episode id>.<random>`` (see
    :class:`isolate._core.containment.Leaves`). Its owner is this run's when it is this
    process, or alive and a descendant of it. An owner that died without removing its leaves
    (killed, or crashed) is this run's when it started after this test process did and the
    leaf's episode id names a file or directory under ``basetemp``: the episode's log
    (``<log_dir>/<episode id>.log``) or the CLI's log bundle (``<log dir>/<episode id>/``);
    episode ids end in 8 random hex digits, so another run's cannot name one. A leaf of a
    concurrent run (its pytest process, its CLI processes alive or dead) is none of these.
    A dead owner of this run whose episode had no log directory under ``basetemp`` goes
    unseen, and so does a leaf another isolate process removed first (any isolate process
    that starts removes the leaves of dead owners)."""
    me = psutil.Process()
    found: list[Path] = []
    for root in _cgroup_roots():
        try:
            owners = [p for p in root.iterdir() if re.fullmatch(r"\d+\.\d+", p.name)]
        except OSError:
            continue
        for owner in owners:
            try:
                leaves = [p for p in owner.iterdir() if p.is_dir()]
            except OSError:
                continue  # removed meanwhile
            if not leaves:
                continue
            pid, start = (int(x) for x in owner.name.split("."))
            if pid == me.pid and start == _SESSION_START:
                found += leaves
            elif _internals.start_time(pid) == start:
                if _descends_from(pid, me):
                    found += leaves
            elif start >= _SESSION_START:
                found += [leaf for leaf in leaves if _named_under(leaf, basetemp)]
    return found


def _descends_from(pid: int, ancestor: psutil.Process) -> bool:
    try:
        return any(p.pid == ancestor.pid for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def _named_under(leaf: Path, basetemp: Path) -> bool:
    """Whether the episode id of ``leaf`` (its name less the random suffix) names a log file
    or log directory somewhere under ``basetemp``."""
    if leaf not in _judged:
        episode_id = leaf.name.rpartition(".")[0]
        names = {f"{episode_id}.log", episode_id}
        _judged[leaf] = any(
            names.intersection(dirs) or names.intersection(files)
            for _, dirs, files in os.walk(basetemp)
        )
    return _judged[leaf]


def _dead(proc: psutil.Process) -> bool:
    """Gone, or a zombie with no live thread: what a SIGKILLed process is about to be."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE and not _internals.has_live_thread(proc.pid)
    except psutil.Error:
        return True


def _remove_leaf(leaf: Path) -> None:
    """Kill what is in ``leaf``, remove it with the cgroups made inside it, and its owner's
    directory once that is empty: the next test starts clean."""

    def empty() -> bool:
        if not _internals.leaf_procs(leaf) and not _internals.leaf_populated(leaf):
            return True
        _internals.kill_leaf(leaf)
        return False

    try:
        wait_for(empty, 5.0, f"{leaf} to empty")
    except AssertionError:
        return  # the failure names the leaf already
    try:
        _internals.remove_leaf(leaf)
        leaf.parent.rmdir()
    except OSError:
        pass  # still populated, or the owner has other leaves: the failure says so


def own_zombies() -> list[str]:
    """Zombie children of the test process that isolate started (the shim, a template, the
    isolate command) and never reaped: ``pid command`` each. A zombie has no command line of
    its own left; the :class:`subprocess.Popen` that started it, still in this process and
    never told of the exit, has."""
    zombies = {
        proc.pid
        for proc in psutil.Process().children()
        if _status(proc) == psutil.STATUS_ZOMBIE and not _internals.has_live_thread(proc.pid)
    }
    if not zombies:
        return []
    found = []
    for popen in _popens():
        if popen.pid in zombies and popen.returncode is None and _is_isolate(popen.args):
            found.append(f"{popen.pid} {_args_text(popen.args)}")
    return found


def _popens() -> list[subprocess.Popen[Any]]:
    """Every Popen object of this process: alive, or collected and kept by subprocess for
    reaping (its ``_active`` list)."""
    found = [o for o in gc.get_objects() if isinstance(o, subprocess.Popen)]
    active = getattr(subprocess, "_active", None) or []
    return found + [p for p in active if p not in found]


def _is_isolate(args: Any) -> bool:
    """Whether a command line is one of isolate's: the shim or a template (a file of the
    ``agent_shim`` package), or the isolate command (``python -m isolate``, ``isolate``)."""
    argv = [os.fsdecode(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
    if any("agent_shim" in Path(arg).parts for arg in argv):
        return True
    if any(argv[i : i + 2] == ["-m", "isolate"] for i in range(len(argv))):
        return True
    return bool(argv) and Path(argv[0]).name == "isolate"


def _args_text(args: Any) -> str:
    argv = [os.fsdecode(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
    return " ".join(argv)[:120]


def _status(proc: psutil.Process) -> str | None:
    try:
        return str(proc.status())
    except psutil.Error:
        return None


def _reap_zombies() -> None:
    """Reap every zombie child of the test process: isolate's own (through its Popen, which
    then knows the exit), and orphans re-parented to the subreaper."""
    zombies = {p.pid for p in psutil.Process().children() if _status(p) == psutil.STATUS_ZOMBIE}
    zombies = {pid for pid in zombies if not _internals.has_live_thread(pid)}
    if not zombies:
        return
    for popen in _popens():
        if popen.pid in zombies and popen.returncode is None:
            popen.poll()
            zombies.discard(popen.pid)
    for pid in zombies:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return "?"


# --- an unprivileged user ---------------------------------------------------------------------

#: The user the tests act as when they need a trainer without privileges.
#: Agent code: ``mark(name)`` makes a file in PID_DIR, ``wait(name)`` waits for one there.
MARKS = """
import os, time


def mark(name):
    open(os.path.join(os.environ["PID_DIR"], name), "w").close()


def wait(name):
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], name)):
        time.sleep(0.01)
"""

NOBODY = 65534
#: The argv prefix that runs a command as that user, with no supplementary group.
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def as_nobody(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AS_NOBODY, *argv], capture_output=True, text=True, **kwargs)


def unprivileged_python(repo: Path) -> tuple[str, dict[str, str]] | str:
    """An interpreter the unprivileged user can run isolate with (and exec from its own
    processes: the shim's spawn and probes have no capability to pass a closed directory), and
    the environment that makes isolate importable there; or why there is none."""
    site = next(iter(Path(sys.prefix).glob("lib/python*/site-packages")), None)
    candidates = [(sys.executable, {})]
    if site is not None:
        for other in ("/usr/bin/python3", "/usr/local/bin/python3"):
            candidates.append((other, {"PYTHONPATH": f"{repo}{os.pathsep}{site}"}))
    why = []
    for python, env in candidates:
        # Exec'd by a process of that user, as the shim's parent does; imports isolate.
        check = as_nobody(
            ["sh", "-c", 'exec "$0" -c "import isolate, sys; print(sys.version_info[:2])"', python],
            env={**os.environ, **env},
            timeout=60 * SLOW,
        )
        if check.returncode == 0 and check.stdout.strip() == str(sys.version_info[:2]):
            return python, env
        why.append(f"{python}: {(check.stderr.strip().splitlines() or [check.stdout])[-1]}")
    return "; ".join(why)


@pytest.fixture
def nobody() -> tuple[str, dict[str, str]]:
    """An interpreter the unprivileged user can run isolate with, and the environment it needs
    (``PATH`` included); the test is skipped where there is none (not root, no setpriv)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to act as an unprivileged user (nobody)")
    found = unprivileged_python(Path(isolate.__file__).resolve().parent.parent)
    if isinstance(found, str):
        pytest.skip(f"no interpreter the unprivileged user can run isolate with: {found}")
    python, env = found
    return python, {"PATH": os.environ["PATH"], **env}


#: Runs one episode of the spec given as JSON with the data given as JSON, and prints its
#: outcome as JSON: a trainer of another user, in a process of its own.
RUN_SPEC = """
import anyio, json, sys
import isolate

async def main():
    spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
    outcome = await isolate.run_episode(spec, json.loads(sys.argv[2]))
    print(json.dumps(json.loads(outcome.model_dump_json())))

anyio.run(main)
"""


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
        (``preload``) are not an episode's, nor the forks they keep parked (with the
        workers those forked ahead), which write to their template's log until they are
        handed an episode: the specs made here name a log directory."""
        marker = f"\0PID_DIR={self.pids}\0".encode()
        own, logs = _internals.templates_logs()
        return [
            p
            for p in episode_processes(marker)
            if p.pid not in own and not _internals.writes_to(p.pid, logs)
        ]

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
    _internals.close_all()
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
