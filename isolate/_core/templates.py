"""Preloaded templates (``EpisodeSpec.preload``): episodes forked from a shim that imported the
agent once.

A template is a shim process under the agent's interpreter that imported the entrypoint's
module (and ``spec.preload``) and never runs an episode; the child side, and the messages, are
in ``agent_shim/shim_template.py``. For each episode the parent makes the usual three pipes and
hands the child's ends to the template over a Unix socket (SCM_RIGHTS); the template forks, and
the fork runs the shim exactly as a fresh start does. So the handshake, the protocol and the
pipe-EOF watch stay as they are; only the exit status comes another way: from the template,
the fork's parent.

One template per key: everything a fork inherits (interpreter, agent root, entrypoint,
environment, working directory, containment, preload list). Episodes that need a template while
it starts wait for it. A template that cannot be used (not importable, a thread running after
import, a socket open) is refused for its key until :func:`close_templates`: its episodes start
fresh, with the reason in their logs. One that dies is replaced by the next episode.

Everything here but :func:`acquire` and :func:`close_templates` blocks: run it in a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import anyio
import psutil

from agent_shim.shim_wire import EPISODE_ENV, json_file, receive_message, send_message

from . import admission as _admission
from . import containment as _containment
from . import sandbox as _sandbox
from .config import EpisodeSpec
from .env import split_env
from .outcome import describe_exit, signal_name
from .procfs import exited, parent_pid
from .shim import boot_path
from .tree import ProcessTree

#: A template answers a fork request within milliseconds; one that does not is stuck (seconds).
_FORK_TIMEOUT_S = 10.0
#: After the fork has exited, how long its status may take to come from the template (seconds).
_STATUS_WAIT_S = 2.0
#: After its control socket closes, how long a template gets to exit before SIGKILL (seconds).
_CLOSE_GRACE_S = 2.0
#: ``returncode`` of a fork whose template died before reporting its exit status.
_UNKNOWN = 255


class TemplateGone(Exception):
    """The template did not fork the episode (it died, or is stuck); the episode starts fresh."""


_send, _receive = send_message, receive_message


def pidfd_pid(pidfd: int) -> int | None:
    """The pid, in our PID namespace, of the process a pidfd refers to; None if it is gone or
    the fd is no pidfd. (A template in a namespace of its own knows only its own numbers.)"""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}") as f:
            for line in f:
                if line.startswith("Pid:"):
                    pid = int(line.split()[1])
                    return pid if pid > 0 else None
    except (OSError, ValueError, IndexError):
        pass
    return None


class Forked:
    """The parent's handle on one episode forked from a template (a ``child.Child``). Its exit
    status comes from the template, the fork's parent, on the fork's reply socket."""

    def __init__(
        self,
        pid: int,
        pidfd: int | None,
        reply: socket.socket,
        err: int,
        template: Template | None = None,
    ) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.reply = reply
        self.template = template
        # Its stdin and stdout are the launcher's channel socket, as for a fresh start.
        self.stderr: IO[bytes] = open(err, "rb", buffering=0)  # noqa: SIM115 - in close()
        self.returncode: int | None = None
        #: False when the template died before it could report the exit status.
        self.status_known = True
        self._eof = False
        reply.setblocking(False)

    def stderr_fd(self) -> int:
        return self.stderr.fileno()

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal) once known, else None."""
        while self.returncode is None and not self._eof:
            try:
                message, fds = _receive(self.reply)
            except BlockingIOError:
                break
            except (OSError, ValueError):
                message, fds = None, []
            for fd in fds:
                os.close(fd)
            if message is None:
                self._eof = True  # the template is gone: wait for the fork itself
            elif message.get("t") == "exit" and isinstance(message.get("status"), int):
                self.returncode = os.waitstatus_to_exitcode(message["status"])
        if self.returncode is None and self._eof and self._exited():
            self.returncode, self.status_known = _UNKNOWN, False
        return self.returncode

    def _exited(self) -> bool:
        if self.pidfd is not None:
            return bool(select.select([self.pidfd], [], [], 0)[0])
        return exited(self.pid)

    async def wait_exit(self) -> None:
        """Until the fork has exited and its status is in (or known to be lost)."""
        if self.poll() is not None:
            return
        if self.pidfd is not None:
            await anyio.wait_readable(self.pidfd)
        else:
            while not self._exited():  # noqa: ASYNC110 - no pidfd on this platform
                await anyio.sleep(0.01)
        # The template reaps it at once; should the template be stopped, the status is lost.
        with anyio.move_on_after(_STATUS_WAIT_S):
            while self.poll() is None and not self._eof:
                await anyio.wait_readable(self.reply.fileno())
        if self.returncode is None:
            self.returncode, self.status_known = _UNKNOWN, False

    def kill(self) -> None:
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass  # gone already

    def wait(self) -> int:
        """Block until the fork has exited (for a spawn that failed half-way)."""
        end = time.monotonic() + _STATUS_WAIT_S
        while self.poll() is None and (not self._exited() or time.monotonic() < end):
            time.sleep(0.005)
        if self.returncode is None:
            self.returncode, self.status_known = _UNKNOWN, False
        return self.returncode

    def close(self) -> None:
        self.stderr.close()
        if self.returncode is None:
            self.poll()
        self.reply.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.template is not None:
            self.template.fork_ended(self)
            self.template = None


