"""The parent's sweep, called in this process: the environment-tag scan, what one signal
round sends and counts, and how PID 1 of a namespace is told apart.

The end-to-end teardown tests reach these through whole episodes, where the shim, the
session scan and the cgroup usually find a process before the tag scan must; here each is
asked on its own, about stand-ins this test starts with a marker of its own."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest

import isolate
from agent_shim.shim_wire import EPISODE_ENV
from isolate._core.system import tree
from isolate._core.system.tree import ProcessTree

from . import _internals
from .conftest import Agents, wait_for
from .test_procfs import ZOMBIE_LEADER
from .test_stale_leaves import cgroups_here

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
MARK = "ISOLATE_TEST_SWEEP_MARK"


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts (appended as it goes), killed and reaped after it."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        below: list[psutil.Process] = []
        for proc in procs:
            if proc.poll() is None:
                try:  # what unshare started: killed here, not left to its parent's death
                    below += psutil.Process(proc.pid).children(recursive=True)
                except psutil.NoSuchProcess:
                    pass
                proc.kill()
            proc.wait()
        for child in below:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(below, timeout=10)
        assert alive == []


def _sleeper(
    procs: list[subprocess.Popen[bytes]], env: dict[str, str], **kwargs: bool
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(SLEEPER, env=env, **kwargs)  # type: ignore[call-overload]
    procs.append(proc)
    return proc


def test_the_tag_scan_finds_the_tag_first_or_among_others_and_nothing_like_it(
    started: list[subprocess.Popen[bytes]],
) -> None:
    tag = secrets.token_hex(6)
    first = _sleeper(started, {MARK: tag})
    among = _sleeper(started, {"A": "1", MARK: tag, "Z": "2"})
    for env in (
        {MARK: tag + "x"},  # a longer value
        {"X" + MARK: tag},  # a longer name
        {"A": f"{MARK}={tag}"},  # the tag inside another variable's value
        {},
    ):
        _sleeper(started, env)
    assert sorted(tree.pids_with_env(MARK, tag)) == sorted([first.pid, among.pid])
    assert tree.pids_with_env(MARK, secrets.token_hex(6)) == []


def test_live_finds_a_tagged_process_outside_the_shims_tree_and_session(
    started: list[subprocess.Popen[bytes]],
) -> None:
    tag = f"sweep-{secrets.token_hex(4)}"
    escaped = _sleeper(started, {tree.EPISODE_TAG_ENV: tag}, start_new_session=True)
    # Another episode's process with the same id, and a tag of its own: not this episode's.
    _sleeper(started, {EPISODE_ENV: tag, tree.EPISODE_TAG_ENV: tag + "x"}, start_new_session=True)
    shim = _sleeper(started, {}, start_new_session=True)
    sweep = ProcessTree(psutil.Process(shim.pid), os.getsid(shim.pid), tag)
    assert [p.pid for p in sweep.live()] == [escaped.pid, shim.pid]  # the shim last
    # Without the episode's tag (a template's forks), the tag is not scanned for.
    blind = ProcessTree(psutil.Process(shim.pid), os.getsid(shim.pid), None)
    assert [p.pid for p in blind.live()] == [shim.pid]


def test_a_signal_round_wakes_the_stopped_skips_the_gone_and_counts_each_process_once(
    started: list[subprocess.Popen[bytes]],
) -> None:
    gone = _sleeper(started, {})
    gone_proc = psutil.Process(gone.pid)
    gone.kill()
    gone.wait()
    stopped = _sleeper(started, {})
    stopped.send_signal(signal.SIGSTOP)
    wait_for(lambda: psutil.Process(stopped.pid).status() == psutil.STATUS_STOPPED, what="stop")
    running = _sleeper(started, {})
    sweep = ProcessTree(None, os.getsid(0), None)
    procs = [gone_proc, psutil.Process(stopped.pid), psutil.Process(running.pid)]
    # SIGTERM stays pending in a stopped process: the SIGCONT after it makes it act.
    assert sweep.signal(procs, signal.SIGTERM) == 2
    assert stopped.wait(timeout=10) == -signal.SIGTERM
    assert running.wait(timeout=10) == -signal.SIGTERM


def test_a_process_signalled_again_is_not_counted_again(
    started: list[subprocess.Popen[bytes]],
) -> None:
    # SIGCONT: a signal these sleepers survive, so the second round meets them alive.
    procs = [psutil.Process(_sleeper(started, {}).pid) for _ in range(2)]
    sweep = ProcessTree(None, os.getsid(0), None)
    assert sweep.signal(procs, signal.SIGCONT) == 2
    assert sweep.signal(procs, signal.SIGCONT) == 0
    assert sweep.signal([psutil.Process(_sleeper(started, {}).pid)], signal.SIGCONT) == 1


def test_pid_1_of_a_namespace_below_is_told_apart_from_ours_and_from_no_process(
    started: list[subprocess.Popen[bytes]],
) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    assert not tree._is_pid_1(1)  # PID 1 of this process's own namespace
    assert not tree._is_pid_1(os.getpid())
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    assert not tree._is_pid_1(reaped.pid)  # no such process
    # One namespace below, and two: PID 1 of each is the command unshare starts.
    for depth in (1, 2):
        command = [unshare, "--pid", "--fork", "--kill-child"] * depth + SLEEPER
        started.append(subprocess.Popen(command))

        def inner(depth: int = depth) -> int | None:
            found = [
                p.pid
                for p in psutil.Process(started[-1].pid).children(recursive=True)
                if p.cmdline() == SLEEPER
            ]
            return found[0] if found else None

        pid = wait_for(inner, what=f"the sleeper {depth} namespace(s) down")
        assert tree._is_pid_1(pid)


# Leaves on SIGTERM, exit status 0, once it said it is ready for it.
POLITE = [
    sys.executable,
    "-c",
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n",
]


def test_a_teardown_of_its_own_sends_sigterm_first_and_waits_its_grace(
    started: list[subprocess.Popen[bytes]],
) -> None:
    episode = f"sweep-{secrets.token_hex(4)}"
    polite = _ready(started, POLITE, episode)
    sweep = ProcessTree(None, polite.pid, episode)
    assert anyio.run(sweep.kill, 30.0) == 1  # no deadline given: SIGTERM, then 30 s of grace
    assert polite.wait(timeout=10) == 0  # its own exit, on SIGTERM: not SIGKILLed


def test_a_process_no_scan_sees_dies_with_the_leaf_that_holds_it(
    started: list[subprocess.Popen[bytes]],
) -> None:
    leaves = _internals.Leaves(cgroups_here(), f"sweep-hidden-{secrets.token_hex(4)}", {})
    leaves.create()
    nested = leaves.dirs.get("v2", Path("/nonexistent")) / "nested"
    try:
        if "v2" not in leaves.dirs:
            pytest.skip("no cgroup v2 leaf here: the v1 leaves list every process they hold")
        # In a cgroup below the leaf: not in the leaf's cgroup.procs, yet it keeps the leaf
        # populated. No tag, a session of its own, no shim: no scan finds it.
        nested.mkdir()
        hidden = _sleeper(started, {}, start_new_session=True)
        (nested / "cgroup.procs").write_text(str(hidden.pid))
        assert leaves.members() == []
        assert leaves.populated()
        sweep = ProcessTree(None, hidden.pid + 1_000_000, f"sweep-{secrets.token_hex(4)}", leaves)
        assert sweep.live() == []
        assert anyio.run(sweep.kill, 5.0) == 0  # nothing was seen to signal
        assert hidden.wait(timeout=10) == -signal.SIGKILL
        assert leaves.wait_empty()
    finally:
        if nested.is_dir():
            nested.rmdir()
        assert leaves.remove() is None


# Ignores SIGTERM, once it said so.
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n",
]


def _ready(
    procs: list[subprocess.Popen[bytes]], command: list[str], episode: str
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        command, env={tree.EPISODE_TAG_ENV: episode}, stdout=subprocess.PIPE, start_new_session=True
    )
    procs.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.stdout.close()
    return proc


def test_a_teardown_counts_each_process_once_over_its_sigterm_and_sigkill_rounds(
    started: list[subprocess.Popen[bytes]],
) -> None:
    episode = f"sweep-{secrets.token_hex(4)}"
    polite, stubborn = _ready(started, POLITE, episode), _ready(started, STUBBORN, episode)
    sweep = ProcessTree(None, polite.pid, episode)
    # Several SIGTERM rounds within the grace (nothing new in the later ones), then SIGKILL.
    assert anyio.run(sweep.kill, 0.3) == 2
    assert polite.wait(timeout=10) == 0
    assert stubborn.wait(timeout=10) == -signal.SIGKILL


def test_a_teardown_with_no_grace_kills_at_once_and_counts_what_it_killed(
    started: list[subprocess.Popen[bytes]],
) -> None:
    episode = f"sweep-{secrets.token_hex(4)}"
    polite, stubborn = _ready(started, POLITE, episode), _ready(started, STUBBORN, episode)
    sweep = ProcessTree(None, polite.pid, episode)  # no leaf: signals only
    assert anyio.run(sweep.kill, 0.0) == 2
    assert polite.wait(timeout=10) == -signal.SIGKILL  # no SIGTERM first
    assert stubborn.wait(timeout=10) == -signal.SIGKILL


def test_a_process_is_alive_while_any_of_its_threads_runs(
    started: list[subprocess.Popen[bytes]],
) -> None:
    leader = subprocess.Popen([sys.executable, "-c", ZOMBIE_LEADER])
    started.append(leader)
    leader_proc = psutil.Process(leader.pid)
    wait_for(lambda: leader_proc.status() == psutil.STATUS_ZOMBIE, what="the leader's exit")
    assert tree.is_alive(leader_proc)  # reads Z, yet its second thread runs
    done = _sleeper(started, {})
    done_proc = psutil.Process(done.pid)
    done.kill()
    wait_for(lambda: done_proc.status() == psutil.STATUS_ZOMBIE, what="the sleeper's death")
    assert not tree.is_alive(done_proc)
    done.wait()
    assert not tree.is_alive(done_proc)  # reaped: no such process any more


# Starts a chain of sleepers of the given length below it, each in a session of its own.
CHAIN = (
    "import subprocess, sys, time\n"
    "if int(sys.argv[1]):\n"
    "    more = [sys.executable, '-c', sys.orig_argv[2], str(int(sys.argv[1]) - 1)]\n"
    "    subprocess.Popen(more, start_new_session=True)\n"
    "time.sleep(120)\n"
)


def _below(proc: subprocess.Popen[bytes], count: int) -> list[psutil.Process]:
    """The ``count`` descendants ``proc`` starts, once all are there."""

    def found() -> list[psutil.Process] | None:
        below = psutil.Process(proc.pid).children(recursive=True)
        return below if len(below) == count else None

    below = wait_for(found, what=f"{count} processes below {proc.pid}")
    assert below is not None
    return below


def test_live_finds_the_shims_descendants_in_sessions_of_their_own(
    started: list[subprocess.Popen[bytes]],
) -> None:
    shim = subprocess.Popen([sys.executable, "-c", CHAIN, "2"], start_new_session=True)
    started.append(shim)
    below = _below(shim, 2)  # a child and a grandchild, untagged, neither in the shim's session
    sweep = ProcessTree(psutil.Process(shim.pid), shim.pid, None)
    live = [p.pid for p in sweep.live()]
    assert sorted(live[:-1]) == sorted(p.pid for p in below)
    assert live[-1] == shim.pid


def test_live_finds_the_members_of_the_session(started: list[subprocess.Popen[bytes]]) -> None:
    # A session leader and its child, with no shim and no tag: the session scan alone.
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])", *SLEEPER],
        start_new_session=True,
    )
    started.append(leader)
    (child,) = _below(leader, 1)
    sweep = ProcessTree(None, leader.pid, None)
    assert sorted(p.pid for p in sweep.live()) == sorted([leader.pid, child.pid])


def test_live_puts_the_shim_last_and_its_pid_1_just_before_it(
    started: list[subprocess.Popen[bytes]],
) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    # The shim's stand-in is unshare; PID 1 of the namespace, its child, starts a sleeper.
    command = [unshare, "--pid", "--fork", "--kill-child", sys.executable, "-c", CHAIN, "1"]
    shim = subprocess.Popen(command, start_new_session=True)
    started.append(shim)
    below = _below(shim, 2)
    (pid_1,) = [p.pid for p in below if p.ppid() == shim.pid]
    assert tree._is_pid_1(pid_1)
    (sleeper,) = [p.pid for p in below if p.pid != pid_1]
    sweep = ProcessTree(psutil.Process(shim.pid), shim.pid, None)
    assert [p.pid for p in sweep.live()] == [sleeper, pid_1, shim.pid]


ONE_ID_HANGS = """
import os, subprocess, sys, time
def run(data):
    # A process in a session of its own: only the scan for the episode's tag finds it.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    time.sleep(60)
