"""The verdict on its own: what was observed -> status, error, reward and reason. The
end-to-end tests (test_results, test_exit, test_protocol, the limit tests) reach these through
real episodes; here the corners that are slow or racy to reach that way."""

from __future__ import annotations

import dataclasses
import signal
from typing import Any

import pytest

from agent_shim.shim_wire import PROTOCOL_VERSION
from isolate import Limits
from isolate._core import protocol as proto
from isolate._core import verdict as v

NONCE = "n" * 32
HELLO = proto.Hello(
    t="hello", nonce=NONCE, protocol=PROTOCOL_VERSION, pid=7, python="3.11", subreaper=True
)


def observed(**changes: Any) -> v.Observed:
    base = v.Observed(
        python="/usr/bin/python3",
        timeout=30.0,
        limits=None,
        violations=(),
        hello=HELLO,
        final=None,
        done=None,
        timed_out=False,
        cancelled_after=None,
        returncode=0,
    )
    return dataclasses.replace(base, **changes)


def done(**fields: Any) -> proto.Done:
    return proto.Done(
        **{
            "t": "done",
            "nonce": NONCE,
            "why": "exited",
            "killed": 0,
            "exit_code": 0,
            "signal": None,
            **fields,
        }
    )


def test_a_result_is_ok_with_its_reward_and_info() -> None:
    result = proto.Result(t="result", nonce=NONCE, reward=0.5, info={"steps": 3})
    assert v.conclude(observed(final=result)) == ("ok", None, 0.5, {"steps": 3}, None)


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), {"a": float("-inf")}])
def test_a_reward_that_is_not_finite_is_a_protocol_error(reward: Any) -> None:
    status, error, *_ = v.conclude(
        observed(final=proto.Result(t="result", nonce=NONCE, reward=reward))
    )
    assert status == "protocol_error"
    assert error is not None
    assert "not a finite number" in error.message


def test_the_callers_cancellation_says_when_it_came() -> None:
    status, error, *_ = v.conclude(observed(timed_out=True, cancelled_after=3.25))
    assert status == "timeout"
    assert error is not None
    assert error.message == "cancelled after 3.2 s; tree killed"
    _, deadline, *_ = v.conclude(observed(timed_out=True))
    assert deadline is not None
    assert deadline.message == "no result within 30 s; tree killed"


def test_a_result_that_came_before_the_deadline_counts_one_after_does_not() -> None:
    result = proto.Result(t="result", nonce=NONCE, reward=1.0)
    assert v.conclude(observed(final=result, returncode=-9))[0] == "ok"
    assert v.conclude(observed(final=result, timed_out=True))[0] == "timeout"
    assert v.conclude(observed(final=result, done=done(why="deadline")))[0] == "timeout"


def test_exit_zero_without_a_result_is_a_protocol_error_a_signal_a_crash() -> None:
    assert v.conclude(observed())[0] == "protocol_error"
    status, error, *_ = v.conclude(observed(returncode=-signal.SIGSEGV))
    assert (status, error and error.message) == (
        "crashed",
        "the agent's process killed by SIGSEGV",
    )


def test_the_workers_exit_wins_over_the_shims_and_a_lost_status_is_unknown() -> None:
    assert v.exit_of(observed(done=done(exit_code=3), returncode=0)) == (3, None)
    assert v.exit_of(observed(done=done(exit_code=None, signal=9))) == (None, "SIGKILL")
    assert v.exit_of(observed(returncode=-15)) == (None, "SIGTERM")
    assert v.exit_of(observed(returncode=1, status_known=False)) == (None, None)


def test_a_shim_that_never_said_hello_is_a_setup_error_with_its_last_line() -> None:
    obs = observed(hello=None, returncode=1, last_line="ImportError: no module named x")
    status, error, *_ = v.conclude(obs)
    assert status == "setup_error"
    assert error is not None
    assert error.message == (
        "the shim did not start under /usr/bin/python3 (exited with 1): "
        "ImportError: no module named x"
    )
    assert v.conclude(observed(hello=None, returncode=-9))[0] == "crashed"
    assert v.conclude(observed(hello=None, timed_out=True))[0] == "timeout"


def test_the_first_violation_is_the_error_whatever_else_came() -> None:
    obs = observed(
        violations=("first", "second"), final=proto.Result(t="result", nonce=NONCE, reward=1.0)
    )
    status, error, *_ = v.conclude(obs)
    assert (status, error and error.message) == ("protocol_error", "first")


def test_another_protocol_version_is_a_protocol_error() -> None:
    hello = HELLO.model_copy(update={"protocol": PROTOCOL_VERSION + 1})
    assert v.conclude(observed(hello=hello))[0] == "protocol_error"


@pytest.mark.parametrize(
    ("limits", "changes", "reason"),
    [
        (Limits(memory_bytes=1 << 30), {"oom_kills": 1, "returncode": -9}, "memory limit 1 GiB"),
        (
            Limits(memory_bytes=1 << 30),
            {
                "final": proto.Error(
                    t="error", nonce=NONCE, kind="agent", type="MemoryError", message=""
                )
            },
            "memory limit 1 GiB",
        ),
        (Limits(max_processes=8), {"pids_limit_hits": 2, "returncode": 1}, "process limit 8"),
        (Limits(cpu_seconds=5), {"returncode": -signal.SIGXCPU}, "CPU limit 5 s"),
        # The follow-up SIGKILL of the CPU limit keeps the reason, when the CPU time says so.
        (
            Limits(cpu_seconds=5),
            {"done": done(exit_code=None, signal=9, cpu_s=5.0)},
            "CPU limit 5 s",
        ),
    ],
)
def test_a_limit_that_ended_the_episode_is_its_reason(
    limits: Limits, changes: dict[str, Any], reason: str
) -> None:
    status, error, _, _, why = v.conclude(observed(limits=limits, **changes))
    assert (status, why) == ("crashed", reason)
    assert error is not None
    assert error.message.startswith(f"{reason} hit: ")


def test_a_sigkill_below_the_cpu_limit_is_not_the_cpu_limit() -> None:
    obs = observed(limits=Limits(cpu_seconds=5), done=done(exit_code=None, signal=9, cpu_s=1.0))
    status, _, _, _, why = v.conclude(obs)
    assert (status, why) == ("crashed", None)


def test_the_last_line_skips_isolates_own_and_is_cut() -> None:
    tail = b"first\n" + b"x" * 400 + b"\n[isolate] a note\n\n"
    assert v.last_line(tail) == "x" * 300
    assert v.last_line(b"[isolate] only ours\n") == ""
