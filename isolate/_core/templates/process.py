"""One running template as the parent sees it: its processes, its control socket and leaf,
and the forks it makes (``forked.Forked``).

Everything here blocks: run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from typing import TYPE_CHECKING

import psutil

from agent_shim.shim_wire import receive_message, send_message

from .. import containment as _containment
from ..containment import sandbox as _sandbox
from ..containment import wall as _wall
from ..model.outcome import describe_exit, signal_name
from ..system import admission as _admission
from ..system.procfs import ns_pid, parent_pid
from ..system.reaping import GIVE_UP_S, Reaper
from ..system.tree import ProcessTree
from . import namespaces as _namespaces
from .burst import Burst
from .forked import STATUS_WAIT_S, Forked, TemplateGone, pidfd_pid, readable, send_episode
from .life import Life

if TYPE_CHECKING:
    from .pool import Pool

#: A template answers a fork request within milliseconds; one that does not is stuck (seconds).
_FORK_TIMEOUT_S = 10.0
#: After its control socket closes, how long a template gets to exit before SIGKILL (seconds).
_CLOSE_GRACE_S = 2.0


class Template:
    """One running template: its outer process, the importer, the control socket, and the
    importer's cgroup leaf. With a PID namespace the outer process's child is the
    namespace's PID 1, which outlives the importer until the last fork has ended."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        control: socket.socket,
        life: socket.socket,
        name: str,
        wall: _wall.Wall,
        own_namespaces: bool = False,
    ) -> None:
        self.popen = popen
        self.control = control
        #: Held for as long as the template may live: EOF there tells the outer process that
        #: we are gone. The importer's wait status comes back on it, and those of its forks
        #: that PID 1 reaped once the importer was gone.
        self.life = Life(life)
        self.name = name
        #: What the importer enters before it imports: an episode's containment. Its sandbox
        #: is the one every fork's own is carved from: its TMPDIR holds theirs.
        self.wall = wall
        self.leaves = wall.leaves
        #: Its forks are the episodes' workers themselves (``Forked.alone``): where each has a
        #: cgroup leaf, whose ``cgroup.kill`` takes what the agent left behind, and the template
        #: a PID namespace, whose PID 1 cancels them at the parent's death, its end the rest.
        self.forks_alone = wall.leaves is not None and "pidns" in wall.layers
        #: Each fork makes user, IPC and UTS namespaces of its own (``namespaces.py``).
        self.own_namespaces = own_namespaces
        self.importer: int | None = None
        self.importer_fd: int | None = None
        self.forks: set[Forked] = set()
        #: Episodes waiting for a fork made on demand (:meth:`fork`): the pool parks none
        #: meanwhile, the template would serve it before theirs.
        self.asking = 0
        #: Forks parked ahead of demand, once asked for (``isolate.park``) or once its first
        #: episode began (sized from its bursts: ``burst``).
        self.pool: Pool | None = None
        #: Its episodes running now and the most at once of late: the pool's size, unless
        #: ``sized`` (the caller's, from ``isolate.park``).
        self.burst = Burst()
        self.sized = False
        #: Its fds given back to the budget (:meth:`release_fds`): closed, or dead.
        self.released = False
        self.closing = False
        self._finished = False
        self._forks_lock = threading.Lock()
        #: Its control and life sockets, counted in the episodes' fd budget while it runs.
        self.fds: _admission.Hold | None = None

    @property
    def pid(self) -> int:
        """The importer's pid (the process holding the agent's code), once it is ready."""
        return self.importer if self.importer is not None else self.popen.pid

    def ready(self, pidfd: int | None) -> str | None:
        """Take the importer's pidfd from its ready message; a problem if it names anything
        but the outer process's child or grandchild."""
        if pidfd is None:
            return "the template's ready message carried no pidfd of its own"
        pid = pidfd_pid(pidfd)
        if pid is None:
            os.close(pidfd)
            return "the template's ready message carried no pidfd of its own"
        up = parent_pid(pid)
        if self.popen.pid not in (up, parent_pid(up) if up is not None else None):
            os.close(pidfd)
            return f"the template's ready message named process {pid}, not its own"
        self.importer, self.importer_fd = pid, pidfd
        return None

    def own_pids(self) -> set[int]:
        """The template's own processes: the outer one, PID 1 of its namespace (if it has
        one) and the importer."""
        pids = {self.popen.pid}
        if self.importer is not None:
            pids.add(self.importer)
            up = parent_pid(self.importer)
            if up is not None and parent_pid(up) == self.popen.pid:
                pids.add(up)
        return pids

    def alive(self) -> bool:
        if self.importer_fd is not None:
            return not readable(self.importer_fd, 0)
        return self.popen.poll() is None

    def death(self) -> str:
        """How the dead template's importer ended, in words."""
        # Its parent sends it once it has reaped it: just after the pidfd said so.
        self.life.read(STATUS_WAIT_S)
        status = self.life.status
        if status is None:
            code = self.popen.returncode  # the outer process: killed, say, by close_templates()
            return describe_exit(None, signal_name(-code)) if code and code < 0 else "ended"
        try:
            code = os.waitstatus_to_exitcode(status)
        except ValueError:
            return "ended"
        if code < 0:
            return describe_exit(None, signal_name(-code))
        return describe_exit(code, None)

    def has_parked(self) -> bool:
        """Whether a parked fork waits in the pool now: then :meth:`fork` need not wait for
        the template (unless another episode takes it first)."""
        pool = self.pool
        return pool is not None and bool(pool.parked)

    def fork(self, episode_id: str, tag: str, channel: int) -> Forked:
        """Fork one episode whose stdin and stdout are ``channel`` (the child's end of the
        launcher's socket): a parked fork from the pool when one is there, else one parked now
        with its hand-over sent right behind the request; blocking. Raises
        :class:`TemplateGone`."""
        parked = self.take_parked(episode_id, tag, channel)
        if parked is not None:
            return parked
        with self._forks_lock:
            self.asking += 1
        try:
            return self.park((episode_id, tag, channel))
        finally:
            with self._forks_lock:
                self.asking -= 1
                idle = self.asking == 0
            pool = self.pool
            if idle and pool is not None:
                pool.wake()  # an empty pool waits for the forks asked for on demand

    def take_parked(self, episode_id: str, tag: str, channel: int) -> Forked | None:
        """A parked fork from the pool, handed this episode (as :meth:`fork`); None when none
        is left. Never waits for the template: it touches sockets, pipes and the pool's lock
        only."""
        while self.pool is not None:
            pipe = os.pipe()  # before the take: EMFILE here takes none, the pool stays whole
            parked = self.pool.take()
            if parked is None:
                os.close(pipe[0])
                os.close(pipe[1])
                break
            try:
                parked.hand_over(episode_id, tag, channel, pipe)
                return parked
            except BaseException as exc:
                # Taken, not handed over: it ends as a dead pair does, and the next is tried.
                parked.kill()
                parked.close()
                if not isinstance(exc, TemplateGone):
                    raise
        return None

    def park(self, episode: tuple[str, str, int] | None = None) -> Forked:
        """A new fork, parked; with ``episode`` (id, tag, channel) handed over at once.
        Blocking; raises :class:`TemplateGone`."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        hand, its_hand = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        err: int | None = None
        ok = False
        try:
            try:
                send_message(self.control, {"t": "park"}, [theirs.fileno(), its_hand.fileno()])
            except OSError as exc:
                raise TemplateGone(f"template {self.name} is gone ({exc.strerror})") from None
            finally:
                theirs.close()
                its_hand.close()
            alone = self.forks_alone
            if episode is not None and self.leaves is not None and self.importer is not None:
                _prime_move(self.leaves, self.importer)
            if episode is not None:  # read by the fork once it is there: no round trip more
                err = send_episode(hand, *episode, os.pipe(), alone)
            pid, pidfd = _forked(self, mine)
            ipc = _adopt(self, pid, pidfd, hand) if self.own_namespaces else None
            if episode is not None and err is None:  # its hand-over could not be sent
                _drop(pidfd)
                raise TemplateGone(f"template {self.name}: the fork took no hand-over")
            forked = Forked(pid, pidfd, mine, hand if err is None else None, self, alone, ipc)
            if err is not None:
                hand.close()
                forked.stderr = open(err, "rb", buffering=0)  # noqa: SIM115 - in close()
                err = None
            with self._forks_lock:
                self.forks.add(forked)
            ok = True
            return forked
        finally:
            if not ok:
                mine.close()
                hand.close()
                if err is not None:
                    os.close(err)

    def release_fds(self) -> None:
        """Give its fd back to the budget; in the event loop, once it is closed (or dead).
        Its pool's fds are not counted again after (``sizing.resize``)."""
        self.released = True
        if self.fds is not None:
            self.fds.release()
            self.fds = None
        if self.pool is not None:
            self.pool.release_fds()

    def close(self, grace: float = _CLOSE_GRACE_S) -> None:
        """End the importer (EOF on its control socket, then SIGKILL after ``grace`` seconds)
        and everything left in its leaf, and remove the leaf; blocking. Episodes forked from
        it run on (each has a leaf of its own); its PID namespace, its outer process and its
        sandbox's TMPDIR go when the last of them has ended."""
        if self.pool is not None:
            self.pool.close()  # its parked forks first: they are forks, spared below
        if self.importer_fd is not None:
            # Nothing of the agent's is worth a graceful end: stopped, so that nothing new
            # appears below it, then killed with all it started but its forks.
            self._signal_importer(signal.SIGSTOP)
            self._kill_leftovers()
            self._signal_importer(signal.SIGKILL)
            readable(self.importer_fd, GIVE_UP_S)
        self.control.close()
        if self.leaves is not None:
            self.leaves.remove()  # what is left in it killed, until it is empty
        with self._forks_lock:
            self.closing = True
            last = not self.forks
        if last:
            self._finish(0.0 if self.importer_fd is not None else grace)

    def _signal_importer(self, sig: int) -> None:
        if self.importer_fd is not None:
            try:
                signal.pidfd_send_signal(self.importer_fd, sig)
            except OSError:
                pass  # gone already

    def _kill_leftovers(self) -> None:
        """SIGKILL every process below the importer but its forks (and what is below them),
        until none is left, for at most ``GIVE_UP_S``. The importer is a subreaper: whatever
        it started, double-forked or not, is below it."""
        if self.importer_fd is None or readable(self.importer_fd, 0):
            return  # it is gone: its number may name another process now
        with self._forks_lock:
            forks = {forked.pid for forked in self.forks}
        Reaper(lambda: self._leftovers(forks), stop_first=True).kill()

    def _leftovers(self, forks: set[int]) -> list[psutil.Process]:
        """The processes below the importer but ``forks`` and what is below them, and but the
        orphans of its episodes (in cgroups not the importer's: a fork that is its own worker
        leaves its orphans to the importer), which go with their episodes' leaves."""
        try:
            children = psutil.Process(self.pid).children()
        except psutil.Error:
            return []
        own = _cgroups_of(self.pid)
        left: list[psutil.Process] = []
        for child in children:
            if child.pid in forks or _cgroups_of(child.pid) not in (own, None):
                continue
            left.append(child)
            try:
                left += child.children(recursive=True)
            except psutil.Error:
                pass
        return left

    def fork_ended(self, forked: Forked) -> None:
        with self._forks_lock:
            self.forks.discard(forked)
            last = self.closing and not self.forks
        if last:
            threading.Thread(target=self._finish, args=(0.0,), daemon=True).start()

    def _finish(self, grace: float) -> None:
        """Once the importer is gone and no fork is left: the outer process (and with it the
        namespace), what is left in its session, the sandbox's TMPDIR, the life socket."""
        with self._forks_lock:
            if self._finished:
                return
            self._finished = True
        if self.popen.returncode is None:
            # Not reaped before the sweep: while it is ours to reap, its pid (the session's
            # id) names no other process.
            outer = os.pidfd_open(self.popen.pid) if hasattr(os, "pidfd_open") else None
            try:
                if outer is None or not readable(outer, grace):
                    self.popen.send_signal(signal.SIGKILL)
                # What is left in its session (the outer process leads it).
                Reaper(ProcessTree(None, self.popen.pid, None).live, stop_first=True).kill()
            finally:
                if outer is not None:
                    os.close(outer)
        self.popen.wait()
        if self.importer_fd is not None:
            os.close(self.importer_fd)
            self.importer_fd = None
        self.life.close()
        if self.wall.sandbox is not None:
            _sandbox.remove_tmpdir(self.wall.sandbox.tmpdir)


