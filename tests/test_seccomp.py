"""The worker's seccomp filter (``agent_shim/shim_seccomp.py``), loaded the way the shim loads
it and installed in a forked child each time: a filter can never be lifted, so never in the test
runner. Children report what they saw as JSON through a pipe."""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import agent_shim.shim as shim

from .conftest import SLOW

PART = shim.load_part("seccomp")
MACHINE = os.uname().machine
if PART.program(MACHINE) is None:
    pytest.skip(f"containment seccomp: no syscall table for {MACHINE}", allow_module_level=True)
# The numbers, written here from the kernel's tables (arch/x86/entry/syscalls/syscall_64.tbl;
# include/uapi/asm-generic/unistd.h for aarch64), never read from the filter under test: a call
# dropped from the filter, or given a wrong number, then fails here.
SHARED_NR = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "mount_setattr": 442,
    "open_tree_attr": 467,
}
NUMBERS: dict[str, dict[str, int]] = {
    "x86_64": SHARED_NR
    | {
        "clone": 56,
        "pivot_root": 155,
        "mount": 165,
        "umount2": 166,
        "init_module": 175,
        "delete_module": 176,
        "kexec_load": 246,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "unshare": 272,
        "perf_event_open": 298,
        "setns": 308,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "finit_module": 313,
        "kexec_file_load": 320,
        "bpf": 321,
        "userfaultfd": 323,
    },
    "aarch64": SHARED_NR
    | {
        "umount2": 39,
        "mount": 40,
        "pivot_root": 41,
        "unshare": 97,
        "kexec_load": 104,
        "init_module": 105,
        "delete_module": 106,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "clone": 220,
        "perf_event_open": 241,
        "setns": 268,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "finit_module": 273,
        "bpf": 280,
        "userfaultfd": 282,
        "kexec_file_load": 294,
    },
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
NR = NUMBERS[MACHINE]
SHIM_DIR = str(Path(shim.__file__).parent)

CLONE_THREAD, CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x10000, 0x20000, 0x10000000, 0x40000000
NAMESPACES = {
    "time": 0x80,
    "mount": CLONE_NEWNS,
    "cgroup": 0x02000000,
    "uts": 0x04000000,
    "ipc": 0x08000000,
    "user": CLONE_NEWUSER,
    "pid": 0x20000000,
    "net": CLONE_NEWNET,
}

# Arguments that make each call fail harmlessly (bad flags, NULL, fd -1) where no filter stops
# it, so the unfiltered control child proves that an EPERM comes from the filter.
M1 = -1
CALLS: dict[str, tuple[int, ...]] = {
    "mount": (0, 0, 0, 0, 0),
    "umount2": (0, M1),
    "open_tree": (M1, 0, M1),
    "open_tree_attr": (M1, 0, M1, 0, 0),
    "move_mount": (M1, 0, M1, 0, M1),
    "fsopen": (0, M1),
    "fsmount": (M1, M1, 0),
    "fsconfig": (M1, M1, 0, 0, 0),
    "fspick": (M1, 0, M1),
    "mount_setattr": (M1, 0, M1, 0, 0),
    "pivot_root": (0, 0),
    "setns": (M1, 0),
    "pidfd_getfd": (M1, M1, 0),
    "process_vm_readv": (0, 0, 0, 0, 0, M1),
    "process_vm_writev": (0, 0, 0, 0, 0, M1),
    "kexec_load": (0, 0, 0, M1),
    "kexec_file_load": (M1, M1, 0, 0, M1),
    "init_module": (0, 0, 0),
    "finit_module": (M1, 0, M1),
    "delete_module": (0, 0),
    "bpf": (M1, 0, 0),
    "keyctl": (M1, 0, 0, 0, 0),
    "add_key": (0, 0, 0, 0, 0),
    "request_key": (0, 0, 0, 0),
    "userfaultfd": (M1,),
    "io_uring_setup": (0, 0),
    "io_uring_enter": (M1, 0, 0, 0, 0, 0),
    "io_uring_register": (M1, 0, 0, 0),
    "perf_event_open": (0, 0, M1, M1, 0),
    "clone3": (0, 0),
}
REFUSED = (
    "mount",
    "umount2",
    "open_tree",
    "open_tree_attr",
    "move_mount",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "pivot_root",
    "setns",
    "pidfd_getfd",
    "process_vm_readv",
    "process_vm_writev",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "keyctl",
    "add_key",
    "request_key",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "perf_event_open",
)
EXPECTED = {name: "EPERM" for name in REFUSED} | {"clone3": "ENOSYS"}


# --- running code in a child ------------------------------------------------------------------


def in_child(
    body: Callable[[], dict[str, Any]],
    *,
    install: bool = True,
    before: Callable[[], None] | None = None,
) -> tuple[dict[str, Any] | None, int]:
    """Fork; in the child run ``before``, install the filter (unless ``install`` is false),
    then ``body``; its dict (or the error) as JSON through a pipe. Returns that dict (None if
    the child died before writing it) and the child's wait status."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():  # 3.12+ warns of fork() in a threaded process
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:  # never back into pytest from the child
            out: dict[str, Any] = {}
            try:
                os.close(read_fd)
                if before is not None:
                    before()
                if install:
                    out["problem"] = PART.install()
                    out["status"] = proc_status()
                if not install or (out["problem"] is None and out["status"]["Seccomp"] == "2"):
                    out.update(body())
            except BaseException:
                out["error"] = traceback.format_exc()
            with open(write_fd, "wb") as f:
                f.write(json.dumps(out, default=repr).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks, end = [], time.monotonic() + 60
    try:
        while select.select([read_fd], [], [], max(0.0, end - time.monotonic()))[0]:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    return (json.loads(data) if data else None), status


def filtered(body: Callable[[], dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """``body``'s results under the filter; fails if the filter did not go in."""
    out, status = in_child(body, **kwargs)
    assert out is not None, f"child died: wait status {status}"
    assert "error" not in out, out["error"]
    assert out["problem"] is None
    assert out["status"]["Seccomp"] == "2"
    return out


def unfiltered(body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    out, status = in_child(body, install=False)
    assert out is not None, f"child died: wait status {status}"
    assert "error" not in out, out["error"]
    return out


def proc_status() -> dict[str, str]:
    with open("/proc/self/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def syscall(number: int, *args: int) -> str:
    """The result of ``syscall(number, *args)`` in words: ``ok`` or the errno's name."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    return "ok" if result != -1 else errno.errorcode.get(ctypes.get_errno(), "?")


def unshare(flags: int) -> str:
    try:
        if hasattr(os, "unshare"):  # Python 3.12+
            os.unshare(flags)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(flags) != 0:
                raise OSError(ctypes.get_errno(), "unshare")
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, "?")


# --- the refused system calls -----------------------------------------------------------------


def every_call() -> dict[str, Any]:
    return {name: syscall(NR[name], *args) for name, args in CALLS.items()}


@pytest.fixture(scope="module")
def calls() -> dict[str, dict[str, Any]]:
    """Every call of CALLS, made once without the filter and once under it."""
    return {"control": unfiltered(every_call), "filtered": filtered(every_call)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_refused(name: str, calls: dict[str, dict[str, Any]]) -> None:
    assert name in CALLS, "give the new refused call harmless arguments in CALLS"
    assert calls["control"][name] != "ok", "the test's arguments must fail without the filter"
    assert calls["filtered"][name] == EXPECTED[name], (name, calls["control"][name])


def test_the_control_child_is_refused_by_the_kernel_not_by_a_filter(
    calls: dict[str, dict[str, Any]],
) -> None:
    """As root the arguments fail for what they are (EINVAL, EFAULT, EBADF...), not EPERM, so
    each filtered EPERM above is the filter's. Unprivileged, the kernel itself says EPERM."""
    if os.geteuid() != 0:
        pytest.skip("as an unprivileged user the kernel refuses most of these with EPERM")
    kernel_eperm = {n for n, r in calls["control"].items() if r == "EPERM"}
    # io_uring may be off (sysctl io_uring_disabled), kexec off in a VM, bpf locked down.
    assert kernel_eperm <= {"io_uring_setup", "kexec_load", "kexec_file_load", "bpf"}, kernel_eperm


def namespace_calls() -> dict[str, Any]:
    """clone with CLONE_THREAD (without CLONE_SIGHAND) and unshare with bit 0 are EINVAL for
    the kernel: where no filter refuses them, nothing is created."""
    out: dict[str, Any] = {"clone": syscall(NR["clone"], CLONE_THREAD, 0, 0, 0, 0)}
    out["unshare"] = syscall(NR["unshare"], 1)
    out["unshare high bits"] = syscall(NR["unshare"], 1 << 32)
    out["unshare user, high bits"] = syscall(NR["unshare"], (1 << 32) | CLONE_NEWUSER | 1)
    for name, flag in NAMESPACES.items():
        out["clone " + name] = syscall(NR["clone"], flag | CLONE_THREAD, 0, 0, 0, 0)
        out["unshare " + name] = syscall(NR["unshare"], flag | 1)
    return out


def test_clone_and_unshare_refused_only_for_namespaces() -> None:
    control, result = unfiltered(namespace_calls), filtered(namespace_calls)
    assert set(control.values()) == {"EINVAL"}, control
    assert result.pop("status")
    assert result.pop("problem") is None
    for name in ("clone", "unshare", "unshare high bits"):
        assert result.pop(name) == "EINVAL", name  # no namespace flag: the kernel's answer
    assert set(result.values()) == {"EPERM"}, result


def test_real_unshare_refused() -> None:
    def body() -> dict[str, Any]:
        flags = {"user": CLONE_NEWUSER, "mount": CLONE_NEWNS, "net": CLONE_NEWNET}
        out = {name: unshare(flag) for name, flag in flags.items()}
        out["all"] = unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET)
        return out

    out = filtered(body)
    assert [out[n] for n in ("user", "mount", "net", "all")] == ["EPERM"] * 4


@pytest.mark.skipif(MACHINE != "x86_64", reason="the x32 ABI is x86_64's")
def test_x32_numbers_refused() -> None:
    def body() -> dict[str, Any]:
        x32 = 0x40000000
        return {"getpid": syscall(x32 | 39), "mount": syscall(x32 | 165, 0, 0, 0, 0, 0)}

    control, out = unfiltered(body), filtered(body)
    assert "EPERM" not in (control["getpid"], control["mount"])  # ENOSYS, or x32 getpid works
    assert (out["getpid"], out["mount"]) == ("EPERM", "EPERM")


def i386_getpid() -> dict[str, Any]:
    """getpid (20) through ``int 0x80``: the i386 table, from this 64-bit process."""
    import mmap
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGSYS dumps core: not into the repo
    code = b"\xb8\x14\x00\x00\x00\xcd\x80\xc3"  # mov eax, 20; int 0x80; ret
    memory = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    memory.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    return {"pid": ctypes.CFUNCTYPE(ctypes.c_long)(address)(), "mine": os.getpid()}


@pytest.mark.skipif(MACHINE != "x86_64", reason="int 0x80 is x86's")
def test_other_architecture_kills() -> None:
    """A system call of another architecture (numbers of another table) kills the process."""
    control, status = in_child(i386_getpid, install=False)
    if control is None or "error" in control or control["pid"] != control["mine"]:
        pytest.skip(f"no i386 system calls here (IA32 emulation off): {control}, {status}")
    out, status = in_child(i386_getpid)
    assert out is None, out
    assert os.WIFSIGNALED(status), status
    assert os.WTERMSIG(status) == signal.SIGSYS


def test_a_thread_started_before_is_covered() -> None:
    """SECCOMP_FILTER_FLAG_TSYNC: the filter reaches threads that exist already."""
    import threading

    go, out = threading.Event(), {}

    def early() -> None:
        go.wait(30 * SLOW)
        out["mount"] = syscall(NR["mount"], 0, 0, 0, 0, 0)

    def start() -> None:
        threads.append(threading.Thread(target=early))
        threads[0].start()

    def body() -> dict[str, Any]:
        go.set()
        threads[0].join()
        return out

    threads: list[threading.Thread] = []
    result = filtered(body, before=start)
    assert result["mount"] == "EPERM"


def test_no_forced_speculation_mitigation() -> None:
    """SECCOMP_FILTER_FLAG_SPEC_ALLOW: where the kernel would force the speculative store bypass
    mitigation on a filtered process (its default before 5.16), it does not on the agent."""
    before = proc_status().get("Speculation_Store_Bypass")
    if before is None:
        pytest.skip("the kernel does not report Speculation_Store_Bypass")
    after = filtered(dict)["status"]["Speculation_Store_Bypass"]
    assert after == before


# --- what still works -------------------------------------------------------------------------


def _mp_child(conn: Any) -> None:
    conn.send(os.getpid())
    conn.close()


def ordinary_work() -> dict[str, Any]:
    import multiprocessing
    import socket
    import threading

    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(thread="ok"))
    thread.start()
    thread.join()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    sh = subprocess.run(["sh", "-c", "echo ok"], capture_output=True, text=True, timeout=30 * SLOW)
    out["sh"] = sh.stdout.strip()
    grep = subprocess.run(["grep", "Seccomp:", "/proc/self/status"], capture_output=True)
    out["exec inherits"] = grep.stdout.decode().split()
    code = "import threading; t = threading.Thread(target=print, args=('ok',)); t.start(); t.join()"
    python = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    out["python thread"] = python.stdout.strip() + python.stderr
    context = multiprocessing.get_context("fork")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=_mp_child, args=(child_end,))
    process.start()
    out["multiprocessing"] = parent_end.recv() == process.pid
    process.join()
    out["multiprocessing exit"] = process.exitcode
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        out["socket"] = "ok"
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        out["socketpair"] = b.recv(1).decode()
    out["chroot"] = syscall(161 if MACHINE == "x86_64" else 51, 0)  # allowed: EFAULT, not EPERM
    return out


