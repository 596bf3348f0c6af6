"""Containment layers and resource limits: ``auto`` picks the strongest combination here, a
layer the machine cannot give is a setup error that says why, a dead parent's stale cgroup
leaves are removed, limits end an episode as ``crashed`` with a reason while its neighbours
carry on, and the handshake and frame parsers survive whatever they are fed. The teardown tests
at every combination are in ``tests/teardown``."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import isolate

from . import _internals
from .conftest import (
    SLOW,
    Agents,
    both_starts,
    wait_for,
)
from .teardown._trees import LEVELS, PARENT, needs, tree

pytestmark = pytest.mark.anyio


# --- levels ------------------------------------------------------------------------------------


def machine_has(layer: str) -> bool:
    """Whether this machine provides containment ``layer``, found without isolate's probes:
    by doing what the layer needs (a cgroup made and removed; ``unshare``; Landlock's ABI)."""
    if layer == "cgroup":
        own = Path("/proc/self/cgroup").read_text().splitlines()
        path = next(line.split(":", 2)[2] for line in own if line.startswith("0::"))
        mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
        for point in [m[1] for m in mounts if m[2] == "cgroup2"]:
            probe = Path(point + path.rstrip("/")) / f"machine-has.{os.getpid()}"
            try:
                probe.mkdir()
            except OSError:
                continue
            try:
                if (probe / "cgroup.kill").exists():
                    return True
            finally:
                probe.rmdir()
        return False
    if layer == "pidns":
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        unshare = shutil.which("unshare")
        return (
            unshare is not None
            and subprocess.run(
                [unshare, *user, "--pid", "--fork", "true"], capture_output=True
            ).returncode
            == 0
        )
    if layer == "landlock":
        libc = ctypes.CDLL(None, use_errno=True)
        abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(.., VERSION)
        return bool(abi >= 6)  # the layer scopes signals: ABI 6
    raise AssertionError(f"teach machine_has about the layer {layer!r}")


AUTO_REPORTER = """
import os, time
def run(data):
    open(data["go"] + ".ready", "w").close()
    while not os.path.exists(data["go"]):  # the test reads our cgroup from outside meanwhile
        time.sleep(0.01)
    return 1.0, {"pidns": os.readlink("/proc/self/ns/pid")}
"""


async def test_auto_picks_the_strongest_combination_available(agents: Agents) -> None:
    # The expectation comes from the machine itself, not from the probe resolve uses; what the
    # agent really got is seen from outside (its cgroup: inside, a cgroup namespace shows its
    # leaf as "/") and from inside (its PID namespace).
    expected = next(c for c in _internals.AUTO if all(machine_has(x) for x in _internals.layers(c)))
    go = agents.tmp / "go"
    cgroups: list[str] = []

    def look() -> None:
        wait_for(Path(f"{go}.ready").exists, 10 * SLOW, "the agent")
        procs = agents.left()
        assert procs
        cgroups.extend(Path(f"/proc/{p.pid}/cgroup").read_text() for p in procs)
        go.touch()

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, look)
        outcome = await isolate.run_episode(agents.spec(AUTO_REPORTER), {"go": str(go)})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.containment == expected
    seen = set()
    if all("/isolate/" in cgroup for cgroup in cgroups):
        seen.add("cgroup")
    if outcome.info["pidns"] != os.readlink("/proc/self/ns/pid"):
        seen.add("pidns")
    assert seen == set(_internals.layers(expected)) - {"landlock"}


def test_a_process_limit_pidns_cannot_enforce_is_a_setup_error() -> None:
    needs("pidns")
    if _internals.needs_userns():
        pytest.skip("an unprivileged parent enforces it with RLIMIT_NPROC in a user namespace")
    spec = isolate.EpisodeSpec(containment="pidns", limits=isolate.Limits(max_processes=10))
    outcome = anyio.run(isolate.run_episode, spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert "max_processes" in outcome.error.message
    assert "RLIMIT_NPROC" in outcome.error.message


def test_session_with_a_process_limit_is_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match=r"max_processes.*containment='session'"):
        isolate.EpisodeSpec(containment="session", limits=isolate.Limits(max_processes=10))


ISOLATED_PARENT = """
import anyio, isolate, json, sys
spec = isolate.EpisodeSpec(entrypoint="builtins:float", containment=sys.argv[1], timeout=20)
outcome = anyio.run(isolate.run_episode, spec, 1.0)
print(json.dumps({"status": outcome.status, "message": outcome.error and outcome.error.message}))
"""