class Template:
    """One running template: its outer process, the importer, the control socket, and the
    importer's cgroup leaf. With a PID namespace the outer process's child is the
    namespace's PID 1, which outlives the importer until the last fork has ended."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        control: socket.socket,
        life: socket.socket,
        leaves: _containment.Leaves | None,
        name: str,
        sandbox: _sandbox.PreparedSandbox | None = None,
    ) -> None:
        self.popen = popen
        self.control = control
        #: Held for as long as the template may live: EOF there tells the outer process that
        #: we are gone. The importer's wait status comes back on it.
        self.life = life
        self.leaves = leaves
        self.name = name
        #: The sandbox every fork's own is carved from: its TMPDIR holds theirs.
        self.sandbox = sandbox
        #: What the importer enters before it imports: an episode's containment.
        self.wall: dict[str, Any] = {}
        self.importer: int | None = None
        self.importer_fd: int | None = None
        self.status: int | None = None
        self.forks: set[Forked] = set()
        self.closing = False
        self._finished = False
        self._forks_lock = threading.Lock()
        #: Its control and life sockets, counted in the episodes' fd budget while it runs.
        self.fds: _admission.Hold | None = None

    @property
    def pid(self) -> int:
        """The importer's pid (the process holding the agent's code), once it is ready."""
        return self.importer if self.importer is not None else self.popen.pid

    def ready(self, pidfd: int | None) -> str | None:
        """Take the importer's pidfd from its ready message; a problem if it names anything
        but the outer process's child or grandchild."""
        if pidfd is None:
            return "the template's ready message carried no pidfd of its own"
        pid = pidfd_pid(pidfd)
        if pid is None:
            os.close(pidfd)
            return "the template's ready message carried no pidfd of its own"
        up = parent_pid(pid)
        if self.popen.pid not in (up, parent_pid(up) if up is not None else None):
            os.close(pidfd)
            return f"the template's ready message named process {pid}, not its own"
        self.importer, self.importer_fd = pid, pidfd
        return None

    def own_pids(self) -> set[int]:
        """The template's own processes: the outer one, PID 1 of its namespace (if it has
        one) and the importer."""
        pids = {self.popen.pid}
        if self.importer is not None:
            pids.add(self.importer)
            up = parent_pid(self.importer)
            if up is not None and parent_pid(up) == self.popen.pid:
                pids.add(up)
        return pids

    def alive(self) -> bool:
        if self.importer_fd is not None:
            return not select.select([self.importer_fd], [], [], 0)[0]
        return self.popen.poll() is None

    def death(self) -> str:
        """How the dead template's importer ended, in words."""
        end = time.monotonic() + _STATUS_WAIT_S
        while self.status is None and self.life.fileno() >= 0:
            # Its parent sends it once it has reaped it: just after the pidfd said so.
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.life], [], [], left)[0]:
                break
            try:
                message, fds = _receive(self.life)
            except (BlockingIOError, OSError, ValueError):
                break
            for fd in fds:
                os.close(fd)
            if message is None:
                break
            if message.get("t") == "exit" and isinstance(message.get("status"), int):
                self.status = message["status"]
        if self.status is None:
            code = self.popen.returncode  # the outer process: killed, say, by close_templates()
            return describe_exit(None, signal_name(-code)) if code and code < 0 else "ended"
        try:
            code = os.waitstatus_to_exitcode(self.status)
        except ValueError:
            return "ended"
        if code < 0:
            return describe_exit(None, signal_name(-code))
        return describe_exit(code, None)

    def fork(self, episode_id: str, channel: int) -> Forked:
        """Fork one episode whose stdin and stdout are ``channel`` (the child's end of the
        launcher's socket); blocking. Raises :class:`TemplateGone`."""
        err_r, err_w = os.pipe()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ok = False
        try:
            try:
                message = {"t": "fork", "episode_id": episode_id}
                _send(self.control, message, [channel, err_w, theirs.fileno()])
            except OSError as exc:
                raise TemplateGone(f"template {self.name} is gone ({exc.strerror})") from None
            finally:
                os.close(err_w)
                theirs.close()
            mine.settimeout(_FORK_TIMEOUT_S)
            try:
                reply, fds = _receive(mine)
            except (OSError, ValueError):
                reply, fds = None, []
            if reply is None or reply.get("t") != "forked" or not isinstance(reply["pid"], int):
                for fd in fds:
                    os.close(fd)
                why = reply.get("reason") if reply else None
                raise TemplateGone(f"template {self.name} did not fork ({why or 'no answer'})")
            pidfd = fds[0] if fds else None
            for fd in fds[1:]:
                os.close(fd)
            pid = pidfd_pid(pidfd) if pidfd is not None else None
            if pid is None or parent_pid(pid) != self.importer:
                if pidfd is not None:
                    os.close(pidfd)
                raise TemplateGone(f"template {self.name} named no fork of its own")
            forked = Forked(pid, pidfd, mine, err_r, self)
            with self._forks_lock:
                self.forks.add(forked)
            ok = True
            return forked
        finally:
            if not ok:
                mine.close()
                os.close(err_r)

    def release_fds(self) -> None:
        """Give its fd back to the budget; in the event loop, once it is closed."""
        if self.fds is not None:
            self.fds.release()
            self.fds = None

    def close(self, grace: float = _CLOSE_GRACE_S) -> None:
        """End the importer (EOF on its control socket, then SIGKILL after ``grace`` seconds)
        and everything left in its leaf, and remove the leaf; blocking. Episodes forked from
        it run on (each has a leaf of its own); its PID namespace, its outer process and its
        sandbox's TMPDIR go when the last of them has ended."""
        if self.importer_fd is not None:
            # Nothing of the agent's is worth a graceful end: stopped, so that nothing new
            # appears below it, then killed with all it started but its forks.
            self._signal_importer(signal.SIGSTOP)
            self._kill_leftovers()
            self._signal_importer(signal.SIGKILL)
            select.select([self.importer_fd], [], [], _CLOSE_GRACE_S)
        self.control.close()
        if self.leaves is not None:
            end = time.monotonic() + _CLOSE_GRACE_S
            while self.leaves.populated() and time.monotonic() < end:
                self.leaves.kill()
                time.sleep(0.01)
            self.leaves.remove()
        with self._forks_lock:
            self.closing = True
            last = not self.forks
        if last:
            self._finish(0.0 if self.importer_fd is not None else grace)

    def _signal_importer(self, sig: int) -> None:
        if self.importer_fd is not None:
            try:
                signal.pidfd_send_signal(self.importer_fd, sig)
            except OSError:
                pass  # gone already

    def _kill_leftovers(self) -> None:
        """SIGKILL every process below the importer but its forks (and what is below them),
        until none is left, for at most a few seconds. The importer is a subreaper: whatever
        it started, double-forked or not, is below it."""
        with self._forks_lock:
            forks = {forked.pid for forked in self.forks}
        if self.importer_fd is None or select.select([self.importer_fd], [], [], 0)[0]:
            return  # it is gone: its number may name another process now
        end = time.monotonic() + _CLOSE_GRACE_S
        while time.monotonic() < end:
            try:
                children = psutil.Process(self.pid).children()
            except psutil.Error:
                return
            left: list[psutil.Process] = []
            for child in children:
                if child.pid in forks:
                    continue
                left.append(child)
                try:
                    left += child.children(recursive=True)
                except psutil.Error:
                    pass
            if not left:
                return
            for proc in left:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            time.sleep(0.005)

    def fork_ended(self, forked: Forked) -> None:
        with self._forks_lock:
            self.forks.discard(forked)
            last = self.closing and not self.forks
        if last:
            threading.Thread(target=self._finish, args=(0.0,), daemon=True).start()

    def _finish(self, grace: float) -> None:
        """Once the importer is gone and no fork is left: the outer process (and with it the
        namespace), what is left in its session, the sandbox's TMPDIR, the life socket."""
        with self._forks_lock:
            if self._finished:
                return
            self._finished = True
        if self.popen.returncode is None:
            # Not reaped before the sweep: while it is ours to reap, its pid (the session's
            # id) names no other process.
            outer = os.pidfd_open(self.popen.pid) if hasattr(os, "pidfd_open") else None
            try:
                if outer is None or not select.select([outer], [], [], grace)[0]:
                    self.popen.send_signal(signal.SIGKILL)
                rest = ProcessTree(None, self.popen.pid, None, None)
                end = time.monotonic() + _CLOSE_GRACE_S
                while time.monotonic() < end:
                    left = rest.live()
                    if not left:
                        break
                    rest.signal(left, signal.SIGKILL)
                    time.sleep(0.01)
            finally:
                if outer is not None:
                    os.close(outer)
        self.popen.wait()
        if self.importer_fd is not None:
            os.close(self.importer_fd)
            self.importer_fd = None
        self.life.close()
        if self.sandbox is not None:
            _sandbox.remove_tmpdir(self.sandbox.tmpdir)


