"""What the outer process of a preloaded template (``shim_template.watch``) does for the
parent besides watching: asked on LIFE, it mounts a sandboxed fork's own ``/dev/pts``,
``/dev/shm`` and ``/dev/mqueue``.

Each fork of a template with a sandbox makes a mount namespace of its own (shim_parked.py),
but the sandbox's Landlock rules forbid it any mount. The outer process is under neither the
template's syscall filter nor its Landlock rules, holds every capability in the user namespace
the forks' namespaces descend from, and is single-threaded, so it may enter the fork's mount
and IPC namespaces (``setns`` through the fork's pidfd), mount them there
(``shim_world.own_instances``; the mqueue file system is the IPC namespace's its mounter is
in), and come back. Messages, one JSON object per packet:

- parent -> outer: ``{"t": "own_dev"}`` carrying the fork's pidfd;
- outer -> parent: ``{"t": "own_dev", "problem"}`` (``problem`` None once mounted).

EOF on LIFE means the parent is gone. Loaded with ``load_part("outer")``. Standard library
only, Python 3.9+.
"""

import os
import socket
import sys

shim = sys.modules["_isolate_shim"]

#: The namespaces entered to mount the fork's: its mount namespace, and its IPC one, whose
#: message queues its /dev/mqueue shows.
THERE = shim.CLONE_NEWNS | shim.CLONE_NEWIPC


def serve(life, home):
    """Take one message from the parent on ``life`` and do what it asks; False at EOF (the
    parent is gone). ``home``: a pidfd of PID 1 of the template's namespace, whose mount
    namespace is this process's own (None without one)."""
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
            problem = own_dev(fds[0], home) if home is not None else "no PID namespace"
        for fd in fds:
            os.close(fd)
        try:
            shim.wire.send_message(sock, {"t": "own_dev", "problem": problem})
        except OSError:
            return False
        return True
    finally:
        sock.close()


def own_dev(pidfd, home):
    """Mount a devpts, a tmpfs and an mqueue file system on ``/dev/pts``, ``/dev/shm`` and
    ``/dev/mqueue`` in the mount namespace of the process ``pidfd`` names, from inside its mount
    and IPC namespaces, then come back to those of ``home`` (a pidfd too: this process's /proc
    is the namespace's, where it has no number of its own). A problem or None."""
    world = shim.load_part("world")  # from here: the fork's file system may hide this file
    mount = world.mounter()
    result, errno = shim.c_call("setns", pidfd, THERE)
    if result != 0:
        return "setns into the fork's namespaces: " + os.strerror(errno)
    try:
        return world.own_instances(mount)
    finally:
        result, errno = shim.c_call("setns", home, THERE)
        if result != 0:  # nowhere safe to stay: the template ends, and its forks with it
            os._exit(1)
