"""``run_episode``: one episode in one fresh process, and the whole tree back afterwards."""

from __future__ import annotations

import codecs
import json
import os
import re
import secrets as _secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import psutil
from anyio.lowlevel import RunVar
from pydantic import SecretStr

from agent_shim.shim_wire import CANCEL, EPISODE_ENV, PROTOCOL_VERSION

from . import admission as _admission
from . import containment as _containment
from . import protocol as proto
from . import sandbox as _sandbox
from . import templates as _templates
from . import verdict as _verdict
from .config import EpisodeSpec, is_env_name
from .env import describe_withheld, split_env
from .errors import ArgumentError
from .netserve import EpisodeNetwork
from .outcome import (
    Cleanup,
    EpisodeOutcome,
    ErrorInfo,
    Status,
    Timings,
)
from .redact import Redactor
from .shim import boot_path
from .tail import Tail
from .tree import ProcessTree

#: How long after the shim exits its pipes may take to reach EOF (seconds). Normally at once:
#: every writer is dead by then. Only a process that escaped everything could hold them longer.
_DRAIN_S = 1.0
#: The shim enforces its own deadline this long after the parent's (seconds): defence in depth
#: for a parent that is stopped or hung, never the normal path.
_SHIM_DEADLINE_MARGIN_S = 2.0
#: Bytes per read of a pipe: a Linux pipe holds 64 KiB, so larger reads return no more. Asking
#: for 256 KiB made each read allocate and shrink a 256 KiB buffer: 200 episodes writing at once
#: then cost the parent ~30 KiB more RSS each.
_READ_CHUNK = 64 * 1024
#: Frames larger than this are parsed in a worker thread, not on the event loop (bytes).
_BIG_FRAME = 256 * 1024
#: stderr chunks larger than this are scrubbed in a worker thread (bytes): ~0.1 ms of work at
#: the scrubber's usual pace, up to ~4 ms for one a hostile child crafted.
_BIG_STDERR_CHUNK = 16 * 1024
#: How much longer than ``cancel_grace`` the parent waits for the shim to report how the
#: agent's clean-up went, before it terminates the tree itself (seconds). The shim counts the
#: grace itself and reports at once; this only matters for a shim that cannot answer.
_CANCEL_MARGIN_S = 0.5
#: How long past ``kill_grace`` the parent waits for a swept shim to exit (seconds): longer only
#: for a process stuck in the kernel (D state).
_SHIM_STUCK_S = 10.0
#: After that report the shim terminates the tree itself (SIGTERM, kill_grace, SIGKILL) and
#: counts what it killed; the parent gives it this long beyond kill_grace before it takes over
#: (seconds).
_SHIM_TEARDOWN_MARGIN_S = 1.0


async def run_episode(
    spec: EpisodeSpec,
    data: Any,
    *,
    kwargs: Mapping[str, Any] | None = None,
    secrets: Mapping[str, str | SecretStr] | None = None,
    episode_id: str | None = None,
    on_start: Callable[[int], object] | None = None,
    secret_env: Mapping[str, str | SecretStr] | None = None,
    on_end: Callable[[EpisodeOutcome], object] | None = None,
) -> EpisodeOutcome:
    """Run ``spec.entrypoint(data, **kwargs, **secrets)`` in a fresh process and return what
    happened. Every way an episode can end is an outcome, ``setup_error`` included; only
    invalid arguments raise (:class:`ArgumentError`).

    ``secrets`` travel only in the stdin handshake and are scrubbed from everything that comes
    back. ``secret_env`` (variable name -> value) travels the same way and is set in the
    worker's ``os.environ`` before the entrypoint is imported, for SDKs that read their key from
    the environment: never in the exec environment or argv of the shim or the worker, but
    inherited by every process the agent starts. ``episode_id`` names the log file (default:
    the record's ``instance_id`` plus a random suffix). ``on_start`` is called with the
    shim's pid once it is running. ``on_end`` is called with the outcome once the episode is
    over, however it ended.

    **Cancellation:** if the calling task is cancelled, the episode ends exactly as on timeout,
    shielded from the cancellation: the agent is cancelled inside its process and gets up to
    ``spec.cancel_grace`` seconds to clean up, then the tree gets SIGTERM, ``spec.kill_grace``
    seconds, SIGKILL, until no process is left. Then ``on_end`` gets the outcome (``timeout``,
    "cancelled after N s", unless a result came first) and the cancellation propagates.
    """
    run = _Run(spec, data, kwargs or {}, secrets or {}, episode_id, secret_env or {})
    return await run.run(on_start, on_end)


async def _run_with_shim(spec: EpisodeSpec, data: Any, shim: Path, **kw: Any) -> EpisodeOutcome:
    """Like :func:`run_episode` with another child program; for protocol tests."""
    args = [kw.pop(k, None) for k in ("kwargs", "secrets", "episode_id", "secret_env")]
    on_start = kw.pop("on_start", None)
    if kw:
        raise TypeError(f"unexpected arguments: {', '.join(kw)}")
    run = _Run(spec, data, args[0] or {}, args[1] or {}, args[2], args[3])
    run.shim = shim
    return await run.run(on_start, None)


_STARTING: RunVar[anyio.CapacityLimiter] = RunVar("isolate_starting")


