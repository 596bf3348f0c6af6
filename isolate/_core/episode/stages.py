"""The results an episode's stages hand on, each made once and never changed (see
``launcher``), and the outcome made from the last one an episode reached: the verdict's
:class:`~.verdict.Observed` gathered from them, and the :class:`EpisodeOutcome` written into
the log."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import templates as _templates
from ..model.config import EpisodeSpec
from ..model.errors import SetupProblem
from ..model.outcome import EpisodeOutcome, ErrorInfo, Status, Timings
from ..system import admission as _admission
from . import child as _child
from . import protocol as _proto
from . import verdict as _verdict
from .episode_log import EpisodeLog
from .frames import Frames
from .infra import infra_kind
from .prepare import Prepared, Request
from .watch import EpisodeWatch


@dataclass(frozen=True)
class Episode:
    """What every stage reads: the request, the child program (``pid1``: it may be started
    as PID 1 of a PID namespace the parent makes, as the shim may), when the episode began,
    and the log (written through its own methods)."""

    req: Request
    shim: Path
    pid1: bool
    began: float
    log: EpisodeLog

    @property
    def spec(self) -> EpisodeSpec:
        return self.req.spec


@dataclass(frozen=True)
class Ready:
    """Admitted and prepared: what the start needs."""

    ticket: _admission.Ticket
    prep: Prepared
    env: dict[str, str] | None = None
    """The exec environment, built with the log opened in the same trip; None when the log
    could not be opened then (the start tries again, waiting for room in the fd table)."""


@dataclass(frozen=True)
class Chosen:
    """How the shim will start: the log open, its exec environment built, and the template to
    fork it from (None: fresh)."""

    ready: Ready
    env: dict[str, str]
    template: _templates.Template | None
    refused: str | None  # why preload gave no template (scrubbed)


@dataclass(frozen=True)
class Started:
    """The shim running, fresh or forked, its handshake under way."""

    chosen: Chosen
    prep: Prepared  # what it runs with: a fork's wall is carved under its template's
    child: _child.Child
    forked: bool
    frames: Frames
    watch: EpisodeWatch
    spawned: float  # time.monotonic() at the start: the timeout counts from here
    start_wait_s: float  # at the start gate
    refused: str | None  # why it did not start from a template (scrubbed), if one was asked


@dataclass(frozen=True)
class Cancelled:
    """The caller's cancellation: when it came, whether a final frame had come by then."""

    at: float
    in_time: bool
    exc: BaseException


#: How far an episode got: the last stage's result (None: not even admitted).
Reached = _admission.Ticket | Ready | Chosen | Started | None


class StartFailed(SetupProblem):
    """The shim's process was made, then could not be set up (and is killed)."""

    def __init__(self, message: str, child: _child.Child) -> None:
        super().__init__(message)
        self.child = child


# --- the verdict and the outcome --------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """What the outcome reads of the stages an episode reached."""

    ticket: _admission.Ticket | None = None
    prep: Prepared | None = None
    child: _child.Child | None = None
    started: Started | None = None
    refused: str | None = None

    @classmethod
    def of(cls, reached: Reached, failed: SetupProblem | None = None) -> Seen:
        """From the last stage reached; ``failed``: the set-up problem that ended the episode
        there, which holds the child when one was made (and killed)."""
        if isinstance(reached, Started):
            ready = reached.chosen.ready
            return cls(ready.ticket, reached.prep, reached.child, reached, reached.refused)
        child = failed.child if isinstance(failed, StartFailed) else None
        if isinstance(reached, Chosen):
            ready = reached.ready
            return cls(ready.ticket, ready.prep, child, refused=reached.refused)
        if isinstance(reached, Ready):
            return cls(reached.ticket, reached.prep)
        return cls(reached)