def test_ordinary_work_still_works() -> None:
    out = filtered(ordinary_work)
    assert out["thread"] == "ok"
    assert out["fork"] == 7
    assert out["sh"] == "ok"
    assert out["exec inherits"] == ["Seccomp:", "2"]
    assert out["python thread"] == "ok"
    assert out["multiprocessing"] is True
    assert out["multiprocessing exit"] == 0
    assert out["socket"] == "ok"
    assert out["socketpair"] == "x"
    assert out["chroot"] == "EFAULT"


def test_unshare_and_mount_tools_fail(tmp_path: Path) -> None:
    target = tmp_path / "mnt"
    target.mkdir()

    def body() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, argv in (
            ("unshare", ["unshare", "-U", "true"]),
            ("unshare -m", ["unshare", "-m", "true"]),
            ("mount", ["mount", "-t", "tmpfs", "none", str(target)]),
        ):
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=30 * SLOW)
                out[name] = [done.returncode, done.stderr.strip()]
            except FileNotFoundError:
                out[name] = None
        return out

    try:
        out = filtered(body)
    finally:
        if os.path.ismount(target):  # the filter failed: take the mount away again
            subprocess.run(["umount", "-l", str(target)], check=False)
    if out["unshare"] is None and out["mount"] is None:
        pytest.skip("neither unshare nor mount is installed")
    for name in ("unshare", "unshare -m", "mount"):
        if out[name] is not None:
            assert out[name][0] != 0, (name, out[name])
    assert not os.path.ismount(target)


