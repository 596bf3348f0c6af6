"""Promises that hold only through one mechanism each: scrubbing on the rarer stdout paths,
the verdicts of the shim's deadline and of the CPU limit's SIGKILL, the timeout's start and
the order of admission. Each test is an episode an unlucky user could cause. (The sweep's
scans and ``cgroup.kill``, a template's refusal and ``Sandbox(connect=[])`` are the wall's:
``tests/wall``.)"""

from __future__ import annotations

import secrets as _secrets

import anyio
import pytest

import isolate

from . import _internals
from .conftest import SLOW, Agents, wait_until

pytestmark = pytest.mark.anyio

KEY = "sk-blind-" + _secrets.token_hex(12)


# --- the parent's sweep after the shim's death --------------------------------------------------


# --- what comes back is scrubbed, on every path -------------------------------------------------

# The agent knows the protocol: it writes lines that are not JSON, with its key in them, to
# every socket it holds, the protocol socket among them: one that cannot even be measured as
# JSON (an odd number of quotes), one that can but does not parse.
NOISE_WITH_THE_KEY = """
import os
def run(data, *, key):
    lines = ("odd quote \\" " + key + " one\\n" + "not json at all " + key + " two\\n").encode()
    wrote = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink("/proc/self/fd/" + fd).startswith("socket:"):
                os.write(int(fd), lines)
                wrote += 1
        except OSError:
            pass
    return float(wrote)
"""


async def test_a_key_in_a_line_of_non_json_noise_is_masked(agents: Agents) -> None:
    spec = agents.spec(NOISE_WITH_THE_KEY)
    outcome = await isolate.run_episode(spec, {}, secrets={"key": KEY})
    assert outcome.status == "ok", outcome.summary()
    assert isinstance(outcome.reward, float)
    assert outcome.reward >= 1.0  # the lines went out on the protocol socket
    assert outcome.log_path is not None
    log = outcome.log_path.read_text()
    noted = [
        "ignored stdout line (not JSON): 'odd quote \" [secret] one'",
        "ignored stdout line (not JSON): 'not json at all [secret] two'",
    ]
    for where, text in {"log": log, "tail": outcome.stderr_tail}.items():
        for line in noted:
            assert line in text, (where, text[-2000:])
        assert KEY not in text, where
        assert KEY[-12:] not in text, where


