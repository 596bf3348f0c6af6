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

from agent_shim.shim_wire import EPISODE_ENV, receive_message, send_message

from . import admission as _admission
from . import containment as _containment
from .config import EpisodeSpec
from .env import split_env
from .outcome import describe_exit, signal_name
from .shim import _boot_path
from .tree import Episode

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


class Forked:
    """The parent's handle on one episode forked from a template: the part of a Popen the
    launcher uses. Its exit status comes from the template, the fork's parent."""

    def __init__(self, pid: int, pidfd: int | None, reply: socket.socket, err: int) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.reply = reply
        # Its stdin and stdout are the launcher's channel socket, as for a fresh start.
        self.stdin: IO[bytes] | None = None
        self.stdout: IO[bytes] | None = None
        self.stderr: IO[bytes] | None = open(err, "rb", buffering=0)  # noqa: SIM115
        self.returncode: int | None = None
        #: False when the template died before it could report the exit status.
        self.status_known = True
        self._eof = False
        reply.setblocking(False)

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
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
        except (OSError, IndexError):
            return True

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
        self.reply.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class Template:
    """One running template: its process, control socket and cgroup leaf."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        control: socket.socket,
        leaves: _containment.Leaves | None,
        name: str,
    ) -> None:
        self.popen = popen
        self.control = control
        self.leaves = leaves
        self.name = name
        #: Its control socket, counted in the episodes' fd budget while it runs.
        self.fds: _admission.Hold | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def death(self) -> str:
        """How the dead template ended, in words."""
        code = self.popen.returncode
        if code is not None and code < 0:
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
            forked = Forked(reply["pid"], fds[0] if fds else None, mine, err_r)
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
        """End the template (EOF on its control socket, then SIGKILL after ``grace`` seconds),
        everything left in its session and leaf, and the leaf; blocking. Episodes forked from
        it run on: each has a session and a leaf of its own."""
        self.control.close()
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        rest = Episode(None, self.pid, None, self.leaves)
        end = time.monotonic() + _CLOSE_GRACE_S
        while time.monotonic() < end:
            left = rest.live()
            if not left and (self.leaves is None or not self.leaves.populated()):
                break
            rest.signal(left, signal.SIGKILL)
            if self.leaves is not None:
                self.leaves.kill()
            time.sleep(0.01)
        if self.leaves is not None:
            self.leaves.remove()


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
    )


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
    template.fds = _admission.hold_fds(1, entry.name)
    try:
        message = {
            "t": "preload",
            "entrypoint": spec.entrypoint,
            "agent_root": agent_root,
            "preload": list(preload_list(spec)),
        }
        try:
            _send(template.control, message)
            await anyio.wait_readable(template.control.fileno())
            reply, fds = _receive(template.control)
        except (OSError, ValueError):  # it died (ECONNRESET), or said something else
            reply, fds = None, []
        for fd in fds:
            os.close(fd)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(template.close, 0.0)  # busy importing: no EOF seen
            template.release_fds()
        raise
    if reply is not None and reply.get("t") == "ready":
        return template, None
    await anyio.to_thread.run_sync(template.close)
    template.release_fds()
    if reply is not None and reply.get("t") == "refused":
        return None, str(reply.get("reason"))
    log = spec.log_dir / f"{entry.name}.log" if spec.log_dir is not None else None
    where = f"; see {log}" if log is not None else ""
    return None, f"the template {template.death()} while importing{where}"


def _spawn(spec: EpisodeSpec, env: dict[str, str], level: str, entry: _Entry) -> Template | str:
    name = entry.name
    leaves = None
    if "cgroup" in _containment.layers(level):
        # Its own leaf, without the episodes' limits: never killed or counted with an episode.
        leaves = _containment.Leaves(_containment.cgroups(), name, _containment.Plan())
        problem = leaves.create()
        if problem is not None:
            leaves.remove()
            return problem
    with _spawn_lock:
        return _spawn_locked(spec, env, entry, leaves)


def _spawn_locked(
    spec: EpisodeSpec, env: dict[str, str], entry: _Entry, leaves: _containment.Leaves | None
) -> Template | str:
    name = entry.name
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    log: Any = subprocess.DEVNULL
    try:
        if spec.log_dir is not None:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(Path(spec.log_dir) / f"{name}.log", "ab")  # noqa: SIM115
        popen = subprocess.Popen(
            [spec.python, "-I", str(_boot_path()), "--template"],
            stdin=theirs.fileno(),
            stdout=log,
            stderr=log,
            env=env,
            cwd=spec.cwd,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        mine.close()
        if leaves is not None:
            leaves.remove()
        return f"cannot start a template: {exc.strerror or exc}"
    finally:
        theirs.close()
        if log is not subprocess.DEVNULL:
            log.close()
    if leaves is not None:
        leaves.move(popen.pid)
    template = Template(popen, mine, leaves, name)
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
    started = time.monotonic()
    template, refused = await _start(spec, env, root, "session", entry)
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
