"""Each layer on its own: where two layers guard one promise, a test that only the layer under
test can answer, with the others absent (a level without ``pidns``, a plan without mounts, the
parent killed with its shim), so that a bug in one layer is not hidden by another.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import isolate

from .conftest import (
    AS_NOBODY,
    NOBODY,
    RUN_SPEC,
    SLOW,
    Agents,
    episode_processes,
    is_gone,
    wait_for,
)
from .teardown._trees import needs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux layers")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may read and write."""
    path = Path(tempfile.mkdtemp(prefix="isolate-alone-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def open_for_all(*paths: Path) -> None:
    for path in paths:
        path.chmod(0o777 if path.is_dir() else 0o666)


# --- the worker's parent-death signal -----------------------------------------------------------


@pytest.mark.parametrize("containment", ["session", "landlock"])
def test_the_worker_dies_with_its_supervisor_when_the_parent_is_gone_too(
    agents: Agents, containment: str
) -> None:
    # No PID namespace (whose PID 1 would take the worker with it), no cgroup, no parent left
    # to sweep and no supervisor to notice the parent's death: only the worker's parent-death
    # signal (PR_SET_PDEATHSIG) ends it.
    needs(containment)
    spec = agents.spec(
        """
        import os, time
        def run(data):
            path = os.path.join(os.environ["PID_DIR"], "worker")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(path + ".tmp", path)
            time.sleep(300)
        """,
        containment=containment,
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", RUN_SPEC, spec.model_dump_json(), "{}"],
        stdout=subprocess.DEVNULL,
    )
    try:
        worker = psutil.Process(agents.wait_pids(1, 20.0 * SLOW)["worker"])
        worker.create_time()  # cached for is_gone
        supervisor = worker.parent()
        assert supervisor is not None
        # Both stopped first, so that neither reacts to the other's death: the parent would
        # sweep the episode, the supervisor would cancel the agent at its pipe's EOF.
        os.kill(parent.pid, signal.SIGSTOP)
        supervisor.suspend()
        supervisor.kill()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: is_gone(worker.pid, worker.create_time()), 2.0 * SLOW, "the worker")
    finally:
        parent.kill()
        parent.wait()
        for proc in agents.left():
            proc.kill()
    wait_for(lambda: agents.left() == [], 5.0 * SLOW, "no process of the episode left")


# --- the shim's processes are not dumpable -------------------------------------------------------

#: Starts a child that is dumpable as any process is, says so, and waits to be let go.
HOLDER = """
import os, subprocess, time
def run(data):
    child = subprocess.Popen(["sleep", "300"])
    open(os.path.join(data["dir"], "ready"), "w").close()
    while not os.path.exists(os.path.join(data["dir"], "go")):
        time.sleep(0.01)
    child.kill()
    child.wait()
    return 1.0
"""


@pytest.mark.parametrize("containment", ["pidns", "landlock", "session"])
def test_every_process_of_the_shim_is_not_dumpable(
    shared: Path, nobody: tuple[str, dict[str, str]], containment: str
) -> None:
    # As an unprivileged trainer, the kernel gives the /proc files of a process that is not
    # dumpable to root: what a ptrace or a read of its memory would check first, seen here
    # without asking any other layer (the PID namespace, Landlock, capabilities) to refuse.
    needs(containment)
    python, env = nobody
    (shared / "agent_root").mkdir()
    (shared / "agent_root" / "holder.py").write_text(textwrap.dedent(HOLDER))
    open_for_all(shared / "agent_root", shared / "agent_root" / "holder.py")
    marker = f"HOLDER_RUN={shared}"
    spec = isolate.EpisodeSpec(
        agent_root=shared / "agent_root",
        entrypoint="holder:run",
        python=python,
        containment=containment,
        timeout=60.0,
        env={"HOLDER_RUN": str(shared)},
    )
    data = json.dumps({"dir": str(shared)})
    parent = subprocess.Popen(
        [*AS_NOBODY, python, "-c", RUN_SPEC, spec.model_dump_json(), data],
        stdout=subprocess.PIPE,
        env=env,
        cwd=shared,
        text=True,
    )
    try:
        wait_for((shared / "ready").exists, 30.0 * SLOW, "the agent")
        owners = {}
        for proc in episode_processes(marker.encode()):
            name = "sleep" if proc.name() == "sleep" else "shim"
            # A directory shows the effective uid; a file shows who may dump the process.
            owners.setdefault(name, set()).add(os.stat(f"/proc/{proc.pid}/environ").st_uid)
        (shared / "go").touch()
        out, _ = parent.communicate(timeout=60 * SLOW)
    finally:
        parent.kill()
        parent.wait()
    assert json.loads(out.splitlines()[-1])["status"] == "ok"
    # The shim's processes (a relay, PID 1, the supervisor, the worker) belong to root in
    # /proc; the agent's own child, as dumpable as any, to its user.
    assert owners == {"shim": {0}, "sleep": {NOBODY}}
    assert episode_processes(marker.encode()) == []


# --- Landlock's file rules without mounts (no read-only view, no hiding mount) ------------------

READER = """
import errno, os
def run(data):
    def err(call):
        try:
            return call()
        except OSError as exc:
            return errno.errorcode[exc.errno]
    return 1.0, {
        "key": err(lambda: open(data["key"]).read()),
        "write outside": err(lambda: open(data["outside"], "a").write("x")),
        "key's folder": err(lambda: os.listdir(os.path.dirname(data["key"]))),
        "mount namespace": os.readlink("/proc/self/ns/mnt"),
    }
"""


def test_landlock_alone_refuses_reads_under_a_hidden_directory_and_writes_outside(
    shared: Path, nobody: tuple[str, dict[str, str]]
) -> None:
    # An unprivileged trainer at landlock: no PID namespace, and the worker may not make a
    # mount namespace, so no empty tmpfs covers the hidden directory; only Landlock's rules do.
    needs("landlock")
    python, env = nobody
    secrets = shared / "secrets"
    secrets.mkdir()
    key = secrets / "key"
    key.write_text("sk-landlock-alone\n")
    outside = shared / "outside.txt"  # anyone's to write, outside the sandbox's paths
    outside.write_text("")
    (shared / "agent_root").mkdir()
    (shared / "agent_root" / "reader.py").write_text(textwrap.dedent(READER))
    (shared / "cwd").mkdir()
    open_for_all(secrets, key, outside, shared / "agent_root", shared / "agent_root" / "reader.py")
    open_for_all(shared / "cwd")
    control = subprocess.run(
        [*AS_NOBODY, "cat", str(key)], capture_output=True, text=True, env=env, check=False
    )
    assert control.stdout == "sk-landlock-alone\n"  # readable by the user without the sandbox
    wrote = subprocess.run([*AS_NOBODY, "sh", "-c", f"echo > {outside}"], env=env, check=False)
    assert wrote.returncode == 0  # and this one writable
    spec = isolate.EpisodeSpec(
        agent_root=shared / "agent_root",
        entrypoint="reader:run",
        python=python,
        containment="landlock",
        cwd=shared / "cwd",
        timeout=60.0,
        sandbox=isolate.Sandbox(hide=[str(secrets)]),
    )
    data = {"key": str(key), "outside": str(outside)}
    done = subprocess.run(
        [*AS_NOBODY, python, "-c", RUN_SPEC, spec.model_dump_json(), json.dumps(data)],
        capture_output=True,
        text=True,
        env=env,
        cwd=shared,
        timeout=60 * SLOW,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert outcome["status"] == "ok", (outcome["error"], outcome["stderr_tail"][-2000:])
    assert outcome["info"]["mount namespace"] == os.readlink("/proc/self/ns/mnt")  # no mounts
    assert outcome["info"]["key"] == "EACCES"
    assert outcome["info"]["write outside"] == "EACCES"  # Landlock's, not a read-only mount's
    assert outcome["info"]["key's folder"] == ["key"]  # names only, as docs/sandbox.md says
