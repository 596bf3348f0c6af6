"""A hostile child, end to end. The parent's promise: whatever bytes the child writes on its
stdout and stderr, in whatever pieces, and however it ends, the run returns an
:class:`EpisodeOutcome` (it raises only for invalid arguments), its memory stays bounded, and
no process of the episode is left. The fakes are those of ``test_protocol``: they read the
handshake and learn the nonce, then do what a body says."""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import isolate

from . import _internals
from .conftest import SLOW, episode_processes, live_children
from .test_protocol import Fake, fake_spec, write_fake

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024
REPO = Path(__file__).resolve().parents[1]
#: Where a drawn stream holds the episode's nonce: only the fake knows it, and puts it there.
NONCE = b"@NONCE@"


def check_promise(outcome: Any) -> None:
    """What holds for every outcome, whatever the child did."""
    assert isinstance(outcome, isolate.EpisodeOutcome), type(outcome)
    assert outcome.status in isolate.STATUSES
    assert (outcome.error is None) == (outcome.status == "ok"), outcome.error
    try:
        outcome.summary().encode("utf-8")
    except UnicodeEncodeError as exc:
        pytest.fail(f"the summary is not UTF-8: {exc}")
    outcome.model_dump_json()
    if outcome.status == "protocol_error":
        message = outcome.error.message
        assert "\n" not in message, f"a multi-line protocol error: {message[:300]!r}"
        assert len(message) <= 1000, f"a protocol error of {len(message)} chars"
    assert outcome.log_path is not None
    try:
        outcome.log_path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        pytest.fail(f"the log is not UTF-8: {exc}")
    tag = f"\0{isolate.EPISODE_ENV}={outcome.episode_id}\0".encode()
    assert episode_processes(tag) == []
    assert live_children() == []


async def run_fake(tmp_path: Path, fake: Fake, *or_status: str) -> Any:
    """Run ``fake``: the promise holds, and the status is the fake's (or one of ``or_status``)."""
    spec = fake_spec(tmp_path, **fake.spec)
    outcome = await _internals.run_with_shim(spec, {"instance_id": "h"}, write_fake(tmp_path, fake))
    check_promise(outcome)
    print(outcome.summary())
    assert outcome.status in (fake.status, *or_status), outcome.summary()
    return outcome


def deep(n: int, shape: str) -> bytes:
    """JSON nested ``n`` levels deep (``open``: never closed)."""
    if shape == "list":
        return b"[" * n + b"]" * n
    if shape == "dict":
        return b'{"a":' * n + b"0" + b"}" * n
    return b"[" * n  # never closed


# --- specific hostile frames ------------------------------------------------------------------


@pytest.mark.parametrize("depth", [500, 100_000])
@pytest.mark.parametrize("shape", ["list", "dict"])
async def test_a_deeply_nested_info(tmp_path: Path, depth: int, shape: str) -> None:
    body = f"DEEP = {deep(depth, shape)!r}\n" + (
        "hello()\n"
        "result_frame = frame('result', reward=1.0, info=None)\n"
        "raw(result_frame.replace(b'\"info\": null', b'\"info\": ' + DEEP))\n"
        "done()\n"
    )
    await run_fake(tmp_path, Fake(body, "ok"), "protocol_error")


async def test_an_error_message_that_is_a_lone_surrogate(tmp_path: Path) -> None:
    body = r"""
    hello()
    error = frame("error", kind="agent", type="ValueError", message="@", traceback="")
    raw(error.replace(b'"@"', b'"\\ud800"'))
    done(1)
    """
    outcome = await run_fake(tmp_path, Fake(body, "agent_error"))
    assert outcome.error.type == "ValueError"


async def test_a_whole_result_frame_at_eof_without_its_newline(tmp_path: Path) -> None:
    body = 'hello(); raw(frame("result", reward=0.625, info={"k": "v"})[:-1])'
    outcome = await run_fake(tmp_path, Fake(body, "ok"))
    assert outcome.reward == 0.625


