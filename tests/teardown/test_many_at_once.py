"""Many episodes in one event loop: all complete, and nothing (fd, zombie, thread) is left."""

from __future__ import annotations

import os
import threading

import anyio
import psutil
import pytest

import isolate

from ..conftest import Agents, wait_for

pytestmark = pytest.mark.anyio


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def stray_threads(before: set[threading.Thread]) -> list[str]:
    """Threads started since ``before`` that are not anyio's worker pool (which keeps idle
    workers for a while, up to its limiter's 40)."""
    return [
        t.name
        for t in threading.enumerate()
        if t not in before and not t.name.startswith("AnyIO worker thread")
    ]


def zombie_children() -> list[int]:
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
async def test_200_concurrent_episodes(agents: Agents) -> None:
    spec = agents.spec(
        """
        import os, subprocess, sys
        def run(data):
            sys.stderr.write("episode %d\\n" % data["i"] * 100)
            if data["i"] % 10 == 0:
                subprocess.Popen(["sleep", "300"])  # a leftover to kill
            return data["i"] / 200
        """,
        timeout=120.0,
        kill_grace=1.0,
    )
    fds_before = open_fds()
    threads_before = set(threading.enumerate())
    outcomes: dict[int, isolate.EpisodeOutcome] = {}

    async def one(i: int) -> None:
        outcomes[i] = await isolate.run_episode(spec, {"i": i})

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)

    assert len(outcomes) == 200
    bad = {i: o.summary() for i, o in outcomes.items() if o.status != "ok"}
    assert not bad
    assert all(o.reward == i / 200 for i, o in outcomes.items())
    assert sum(o.killed for o in outcomes.values()) == 20
    assert len({o.episode_id for o in outcomes.values()}) == 200
    # Threads of anyio's pool may still hold nothing; fds must be back where they were.
    wait_for(lambda: open_fds() <= fds_before, 5.0, f"fds back to {fds_before}")
    assert zombie_children() == []
    # The thread that ran the episodes' blocking calls ends once no call has come for a while.
    wait_for(lambda: stray_threads(threads_before) == [], 10.0, "no thread of ours left")
    pool = [t for t in threading.enumerate() if t.name.startswith("AnyIO worker thread")]
    assert len(pool) <= anyio.to_thread.current_default_thread_limiter().total_tokens
    # No thread outside Python's view either (one started by C code, say).
    assert psutil.Process().num_threads() == threading.active_count()
