"""Network isolation: what ``Sandbox(network=...)`` costs at launch, in throughput and per
connection.

    python -m bench.network [--rounds 10] [--launch-rounds 20] [--mb 100] [--connections 200]
                            [--containment auto] [--quick]

Everything runs in one parent, one episode at a time, the contenders of each figure
interleaved round-robin (the order reversed every other round) so they see the same moments of
a shared machine. Two servers run as threads of this process, on its loopback: one streams the
number of bytes it is asked for, one answers one byte with one byte. Agents use plain sockets
and time themselves (``time.perf_counter``), so their figures leave the launch out.

- launch: a no-op episode under ``Sandbox()``, ``Sandbox(network=["127.0.0.1:PORT"])`` and
  ``Sandbox(network="none")``;
- download of ``--mb`` MB: direct under ``Sandbox()``; under
  ``Sandbox(network=["127.0.0.1:PORT"])`` to the carried port (the agent connects to
  127.0.0.1:PORT in its namespace), and through the proxy (``CONNECT 127.0.0.1:PORT`` to the
  address in ``HTTP_PROXY``);
- ``--connections`` sequential short connections (connect, one byte each way, close), the same
  three ways.

Ratios and differences are per round, against the first contender of the figure, then their
median (min–max). The parent's CPU per episode (every thread of this process: the servers, the
event loop and, with a network, the proxy's copying) is shown beside the two traffic figures.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

import isolate

from ._common import live_children, machine_info

AGENT = """\
import os
import socket
import time


def _proxy_address():
    url = os.environ["HTTP_PROXY"]
    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    return host, int(port)


