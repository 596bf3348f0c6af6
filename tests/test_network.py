"""``Sandbox(network=...)``: an episode in a network namespace of its own, reaching the LLM
endpoint and its allow-list through the parent's egress proxy, and nothing else.

Stand-ins on the trainer's loopback: an LLM endpoint, another allowed server, a "dashboard"
(Ray's job API, say) that must stay out of reach, and a UDP echo server. Each answers with a
marker unique to the test run, so an answer that crossed the wall cannot be mistaken."""

from __future__ import annotations

import http.server
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import isolate

from . import _internals
from .conftest import (
    MARKS,
    SLOW,
    Agents,
    as_nobody,
    episode_processes,
    remove_dead_parents_leaves,
    unprivileged_python,
    wait_for,
    wait_until,
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces"),
]

MARK = secrets.token_hex(8)

# The agent: each probe's result is a word (the answer's marker, an HTTP status or an errno
# name), collected in its info.
AGENT = r'''
import errno, json, os, socket, subprocess, urllib.error, urllib.request


def word(exc):
    if isinstance(exc, urllib.error.HTTPError):
        return "HTTP %d" % exc.code
    if isinstance(exc, urllib.error.URLError):
        exc = exc.reason
    if isinstance(exc, socket.gaierror):
        return "no name"
    if isinstance(exc, socket.timeout):
        return "timeout"
    if isinstance(exc, OSError) and exc.errno:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


def attempt(fn):
    try:
        return fn()
    except Exception as exc:
        return word(exc)


def get(url, proxy=None):
    """urllib with the environment's proxies, or through ``proxy`` for every host."""
    handler = urllib.request.ProxyHandler({"http": proxy} if proxy else None)
    if proxy:
        os.environ.pop("no_proxy", None), os.environ.pop("NO_PROXY", None)
    try:
        opener = urllib.request.build_opener(handler)
        return opener.open(url, timeout=10).read().decode()
    finally:
        os.environ.update({k: v for k, v in ENV.items() if k.lower() == "no_proxy"})


def raw_http(host, port, request):
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode("latin-1")


def udp(port):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))
        sock.send(b"ping")
        return sock.recv(100).decode()


def run(data, probes=None):
    global ENV
    ENV = dict(os.environ)
    proxy = os.environ.get("HTTPS_PROXY")
    llm, allowed, dashboard = data["llm"], data["allowed"], data["dashboard"]
    found = {"proxy": proxy}
    found["llm"] = attempt(lambda: get("http://127.0.0.1:%d/v1/models" % llm))
    found["llm raw"] = attempt(
        lambda: raw_http("127.0.0.1", llm, b"GET / HTTP/1.0\r\n\r\n").split("\r\n\r\n")[-1]
    )
    found["dashboard direct"] = attempt(
        lambda: raw_http("127.0.0.1", dashboard, b"GET / HTTP/1.0\r\n\r\n")
    )
    found["udp"] = attempt(lambda: udp(data["udp"]))
    found["outside"] = attempt(lambda: socket.create_connection(("203.0.113.7", 80), 5).close())
    found["dns"] = attempt(lambda: socket.getaddrinfo("example.com", 80) and "resolved")
    if proxy:
        found["allowed via proxy"] = attempt(lambda: get("http://127.0.0.1:%d/" % allowed, proxy))
        found["dashboard via proxy"] = attempt(
            lambda: get("http://127.0.0.1:%d/" % dashboard, proxy)
        )
        port = int(proxy.rsplit(":", 1)[1])
        connect = b"CONNECT 127.0.0.1:%d HTTP/1.1\r\n\r\n" % dashboard
        found["dashboard connect"] = attempt(
            lambda: raw_http("127.0.0.1", port, connect).split("\r\n")[0]
        )
    for name in probes or ():
        found[name] = PROBES[name](data, proxy)
    return 1.0, found


def httpx_probe(data, proxy):
    import httpx

    out = {}
    # The environment's proxies: the LLM endpoint on loopback goes direct (NO_PROXY).
    out["llm"] = attempt(lambda: httpx.get("http://127.0.0.1:%d/" % data["llm"]).text)
    with httpx.Client(proxy=proxy, trust_env=False) as client:
        out["allowed"] = attempt(
            lambda: client.get("http://127.0.0.1:%d/" % data["allowed"]).text
        )
        out["dashboard"] = attempt(
            lambda: "HTTP %d" % client.get("http://127.0.0.1:%d/" % data["dashboard"]).status_code
        )
    return out


def curl_probe(data, proxy):
    def curl(*args):
        done = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10", *args],
            capture_output=True, text=True,
        )
        return done.stdout or "exit %d" % done.returncode

    return {
        "llm": curl("http://127.0.0.1:%d/" % data["llm"]),
        "dashboard": curl("--noproxy", "", "-x", proxy, "http://127.0.0.1:%d/" % data["dashboard"]),
        "dashboard direct": curl("--noproxy", "*", "http://127.0.0.1:%d/" % data["dashboard"]),
    }


def escape_probe(data, proxy):
    """Leave the namespace for the trainer's: setns into its network namespace (by /proc and by
    pidfd), or make namespaces of one's own; then try the dashboard again."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    out = {}

    def call(fn):
        result = fn()
        return "ok" if result == 0 else errno.errorcode.get(ctypes.get_errno(), "?")

    try:
        fd = os.open("/proc/%d/ns/net" % data["trainer"], os.O_RDONLY)
        out["setns by /proc"] = call(lambda: libc.setns(fd, 0x40000000))
    except OSError as exc:
        out["setns by /proc"] = word(exc)
    try:
        pidfd = os.pidfd_open(data["trainer"])
        out["setns by pidfd"] = call(lambda: libc.setns(pidfd, 0x40000000))
    except OSError as exc:
        out["setns by pidfd"] = word(exc)
    out["unshare user+net"] = call(lambda: libc.unshare(0x10000000 | 0x40000000))
    out["dashboard after"] = attempt(
        lambda: raw_http("127.0.0.1", data["dashboard"], b"GET / HTTP/1.0\r\n\r\n")
    )
    return out


PROBES = {"httpx": httpx_probe, "curl": curl_probe, "escape": escape_probe}
'''


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        body = f"{self.server.name} {MARK}".encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Servers:
    llm: int
    allowed: int
    dashboard: int
    udp: int

    def data(self) -> dict[str, int]:
        return {
            "llm": self.llm,
            "allowed": self.allowed,
            "dashboard": self.dashboard,
            "udp": self.udp,
        }

    def allow(self) -> tuple[str, ...]:
        """The allow-list of these tests: the endpoint as the workflow adds it, another
        server by its address; never the dashboard."""
        return (f"127.0.0.1:{self.llm}", f"127.0.0.1:{self.allowed}", "api.example.com")


