"""The last bytes of an episode's output, in bounded memory."""

from __future__ import annotations


class Tail:
    """Keeps the last ``limit`` bytes written, in one buffer of at most ``limit`` bytes.

    A ring: once full, new bytes overwrite the oldest in place. With 200 episodes at once, a
    buffer that grew to twice the limit before trimming cost the parent 128 KiB per episode.
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        self.limit = limit
        self._buf = bytearray()
        self._start = 0  # where the oldest byte is, once the buffer is full

    def write(self, data: bytes) -> None:
        limit = self.limit
        view = memoryview(data)[-limit:] if limit else memoryview(b"")
        if not view:
            return
        room = limit - len(self._buf)
        if room > 0:  # still filling up: no wrapping yet
            self._buf += view[:room]
            view = view[room:]
        while view:
            n = min(len(view), limit - self._start)
            self._buf[self._start : self._start + n] = view[:n]
            self._start = (self._start + n) % limit
            view = view[n:]

    def value(self) -> bytes:
        """The kept bytes, oldest first."""
        return bytes(self._buf[self._start :] + self._buf[: self._start])
