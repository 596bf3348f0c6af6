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
from isolate._core.episode import verdict as v

from ._internals import Done, ErrorFrame, Hello, Result

NONCE = "n" * 32
HELLO = Hello(
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


def done(**fields: Any) -> Done:
    return Done(
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
    result = Result(t="result", nonce=NONCE, reward=0.5, info={"steps": 3})
    assert v.conclude(observed(final=result)) == ("ok", None, 0.5, {"steps": 3}, None)


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), {"a": float("-inf")}])
def test_a_reward_that_is_not_finite_is_a_protocol_error(reward: Any) -> None:
    status, error, *_ = v.conclude(observed(final=Result(t="result", nonce=NONCE, reward=reward)))
    assert status == "protocol_error"
    assert error is not None
    assert error.type == "ProtocolError"
    assert "not a finite number" in error.message


def test_a_reward_that_is_not_a_number_says_what_it_was_and_what_is_expected() -> None:
    result = Result(t="result", nonce=NONCE, reward=None, reward_type="str", reward_repr="'a'")
    status, error, reward, *_ = v.conclude(observed(final=result))
    assert (status, reward) == ("protocol_error", None)
    assert error is not None
    assert error.message == (
        "the entrypoint returned a str ('a'); expected a number, (reward, extra) or "
        "{completion_id: reward}"
    )


def test_the_callers_cancellation_says_when_it_came() -> None:
    status, error, *_ = v.conclude(observed(timed_out=True, cancelled_after=3.25))
    assert status == "timeout"
    assert error is not None
    assert (error.type, error.message) == ("EpisodeTimeout", "cancelled after 3.2 s; tree killed")
    _, deadline, *_ = v.conclude(observed(timed_out=True))
    assert deadline is not None
    assert (deadline.type, deadline.message) == (
        "EpisodeTimeout",
        "no result within 30 s; tree killed",
    )


def test_a_result_that_came_before_the_deadline_counts_one_after_does_not() -> None:
    result = Result(t="result", nonce=NONCE, reward=1.0)
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
        violations=("first", "second"), final=Result(t="result", nonce=NONCE, reward=1.0)
    )
    status, error, *_ = v.conclude(obs)
    assert (status, error and error.message) == ("protocol_error", "first")


def test_another_protocol_version_is_a_protocol_error() -> None:
    hello = HELLO.model_copy(update={"protocol": PROTOCOL_VERSION + 1})
    status, error, *_ = v.conclude(observed(hello=hello))
    assert status == "protocol_error"
    assert error is not None
    assert error.type == "ProtocolError"