def observed(ep: Episode, seen: Seen, cancelled: Cancelled | None) -> _verdict.Observed:
    """Everything the verdict depends on; ``cancelled``: the caller's cancellation, which
    counts as the deadline unless a final frame had come by then."""
    started, child = seen.started, seen.child
    frames = started.frames if started is not None else None
    sup = started.watch if started is not None else None
    if cancelled is not None:
        timed_out = not cancelled.in_time
    else:
        timed_out = sup is not None and sup.timed_out
    return _verdict.Observed(
        python=ep.spec.python,
        timeout=ep.spec.timeout,
        limits=ep.spec.limits,
        violations=tuple(frames.violations) if frames is not None else (),
        hello=frames.hello if frames is not None else None,
        final=frames.final if frames is not None else None,
        done=frames.done if frames is not None else None,
        timed_out=timed_out,
        cancelled_after=cancelled.at - ep.began if cancelled is not None else None,
        returncode=child.returncode if child is not None else None,
        status_known=child.status_known if child is not None else True,
        last_line=_verdict.last_line(ep.log.tail.value()),
        oom_kills=sup.oom_kills if sup is not None else None,
        pids_limit_hits=sup.pids_limit_hits if sup is not None else 0,
        cpu_s=child.cpu_s if child is not None else None,
    )


def make_outcome(
    ep: Episode,
    seen: Seen,
    status: Status,
    error: ErrorInfo | None,
    verdict: tuple[float | dict[str, float] | None, Any, str | None] = (None, None, None),
    obs: _verdict.Observed | None = None,
    containment: str = "session",
) -> EpisodeOutcome:
    """The outcome, from the verdict and what the stages reached; written into the log.
    ``containment``: what to show when the episode was not even prepared."""
    reward, info, reason = verdict
    started, child, prep = seen.started, seen.child, seen.prep
    frames = started.frames if started is not None else None
    sup = started.watch if started is not None else None
    exit_code, sig = None, None
    if child is not None:
        exit_code, sig = _verdict.exit_of(obs or observed(ep, seen, None))
    killed = sup.killed if sup is not None else 0
    done = frames.done if frames is not None else None
    if done is not None and not (sup is not None and sup.swept_live):
        killed += done.killed
    hello = frames.hello if frames is not None else None
    if hello is not None:
        containment = hello.containment or "session"
    elif prep is not None:
        containment = prep.containment
    final = frames.final if frames is not None else None
    missing = frames.sandbox_missing if frames is not None else None
    made = EpisodeOutcome(
        status=status,
        reward=reward,
        info=info,
        exit_code=exit_code,
        signal=sig,
        pid=child.pid if child is not None else None,
        duration_s=time.monotonic() - ep.began,
        stderr_tail=ep.log.tail.value().decode("utf-8", "replace"),
        log_path=ep.log.path,
        error=error,
        killed=killed,
        episode_id=ep.req.episode_id,
        containment=containment,
        reason=reason,
        oom_kills=sup.oom_kills if sup is not None else None,
        timings=_timings(seen),
        cleanup=frames.cleanup if frames is not None else None,
        sandbox=prep.report(missing, ep.req.redact) if prep is not None else None,
        # A fork whose set-up failed (StartFailed) began from its template all the same.
        start="template" if isinstance(child, _templates.Forked) else "fresh",
        preload_refused=seen.refused,
        infra=_infra_of(status, final, error),
    )
    ep.log.summary(made.summary())
    return made


def _timings(seen: Seen) -> Timings:
    started = seen.started
    hello_at = started.frames.hello_at if started is not None else None
    return Timings(
        admission_s=seen.ticket.wait_s if seen.ticket is not None else 0.0,
        start_wait_s=started.start_wait_s if started is not None else 0.0,
        start_s=hello_at - started.spawned if started is not None and hello_at else None,
    )


def _infra_of(
    status: Status, final: _proto.Result | _proto.ErrorFrame | None, error: ErrorInfo | None
) -> str | None:
    """The outcome's ``infra``: only an ``agent_error`` can be the infrastructure's."""
    if status != "agent_error":
        return None
    at_call = isinstance(final, _proto.ErrorFrame) and final.at_call
    return infra_kind(error, at_call)
