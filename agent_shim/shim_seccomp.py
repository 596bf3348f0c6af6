"""A seccomp filter for the worker: the second line of the wall, loaded before the agent.

Loaded with ``load_part("seccomp")``; standard library only, Python 3.9+, no side effect at
import. ``install()`` puts this process, and everything it starts afterwards, under a classic
BPF filter that can never be lifted, and returns a problem in words, or None. It calls the C
library through the shim's ``c_call`` (ints, bytes as ``char *``, None as NULL; returns
``(result, errno)``). ``SHARED_NUMBERS`` are the syscall numbers x86_64 and aarch64 share.

What the filter decides, on x86_64 and aarch64 (little-endian, 64-bit processes):

- a system call of another architecture (on x86_64: ``int 0x80``, the i386 table, whose numbers
  mean other calls): the process is killed (SIGSYS), as libseccomp and seccompiler do;
- on x86_64, a number with the x32 bit (``0x40000000``) set: EPERM;
- ``SYSCALLS_REFUSED``: EPERM. Mounts and the new mount API, namespaces joined with ``setns``,
  other processes' memory, kernel modules and kexec, bpf, the key store, userfaultfd, io_uring
  (whose operations no filter sees) and perf events;
- ``clone`` and ``unshare`` asking for a new namespace (``NAMESPACE_FLAGS`` in the low 32 bits
  of their first argument, the flags on both architectures): EPERM. A template's importer
  (``install(unshare=FLAGS)``) may call ``unshare`` with exactly ``FLAGS``, so that each of its
  forks can make namespaces of its own (shim_parked.py), and, where FLAGS hold
  ``CLONE_NEWNS``, ``mount``, which none of its processes holds ``SYS_ADMIN`` for but a fork
  in its own namespaces (it mounts its ``/dev/shm``; under a sandbox Landlock refuses it the
  mount, and the template's outer process makes it: shim_outer.py); the forks' workers, under
  a second filter without it, cannot;
- ``clone3``: ENOSYS, since its flags lie in memory a filter cannot read; glibc then falls back
  to ``clone``, so threads and fork keep working;
- everything else (``chroot`` too): allowed.

The kernel wants no_new_privs or CAP_SYS_ADMIN to load a filter; where it refuses for want of
both (EACCES), no_new_privs is set and the load tried again. The filter is loaded with the
seccomp system call: with SECCOMP_FILTER_FLAG_TSYNC, so a thread started before it is covered
too, and with SECCOMP_FILTER_FLAG_SPEC_ALLOW, as runc and crun do: before Linux 5.16 a filter
would otherwise force the speculative store bypass mitigation on the agent, which can make
Python code run up to twice as slow, and protects nothing here (the agent may read all of its
own process anyway). Kernels older than 4.17 get it through prctl, without either flag.
"""

import os
import sys
from errno import EACCES, EINVAL, ENOSYS, EPERM

shim = sys.modules["_isolate_shim"]

