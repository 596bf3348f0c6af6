"""The episode's world, built for it: attacks on each kernel object an episode with a PID
namespace could share with the trainer (System V IPC, POSIX message queues, terminals, device
nodes, raw sockets on loopback, the cgroup tree, the host name), from inside an episode, against
a stand-in trainer with a unique marker that holds a credential in each; with a control that
runs the same attack from a plain process and reaches it. As root at each combination with a
PID namespace, and as an unprivileged trainer (``nobody``, in a user namespace).
"""

from __future__ import annotations

import ctypes
import http.server
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import isolate

from .conftest import AS_NOBODY, NOBODY, RUN_SPEC, SLOW, both_starts, episode_processes, wait_for
from .test_cli import SCRIPTED, isolate_cli
from .test_containment import COMBINATIONS, needs

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces are Linux's"),
]

#: The stand-in trainer: a System V segment, semaphore set and message queue holding (or named
#: by) its credential, and a terminal of its own; says where they are, holds them until EOF.
STANDIN = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
IPC_CREAT = 0o1000
credential = sys.argv[1].encode()
shmid = libc.shmget(0, 4096, IPC_CREAT | 0o666)  # IPC_PRIVATE: found by id, not by key
address = libc.shmat(shmid, None, 0)
ctypes.memmove(address, credential, len(credential))
semid = libc.semget(0, 1, IPC_CREAT | 0o666)
msqid = libc.msgget(0, IPC_CREAT | 0o666)
master, slave = os.openpty()
os.fchmod(slave, 0o666)
print(json.dumps({"shmid": shmid, "semid": semid, "msqid": msqid, "pty": os.ttyname(slave)}),
      flush=True)
sys.stdin.read()
for remove in (lambda: libc.shmctl(shmid, 0, None), lambda: libc.semctl(semid, 0, 0),
               lambda: libc.msgctl(msqid, 0, None)):
    remove()  # IPC_RMID
"""

#: The attack, as a module: run in an episode, and in a plain process for the control.
ATTACK = r"""
import ctypes, errno, json, os, socket, sys

libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
IPC_CREAT = 0o1000


def err(call):
    try:
        call()
        return "done"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


def c_err(result):
    return "done" if result not in (-1, None, ctypes.c_void_p(-1).value) else errno.errorcode[
        ctypes.get_errno()]


def ids(path):
    with open(path) as f:
        return [line.split()[1] for line in f.readlines()[1:]]


def attack(data):
    out = {}
    # System V: the trainer's segment listed, attached, read; its semaphores and queue.
    out["shm listed"] = str(data["shmid"]) in ids("/proc/sysvipc/shm")
    address = libc.shmat(data["shmid"], None, 0)
    out["shm attached"] = c_err(address)
    if out["shm attached"] == "done":
        out["shm read"] = ctypes.string_at(address, len(data["credential"])).decode()
    out["sem listed"] = str(data["semid"]) in ids("/proc/sysvipc/sem")
    out["sem reached"] = c_err(libc.semctl(data["semid"], 0, 12))  # GETVAL
    out["msg listed"] = str(data["msqid"]) in ids("/proc/sysvipc/msg")
    out["msg reached"] = c_err(libc.msgctl(data["msqid"], 2, ctypes.create_string_buffer(256)))
    # What the episode leaves for the next one: a segment, semaphores, a queue by key.
    key = data["leave_key"]
    out["leave shm"] = c_err(libc.shmget(key, 4096, IPC_CREAT | 0o600))
    out["leave sem"] = c_err(libc.semget(key, 1, IPC_CREAT | 0o600))
    out["leave msg"] = c_err(libc.msgget(key, IPC_CREAT | 0o600))
    # The trainer's terminal.
    out["pty"] = err(lambda: os.close(os.open(data["pty"], os.O_RDWR | os.O_NOCTTY)))
    # Devices: the machine's disk by name, one made anew, the names /dev holds.
    out["disk"] = err(lambda: os.close(os.open(data["disk"], os.O_RDONLY)))
    node = os.path.join(data["scratch"], "node-%d" % os.getpid())
    out["mknod"] = err(lambda: os.mknod(node, 0o600 | 0o60000, os.makedev(7, 0)))
    if out["mknod"] == "done":
        os.unlink(node)
    out["dev"] = sorted(os.listdir("/dev"))
    # Raw sockets: every process's loopback traffic.
    out["raw socket"] = err(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0).close())
    # The cgroup tree above the episode, named by the trainer's path to it.
    out["cgroup line"] = open("/proc/self/cgroup").read().splitlines()[-1]
    out["cgroup move"] = err(lambda: open(data["cgroup_procs"], "w").write(str(os.getpid())))
    out["cgroup mkdir"] = err(lambda: os.mkdir(data["cgroup_dir"] + "/made-by-agent"))
    # Namespaces.
    for kind in ("ipc", "uts", "cgroup", "pid", "mnt"):
        out["ns " + kind] = os.readlink("/proc/self/ns/" + kind) != data["ns"][kind]
    out["hostname"] = err(lambda: socket.sethostname("episode-renamed"))
    # The kernel's files that act on the machine, opened for writing (nothing written), and
    # one it masks.
    out["kernel files"] = {
        path: err(lambda path=path: os.close(os.open(path, os.O_WRONLY)))
        for path in data["kernel_files"]
    }
    out["timer list"] = len(open("/proc/timer_list", "rb").read())
    return out


