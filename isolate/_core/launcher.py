"""``run_episode``: one episode in one fresh process, and the whole tree back afterwards.

The steps, each in a part of its own: admission (``admission``: the fd budget), preparation
(``prepare``: paths, containment, sandbox, environment, handshake), the start (``child``: fresh
or forked from a template), supervision (``supervise``, reading ``frames``), the verdict
(``verdict``). :class:`_Run` holds them together, with the shielded clean-up in its
``finally``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
from anyio.lowlevel import RunVar
from pydantic import SecretStr

from . import admission as _admission
from . import child as _child
from . import protocol as _proto
from . import sandbox as _sandbox
from . import templates as _templates
from . import verdict as _verdict
from .config import EpisodeSpec
from .episode_log import EpisodeLog
from .errors import SetupProblem
from .frames import Frames
from .infra import infra_kind
from .outcome import EpisodeOutcome, ErrorInfo, Status, Timings
from .prepare import Prepared, Request, exec_env
from .prepare import prepare as _prepare
from .shim import boot_path
from .supervise import Graces, Supervisor

__all__ = ["run_episode"]


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
    req = Request.check(spec, data, kwargs or {}, secrets or {}, episode_id, secret_env or {})
    return await _Run(req).run(on_start, on_end)


async def _run_with_shim(
    spec: EpisodeSpec,
    data: Any,
    shim: Path,
    *,
    kwargs: Mapping[str, Any] | None = None,
    secrets: Mapping[str, SecretStr | str] | None = None,
    episode_id: str | None = None,
    secret_env: Mapping[str, SecretStr | str] | None = None,
    on_start: Callable[[int], object] | None = None,
) -> EpisodeOutcome:
    """Like :func:`run_episode` with another child program; for protocol tests and benches."""
    req = Request.check(spec, data, kwargs or {}, secrets or {}, episode_id, secret_env or {})
    return await _Run(req, shim).run(on_start, None)


_STARTING: RunVar[anyio.CapacityLimiter] = RunVar("isolate_starting")


def _starting_gate() -> anyio.CapacityLimiter:
    """The event loop's limit on children between spawn and hello (created on first use)."""
    try:
        return _STARTING.get()
    except LookupError:
        gate = anyio.CapacityLimiter(max(4, 2 * (os.cpu_count() or 1)))
        _STARTING.set(gate)
        return gate