@pytest.fixture
def servers() -> Iterator[Servers]:
    started: list[Any] = []
    ports = []
    for name in ("llm", "allowed", "dashboard"):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.name = name  # type: ignore[attr-defined]
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        ports.append(server.server_address[1])
    echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo.bind(("127.0.0.1", 0))
    stop = threading.Event()

    def serve_udp() -> None:
        echo.settimeout(0.2)
        while not stop.is_set():
            try:
                _, peer = echo.recvfrom(100)
                echo.sendto(f"udp {MARK}".encode(), peer)
            except OSError:
                continue

    thread = threading.Thread(target=serve_udp, daemon=True)
    thread.start()
    try:
        yield Servers(*ports, echo.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        echo.close()
        for server in started:
            server.shutdown()
            server.server_close()


def expected_walled(servers: Servers, *, proxy: bool) -> dict[str, Any]:
    """What an agent behind an allow-list finds: the endpoint and the allowed server through
    the proxy, the dashboard refused by it, and nothing at all by any other way."""
    found: dict[str, Any] = {
        "llm": f"llm {MARK}",
        "llm raw": f"llm {MARK}",
        "dashboard direct": "ECONNREFUSED",  # its loopback, where no dashboard listens
        "udp": "ECONNREFUSED",
        "outside": "ENETUNREACH",
        "dns": "no name",
    }
    if proxy:
        found["allowed via proxy"] = f"allowed {MARK}"
        found["dashboard via proxy"] = "HTTP 403"
        found["dashboard connect"] = "HTTP/1.1 403 Forbidden"
    return found


def resolved(containment: str) -> str:
    """The combination ``containment`` resolves to here (``auto``: the first there is)."""
    return _internals.resolve(containment, None)[0]


def forks_have_networks(containment: str | None) -> bool:
    """Whether a template's forks at ``containment`` get networks of their own here: with a
    PID namespace, where user namespaces work (``templates.namespaces.network_problem``)."""
    assert containment is not None
    return "pidns" in containment and _internals.userns_problem() is None


def findings(outcome: isolate.EpisodeOutcome) -> dict[str, Any]:
    assert outcome.status == "ok", (outcome.status, outcome.error, outcome.stderr_tail[-3000:])
    assert isinstance(outcome.info, dict)
    return outcome.info


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# --- the wall, in every start and containment ----------------------------------------------


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("containment", ["auto", "session"])
async def test_an_allow_list_lets_through_the_endpoint_and_its_hosts_and_nothing_else(
    agents: Agents, servers: Servers, containment: str, preload: bool
) -> None:
    """With ``preload`` too: a template's fork makes a network namespace of its own where the
    trainer is root and the template has a PID namespace (``auto`` here); elsewhere (at
    ``session``) the episode starts fresh, with the reason, and is walled in as one."""
    before = open_fds()
    box = isolate.Sandbox(network=servers.allow())
    spec = agents.spec(AGENT, sandbox=box, containment=containment, preload=preload)
    outcome = await isolate.run_episode(spec, servers.data())
    forked = preload and forks_have_networks(outcome.containment)
    assert outcome.start == ("template" if forked else "fresh"), outcome.preload_refused
    if preload and not forked:
        assert outcome.preload_refused is not None
        assert "network namespace of its own" in outcome.preload_refused
    found = findings(outcome)
    proxy = found.pop("proxy")
    assert proxy is not None
    assert proxy.startswith("http://127.0.0.1:")
    assert found == expected_walled(servers, proxy=True)
    assert outcome.sandbox is not None
    refused = f"127.0.0.1:{servers.dashboard}"
    assert outcome.sandbox.refused == {refused: 2}
    assert any(
        line.startswith("network: only through the proxy") for line in outcome.sandbox.enforced
    )
    log = (agents.logs / f"{outcome.episode_id}.log").read_text()
    assert f"network: 2 connections refused: {refused}" in log
    await isolate.close_templates()  # a template's own fds are the parent's too
    await wait_until(lambda: open_fds() <= before)


# --- a template's forks, each with a network of its own ----------------------------------------

#: Two roles of one template: a "server" listens on a loopback port and an abstract unix
#: socket of its network namespace; a "client" forked from the same template tries both, then
#: the LLM endpoint (its own proxy's carried port). Plain processes run it too (the control).
SIBLINGS = (
    MARKS
    + r"""
import errno, os, socket, time, urllib.request



def attempt(family, address):
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(address)
            return sock.recv(64).decode()
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))


def run(data):
    name = "\0isolate-sibling-" + data["mark"]
    if data["role"] == "server":
        tcp = socket.create_server(("127.0.0.1", data["port"]))
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(name)
        unix.listen(1)
        for sock in (tcp, unix):
            sock.settimeout(0.05)
        mark("listening")
        while not os.path.exists(os.path.join(os.environ["PID_DIR"], "checked")):
            for sock in (tcp, unix):
                try:
                    peer = sock.accept()[0]
                    peer.sendall(b"server " + data["mark"].encode())
                    peer.close()
                except socket.timeout:
                    pass
        return 1.0, {"net": os.stat("/proc/self/ns/net").st_ino}
    wait("listening")
    found = {
        "tcp": attempt(socket.AF_INET, ("127.0.0.1", data["port"])),
        "unix": attempt(socket.AF_UNIX, name),
        "net": os.stat("/proc/self/ns/net").st_ino,
    }
    mark("checked")
    if data.get("llm"):
        url = "http://127.0.0.1:%d/v1/models" % data["llm"]
        found["llm"] = urllib.request.urlopen(url, timeout=10).read().decode()
    return 1.0, found
"""
)


def test_the_sibling_attack_reaches_a_server_in_one_network_namespace(tmp_path: Path) -> None:
    """The control: the same two roles as plain processes of one network namespace."""
    (tmp_path / "siblings.py").write_text(SIBLINGS)
    mark = secrets.token_hex(6)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    data = {"mark": mark, "port": port}
    script = (
        "import json, sys, siblings; print(json.dumps(siblings.run(json.loads(sys.argv[1]))[1]))"
    )
    env = {**os.environ, "PID_DIR": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    server = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps({**data, "role": "server"})], env=env
    )
    try:
        client = subprocess.run(
            [sys.executable, "-c", script, json.dumps({**data, "role": "client"})],
            env=env,
            capture_output=True,
            timeout=30 * SLOW,
        )
        found = json.loads(client.stdout)
        assert (found["tcp"], found["unix"]) == (f"server {mark}", f"server {mark}")
    finally:
        server.wait(timeout=30 * SLOW)