def run_isolated_parent(wrapper: str, level: str) -> dict[str, Any]:
    """Run a parent in a sandbox that ``wrapper`` (a shell command prefix) sets up."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv to take the level away for real")
    done = subprocess.run(
        ["sh", "-c", f'{wrapper} "$0" -c "$1" "$2"', sys.executable, ISOLATED_PARENT, level],
        capture_output=True,
        timeout=60 * SLOW,
    )
    assert done.returncode == 0, done.stderr.decode()
    result: dict[str, Any] = json.loads(done.stdout.decode().splitlines()[-1])
    return result


def test_cgroup_on_a_read_only_cgroup_tree_is_a_setup_error_that_says_why() -> None:
    needs("cgroup")
    mounts = " && ".join(
        f"mount -o remount,bind,ro {point}"
        for fstype, _, point, _ in _internals.mounts()
        if fstype in ("cgroup", "cgroup2")
    )
    wrapper = f'unshare --mount --propagation private sh -c \'{mounts} && exec "$0" "$@"\''
    result = run_isolated_parent(wrapper, "cgroup")
    assert result["status"] == "setup_error"
    assert "containment 'cgroup' is not available" in result["message"]
    assert "not writable (Read-only file system)" in result["message"]


def test_pidns_without_namespaces_is_a_setup_error_that_says_why() -> None:
    # A user namespace of our own that allows no further user namespaces, and no
    # CAP_SYS_ADMIN: nothing left to make a PID namespace with.
    wrapper = (
        "unshare --user --map-root-user sh -c 'echo 0 > /proc/sys/user/max_user_namespaces "
        '&& exec setpriv --inh-caps=-sys_admin --bounding-set=-sys_admin "$0" "$@"\''
    )
    result = run_isolated_parent(wrapper, "pidns")
    assert result["status"] == "setup_error"
    assert "containment 'pidns' is not available" in result["message"]
    assert "namespaces not permitted" in result["message"]


# --- stale leaves -----------------------------------------------------------------------------


def test_stale_leaves_of_a_dead_parent_are_removed_on_the_next_start(agents: Agents) -> None:
    needs("cgroup")
    groups = _internals.cgroups()
    roots = [r for r in [groups.v2, *groups.v1.values()] if r is not None]

    def owner_of(proc: subprocess.Popen[bytes]) -> str:
        return f"{proc.pid}.{_internals.start_time(proc.pid)}"

    dead = subprocess.Popen(["sleep", "60"])
    alive = subprocess.Popen(["sleep", "60"])
    victim = subprocess.Popen(["sleep", "300"])
    dead_name, alive_name = owner_of(dead), owner_of(alive)
    try:
        dead.kill()
        dead.wait()
        for root in roots:
            for name in (dead_name, alive_name):
                (root / name / "crashed-episode.1").mkdir(parents=True)
        assert groups.v2 is not None
        # A process still in the dead parent's leaf, as after a crash of the parent, in a
        # cgroup its agent made inside the leaf.
        nested = groups.v2 / dead_name / "crashed-episode.1" / "made-by-the-agent"
        nested.mkdir()
        (nested / "cgroup.procs").write_text(str(victim.pid))

        spec = agents.spec("def run(d):\n    return 1.0\n", containment="cgroup")
        fresh = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(PARENT), spec.model_dump_json()],
            capture_output=True,
            timeout=60 * SLOW,
        )
        assert fresh.returncode == 0, fresh.stderr.decode()
        assert victim.wait(timeout=5 * SLOW) == -signal.SIGKILL
        for root in roots:
            assert not (root / dead_name).exists()
            assert (root / alive_name / "crashed-episode.1").is_dir()  # its parent lives
    finally:
        for proc in (dead, alive, victim):
            proc.kill()
            proc.wait()
        for root in roots:
            for name in (dead_name, alive_name):
                episode = root / name / "crashed-episode.1"
                for leaf in [episode / "made-by-the-agent", episode, root / name]:
                    if leaf.exists():
                        leaf.rmdir()


NESTING_AGENT = """
import os, subprocess
def run(data):
    # The agent's own v2 cgroup (the episode's leaf), and one it makes inside, as a container
    # runtime would, with a process of its own in it.
    mount = [l.split()[1] for l in open("/proc/self/mounts") if l.split()[2] == "cgroup2"][0]
    path = [l for l in open("/proc/self/cgroup") if l.startswith("0::")][0][3:].strip()
    leaf = mount + path
    os.mkdir(leaf + "/made-by-the-agent")
    child = subprocess.Popen(["sleep", "300"])
    with open(leaf + "/made-by-the-agent/cgroup.procs", "w") as f:
        f.write(str(child.pid))
    with open(data["out"], "w") as f:
        f.write(leaf)
    return 1.0
