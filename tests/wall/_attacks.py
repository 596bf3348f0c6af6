"""What the files of ``tests/wall`` share: the hostile agent (attacks on mounts, namespaces,
the supervisor's memory and fds, capabilities) and what it must find at each combination, the
red team's world (a fake home with secrets, a checkout, a neighbour), a stand-in trainer,
runs as an unprivileged trainer, and the fixtures ``combination``, ``standin``, ``world`` and
``scratch``, which a test file imports and names in its ``__all__``."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import isolate

from .. import _internals
from ..conftest import (
    NOBODY,
    RUN_SPEC,
    SLOW,
    Agents,
    as_nobody,
    episode_processes,
    unprivileged_python,
)
from ..teardown._trees import COMBINATIONS, needs

CAP_NAMES = [
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
]  # fmt: skip


#: All a root agent may keep in the machine's network namespace: Docker's default set less
#: NET_RAW, MKNOD, SETFCAP and NET_BIND_SERVICE (bits 0, 1, 3-7, 18, 29).
KEPT_CAPS = sorted("CAP_" + CAP_NAMES[bit] for bit in (0, 1, 3, 4, 5, 6, 7, 18, 29))


def cap_names(mask_hex: str) -> list[str]:
    mask = int(mask_hex, 16)
    return sorted(
        "CAP_" + (CAP_NAMES[bit] if bit < len(CAP_NAMES) else str(bit))
        for bit in range(64)
        if mask >> bit & 1
    )


# The hostile agent. It returns 0.25: any other reward in the outcome was forged.
HOSTILE = r'''
import ctypes, errno, json, os, signal, subprocess, sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]

AT_FDCWD, OPEN_TREE_CLONE, O_CLOEXEC, MNT_DETACH = -100, 1, 0o2000000, 2
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
NR = dict(
    pivot_root=155, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
    fspick=433, mount_setattr=442, pidfd_getfd=438, process_vm_readv=310,
    process_vm_writev=311, kexec_load=246, kexec_file_load=320, init_module=175,
    delete_module=176, finit_module=313, bpf=321, keyctl=250, add_key=248, request_key=249,
    userfaultfd=323, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
    perf_event_open=298, setns=308, unshare=272, clone=56, clone3=435,
)
NAMESPACES = dict(
    user=0x10000000, mnt=0x20000, net=0x40000000, pid=0x20000000, uts=0x04000000,
    ipc=0x08000000, cgroup=0x02000000, time=0x80,
)


class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def name(code):
    return errno.errorcode.get(code, str(code))


def attempt(fn):
    try:
        return fn()
    except OSError as exc:
        return name(exc.errno)


def sc(nr, *args):
    """A raw system call: (result, errno)."""
    conv = []
    for a in args:
        if a is None:
            conv.append(ctypes.c_void_p(None))
        elif isinstance(a, bytes):
            conv.append(ctypes.c_char_p(a))
        elif isinstance(a, int):
            conv.append(ctypes.c_long(a))
        else:
            conv.append(a)
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(nr), *conv)
    return result, ctypes.get_errno()


def word(nr, *args, fd=False):
    """'ok' if the call went through (an fd it returns is closed), else the errno name."""
    result, code = sc(NR[nr] if isinstance(nr, str) else nr, *args)
    if result < 0:
        return name(code)
    if fd:
        os.close(result)
    return "ok"


def in_child(fn):
    """Run fn in a forked child (namespace changes stay there); its word."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            out = str(fn())
        except BaseException as exc:
            out = "raised %r" % (exc,)
        os.write(w, out.encode()[:500])
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def binary(argv):
    """Run a tool: 'done', 'EPERM' for its ways of saying so, else its exit and message."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        return "not installed"
    if done.returncode == 0:
        return "done"
    text = done.stderr.strip()
    refusals = ("Operation not permitted", "permission denied", "must be superuser")
    if any(r in text for r in refusals):
        return "EPERM"
    return "exit %d: %s" % (done.returncode, text.splitlines()[0] if text else "")


def caps(text):
    return {
        line.split(":")[0]: line.split()[1]
        for line in text.splitlines()
        if line.startswith("Cap")
    }


# --- the process table ---------------------------------------------------------------------

def ppid_of(pid):
    with open("/proc/%d/stat" % pid, "rb") as f:
        stat = f.read()
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def trainer_seen(trainer):
    return os.path.exists("/proc/%d" % trainer)


def remount_proc():
    libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


# --- mounts ----------------------------------------------------------------------------------

def mount_attacks(scratch, private, trainer, binaries):
    found, seen_after = {}, []
    target = b"/proc" if private else scratch.encode()
    clone = OPEN_TREE_CLONE | O_CLOEXEC
    found["open_tree /proc"] = word("open_tree", AT_FDCWD, b"/proc", clone, fd=True)
    found["open_tree cwd"] = word("open_tree", AT_FDCWD, b".", clone, fd=True)

    ctypes.set_errno(0)
    if libc.mount(b"none", target, b"tmpfs", 0, None) == 0:
        found["mount tmpfs"] = "ok"
        if private and trainer_seen(trainer):
            seen_after.append("mount tmpfs")
        libc.umount2(target, MNT_DETACH)
    else:
        found["mount tmpfs"] = name(ctypes.get_errno())

    if binaries:
        found["mount -t tmpfs"] = binary(["mount", "-t", "tmpfs", "none", target.decode()])
        if found["mount -t tmpfs"] == "done":
            libc.umount2(target, MNT_DETACH)

    # In the host's mount namespace the scratch directory is no mount point: a umount the
    # wall lets through fails there with EINVAL, and nothing is unmounted.
    ctypes.set_errno(0)
    if libc.umount2(target, MNT_DETACH if private else 0) == 0:
        found["umount2"] = "ok"
        if private and trainer_seen(trainer):
            seen_after.append("umount2")
        remount_proc()
    else:
        found["umount2"] = name(ctypes.get_errno())

    if private:
        if binaries:  # umount(8) looks for the mount first: only where there is one
            found["umount -l"] = binary(["umount", "-l", "/proc"])
            if found["umount -l"] == "done":
                if trainer_seen(trainer):
                    seen_after.append("umount -l")
                remount_proc()
        found["trainer seen in /proc after"] = seen_after
    return found


# --- system calls the seccomp filter refuses ------------------------------------------------

def raw_clone(flags):
    """clone(2) with namespace flags, in a forked child: 'ok' if a child came out."""
    result, code = sc(NR["clone"], flags | signal.SIGCHLD, 0, 0, 0, 0)
    if result == 0:
        os._exit(0)
    if result < 0:
        return name(code)
    os.waitpid(result, 0)
    return "ok"


def syscall_probes(scratch):
    """Each call with arguments that do nothing harmful where it is let through: then it
    says 'ok' or the errno of its bad arguments, not EPERM."""
    s = scratch.encode()
    buf = ctypes.create_string_buffer(b"x" * 16)
    other = ctypes.create_string_buffer(16)
    here = iovec(ctypes.addressof(other), 16)
    there = iovec(ctypes.addressof(buf), 16)
    me = os.pidfd_open(os.getpid())
    uts = os.open("/proc/self/ns/uts", os.O_RDONLY)
    params = ctypes.create_string_buffer(120)
    try:
        found = {
            "pivot_root": word("pivot_root", s, s),
            "move_mount": word("move_mount", -1, b"", -1, b"", 0),
            "fsopen": word("fsopen", b"tmpfs", 1, fd=True),
            "fsconfig": word("fsconfig", -1, 6, None, None, 0),
            "fsmount": word("fsmount", -1, 0, 0, fd=True),
            "fspick": word("fspick", AT_FDCWD, b"/proc", 1, fd=True),
            "mount_setattr": word("mount_setattr", -1, b"", 0, None, 0),
            "pidfd_getfd": word("pidfd_getfd", me, 0, 0, fd=True),
            "process_vm_readv": word(
                "process_vm_readv", os.getpid(), ctypes.byref(here), 1, ctypes.byref(there), 1, 0
            ),
            "process_vm_writev": word(
                "process_vm_writev", os.getpid(), ctypes.byref(there), 1, ctypes.byref(here), 1, 0
            ),
            "kexec_load": word("kexec_load", 0, 0xFFFFFFFF, None, 0),
            "kexec_file_load": word("kexec_file_load", -1, -1, 0, None, 0),
            "init_module": word("init_module", None, 0, b""),
            "finit_module": word("finit_module", -1, b"", 0),
            "delete_module": word("delete_module", b"isolate_no_such_module", os.O_NONBLOCK),
            "bpf": word("bpf", 0x7FFFFFFF, None, 0),
            "keyctl": word("keyctl", 0, -3, 0),
            "add_key": word("add_key", b"isolate-no-such-type", b"x", None, 0, -2),
            "request_key": word("request_key", b"isolate-no-such-type", b"x", None, 0),
            "userfaultfd": word("userfaultfd", O_CLOEXEC, fd=True),
            "io_uring_setup": word("io_uring_setup", 1, params, fd=True),
            "io_uring_enter": word("io_uring_enter", -1, 0, 0, 0, None, 0),
            "io_uring_register": word("io_uring_register", -1, 0, None, 0),
            "perf_event_open": word("perf_event_open", None, 0, -1, -1, 0, fd=True),
            "setns": word("setns", uts, NAMESPACES["uts"]),
            "clone3": word("clone3", None, 0),
        }
    finally:
        os.close(me)
        os.close(uts)
    for ns, flag in sorted(NAMESPACES.items()):
        found["unshare " + ns] = in_child(lambda flag=flag: word("unshare", flag))
        if ns != "time":  # clone(2) has no room for CLONE_NEWTIME: it is the exit signal's
            found["clone " + ns] = in_child(lambda flag=flag: raw_clone(flag))
    return found


# --- the supervisor --------------------------------------------------------------------------

def ptrace(pid):
    if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
        return name(ctypes.get_errno())
    os.waitpid(pid, 0)
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    return "attached"


def shared_address():
    """An address mapped alike in the supervisor (the worker is its fork): libc's code."""
    return ctypes.cast(libc.getpid, ctypes.c_void_p).value


