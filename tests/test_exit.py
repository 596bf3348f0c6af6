"""The agent's process as an ordinary program: after its result it exits the normal way
(atexit, flushes, finalizers, threads joined), bounded by exit_grace; sys.argv and __main__
look like a program's, not the shim's."""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import pytest

import agent_shim.shim
import isolate

from .conftest import SLOW, Agents, both_starts, episode_processes
from .test_multiprocessing import interpreters

pytestmark = pytest.mark.anyio


@both_starts
@pytest.mark.parametrize("python", interpreters())
async def test_the_normal_exit_loses_nothing(agents: Agents, python: str) -> None:
    out = agents.tmp / "out"
    out.mkdir()
    spec = agents.spec(
        """
        import atexit, gzip, logging, os, tempfile
        OUT = os.environ["OUT"]
        def run(data):
            trajectory = open(os.path.join(OUT, "trajectory.jsonl"), "w")
            trajectory.write('{"step": 1}\\n' * 100)  # buffered, never closed
            atexit.register(lambda: open(os.path.join(OUT, "atexit"), "w").write("ran"))
            global scratch
            scratch = tempfile.TemporaryDirectory(dir=OUT)
            open(os.path.join(OUT, "scratch"), "w").write(scratch.name)
            handler = logging.FileHandler(os.path.join(OUT, "agent.log"), delay=True)
            log = logging.getLogger("agent")
            log.addHandler(handler)
            log.warning("last record")
            node = Mark()
            node.self = node  # a cycle: only the collector at exit finalises it
            del node
            # Alive at exit, in module globals: closed at exit, as plain python's teardown would.
            global steps, archive
            steps = open(os.path.join(OUT, "steps.txt"), "w")
            steps.write("kept\\n")
            archive = gzip.open(os.path.join(OUT, "steps.gz"), "wt")
            archive.write("kept too\\n")  # readable only once the trailer is written, at close
            return 1.0
        class Mark:
            def __del__(self):
                with open(os.path.join(OUT, "in-a-cycle"), "w") as f:
                    f.write("finalised by the collector")
        """,
        env={"PID_DIR": str(agents.pids), "OUT": str(out)},
        python=python,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert (out / "trajectory.jsonl").read_text() == '{"step": 1}\n' * 100
    assert (out / "atexit").read_text() == "ran"
    scratch = (out / "scratch").read_text()
    assert scratch.startswith(str(out))
    assert Path(scratch).name not in {p.name for p in out.iterdir()}
    assert (out / "agent.log").read_text() == "last record\n"
    assert (out / "in-a-cycle").read_text() == "finalised by the collector"
    assert (out / "steps.txt").read_text() == "kept\n"
    assert gzip.decompress((out / "steps.gz").read_bytes()) == b"kept too\n"
    assert outcome.exit_code == 0


@pytest.mark.parametrize(
    "hang",
    [
        "import atexit\natexit.register(lambda: time.sleep(300))",
        "threading.Thread(target=time.sleep, args=(300,)).start()",
    ],
    ids=["atexit", "thread"],
)
async def test_an_exit_that_hangs_is_cut_at_exit_grace_and_the_result_stands(
    agents: Agents, hang: str
) -> None:
    code = "import threading, time\n\ndef run(data):\n"
    code += "".join(f"    {line}\n" for line in hang.splitlines())
    code += "    return 0.5, {'kept': True}\n"
    spec = agents.spec(code, exit_grace=1.0, kill_grace=0.5)
    started = time.monotonic()
    outcome = await isolate.run_episode(spec, {})
    elapsed = time.monotonic() - started
    assert outcome.status == "ok", outcome.summary()
    assert (outcome.reward, outcome.info) == (0.5, {"kept": True})
    assert outcome.signal == "SIGKILL"
    assert "exit took longer than exit_grace (1 s)" in outcome.stderr_tail
    assert 1.0 <= elapsed <= 1.0 + 3.0 * SLOW, elapsed
    assert not episode_processes(f"PID_DIR={agents.pids}".encode())


def test_the_supervisor_believes_only_a_whole_exit_line() -> None:
    told = agent_shim.shim.load_part("supervisor").told
    assert told(b"exit 7 0.25\n") == (7 << 8, 0.25)
    assert told(b"xexit 0 0.5\n") == (0, 0.5)  # after the byte that says the frame is out
    assert told(b"exit 9 1.0\nexit 3 2.0\n") == (3 << 8, 2.0)  # the last line counts
    for said in (
        b"x",
        b"exit 7 0.25",  # not a whole line
        b"exit 256 0.1\n",
        b"exit -1 0.1\n",
        b"exit 1 nan\n",
        b"exit 1 inf\n",
        b"exit 1 -0.5\n",
        b"exit 1\n",
        b"exit 1 0.1 2\n",
        b"exit one 0.1\n",
    ):
        assert told(said) is None, said


@pytest.mark.parametrize(
    ("containment", "status"), [("cgroup+pidns", "crashed"), ("session", "timeout")]
)
async def test_an_agent_that_says_it_exits_ends_only_itself(
    agents: Agents, containment: str, status: str
) -> None:
    """The worker tells a supervisor that is PID 1 of the episode's namespace its exit status,
    and the supervisor ends the episode without waiting for the exit: the kernel reaps the
    worker with it. An agent that writes that line itself ends its own episode, as os._exit
    would: it is killed, and nothing of it is left. Without a PID namespace the line is not
    believed: the agent runs on to its deadline."""
    spec = agents.spec(
        """
        import os, stat, time
        def run(data):
            for name in os.listdir("/proc/self/fd"):
                try:
                    fd = int(name)
                    if fd > 2 and stat.S_ISFIFO(os.fstat(fd).st_mode):
                        os.write(fd, b"exit 7 0.0\\n")
                except OSError:
                    pass
            time.sleep(60)
        """,
        containment=containment,
        timeout=3.0,
        kill_grace=0.5,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == status, outcome.summary()
    if status == "crashed":
        assert outcome.exit_code == 7, outcome.summary()
        assert outcome.killed == 0, outcome.summary()  # the worker is no survivor to count
        assert outcome.duration_s < 3.0, outcome.summary()
    else:
        assert outcome.duration_s >= 3.0, outcome.summary()
    assert not episode_processes(f"PID_DIR={agents.pids}".encode())


async def test_an_error_frame_is_followed_by_the_normal_exit_too(agents: Agents) -> None:
    marker = agents.tmp / "atexit"
    spec = agents.spec(
        f"""
        import atexit
        def run(data):
            atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
            raise ValueError("nope")
        """
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "agent_error", outcome.summary()
    assert marker.read_text() == "ran"


async def test_the_agent_sees_an_ordinary_program(agents: Agents) -> None:
    spec = agents.spec(
        """
        import sys, __main__
        seen_at_import = (list(sys.argv), getattr(__main__, "__file__", None))
        def run(data):
            main = sys.modules["__main__"]
            return 1.0, {
                "argv": sys.argv,
                "at_import": seen_at_import,
                "main_file": getattr(main, "__file__", None),
                "main_spec": repr(main.__spec__),
                "main_names": sorted(n for n in vars(main) if n != "__builtins__"),
                "has_builtins": hasattr(main, "__builtins__"),
            }
        """
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    info = outcome.info
    assert info["argv"] == [spec.entrypoint]
    assert info["at_import"] == [[spec.entrypoint], None]
    assert info["main_file"] is None
    assert info["main_spec"] == "None"
    assert info["main_names"] == ["__doc__", "__loader__", "__name__", "__package__", "__spec__"]
    assert info["has_builtins"]
