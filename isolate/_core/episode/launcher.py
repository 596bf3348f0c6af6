"""``run_episode``: one episode in one fresh process, and the whole tree back afterwards.

An episode is a pipeline of stages, each taking what the one before made and handing on a
result that does not change afterwards:

1. the arguments checked (``prepare.Request``);
2. admitted (``admission``: its share of the fd budget, a :class:`~.admission.Ticket`);
3. prepared (``prepare.prepare_episode``: paths, containment, the wall, the network, a frozen
   ``Prepared``; ``stages.Ready``), and in the same worker-thread trip the log opened and the
   exec environment built;
4. chosen: the exec environment (built again where the log did not open then), the template
   found when preloading (``stages.Chosen``);
5. started (``child``: fresh, or forked from a template; the handshake under way), with the
   frames reader and the parent's watch made for it (``stages.Started``);
6. observed (``watch`` reading ``frames``, each writing only what it owns);
7. the verdict (``verdict``, a pure function of what was observed) and the outcome
   (``stages.make_outcome``).

What a stage holds (the admission ticket, the start gate, the leaves and the TMPDIR, the
network, the child and its socket) goes on an exit stack as soon as it exists, and is released
in reverse order, shielded from cancellation, before the verdict; the log and the ticket last,
after the outcome is written into the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import anyio
from anyio.lowlevel import RunVar
from pydantic import SecretStr

from .. import templates as _templates
from ..containment import sandbox as _sandbox
from ..model.config import EpisodeSpec
from ..model.errors import SetupProblem
from ..model.outcome import EpisodeOutcome, ErrorInfo
from ..system import admission as _admission
from ..system import offload as _offload
from ..system.shim import boot_path
from . import child as _child
from . import stages as _st
from . import verdict as _verdict
from .episode_log import EpisodeLog
from .frames import Frames
from .prepare import Prepared, Request, Unprepared, exec_env, make_leaves, prepare_episode
from .watch import EpisodeWatch, Graces

__all__ = ["run_episode"]

_T = TypeVar("_T")


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
    return await _episode(req, boot_path(), True, on_start, on_end)


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
    pid1: bool = False,
) -> EpisodeOutcome:
    """Like :func:`run_episode` with another child program; for protocol tests and benches.
    ``pid1``: the program is a copy of the shim, started as the shim is (as PID 1 of a PID
    namespace the parent makes, where it makes one); else as a plain child, whatever the
    containment."""
    req = Request.check(spec, data, kwargs or {}, secrets or {}, episode_id, secret_env or {})
    return await _episode(req, shim, pid1, on_start, None)


_STARTING: RunVar[anyio.CapacityLimiter] = RunVar("isolate_starting")


def _starting_gate() -> anyio.CapacityLimiter:
    """The event loop's limit on children between spawn and hello (created on first use)."""
    try:
        return _STARTING.get()
    except LookupError:
        gate = anyio.CapacityLimiter(max(4, 2 * (os.cpu_count() or 1)))
        _STARTING.set(gate)
        return gate


class _Slot:
    """A place at the start gate, held from the spawn to the shim's hello; released once.

    At most a few children between spawn and hello at once: 200 interpreters starting
    together on 2 cores starve the event loop for seconds (p99 lag 1.1 s)."""

    def __init__(self) -> None:
        self._gate: anyio.CapacityLimiter | None = None

    async def take(self) -> None:
        gate = _starting_gate()
        await gate.acquire_on_behalf_of(self)
        self._gate = gate  # only once held: a cancelled wait has nothing to release

    def release(self) -> None:
        if self._gate is not None:
            self._gate.release_on_behalf_of(self)
            self._gate = None


# --- the pipeline -----------------------------------------------------------------------------


async def _episode(
    req: Request,
    shim: Path,
    pid1: bool,
    on_start: Callable[[int], object] | None,
    on_end: Callable[[EpisodeOutcome], object] | None,
) -> EpisodeOutcome:
    """The stages of one episode, then ``on_end``; the caller's cancellation goes on after."""
    limits = req.spec.limits
    log = EpisodeLog(req.spec.stderr_tail_bytes, limits.log_bytes if limits else None)
    ep = _st.Episode(req, shim, pid1, time.monotonic(), log)
    with contextlib.ExitStack() as kept:  # after the outcome: the log, and the fd budget
        kept.callback(log.close)
        outcome, cancelled = await _stages(ep, on_start, kept)
    if on_end is not None:
        on_end(outcome)  # also when a cancellation goes on: the caller learns how it ended
    if cancelled is not None:
        raise cancelled.exc
    return outcome