@dataclass
class _Entry:
    """The template of one key, or why that key gets none."""

    name: str
    template: Template | None = None
    starting: bool = False
    pending: Template | None = None
    """The template being started, until it is ready or refused."""
    refused: str | None = None
    restarts: int = 0
    closed: bool = False


_lock = threading.Lock()
#: Held from a template's spawn until it is ``pending``: close_templates() then sees it.
_spawn_lock = threading.Lock()
_entries: dict[tuple[Any, ...], _Entry] = {}


def preload_list(spec: EpisodeSpec) -> tuple[str, ...]:
    return () if isinstance(spec.preload, bool) else spec.preload


#: Per-episode variables the fork's worker sets itself (the handshake's ``temp_env``): not part
#: of a template's key, or every sandboxed episode (a private TMPDIR each) had a template.
TEMP_ENV = ("TMPDIR", "TMP", "TEMP")


def _key(
    spec: EpisodeSpec, env: dict[str, str], agent_root: str | None, level: str
) -> tuple[Any, ...]:
    per_episode = (EPISODE_ENV, *TEMP_ENV)
    return (
        spec.python,
        agent_root,
        spec.entrypoint,
        tuple(sorted((k, v) for k, v in env.items() if k not in per_episode)),
        str(spec.cwd.absolute()) if spec.cwd is not None else os.getcwd(),
        spec.containment,
        level,
        preload_list(spec),
        # The importer is walled in as its episodes are: their limits and sandbox are its.
        spec.limits.model_dump_json() if spec.limits is not None else None,
        spec.sandbox.model_dump_json() if spec.sandbox is not None else None,
    )


