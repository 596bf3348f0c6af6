"""Promise: an episode reaches on the network only what it is allowed: no port a sandbox does
not allow, nothing with ``Sandbox(connect=[])``, and not a sibling episode's traffic on
loopback. Which layer answers:

- ``connect`` to a port that is not allowed: Landlock's TCP rules (ABI 4), ``EACCES``; no TCP
  connection is left open.
- sniffing a sibling's key on loopback: no ``NET_RAW`` (``EPERM``), and a network namespace
  of its own with a network rule.
The allow-list of ``EpisodeSpec.network`` is ``test_network.py``'s."""

from __future__ import annotations

import http.server
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import isolate

from .. import _internals
from ..conftest import MARKS, SLOW, Agents, episode_processes, wait_for
from ..teardown._trees import needs
from ._attacks import (
    World,
    _denied,
    assert_forked,
    hostile_as_nobody,
    linux_only,
    needs_net,
    nobody_parent,
    scratch,
    world,
)

pytestmark = pytest.mark.anyio
__all__ = ["scratch", "world"]  # fixtures, used by name


@pytest.fixture
def two_servers() -> Iterator[tuple[int, int]]:
    """Two TCP servers on 127.0.0.1 that answer every connection with ``hello``."""
    servers = []
    stop = threading.Event()
    for _ in range(2):
        sock = socket.create_server(("127.0.0.1", 0))
        sock.settimeout(0.1)
        servers.append(sock)

    def serve(sock: socket.socket) -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"hello")

    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    yield servers[0].getsockname()[1], servers[1].getsockname()[1]
    stop.set()
    for thread in threads:
        thread.join()
    for sock in servers:
        sock.close()


@needs_net
async def test_connect_to_a_port_that_is_not_allowed(
    world: World, two_servers: tuple[int, int]
) -> None:
    allowed, other = two_servers
    code = """
        import socket

        def talk(port):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                return s.recv(5).decode()

        out["allowed"] = try_(talk, data["allowed"])
        out["other"] = try_(talk, data["other"])
        """
    found = await world.attempt(
        code, isolate.Sandbox(connect=[allowed]), allowed=allowed, other=other
    )
    assert found["allowed"] == "hello"
    assert _denied(found["other"]), found
    # connect=None leaves the network alone.
    found = await world.attempt(code, isolate.Sandbox(), allowed=allowed, other=other)
    assert found == {"allowed": "hello", "other": "hello"}


#: Calls the server with its key until told to stop.
CALLER = """
import os, time, urllib.request
def run(data):
    calls = 0
    while not os.path.exists(data["stop"]):
        headers = {"Authorization": "Bearer " + data["key"]}
        urllib.request.urlopen(urllib.request.Request(data["url"], headers=headers)).read()
        calls += 1
        time.sleep(0.01)
    return 1.0, calls
"""


#: Listens on loopback for a while, by every raw means, for the sibling's key.
SNIFFER = r"""
import errno, os, socket, time
def run(data):
    found = {}
    for name, family, kind, proto in (
        ("packet", socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)),  # ETH_P_ALL
        ("raw tcp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP),
    ):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            found[name] = errno.errorcode[exc.errno]
            continue
        sock.settimeout(0.1)
        seen, end = b"", time.monotonic() + 2
        while time.monotonic() < end and data["key"].encode() not in seen:
            try:
                seen += sock.recv(65536)
            except socket.timeout:
                pass
        found[name] = "read the key" if data["key"].encode() in seen else "nothing"
        sock.close()
    open(data["stop"], "w").close()
    return 1.0, found
"""


