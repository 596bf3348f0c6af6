"""The egress proxy against real servers on 127.0.0.1: rules as written, HTTP CONNECT, plain
HTTP through urllib, SOCKS5, the checks that keep the trainer's loopback and the metadata
service out of reach, the bound on connections, and no socket left after cancellation."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import psutil
import pytest
from anyio.abc import SocketAttribute, SocketStream

from isolate._core.network.allowlist import Rule, forwards, parse_rules, rule_for_url
from isolate._core.network.egress import Egress

from .conftest import SLOW, wait_until

T = TypeVar("T")

TIMEOUT = 5.0 * SLOW  # seconds a blocking client waits for any one read
WEB_MARKER = b"web-7f3a"
DASHBOARD_MARKER = b"dashboard-SECRET-91c2"


# --- rules --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "rule"),
    [
        ("example.com", Rule("example.com", None)),
        ("Example.COM:443", Rule("example.com", 443)),
        ("example.com.:80", Rule("example.com", 80)),
        ("*", Rule("*", None)),
        ("*:8000", Rule("*", 8000)),
        ("*.Example.com:443", Rule("*.example.com", 443)),
        ("1.2.3.4:80", Rule("1.2.3.4", 80)),
        ("127.0.0.1", Rule("127.0.0.1", None)),
        ("[::1]:8000", Rule("::1", 8000)),
        ("[::1]", Rule("::1", None)),
        ("[0:0::1]:8000", Rule("::1", 8000)),
        ("[::ffff:127.0.0.1]:80", Rule("127.0.0.1", 80)),
        ("my_host-1.internal:65535", Rule("my_host-1.internal", 65535)),
        ("localhost:8000", Rule("localhost", 8000)),
    ],
)
def test_parse_rules_accepts(entry: str, rule: Rule) -> None:
    assert parse_rules([entry]) == (rule,)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("", "empty"),
        ("http://example.com", "scheme"),
        ("example.com/v1", "path"),
        ("example.com?x", "query"),
        ("user@example.com", "user"),
        ("example .com", "' '"),
        (" example.com", "' '"),
        ("example.com\0", "'\\x00'"),
        ("a.*.com", "'*'"),
        ("*a.com", "'*'"),
        ("example.*", "'*'"),
        ("example.com:0", "bad port"),
        ("example.com:65536", "bad port"),
        ("example.com:http", "bad port"),
        ("example.com:+80", "bad port"),
        ("example.com:", "bad port"),
        (":80", "no host"),
        ("::1", "brackets"),
        ("::1:8000", "brackets"),
        ("[::1", "bracketed"),
        ("[1.2.3.4]:80", "not an IPv6"),
        ("[::1]8000", "':port'"),
        ("[fe80::1%eth0]:80", "bracketed"),
        ("a..com", "not a host name"),
        ("127.1", "not a host name"),
        ("01.2.3.4", "not a host name"),
        ("exämple.com", "not a host name"),
        ("*.", "not a host name"),
    ],
)
def test_parse_rules_rejects(entry: str, says: str) -> None:
    with pytest.raises(ValueError, match="network rule") as caught:
        parse_rules(["fine.example", entry])
    assert repr(entry) in str(caught.value)
    assert says in str(caught.value)


def test_parse_rules_deduplicates_in_order() -> None:
    rules = parse_rules(["b.com", "a.com:80", "B.com", "a.com:80", "[::1]:1", "[0::1]:1"])
    assert rules == (Rule("b.com", None), Rule("a.com", 80), Rule("::1", 1))


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("http://127.0.0.1:8000/v1", Rule("127.0.0.1", 8000)),
        ("https://api.openai.com/v1", Rule("api.openai.com", 443)),
        ("http://Inference.Internal/v1/chat", Rule("inference.internal", 80)),
        ("HTTPS://[::1]:9000", Rule("::1", 9000)),
        ("http://user:sk-key@localhost:8000/v1?x=1", Rule("localhost", 8000)),
    ],
)
def test_rule_for_url(url: str, rule: Rule) -> None:
    assert rule_for_url(url) == rule


@pytest.mark.parametrize(
    "url", ["ftp://example.com/", "example.com:80", "http:///v1", "http://h:x/", "http://*.a.com/"]
)
def test_rule_for_url_rejects(url: str) -> None:
    with pytest.raises(ValueError, match="endpoint URL"):
        rule_for_url(url)


def test_rule_for_url_keeps_the_url_out_of_its_message() -> None:
    with pytest.raises(ValueError, match="http") as caught:
        rule_for_url("gopher://user:sk-SECRET@example.com/")
    assert "SECRET" not in str(caught.value)


def test_forwards() -> None:
    rules = parse_rules(
        ["localhost:8000", "127.0.0.1:8000", "127.0.1.1:9", "[::1]:7", "[::1]", "127.0.0.2"]
        + ["*:8000", "example.com:80", "10.0.0.1:80", "*.localhost:80"]
    )
    assert forwards(rules) == [("127.0.0.1", 8000), ("127.0.1.1", 9), ("::1", 7)]


# --- servers and clients ------------------------------------------------------------------


@dataclass
class Upstream:
    """Servers on 127.0.0.1: raw echo, a web server, and a "dashboard" no episode may reach."""

    echo: int
    web: int
    dashboard: int
    heads: list[bytes] = field(default_factory=list)  # what the web server received
    dashboard_hits: list[bytes] = field(default_factory=list)


async def _echo(stream: SocketStream) -> None:
    """Echo until end of stream, then say so and close: proves both half-closes."""
    async with stream:
        try:
            async for chunk in stream:
                await stream.send(chunk)
            await stream.send(b"[eof]")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass


def _web(marker: bytes, heads: list[bytes]) -> Callable[[SocketStream], Awaitable[None]]:
    async def handle(stream: SocketStream) -> None:
        async with stream:
            head = b""
            try:
                while b"\r\n\r\n" not in head:
                    head += await stream.receive()
                heads.append(head)
                body = marker + b"\n" + head
                answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                await stream.send(answer % len(body) + body)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    return handle


async def _serve(listener: Any, handler: Callable[[SocketStream], Awaitable[None]]) -> None:
    async with listener:  # serve() leaves the listener open when cancelled
        await listener.serve(handler)


@asynccontextmanager
async def upstream() -> AsyncIterator[Upstream]:
    heads: list[bytes] = []
    hits: list[bytes] = []
    handlers = [_echo, _web(WEB_MARKER, heads), _web(DASHBOARD_MARKER, hits)]
    async with anyio.create_task_group() as tg:
        ports = []
        for handler in handlers:
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
            ports.append(listener.extra(SocketAttribute.local_port))
            tg.start_soon(_serve, listener, handler)
        yield Upstream(*ports, heads=heads, dashboard_hits=hits)
        tg.cancel_scope.cancel()


@dataclass
class Proxy:
    egress: Egress
    port: int
    notes: list[str]
    listener: socket.socket


@contextmanager
def listening(host: str = "127.0.0.1") -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, 0))
        sock.listen(16)
        yield sock
    finally:
        sock.close()


@asynccontextmanager
async def proxy(*rules: str, **options: Any) -> AsyncIterator[Proxy]:
    notes: list[str] = []
    egress = Egress(parse_rules(rules), note=notes.append, **options)
    with listening() as listener:
        async with anyio.create_task_group() as tg:
            tg.start_soon(egress.serve_proxy, listener)
            yield Proxy(egress, listener.getsockname()[1], notes, listener)
            tg.cancel_scope.cancel()
    assert not [line for line in notes if "proxy error" in line]


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    return await anyio.to_thread.run_sync(partial(fn, *args))


def dial(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)


def read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"end of stream after {data!r}"
        data += chunk
    return data


def read_head(sock: socket.socket) -> bytes:
    """An HTTP answer's head, one byte at a time: not a byte of what follows."""
    data = b""
    while not data.endswith(b"\r\n\r\n"):
        data += read_exactly(sock, 1)
    return data


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def tunnel(port: int, target: str) -> tuple[socket.socket, bytes]:
    """A CONNECT to ``target``: the socket and the answer's head."""
    sock = dial(port)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    return sock, read_head(sock)


