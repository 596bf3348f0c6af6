"""The bytes of the egress proxy: a client's request read and parsed (HTTP ``CONNECT``, plain
HTTP with an absolute URL, SOCKS5 replies), the answers, and the copying of bytes between two
non-blocking sockets in the event loop.

**Cancellation:** every function here may be cancelled at an await; a socket it opened is
closed on the way out, one it was given stays the caller's.
"""

from __future__ import annotations

import errno
import os
import re
import socket
from dataclasses import dataclass
from typing import TypeAlias

import anyio
import anyio.lowlevel

from .allowlist import Destination, destination, split_authority

Target: TypeAlias = "tuple[int, tuple[str, int]]"  # (address family, socket address)


_CHUNK = 64 * 1024  # bytes per recv
_HEAD_LIMIT = 64 * 1024  # bytes of an HTTP request head; more gets 431
_LINGER = 1.0  # seconds a refused client has to close after its answer
_LINGER_BYTES = 1024 * 1024  # bytes taken from it meanwhile

_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # tab is allowed in header values
_HOP_BY_HOP = frozenset({b"connection", b"proxy-connection", b"proxy-authorization"})
_REASONS = {
    200: "Connection established",
    400: "Bad Request",
    403: "Forbidden",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
}

# SOCKS5 reply codes (RFC 1928).
SOCKS_FAILURE = 0x01
SOCKS_NOT_ALLOWED = 0x02
SOCKS_HOST_UNREACHABLE = 0x04
SOCKS_REFUSED = 0x05
SOCKS_BAD_COMMAND = 0x07
SOCKS_BAD_ADDRESS = 0x08


class Closed(Exception):
    """The client closed before its request was complete."""


@dataclass(frozen=True)
class HttpRequest:
    dest: Destination
    connect: bool  # CONNECT: answer 200, then splice; else send ``forwarded`` upstream first
    forwarded: bytes


class Reader:
    """A client's bytes, buffered while its request is parsed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    async def fill(self) -> None:
        data = await recv(self.sock)
        if not data:
            raise Closed
        self.buf += data

    async def take(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self.fill()
        return self.take_now(n)

    async def head(self) -> bytes | None:
        """An HTTP request head through its blank line, or None when it is over the limit."""
        start = 0
        while True:
            end = self.buf.find(b"\r\n\r\n", max(0, start - 3))
            if end >= 0:
                return self.take_now(end + 4) if end + 4 <= _HEAD_LIMIT else None
            if len(self.buf) >= _HEAD_LIMIT:
                return None
            start = len(self.buf)
            await self.fill()

    def take_now(self, n: int) -> bytes:
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def parse_http(head: bytes) -> HttpRequest:
    """The destination of an HTTP proxy request; ValueError with a reason when malformed."""
    lines = head[:-4].split(b"\r\n")
    if any(_CONTROL.search(line) for line in lines):
        raise ValueError("control character in the request head")
    words = lines[0].decode("latin-1").split(" ")
    if len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise ValueError("malformed request line")
    method, target, version = words
    if not _TOKEN.fullmatch(method.encode("latin-1")):
        raise ValueError("malformed method")
    headers = lines[1:]
    names = [line.partition(b":")[0] for line in headers]
    if not all(b":" in line for line in headers) or not all(map(_TOKEN.fullmatch, names)):
        raise ValueError("malformed header line")
    if method == "CONNECT":
        host, port = split_authority(target)
        if port is None:
            raise ValueError("CONNECT needs host:port")
        return HttpRequest(destination(host, port), True, b"")
    if target[:7].lower() != "http://":
        raise ValueError("this is a proxy: send an absolute http:// URL")
    rest = target[7:]
    cut = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    if "@" in authority:
        raise ValueError("user information in the URL")
    host, port = split_authority(authority)
    dest = destination(host, 80 if port is None else port)
    kept = [
        line for line, name in zip(headers, names, strict=True) if name.lower() not in _HOP_BY_HOP
    ]
    if b"host" not in (name.lower() for name in names):
        kept.insert(0, b"Host: " + authority.encode("latin-1"))
    path = path if path.startswith("/") else "/" + path
    forwarded = [f"{method} {path} {version}".encode("latin-1"), *kept, b"Connection: close"]
    return HttpRequest(dest, False, b"\r\n".join(forwarded) + b"\r\n\r\n")


def http_answer(status: int, text: str) -> bytes:
    body = (text + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def socks_reply(code: int) -> bytes:
    # The bound address 0.0.0.0:0: clients do not use it for CONNECT.
    return bytes([0x05, code, 0x00, 0x01, 0, 0, 0, 0, 0, 0])


async def recv(sock: socket.socket) -> bytes:
    """Up to 64 KiB; b"" at end of stream."""
    while True:
        try:
            return sock.recv(_CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(sock)


async def send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except BlockingIOError:
            await anyio.wait_writable(sock)


async def last_word(sock: socket.socket, data: bytes) -> None:
    """Send a client its last answer, then half-close and take what it still sends until it
    closes, for at most 1 s and 1 MiB: closing with its bytes unread would reset the
    connection, and the client could lose the answer."""
    await send_all(sock, data)
    sock.shutdown(socket.SHUT_WR)
    with anyio.move_on_after(_LINGER):
        taken = 0
        while taken < _LINGER_BYTES and (chunk := await recv(sock)):
            taken += len(chunk)


async def _pump(
    src: socket.socket, dst: socket.socket, first: bytes, scope: anyio.CancelScope
) -> None:
    """Copy ``src`` to ``dst`` until end of stream, then half-close ``dst``. An error on either
    socket ends the other direction too: the connection is broken."""
    try:
        await send_all(dst, first)
        while data := await recv(src):
            await send_all(dst, data)
            await anyio.lowlevel.checkpoint()  # a fast sender must not starve the loop
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        scope.cancel()


async def splice(client: socket.socket, upstream: socket.socket, to_upstream: bytes) -> None:
    """Copy both ways until both directions have ended."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(_pump, client, upstream, to_upstream, tg.cancel_scope)
        tg.start_soon(_pump, upstream, client, b"", tg.cancel_scope)


async def connect(targets: list[Target]) -> socket.socket:
    """A socket connected to the first of ``targets`` that answers; the last OSError if none."""
    error = OSError(errno.EHOSTUNREACH, "no address to connect to")
    for family, address in targets:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            try:
                sock.connect(address)
            except BlockingIOError:
                await anyio.wait_writable(sock)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, os.strerror(code)) from None
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise error


def nodelay(sock: socket.socket) -> None:
    # Bytes are passed on as they come: batching them again only adds latency (a token stream).
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
