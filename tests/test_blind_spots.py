"""Promises that hold only through one mechanism each: the sweep's scans and ``cgroup.kill``,
scrubbing on the rarer stdout paths, the verdicts of the shim's deadline and of the CPU
limit's SIGKILL, the timeout's start, a template's refusal, ``Sandbox(connect=[])`` and the
order of admission. Each test is an episode an attacker, or an unlucky user, could cause."""

from __future__ import annotations

import os
import secrets as _secrets
import signal
import socket
import time
from collections.abc import Iterator

import anyio
import psutil
import pytest

import isolate
from isolate import EPISODE_ENV
from isolate._core import containment as _containment
from isolate._core.containment.sandbox import landlock_abi
from isolate._core.episode import prepare as _prepare
from isolate._core.system import admission

from .conftest import SLOW, Agents, is_gone, record_pid_sh, wait_until

pytestmark = pytest.mark.anyio

KEY = "sk-blind-" + _secrets.token_hex(12)


def needs(containment: str) -> None:
    problem = _containment.problem(containment)
    if problem is not None:
        pytest.skip(f"containment {containment!r} is not available here: {problem}")


async def kill_shim_once_recorded(
    agents: Agents, spec: isolate.EpisodeSpec, name: str
) -> tuple[isolate.EpisodeOutcome, psutil.Process, dict[str, str], float]:
    """Run an episode; once its agent's process ``name`` has recorded its pid, SIGKILL the
    shim, as the kernel's OOM killer or a cluster agent might. Returns the outcome, that
    process and its environment (as they were before the kill), and the seconds from the kill
    to the outcome."""
    shim: list[int] = []
    outcome: list[isolate.EpisodeOutcome] = []

    async def run() -> None:
        outcome.append(await isolate.run_episode(spec, {}, on_start=shim.append))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await wait_until(lambda: bool(shim) and name in agents.pid_files(), 20.0)
        left = psutil.Process(agents.pid_files()[name])
        left.create_time()  # cached: is_gone compares it against a reused pid
        environ = left.environ()
        os.kill(shim[0], signal.SIGKILL)
        killed_at = time.monotonic()
    return outcome[0], left, environ, time.monotonic() - killed_at


# --- the parent's sweep after the shim's death --------------------------------------------------

# A grandchild of the agent that outlives the shim, found by one scan or the other: it left the
# shim's session but carries the episode's tag; it dropped the tag but stayed in the session;
# or it did neither. There is no cgroup at containment="session", and the shim that could
# have killed it is dead.
ESCAPES = {
    "own session, tagged": "start_new_session=True",
    "in the session, untagged": (
        f"env={{k: v for k, v in os.environ.items() if k != {EPISODE_ENV!r}}}"
    ),
    "in the session, tagged": "",
}


@pytest.mark.parametrize("how", list(ESCAPES.values()), ids=list(ESCAPES))
async def test_the_sweep_finds_a_survivor_of_the_shim(agents: Agents, how: str) -> None:
    spec = agents.spec(
        f"""
        import os, subprocess, time
        def run(data):
            cmd = '{record_pid_sh("escaped")}; exec sleep 300'
            subprocess.Popen(["sh", "-c", cmd], {how})
            time.sleep(300)
        """,
        containment="session",
        kill_grace=0.5,
    )
    outcome, escaped, _, _ = await kill_shim_once_recorded(agents, spec, "escaped")
    assert outcome.status == "crashed", outcome.summary()
    assert outcome.signal == "SIGKILL"
    assert is_gone(escaped.pid, escaped.create_time()), "a process of the episode survived it"
    assert outcome.killed >= 1


# A process of the agent that hid from every scan: its own session, no tag, in a cgroup it
# made inside the episode's leaf (the leaf's cgroup.procs does not list it). Only the leaf's
# "populated" says it is there, and only cgroup.kill reaches it.
HIDDEN_IN_THE_LEAF = f"""
import os, subprocess, time
def run(data):
    mount = [l.split()[1] for l in open("/proc/self/mounts") if l.split()[2] == "cgroup2"][0]
    path = [l for l in open("/proc/self/cgroup") if l.startswith("0::")][0][3:].strip()
    hideout = mount + path + "/hideout"
    os.mkdir(hideout)
    env = {{"PATH": os.environ["PATH"], "PID_DIR": os.environ["PID_DIR"], "HIDE": hideout}}
    cmd = 'echo $$ > "$HIDE/cgroup.procs" && {record_pid_sh("hidden")} && exec sleep 300'
    subprocess.Popen(["sh", "-c", cmd], env=env, start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    time.sleep(300)
"""


