"""Landlock for the shim: small wrappers over the kernel's three system calls (Linux 5.13+).

Loaded with ``load_part("landlock")``; standard library only, Python 3.9+. The parent imports
it too (``agent_shim.shim_landlock``, for ``abi()``), so it takes nothing from the shim but
its call into the C library: ``c_call`` where the shim loaded it (``_isolate_shim`` in
sys.modules), else ctypes; ``no_new_privs`` (and ``restrict_self``, which may need it) only
where the shim did. A process
restricts itself, and every process it starts afterwards inherits the restriction; it can never
be lifted. Whatever the ruleset, the kernel refuses a process in a domain ptrace of any process
outside it, and with it ``/proc/PID/mem``, ``cwd``, ``fd/*`` links and ``syscall``; ``environ``,
``maps`` and ``cmdline`` stay readable (Linux 6.18, measured: they are checked differently).

    abi()                                  -> the kernel's ABI version; 0: no Landlock
    errata()                               -> bit mask of the kernel's fixed errata
    create_ruleset(fs=0, net=0, scoped=0)  -> ruleset fd; the access rights it handles
    add_path_rule(ruleset, path, access, follow=True) -> allow ``access`` (FS_*) beneath ``path``
    add_port_rule(ruleset, port, access)   -> allow ``access`` (NET_*) on TCP ``port``
    restrict_self(ruleset, flags=0)        -> enter the domain (sets no_new_privs if needed)
    no_new_privs()                         -> prctl(PR_SET_NO_NEW_PRIVS)
    refused(abi_version, fs, net, scoped)  -> the part of those masks this ABI lacks

Each raises ``OSError`` (with errno) on failure; callers decide what a missing feature means.
Everything handled and not allowed by a rule is denied: an fs mask with no rule denies those
rights everywhere. Rights a kernel's ABI does not know are rejected (EINVAL): mask with
``refused()`` first. ``scoped`` (ABI 6): SCOPE_SIGNAL refuses signals to processes outside the
domain, SCOPE_ABSTRACT_UNIX_SOCKET refuses connecting to abstract unix sockets made outside it.
"""

import os
import sys

# Same numbers on every architecture but alpha (asm-generic table, Linux 5.13).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION, _CREATE_RULESET_ERRATA = 1 << 0, 1 << 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2

# File-system access rights (ABI in which each appeared: 1 unless noted).
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
# TCP access rights (ABI 4).
NET_BIND_TCP = 1 << 0
NET_CONNECT_TCP = 1 << 1
# Scopes (ABI 6).
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1

#: Every right of each kind that an ABI version knows.
FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
NET_BY_ABI = {4: NET_BIND_TCP | NET_CONNECT_TCP}
SCOPED_BY_ABI = {6: SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL}


def _ctypes_call(name, *args):
    import ctypes

    func = getattr(ctypes.CDLL(None, use_errno=True), name)
    return func(*args), ctypes.get_errno()


# The shim's c_call (ints, bytes as ``char *``, None as NULL) spares the import of ctypes,
# which costs every episode ~1.7 ms; the parent, without the shim, uses ctypes.
_shim = sys.modules.get("_isolate_shim")
_call = _ctypes_call if _shim is None else _shim.c_call


def _syscall(number, *args):
    """The structs travel as bytes (little-endian: every Landlock architecture here is)."""
    result, errno = _call("syscall", number, *args)
    if result < 0:
        raise OSError(errno, os.strerror(errno))
    return result


def _u64(*values):
    return b"".join(v.to_bytes(8, "little") for v in values)


def abi():
    """The Landlock ABI version of the running kernel; 0 where it has none or it is off."""
    try:
        return _syscall(_SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    except (OSError, AttributeError):  # ENOSYS, EOPNOTSUPP; no syscall() in this libc
        return 0


def errata():
    """Bit mask of the Landlock errata this kernel has fixed (0 before Linux 6.15)."""
    try:
        return _syscall(_SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_ERRATA)
    except (OSError, AttributeError):
        return 0


def refused(abi_version, fs=0, net=0, scoped=0):
    """``(fs, net, scoped)``: the rights among those given that ``abi_version`` lacks."""

    def known(table):
        return max([mask for version, mask in table.items() if version <= abi_version] or [0])

    return fs & ~known(FS_BY_ABI), net & ~known(NET_BY_ABI), scoped & ~known(SCOPED_BY_ABI)


def create_ruleset(fs=0, net=0, scoped=0):
    """A new ruleset handling these access masks; its fd (close-on-exec). Older kernels take
    only the struct's leading fields: they get no bigger one than the masks need."""
    attr = _u64(fs, net, scoped)[: 24 if scoped else 16 if net else 8]
    return _syscall(_SYS_CREATE_RULESET, attr, len(attr), 0)


def add_path_rule(ruleset, path, access, follow=True):
    """Allow ``access`` (FS_* bits, each handled by the ruleset) beneath ``path``. With
    ``follow=False`` a symlink at ``path`` is not followed: the rule lands on the link itself,
    which grants nothing (a path swapped for a link after it was chosen cannot redirect it)."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        # struct landlock_path_beneath_attr is packed: u64 allowed_access, s32 parent_fd.
        attr = _u64(access) + fd.to_bytes(4, "little", signed=True)
        _syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, attr, 0)
    finally:
        os.close(fd)


def add_port_rule(ruleset, port, access):
    """Allow ``access`` (NET_* bits, each handled by the ruleset) on TCP ``port``."""
    _syscall(_SYS_ADD_RULE, ruleset, _RULE_NET_PORT, _u64(access, port), 0)


def no_new_privs():
    """No exec of this process or its descendants gains privileges (set-uid, file caps)."""
    result, errno = _call("prctl", _shim.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if result != 0:
        raise OSError(errno, os.strerror(errno))


def restrict_self(ruleset, flags=0):
    """Put this thread (and what it starts later) into the ruleset's domain. The kernel wants
    no_new_privs or CAP_SYS_ADMIN for it: without the capability, no_new_privs is set first.
    Call it before starting threads: other threads of the process stay outside."""
    try:
        _syscall(_SYS_RESTRICT_SELF, ruleset, flags)
    except OSError as exc:
        if exc.errno != 1:  # EPERM: neither no_new_privs nor the capability
            raise
        no_new_privs()
        _syscall(_SYS_RESTRICT_SELF, ruleset, flags)