def test_a_refused_load_is_a_problem_in_words() -> None:
    """The kernel caps the instructions of all the filters a process has (32768, four more per
    filter): stacking the filter until it refuses (ENOMEM) gives ``seccomp: <strerror>``."""

    def body() -> dict[str, Any]:
        for count in range(1, 2000):
            problem = PART.install()
            if problem is not None:
                return {"filters": count, "refused": problem}
        return {"filters": None}

    out = filtered(body)
    # The kernel counts the program it converted to eBPF: 585 here, not 32768 // (43 + 4).
    assert out["filters"] is not None
    assert out["filters"] > 100
    assert out["refused"] == "seccomp: " + os.strerror(errno.ENOMEM)


# --- no_new_privs -----------------------------------------------------------------------------


def has_sys_admin() -> bool:
    return bool(int(proc_status()["CapEff"], 16) >> 21 & 1)


def test_no_new_privs_left_alone_with_cap_sys_admin() -> None:
    """Set-uid programs keep working for an agent that has the capability anyway."""
    if not has_sys_admin():
        pytest.skip("the test runner lacks CAP_SYS_ADMIN")
    assert filtered(dict)["status"]["NoNewPrivs"] == "0"


def test_no_new_privs_set_without_cap_sys_admin() -> None:
    if os.geteuid() != 0 and has_sys_admin():
        pytest.skip("the test runner is not root, yet has CAP_SYS_ADMIN")

    def drop() -> None:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)

    out = filtered(lambda: {"clone3": syscall(NR["clone3"], 0, 0)}, before=drop)
    assert out["status"]["NoNewPrivs"] == "1"
    assert out["status"]["CapEff"] == "0000000000000000"
    assert out["clone3"] == "ENOSYS"