async def test_eof_in_the_middle_of_a_result_frame(tmp_path: Path) -> None:
    body = """
    hello()
    half = frame("result", reward=1.0, info={"k": "v" * 50})
    raw(half[: len(half) // 2])
    """
    outcome = await run_fake(tmp_path, Fake(body, "protocol_error"))
    assert re.search(r"(?i)incomplete", outcome.error.message), outcome.error.message


async def test_a_character_split_across_stderr_writes_stays_whole_in_the_log(
    tmp_path: Path,
) -> None:
    # Found by the fuzz: the parent's own note on a noise line lands between the two halves of
    # "é" (C3 A9) on the agent's stderr, and the log is no longer UTF-8.
    body = """
    hello()
    def err(data):
        sys.stderr.buffer.write(data)
        sys.stderr.buffer.flush()
        time.sleep(0.1)
    err(b"caf\\xc3")
    raw(b"noise on stdout\\n")
    time.sleep(0.1)
    err(b"\\xa9\\n")
    result(1.0)
    done()
    """
    outcome = await run_fake(tmp_path, Fake(body, "ok"))
    log = outcome.log_path.read_text(encoding="utf-8")  # not a byte of it cut in two
    # The character waits for its second half: isolate's note comes before it, never inside.
    assert "caf[isolate] ignored stdout line (not JSON): 'noise on stdout'\né\n" in log


# --- a 16 MiB frame: the parent's own memory ----------------------------------------------------

FRAME_BYTES = 16 * MiB  # the line, without its newline: max_frame_bytes' default exactly
BIG_BODY = """
hello()
nonce = N if OURS else "f" * 32  # not ours: noise, to be ignored
head = b'{"t": "result", "nonce": "' + nonce.encode() + b'", "reward": 1.0, "info": ['
tail = b"]}"
room = SIZE - len(head) - len(tail)
items = b",".join([ITEM] * ((room + 1) // (len(ITEM) + 1)))
raw(head + items + b" " * (room - len(items)) + tail + b"\\n")
del items
if not OURS:
    result(1.0)
done()
"""
ITEMS = {"tiny dicts": b"{}", "long strings": b'"' + b"x" * 1000 + b'"', "floats": b"1.5"}

# The parent in a process of its own, so that its peak is the parent's alone (KiB). Its
# ru_maxrss is printed, but it starts at the peak of the process that spawned it (the kernel
# carries the hiwater mark of the vforked mm across exec: pytest's, 87 MiB and more), which
# hides as much growth; the figure asserted on is the process's own peak, VmHWM, reset to the
# present before the run (clear_refs 5).
PARENT = """
import json, resource, sys
from pathlib import Path
import anyio
from tests import _internals
from tests.test_protocol import fake_spec

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

def maxrss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

tmp, shim = Path(sys.argv[1]), Path(sys.argv[2])
spec = fake_spec(tmp)
anyio.run(anyio.sleep, 0)  # the event loop's own imports are not the episode's
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
except OSError:
    base = status("VmHWM")  # no reset: a bound that can hide the gap up to the peak so far
before = maxrss()
outcome = anyio.run(_internals.run_with_shim, spec, {"instance_id": "big"}, shim)
report = {"before": before, "after": maxrss(), "base": base, "peak": status("VmHWM")}
report["status"] = outcome.status
report["message"] = outcome.error.message if outcome.error is not None else None
print(json.dumps(dict(report, log=str(outcome.log_path), summary=outcome.summary())))
"""