def connect_answer(port: int, target: str) -> bytes:
    """The whole answer to a CONNECT, when it is a refusal: the proxy then closes."""
    sock, head = tunnel(port, target)
    with sock:
        return head + read_all(sock)


def round_trip(sock: socket.socket, data: bytes) -> bytes:
    """Send ``data``, half-close, read to end of stream."""
    sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
    return read_all(sock)


ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


# --- HTTP CONNECT -------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_connect_round_trip_with_half_close(anyio_backend: str) -> None:
    data = os.urandom(300 * 1024)  # several 64 KiB chunks each way
    async with upstream() as up, proxy(f"127.0.0.1:{up.echo}") as px:
        sock, head = await in_thread(tunnel, px.port, f"127.0.0.1:{up.echo}")
        with sock:
            assert head == ESTABLISHED
            # The echo server says [eof] only after the client's half-close reached it, and
            # read_all returns only after the server's close reached the client.
            assert await in_thread(round_trip, sock, data) == data + b"[eof]"
        assert px.egress.allowed == 1
        assert px.egress.refused == {}
        assert px.egress.summary() is None
        assert px.notes == []


@pytest.mark.anyio
async def test_connect_refused_is_counted_and_noted_once() -> None:
    async with upstream() as up, proxy(f"127.0.0.1:{up.echo}") as px:
        target = f"127.0.0.1:{up.dashboard}"
        answers = [await in_thread(connect_answer, px.port, target) for _ in range(3)]
        for answer in answers:
            assert answer.startswith(b"HTTP/1.1 403 Forbidden\r\n")
            assert b"\r\nConnection: close\r\n" in answer
            body = answer.partition(b"\r\n\r\n")[2].decode()
            assert body == f"isolate: {target} is not in this episode's network allow-list\n"
        assert up.dashboard_hits == []
        assert px.egress.refused == {target: 3}
        assert px.egress.allowed == 0
        assert px.notes == [f"network: refused {target} (not in the allow-list)"]
        assert px.egress.summary() == f"network: 3 connections refused: {target}"