async def test_each_fork_of_a_template_has_a_network_of_its_own(
    agents: Agents, servers: Servers
) -> None:
    """Episodes of one template under ``Sandbox(network=...)``: neither reaches a sibling's
    loopback port or abstract unix socket, each reaches the endpoint through its own proxy."""
    if not forks_have_networks(await anyio.to_thread.run_sync(resolved, "auto")):
        pytest.skip(
            "a template's forks have networks of their own only with pidns and user namespaces"
        )
    box = isolate.Sandbox(network=servers.allow(), write=(agents.pids,))
    spec = agents.spec(SIBLINGS, sandbox=box, preload=True)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    data = {"mark": secrets.token_hex(6), "port": port}
    results: dict[str, isolate.EpisodeOutcome] = {}

    async def one(role: str) -> None:
        results[role] = await isolate.run_episode(spec, {**data, "role": role, "llm": servers.llm})

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "server")
        tg.start_soon(one, "client")
    for outcome in results.values():
        assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    found = results["client"].info
    assert (found["tcp"], found["unix"]) == ("ECONNREFUSED", "ECONNREFUSED"), found
    assert found["llm"] == f"llm {MARK}"
    assert found["net"] != results["server"].info["net"]
    await isolate.close_templates()
    assert agents.left() == []


