"""What an entrypoint returns or does, and the status the outcome reports for it."""

from __future__ import annotations

import json

import pytest

import isolate

from .conftest import SLOW, Agents, both_starts

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("body", "reward", "info"),
    [
        ("return 0.5", 0.5, None),
        ("return 2", 2.0, None),
        ("return True", 1.0, None),
        ("return (1.0, {'turns': 3})", 1.0, {"turns": 3}),
        ("return {'c1': 1.0, 'c2': 0}", {"c1": 1.0, "c2": 0.0}, None),
        (
            "return (0.0, {'obj': object.__name__, 'set': {1}})",
            0.0,
            {"obj": "object", "set": "{1}"},
        ),
    ],
)
@both_starts
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_return_shapes(
    agents: Agents, body: str, reward: object, info: object, kind: str
) -> None:
    prefix = "async def" if kind == "async" else "def"
    spec = agents.spec(f"{prefix} run(data, **kw):\n    {body}\n")
    outcome = await isolate.run_episode(spec, {"instance_id": "t"})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.reward == reward
    assert outcome.info == info
    assert outcome.exit_code == 0
    assert outcome.signal is None
    assert outcome.error is None


async def test_data_and_kwargs_arrive(agents: Agents) -> None:
    spec = agents.spec(
        """
        def run(data, **kw):
            return 1.0, {"data": data, "kw": kw}
        """
    )
    data = {"instance_id": "x", "nested": [1, "two", {"3": None}], "text": "é\u2603\n"}
    outcome = await isolate.run_episode(spec, data, kwargs={"agent_type": "swe", "n": 3})
    assert outcome.info == {"data": data, "kw": {"agent_type": "swe", "n": 3}}