def unusable(spec: EpisodeSpec, level: str) -> str | None:
    """Why no template can give episodes of ``spec`` at ``level`` what a fresh start gives
    them, or None. Blocking (a probe may run)."""
    layers = _containment.layers(level)
    if spec.sandbox is not None and spec.sandbox.network is not None:
        return (
            "a template cannot give each episode a network namespace of its own: episodes "
            "with Sandbox(network=...) start fresh"
        )
    if "pidns" in layers:
        if not hasattr(os, "pidfd_open"):
            return "a template in a PID namespace needs pidfds (Linux 5.3)"
        problem = _containment.landlock().problem
        if problem is not None:
            return (
                "the episodes of a template share its PID namespace, and only a Landlock "
                f"domain of their own keeps them from signalling each other ({problem})"
            )
        how = _containment.plan(level, spec.limits, _containment.cgroups())
        if isinstance(how, _containment.LimitPlan) and "RLIMIT_NPROC" in how.rlimits:
            return (
                "limits.max_processes without a pids cgroup counts the processes of a user "
                "namespace, which a template's episodes share: add the 'cgroup' layer"
            )
    return None


async def acquire(
    spec: EpisodeSpec,
    env: dict[str, str],
    agent_root: str | None,
    level: str,
    note: Callable[[str], None],
    refused_because: Callable[[str], None] = lambda reason: None,
) -> Template | None:
    """The running template for an episode of ``spec`` whose exec environment would be
    ``env``, started (or restarted) if need be; None when its key is refused (the reason goes
    to ``note``, and to ``refused_because``): the episode starts fresh."""
    key = _key(spec, env, agent_root, level)
    name = "template." + hashlib.sha256(repr(key).encode()).hexdigest()[:12]
    while True:
        died = None
        with _lock:
            entry = _entries.setdefault(key, _Entry(name))
            template, starter = entry.template, False
            if entry.refused is None and template is not None:
                if template.alive():
                    return template
                entry.template, died = None, template
                entry.restarts += 1
            if entry.refused is None and not entry.starting:
                entry.starting = starter = True
        if died is not None:
            note(
                f"template {name} (pid {died.pid}) {died.death()}; starting a new one "
                f"(restart {entry.restarts})"
            )
            died.release_fds()
            threading.Thread(target=died.close, daemon=True).start()  # reap it, remove its leaf
        if starter:
            problem = await anyio.to_thread.run_sync(unusable, spec, level)
            if problem is not None:
                with _lock:
                    entry.starting, entry.refused = False, problem
        if entry.refused is not None:
            note(f"preload refused: {entry.refused}; this episode starts fresh")
            refused_because(entry.refused)
            return None
        if not starter:
            await anyio.sleep(0.01)  # another episode is starting it: wait for that
            continue
        started: Template | None = None
        refused: str | None = None
        try:
            tagged = {**env, EPISODE_ENV: name}  # the episode's, tagged with the template's name
            started, refused = await _start(spec, tagged, agent_root, level, entry)
        finally:
            with _lock:
                entry.starting, entry.pending = False, None
                if entry.closed and started is not None:
                    # close_templates() ran while this one started.
                    started.release_fds()
                    threading.Thread(target=started.close, daemon=True).start()
                    started, refused = None, "templates were closed while this one started"
                entry.template, entry.refused = started, refused
        if started is None:
            assert refused is not None
            note(f"preload refused: {refused}; this episode starts fresh")
            refused_because(refused)
            return None
        note(f"template {name} started (pid {started.pid})")
        return started