#: At import, in a template whose episodes have a network: the trainer's loopback server and an
#: outside address, tried; what was found goes to a file.
IMPORT_REACHES = r"""
import errno, json, os, socket


def _try(address):
    try:
        socket.create_connection(address, timeout=5).close()
        return "connected"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


if os.environ["ISOLATE_EPISODE_ID"].startswith("template."):
    _pids = os.environ["PID_DIR"]
    with open(os.path.join(_pids, "llm_port")) as f:
        _llm = int(f.read())
    with open(os.path.join(_pids, "import.json"), "w") as f:
        json.dump({"llm": _try(("127.0.0.1", _llm)), "outside": _try(("192.0.2.1", 80))}, f)


def run(data):
    return 1.0
"""


async def test_a_network_templates_import_reaches_nothing(agents: Agents, servers: Servers) -> None:
    """The import runs in a network namespace of the template's own, with loopback only and
    no proxy: the trainer's endpoint is not there, nothing outside is."""
    if not forks_have_networks(await anyio.to_thread.run_sync(resolved, "auto")):
        pytest.skip(
            "a template's forks have networks of their own only with pidns and user namespaces"
        )
    box = isolate.Sandbox(network=servers.allow(), write=(agents.pids,))
    (agents.pids / "llm_port").write_text(str(servers.llm))
    spec = agents.spec(IMPORT_REACHES, sandbox=box, preload=True)
    outcome = await isolate.run_episode(spec, {})
    assert (outcome.status, outcome.start) == ("ok", "template"), outcome.summary()
    found = json.loads((agents.pids / "import.json").read_text())
    assert found == {"llm": "ECONNREFUSED", "outside": "ENETUNREACH"}
    await isolate.close_templates()
    assert agents.left() == []