def read_mem(pid, address):
    with open("/proc/%d/mem" % pid, "rb", buffering=0) as mem:
        mem.seek(address)
        return "read %d bytes" % len(mem.read(16))


def write_mem(pid, address):
    with open("/proc/%d/mem" % pid, "r+b", buffering=0) as mem:
        mem.seek(address)
        same = mem.read(16)
        mem.seek(address)
        return "wrote %d bytes" % mem.write(same)  # what was there: the attack, no harm


def vm_read(pid, address):
    local = ctypes.create_string_buffer(16)
    here, there = iovec(ctypes.addressof(local), 16), iovec(address, 16)
    result, code = sc(NR["process_vm_readv"], pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
    return name(code) if result < 0 else "read %d bytes" % result


def take_fds(pid, use=None):
    """pidfd_getfd of fds 0-10 of pid, each fd taken handed to ``use`` first: the set of
    what happened."""
    words = set()
    pidfd = attempt(lambda: os.pidfd_open(pid))
    if isinstance(pidfd, str):
        return ["pidfd_open " + pidfd]
    for target in range(11):
        result, code = sc(NR["pidfd_getfd"], pidfd, target, 0)
        if result >= 0:
            words.add("took an fd")
            if use is not None:
                use(result)
            os.close(result)
        elif code != errno.EBADF:  # no such fd in the target
            words.add(name(code))
    os.close(pidfd)
    return sorted(words)


def supervisor_attacks(supervisor):
    address = shared_address()
    return {
        "supervisor ptrace": ptrace(supervisor),
        "supervisor mem read": attempt(lambda: read_mem(supervisor, address)),
        "supervisor mem write": attempt(lambda: write_mem(supervisor, address)),
        "supervisor process_vm_readv": vm_read(supervisor, address),
        "supervisor pidfd_getfd": take_fds(supervisor),
    }


# --- an exec'd child of the agent (a bash step) ---------------------------------------------

CHILD = """
import ctypes, errno, json, os, sys
exec(sys.argv[1])  # the helpers above
worker, address, nonce = os.getppid(), int(sys.argv[2]), sys.argv[3]
supervisor = ppid_of(worker)
forged = json.dumps({"t": "result", "nonce": nonce, "reward": 0.99, "info": {"forged": 1}})
written = 0

def write_forged(fd):
    global written
    try:
        os.write(fd, (forged + "\\n").encode())
        written += 1
    except OSError:
        pass

def forge(pid):
    return take_fds(pid, write_forged)

found = {
    "child pidfd_getfd worker": forge(worker),
    "child pidfd_getfd supervisor": forge(supervisor),
    "child process_vm_readv worker": vm_read(worker, address),
    "child mem worker": attempt(lambda: read_mem(worker, address)),
}
found["child forged frames written"] = written
print(json.dumps(found))
"""


def find_nonce():
    """The nonce, as an agent that knows the shim finds it: in its caller's frames."""
    frame = sys._getframe(1)
    while frame is not None:
        channel = frame.f_locals.get("channel")
        if getattr(channel, "nonce", None):
            return channel.nonce
        frame = frame.f_back
    return "not-found"


def child_attacks():
    secret = ctypes.create_string_buffer(b"worker-only-data", 16)
    helpers = HELPERS
    done = subprocess.run(
        [sys.executable, "-c", CHILD, helpers, str(ctypes.addressof(secret)), find_nonce()],
        capture_output=True, text=True, timeout=60,
    )
    if done.returncode != 0:
        return {"child": "exit %d: %s" % (done.returncode, done.stderr[-500:])}
    return json.loads(done.stdout)


# --- the agent -------------------------------------------------------------------------------

def run(data):
    trainer, binaries = data["trainer"], data["binaries"]
    with open("/proc/self/status") as f:
        status = f.read()
    found = {"caps": caps(status)}
    shown = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True)
    found["child caps"] = caps(shown.stdout)
    found["dumpable"] = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
    private = os.stat("/proc/self/ns/mnt").st_ino != data["host_mnt"]
    found["own mount namespace"] = private
    found.update(mount_attacks(data["scratch"], private, trainer, binaries))
    for flag in ("-U", "-m", "-n"):
        found["unshare %s true" % flag] = binary(["unshare", flag, "true"])
    found["syscalls"] = syscall_probes(data["scratch"])
    supervisor = os.getppid()
    found["supervisor"] = supervisor
    found.update(supervisor_attacks(supervisor))
    found.update(child_attacks())
    # What the agent sees of the machine, after every attack above.
    found["trainer in /proc"] = trainer_seen(trainer)
    found["kill trainer"] = attempt(lambda: os.kill(trainer, 0) or "sent")
    found["supervisor's parent"] = attempt(lambda: ppid_of(supervisor))
    found["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    return 0.25, found
'''


# The child attacker runs the same helpers: everything above "# --- an exec'd child".
_HELPERS = HOSTILE.split("# --- an exec'd child")[0]


HOSTILE = HOSTILE.replace("    helpers = HELPERS\n", f"    helpers = {_HELPERS!r}\n")


def expected_findings(combination: str, *, root: bool) -> dict[str, Any]:
    """What each attack gives at ``combination`` once the wall holds: refused, every one."""
    eperm = "EPERM"
    syscalls = {
        name: eperm
        for name in (
            "pivot_root", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
            "mount_setattr", "pidfd_getfd", "process_vm_readv", "process_vm_writev",
            "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
            "bpf", "keyctl", "add_key", "request_key", "userfaultfd", "io_uring_setup",
            "io_uring_enter", "io_uring_register", "perf_event_open", "setns",
        )
    }  # fmt: skip
    syscalls["clone3"] = "ENOSYS"
    for ns in ("cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts"):
        syscalls["unshare " + ns] = eperm
        if ns != "time":
            syscalls["clone " + ns] = eperm
    expected: dict[str, Any] = {
        "dumpable": 0,
        "open_tree /proc": eperm,
        "open_tree cwd": eperm,
        "mount tmpfs": eperm,
        "umount2": eperm,
        "unshare -U true": eperm,
        "unshare -m true": eperm,
        "unshare -n true": eperm,
        "syscalls": syscalls,
        "supervisor ptrace": eperm,
        "supervisor mem read": "EACCES",
        "supervisor mem write": "EACCES",
        "supervisor process_vm_readv": eperm,
        "supervisor pidfd_getfd": [eperm],
        "child pidfd_getfd worker": [eperm],
        "child pidfd_getfd supervisor": [eperm],
        "child process_vm_readv worker": eperm,
        "child mem worker": "EACCES",
        "child forged frames written": 0,
    }
    walled = "pidns" in _internals.layers(combination)
    if root:
        expected["mount -t tmpfs"] = eperm
        if walled:
            expected["umount -l"] = eperm
    if walled:
        expected.update(
            {
                "own mount namespace": True,
                "trainer seen in /proc after": [],
                "trainer in /proc": False,
                "kill trainer": "ESRCH",
                "supervisor": 1,  # PID 1 of the namespace
                "supervisor's parent": 0,  # the trainer (or a relay) is outside: not even a number
            }
        )
    return expected


def cap_findings(found: dict[str, Any], *, root: bool) -> dict[str, Any]:
    """The capability sets of the agent and of a process it exec'd, by name."""
    out: dict[str, Any] = {}
    for who in ("caps", "child caps"):
        sets = found[who]
        for name in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
            out[f"{who} {name}"] = cap_names(sets[name])
        inh = cap_names(sets["CapInh"])
        if root:
            out[f"{who} CapInh beyond the kept set"] = [c for c in inh if c not in KEPT_CAPS]
        else:
            out[f"{who} CapInh"] = inh
    return out


def expected_caps(*, root: bool, found: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for who in ("caps", "child caps"):
        if root:
            for name in ("CapEff", "CapPrm", "CapBnd"):
                out[f"{who} {name}"] = KEPT_CAPS
            out[f"{who} CapAmb"] = []
            out[f"{who} CapInh beyond the kept set"] = []
        else:
            for name in ("CapEff", "CapPrm", "CapAmb", "CapInh"):
                out[f"{who} {name}"] = []
            # The bounding set may stay as the kernel gives it, without what reaches out.
            bounding = cap_names(found[who]["CapBnd"])
            out[f"{who} CapBnd"] = [
                c for c in bounding if c not in ("CAP_SYS_ADMIN", "CAP_SYS_PTRACE")
            ]
    return out


def compare(found: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """The part of ``found`` that ``expected`` speaks of (missing keys: 'missing')."""
    return {key: found.get(key, "missing") for key in expected}


@pytest.fixture
def standin() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in trainer with a unique marker (the real trainer is the test runner: never the
    target)."""
    marker = f"hostilestandin{secrets.token_hex(6)}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", marker],
        env={"PATH": os.environ["PATH"]},
    )
    yield proc
    proc.kill()
    proc.wait()


def host_mnt() -> int:
    return os.stat("/proc/self/ns/mnt").st_ino


@pytest.fixture(params=COMBINATIONS)
def combination(request: pytest.FixtureRequest) -> str:
    return needs(request.param)


WALLED = [c for c in COMBINATIONS if "pidns" in _internals.layers(c)]


ABI = _internals.landlock_abi()


needs_landlock = pytest.mark.skipif(ABI < 1, reason="this kernel has no Landlock")


needs_net = pytest.mark.skipif(ABI < 4, reason=f"TCP rules need Landlock ABI 4, this has {ABI}")


SECRET = "SECRET-7f3a9c"


HIDDEN_DIRS = ("~/.ssh", "~/.ray", "~/.gnupg", "~/.config/gcloud", "~/.config/gh")


# What every sandbox hides (docs/sandbox.md), written here: a path dropped from the code's
# defaults is then read by the agent below, not left out of the test.
DEFAULT_HIDE = (
    *HIDDEN_DIRS,
    "~/.aws/credentials",
    "~/.netrc",
    "~/.docker/config.json",
    "~/.kube/config",
    "~/.cache/huggingface/token",
    "~/.git-credentials",
    "~/.pypirc",
)


# The snippet runs with ``home``, ``cwd``, ``other``, ``secret``, ``data`` and helpers ``try_``
# (call a function; its value, or "denied: <error>") and ``read`` (a file's text) in scope, and
# leaves what it found in ``out``.
_AGENT = r"""
import os, subprocess, sys, tempfile


def try_(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except OSError as exc:
        return "denied: %s" % exc


def read(path):
    with open(path) as f:
        return f.read()


def write(path, text="pwned"):
    with open(path, "w") as f:
        f.write(text)
    return "written"


def run(data):
    scope = dict(data["paths"], data=data, try_=try_, read=read, write=write, os=os,
                 subprocess=subprocess, sys=sys, tempfile=tempfile, out={})
    exec(data["code"], scope)
    return 1.0, scope["out"]
"""


class World:
    """A fake home, a checkout as working directory, a neighbour, and an agent that runs
    snippets in an episode under a sandbox."""

    def __init__(self, agents: Agents, tmp_path: Path) -> None:
        self.agents = agents
        self.home = tmp_path / "home"
        self.cwd = tmp_path / "checkout"
        self.other = tmp_path / "other-episode"
        for path in DEFAULT_HIDE:
            target = self.home / path[2:]
            if path in HIDDEN_DIRS:
                target.mkdir(parents=True)
                (target / "id_rsa").write_text(f"{SECRET} {path}\n")
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(f"{SECRET} {path}\n")
        (self.home / ".bashrc").write_text("# the user's own\n")
        (self.home / ".gitconfig").write_text("[user]\n\tname = Trainer\n\temail = t@x\n")
        self.cwd.mkdir()
        (self.cwd / "module.py").write_text("x = 1\n")
        git = ["git", "-c", "init.defaultBranch=main"]
        env = {**os.environ, "HOME": str(self.home)}
        subprocess.run([*git, "init", "-q"], cwd=self.cwd, check=True, env=env)
        subprocess.run(["git", "add", "-A"], cwd=self.cwd, check=True, env=env)
        subprocess.run(["git", "commit", "-qm", "base"], cwd=self.cwd, check=True, env=env)
        self.other.mkdir()
        (self.other / "result.json").write_text("{}")

    def spec(
        self, sandbox: isolate.Sandbox | None = None, containment: str = "auto"
    ) -> isolate.EpisodeSpec:
        return self.agents.spec(
            _AGENT,
            containment=containment,
            cwd=self.cwd,
            env={"HOME": str(self.home), "PID_DIR": str(self.agents.pids)},
            sandbox=isolate.Sandbox() if sandbox is None else sandbox,
        )

    def paths(self) -> dict[str, str]:
        return {"home": str(self.home), "cwd": str(self.cwd), "other": str(self.other)}

    async def attempt(
        self,
        code: str,
        sandbox: isolate.Sandbox | None = None,
        containment: str = "auto",
        **data: Any,
    ) -> dict[str, Any]:
        record = {"code": textwrap.dedent(code), "paths": self.paths(), "secret": SECRET, **data}
        outcome = await isolate.run_episode(self.spec(sandbox, containment), record)
        assert outcome.status == "ok", outcome.summary() + "\n" + outcome.stderr_tail[-3000:]
        # A template that was refused would start fresh: then nothing here tested it.
        wanted = "template" if self.agents.preload else "fresh"
        assert outcome.start == wanted, outcome.preload_refused
        assert outcome.sandbox is not None
        assert outcome.sandbox.missing == ()
        assert outcome.sandbox.tmpdir is not None
        assert not outcome.sandbox.tmpdir.exists(), "the private TMPDIR outlived the episode"
        result: dict[str, Any] = outcome.info
        return result


@pytest.fixture
def world(agents: Agents, tmp_path: Path) -> World:
    return World(agents, tmp_path)


def _denied(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("denied:")


def _no_secret(value: Any) -> bool:
    return SECRET not in str(value)


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


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="isolate-world-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


# The skips of the files the tests came from, for the tests that moved without their file.
x86_64_linux = pytest.mark.skipif(
    platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
    reason="the attacks use x86_64 Linux system call numbers",
)
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="namespaces are Linux's"
)


#: What ``hostile_as_nobody`` runs for episodes of one template (:func:`nobody_parent`).
NOBODY_PARENT = """
import anyio, json, os, subprocess, sys
import isolate

work = sys.argv[1]
pids = os.path.join(work, "pids")
ROLES, LATER, PLAIN, DATA = @ROLES@, @LATER@, @PLAIN@, @DATA@


async def main():
    spec = isolate.EpisodeSpec(
        sandbox=@SANDBOX@,
        agent_root=os.path.join(work, "agent_root"),
        entrypoint="hostile:run",
        timeout=60.0,
        log_dir=os.path.join(work, "logs"),
        cwd=work,
        preload=True,
        env={"PID_DIR": pids},
    )
    results = {}

    async def one(role):
        outcome = await isolate.run_episode(spec, {**DATA, "role": role})
        results[role] = json.loads(outcome.model_dump_json())

    async with anyio.create_task_group() as tg:
        for role in ROLES:
            tg.start_soon(one, role)
    for role in LATER:
        await one(role)
    await isolate.close_templates()
    print(json.dumps({"uid": os.getuid(), "data": DATA, "outcomes": results}))


def plain():
    env = {**os.environ, "PID_DIR": pids, "PYTHONPATH": os.path.join(work, "agent_root")}
    run = "import hostile, json, sys; print(json.dumps(hostile.run(json.loads(sys.argv[1]))[1]))"
    argv = [[sys.executable, "-c", run, json.dumps({**DATA, "role": role})] for role in ROLES]
    first = subprocess.Popen(argv[0], env=env, stdout=subprocess.PIPE)
    second = subprocess.run(argv[1], env=env, capture_output=True)
    out, _ = first.communicate(timeout=30)
    infos = [json.loads(out), json.loads(second.stdout)]
    outcomes = {role: {"info": info} for role, info in zip(ROLES, infos)}
    print(json.dumps({"uid": os.getuid(), "data": DATA, "outcomes": outcomes}))


plain() if PLAIN else anyio.run(main)
"""


def nobody_parent(
    sandbox: str,
    roles: tuple[str, str],
    *,
    later: tuple[str, ...] = (),
    plain: bool = False,
    data: str = "{}",
) -> str:
    """A script for :func:`hostile_as_nobody`: episodes of ``hostile:run`` from one template
    under ``sandbox`` (Python, where ``pids`` is the episodes' PID_DIR), the two ``roles`` at
    once, then each of ``later``; or, with ``plain``, the two roles as plain processes, the
    control. ``data`` (Python) is every episode's data besides its ``role``. It prints the
    outcomes by role, and the data."""
    script = NOBODY_PARENT.replace("@SANDBOX@", sandbox).replace("@DATA@", data)
    return (
        script.replace("@ROLES@", repr(roles))
        .replace("@LATER@", repr(later))
        .replace("@PLAIN@", repr(plain))
    )


def assert_forked(outcomes: dict[str, Any]) -> None:
    """Each outcome (as JSON, by role) ended ``ok`` and started from the template; else why."""
    for outcome in outcomes.values():
        assert (outcome["status"], outcome["start"]) == ("ok", "template"), (
            outcome["error"],
            outcome["preload_refused"],
            outcome["stderr_tail"][-2000:],
        )


@contextlib.contextmanager
def hostile_as_nobody(prefix: str, hostile: str, parent: str) -> Iterator[tuple[Path, Any]]:
    """Run the script ``parent`` (given its work directory) as ``nobody``, with ``hostile`` as
    ``agent_root/hostile.py``, in a fresh work directory (``agent_root``, ``logs``, ``pids``,
    ``scratch``; all mode 0777) removed afterwards. Yields the directory and the JSON line the
    script printed last, once the script exited 0 as ``nobody``. Skips the test where root
    cannot act as ``nobody`` or ``nobody`` has no interpreter that runs isolate."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to act as an unprivileged user (nobody)")
    repo = Path(isolate.__file__).resolve().parent.parent
    found_python = unprivileged_python(repo)
    if isinstance(found_python, str):
        pytest.skip(f"no interpreter the unprivileged user can run isolate with: {found_python}")
    python, env = found_python
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        for sub in ("agent_root", "logs", "pids", "scratch"):
            (work / sub).mkdir()
        (work / "agent_root" / "hostile.py").write_text(textwrap.dedent(hostile))
        (work / "parent.py").write_text(parent)
        for path in (work, *work.iterdir(), *(work / "agent_root").iterdir()):
            path.chmod(0o777)
        done = as_nobody(
            [python, str(work / "parent.py"), str(work)],
            cwd=work,
            env={"PATH": os.environ["PATH"], "HOME": str(work), **env},
            timeout=120 * SLOW,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.splitlines()[-1])
        assert report["uid"] == NOBODY
        yield work, report
    finally:
        shutil.rmtree(work, ignore_errors=True)
