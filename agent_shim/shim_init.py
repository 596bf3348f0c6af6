"""PID 1 of a preloaded template's PID namespace (``shim_template.py``), and how a template's
process tells the parent the importer's wait status (on LIFE).

PID 1 reaps, reports the importer's end (and, once the importer is gone, the end of each fork
and orphan it reaps, with its pid here: the parent knows its forks by it), and exits once no
process is left. Should the parent
die, the template's outer process sends it SIGTERM: it cancels every episode forked from the
template as the parent would (SIGINT, then SIGCONT), waits for them to exit for at most the
template's ``cancel_grace``, and exits, which ends the namespace (the kernel kills what is
left). A SIGTERM sent from inside the namespace is ignored: only one from outside it (its
sender's pid reads 0 here) counts. Without a PID namespace the outer process does the same
itself (stop_and_cancel), the importer stopped meanwhile, then kills all below it.

Loaded by the template with ``load_part("init")``. Standard library only, Python 3.9+.
"""

import math
import os
import select
import socket
import sys
import time

shim = sys.modules["_isolate_shim"]
signal = shim.signal
send = shim.wire.send_message


def grace_of(message):
    """The ``cancel_grace`` of the template's preload message, in seconds (0 when absent)."""
    grace = message.get("cancel_grace")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)):
        return 0.0
    return float(grace) if math.isfinite(grace) and grace > 0 else 0.0


def tell(life, status, **more):
    """Send the importer's wait status to the parent (on LIFE); with ``pid`` and ``cpu_s`` in
    ``more``, another process's."""
    if life is not None:
        sock = socket.socket(fileno=os.dup(life))
        sock.setblocking(False)  # a parent that reads no more never holds PID 1's reaping up
        try:
            send(sock, dict({"t": "exit", "status": status}, **more))
        except OSError:
            pass  # the parent is gone, or its socket full
        finally:
            sock.close()


def init(importer, life, grace):
    """PID 1 of the template's namespace: report the importer's end, reap, and exit once no
    process is left; on SIGTERM from outside the namespace, cancel the episodes first
    (``grace`` seconds at most). Never returns."""
    # Blocked, so taken by sigwaitinfo only: and a blocked signal reaches PID 1 even without a
    # handler. The importer, forked before, does not inherit the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD, signal.SIGTERM])
    while True:
        if not reap(importer, life):
            os._exit(0)
        info = signal.sigwaitinfo([signal.SIGCHLD, signal.SIGTERM])
        if info.si_signo == signal.SIGTERM and info.si_pid == 0:
            cancel_episodes((1, importer), grace, lambda: reap(importer, life))
            os._exit(0)  # the namespace ends with PID 1: the kernel kills what is left


def reap(importer, life):
    """Reap every child that has exited, telling the parent of its end: the importer's, and
    once the importer is gone, those of its forks and what else comes here (the parent knows
    its forks by their pids here: a fork that is its own worker has no one else to report
    it). False once no child is left."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        except InterruptedError:
            continue
        if pid == 0:
            return True
        if pid == importer:
            tell(life, status)
        else:
            tell(life, status, pid=pid, cpu_s=usage.ru_utime + usage.ru_stime)


def stop_and_cancel(importer, grace):
    """Without a PID namespace, in the outer process once the parent is gone: stop the
    importer (it neither forks nor exits meanwhile: its forks stay its children), then cancel
    its forks as PID 1 does. The outer process kills all below the importer after."""
    try:
        os.kill(importer, signal.SIGSTOP)  # its child: the pid is not reused before the wait
    except OSError:
        return
    cancel_episodes((importer,), grace, lambda: None)


def cancel_episodes(parents, grace, reap):
    """Send each episode fork (see episode_forks) SIGINT, then SIGCONT (a stopped one wakes
    with it pending), and wait until all have exited, ``grace`` seconds at most, calling
    ``reap`` meanwhile. ``grace`` 0: none is cancelled, as a fresh episode with
    ``cancel_grace=0`` is not."""
    if grace <= 0:
        return
    end = time.monotonic() + grace
    poller = select.poll()
    waiting = set()
    for pid in episode_forks(parents):
        pidfd = open_fork(pid, parents)
        if pidfd is None:
            continue
        for sig in (signal.SIGINT, signal.SIGCONT):
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except OSError:
                pass  # it exited meanwhile
        poller.register(pidfd, select.POLLIN)
        waiting.add(pidfd)
    while waiting:
        reap()
        left = end - time.monotonic()
        if left <= 0:
            return
        # A short step: this process's own children are reaped as they end.
        for pidfd, _ in poller.poll(min(left, 0.05) * 1000):
            poller.unregister(pidfd)
            waiting.discard(pidfd)
            os.close(pidfd)


def episode_forks(parents):
    """The pids of the template's forks: the children of ``parents`` (the importer; with a
    PID namespace also its PID 1, their parent once the importer is gone) that lead a session
    of their own, as a fork does from its start. Any other process there that leads a session
    of its own is among them, and gets the same SIGINT and wait: one the agent's code started
    in the template, or a daemon an episode left to the importer (a fork that is its own
    worker leaves its orphans there). That costs at most the wait: nothing holds the namespace
    past ``cancel_grace``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and is_fork(int(entry), parents):
            found.append(int(entry))
    return found


def is_fork(pid, parents):
    """Whether ``pid`` is a fork of the template now (see episode_forks)."""
    if pid in parents:
        return False
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    # After the command: state, ppid, process group, session.
    return int(fields[1]) in parents and int(fields[3]) == pid


def open_fork(pid, parents):
    """A pidfd of the fork ``pid``, checked once open (its number could have been reused
    since the scan); None if it is gone or not a fork."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    if is_fork(pid, parents):
        return pidfd
    os.close(pidfd)
    return None
