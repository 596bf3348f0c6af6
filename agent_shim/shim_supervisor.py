"""The supervisor: the shim's process that outlives the worker and ends the episode.

It reaps what is re-parented to it, waits for the worker's exit, the deadline, a cancel
request, SIGTERM or the parent's death, cancels the agent first where it must, then kills
every process left below it and sends ``done``. Loaded with ``load_part("supervisor")``.
Standard library only, Python 3.9+.
"""

import os
import select
import sys
import time

shim = sys.modules["_isolate_shim"]
signal = shim.signal


# --- containment: the cgroups, the PID namespace --------------------------------------------


def contain(hs):
    """Join the episode's cgroups; with pidns, fork PID 1 of a new PID namespace, and turn this
    process into a relay. Returns a problem, or None in the process that carries on. A
    template's fork (``forked``) lives in its template's namespaces already, and the parent
    moved it into its leaf before the handshake (the template's cgroup view does not show the
    machine's tree). With ``pid1`` the parent started this process as PID 1 of a PID
    namespace of its own: it makes the other namespaces and needs no relay."""
    if hs.get("forked"):
        return None
    problem = join_cgroups(hs.get("cgroups", ()))
    if problem is not None or "pidns" not in shim.layers_of(hs):
        return problem
    if hs.get("pid1"):
        if os.getpid() != 1:
            return "the parent's PID namespace: this process is not its PID 1"
        problem = unshare_namespaces(False, cgroupns=True, pid=False)
        return problem or become_init(cgroupns=True, relayed=False)
    problem = unshare_namespaces(hs.get("userns", False), cgroupns=True)
    if problem is not None:
        return problem
    pid = os.fork()
    if pid:
        relay(pid)  # exits
    return become_init(cgroupns=True)


def join_cgroups(paths):
    """Be in each of these cgroup directories before creating any process; a problem or None."""
    me = str(os.getpid())
    for path in paths:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                if me in f.read().split():
                    continue  # the parent moved us in already
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(me)
        except OSError as exc:
            return "cannot join cgroup %s: %s" % (path, exc.strerror or exc)
    return None


def unshare_namespaces(userns, cgroupns=False, pid=True):
    """New PID (unless not ``pid``: this process is PID 1 of one already), mount, IPC and UTS
    namespaces (and a user one with ``userns``; a cgroup one with ``cgroupns``, rooted at the
    cgroup this process is in: join the leaf first). A problem or None."""
    uid, gid = os.getuid(), os.getgid()
    flags = shim.CLONE_NEWNS | shim.CLONE_NEWIPC | shim.CLONE_NEWUTS
    flags |= (shim.CLONE_NEWPID if pid else 0) | (shim.CLONE_NEWUSER if userns else 0)
    flags |= shim.CLONE_NEWCGROUP if cgroupns else 0
    result, errno = shim.c_call("unshare", flags)
    if result != 0:
        return "unshare(%s%s+mount+ipc+uts%s): %s" % (
            "user+" if userns else "",
            "pid" if pid else "",
            "+cgroup" if cgroupns else "",
            os.strerror(errno),
        )
    return map_own_ids(uid, gid) if userns else None