"""


async def test_a_cgroup_the_agent_made_inside_its_leaf_goes_with_the_leaf(agents: Agents) -> None:
    needs("cgroup")
    out = agents.tmp / "leaf"
    spec = agents.spec(NESTING_AGENT, containment="cgroup")
    outcome = await isolate.run_episode(spec, {"out": str(out)})
    assert outcome.status == "ok", outcome.summary()
    leaf = Path(out.read_text())
    assert leaf.parent.name == _internals.owner_name()
    assert leaf.name.startswith(outcome.episode_id + ".")
    assert not await anyio.Path(leaf).exists()
    assert outcome.killed >= 1  # the sleep in the nested cgroup
    assert tree(agents) == []


# --- resource limits --------------------------------------------------------------------------

FORK_BOMB = """
import os, time
def run(data):
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.01)
"""


def pids_counters(episode_id: str) -> tuple[int, int] | None:
    """``pids.peak`` and the ``max`` count of ``pids.events`` of the episode's pids leaf, while
    it exists: the kernel's own count, no sample missed."""
    groups = _internals.cgroups()
    roots = [r for r in [groups.v2, *groups.v1.values()] if r is not None]
    for root in roots:
        for leaf in (root / _internals.owner_name()).glob(f"{episode_id}.*"):
            try:
                peak = int((leaf / "pids.peak").read_text())
                events = dict(
                    line.split() for line in (leaf / "pids.events").read_text().splitlines()
                )
            except (OSError, ValueError):
                continue  # not the pids leaf, or gone just now
            return peak, int(events["max"])
    return None