async def _start(
    spec: EpisodeSpec, env: dict[str, str], agent_root: str | None, level: str, entry: _Entry
) -> tuple[Template | None, str | None]:
    """Start a template and wait until it has preloaded: (template, None) or (None, reason)."""
    found = await anyio.to_thread.run_sync(_spawn, spec, env, level, entry)
    if isinstance(found, str):
        return None, found
    template = found
    template.fds = _admission.hold_fds(3, entry.name)  # control, life, the importer's pidfd
    try:
        message = {
            "t": "preload",
            "entrypoint": spec.entrypoint,
            "agent_root": agent_root,
            "preload": list(preload_list(spec)),
        }
        try:
            # The wall goes as a file: a sandbox's rules can outgrow a control message.
            wall = json_file(template.wall)
            try:
                _send(template.control, message, [wall])
            finally:
                os.close(wall)
            await anyio.wait_readable(template.control.fileno())
            reply, fds = _receive(template.control)
        except (OSError, ValueError):  # it died (ECONNRESET), or said something else
            reply, fds = None, []
        problem = None
        if reply is not None and reply.get("t") == "ready":
            problem = template.ready(fds.pop(0) if fds else None)
        for fd in fds:
            os.close(fd)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(template.close, 0.0)  # busy importing: no EOF seen
            template.release_fds()
        raise
    if reply is not None and reply.get("t") == "ready" and problem is None:
        return template, None
    died = None
    if problem is None and (reply is None or reply.get("t") != "refused"):
        died = await anyio.to_thread.run_sync(template.death)  # before close() ends its socket
    await anyio.to_thread.run_sync(template.close)
    template.release_fds()
    if problem is not None:
        return None, problem
    if died is None:
        return None, str(reply.get("reason") if reply is not None else "refused")
    log = spec.log_dir / f"{entry.name}.log" if spec.log_dir is not None else None
    where = f"; see {log}" if log is not None else ""
    return None, f"the template {died} while importing{where}"


