"""The episode's world, built in PID 1 of its namespaces before anything of the agent runs.

Loaded with ``load_part("world")``; standard library only, Python 3.9+, no side effect at
import. The namespaces themselves are made by the supervisor's ``unshare_namespaces``: PID,
mount, IPC and UTS, the cgroup one for a fresh episode, a user one for an unprivileged
trainer. Here, in the new mount namespace, private and so invisible to the machine:

- ``/proc`` of the PID namespace, so that no process outside it can be named;
- ``/dev`` assembled: a tmpfs with ``null``, ``zero``, ``full``, ``random``, ``urandom`` and
  ``tty`` bound from the machine's, a devpts instance of its own (``/dev/pts``, ``/dev/ptmx``:
  no terminal of the machine's can be opened), a ``/dev/shm`` and a ``/dev/mqueue`` of the
  episode's own, and the ``fd``, ``stdin``, ``stdout``, ``stderr`` links. No disk, no other
  device of the machine's has a name in it;
- with a cgroup namespace, ``/sys/fs/cgroup`` mounted anew, read-only, cgroup v2 only: the
  episode's leaf is its root, and no cgroup above it can be named (the kernel refuses a move
  out of the namespace's root anyway);
- the kernel's files that act on the whole machine out of reach, as in Docker: ``/sys``
  read-only, ``/proc/sys``, ``/proc/sysrq-trigger``, ``/proc/irq``, ``/proc/bus`` and
  ``/proc/fs`` read-only, ``/proc/kcore``, ``/proc/keys``, the timer lists and the firmware
  tables masked.

``build(cgroupns)`` returns a problem in words, or None. The C library is called through the
shim's ``c_call`` (ints, bytes, None), which spares the import of ctypes.
"""

import os
import sys
from errno import ENOSYS

shim = sys.modules["_isolate_shim"]

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 0x4000, 0x40000
O_PATH = getattr(os, "O_PATH", 0o10000000)

#: The device nodes an episode finds in its /dev, bound from the machine's.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
#: Links in /dev, as a system's udev makes them.
LINKS = (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
)
QUIET = MS_NOSUID | MS_NODEV | MS_NOEXEC
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs flags with the same meaning as mount flags. A remount must repeat those the mount
# has (in a user namespace they are locked: leaving one out is EPERM).
_KEPT = ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC))
_KEPT += ((1024, MS_NOATIME), (2048, MS_NODIRATIME), (4096, MS_RELATIME))
# mount_setattr(2), Linux 5.12 (its number: the seccomp part's table, the same on x86_64 and
# aarch64).
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
#: Files of /proc that act on the whole machine: read-only, as Docker and bubblewrap keep them.
READ_ONLY_PROC = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
#: What Docker masks: the kernel's memory, keys and timers, firmware tables.
MASKED = (
    "/proc/kcore",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/latency_stats",
    "/proc/acpi",
    "/proc/asound",
    "/proc/scsi",
    "/sys/firmware",
)


def build(cgroupns, guard=True):
    """Mount the episode's /proc, /dev and cgroup view, and (``guard``) make the kernel's
    files read-only; a problem or None."""
    mount = mounter()
    problem = mount(None, b"/", None, MS_REC | MS_PRIVATE)
    problem = problem or mount(b"proc", b"/proc", b"proc", QUIET)
    if problem is not None:
        return "cannot mount a private /proc: " + problem
    problem = private_dev(mount)
    if problem is not None:
        return "cannot assemble a private /dev: " + problem
    problem = cgroup_view(mount) if cgroupns else None
    if problem is not None:
        return "cannot mount a read-only view of the episode's cgroup: " + problem
    problem = guard_kernel_files(mount) if guard else None
    if problem is not None:
        return "cannot make the kernel's files read-only: " + problem
    return None


def guard_kernel_files(mount):
    """/sys read-only, /proc's files of the machine read-only or masked; a problem or None."""
    for path in READ_ONLY_PROC:
        if os.path.lexists(path):
            target = path.encode()
            problem = mount(target, target, None, MS_BIND) or remount_read_only(mount, target)
            if problem is not None:
                return problem
    for path in MASKED:
        if os.path.isdir(path) and not os.path.islink(path):
            problem = mount(b"tmpfs", path.encode(), b"tmpfs", QUIET | MS_RDONLY, b"size=0")
        elif os.path.lexists(path):
            problem = mount(b"/dev/null", path.encode(), None, MS_BIND)
        else:
            continue
        if problem is not None:
            return problem
    if not os.path.isdir("/sys"):
        return None
    problem = mount_setattr("/sys", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)
    if problem is not None and problem.endswith(os.strerror(ENOSYS)):
        # Before Linux 5.12: /sys itself; its submounts stay as they are.
        return remount_read_only(mount, b"/sys")
    return problem


def remount_read_only(mount, path):
    """Make the mount at ``path`` read-only, repeating the flags it has; a problem or None.
    ``mount``: a :func:`mounter`, or one like it taking ``path``'s type."""
    kept = os.statvfs(path).f_flag
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY
    for bit, flag in _KEPT:
        if kept & bit:
            flags |= flag
    return mount(None, path, None, flags)


