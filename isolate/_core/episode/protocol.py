"""The wire protocol between parent and shim (see docs/protocol.md).

One handshake line parent -> child on stdin; JSON frames child -> parent on stdout, one per
line, each carrying the per-episode nonce. Lines without that nonce are noise, not frames.
"""

from __future__ import annotations

import functools
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from agent_shim.shim_wire import MAX_MESSAGE_CHARS, MAX_TRACEBACK_CHARS

from .redact import Redactor

#: JSON nesting a frame may have: an agent's info is a trajectory of messages, some levels deep;
#: a hostile one could nest until the parent's recursion limit (in pydantic, or in json).
MAX_DEPTH = 64
#: JSON values a frame may hold beyond those of its info (a reward per completion, ...).
_SPARE_VALUES = 1 << 16
#: Room above ``max_info_bytes`` for the shim's own summary of an info it had to cut (bytes).
_INFO_SLACK = 8 * 1024
#: What a frame may hold besides its info (bytes): an error's message and traceback, which the
#: shim cuts to MAX_MESSAGE_CHARS and MAX_TRACEBACK_CHARS (up to 12 bytes a character once
#: JSON-escaped), a reward per completion. A longer line is refused before it is buffered.
FRAME_ROOM = 8 * 1024 * 1024


class _Frame(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    nonce: str


class Hello(_Frame):
    """First frame: the shim's protocol version and what it could set up."""

    t: Literal["hello"]
    protocol: int
    pid: int
    python: str = Field(max_length=100)
    subreaper: bool
    containment: str | None = Field(default=None, max_length=100)
    """The level the shim is setting up (None: a shim that does not say)."""


class Result(_Frame):
    """The entrypoint returned. ``reward`` is None when its type was not a reward."""

    t: Literal["result"]
    reward: float | dict[str, float] | None
    reward_type: str | None = Field(default=None, max_length=200)
    reward_repr: str | None = Field(default=None, max_length=2000)
    info: Any = None


class ErrorFrame(_Frame):
    """The entrypoint raised (``agent``) or could not be loaded (``setup``). A message or
    traceback longer than :data:`MAX_MESSAGE_CHARS` or :data:`MAX_TRACEBACK_CHARS` is cut,
    and says so; the log has the traceback whole."""

    t: Literal["error"]
    kind: Literal["agent", "setup"]
    type: str = Field(max_length=200)
    message: str
    traceback: str = ""
    at_call: bool = False
    """The call of the entrypoint itself raised (a ``TypeError`` from its arguments), before
    any of its code ran."""

    @field_validator("message")
    @classmethod
    def _cut_message(cls, value: str) -> str:
        if len(value) <= MAX_MESSAGE_CHARS:
            return value
        return f"{value[:MAX_MESSAGE_CHARS]} [... {len(value) - MAX_MESSAGE_CHARS} more characters]"

    @field_validator("traceback")
    @classmethod
    def _cut_traceback(cls, value: str) -> str:
        # Its end says where the error was raised: keep that.
        if len(value) <= MAX_TRACEBACK_CHARS:
            return value
        return (
            f"[{len(value) - MAX_TRACEBACK_CHARS} characters cut ...]\n"
            + value[-MAX_TRACEBACK_CHARS:]
        )


class Progress(_Frame):
    """Optional, between hello and the final frame; carries nothing the parent acts on."""

    model_config = ConfigDict(extra="allow", frozen=True)
    t: Literal["progress"]


class CleanupFrame(_Frame):
    """After a cancel request: the worker exited within ``cancel_grace`` (``finished``), or
    the grace ran out (``cut short``). Sent before teardown goes on."""

    t: Literal["cleanup"]
    how: Literal["finished", "cut short"]


class Sandboxed(_Frame):
    """The worker entered the episode's sandbox, before importing the agent."""

    t: Literal["sandbox"]
    missing: list[str] = Field(default=[], max_length=100)
    """What it could not enforce (best_effort), one line each."""


class Net(_Frame):
    """The worker is in its network namespace; the listeners the parent asked for come
    attached (SCM_RIGHTS), in the order asked."""

    t: Literal["net"]


class Done(_Frame):
    """Last frame: the worker's exit and how many leftovers the supervisor killed."""

    t: Literal["done"]
    why: Literal["exited", "deadline", "terminated", "cancelled"]
    killed: int = Field(ge=0, le=1 << 31)
    exit_code: int | None = Field(ge=0, le=255)
    signal: int | None = Field(ge=1, le=255)
    cpu_s: float | None = None
    """CPU seconds the worker used (user + system)."""


Frame = Annotated[
    Hello | Result | ErrorFrame | Progress | CleanupFrame | Sandboxed | Net | Done,
    Field(discriminator="t"),
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


_STRING = re.compile(rb'"[^"]*"')
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def frame_cap(max_frame_bytes: int, max_info_bytes: int) -> int:
    """The longest line the parent reads as a frame (bytes): ``max_frame_bytes``, or less
    where ``max_info_bytes`` leaves no room for more."""
    return min(max_frame_bytes, max_info_bytes + FRAME_ROOM)


def max_values(max_info_bytes: int) -> int:
    """JSON values a frame may hold: an info of ``max_info_bytes`` has at most one per two
    bytes (``[0,0,...]``), and the frame's other fields get :data:`_SPARE_VALUES`."""
    return max_info_bytes // 2 + _SPARE_VALUES


def shape(line: bytes, limit: int | None = None) -> tuple[int, int | None] | None:
    """How many JSON values ``line`` holds at most, and how deep it nests (capped at
    ``MAX_DEPTH + 1``; None when the values are over ``limit``, which says enough), counted on
    its bytes without building a single object; None where it cannot be JSON. The memory a
    parse would need follows from the first, so it is known before any is spent: a 16 MiB line
    of ``{}`` parses into 5.5 million dicts (~840 MB)."""
    # Escapes first (each keeps its length), so that every quote left delimits a string.
    text = line.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    quotes = text.count(b'"')
    if quotes % 2:
        return None
    if limit is not None and quotes // 2 > limit:
        return quotes // 2, None  # each string is a value: no need to look further
    bare = _STRING.sub(b"0", text)  # a string is one value, whatever it holds
    del text
    values = 1 + sum(bare.count(c) for c in (b",", b":", b"[", b"{"))
    brackets = bare.translate(_BRACKETS, _NOT_BRACKETS)
    del bare
    if 2 * brackets.count(b"[") != len(brackets):
        return None
    if limit is not None and values > limit:
        return values, None
    # Each pass removes the innermost pairs: as many passes as levels.
    too_deep = b"[" * (MAX_DEPTH + 1)
    for depth in range(MAX_DEPTH + 1):
        if not brackets:
            return values, depth
        if too_deep in brackets:
            break
        brackets = brackets.replace(b"[]", b"")
    return values, MAX_DEPTH + 1


def parse_line(
    line: bytes,
    nonce: str,
    redact: Redactor,
    max_info_bytes: int = 1 << 20,
    *,
    previews: bool = True,
) -> Frame | Noise | Violation:
    """Classify one stdout line (without its newline); never raises. ``previews=False``: a
    noise line comes with an empty preview, and is not scrubbed.

    Everything the child sends is hostile input: a line is measured before it is parsed
    (:func:`shape`), a frame's ``info`` must fit ``max_info_bytes`` (the shim's own cap), and
    any failure to digest a line is a violation with a one-line reason.

    This is where everything on the child's stdout enters the parent, so it is also where it
    is scrubbed: a frame is built from the scrubbed JSON object (keys, values, fields that do
    not exist yet), and a noise preview or a violation's text only ever quotes scrubbed data.
    """
    try:
        return _parse_line(line, nonce, redact, max_info_bytes, previews)
    except Exception as exc:  # MemoryError included: one frame must not end the caller
        return Violation(f"cannot read a frame of {len(line)} bytes: {type(exc).__name__}")


def _parse_line(
    line: bytes, nonce: str, redact: Redactor, max_info_bytes: int, previews: bool
) -> Frame | Noise | Violation:
    limit = max_values(max_info_bytes)
    measured = shape(line, limit)
    if measured is None:
        return Noise("not JSON", _preview(line, redact, previews))
    values, depth = measured
    if depth is None or depth > MAX_DEPTH:
        if nonce.encode() not in line:
            return Noise(
                "not a frame of this episode, too large to read", _preview(line, redact, previews)
            )
        if depth is not None:
            return Violation(f"a frame nested deeper than {MAX_DEPTH} levels")
        return Violation(
            f"a frame of {len(line)} bytes holds up to {values} JSON values, over the limit "
            f"of {limit} (max_info_bytes // 2 + {_SPARE_VALUES})"
        )
    # Plain: no escape that could spell a secret, or a lone surrogate, another way than the
    # redactor looks for; then a line without a secret parses into strings without one.
    plain = b"\\u" not in line and b"\\/" not in line
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        text, plain = None, False
    try:
        if text is None:
            text = line.decode("utf-8", "surrogatepass")  # as json.loads decodes bytes
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return Noise("not JSON", _preview(line, redact, previews))
    del text
    if not isinstance(obj, dict):
        return Noise("not a JSON object", _preview(line, redact, previews))
    their = obj.get("nonce")
    if not isinstance(their, str) or not hmac.compare_digest(
        their.encode("utf-8", "surrogatepass"), nonce.encode()
    ):
        return Noise("no nonce of this episode", _preview(line, redact, previews))
    if obj.get("info") is not None:
        # Measured as the shim measures it: the length of json.dumps' text.
        size = len(json.dumps(obj["info"]))
        if size > max_info_bytes + _INFO_SLACK:
            kind = _clean(str(obj.get("t")), redact)
            return Violation(
                one_line(
                    f"a {kind!r} frame's info of {size} bytes is over max_info_bytes "
                    f"({max_info_bytes})"
                )
            )
    if not plain or (redact and redact.scrub(line) != line):
        obj = _scrub(obj, redact)
    try:
        return _FRAME.validate_python(obj)
    except ValidationError as exc:
        # pydantic's text quotes the input, its location names dict keys: both are scrubbed.
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return Violation(one_line(f"malformed {obj.get('t')!r} frame: {where}: {first['msg']}"))


def one_line(text: str, limit: int = 300) -> str:
    """``text`` as one line of at most ``limit`` characters, ending in ``...`` where it was cut:
    control characters and lone surrogates escaped."""
    line = _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode(), text[:limit])
    return line if len(line) <= limit and len(text) <= limit else line[: limit - 3] + "..."


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


def _scrub(obj: dict[str, Any], redact: Redactor) -> dict[str, Any]:
    """The frame object with every string scrubbed and made valid Unicode (a lone surrogate,
    which JSON's ``\\ud800`` can carry, would make every later ``encode()`` raise), but for
    the protocol's own words at its top level (field names, frame types, ``why``...), so a
    short secret cannot turn ``killed`` into ``[secret]illed``. After the nonce check: a secret
    may be a substring of the nonce."""
    words = _words()
    return {
        key if key in words else _clean(key, redact): (
            value if isinstance(value, str) and value in words else _clean_json(value, redact)
        )
        for key, value in obj.items()
    }


def _clean(text: str, redact: Redactor) -> str:
    return _valid(redact.text(text))


def _clean_json(value: Any, redact: Redactor) -> Any:
    """A copy of a JSON value with every string (keys too) cleaned as :func:`_scrub` does.
    Iterative: nesting is bounded by :data:`MAX_DEPTH` before this runs, but no walk over the
    child's data should depend on a bound checked elsewhere."""
    root: list[Any] = []
    # (list or dict to fill, key (None: append), value to copy)
    stack: list[tuple[Any, Any, Any]] = [(root, None, value)]
    while stack:
        into, key, item = stack.pop()
        if isinstance(item, str):
            item = _clean(item, redact)
        elif isinstance(item, dict):
            copy: dict[str, Any] = {}
            stack.extend((copy, _clean(str(k), redact), v) for k, v in reversed(item.items()))
            item = copy
        elif isinstance(item, list):
            items: list[Any] = []
            stack.extend((items, None, v) for v in reversed(item))
            item = items
        if key is None:
            into.append(item)
        else:
            into[key] = item
    return root[0]


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


def _valid(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX``: encodable as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _preview(line: bytes, redact: Redactor, wanted: bool) -> bytes:
    """The start of a line for the log, scrubbed whole first (a cut could halve a secret);
    empty when not ``wanted``."""
    return redact.scrub(line)[:200] if wanted else b""


class LineSplitter:
    """Split a byte stream into lines of at most ``max_bytes``; longer lines are reported."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._buf = bytearray()
        self._oversize = 0  # bytes of the current over-long line seen so far; 0 when none

    def feed(self, chunk: bytes) -> list[bytes | int]:
        """Return complete lines, and for each over-long line its size in bytes (an int).

        One ``bytes.split`` per chunk: a chunk of 64 KiB can hold 32,768 lines, and a loop of
        Python per line would cost the event loop ~20 ms."""
        *complete, last = chunk.split(b"\n")
        out: list[bytes | int] = []
        if complete:
            out.append(self._end(complete[0]))
            if len(chunk) <= self._max:  # no line inside the chunk can be over
                out += complete[1:]
            else:
                out += [line if len(line) <= self._max else len(line) for line in complete[1:]]
        self._add(last)
        return out

    def rest(self) -> bytes | int | None:
        """What is left after EOF: an unterminated line, its size if over-long, or None."""
        if self._oversize:
            return self._oversize
        return bytes(self._buf) if self._buf else None

    def _add(self, piece: bytes) -> None:
        """``piece`` continues the current line."""
        if self._oversize:
            self._oversize += len(piece)
        elif len(self._buf) + len(piece) > self._max:
            self._oversize = len(self._buf) + len(piece)
            self._buf.clear()
        else:
            self._buf += piece

    def _end(self, piece: bytes) -> bytes | int:
        """``piece`` ends the current line: the line, or its size if over-long."""
        self._add(piece)
        if self._oversize:
            size, self._oversize = self._oversize, 0
            return size
        line = bytes(self._buf)
        self._buf.clear()
        return line


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