async def test_a_parked_fork_has_a_network_of_its_own_at_its_hand_over(
    agents: Agents, servers: Servers
) -> None:
    if not forks_have_networks(await anyio.to_thread.run_sync(resolved, "auto")):
        pytest.skip(
            "a template's forks have networks of their own only with pidns and user namespaces"
        )
    box = isolate.Sandbox(network=servers.allow())
    spec = agents.spec(AGENT, sandbox=box, preload=True)
    await isolate.park(spec, 2)
    outcome = await isolate.run_episode(spec, servers.data())
    assert outcome.start == "template"
    found = findings(outcome)
    found.pop("proxy")
    assert found == expected_walled(servers, proxy=True)
    await isolate.park(spec, 0)
    await isolate.close_templates()
    assert agents.left() == []


async def test_an_agents_clients_work_unchanged_behind_the_proxy(
    agents: Agents, servers: Servers
) -> None:
    if shutil.which("curl") is None:
        pytest.fail("curl is part of this machine; the test needs it")
    box = isolate.Sandbox(network=servers.allow())
    spec = agents.spec(AGENT, sandbox=box)
    outcome = await isolate.run_episode(spec, servers.data(), kwargs={"probes": ["httpx", "curl"]})
    found = findings(outcome)
    assert found["httpx"] == {
        "llm": f"llm {MARK}",
        "allowed": f"allowed {MARK}",
        "dashboard": "HTTP 403",
    }
    assert found["curl"] == {"llm": "200", "dashboard": "403", "dashboard direct": "000"}
    assert outcome.sandbox is not None
    assert outcome.sandbox.refused == {f"127.0.0.1:{servers.dashboard}": 4}


@pytest.mark.parametrize("containment", ["auto", "session"])
async def test_the_agent_cannot_leave_its_network_namespace(
    agents: Agents, servers: Servers, containment: str
) -> None:
    spec = agents.spec(
        AGENT, sandbox=isolate.Sandbox(network=servers.allow()), containment=containment
    )
    data = {**servers.data(), "trainer": os.getpid()}
    found = findings(await isolate.run_episode(spec, data, kwargs={"probes": ["escape"]}))
    escape = found["escape"]
    assert escape["dashboard after"] == "ECONNREFUSED"
    # Each way out is refused, whatever refuses it (Landlock, the syscall filter, capabilities).
    assert "ok" not in escape.values()
    assert escape["unshare user+net"] == "EPERM"


async def test_none_is_no_network_at_all(agents: Agents, servers: Servers) -> None:
    spec = agents.spec(AGENT, sandbox=isolate.Sandbox(network="none"))
    found = findings(await isolate.run_episode(spec, servers.data()))
    assert found == {
        "proxy": None,
        "llm": "ECONNREFUSED",
        "llm raw": "ECONNREFUSED",
        "dashboard direct": "ECONNREFUSED",
        "udp": "ECONNREFUSED",
        "outside": "ENETUNREACH",
        "dns": "no name",
    }


async def test_without_network_the_agent_shares_the_trainers(
    agents: Agents, servers: Servers
) -> None:
    """The control: the same agent with the default sandbox reaches the dashboard, so the
    walled results above are the wall's doing."""
    spec = agents.spec(AGENT, sandbox=isolate.Sandbox())
    found = findings(await isolate.run_episode(spec, servers.data()))
    assert found["proxy"] is None
    assert found["dashboard direct"].endswith(f"dashboard {MARK}")
    assert found["udp"] == f"udp {MARK}"


async def test_landlock_ports_let_the_proxy_through(agents: Agents, servers: Servers) -> None:
    box = isolate.Sandbox(network=servers.allow(), connect=(servers.llm,))
    spec = agents.spec(AGENT, sandbox=box)
    found = findings(await isolate.run_episode(spec, servers.data()))
    found.pop("proxy")
    expected = expected_walled(servers, proxy=True)
    # Landlock refuses a connect to the dashboard's port inside the namespace before the
    # namespace can; the other ports are the endpoint's and the proxy's.
    expected["dashboard direct"] = expected["outside"] = "EACCES"
    assert found == expected


