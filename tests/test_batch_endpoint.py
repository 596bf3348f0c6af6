"""Errors of the infrastructure apart from the agent's, and any entrypoint from the command
line: a real HTTP endpoint that stops and starts again, entrypoints of every signature, real
drivers in subprocesses."""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from .conftest import SLOW, Agents, wait_for
from .test_batch import record, results, start, write_records
from .test_cli import cli_env, isolate_cli

AGENT = """
import hashlib, json, os, urllib.request

def net(data, override_base_url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(override_base_url + "/ping?id=" + data["instance_id"], timeout=30) as r:
        r.read()
    return 1.0

def plain(data):
    return 1.0

def some_net(data, override_base_url):
    if (data.get("behaviour") or {}).get("net"):
        return net(data, override_base_url)
    return 1.0

def dials(data):
    import socket
    socket.create_connection(("127.0.0.1", data["behaviour"]["port"]), timeout=5).close()
    return 1.0

def needs(data, needed):
    return 1.0

def takes_k(data, k):
    return float(k["v"])

def by_behaviour(data):
    b = data.get("behaviour") or {}
    if b.get("raise"):
        raise ValueError(b["raise"])
    if b.get("crash"):
        os._exit(3)
    return 1.0

def secret_sha(data, token):
    return 1.0, {"sha": hashlib.sha256(token.encode()).hexdigest()}

def holds_secret(data, token):
    pids = os.environ["PID_DIR"]
    open(os.path.join(pids, "up"), "w").close()
    while not os.path.exists(os.path.join(pids, "go")):
        import time
        time.sleep(0.02)
    return 1.0, {"sha": hashlib.sha256(token.encode()).hexdigest()}
"""


class Endpoint:
    """A real HTTP server on 127.0.0.1, in a thread: answers every GET 200 and keeps its
    path. With ``close_after``, it stops listening when that many ``/ping`` requests have
    come (the last one is still answered): later connections are refused."""

    def __init__(self, port: int = 0, close_after: int | None = None) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.port: int = self.sock.getsockname()[1]
        self.close_after = close_after
        self.paths: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def pings(self) -> list[str]:
        return [p.partition("id=")[2] for p in self.paths if "/ping" in p]

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # stopped
            with conn:
                conn.settimeout(10 * SLOW)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                if not data:
                    continue
                self.paths.append(data.split(b" ")[1].decode())
                if self.close_after is not None and len(self.pings()) >= self.close_after:
                    self._close()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    def _close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes an accept() in the thread
        except OSError:
            pass
        self.sock.close()

    def stop(self) -> None:
        self._close()
        self.thread.join(10 * SLOW)


@pytest.fixture
def endpoint() -> Any:
    servers: list[Endpoint] = []

    def make(port: int = 0, close_after: int | None = None) -> Endpoint:
        servers.append(Endpoint(port, close_after))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def args_for(agents: Agents, records: Path, out: Path, entry: str, *extra: str) -> list[str]:
    (agents.root / "cli_agent.py").write_text(textwrap.dedent(AGENT))
    return [
        "batch",
        str(records),
        "--out",
        str(out),
        "--agent-root",
        str(agents.root),
        "--entrypoint",
        f"cli_agent:{entry}",
        "--log-dir",
        str(agents.logs),
        "--kill-grace",
        "0.2",
        *extra,
    ]