@pytest.mark.anyio
async def test_connect_passes_bytes_sent_with_the_head() -> None:
    async with upstream() as up, proxy(f"127.0.0.1:{up.echo}") as px:

        def eager() -> bytes:
            with dial(px.port) as sock:
                target = f"127.0.0.1:{up.echo}"
                sock.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\nearly".encode())
                sock.shutdown(socket.SHUT_WR)
                return read_all(sock)

        assert await in_thread(eager) == ESTABLISHED + b"early[eof]"


@pytest.mark.anyio
async def test_connect_ipv6_literal() -> None:
    async with upstream() as up, proxy("[::1]:9") as px:
        # Allowed, and nothing listens there on [::1] (or IPv6 is off): a 502, not a 403.
        answer = await in_thread(connect_answer, px.port, "[::1]:9")
        assert answer.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
        assert b"isolate: cannot connect to [::1]:9: " in answer
        answer = await in_thread(connect_answer, px.port, f"[::1]:{up.dashboard}")
        assert answer.startswith(b"HTTP/1.1 403 ")
        assert px.egress.summary() == f"network: 1 connection refused: [::1]:{up.dashboard}"


# --- plain HTTP ---------------------------------------------------------------------------


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib skips the proxy for hosts in no_proxy: keep it from skipping ours."""
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)


def fetch(proxy_port: int, url: str) -> tuple[int, bytes]:
    handler = urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{proxy_port}"})
    opener = urllib.request.build_opener(handler)
    try:
        with opener.open(url, timeout=TIMEOUT) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


@pytest.mark.anyio
@pytest.mark.usefixtures("no_proxy_env")
async def test_urllib_through_the_proxy() -> None:
    async with upstream() as up, proxy(f"127.0.0.1:{up.web}") as px:
        status, body = await in_thread(fetch, px.port, f"http://127.0.0.1:{up.web}/v1/x?q=1")
        assert status == 200
        assert body.startswith(WEB_MARKER + b"\n")
        (seen,) = up.heads
        assert seen.startswith(b"GET /v1/x?q=1 HTTP/1.1\r\n")
        assert b"\r\nConnection: close\r\n" in seen
        assert b"proxy-" not in seen.lower()

        status, body = await in_thread(fetch, px.port, f"http://127.0.0.1:{up.dashboard}/")
        assert status == 403
        assert f"127.0.0.1:{up.dashboard} is not in this episode's".encode() in body
        assert up.dashboard_hits == []
        assert px.egress.refused == {f"127.0.0.1:{up.dashboard}": 1}
        assert px.egress.allowed == 1


@pytest.mark.anyio
async def test_absolute_form_is_rewritten_to_origin_form() -> None:
    async with upstream() as up, proxy(f"127.0.0.1:{up.echo}") as px:
        request = (
            f"POST http://127.0.0.1:{up.echo}/p?a=b HTTP/1.1\r\n"
            "Host: 127.0.0.1\r\n"
            "Proxy-Connection: keep-alive\r\n"
            "proxy-authorization: Basic eDp5\r\n"
            "Connection: keep-alive\r\n"
            "X-Kept: 1\r\n"
            "Content-Length: 5\r\n\r\nhello"
        )

        def send() -> bytes:
            with dial(px.port) as sock:
                return round_trip(sock, request.encode())

        assert await in_thread(send) == (
            b"POST /p?a=b HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Kept: 1\r\nContent-Length: 5\r\n"
            b"Connection: close\r\n\r\nhello[eof]"
        )


@pytest.mark.anyio
async def test_absolute_form_without_host_header_gets_one() -> None:
    async with upstream() as up, proxy(f"127.0.0.1:{up.echo}") as px:

        def send() -> bytes:
            with dial(px.port) as sock:
                return round_trip(sock, f"GET http://127.0.0.1:{up.echo} HTTP/1.0\r\n\r\n".encode())

        assert (
            await in_thread(send)
            == (
                f"GET / HTTP/1.0\r\nHost: 127.0.0.1:{up.echo}\r\nConnection: close\r\n\r\n[eof]"
            ).encode()
        )


def answer_to(port: int, data: bytes) -> bytes:
    with dial(port) as sock:
        sock.sendall(data)
        return read_all(sock)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (b"GET /v1 HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),  # to the proxy itself
        (b"GET https://example.com/ HTTP/1.1\r\n\r\n", b"400"),
        (b"GARBAGE\r\n\r\n", b"400"),
        (b"GET http://a.com/ HTTP/2\r\n\r\n", b"400"),
        (b"CONNECT example.com HTTP/1.1\r\n\r\n", b"400"),  # no port
        (b"CONNECT ::1:80 HTTP/1.1\r\n\r\n", b"400"),
        (b"CONNECT a.com:80 HTTP/1.1\r\nNo colon here\r\n\r\n", b"400"),
        (b"CONNECT a.com:80 HTTP/1.1\r\nX: a\nb\r\n\r\n", b"400"),  # a bare LF
        (b"CONNECT a\x00.com:80 HTTP/1.1\r\n\r\n", b"400"),
        (b"GET http://u:p@a.com/ HTTP/1.1\r\n\r\n", b"400"),
        (b"CONNECT a.com:80 HTTP/1.1\r\nX: " + b"y" * 70000 + b"\r\n\r\n", b"431"),
        (b"CONNECT a.com:80 HTTP/1.1\r\nX: " + b"y" * 70000, b"431"),  # no end in sight
    ],
)
async def test_malformed_requests(request_head: bytes, status: bytes) -> None:
    async with proxy("*") as px:
        answer = await in_thread(answer_to, px.port, request_head)
        assert answer.startswith(b"HTTP/1.1 " + status + b" ")
        assert b"\r\nConnection: close\r\n" in answer
        assert px.egress.refused == {}
        assert px.egress.allowed == 0


@pytest.mark.anyio
@pytest.mark.parametrize("sent", [b"", b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n", b"\x05\x01"])
async def test_no_complete_request_in_time_is_closed(sent: bytes) -> None:
    async with proxy("*", head_timeout=0.2) as px:
        started = anyio.current_time()
        assert await in_thread(answer_to, px.port, sent) == b""
        assert anyio.current_time() - started < TIMEOUT


@pytest.mark.anyio
async def test_upstream_failure_is_502_and_not_a_refusal() -> None:
    with listening() as closed:
        dead = closed.getsockname()[1]
    async with proxy(
        f"127.0.0.1:{dead}", "no-such-host.invalid:80", connect_timeout=2.0 * SLOW
    ) as px:
        answer = await in_thread(connect_answer, px.port, f"127.0.0.1:{dead}")
        assert answer.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
        assert f"isolate: cannot connect to 127.0.0.1:{dead}: Connection refused".encode() in answer
        answer = await in_thread(connect_answer, px.port, "no-such-host.invalid:80")
        assert answer.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
        # Where DNS does not answer at all, the connect timeout ends the wait instead.
        assert b"cannot resolve" in answer or b"timed out after" in answer
        assert px.egress.refused == {}
        assert px.egress.summary() is None


@pytest.mark.anyio
async def test_connect_timeout_is_502() -> None:
    # A listener whose accept queue is full drops SYNs: the connect hangs.
    with listening() as full:
        full.listen(0)
        port = full.getsockname()[1]
        with dial(port):
            async with proxy(f"127.0.0.1:{port}", connect_timeout=0.2) as px:
                answer = await in_thread(connect_answer, px.port, f"127.0.0.1:{port}")
                assert answer.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
                assert b"timed out after 0.2 s" in answer
                sock = await in_thread(socks, px.port, ipv4("127.0.0.1"), port)
                with sock:
                    assert (await in_thread(read_all, sock))[:2] == b"\x05\x04"
                assert px.egress.allowed == 0


# --- SOCKS5 -------------------------------------------------------------------------------


def socks(port: int, address: bytes, dport: int, methods: bytes = b"\x00") -> socket.socket:
    """A SOCKS5 CONNECT: ``address`` is ATYP and DST.ADDR. The socket is past the greeting."""
    sock = dial(port)
    sock.sendall(b"\x05" + bytes([len(methods)]) + methods)
    assert read_exactly(sock, 2) == b"\x05\x00"
    sock.sendall(b"\x05\x01\x00" + address + dport.to_bytes(2, "big"))
    return sock


def ipv4(text: str) -> bytes:
    return b"\x01" + socket.inet_aton(text)


def domain(name: str) -> bytes:
    return b"\x03" + bytes([len(name)]) + name.encode()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["ipv4", "domain"])
async def test_socks_allowed(kind: str) -> None:
    async with upstream() as up, proxy(f"127.0.0.1:{up.echo}", f"localhost:{up.echo}") as px:
        address = ipv4("127.0.0.1") if kind == "ipv4" else domain("localhost")

        def talk() -> tuple[bytes, bytes]:
            with socks(px.port, address, up.echo) as sock:
                return read_exactly(sock, 10), round_trip(sock, b"hello")

        reply, echoed = await in_thread(talk)
        assert reply[:2] == b"\x05\x00"
        assert echoed == b"hello[eof]"
        assert px.egress.allowed == 1


@pytest.mark.anyio
async def test_socks_refused_and_unreachable() -> None:
    with listening() as closed:
        dead = closed.getsockname()[1]
    async with upstream() as up, proxy(f"127.0.0.1:{dead}") as px:

        def reply(address: bytes, port: int) -> bytes:
            with socks(px.port, address, port) as sock:
                answer = read_all(sock)
            return answer

        assert await in_thread(reply, ipv4("127.0.0.1"), up.dashboard) == (
            b"\x05\x02\x00\x01" + bytes(6)
        )
        assert (await in_thread(reply, ipv4("127.0.0.1"), dead))[:2] == b"\x05\x05"
        v6 = b"\x04" + socket.inet_pton(socket.AF_INET6, "::ffff:127.0.0.1")
        assert (await in_thread(reply, v6, up.dashboard))[:2] == b"\x05\x02"
        assert (await in_thread(reply, domain("bad name"), up.dashboard))[:2] == b"\x05\x01"
        assert up.dashboard_hits == []
        assert px.egress.refused == {f"127.0.0.1:{up.dashboard}": 2}


@pytest.mark.anyio
async def test_socks_unsupported_method_and_command() -> None:
    async with proxy("*") as px:

        def no_auth_refused() -> bytes:
            with dial(px.port) as sock:
                sock.sendall(b"\x05\x01\x02")  # username/password only
                return read_all(sock)

        def bind() -> bytes:
            with dial(px.port) as sock:
                sock.sendall(b"\x05\x01\x00")
                assert read_exactly(sock, 2) == b"\x05\x00"
                sock.sendall(b"\x05\x02\x00" + ipv4("1.2.3.4") + b"\x00\x50")
                return read_all(sock)

        assert await in_thread(no_auth_refused) == b"\x05\xff"
        assert (await in_thread(bind))[:2] == b"\x05\x07"


# --- what the checks keep out -------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("rule", "target", "allowed"),
    [
        ("localhost:{echo}", "localhost:{echo}", True),
        ("LocalHost", "localhost:{echo}", True),
        ("127.0.0.1", "127.0.0.1:{echo}", True),
        ("[::ffff:127.0.0.1]:{echo}", "127.0.0.1:{echo}", True),
        ("127.0.0.1:{echo}", "[::ffff:127.0.0.1]:{echo}", True),
        # A loopback literal needs a rule naming it: not "*".
        ("*", "127.0.0.1:{dashboard}", False),
        ("*", "127.0.0.2:{dashboard}", False),
        ("*", "[::ffff:127.0.0.1]:{dashboard}", False),
        ("*", "[::1]:{dashboard}", False),
        ("*", "0.0.0.0:{dashboard}", False),  # Linux connects that to loopback
        ("*", "169.254.169.254:80", False),  # the metadata service
        ("*", "[fe80::1]:80", False),
        ("*", "224.0.0.1:80", False),
        # localhost is loopback by name: "*" does not let it through either.
        ("*", "localhost:{dashboard}", False),
        ("*", "evil.localhost:{dashboard}", False),
        ("*.localhost", "localhost:{dashboard}", False),  # subdomains only
        # A name that resolves to loopback, allowed by "*": refused after resolution.
        ("*", "0x7f000001:{dashboard}", False),
        ("127.0.0.1:{dashboard}", "localhost:{dashboard}", False),  # names match names
        ("localhost:{echo}", "localhost:{dashboard}", False),
        ("*.example.com", "example.com:80", False),
    ],
)
async def test_destination_checks(rule: str, target: str, allowed: bool) -> None:
    async with upstream() as up:
        ports = {"echo": up.echo, "dashboard": up.dashboard}
        target = target.format(**ports)
        async with proxy(rule.format(**ports)) as px:
            sock, head = await in_thread(tunnel, px.port, target)
            with sock:
                if allowed:
                    assert head == ESTABLISHED
                    assert await in_thread(round_trip, sock, b"x") == b"x[eof]"
                else:
                    assert head.startswith(b"HTTP/1.1 403 Forbidden\r\n"), head
                    assert sum(px.egress.refused.values()) == 1
                    assert len(px.notes) == 1
            assert up.dashboard_hits == []
            assert px.egress.allowed == int(allowed)


@pytest.mark.anyio
async def test_name_resolving_to_loopback_says_so() -> None:
    async with proxy("*") as px:
        answer = await in_thread(connect_answer, px.port, "0x7f000001:80")
        assert b"(resolves to 127.0.0.1, a loopback address)" in answer
        assert px.notes == [
            "network: refused 0x7f000001:80 (resolves to 127.0.0.1, a loopback address)"
        ]


def own_address() -> str | None:
    """An IPv4 address of this machine that is not loopback or link-local, if it has one."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith(
                ("127.", "169.254.")
            ):
                return address.address
    return None