async def test_concurrent_episodes_each_get_their_own_allow_list(
    agents: Agents, servers: Servers
) -> None:
    only_llm = isolate.Sandbox(network=(f"127.0.0.1:{servers.llm}",))
    also_dashboard = isolate.Sandbox(
        network=(f"127.0.0.1:{servers.llm}", f"127.0.0.1:{servers.dashboard}")
    )
    results: dict[str, dict[str, Any]] = {}

    async def one(name: str, box: isolate.Sandbox) -> None:
        results[name] = findings(
            await isolate.run_episode(agents.spec(AGENT, sandbox=box), servers.data())
        )

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(one, f"only {i}", only_llm)
            tg.start_soon(one, f"also {i}", also_dashboard)
    for name, found in results.items():
        if name.startswith("only"):
            assert found["dashboard via proxy"] == "HTTP 403", name
            assert found["allowed via proxy"] == "HTTP 403", name
        else:
            assert found["dashboard via proxy"] == f"dashboard {MARK}", name
            # A carried port: the dashboard's own, inside the namespace, as the endpoint's.
            assert found["dashboard direct"].endswith(f"dashboard {MARK}"), name
        assert found["llm"] == f"llm {MARK}", name


# --- what is left behind -------------------------------------------------------------------

HOLDER = r'''
import os, socket, time


def run(data):
    """Open connections to the proxy and the carried port, half-way through a request each,
    then hang: the parent holds the other ends."""
    port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
    held = []
    for target in [port] * 10 + [data["llm"]] * 10:
        sock = socket.create_connection(("127.0.0.1", target), timeout=10)
        head = b"CONNECT 127.0.0.1:%d HTTP/1.1\r\n" % data["llm"]
        sock.sendall(head if target == port else b"GET")
        held.append(sock)
    open(os.path.join(os.environ["PID_DIR"], "holding"), "w").close()
    time.sleep(3600)
'''


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_timeout_or_cancellation_closes_every_connection(
    agents: Agents, servers: Servers, how: str
) -> None:
    before = open_fds()
    box = isolate.Sandbox(network=servers.allow(), write=(agents.pids,))
    spec = agents.spec(
        HOLDER, sandbox=box, timeout=60.0 if how == "cancel" else 3.0 * SLOW, cancel_grace=0.5
    )
    holding = agents.pids / "holding"
    outcome: isolate.EpisodeOutcome | None = None

    async def run() -> None:
        nonlocal outcome
        outcome = await isolate.run_episode(spec, servers.data())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await wait_until(holding.exists, 30 * SLOW)
        # The parent takes the twenty connections (ten carried ones with their upstreams).
        await wait_until(lambda: len(open_fds() - before) >= 30, 20.0)
        if how == "cancel":
            tg.cancel_scope.cancel()
    if how == "timeout":
        assert outcome is not None
        assert outcome.status == "timeout"
    await wait_until(lambda: open_fds() <= before)


FLOOD = r'''
import os, socket, time


def run(data):
    """Open as many connections to the proxy as the kernel lets this episode, and hang."""
    port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
    held = []
    for _ in range(1000):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        except OSError:
            sock.close()
            break
        held.append(sock)
    open(os.path.join(os.environ["PID_DIR"], "flooding"), "w").close()
    time.sleep(3600)
'''


async def test_a_flood_of_connections_is_bounded_and_does_not_slow_a_sibling(
    agents: Agents, servers: Servers
) -> None:
    before = open_fds()
    box = isolate.Sandbox(network=servers.allow(), write=(agents.pids,))
    flood = agents.spec(FLOOD, sandbox=box, timeout=120.0, kill_grace=1.0)
    flooding = agents.pids / "flooding"
    sibling: isolate.EpisodeOutcome | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(isolate.run_episode, flood, servers.data())
        await wait_until(flooding.exists, 30 * SLOW)
        # The flooder's proxy took no more than its bound of connections.
        assert len(open_fds() - before) <= 64 + 16
        sibling = await isolate.run_episode(agents.spec(AGENT, sandbox=box), servers.data())
        tg.cancel_scope.cancel()
    found = findings(sibling)
    found.pop("proxy")
    assert found == expected_walled(servers, proxy=True)
    await wait_until(lambda: open_fds() <= before)


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["http://api.openai.com"], "http://api.openai.com"),
        (["api.*.com"], "api.*.com"),
        (["host:0"], "host:0"),
        (["host:99999"], "host:99999"),
        ([""], "empty"),
    ],
)
def test_a_bad_entry_is_refused_before_anything_starts(entries: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace(".", r"\.")):
        isolate.Sandbox(network=tuple(entries))


