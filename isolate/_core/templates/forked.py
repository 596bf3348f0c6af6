"""One episode forked from a template, as the parent sees it: the fork's handle, its hand-over
and its exit status, which comes from the template (``process.Template``).

Everything here blocks but :meth:`Forked.wait_exit`: run it in a worker thread.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import time
from typing import IO, TYPE_CHECKING

import anyio

from agent_shim.shim_wire import receive_message, send_message

from .. import containment as _containment
from ..system.procfs import exited, ns_pid

if TYPE_CHECKING:
    from .process import Template

#: After the fork has exited, how long its status may take to come from the template (seconds).
STATUS_WAIT_S = 2.0
#: ``returncode`` of a fork whose template died before reporting its exit status.
_UNKNOWN = 255


class TemplateGone(Exception):
    """The template did not fork the episode (it died, or is stuck); the episode starts fresh."""


def pidfd_pid(pidfd: int) -> int | None:
    """The pid, in our PID namespace, of the process a pidfd refers to; None if it is gone or
    the fd is no pidfd. (A template in a namespace of its own knows only its own numbers.)"""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}") as f:
            for line in f:
                if line.startswith("Pid:"):
                    pid = int(line.split()[1])
                    return pid if pid > 0 else None
    except (OSError, ValueError, IndexError):
        pass
    return None


def readable(fd: int, seconds: float) -> bool:
    """Whether ``fd`` is readable within ``seconds`` (poll: the fd may be past 1023)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(seconds * 1000))


def send_episode(
    hand: socket.socket,
    episode_id: str,
    tag: str,
    channel: int,
    pipe: tuple[int, int],
    alone: bool,
) -> int | None:
    """Hand a parked fork its episode and the write end of its stderr ``pipe`` (closed here;
    its read end too on failure): the read end, or None if the fork is gone. ``alone``: the
    fork is its own worker."""
    err_r, err_w = pipe
    message = {"t": "episode", "episode_id": episode_id, "tag": tag, "alone": alone}
    try:
        send_message(hand, message, [channel, err_w])
    except OSError:
        os.close(err_r)
        return None
    finally:
        os.close(err_w)
    return err_r