def _forked(template: Template, reply_socket: socket.socket) -> tuple[int, int]:
    """``template``'s answer to a park request: the fork's pid and pidfd. Raises
    :class:`TemplateGone`."""
    reply_socket.settimeout(_FORK_TIMEOUT_S)
    why = None
    try:
        reply, fds = receive_message(reply_socket)
    except TimeoutError:
        reply, fds, why = None, [], f"no answer within {_FORK_TIMEOUT_S:g} s"
    except (OSError, ValueError):
        reply, fds = None, []
    if reply is None or reply.get("t") != "forked" or not isinstance(reply["pid"], int):
        for fd in fds:
            os.close(fd)
        why = why or (reply.get("reason") if reply else None)
        raise TemplateGone(f"template {template.name} did not fork ({why or 'no answer'})")
    pidfd = fds[0] if fds else None
    for fd in fds[1:]:
        os.close(fd)
    pid = pidfd_pid(pidfd) if pidfd is not None else None
    if pid is None or pidfd is None or parent_pid(pid) != template.importer:
        if pidfd is not None:
            os.close(pidfd)
        raise TemplateGone(f"template {template.name} named no fork of its own")
    return pid, pidfd


def _adopt(template: Template, pid: int, pidfd: int, hand: socket.socket) -> int | None:
    """Once the fork says on ``hand`` that it made its namespaces, check them and have its ids
    mapped (``namespaces.maps`` says by whom), and under a sandbox have the template's outer
    process mount its ``/dev/pts``, ``/dev/shm`` and ``/dev/mqueue``: the inode of its IPC
    namespace. Raises :class:`TemplateGone`, with the fork killed. None where the fork maps
    its own ids: an unprivileged parent cannot read the namespaces of a process that is not
    dumpable, and the fork is not."""

    def shared(ipc: int) -> bool:
        # A namespace's inode is reused as soon as it is freed: only a fork that is in it now
        # counts. An exiting one leaves it before its pidfd says so; and its pid, once it is
        # reaped, may be another's (this fork's, even): alive before and after the look.
        with template._forks_lock:
            same = [f for f in template.forks if f.ipc == ipc]
        return any(
            not f.has_exited() and _namespaces.still_in(f.pid, "ipc", ipc) and not f.has_exited()
            for f in same
        )

    try:
        hand.settimeout(_FORK_TIMEOUT_S)
        try:
            said, fds = receive_message(hand)
        except (OSError, ValueError):  # TimeoutError among them
            said, fds = None, []
        finally:
            hand.settimeout(None)
        for fd in fds:
            os.close(fd)
        if said is None or said.get("t") != "unshared":
            why = said.get("reason") if said is not None else "no answer"
            raise TemplateGone(
                f"template {template.name}: its fork {pid} has no namespaces ({why})"
            )
        who = _namespaces.maps(template.wall)
        if who == "own":
            return None
        kinds = _namespaces.kinds(template.wall)
        if who == "parent":
            ipc = _namespaces.adopt(pid, template.importer, template.name, shared, kinds)
        else:
            ipc = _namespaces.own_ipc(pid, template.name, shared)
        if _namespaces.mounted_by_the_template(template.wall):
            maps: list[int] | None = None
            own: tuple[str, ...] = ()
            if who == "template":
                maps = [_ns_pid(pid, template.name), os.getuid(), os.getgid()]
                own = ("ipc", "uts", *kinds)
            problem = template.life.own_dev(pidfd, _FORK_TIMEOUT_S, maps, own)
            if problem is not None:
                raise TemplateGone(f"template {template.name}: its fork {pid}: {problem}")
        return ipc
    except TemplateGone:
        _drop(pidfd)
        raise


def _ns_pid(pid: int, name: str) -> int:
    """The fork ``pid``'s number in the namespace of template ``name``; TemplateGone if gone."""
    number = ns_pid(pid)
    if number is None:
        raise TemplateGone(f"template {name}: its fork {pid} is gone")
    return number


def _drop(pidfd: int) -> None:
    """Kill a fork the parent does not keep, through its pidfd (never a reused pid; it may be
    gone already, reaped by its template), and close the pidfd."""
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    os.close(pidfd)


def _cgroups_of(pid: int) -> bytes | None:
    """``/proc/PID/cgroup`` as read; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            return f.read()
    except OSError:
        return None


def _prime_move(leaves: _containment.Leaves, importer: int) -> None:
    """While the importer forks, write its pid into its own leaves (a move to where it is): the
    kernel's cgroup lock switches to its writers' mode, an RCU grace period (up to ~10 ms),
    beside the fork instead of at the fork's move into its leaf, which then finds the lock
    ready. In a thread of its own; the move changes nothing."""
    threading.Thread(target=leaves.move, args=(importer,), daemon=True).start()