def run(data):
    return 1.0, attack(data)


if __name__ == "__main__":
    print(json.dumps(attack(json.loads(sys.argv[1]))))
"""

#: What a world built for the episode holds in /dev.
EPISODE_DEV = sorted(
    ["fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin"]
    + ["stdout", "tty", "urandom", "zero"]
)


def own_cgroup() -> Path:
    """The trainer's cgroup v2 directory, where the machine has cgroup v2."""
    line = Path("/proc/self/cgroup").read_text().splitlines()[-1]
    path = line.split(":", 2)[2]
    mounts = [m.split() for m in Path("/proc/self/mounts").read_text().splitlines()]
    point = next(m[1] for m in mounts if m[2] == "cgroup2")
    return Path(point + path.rstrip("/"))


def a_disk() -> str:
    """A block device of the machine, by its path under /dev."""
    for name in sorted(os.listdir("/dev")):
        if stat.S_ISBLK(os.stat(f"/dev/{name}", follow_symlinks=False).st_mode):
            return f"/dev/{name}"
    raise AssertionError("this machine has no block device in /dev")


class Standin:
    """A stand-in trainer process with a unique marker in its environment."""

    def __init__(self, argv_prefix: list[str], python: str, env: dict[str, str]) -> None:
        self.marker = f"isolate-standin-{uuid.uuid4().hex}"
        self.credential = f"sk-standin-{uuid.uuid4().hex}"
        self.proc = subprocess.Popen(
            [*argv_prefix, python, "-c", STANDIN, self.credential],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**env, "STANDIN_MARKER": self.marker},
            text=True,
        )
        assert self.proc.stdout is not None
        self.held: dict[str, Any] = json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10 * SLOW)
        self.proc.stdout.close()
        assert episode_processes(f"STANDIN_MARKER={self.marker}".encode()) == []


def attack_data(standin: Standin, scratch: Path, leave_key: int) -> dict[str, Any]:
    cgroup = own_cgroup()
    return {
        **standin.held,
        "credential": standin.credential,
        "leave_key": leave_key,
        "disk": a_disk(),
        "scratch": str(scratch),
        "cgroup_procs": str(cgroup / "cgroup.procs"),
        "cgroup_dir": str(cgroup),
        "ns": {k: os.readlink(f"/proc/self/ns/{k}") for k in NAMESPACES},
        "kernel_files": [p for p in KERNEL_FILES if os.path.exists(p)],
    }


