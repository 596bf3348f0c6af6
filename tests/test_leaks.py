"""Every path back from the child is scrubbed. The cases are generated: the episode's keys go
into every field of every frame type the protocol has (read from its own models, so a new
frame or field is covered without editing this file), into every shape of reward and info,
into exception type names and into the agent's output; none of it may show in what isolate
keeps: repr, str, JSON, summary, exception, tail or log."""

from __future__ import annotations

import json
import secrets as _secrets
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import anyio
import pytest
from pydantic import BaseModel

import isolate

from . import _internals
from .conftest import Agents

pytestmark = pytest.mark.anyio

# Two keys: one ASCII, one that JSON escapes (the raw line then holds "\u00fc", not the key).
# The agent gets the first as a keyword argument (secrets), the second as WIDE in its
# os.environ (secret_env): both ways back must be scrubbed.
KEYS = {"key": "sk-leak-" + _secrets.token_hex(12), "wide": "sk-wïdé-" + _secrets.token_hex(12)}
#: A window of this many characters of a key is a leak too: a cut must not keep half a key.
WINDOW = 10

SECRETS_BOTH_WAYS: dict[str, Any] = {
    "secrets": {"key": KEYS["key"]},
    "secret_env": {"WIDE": KEYS["wide"]},
}

FRAME_MODELS: tuple[type[BaseModel], ...] = get_args(get_args(_internals.Frame)[0])


def windows(key: str) -> set[str]:
    return {key[i : i + WINDOW] for i in range(len(key) - WINDOW + 1)}


def kept_texts(outcome: isolate.EpisodeOutcome) -> dict[str, str]:
    """Everything isolate keeps of an episode, as text."""
    texts = {
        "repr": repr(outcome),
        "str": str(outcome),
        "model_dump_json": outcome.model_dump_json(),
        "summary": outcome.summary(),
        "stderr_tail": outcome.stderr_tail,
        "error": repr(outcome.error) + (outcome.error.traceback if outcome.error else ""),
    }
    if outcome.status != "ok":
        try:
            outcome.raise_for_status()
        except isolate.EpisodeError as exc:
            texts["exception"] = f"{exc!s} {exc!r}"
    if outcome.log_path is not None:
        texts["log"] = outcome.log_path.read_bytes().decode("utf-8", "backslashreplace")
    return texts


def leaks(outcome: isolate.EpisodeOutcome) -> list[str]:
    """Where a key, or a window of one, shows."""
    return [
        f"{where}: {piece!r}"
        for where, text in kept_texts(outcome).items()
        for key in KEYS.values()
        for piece in windows(key)
        if piece in text
    ]


# --- frames: every field of every frame type ----------------------------------------------------


def example(annotation: Any) -> Any:
    """A valid value of a field's type, for the frames around the one under test."""
    origin = get_origin(annotation)
    if origin is Literal:
        return get_args(annotation)[0]
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        return None if type(None) in args else example(args[0])
    if origin is dict:
        return {}
    known = {int: 0, float: 0.0, bool: False, str: "x"}
    if annotation is Any:
        return None
    if annotation in known:
        return known[annotation]
    raise AssertionError(f"no example value for {annotation!r}: teach test_leaks.example")


def base_frame(model: type[BaseModel]) -> dict[str, Any]:
    """A valid frame of ``model``: the required fields with example values."""
    frame = {
        name: example(field.annotation)
        for name, field in model.model_fields.items()
        if field.is_required()
    }
    frame["nonce"] = "@NONCE@"
    if model is _internals.Hello:
        frame["protocol"] = isolate.PROTOCOL_VERSION
    return frame


# Every key, in every shape a JSON value can carry it. The fake shim fills the placeholders in
# from the handshake's secrets: the keys reach it the way they reach a real agent.
SHAPES: dict[str, Any] = {
    "text": "said @key@ and @wide@",
    "mapping keys": {"@key@": 1.0, "@wide@": 2.0},
    "nested": [{"k": "@key@", "@wide@": ["@key@", {"@key@": None, "n": {"@wide@": "@wide@"}}]}],
}
EXTRA = "a_field_no_frame_has"

FIELD_CASES = [
    pytest.param(model, name, id=f"{model.__name__}.{name}")
    for model in FRAME_MODELS
    for name in [*model.model_fields, EXTRA]
]