@pytest.mark.anyio
async def test_own_interface_address_needs_a_rule_naming_it() -> None:
    # A server bound to 0.0.0.0 (Ray's dashboard, often) listens on every interface address.
    mine = own_address()
    if mine is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with listening("0.0.0.0") as server:
        port = server.getsockname()[1]
        server.setblocking(False)
        async with proxy("*") as px:
            answer = await in_thread(connect_answer, px.port, f"{mine}:{port}")
            assert answer.startswith(b"HTTP/1.1 403 ")
            assert b"an address of this machine" in answer
        with pytest.raises(BlockingIOError):
            server.accept()  # the proxy never connected
        async with proxy(f"{mine}:{port}") as px:
            sock, head = await in_thread(tunnel, px.port, f"{mine}:{port}")
            sock.close()
            assert head == ESTABLISHED
        server.accept()[0].close()


# --- forwards -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_serve_forward() -> None:
    with listening() as closed:
        dead = closed.getsockname()[1]
    async with upstream() as up:
        egress = Egress((), note=pytest.fail)
        with listening() as to_echo, listening() as to_dead:
            async with anyio.create_task_group() as tg:
                tg.start_soon(egress.serve_forward, to_echo, "127.0.0.1", up.echo)
                tg.start_soon(egress.serve_forward, to_dead, "127.0.0.1", dead)

                def talk(port: int) -> bytes:
                    with dial(port) as sock:
                        return round_trip(sock, b"abc")

                def closed_at_once(port: int) -> bytes:
                    with dial(port) as sock:
                        return read_all(sock)

                assert await in_thread(talk, to_echo.getsockname()[1]) == b"abc[eof]"
                assert await in_thread(closed_at_once, to_dead.getsockname()[1]) == b""
                tg.cancel_scope.cancel()
        assert egress.allowed == 1
        assert egress.refused == {}


