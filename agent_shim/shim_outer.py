"""What the outer process of a preloaded template (``shim_template.watch``) does for the
parent besides watching: asked on LIFE, it mounts a sandboxed fork's own ``/dev/shm``.

Each fork of a template with a sandbox makes a mount namespace of its own (shim_parked.py),
but the sandbox's Landlock rules forbid it any mount. The outer process is under neither the
template's syscall filter nor its Landlock rules, holds every capability in the user namespace
the forks' namespaces descend from, and is single-threaded, so it may enter the fork's mount
namespace (``setns`` through the fork's pidfd), mount a tmpfs on ``/dev/shm`` there, and come
back. Messages, one JSON object per packet:

- parent -> outer: ``{"t": "dev_shm"}`` carrying the fork's pidfd;
- outer -> parent: ``{"t": "dev_shm", "problem"}`` (``problem`` None once mounted).

EOF on LIFE means the parent is gone. Loaded with ``load_part("outer")``. Standard library
only, Python 3.9+.
"""

import os
import socket
import sys

shim = sys.modules["_isolate_shim"]


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
        if message is not None and message.get("t") == "dev_shm" and len(fds) == 1:
            problem = dev_shm(fds[0], home) if home is not None else "no PID namespace"
        for fd in fds:
            os.close(fd)
        try:
            shim.wire.send_message(sock, {"t": "dev_shm", "problem": problem})
        except OSError:
            return False
        return True
    finally:
        sock.close()


def dev_shm(pidfd, home):
    """Mount a tmpfs on ``/dev/shm`` in the mount namespace of the process ``pidfd`` names,
    from inside it, then come back to that of ``home`` (a pidfd too: this process's /proc is
    the namespace's, where it has no number of its own). A problem or None."""
    world = shim.load_part("world")  # from here: the fork's file system may hide this file
    mount = world.mounter()
    result, errno = shim.c_call("setns", pidfd, shim.CLONE_NEWNS)
    if result != 0:
        return "setns into the fork's mount namespace: " + os.strerror(errno)
    try:
        return mount(b"tmpfs", b"/dev/shm", b"tmpfs", world.QUIET, b"mode=1777")
    finally:
        result, errno = shim.c_call("setns", home, shim.CLONE_NEWNS)
        if result != 0:  # nowhere safe to stay: the template ends, and its forks with it
            os._exit(1)
