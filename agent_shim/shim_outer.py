"""The outer process of a preloaded template: the first process of the template, which stays
outside its namespaces, single-threaded, and watches PID 1 (or the importer) and LIFE
(:func:`watch`). At the parent's death it ends the template. Asked on LIFE, it maps a
sandboxed fork's ids and mounts its own ``/dev/pts``, ``/dev/shm`` and ``/dev/mqueue``.

Each fork of a template with a sandbox makes a mount namespace of its own (shim_parked.py),
but the sandbox's Landlock rules forbid it any mount. The outer process is under neither the
template's syscall filter nor its Landlock rules, holds every capability in the user namespace
the forks' namespaces descend from, and is single-threaded, so it may enter the fork's mount
and IPC namespaces (``setns`` through the fork's pidfd), mount them there
(``shim_world.own_instances``; the mqueue file system is the IPC namespace's its mounter is
in), and come back. Messages, one JSON object per packet:

- parent -> outer: ``{"t": "own_dev", "maps", "own"}`` carrying the fork's pidfd; ``maps``
  (an unprivileged trainer's template: [the fork's pid in the template's namespace, uid,
  gid]) asks for the fork's id maps first (:func:`map_ids`), once its namespaces named in
  ``own`` are found to be its own;
- outer -> parent: ``{"t": "own_dev", "problem"}`` (``problem`` None once mounted).

EOF on LIFE means the parent is gone. Loaded with ``load_part("outer")``. Standard library
only, Python 3.9+.
"""

import fcntl
import os
import select
import socket
import sys
from errno import EPERM

shim = sys.modules["_isolate_shim"]
signal = shim.signal

#: The namespaces entered to mount the fork's: its mount namespace, and its IPC one, whose
#: message queues its /dev/mqueue shows.
HOME = {"mnt": shim.CLONE_NEWNS, "ipc": shim.CLONE_NEWIPC}
THERE = sum(HOME.values())  # both at once (each a bit of its own)
#: The namespaces a fork may be asked to have made (``map_ids``).
KINDS = {"mnt", "ipc", "uts", "net"}
#: ioctl(2) on a namespace's fd: an fd of the user namespace that owns it.
NS_GET_USERNS = 0xB701
#: After the parent's death, how long past the episodes' ``cancel_grace`` PID 1 gets to end
#: its namespace before the outer process kills it (seconds).
END_MARGIN = 1.0
OPEN_TREE_CLONE, AT_EMPTY_PATH = 1, 0x1000


def serve(life, home):
    """Take one message from the parent on ``life`` and do what it asks; False at EOF (the
    parent is gone). ``home``: this process's namespaces (:func:`home`), those of the
    template's PID 1 too; empty without a PID namespace."""
    sock = socket.socket(fileno=os.dup(life))
    try:
        try:
            message, fds = shim.wire.receive_message(sock)
        except ValueError:
            return True  # not JSON: nothing asked
        except OSError:
            return False
        if message is None and not fds:
            return False
        problem = "not asked"
        if message is not None and message.get("t") == "own_dev" and len(fds) == 1:
            maps = message.get("maps")
            problem = None if home else "no PID namespace"
            if problem is None and maps is not None:
                problem = map_ids(fds[0], maps, home, message.get("own"))
            if problem is None:
                problem = own_dev(fds[0], home)
        for fd in fds:
            os.close(fd)
        try:
            shim.wire.send_message(sock, {"t": "own_dev", "problem": problem})
        except OSError:
            return False
        return True
    finally:
        sock.close()


def home():
    """This process's mount, IPC and user namespaces, {"mnt": fd, "ipc": fd, "user": fd},
    opened while its /proc is still the machine's (before PID 1 of its namespace mounts
    another). They are this process's alone: its child closes them at once."""
    kinds = (*HOME, "user")
    return {kind: os.open("/proc/self/ns/" + kind, os.O_RDONLY | os.O_CLOEXEC) for kind in kinds}


def leave(home):
    """In the outer process's child: close its namespaces (:func:`home`)."""
    for fd in home.values():
        os.close(fd)


def map_ids(pidfd, maps, home, kinds):
    """Map the ids of the fork ``pidfd`` names, which is dumpable until they are (an
    unprivileged trainer's sandboxed template: shim_parked.own_namespaces), each to itself:
    ``maps`` is [its pid in the template's namespace, uid, gid]. Its namespaces of ``kinds``
    must be its own (:func:`made_by_the_fork`). A problem or None."""
    if not (isinstance(maps, list) and len(maps) == 3 and all(type(n) is int for n in maps)):
        return "no maps asked"
    if not (isinstance(kinds, list) and set(kinds) <= KINDS):
        return "no namespaces named"
    try:
        problem = made_by_the_fork(maps[0], kinds, home)
    except OSError as exc:
        problem = "the fork's namespaces: " + os.strerror(exc.errno)
    if problem is not None:
        return problem
    try:
        proc = writable_proc()
    except OSError as exc:
        return "a writable /proc: " + os.strerror(exc.errno)
    try:

        def opener(name):
            fd = os.open("%d/%s" % (maps[0], name), os.O_WRONLY | os.O_CLOEXEC, dir_fd=proc)
            return os.fdopen(fd, "w")

        problem = shim.load_part("supervisor").map_own_ids(maps[1], maps[2], opener)
    finally:
        os.close(proc)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if poller.poll(0):  # gone: its number may name another process since
        return "the fork is gone"
    return problem


