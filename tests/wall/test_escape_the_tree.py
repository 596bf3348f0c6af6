"""Promise: nothing an agent starts outlives its episode, however it leaves the process tree:
daemons, ``setsid``, double forks, an empty environment, a process hidden from every scan, a
killed supervisor. Which layer answers:

- a survivor of the shim (double-forked, new session, tag-less): the parent's sweep, which
  finds it by its scans; in a PID namespace PID 1's death; ``cgroup.kill`` with ``cgroup``.
- a process hidden from every scan: the cgroup leaf, killed at once with ``cgroup``.
- an agent that kills its supervisor: Landlock (``EPERM``); in a PID namespace the supervisor
  is PID 1, which the kernel shields; at ``session`` a daemon that nothing finds remains
  (docs/containment.md, "What no containment here covers")."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import psutil
import pytest

import isolate
from isolate import EPISODE_ENV

from .. import _internals
from ..conftest import (
    SLOW,
    Agents,
    both_starts,
    is_gone,
    live_children,
    record_pid_sh,
    wait_for,
    wait_until,
)
from ..teardown._trees import needs, tree
from ._attacks import combination

pytestmark = pytest.mark.anyio
__all__ = ["combination"]  # a fixture, used by name


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


ESCAPER = """
import errno, os, signal, subprocess, sys, time

DAEMON = '''
import os, signal, sys, time
if os.fork():
    os._exit(0)
os.setsid()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
fifo = open(sys.argv[1], "w")
fifo.write("alive\\\\n")
fifo.flush()
open(sys.argv[1] + ".up", "w").close()
time.sleep(300)
'''


def until(predicate, what):
    end = time.monotonic() + 20
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.005)


def orphan():
    # A process re-parented to the supervisor (a subreaper) that exits at once: its pid
    # vanishes from /proc only when the supervisor reaps it.
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        if os.fork() == 0:
            os.write(w, b"%d" % os.getpid())
        os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    pid = int(os.read(r, 32))
    os.close(r)
    return pid


def run(data):
    # No episode tag in its environment, its own session, re-parented: invisible to every
    # scan of the parent's sweep once the supervisor is gone.
    subprocess.run([sys.executable, "-c", DAEMON, data["fifo"]], env={})
    until(lambda: os.path.exists(data["fifo"] + ".up"), "the daemon's 'alive'")
    supervisor = os.getppid()
    try:
        os.kill(supervisor, signal.SIGKILL)
    except OSError as exc:
        return 1.0, {"kill": errno.errorcode[exc.errno], "supervisor": supervisor}
    # Sent. Either the supervisor dies (and this worker with it, or it is re-parented), or it
    # lives on and reaps an orphan made after the kill: proof that the kill did nothing.
    pid = orphan()
    until(lambda: os.getppid() != supervisor or not os.path.exists("/proc/%d" % pid), "a sign")
    if os.getppid() == supervisor:
        return 1.0, {"kill": "ignored", "supervisor": supervisor}
    time.sleep(300)  # the parent must end the episode
    return 0.0
"""


@both_starts
async def test_an_agent_that_kills_its_supervisor(
    agents: Agents, tmp_path: Path, combination: str
) -> None:
    """The agent starts a daemon with an empty environment in its own session, then sends
    SIGKILL to its supervisor. With ``landlock`` the kill is refused (EPERM); in a PID
    namespace the supervisor is its PID 1, which the kernel shields: the kill does nothing (a
    template's fork, in its template's namespace, has a Landlock domain of its own: EPERM).
    There the episode ends as the agent returns. At ``session`` and ``cgroup`` the supervisor
    dies: the episode is ``crashed`` by its SIGKILL, and nothing is left, except at ``session``
    the daemon, which nothing finds (docs/containment.md, "What no containment here covers")."""
    layers = _internals.layers(combination)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    heard = b""

    def daemon_gone() -> bool:
        # EOF once every writer, the daemon, is dead; but first its "alive".
        nonlocal heard
        try:
            chunk = os.read(reader, 100)
        except BlockingIOError:
            return False
        heard += chunk
        return not chunk and heard == b"alive\n"

    try:
        spec = agents.spec(ESCAPER, kill_grace=0.5, containment=combination)
        outcome = await isolate.run_episode(spec, {"fifo": str(fifo)})
        assert outcome.containment == combination
        if "landlock" in layers or "pidns" in layers:
            # Refused, or shielded: the supervisor ran the episode to its normal end.
            assert outcome.status == "ok", outcome.summary()
            assert outcome.reward == 1.0
            assert outcome.exit_code == 0, outcome.summary()
            assert outcome.signal is None
            # A template's forks share its PID namespace: each worker has a Landlock domain of
            # its own, whatever the layers.
            forked = outcome.start == "template"
            scoped = "landlock" in layers or (forked and "pidns" in layers)
            assert outcome.info["kill"] == ("EPERM" if scoped else "ignored"), outcome.info
            if "pidns" in layers and not forked:
                assert outcome.info["supervisor"] == 1  # the namespace's init
        else:
            # The supervisor died without a result: the design's "crashed", with its signal.
            assert outcome.status == "crashed", outcome.summary()
            assert outcome.reward is None
            assert outcome.signal == "SIGKILL"
            assert outcome.error is not None
            assert outcome.error.type == "EpisodeCrashed"
            assert "killed by SIGKILL" in outcome.error.message, outcome.error.message
        assert tree(agents) == []  # nothing tagged, worker included, is left
        if combination == "session":
            # The untagged daemon in its own session outlives the episode: nothing finds it.
            # Kill it here (the test process, a subreaper, is its parent now).
            daemons = [p for p in live_children() if str(fifo) in " ".join(p.cmdline())]
            assert len(daemons) == 1, daemons
            assert not daemon_gone()
            assert heard == b"alive\n"
            daemons[0].kill()
        await anyio.to_thread.run_sync(wait_for, daemon_gone, 5.0, "the daemon to die")
    finally:
        os.close(reader)