@pytest.mark.parametrize("ours", [True, False], ids=["our nonce", "noise"])
@pytest.mark.parametrize("item", list(ITEMS))
def test_a_16_mib_frame_costs_the_parent_at_most_4x(tmp_path: Path, item: str, ours: bool) -> None:
    prefix = f"ITEM = {ITEMS[item]!r}\nOURS = {ours}\nSIZE = {FRAME_BYTES}\n"
    shim = write_fake(tmp_path, Fake(prefix + BIG_BODY, "protocol_error" if ours else "ok"))
    done = subprocess.run(
        [sys.executable, "-c", PARENT, str(tmp_path), str(shim)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100 * SLOW,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    growth = report["peak"] - report["base"]
    print(
        f"16 MiB frame of {item} ({'our nonce' if ours else 'noise'}): the parent's "
        f"ru_maxrss before {report['before']} KiB, after {report['after']} KiB; own RSS "
        f"{report['base']} KiB before, peak {report['peak']} KiB: growth {growth / 1024:.1f} MiB "
        f"(bound {4 * FRAME_BYTES // MiB} MiB); {report['summary']}"
    )
    problems = []
    if growth > 4 * FRAME_BYTES // 1024:
        problems.append(f"the parent grew by {growth / 1024:.0f} MiB")
    message = report["message"] or ""
    if ours:
        if report["status"] != "protocol_error":
            problems.append(f"status {report['status']}, not protocol_error")
        elif not re.search(r"(?i)info|limit|values", message):
            problems.append(f"the message names neither the info nor a limit: {message[:300]!r}")
    elif report["status"] not in ("ok", "protocol_error", "crashed"):
        problems.append(f"status {report['status']}")
    if report["status"] == "protocol_error" and ("\n" in message or len(message) > 1000):
        problems.append(f"not one short line: {message[:300]!r}")
    try:
        Path(report["log"]).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        problems.append(f"the log is not UTF-8: {exc}")
    assert not problems, problems


# --- the fuzz: drawn bytes, drawn pieces, a drawn end -------------------------------------------

# JSON texts as bytes, so that a frame can hold what no json.dumps writes: invalid UTF-8 in a
# string, numbers past every limit, nesting past the decoder's, an array never closed.
STRINGS = [
    b'""',
    b'"\\ud800"',  # a lone surrogate, as JSON's escape: valid JSON, not encodable as UTF-8
    b'"\\udfff"',
    b'"a\\ud83db"',
    b'"\xff\xfe"',  # invalid UTF-8 inside the string
    b'"\xed\xa0\x80"',  # a surrogate encoded as UTF-8
    b'"\xc0\x80"',  # overlong
    b'"x\x80y"',
    b'"\\u0000"',
    b'"two\\nlines\\r\\n"',
    b'"' + b"m" * 5000 + b'"',
    b'"[secret]"',
    b'"exited"',
    b'"agent"',
]
SCALARS = [
    b"null",
    b"true",
    b"false",
    b"0",
    b"-1",
    b"-0.0",
    b"1.5",
    b"1e999",
    b"-1e999",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"1" + b"0" * 400,
    b"1" + b"0" * 5000,  # past Python's 4300-digit limit on int()
    b"1.0e",  # not JSON
]


def json_text(value: Any) -> bytes:
    return json.dumps(value).encode()


strings = st.sampled_from(STRINGS) | st.text(max_size=12).map(json_text)
scalars = (
    st.sampled_from(SCALARS)
    | strings
    | st.integers().map(json_text)
    | st.floats().map(json_text)
    | st.tuples(st.integers(1, 3000), st.sampled_from(["list", "dict", "open"])).map(
        lambda a: deep(*a)
    )
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4).map(lambda xs: b"[" + b",".join(xs) + b"]")
        | st.lists(st.tuples(strings, inner), max_size=4).map(
            lambda kv: b"{" + b",".join(k + b":" + v for k, v in kv) + b"}"
        )
    ),
    max_leaves=8,
)

# Values a mutated field takes: the nasty ones first, then anything.
nasty = st.one_of(
    st.sampled_from(SCALARS),
    st.sampled_from(STRINGS),
    st.tuples(st.integers(1, 3000), st.sampled_from(["list", "dict", "open"])).map(
        lambda a: deep(*a)
    ),
    values,
)

