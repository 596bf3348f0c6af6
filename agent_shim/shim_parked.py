"""A parked fork of a preloaded template (``shim_template.py``) and its worker, forked ahead.

The fork waits on its hand-over socket. Once the parent has moved it into its cgroup leaf it
says so (``{"t": "moved"}``; sent where there is no leaf too): the fork becomes a child
subreaper, not dumpable, cuts its bounding set to what its agent will keep (:func:`narrow`),
and forks its worker at once, born in the leaf. That worker waits on
a socket pair of their own; it holds no handshake and no secret, and has run none of the
episode's code. At its hand-over (``{"t": "episode"}``, with the channel and the stderr pipe)
the fork runs shim.main(), the code of a fresh start: it reads the handshake, says hello and
passes the worker, on their socket pair, the handshake as it came, the channel and stderr and
the pipe on which the worker says its final frame is out; the worker then runs
``shim_worker.run`` as a worker forked there does, walls included, and the fork supervises it.
A fork handed its episode at once (no pool) forks its worker after the handshake, as a fresh
start does. Should the parked worker die, the fork exits too, and the pool replaces the pair.

Where the parent asks for it, each fork first makes a user namespace of its own, and in it
IPC and UTS ones (and mount, network ones: ``unshare_flags``), and says so on its hand-over
socket (``{"t": "unshared"}``), where the parent waits for it before it maps the fork's ids:
no fork of a template reaches another's System V objects, message queues or hostname.

Loaded by the template before its first fork, with ``load_part("parked")``. Standard library
only, Python 3.9+.
"""

import os
import select
import socket
import sys

shim = sys.modules["_isolate_shim"]
signal, wire = shim.signal, shim.wire

EPISODE_ENV, EPISODE_TAG_ENV = wire.EPISODE_ENV, wire.EPISODE_TAG_ENV
send, receive = wire.send_message, wire.receive_message
PR_GET_DUMPABLE = 3
#: The handshake goes to the worker in packets of at most this many bytes.
PACKET = 65536


#: The namespaces each fork of a template makes for itself where the parent asks it to
#: (``fork_unshare`` in the template's wall): a user namespace, so that it may, and in it IPC
#: and UTS ones, so that no System V object, POSIX message queue or hostname of another
#: episode of the same template is in its reach; and those the parent names besides.
OWN_NAMESPACES = shim.CLONE_NEWUSER | shim.CLONE_NEWIPC | shim.CLONE_NEWUTS
#: What the parent may name besides: a mount namespace, for a ``/dev/pts``, ``/dev/shm`` and
#: ``/dev/mqueue`` of its own; a network one, for the sandbox's network (templates/namespaces.py
#: decides).
MORE_NAMESPACES = {"mnt": shim.CLONE_NEWNS, "net": shim.CLONE_NEWNET}


def unshare_flags(wall):
    """The flags of ``unshare`` each fork of a template walled in by ``wall`` calls, and its
    filter allows: 0 unless the wall asks for ``fork_unshare`` (a list of the namespaces of
    :data:`MORE_NAMESPACES` to make besides)."""
    more = wall.get("fork_unshare")
    if not isinstance(more, list):
        return 0
    return OWN_NAMESPACES | sum(MORE_NAMESPACES[kind] for kind in set(more) & set(MORE_NAMESPACES))


def fork_walls(wall):
    """What each fork does first (:func:`own_namespaces`): (flags, who maps its ids: "parent",
    "own" or "template", whether it mounts its own ``/dev/pts``, ``/dev/shm`` and
    ``/dev/mqueue``: not under a sandbox, whose Landlock rules forbid mounts, and where the
    template's outer process mounts them, shim_outer.py); flags 0: nothing."""
    flags = unshare_flags(wall)
    mounts = bool(flags & shim.CLONE_NEWNS) and wall.get("sandbox") is None
    return flags, wall.get("fork_maps", "parent"), mounts