# --- bounds -------------------------------------------------------------------------------


def accept_queue(port: int) -> int:
    """Connections waiting in the backlog of the listener on 127.0.0.1:``port`` (Linux: a
    listening socket's rx_queue in /proc/net/tcp)."""
    local = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == local and fields[3] == "0A":
                return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"no listener on 127.0.0.1:{port}")


@pytest.mark.anyio
async def test_max_connections_leaves_the_rest_in_the_backlog() -> None:
    async with upstream() as up, proxy(f"127.0.0.1:{up.echo}", max_connections=2) as px:
        target = f"127.0.0.1:{up.echo}"
        first, head1 = await in_thread(tunnel, px.port, target)
        second, head2 = await in_thread(tunnel, px.port, target)
        assert head1 == head2 == ESTABLISHED
        third = await in_thread(dial, px.port)
        try:
            third.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
            await wait_until(lambda: accept_queue(px.port) == 1)
            # Let the proxy run: a byte through the first tunnel and back.
            first.sendall(b"y")
            assert await in_thread(read_exactly, first, 1) == b"y"
            assert accept_queue(px.port) == 1  # still not accepted
            third.setblocking(False)
            with pytest.raises(BlockingIOError):
                third.recv(1)
            third.setblocking(True)
            third.settimeout(TIMEOUT)

            first.close()
            assert await in_thread(read_head, third) == ESTABLISHED
            assert accept_queue(px.port) == 0
            assert await in_thread(round_trip, third, b"z") == b"z[eof]"
        finally:
            for sock in (first, second, third):
                sock.close()