class _Run:
    """One episode, from checked arguments to outcome: admit, prepare, start, supervise,
    conclude, and whatever happens, clean up.

    What the child sends enters at two places only, and is scrubbed of the secrets there,
    before anything keeps it: stderr in the supervisor, stdout in ``proto.parse_line`` (a
    frame is built from the scrubbed object). Frames, log and outcome hold only scrubbed
    data, so a field added to a frame is scrubbed without anyone thinking of it.
    """

    def __init__(self, req: Request, shim: Path | None = None) -> None:
        self.req, self.spec = req, req.spec
        self.shim = boot_path() if shim is None else shim
        self.started = time.monotonic()
        self.spawned = self.started  # the timeout counts from here
        limits = self.spec.limits
        self.log = EpisodeLog(self.spec.stderr_tail_bytes, limits.log_bytes if limits else None)
        self.prep = Prepared()
        self.frames = Frames(
            nonce=req.nonce,
            redact=req.redact,
            max_frame_bytes=self.spec.max_frame_bytes,
            max_info_bytes=self.spec.max_info_bytes,
            containment=self.prep.containment,
            note=self.log.note,
            on_hello=self._open_gate,
            on_net=lambda: self.prep.take_net(),  # a fork's, once handed on
        )
        self.env: dict[str, str] | None = None  # the shim's exec environment, once built
        self.ticket: _admission.Ticket | None = None  # this episode's share of the fd budget
        self.gate: anyio.CapacityLimiter | None = None  # held from spawn to hello
        self.start_wait_s = 0.0
        self.asked_template = False
        self.template: _templates.Template | None = None  # the one it was forked from
        self.preload_refused: str | None = None  # why preload gave no template
        self.child: _child.Child | None = None
        self.channel: int | None = None  # our end of the socket that is the child's stdin+stdout
        self.supervisor: Supervisor | None = None  # once the child is started
        self.cancelled_at: float | None = None  # when the caller's cancellation arrived
        self.cancelled_in_time = False  # a final frame had come by then
        self.outcome: EpisodeOutcome | None = None  # once concluded

    async def run(
        self,
        on_start: Callable[[int], object] | None,
        on_end: Callable[[EpisodeOutcome], object] | None,
    ) -> EpisodeOutcome:
        try:
            outcome = await self._run(on_start)
        finally:
            self.log.close()  # last: _finish writes its summary line into it
            if self.ticket is not None:
                self.ticket.release()  # every fd of the episode is closed now
            # Also when a cancellation propagates: the caller still learns how the episode ended.
            if on_end is not None and self.outcome is not None:
                on_end(self.outcome)
        return outcome

    async def _run(self, on_start: Callable[[int], object] | None) -> EpisodeOutcome:
        try:
            try:
                await self._set_up()
            except SetupProblem as exc:
                return self._finish("setup_error", ErrorInfo(type="SetupError", message=str(exc)))
            if self.supervisor is None or self.child is None:
                message = f"no template was ready within {self.spec.timeout:g} s"
                return self._finish("timeout", ErrorInfo(type="EpisodeTimeout", message=message))
            if on_start is not None:
                on_start(self.child.pid)
            await self.supervisor.run(self.spawned + self.spec.timeout)
        except BaseException as exc:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                # The caller's cancellation ends the episode as a deadline would.
                self.cancelled_at = time.monotonic()
                self.cancelled_in_time = self.frames.final is not None
            if self.supervisor is not None:
                with anyio.CancelScope(shield=True):
                    await self.supervisor.abort()
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()
            if self.cancelled_at is not None:
                self._conclude()  # for on_end: the cancellation goes on
        return self._conclude()

    # --- set-up -----------------------------------------------------------------------------

    async def _set_up(self) -> None:
        """Admission, preparation and the start; raises :class:`SetupProblem`."""
        # Wait for this episode's fds to fit the open-file limit, instead of hitting EMFILE.
        ticket = await _admission.admit(self.req.episode_id, _admission.episode_fds(self.spec))
        self.ticket = ticket
        await anyio.to_thread.run_sync(_prepare, self.req, self.shim, self.prep, self.log.note)
        self.frames.containment = self.prep.containment
        while True:  # a full fd table means: wait for room, retry
            try:
                if not await self._start():
                    return  # no template in time: no process
            except OSError as exc:
                if not _admission.exhausted(exc):
                    raise SetupProblem(
                        f"cannot start interpreter {self.spec.python!r}: {exc.strerror or exc}"
                    ) from None
                self._open_gate()
                problem = await ticket.starved(exc, self.spec.timeout)
                if problem is not None:
                    raise SetupProblem(problem) from None
                continue
            self.spawned = time.monotonic()
            ticket.started()
            return

    async def _start(self) -> bool:
        """Open the log, find the template, spawn the shim; False when no template came in
        time. OSError goes on (EMFILE: the caller waits for room and calls again)."""
        await anyio.to_thread.run_sync(self._open_log)
        assert self.env is not None
        if self.spec.preload and not self.asked_template:
            self.asked_template = True  # once: a retry after EMFILE does not ask again
            with anyio.move_on_after(self.spec.timeout) as scope:
                self.template = await _templates.acquire(
                    self.spec,
                    self.env,
                    self.prep.agent_root,
                    self.prep.containment,
                    self.log.note,
                    self._fresh_because,
                )
            if scope.cancelled_caught:
                return False
        # At most a few children between spawn and hello at once: 200 interpreters starting
        # together on 2 cores starve the event loop for seconds (p99 lag 1.1 s).
        gate, waited = _starting_gate(), time.monotonic()
        await gate.acquire_on_behalf_of(self)
        self.gate = gate  # only once held: a cancelled wait has nothing to release
        self.start_wait_s += time.monotonic() - waited
        await anyio.to_thread.run_sync(self._spawn)
        return True

    def _open_log(self) -> None:
        if self.spec.log_dir is not None:
            self.log.open(self.spec.log_dir, self.req.episode_id)
        if self.env is None:  # once, after the log is open: its first line names what is withheld
            self.env, withheld = exec_env(self.req, self.prep)
            if withheld is not None:
                self.log.note(withheld)

    def _spawn(self) -> None:
        """Start the shim and hand it its episode; blocking, in a worker thread. Raises
        SetupProblem (with the child killed)."""
        assert self.env is not None
        launch = _child.Launch(self.spec.python, self.shim, self.env, self.spec.cwd)
        template = self.template
        child, self.channel = _child.start(
            launch, template, self.req.episode_id, self._template_gone
        )
        self.child = child
        if template is not None and self.template is not None:
            self.log.note(f"forked from {template.name} (pid {child.pid})")
        self.prep = _child.into_template(self.req, self.prep, child, template)
        rest, tree = _child.hand_over(self.req, self.prep, self.env, child, self.channel)
        graces = Graces(self.spec.timeout, self.spec.kill_grace, self.spec.cancel_grace)
        self.supervisor = Supervisor(
            child=child,
            channel=self.channel,
            tree=tree,
            handshake=rest,
            frames=self.frames,
            log=self.log,
            redact=self.req.redact,
            graces=graces,
            leaves=self.prep.leaves,
            network=self.prep.network,
        )

    def _template_gone(self, reason: str) -> None:
        # The next episode starts a new template; this one need not wait for it.
        self.log.note(f"{reason}; this episode starts fresh")
        self._fresh_because(reason)
        self.template = None

    def _fresh_because(self, reason: str) -> None:
        self.preload_refused = self.req.redact.text(reason)

    def _open_gate(self) -> None:
        """Let the next episode start: this one is past its interpreter's start-up."""
        if self.gate is not None:
            self.gate.release_on_behalf_of(self)
            self.gate = None

    # --- clean-up ---------------------------------------------------------------------------

    async def _release(self) -> None:
        """Close what the parent holds, remove the leaves and the sandbox's TMPDIR."""
        self._open_gate()
        self._close()
        leaves = self.prep.leaves
        if leaves is not None:
            problem = self.supervisor.leaves_problem if self.supervisor is not None else None
            if leaves.dirs:  # not yet removed by the supervisor
                problem = await anyio.to_thread.run_sync(leaves.remove)
            if problem is not None:
                self.log.note(f"cgroup clean-up: {problem}; the next start of isolate removes it")
        if self.prep.sandbox is not None:
            await anyio.to_thread.run_sync(_sandbox.remove_tmpdir, self.prep.sandbox.tmpdir)

    def _close(self) -> None:
        self.frames.note_counts()  # when stdout never reached its EOF
        if self.channel is not None:
            os.close(self.channel)
            self.channel = None
        if self.child is not None:
            self.child.close()
        self.log.keep_stderr(self.req.redact.flush(), final=True)
        self.prep.close_network(self.log.note)

    # --- the outcome ------------------------------------------------------------------------

    def _conclude(self) -> EpisodeOutcome:
        observed = self._observed()
        status, error, reward, info, reason = _verdict.conclude(observed)
        return self._finish(status, error, reward, info, reason, observed)

    def _observed(self) -> _verdict.Observed:
        child, sup, frames = self.child, self.supervisor, self.frames
        if self.cancelled_at is not None:
            timed_out = not self.cancelled_in_time
        else:
            timed_out = sup is not None and sup.timed_out
        return _verdict.Observed(
            python=self.spec.python,
            timeout=self.spec.timeout,
            limits=self.spec.limits,
            violations=tuple(frames.violations),
            hello=frames.hello,
            final=frames.final,
            done=frames.done,
            timed_out=timed_out,
            cancelled_after=(
                self.cancelled_at - self.started if self.cancelled_at is not None else None
            ),
            returncode=child.returncode if child is not None else None,
            status_known=child.status_known if child is not None else True,
            last_line=_verdict.last_line(self.log.tail.value()),
            oom_kills=sup.oom_kills if sup is not None else None,
            pids_limit_hits=sup.pids_limit_hits if sup is not None else 0,
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
        child, sup, frames = self.child, self.supervisor, self.frames
        exit_code, sig = (
            _verdict.exit_of(observed or self._observed()) if child is not None else (None, None)
        )
        killed = sup.killed if sup is not None else 0
        if frames.done is not None and not (sup is not None and sup.swept_live):
            killed += frames.done.killed
        hello = frames.hello
        outcome = EpisodeOutcome(
            status=status,
            reward=reward,
            info=info,
            exit_code=exit_code,
            signal=sig,
            pid=child.pid if child is not None else None,
            duration_s=time.monotonic() - self.started,
            stderr_tail=self.log.tail.value().decode("utf-8", "replace"),
            log_path=self.log.path,
            error=error,
            killed=killed,
            episode_id=self.req.episode_id,
            containment=(hello.containment or "session") if hello else self.prep.containment,
            reason=reason,
            oom_kills=sup.oom_kills if sup is not None else None,
            timings=self._timings(),
            cleanup=frames.cleanup,
            sandbox=self.prep.report(self.frames.sandbox_missing, self.req.redact),
            start="template" if self.template is not None else "fresh",
            preload_refused=self.preload_refused,
            infra=_infra_of(status, frames.final, error),
        )
        self.log.summary(outcome.summary())
        self.outcome = outcome
        return outcome

    def _timings(self) -> Timings:
        hello_at = self.frames.hello_at
        return Timings(
            admission_s=self.ticket.wait_s if self.ticket is not None else 0.0,
            start_wait_s=self.start_wait_s,
            start_s=hello_at - self.spawned if hello_at is not None else None,
        )


def _infra_of(
    status: Status, final: _proto.Result | _proto.Error | None, error: ErrorInfo | None
) -> str | None:
    """The outcome's ``infra``: only an ``agent_error`` can be the infrastructure's."""
    if status != "agent_error":
        return None
    at_call = isinstance(final, _proto.Error) and final.at_call
    return infra_kind(error, at_call)