NAMESPACES = ("ipc", "uts", "cgroup", "pid", "mnt")
#: Files of the kernel a root process could change the machine with: a sysctl, the magic
#: SysRq key, a setting in /sys.
KERNEL_FILES = (
    "/proc/sys/kernel/printk_ratelimit",
    "/proc/sysrq-trigger",
    "/sys/kernel/mm/transparent_hugepage/enabled",
)


def host_ipc_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "sem", "msg"):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            keys.add(int(line.split()[0]))
    return keys


def remove_ipc(key: int) -> None:
    """Remove the System V objects of this key from the machine, where there are any."""
    libc = ctypes.CDLL(None, use_errno=True)
    for get, control, args in (
        (libc.shmget, libc.shmctl, (0, 0)),
        (libc.semget, libc.semctl, (0, 0)),
        (libc.msgget, libc.msgctl, (0,)),
    ):
        found = get(key, *args)
        if found >= 0:
            control(found, 0, None)  # IPC_RMID


#: What the attack finds from inside an episode with a PID namespace, at every combination.
REFUSED: dict[str, Any] = {
    "shm listed": False,
    "shm attached": "EINVAL",
    "sem listed": False,
    "sem reached": "EINVAL",
    "msg listed": False,
    "msg reached": "EINVAL",
    "leave shm": "done",  # made, in the episode's own IPC namespace: gone with it
    "leave sem": "done",
    "leave msg": "done",
    "pty": "ENOENT",
    "disk": "ENOENT",
    "mknod": "EPERM",
    "dev": EPISODE_DEV,
    "raw socket": "EPERM",
    "ns ipc": True,
    "ns uts": True,
    "ns pid": True,
    "ns mnt": True,
    "hostname": "EPERM",
}


def refused(found: dict[str, Any], *, forked: bool = False, root: bool = True) -> dict[str, Any]:
    """The findings to compare with REFUSED, with the cgroup's judged apart: a fresh episode's
    cgroup is its cgroup namespace's root; a template's fork in a leaf (``forked``) sits beside
    its template's, outside the namespace's root, where it cannot move from."""
    seen = {k: found[k] for k in REFUSED}
    assert found["cgroup move"] in ("ENOENT", "EROFS"), found
    assert found["cgroup mkdir"] in ("ENOENT", "EROFS"), found
    assert found["ns cgroup"], found
    line = found["cgroup line"]
    assert line.startswith("0::/../") if forked else line == "0::/", found
    # The mount's read-only flag answers root; an unprivileged agent meets the file's mode first.
    assert found["kernel files"], found
    assert set(found["kernel files"].values()) == ({"EROFS"} if root else {"EACCES"}), found
    assert found["timer list"] == 0, found  # masked
    return seen


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="isolate-world-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_same_attack_from_a_plain_process_reaches_everything(scratch: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the control's raw socket and mknod need root")
    standin = Standin([], sys.executable, {"PATH": os.environ["PATH"]})
    try:
        (scratch / "attack.py").write_text(ATTACK)
        key = 0x150_0000 + os.getpid() % 0xFFFF
        data = attack_data(standin, scratch, key)
        done = subprocess.run(
            [sys.executable, str(scratch / "attack.py"), json.dumps(data)],
            capture_output=True,
            text=True,
            timeout=30 * SLOW,
        )
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        assert found["shm listed"]
        assert found["shm read"] == standin.credential
        assert (found["sem listed"], found["sem reached"]) == (True, "done")
        assert (found["msg listed"], found["msg reached"]) == (True, "done")
        assert (found["pty"], found["disk"], found["mknod"]) == ("done", "done", "done")
        assert found["raw socket"] == "done"
        assert set(EPISODE_DEV) - {"mqueue"} < set(found["dev"])
        assert not any(found["ns " + k] for k in NAMESPACES)
        assert found["cgroup mkdir"] == "done"
        assert set(found["kernel files"].values()) == {"done"}, found
        assert found["timer list"] > 0
        assert key in host_ipc_keys()  # the control's leftovers are the machine's
    finally:
        made = own_cgroup() / "made-by-agent"
        if made.exists():
            made.rmdir()
        remove_ipc(key)
        standin.close()