# --- the program ------------------------------------------------------------------------------


def run_filter(code: bytes, arch: int, nr: int, arg0: int = 0) -> int:
    """Classic BPF, as the kernel runs the filter: the action for one system call."""
    data = (nr & 0xFFFFFFFF).to_bytes(4, "little") + arch.to_bytes(4, "little") + bytes(8)
    data += arg0.to_bytes(8, "little") + bytes(40)  # struct seccomp_data
    pc, acc = 0, 0
    while True:
        op = int.from_bytes(code[pc * 8 : pc * 8 + 2], "little")
        jt, jf, k = code[pc * 8 + 2], code[pc * 8 + 3], int.from_bytes(code[pc * 8 + 4 :], "little")
        k &= 0xFFFFFFFF
        pc += 1
        if op == 0x20:  # ld [k]
            acc = int.from_bytes(data[k : k + 4], "little")
        elif op in (0x15, 0x45):  # jeq, jset
            pc += jt if (acc == k if op == 0x15 else acc & k) else jf
        elif op == 0x06:  # ret
            return k
        else:
            raise AssertionError(f"unexpected instruction {op:#x}")


ALLOW, KILL = 0x7FFF0000, 0x80000000
EPERM, ENOSYS = 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_program_decides_as_documented(machine: str) -> None:
    """Run on an interpreter of classic BPF: what the kernel would decide, on either
    architecture, whichever this machine is."""
    code = PART.program(machine)
    audit_arch, numbers = AUDIT_ARCH[machine], NUMBERS[machine]
    assert len(code) % 8 == 0
    assert len(code) <= 4096 * 8
    by_number = {numbers[name]: name for name in numbers}
    for nr in range(600):
        name = by_number.get(nr)
        for arg0 in (0, CLONE_THREAD, 1 << 32, 0xFFFFFFFF00000000 | CLONE_THREAD):
            want = ALLOW
            if name in REFUSED:
                want = EPERM
            elif name == "clone3":
                want = ENOSYS
            assert run_filter(code, audit_arch, nr, arg0) == want, (nr, name, arg0)
    for name in ("clone", "unshare"):
        for flag in NAMESPACES.values():
            for arg0 in (flag, flag | CLONE_THREAD, (1 << 40) | flag):
                assert run_filter(code, audit_arch, numbers[name], arg0) == EPERM, (name, arg0)
    for other in (0x40000003, 0xC000003E, 0xC00000B7, 0):  # i386, x86_64, aarch64, none
        if other != audit_arch:
            assert run_filter(code, other, numbers["mount"]) == KILL
            assert run_filter(code, other, 0) == KILL
    x32 = run_filter(code, audit_arch, 0x40000000 | 39)
    assert x32 == (EPERM if machine == "x86_64" else ALLOW)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_a_template_importers_program_allows_exactly_its_unshare(machine: str) -> None:
    """``program(machine, unshare=FLAGS)``: ``unshare`` with exactly FLAGS is allowed; with any
    other namespace flag, or FLAGS and one more, EPERM; ``clone`` with FLAGS stays refused;
    the rest decides as without it."""
    flags = NAMESPACES["user"] | NAMESPACES["ipc"] | NAMESPACES["uts"]
    code, plain = PART.program(machine, flags), PART.program(machine)
    audit_arch, numbers = AUDIT_ARCH[machine], NUMBERS[machine]
    unshare, clone = numbers["unshare"], numbers["clone"]
    assert run_filter(code, audit_arch, unshare, flags) == ALLOW
    assert run_filter(plain, audit_arch, unshare, flags) == EPERM
    assert run_filter(code, audit_arch, clone, flags) == EPERM
    for flag in NAMESPACES.values():
        assert run_filter(code, audit_arch, unshare, flag) == EPERM, flag
        if not flag & flags:
            assert run_filter(code, audit_arch, unshare, flags | flag) == EPERM, flag
    assert run_filter(code, audit_arch, unshare, flags | CLONE_THREAD) == EPERM
    assert run_filter(code, audit_arch, unshare, CLONE_THREAD) == ALLOW
    for nr in range(600):
        for arg0 in (0, CLONE_THREAD):
            if nr != unshare:
                want = run_filter(plain, audit_arch, nr, arg0)
                assert run_filter(code, audit_arch, nr, arg0) == want, (nr, arg0)
    # With a mount namespace among them, mount too (a fork mounts its own /dev/shm), and only
    # that besides.
    mounts = flags | CLONE_NEWNS
    with_mount = PART.program(machine, mounts)
    assert run_filter(with_mount, audit_arch, unshare, mounts) == ALLOW
    assert run_filter(with_mount, audit_arch, unshare, flags) == EPERM
    assert run_filter(code, audit_arch, numbers["mount"], 0) == EPERM
    for nr in range(600):
        if nr not in (unshare, numbers["mount"]):
            assert run_filter(with_mount, audit_arch, nr, 0) == run_filter(plain, audit_arch, nr, 0)
    assert run_filter(with_mount, audit_arch, numbers["mount"], 0) == ALLOW


