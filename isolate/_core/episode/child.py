"""The episode's first process, started fresh or forked from a template, behind one interface.

Its stdin and stdout are one end of a socket pair: the parent writes the handshake and a cancel
request on its end and reads frames from it. One fd less per episode than two pipes (the fd
budget), on both sides. stderr is a pipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import psutil

from .. import containment as _containment
from .. import templates as _templates
from ..containment import sandbox as _sandbox
from ..model.errors import SetupProblem
from ..system import pidns as _pidns
from ..system.tree import ProcessTree
from . import protocol as proto
from .prepare import Prepared, Request, handshake, make_leaves


class Child(Protocol):
    """What the launcher needs of the shim's process, however it was started."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: killed by that signal) once seen, else None."""

    @property
    def status_known(self) -> bool:
        """False when the exit status was lost (a template that died before reporting it)."""

    @property
    def alone(self) -> bool:
        """The agent's own process, supervised from the parent (a template's fork that is its
        own worker), rather than a shim that supervises the worker it forks."""

    @property
    def pid1(self) -> bool:
        """Started as PID 1 of a PID namespace of its own: until the shim sets its handler,
        SIGTERM does not reach it (the kernel spares PID 1 every signal it does not handle)."""

    @property
    def cpu_s(self) -> float | None:
        """The process's CPU time (seconds) where the parent learns it (``alone``), else None."""

    def stderr_fd(self) -> int: ...

    def poll(self) -> int | None: ...

    async def wait_exit(self) -> None:
        """Until the process has exited and its status is in (or known to be lost)."""

    def kill(self) -> None:
        """SIGKILL, if it is still there."""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process itself, if it is still there."""

    def wait(self) -> int:
        """Block until it has exited (for a start that failed half-way)."""

    def close(self) -> None:
        """Release what the parent holds of it; reaps it if it has exited."""


class Fresh:
    """A shim the parent started itself with ``subprocess``: its child, waited for by pidfd."""

    status_known = True
    #: A fresh shim supervises the worker it forks (``templates.Forked.alone``: a fork that
    #: is its own worker, supervised from the parent).
    alone = False
    cpu_s: float | None = None

    def __init__(self, popen: subprocess.Popen[bytes], pid1: bool) -> None:
        """``pid1``: started as PID 1 of a PID namespace of its own (:class:`Launch`)."""
        self.popen = popen
        self.pid = popen.pid
        self.pid1 = pid1
        self.pidfd: int | None = None

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def open_pidfd(self) -> None:
        """Open the pidfd ``wait_exit`` waits on, where the platform has them."""
        if hasattr(os, "pidfd_open"):
            try:
                self.pidfd = os.pidfd_open(self.pid)
            except OSError:
                self.pidfd = None

    def stderr_fd(self) -> int:
        assert self.popen.stderr is not None
        return self.popen.stderr.fileno()

    def poll(self) -> int | None:
        return self.popen.poll()

    async def wait_exit(self) -> None:
        if self.pidfd is not None:
            # Readable once the process has exited; poll() then reaps it without blocking.
            await anyio.wait_readable(self.pidfd)
            self.popen.poll()
            return
        while self.popen.poll() is None:  # noqa: ASYNC110 - no pidfd on this platform
            await anyio.sleep(0.01)

    def kill(self) -> None:
        self.popen.kill()

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait(self) -> int:
        return self.popen.wait()

    def close(self) -> None:
        if self.popen.stderr is not None:
            self.popen.stderr.close()
        if self.popen.returncode is None:
            self.popen.poll()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass(frozen=True)
class Launch:
    """How to start a fresh shim. ``pid1``: as PID 1 of a new PID namespace, made by the
    parent (``system.pidns``), so that the shim needs no relay outside it."""

    python: str
    shim: Path
    env: dict[str, str]
    cwd: Path | None
    pid1: bool = False


def start(
    launch: Launch, template: _templates.Template | None, episode_id: str, tag: str
) -> tuple[Child, int]:
    """Start the shim: forked from ``template`` when there is one, else fresh (``tag``: the
    episode's, which a fork sets in its environment). Returns the child
    and the parent's end of its socket; blocking (run it in a worker thread: fork+exec of a big
    parent must not stall the event loop). :class:`~isolate._core.templates.TemplateGone` when
    the template did not fork (then the caller starts it fresh, after its wait at the start
    gate); OSError from ``subprocess`` goes on."""

    def make(theirs: int) -> Child:
        if template is not None:
            # A fork that comes late holds this pair's end: EOF for it once we give up.
            return template.fork(episode_id, tag, theirs)
        born = _pidns.born_in_new() if launch.pid1 else contextlib.nullcontext()
        with born:
            popen = subprocess.Popen(
                [launch.python, "-I", str(launch.shim)],
                stdin=theirs,
                stdout=theirs,
                stderr=subprocess.PIPE,
                env=launch.env,
                cwd=launch.cwd,
                start_new_session=True,  # never preexec_fn: unsafe with threads, no vfork
                close_fds=True,
                bufsize=0,  # the pipe is read by fd: no 8 KiB buffer
            )
        return Fresh(popen, launch.pid1)

    started = _paired(make)
    assert started is not None
    return started


def start_parked(
    template: _templates.Template, episode_id: str, tag: str
) -> tuple[Child, int] | None:
    """A parked fork of ``template`` handed this episode, as :func:`start` would; None when
    none is left in its pool. Touches sockets and pipes only: it may run in the event loop."""
    return _paired(lambda theirs: template.take_parked(episode_id, tag, theirs))


def _paired(make: Callable[[int], Child | None]) -> tuple[Child, int] | None:
    """``make(fd)`` with the child's end of a new socket pair (closed here after): the child
    and the parent's end, both non-blocking; None (the pair closed) if it made none."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        child = make(theirs.fileno())
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    if child is None:
        ours.close()
        return None
    channel = ours.detach()
    for fd in (channel, child.stderr_fd()):
        os.set_blocking(fd, False)
    return child, channel