async def _stages(
    ep: _st.Episode, on_start: Callable[[int], object] | None, kept: contextlib.ExitStack
) -> tuple[EpisodeOutcome, _st.Cancelled | None]:
    """Admit, prepare, start, observe; release what they hold; the outcome. A set-up problem
    ends it before the release, as its own outcome; an unexpected error goes on."""
    held = contextlib.AsyncExitStack()  # released before the verdict, shielded
    held.callback(lambda: ep.log.keep_stderr(ep.req.redact.flush(), final=True))
    reached: _st.Reached = None
    cancelled = None
    try:
        # Wait for this episode's fds to fit the open-file limit, instead of hitting EMFILE.
        reached = ticket = await _admission.admit(
            ep.req.episode_id, _admission.episode_fds(ep.spec)
        )
        kept.callback(ticket.release)  # every fd of the episode is closed by then
        reached = ready = await _ready(ep, ticket, held)
        chosen = await _choose(ep, ready)
        if chosen is None:
            message = f"no template was ready within {ep.spec.timeout:g} s"
            late = ErrorInfo(type="EpisodeTimeout", message=message)
            return _st.make_outcome(ep, _st.Seen.of(reached), "timeout", late), None
        reached = chosen
        reached = started = await _start(ep, chosen, held)
        cancelled = await _observe(ep, started, on_start)
    except SetupProblem as exc:
        problem = ErrorInfo(type="SetupError", message=str(exc))
        shown = exc.containment if isinstance(exc, Unprepared) else "session"
        seen = _st.Seen.of(reached, exc)
        return _st.make_outcome(ep, seen, "setup_error", problem, containment=shown), None
    except anyio.get_cancelled_exc_class() as exc:
        cancelled = _st.Cancelled(time.monotonic(), False, exc)  # before the start: no frame
    finally:
        with anyio.CancelScope(shield=True):
            await held.aclose()
    seen = _st.Seen.of(reached)
    observed = _st.observed(ep, seen, cancelled)
    status, error, reward, info, reason = _verdict.conclude(observed)
    return _st.make_outcome(ep, seen, status, error, (reward, info, reason), observed), cancelled


async def _ready(
    ep: _st.Episode, ticket: _admission.Ticket, held: contextlib.AsyncExitStack
) -> _st.Ready:
    """Prepare, then open the log, in one worker-thread trip; its leaves, TMPDIR and network go
    on ``held``. Raises :class:`SetupProblem`."""
    prep, env = await _offload.call(_prepare, ep)
    held.push_async_callback(_release_wall, ep, prep)
    held.callback(prep.close_network, ep.log.note)
    return _st.Ready(ticket, prep, env)


def _prepare(ep: _st.Episode) -> tuple[Prepared, dict[str, str] | None]:
    """``prepare_episode``, then :func:`_open_log`: its environment, or None where the log did
    not open (``_choose`` tries again, and meets what failed as it would have first, with what
    was prepared on the exit stack). Blocking."""
    prep = prepare_episode(ep.req, ep.shim, ep.log.note)
    try:
        return prep, _open_log(ep, prep)
    except Exception:
        return prep, None


async def _choose(ep: _st.Episode, ready: _st.Ready) -> _st.Chosen | None:
    """The exec environment (the log opened first, unless ``_ready`` did both), and with
    ``preload`` the template; None when no template came in time. Raises
    :class:`SetupProblem`."""
    env = ready.env
    if env is None:
        env = await _retrying(ep, ready.ticket, lambda: _offload.call(_open_log, ep, ready.prep))
    if not ep.spec.preload:
        return _st.Chosen(ready, env, None, None)
    refused: list[str] = []
    with anyio.move_on_after(ep.spec.timeout) as scope:
        template = await _templates.acquire(
            ep.spec,
            env,
            ready.prep.agent_root,
            ready.prep.containment,
            ep.log.note,
            refused.append,
        )
    if scope.cancelled_caught:
        return None
    why = ep.req.redact.text(refused[-1]) if refused else None
    return _st.Chosen(ready, env, template, why)