def test_program_per_architecture() -> None:
    x86, arm = PART.program("x86_64"), PART.program("aarch64")
    assert len(x86) == len(arm) + 8  # the x32 check
    for machine in ("i686", "armv7l", "riscv64", "s390x", "ppc64le", "aarch64_be", ""):
        assert PART.program(machine) is None, machine
    # A call the filter refuses beyond those above would go untested: name it in REFUSED.
    assert sorted(PART.SYSCALLS_REFUSED) == sorted(REFUSED)
    assert "chroot" not in PART.SYSCALLS_REFUSED


@pytest.mark.parametrize("machine", sorted(NUMBERS))
def test_the_filters_numbers_are_the_kernels(machine: str) -> None:
    """The filter's table holds the numbers written above, for every call it decides on."""
    table = PART._ARCHES[machine][1]
    assert {name: table.get(name) for name in NUMBERS[machine]} == NUMBERS[machine]
    assert PART._ARCHES[machine][0] == AUDIT_ARCH[machine]


HEADERS = {
    "x86_64": ["/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"],
    "aarch64": ["/usr/include/asm-generic/unistd.h"],
}


@pytest.mark.parametrize("machine", sorted(HEADERS))
def test_numbers_match_the_kernel_headers(machine: str) -> None:
    """The filter's tables, and this file's, against the system's kernel headers
    (linux-libc-dev), where installed."""
    header = next((path for path in HEADERS[machine] if os.path.exists(path)), None)
    if header is None:
        pytest.skip(f"no kernel headers for {machine}: {HEADERS[machine]}")
    defined = dict(re.findall(r"^#define __NR_(\w+)\s+(\d+)\s*$", Path(header).read_text(), re.M))
    table = PART._ARCHES[machine][1]
    known = {name for name in table if name in defined}
    assert len(known) >= len(table) - 1  # an older header may lack open_tree_attr (6.15)
    assert {name: table[name] for name in known} == {name: int(defined[name]) for name in known}
    ours = NUMBERS[machine]
    assert {n: ours[n] for n in ours if n in defined} == {
        n: int(defined[n]) for n in ours if n in defined
    }