def _open(mode, port, proxy):
    if mode == "proxy":
        sock = socket.create_connection(proxy)
        target = "127.0.0.1:%d" % port
        sock.sendall(("CONNECT %s HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % (target, target)).encode())
        head = b""
        while b"\\r\\n\\r\\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("the proxy closed the connection: %r" % head)
            head += chunk
        status = head.split(b"\\r\\n", 1)[0]
        if b" 200 " not in status + b" ":
            raise ConnectionError("the proxy answered %r" % status)
        if head.index(b"\\r\\n\\r\\n") + 4 != len(head):
            raise ConnectionError("bytes after the proxy's answer")
        return sock
    return socket.create_connection(("127.0.0.1", port))


def run(data, **kwargs):
    mode, port = data["mode"], data["port"]
    proxy = _proxy_address() if mode == "proxy" else None
    if data["task"] == "noop":
        return 1.0
    if data["task"] == "download":
        size = data["bytes"]
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        got = 0
        start = time.perf_counter()
        sock = _open(mode, port, proxy)
        sock.sendall(b"%d\\n" % size)
        while True:
            n = sock.recv_into(view)
            if not n:
                break
            got += n
        elapsed = time.perf_counter() - start
        sock.close()
        if got != size:
            raise RuntimeError("got %d bytes of %d" % (got, size))
        return 1.0, {"seconds": elapsed}
    count = data["count"]
    start = time.perf_counter()
    for _ in range(count):
        sock = _open(mode, port, proxy)
        sock.sendall(b"x")
        if sock.recv(1) != b"x":
            raise RuntimeError("no answer")
        sock.close()
    return 1.0, {"seconds": time.perf_counter() - start}
"""

_CHUNK = bytes(range(256)) * 4096  # 1 MiB


class _Server:
    """A TCP server on 127.0.0.1 in a thread of its own, one connection at a time."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self._handle = handle
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._loop, name=f"bench-net-{self.port}")
        self._thread.daemon = True
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self._listener.accept()[0]
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stop.is_set():
                    self.errors.append(repr(exc))
                continue
            try:
                conn.settimeout(30)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._handle(conn)
            except OSError as exc:
                self.errors.append(repr(exc))
            finally:
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()


def _read_line(conn: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise ConnectionError("closed before the request")
        line += chunk
    return line


def _stream(conn: socket.socket) -> None:
    """Send the number of bytes the request line asks for, then close."""
    left = int(_read_line(conn))
    view = memoryview(_CHUNK)
    while left > 0:
        part = view[: min(left, len(view))]
        conn.sendall(part)
        left -= len(part)
    conn.shutdown(socket.SHUT_WR)


def _echo(conn: socket.socket) -> None:
    """One byte in, one byte back, close."""
    if conn.recv(1):
        conn.sendall(b"x")


async def _episode(spec: isolate.EpisodeSpec, data: dict[str, Any]) -> tuple[float, float, Any]:
    """(wall seconds, parent CPU seconds, info) of one episode that must be ok."""
    cpu, start = time.process_time(), time.perf_counter()
    outcome = await isolate.run_episode(spec, data)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if outcome.status != "ok":
        raise RuntimeError(outcome.summary() + "\n" + outcome.stderr_tail[-2000:])
    return wall, cpu, outcome.info


Contenders = dict[str, tuple[isolate.EpisodeSpec, dict[str, Any]]]


async def _rounds(contenders: Contenders, rounds: int) -> dict[str, list[tuple[float, float, Any]]]:
    for spec, data in contenders.values():  # warm-up: probes, bytecode caches
        await _episode(spec, data)
    out: dict[str, list[tuple[float, float, Any]]] = {name: [] for name in contenders}
    for index in range(rounds):
        order = list(contenders) if index % 2 == 0 else list(reversed(contenders))
        for name in order:
            out[name].append(await _episode(*contenders[name]))
    return out


def _spread(samples: list[float], digits: int) -> str:
    return (
        f"{statistics.median(samples):.{digits}f} "
        f"({min(samples):.{digits}f}–{max(samples):.{digits}f})"
    )


def _ratio(values: list[float], base: list[float]) -> str:
    ratios = [v / b for v, b in zip(values, base, strict=True)]
    return f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"


def _difference(values: list[float], base: list[float], digits: int) -> str:
    diffs = [v - b for v, b in zip(values, base, strict=True)]
    low, mid, high = (
        f"{x:+.{digits}f}".replace("-", "−")
        for x in (min(diffs), statistics.median(diffs), max(diffs))
    )
    return f"{mid} ({low}–{high})"


def _rows(
    figure: str, series: dict[str, list[float]], digits: int, cpu: dict[str, list[float]] | None
) -> list[str]:
    base_name = next(iter(series))
    base = series[base_name]
    rows = []
    for name, samples in series.items():
        first = name == base_name
        ratio = "1.00×" if first else _ratio(samples, base)
        diff = "—" if first else _difference(samples, base, digits)
        parent = "" if cpu is None else _spread([c * 1e3 for c in cpu[name]], 1)
        rows.append(
            f"| {figure} | {name} | {_spread(samples, digits)} | {ratio} | {diff} | {parent} |"
        )
    return rows


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(rounds: int, launch_rounds: int, mb: float, connections: int, containment: str) -> None:
    start_load = _load()
    info = machine_info()
    size = int(mb * 1e6)
    stream, echo = _Server(_stream), _Server(_echo)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-network.") as work:
            root = Path(work) / "agent"
            root.mkdir()
            (root / "net_bench_agent.py").write_text(AGENT)
            checkout = Path(work) / "checkout"
            checkout.mkdir()
            subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
            base = isolate.EpisodeSpec(
                agent_root=root,
                entrypoint="net_bench_agent:run",
                cwd=checkout,
                timeout=300,
                kill_grace=1,
                containment=containment,  # type: ignore[arg-type]
            )

            def spec(network: Any) -> isolate.EpisodeSpec:
                box = isolate.Sandbox() if network is None else isolate.Sandbox(network=network)
                return base.model_copy(update={"sandbox": box})

            plain = spec(None)
            none = spec("none")

            def carrying(port: int) -> isolate.EpisodeSpec:
                return spec([f"127.0.0.1:{port}"])

            noop = {"task": "noop", "mode": "direct", "port": 0}
            launch: Contenders = {
                "`Sandbox()`": (plain, noop),
                '`Sandbox(network=["127.0.0.1:PORT"])`': (carrying(echo.port), noop),
                '`Sandbox(network="none")`': (none, noop),
            }

            def traffic(port: int, task: dict[str, Any]) -> Contenders:
                return {
                    "direct, `Sandbox()`": (plain, {**task, "mode": "direct", "port": port}),
                    "carried port": (carrying(port), {**task, "mode": "carried", "port": port}),
                    "proxy `CONNECT`": (carrying(port), {**task, "mode": "proxy", "port": port}),
                }

            download = traffic(stream.port, {"task": "download", "bytes": size})
            per_conn = traffic(echo.port, {"task": "connections", "count": connections})

            async def everything() -> tuple[Any, Any, Any, isolate.EpisodeOutcome]:
                times = await _rounds(launch, launch_rounds)
                got = await _rounds(download, rounds)
                conns = await _rounds(per_conn, rounds)
                last = await isolate.run_episode(*launch['`Sandbox(network="none")`'])
                return times, got, conns, last

            times, got, conns, last = anyio.run(everything)
    finally:
        stream.close()
        echo.close()
    errors = stream.errors + echo.errors
    left = live_children()

    code = info["code"]
    dirty = " (isolate or agent_shim uncommitted)" if code["uncommitted"] else ""
    print(
        f"bench.network: containment {last.containment}; launch {launch_rounds} rounds, "
        f"traffic {rounds} rounds; download {size / 1e6:g} MB, {connections} connections"
    )
    print(
        f"machine: {info['date']} · Linux {info['kernel']} · {info['cpu']} · {info['cores']} "
        f"cores · Python {info['python']} · load average {start_load} at the start, "
        f"{_load()} at the end · code {code['commit']}{dirty}"
    )
    print()
    print(
        "| figure | contender | median (min–max) | ratio to the first: median (min–max) "
        "| difference to the first | parent CPU ms/episode |"
    )
    print("|---|---|---|---|---|---|")
    rows = _rows("launch, ms", {n: [s[0] * 1e3 for s in v] for n, v in times.items()}, 2, None)
    rows += _rows(
        f"download {size / 1e6:g} MB, MB/s",
        {n: [size / 1e6 / s[2]["seconds"] for s in v] for n, v in got.items()},
        0,
        {n: [s[1] for s in v] for n, v in got.items()},
    )
    rows += _rows(
        "per connection, µs",
        {n: [s[2]["seconds"] / connections * 1e6 for s in v] for n, v in conns.items()},
        1,
        {n: [s[1] for s in v] for n, v in conns.items()},
    )
    print("\n".join(rows))
    print()
    print(
        f"server errors: {len(errors)}{' ' + '; '.join(errors[:3]) if errors else ''}; "
        f"child processes left: {len(left)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the traffic figures")
    parser.add_argument("--launch-rounds", type=int, default=20)
    parser.add_argument("--mb", type=float, default=100, help="MB (10^6 bytes) per download")
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--containment", default="auto")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.launch_rounds, args.mb, args.connections = 2, 3, 2, 20
    measure(args.rounds, args.launch_rounds, args.mb, args.connections, args.containment)


if __name__ == "__main__":
    main()