async def _start(
    ep: _st.Episode, chosen: _st.Chosen, held: contextlib.AsyncExitStack
) -> _st.Started:
    """``Frames`` built, a place at the start gate, then the spawn. Raises
    :class:`SetupProblem`."""
    prep = chosen.ready.prep
    frames = Frames(
        nonce=ep.req.nonce,
        redact=ep.req.redact,
        max_frame_bytes=ep.spec.max_frame_bytes,
        max_info_bytes=ep.spec.max_info_bytes,
        containment=prep.containment,
        network=prep.network,
        note=ep.log.note,
    )
    waited = 0.0

    async def spawn() -> _st.Started:
        nonlocal chosen, waited
        template = chosen.template
        if template is not None:  # a fork starts no interpreter: no place at the gate
            if template.has_parked() and chosen.ready.prep.sandbox is None:
                # A hand-over touches sockets, pipes, cgroupfs and procfs only: in the event
                # loop, with no worker-thread trip (a fork's sandbox makes its TMPDIR).
                started = _hand_over(ep, chosen, frames, held)
                if started is not None:
                    return started
            # A fork made on demand waits for its template: a thread of its own, so that
            # others' forks are asked for meanwhile.
            offload = _offload.call if template.has_parked() else anyio.to_thread.run_sync
            try:
                return await offload(_spawn, ep, chosen, frames, held, None, 0.0)
            except _templates.TemplateGone as exc:
                # The next episode starts a new template; this one need not wait for it.
                ep.log.note(f"{exc}; this episode starts fresh")
                chosen = dataclasses.replace(
                    chosen, template=None, refused=ep.req.redact.text(str(exc))
                )
        slot, since = _Slot(), time.monotonic()
        await slot.take()
        held.callback(slot.release)
        waited += time.monotonic() - since
        try:
            return await _offload.call(_spawn, ep, chosen, frames, held, slot, waited)
        except OSError:
            slot.release()  # while it waits for room, others may start
            raise

    started = await _retrying(ep, chosen.ready.ticket, spawn)
    chosen.ready.ticket.started()
    template = started.chosen.template
    if started.forked and template is not None:
        _templates.began(template)  # its pool follows its bursts
        held.callback(_templates.ended, template)
    return started


async def _retrying(
    ep: _st.Episode, ticket: _admission.Ticket, attempt: Callable[[], Awaitable[_T]]
) -> _T:
    """``attempt()``, again after each failure for a full fd table, once there is room; any
    other OSError, and a wait for room that is given up, is a :class:`SetupProblem`."""
    while True:
        try:
            return await attempt()
        except OSError as exc:
            if not _admission.exhausted(exc):
                raise SetupProblem(
                    f"cannot start interpreter {ep.spec.python!r}: {exc.strerror or exc}"
                ) from None
            problem = await ticket.starved(exc, ep.spec.timeout)
            if problem is not None:
                raise SetupProblem(problem) from None


def _open_log(ep: _st.Episode, prep: Prepared) -> dict[str, str]:
    """Open the log, then build the exec environment: the log's first line names what it
    withholds. Blocking; OSError for a full fd table goes on."""
    if ep.spec.log_dir is not None:
        ep.log.open(ep.spec.log_dir, ep.req.episode_id, ep.req.tag)
    env, withheld = exec_env(ep.req, prep)
    if withheld is not None:
        ep.log.note(withheld)
    return env


def _spawn(
    ep: _st.Episode,
    chosen: _st.Chosen,
    frames: Frames,
    held: contextlib.AsyncExitStack,
    slot: _Slot | None,
    waited: float,
) -> _st.Started:
    """Start the shim and hand it its episode; blocking, in a worker thread. What it makes
    goes on ``held`` at once. ``slot``: its place at the start gate, given back at hello
    (None for a fork, which starts no interpreter); ``waited``: how long it waited for one.
    Raises :class:`~.stages.StartFailed` (with the child killed)."""
    template = chosen.template
    make_leaves(chosen.ready.prep)  # unless made: a parked fork's may still be adopted
    # A fresh shim whose PID namespace needs no user namespace: the parent makes it.
    pid1 = ep.pid1 and template is None and chosen.ready.prep.userns is False
    launch = _child.Launch(ep.spec.python, ep.shim, chosen.env, ep.spec.cwd, pid1)
    child, channel = _child.start(launch, template, ep.req.episode_id, ep.req.tag)
    return _handshake(ep, chosen, frames, held, (child, channel), slot, waited)


