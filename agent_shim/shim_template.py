"""A preloaded template: import the agent once, then fork one episode per request.

Started by the parent as ``<python> -I boot.py --template LIFE`` with one end of a
SOCK_SEQPACKET socket pair as fd 0: the control socket. EOF on it means the parent closed it
or died, and the template exits. LIFE is the fd of a second socket pair, held by the parent
for as long as it lives: EOF there means the parent is gone. Messages are JSON, one per
packet:

- parent -> template: ``{"t": "preload", "entrypoint", "agent_root", "preload": [...],
  "cancel_grace"}`` (the episodes', for the parent's death: shim_init.py) carrying a file
  (a memfd) that holds the wall as JSON: an episode's containment (``containment``,
  ``cgroups``, ``userns``, ``sandbox``, ``fork_unshare``, ``fork_maps``), which can
  outgrow a message;
- template -> parent: ``{"t": "ready", "seconds"}`` carrying a pidfd of the importing process,
  or ``{"t": "refused", "reason"}`` (then it kills what the import started and exits): not
  containable, not importable, or not safe to fork (a thread running, a process the import
  started still alive, a socket open);
- parent -> template: ``{"t": "park"}`` carrying two fds (SCM_RIGHTS), a reply socket and a
  hand-over socket: the template forks, and the fork parks (a session of its own, waiting);
- template -> parent, on the reply socket: ``{"t": "forked", "pid"}`` carrying a pidfd, and once
  the fork is reaped ``{"t": "exit", "status"}`` (a wait status);
- parked fork -> parent, on the hand-over socket, with ``fork_unshare``: ``{"t": "unshared"}``
  once it is in namespaces of its own (shim_parked.own_namespaces), which the parent then maps;
- parent -> parked fork, on the hand-over socket: ``{"t": "moved"}`` once it is in its cgroup
  leaf (it forks its worker ahead then: shim_parked.py); ``{"t": "episode", "episode_id"}``
  carrying two fds: the episode's channel (its stdin and stdout, one socket) and its stderr
  pipe; or EOF (the parent closed it, or is gone): the parked fork exits. Every fork is parked
  first.

The import is the agent's code: it runs inside the wall a fresh episode gets, entered before
it. Three processes, of which only the last ever holds the agent's code:

- the outer one (the parent's child) watches LIFE and its child. When the parent is gone it
  ends the rest: with a PID namespace its child is that namespace's PID 1, which it tells
  (SIGTERM) to cancel the episodes and end, killing it should it outlast their
  ``cancel_grace``; otherwise it stops the importer, cancels the forks itself as PID 1 does,
  then kills the importer and all below it, and sends the importer's wait status on LIFE;
- with a PID namespace, its PID 1: it mounts the namespace's /proc, forks the importer, sends
  its wait status on LIFE and reaps what is left; it ends, and the namespace with it, once
  the importer and every episode forked from it have ended, or once the episodes have had
  their clean-up after the parent's death (shim_init.py);
- the importer joins its cgroup leaf, enters the Landlock domain, the sandbox and the syscall
  filter, drops its capabilities, and only then imports.

A fork, once handed its episode, puts the channel on fds 0 and 1 and the pipe on 2, and from
there runs shim.main(), the code of a fresh start: its own handshake (secrets never pass
through here, and the handshake comes only after the hand-over), supervisor, worker (a parked
fork's is forked ahead, in its leaf, and gets the handshake from it) and teardown. It stays
in the template's PID namespace, where the parent moves it into its own cgroup leaf before
the handshake (a parked one, before its hand-over); its worker enters a Landlock domain of
its own, so that no episode reaches another.
"""

import gc
import os
import select
import socket
import sys
import time

shim = sys.modules["_isolate_shim"]
signal, wire = shim.signal, shim.wire

send, receive = wire.send_message, wire.receive_message
#: A thread the agent started at import may be about to end: wait this long before refusing.
THREAD_GRACE = 0.5