@pytest.mark.parametrize(
    ("limits", "changes", "reason"),
    [
        (Limits(memory_bytes=1 << 30), {"oom_kills": 1, "returncode": -9}, "memory limit 1 GiB"),
        (
            Limits(memory_bytes=1 << 30),
            {
                "final": ErrorFrame(
                    t="error", nonce=NONCE, kind="agent", type="MemoryError", message=""
                )
            },
            "memory limit 1 GiB",
        ),
        (Limits(max_processes=8), {"pids_limit_hits": 2, "returncode": 1}, "process limit 8"),
        (Limits(max_processes=8), {"pids_limit_hits": 1, "returncode": 1}, "process limit 8"),
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


def agent_error(kind: str) -> ErrorFrame:
    return ErrorFrame(t="error", nonce=NONCE, kind="agent", type=kind, message="boom")


@pytest.mark.parametrize(
    ("limits", "changes", "status"),
    [
        # A SIGKILL under a memory limit, where no OOM kill was counted (or none could be).
        (Limits(memory_bytes=1 << 30), {"oom_kills": None, "returncode": -9}, "crashed"),
        (Limits(memory_bytes=1 << 30), {"oom_kills": 0, "returncode": -9}, "crashed"),
        (
            Limits(memory_bytes=1 << 30),
            {"oom_kills": 0, "final": agent_error("ValueError")},
            "agent_error",
        ),
        # Python's own MemoryError, with no memory limit to blame.
        (Limits(cpu_seconds=5), {"final": agent_error("MemoryError")}, "agent_error"),
        (Limits(max_processes=8), {"pids_limit_hits": 0, "returncode": 1}, "crashed"),
        # A SIGKILL whose CPU time is unknown (no done frame) is not the CPU limit's.
        (Limits(cpu_seconds=1), {"returncode": -9}, "crashed"),
    ],
)
def test_a_limit_that_was_not_hit_is_no_reason(
    limits: Limits, changes: dict[str, Any], status: str
) -> None:
    got, error, _, _, why = v.conclude(observed(limits=limits, **changes))
    assert (got, why) == (status, None)
    assert error is not None
    assert " hit: " not in error.message


def test_a_limit_hit_keeps_an_agents_error_type_and_makes_the_rest_a_crash() -> None:
    memory = Limits(memory_bytes=1 << 30)
    _, raised, *_ = v.conclude(observed(limits=memory, final=agent_error("MemoryError")))
    assert raised is not None
    assert (raised.type, raised.message) == ("MemoryError", "memory limit 1 GiB hit: boom")
    status, timeout, _, _, why = v.conclude(observed(limits=memory, oom_kills=1, timed_out=True))
    assert (status, why) == ("crashed", "memory limit 1 GiB")
    assert timeout is not None
    assert timeout.type == "EpisodeCrashed"
    assert timeout.message == "memory limit 1 GiB hit: no result within 30 s; tree killed"


def test_a_limit_hit_keeps_the_agents_traceback() -> None:
    raised = ErrorFrame(
        t="error",
        nonce=NONCE,
        kind="agent",
        type="MemoryError",
        message="",
        traceback='Traceback (most recent call last):\n  File "agent.py", line 3\nMemoryError\n',
    )
    obs = observed(limits=Limits(memory_bytes=1 << 30), final=raised)
    status, error, _, _, why = v.conclude(obs)
    assert (status, why) == ("crashed", "memory limit 1 GiB")
    assert error is not None
    assert error.traceback == raised.traceback


def test_a_limit_hit_does_not_turn_a_result_or_a_protocol_error_into_a_crash() -> None:
    # An OOM kill of a child the agent outlived; a fork refused, and then a bad frame.
    result = Result(t="result", nonce=NONCE, reward=1.0)
    obs = observed(limits=Limits(memory_bytes=1 << 30), oom_kills=1, final=result)
    assert v.conclude(obs) == ("ok", None, 1.0, None, None)
    obs = observed(limits=Limits(max_processes=8), pids_limit_hits=1, violations=("bad frame",))
    status, error, _, _, why = v.conclude(obs)
    assert (status, why) == ("protocol_error", None)
    assert error is not None
    assert error.message == "bad frame"


def test_a_sigkill_below_the_cpu_limit_is_not_the_cpu_limit() -> None:
    obs = observed(limits=Limits(cpu_seconds=5), done=done(exit_code=None, signal=9, cpu_s=1.0))
    status, _, _, _, why = v.conclude(obs)
    assert (status, why) == ("crashed", None)


def test_the_last_line_skips_isolates_own_and_is_cut() -> None:
    tail = b"first\n" + b"x" * 400 + b"\n[isolate] a note\n\n"
    assert v.last_line(tail) == "x" * 300
    assert v.last_line(b"[isolate] only ours\n") == ""


def test_the_last_line_of_a_tail_that_is_not_utf8_is_read_with_replacements() -> None:
    # A tail cut in the middle of a character, and a line of bytes that are no text.
    tail = "€".encode()[1:] + b" cut\nbinary \xff\xfe out\n"
    assert v.last_line(tail) == "binary \ufffd\ufffd out"


@pytest.mark.parametrize(
    ("changes", "status", "kind", "message"),
    [
        ({"violations": ("bad",)}, "protocol_error", "ProtocolError", "bad"),
        (
            {"hello": None, "returncode": -9},
            "crashed",
            "EpisodeCrashed",
            "the shim was killed by SIGKILL before it started",
        ),
        (
            {"hello": None, "returncode": 1},
            "setup_error",
            "SetupError",
            "the shim did not start under /usr/bin/python3 (exited with 1)",
        ),
        (
            {"returncode": 0},
            "protocol_error",
            "ProtocolError",
            "the agent's process exited 0 without sending a result",
        ),
        ({"returncode": 3}, "crashed", "EpisodeCrashed", "the agent's process exited with 3"),
    ],
)
def test_each_status_found_by_the_parent_has_its_error_type(
    changes: dict[str, Any], status: str, kind: str, message: str
) -> None:
    got, error, *_ = v.conclude(observed(**changes))
    assert error is not None
    assert (got, error.type, error.message) == (status, kind, message)


def test_a_setup_error_frame_is_a_setup_error_an_agent_one_an_agent_error() -> None:
    setup = ErrorFrame(t="error", nonce=NONCE, kind="setup", type="ImportError", message="x")
    assert v.conclude(observed(final=setup))[0] == "setup_error"
    assert v.conclude(observed(final=agent_error("ValueError")))[0] == "agent_error"