@both_starts
@pytest.mark.parametrize("containment", [c for c in COMBINATIONS if "pidns" in c])
async def test_an_episode_reaches_none_of_the_trainers_objects(
    agents: Any, scratch: Path, containment: str
) -> None:
    needs(containment)
    standin = Standin([], sys.executable, {"PATH": os.environ["PATH"]})
    key = 0x151_0000 + os.getpid() % 0xFFFF
    try:
        spec = agents.spec(ATTACK, containment=containment, cwd=scratch)
        outcome = await isolate.run_episode(spec, attack_data(standin, scratch, key))
        assert outcome.status == "ok", outcome.summary()
        assert outcome.containment == containment
        found = outcome.info
        assert "shm read" not in found
        forked = agents.preload and "cgroup" in containment
        assert refused(found, forked=forked) == REFUSED
        assert key not in host_ipc_keys()  # what the episode made went with its namespace
        assert agents.left() == []
    finally:
        remove_ipc(key)  # should the episode have made them on the machine
        standin.close()


def nobody_root(scratch: Path, module: str, code: str) -> Path:
    """An agent root with ``module`` holding ``code``, and a PID_DIR beside it, that the
    unprivileged user may use: ``scratch/work``."""
    work = scratch / "work"
    for sub in ("agent_root", "pids"):
        (work / sub).mkdir(parents=True)
    (work / "agent_root" / f"{module}.py").write_text(code)
    for path in (work, *work.iterdir(), *(work / "agent_root").iterdir()):
        path.chmod(0o777)
    return work


