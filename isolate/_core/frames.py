"""The child's stdout, read as frames: what each frame may say, in which order, how often."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from . import protocol as proto
from .outcome import Cleanup
from .redact import Redactor

#: Frames larger than this are parsed in a worker thread, not on the event loop (bytes).
_BIG_FRAME = 256 * 1024


class Frames:
    """What the child has said so far, from its stdout.

    Lines are scrubbed of the secrets by ``proto.parse_line`` before anything keeps them: a
    frame is built from the scrubbed object. Anything out of order (a frame before hello, a
    second final frame, a shim that set up other containment than asked) is a violation: kept,
    noted in the log, and the verdict's to judge.
    """

    def __init__(
        self,
        *,
        nonce: str,
        redact: Redactor,
        max_frame_bytes: int,
        max_info_bytes: int,
        containment: str,
        note: Callable[[str], None],
        on_hello: Callable[[], None],
        on_net: Callable[[], str | None],
    ) -> None:
        self._nonce, self._redact, self._note = nonce, redact, note
        self._max_frame_bytes, self._max_info_bytes = max_frame_bytes, max_info_bytes
        self._on_hello, self._on_net = on_hello, on_net
        self.containment = containment  # what the shim must say it set up
        self.cap = proto.frame_cap(max_frame_bytes, max_info_bytes)
        self._splitter = proto.LineSplitter(self.cap)
        self.hello: proto.Hello | None = None
        self.hello_at: float | None = None  # time.monotonic() when it came
        self.final: proto.Result | proto.Error | None = None
        self.done: proto.Done | None = None
        #: How the agent's clean-up went, from its frame; "cut short" when it never said.
        self.cleanup: Cleanup | None = None
        self.cleanup_seen = anyio.Event()
        self.sandbox_missing: list[str] | None = None  # from the worker's sandbox frame
        self.violations: list[str] = []

    async def feed(self, chunk: bytes) -> None:
        for line in self._splitter.feed(chunk):
            await self._line(line)

    async def at_eof(self) -> None:
        """stdout ended: a last line without its newline is a frame if it is whole, and a
        violation if it is a frame cut short."""
        rest = self._splitter.rest()
        if isinstance(rest, int):
            self.violate(f"an incomplete frame at EOF: {rest} bytes, {self._over_cap()}")
        elif rest is not None:
            await self._line(rest, last=True)

    def violate(self, message: str) -> None:
        message = proto.one_line(message)
        self.violations.append(message)
        self._note(f"protocol violation: {message}")

    async def _line(self, line: bytes | int, *, last: bool = False) -> None:
        if isinstance(line, int):
            self.violate(f"frame of {line} bytes, {self._over_cap()}")
            return
        args = (line, self._nonce, self._redact, self._max_info_bytes)
        if len(line) > _BIG_FRAME:
            item = await anyio.to_thread.run_sync(proto.parse_line, *args)
        else:
            item = proto.parse_line(*args)
        if last and isinstance(item, proto.Noise) and item.reason == "not JSON":
            self.violate(f"an incomplete frame at EOF: {len(line)} bytes without a newline")
        elif isinstance(item, proto.Noise):
            shown = item.preview.decode("utf-8", "backslashreplace")
            self._note(f"ignored stdout line ({item.reason}): {shown!r}")
        elif isinstance(item, proto.Violation):
            self.violate(item.message)
        else:
            self._frame(item)

    def _over_cap(self) -> str:
        if self.cap == self._max_frame_bytes:
            return f"over max_frame_bytes ({self.cap})"
        room = proto.FRAME_ROOM // (1024 * 1024)
        return f"over max_info_bytes + {room} MiB ({self.cap}), less than max_frame_bytes"

    def _frame(self, frame: proto.Frame) -> None:
        if isinstance(frame, proto.Hello):
            self._hello(frame)
        elif self.hello is None:
            self.violate(f"a {frame.t!r} frame before hello")
        elif isinstance(frame, proto.Result | proto.Error):
            if self.final is not None:
                self.violate(f"a second final frame ({frame.t!r} after {self.final.t!r})")
            else:
                self.final = frame
        elif isinstance(frame, proto.CleanupFrame):
            if self.cleanup is None:
                self.cleanup = frame.how
                self._note(f"the agent's clean-up {frame.how}")
            self.cleanup_seen.set()
        elif isinstance(frame, proto.Sandboxed):
            self.sandbox_missing = frame.missing
        elif isinstance(frame, proto.Net):
            problem = self._on_net()
            if problem is not None:
                self.violate(problem)
        elif isinstance(frame, proto.Done):
            if self.done is not None:
                self.violate("a second done frame")
            self.done = frame

    def _hello(self, frame: proto.Hello) -> None:
        if self.hello is not None:
            self.violate("a second hello frame")
        elif frame.containment not in (None, self.containment):
            level = f"{frame.containment!r}, not {self.containment!r}"
            self.violate(f"the shim set up containment {level}")
        self.hello = frame
        self.hello_at = time.monotonic()
        self._on_hello()