async def test_info_is_size_capped(agents: Agents) -> None:
    spec = agents.spec(
        "def run(data):\n    return 1.0, {'blob': 'x' * 100000}\n", max_info_bytes=1000
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok"
    assert outcome.info["truncated"] is True
    assert outcome.info["bytes"] > 100000
    assert len(json.dumps(outcome.info)) < 5000


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return float('nan')", "nan"),
        ("return float('inf')", "inf"),
        ("return {'a': float('-inf')}", "-inf"),
        ("return 'one'", "str"),
        ("return None", "NoneType"),
        ("return [1.0]", "list"),
        ("return '2'", "returned a str ('2')"),
        # A mapping with one value that is no number is no reward, like that value alone.
        ("return {'a': 1.0, 'b': None}", "returned a dict ({'a': 1.0, 'b': None})"),
        ("return {'b': '2'}", "returned a dict ({'b': '2'})"),
        ("return ({'a': 1.0, 'b': None}, {'turns': 3})", "returned a dict ({'a': 1.0, 'b': None})"),
    ],
)
@both_starts
async def test_bad_rewards_are_protocol_errors(agents: Agents, body: str, message: str) -> None:
    spec = agents.spec(f"def run(data):\n    {body}\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "protocol_error"
    assert outcome.error is not None
    assert message in outcome.error.message
    assert outcome.reward is None


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("d = {}; d['d'] = d; return 1.0, d", ("ValueError", "Circular reference detected")),
        (
            "class R:\n        def __repr__(self): raise RuntimeError('no repr')\n    return R()",
            ("RuntimeError", "no repr"),
        ),
        (
            "class F(float):\n        def __float__(self): raise ValueError('no float')\n"
            "    return {'a': F(1.0)}",
            ("ValueError", "no float"),
        ),
    ],
)
async def test_a_return_value_that_raises_as_it_is_sent_is_an_agent_error(
    agents: Agents, body: str, error: tuple[str, str]
) -> None:
    """The agent returned, then its value raised as the worker read it: the worker still sends
    a final frame, naming what raised, instead of exiting without one."""
    spec = agents.spec(f"def run(data):\n    {body}\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "agent_error", outcome.summary()
    assert outcome.error is not None
    assert outcome.error.type == error[0]
    assert outcome.error.message == (
        f"the entrypoint's return value cannot be sent back: {error[0]}: {error[1]}"
    )
    assert "in to_result" in outcome.error.traceback
    assert outcome.reward is None
    assert outcome.exit_code == 1


@both_starts
async def test_exception_is_agent_error_with_traceback(agents: Agents) -> None:
    spec = agents.spec(
        """
        def helper():
            raise KeyError("missing-thing")

        def run(data):
            helper()
        """
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "agent_error"
    assert outcome.error is not None
    assert outcome.error.type == "KeyError"
    assert "missing-thing" in outcome.error.message
    assert "in helper" in outcome.error.traceback
    assert outcome.log_path is not None
    assert "missing-thing" in outcome.log_path.read_text()


@both_starts
@pytest.mark.parametrize(("code", "exit_code"), [("3", 3), ("'bye'", 1), ("None", 0)])
async def test_system_exit_is_agent_error(agents: Agents, code: str, exit_code: int) -> None:
    spec = agents.spec(f"import sys\ndef run(data):\n    sys.exit({code})\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "agent_error"
    assert outcome.error is not None
    assert outcome.error.type == "SystemExit"
    assert outcome.exit_code == exit_code


@both_starts
async def test_segfault_is_crashed(agents: Agents) -> None:
    spec = agents.spec("import ctypes\ndef run(data):\n    ctypes.string_at(0)\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "crashed"
    assert outcome.signal == "SIGSEGV"
    assert outcome.exit_code is None
    assert "killed by SIGSEGV" in outcome.summary()


@both_starts
async def test_os_exit_is_crashed(agents: Agents) -> None:
    spec = agents.spec("import os\ndef run(data):\n    os._exit(3)\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "crashed"
    assert outcome.exit_code == 3
    assert outcome.signal is None
    assert "exited with 3" in outcome.summary()


@both_starts
async def test_os_exit_zero_without_result_is_protocol_error(agents: Agents) -> None:
    spec = agents.spec("import os\ndef run(data):\n    os._exit(0)\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "protocol_error"
    assert outcome.error is not None
    assert "without sending a result" in outcome.error.message


@both_starts
async def test_self_sigkill_is_crashed(agents: Agents) -> None:
    spec = agents.spec(
        "import os, signal\ndef run(data):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "crashed"
    assert outcome.signal == "SIGKILL"


@both_starts
async def test_result_survives_unflushed_exit(agents: Agents) -> None:
    """The agent leaves a non-daemon thread that would hang interpreter shutdown, and prints
    without flushing; with PYTHONUNBUFFERED absent from the child the result still arrives and
    the printed line still reaches the log."""
    spec = agents.spec(
        """
        import os, sys, threading
        def run(data):
            threading.Thread(target=threading.Event().wait).start()
            print("printed-before-return")
            sys.stdout.write("written-no-newline")
            return 1.0, {"unbuffered": os.environ.get("PYTHONUNBUFFERED")}
        """,
        inherit_env=("PATH", "HOME"),
        exit_grace=0.5,  # the thread never ends: the exit is cut short
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.info == {"unbuffered": None}
    assert outcome.log_path is not None
    log = outcome.log_path.read_text()
    assert "printed-before-return" in log
    assert "written-no-newline" in log
    assert outcome.duration_s < 10 * SLOW


@pytest.mark.parametrize(
    "attr", ["Agent.run", "Agent.arun", "Agent.Inner.run"], ids=["static", "async", "nested"]
)
async def test_a_mod_cls_method_entrypoint(agents: Agents, attr: str) -> None:
    spec = agents.spec(
        """
        class Agent:
            @staticmethod
            def run(data):
                return 0.25, {"via": "static"}

            @classmethod
            async def arun(cls, data):
                return 0.5, {"via": cls.__name__}

            class Inner:
                run = staticmethod(lambda data: (0.75, {"via": "nested"}))
        """,
        function=attr,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    expected = {"Agent.run": (0.25, "static"), "Agent.arun": (0.5, "Agent")}
    expected["Agent.Inner.run"] = (0.75, "nested")
    assert (outcome.reward, outcome.info["via"]) == expected[attr]