class Forked:
    """The parent's handle on one episode forked from a template (a ``child.Child``). Its exit
    status comes from the template, the fork's parent, on the fork's reply socket.

    ``alone``: the fork is the episode's worker itself, one process of the agent's image per
    episode, supervised from here (its deadline, cancellation and the kill of what it leaves
    in its leaf: ``episode.watch``); else it is a shim's supervisor that forks its worker, as
    a fresh start is (where the episode has no cgroup leaf, whose ``cgroup.kill`` takes what a
    process of the agent's left behind)."""

    def __init__(
        self,
        pid: int,
        pidfd: int | None,
        reply: socket.socket,
        hand: socket.socket | None,
        template: Template | None = None,
        alone: bool = False,
        ipc: int | None = None,
    ) -> None:
        self.pid = pid
        self.alone = alone
        #: The inode of its IPC namespace, where it made one of its own (``namespaces.py``).
        self.ipc = ipc
        #: Its CPU time (seconds, user and system, its reaped children's included), from the
        #: template once it reaped it.
        self.cpu_s: float | None = None
        self.pidfd = pidfd
        self.reply = reply
        #: Its hand-over socket, until it is handed its episode (EOF there: it exits).
        self.hand = hand
        self.template = template
        # Its stdin and stdout are the launcher's channel socket, as for a fresh start.
        self.stderr: IO[bytes] | None = None
        #: A parked fork's cgroup leaves, made and entered ahead; the episode adopts them.
        self.leaves: _containment.Leaves | None = None
        self.returncode: int | None = None
        #: False when the template died before it could report the exit status.
        self.status_known = True
        self.pid1 = False  # in its template's PID namespace
        #: Its pid in the template's PID namespace: PID 1 reports it by that number.
        self.ns_pid = ns_pid(pid) if alone else None
        self._eof = False
        self._orphaned_at: float | None = None
        reply.setblocking(False)

    def stderr_fd(self) -> int:
        assert self.stderr is not None
        return self.stderr.fileno()

    def hand_over(self, episode_id: str, tag: str, channel: int, pipe: tuple[int, int]) -> None:
        """Send the parked fork its episode: ``channel`` and the write end of its stderr
        ``pipe`` (both ends owned from here on); blocking. Raises :class:`TemplateGone` if it
        is gone."""
        assert self.hand is not None
        err = send_episode(self.hand, episode_id, tag, channel, pipe, self.alone)
        if err is None:
            raise TemplateGone(f"the parked fork {self.pid} is gone")
        self.hand.close()
        self.hand = None
        self.stderr = open(err, "rb", buffering=0)  # noqa: SIM115 - in close()

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal) once known, else None."""
        while self.returncode is None and not self._eof:
            try:
                message, fds = receive_message(self.reply)
            except BlockingIOError:
                break
            except (OSError, ValueError):
                message, fds = None, []
            for fd in fds:
                os.close(fd)
            if message is None:
                self._eof = True  # the template is gone: wait for the fork itself
            elif message.get("t") == "exit" and isinstance(message.get("status"), int):
                self.returncode = os.waitstatus_to_exitcode(message["status"])
                cpu = message.get("cpu_s")
                self.cpu_s = float(cpu) if isinstance(cpu, (int, float)) else None
        if self.returncode is None and self._eof and self.has_exited():
            self._status_from_init()
        return self.returncode

    def _status_from_init(self) -> None:
        """Both the template and the fork are gone: the fork's status from PID 1, which reaped
        it (a fork that is its own worker lives in the template's PID namespace) once the
        importer was gone, if it comes within ``STATUS_WAIT_S``; else unknown."""
        found = None
        if self.template is not None and self.ns_pid is not None:
            found = self.template.life.fork_status(self.ns_pid)
        if found is not None:
            status, self.cpu_s = found
            self.returncode = os.waitstatus_to_exitcode(status)
            return
        now = time.monotonic()
        if self._orphaned_at is None:
            self._orphaned_at = now
        if self.ns_pid is None or now - self._orphaned_at >= STATUS_WAIT_S:
            self.returncode, self.status_known = _UNKNOWN, False

    def has_exited(self) -> bool:
        """Whether the fork has exited (a parked one killed from outside, say), from its pidfd
        (from any thread: its status, on the reply socket, is read in the event loop); from
        ``/proc`` where it has none."""
        if self.pidfd is not None:
            return readable(self.pidfd, 0)
        return exited(self.pid)

    async def wait_exit(self) -> None:
        """Until the fork has exited and its status is in (or known to be lost)."""
        if self.poll() is not None:
            return
        if self.pidfd is not None:
            await anyio.wait_readable(self.pidfd)
        else:
            while not self.has_exited():  # noqa: ASYNC110 - no pidfd on this platform
                await anyio.sleep(0.01)
        # The template reaps it at once; should the template be stopped, the status is lost.
        with anyio.move_on_after(STATUS_WAIT_S):
            while self.poll() is None and not self._eof:
                await anyio.wait_readable(self.reply.fileno())
            while self.poll() is None:  # noqa: ASYNC110 - the template gone: from its PID 1
                await anyio.sleep(0.005)
        if self.returncode is None:
            self.returncode, self.status_known = _UNKNOWN, False

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the fork itself (through its pidfd: never to a reused pid)."""
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except OSError:
            pass  # gone already

    def wait(self) -> int:
        """Block until the fork has exited (for a spawn that failed half-way)."""
        end = time.monotonic() + STATUS_WAIT_S
        while self.poll() is None and (not self.has_exited() or time.monotonic() < end):
            time.sleep(0.005)
        if self.returncode is None:
            self.returncode, self.status_known = _UNKNOWN, False
        return self.returncode

    def close(self) -> None:
        if self.stderr is not None:
            self.stderr.close()
        if self.hand is not None:  # parked, never handed over: EOF there ends it
            self.hand.close()
            self.hand = None
        if self.leaves is not None:  # a parked fork's: killed, emptied, removed
            self.leaves.remove()
            self.leaves = None
        if self.returncode is None:
            self.poll()
        self.reply.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.template is not None:
            self.template.fork_ended(self)
            self.template = None