FAKE_SHIM = """\
import json, sys
hs = json.loads(sys.stdin.buffer.readline())
swap = dict(hs["secrets"], wide=hs["secret_env"]["WIDE"], NONCE=hs["nonce"])

def fill(value):
    if isinstance(value, str):
        for name, real in swap.items():
            value = value.replace("@%s@" % name, real)
        return value
    if isinstance(value, list):
        return [fill(v) for v in value]
    if isinstance(value, dict):
        return {fill(k): fill(v) for k, v in value.items()}
    return value

sys.stderr.write(fill(hs["data"]["stderr"]))
# Said before the frames: once the parent reads a frame that breaks the protocol it may end
# this process at once, and a line written after them would race that.
sys.stderr.write("fake shim: sending every frame\\n")
sys.stderr.flush()
for frame in hs["data"]["frames"]:
    sys.stdout.write(json.dumps(fill(frame)) + "\\n")  # ensure_ascii: "wide" goes escaped
sys.stdout.flush()
"""


def frames_with(model: type[BaseModel], field: str, value: Any) -> list[dict[str, Any]]:
    """hello (unless it is the frame under test), the frame with ``value`` in ``field``, done."""
    frame = dict(base_frame(model), **{field: value})
    before = [] if model is _internals.Hello else [base_frame(_internals.Hello)]
    after = [] if model is _internals.Done else [base_frame(_internals.Done)]
    return [*before, frame, *after]


async def run_fake(tmp_path: Path, data: dict[str, Any], name: str) -> isolate.EpisodeOutcome:
    shim = tmp_path / "fake_shim.py"
    if not shim.exists():
        shim.write_text(FAKE_SHIM)
    spec = isolate.EpisodeSpec(
        entrypoint="fake:run", timeout=20.0, kill_grace=0.5, log_dir=tmp_path / "logs"
    )
    return await _internals.run_with_shim(spec, data, shim, episode_id=name, **SECRETS_BOTH_WAYS)


def test_the_generator_knows_every_frame_type() -> None:
    # The control for the cases below: each base frame is valid, and every type has cases.
    assert {m.__name__ for m in FRAME_MODELS} >= {
        "Hello",
        "Result",
        "ErrorFrame",
        "Done",
        "Progress",
    }
    for model in FRAME_MODELS:
        item = _internals.parse_line(
            _json_line(dict(base_frame(model), nonce="n")),
            "n",
            _internals.Redactor(list(KEYS.values())),
        )
        assert isinstance(item, model), item


def _json_line(obj: Any) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize(("model", "field"), FIELD_CASES)
async def test_a_key_in_any_frame_field_never_shows(
    tmp_path: Path, model: type[BaseModel], field: str
) -> None:
    outcomes: dict[str, isolate.EpisodeOutcome] = {}

    async def one(shape: str, value: Any) -> None:
        data = {"frames": frames_with(model, field, value), "stderr": ""}
        outcomes[shape] = await run_fake(tmp_path, data, shape.replace(" ", "_"))

    async with anyio.create_task_group() as tg:
        for shape, value in SHAPES.items():
            tg.start_soon(one, shape, value)
    for shape, outcome in outcomes.items():
        assert "fake shim: sending every frame" in outcome.stderr_tail, (shape, outcome.summary())
        assert leaks(outcome) == [], (shape, outcome.summary())
    assert len(outcomes) == len(SHAPES)


@pytest.mark.parametrize(
    "frames",
    [[], [base_frame(_internals.Hello)]],
    ids=["before hello", "after hello"],
)
async def test_a_key_on_stderr_of_a_fake_shim_never_shows(
    tmp_path: Path, frames: list[dict[str, Any]]
) -> None:
    # Without a hello, the last stderr line goes into the setup error's message.
    data = {"frames": frames, "stderr": "one @key@\nlast line: @wide@ @key@"}
    outcome = await run_fake(tmp_path, data, "stderr")
    assert outcome.status == ("setup_error" if not frames else "protocol_error")
    assert "last line: [secret] [secret]" in outcome.stderr_tail
    assert leaks(outcome) == []


async def test_a_key_in_a_stdout_line_that_is_no_frame_never_shows(tmp_path: Path) -> None:
    noise = {"t": "result", "nonce": "not this episode's", "reward": "@key@ @wide@"}
    data = {"frames": [base_frame(_internals.Hello), noise], "stderr": ""}
    outcome = await run_fake(tmp_path, data, "noise")
    assert outcome.log_path is not None
    assert "ignored stdout line" in outcome.log_path.read_text()
    assert leaks(outcome) == []


# --- the real shim: every shape of reward, info and exception -----------------------------------