def test_program_buffer_holds_the_program() -> None:
    code = PART.program(MACHINE)
    buffer, address = PART._c_copy(code)
    assert ctypes.string_at(address, len(code)) == code
    del buffer


# --- other interpreters, the cost -------------------------------------------------------------

# Run by path under each interpreter, as the shim is: syscalls through the shim's c_call, so
# it shows too that neither the part nor the install imports ctypes.
_SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import shim
part = shim.load_part("seccomp")
nr = part._ARCHES[os.uname().machine][1]
read_fd, write_fd = os.pipe()
pid = os.fork()
if pid == 0:
    out = {}
    try:
        out["problem"] = part.install()
        out["ctypes"] = "ctypes" in sys.modules
        def call(*args):
            result, errno = shim.c_call(*args)
            return "ok" if result != -1 else os.strerror(errno)
        out["mount"] = call("syscall", nr["mount"], None, None, None, 0, None)
        out["clone3"] = call("syscall", nr["clone3"], None, 0)
        out["unshare"] = call("unshare", 0x10000000)
        import socket, subprocess, threading
        thread = threading.Thread(target=out.update, kwargs={"thread": "ok"})
        thread.start()
        thread.join()
        child = os.fork()
        if child == 0:
            os._exit(7)
        out["fork"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        out["sh"] = subprocess.run(["sh", "-c", "echo ok"], stdout=subprocess.PIPE).stdout
        out["sh"] = out["sh"].decode().strip()
        socket.socket().close()
        out["socket"] = "ok"
    except BaseException as exc:
        out["error"] = repr(exc)
    os.write(write_fd, json.dumps(out).encode())
    os._exit(0)
os.close(write_fd)
data = b""
while True:
    chunk = os.read(read_fd, 65536)
    if not chunk:
        break
    data += chunk
os.waitpid(pid, 0)
print(data.decode())
"""


def interpreters() -> list[Any]:
    found = [pytest.param(sys.executable, id="this")]
    for version in ("3.9", "3.13"):
        paths = sorted(glob.glob(f"/root/.pyenv/versions/{version}.*/bin/python{version}"))
        paths = paths or sorted(glob.glob(f"/usr/bin/python{version}"))
        found.append(pytest.param(paths[-1] if paths else None, id=version))
    return found


@pytest.mark.parametrize("python", interpreters())
def test_under_each_python(python: str | None, tmp_path: Path) -> None:
    if python is None:
        pytest.skip("this Python version is not installed")
    script = tmp_path / "check_seccomp.py"
    script.write_text(_SCRIPT)
    done = subprocess.run(
        [python, "-I", str(script), SHIM_DIR], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out == {
        "problem": None,
        "ctypes": False,
        "mount": os.strerror(errno.EPERM),
        "clone3": os.strerror(errno.ENOSYS),
        "unshare": os.strerror(errno.EPERM),
        "thread": "ok",
        "fork": 7,
        "sh": "ok",
        "socket": "ok",
    }, done.stderr


_COST = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import shim
import _ctypes  # the worker has it already: the shim's c_call loaded it
shim.c_call("prctl", 39, 0, 0, 0, 0)  # PR_GET_NO_NEW_PRIVS: prctl's C function is made
if sys.argv[2] == "preloaded":
    shim.load_part("seccomp")
inside, spans = [], {True: [], False: []}
for _ in range(50):
    for install in (True, False):
        read_fd, write_fd = os.pipe()
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            took, problem = time.perf_counter(), None
            if install:
                problem = shim.load_part("seccomp").install()
            took = time.perf_counter() - took
            os.write(write_fd, json.dumps([problem, took]).encode())
            os._exit(0)
        os.close(write_fd)
        problem, took = json.loads(os.read(read_fd, 4096))
        os.close(read_fd)
        os.waitpid(pid, 0)
        spans[install].append((time.perf_counter() - start) * 1000)
        assert problem is None, problem
        if install:
            inside.append(took * 1000)
median = lambda values: sorted(values)[len(values) // 2]
print(json.dumps({
    "inside_ms": median(inside),
    "fork_to_reap_ms": median(spans[True]),
    "bare_fork_to_reap_ms": median(spans[False]),
}))
"""


@pytest.mark.parametrize("how", ["preloaded", "imported"])
def test_install_cost(how: str, tmp_path: Path) -> None:
    """Medians of 50 forks (a benchmark, not a timed test): the install timed in the child, and
    fork to reap with and without it. ``imported`` includes loading the part from its cached
    bytecode, as the worker does."""
    script = tmp_path / "cost.py"
    script.write_text(_COST)
    command = [sys.executable, "-I", str(script), SHIM_DIR, how]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120 * SLOW)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    print(
        f"seccomp install ({how}), medians of 50 forks: {r['inside_ms']:.3f} ms in the child; "
        f"fork to reap {r['fork_to_reap_ms']:.3f} ms, without it {r['bare_fork_to_reap_ms']:.3f}"
    )
    assert r["inside_ms"] < 1000 * SLOW