def fork_hazard(control, process_table, spaces):
    """Why forking this process would not give each episode a clean copy, or None.
    ``spaces``: its namespaces before the import (``shim_parked.namespaces``)."""
    if shim.load_part("parked").namespaces() != spaces:
        return "the import entered namespaces of its own: its forks would share them"
    end = time.monotonic() + THREAD_GRACE
    while len(os.listdir("/proc/self/task")) > 1 and time.monotonic() < end:
        time.sleep(0.01)
    tasks = sorted(int(t) for t in os.listdir("/proc/self/task"))
    if len(tasks) > 1:
        # A fork copies only the calling thread: locks the others hold stay locked forever.
        names = {}
        threading = sys.modules.get("threading")
        if threading is not None:
            names = {t.native_id: t.name for t in threading.enumerate()}
        tid = tasks[1] if tasks[0] == os.getpid() else tasks[0]
        name = names.get(tid)
        if name is None:
            try:
                with open("/proc/self/task/%d/comm" % tid) as f:
                    name = f.read().strip()
            except OSError:
                name = str(tid)
        return "thread %r running after import" % name
    kids = children_after(THREAD_GRACE, process_table)
    if kids:
        pid, name = kids[0]
        return "process %d (%s) running after import: it would outlive its episodes" % (pid, name)
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd == control.fileno():
            continue
        try:
            target = os.readlink("/proc/self/fd/%d" % fd)
        except OSError:
            continue  # the fd listdir itself used
        if target.startswith("socket:"):
            return "socket open after import (fd %d): every episode would share it" % fd
    return None


def children_after(grace, process_table):
    """The live children of this process, as (pid, command name), after waiting up to
    ``grace`` seconds for them to exit (and reaping those that did). The template is a child
    subreaper: whatever the import started, double-forked or not, is among them.
    ``process_table``: the shim's, pid -> (ppid, state)."""
    end = time.monotonic() + grace
    me = os.getpid()
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        found = [
            pid
            for pid, (ppid, state) in process_table().items()
            if ppid == me and state not in ("Z", "X")
        ]
        if not found or time.monotonic() >= end:
            return [(pid, command_name(pid)) for pid in found]
        time.sleep(0.01)