def _spawn(spec: EpisodeSpec, env: dict[str, str], level: str, entry: _Entry) -> Template | str:
    name = entry.name
    layers = _containment.layers(level)
    wall: dict[str, Any] = {"containment": level}
    leaves = None
    if "cgroup" in layers:
        # Its own leaf, with the episodes' limits: never killed or counted with an episode.
        groups = _containment.cgroups()
        how = _containment.plan(level, spec.limits, groups)
        if isinstance(how, str):
            return how
        leaves = _containment.Leaves(groups, name, how.writes)
        problem = leaves.create()
        if problem is not None:
            leaves.remove()
            return problem
        wall["cgroups"] = leaves.join()
    if "pidns" in layers:
        wall["userns"] = _containment.needs_userns()
    sandbox = None
    if spec.sandbox is not None:
        found = _sandbox.prepare(
            spec.sandbox,
            episode_id=name,
            cwd=str(spec.cwd) if spec.cwd is not None else os.getcwd(),
            child_env=spec.env,
            mountns="pidns" in layers,
            can_unshare=not _containment.needs_userns(),
        )
        if isinstance(found, str):
            if leaves is not None:
                leaves.remove()
            return found
        sandbox = found
        wall["sandbox"] = found.handshake
        env = {**env, **{k: found.tmpdir for k in TEMP_ENV}}  # the only place it may write
    with _spawn_lock:
        made = _spawn_locked(spec, env, entry, leaves, "pidns" in layers, sandbox)
    if isinstance(made, Template):
        made.wall = wall
    return made