def map_own_ids(uid, gid, opener=None):
    """In a user namespace just made: map our own ids to themselves, so that files the agent
    writes keep the caller's ownership. ``opener(name)``: a file of /proc/PID open for
    writing, for another process in it (the template's outer process maps a sandboxed
    fork's, which is dumpable meanwhile). A problem or None."""
    # The files of a process that is not dumpable belong to root: dumpable just for the opens
    # (what was opened stays writable), then at once not again.
    maps = (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)))
    maps += (("gid_map", "%d %d 1" % (gid, gid)),)
    files, problem = [], None
    if opener is None:
        shim.c_call("prctl", shim.PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        for name, _ in maps:
            files.append(opener(name) if opener else open("/proc/self/" + name, "w"))
    except OSError as exc:
        problem = exc
    finally:
        if opener is None:
            shim.c_call("prctl", shim.PR_SET_DUMPABLE, 0, 0, 0, 0)
    for i, f in enumerate(files):
        try:
            with f:
                if problem is None:
                    f.write(maps[i][1])
        except OSError as exc:
            problem = problem or exc
    if problem is not None:
        return "cannot map ids in the user namespace: %s" % (problem.strerror or problem)
    return None


def become_init(cgroupns=False, guard=True, relayed=True):
    """In PID 1 of the new namespace: die with the relay (``relayed``); build the episode's
    world (a /proc that shows only the namespace, or the supervisor's scan of /proc would see
    the whole machine; a /dev of its own; the cgroup view; with ``guard``, the kernel's files
    read-only): shim_world.py. A problem or None."""
    if relayed:
        shim.c_call("prctl", shim.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return shim.load_part("world").build(cgroupns, guard)


def relay(child):
    """The outer half of a PID namespace: pass SIGTERM on to PID 1, exit as it exits."""
    pidfd = os.pidfd_open(child) if hasattr(os, "pidfd_open") else None

    def forward(*_):
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            else:
                os.kill(child, signal.SIGTERM)
        except OSError:
            pass  # PID 1 is gone already

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if os.WIFSIGNALED(status):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # whose action is always the default, and cannot be set
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


# --- supervision ------------------------------------------------------------------------------


def process_table():
    """Map pid -> (ppid, state) for every process, from /proc; empty where there is no /proc."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        stat = read_stat("/proc/%s/stat" % name)
        if stat is None:
            continue
        # The command name may hold spaces and parentheses: split after the last ')'.
        rest = stat[stat.rfind(b")") + 2 :].split()
        table[int(name)] = (int(rest[1]), rest[0].decode())
    return table


def read_stat(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def has_live_thread(pid):
    """Whether a thread of ``pid`` can still run. A process whose main thread exited
    (``pthread_exit``) reads as a zombie while its other threads run on."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return False
    for tid in tids:
        stat = read_stat("/proc/%d/task/%s/stat" % (pid, tid))
        if stat is not None and stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in b"ZXx":
            return True
    return False


def live_descendants(root):
    table = process_table()
    children = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], list(children.get(root, ()))
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, ()))
        if table[pid][1] not in "ZX" or has_live_thread(pid):
            found.append(pid)
    return found


def reap(worker_pid, status):
    """Reap every exited child. Returns the worker's (wait status, CPU seconds) once known, and
    whether no child at all is left."""
    while True:
        try:
            pid, code, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return status, True
        if pid == 0:
            return status, False
        if pid == worker_pid:
            status = (code, usage.ru_utime + usage.ru_stime)


def told(said):
    """The worker's (wait status, CPU seconds) from the last ``exit CODE CPU_S`` line it wrote
    on the exit pipe, or None."""
    fields = said[said.rfind(b"exit ") :].split() if said.endswith(b"\n") else ()
    try:
        code, cpu_s = int(fields[1]), float(fields[2])
    except (IndexError, ValueError):
        return None
    ok = len(fields) == 3 and 0 <= code <= 255 and 0 <= cpu_s < shim.INF
    return (code << 8, cpu_s) if ok else None  # a wait status: exited with code


def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


# --- killing: the child side's one loop "until nothing is left" --------------------------------

#: After the grace, how long SIGKILL rounds go on before the rest is left to the parent's sweep,
#: or, as PID 1 of a namespace, to the kernel (seconds).
KILL_WAIT = 5.0
#: The pause between two rounds: the first, doubled each round up to the longest (seconds).
POLL_FIRST, POLL_MAX = 0.002, 0.02
#: After the parent's pipe closes, survivors get at most this long after SIGTERM (seconds):
#: the parent promises its tree is gone within cancel_grace + 2 s of its own death.
PARENT_GONE_GRACE = 1.0


def kill_until_gone(find, stop=(), grace=0.0, pause=None):
    """Kill what ``find()`` lists until it says the rest is gone. Returns the set of pids it
    signalled (``stop`` not counted) and whether nothing was left.

    - ``find()`` returns ``(pids, gone)``: the processes still alive, and whether nothing is
      left (it may reap, and say not gone while it lists none: a child not reaped yet);
    - ``stop``: SIGSTOPped before the first round, SIGKILLed after the last: processes below
      which new ones could appear meanwhile;
    - for ``grace`` seconds, each process found gets SIGTERM then SIGCONT (a stopped one wakes
      with SIGTERM pending), once; after them every one found gets SIGKILL, each round;
    - rounds end ``grace`` + KILL_WAIT seconds after the start at most: what is still there
      is stuck in the kernel (D state), or cannot be reaped;
    - between two rounds it waits POLL_FIRST seconds, doubled each round up to POLL_MAX:
      ``time.sleep``, or ``pause(seconds)``, which may return an earlier end of the grace
      (``time.monotonic()``), else None.
    """
    signal_all(stop, signal.SIGSTOP)
    victims, gone = set(), False
    end = time.monotonic() + grace
    delay = POLL_FIRST
    while True:
        live, gone = find()
        now = time.monotonic()
        if gone or now > end + KILL_WAIT:
            break
        fresh = [pid for pid in live if pid not in victims]
        victims.update(fresh)
        if now < end:
            signal_all(fresh, signal.SIGTERM)
            signal_all(fresh, signal.SIGCONT)  # after: a stopped process meets SIGTERM pending
        else:
            signal_all(live, signal.SIGKILL)
        sooner = pause(delay) if pause is not None else time.sleep(delay)
        if sooner is not None:
            end = min(end, sooner)
        delay = min(delay * 2, POLL_MAX)
    signal_all(stop, signal.SIGKILL)
    return victims, gone