def mount_setattr(path, flags, attr_set, attr_clr, dirfd=AT_FDCWD):
    """mount_setattr(2) on ``path`` (from ``dirfd``): set and clear MOUNT_ATTR_* flags; a
    problem or None."""
    attr = b"".join(x.to_bytes(8, "little") for x in (attr_set, attr_clr, 0, 0))
    nr = shim.load_part("seccomp").SHARED_NUMBERS["mount_setattr"]
    target = os.fsencode(path)
    result, errno = shim.c_call("syscall", nr, dirfd, target, flags, attr, len(attr))
    if result != 0:
        return "mount_setattr %s: %s" % (path, os.strerror(errno))
    return None


def mounter():
    """mount(2) through the shim's ``c_call``, with bytes arguments: a problem in words, or
    None."""

    def mount(source, target, fstype, flags, data=None):
        result, errno = shim.c_call("mount", source, target, fstype, flags, data)
        return None if result == 0 else "%s: %s" % (target.decode(), os.strerror(errno))

    return mount


def cgroup_namespace():
    """A cgroup namespace rooted at this process's cgroup, its read-only view over
    /sys/fs/cgroup and the kernel's files read-only (in the mount namespace this process shares
    with its PID 1): a template's importer, once in its leaf. A problem or None."""
    result, errno = shim.c_call("unshare", shim.CLONE_NEWCGROUP)
    if result != 0:
        return "unshare(cgroup): " + os.strerror(errno)
    mount = mounter()
    problem = cgroup_view(mount)
    if problem is not None:
        return "cannot mount a read-only view of the template's cgroup: " + problem
    problem = guard_kernel_files(mount)
    if problem is not None:
        return "cannot make the kernel's files read-only: " + problem
    return None


def private_dev(mount):
    """A tmpfs over /dev with the few nodes an agent needs; a problem or None."""
    if not os.path.isdir("/dev"):
        return None
    nodes = {}
    try:
        for name in DEVICES:
            try:
                nodes[name] = os.open("/dev/" + name, O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                pass  # a machine without it: neither has the episode
        problem = mount(b"tmpfs", b"/dev", b"tmpfs", MS_NOSUID | MS_NOEXEC, b"mode=755,size=64k")
        if problem is not None:
            return problem
        for name, fd in nodes.items():
            target = b"/dev/" + name.encode()
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o666))
            # The machine's node, by the fd opened before /dev was covered.
            problem = mount(b"/proc/self/fd/%d" % fd, target, None, MS_BIND)
            if problem is not None:
                return problem
    finally:
        for fd in nodes.values():
            os.close(fd)
    for name in ("pts", "shm", "mqueue"):
        os.mkdir("/dev/" + name, 0o755)
    problem = own_instances(mount)
    if problem is not None:
        return problem
    for name, target in LINKS:
        os.symlink(target, "/dev/" + name)
    return None


def own_instances(mount):
    """A devpts (``/dev/pts``, whose ``ptmx`` ``/dev/ptmx`` links to), a ``/dev/shm`` (tmpfs)
    and a ``/dev/mqueue`` (of the IPC namespace this process is in) of this mount namespace's
    own, over what is there (a template's fork gets its own too: shim_parked.py,
    shim_outer.py); a problem or None. A kernel without POSIX message queues has no mqueue
    file system: that one is left out."""
    options = b"newinstance,ptmxmode=0666,mode=620"
    problem = mount(b"devpts", b"/dev/pts", b"devpts", MS_NOSUID | MS_NOEXEC, options)
    problem = problem or mount(b"tmpfs", b"/dev/shm", b"tmpfs", QUIET, b"mode=1777")
    if problem is None:
        mount(b"mqueue", b"/dev/mqueue", b"mqueue", QUIET)
    return problem


def cgroup_view(mount):
    """Over /sys/fs/cgroup, read-only: cgroup v2 where the machine has it (there, or at
    ``unified`` on a hybrid host, in an empty tmpfs that hides the v1 trees). A problem or
    None."""
    top = "/sys/fs/cgroup"
    if not os.path.isdir(top):
        return None
    with open("/proc/self/mounts") as f:
        points = [fields[1] for fields in map(str.split, f) if fields[2] == "cgroup2"]
    points = [p for p in points if p == top or p.startswith(top + "/")]
    view = b"cgroup2", b"cgroup2", QUIET | MS_RDONLY
    if top in points:
        return mount(view[0], top.encode(), view[1], view[2])
    problem = mount(b"tmpfs", top.encode(), b"tmpfs", QUIET, b"mode=755,size=4k")
    for point in points if problem is None else ():
        os.makedirs(point, 0o555, exist_ok=True)
        problem = problem or mount(view[0], point.encode(), view[1], view[2])
    return problem or mount(None, top.encode(), None, MS_BIND | MS_REMOUNT | QUIET | MS_RDONLY)
