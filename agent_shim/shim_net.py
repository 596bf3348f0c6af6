"""The episode's own network: entered by the worker before its sandbox, when the sandbox has a
``network`` setting. Loaded with ``load_part("net")``; standard library only, Python 3.9+.

1. A network namespace of the worker's own (with a user namespace too, for a trainer without
   the capabilities): nothing but a loopback interface, so no address of the machine or
   beyond is reachable, by any protocol. Abstract Unix sockets are per namespace as well. A
   template's fork made its own before its hand-over (shim_parked.own_namespaces), and the
   parent checked that it did.
2. The loopback interface up.
3. The listeners the parent asked for (``listen``: ``[address, port]`` pairs, the proxy's
   first), bound here, in the namespace, and handed to the parent over the protocol socket
   (SCM_RIGHTS) with a ``net`` frame: the parent accepts on them, and what it accepts comes
   from inside the namespace. No relay process, no copy here; the worker keeps no listener.
4. The proxy's variables (``env``) in ``os.environ``, for the agent's clients and its
   subprocesses.

``enter(network, channel)`` returns a problem or None;
``probe(...)`` (``shim.py --probe-net``, for doctor) tries steps 1 and 2 and says what failed.
"""

import os
import sys

shim = sys.modules["_isolate_shim"]

CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 1


def enter(network, channel, forked=False):
    """``forked``: in a template's fork, which made its network namespace already (and the
    parent checked that it did)."""
    problem = None if forked else unshare_net()
    if problem is None:
        problem = loopback_up()
    if problem is not None:
        return problem
    import socket

    listeners = []
    try:
        for address, port in network.get("listen", ()):
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            listeners.append(sock)
            try:
                sock.bind((address, port))
                sock.listen(128)
            except OSError as exc:
                return "cannot listen on %s port %d: %s" % (address, port, exc.strerror or exc)
        channel.send_fds("net", [sock.fileno() for sock in listeners])
    finally:
        for sock in listeners:
            sock.close()
    os.environ.update(network.get("env") or {})
    return None


def unshare_net():
    """A network namespace; with a user namespace as well unless this process may make one
    without (root, or already in a user namespace of its own). A problem or None."""
    caps = shim.load_part("worker").capability_sets().get("CapEff", 0)
    needed = 1 << CAP_SYS_ADMIN | 1 << CAP_NET_ADMIN
    userns = caps & needed != needed
    uid, gid = os.getuid(), os.getgid()
    flags = shim.CLONE_NEWNET | (shim.CLONE_NEWUSER if userns else 0)
    result, errno = shim.c_call("unshare", flags)
    if result != 0:
        return "unshare(%s): %s" % ("user+net" if userns else "net", os.strerror(errno))
    return shim.load_part("supervisor").map_own_ids(uid, gid) if userns else None


def loopback_up():
    """``ip link set lo up``, by ioctl. A problem or None."""
    import fcntl
    import socket
    import struct

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        request = struct.pack("16sH22x", b"lo", 0)  # struct ifreq: a name, then the flags
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
    except OSError as exc:
        return "cannot bring the loopback interface up: %s" % (exc.strerror or exc)
    finally:
        sock.close()
    return None


def probe():
    """Exit status 0 if this process can have a network namespace with loopback up."""
    problem = unshare_net() or loopback_up()
    if problem is not None:
        sys.stderr.write(problem + "\n")
        return 1
    return 0