def move(child: Child, leaves: _containment.Leaves) -> None:
    """Put the child into its cgroup leaves; on failure kill it and raise :class:`SetupProblem`.

    A move waits for an RCU grace period (~10 ms here, as long as a plain interpreter takes to
    start) unless another move came just before. A fresh shim makes sure it is in its cgroups
    before it creates any process (joining by itself waits for this move to finish), so the
    move overlaps its start-up; a template's fork waits for it before its handshake."""
    problem = leaves.move(child.pid)
    if problem is not None:
        child.kill()
        child.wait()
        raise SetupProblem(problem)


def into_template(
    req: Request, prep: Prepared, child: Child, template: _templates.Template | None
) -> Prepared:
    """A template's fork goes into its leaf (before it may start anything; a parked fork is
    in leaves of its own already, which the episode takes instead of its own) and gets its
    sandbox under the template's, whose mounts are the fork's; the TMPDIR made for it before
    is removed. Returns what the episode runs with: ``prep`` itself for a fresh shim, or one
    with the fork's wall. Blocking; raises :class:`SetupProblem`, with the child killed."""
    if not isinstance(child, _templates.Forked):
        return prep
    assert template is not None
    adopted = None
    if prep.leaves is not None:
        if child.leaves is None:
            try:
                make_leaves(prep)
            except SetupProblem:
                child.kill()
                child.wait()
                raise
            move(child, prep.leaves)
        else:  # parked in leaves made ahead: the episode adopts them, no move
            made, adopted, child.leaves = prep.leaves, child.leaves, None
            prep = dataclasses.replace(prep, wall=dataclasses.replace(prep.wall, leaves=adopted))
            made.remove()
    old = prep.wall
    if old.sandbox is None or template.wall.sandbox is None:
        return prep
    try:
        wall = old.for_fork(req.spec, req.episode_id, template.wall)
    except (SetupProblem, OSError) as exc:
        child.kill()
        child.wait()
        if adopted is not None:  # the caller holds only the leaves made for the episode
            adopted.remove()
        if isinstance(exc, SetupProblem):
            raise
        # Its TMPDIR goes in the template's (removed from outside, say).
        raise SetupProblem(f"cannot make the fork's sandbox: {exc}") from None
    _sandbox.remove_tmpdir(old.sandbox.tmpdir)
    return dataclasses.replace(prep, wall=wall)


def send_handshake(
    req: Request, prep: Prepared, env: dict[str, str], child: Child, channel: int
) -> tuple[memoryview, ProcessTree]:
    """What follows the start (and :func:`into_template`), still in the worker thread: the
    handshake goes out (what the socket takes now); a fresh shim goes into its leaf. Returns
    what is left of the handshake and the episode's process tree. Raises
    :class:`SetupProblem`, with the child killed."""
    forked = isinstance(child, _templates.Forked)
    public = handshake(req, prep, env, forked=forked, pid1=child.pid1)
    line = proto.encode_handshake(public, req.secrets, req.secret_env)
    # Out at once, so the shim can read it as soon as it has started; the rest later.
    rest = write_some(channel, memoryview(line))
    if prep.leaves is not None and not forked:
        move(child, prep.leaves)  # overlaps the shim's start-up
    tree = ProcessTree(_process(child), child.pid, req.tag, prep.leaves, shim_counts=child.alone)
    if isinstance(child, Fresh):
        child.open_pidfd()
    return rest, tree


def _process(child: Child) -> psutil.Process | Callable[[], psutil.Process | None] | None:
    """The child as psutil sees it, for its process tree; for a fork with a pidfd, a function
    that finds it once the tree first asks (a teardown that has to look, in a worker thread:
    not on every hand-over)."""
    if isinstance(child, _templates.Forked) and child.pidfd is not None:
        return functools.partial(_forked_process, child)
    # After the move: reading /proc/PID/stat of a process that is still in exec takes ~2 ms.
    try:
        shim = psutil.Process(child.pid)
    except (psutil.Error, OSError):  # only an error of Popen itself is worth a retry
        return None
    if isinstance(child, _templates.Forked) and child.poll() is not None:
        # Not our child: a pid its template has reaped may be reused at once.
        return None
    return shim


def _forked_process(forked: _templates.Forked) -> psutil.Process | None:
    """A template's fork as psutil sees it, None once it has exited: its pid, not ours to
    reap, may be another process's by then. Its pidfd says whether the handle can be another
    process (safe from any thread, unlike its reply socket)."""
    try:
        found = psutil.Process(forked.pid)
    except (psutil.Error, OSError):
        return None
    return None if forked.has_exited() else found


def write_some(fd: int, data: memoryview) -> memoryview:
    """Write as much of ``data`` as ``fd`` (non-blocking) takes now; what is left of it. Empty
    once all is out, and when the child is gone (its exit says why)."""
    try:
        while data:
            data = data[os.write(fd, data) :]
    except BlockingIOError:
        pass
    except (BrokenPipeError, ConnectionResetError):
        data = memoryview(b"")
    return data
