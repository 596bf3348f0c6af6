"""A template's LIFE socket as the parent reads it: the importer's wait status, and those of
the forks that PID 1 of the template's namespace reaped once the importer was gone
(``agent_shim/shim_init.py``).

Messages: ``{"t": "exit", "status"}`` for the importer; ``{"t": "exit", "pid", "status",
"cpu_s"}`` for another process PID 1 reaped, ``pid`` as the template's namespace numbers it.
Blocking.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Any

from agent_shim.shim_wire import receive_message

#: The most statuses of reaped processes kept until a fork asks for its own.
_KEPT = 4096


class Life:
    """The parent's end of a template's LIFE socket (non-blocking), and what came on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        #: The importer's wait status, once it came.
        self.status: int | None = None
        self._forks: dict[int, tuple[int, float | None]] = {}
        self._lock = threading.Lock()

    def read(self, importer_within: float = 0.0) -> None:
        """Take what has come; with ``importer_within``, wait up to that long (seconds) for
        the importer's status if it is not in yet."""
        end = time.monotonic() + importer_within
        with self._lock:
            while self.sock.fileno() >= 0:
                left = 0.0 if self.status is not None else max(0.0, end - time.monotonic())
                if not select.select([self.sock], [], [], left)[0]:
                    return
                try:
                    message, fds = receive_message(self.sock)
                except (OSError, ValueError):  # BlockingIOError among them
                    return
                for fd in fds:
                    os.close(fd)
                if message is None:
                    return  # the template's processes are gone: nothing more comes
                self._take(message)

    def fork_status(self, ns_pid: int) -> tuple[int, float | None] | None:
        """The wait status and CPU seconds of the process ``ns_pid`` (its number in the
        template's namespace) if PID 1 reaped it, else None."""
        self.read()
        with self._lock:
            return self._forks.pop(ns_pid, None)

    def close(self) -> None:
        self.sock.close()

    def _take(self, message: dict[str, Any]) -> None:
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