def test_the_plan_carries_loopback_entries_and_gives_the_proxy_a_free_port() -> None:
    box = isolate.Sandbox(
        network=("127.0.0.1:3128", "localhost:8000", "api.openai.com", "[::1]:9000")
    )
    found = _internals.plan_sandbox(
        box, cwd="/tmp", tmpdir="/tmp", home_dirs=[], abi=0, mountns=False, can_unshare=False
    )
    assert found.network is not None
    assert found.network.listen == [
        ("127.0.0.1", 3129),
        ("127.0.0.1", 3128),
        ("127.0.0.1", 8000),
        ("::1", 9000),
    ]
    env = found.network.env()
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3129"
    assert env["NO_PROXY"] == "localhost,127.0.0.1,::1"


def test_the_workflow_adds_the_llm_endpoint_to_the_allow_list(tmp_path: Path) -> None:
    from isolate.workflow import sandbox_of

    econfig = {"sandbox_network": ["api.example.com"]}
    box = sandbox_of(econfig, str(tmp_path), "http://127.0.0.1:8000/v1")
    assert box is not None
    assert box.network == ("api.example.com", "127.0.0.1:8000")
    none = sandbox_of({"sandbox_network": "none"}, None, "http://127.0.0.1:8000/v1")
    assert none is not None
    assert none.network == "none"
    with pytest.raises(ValueError, match="econfig.sandbox_network"):
        sandbox_of({"sandbox_network": "api.example.com"}, None, None)


# --- an unprivileged trainer ---------------------------------------------------------------

PARENT = """
import anyio, json, os, sys
import isolate

work, llm, dashboard, udp, allowed = sys.argv[1], *map(int, sys.argv[2:])

async def main():
    outcomes = {}

    async def one(containment):
        spec = isolate.EpisodeSpec(
            agent_root=os.path.join(work, "agent_root"),
            entrypoint="walled:run",
            containment=containment,
            timeout=60.0,
            kill_grace=1.0,
            log_dir=os.path.join(work, "logs"),
            cwd=work,
            env={"PID_DIR": os.path.join(work, "pids")},
            sandbox=isolate.Sandbox(network=(f"127.0.0.1:{llm}", f"127.0.0.1:{allowed}")),
        )
        data = {"llm": llm, "dashboard": dashboard, "udp": udp, "allowed": allowed}
        outcome = await isolate.run_episode(spec, data)
        outcomes[containment] = json.loads(outcome.model_dump_json())

    async with anyio.create_task_group() as tg:
        for containment in ("auto", "session"):
            tg.start_soon(one, containment)
    print(json.dumps({"uid": os.getuid(), "outcomes": outcomes}))

anyio.run(main)
"""