def command_name(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return "?"


def kill_children(process_table, spared=()):
    """Kill every child but the ``spared`` until none is left (a subreaper: their orphans come
    back here): the supervisor's ``kill_until_gone``, SIGKILL at once. Spared too: a child in
    cgroups other than this process's, an orphan of an episode (a fork that is its own worker
    leaves its orphans here), which goes with its episode's leaf. The parent's clean-up of the
    template's session and leaf comes after."""
    own = cgroups_of("self")

    def find():
        kids = [
            pid
            for pid, _ in children_after(0, process_table)
            if pid not in spared and cgroups_of(pid) in (own, None)
        ]
        return kids, not kids

    shim.load_part("supervisor").kill_until_gone(find)


def cgroups_of(pid):
    """``/proc/PID/cgroup`` as read (``pid`` may be "self"); None once the process is gone."""
    try:
        with open("/proc/%s/cgroup" % pid, "rb") as f:
            return f.read()
    except OSError:
        return None


def serve():
    """The template's life: contain, preload, report, then fork episodes until the control
    socket ends. Never returns: a thread the agent started must not hold up the exit."""
    code = 1
    try:
        code = preload_and_loop()
    except BaseException:
        import traceback

        traceback.print_exc()  # a bug of the template itself: leave a trace in the log
    finally:
        shim.leave(code)  # a fork never gets here: its supervisor and worker end by their own exits


def preload_and_loop():
    import faulthandler

    # A template that a signal kills (SIGSEGV in an extension the agent imports, say) leaves
    # the Python traceback of each of its processes in its log.
    faulthandler.enable()
    control = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # what the agent prints at import goes to the template's log
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    life = int(sys.argv[2]) if sys.argv[2:3] and sys.argv[2].isdigit() else None
    message, fds = receive(control)
    if message is None:
        return 0
    wall = wire.read_json_file(fds.pop(0)) if fds else {}
    for fd in fds:
        os.close(fd)
    grace = shim.load_part("init").grace_of(message)
    wall = wall if isinstance(wall, dict) else {}
    problem = enter_wall(wall, control, life, grace)
    if problem is not None:
        sys.stderr.write("isolate template: cannot contain the template: %s\n" % problem)
        send(control, {"t": "refused", "reason": "cannot contain the template: " + problem})
        return 1
    spaces = shim.load_part("parked").namespaces()
    started = time.monotonic()
    try:
        shim.load_part("worker").load_entrypoint(message["entrypoint"], message.get("agent_root"))
        for name in message.get("preload", ()):
            __import__(name)
    except BaseException as exc:
        import traceback

        traceback.print_exc()
        reason = "cannot import %s: %s: %s" % (message["entrypoint"], type(exc).__name__, exc)
        send(control, {"t": "refused", "reason": reason})
        return 1
    process_table = shim.load_part("supervisor").process_table
    reason = fork_hazard(control, process_table, spaces)
    if reason is not None:
        sys.stderr.write("isolate template: preload refused: %s\n" % reason)
        kill_children(process_table)  # nothing the import started outlives the refusal
        send(control, {"t": "refused", "reason": reason})
        return 0
    # Objects that exist now are never collected in a fork: its collector leaves their pages
    # alone, and they stay shared with this process.
    gc.collect()
    gc.freeze()
    random = sys.modules.get("random")
    state = hash(random.getstate()) if random is not None else None
    me = os.pidfd_open(os.getpid()) if hasattr(os, "pidfd_open") else None
    fds = [me] if me is not None else []
    send(control, {"t": "ready", "seconds": time.monotonic() - started}, fds)
    if me is not None:
        os.close(me)
    loop(control, shim.main, state, process_table, shim.load_part("parked").fork_walls(wall))
    return 0


def enter_wall(wall, control, life, grace):
    """Become the importer, inside what a fresh episode of this containment gets; a problem,
    or None. The outer process and PID 1 stay in here until they exit; ``grace``: how long
    PID 1 lets the episodes clean up after the parent's death (their ``cancel_grace``)."""
    supervisor, worker = shim.load_part("supervisor"), shim.load_part("worker")
    layers = shim.layers_of(wall)
    pidns = "pidns" in layers
    if pidns:
        problem = supervisor.unshare_namespaces(wall.get("userns", False))
        if problem is not None:
            return problem
    outer = os.getpid()
    watcher = shim.load_part("outer")
    home = watcher.home() if pidns else {}
    child = os.fork()
    if child:
        control.close()
        leaves = () if pidns else wall.get("cgroups", ())
        watcher.watch(child, life, leaves, not pidns, grace, home)
    watcher.leave(home)
    if pidns:
        # Dies with the outer process. /sys stays writable until the importer is in its leaf.
        problem = supervisor.become_init(guard=False)
        if problem is not None:
            return problem
        child = os.fork()
        if child:
            control.close()
            shim.load_part("init").init(child, life, grace)
    else:
        # The outer process is single-threaded: its death is the parent-death signal's.
        shim.c_call("prctl", shim.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != outer:
            os._exit(1)  # it died before the signal was armed
    if life is not None:
        os.close(life)
    # A subreaper, so that a process the import started stays its child, found and killed.
    shim.set_subreaper()
    problem = supervisor.join_cgroups(wall.get("cgroups", ()))
    if problem is None and pidns:
        # Rooted at the importer's leaf: the forks, moved into leaves beside it, cannot leave
        # theirs. PID 1 stays out of it, so that closing the template spares its forks.
        problem = shim.load_part("world").cgroup_namespace()
    if problem is not None:
        return problem
    return enter_layers(wall, layers, worker)


def enter_layers(wall, layers, worker):
    """In the importer: the layers a fresh episode's worker enters; a problem or None."""
    # Loaded once here, before the sandbox: each fork's worker uses them.
    for part in ("cancel", "seccomp", "sandbox", "landlock", "world", "parked"):
        shim.load_part(part)
    import resource  # noqa: F401 - the worker sets the episode's rlimits with it

    if "landlock" in layers:
        problem = worker.enter_landlock()
        if problem is not None:
            return problem
    sandbox = wall.get("sandbox")
    if sandbox is not None:
        missing = enter_sandbox(sandbox)
        if missing and not sandbox.get("best_effort"):
            return "sandbox: cannot enforce " + "; ".join(missing)
    if sys.platform.startswith("linux"):
        # Its forks (not their workers) may make namespaces of their own: own_namespaces.
        network = sandbox is not None and sandbox.get("network") is not None
        shim.load_part("seccomp").prepare(os.uname().machine)  # each fork's worker's filter
        return worker.harden(shim.load_part("parked").unshare_flags(wall), network)
    return None


def enter_sandbox(sandbox):
    """The sandbox's file-system part and, where it has a network, a network namespace with
    loopback only (nothing reaches out at import; each fork makes one of its own, served by
    the parent, shim_parked.py): what could not be done."""
    missing = []
    if sandbox.get("network") is not None:
        net = shim.load_part("net")
        problem = net.unshare_net() or net.loopback_up()
        if problem is not None:
            missing.append("network isolation: " + problem)
    return missing + shim.load_part("sandbox").enter(sandbox)


def loop(control, shim_main, random_state, process_table, unshare):
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    replies = {}  # pid -> reply socket, until the episode is reaped
    poller = select.poll()
    poller.register(control.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    own = [control, wake_r, wake_w]
    while True:
        for fd, _ in poller.poll():
            if fd == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            message, fds = receive(control)
            if message is None:
                # The parent is gone or closed us. Episodes live on (they watch their own
                # pipes); what else the agent's code started here does not.
                kill_children(process_table, spared=replies)
                return
            if message.get("t") == "park" and len(fds) == 2:
                reply, hand = socket.socket(fileno=fds[0]), socket.socket(fileno=fds[1])
                others = own + list(replies.values())
                pid = fork(hand, reply, others, shim_main, random_state, unshare)
                if pid is not None:
                    replies[pid] = reply
            else:
                for fd in fds:
                    os.close(fd)
        while True:  # its forks, and orphans of this subreaper: a dead parked fork's worker
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reply = replies.pop(pid, None)
            if reply is not None:
                cpu = usage.ru_utime + usage.ru_stime
                try:
                    send(reply, {"t": "exit", "status": status, "cpu_s": cpu})
                except OSError:
                    pass  # the parent stopped waiting for it
                reply.close()


def fork(hand, reply, own, shim_main, random_state, unshare):
    """Fork a parked process that waits for its episode on ``hand`` (in namespaces of its own
    first, with ``unshare``: flags and whether it maps its own ids); here, report its pid
    (and a pidfd) on its reply socket. None if the fork failed (the reply says why)."""
    try:
        pid = os.fork()
    except OSError as exc:
        hand.close()
        try:
            send(reply, {"t": "error", "reason": "fork: %s" % (exc.strerror or exc)})
        except OSError:
            pass
        reply.close()
        return None
    if pid == 0:
        code = 1
        try:
            parked = shim.load_part("parked")
            if not unshare[0] or parked.own_namespaces(hand, *unshare):
                code = parked.park(hand, own + [reply], shim_main, random_state, unshare[0])
        except BaseException:
            import traceback

            traceback.print_exc()
        shim.leave(code)
    hand.close()
    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    try:
        send(reply, {"t": "forked", "pid": pid}, [pidfd] if pidfd is not None else ())
    except OSError:
        pass  # the parent gave up on it; it sees EOF on its hand-over socket and ends
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return pid
