"""The shim's probes of what this machine provides, run by the parent in a short-lived shim
(``shim.py --probe-pidns [userns]``, ``--probe-landlock``) and never on an episode's path.

Loaded by shim.py, under its private name, only for a probe. Stdlib only, Python 3.9+.
"""

import os
import sys

shim = sys.modules["_isolate_shim"]


def pidns(userns):
    """``shim.py --probe-pidns [userns]``: can this machine give an episode a PID namespace?"""
    supervisor = shim.load_part("supervisor")
    problem = supervisor.unshare_namespaces(userns)
    if problem is None:
        pid = os.fork()
        if pid == 0:
            problem = supervisor.become_init() or (None if os.getpid() == 1 else "not PID 1")
            sys.stderr.write(problem + "\n" if problem else "")
            shim.leave(1 if problem else 0)
        return 0 if os.waitpid(pid, 0)[1] == 0 else 1
    sys.stderr.write(problem + "\n")
    return 1


def landlock():
    """``shim.py --probe-landlock``: can this machine give an episode the landlock layer? Says
    ``abi N`` and whether the domain can still read its parent's environ, on stdout."""
    version = shim.load_part("landlock").abi()
    sys.stdout.write("abi %d\n" % version)
    if version < 6:
        why = (
            "the kernel has no Landlock (or it is off)"
            if version == 0
            else ("Landlock ABI %d has no scoped signals (ABI 6, Linux 6.12, needed)" % version)
        )
        sys.stderr.write(why + "\n")
        return 1
    read_r, read_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_r)
        problem = shim.load_part("worker").enter_landlock()
        if problem is None:
            try:
                os.kill(os.getppid(), 0)
                problem = "a signal from a scoped domain reached a process outside it"
            except PermissionError:
                pass
        try:
            with open("/proc/%d/environ" % os.getppid(), "rb"):
                os.write(read_w, b"environ readable\n")
        except OSError:
            os.write(read_w, b"environ refused\n")
        sys.stderr.write(problem + "\n" if problem else "")
        shim.leave(1 if problem else 0)
    os.close(read_w)
    with os.fdopen(read_r) as f:
        sys.stdout.write(f.read())
    return 0 if os.waitpid(pid, 0)[1] == 0 else 1
