"""Promise: an episode reaches none of the trainer's kernel objects. Attacks from inside an
episode on each object it could share with a stand-in trainer that holds a credential in each,
with a control that runs the same attack from a plain process and reaches it; as root at each
combination with a PID namespace, and as an unprivileged trainer (``nobody``, in a user
namespace). Which layer answers:

- System V shared memory, semaphores, message queues; POSIX message queues: the IPC namespace
  (the trainer's ids are ``EINVAL``, nothing is listed).
- ``/dev/shm``: a tmpfs of the episode's own (``test_dev_shm_is_private_to_the_episode``).
- terminals, device nodes: a ``/dev`` of six nodes and a devpts of its own; ``mknod`` refused
  (no ``MKNOD``).
- raw and packet sockets: no ``NET_RAW``.
- the cgroup tree: a cgroup namespace rooted at the leaf and a read-only view; a move out is
  refused, also into an unprivileged trainer's delegated cgroup.
- ``/proc/sys``, ``/sys``: read-only. Host and domain name: a UTS namespace, and no
  ``SYS_ADMIN``."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

import isolate

from ..conftest import AS_NOBODY, NOBODY, SLOW, Agents, both_starts, wait_until
from ..teardown._trees import COMBINATIONS, needs, tree
from ._attacks import WALLED, Standin, nobody_root, nobody_spec, run_as, scratch, x86_64_linux

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces are Linux's"),
]
__all__ = ["scratch"]  # a fixture, used by name


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


SHM_WRITER = """
import os, time
def run(data):
    path = "/dev/shm/" + data["name"]
    with open(path, "w") as f:
        f.write("episode data")
    seen = os.path.exists(path)
    open(os.path.join(os.environ["PID_DIR"], "written"), "w").close()
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "release")):
        time.sleep(0.01)
    return 1.0, {"own file": "visible" if seen else "absent"}
"""


SHM_SIBLING = """
import os, time
def run(data):
    while not os.path.exists(os.path.join(os.environ["PID_DIR"], "written")):
        time.sleep(0.01)
    seen = os.path.exists("/dev/shm/" + data["name"])
    open(os.path.join(os.environ["PID_DIR"], "checked"), "w").close()
    return 1.0, {"sibling": "visible" if seen else "absent"}
"""


@x86_64_linux
@pytest.mark.parametrize("combination", WALLED)
async def test_dev_shm_is_private_to_the_episode(agents: Agents, combination: str) -> None:
    needs(combination)
    name = f"isolate-hostile-{secrets.token_hex(6)}"
    host_path = Path("/dev/shm") / name
    writer = agents.spec(SHM_WRITER, containment=combination)
    sibling = agents.spec(SHM_SIBLING, containment=combination)
    outcomes: dict[str, isolate.EpisodeOutcome] = {}
    seen: dict[str, str] = {}

    async def one(key: str, spec: isolate.EpisodeSpec) -> None:
        outcomes[key] = await isolate.run_episode(spec, {"name": name})

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "writer", writer)
            tg.start_soon(one, "sibling", sibling)
            await wait_until((agents.pids / "written").exists, 20.0)
            seen["host while running"] = "visible" if host_path.exists() else "absent"
            await wait_until((agents.pids / "checked").exists, 20.0)
            (agents.pids / "release").touch()
        seen["host after"] = "visible" if host_path.exists() else "absent"
    finally:
        host_path.unlink(missing_ok=True)
    for outcome in outcomes.values():
        assert outcome.status == "ok", outcome.summary()
    seen.update(outcomes["writer"].info)
    seen.update(outcomes["sibling"].info)
    assert seen == {
        "own file": "visible",
        "sibling": "absent",
        "host while running": "absent",
        "host after": "absent",
    }
    assert tree(agents) == []
