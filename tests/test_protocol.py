"""The wire protocol: fake shims that break it end to end, the real shim's side of the
version check, and properties of the parent-side parser, line splitter and redactor."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

import agent_shim.shim
import isolate
from isolate._core.episode.protocol import (
    Done,
    ErrorFrame,
    Hello,
    LineSplitter,
    Noise,
    Progress,
    Result,
    Violation,
    encode_handshake,
    one_line,
    parse_line,
    shape,
)

from . import _internals
from ._internals import MASK, Redactor
from .conftest import SLOW, Agents, wait_until

# The bounds docs/protocol.md gives, written here rather than read from the code under test.
MAX_MESSAGE_CHARS = 64 * 1024  # an error's message
MAX_TRACEBACK_CHARS = 256 * 1024  # an error's traceback, its last characters
MAX_DEPTH = 64  # nesting of a frame's JSON values
MAX_NOTED = 100  # noise lines and violations noted one by one

V = isolate.PROTOCOL_VERSION

# --- fake shims, end to end -------------------------------------------------------------------

# Every fake starts like the real shim: read the handshake line, learn the nonce. Helpers write
# whole frames; a body decides what to send and how.
PRELUDE = """\
import json, os, resource, signal, sys, time
hs = json.loads(sys.stdin.buffer.readline())
N = hs["nonce"]

def frame(t, **fields):
    return (json.dumps(dict(fields, t=t, nonce=N)) + "\\n").encode()

def raw(data):
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()

def send(t, **fields):
    raw(frame(t, **fields))

def hello(protocol=1):
    send("hello", protocol=protocol, pid=os.getpid(), python="3.11", subreaper=False)

def result(reward=1.0, **fields):
    fields.setdefault("info", None)
    send("result", reward=reward, **fields)

def done(exit_code=0):
    send("done", why="exited", killed=0, exit_code=exit_code, signal=None)