def test_an_unprivileged_trainers_agent_is_walled_the_same(servers: Servers) -> None:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.fail("the test suite runs as root, with setpriv, to act as an unprivileged user")
    repo = Path(isolate.__file__).resolve().parent.parent
    found_python = unprivileged_python(repo)
    if isinstance(found_python, str):
        pytest.fail(f"no interpreter the unprivileged user can run isolate with: {found_python}")
    python, env = found_python
    work = Path(tempfile.mkdtemp(prefix="isolate-network-nobody-"))
    marker = f"PID_DIR={work}/pids".encode()
    try:
        for sub in ("agent_root", "logs", "pids"):
            (work / sub).mkdir()
        (work / "agent_root" / "walled.py").write_text(textwrap.dedent(AGENT))
        (work / "parent.py").write_text(PARENT)
        for path in (work, *work.iterdir(), *(work / "agent_root").iterdir()):
            path.chmod(0o777)
        ports = [servers.llm, servers.dashboard, servers.udp, servers.allowed]
        done = as_nobody(
            [python, str(work / "parent.py"), str(work), *map(str, ports)],
            cwd=work,
            env={"PATH": os.environ["PATH"], "HOME": str(work), **env},
            timeout=120 * SLOW,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.splitlines()[-1])
        assert report["uid"] == 65534
        assert episode_processes(marker) == []
        for containment, outcome in report["outcomes"].items():
            assert outcome["status"] == "ok", (
                containment,
                outcome["error"],
                outcome["stderr_tail"],
            )
            found = outcome["info"]
            assert found.pop("proxy").startswith("http://127.0.0.1:")
            assert found == expected_walled(servers, proxy=True), containment
            assert outcome["sandbox"]["refused"] == {f"127.0.0.1:{servers.dashboard}": 2}
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- the trainer's death, and a machine that cannot make a network namespace ----------------

ONE_EPISODE = """
import anyio, json, sys
import isolate

spec = isolate.EpisodeSpec.model_validate_json(sys.argv[1])
data = json.loads(sys.argv[2])
outcome = anyio.run(isolate.run_episode, spec, data)
print(outcome.model_dump_json())
"""


def test_the_parents_death_leaves_no_process_and_no_connection(
    agents: Agents, servers: Servers
) -> None:
    box = isolate.Sandbox(network=servers.allow(), write=(agents.pids,))
    spec = agents.spec(HOLDER, sandbox=box, timeout=120.0)
    marker = f"PID_DIR={agents.pids}".encode()
    parent = subprocess.Popen(
        [sys.executable, "-c", ONE_EPISODE, spec.model_dump_json(), json.dumps(servers.data())]
    )
    try:
        wait_for(lambda: (agents.pids / "holding").exists(), 30.0, "the connections")
        assert episode_processes(marker) != []
        # The carried ones, through the parent, once it has taken them all.
        wait_for(lambda: established(servers.llm) >= 10, 10.0, "the carried connections")
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        # The shim's pipe to the parent closed: its tree goes within cancel_grace + 2 s.
        wait_for(lambda: episode_processes(marker) == [], spec.cancel_grace + 2.0, "the tree")
    finally:
        parent.kill()
        parent.wait()
    # Nothing holds the carried connections any more: the endpoint's side of each is closed.
    wait_for(lambda: established(servers.llm) == 0, 5.0, "the carried connections to close")
    # The dead parent's cgroup leaf stays until an isolate process starts and removes it.
    remove_dead_parents_leaves()


def established(port: int) -> int:
    """Established TCP connections to ``port`` on this machine's loopback."""
    return sum(
        1
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
    )


@pytest.mark.parametrize("best_effort", [False, True])
def test_no_network_namespace_is_a_setup_error_unless_best_effort(
    agents: Agents, servers: Servers, best_effort: bool
) -> None:
    """A trainer in a user namespace that may make no network namespace (its limit is 0):
    the machine that cannot isolate the network, made without changing this one."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is part of this machine; the test needs it")
    box = isolate.Sandbox(network=servers.allow(), best_effort=best_effort)
    spec = agents.spec(AGENT, sandbox=box, containment="session")
    script = 'echo 0 > /proc/sys/user/max_net_namespaces && exec "$@"'
    argv = [sys.executable, "-c", ONE_EPISODE, spec.model_dump_json(), json.dumps(servers.data())]
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh", *argv],
        capture_output=True,
        text=True,
        timeout=120 * SLOW,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = isolate.EpisodeOutcome.model_validate_json(done.stdout.splitlines()[-1])
    missing = "network isolation: unshare(net): No space left on device"
    if best_effort:
        found = findings(outcome)
        assert outcome.sandbox is not None
        assert missing in outcome.sandbox.missing
        assert found["proxy"] is None
        assert found["dashboard direct"].endswith(f"dashboard {MARK}")  # said, not walled
    else:
        assert outcome.status == "setup_error"
        assert outcome.error is not None
        assert missing in outcome.error.message