def _hand_over(
    ep: _st.Episode, chosen: _st.Chosen, frames: Frames, held: contextlib.AsyncExitStack
) -> _st.Started | None:
    """As :func:`_spawn`, to a parked fork of the template; None when none is left. Waits on
    nothing but the kernel (sockets, pipes, cgroupfs, procfs): it runs in the event loop."""
    assert chosen.template is not None
    made = _child.start_parked(chosen.template, ep.req.episode_id, ep.req.tag)
    if made is None:
        return None
    return _handshake(ep, chosen, frames, held, made, None, 0.0)


def _handshake(
    ep: _st.Episode,
    chosen: _st.Chosen,
    frames: Frames,
    held: contextlib.AsyncExitStack,
    made: tuple[_child.Child, int],
    slot: _Slot | None,
    waited: float,
) -> _st.Started:
    """After the start: a fork into its wall, the handshake sent (what the socket takes
    now), the watch made."""
    env, template, ready = chosen.env, chosen.template, chosen.ready
    child, channel = made
    held.callback(_close_child, frames, child, channel)
    if template is not None:
        ep.log.note(f"forked from {template.name} (pid {child.pid})")
    try:
        prep = _child.into_template(ep.req, ready.prep, child, template)
        if prep is not ready.prep:  # a fork's: its own TMPDIR, maybe leaves it adopted
            held.push_async_callback(_release_wall, ep, prep)
        rest, tree = _child.send_handshake(ep.req, prep, env, child, channel)
    except SetupProblem as exc:
        raise _st.StartFailed(str(exc), child) from None
    spec = ep.spec
    watch = EpisodeWatch(
        child=child,
        channel=channel,
        tree=tree,
        handshake=rest,
        frames=frames,
        log=ep.log,
        redact=ep.req.redact,
        graces=Graces(spec.timeout, spec.kill_grace, spec.cancel_grace, spec.exit_grace),
        leaves=prep.leaves,
        network=prep.network,
        at_hello=slot.release if slot is not None else None,
    )
    forked = isinstance(child, _templates.Forked)
    spawned = time.monotonic()
    return _st.Started(chosen, prep, child, forked, frames, watch, spawned, waited, chosen.refused)


async def _observe(
    ep: _st.Episode, started: _st.Started, on_start: Callable[[int], object] | None
) -> _st.Cancelled | None:
    """Watch the started episode to its end; the caller's cancellation, when it came
    (the episode is then ended as a deadline would end it). An unexpected error goes on,
    once the tree is torn down."""
    watch = started.watch
    try:
        if on_start is not None:
            on_start(started.child.pid)
        await watch.run(started.spawned + ep.spec.timeout)
    except BaseException as exc:
        cancelled = None
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            cancelled = _st.Cancelled(time.monotonic(), started.frames.final is not None, exc)
        with anyio.CancelScope(shield=True):
            await watch.abort()
        if cancelled is None:
            raise
        return cancelled
    leaves, problem = started.prep.leaves, watch.leaves_problem
    if leaves is not None and problem is not None and not leaves.dirs:  # else the release says
        ep.log.note(f"cgroup clean-up: {problem}; the next start of isolate removes it")
    return None


# --- the release ------------------------------------------------------------------------------


def _close_child(frames: Frames, child: _child.Child, channel: int) -> None:
    frames.note_counts()  # when stdout never reached its EOF
    os.close(channel)
    child.close()


async def _release_wall(ep: _st.Episode, prep: Prepared) -> None:
    """Remove the leaves (unless the episode's watch did) and the sandbox's TMPDIR."""
    leaves = prep.leaves
    if leaves is not None and leaves.dirs:  # not yet removed by the watch
        problem = await _offload.call(leaves.remove)
        if problem is not None:
            ep.log.note(f"cgroup clean-up: {problem}; the next start of isolate removes it")
    if prep.sandbox is not None:
        await _offload.call(_sandbox.remove_tmpdir, prep.sandbox.tmpdir)