RETURNS = {
    "reward and the key as info": "return 1.0, key",
    "info keyed by the key": "return 1.0, {key: key, wide: [wide]}",
    "info nested, with a tuple, a set and bytes": (
        "return 1.0, {'a': [{'b': (key, {wide}), key: [key.encode()], 'n': {wide: {key: 1}}}]}"
    ),
    "info an object whose repr is the key": (
        "return 1.0, {'o': type('R', (), {'__repr__': lambda self: key})()}"
    ),
    "reward mapping keyed by the key": "return {key: 1.0, wide: 0.5}",
    "reward mapping and info": "return {key: 1.0, 'c2': 0.5}, {key: [wide]}",
    "reward of a wrong type": "return key",
    "reward mapping with a wrong value": "return {key: wide}",
    "reward a pair of keys": "return (key, wide)",
    "reward NaN and the key as info": "return float('nan'), {key: wide}",
    "reward repr cut through the key": "return 'x' * 185 + key",
    "info preview cut through the key": "return 1.0, 'x' * 4085 + key + 'y' * 5000",
    "info preview cut through the env key": "return 1.0, 'x' * 4060 + wide + 'y' * 5000",
    "info over 256 KiB, parsed off the loop": "return 1.0, {'pad': 'x' * 300_000, key: wide}",
}
RAISES = {
    "a message with the key": "raise ValueError('bad key ' + key + ' ' + wide)",
    "an exception type named after the key": "raise type(key, (Exception,), {})(wide)",
    "a module and qualname of the key": (
        "raise type('E', (Exception,), {'__qualname__': key, '__module__': wide})(key)"
    ),
    "a cause that quotes the key": (
        "try:\n        raise KeyError(key)\n    except KeyError as e:\n"
        "        raise RuntimeError(wide) from e"
    ),
    "a note with the key": "e = ValueError('x')\n    e.add_note(key + wide)\n    raise e",
    "SystemExit with the key": "raise SystemExit(key)",
    "KeyboardInterrupt with the key": "raise KeyboardInterrupt(wide)",
}
PRINTS = {
    "print": "print('key', key, wide)\n    return 1.0",
    "stderr": "import sys\n    sys.stderr.write(key * 3 + wide)\n    return 1.0",
    "a subprocess's stdout": (
        "import subprocess\n    subprocess.run(['echo', key, wide], check=True)\n    return 1.0"
    ),
    "stderr, then a crash": (
        "import os, sys\n    sys.stderr.write(wide + key)\n    sys.stderr.flush()\n    os._exit(3)"
    ),
}
AGENT_CASES = {**RETURNS, **RAISES, **PRINTS}


@pytest.mark.parametrize("body", list(AGENT_CASES.values()), ids=list(AGENT_CASES))
async def test_a_key_in_what_an_agent_returns_raises_or_prints_never_shows(
    agents: Agents, body: str
) -> None:
    code = f"import os\ndef run(data, *, key):\n    wide = os.environ['WIDE']\n    {body}\n"
    big = "300_000" in body  # a frame over 256 KiB: parsed in a worker thread
    spec = agents.spec(code, max_info_bytes=400_000 if big else 4096)
    outcome = await isolate.run_episode(spec, {}, **SECRETS_BOTH_WAYS)
    # The control: the agent did run, and what it sent came back (scrubbed).
    assert outcome.status != "setup_error", outcome.summary()
    assert leaks(outcome) == [], outcome.summary()
    if big:  # the info came back whole, not cut to a preview, with the keys masked
        assert outcome.info == {"pad": "x" * 300_000, "[secret]": "[secret]"}, outcome.summary()


# --- the check itself can fail ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [
        (_internals.Result, "reward", {"@key@": 1.0}),  # the reward mapping's keys
        (_internals.Result, "t", "@key@"),  # the protocol-violation text
    ],
    ids=["reward mapping key", "violation text"],
)
async def test_the_check_finds_a_key_when_scrubbing_is_off(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: type[BaseModel],
    field: str,
    value: Any,
) -> None:
    # As the code was before the scrubbing moved into parse_line: frames kept as sent.
    monkeypatch.setattr(_internals.protocol, "_clean_json", lambda value, redact: value)
    data = {"frames": frames_with(model, field, value), "stderr": ""}
    outcome = await run_fake(tmp_path, data, "unscrubbed")
    found = leaks(outcome)
    assert any(where.startswith("model_dump_json") for where in found), found
    assert any(where.startswith("log") for where in found), found