"""

ONE_ID_WORKS = """
import os, subprocess, sys, time
def run(data):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline and not os.path.exists(data["swept"]):
        time.sleep(0.05)
    alive = child.poll() is None
    child.kill()
    child.wait()
    return 1.0, {"swept": os.path.exists(data["swept"]), "child alive": alive}
"""


@pytest.mark.anyio
async def test_two_episodes_with_one_id_sweep_only_their_own(agents: Agents) -> None:
    """The caller may give two episodes one id (a rollout per sample of one record). The sweep
    of one that times out finds its processes by its own tag, and leaves the other's alone."""
    swept = agents.tmp / "swept"
    hangs = agents.spec(ONE_ID_HANGS, timeout=1.0)
    works = agents.spec(ONE_ID_WORKS, timeout=20.0)
    outcomes: dict[str, isolate.EpisodeOutcome] = {}

    async def hang() -> None:
        outcomes["hangs"] = await isolate.run_episode(hangs, {}, episode_id="one-id")
        swept.touch()

    async def work() -> None:
        data = {"swept": str(swept)}
        outcomes["works"] = await isolate.run_episode(works, data, episode_id="one-id")

    async with anyio.create_task_group() as tg:
        tg.start_soon(hang)
        tg.start_soon(work)
    assert outcomes["hangs"].status == "timeout", outcomes["hangs"].summary()
    assert outcomes["hangs"].killed >= 1, outcomes["hangs"].summary()  # its own, escaped child
    assert outcomes["works"].status == "ok", outcomes["works"].summary()
    assert outcomes["works"].info == {"swept": True, "child alive": True}