def test_records_the_endpoint_failed_are_infra_and_a_rerun_runs_exactly_them_once(
    agents: Agents, endpoint: Any
) -> None:
    ids = [f"e-{i}" for i in range(5)]
    records = write_records(agents.tmp / "records.jsonl", [record(agents, i) for i in ids])
    out = agents.tmp / "results.jsonl"
    first = endpoint(close_after=2)  # answers the check and e-0, e-1; then refuses
    args = args_for(
        agents, records, out, "net", "--base-url", first.url, "--concurrency", "1",
        "--retries-infra", "1",
    )  # fmt: skip
    proc = isolate_cli(*args, env=cli_env(), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert first.paths[0] == "/v1"  # the check before the batch
    assert first.pings() == ["e-0", "e-1"]
    lines = results(out)
    failed = [e for e in lines if e["infra_kind"]]
    assert [e["instance_id"] for e in failed] == ["e-2", "e-2", "e-3", "e-3", "e-4", "e-4"]
    for entry in failed:
        assert (entry["status"], entry["infra"], entry["final"]) == ("agent_error", True, False)
        assert entry["infra_kind"] == "endpoint unreachable"
    assert "infra: endpoint unreachable (runs again)      3" in proc.stdout
    assert "3 instance(s) without a final result" in proc.stderr
    report = isolate_cli("report", str(out), "--json")
    groups = [g for g in json.loads(report.stdout)["failures"] if g["infra"]]
    assert [(g["infra"], g["count"]) for g in groups] == [("endpoint unreachable", 3)]
    assert "agent_error  URLError, exit 1, infra: endpoint unreachable  (3)" in (
        isolate_cli("report", str(out)).stdout
    )

    again = endpoint(port=first.port)  # the endpoint is back, where it was
    proc = isolate_cli(*args, env=cli_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 of 5 instances already have a final result" in proc.stderr
    assert sorted(again.pings()) == ["e-2", "e-3", "e-4"]  # each once
    new = results(out)[len(lines) :]
    assert [(e["instance_id"], e["status"], e["final"]) for e in new] == [
        (i, "ok", True) for i in ("e-2", "e-3", "e-4")
    ]
    report = isolate_cli("report", str(out), "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["counts"] == {"ok": 5}


def test_a_batch_run_while_the_endpoint_was_down_reruns_exactly_its_records_once(
    agents: Agents, endpoint: Any
) -> None:
    lines = [
        record(agents, "n-0", net=True),
        record(agents, "n-1"),
        record(agents, "n-2", net=True),
    ]
    records = write_records(agents.tmp / "records.jsonl", lines)
    out = agents.tmp / "results.jsonl"
    down = endpoint()
    url, port = down.url, down.port
    down.stop()
    args = args_for(
        agents, records, out, "some_net", "--base-url", url, "--retries-infra", "0",
        "--concurrency", "1",
    )  # fmt: skip
    proc = isolate_cli(*args, "--no-endpoint-check", env=cli_env(), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert [(e["instance_id"], e["infra_kind"], e["final"]) for e in results(out)] == [
        ("n-0", "endpoint unreachable", False),
        ("n-1", None, True),
        ("n-2", "endpoint unreachable", False),
    ]
    assert "not final    2 endpoint unreachable: not the agent's" in proc.stdout

    up = endpoint(port=port)
    proc = isolate_cli(*args, env=cli_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 of 3 instances already have a final result in" in proc.stderr
    assert sorted(up.pings()) == ["n-0", "n-2"]
    assert [(e["instance_id"], e["status"], e["final"]) for e in results(out)[3:]] == [
        ("n-0", "ok", True),
        ("n-2", "ok", True),
    ]
    proc = isolate_cli(*args, env=cli_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "3 of 3 instances already have a final result" in proc.stderr
    assert (len(results(out)), sorted(up.pings())) == (5, ["n-0", "n-2"])


def test_an_agent_that_raises_connection_refused_itself_is_final_after_the_cap(
    agents: Agents,
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
        port = closed.getsockname()[1]
        records = write_records(agents.tmp / "records.jsonl", [record(agents, "c-1", port=port)])
        out = agents.tmp / "results.jsonl"
        args = args_for(agents, records, out, "dials", "--retries-infra", "0")
        for run in (1, 2, 3):
            proc = isolate_cli(*args)
            assert proc.returncode == (0 if run == 3 else 1), proc.stderr
            [entry] = results(out)[run - 1 :]
            assert (entry["status"], entry["infra_kind"]) == ("agent_error", "endpoint unreachable")
            assert (entry["infra_runs"], entry["final"]) == (run, run == 3)
        gave = "1 gave up after infrastructure failures in 3 runs (--infra-runs): final with "
        assert f"gave up      {gave}their last status; --rerun infra runs again" in proc.stdout
        assert "not final" not in proc.stdout
        proc = isolate_cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert "1 of 1 instances already have a final result" in proc.stderr
        assert len(results(out)) == 3
        report = isolate_cli("report", str(out))
        assert gave + "their last status  (1)" in report.stdout
        as_json = json.loads(isolate_cli("report", str(out), "--json").stdout)
        [group] = as_json["failures"]
        assert [r["gave_up_after_runs"] for r in group["results"]] == [3]

        proc = isolate_cli(*args, "--rerun", "infra")  # asked for by name: once more
        assert proc.returncode == 0, proc.stderr
        [entry] = results(out)[3:]
        assert (entry["infra_runs"], entry["final"]) == (4, True)
        few = isolate_cli(*args, "--infra-runs", "0")
        assert few.returncode == 2
        assert "--infra-runs: must be a whole number of at least 1" in few.stderr


def test_an_endpoint_that_does_not_answer_stops_the_batch_before_any_record(
    agents: Agents, endpoint: Any
) -> None:
    records = write_records(agents.tmp / "records.jsonl", [record(agents, "d-1")])
    out = agents.tmp / "results.jsonl"
    gone = endpoint()
    url = gone.url
    gone.stop()
    proc = isolate_cli(*args_for(agents, records, out, "net", "--base-url", url))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"isolate: error: --base-url {url} does not answer (no connection: Connection refused); "
        "nothing was run (--no-endpoint-check starts anyway)"
    ]
    assert not out.exists()
    assert not list(agents.pids.iterdir())


def test_isolate_run_checks_the_endpoint_before_it_starts(agents: Agents, endpoint: Any) -> None:
    """The check batch makes, for one episode: a ``--base-url``, a record's ``base_url`` and
    a replayed bundle's endpoint that do not answer stop ``isolate run`` in one line, exit 2,
    nothing started; ``--no-endpoint-check`` starts anyway."""
    (agents.root / "cli_agent.py").write_text(textwrap.dedent(AGENT))
    one = agents.tmp / "one.json"
    one.write_text(json.dumps(record(agents, "u-1")))
    gone = endpoint()
    url, port = gone.url, gone.port
    gone.stop()
    argv = ["run", str(one), "--agent-root", str(agents.root), "--entrypoint", "cli_agent:net"]
    argv += ["--log-dir", str(agents.logs), "--kill-grace", "0.2"]
    proc = isolate_cli(*argv, "--base-url", url)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"isolate: error: --base-url {url} does not answer (no connection: Connection refused); "
        "nothing was run (--no-endpoint-check starts anyway)"
    ]
    assert proc.stdout == ""
    assert not agents.logs.exists()
    assert not list(agents.pids.iterdir())

    own = agents.tmp / "own.json"
    own.write_text(json.dumps({**record(agents, "u-2"), "base_url": url}))
    proc = isolate_cli(*[str(own) if a == str(one) else a for a in argv])
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f'isolate: error: the record\'s "base_url" {url} does not answer (no connection: '
        "Connection refused); nothing was run (--no-endpoint-check starts anyway)"
    ]

    proc = isolate_cli(*argv, "--base-url", url, "--no-endpoint-check")
    assert proc.returncode == 10, proc.stderr  # the agent ran, and could not reach it
    assert json.loads(proc.stdout)["infra"] == "endpoint unreachable"

    back = endpoint(port=port)  # the endpoint is back, where it was
    proc = isolate_cli(*argv, "--base-url", url)
    assert proc.returncode == 0, proc.stderr
    assert (back.paths[0], back.pings()) == ("/v1", ["u-1"])  # the check, then the episode
    bundle = proc.stderr.split("isolate run --replay ")[1].split()[0]
    back.stop()
    replay = isolate_cli("run", "--replay", bundle)
    assert replay.returncode == 2
    assert replay.stderr.splitlines() == [
        f"isolate: error: the bundle's override_base_url {url} does not answer (no "
        "connection: Connection refused); nothing was run (--no-endpoint-check starts anyway)"
    ]
    assert back.pings() == ["u-1"]


@pytest.mark.parametrize(
    ("entry", "extra", "why"),
    [
        ("needs", (), "missing a required argument: 'needed'"),
        ("plain", ("--kwargs", '{"x": 1}'), "got an unexpected keyword argument 'x'"),
    ],
)
def test_an_entrypoint_that_cannot_take_the_call_is_refused_in_one_line(
    agents: Agents, entry: str, extra: tuple[str, ...], why: str
) -> None:
    records = write_records(agents.tmp / "records.jsonl", [record(agents, "w-1")])
    out = agents.tmp / "results.jsonl"
    proc = isolate_cli(*args_for(agents, records, out, entry, *extra))
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"isolate: error: cli_agent:{entry}(data")
    assert line.endswith(why)
    assert not out.exists()
    assert not agents.logs.exists()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("code", "kwargs", "kind"),
    [
        ("def run(data):\n    return 1.0\n", {"x": 1}, "entrypoint signature"),
        ("def run(data, **kw):\n    raise TypeError('inside')\n", {}, None),
        (
            "import urllib.request\ndef run(data):\n"
            "    urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=5)\n",
            {},
            "endpoint unreachable",
        ),
        (
            "def run(data):\n    try:\n        raise ConnectionResetError(104, 'reset')\n"
            "    except OSError as exc:\n"
            "        raise RuntimeError('the model call failed') from exc\n",
            {},
            "endpoint unreachable",
        ),
        (
            "def run(data):\n    raise RuntimeError('Error code: 502 - bad gateway')\n",
            {},
            "endpoint error",
        ),
        ("def run(data):\n    raise ValueError('no')\n", {}, None),
    ],
    ids=["call", "inside", "refused", "chained", "5xx", "own"],
)
async def test_the_outcome_tells_the_infrastructure_apart(
    agents: Agents, code: str, kwargs: dict[str, Any], kind: str | None
) -> None:
    import isolate

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: refused
        spec = agents.spec(code.replace("{port}", str(port)))
        outcome = await isolate.run_episode(spec, {"instance_id": "o-1"}, kwargs=kwargs)
    assert (outcome.status, outcome.infra) == ("agent_error", kind)


def test_rerun_runs_again_exactly_the_records_of_the_kinds_named(agents: Agents) -> None:
    lines = [
        record(agents, "k-ok"),
        record(agents, "k-err", **{"raise": "boom"}),
        record(agents, "k-crash", crash=True),
    ]
    records = write_records(agents.tmp / "records.jsonl", lines)
    out = agents.tmp / "results.jsonl"
    args = args_for(agents, records, out, "by_behaviour")
    proc = isolate_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert sorted((e["instance_id"], e["status"]) for e in results(out)) == [
        ("k-crash", "crashed"), ("k-err", "agent_error"), ("k-ok", "ok"),
    ]  # fmt: skip
    proc = isolate_cli(*args)
    assert "3 of 3 instances already have a final result" in proc.stderr
    assert len(results(out)) == 3

    proc = isolate_cli(*args, "--rerun", "agent_error")
    assert proc.returncode == 0, proc.stderr
    assert "1 to run (1 of them again: --rerun agent_error)" in proc.stderr
    assert [(e["instance_id"], e["attempt"]) for e in results(out)[3:]] == [("k-err", 2)]

    proc = isolate_cli(*args, "--rerun", "crashed,agent_error")
    assert proc.returncode == 0, proc.stderr
    assert sorted((e["instance_id"], e["attempt"]) for e in results(out)[4:]) == [
        ("k-crash", 2), ("k-err", 3),
    ]  # fmt: skip

    bad = isolate_cli(*args, "--rerun", "nope")
    assert bad.returncode == 2
    assert "'nope' is not one of ok, agent_error" in bad.stderr


def test_any_entrypoint_runs_without_a_base_url_and_gets_kwargs(agents: Agents) -> None:
    records = write_records(agents.tmp / "records.jsonl", [record(agents, "p-1")])
    out = agents.tmp / "plain.jsonl"
    proc = isolate_cli(*args_for(agents, records, out, "plain"))
    assert proc.returncode == 0, proc.stderr
    assert "API key" not in proc.stderr  # an entrypoint without one is not asked for one
    assert [(e["status"], e["reward"]) for e in results(out)] == [("ok", 1.0)]

    out = agents.tmp / "k.jsonl"
    proc = isolate_cli(*args_for(agents, records, out, "takes_k", "--kwargs", '{"k": {"v": 7}}'))
    assert proc.returncode == 0, proc.stderr
    assert [(e["status"], e["reward"]) for e in results(out)] == [("ok", 7.0)]

    # isolate run, the same way.
    one = agents.tmp / "one.json"
    one.write_text(json.dumps(record(agents, "p-2")))
    argv = ["run", str(one), "--agent-root", str(agents.root), "--entrypoint", "cli_agent:plain"]
    proc = isolate_cli(*argv, "--log-dir", str(agents.logs))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["reward"] == 1.0


def test_a_secret_reaches_the_entrypoint_and_no_argv_env_or_log(agents: Agents) -> None:
    token = f"tok-{secrets.token_hex(16)}"
    records = write_records(agents.tmp / "records.jsonl", [record(agents, "t-1")])
    out = agents.tmp / "results.jsonl"
    args = args_for(agents, records, out, "holds_secret", "--secret", "token=THE_TOKEN")
    driver = start(args, agents.tmp, cli_env(THE_TOKEN=token))
    try:
        wait_for(lambda: (agents.pids / "up").exists(), 30 * SLOW, "the agent up")
        episode = agents.left()
        assert episode
        for proc in episode:
            for part in ("environ", "cmdline"):
                assert token.encode() not in Path(f"/proc/{proc.pid}/{part}").read_bytes()
        assert token.encode() not in Path(f"/proc/{driver.pid}/cmdline").read_bytes()
        (agents.pids / "go").touch()
        assert driver.wait(60 * SLOW) == 0, (agents.tmp / "driver.err").read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    [entry] = results(out)
    assert entry["info"] == {"sha": hashlib.sha256(token.encode()).hexdigest()}
    for path in [out, *agents.logs.rglob("*")]:
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


def test_a_secret_without_a_value_is_refused(agents: Agents) -> None:
    records = write_records(agents.tmp / "records.jsonl", [record(agents, "t-1")])
    out = agents.tmp / "results.jsonl"
    args = args_for(agents, records, out, "holds_secret", "--secret", "token=NOT_SET_HERE")
    proc = isolate_cli(*args)
    assert proc.returncode == 2
    assert "--secret token: environment variable NOT_SET_HERE is not set" in proc.stderr


def test_isolate_run_replays_an_episode_with_the_keywords_it_was_given(agents: Agents) -> None:
    """A replay passes the key and the secrets as the episode got them: none to ``plain``,
    ``token`` (read again from its variable) to ``secret_sha``."""
    token = f"tok-{secrets.token_hex(16)}"
    one = agents.tmp / "one.json"
    one.write_text(json.dumps(record(agents, "r-1")))
    (agents.root / "cli_agent.py").write_text(textwrap.dedent(AGENT))
    environ = cli_env(THE_TOKEN=token)
    sha = hashlib.sha256(token.encode()).hexdigest()
    for entry, extra, info in [
        ("plain", (), None),
        ("secret_sha", ("--secret", "token=THE_TOKEN"), {"sha": sha}),
    ]:
        argv = ["run", str(one), "--agent-root", str(agents.root), "--log-dir", str(agents.logs)]
        proc = isolate_cli(*argv, "--entrypoint", f"cli_agent:{entry}", *extra, env=environ)
        assert proc.returncode == 0, proc.stderr
        assert "API key" not in proc.stderr
        assert json.loads(proc.stdout)["info"] == info
        bundle = proc.stderr.split("isolate run --replay ")[1].split()[0]
        again = isolate_cli("run", "--replay", bundle, env=environ)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["info"] == info
    for path in agents.logs.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path