"""


@dataclass(frozen=True)
class Fake:
    """One fake shim and what the parent must make of it."""

    body: str
    status: str
    says: tuple[str, ...] = ()  # regexes the error message must match (status != ok)
    spec: dict[str, Any] = field(default_factory=dict)
    log_says: tuple[str, ...] = ()  # regexes the episode log must match
    signal: str | None = None
    prelude: bool = True
    reward: float = 1.0  # when status is ok


FAKES = {
    "well-behaved": Fake("hello(); result(0.75); done()", "ok", reward=0.75),
    "nan reward": Fake(
        "hello(); result(float('nan')); done()",
        "protocol_error",
        (r"\bnan\b", r"finite"),
    ),
    "inf reward": Fake(
        "hello(); result(float('inf')); done()",
        "protocol_error",
        (r"\binf\b", r"finite"),
    ),
    "nan in a reward mapping": Fake(
        "hello(); result({'c1': 1.0, 'c2': float('-inf')}); done()",
        "protocol_error",
        (r"-inf\b", r"finite"),
    ),
    "reward of a wrong type": Fake(
        "hello(); result(None, reward_type='str', reward_repr=\"'x'\"); done()",
        "protocol_error",
        (r"\bstr\b", r"'x'"),
    ),
    "two results": Fake(
        "hello(); result(1.0); result(0.0); done()",
        "protocol_error",
        (r"second", r"result"),
    ),
    "result then error": Fake(
        "hello(); result(1.0); "
        "send('error', kind='agent', type='X', message='m', traceback=''); done()",
        "protocol_error",
        (r"second", r"'error'", r"'result'"),
    ),
    "result without reward": Fake(
        "hello(); send('result', info=None); done()",
        "protocol_error",
        (r"malformed", r"result", r"reward"),
    ),
    "error of a weird kind": Fake(
        "hello(); send('error', kind='weird', type='X', message='m', traceback=''); done()",
        "protocol_error",
        (r"malformed", r"'error'", r"kind"),
    ),
    "result before hello": Fake(
        "result(1.0); hello(); done()",
        "protocol_error",
        (r"'result'", r"before hello"),
    ),
    "frame over max_frame_bytes": Fake(
        # A result line of exactly 10240 bytes, nonce and all, against a cap of 2048.
        """
        hello()
        base = len(frame("result", reward=1.0, info="")) - 1
        raw(frame("result", reward=1.0, info="x" * (10240 - base)))
        done()
        """,
        "protocol_error",
        (r"\b10240\b", r"max_frame_bytes"),
        spec={"max_frame_bytes": 2048},
    ),
    "noise before the result": Fake(
        """
        hello()
        raw(b"garbage line one\\n")
        raw(b"\\xff\\xfe not even utf-8\\n")
        raw(b"[1, 2, 3]\\n")
        raw(json.dumps({"t": "result", "nonce": "not-" + N, "reward": 0.0}).encode() + b"\\n")
        raw(json.dumps({"t": "result", "nonce": N.upper(), "reward": "bad"}).encode() + b"\\n")
        raw(json.dumps({"t": "result", "reward": 0.0}).encode() + b"\\n")
        result(1.0)
        done()
        """,
        "ok",
        log_says=(
            r"ignored stdout line \(not JSON\).*garbage line one",
            r"ignored stdout line \(not a JSON object\)",
            r"ignored stdout line \(no nonce of this episode\).*not-",
        ),
    ),
    "deeply nested JSON noise": Fake(
        # Noise like any other line: it must not take the parent down with a RecursionError.
        "hello(); raw(b'[' * 5000 + b'\\n'); result(1.0); done()",
        "ok",
        log_says=(r"ignored stdout line",),
    ),
    "a nonce that is a lone surrogate": Fake(
        # Valid JSON; its nonce cannot be encoded as UTF-8. Still just noise.
        'hello(); raw(b\'{"t": "result", "nonce": "\\\\ud800"}\\n\'); result(1.0); done()',
        "ok",
        log_says=(r"ignored stdout line",),
    ),
    "protocol 2": Fake(
        "hello(protocol=2); sys.exit(2)",
        "protocol_error",
        (r"protocol 2\b", rf"\b{V}\b"),
    ),
    "a second hello": Fake(
        "hello(); hello(); result(1.0); done()",
        "protocol_error",
        (r"a second hello frame",),
    ),
    "a containment other than the parent's": Fake(
        "send('hello', protocol=1, pid=os.getpid(), python='3', subreaper=False, "
        "containment='pidns'); result(1.0); done()",
        "protocol_error",
        (r"the shim set up containment 'pidns', not 'session'",),
        spec={"containment": "session"},
    ),
    "a second done": Fake(
        "hello(); result(1.0); done(); done()",
        "protocol_error",
        (r"a second done frame",),
    ),
    "killed by a signal before hello": Fake(
        "os.kill(os.getpid(), signal.SIGKILL)",
        "crashed",
        (r"the shim was killed by SIGKILL before it started",),
        signal="SIGKILL",
    ),
    "no hello, exit 0": Fake(
        "sys.stderr.write('fake shim: refusing to start\\n')",
        "setup_error",
        (r"did not start", r"exited with 0", r"fake shim: refusing to start"),
    ),
    "hello, then exit 0": Fake(
        "hello()",
        "protocol_error",
        (r"exited 0", r"without .*result"),
    ),
    "hello, then SIGSEGV": Fake(
        # No core file: this is a test, not a post-mortem.
        "hello(); resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
        "os.kill(os.getpid(), signal.SIGSEGV)",
        "crashed",
        (r"killed by SIGSEGV",),
        signal="SIGSEGV",
    ),
    "hangs after hello": Fake(
        "hello(); time.sleep(60)",
        "timeout",
        (r"no result within 1 s",),
        spec={"timeout": 1.0},
    ),
    "a result in time, then a hang past the deadline": Fake(
        # The result counts; the deadline only ends the hang (no done frame ever comes).
        "hello(); result(0.5); time.sleep(60)",
        "ok",
        spec={"timeout": 1.0},
        reward=0.5,
    ),
    "never reads stdin": Fake(
        "import time; time.sleep(60)",
        "timeout",
        (r"no result within 1 s",),
        spec={"timeout": 1.0},
        prelude=False,
    ),
    "frames byte by byte": Fake(
        # Every frame split across many reads of the parent.
        """
        data = (
            frame("hello", protocol=1, pid=os.getpid(), python="3.11", subreaper=False)
            + frame("result", reward=0.5, info={"k": [1, 2]})
            + frame("done", why="exited", killed=0, exit_code=0, signal=None)
        )
        for i in range(len(data)):
            raw(data[i : i + 1])
            time.sleep(0.0005)
        """,
        "ok",
        reward=0.5,
    ),
    "result in small os.write chunks": Fake(
        """
        hello()
        sys.stdout.flush()
        data = frame("result", reward=0.25, info={"text": "x" * 500})
        for i in range(0, len(data), 3):
            os.write(1, data[i : i + 3])
        done()
        """,
        "ok",
        reward=0.25,
    ),
    "a frame over max_info_bytes + 8 MiB": Fake(
        # Under max_frame_bytes, but no frame with an info of 1 KiB needs 9 MiB.
        """
        hello()
        raw(frame("result", reward=1.0, info="x" * (9 * 1024 * 1024)))
        done()
        """,
        "protocol_error",
        (r"over max_info_bytes \+ 8 MiB \(8389632\), less than max_frame_bytes",),
        spec={"max_info_bytes": 1024},
    ),
    "a last result without its newline": Fake(
        "hello(); raw(frame('result', reward=0.5, info=None)[:-1])",
        "ok",
        reward=0.5,
    ),
    "eof in the middle of the result": Fake(
        "hello(); raw(frame('result', reward=0.5, info={'a': 'b' * 100})[:60])",
        "protocol_error",
        (r"incomplete frame at EOF", r"\b60 bytes"),
    ),
    "a result whose info is over max_info_bytes": Fake(
        "hello(); result(1.0, info=['x' * 100] * 200); done()",
        "protocol_error",
        (r"info of \d+ bytes is over max_info_bytes \(1024\)",),
        spec={"max_info_bytes": 1024},
    ),
    "a result nested deeper than the limit": Fake(
        'hello(); raw(b\'{"t": "result", "nonce": "%s", "reward": 1, "info": %s}\\n\''
        " % (N.encode(), b'[' * 65 + b']' * 65)); done()",
        "protocol_error",
        (r"nested deeper than 64 levels",),
    ),
    "an error message with a lone surrogate": Fake(
        'hello(); raw(b\'{"t": "error", "nonce": "%s", "kind": "agent", '
        '"type": "E", "message": "bad \\\\ud800 end"}\\n\' % N.encode()); done(1)',
        "agent_error",
        (r"^bad \\ud800 end$",),
    ),
}


def fake_spec(tmp_path: Path, **overrides: Any) -> isolate.EpisodeSpec:
    fields: dict[str, Any] = {
        "entrypoint": "fake:run",  # never imported: the fake shim ignores it
        "timeout": 20.0,
        "kill_grace": 0.5,
        "cancel_grace": 1.0,  # the fakes never answer a cancel request
        "log_dir": tmp_path / "logs",
    }
    fields.update(overrides)
    return isolate.EpisodeSpec(**fields)


def write_fake(tmp_path: Path, fake: Fake) -> Path:
    path = tmp_path / "fake_shim.py"
    body = textwrap.dedent(fake.body).strip() + "\n"
    path.write_text((PRELUDE + body) if fake.prelude else body)
    return path


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(FAKES))
async def test_fake_shim(tmp_path: Path, name: str) -> None:
    fake = FAKES[name]
    spec = fake_spec(tmp_path, **fake.spec)
    started = time.monotonic()
    outcome = await _internals.run_with_shim(spec, {"instance_id": "p"}, write_fake(tmp_path, fake))
    elapsed = time.monotonic() - started

    assert outcome.status == fake.status, outcome.summary()
    if fake.status == "ok":
        assert outcome.error is None
        assert outcome.reward == fake.reward
    else:
        assert outcome.error is not None
        assert outcome.reward is None
        for pattern in fake.says:
            assert re.search(pattern, outcome.error.message), (pattern, outcome.error.message)
    if fake.signal is not None:
        assert outcome.signal == fake.signal
        assert outcome.exit_code is None
    assert outcome.log_path is not None
    log = outcome.log_path.read_text(errors="replace")
    for pattern in fake.log_says:
        assert re.search(pattern, log), (pattern, log)
    if "time.sleep(60)" in fake.body:
        # Killed at the deadline, not when the fake's sleep ran out.
        bound = spec.timeout + spec.cancel_grace + spec.kill_grace + 5.0
        assert spec.timeout <= elapsed < bound * SLOW
    if fake.status == "ok":
        assert "protocol violation" not in log


@pytest.mark.anyio
async def test_fake_secret_is_scrubbed_from_protocol_errors(tmp_path: Path) -> None:
    # The child knows the secret and may quote it in a frame that breaks the protocol.
    secret = "sk-proto-SECRET-987"
    fake = Fake(
        "hello(); result(None, reward_type='str', reward_repr=repr(hs['secrets']['key'])); done()",
        "protocol_error",
    )
    spec = fake_spec(tmp_path)
    outcome = await _internals.run_with_shim(
        spec, {}, write_fake(tmp_path, fake), secrets={"key": secret}
    )
    assert outcome.status == "protocol_error"
    assert outcome.error is not None
    assert MASK.decode() in outcome.error.message
    assert secret not in outcome.model_dump_json()


# --- the real shim, directly ------------------------------------------------------------------


def run_real_shim(
    tmp_path: Path, handshake: bytes | None, program: Path | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run the real shim (or ``program``); its stdin is a pipe we keep open, so only the
    handshake can end it."""
    read_end, write_end = os.pipe()
    try:
        if handshake is not None:
            os.write(write_end, handshake)
        else:
            os.close(write_end)
            write_end = -1
        proc = subprocess.Popen(
            [sys.executable, "-I", str(program or isolate.shim_path())],
            stdin=read_end,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
        )
        os.close(read_end)
        read_end = -1
        try:
            out, err = proc.communicate(timeout=10 * SLOW)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        assert proc.returncode is not None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)


def marker_agent(agents: Agents) -> tuple[dict[str, Any], Path]:
    """A handshake for an agent that leaves a marker file when imported or called."""
    marker = agents.tmp / "marker"
    (agents.root / "marker_agent.py").write_text(
        textwrap.dedent(
            f"""
            open({str(marker)!r}, "a").write("imported\\n")

            def run(data):
                open({str(marker)!r}, "a").write("called\\n")
                return 1.0
            """
        )
    )
    hs = {
        "protocol": V,
        "nonce": "n0nce-for-the-real-shim",
        "entrypoint": "marker_agent:run",
        "agent_root": str(agents.root),
        "data": {},
        "kwargs": {},
        "deadline": 10.0,
        "kill_grace": 1.0,
        "max_info_bytes": 1000,
        "secrets": {},
    }
    return hs, marker