def own_namespaces(hand, flags, maps, mounts):
    """In a fork just made: unshare ``flags`` (:func:`unshare_flags`), then say so on ``hand``
    (``{"t": "unshared"}``, or ``{"t": "error", "reason"}``), its hand-over socket. Then its
    new user namespace's ids are mapped, each to itself, by ``maps``: the parent (root to
    root: only a process that holds CAP_SETFCAP outside may, and neither the template nor its
    forks do); the fork itself ("own": an unprivileged trainer's template without a sandbox);
    or the template's outer process ("template": an unprivileged trainer's template with a
    sandbox, whose Landlock rules keep the fork from its maps in /proc), for which the fork is
    dumpable, its /proc files its own, until it is moved or its handshake comes (:func:`park`,
    :func:`episode`), which the parent sends once they are mapped. With
    ``mounts`` it mounts its own ``/dev/pts``, ``/dev/shm`` and ``/dev/mqueue`` meanwhile.
    True if done (else it exits before its hand-over, the reason in the template's log)."""
    uid, gid = os.getuid(), os.getgid()
    result, errno = shim.c_call("unshare", flags)
    problem = None if result == 0 else "unshare: " + os.strerror(errno)
    said = {"t": "unshared"} if problem is None else {"t": "error", "reason": problem}
    if problem is None and maps == "template":
        shim.c_call("prctl", shim.PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        send(hand, said)
    except OSError:
        return False  # the parent gave up on it
    if problem is None and mounts:
        world = shim.load_part("world")
        problem = world.own_instances(world.mounter())
    if problem is None and maps == "own":
        problem = shim.load_part("supervisor").map_own_ids(uid, gid)
    if problem is not None:
        sys.stderr.write("isolate template: a fork's own namespaces: %s\n" % problem)
    return problem is None


def namespaces():
    """This process's namespaces, as the inode numbers of ``/proc/self/ns/*``: the template
    compares them before and after its import."""
    found = []
    for kind in ("user", "ipc", "uts", "mnt", "net", "pid", "cgroup"):
        try:
            found.append(os.stat("/proc/self/ns/" + kind).st_ino)
        except OSError:
            found.append(None)
    return found


def park(hand, own, shim_main, random_state, flags):
    """In the fork: a session of its own, then the hand-over; its exit code (0 at EOF).
    ``flags``: those its :func:`own_namespaces` unshared."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for item in own:
        if isinstance(item, int):
            os.close(item)
        else:
            item.close()
    ahead = None
    message, fds = take(hand)
    if message is not None and message.get("t") == "moved" and not fds:
        # As shim.main() does first (a fork whose ids the template mapped was dumpable so far).
        shim.c_call("prctl", shim.PR_SET_DUMPABLE, 0, 0, 0, 0)
        if flags & shim.CLONE_NEWUSER:
            narrow(flags)
        if message.get("alone"):  # its own worker: nothing to fork ahead
            message, fds = take(hand)
        else:
            ahead = fork_ahead(hand, random_state)
            message, fds = wait(hand, ahead) if ahead is not None else take(hand)
    hand.close()
    if message is None or message.get("t") != "episode" or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return 0 if message is None else 1  # its worker, if any, dies with it
    return episode(message, fds, shim_main, random_state, ahead)


def narrow(flags):
    """Ahead of its episode, in a fork with a user namespace of its own (which gave it every
    capability again), and its ids mapped: the bounding set cut to what the episode's agent
    keeps, as its worker would cut it (``shim_worker.drop_capabilities``), which then has the
    other sets left to drop. Its own capabilities stay until then."""
    worker = shim.load_part("worker")
    problem = worker.drop_bounding(worker.kept(bool(flags & shim.CLONE_NEWNET)))
    if problem is not None:  # the worker tries again, and fails the episode with it
        sys.stderr.write("isolate template: a parked fork: %s\n" % problem)


def take(sock):
    """The next message on ``sock`` and its fds; (None, []) at EOF or on a broken one."""
    try:
        return receive(sock)
    except (OSError, ValueError):
        return None, []


def episode(message, pipes, shim_main, random_state, ahead):
    """In a parked fork, handed its episode: become a fresh start's shim, run shim.main()."""
    channel, stderr = pipes
    for target, fd in ((0, channel), (1, channel), (2, stderr)):
        os.dup2(fd, target)
    for fd in pipes:
        if fd > 2:
            os.close(fd)
    tag_episode(message)
    reseed(random_state)
    sys.argv[1:] = []
    if message.get("alone"):  # SIGINT, the episode's cancellation, waits for its handler
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    if shim.c_call("prctl", PR_GET_DUMPABLE, 0, 0, 0, 0)[0] == 1:
        # Its ids are the template's to map (own_namespaces), until the handshake comes;
        # shim.main() makes it not dumpable before it reads it.
        select.select([0], [], [])
    code = shim_main(ahead, bool(message.get("alone")))
    return code if isinstance(code, int) else 0


def tag_episode(message):
    """The episode's id and tag in ``os.environ``, for what its processes inherit: the parent's
    sweep finds them by the tag."""
    os.environ[EPISODE_ENV] = str(message.get("episode_id"))
    os.environ[EPISODE_TAG_ENV] = str(message.get("tag"))


def reseed(random_state):
    random = sys.modules.get("random")
    if random is not None and hash(random.getstate()) == random_state:
        random.seed()  # Python reseeds at fork; should that ever not happen, we do


# --- the worker, forked ahead ------------------------------------------------------------------


class Ahead:
    """The fork's side of its worker forked ahead: its pid and their socket."""

    def __init__(self, pid, sock):
        self.pid = pid
        self.sock = sock

    def hand(self, raw, frames_fd, exit_w):
        """Pass the worker its episode: the handshake ``raw`` as read, the channel, stderr (fd
        2) and ``exit_w``. The worker's pid, or None if it is gone (then fork one as a fresh
        start does)."""
        header = {
            "t": "episode",
            "episode_id": os.environ.get(EPISODE_ENV),
            "tag": os.environ.get(EPISODE_TAG_ENV),
            "size": len(raw),
        }
        try:
            send(self.sock, header, [frames_fd, 2, exit_w])
            view = memoryview(raw)
            while view:
                view = view[self.sock.send(view[:PACKET]) :]
        except OSError:
            return None
        finally:
            self.sock.close()  # a worker that did not get it all sees EOF and exits
        return self.pid


def fork_ahead(hand, random_state):
    """In a parked fork, once in its leaf: fork its worker now. Its :class:`Ahead`, or None if
    the fork failed (the worker is then forked after the handshake)."""
    shim.c_call("prctl", shim.PR_SET_DUMPABLE, 0, 0, 0, 0)  # as shim.main() does first
    shim.set_subreaper()
    shim.before_worker_fork()
    ours, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    me = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        its.close()
        return None
    if pid == 0:
        code = 1
        try:
            ours.close()
            hand.close()
            code = parked_worker(its, me, random_state)
        except BaseException:
            import traceback

            traceback.print_exc()
        shim.leave(code)
    its.close()
    return Ahead(pid, ours)


def wait(hand, ahead):
    """Until the hand-over: the message on ``hand`` and its fds; (None, []) at EOF there, or
    once the worker forked ahead is gone (then this fork exits, and the pool replaces it)."""
    poller = select.poll()
    poller.register(hand.fileno(), select.POLLIN)
    poller.register(ahead.sock.fileno(), select.POLLIN)
    while True:
        ready = [fd for fd, _ in poller.poll()]
        if hand.fileno() in ready:
            return take(hand)  # should the worker be gone too, one is forked after the handshake
        if ready:
            ahead.sock.close()
            return None, []


class Handed:
    """What ``shim_worker.run`` asks of its supervisor (``Supervisor.as_worker``), for a worker
    forked ahead: it never had the supervisor's handlers or fds, only the exit pipe's end."""

    def __init__(self, exit_w):
        self.exit_w = exit_w

    def as_worker(self):
        return self.exit_w


def parked_worker(sock, supervisor_pid, random_state):
    """The worker forked ahead: wait for the episode on ``sock``, then run it (never returns);
    its exit code if the fork ends first."""
    # As in a worker forked after the handshake: SIGINT (its cancellation) blocked until its
    # handler is set, and no life after the fork's.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    shim.c_call("prctl", shim.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != supervisor_pid:
        return 1
    message, fds = take(sock)
    size = message.get("size") if message is not None else None
    chunks, left = [], size if type(size) is int and len(fds) == 3 else -1
    while left > 0:
        chunk = sock.recv(PACKET)
        if not chunk:
            break  # the fork is gone
        chunks.append(chunk)
        left -= len(chunk)
    sock.close()
    if left != 0:
        for fd in fds:
            os.close(fd)
        return 0 if message is None else 1
    frames, stderr, exit_w = fds
    os.dup2(stderr, 1)  # stdout and stderr go to the episode's log, as the fork's do
    os.dup2(stderr, 2)
    os.close(stderr)
    tag_episode(message)
    reseed(random_state)
    sys.argv[1:] = []
    hs = shim.json_loads(b"".join(chunks).decode("utf-8"))
    del chunks
    channel = shim.Channel(frames, hs["nonce"])
    shim.load_part("worker").run(hs, channel, supervisor_pid, Handed(exit_w))  # exits
    return 1