SYSCALLS_REFUSED = (
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
SYSCALLS_NO_NAMESPACE = ("clone", "unshare")  # refused only when they ask for a namespace
SYSCALLS_ENOSYS = ("clone3",)

# Every namespace: time, mount, cgroup, UTS, IPC, user, PID, net. For clone, CLONE_NEWTIME
# (0x80) lies in CSIGNAL (the exit signal): one that high is invalid anyway.
NAMESPACE_FLAGS = shim.CLONE_NEWTIME | shim.CLONE_NEWNS | shim.CLONE_NEWCGROUP | shim.CLONE_NEWUTS
NAMESPACE_FLAGS |= shim.CLONE_NEWIPC | shim.CLONE_NEWUSER | shim.CLONE_NEWPID | shim.CLONE_NEWNET

# The numbers, from the kernel's tables: arch/x86/entry/syscalls/syscall_64.tbl, and for
# aarch64 include/uapi/asm-generic/unistd.h. Since io_uring_setup (425) both share them.
SHARED_NUMBERS = {
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
    "open_tree_attr": 467,  # Linux 6.15
}
_X86_64 = dict(
    SHARED_NUMBERS,
    clone=56,
    pivot_root=155,
    mount=165,
    umount2=166,
    init_module=175,
    delete_module=176,
    kexec_load=246,
    add_key=248,
    request_key=249,
    keyctl=250,
    unshare=272,
    perf_event_open=298,
    setns=308,
    process_vm_readv=310,
    process_vm_writev=311,
    finit_module=313,
    seccomp=317,
    kexec_file_load=320,
    bpf=321,
    userfaultfd=323,
)
_AARCH64 = dict(
    SHARED_NUMBERS,
    umount2=39,
    mount=40,
    pivot_root=41,
    unshare=97,
    kexec_load=104,
    init_module=105,
    delete_module=106,
    add_key=217,
    request_key=218,
    keyctl=219,
    clone=220,
    perf_event_open=241,
    setns=268,
    process_vm_readv=270,
    process_vm_writev=271,
    finit_module=273,
    seccomp=277,
    bpf=280,
    userfaultfd=282,
    kexec_file_load=294,
)
# os.uname().machine -> (AUDIT_ARCH_*, numbers): EM_X86_64 62, EM_AARCH64 183, 64-bit, LE.
_ARCHES = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _AARCH64)}
_X32_BIT = 0x40000000

# Classic BPF (linux/filter.h, linux/seccomp.h).
_LD_ABS_W, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data (little-endian)
_ALLOW, _ERRNO, _KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, _SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1, 1, 4


def program(machine, unshare=0):
    """The filter for ``machine`` (``os.uname().machine``) as struct sock_filter bytes, or None
    where there is no table for it (or this process is not a 64-bit little-endian one).
    ``unshare``: flags (of ``NAMESPACE_FLAGS``) that ``unshare`` may take, all at once and
    nothing else; 0: none."""
    if machine not in _ARCHES or sys.maxsize < 1 << 32 or sys.byteorder != "little":
        return None
    audit_arch, numbers = _ARCHES[machine]
    # The tests of the number: (jump, k, where to when it holds); else on to the next.
    tests = [(_JSET, _X32_BIT, "eperm")] if machine == "x86_64" else []
    # A fork that makes a mount namespace mounts its own /dev/shm there (shim_parked.py).
    refused = [n for n in SYSCALLS_REFUSED if n != "mount" or not unshare & shim.CLONE_NEWNS]
    tests += [(_JEQ, numbers[name], "eperm") for name in refused]
    tests += [(_JEQ, numbers[name], "enosys") for name in SYSCALLS_ENOSYS]
    if unshare:
        tests.append((_JEQ, numbers["unshare"], "unshare"))
    tests += [(_JEQ, numbers[name], "flags") for name in SYSCALLS_NO_NAMESPACE]
    # By index: 0 load the arch, 1 another one: kill, 2 load the number, 3... the tests; then
    # allow; "unshare": load the low half of argument 0, exactly the flags allowed: allow, else
    # on to "flags": load it (again), a namespace flag: eperm, allow; "eperm"; "enosys";
    # "kill". A jump's offset counts from the next instruction. The kernel refuses flags in
    # the high half (EINVAL).
    end = 3 + len(tests)
    at = {"unshare": end + 1, "flags": end + 3, "eperm": end + 6, "enosys": end + 7}
    at["kill"] = end + 8
    code = [(_LD_ABS_W, 0, 0, _ARCH), (_JEQ, 0, at["kill"] - 2, audit_arch)]
    code.append((_LD_ABS_W, 0, 0, _NR))
    code += [(op, at[to] - 4 - i, 0, k) for i, (op, k, to) in enumerate(tests)]
    code += [
        (_RET, 0, 0, _ALLOW),
        (_LD_ABS_W, 0, 0, _ARG0_LOW),  # "unshare"
        (_JEQ, 2, 0, unshare),  # to the allow after "flags"
        (_LD_ABS_W, 0, 0, _ARG0_LOW),  # "flags"
        (_JSET, 1, 0, NAMESPACE_FLAGS),  # to "eperm"
        (_RET, 0, 0, _ALLOW),
        (_RET, 0, 0, _ERRNO | EPERM),
        (_RET, 0, 0, _ERRNO | ENOSYS),
        (_RET, 0, 0, _KILL_PROCESS),
    ]
    # struct sock_filter {u16 code; u8 jt, jf; u32 k}, little-endian: one u64 each. Every jump
    # is forward and shorter than 256, as the u8 needs.
    return b"".join(
        (op | jt << 16 | jf << 24 | k << 32).to_bytes(8, "little") for op, jt, jf, k in code
    )