@both_starts
@pytest.mark.parametrize("requested", ["cgroup", "auto"])
async def test_a_fork_bomb_is_contained_and_cleaned(agents: Agents, requested: str) -> None:
    used = needs(requested)
    if "cgroup" not in _internals.layers(used):
        pytest.skip(f"auto is {used!r} here, without the cgroup layer")
    limits = isolate.Limits(max_processes=32)
    spec = agents.spec(FORK_BOMB, timeout=2.0, kill_grace=0.2, containment=requested, limits=limits)
    bomb_spec = spec.model_copy(update={"env": {**spec.env, "ROLE": "bomb"}})
    sibling = agents.spec("import time\ndef run(d):\n    time.sleep(1.0)\n    return 1.0\n")
    outcomes: dict[str, isolate.EpisodeOutcome] = {}
    counters: list[tuple[int, int]] = []  # the last read wins: both only ever grow

    async def watch() -> None:
        while "bomb" not in outcomes:
            found = await anyio.to_thread.run_sync(pids_counters, "bomb")
            if found is not None:
                counters.append(found)
            await anyio.sleep(0.05)

    async def one(name: str, episode_spec: isolate.EpisodeSpec) -> None:
        outcomes[name] = await isolate.run_episode(episode_spec, {}, episode_id=name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        tg.start_soon(one, "bomb", bomb_spec)
        tg.start_soon(one, "sibling", sibling)
    bomb = outcomes["bomb"]
    assert bomb.status == "crashed", bomb.summary()
    assert bomb.reason == "process limit 32"
    assert bomb.error is not None
    assert bomb.error.message.startswith("process limit 32 hit: ")
    # It forked up to the limit (32, + the supervisor, + with a PID namespace in a user
    # namespace its relay), not past it, and was refused.
    assert counters, "the bomb's pids leaf was never seen"
    peak, refused = counters[-1]
    relayed = "pidns" in _internals.layers(used) and _internals.needs_userns()
    assert peak == 33 + relayed
    assert refused > 0
    assert bomb.containment == used
    assert outcomes["sibling"].status == "ok", outcomes["sibling"].summary()
    assert tree(agents) == []


@both_starts
@pytest.mark.parametrize("mechanism", LEVELS)
async def test_a_memory_hog_is_killed_alone_with_the_reason(agents: Agents, mechanism: str) -> None:
    used = needs(mechanism)
    limits = isolate.Limits(memory_bytes=128 * 1024 * 1024)
    hog = agents.spec(
        """
        def run(data):
            hoard = []
            while True:
                hoard.append(bytearray(1 << 20))
        """,
        containment=mechanism,
        limits=limits,
    )
    sibling = agents.spec(
        "import time\ndef run(d):\n    time.sleep(0.5)\n    return d['i']\n", containment=mechanism
    )
    outcomes: dict[int, isolate.EpisodeOutcome] = {}

    async def one(i: int) -> None:
        outcomes[i] = await isolate.run_episode(hog if i < 0 else sibling, {"i": i})

    async with anyio.create_task_group() as tg:
        for i in range(-1, 8):
            tg.start_soon(one, i)
    hogged = outcomes.pop(-1)
    assert hogged.status == "crashed", hogged.summary()
    assert hogged.reason == "memory limit 128 MiB"
    if "cgroup" in _internals.layers(used) and _internals.cgroups().controller("memory"):
        assert hogged.oom_kills is not None
        assert hogged.oom_kills >= 1
        assert hogged.signal == "SIGKILL"
    else:
        assert hogged.error is not None
        assert hogged.error.type == "MemoryError"  # RLIMIT_DATA, per process
    assert {i: o.status for i, o in outcomes.items()} == {i: "ok" for i in range(8)}
    assert [outcomes[i].reward for i in range(8)] == [float(i) for i in range(8)]


@both_starts
async def test_a_memory_error_is_reported_with_no_room_left_below_the_limit(agents: Agents) -> None:
    # Memory exhausted to the last small block, then an error whose report (message, traceback,
    # frame) needs a few MiB more: only the room above the soft limit lets it reach the parent.
    spec = agents.spec(
        """
        hoard = []
        def run(data):
            note = "n" * (3 << 19)  # 1.5 MiB, quoted by the message and the traceback
            for size in (1 << 20, 1 << 12, 64):
                try:
                    while True:
                        hoard.append(bytearray(size))
                except MemoryError:
                    pass
            raise MemoryError(note)
        """,
        containment="session",
        limits=isolate.Limits(memory_bytes=128 * 1024 * 1024),
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "crashed", outcome.summary()
    assert outcome.reason == "memory limit 128 MiB"
    assert outcome.error is not None
    assert outcome.error.type == "MemoryError"
    # The report made it whole; the message is cut to what the parent keeps, and says so.
    assert re.search(r"n{1000} \[\.\.\. \d+ more characters\]$", outcome.error.message)
    assert tree(agents) == []


@both_starts
async def test_a_cpu_limit_ends_the_episode_with_the_reason(agents: Agents) -> None:
    spec = agents.spec(
        "def run(d):\n    while True:\n        pass\n",
        limits=isolate.Limits(cpu_seconds=1, core_dumps=False),
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "crashed", outcome.summary()
    assert outcome.reason == "CPU limit 1 s"
    assert outcome.signal == "SIGXCPU"


@both_starts
async def test_rlimits_reach_the_agent_and_its_children(agents: Agents) -> None:
    spec = agents.spec(
        """
        import resource, subprocess, sys
        from resource import RLIMIT_CORE, RLIMIT_NOFILE, getrlimit
        SHOW = "import resource as r; print(r.getrlimit(%d), r.getrlimit(%d))" % (
            RLIMIT_NOFILE, RLIMIT_CORE)
        def run(data):
            child = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True)
            mine = [getrlimit(RLIMIT_NOFILE), getrlimit(RLIMIT_CORE)]
            return 1.0, {"mine": mine, "child": child.stdout.strip()}
        """,
        limits=isolate.Limits(open_files=64, core_dumps=False),
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.info == {"mine": [[64, 64], [0, 0]], "child": "(64, 64) (0, 0)"}


@both_starts
async def test_the_log_is_cut_at_log_bytes_and_the_tail_goes_on(agents: Agents) -> None:
    spec = agents.spec(
        """
        import sys
        def run(data):
            for i in range(2000):
                sys.stderr.write("line %04d %s\\n" % (i, "x" * 200))
            return 1.0
        """,
        limits=isolate.Limits(log_bytes=10_000),
        stderr_tail_bytes=4096,
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.log_path is not None
    log = outcome.log_path.read_bytes()
    kept, _, rest = log.partition(b"\n[isolate] log cut at limits.log_bytes=10000")
    assert len(kept) == 10_000
    while kept.startswith(b"[isolate] "):  # with preload, which template forked it
        kept = kept.split(b"\n", 1)[1]
    assert kept.startswith(b"line 0000 ")
    assert rest.count(b"log cut") == 0  # noted once
    assert len(log) < 10_000 + 1000  # the note and the closing summary line
    assert log.endswith(f"\n[isolate] {outcome.summary()}\n".encode())  # past the cap too
    assert "line 1999 " in outcome.stderr_tail


def test_unprivileged_pidns_keeps_ownership_and_counts_processes_per_namespace() -> None:
    """The real shim as an unprivileged user (nobody), under the system Python: PID 1 of a PID
    namespace inside a user namespace; files keep the user's ownership and RLIMIT_NPROC counts
    only the episode's processes, not the user's others."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.access(python, os.X_OK):
        pytest.skip("needs root, setpriv and a system python3 to act as an unprivileged user")
    nobody = 65534
    work = Path(tempfile.mkdtemp(prefix="isolate-nobody-"))
    others = []
    try:
        work.chmod(0o777)
        (work / "agent.py").write_text(
            textwrap.dedent(
                """
                import os, time
                def run(data):
                    open(os.path.join(data["dir"], "written"), "w").write("x")
                    forked = []
                    try:
                        while len(forked) < 50:
                            pid = os.fork()
                            if pid == 0:
                                time.sleep(30)
                                os._exit(0)
                            forked.append(pid)
                    except OSError:
                        pass
                    return 1.0, {"forked": len(forked), "pid": os.getpid()}
                """
            )
        )
        as_nobody = ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups"]
        # Processes of the same user outside the episode must not count against its limit.
        others = [subprocess.Popen([*as_nobody, "sleep", "60"]) for _ in range(10)]
        handshake = {
            "protocol": isolate.PROTOCOL_VERSION,
            "nonce": "n" * 32,
            "entrypoint": "agent:run",
            "agent_root": str(work),
            "data": {"dir": str(work)},
            "kwargs": {},
            "secrets": {},
            "deadline": 30.0,
            "kill_grace": 0.2,
            "max_info_bytes": 10_000,
            "containment": "pidns",
            "userns": True,
            "rlimits": {"RLIMIT_NPROC": [10, 10]},
        }
        done = run_shim(
            [*as_nobody, python, "-I", str(isolate.shim_path())],
            json.dumps(handshake).encode() + b"\n",
            keep_stdin=True,
            cwd=work,
        )
        assert done.returncode == 0, done.stderr.decode()
        frames = {f["t"]: f for f in map(json.loads, done.stdout.splitlines())}
        assert frames["hello"]["containment"] == "pidns"
        assert frames["result"]["info"]["pid"] == 2
        # 10 in the namespace: the shim's two halves, the worker, and 7 children.
        assert frames["result"]["info"]["forked"] == 7
        assert frames["done"]["killed"] == 7
        assert (work / "written").stat().st_uid == nobody
    finally:
        for proc in others:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


# --- the real shim, directly ------------------------------------------------------------------


def run_shim(
    argv: list[str], handshake: bytes, *, keep_stdin: bool, cwd: Path
) -> subprocess.CompletedProcess[bytes]:
    """Run the shim on a handshake. With ``keep_stdin`` its stdin stays open (EOF would mean
    that the parent died); else it is closed after the handshake."""
    if not keep_stdin:
        return subprocess.run(
            argv, input=handshake, capture_output=True, timeout=20 * SLOW, cwd=cwd
        )
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, handshake)
        proc = subprocess.Popen(
            argv, stdin=read_end, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd
        )
        os.close(read_end)
        read_end = -1
        try:
            out, err = proc.communicate(timeout=20 * SLOW)
        finally:
            proc.kill()
            proc.wait()
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


# --- the handshake, fuzzed: the real shim ------------------------------------------------------

MARKER_AGENT = """
import os
open(os.path.join(os.path.dirname(__file__), "imported"), "w").close()
def run(data):
    return 1.0
"""

WRONG = {
    "entrypoint": [1, None, [], "no_colon", "a:b c", {}],
    "agent_root": [1, [], {}, True],
    "kwargs": [[], "x", 1, None],
    "secrets": [[], {"k": 1}, {"k": None}, "x"],
    "deadline": ["1", None, [], -1, 0, True, float("inf")],
    "kill_grace": [-1, "1", None, True, float("nan")],
    "max_info_bytes": [-1, 1.5, "1", True, None],
    "containment": ["docker", 1, None, []],
    "userns": [1, "yes", None],
    "cgroups": ["x", [1], {}, None],
    "rlimits": [
        [],
        {"RLIMIT_NOPE": [1, 1]},
        {"RLIMIT_CPU": [1]},
        {"RLIMIT_CPU": [-1, 1]},
        {"RLIMIT_CPU": "1"},
        {"CPU": [1, 1]},
        None,
    ],
}


def valid_handshake(root: Path) -> dict[str, Any]:
    return {
        "protocol": isolate.PROTOCOL_VERSION,
        "nonce": "f" * 32,
        "entrypoint": "marker:run",
        "agent_root": str(root),
        "data": {},
        "kwargs": {},
        "secrets": {},
        "deadline": 10.0,
        "kill_grace": 0.5,
        "max_info_bytes": 1000,
        "containment": "session",
    }


@st.composite
def broken_handshakes(draw: st.DrawFn, root: Path) -> bytes:
    good = valid_handshake(root)
    line = json.dumps(good).encode()
    kind = draw(st.sampled_from(["bytes", "cut", "huge", "nonce", "version", "type", "missing"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300)) + draw(st.sampled_from([b"\n", b""]))
    if kind == "cut":
        return line[: draw(st.integers(0, len(line) - 1))] + draw(st.sampled_from([b"\n", b""]))
    if kind == "huge":
        size = draw(st.integers(1, 4)) << 20
        return draw(st.sampled_from([b"x", b"[", b'{"a":"'])) * size + b"\n"
    if kind == "nonce":
        good["nonce"] = draw(st.sampled_from([1, None, [], {}, 1.5]))
    elif kind == "version":
        good["protocol"] = draw(st.sampled_from([0, 2, "1", 1.0, True, None, []]))
    elif kind == "type":
        name = draw(st.sampled_from(sorted(WRONG)))
        good[name] = draw(st.sampled_from(WRONG[name]))
    else:
        del good[draw(st.sampled_from(["nonce", "entrypoint", "data", "protocol"]))]
    return json.dumps(good).encode() + b"\n"


def test_each_wrong_value_of_each_field_is_refused_without_running_anything() -> None:
    """Every entry of WRONG, not a sample: a null containment once passed the shim's check
    (its canonical form of a non-containment is None too) and crashed it at exit 1."""
    root = Path(tempfile.mkdtemp(prefix="isolate-hs-"))
    (root / "marker.py").write_text(MARKER_AGENT)
    try:
        refused = []
        for name, values in sorted(WRONG.items()):
            for value in values:
                handshake = {**valid_handshake(root), name: value}
                done = run_shim(
                    [sys.executable, "-I", str(isolate.shim_path())],
                    json.dumps(handshake).encode() + b"\n",
                    keep_stdin=False,
                    cwd=root,
                )
                assert done.returncode == 2, (name, value, done.stderr[-300:])
                assert not (root / "imported").exists(), (name, value)
                refused.append((name, value))
        assert len(refused) == sum(len(v) for v in WRONG.values())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_shim_refuses_every_broken_handshake_without_running_anything() -> None:
    root = Path(tempfile.mkdtemp(prefix="isolate-hs-"))
    (root / "marker.py").write_text(MARKER_AGENT)
    runs = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(handshake=broken_handshakes(root))
    def check(handshake: bytes) -> None:
        done = run_shim(
            [sys.executable, "-I", str(isolate.shim_path())], handshake, keep_stdin=False, cwd=root
        )
        runs.append(handshake)
        assert done.returncode == 2, (handshake[:200], done.stderr[-500:])
        frames = [json.loads(line) for line in done.stdout.splitlines()]
        assert [f["t"] for f in frames] in ([], ["hello"], ["hello", "error"])
        if len(frames) == 2:
            assert frames[1]["kind"] == "setup"
            assert "handshake" in frames[1]["message"]
        assert not (root / "imported").exists()

    try:
        # The control: the valid handshake does run the agent.
        line = json.dumps(valid_handshake(root)).encode() + b"\n"
        ran = run_shim(
            [sys.executable, "-I", str(isolate.shim_path())], line, keep_stdin=True, cwd=root
        )
        assert ran.returncode == 0, ran.stderr
        assert (root / "imported").exists()
        (root / "imported").unlink()
        check()
        assert len(runs) >= 30
        assert any(len(h) > 1 << 20 for h in runs)  # a huge line was among them
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- frames, fuzzed: fake shims against the real parent ---------------------------------------

FAKE = """
import sys
hs = sys.stdin.buffer.readline()
nonce = hs.split(b'"nonce":"', 1)[1].split(b'"', 1)[0]
with open(sys.argv[0] + ".out", "rb") as f:
    sys.stdout.buffer.write(f.read().replace(b"@N@", nonce))
sys.stdout.flush()
"""
MAX_FRAME = 4096

bad_frames = st.sampled_from(
    [
        b'{"t":"hello","nonce":"@N@","protocol":"1","pid":1,"python":"3","subreaper":true}',
        b'{"t":"hello","nonce":"@N@","protocol":2,"pid":1,"python":"3","subreaper":true}',
        b'{"t":"result","nonce":"@N@","reward":"high"}',
        b'{"t":"result","nonce":"@N@"}',
        b'{"t":"error","nonce":"@N@","kind":"weird","type":"X","message":"m"}',
        b'{"t":"done","nonce":"@N@","why":"bored","killed":0,"exit_code":0,"signal":null}',
        b'{"t":"done","nonce":"@N@","why":"exited","killed":-1,"exit_code":0,"signal":null}',
        b'{"t":7,"nonce":"@N@"}',
    ]
)
noise = st.one_of(
    st.binary(max_size=200).map(lambda b: b.replace(b"\n", b"")),
    st.sampled_from([b"[1,2]", b"NaN", b'{"t":"result","nonce":"other","reward":1}', b"{}"]),
)
oversized = st.integers(MAX_FRAME + 1, 3 << 20).map(lambda n: b"y" * n)


HELLO = b'{"t":"hello","nonce":"@N@","protocol":1,"pid":1,"python":"3.11","subreaper":true}'


@st.composite
def garbage(draw: st.DrawFn) -> tuple[bytes, str]:
    """Stdout of a broken shim, and the status it must get: ``protocol_error`` once it said
    hello or broke the protocol, else (all noise, no hello) ``setup_error``."""
    kinds = draw(st.lists(st.sampled_from(["noise", "bad", "big"]), max_size=6))
    hello = draw(st.booleans())
    out, breaks = [HELLO] if hello else [], hello
    for kind in kinds:
        if kind == "noise":
            out.append(draw(noise))
        else:
            out.append(draw(bad_frames if kind == "bad" else oversized))
            breaks = True
    text = b"\n".join(out) + (b"\n" if out else b"")
    cut = draw(st.sampled_from([b"", b'{"t":"result","nonce":"@N@","reward":1.0,"info"']))
    # A frame cut short at EOF breaks the protocol too.
    return text + cut, "protocol_error" if breaks or cut else "setup_error"


def test_garbage_on_stdout_is_always_a_clean_outcome(tmp_path: Path) -> None:
    spec = isolate.EpisodeSpec(
        entrypoint="fake:run",
        timeout=20.0,
        kill_grace=0.2,
        max_frame_bytes=MAX_FRAME,
        stderr_tail_bytes=1024,
    )
    me = psutil.Process()
    rss: list[int] = []
    sent = 0

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=garbage())
    def check(case: tuple[bytes, str]) -> None:
        nonlocal sent
        payload, status = case
        fake = Path(tempfile.mkdtemp(dir=tmp_path)) / "fake_shim.py"
        fake.write_text(FAKE)
        Path(str(fake) + ".out").write_bytes(payload)
        outcome = anyio.run(_internals.run_with_shim, spec, {}, fake)
        sent += len(payload)
        rss.append(me.memory_info().rss)
        assert isinstance(outcome, isolate.EpisodeOutcome)
        assert outcome.status == status, outcome.summary()
        assert outcome.error is not None

    check()
    assert len(rss) >= 20
    assert sent > 0
    assert max(rss) - rss[0] < 64 * 1024 * 1024, (rss[0], max(rss), sent)
