"""A template's LIFE socket as the parent reads it: the importer's wait status, and those of
the forks that PID 1 of the template's namespace reaped once the importer was gone
(``agent_shim/shim_init.py``); and what the parent asks of the template's outer process
(``agent_shim/shim_outer.py``).

Messages: ``{"t": "exit", "status"}`` for the importer; ``{"t": "exit", "pid", "status",
"cpu_s"}`` for another process PID 1 reaped, ``pid`` as the template's namespace numbers it;
``{"t": "own_dev", "problem"}``, the outer process's answer. Blocking.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Any

from agent_shim.shim_wire import receive_message, send_message

#: The most statuses of reaped processes kept until a fork asks for its own.
_KEPT = 4096


class Life:
    """The parent's end of a template's LIFE socket (non-blocking), and what came on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        #: The importer's wait status, once it came.
        self.status: int | None = None
        self._forks: dict[int, tuple[int, float | None]] = {}
        #: The outer process's answer to the one request in flight (``_asking``).
        self._answer: dict[str, Any] | None = None
        #: EOF came: the template's processes are gone.
        self.ended = False
        self._lock = threading.Lock()
        self._asking = threading.Lock()

    def read(self, importer_within: float = 0.0, answer: bool = False) -> None:
        """Take what has come; with ``importer_within``, wait up to that long (seconds) for
        the importer's status if it is not in yet (with ``answer``, for the outer process's
        answer)."""
        end = time.monotonic() + importer_within
        with self._lock:
            while self.sock.fileno() >= 0:
                done = self._answer is not None if answer else self.status is not None
                left = 0.0 if done else max(0.0, end - time.monotonic())
                if not select.select([self.sock], [], [], left)[0]:
                    return
                try:
                    message, fds = receive_message(self.sock)
                except (OSError, ValueError):  # BlockingIOError among them
                    return
                for fd in fds:
                    os.close(fd)
                if message is None:
                    self.ended = True  # the template's processes are gone: nothing more comes
                    return
                self._take(message)

    def fork_status(self, ns_pid: int) -> tuple[int, float | None] | None:
        """The wait status and CPU seconds of the process ``ns_pid`` (its number in the
        template's namespace) if PID 1 reaped it, else None."""
        self.read()
        with self._lock:
            return self._forks.pop(ns_pid, None)

    def own_dev(
        self, pidfd: int, seconds: float, maps: list[int] | None = None, own: tuple[str, ...] = ()
    ) -> str | None:
        """Ask the template's outer process to mount a ``/dev/pts``, ``/dev/shm`` and
        ``/dev/mqueue`` of its own in the mount namespace of the fork ``pidfd`` names, and wait
        for its answer, ``seconds`` at most: a problem or None. With ``maps`` ([the fork's pid
        in the template's namespace, uid, gid]: an unprivileged trainer's template), it maps the
        fork's ids first (``shim_outer.map_ids``), once it has found that the fork's namespaces
        named in ``own`` were made in its own user namespace."""
        with self._asking:
            try:
                send_message(self.sock, {"t": "own_dev", "maps": maps, "own": list(own)}, [pidfd])
            except OSError as exc:
                return f"the template is gone ({exc.strerror})"
            end = time.monotonic() + seconds
            while True:
                with self._lock:
                    answer, self._answer = self._answer, None
                if answer is not None:
                    problem = answer.get("problem")
                    return None if problem is None else str(problem)
                left = end - time.monotonic()
                if self.ended or self.sock.fileno() < 0:
                    return "the template is gone"
                if left <= 0:
                    return f"no answer from the template within {seconds:g} s"
                self.read(min(left, 0.05), answer=True)

    def close(self) -> None:
        self.sock.close()

    def _take(self, message: dict[str, Any]) -> None:
        if message.get("t") == "own_dev":
            self._answer = message
            return
        status, pid = message.get("status"), message.get("pid")
        if message.get("t") != "exit" or type(status) is not int:
            return
        if pid is None:
            self.status = status
        elif type(pid) is int:
            cpu = message.get("cpu_s")
            self._forks[pid] = (status, float(cpu) if isinstance(cpu, (int, float)) else None)
            if len(self._forks) > _KEPT:  # orphans of the agent's that no fork asks for
                del self._forks[next(iter(self._forks))]