def run_as(
    prefix: list[str], nobody: tuple[str, dict[str, str]], spec: isolate.EpisodeSpec, data: Any
) -> dict[str, Any]:
    """One episode of ``spec`` run by a trainer started with ``prefix`` (as nobody), ``ok``;
    its outcome as JSON, once no process of it is left."""
    python, env = nobody
    done = subprocess.run(
        [*prefix, python, "-c", RUN_SPEC, spec.model_dump_json(), json.dumps(data)],
        capture_output=True,
        text=True,
        env={"HOME": str(spec.cwd), **env},
        cwd=spec.cwd,
        timeout=120 * SLOW,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    assert outcome["status"] == "ok", (outcome["error"], outcome["stderr_tail"][-2000:])
    assert episode_processes(f"PID_DIR={spec.env['PID_DIR']}".encode()) == []
    return outcome


def nobody_spec(
    work: Path, entrypoint: str, python: str, cwd: Path, **fields: Any
) -> isolate.EpisodeSpec:
    return isolate.EpisodeSpec(
        agent_root=work / "agent_root",
        entrypoint=entrypoint,
        python=python,
        timeout=60.0,
        kill_grace=1.0,
        cwd=cwd,
        env={"PID_DIR": str(work / "pids")},
        **fields,
    )


def test_an_unprivileged_trainers_episode_reaches_none_of_its_objects(
    scratch: Path, nobody: tuple[str, dict[str, str]]
) -> None:
    work = nobody_root(scratch, "attack", ATTACK)
    standin = Standin(AS_NOBODY, *nobody)
    key = 0x152_0000 + os.getpid() % 0xFFFF
    try:
        spec = nobody_spec(work, "attack:run", nobody[0], scratch, containment="pidns")
        found = run_as(AS_NOBODY, nobody, spec, attack_data(standin, scratch, key))["info"]
        assert "shm read" not in found
        assert refused(found, root=False) == REFUSED
        assert key not in host_ipc_keys()
    finally:
        remove_ipc(key)
        standin.close()


def test_an_episode_cannot_leave_for_its_unprivileged_trainers_delegated_cgroup(
    scratch: Path, nobody: tuple[str, dict[str, str]]
) -> None:
    # The trainer runs as nobody in a cgroup delegated to it (its cgroup.procs is nobody's):
    # without a cgroup namespace, any process of nobody's below it may move itself up there,
    # out of its episode's leaf and its limits, and outlive the episode.
    needs("cgroup")
    delegated = own_cgroup() / f"isolate-test-delegated-{uuid.uuid4().hex[:12]}"
    delegated.mkdir()
    # Into the delegated cgroup as root, then as nobody from there.
    enter = ["sh", "-c", ENTER, str(delegated), *AS_NOBODY]
    try:
        for path in (delegated, *(delegated / n for n in DELEGATED_FILES)):
            os.chown(path, NOBODY, NOBODY)
        # The control: a process of nobody's in a cgroup below moves itself up.
        control = subprocess.run(
            [*enter, "sh", "-c", CONTROL_MOVE, "-"],
            capture_output=True,
            text=True,
            timeout=30 * SLOW,
        )
        assert control.stdout.split() == ["moved"], control.stderr
        work = nobody_root(scratch, "attack", ATTACK)
        standin = Standin([], sys.executable, {"PATH": os.environ["PATH"]})
        key = 0x153_0000 + os.getpid() % 0xFFFF
        try:
            data = {
                **attack_data(standin, scratch, key),
                "cgroup_procs": str(delegated / "cgroup.procs"),
                "cgroup_dir": str(delegated),
            }
            spec = nobody_spec(work, "attack:run", nobody[0], work, containment="cgroup+pidns")
            outcome = run_as(enter, nobody, spec, data)
            assert outcome["containment"] == "cgroup+pidns"
            assert refused(outcome["info"], root=False) == REFUSED
            assert (delegated / "cgroup.procs").read_text() == ""  # nothing moved up
        finally:
            remove_ipc(key)
            standin.close()
    finally:
        below = [p for p in delegated.rglob("*") if p.is_dir()]
        for leaf in sorted(below, key=lambda p: -len(p.parts)):
            leaf.rmdir()
        delegated.rmdir()


#: The files of a cgroup that delegating it hands over (cgroup v2's delegation).
DELEGATED_FILES = ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control")
#: As root: move into the cgroup named by $0, then exec the rest (which drops to nobody).
ENTER = 'echo $$ > "$0/cgroup.procs" && export DELEGATED="$0" && exec "$@"'
#: As nobody, in the delegated cgroup: make a cgroup below, move in, then move back up.
CONTROL_MOVE = """
mkdir "$DELEGATED/below" && echo $$ > "$DELEGATED/below/cgroup.procs" &&
echo $$ > "$DELEGATED/cgroup.procs" && echo moved
"""


# --- under Sandbox(): a view, not a veto ---------------------------------------------------------

#: What an agent under Sandbox() tries on a trainer file it may read but not write, and on the
#: trainer's terminal; and what it must still do in its working directory.
VIEW_ATTACK = r"""
import errno, os, subprocess, tempfile


def err(call):
    try:
        call()
        return "done"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


def attack(data):
    target, folder = data["target"], os.path.dirname(data["target"])
    out = {
        "chmod": err(lambda: os.chmod(target, 0o4777)),
        "chmod folder": err(lambda: os.chmod(folder, 0o777)),
        "chown": err(lambda: os.chown(target, 65534, 65534)),
        "utime": err(lambda: os.utime(target, (0, 0))),
        "setxattr": err(lambda: os.setxattr(target, "user.isolate", b"1")),
        "pty": err(lambda: os.close(os.open(data["pty"], os.O_RDWR | os.O_NOCTTY))),
        "mknod": err(lambda: os.mknod("node", 0o600 | 0o20000, os.makedev(1, 3))),
    }
    # An agent's work: files, modes and a repository in its working directory, a temporary file.
    out["work"] = [
        err(lambda: open("made.txt", "w").write("x")),
        err(lambda: os.chmod("made.txt", 0o600)),
        err(lambda: os.utime("made.txt", (0, 0))),
        err(lambda: tempfile.NamedTemporaryFile().close()),
        subprocess.run(["git", "init", "-q", "repo"], capture_output=True).returncode,
    ]
    return out


def run(data):
    return 1.0, attack(data)


if __name__ == "__main__":
    import json, sys

    print(json.dumps(attack(json.loads(sys.argv[1]))))
"""

#: What the view leaves the agent: EROFS on what it may not write, its own work done.
VIEW_REFUSED = {
    "chmod": "EROFS",
    "chmod folder": "EROFS",
    "chown": "EROFS",
    "utime": "EROFS",
    "setxattr": "EROFS",
    "pty": "ENOENT",
    "mknod": "EPERM",
    "work": ["done", "done", "done", "done", 0],
}


@pytest.fixture
def trainer_file(scratch: Path) -> Path:
    """A file of the trainer's, outside every writable path, that the agent may read."""
    folder = scratch / "trainer"
    folder.mkdir()
    folder.chmod(0o755)
    target = folder / "config.yaml"
    target.write_text("model: x\n")
    target.chmod(0o644)
    return target


def metadata(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns


def test_a_plain_process_changes_the_trainers_metadata(scratch: Path, trainer_file: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the control's chown needs root")
    standin = Standin([], sys.executable, {"PATH": os.environ["PATH"]})
    work = scratch / "work"
    work.mkdir()
    try:
        (scratch / "view_attack.py").write_text(VIEW_ATTACK)
        data = {"target": str(trainer_file), "pty": standin.held["pty"]}
        done = subprocess.run(
            [sys.executable, str(scratch / "view_attack.py"), json.dumps(data)],
            capture_output=True,
            text=True,
            cwd=work,
            timeout=30 * SLOW,
        )
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        for name in ("chmod", "chmod folder", "chown", "utime", "pty", "mknod"):
            assert found[name] == "done", (name, found)
        assert found["setxattr"] in ("done", "ENOTSUP")  # tmpfs without user xattrs
        assert found["work"] == VIEW_REFUSED["work"]
        changed = os.stat(trainer_file)  # the chown after the chmod cleared its set-uid bit
        assert (stat.S_IMODE(changed.st_mode), changed.st_uid) == (0o777, NOBODY)
    finally:
        standin.close()


@both_starts
@pytest.mark.parametrize("containment", COMBINATIONS)
async def test_under_the_sandbox_the_trainers_files_are_a_read_only_view(
    agents: Any, scratch: Path, trainer_file: Path, containment: str
) -> None:
    needs(containment)
    standin = Standin([], sys.executable, {"PATH": os.environ["PATH"]})
    work = scratch / "work"
    work.mkdir()
    before = metadata(trainer_file), metadata(trainer_file.parent)
    try:
        spec = agents.spec(
            VIEW_ATTACK, containment=containment, cwd=work, sandbox=isolate.Sandbox()
        )
        data = {"target": str(trainer_file), "pty": standin.held["pty"]}
        outcome = await isolate.run_episode(spec, data)
        assert outcome.status == "ok", outcome.summary()
        assert outcome.info == VIEW_REFUSED
        assert (metadata(trainer_file), metadata(trainer_file.parent)) == before
        assert (work / "made.txt").read_text() == "x"
        assert agents.left() == []
    finally:
        standin.close()


def test_an_unprivileged_trainers_sandbox_is_a_read_only_view(
    scratch: Path, trainer_file: Path, nobody: tuple[str, dict[str, str]]
) -> None:
    # The trainer's own file and folder: nobody may chmod them, as their owner.
    os.chown(trainer_file, NOBODY, NOBODY)
    os.chown(trainer_file.parent, NOBODY, NOBODY)
    work = nobody_root(scratch, "view_attack", VIEW_ATTACK)
    (work / "cwd").mkdir()
    os.chown(work / "cwd", NOBODY, NOBODY)
    standin = Standin(AS_NOBODY, *nobody)
    before = metadata(trainer_file), metadata(trainer_file.parent)
    try:
        data = {"target": str(trainer_file), "pty": standin.held["pty"]}
        spec = nobody_spec(
            work, "view_attack:run", nobody[0], work / "cwd", sandbox=isolate.Sandbox()
        )
        info = run_as(AS_NOBODY, nobody, spec, data)["info"]
        # chown to another user is EPERM before the mount is looked at, for an unprivileged one.
        assert info == {**VIEW_REFUSED, "chown": info["chown"]}
        assert info["chown"] in ("EROFS", "EPERM")
        assert (metadata(trainer_file), metadata(trainer_file.parent)) == before
    finally:
        standin.close()


@pytest.mark.parametrize("containment", ["cgroup+pidns", "pidns", "cgroup", "landlock"])
def test_doctor_says_what_the_combination_builds(containment: str) -> None:
    needs(containment)
    proc = isolate_cli("doctor", "--agent-root", str(SCRIPTED), "--containment", containment)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    world = f"ok    at {containment} the episode's world is built for it: PID, mount, IPC, UTS"
    assert (world in proc.stdout) is ("pidns" in containment), proc.stdout
    if os.geteuid() == 0:
        sysrq = "reboot the machine through /proc/sysrq-trigger"
        assert (sysrq in proc.stdout) is ("pidns" not in containment), proc.stdout


# --- a sibling's traffic on loopback -------------------------------------------------------------

#: Calls the server with its key until told to stop.
CALLER = """
import os, time, urllib.request
def run(data):
    calls = 0
    while not os.path.exists(data["stop"]):
        headers = {"Authorization": "Bearer " + data["key"]}
        urllib.request.urlopen(urllib.request.Request(data["url"], headers=headers)).read()
        calls += 1
        time.sleep(0.01)
    return 1.0, calls
"""

#: Listens on loopback for a while, by every raw means, for the sibling's key.
SNIFFER = r"""
import errno, os, socket, time
def run(data):
    found = {}
    for name, family, kind, proto in (
        ("packet", socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)),  # ETH_P_ALL
        ("raw tcp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP),
    ):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            found[name] = errno.errorcode[exc.errno]
            continue
        sock.settimeout(0.1)
        seen, end = b"", time.monotonic() + 2
        while time.monotonic() < end and data["key"].encode() not in seen:
            try:
                seen += sock.recv(65536)
            except socket.timeout:
                pass
        found[name] = "read the key" if data["key"].encode() in seen else "nothing"
        sock.close()
    open(data["stop"], "w").close()
    return 1.0, found
"""


@pytest.mark.parametrize("containment", ["auto", "landlock"])
async def test_a_sibling_episode_cannot_read_anothers_key_on_loopback(
    agents: Any, scratch: Path, containment: str
) -> None:
    if containment != "auto":
        needs(containment)
    key = f"sk-sibling-{uuid.uuid4().hex}"
    heard: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            heard.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stop = scratch / "stop"
    data = {"key": key, "url": f"http://127.0.0.1:{server.server_port}/", "stop": str(stop)}
    outcomes: dict[str, isolate.EpisodeOutcome] = {}
    try:
        caller = agents.spec(CALLER, containment=containment)
        sniffer = agents.spec(SNIFFER, containment=containment)

        async def one(name: str, spec: isolate.EpisodeSpec) -> None:
            outcomes[name] = await isolate.run_episode(spec, data)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "caller", caller)
            await anyio.to_thread.run_sync(wait_for, lambda: heard, 20.0 * SLOW, "a call")
            tg.start_soon(one, "sniffer", sniffer)
    finally:
        stop.touch()
        server.shutdown()
        server.server_close()
    assert outcomes["caller"].status == "ok", outcomes["caller"].summary()
    assert heard[0] == f"Bearer {key}"  # the key was on loopback the while
    assert outcomes["sniffer"].status == "ok", outcomes["sniffer"].summary()
    assert outcomes["sniffer"].info == {"packet": "EPERM", "raw tcp": "EPERM"}
    assert agents.left() == []