@linux_only
@pytest.mark.parametrize("containment", ["auto", "landlock"])
async def test_a_sibling_episode_cannot_read_anothers_key_on_loopback(
    agents: Any, scratch: Path, containment: str
) -> None:
    if containment != "auto":
        needs(containment)
    key = f"sk-sibling-{uuid.uuid4().hex}"
    heard: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            heard.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stop = scratch / "stop"
    data = {"key": key, "url": f"http://127.0.0.1:{server.server_port}/", "stop": str(stop)}
    outcomes: dict[str, isolate.EpisodeOutcome] = {}
    try:
        caller = agents.spec(CALLER, containment=containment)
        sniffer = agents.spec(SNIFFER, containment=containment)

        async def one(name: str, spec: isolate.EpisodeSpec) -> None:
            outcomes[name] = await isolate.run_episode(spec, data)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "caller", caller)
            await anyio.to_thread.run_sync(wait_for, lambda: heard, 20.0 * SLOW, "a call")
            tg.start_soon(one, "sniffer", sniffer)
    finally:
        stop.touch()
        server.shutdown()
        server.server_close()
    assert outcomes["caller"].status == "ok", outcomes["caller"].summary()
    assert heard[0] == f"Bearer {key}"  # the key was on loopback the while
    assert outcomes["sniffer"].status == "ok", outcomes["sniffer"].summary()
    assert outcomes["sniffer"].info == {"packet": "EPERM", "raw tcp": "EPERM"}
    assert agents.left() == []


@pytest.fixture
def tcp_server() -> Iterator[int]:
    """A listening TCP socket on 127.0.0.1 (the kernel completes connections to its backlog)."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:
        yield server.getsockname()[1]


CONNECT = """
import socket
def run(data):
    try:
        with socket.create_connection(("127.0.0.1", data["port"]), timeout=5):
            return 1.0, "connected"
    except OSError as exc:
        return 0.0, type(exc).__name__
"""


async def test_connect_to_no_port_leaves_no_tcp_open(agents: Agents, tcp_server: int) -> None:
    if _internals.landlock_abi() < 4:
        pytest.skip(
            f"containment: TCP connect rules need Landlock ABI 4, not {_internals.landlock_abi()}"
        )
    work = agents.tmp / "work"
    work.mkdir()
    for box, expected in [
        (isolate.Sandbox(), "connected"),  # the control: the server is there to reach
        (isolate.Sandbox(connect=[]), "PermissionError"),
    ]:
        spec = agents.spec(CONNECT, sandbox=box, cwd=work)
        outcome = await isolate.run_episode(spec, {"port": tcp_server})
        assert outcome.status == "ok", outcome.summary()
        assert outcome.info == expected, (box, outcome.info)
    assert outcome.sandbox is not None
    assert outcome.sandbox.missing == ()
    assert "TCP connect only to ports none" in outcome.sandbox.enforced


#: Two siblings: the server listens on its loopback and says its port; the client tries it.
LOOPBACK_SIBLINGS = (
    MARKS
    + r"""
import errno, os, socket


def run(data):
    pid_dir = os.environ["PID_DIR"]
    if data["role"] == "server":
        with socket.create_server(("127.0.0.1", 0)) as server:
            with open(os.path.join(pid_dir, "port.tmp"), "w") as f:
                f.write(str(server.getsockname()[1]))
            os.rename(os.path.join(pid_dir, "port.tmp"), os.path.join(pid_dir, "port"))
            wait("tried")
        return 1.0, {"net": os.stat("/proc/self/ns/net").st_ino}
    wait("port")
    port = int(open(os.path.join(pid_dir, "port")).read())
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        found = "connected"
    except OSError as exc:
        found = errno.errorcode.get(exc.errno, str(exc))
    mark("tried")
    return 1.0, {"net": os.stat("/proc/self/ns/net").st_ino, "tcp": found}
"""
)


@linux_only
@pytest.mark.parametrize("plain", [True, False], ids=["control", "episodes"])
def test_an_unprivileged_trainers_template_gives_each_fork_a_network_of_its_own(
    plain: bool,
) -> None:
    """As ``nobody``, episodes of one template under ``Sandbox(network="none")``: each fork
    makes a network namespace of its own in its own user namespace (the template's outer
    process maps its ids and checks that its namespaces are its own), so a sibling's loopback
    port is not there. The control: two plain processes, where the client connects."""
    box = 'isolate.Sandbox(write=(pids,), network="none")'
    parent = nobody_parent(box, ("server", "client"), plain=plain)
    with hostile_as_nobody("isolate-loopback-", LOOPBACK_SIBLINGS, parent) as (work, report):
        outcomes = report["outcomes"]
        if not plain:
            assert_forked(outcomes)
        server, client = outcomes["server"]["info"], outcomes["client"]["info"]
        assert client["tcp"] == ("connected" if plain else "ECONNREFUSED")
        assert (client["net"] == server["net"]) is plain
        assert episode_processes(f"PID_DIR={work}/pids".encode()) == []