@pytest.mark.anyio
async def test_refusals_are_bounded() -> None:
    async with proxy() as px:

        def refuse_all() -> None:
            for port in range(1, 111):
                answer = connect_answer(px.port, f"127.0.0.1:{port}")
                assert answer.startswith(b"HTTP/1.1 403 ")

        await in_thread(refuse_all)
        refused = px.egress.refused
        names = [f"127.0.0.1:{port}" for port in range(1, 33)]
        assert refused == {**dict.fromkeys(names, 1), "other": 110 - 32}
        assert len(px.notes) == 100
        assert px.notes[0] == "network: refused 127.0.0.1:1 (not in the allow-list)"
        assert px.notes[98] == "network: refused 127.0.0.1:99 (not in the allow-list)"
        assert "not shown" in px.notes[99]
        assert px.egress.summary() == (
            f"network: 110 connections refused: {', '.join(names)}, others"
        )


@pytest.mark.anyio
async def test_a_listener_shut_down_by_the_child_ends_accepting_quietly() -> None:
    # The child keeps its copy of the listener and may shut it down: accept() then fails.
    async with upstream() as up, proxy(f"127.0.0.1:{up.echo}") as px:
        sock, head = await in_thread(tunnel, px.port, f"127.0.0.1:{up.echo}")
        with sock:
            assert head == ESTABLISHED
            with socket.socket(fileno=os.dup(px.listener.fileno())) as theirs:
                theirs.shutdown(socket.SHUT_RD)
            await wait_until(
                lambda: px.notes == ["network: stopped accepting connections: Invalid argument"]
            )
            # The open tunnel is still served.
            assert await in_thread(round_trip, sock, b"still") == b"still[eof]"


