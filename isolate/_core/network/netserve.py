"""The parent's half of one episode's network: the listeners its worker hands over on the
protocol socket, checked, then served by :class:`.egress.Egress` until the episode ends."""

from __future__ import annotations

import array
import os
import socket
from collections.abc import Callable

import anyio

from .egress import Egress
from .plan import NetworkPlan

#: Room for the fds of one message (bytes of ancillary data): a worker sends them in one frame.
_ANCILLARY = socket.CMSG_SPACE(16 * array.array("i").itemsize)


class EpisodeNetwork:
    """Takes the listeners off the protocol socket, and serves them."""

    def __init__(self, plan: NetworkPlan, note: Callable[[str], None]) -> None:
        self.plan = plan
        self.egress = Egress(plan.rules or (), note=note)
        self.listeners: list[socket.socket] = []
        self.received: list[int] = []
        self.taken = False
        self.ready = anyio.Event()

    def recv(self, fd: int, size: int) -> bytes:
        """One read of the protocol socket; fds that come with it are kept until the ``net``
        frame, and closed at once after it: the child sends nothing else with fds."""
        sock = socket.socket(fileno=fd)
        try:
            data, ancillary, _, _ = sock.recvmsg(size, _ANCILLARY)
        finally:
            sock.detach()
        for level, kind, payload in ancillary:
            if level != socket.SOL_SOCKET or kind != socket.SCM_RIGHTS:
                continue
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            for one in fds:
                if self.taken or len(self.received) >= len(self.plan.listen):
                    os.close(one)
                else:
                    self.received.append(one)
        return data

    def take(self) -> str | None:
        """At the ``net`` frame: check what came with it; a protocol violation, or None."""
        if self.taken:
            return "a second net frame"
        self.taken = True
        fds, self.received = self.received, []
        wanted = self.plan.listen
        problem = None
        for i, fd in enumerate(fds):
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                os.close(fd)
                problem = problem or "the net frame came with an fd that is not a socket"
                continue
            self.listeners.append(sock)
            problem = problem or _check(sock, wanted[i])
        if problem is None and len(fds) != len(wanted):
            problem = f"the net frame came with {len(fds)} listeners, not {len(wanted)}"
        if problem is not None:
            self.close()
            return problem
        for sock in self.listeners:
            sock.setblocking(False)
        self.ready.set()
        return None

    async def serve(self) -> None:
        """Serve the listeners once they are here, until cancelled."""
        await self.ready.wait()
        if not self.listeners:
            return  # no network at all: nothing to serve
        async with anyio.create_task_group() as tg:
            proxy, *carried = self.listeners
            tg.start_soon(self.egress.serve_proxy, proxy)
            for sock, (address, port) in zip(carried, self.plan.forwards, strict=True):
                tg.start_soon(self.egress.serve_forward, sock, address, port)

    def close(self) -> None:
        for fd in self.received:
            os.close(fd)
        self.received = []
        for sock in self.listeners:
            sock.close()
        self.listeners = []


def _check(sock: socket.socket, wanted: tuple[str, int]) -> str | None:
    """Is this the listening TCP socket the worker was asked for?"""
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        kind = sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        family = sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
        address, port = sock.getsockname()[:2]
    except (OSError, ValueError, TypeError):
        return "the net frame came with an fd that is not a socket"
    if family not in (socket.AF_INET, socket.AF_INET6) or kind != socket.SOCK_STREAM:
        return "the net frame came with a socket that is not TCP"
    if not listening or (address, port) != wanted:
        return f"the net frame came with a socket on {address} port {port}, not {wanted}"
    return None