async def test_a_process_hidden_from_every_scan_dies_with_the_leaf_at_once(
    agents: Agents,
) -> None:
    needs("cgroup")
    # A long kill_grace: a teardown that waited for its SIGKILL step, instead of killing a
    # populated leaf whose processes no scan sees at once, would show in the time it took.
    spec = agents.spec(HIDDEN_IN_THE_LEAF, containment="cgroup", kill_grace=4.0 * SLOW)
    outcome, hidden, environ, took = await kill_shim_once_recorded(agents, spec, "hidden")
    assert outcome.status == "crashed", outcome.summary()
    assert EPISODE_ENV not in environ  # it did hide from the tag scan
    assert is_gone(hidden.pid, hidden.create_time()), "the hidden process survived the episode"
    assert took < 2.0 * SLOW, f"teardown took {took:.1f} s (kill_grace {spec.kill_grace} s)"
    assert "cgroup clean-up" not in outcome.stderr_tail


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
    monkeypatch.setattr(_prepare, "SHIM_DEADLINE_MARGIN_S", 1.5 - spec.timeout - spec.kill_grace)
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
        self.hold: admission.Hold | None = None

    def leave(self, fds: int) -> None:
        """Leave room for ``fds`` (the new hold is taken before the old one is given back:
        nothing is admitted on the way)."""
        budget = admission._budget()
        held = self.hold.fds if self.hold is not None else 0
        hold = admission.hold_fds(budget.capacity - budget.used + held - fds, "test room")
        self.close()
        self.hold = hold

    def close(self) -> None:
        if self.hold is not None:
            self.hold.release()
            self.hold = None


async def test_the_timeout_counts_from_spawn_not_from_admission(agents: Agents) -> None:
    spec = agents.spec("def run(data):\n    return 1.0\n", timeout=2.5 * SLOW)
    room, waiting = Room(), admission.waiting()
    outcome: list[isolate.EpisodeOutcome] = []

    async def run() -> None:
        outcome.append(await isolate.run_episode(spec, {}))

    try:
        room.leave(0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await wait_until(lambda: admission.waiting() > waiting)
            # The point of the test: the episode waits for admission longer than its timeout.
            await anyio.sleep(spec.timeout + 0.5)
            room.close()
    finally:
        room.close()
    assert outcome[0].timings.admission_s > spec.timeout
    assert outcome[0].status == "ok", outcome[0].summary()


# --- templates ----------------------------------------------------------------------------------

# Records each import of the agent's module with the environment tag of the process that
# imports it (a template's name, or the episode's id), and keeps a thread running after import:
# no template can be forked from it.
REFUSED_AT_IMPORT = f"""
import os, threading, time
with open(os.path.join(os.environ["PID_DIR"], "imports"), "a") as f:
    f.write(os.environ[{EPISODE_ENV!r}] + "\\n")
threading.Thread(target=time.sleep, args=(60,), name="cost-map-retry", daemon=True).start()
def run(data):
    return 1.0
"""


async def test_a_refused_template_is_not_tried_again_for_the_next_episode(agents: Agents) -> None:
    spec = agents.spec(REFUSED_AT_IMPORT, preload=True)
    reason = "thread 'cost-map-retry' running after import"
    outcomes = [await isolate.run_episode(spec, {}) for _ in range(2)]
    for outcome in outcomes:
        assert (outcome.status, outcome.start) == ("ok", "fresh"), outcome.summary()
        assert outcome.preload_refused == reason
        assert f"preload refused: {reason}; this episode starts fresh" in outcome.stderr_tail
    imports = (agents.pids / "imports").read_text().split()
    templates = [tag for tag in imports if tag.startswith("template.")]
    assert len(templates) == 1, imports  # one template started, for both episodes
    assert sorted(set(imports) - set(templates)) == sorted(o.episode_id for o in outcomes)
    assert "started (pid" not in outcomes[1].stderr_tail


# --- the sandbox --------------------------------------------------------------------------------


@pytest.fixture
def tcp_server() -> Iterator[int]:
    """A listening TCP socket on 127.0.0.1 (the kernel completes connections to its backlog)."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:
        yield server.getsockname()[1]


CONNECT = """
import socket
def run(data):
    try:
        with socket.create_connection(("127.0.0.1", data["port"]), timeout=5):
            return 1.0, "connected"
    except OSError as exc:
        return 0.0, type(exc).__name__
"""


async def test_connect_to_no_port_leaves_no_tcp_open(agents: Agents, tcp_server: int) -> None:
    if landlock_abi() < 4:
        pytest.skip(f"containment: TCP connect rules need Landlock ABI 4, not {landlock_abi()}")
    work = agents.tmp / "work"
    work.mkdir()
    for box, expected in [
        (isolate.Sandbox(), "connected"),  # the control: the server is there to reach
        (isolate.Sandbox(connect=[]), "PermissionError"),
    ]:
        spec = agents.spec(CONNECT, sandbox=box, cwd=work)
        outcome = await isolate.run_episode(spec, {"port": tcp_server})
        assert outcome.status == "ok", outcome.summary()
        assert outcome.info == expected, (box, outcome.info)
    assert outcome.sandbox is not None
    assert outcome.sandbox.missing == ()
    assert "TCP connect only to ports none" in outcome.sandbox.enforced


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
    cost = admission.episode_fds(spec)
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
    big, small = admission.episode_fds(logged).peak, admission.episode_fds(unlogged).peak
    assert small < big
    room, waiting = Room(), admission.waiting()
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
                await wait_until(lambda n=n: admission.waiting() - waiting >= n or order(agents))
            assert order(agents) == [], "an episode went ahead of one that came before it"
            room.leave(big)  # one at a time: a running one leaves no room for the next
    finally:
        room.close()
    assert [o.status for o in outcomes] == ["ok"] * 3
    assert order(agents) == ["one", "two", "three"]