def frames_of(out: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.parametrize("program", ["shim.py", "boot.py"])
def test_real_shim_runs_a_matching_handshake(agents: Agents, tmp_path: Path, program: str) -> None:
    # The control for the tests below: the marker does show when the agent runs. boot.py is
    # what the launcher starts; it runs shim.py from its cached bytecode.
    hs, marker = marker_agent(agents)
    path = isolate.shim_path().with_name(program)
    done = run_real_shim(tmp_path, json.dumps(hs).encode() + b"\n", path)
    assert done.returncode == 0, done.stderr
    frames = frames_of(done.stdout)
    assert [f["t"] for f in frames] == ["hello", "result", "done"]
    assert {f["nonce"] for f in frames} == {hs["nonce"]}
    assert frames[1]["reward"] == 1.0
    assert marker.read_text() == "imported\ncalled\n"


def test_real_shim_answers_a_version_mismatch_and_stops(agents: Agents, tmp_path: Path) -> None:
    hs, marker = marker_agent(agents)
    hs["protocol"] = 999
    done = run_real_shim(tmp_path, json.dumps(hs).encode() + b"\n")
    assert done.returncode == 2
    frames = frames_of(done.stdout)
    assert len(frames) == 1, done.stdout
    (hello,) = frames
    assert hello["t"] == "hello"
    assert hello["protocol"] == isolate.PROTOCOL_VERSION
    assert hello["nonce"] == hs["nonce"]
    assert not marker.exists()


@pytest.mark.parametrize(
    "entrypoint",
    ["marker_agent", "marker_agent:run:x", "marker_agent:", "1agent:run", "marker_agent:r un", 7],
)
def test_real_shim_refuses_a_malformed_entrypoint(
    agents: Agents, tmp_path: Path, entrypoint: object
) -> None:
    hs, marker = marker_agent(agents)
    hs["entrypoint"] = entrypoint
    done = run_real_shim(tmp_path, json.dumps(hs).encode() + b"\n")
    assert done.returncode == 2
    hello, error = frames_of(done.stdout)
    assert (hello["t"], error["t"], error["type"]) == ("hello", "error", "HandshakeError")
    assert "'entrypoint'" in error["message"]
    assert not marker.exists()


@pytest.mark.parametrize(
    "handshake",
    [None, b"not json\n", b'{"protocol": 1}\n'],
    ids=["stdin closed", "not JSON", "no nonce"],
)
def test_real_shim_without_a_handshake(tmp_path: Path, handshake: bytes | None) -> None:
    done = run_real_shim(tmp_path, handshake)
    assert done.returncode == 2
    assert done.stdout == b""
    assert b"handshake" in done.stderr


def test_the_shim_cuts_errors_to_what_the_parent_keeps() -> None:
    assert agent_shim.shim.MAX_MESSAGE_CHARS == MAX_MESSAGE_CHARS
    assert agent_shim.shim.MAX_TRACEBACK_CHARS == MAX_TRACEBACK_CHARS
    secret = "sk-" + "s" * 40
    message = "m" * (MAX_MESSAGE_CHARS - 80) + secret + "m" * 100
    traceback = "t" * 100 + secret + "t" * (MAX_TRACEBACK_CHARS - 80) + "END"
    fields = agent_shim.shim.load_part("worker").report(message, traceback, [secret])
    assert len(fields["message"]) <= MAX_MESSAGE_CHARS
    assert len(fields["traceback"]) <= MAX_TRACEBACK_CHARS
    assert "s" * 12 not in fields["message"] + fields["traceback"]  # never half a secret
    assert fields["message"].startswith("m" * 1000)
    assert fields["message"].endswith(
        f"[... {len(message) - MAX_MESSAGE_CHARS + 80} more characters]"
    )
    assert fields["traceback"].endswith("t" * 1000 + "END")
    small = agent_shim.shim.load_part("worker").report("short", "tb", [secret])
    assert small == {"message": "short", "traceback": "tb"}


def test_shim_protocol_version_matches() -> None:
    assert agent_shim.shim.PROTOCOL_VERSION == isolate.PROTOCOL_VERSION


WIRE_NAMES = {
    "PROTOCOL_VERSION",
    "CANCEL",
    "EPISODE_ENV",
    "EPISODE_TAG_ENV",
    "EPISODE_VARS",
    "LAYERS",
    "MAX_MESSAGE_CHARS",
    "MAX_TRACEBACK_CHARS",
    "MAX_MESSAGE",
    "_MAX_MESSAGE",
}


def test_every_error_type_the_shim_sends_is_a_class_or_documented() -> None:
    """Each ``type`` the shim writes into an ``error`` frame by name (not the agent's exception
    class) is a class of isolate's errors or listed in docs/protocol.md's table of them."""
    import ast

    from isolate._core.model import errors

    root = Path(isolate.__file__).resolve().parent.parent
    documented = set(re.findall(r"^\| `(\w+)` \|", (root / "docs/protocol.md").read_text(), re.M))
    sent: dict[str, str] = {}
    for path in sorted(root.glob("agent_shim/*.py")):
        tree = ast.parse(path.read_text())
        # Names assigned a string in the file: a frame's type may be passed as a variable.
        strings: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = (
                        zip(target.elts, node.value.elts, strict=True)
                        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                        else [(target, node.value)]
                    )
                    for name, value in pairs:
                        if isinstance(name, ast.Name) and isinstance(value, ast.Constant):
                            strings.setdefault(name.id, set()).add(str(value.value))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            first = node.args[0] if node.args else None
            if node.func.attr != "send" or not isinstance(first, ast.Constant):
                continue
            if first.value != "error":
                continue
            for keyword in node.keywords:
                if keyword.arg != "type":
                    continue
                value = keyword.value
                if isinstance(value, ast.Constant):
                    sent[str(value.value)] = f"{path.name}:{node.lineno}"
                elif isinstance(value, ast.Name):
                    for text in strings[value.id]:
                        sent[text] = f"{path.name}:{node.lineno}"
    assert {"HandshakeError", "ContainmentError", "LimitError", "SandboxError"} <= set(sent)
    unnamed = {t: at for t, at in sent.items() if t not in documented and not hasattr(errors, t)}
    assert unnamed == {}


def test_the_wire_is_written_once() -> None:
    """Both sides take the protocol's constants, the containment grammar and the template
    socket's codec from agent_shim/shim_wire.py: no other module gives one of them a value of
    its own, and the shim's are the very values the parent uses."""
    import ast

    import agent_shim.shim_wire as wire

    root = Path(isolate.__file__).resolve().parent.parent
    own: list[str] = []
    for path in sorted([*root.glob("isolate/**/*.py"), *root.glob("agent_shim/*.py")]):
        if path.name == "shim_wire.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                names = {n.id for n in flat if isinstance(n, ast.Name)}
                literal = any(isinstance(n, ast.Constant) for n in ast.walk(node.value))
                if names & WIRE_NAMES and literal:
                    own.append(f"{path.relative_to(root)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr in ("recvmsg", "sendmsg"):
                # The channel socket's reader (netserve) takes a worker's listeners; no one
                # else encodes messages with fds but the wire.
                if path.name not in ("netserve.py",):
                    own.append(f"{path.relative_to(root)}:{node.lineno} {node.attr}")
    assert own == []
    shim = agent_shim.shim
    assert Path(shim.wire.__file__).resolve() == Path(wire.__file__).resolve()
    for name in ("PROTOCOL_VERSION", "CANCEL", "LAYERS", "MAX_MESSAGE_CHARS"):
        assert getattr(shim, name) == getattr(wire, name), name
    from isolate._core.model import config

    assert _internals.CANCEL is wire.CANCEL
    assert config.LAYERS is wire.LAYERS
    process_receive, registry_receive = _internals.template_receivers
    assert process_receive is wire.receive_message
    assert registry_receive is wire.receive_message


@pytest.mark.parametrize(
    ("value", "canonical"),
    [
        ("session", "session"),
        ("pidns+cgroup", "cgroup+pidns"),
        ("landlock+cgroup+pidns", "cgroup+pidns+landlock"),
        ("cgroup+cgroup", None),
        ("auto", None),
        ("", None),
        ("cgroup+", None),
        (None, None),
    ],
)
def test_one_containment_grammar_on_both_sides(value: Any, canonical: str | None) -> None:
    import agent_shim.shim_wire as wire

    assert wire.canonical_containment(value) == canonical
    assert agent_shim.shim.is_containment(value) is (canonical is not None and canonical == value)
    if isinstance(value, str) and value != "auto":
        if canonical is None:
            with pytest.raises(ValueError, match="containment must be"):
                isolate.EpisodeSpec(agent_root="/", entrypoint="m:f", containment=value)
        else:
            spec = isolate.EpisodeSpec(agent_root="/", entrypoint="m:f", containment=value)
            assert spec.containment == canonical


def test_the_shim_keeps_heavy_imports_off_the_launch_path(tmp_path: Path) -> None:
    """Every episode pays for what importing the shim imports: these are each 0.3-40 ms and are
    imported where needed (see bench.profile_launch), never at the top. -S: without site,
    which in some environments imports re itself."""
    code = textwrap.dedent(
        """
        import sys
        before = set(sys.modules)
        sys.path.insert(0, sys.argv[1])
        import shim
        print(" ".join(sorted(set(sys.modules) - before)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(isolate.shim_path().parent)],
        capture_output=True,
        text=True,
        timeout=10 * SLOW,
        check=True,
    )
    imported = set(done.stdout.split())
    assert "shim" in imported  # the control: the import did happen
    heavy = {"asyncio", "ctypes", "enum", "inspect", "json", "numbers", "re", "resource", "signal"}
    heavy |= {"traceback", "socket", "array", "typing"}
    assert imported & heavy == set()


@pytest.mark.anyio
async def test_the_parent_starts_the_shim_through_boot_py(agents: Agents) -> None:
    started: list[int] = []
    spec = agents.spec("import time\ndef run(d):\n    time.sleep(0.5)\n    return 1.0\n")
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: isolate.run_episode(spec, {}, on_start=started.append))
        await wait_until(lambda: bool(started), 10.0)
        cmdline = await anyio.Path(f"/proc/{started[0]}/cmdline").read_bytes()
    boot = isolate.shim_path().with_name("boot.py")
    assert cmdline.split(b"\0")[1:-1] == [b"-I", str(boot).encode()]


@pytest.mark.parametrize("drift", [False, True], ids=["ctypes core", "ctypes itself"])
def test_shim_calls_libc_with_or_without_the_private_ctypes_interface(drift: bool) -> None:
    # "drift": as if _ctypes' private interface had changed (ctypes, loaded first, still works)
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, sys.argv[1])
        import shim
        if {drift}:
            import ctypes, _ctypes
            _ctypes._SimpleCData = None
        print(shim.c_call("prctl", 36, 1, 0, 0, 0), shim.c_call("unshare", -1), end=" ")
        print("ctypes" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(isolate.shim_path().parent)],
        capture_output=True,
        text=True,
        timeout=10 * SLOW,
        check=True,
    )
    # PR_SET_CHILD_SUBREAPER works; unshare(-1) fails with EINVAL, and errno says so
    assert done.stdout == f"(0, 0) (-1, {errno.EINVAL}) {drift}\n"


def test_importing_the_shim_module_has_no_side_effect(tmp_path: Path) -> None:
    # In a fresh interpreter: the shim touches fds and signals when it runs, never on import.
    repo = Path(isolate.__file__).resolve().parents[1]
    code = textwrap.dedent(
        f"""
        import json, os, signal, sys, threading
        sys.path.insert(0, {str(repo)!r})

        def state():
            fds = {{}}
            for fd in os.listdir("/proc/self/fd"):
                try:
                    fds[fd] = os.readlink("/proc/self/fd/" + fd)
                except OSError:
                    pass  # the fd listdir itself used, closed by now
            sigs = {{s.name: repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGCHLD,
                    signal.SIGHUP, signal.SIGINT)}}
            return {{"fds": sorted(fds.values()), "sigs": sigs,
                    "stdout": sys.stdout.fileno(), "threads": threading.active_count()}}

        before = state()
        import agent_shim.shim
        after = state()
        sys.stderr.write(json.dumps([before, after]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", code],
        stdin=subprocess.PIPE,  # open, never written: a read on import would hang
        capture_output=True,
        cwd=tmp_path,
        timeout=10 * SLOW,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b""
    before, after = json.loads(done.stderr)
    assert before == after
    assert list(tmp_path.iterdir()) == []


# --- properties of the parent-side parser -----------------------------------------------------

QUICK = settings(max_examples=200, deadline=None)
NONCE = "0123456789abcdef0123456789abcdef"
NO_SECRETS = Redactor([])
FRAME_TYPES = (Hello, Result, ErrorFrame, Progress, Done)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
other_nonces = st.one_of(
    st.sampled_from(
        [NONCE[:-1], NONCE + "0", NONCE.upper(), " " + NONCE, NONCE + "\n", "", "\u0000"]
    ),
    st.text(max_size=40).filter(lambda s: s != NONCE),
    st.integers(),
    st.none(),
    st.lists(st.just(NONCE), max_size=1),
)
frame_fields = st.fixed_dictionaries(
    {"t": st.sampled_from(["hello", "result", "error", "progress", "done", "other", 7])},
    optional={
        "protocol": st.integers(-2, 3) | json_values,
        "pid": st.integers(0, 2**22) | json_values,
        "python": st.just("3.11") | json_values,
        "subreaper": st.booleans() | json_values,
        "reward": st.floats() | st.dictionaries(st.text(max_size=3), st.floats()) | json_values,
        "reward_type": st.text(max_size=5),
        "reward_repr": st.text(max_size=5),
        "info": json_values,
        "kind": st.sampled_from(["agent", "setup", "weird"]),
        "type": st.text(max_size=5) | json_values,
        "message": st.text(max_size=5) | json_values,
        "traceback": st.text(max_size=5),
        "why": st.sampled_from(["exited", "deadline", "terminated", "bored"]),
        "killed": st.integers(-2, 5),
        "exit_code": st.none() | st.integers(-1, 255),
        "signal": st.none() | st.integers(1, 64) | json_values,
    },
)


@QUICK
@given(line=st.binary(max_size=300))
@example(line=b"[" * 5000)  # nesting deeper than the JSON decoder's recursion limit
@example(line=b'{"t": "hello", "nonce": "\\ud800"}')  # a nonce UTF-8 cannot encode
@example(line=b'{"nonce": "0123456789abcdef0123456789abcdef"}')
@example(line=b"\xef\xbb\xbf{}")
@example(line=b"NaN")
def test_parse_line_never_raises(line: bytes) -> None:
    item = parse_line(line, NONCE, NO_SECRETS)
    assert isinstance(item, (*FRAME_TYPES, Noise, Violation))
    if isinstance(item, Noise):
        assert item.preview == line[:200]
    if isinstance(item, (*FRAME_TYPES, Violation)):
        # Only a JSON object carrying exactly this nonce is a frame, or can break the protocol.
        obj = json.loads(line)
        assert obj["nonce"] == NONCE


@QUICK
@given(fields=frame_fields, nonce=other_nonces, drop=st.booleans())
def test_a_line_without_the_exact_nonce_is_never_a_frame(
    fields: dict[str, Any], nonce: Any, drop: bool
) -> None:
    obj = dict(fields) if drop else dict(fields, nonce=nonce)
    item = parse_line(json.dumps(obj).encode(), NONCE, NO_SECRETS)
    assert isinstance(item, Noise), item


@QUICK
@given(fields=frame_fields)
def test_a_line_with_the_nonce_is_a_frame_or_a_violation(fields: dict[str, Any]) -> None:
    item = parse_line(json.dumps(dict(fields, nonce=NONCE)).encode(), NONCE, NO_SECRETS)
    assert isinstance(item, (*FRAME_TYPES, Violation)), item
    if isinstance(item, FRAME_TYPES):
        assert item.nonce == NONCE
        assert item.t == fields["t"]
    else:
        assert item.message


def test_parse_line_examples() -> None:
    # The properties above hold for a parser that calls everything noise; pin real frames too.
    hello = b'{"t":"hello","nonce":"%s","protocol":1,"pid":5,"python":"3.9.1","subreaper":true}'
    item = parse_line(hello % NONCE.encode(), NONCE, NO_SECRETS)
    assert item == Hello(t="hello", nonce=NONCE, protocol=1, pid=5, python="3.9.1", subreaper=True)
    result = b'{"t":"result","nonce":"%s","reward":NaN,"info":{"a":[1]}}' % NONCE.encode()
    item = parse_line(result, NONCE, NO_SECRETS)
    assert isinstance(item, Result)
    assert isinstance(item.reward, float)
    assert math.isnan(item.reward)
    assert item.info == {"a": [1]}
    bad = b'{"t":"done","nonce":"%s","why":"exited","killed":-1,"exit_code":0,"signal":null}'
    item = parse_line(bad % NONCE.encode(), NONCE, NO_SECRETS)
    assert isinstance(item, Violation)
    assert "killed" in item.message


def json_count_and_depth(value: Any) -> tuple[int, int]:
    """How many JSON values (keys included) ``value`` holds, and how deep it nests."""
    if isinstance(value, dict):
        inner = [json_count_and_depth(v) for v in value.values()]
        return 1 + len(value) + sum(c for c, _ in inner), 1 + max((d for _, d in inner), default=0)
    if isinstance(value, list):
        inner = [json_count_and_depth(v) for v in value]
        return 1 + sum(c for c, _ in inner), 1 + max((d for _, d in inner), default=0)
    return 1, 0


@QUICK
@given(value=json_values, indent=st.sampled_from([None, 1]))
@example(value={"a\\": ['"', '\\"', "[{", []]}, indent=None)
def test_shape_bounds_what_a_parse_would_build(value: Any, indent: int | None) -> None:
    line = json.dumps(value, indent=indent).encode()
    count, depth = json_count_and_depth(value)
    measured = shape(line)
    assert measured is not None
    assert measured[0] >= count  # an upper bound: the memory a parse needs is known before
    assert measured[1] == depth


@pytest.mark.parametrize(
    "line", [b'"unterminated', b"[[]", b"{}}", b'["a\\"]', b"[" * 100, b'{"a": "b"}]']
)
def test_shape_refuses_what_cannot_be_json(line: bytes) -> None:
    assert shape(line) is None


def test_shape_caps_the_depth_it_counts() -> None:
    assert shape(b"[" * 64 + b"]" * 64) == (65, 64)
    assert shape(b"[" * 100_000 + b"]" * 100_000) == (100_001, MAX_DEPTH + 1)


def result_line(info: bytes, nonce: str = NONCE) -> bytes:
    return b'{"t":"result","nonce":"%s","reward":1.0,"info":%s}' % (nonce.encode(), info)


def test_parse_line_measures_before_it_parses() -> None:
    # 700,000 empty dicts: ~60 MB once parsed, refused from their count alone.
    many = b"[" + b",".join([b"{}"] * 700_000) + b"]"
    item = parse_line(result_line(many), NONCE, NO_SECRETS)
    assert isinstance(item, Violation)
    assert "JSON values, over the limit" in item.message
    # Without this episode's nonce the same line is noise, read no further.
    item = parse_line(result_line(many, "f" * 32), NONCE, NO_SECRETS)
    assert isinstance(item, Noise)
    # The frame's own object is a level: its info may nest 63 deep.
    deep = b"[" * 64 + b"]" * 64
    item = parse_line(result_line(deep), NONCE, NO_SECRETS)
    assert isinstance(item, Violation)
    assert item.message == "a frame nested deeper than 64 levels"
    ok = parse_line(result_line(b"[" * 63 + b"]" * 63), NONCE, NO_SECRETS)
    assert isinstance(ok, Result)


def test_parse_line_holds_the_child_to_max_info_bytes() -> None:
    value = ["y" * 1000] * 20
    size = len(json.dumps(value))  # measured as the shim measures it
    info = json.dumps(value, separators=(",", ":")).encode()
    assert isinstance(parse_line(result_line(info), NONCE, NO_SECRETS, size), Result)
    # The slack is for the shim's own summary of an info it cut; past it, the child lied.
    item = parse_line(result_line(info), NONCE, NO_SECRETS, size - 8193)
    assert isinstance(item, Violation)
    expected = f"'result' frame's info of {size} bytes is over max_info_bytes ({size - 8193})"
    assert expected in item.message


def test_parse_line_makes_every_string_encodable() -> None:
    line = b'{"t":"error","nonce":"%s","kind":"agent","type":"E\\udc80","message":"a\\ud800",'
    line += b'"traceback":"","x\\udfff":{"\\ud801":["\\udbff"]}}'
    item = parse_line(line % NONCE.encode(), NONCE, NO_SECRETS)
    assert isinstance(item, ErrorFrame)
    assert (item.type, item.message) == ("E\\udc80", "a\\ud800")
    item.model_dump_json().encode("utf-8")


def test_an_error_frame_keeps_bounded_text() -> None:
    line = json.dumps(
        {
            "t": "error",
            "nonce": NONCE,
            "kind": "agent",
            "type": "E",
            "message": "m" * 100_000,
            "traceback": "t" * 300_000 + "END",
        }
    ).encode()
    item = parse_line(line, NONCE, NO_SECRETS)
    assert isinstance(item, ErrorFrame)
    assert item.message.startswith("m" * 1000)
    assert item.message.endswith(f"[... {100_000 - MAX_MESSAGE_CHARS} more characters]")
    assert len(item.message) < MAX_MESSAGE_CHARS + 100
    assert item.traceback.endswith("END")
    assert item.traceback.startswith(f"[{300_003 - MAX_TRACEBACK_CHARS} characters cut ...]")


# --- properties of the line splitter ----------------------------------------------------------

streams = st.lists(
    st.sampled_from([b"\n", b"\n\n", b"a", b"bc", b"defgh", b"x" * 11, b"\r", b"\x00\xff"])
    | st.binary(max_size=6),
    max_size=40,
).map(b"".join)


def cut(data: bytes, points: list[int]) -> list[bytes]:
    bounds = [0, *sorted(p % (len(data) + 1) for p in points), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@QUICK
@given(data=streams, points=st.lists(st.integers(0, 10_000), max_size=12), limit=st.integers(0, 12))
def test_line_splitter_matches_a_whole_split(data: bytes, points: list[int], limit: int) -> None:
    splitter = LineSplitter(limit)
    got: list[bytes | int] = []
    for chunk in cut(data, points):
        got += splitter.feed(chunk)
        assert len(splitter._buf) <= limit
    *complete, last = data.split(b"\n")
    assert got == [line if len(line) <= limit else len(line) for line in complete]
    if not last:
        assert splitter.rest() is None
    else:
        assert splitter.rest() == (last if len(last) <= limit else len(last))


# --- properties of the redactor ---------------------------------------------------------------

# Secrets from an alphabet disjoint from the mask "[secret]": a secret that is part of the
# mask would "appear" in every scrubbed text, which says nothing about leaks. A space, a
# backslash and a character of two bytes in UTF-8: forms that escaping and encoding change.
SECRET_ALPHABET = "abk-9 \\\u00e9"
assert not set(SECRET_ALPHABET) & set(MASK.decode())
secret_values = st.text(alphabet=SECRET_ALPHABET, min_size=1, max_size=7)


@st.composite
def secret_streams(draw: st.DrawFn, max_secrets: int) -> tuple[list[str], bytes, list[int]]:
    secrets = draw(st.lists(secret_values, min_size=1, max_size=max_secrets))
    pieces = st.sampled_from(secrets).map(str.encode) | st.text(
        alphabet=SECRET_ALPHABET + "\n", max_size=5
    ).map(str.encode)
    # Prefixes and suffixes of secrets are what a careless stream scrubber gets wrong.
    halves = st.sampled_from(secrets).flatmap(
        lambda s: st.integers(0, len(s)).flatmap(
            lambda i: st.sampled_from([s[:i].encode(), s[i:].encode()])
        )
    )
    data = b"".join(draw(st.lists(pieces | halves, max_size=20)))
    points = draw(st.lists(st.integers(0, 10_000), max_size=10))
    return secrets, data, points


def stream_through(secrets: list[str], chunks: list[bytes]) -> bytes:
    redactor = Redactor(secrets)
    return b"".join(redactor.stream(chunk) for chunk in chunks) + redactor.flush()


@QUICK
@given(case=secret_streams(max_secrets=1))
def test_redactor_stream_equals_scrub_one_secret(case: tuple[list[str], bytes, list[int]]) -> None:
    secrets, data, points = case
    streamed = stream_through(secrets, cut(data, points))
    assert streamed == Redactor(secrets).scrub(data)
    assert secrets[0].encode() not in streamed


@QUICK
@given(case=secret_streams(max_secrets=3))
@example(case=(["sk-abc", "sk-abcdef"], b"sk-abcdef", [6]))  # one key a prefix of another
@example(case=(["abcd", "bc"], b"abcd", [3]))  # one key inside another
def test_redactor_stream_equals_scrub_several_secrets(
    case: tuple[list[str], bytes, list[int]],
) -> None:
    secrets, data, points = case
    streamed = stream_through(secrets, cut(data, points))
    assert streamed == Redactor(secrets).scrub(data)
    for secret in secrets:
        assert secret.encode() not in streamed


def test_redactor_holds_back_a_split_secret() -> None:
    # The example the properties rest on: a secret cut in three still never shows.
    redactor = Redactor(["sk-abc123"])
    parts = [redactor.stream(b"key=sk-a"), redactor.stream(b"bc1"), redactor.stream(b"23 ok")]
    assert b"".join(parts) + redactor.flush() == b"key=[secret] ok"
    assert parts[0] == b"key="


# --- the shim's JSON, which avoids importing json ---------------------------------------------


def same_json(a: Any, b: Any) -> bool:
    """Equal, NaN included (NaN != NaN, but the same text)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@QUICK
@given(value=json_values | st.tuples(json_scalars, json_scalars))
def test_shim_to_json_reads_back_as_json_dumps_does(value: Any) -> None:
    text = agent_shim.shim.to_json(value)
    assert text.isascii()
    assert same_json(json.loads(text), json.loads(json.dumps(value, default=repr)))


def test_shim_to_json_falls_back_to_repr() -> None:
    value = {"x": {1, 2}.__class__, "y": [b"z"]}
    assert json.loads(agent_shim.shim.to_json(value)) == {"x": repr(set), "y": [repr(b"z")]}


@QUICK
@given(value=json_values, pad=st.sampled_from(["", " ", "\n", " \t\r\n "]))
def test_shim_json_loads_reads_what_json_writes(value: Any, pad: str) -> None:
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
        assert same_json(agent_shim.shim.json_loads(pad + text + pad), value)


@pytest.mark.parametrize(
    "text", ["", " ", "{", '{"a": 1} {}', '{"a": 1}x', "[1,]", "{'a': 1}", '"\x01"', "nan"]
)
def test_shim_json_loads_refuses_what_json_loads_refuses(text: str) -> None:
    said = "Expecting|Extra data|Invalid control character"
    with pytest.raises(ValueError, match=said):
        json.loads(text)
    with pytest.raises(ValueError, match=said):
        agent_shim.shim.json_loads(text)


def test_parse_line_scrubs_data_but_not_the_protocols_words() -> None:
    # A one-letter key ("k", as tests use) is in "killed": the frame must still parse.
    redact = Redactor(["k"])
    done = b'{"t":"done","nonce":"%s","why":"exited","killed":0,"exit_code":0,"signal":null}'
    assert isinstance(parse_line(done % NONCE.encode(), NONCE, redact), Done)
    result = b'{"t":"result","nonce":"%s","reward":{"k1":1.0},"info":{"k":["ok"]},"k":1}'
    item = parse_line(result % NONCE.encode(), NONCE, redact)
    assert isinstance(item, Result)
    assert item.reward == {"[secret]1": 1.0}
    assert item.info == {"[secret]": ["o[secret]"]}


# --- handshakes and frames larger than a pipe ---------------------------------------------------


def pipe_size() -> int:
    read_end, write_end = os.pipe()
    try:
        return int(fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ))
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.anyio
async def test_a_handshake_larger_than_a_pipe_arrives_whole(agents: Agents) -> None:
    # 16 pipes' worth: written in parts, each when the pipe has room again.
    blob = "x" * (16 * pipe_size())
    spec = agents.spec(
        "import hashlib\n"
        "def run(data, *, key):\n"
        "    digest = hashlib.sha256(data['blob'].encode()).hexdigest()\n"
        "    return 1.0, {'digest': digest, 'key': len(key)}\n"
    )
    key = "k" * (2 * pipe_size())  # the secrets come last: a key that starts past a pipe
    outcome = await isolate.run_episode(spec, {"blob": blob}, secrets={"key": key})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.info == {"digest": hashlib.sha256(blob.encode()).hexdigest(), "key": len(key)}


@pytest.mark.anyio
@pytest.mark.parametrize(
    "body",
    ["os._exit(3)", "sys.stdin.buffer.read(100_000); os._exit(3)"],
    ids=["reads nothing", "reads part of it"],
)
async def test_a_child_that_exits_during_a_large_handshake(tmp_path: Path, body: str) -> None:
    # The rest of the write meets a closed pipe: the outcome says how the child ended.
    shim = tmp_path / "early_exit.py"
    shim.write_text(f"import os, sys\n{body}\n")
    spec = fake_spec(tmp_path)
    data = {"blob": "x" * (16 * pipe_size())}
    outcome = await _internals.run_with_shim(spec, data, shim)
    assert outcome.status == "setup_error", outcome.summary()
    assert outcome.error is not None
    assert "did not start" in outcome.error.message
    assert "exited with 3" in outcome.error.message


@pytest.mark.anyio
async def test_frames_over_256_kib_are_parsed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where: list[tuple[int, bool]] = []  # (bytes, parsed on the event loop's thread)
    parse = _internals.frames_protocol.parse_line

    def recording_parse(
        line: bytes, nonce: str, redact: Redactor, max_info: int, **options: Any
    ) -> Any:
        where.append((len(line), threading.current_thread() is threading.main_thread()))
        return parse(line, nonce, redact, max_info, **options)

    monkeypatch.setattr(_internals.frames_protocol, "parse_line", recording_parse)
    big = 300 * 1024
    fake = Fake(f"hello(); result(1.0, info='x' * {big}); done()", "ok")
    spec = fake_spec(tmp_path)
    outcome = await _internals.run_with_shim(spec, {}, write_fake(tmp_path, fake))
    assert outcome.status == "ok", outcome.summary()
    assert len(outcome.info) == big
    assert sorted(on_loop for size, on_loop in where if size > big) == [False]
    assert [on_loop for size, on_loop in where if size < 1024] == [True, True]  # hello, done


def test_one_line_escapes_control_characters_and_lone_surrogates() -> None:
    assert one_line("a\nb\tc\x00d\x7fe\ud800f") == "a\\nb\\tc\\x00d\\x7fe\\ud800f"
    assert one_line("plain text, é €") == "plain text, é €"


def test_one_line_ends_in_dots_wherever_it_cuts() -> None:
    assert one_line("x" * 300) == "x" * 300
    assert one_line("x" * 301) == "x" * 297 + "..."
    # Escapes make it longer than the limit: cut again.
    assert one_line("\n" * 200) == "\\n" * 148 + "\\" + "..."
    assert one_line("ab\ncd", limit=5) == "ab..."
    assert all(len(one_line(t)) <= 300 for t in ("x" * 10_000, "\x00" * 10_000))


def test_a_short_secret_inside_a_protocol_word_leaves_the_frame_readable() -> None:
    """A secret "exit" must not turn ``why: "exited"`` into ``[secret]ed``: the protocol's own
    words at the top level are kept; the same text elsewhere is scrubbed."""
    done = {"t": "done", "nonce": NONCE, "why": "exited", "killed": 0, "exit_code": 0}
    item = parse_line(json.dumps(dict(done, signal=None)).encode(), NONCE, Redactor(["exit"]))
    assert isinstance(item, Done)
    assert (item.why, item.exit_code) == ("exited", 0)
    progress = {"t": "progress", "nonce": NONCE, "info": {"step": "exited"}}
    item = parse_line(json.dumps(progress).encode(), NONCE, Redactor(["exit"]))
    assert isinstance(item, Progress)
    assert item.info == {"step": "[secret]ed"}


def test_a_progress_frame_keeps_its_own_fields_but_with_every_secret_scrubbed() -> None:
    """Progress frames keep fields the protocol does not know yet: their names are scrubbed
    too, not only their values."""
    secret = "sk-" + "Q7vX2mR9tL4wZ8pK3nB6" * 2
    obj = {"t": "progress", "nonce": NONCE, secret: 1, "note": f"key={secret}"}
    item = parse_line(json.dumps(obj).encode(), NONCE, Redactor([secret]))
    assert isinstance(item, Progress)
    assert item.model_extra == {MASK.decode(): 1, "note": f"key={MASK.decode()}"}
    assert secret not in repr(item)


def test_the_handshake_line_is_compact_json_with_its_secrets_last() -> None:
    line = encode_handshake(
        {"nonce": "n", "data": [1, 2]},
        {"key": SecretStr("v a")},
        {"API_KEY": SecretStr("e")},
    )
    expected = b'{"nonce":"n","data":[1,2],"secrets":{"key":"v a"},"secret_env":{"API_KEY":"e"}}'
    assert line == expected + b"\n"
    # No secret_env: no field for it, the line is the same as before it existed.
    assert encode_handshake({"nonce": "n"}, {}, {}) == b'{"nonce":"n","secrets":{}}\n'
    assert encode_handshake({"nonce": "n"}, {}) == b'{"nonce":"n","secrets":{}}\n'
    two = encode_handshake(
        {"nonce": "n"},
        {"a": SecretStr("1"), "b": SecretStr("2")},
        {"A": SecretStr("3"), "B": SecretStr("4")},
    )
    assert two == b'{"nonce":"n","secrets":{"a":"1","b":"2"},"secret_env":{"A":"3","B":"4"}}\n'


def test_a_handshake_with_a_number_json_cannot_carry_is_refused() -> None:
    with pytest.raises(ValueError, match="JSON compliant"):
        encode_handshake({"nonce": "n", "timeout": math.inf}, {})


def test_the_json_values_a_frame_may_hold_are_half_its_info_bound_plus_a_margin() -> None:
    """``max_info_bytes // 2 + 65536`` values: one more is a violation that names the bound."""
    bound = 1000 // 2 + 65536
    fits = {"t": "progress", "nonce": NONCE, "info": None, "junk": [0] * (bound - 10)}
    item = parse_line(json.dumps(fits).encode(), NONCE, NO_SECRETS, max_info_bytes=1000)
    assert isinstance(item, Progress)
    over = dict(fits, junk=[0] * (bound + 10))
    item = parse_line(json.dumps(over).encode(), NONCE, NO_SECRETS, max_info_bytes=1000)
    assert isinstance(item, Violation)
    assert f"over the limit of {bound} (max_info_bytes // 2 + 65536)" in item.message
    # At a large bound the half counts: 300,000 values fit under 600,000 bytes of info.
    big = dict(fits, junk=[0] * 300_000)
    item = parse_line(json.dumps(big).encode(), NONCE, NO_SECRETS, max_info_bytes=600_000)
    assert isinstance(item, Progress)


def test_shape_counts_strings_first_and_stops_there_when_they_are_over_the_limit() -> None:
    three = b'["a","b","c"]'  # 4 values: the list and its 3 strings
    assert shape(three) == (4, 1)
    assert shape(three, 4) == (4, 1)
    assert shape(three, 3) == (4, None)  # 3 strings are not over 3: every value counted
    assert shape(three, 2) == (3, None)  # 3 strings are over 2: no need to count further
    values = shape(three, 2)
    assert values is not None
    assert type(values[0]) is int
    assert shape(b"[1,2,3]", 4) == (4, 1)
    assert shape(b"[1,2,3]", 3) == (4, None)


def test_a_line_too_large_to_read_without_the_nonce_is_noise_with_a_scrubbed_preview() -> None:
    secret = "sk-preview-" + "Zq8vRt2L" * 3
    line = json.dumps({"key": secret, "junk": [0] * 70_000}).encode()
    item = parse_line(line, NONCE, Redactor([secret]), max_info_bytes=1000)
    assert item == Noise(
        "not a frame of this episode, too large to read",
        Redactor([secret]).scrub(line)[:200],
    )
    assert secret.encode() not in item.preview


def test_a_secret_spelled_with_some_slashes_escaped_is_scrubbed_from_the_frame() -> None:
    """JSON may escape each ``/`` or not: a line that mixes both spells no form the redactor
    looks for, but its string is the secret once parsed."""
    secret = "ab/cd/ef-short"  # short: masked whole only
    line = b'{"t":"progress","nonce":"%s","info":{"k":"ab\\/cd/ef-short"}}' % NONCE.encode()
    assert Redactor([secret]).scrub(line) == line  # the line itself shows no form of it
    item = parse_line(line, NONCE, Redactor([secret]))
    assert isinstance(item, Progress)
    assert item.info == {"k": MASK.decode()}


def test_a_lone_surrogate_in_raw_bytes_comes_out_escaped_and_encodable() -> None:
    line = b'{"t":"progress","nonce":"%s","info":{"k":"a\xed\xa0\x80b"}}' % NONCE.encode()
    item = parse_line(line, NONCE, NO_SECRETS)
    assert isinstance(item, Progress)
    assert item.info == {"k": "a\\ud800b"}
    item.model_dump_json().encode("utf-8")  # would raise on a lone surrogate


def test_an_info_at_exactly_its_bound_plus_the_slack_fits() -> None:
    bound = 1000 + 8 * 1024
    for size, fits in ((bound, True), (bound + 1, False)):
        info = "x" * (size - 2)  # json.dumps adds the quotes
        line = json.dumps({"t": "progress", "nonce": NONCE, "info": info}).encode()
        item = parse_line(line, NONCE, NO_SECRETS, max_info_bytes=1000)
        assert isinstance(item, Progress) is fits, size


def test_a_malformed_frame_names_the_field_by_its_dotted_path() -> None:
    done = {"t": "done", "nonce": NONCE, "why": "exited", "killed": -1, "exit_code": 0}
    item = parse_line(json.dumps(dict(done, signal=None)).encode(), NONCE, NO_SECRETS)
    assert item == Violation(
        "malformed 'done' frame: done.killed: Input should be greater than or equal to 0"
    )


class _BrokenRedactor(Redactor):
    def scrub(self, data: bytes) -> bytes:
        raise LookupError("broken")


def test_a_frame_that_cannot_be_digested_is_a_violation_naming_the_error() -> None:
    line = json.dumps({"t": "progress", "nonce": NONCE}).encode()
    item = parse_line(line, NONCE, _BrokenRedactor(["k"]))
    assert item == Violation(f"cannot read a frame of {len(line)} bytes: LookupError")


# --- a flood of lines -------------------------------------------------------------------------

FLOOD_KEY = "sk-proj-" + "Q7w9Zt2Lx4Vb8Nc1Md5Kf3Hg6Js0Pa2Ry"
WRONG = NONCE[:-1] + "0"
#: Lines that are not frames of the episode, each cheap to write and, one by one, dear to read.
FLOOD_LINES = (
    b"{}",
    b"x",
    b'{"nonce":"' + WRONG.encode() + b'"}',
    b'{"t":"result","nonce":"' + WRONG.encode() + b'","reward":0.0}',
    b'"\\u0041"',
    NONCE.encode(),
    b"the key " + FLOOD_KEY.encode(),
)


def flood_frames(notes: list[str]) -> _internals.Frames:
    return _internals.Frames(
        nonce=NONCE,
        redact=Redactor([FLOOD_KEY]),
        max_frame_bytes=1 << 20,
        max_info_bytes=1 << 16,
        containment="session",
        network=None,
        note=notes.append,
    )


def frame_line(t: str, **fields: Any) -> bytes:
    return json.dumps({"t": t, "nonce": NONCE, **fields}).encode() + b"\n"


HELLO_LINE = frame_line("hello", protocol=V, pid=1, python="3", subreaper=True)
DONE_LINE = frame_line("done", why="exited", killed=0, exit_code=0, signal=None)


async def feed_in_reads(frames: _internals.Frames, data: bytes) -> None:
    """``data`` as the pump reads it: 64 KiB at a time."""
    for start in range(0, len(data), 64 * 1024):
        await frames.feed(data[start : start + 64 * 1024])
    await frames.at_eof()


@pytest.mark.anyio
@pytest.mark.parametrize("line", FLOOD_LINES)
async def test_a_flood_of_lines_costs_a_bounded_number_of_notes(line: bytes) -> None:
    """200,000 lines that are not frames around the episode's own: every frame is seen, in
    order; MAX_NOTED lines are noted, scrubbed, and the rest counted in one note at EOF."""
    notes: list[str] = []
    frames = flood_frames(notes)
    flood = (line + b"\n") * 100_000
    data = HELLO_LINE + flood + frame_line("result", reward=0.5) + flood + DONE_LINE
    await feed_in_reads(frames, data)
    assert frames.hello is not None
    assert frames.final == Result(t="result", nonce=NONCE, reward=0.5)
    assert frames.done is not None
    assert frames.violations == []
    shown = [n for n in notes if n.startswith("ignored stdout line")]
    assert len(shown) == MAX_NOTED
    assert (
        notes[-1] == f"{200_000 - MAX_NOTED} more stdout lines ignored (not frames of this episode)"
    )
    assert len(notes) == MAX_NOTED + 2  # and the one that says the rest are counted
    assert FLOOD_KEY[:12] not in "".join(notes)
    if FLOOD_KEY.encode() in line:
        assert MASK.decode() in shown[0]


@pytest.mark.anyio
async def test_a_flood_of_violations_costs_a_bounded_number_of_notes() -> None:
    """Frames of the episode that break the protocol, 100,000 of them: the first MAX_NOTED
    are kept and noted, the rest counted; the verdict judges by the first."""
    notes: list[str] = []
    frames = flood_frames(notes)
    bad = frame_line("result", reward="not a number")
    await feed_in_reads(frames, HELLO_LINE + bad * 100_000 + DONE_LINE)
    assert len(frames.violations) == MAX_NOTED
    assert frames.violations[0].startswith("malformed 'result' frame")
    assert notes[-1] == f"{100_000 - MAX_NOTED} more protocol violations"
    assert len(notes) == MAX_NOTED + 1
    assert frames.done is not None


@pytest.mark.anyio
async def test_reading_a_flood_yields_to_the_event_loop() -> None:
    """Reads of 64 KiB of tiny lines give other tasks turns while they are read."""
    frames = flood_frames([])
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            await anyio.lowlevel.checkpoint()
            turns += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await anyio.lowlevel.checkpoint()
        before = turns
        for _ in range(16):
            await frames.feed(b"{}\n" * (64 * 1024 // 3))
        assert turns > before + 16  # more than one per read: turns within them
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_read_is_read_whole_under_cancellation() -> None:
    """A chunk read from the child is read to its end even when the reader is cancelled
    meanwhile: the frame after a flood in the same read is not lost."""
    frames = flood_frames([])
    chunk = HELLO_LINE + b"x\n" * 30_000 + frame_line("result", reward=1.0)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await frames.feed(chunk)
    assert frames.final is not None
    assert frames.final.t == "result"