# Each frame type with valid fields. A drawn frame has one thing wrong (a field mutated,
# dropped, or one unknown field more), or many.
VALID: dict[str, dict[str, bytes]] = {
    "hello": {"protocol": b"1", "pid": b"4242", "python": b'"3.11"', "subreaper": b"false"},
    "result": {"reward": b"0.5", "info": b'{"k": [1, 2]}'},
    "error": {"kind": b'"agent"', "type": b'"ValueError"', "message": b'"m"', "traceback": b'""'},
    "progress": {"step": b"1"},
    "cleanup": {"how": b'"finished"'},
    "sandbox": {"missing": b"[]"},
    "done": {"why": b'"exited"', "killed": b"0", "exit_code": b"0", "signal": b"null"},
}
OUR_NONCE = b'"' + NONCE + b'"'
other_nonces = st.sampled_from(
    [
        b'"' + NONCE + b' "',
        b'"' + NONCE + b'\\u0000"',
        b'"\\ud800"',
        b"null",
        b"[" + OUR_NONCE + b"]",
    ]
)
fates = st.sampled_from(["keep", "keep", "keep", "mutate", "drop"])


@st.composite
def frames(draw: st.DrawFn, types: tuple[str, ...] = tuple(VALID)) -> bytes:
    t = draw(st.sampled_from(types))
    fields = {b'"t"': json_text(t), b'"nonce"': OUR_NONCE}
    fields.update((json_text(name), value) for name, value in VALID[t].items())
    if draw(st.sampled_from(["one", "one", "many"])) == "one":
        name = draw(st.sampled_from([*fields, b""]))
        if not name:
            fields[draw(strings)] = draw(nasty)  # unknown
        elif draw(st.integers(0, 3)) == 0:
            del fields[name]
        else:
            fields[name] = draw((other_nonces | nasty) if name == b'"nonce"' else nasty)
    else:
        for name in list(fields):
            fate = draw(fates)
            if fate == "drop":
                del fields[name]
            elif fate == "mutate":
                fields[name] = draw((other_nonces | nasty) if name == b'"nonce"' else nasty)
        fields.update(draw(st.lists(st.tuples(strings, nasty), max_size=2)))
    items = list(fields.items())
    if draw(st.booleans()):
        items = draw(st.permutations(items))
    return b"{" + b",".join(k + b":" + v for k, v in items) + b"}"


def line(t: str) -> bytes:
    items = [b'"t":' + json_text(t), b'"nonce":' + OUR_NONCE]
    items += [json_text(name) + b":" + value for name, value in VALID[t].items()]
    return b"{" + b",".join(items) + b"}\n"


WELL_FORMED = [line("hello"), line("result"), line("error"), line("progress"), line("done")]
OTHER_EPISODE = b'"' + b"f" * 32 + b'"'
pieces = st.one_of(
    frames().map(lambda f: f + b"\n"),  # most break the protocol
    frames().map(lambda f: f.replace(OUR_NONCE, OTHER_EPISODE) + b"\n"),  # noise
    st.sampled_from(WELL_FORMED),
    st.binary(max_size=64),
    st.just(b"\n"),
)
often = st.sampled_from([True, True, True, False])
# What an agent controls in a final frame, with the fields a hostile one fills.
PAYLOAD = {"result": ("reward", "info", "reward_repr"), "error": ("type", "message", "traceback")}
payload_values = st.one_of(
    st.sampled_from(STRINGS),
    st.tuples(st.integers(1, 3000), st.sampled_from(["list", "dict"])).map(lambda a: deep(*a)),
    nasty,
)


@st.composite
def final_frames(draw: st.DrawFn) -> bytes:
    """A result or error frame, well-formed but for what the agent put in it."""
    t = draw(st.sampled_from(sorted(PAYLOAD)))
    fields = {"t": json_text(t), "nonce": OUR_NONCE, **VALID[t]}
    hostile = draw(st.sampled_from([*PAYLOAD[t], "all"]))
    for name in PAYLOAD[t]:
        if hostile in (name, "all"):
            fields[name] = draw(payload_values)
    return b"{" + b",".join(json_text(k) + b":" + v for k, v in fields.items()) + b"}"


