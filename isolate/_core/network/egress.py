"""The parent's side of an episode's network: an allow-list proxy.

An episode with a network rule runs in its own network namespace with only loopback. The child
listens there and hands the listening sockets to the parent, which accepts on them here. A
socket accepted in the parent reaches the host's network, so every connection is checked first.

Two kinds of listener:

- a proxy port (:meth:`Egress.serve_proxy`) speaking HTTP ``CONNECT``, plain HTTP with an
  absolute URL, and SOCKS5, told apart by the first byte;
- a forward port (:meth:`Egress.serve_forward`) for each loopback rule with a port
  (:func:`.allowlist.forwards`). Each connection goes to the same address and port on the
  host, so an agent given ``http://127.0.0.1:8000/v1`` needs no proxy settings.

Each destination is checked first (:mod:`.allowlist` says how).

**Cancellation:** cancelling a ``serve_*`` call ends its connections at once, and every socket
this module accepted or opened is closed on the way out. The listener stays the caller's: it is
made non-blocking, not closed.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import socket
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import anyio
import anyio.lowlevel

from .allowlist import (
    IP,
    NOT_LISTED,
    Destination,
    Rule,
    destination,
    ip_of,
    is_local_name,
    own_addresses,
    refusal,
    reserved,
)
from .streams import (
    SOCKS_BAD_ADDRESS,
    SOCKS_BAD_COMMAND,
    SOCKS_FAILURE,
    SOCKS_HOST_UNREACHABLE,
    SOCKS_NOT_ALLOWED,
    SOCKS_REFUSED,
    Closed,
    Reader,
    Target,
    connect,
    http_answer,
    last_word,
    nodelay,
    parse_http,
    send_all,
    socks_reply,
    splice,
)

_NAMES_KEPT = 32  # distinct refused destinations counted by name; the rest count as "other"
_NOTE_LIMIT = 100  # note lines per episode
_ACCEPT_BACKOFF = 0.1  # seconds to wait when the parent is out of file descriptors

# accept(2) errors that belong to one queued client; and those that mean "try again soon".
_ACCEPT_RETRY = frozenset(
    {errno.ECONNABORTED, errno.EINTR, errno.EPROTO, errno.ENETDOWN, errno.ENETUNREACH}
    | {errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.ENONET}
)
_ACCEPT_BACKOFF_ON = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _Refused(Exception):
    """The destination is not allowed; counted and noted already."""

    def __init__(self, dest: Destination, reason: str) -> None:
        super().__init__(reason)
        extra = "" if reason == NOT_LISTED else f" ({reason})"
        self.text = f"isolate: {dest} is not in this episode's network allow-list{extra}"


class _Failed(Exception):
    """The destination is allowed but could not be reached."""

    def __init__(self, dest: Destination, reason: str, socks_code: int) -> None:
        super().__init__(reason)
        self.text = f"isolate: cannot connect to {dest}: {reason}"
        self.socks_code = socks_code


class Egress:
    """One episode's side of the proxy: its rules, its bound on connections, its counts.

    ``note`` gets one line per refused destination (at most 100 lines per episode).
    ``max_connections`` bounds the connections open at once over all listeners; at the bound
    no more are accepted, so more wait in the kernel's backlog. ``head_timeout`` (seconds)
    bounds the wait for a complete request; ``connect_timeout`` (seconds) resolving and
    connecting upstream."""

    def __init__(
        self,
        rules: Sequence[Rule],
        *,
        note: Callable[[str], None],
        max_connections: int = 64,
        head_timeout: float = 30.0,
        connect_timeout: float = 30.0,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if head_timeout <= 0 or connect_timeout <= 0:
            raise ValueError("head_timeout and connect_timeout must be > 0 seconds")
        self._rules = tuple(rules)
        self._note = note
        self._slots = anyio.Semaphore(max_connections)
        self._head_timeout = head_timeout
        self._connect_timeout = connect_timeout
        self._refused: dict[str, int] = {}
        self._refused_total = 0
        self._allowed = 0
        self._noted: set[str] = set()
        self._notes = 0

    @property
    def refused(self) -> dict[str, int]:
        """Refused connections by ``host:port``, first seen first; past 32 names, "other"."""
        return dict(self._refused)

    @property
    def allowed(self) -> int:
        """Connections let through (connected upstream)."""
        return self._allowed

    def summary(self) -> str | None:
        """One line on what was refused, or None when nothing was."""
        if not self._refused_total:
            return None
        names = [name for name in self._refused if name != "other"]
        if "other" in self._refused:
            names.append("others")
        plural = "" if self._refused_total == 1 else "s"
        return f"network: {self._refused_total} connection{plural} refused: {', '.join(names)}"

    async def serve_proxy(self, listener: socket.socket) -> None:
        """Accept proxy connections on ``listener`` until cancelled."""
        await self._serve(listener, self._proxy)

    async def serve_forward(self, listener: socket.socket, address: str, port: int) -> None:
        """Accept connections on ``listener`` until cancelled and splice each to ``address``
        (an IP literal) and ``port`` on the host. Allowed by construction: see :func:`forwards`."""
        ip = ip_of(address)
        if ip is None or not 0 < port < 65536:
            raise ValueError(f"cannot forward to {address!r} port {port}")
        await self._serve(listener, partial(self._forward, Destination(str(ip), ip, port)))

    async def _serve(
        self, listener: socket.socket, handle: Callable[[socket.socket], Awaitable[None]]
    ) -> None:
        listener.setblocking(False)
        async with anyio.create_task_group() as tg:
            while True:
                # Take the slot before accepting: at the bound, clients wait in the backlog.
                await self._slots.acquire()
                try:
                    conn = await self._accept(listener)
                except BaseException:
                    self._slots.release()
                    raise
                tg.start_soon(self._run, handle, conn)

    async def _accept(self, listener: socket.socket) -> socket.socket:
        """The next connection. A listener that fails for good (the child still holds it and
        may shut it down) ends accepting, not the episode: this then waits to be cancelled."""
        while True:
            try:
                return listener.accept()[0]
            except BlockingIOError:
                await anyio.wait_readable(listener)
            except OSError as exc:
                if exc.errno in _ACCEPT_RETRY:
                    continue  # that client's trouble, reported early (accept(2))
                problem = exc.strerror or str(exc)
                if exc.errno not in _ACCEPT_BACKOFF_ON:
                    self._say(f"network: stopped accepting connections: {problem}")
                    await anyio.sleep_forever()
                if problem not in self._noted:  # once: it may last
                    self._noted.add(problem)
                    self._say(f"network: cannot accept connections for now: {problem}")
                await anyio.sleep(_ACCEPT_BACKOFF)

    async def _run(
        self, handle: Callable[[socket.socket], Awaitable[None]], conn: socket.socket
    ) -> None:
        try:
            conn.setblocking(False)
            nodelay(conn)
            await handle(conn)
        except (OSError, Closed):
            pass  # the client went away: nothing to tell anyone
        except Exception as exc:
            # Every byte is the agent's: a request that trips a bug ends its own connection,
            # never the episode's task group.
            self._say(f"network: proxy error: {exc!r}")
        finally:
            conn.close()
            self._slots.release()

    async def _proxy(self, conn: socket.socket) -> None:
        reader = Reader(conn)
        # Without a complete request in time, the connection is closed without a word. The
        # handler lifts this deadline once it has the request.
        with anyio.move_on_after(self._head_timeout) as head_scope:
            await reader.fill()
            handle = self._socks if reader.buf[0] == 0x05 else self._http
            await handle(conn, reader, head_scope)

    async def _http(
        self, conn: socket.socket, reader: Reader, head_scope: anyio.CancelScope
    ) -> None:
        head = await reader.head()
        head_scope.deadline = math.inf
        if head is None:
            await last_word(conn, http_answer(431, "isolate: request head over 64 KiB"))
            return
        try:
            request = parse_http(head)
        except ValueError as exc:
            await last_word(conn, http_answer(400, f"isolate: {exc}"))
            return
        try:
            upstream = await self._open(request.dest)
        except _Refused as exc:
            await last_word(conn, http_answer(403, exc.text))
            return
        except _Failed as exc:
            await last_word(conn, http_answer(502, exc.text))
            return
        try:
            if request.connect:
                await send_all(conn, b"HTTP/1.1 200 Connection established\r\n\r\n")
            await splice(conn, upstream, request.forwarded + reader.take_now(len(reader.buf)))
        finally:
            upstream.close()

    async def _socks(
        self, conn: socket.socket, reader: Reader, head_scope: anyio.CancelScope
    ) -> None:
        """SOCKS5 without authentication, CONNECT only (RFC 1928)."""
        _, count = await reader.take(2)
        if 0x00 not in await reader.take(count):
            await last_word(conn, b"\x05\xff")  # no acceptable method
            return
        await send_all(conn, b"\x05\x00")
        version, command, _, kind = await reader.take(4)
        if version != 0x05:
            return
        if command != 0x01:
            await last_word(conn, socks_reply(SOCKS_BAD_COMMAND))
            return
        if kind == 0x01:
            host = str(ipaddress.IPv4Address(await reader.take(4)))
        elif kind == 0x04:
            host = str(ipaddress.IPv6Address(await reader.take(16)))
        elif kind == 0x03:
            (length,) = await reader.take(1)
            host = (await reader.take(length)).decode("ascii", "replace")
        else:
            await last_word(conn, socks_reply(SOCKS_BAD_ADDRESS))
            return
        try:
            dest = destination(host, int.from_bytes(await reader.take(2), "big"))
        except ValueError:
            await last_word(conn, socks_reply(SOCKS_FAILURE))
            return
        head_scope.deadline = math.inf
        try:
            upstream = await self._open(dest)
        except _Refused:
            await last_word(conn, socks_reply(SOCKS_NOT_ALLOWED))
            return
        except _Failed as exc:
            await last_word(conn, socks_reply(exc.socks_code))
            return
        try:
            await send_all(conn, socks_reply(0x00))
            await splice(conn, upstream, reader.take_now(len(reader.buf)))
        finally:
            upstream.close()

    async def _forward(self, dest: Destination, conn: socket.socket) -> None:
        try:
            upstream = await self._dial(dest)
        except _Failed:
            return  # nothing to answer on a raw forward: the client sees the close
        try:
            await splice(conn, upstream, b"")
        finally:
            upstream.close()

    async def _open(self, dest: Destination) -> socket.socket:
        """A socket connected to ``dest`` if the rules allow it; else _Refused or _Failed."""
        reason = refusal(self._rules, dest)
        if reason is not None:
            raise self._refuse(dest, reason)
        return await self._dial(dest)

    async def _dial(self, dest: Destination) -> socket.socket:
        """A socket connected to ``dest``, resolved and filtered; else _Refused or _Failed."""
        # Not fail_after: its TimeoutError could not be told from a connect's ETIMEDOUT.
        with anyio.move_on_after(self._connect_timeout):
            try:
                sock = await connect(await self._targets(dest))
            except OSError as exc:
                refused = exc.errno == errno.ECONNREFUSED
                code = SOCKS_REFUSED if refused else SOCKS_HOST_UNREACHABLE
                raise _Failed(dest, exc.strerror or str(exc), code) from None
            nodelay(sock)
            self._allowed += 1
            return sock
        timeout = f"timed out after {self._connect_timeout:g} s"
        raise _Failed(dest, timeout, SOCKS_HOST_UNREACHABLE)

    async def _targets(self, dest: Destination) -> list[Target]:
        """Where to connect for ``dest``: an IP literal as it is, a name resolved and filtered."""
        if dest.ip is not None:
            family = socket.AF_INET6 if dest.ip.version == 6 else socket.AF_INET
            return [(family, (dest.host, dest.port))]
        try:
            found = await anyio.getaddrinfo(dest.host, dest.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise _Failed(dest, f"cannot resolve: {exc.strerror}", SOCKS_HOST_UNREACHABLE) from None
        local = is_local_name(dest.host)
        own: frozenset[IP] = frozenset() if local else own_addresses()
        targets: list[Target] = []
        kinds: list[str] = []
        for family, _, _, _, address in found:
            ip = ip_of(address[0])
            if ip is None:
                continue
            kind = ("not loopback" if not ip.is_loopback else None) if local else reserved(ip, own)
            if kind is None:
                targets.append((family, address))
            else:
                kinds.append(f"{ip}, {kind}")
        if not targets and kinds:
            raise self._refuse(dest, f"resolves to {kinds[0]}")
        return targets

    def _refuse(self, dest: Destination, reason: str) -> _Refused:
        """Count and note a refusal; the exception to raise."""
        name = str(dest)
        named = len(self._refused) - ("other" in self._refused)
        if name not in self._refused and named >= _NAMES_KEPT:
            name = "other"
        self._refused[name] = self._refused.get(name, 0) + 1
        self._refused_total += 1
        if str(dest) not in self._noted and self._notes < _NOTE_LIMIT:
            self._noted.add(str(dest))
            self._say(f"network: refused {dest} ({reason})")
        return _Refused(dest, reason)

    def _say(self, line: str) -> None:
        """``note``, at most 100 lines per episode; the last says that more were left out."""
        if self._notes < _NOTE_LIMIT - 1:
            self._note(line)
        elif self._notes == _NOTE_LIMIT - 1:
            self._note("network: more refusals and errors of this episode are not shown")
        self._notes += 1