# --- verdicts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cancel_grace", [0.0, 0.5])
async def test_the_shims_own_deadline_is_a_timeout(
    agents: Agents, monkeypatch: pytest.MonkeyPatch, cancel_grace: float
) -> None:
    """The shim's deadline is meant for a parent that is stopped or hung; brought before the
    parent's, it ends the episode itself, with a ``done`` frame that says so. Without a
    cancel grace the worker gets SIGTERM at once; with one, it is cancelled and answers with a
    result, which came after the deadline and does not count."""
    agent = """
        import time
        def run(data):
            try:
                time.sleep(300)
            except KeyboardInterrupt:
                return 1.0
        """
    spec = agents.spec(agent, timeout=60.0, kill_grace=0.5, cancel_grace=cancel_grace)
    # The shim's deadline 1.5 s after its start, the parent's a minute after.
    monkeypatch.setattr(
        _internals.prepare, "SHIM_DEADLINE_MARGIN_S", 1.5 - spec.timeout - spec.kill_grace
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "timeout", outcome.summary()
    assert outcome.error is not None
    assert outcome.error.type == "EpisodeTimeout"
    assert outcome.duration_s < 20.0 * SLOW  # the shim's deadline, not the parent's


async def test_a_cpu_limit_enforced_by_sigkill_keeps_its_reason(agents: Agents) -> None:
    """An agent that ignores SIGXCPU runs on to the hard RLIMIT_CPU, where SIGKILL ends it."""
    spec = agents.spec(
        """
        import signal
        def run(data):
            signal.signal(signal.SIGXCPU, signal.SIG_IGN)
            while True:
                pass
        """,
        limits=isolate.Limits(cpu_seconds=1, core_dumps=False),
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.signal == "SIGKILL", outcome.summary()
    assert outcome.status == "crashed", outcome.summary()
    assert outcome.reason == "CPU limit 1 s"
    assert outcome.error is not None
    assert outcome.error.message.startswith("CPU limit 1 s hit:")


class Room:
    """What this event loop's fd budget leaves episodes, set by holding the rest."""

    def __init__(self) -> None:
        self.hold: _internals.Hold | None = None

    def leave(self, fds: int) -> None:
        """Leave room for ``fds`` (the new hold is taken before the old one is given back:
        nothing is admitted on the way)."""
        budget = _internals.fd_budget()
        held = self.hold.fds if self.hold is not None else 0
        hold = _internals.hold_fds(budget.capacity - budget.used + held - fds, "test room")
        self.close()
        self.hold = hold

    def close(self) -> None:
        if self.hold is not None:
            self.hold.release()
            self.hold = None


async def test_the_timeout_counts_from_spawn_not_from_admission(agents: Agents) -> None:
    spec = agents.spec("def run(data):\n    return 1.0\n", timeout=2.5 * SLOW)
    room, waiting = Room(), _internals.admission_waiting()
    outcome: list[isolate.EpisodeOutcome] = []

    async def run() -> None:
        outcome.append(await isolate.run_episode(spec, {}))

    try:
        room.leave(0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await wait_until(lambda: _internals.admission_waiting() > waiting)
            # The point of the test: the episode waits for admission longer than its timeout.
            await anyio.sleep(spec.timeout + 0.5)
            room.close()
    finally:
        room.close()
    assert outcome[0].timings.admission_s > spec.timeout
    assert outcome[0].status == "ok", outcome[0].summary()


# --- templates ----------------------------------------------------------------------------------


# --- the sandbox --------------------------------------------------------------------------------


# --- admission ----------------------------------------------------------------------------------

# Appends its name to a file shared by the episodes, then, if told to, waits (up to a bound)
# for the name of another episode to appear there; the reward says whether it did.
IN_ORDER = """
import os, time
def run(data):
    path = os.path.join(os.environ["PID_DIR"], "order")
    with open(path, "a") as f:
        f.write(data["name"] + "\\n")
    if data.get("wait_for") is None:
        return 1.0
    end = time.monotonic() + data["bound"]
    while data["wait_for"] not in open(path).read().split():
        if time.monotonic() > end:
            return 0.0
        time.sleep(0.01)
    return 1.0
"""


def order(agents: Agents) -> list[str]:
    path = agents.pids / "order"
    return path.read_text().split() if path.exists() else []


async def test_a_started_episode_gives_back_the_fds_only_its_spawn_needed(agents: Agents) -> None:
    spec = agents.spec(IN_ORDER)
    cost = _internals.episode_fds(spec)
    assert cost.peak > cost.steady
    room = Room()
    outcomes: dict[str, isolate.EpisodeOutcome] = {}

    async def run(name: str, **data: object) -> None:
        outcomes[name] = await isolate.run_episode(spec, {"name": name, **data})

    try:
        # Room for one episode being spawned next to one that runs: no more.
        room.leave(cost.peak + cost.steady)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run("first", wait_for="second", bound=10.0 * SLOW))
            await wait_until(lambda: order(agents) == ["first"], 20.0)
            tg.start_soon(lambda: run("second"))
    finally:
        room.close()
    assert order(agents) == ["first", "second"]
    assert {name: o.status for name, o in outcomes.items()} == {"first": "ok", "second": "ok"}
    assert outcomes["first"].reward == 1.0, "the second episode was admitted only after it"


async def test_admission_is_first_come_first_served(agents: Agents) -> None:
    logged = agents.spec(IN_ORDER)
    unlogged = agents.spec(IN_ORDER, log_dir=None)
    big, small = _internals.episode_fds(logged).peak, _internals.episode_fds(unlogged).peak
    assert small < big
    room, waiting = Room(), _internals.admission_waiting()
    outcomes: list[isolate.EpisodeOutcome] = []

    async def run(spec: isolate.EpisodeSpec, name: str) -> None:
        outcomes.append(await isolate.run_episode(spec, {"name": name}))

    try:
        # Room for the small one, not the big one: the small one comes second, and waits.
        room.leave(small)
        async with anyio.create_task_group() as tg:
            for n, (spec, name) in enumerate(
                [(logged, "one"), (unlogged, "two"), (logged, "three")], start=1
            ):
                tg.start_soon(run, spec, name)
                await wait_until(
                    lambda n=n: _internals.admission_waiting() - waiting >= n or order(agents)
                )
            assert order(agents) == [], "an episode went ahead of one that came before it"
            room.leave(big)  # one at a time: a running one leaves no room for the next
    finally:
        room.close()
    assert [o.status for o in outcomes] == ["ok"] * 3
    assert order(agents) == ["one", "two", "three"]