@st.composite
def stdout_streams(draw: st.DrawFn) -> bytes:
    """Mostly the shape of an episode (hello, a final frame, done) with noise and broken frames
    between, and an end: a newline, a frame without one, or a frame cut short."""
    parts = [line("hello")] if draw(often) else []
    parts += draw(st.lists(pieces, max_size=3))
    if draw(often):
        final = final_frames() if draw(often) else frames(tuple(PAYLOAD))
        parts.append(draw(final) + b"\n")
    parts += draw(st.lists(pieces, max_size=2))
    if draw(st.booleans()):
        parts.append(line("done"))
    data = b"".join(parts)
    end = draw(st.sampled_from(["newline", "frame without newline", "frame cut short"]))
    if end != "newline":
        last = draw(final_frames() | frames() | st.sampled_from(WELL_FORMED).map(lambda f: f[:-1]))
        if end == "frame cut short":
            last = last[: draw(st.integers(1, max(1, len(last) - 1)))]
        data += last
    return data


SIGNALS = [signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM, signal.SIGABRT]
# stderr is the agent's own: UTF-8 text (its characters cut anywhere by the writes), or any
# bytes at all. Text is what UTF-8 can encode: no lone surrogates.
STDERR = {
    "text on stderr": st.text(
        st.sampled_from("a\né€😀") | st.characters(codec="utf-8"), max_size=200
    ).map(str.encode),
    "bytes on stderr": st.binary(min_size=1, max_size=300),
}


def plans(stderr: st.SearchStrategy[bytes]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "stdout": stdout_streams(),
            "stderr": stderr,
            # (stream, bytes, pause in ms) in turn; then whatever is left of both, at once
            "ops": st.lists(
                st.tuples(
                    st.sampled_from(["out", "out", "out", "err"]),
                    st.integers(1, 16) | st.integers(1, 4096),
                    st.sampled_from([0, 0, 0, 1, 2, 5]),
                ),
                max_size=24,
            ),
            "bytewise": st.sampled_from([False, False, False, True]),  # stdout one byte a write
            "end": st.sampled_from([("exit", c) for c in (0, 0, 1, 2, 255)])
            | st.sampled_from([("signal", int(s)) for s in SIGNALS]),
            "spec": st.fixed_dictionaries(
                {},
                optional={
                    "max_frame_bytes": st.sampled_from([1024, 4096]),
                    "max_info_bytes": st.sampled_from([0, 64, 4096]),
                },
            ),
        }
    )


FUZZ_BODY = """
import base64
with open(PLAN) as f:
    plan = json.load(f)
left = {
    "out": base64.b64decode(plan["stdout"]).replace(b"@NONCE@", N.encode()),
    "err": base64.b64decode(plan["stderr"]),
}
files = {"out": sys.stdout.buffer, "err": sys.stderr.buffer}

def put(name, size):
    files[name].write(left[name][:size])
    files[name].flush()
    left[name] = left[name][size:]

while plan["bytewise"] and left["out"]:
    put("out", 1)
for name, size, pause in plan["ops"]:
    put(name, size)
    if pause:
        time.sleep(pause / 1000)
put("out", len(left["out"]))
put("err", len(left["err"]))
how, number = plan["end"]
if how == "signal":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), number)
os._exit(number)
"""

# Each example is a real process (30-50 ms). No shrinking: on a failure it would run hundreds
# more; hypothesis reports each distinct failure with the example as drawn. No database: the
# file tree stays as it was.
FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


@pytest.mark.parametrize("stderr", list(STDERR))
@FUZZ
@given(data=st.data())
def test_any_bytes_from_the_child_give_an_outcome(
    tmp_path: Path, stderr: str, data: st.DataObject
) -> None:
    plan = data.draw(plans(STDERR[stderr]), label="plan")
    path = tmp_path / "plan.json"
    stored = dict(plan, stdout=base64.b64encode(plan["stdout"]).decode())
    stored["stderr"] = base64.b64encode(plan["stderr"]).decode()
    path.write_text(json.dumps(stored))
    fake = Fake(f"PLAN = {str(path)!r}\n" + FUZZ_BODY, "any")  # any status: the promise
    spec = fake_spec(tmp_path, **plan["spec"])
    shim = write_fake(tmp_path, fake)
    outcome = anyio.run(_internals.run_with_shim, spec, {"instance_id": "fuzz"}, shim)
    check_promise(outcome)