def kill_tree(worker_pid, status, grace, reaper, parent_fd=None, told_status=None):
    """Kill every descendant (``kill_until_gone``: SIGTERM for ``grace`` seconds, then SIGKILL)
    and reap everything; with the parent's pipe ``parent_fd`` at EOF the grace ends within
    PARENT_GONE_GRACE; ``told_status``: :func:`told`'s. Returns (signalled, worker's status)."""
    status, clear = reap(worker_pid, status)
    if clear and reaper:
        # Every orphan below a subreaper (or PID 1) is re-parented to it, with its exit signal
        # reset to SIGCHLD, so a reaper that wait4() finds childless has no descendants at all:
        # no need to read /proc.
        return 0, status
    me, statuses = os.getpid(), [status]

    def find():
        # Reap the dead too: an unreaped zombie's own children would be handed to init.
        statuses[0], clear = reap(worker_pid, statuses[0])
        live = live_descendants(me)
        if told_status is not None:  # no survivor: the kernel reaps it with PID 1
            live = [pid for pid in live if pid != worker_pid]
        return live, (clear or told_status is not None) and not live

    pause = None if parent_fd is None else watching_parent(parent_fd)
    victims, _ = kill_until_gone(find, grace=grace, pause=pause)
    return len(victims), statuses[0]


