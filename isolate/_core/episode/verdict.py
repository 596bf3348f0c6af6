"""The verdict: how what the parent observed of an episode becomes its status, error, reward
and reason. Pure functions of an :class:`Observed`; the launcher gathers one at the end."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent_shim.shim_wire import PROTOCOL_VERSION

from ..containment import size
from ..model.config import Limits
from ..model.outcome import ErrorInfo, Status, describe_exit, signal_name
from . import protocol as proto


@dataclass(frozen=True)
class Observed:
    """What the parent saw of one episode, all a verdict depends on."""

    python: str
    """The interpreter the shim was started under (``spec.python``)."""
    timeout: float
    """``spec.timeout`` (seconds)."""
    limits: Limits | None
    violations: Sequence[str]
    """Protocol violations, in the order seen."""
    hello: proto.Hello | None
    final: proto.Result | proto.ErrorFrame | None
    """The result or error frame, if one came before the deadline."""
    done: proto.Done | None
    timed_out: bool
    """The deadline (or the caller's cancellation) came before a final frame."""
    cancelled_after: float | None
    """Seconds from the start to the caller's cancellation; None when it was not cancelled."""
    returncode: int | None
    """The shim's exit status as ``Popen.returncode`` has it (negative: a signal)."""
    status_known: bool = True
    """False for a fork whose template died before it said how the fork ended."""
    last_line: str = ""
    """The log's last line that is not isolate's own (at most 300 characters)."""
    oom_kills: int | None = None
    pids_limit_hits: int = 0
    cpu_s: float | None = None
    """The agent's process's CPU time (seconds), where no done frame says it: a fork that is
    its own worker, from its template's wait."""


Verdict = tuple[Status, ErrorInfo | None, float | dict[str, float] | None, Any, str | None]
"""Status, error, reward, info, and the limit that ended the episode (``reason``)."""


def conclude(obs: Observed) -> Verdict:
    """The verdict of an episode. A limit that visibly ended it makes it ``crashed`` with the
    limit as its reason, however its end looked from inside."""
    status, error, reward, info = classify(obs)
    reason = limit_hit(obs) if status in ("agent_error", "crashed", "timeout") else None
    if reason is not None:
        assert error is not None
        kind = error.type if status == "agent_error" else "EpisodeCrashed"
        message = f"{reason} hit: {error.message}"
        error = ErrorInfo(type=kind, message=message, traceback=error.traceback)
        status = "crashed"
    return status, error, reward, info, reason


def limit_hit(obs: Observed) -> str | None:
    """The resource limit that ended the episode, if one visibly did."""
    limits = obs.limits
    if limits is None:
        return None
    if limits.memory_bytes is not None and (
        (obs.oom_kills or 0) > 0
        or (isinstance(obs.final, proto.ErrorFrame) and obs.final.type == "MemoryError")
    ):
        return f"memory limit {size(limits.memory_bytes)}"
    if limits.max_processes is not None and obs.pids_limit_hits > 0:
        return f"process limit {limits.max_processes}"
    if limits.cpu_seconds is not None:
        _, sig = exit_of(obs)
        cpu = obs.done.cpu_s if obs.done is not None else obs.cpu_s
        if sig == "SIGXCPU" or (sig == "SIGKILL" and (cpu or 0) >= limits.cpu_seconds):
            return f"CPU limit {limits.cpu_seconds} s"
    return None


def exit_of(obs: Observed) -> tuple[int | None, str | None]:
    """The agent's exit (code, signal name): the worker's, from the done frame, else the
    shim's own."""
    done = obs.done
    if done is not None and (done.exit_code is not None or done.signal):
        return done.exit_code, signal_name(done.signal) if done.signal else None
    if not obs.status_known:
        return None, None
    code = obs.returncode
    if code is not None and code < 0:
        return None, signal_name(-code)
    return code, None


def classify(
    obs: Observed,
) -> tuple[Status, ErrorInfo | None, float | dict[str, float] | None, Any]:
    """Status, error, reward and info, before limits are considered."""
    final = obs.final
    if obs.violations:
        return "protocol_error", _err("ProtocolError", obs.violations[0]), None, None
    if obs.hello is None:
        if obs.timed_out:
            return "timeout", timeout_error(obs), None, None
        exit_code, sig = exit_of(obs)
        if sig is not None:
            message = f"the shim was killed by {sig} before it started"
            return "crashed", _err("EpisodeCrashed", message), None, None
        last = obs.last_line
        message = (
            f"the shim did not start under {obs.python} "
            f"({describe_exit(exit_code, sig)}){': ' + last if last else ''}"
        )
        return "setup_error", _err("SetupError", message), None, None
    if obs.hello.protocol != PROTOCOL_VERSION:
        message = (
            f"the shim speaks protocol {obs.hello.protocol}, this isolate speaks {PROTOCOL_VERSION}"
        )
        return "protocol_error", _err("ProtocolError", message), None, None
    if obs.timed_out or (obs.done is not None and obs.done.why == "deadline"):
        # No final frame by the deadline (ours, or the shim's own when we were stopped): one
        # that came during teardown does not count.
        return "timeout", timeout_error(obs), None, None
    if isinstance(final, proto.ErrorFrame):
        error = ErrorInfo(type=final.type, message=final.message, traceback=final.traceback)
        return ("setup_error" if final.kind == "setup" else "agent_error"), error, None, None
    if isinstance(final, proto.Result):
        problem = check_reward(final)
        if problem is not None:
            return "protocol_error", _err("ProtocolError", problem), None, None
        return "ok", None, final.reward, final.info
    exit_code, sig = exit_of(obs)
    if sig is None and exit_code == 0:
        message = "the agent's process exited 0 without sending a result"
        return "protocol_error", _err("ProtocolError", message), None, None
    message = f"the agent's process {describe_exit(exit_code, sig)}"
    return "crashed", _err("EpisodeCrashed", message), None, None


def timeout_error(obs: Observed) -> ErrorInfo:
    if obs.cancelled_after is not None:
        return _err("EpisodeTimeout", f"cancelled after {obs.cancelled_after:.1f} s; tree killed")
    return _err("EpisodeTimeout", f"no result within {obs.timeout:g} s; tree killed")


def check_reward(result: proto.Result) -> str | None:
    """Why a result's reward is not one, or None."""
    reward = result.reward
    if reward is None:
        return (
            f"the entrypoint returned a {result.reward_type} ({result.reward_repr}); expected a "
            "number, (reward, extra) or {completion_id: reward}"
        )
    values = reward.values() if isinstance(reward, dict) else [reward]
    for value in values:
        if not math.isfinite(value):
            return f"the reward is {value}, not a finite number"
    return None


def last_line(log_tail: bytes) -> str:
    """The last line of ``log_tail`` that is not isolate's own, cut to 300 characters."""
    lines = [ln for ln in log_tail.decode("utf-8", "replace").splitlines() if ln]
    lines = [ln for ln in lines if not ln.startswith("[isolate]")]
    return lines[-1][:300] if lines else ""


def _err(kind: str, message: str) -> ErrorInfo:
    return ErrorInfo(type=kind, message=message)