def install(unshare=0):
    """Load the filter into this process, every thread of it (TSYNC) and all it starts from
    then on: a problem in words, or None when the filter is in place. ``unshare``: as for
    :func:`program`."""
    machine = os.uname().machine
    fprog = prepare(machine, unshare)
    if fprog is None:
        if machine in _ARCHES:
            return "no seccomp syscall table for a %d-bit process on %s" % (
                64 if sys.maxsize >= 1 << 32 else 32,
                machine,
            )
        return "no seccomp syscall table for %s" % machine
    number = _ARCHES[machine][1]["seccomp"]
    result, errno = _load(number, fprog)
    if result < 0 and errno == EACCES:
        # Neither CAP_SYS_ADMIN (in our user namespace) nor no_new_privs: the kernel wants the
        # latter. Asking the kernel first spares reading CapEff from /proc/self/status, and
        # keeps set-uid programs working where the capability is there anyway.
        result, errno = shim.c_call("prctl", shim.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if result != 0:
            return "seccomp: no_new_privs: %s" % os.strerror(errno)
        result, errno = _load(number, fprog)
    if result > 0:  # TSYNC: the id of a thread that could not be synchronised
        return "seccomp: thread %d has a filter of its own" % result
    if result != 0:
        return "seccomp: %s" % os.strerror(errno)
    return None


#: (machine, unshare) -> (the C buffer of the program, its struct sock_fprog): made once per
#: process, and by a template before its forks, which find it in the pages they share.
_prepared = {}


def prepare(machine, unshare=0):
    """The filter of :func:`program` in C memory, as the struct sock_fprog that points at it
    (bytes); None where there is no program. Kept: the kernel copies it at each load."""
    key = (machine, unshare)
    if key not in _prepared:
        code = program(machine, unshare)
        if code is None:
            return None
        buffer, address = _c_copy(code)
        # struct sock_fprog: unsigned short len, padding to the pointer, struct sock_filter *.
        fprog = (len(code) // 8).to_bytes(2, "little") + bytes(6) + address.to_bytes(8, "little")
        _prepared[key] = buffer, fprog
    return _prepared[key][1]


def _load(number, fprog):
    flags = _SECCOMP_FILTER_FLAG_TSYNC | _SECCOMP_FILTER_FLAG_SPEC_ALLOW
    result, errno = shim.c_call("syscall", number, _SECCOMP_SET_MODE_FILTER, flags, fprog)
    if result < 0 and errno in (EINVAL, ENOSYS):  # before Linux 4.17 (SPEC_ALLOW), 3.17
        result, errno = shim.c_call("prctl", _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog, 0, 0)
    return result, errno


def _c_copy(data):
    """A C buffer holding ``data``, and its address. Through ctypes' C core, as the shim's
    ``c_function``: importing the ctypes package costs every episode ~1.7 ms. Should that
    private interface change, ctypes itself."""
    try:
        import _ctypes

        class Char(_ctypes._SimpleCData):
            _type_ = "c"

        class Buffer(_ctypes.Array):
            _type_ = Char
            _length_ = len(data)

        buffer = Buffer.from_buffer_copy(data)
        return buffer, _ctypes.addressof(buffer)
    except (ImportError, AttributeError, TypeError, ValueError):
        import ctypes

        buffer = ctypes.create_string_buffer(data, len(data))
        return buffer, ctypes.addressof(buffer)
