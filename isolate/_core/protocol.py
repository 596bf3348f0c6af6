"""The wire protocol between parent and shim (see docs/protocol.md).

One handshake line parent -> child on stdin; JSON frames child -> parent on stdout, one per
line, each carrying the per-episode nonce. Lines without that nonce are noise, not frames.
"""

from __future__ import annotations

import functools
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, ValidationError

from .redact import Redactor

PROTOCOL_VERSION = 1


class _Frame(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    nonce: str


class Hello(_Frame):
    """First frame: the shim's protocol version and what it could set up."""

    t: Literal["hello"]
    protocol: int
    pid: int
    python: str
    subreaper: bool
    containment: str | None = None
    """The level the shim is setting up (None: a shim that does not say)."""


class Result(_Frame):
    """The entrypoint returned. ``reward`` is None when its type was not a reward."""

    t: Literal["result"]
    reward: float | dict[str, float] | None
    reward_type: str | None = None
    reward_repr: str | None = None
    info: Any = None


class Error(_Frame):
    """The entrypoint raised (``agent``) or could not be loaded (``setup``)."""

    t: Literal["error"]
    kind: Literal["agent", "setup"]
    type: str
    message: str
    traceback: str = ""


class Progress(_Frame):
    """Optional, between hello and the final frame; carries nothing the parent acts on."""

    model_config = ConfigDict(extra="allow", frozen=True)
    t: Literal["progress"]


class Cleanup(_Frame):
    """After a cancel request: the worker exited within ``cancel_grace`` (``finished``), or
    the grace ran out (``cut short``). Sent before teardown goes on."""

    t: Literal["cleanup"]
    how: Literal["finished", "cut short"]


class Sandboxed(_Frame):
    """The worker entered the episode's sandbox, before importing the agent."""

    t: Literal["sandbox"]
    missing: list[str] = []
    """What it could not enforce (best_effort), one line each."""


class Done(_Frame):
    """Last frame: the worker's exit and how many leftovers the supervisor killed."""

    t: Literal["done"]
    why: Literal["exited", "deadline", "terminated", "cancelled"]
    killed: int = Field(ge=0)
    exit_code: int | None
    signal: int | None
    cpu_s: float | None = None
    """CPU seconds the worker used (user + system)."""


Frame = Annotated[
    Hello | Result | Error | Progress | Cleanup | Sandboxed | Done, Field(discriminator="t")
]
_FRAME: TypeAdapter[Frame] = TypeAdapter(Frame)


@dataclass(frozen=True)
class Noise:
    """A stdout line that is not a frame of this episode; logged and otherwise ignored."""

    reason: str
    preview: bytes


@dataclass(frozen=True)
class Violation:
    """Something on stdout that breaks the protocol (a malformed frame with our nonce)."""

    message: str


def parse_line(line: bytes, nonce: str, redact: Redactor) -> Frame | Noise | Violation:
    """Classify one stdout line (without its newline).

    This is where everything on the child's stdout enters the parent, so it is also where it
    is scrubbed: a frame is built from the scrubbed JSON object (keys, values, fields that do
    not exist yet), and a noise preview or a violation's text only ever quotes scrubbed data.
    """
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested arrays
        return Noise("not JSON", _preview(line, redact))
    if not isinstance(obj, dict):
        return Noise("not a JSON object", _preview(line, redact))
    their = obj.get("nonce")
    if not isinstance(their, str) or not hmac.compare_digest(
        their.encode("utf-8", "surrogatepass"), nonce.encode()
    ):
        return Noise("no nonce of this episode", _preview(line, redact))
    obj = _scrub(obj, redact)
    try:
        return _FRAME.validate_python(obj)
    except ValidationError as exc:
        # pydantic's text quotes the input, its location names dict keys: both are scrubbed.
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return Violation(f"malformed {obj.get('t')!r} frame: {where}: {first['msg']}")


def _scrub(obj: dict[str, Any], redact: Redactor) -> dict[str, Any]:
    """The frame object with every string scrubbed but the protocol's own words (field names,
    frame types, ``why``...), so a short secret cannot turn ``killed`` into ``[secret]illed``.
    After the nonce check: a secret may be a substring of the nonce."""
    return {
        key if key in _words() else redact.text(key): (
            value if isinstance(value, str) and value in _words() else redact.json(value)
        )
        for key, value in obj.items()
    }


@functools.cache
def _words() -> frozenset[str]:
    """Every frame field name and every value a Literal field of a frame can take."""
    words: set[str] = set()
    for model in get_args(get_args(Frame)[0]):
        for name, field in model.model_fields.items():
            words.add(name)
            if get_origin(field.annotation) is Literal:
                words.update(get_args(field.annotation))
    return frozenset(words)


def _preview(line: bytes, redact: Redactor) -> bytes:
    """The start of a line for the log, scrubbed whole first (a cut could halve a secret)."""
    return redact.scrub(line)[:200]


class LineSplitter:
    """Split a byte stream into lines of at most ``max_bytes``; longer lines are reported."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._buf = bytearray()
        self._oversize = 0  # bytes of the current over-long line seen so far; 0 when none

    def feed(self, chunk: bytes) -> list[bytes | int]:
        """Return complete lines, and for each over-long line its size in bytes (an int)."""
        out: list[bytes | int] = []
        start = 0
        while True:
            newline = chunk.find(b"\n", start)
            piece = chunk[start:] if newline < 0 else chunk[start:newline]
            if self._oversize:
                self._oversize += len(piece)
            elif len(self._buf) + len(piece) > self._max:
                self._oversize = len(self._buf) + len(piece)
                self._buf.clear()
            else:
                self._buf += piece
            if newline < 0:
                return out
            if self._oversize:
                out.append(self._oversize)
                self._oversize = 0
            else:
                out.append(bytes(self._buf))
                self._buf.clear()
            start = newline + 1

    def rest(self) -> bytes | int | None:
        """What is left after EOF: an unterminated line, its size if over-long, or None."""
        if self._oversize:
            return self._oversize
        return bytes(self._buf) if self._buf else None


#: What the parent writes on the shim's stdin, after the handshake, to cancel the agent.
CANCEL = b"cancel\n"


def encode_handshake(
    public: Mapping[str, Any],
    secrets: Mapping[str, SecretStr],
    secret_env: Mapping[str, SecretStr] | None = None,
) -> bytes:
    """The handshake line. ``public`` must already be known to be JSON-serialisable."""
    head = json.dumps(dict(public), allow_nan=False, separators=(",", ":"))
    values = {name: value.get_secret_value() for name, value in secrets.items()}
    tail = json.dumps(values, separators=(",", ":"))
    extra = ""
    if secret_env:  # absent when empty: the handshake of an episode without it is unchanged
        env = {name: value.get_secret_value() for name, value in secret_env.items()}
        extra = ',"secret_env":' + json.dumps(env, separators=(",", ":"))
    return f'{head[:-1]},"secrets":{tail}{extra}}}\n'.encode()
