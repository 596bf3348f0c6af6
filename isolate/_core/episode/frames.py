"""The child's stdout, read as frames: what each frame may say, in which order, how often."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import anyio

from ..model.outcome import Cleanup
from ..network.netserve import EpisodeNetwork
from . import protocol as proto
from .redact import Redactor

#: Lines that are not frames, and protocol violations, noted in the log one by one (each);
#: the rest are counted, and the count noted once at the end.
MAX_NOTED = 100
#: Work on the event loop between two yields while a chunk is read as lines (seconds).
_TURN_S = 0.002
#: Frames larger than this are parsed in a worker thread, not on the event loop (bytes).
_BIG_FRAME = 256 * 1024


class Frames:
    """What the child has said so far, from its stdout.

    Lines are scrubbed of the secrets by ``proto.parse_line`` before anything keeps them: a
    frame is built from the scrubbed object. Anything out of order (a frame before hello, a
    second final frame, a shim that set up other containment than asked) is a violation: kept,
    noted in the log, and the verdict's to judge.

    A flood costs what a byte flood does: the first :data:`MAX_NOTED` lines that are not frames
    (and violations) are noted one by one, the rest only counted; past that bound a line that
    cannot hold the nonce is not parsed at all; and a chunk is read in turns of ``_TURN_S``.
    """

    def __init__(
        self,
        *,
        nonce: str,
        redact: Redactor,
        max_frame_bytes: int,
        max_info_bytes: int,
        containment: str,
        network: EpisodeNetwork | None,
        note: Callable[[str], None],
    ) -> None:
        self._nonce, self._redact, self._note = nonce, redact, note
        self._max_frame_bytes, self._max_info_bytes = max_frame_bytes, max_info_bytes
        self._containment = containment  # what the shim must say it set up
        self._network = network  # takes the listeners that come with the ``net`` frame
        self.cap = proto.frame_cap(max_frame_bytes, max_info_bytes)
        self._splitter = proto.LineSplitter(self.cap)
        self.hello: proto.Hello | None = None
        self.hello_at: float | None = None  # time.monotonic() when it came
        self.said_hello = anyio.Event()  # the shim is past its interpreter's start-up
        self.final: proto.Result | proto.ErrorFrame | None = None
        self.done: proto.Done | None = None
        #: How the agent's clean-up went, from its frame; "cut short" when it never said
        #: (:meth:`cut_short`).
        self.cleanup: Cleanup | None = None
        self.cleanup_seen = anyio.Event()
        self.final_seen = anyio.Event()  # a result or error frame came
        self.sandbox_missing: list[str] | None = None  # from the worker's sandbox frame
        self.violations: list[str] = []  # the first MAX_NOTED
        self._nonce_bytes = nonce.encode()
        self._noted = 0  # lines that were not frames, noted
        self._ignored = 0  # more of them, counted and not yet noted
        self._unnoted_violations = 0  # violations past MAX_NOTED, not yet noted

    async def feed(self, chunk: bytes) -> None:
        """Read the lines of ``chunk``, yielding to the event loop after every ``_TURN_S`` of
        work: 64 KiB can hold 32,768 lines."""
        turn_ends = time.monotonic() + _TURN_S
        for line in self._splitter.feed(chunk):
            if not self._counted(line):
                await self._line(line)
            if time.monotonic() >= turn_ends:
                # Shielded: a chunk once read is read whole, so no frame in it is lost to a
                # cancellation; the pump's own checkpoint between chunks is the one that acts.
                await anyio.lowlevel.cancel_shielded_checkpoint()
                turn_ends = time.monotonic() + _TURN_S

    async def at_eof(self) -> None:
        """stdout ended: a last line without its newline is a frame if it is whole, and a
        violation if it is a frame cut short."""
        rest = self._splitter.rest()
        if isinstance(rest, int):
            self.violate(f"an incomplete frame at EOF: {rest} bytes, {self._over_cap()}")
        elif rest is not None:
            await self._line(rest, last=True)
        self.note_counts()

    def note_counts(self) -> None:
        """Note how many lines and violations were counted without a note of their own, if
        any, since the last time."""
        if self._ignored:
            self._note(f"{self._ignored} more stdout lines ignored (not frames of this episode)")
            self._ignored = 0
        if self._unnoted_violations:
            self._note(f"{self._unnoted_violations} more protocol violations")
            self._unnoted_violations = 0

    def cleaned_up(self) -> None:
        """The agent exited within its clean-up grace, as the parent saw it: a fork that is its
        own worker has no supervisor to send a ``cleanup`` frame."""
        if self.cleanup is None:
            self.cleanup = "finished"
            self._note("the agent's clean-up finished")
        self.cleanup_seen.set()

    def cut_short(self) -> None:
        """The parent stopped waiting for the agent's clean-up frame: unless one came, the
        clean-up is "cut short", and a later frame does not change that."""
        if self.cleanup is None:
            self.cleanup = "cut short"

    def violate(self, message: str) -> None:
        if len(self.violations) >= MAX_NOTED:
            self._unnoted_violations += 1
            return
        message = proto.one_line(message)
        self.violations.append(message)
        self._note(f"protocol violation: {message}")

    def _counted(self, line: bytes | int) -> bool:
        """Past :data:`MAX_NOTED` noted lines, count a line that cannot be a frame of this
        episode (nor a violation: neither the nonce in it nor an escape that could spell it),
        without parsing it; True if counted."""
        if (
            self._noted < MAX_NOTED
            or isinstance(line, int)
            or self._nonce_bytes in line
            or b"\\" in line
        ):
            return False
        self._ignored += 1
        return True

    async def _line(self, line: bytes | int, *, last: bool = False) -> None:
        if isinstance(line, int):
            self.violate(f"frame of {line} bytes, {self._over_cap()}")
            return
        previews = self._noted < MAX_NOTED
        parse = functools.partial(proto.parse_line, previews=previews)
        args = (line, self._nonce, self._redact, self._max_info_bytes)
        if len(line) > _BIG_FRAME:
            item = await anyio.to_thread.run_sync(parse, *args)
        else:
            item = parse(*args)
        if last and isinstance(item, proto.Noise) and item.reason == "not JSON":
            self.violate(f"an incomplete frame at EOF: {len(line)} bytes without a newline")
        elif isinstance(item, proto.Noise):
            self._noise(item)
        elif isinstance(item, proto.Violation):
            self.violate(item.message)
        else:
            self._frame(item)

    def _noise(self, item: proto.Noise) -> None:
        if self._noted >= MAX_NOTED:
            self._ignored += 1
            return
        shown = item.preview.decode("utf-8", "backslashreplace")
        self._note(f"ignored stdout line ({item.reason}): {shown!r}")
        self._noted += 1
        if self._noted == MAX_NOTED:
            self._note("the next stdout lines that are not frames are counted, not shown")

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
        elif isinstance(frame, proto.Result | proto.ErrorFrame):
            if self.final is not None:
                self.violate(f"a second final frame ({frame.t!r} after {self.final.t!r})")
            else:
                self.final = frame
                self.final_seen.set()
        elif isinstance(frame, proto.CleanupFrame):
            if self.cleanup is None:
                self.cleanup = frame.how
                self._note(f"the agent's clean-up {frame.how}")
            self.cleanup_seen.set()
        elif isinstance(frame, proto.Sandboxed):
            self.sandbox_missing = frame.missing
        elif isinstance(frame, proto.Net):
            if self._network is None:
                problem: str | None = "a net frame, with no network asked for"
            else:
                problem = self._network.take()
            if problem is not None:
                self.violate(problem)
        elif isinstance(frame, proto.Done):
            if self.done is not None:
                self.violate("a second done frame")
            self.done = frame

    def _hello(self, frame: proto.Hello) -> None:
        if self.hello is not None:
            self.violate("a second hello frame")
        elif frame.containment not in (None, self._containment):
            level = f"{frame.containment!r}, not {self._containment!r}"
            self.violate(f"the shim set up containment {level}")
        self.hello = frame
        self.hello_at = time.monotonic()
        self.said_hello.set()