def _spawn_locked(
    spec: EpisodeSpec,
    env: dict[str, str],
    entry: _Entry,
    leaves: _containment.Leaves | None,
    pidns: bool,
    sandbox: _sandbox.PreparedSandbox | None,
) -> Template | str:
    name = entry.name
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    life, its_life = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    log: Any = subprocess.DEVNULL

    def undo() -> None:
        mine.close()
        life.close()
        if leaves is not None:
            leaves.remove()
        if sandbox is not None:
            _sandbox.remove_tmpdir(sandbox.tmpdir)

    try:
        if spec.log_dir is not None:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(Path(spec.log_dir) / f"{name}.log", "ab")  # noqa: SIM115
        popen = subprocess.Popen(
            [spec.python, "-I", str(boot_path()), "--template", str(its_life.fileno())],
            stdin=theirs.fileno(),
            stdout=log,
            stderr=log,
            env=env,
            cwd=spec.cwd,
            start_new_session=True,
            close_fds=True,
            pass_fds=(its_life.fileno(),),
        )
    except OSError as exc:
        undo()
        return f"cannot start a template: {exc.strerror or exc}"
    finally:
        theirs.close()
        its_life.close()
        if log is not subprocess.DEVNULL:
            log.close()
    if leaves is not None and not pidns:
        # With a PID namespace the outer process and PID 1 stay outside the leaf (its kill
        # must not end the namespace its episodes live in); the importer joins it itself.
        leaves.move(popen.pid)
    life.setblocking(False)
    template = Template(popen, mine, life, leaves, name, sandbox)
    with _lock:
        entry.pending, closed = template, entry.closed
    if closed:  # close_templates() ran meanwhile, and could not see this one
        template.close(0.0)
        return "templates were closed while this one started"
    return template


async def probe(spec: EpisodeSpec) -> tuple[str | None, float]:
    """Start a template for ``spec`` as its first episode would, outside the registry, and
    close it again: (why it would be refused, or None; seconds until it was ready)."""
    env, _ = split_env(os.environ, spec.inherit_env)
    env.update(spec.env)
    entry = _Entry("template.doctor")
    env[EPISODE_ENV] = entry.name
    root = str(spec.agent_root.expanduser().absolute()) if spec.agent_root is not None else None
    found = await anyio.to_thread.run_sync(_containment.resolve, spec.containment, spec.limits)
    if isinstance(found, str):
        return found, 0.0
    level = found[0]
    problem = await anyio.to_thread.run_sync(unusable, spec, level)
    if problem is not None:
        return problem, 0.0
    started = time.monotonic()
    template, refused = await _start(spec, env, root, level, entry)
    seconds = time.monotonic() - started
    if template is not None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(template.close)
        template.release_fds()
    return refused, seconds


def remedy(refused: str) -> str | None:
    """How to get a template used after it was refused for ``refused``, where a fix is known."""
    if "litellm" in refused:
        return (
            "litellm starts that thread at import unless LITELLM_LOCAL_MODEL_COST_MAP=True is "
            "in the agent's environment (econfig env, EpisodeSpec.env)"
        )
    return None


def started_templates() -> list[Template]:
    """The templates running now (for diagnostics and tests)."""
    with _lock:
        return [e.template for e in _entries.values() if e.template is not None]


async def close_templates() -> None:
    """Stop every preloaded template (and forget refusals), leaving no template process behind.
    Episodes forked from them run on to their normal end. The next episode with
    ``preload`` starts a new template.

    **Cancellation:** shielded; the templates are gone when this returns or raises.
    """
    with anyio.CancelScope(shield=True):
        for template in await anyio.to_thread.run_sync(close_all):
            template.release_fds()


def close_all() -> list[Template]:
    """:func:`close_templates`, blocking, for code outside an event loop; returns the templates
    it closed (their fds are still counted in their loop's budget)."""
    with _lock:
        entries = list(_entries.values())
        _entries.clear()
        for entry in entries:
            entry.closed = True
    templates = [e.template for e in entries if e.template is not None]
    for template in templates:
        template.control.close()  # all of them at once, then wait for each
    for template in templates:
        template.close()
    with _spawn_lock:
        pending = [e.pending for e in entries if e.pending is not None]
    for template in pending:
        # Still importing, it would not notice an EOF; its starter sees it die.
        template.popen.kill()
        template.popen.wait()
    return templates
