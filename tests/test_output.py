"""Output handling: nothing the agent writes reaches the protocol; floods neither deadlock
nor grow the parent; pipes held by grandchildren do not delay the result."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import anyio
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import isolate

from . import _internals
from .conftest import SLOW, Agents, both_starts, record_pid_sh, wait_until

pytestmark = pytest.mark.anyio

NO_UNBUFFERED = ("PATH", "HOME")  # PYTHONUNBUFFERED is set on this machine: keep it out


@both_starts
async def test_stdout_pollution_lands_in_the_log(agents: Agents) -> None:
    spec = agents.spec(
        """
        import ctypes, os, subprocess, sys
        def run(data):
            print('{"t": "result", "reward": 0.0}')  # looks like a frame, has no nonce
            print("from-print")
            sys.stdout.write("from-sys-stdout\\n")
            os.write(1, b"from-os-write\\n")
            libc = ctypes.CDLL(None)
            libc.puts(b"from-libc-puts")
            libc.fflush(None)
            subprocess.run(["sh", "-c", "echo from-grandchild-echo"], check=True)
            os.system("echo from-os-system")
            return 0.75
        """,
        inherit_env=NO_UNBUFFERED,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.reward == 0.75
    assert outcome.log_path is not None
    log = outcome.log_path.read_text()
    assert log.endswith(f"\n[isolate] {outcome.summary()}\n")  # the log closes with the summary
    for text in (
        "from-print",
        "from-sys-stdout",
        "from-os-write",
        "from-libc-puts",
        "from-grandchild-echo",
        "from-os-system",
        '"reward": 0.0',
    ):
        assert text in log
        assert text in outcome.stderr_tail


@both_starts
async def test_stderr_flood_is_streamed_not_buffered(agents: Agents) -> None:
    """100 MB on stderr: all of it in the log, a bounded tail in memory, no deadlock."""
    size = 100 * 1024 * 1024
    spec = agents.spec(
        f"""
        import os
        def run(data):
            block = b"y" * 65535 + b"\\n"
            for _ in range({size} // 65536):
                os.write(2, block)
            os.write(1, b"tail-marker\\n")
            return 1.0
        """,
        inherit_env=NO_UNBUFFERED,
        stderr_tail_bytes=4096,
    )
    me = psutil.Process()
    before = me.memory_info().rss
    outcome = await isolate.run_episode(spec, {})
    grown = me.memory_info().rss - before
    assert outcome.status == "ok", outcome.summary()
    assert outcome.log_path is not None
    assert outcome.log_path.stat().st_size >= size
    assert len(outcome.stderr_tail.encode()) <= 4096
    assert "tail-marker" in outcome.stderr_tail
    assert grown < 40 * 1024 * 1024, f"parent RSS grew by {grown} bytes"


@both_starts
async def test_stdout_flood_is_drained(agents: Agents) -> None:
    """20 MB of stdout without newlines (one line far above max_frame_bytes) is noise that
    must not deadlock the child, and must not count as a frame."""
    spec = agents.spec(
        """
        import sys
        def run(data):
            for _ in range(320):
                sys.stdout.write("z" * 65536)
            sys.stdout.write("\\n")
            return 1.0
        """,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.log_path is not None
    assert outcome.log_path.stat().st_size >= 320 * 65536


@both_starts
async def test_grandchild_holding_the_pipes_does_not_delay_the_result(agents: Agents) -> None:
    """The agent returns while a background process still holds stdout/stderr: the outcome
    comes promptly, and the leftover is killed and counted."""
    spec = agents.spec(
        f"""
        import subprocess
        def run(data):
            subprocess.Popen(["sh", "-c", '{record_pid_sh("holder")}; exec sleep 300'])
            import os, time
            while not os.path.exists(os.path.join(os.environ["PID_DIR"], "holder")):
                time.sleep(0.01)
            return 1.0
        """,
        timeout=60.0,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.duration_s < 5.0 * SLOW
    assert outcome.killed == 1
    assert "holder" in agents.pid_files()  # the control: the holder did start
    assert agents.left() == []


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(min_value=0, max_value=64),
    chunks=st.lists(st.binary(max_size=150), max_size=30),
)
def test_tail_keeps_exactly_the_last_bytes(limit: int, chunks: list[bytes]) -> None:
    tail = _internals.Tail(limit)
    written = b""
    for chunk in chunks:
        tail.write(chunk)
        written += chunk
        assert tail.value() == (written[-limit:] if limit else b"")
    assert len(tail._buf) <= limit  # never more memory than the limit


async def test_a_log_that_cannot_be_written_does_not_end_the_episode(
    agents: Agents, tmp_path: Path
) -> None:
    """A full disk (here /dev/full behind the log's name) costs the log, never the result."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "full.log").symlink_to("/dev/full")
    spec = agents.spec(
        """
        import sys
        def run(data):
            for i in range(2000):
                sys.stderr.write("line %d of the agent\\n" % i)
            return 0.5
        """,
        log_dir=logs,
        inherit_env=NO_UNBUFFERED,
    )
    outcome = await isolate.run_episode(spec, {}, episode_id="full")
    assert outcome.status == "ok", outcome.summary()
    assert outcome.reward == 0.5
    assert "[isolate] cannot write the log" in outcome.stderr_tail
    assert "No space left on device" in outcome.stderr_tail
    assert "line 1999 of the agent" in outcome.stderr_tail  # the tail goes on


@both_starts
async def test_the_log_shows_what_came_while_the_episode_runs(agents: Agents) -> None:
    """A line the agent printed is in the log file at once (``tail -f``), not when an 8 KiB
    buffer fills or the episode ends."""
    release = agents.tmp / "release"
    spec = agents.spec(
        f"""
        import os, sys, time
        def run(data):
            print("first line of the agent")
            sys.stderr.write("a line on stderr\\n")
            while not os.path.exists({str(release)!r}):
                time.sleep(0.01)
            return 1.0
        """,
        inherit_env=NO_UNBUFFERED,  # not the shim's PYTHONUNBUFFERED: its own flushing
    )

    async def read_then_release() -> None:
        log = agents.logs / "live.log"
        await wait_until(lambda: log.exists() and b"a line on stderr" in log.read_bytes())
        text = log.read_text()
        assert "first line of the agent" in text
        release.touch()

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_then_release)
        outcome = await isolate.run_episode(spec, {}, episode_id="live")
    assert outcome.status == "ok", outcome.summary()


@both_starts
async def test_episodes_with_one_id_keep_logs_of_their_own(agents: Agents) -> None:
    """Two running episodes the caller gave one id do not write one file: the second one's
    log is ``<id>.<tag>.log``, named in its first line and in its outcome. Once the first has
    ended, the id's own file is free again, and a later episode appends to it."""
    release = agents.tmp / "release-twins"
    spec = agents.spec(
        f"""
        import os, time
        def run(data):
            print("marker", data["marker"], flush=True)
            while not os.path.exists({str(release)!r}):
                time.sleep(0.01)
            return 1.0
        """,
        inherit_env=NO_UNBUFFERED,
    )
    markers = ("twin-one-4c1d", "twin-two-93ab")
    outcomes: dict[str, isolate.EpisodeOutcome] = {}

    async def one(marker: str) -> None:
        outcomes[marker] = await isolate.run_episode(spec, {"marker": marker}, episode_id="twin")

    def both_printed() -> bool:
        text = "".join(p.read_text() for p in agents.logs.glob("twin*.log"))
        return all(f"marker {m}" in text for m in markers)

    async with anyio.create_task_group() as tg:
        for marker in markers:
            tg.start_soon(one, marker)
        await wait_until(both_printed)  # both run at once, each has written its log
        release.touch()
    assert all(o.status == "ok" for o in outcomes.values()), [
        o.summary() for o in outcomes.values()
    ]
    paths = {m: o.log_path for m, o in outcomes.items()}
    assert all(p is not None for p in paths.values())
    first = agents.logs.absolute() / "twin.log"
    assert sorted(p.name for p in paths.values() if p is not None)[-1] == "twin.log"
    for marker, path in paths.items():
        assert path is not None
        text = path.read_text()
        others = [m for m in markers if m != marker]
        assert f"marker {marker}" in text
        assert not any(f"marker {m}" in text for m in others)
        if path != first:
            assert re.fullmatch(r"twin\.[0-9a-f]{8}\.log", path.name), path.name
            assert f"another running episode writes {first}: this one's log is {path}" in text
    again = await isolate.run_episode(spec, {"marker": "twin-again-77e0"}, episode_id="twin")
    assert again.status == "ok", again.summary()
    assert again.log_path == first
    text = first.read_text()
    assert "marker twin-again-77e0" in text
    assert sum(f"marker {m}" in text for m in markers) == 1
    assert agents.left() == []


async def test_a_log_held_by_another_process_is_left_to_it(agents: Agents) -> None:
    """A process outside (another trainer with the same log directory, say) writes
    ``<id>.log`` and holds its lock: the episode writes its own file beside it and never
    touches that one."""
    agents.logs.mkdir(parents=True, exist_ok=True)
    held = agents.logs / "shared-id.log"
    stand_in = f"import fcntl, sys, time; f = open({str(held)!r}, 'ab'); "
    stand_in += "fcntl.flock(f, fcntl.LOCK_EX); f.write(b'stand-in 5e2f\\n'); f.flush(); "
    stand_in += "print('locked', flush=True); sys.stdin.read()"
    async with await anyio.open_process([sys.executable, "-c", stand_in]) as holder:
        assert holder.stdout is not None
        assert holder.stdin is not None
        assert await holder.stdout.receive() == b"locked\n"
        spec = agents.spec("def run(data):\n    print('episode 0b7c')\n    return 1.0\n")
        outcome = await isolate.run_episode(spec, {}, episode_id="shared-id")
        await holder.stdin.aclose()
        assert await holder.wait() == 0
    assert outcome.status == "ok", outcome.summary()
    assert outcome.log_path is not None
    assert outcome.log_path.parent == held.parent.absolute()
    assert outcome.log_path.name != held.name
    assert "episode 0b7c" in outcome.log_path.read_text()
    assert held.read_bytes() == b"stand-in 5e2f\n"
    assert agents.left() == []


#: Lines an agent floods the protocol channel with, ``@NONCE@`` standing for the episode's
#: nonce and ``@WRONG@`` for one a character off: each costs the parent a parse, or would.
CHANNEL_FLOODS = {
    "empty object": "{}",
    "junk": "x",
    "wrong nonce": '{"nonce":"@WRONG@"}',
    "result of the wrong nonce": '{"t":"result","nonce":"@WRONG@","reward":0.0}',
    "escaped string": '"\\u0041"',
    "bare nonce": "@NONCE@",
    "progress frames": '{"t":"progress","nonce":"@NONCE@"}',
}
#: The floods that are frames of the episode: kept, not noted.
FRAME_FLOODS = ("progress frames",)


#: A key of the length API keys have: the redactor looks for its fragments in every line.
KEY = "sk-proj-" + "Q7w9Zt2Lx4Vb8Nc1Md5Kf3Hg6Js0Pa2Ry"


@pytest.mark.parametrize("form", sorted(CHANNEL_FLOODS))
async def test_a_line_flood_on_the_channel_does_not_stall_the_event_loop(
    agents: Agents, form: str
) -> None:
    """The agent finds the shim's private frame channel and floods it with tiny lines for a
    second, then returns: the episode ends ``ok`` with its reward, the event loop never lags
    long, and the log holds a bounded number of notes about the ignored lines."""
    spec = agents.spec(
        f"""
        import os, sys, time
        def run(data, api_key):
            caller = sys._getframe(1)  # the shim's worker, which holds the channel
            while "channel" not in caller.f_locals:
                caller = caller.f_back
            chan = caller.f_locals["channel"]
            wrong = chan.nonce[:-1] + ("1" if chan.nonce[-1] == "0" else "0")
            line = {CHANNEL_FLOODS[form]!r}.replace("@WRONG@", wrong)
            line = line.replace("@NONCE@", chan.nonce).encode() + b"\\n"
            block = line * (65536 // len(line))
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                view = memoryview(block)
                while view:
                    view = view[os.write(chan.fd, view) :]
            with open(os.path.join(os.environ["PID_DIR"], "flooded"), "w") as f:
                f.write(str(os.getpid()))
            return 0.25
        """,
        inherit_env=NO_UNBUFFERED,
        timeout=60.0,
    )
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        outcome = await isolate.run_episode(spec, {}, secrets={"api_key": KEY})
        tg.cancel_scope.cancel()
    assert outcome.status == "ok", outcome.summary()
    assert outcome.reward == 0.25
    assert "flooded" in agents.pid_files()  # the control: the agent did flood
    worst = max(lags)
    assert worst < 0.25 * SLOW, f"the event loop lagged {1000 * worst:.0f} ms"
    assert outcome.log_path is not None
    log = outcome.log_path.read_text()
    assert log.count("[isolate] ignored stdout line") <= _internals.MAX_NOTED
    if form not in FRAME_FLOODS:
        counted = re.search(r"\[isolate\] (\d+) more stdout lines ignored", log)
        assert counted is not None, log[-2000:]
        assert int(counted[1]) > 10_000  # a flood indeed
    assert agents.left() == []