def _starting_gate() -> anyio.CapacityLimiter:
    """The event loop's limit on children between spawn and hello (created on first use)."""
    try:
        return _STARTING.get()
    except LookupError:
        gate = anyio.CapacityLimiter(max(4, 2 * (os.cpu_count() or 1)))
        _STARTING.set(gate)
        return gate


def default_episode_id(data: Any) -> str:
    base = data.get("instance_id") if isinstance(data, Mapping) else None
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(base))[:80] if base else "episode"
    return f"{stem}.{_secrets.token_hex(4)}"


class _Run:
    """The state of one episode, from arguments to outcome.

    What the child sends enters at two places only, and is scrubbed of the secrets there,
    before anything keeps it: stderr in :meth:`_on_stderr`, stdout in ``proto.parse_line``
    (a frame is built from the scrubbed object). Frames, tail, log and outcome hold only
    scrubbed data, so a field added to a frame is scrubbed without anyone thinking of it.
    """

    def __init__(
        self,
        spec: EpisodeSpec,
        data: Any,
        kwargs: Mapping[str, Any],
        secrets: Mapping[str, str | SecretStr],
        episode_id: str | None,
        secret_env: Mapping[str, str | SecretStr] | None = None,
    ) -> None:
        for name in list(kwargs) + list(secrets):
            if not isinstance(name, str) or not name.isidentifier():
                raise ArgumentError(f"keyword argument names must be identifiers, got {name!r}")
        both = sorted(set(kwargs) & set(secrets))
        if both:
            raise ArgumentError(f"keys in both kwargs and secrets: {', '.join(both)}")
        self.secrets = {
            k: v if isinstance(v, SecretStr) else SecretStr(_secret_str(k, v))
            for k, v in secrets.items()
        }
        self.secret_env = _secret_env(spec, secret_env or {})
        self.spec = spec
        self.episode_id = default_episode_id(data) if episode_id is None else episode_id
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", self.episode_id):
            raise ArgumentError(f"episode_id must be 1-200 of [A-Za-z0-9_.-], got {episode_id!r}")
        self.nonce = _secrets.token_hex(16)
        self.public = {
            "protocol": PROTOCOL_VERSION,
            "nonce": self.nonce,
            "entrypoint": spec.entrypoint,
            "agent_root": None,
            "data": data,
            "kwargs": dict(kwargs),
            "deadline": spec.timeout + spec.kill_grace + _SHIM_DEADLINE_MARGIN_S,
            "kill_grace": spec.kill_grace,
            "cancel_grace": spec.cancel_grace,
            "exit_grace": spec.exit_grace,
            "max_info_bytes": spec.max_info_bytes,
        }
        try:
            json.dumps(self.public, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ArgumentError(f"data and kwargs must be JSON-serialisable: {exc}") from None
        self.secret_values = [
            s.get_secret_value() for s in [*self.secrets.values(), *self.secret_env.values()]
        ]
        self.redact = Redactor(self.secret_values)
        self.env: dict[str, str] = {}
        self.shim = boot_path()

        self.started = time.monotonic()
        self.asked_template = False
        self.preload_refused: str | None = None  # why preload gave no template
        self.containment = "session"  # the containment combination, once resolved
        self.leaves: _containment.Leaves | None = None
        self.leaves_problem: str | None = None
        self.oom_kills: int | None = None
        self.pids_limit_hits = 0
        self.log_written = 0
        self.popen: subprocess.Popen[bytes] | _templates.Forked | None = None
        self.template: _templates.Template | None = None
        self.channel: int | None = None  # our end of the socket that is the child's stdin+stdout
        self.handshake = memoryview(b"")  # what is still to be written of it
        self.tree: ProcessTree | None = None
        self.pidfd: int | None = None
        self.log: Any = None  # binary file, when spec.log_dir is set
        self.log_path: Path | None = None
        self.tail = Tail(spec.stderr_tail_bytes)
        self.stderr_decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
        self.hello: proto.Hello | None = None
        self.final: proto.Result | proto.Error | None = None
        self.done: proto.Done | None = None
        self.violations: list[str] = []
        self.frame_cap = proto.frame_cap(spec.max_frame_bytes, spec.max_info_bytes)
        self.splitter = proto.LineSplitter(self.frame_cap)
        self.timed_out = False
        self.cancelled_at: float | None = None  # when the caller's cancellation arrived
        self.outcome: EpisodeOutcome | None = None  # once concluded
        self.cancel_until: float | None = None  # set once the agent was asked to cancel
        self.cleanup: Cleanup | None = None
        self.cleanup_seen = anyio.Event()
        self.swept_live = False
        self.killed = 0
        self.term_deadline: float | None = None
        self.spawned = self.started
        self.gate: anyio.CapacityLimiter | None = None
        self.ticket: _admission.Ticket | None = None  # this episode's share of the fd budget
        self.start_wait_s = 0.0
        self.hello_at: float | None = None
        self.stdout_eof = anyio.Event()
        self.stderr_eof = anyio.Event()
        self.sandbox: _sandbox.PreparedSandbox | None = None
        self.sandbox_missing: list[str] | None = None  # from the worker's sandbox frame
        self.network: EpisodeNetwork | None = None

    # --- the episode ------------------------------------------------------------------------

    async def run(
        self,
        on_start: Callable[[int], object] | None,
        on_end: Callable[[EpisodeOutcome], object] | None,
    ) -> EpisodeOutcome:
        try:
            outcome = await self._run(on_start)
        finally:
            self._close_log()  # last: _finish writes its summary line into it
            if self.ticket is not None:
                self.ticket.release()  # every fd of the episode is closed now
            # Also when a cancellation propagates: the caller still learns how the episode ended.
            if on_end is not None and self.outcome is not None:
                on_end(self.outcome)
        return outcome

    async def _run(self, on_start: Callable[[int], object] | None) -> EpisodeOutcome:
        try:
            # Wait for this episode's fds to fit the open-file limit, instead of hitting EMFILE.
            ticket = await _admission.admit(self.episode_id, _admission.episode_fds(self.spec))
            if isinstance(ticket, str):
                return self._finish("setup_error", _err("SetupError", ticket))
            self.ticket = ticket
            problem = await anyio.to_thread.run_sync(self._prepare)
            if problem is None:
                problem = await self._start()
            if problem is None and self.popen is None:
                message = f"no template was ready within {self.spec.timeout:g} s"
                return self._finish("timeout", _err("EpisodeTimeout", message))
            if problem is not None:
                return self._finish("setup_error", _err("SetupError", problem))
            if on_start is not None:
                assert self.popen is not None
                on_start(self.popen.pid)
            await self._supervise()
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                # The caller's cancellation ends the episode as a deadline would.
                self.cancelled_at = time.monotonic()
                self.timed_out = self.final is None
            with anyio.CancelScope(shield=True):
                await self._abort()
            raise
        finally:
            self._open_gate()
            self._close()
            if self.leaves is not None:
                with anyio.CancelScope(shield=True):
                    await self._remove_leaves()
            if self.sandbox is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_sandbox.remove_tmpdir, self.sandbox.tmpdir)
            if self.cancelled_at is not None:
                self._conclude()  # for on_end: the cancellation goes on
        return self._conclude()

    def _prepare(self) -> str | None:
        """Check what can be checked before spawning. Returns a problem or None."""
        spec = self.spec
        if spec.agent_root is not None:
            root = spec.agent_root.expanduser().absolute()
            if not root.is_dir():
                what = "is not a directory" if root.exists() else "does not exist"
                return f"agent root {root} {what}"
            self.public["agent_root"] = str(root)
        if spec.cwd is not None and not spec.cwd.is_dir():
            return f"working directory {spec.cwd} does not exist"
        if os.sep in spec.python:
            python = Path(spec.python)
            if not python.exists():
                return f"interpreter {spec.python} does not exist"
            if not os.access(python, os.X_OK) or python.is_dir():
                return f"interpreter {spec.python} is not an executable file"
        if not self.shim.is_file():
            return f"shim {self.shim} is missing from the installation"
        problem = self._contain()
        if problem is not None:
            return problem
        if spec.sandbox is not None:
            problem = self._prepare_sandbox(spec.sandbox)
            if problem is not None:
                return problem
        _admission.child_rlimits(self.public)
        return None

    def _open_log(self) -> str | None:
        spec = self.spec
        if spec.log_dir is not None and self.log is None:
            try:
                spec.log_dir.mkdir(parents=True, exist_ok=True)
                self.log_path = (spec.log_dir / f"{self.episode_id}.log").absolute()
                self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _close
            except OSError as exc:
                if _admission.exhausted(exc):
                    raise
                return f"cannot open a log file in {spec.log_dir}: {exc.strerror or exc}"
        if not self.env:  # once, after the log is open: its first line names what is withheld
            self._build_env()
        return None

    def _build_env(self) -> None:
        """The shim's exec environment; the first line of the log names what it withholds."""
        env, withheld = split_env(
            os.environ, self.spec.inherit_env, secret_values=self.secret_values
        )
        for name in self.secret_env:  # delivered in the handshake, never in the exec environment
            env.pop(name, None)
            withheld.pop(name, None)
        env.update(self.spec.env)
        env[EPISODE_ENV] = self.episode_id
        if self.sandbox is not None:  # the only place it may write temporary files
            tmp = self.sandbox.tmpdir
            env.update(TMPDIR=tmp, TMP=tmp, TEMP=tmp)
        if self.spec.preload:
            # A template's fork has the template's exec environment: its own temporary
            # directory comes in the handshake, so episodes that differ only there share one.
            self.public["temp_env"] = {k: env[k] for k in _templates.TEMP_ENV if k in env}
        self.env = env
        if withheld:
            self._note(describe_withheld(withheld))

    async def _start(self) -> str | None:
        """Open the log and spawn the shim; a full fd table means: wait for room, retry."""
        assert self.ticket is not None
        while True:
            try:
                problem = await anyio.to_thread.run_sync(self._open_log)
                if problem is not None:
                    return problem
                if self.spec.preload and not self.asked_template:
                    self.asked_template = True  # once: a retry after EMFILE does not ask again
                    with anyio.move_on_after(self.spec.timeout) as scope:
                        self.template = await _templates.acquire(
                            self.spec,
                            self.env,
                            self.public["agent_root"],
                            self.containment,
                            self._note,
                            self._fresh_because,
                        )
                    if scope.cancelled_caught:
                        return None  # no process: _run reports the timeout
                # At most a few children between spawn and hello at once: 200 interpreters
                # starting together on 2 cores starve the event loop for seconds (p99 lag 1.1 s).
                gate, waited = _starting_gate(), time.monotonic()
                await gate.acquire_on_behalf_of(self)
                self.gate = gate  # only once held: a cancelled wait has nothing to release
                self.start_wait_s += time.monotonic() - waited
                problem = await anyio.to_thread.run_sync(self._spawn)
            except OSError as exc:
                if not _admission.exhausted(exc):
                    return f"cannot start interpreter {self.spec.python!r}: {exc.strerror or exc}"
                self._open_gate()
                problem = await self.ticket.starved(exc, self.spec.timeout)
                if problem is not None:
                    return problem
                continue
            self.spawned = time.monotonic()
            self.ticket.started()
            return problem

    def _contain(self) -> str | None:
        """Pick the containment layers, make the cgroup leaves, put both into the handshake."""
        found = _containment.resolve(self.spec.containment, self.spec.limits)
        if isinstance(found, str):
            return found
        self.containment, how = found
        self.public["containment"] = self.containment
        if how.rlimits:
            self.public["rlimits"] = {name: list(pair) for name, pair in how.rlimits.items()}
        layers = _containment.layers(self.containment)
        if "pidns" in layers:
            self.public["userns"] = _containment.needs_userns()
        if "cgroup" in layers:
            self.leaves = _containment.Leaves(_containment.cgroups(), self.episode_id, how)
            problem = self.leaves.create()
            if problem is not None:
                return problem
            self.public["cgroups"] = self.leaves.join()
        return None

    def _prepare_sandbox(self, sandbox: _sandbox.Sandbox) -> str | None:
        """The private TMPDIR and the rules the worker enforces; a problem, or None."""
        found = _sandbox.prepare(
            sandbox,
            episode_id=self.episode_id,
            cwd=str(self.spec.cwd) if self.spec.cwd is not None else os.getcwd(),
            child_env=self.spec.env,  # its HOME, if it sets one; homes() adds ours
            mountns="pidns" in self.containment.split("+"),
            can_unshare=not _containment.needs_userns(),
        )
        if isinstance(found, str):
            return found
        self.sandbox = found
        self.public["sandbox"] = found.handshake
        if found.plan.network is not None:
            self.network = EpisodeNetwork(found.plan.network, self._note)
        return None

    async def _remove_leaves(self) -> None:
        assert self.leaves is not None
        problem = self.leaves_problem
        if self.leaves.dirs:  # not yet removed by _settled
            problem = await anyio.to_thread.run_sync(self.leaves.remove)
        if problem is not None:
            self._note(f"cgroup clean-up: {problem}; the next start of isolate removes it")

    def _fresh_because(self, reason: str) -> None:
        self.preload_refused = self.redact.text(reason)

    def _spawn(self) -> str | None:
        """Start the shim (and put it into its cgroup leaves); a problem, or None."""
        # Runs in a worker thread: fork+exec of a big parent must not stall the event loop.
        # The child's stdin and stdout are one socket: one fd less per episode here than two
        # pipes (the fd budget), and the same for the shim (handshake in, frames out, EOF).
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if self.template is not None:
                try:
                    self.popen = self.template.fork(self.episode_id, theirs.fileno())
                    self._note(f"forked from {self.template.name} (pid {self.popen.pid})")
                except _templates.TemplateGone as exc:
                    # The next episode starts a new template; this one need not wait for it.
                    self._note(f"{exc}; this episode starts fresh")
                    self._fresh_because(str(exc))
                    self.template = None
            if self.popen is None:
                self.popen = subprocess.Popen(
                    [self.spec.python, "-I", str(self.shim)],
                    stdin=theirs.fileno(),
                    stdout=theirs.fileno(),
                    stderr=subprocess.PIPE,
                    env=self.env,
                    cwd=self.spec.cwd,
                    start_new_session=True,  # never preexec_fn: unsafe with threads, no vfork
                    close_fds=True,
                    bufsize=0,  # the pipe is read by fd: no 8 KiB buffer
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.channel = ours.detach()
        pid = self.popen.pid
        assert self.popen.stderr is not None
        for fd in (self.channel, self.popen.stderr.fileno()):
            os.set_blocking(fd, False)
        forked = isinstance(self.popen, _templates.Forked)
        if forked:
            problem = self._as_fork()
            if problem is not None:
                self.popen.kill()
                self.popen.wait()
                return problem
        # The handshake goes out at once (what the pipe takes now; _write_handshake the rest),
        # so the shim can read it as soon as it has started, while this thread carries on.
        self.handshake = memoryview(
            proto.encode_handshake(self.public, self.secrets, self.secret_env)
        )
        self._push_handshake()
        if self.leaves is not None and not forked:
            # A move waits for an RCU grace period (~10 ms here, as long as a plain interpreter
            # takes to start) unless another move came just before: done here, it overlaps the
            # shim's start-up. The shim makes sure it is in its cgroups before it creates any
            # process (joining by itself waits for this move to finish).
            problem = self.leaves.move(pid)
            if problem is not None:
                self.popen.kill()
                self.popen.wait()
                return problem
        # After the move: reading /proc/PID/stat of a process that is still in exec takes ~2 ms.
        try:
            shim: psutil.Process | None = psutil.Process(pid)
        except (psutil.Error, OSError):  # only an error of Popen itself is worth a retry
            shim = None
        if isinstance(self.popen, _templates.Forked):
            # Not our child: a pid its template has reaped may be reused at once. The fork's
            # own pidfd says whether this psutil handle can be another process.
            if shim is not None and self.popen.poll() is not None:
                shim = None
            self.tree = ProcessTree(shim, pid, self.episode_id, self.leaves)
            return None
        self.tree = ProcessTree(shim, pid, self.episode_id, self.leaves)
        if hasattr(os, "pidfd_open"):
            try:
                self.pidfd = os.pidfd_open(pid)
            except OSError:
                self.pidfd = None
        return None

    async def _supervise(self) -> None:
        assert self.popen is not None
        assert self.tree is not None
        deadline = self.spawned + self.spec.timeout  # the timeout counts from spawn
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_handshake)
            tg.start_soon(
                self._pump, self._fd("stdout"), self._on_stdout, self.stdout_eof, self._at_eof
            )
            tg.start_soon(self._pump, self._fd("stderr"), self._on_stderr, self.stderr_eof)
            if self.network is not None:
                tg.start_soon(self.network.serve)
            with anyio.move_on_after(deadline - time.monotonic()):
                await self._wait_exit()
            if self.popen.returncode is None:
                # Deadline. A final frame that made it in time still counts.
                self.timed_out = self.final is None
                await self._end_early()
                # The sweep took the tree; a shim stuck in the kernel is not waited for forever.
                with anyio.move_on_after(self.spec.kill_grace + _SHIM_STUCK_S):
                    await self._wait_exit()
            # The done frame is written before the shim exits: read stdout to EOF first.
            with anyio.move_on_after(_DRAIN_S):
                await self.stdout_eof.wait()
            if not (self._clean_exit() and await self._settled()):
                await self._sweep(live=False)
                if self.leaves is not None:
                    leaves = self.leaves
                    self.oom_kills, self.pids_limit_hits = await anyio.to_thread.run_sync(
                        lambda: (leaves.oom_kills(), leaves.pids_limit_hits())
                    )
            with anyio.move_on_after(_DRAIN_S):
                await self.stderr_eof.wait()
            tg.cancel_scope.cancel()

    def _clean_exit(self) -> bool:
        """The shim exited after killing and reaping everything below it, as a subreaper."""
        return (
            self.popen is not None
            and self.popen.returncode == 0
            and self.hello is not None
            and self.hello.subreaper
            and self.done is not None
            and self.done.why == "exited"
        )

    async def _settled(self) -> bool:
        """After a clean exit: is the episode over, nothing left to sweep? At the cgroup level,
        if the leaf is empty, also read its counters and remove it, in one worker-thread trip."""
        leaves = self.leaves
        if leaves is None:
            return True

        def settle() -> bool:
            if leaves.populated():
                return False
            self.oom_kills, self.pids_limit_hits = leaves.oom_kills(), leaves.pids_limit_hits()
            self.leaves_problem = leaves.remove()
            return True

        return await anyio.to_thread.run_sync(settle)

    async def _sweep(self, *, live: bool) -> None:
        assert self.tree is not None
        if self.term_deadline is None:
            self.term_deadline = time.monotonic() + self.spec.kill_grace
        self.swept_live = self.swept_live or live
        self.killed += await self.tree.kill(self.spec.kill_grace, self.term_deadline)

    async def _end_early(self) -> None:
        """Cancel first, then terminate: the agent cleans up (``cancel_grace``), then the tree
        gets SIGTERM, ``kill_grace``, SIGKILL, until nothing is left."""
        assert self.popen is not None
        if self.final is None:
            await self._cancel()
        if self.cleanup_seen.is_set() and self.popen.returncode is None:
            # The shim answered: it terminates the tree itself and says what it killed.
            with anyio.move_on_after(self.spec.kill_grace + _SHIM_TEARDOWN_MARGIN_S):
                await self._wait_exit()
            if self.popen.returncode is None and self.term_deadline is None:
                self.term_deadline = time.monotonic()  # the grace is spent: SIGKILL at once
        await self._sweep(live=self.popen.returncode is None)

    async def _cancel(self) -> None:
        """Cancel first: ask the shim to cancel the agent inside its process, then wait until
        the shim says how its clean-up went (``cancel_grace`` at most) or exits. Only once the
        agent is running and has sent no final frame; resumes an earlier, interrupted wait."""
        assert self.popen is not None
        if self.cancel_until is None:
            if (
                self.spec.cancel_grace <= 0
                or self.final is not None
                or self.hello is None  # the agent may not be running: nothing to cancel
                or self.handshake  # not all of it written: the shim cannot have started it
                or self.popen.returncode is not None
            ):
                return
            try:
                os.write(self._fd("stdin"), CANCEL)
            except OSError:
                return  # the shim is gone: its exit says how the episode ended
            try:
                os.kill(self.popen.pid, signal.SIGCONT)  # a stopped shim could not act on it
            except OSError:
                pass
            self.cancel_until = time.monotonic() + self.spec.cancel_grace + _CANCEL_MARGIN_S
            self._note(f"cancelling the agent; it has {self.spec.cancel_grace:g} s to clean up")
        with anyio.move_on_after(self.cancel_until - time.monotonic()):
            async with anyio.create_task_group() as tg:

                async def exited() -> None:
                    await self._wait_exit()
                    tg.cancel_scope.cancel()

                tg.start_soon(exited)
                await self.cleanup_seen.wait()
                tg.cancel_scope.cancel()
        if self.cleanup is None:
            # The shim did not say within the grace, or was killed (a second Ctrl-C) before it
            # could: the agent was asked to clean up and was not seen to finish.
            self.cleanup = "cut short"

    async def _abort(self) -> None:
        """Teardown after cancellation or an unexpected error: cancel the agent, kill the
        tree, reap the shim."""
        if self.popen is None or self.tree is None:
            return
        # The pumps went with the cancelled task group: the agent's clean-up must not block on
        # a full pipe, and the shim's report must be read.
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                self._pump, self._fd("stdout"), self._on_stdout, anyio.Event(), self._at_eof
            )
            tg.start_soon(self._pump, self._fd("stderr"), self._on_stderr, anyio.Event())
            await self._end_early()
            tg.cancel_scope.cancel()
        with anyio.move_on_after(self.spec.kill_grace + _SHIM_STUCK_S):
            await self._wait_exit()

    async def _wait_exit(self) -> None:
        assert self.popen is not None
        if isinstance(self.popen, _templates.Forked):
            await self.popen.wait_exit()
            return
        if self.pidfd is not None:
            # Readable once the process has exited; poll() then reaps it without blocking.
            await anyio.wait_readable(self.pidfd)
            self.popen.poll()
            return
        while self.popen.poll() is None:  # noqa: ASYNC110 - no pidfd on this platform
            await anyio.sleep(0.01)

    # --- pipes ------------------------------------------------------------------------------

    def _fd(self, name: str) -> int:
        if name != "stderr":
            assert self.channel is not None
            return self.channel
        pipe = getattr(self.popen, name)
        assert pipe is not None
        fd: int = pipe.fileno()
        return fd

    def _as_fork(self) -> str | None:
        """A template's fork, before its handshake: into its leaf before it may start anything,
        and its TMPDIR under the template's. A problem, or None."""
        assert isinstance(self.popen, _templates.Forked)
        assert self.template is not None
        if self.leaves is not None:
            problem = self.leaves.move(self.popen.pid)
            if problem is not None:
                return problem
        self.public["forked"] = True
        if "pidns" in _containment.layers(self.containment):
            self.public["scoped"] = True  # its PID namespace is shared: a domain of its own
        outer = self.template.sandbox
        if self.sandbox is not None and outer is not None and self.spec.sandbox is not None:
            found = _sandbox.prepare(
                self.spec.sandbox,
                episode_id=self.episode_id,
                cwd=str(self.spec.cwd) if self.spec.cwd is not None else os.getcwd(),
                child_env=self.spec.env,
                mountns=True,
                can_unshare=False,
                under=outer.tmpdir,
            )
            if isinstance(found, str):
                return found
            _sandbox.remove_tmpdir(self.sandbox.tmpdir)
            self.sandbox = found
            # The template's mounts are its forks': a fork can make none of its own.
            self.public["sandbox"] = {**found.handshake, "mounts": [], "unshare_mounts": False}
            self.public["temp_env"] = {k: found.tmpdir for k in _templates.TEMP_ENV}
        return None

    def _push_handshake(self) -> bool:
        """Write as much of the handshake as the stdin pipe takes now; True once it is out."""
        fd = self._fd("stdin")
        try:
            while self.handshake:
                self.handshake = self.handshake[os.write(fd, self.handshake) :]
        except BlockingIOError:
            return False
        except (BrokenPipeError, ConnectionResetError):
            self.handshake = memoryview(b"")  # the child is gone; its exit says why
        return True

    async def _write_handshake(self) -> None:
        while not self._push_handshake():
            await anyio.wait_writable(self._fd("stdin"))
        # stdin stays open: its EOF is how the shim learns that the parent died.

    async def _pump(
        self,
        fd: int,
        sink: Callable[[bytes], Any],
        eof: anyio.Event,
        at_eof: Callable[[], Any] | None = None,
    ) -> None:
        read = self.network.recv if self.network is not None and fd == self.channel else os.read
        try:
            while True:
                try:
                    chunk = read(fd, _READ_CHUNK)
                except BlockingIOError:
                    await anyio.wait_readable(fd)
                    continue
                except ConnectionResetError:
                    break  # the child closed the socket with our handshake unread: EOF too
                if not chunk:
                    if at_eof is not None:
                        await at_eof()
                    break
                await sink(chunk)
                # A child that writes without pause must not starve the event loop.
                await anyio.lowlevel.checkpoint()
        finally:
            eof.set()

    async def _on_stderr(self, chunk: bytes) -> None:
        if self.redact and len(chunk) > _BIG_STDERR_CHUNK:
            # A child that writes pieces of its key at every offset makes the scrubber slow:
            # off the event loop, where the interpreter's switch interval bounds the lag.
            scrubbed = await anyio.to_thread.run_sync(self.redact.stream, chunk)
        else:
            scrubbed = self.redact.stream(chunk)
        self._keep_stderr(scrubbed)

    def _keep_stderr(self, data: bytes, *, final: bool = False) -> None:
        """Keep what the child wrote as valid UTF-8: bytes that are not are written as
        ``\\xNN``, and a character split across reads is held until it is whole, so that
        isolate's own lines between two reads cannot land inside one."""
        self._keep(self.stderr_decoder.decode(data, final).encode())

    def _keep(self, data: bytes) -> None:
        if not data:
            return
        if self.log is not None:
            self._log(data)
        self.tail.write(data)

    def _log(self, data: bytes) -> None:
        try:
            self._write_log(data)
        except OSError as exc:
            self._lose_log(exc)

    def _lose_log(self, exc: OSError) -> None:
        """The log cannot be written (a full disk, say): stop writing it, say so in the tail,
        and go on. The episode's result does not depend on its log."""
        log, self.log = self.log, None
        try:
            log.close()  # closes the file even when the flush inside fails again
        except OSError:
            pass
        problem = f"cannot write the log {self.log_path}: {exc.strerror or exc}"
        self._note(f"{problem}; it stops here, the outcome's tail goes on")

    def _write_log(self, data: bytes) -> None:
        """Write and flush: ``tail -f`` shows what came, and a parent that is killed loses
        nothing that was read."""
        cap = self.spec.limits.log_bytes if self.spec.limits is not None else None
        if cap is None:
            self.log.write(data)
        else:
            room = cap - self.log_written
            if room > 0:
                self.log.write(data[:room])
            self.log_written += len(data)
            if room >= 0 and self.log_written > cap:
                note = (
                    f"\n[isolate] log cut at limits.log_bytes={cap}; the outcome's tail goes on\n"
                )
                self.log.write(note.encode())
        self.log.flush()

    def _note(self, text: str) -> None:
        """A line from isolate itself into the episode's log and tail."""
        self._keep(f"[isolate] {text}\n".encode("utf-8", "backslashreplace"))

    async def _on_stdout(self, chunk: bytes) -> None:
        for line in self.splitter.feed(chunk):
            await self._on_line(line)

    async def _at_eof(self) -> None:
        """stdout ended: a last line without its newline is a frame if it is whole, and a
        violation if it is a frame cut short."""
        rest = self.splitter.rest()
        if isinstance(rest, int):
            self._violate(f"an incomplete frame at EOF: {rest} bytes, {self._over_cap()}")
        elif rest is not None:
            await self._on_line(rest, last=True)

    async def _on_line(self, line: bytes | int, *, last: bool = False) -> None:
        if isinstance(line, int):
            self._violate(f"frame of {line} bytes, {self._over_cap()}")
            return
        args = (line, self.nonce, self.redact, self.spec.max_info_bytes)
        if len(line) > _BIG_FRAME:
            item = await anyio.to_thread.run_sync(proto.parse_line, *args)
        else:
            item = proto.parse_line(*args)
        if last and isinstance(item, proto.Noise) and item.reason == "not JSON":
            self._violate(f"an incomplete frame at EOF: {len(line)} bytes without a newline")
        elif isinstance(item, proto.Noise):
            shown = item.preview.decode("utf-8", "backslashreplace")
            self._note(f"ignored stdout line ({item.reason}): {shown!r}")
        elif isinstance(item, proto.Violation):
            self._violate(item.message)
        else:
            self._on_frame(item)

    def _over_cap(self) -> str:
        if self.frame_cap == self.spec.max_frame_bytes:
            return f"over max_frame_bytes ({self.frame_cap})"
        room = proto.FRAME_ROOM // (1024 * 1024)
        return f"over max_info_bytes + {room} MiB ({self.frame_cap}), less than max_frame_bytes"

    def _violate(self, message: str) -> None:
        message = proto.one_line(message)
        self.violations.append(message)
        self._note(f"protocol violation: {message}")

    def _on_frame(self, frame: proto.Frame) -> None:
        if isinstance(frame, proto.Hello):
            if self.hello is not None:
                self._violate("a second hello frame")
            elif frame.containment not in (None, self.containment):
                level = f"{frame.containment!r}, not {self.containment!r}"
                self._violate(f"the shim set up containment {level}")
            self.hello = frame
            self.hello_at = time.monotonic()
            self._open_gate()
        elif self.hello is None:
            self._violate(f"a {frame.t!r} frame before hello")
        elif isinstance(frame, proto.Result | proto.Error):
            if self.final is not None:
                self._violate(f"a second final frame ({frame.t!r} after {self.final.t!r})")
            else:
                self.final = frame
        elif isinstance(frame, proto.CleanupFrame):
            if self.cleanup is None:
                self.cleanup = frame.how
                self._note(f"the agent's clean-up {frame.how}")
            self.cleanup_seen.set()
        elif isinstance(frame, proto.Sandboxed):
            self.sandbox_missing = frame.missing
        elif isinstance(frame, proto.Net):
            problem = (
                self.network.take()
                if self.network is not None
                else "a net frame, with no network asked for"
            )
            if problem is not None:
                self._violate(problem)
        elif isinstance(frame, proto.Done):
            if self.done is not None:
                self._violate("a second done frame")
            self.done = frame

    def _open_gate(self) -> None:
        """Let the next episode start: this one is past its interpreter's start-up."""
        if self.gate is not None:
            self.gate.release_on_behalf_of(self)
            self.gate = None

    def _close(self) -> None:
        if self.channel is not None:
            os.close(self.channel)
            self.channel = None
        if self.popen is not None:
            for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
                if pipe is not None:
                    pipe.close()
            if self.popen.returncode is None:
                self.popen.poll()
            if isinstance(self.popen, _templates.Forked):
                self.popen.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self._keep_stderr(self.redact.flush(), final=True)
        if self.network is not None:
            self.network.close()
            summary = self.network.egress.summary()
            if summary is not None:
                self._note(summary)

    def _close_log(self) -> None:
        if self.log is not None:
            try:
                self.log.close()
            except OSError:
                pass  # the outcome is out already; what is in the file stays
            self.log = None

    # --- the outcome ------------------------------------------------------------------------

    def _sandbox_report(self) -> _sandbox.SandboxReport | None:
        if self.sandbox is None:
            return None
        missing = [self.redact.text(m) for m in self.sandbox_missing or []]
        refused = self.network.egress.refused if self.network is not None else {}
        return self.sandbox.report(missing, _sandbox.landlock_abi(), refused)

    def _conclude(self) -> EpisodeOutcome:
        observed = self._observed()
        status, error, reward, info, reason = _verdict.conclude(observed)
        return self._finish(status, error, reward, info, reason, observed)

    def _observed(self) -> _verdict.Observed:
        popen = self.popen
        return _verdict.Observed(
            python=self.spec.python,
            timeout=self.spec.timeout,
            limits=self.spec.limits,
            violations=tuple(self.violations),
            hello=self.hello,
            final=self.final,
            done=self.done,
            timed_out=self.timed_out,
            cancelled_after=(
                self.cancelled_at - self.started if self.cancelled_at is not None else None
            ),
            returncode=popen.returncode if popen is not None else None,
            status_known=not isinstance(popen, _templates.Forked) or popen.status_known,
            last_line=_verdict.last_line(self.tail.value()),
            oom_kills=self.oom_kills,
            pids_limit_hits=self.pids_limit_hits,
        )

    def _finish(
        self,
        status: Status,
        error: ErrorInfo | None,
        reward: float | dict[str, float] | None = None,
        info: Any = None,
        reason: str | None = None,
        observed: _verdict.Observed | None = None,
    ) -> EpisodeOutcome:
        if self.popen is not None:
            exit_code, sig = _verdict.exit_of(observed or self._observed())
        else:
            exit_code, sig = None, None
        killed = self.killed
        if self.done is not None and not self.swept_live:
            killed += self.done.killed
        tail = self.tail.value()
        outcome = EpisodeOutcome(
            status=status,
            reward=reward,
            info=info,
            exit_code=exit_code,
            signal=sig,
            pid=self.popen.pid if self.popen is not None else None,
            duration_s=time.monotonic() - self.started,
            stderr_tail=tail.decode("utf-8", "replace"),
            log_path=self.log_path,
            error=error,
            killed=killed,
            episode_id=self.episode_id,
            containment=(self.hello.containment or "session") if self.hello else self.containment,
            reason=reason,
            oom_kills=self.oom_kills,
            timings=self._timings(),
            cleanup=self.cleanup,
            sandbox=self._sandbox_report(),
            start="template" if self.template is not None else "fresh",
            preload_refused=self.preload_refused,
        )
        if self.log is not None:
            try:
                self.log.write(
                    f"[isolate] {outcome.summary()}\n".encode("utf-8", "backslashreplace")
                )
            except OSError as exc:
                self._lose_log(exc)
        self.outcome = outcome
        return outcome

    def _timings(self) -> Timings:
        started = self.hello_at - self.spawned if self.hello_at is not None else None
        return Timings(
            admission_s=self.ticket.wait_s if self.ticket is not None else 0.0,
            start_wait_s=self.start_wait_s,
            start_s=started,
        )


def _err(kind: str, message: str) -> ErrorInfo:
    return ErrorInfo(type=kind, message=message)


def _secret_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        # Say what is wrong without echoing the value.
        raise ArgumentError(
            f"secret {name!r} must be a str or SecretStr, not {type(value).__name__}"
        )
    return value


def _secret_env(
    spec: EpisodeSpec, secret_env: Mapping[str, str | SecretStr]
) -> dict[str, SecretStr]:
    """``secret_env`` checked and wrapped: names a process environment can hold, values
    without NUL (said without echoing them), none that the spec's ``env`` sets as well."""
    out: dict[str, SecretStr] = {}
    for name, value in secret_env.items():
        if not isinstance(name, str) or not is_env_name(name) or name == EPISODE_ENV:
            raise ArgumentError(f"secret_env: invalid variable name {name!r}")
        secret = value if isinstance(value, SecretStr) else SecretStr(_secret_str(name, value))
        if "\x00" in secret.get_secret_value():
            raise ArgumentError(f"secret_env: the value of {name} contains a NUL byte")
        out[name] = secret
    both = sorted(set(out) & set(spec.env))
    if both:
        raise ArgumentError(f"variables in both secret_env and spec.env: {', '.join(both)}")
    return out