def made_by_the_fork(pid, kinds, home):
    """A problem, or None if the namespaces of ``kinds`` of the process ``pid`` (in the
    template's namespace) were all made in its own user namespace, which is not this
    process's: made by the fork after that, so neither the template's nor a sibling's."""
    where = "/proc/%d/ns/" % pid
    own = os.stat(where + "user").st_ino
    if own == os.fstat(home["user"]).st_ino:
        return "the fork has no user namespace of its own"
    for kind in kinds:
        fd = os.open(where + kind, os.O_RDONLY | os.O_CLOEXEC)
        try:
            owner = fcntl.ioctl(fd, NS_GET_USERNS)
        finally:
            os.close(fd)
        try:
            if os.fstat(owner).st_ino != own:
                return "the fork's %s namespace is not its own" % kind
        finally:
            os.close(owner)
    return None


def writable_proc():
    """A detached copy of this process's /proc (the template's namespace's), writable: the
    sandbox's view made /proc read-only, and the forks' maps are files in it. Its fd, or
    OSError."""
    world = shim.load_part("world")
    nr = shim.load_part("seccomp").SHARED_NUMBERS["open_tree"]
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC
    fd, errno = shim.c_call("syscall", nr, world.AT_FDCWD, b"/proc", flags)
    if fd < 0:
        raise OSError(errno, os.strerror(errno))
    problem = world.mount_setattr("", AT_EMPTY_PATH, 0, world.MOUNT_ATTR_RDONLY, dirfd=fd)
    if problem is not None:
        os.close(fd)
        raise OSError(EPERM, problem)
    return fd


def own_dev(pidfd, home):
    """Mount a devpts, a tmpfs and an mqueue file system on ``/dev/pts``, ``/dev/shm`` and
    ``/dev/mqueue`` in the mount namespace of the process ``pidfd`` names, from inside its mount
    and IPC namespaces, then come back to this process's own (``home``: through a pidfd, the
    kernel would want a ptrace right over it). A problem or None."""
    world = shim.load_part("world")  # from here: the fork's file system may hide this file
    mount = world.mounter()
    result, errno = shim.c_call("setns", pidfd, THERE)
    if result != 0:
        return "setns into the fork's namespaces: " + os.strerror(errno)
    try:
        return world.own_instances(mount)
    finally:
        for kind, flag in HOME.items():
            result, errno = shim.c_call("setns", home[kind], flag)
            if result != 0:  # nowhere safe to stay: the template ends, and its forks with it
                os._exit(1)


def watch(child, life, leaves, below, grace, home):
    """The outer process: exit once ``child`` has. Should the parent go first, end ``child``:
    PID 1, which lets the episodes clean up (``grace``) and ends the whole namespace
    (end_namespace); or, without a namespace (``below``), stop the importer, let its forks
    clean up (``grace``, shim_init.stop_and_cancel), then kill it, its cgroup ``leaves`` and
    every process below it (a subreaper: whatever it started is there), and send its wait
    status on LIFE. Meanwhile, serve the parent's requests on LIFE (shim_outer.py; ``home``:
    this process's namespaces). Never returns."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    pidfd = os.pidfd_open(child) if hasattr(os, "pidfd_open") else None
    poller = select.poll()
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    if life is not None:
        poller.register(life, select.POLLIN)
    status = None
    while status is None:
        ready = [fd for fd, _ in poller.poll(None if pidfd is not None else 100)]
        if pidfd in ready or pidfd is None:
            pid, found = os.waitpid(child, os.WNOHANG)
            if pid == child:
                status = found
                if life is not None and select.select([life], [], [], 0)[0]:
                    if not serve(life, home):  # gone together: what is left goes too
                        kill_leaves(leaves)
                break
        if life in ready and not serve(life, home):
            if below or pidfd is None:
                if below:  # its forks, each a supervisor and its worker, clean up first
                    shim.load_part("init").stop_and_cancel(child, grace)
                kill_all(child, leaves, below)
            else:
                end_namespace(pidfd, grace)
            status = os.waitpid(child, 0)[1]
    if below:
        shim.load_part("init").tell(life, status)
    os._exit(0)


def end_namespace(pidfd, grace):
    """After the parent's death: SIGTERM to PID 1, which cancels the episodes and exits once
    they have ended, ``grace`` seconds at most (shim_init.py); SIGKILL should it still be there
    ``END_MARGIN`` seconds past that. The namespace, and all in it, ends with PID 1."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    except OSError:
        return  # gone already
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if not poller.poll((grace + END_MARGIN) * 1000):
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass  # it exited just now


def kill_leaves(leaves):
    """Kill every process in these cgroup leaves (cgroup v2's ``cgroup.kill``)."""
    for leaf in leaves:
        try:
            with open(os.path.join(leaf, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass  # cgroup v1, or gone already


def kill_all(child, leaves, below):
    """SIGKILL ``child`` and, with ``below``, every process below it (the supervisor's
    ``kill_until_gone`` over its ``live_descendants``, the child stopped first, so that nothing
    new appears below it meanwhile)."""
    kill_leaves(leaves)
    supervisor = shim.load_part("supervisor")
    if not below:
        supervisor.signal_all([child], signal.SIGKILL)
        return

    def find():
        found = supervisor.live_descendants(child)
        return found, not found

    supervisor.kill_until_gone(find, stop=[child])  # the child SIGKILLed last