def watching_parent(fd):
    """A ``pause`` for kill_until_gone that reads the parent's pipe meanwhile; at its EOF, the
    end of the grace PARENT_GONE_GRACE seconds later."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    watched = [fd]

    def pause(seconds):
        if not watched:
            time.sleep(seconds)
            return None
        for _ in poller.poll(seconds * 1000):
            if parent_eof(fd):
                watched.clear()
                return time.monotonic() + PARENT_GONE_GRACE
        return None

    return pause


def parent_eof(fd):
    """Read what the parent sent (a cancel request, ignored this late); True at EOF."""
    try:
        return not os.read(fd, 4096)
    except BlockingIOError:
        return False
    except OSError:
        return True


class Supervisor:
    """The supervisor's side of one episode: the wake pipe its signal handlers write to, the
    pipe on which the worker says that its final frame is out, and the parent's pipe.

    Made before the fork (its handlers and the blocked SIGINT are the worker's to undo, with
    :meth:`as_worker`); after it, :meth:`run` supervises and exits.
    """

    def __init__(self, parent_fd, pending):
        self.parent_fd = parent_fd
        self.pending = pending  # what came after the handshake: a cancel request, maybe
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.exit_r, self.exit_w = os.pipe()  # the worker writes a byte once its frame is out
        self.flags = {}
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self.flags.update(terminated=True))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closing terminal is not our business
        # SIGINT is how the worker is cancelled; the supervisor never takes it. Blocked before
        # the fork, so that one sent before the worker has set its handler waits for it.
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])

    def as_worker(self):
        """In the worker, at once after the fork: the supervisor's handlers and fds gone. The
        fd to write one byte to once the final frame is out (PID 1 also reads :func:`told`)."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        for fd in (self.wake_r, self.wake_w, self.parent_fd, self.exit_r):
            os.close(fd)
        return self.exit_w

    def run(self, hs, channel, worker_pid, reaper):
        """Wait for the worker to exit (bounded by ``exit_grace`` once it said its final frame
        is out), for the deadline, a cancel request, SIGTERM or the parent's death; at an early
        end cancel the agent first (``cancel_grace``); then kill the tree and send ``done``.
        ``reaper``: this process is a subreaper or PID 1. Never returns."""
        os.close(self.exit_w)
        self.worker_pid = worker_pid
        grace = float(hs.get("kill_grace", 5.0))
        status, why, exiting, told_status = self._wait(hs)
        if why in ("terminated", "parent gone"):
            grace = min(grace, PARENT_GONE_GRACE)
        cancel_grace = float(hs.get("cancel_grace", 0.0))
        if why not in ("exited", "terminated") and not exiting and cancel_grace > 0:
            status = self._cancel(channel, status, cancel_grace, tell=why != "parent gone")
        watch = None if why == "parent gone" else self.parent_fd
        killed, status = kill_tree(worker_pid, status, grace, reaper, watch, told_status)
        if why == "parent gone":
            os._exit(0)  # nobody to report to; skip the interpreter shutdown
        try:
            channel.send("done", **done_frame(why, killed, status))
        except OSError:
            pass
        # The report is out: skip interpreter finalisation, which costs every episode ~20 ms.
        shim.leave(0 if why == "exited" else 3)

    def _wait(self, hs):
        """Until the episode ends: the worker's (wait status, CPU seconds) or None, why it
        ended (``exited``, ``deadline``, ``cancelled``, ``terminated``, ``parent gone``),
        whether the worker's final frame was out, and the status it told (:func:`told`)."""
        deadline = time.monotonic() + float(hs.get("deadline", 1e9))
        exit_grace = float(hs.get("exit_grace", 10.0))
        poller = select.poll()
        for fd in (self.parent_fd, self.wake_r, self.exit_r):
            poller.register(fd, select.POLLIN)
        status, why = None, "cancelled" if shim.CANCEL in self.pending else "exited"
        exit_by = None  # when the worker's normal exit must be over (monotonic)
        exiting = False  # the worker's final frame is out: nothing left to cancel
        told_status = None  # the worker's status as it told PID 1, not yet reaped maybe
        while why == "exited":
            status, _ = reap(self.worker_pid, status)
            if status is not None:
                break
            if self.flags.get("terminated"):
                why = "terminated"
                break
            now = time.monotonic()
            if exit_by is not None and now >= exit_by:
                sys.stderr.write(
                    "isolate shim: the agent's exit took longer than exit_grace (%g s): killed; "
                    "its result stands\n" % exit_grace
                )
                signal_all([self.worker_pid], signal.SIGKILL)
                exit_by = None
            remaining = deadline - now
            if remaining <= 0 and not exiting:
                # Once the final frame is out, the result stands: exit_grace bounds the rest.
                why = "deadline"
                break
            if exiting:
                remaining = 3600.0  # past the deadline too: exit_by decides
            if exit_by is not None:
                remaining = min(remaining, exit_by - now)
            for fd, _ in poller.poll(min(remaining, 3600.0) * 1000):
                if fd == self.wake_r:
                    drain(self.wake_r)
                elif fd == self.exit_r:
                    said = os.read(self.exit_r, 64)
                    if not said:
                        poller.unregister(self.exit_r)  # EOF: the worker is gone
                    elif not exiting:
                        exiting, exit_by = True, time.monotonic() + exit_grace
                    if said and os.getpid() == 1 and status is None:
                        status = told_status = told(said)
                else:
                    data = os.read(self.parent_fd, 4096)
                    if not data:
                        why = "parent gone"
                        poller.unregister(self.parent_fd)
                    elif shim.CANCEL in data:
                        why = "cancelled"
        return status, why, exiting, told_status

    def _cancel(self, channel, status, grace, tell):
        """Cancel first: the agent releases its sandboxes in its own finally: blocks. The
        worker's status, once it exited; ``tell``: send how its clean-up went."""
        status, _ = reap(self.worker_pid, status)
        if status is not None:
            return status
        part = shim.load_part("cancel")
        status, how = part.cancel_worker(
            self.worker_pid, status, grace, self.wake_r, self.flags, reap
        )
        if tell:
            try:
                channel.send("cleanup", how=how)
            except OSError:
                pass
        return status


def drain(fd):
    try:
        os.read(fd, 4096)
    except BlockingIOError:
        pass


def done_frame(why, killed, status):
    """The ``done`` frame's fields; ``status``: the worker's (wait status, CPU seconds)."""
    done = {"why": why, "killed": killed, "exit_code": None, "signal": None}
    if status is not None:
        status, done["cpu_s"] = status
        if os.WIFSIGNALED(status):
            done["signal"] = os.WTERMSIG(status)
        else:
            done["exit_code"] = os.WEXITSTATUS(status)
    return done