# --- cancellation -------------------------------------------------------------------------


def sockets() -> set[str]:
    """The sockets this process holds, by inode: unlike a count, not fooled when the garbage
    collector closes some other file meanwhile."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the fd of the listing itself, or one closed meanwhile
        if target.startswith("socket:"):
            found.add(target)
    return found


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other side closed, by end of stream or, when it had not read all that was
    sent, by a reset."""
    try:
        return read_all(sock) == b""
    except ConnectionResetError:
        return True


@pytest.mark.anyio
async def test_cancellation_closes_every_socket() -> None:
    async with upstream() as up:
        before = sockets()
        egress = Egress(parse_rules([f"127.0.0.1:{up.echo}"]), note=lambda line: None)
        clients: list[socket.socket] = []
        with listening() as listener, listening() as forward:
            port = listener.getsockname()[1]
            async with anyio.create_task_group() as tg:
                tg.start_soon(egress.serve_proxy, listener)
                tg.start_soon(egress.serve_forward, forward, "127.0.0.1", up.echo)
                sock, head = await in_thread(tunnel, port, f"127.0.0.1:{up.echo}")
                clients.append(sock)
                assert head == ESTABLISHED
                sock = await in_thread(dial, forward.getsockname()[1])
                clients.append(sock)
                sock.sendall(b"f")
                assert await in_thread(read_exactly, sock, 1) == b"f"
                sock = await in_thread(socks, port, ipv4("127.0.0.1"), up.echo)
                clients.append(sock)
                assert await in_thread(read_exactly, sock, 10) == b"\x05\x00\x00\x01" + bytes(6)
                sock = await in_thread(dial, port)  # a head still on its way
                clients.append(sock)
                sock.sendall(b"CONNECT 127.0.0.1:")
                # 2 listeners, 4 clients, 4 accepted, 3 upstream and 3 at the echo server.
                await wait_until(lambda: len(sockets() - before) >= 16)
                tg.cancel_scope.cancel()
            for sock in clients:
                assert await in_thread(closed_by_peer, sock)
                sock.close()
        await wait_until(lambda: sockets() <= before)
        assert egress.allowed == 3
