"""Scrub secret values out of everything that comes back from the child.

The agent holds its own key and may print it (an SDK's debug log, an auth error that quotes
the key). Nothing that isolate writes to a log, a tail or an outcome may contain it.
"""

from __future__ import annotations

from typing import Any

MASK = b"[secret]"


class Redactor:
    """Replace secret values in text and in a byte stream split at arbitrary points."""

    def __init__(self, secrets: list[str]) -> None:
        values = {s.encode() for s in secrets if s}
        self._needles = sorted(values, key=len, reverse=True)
        self._keep = max((len(n) for n in self._needles), default=1) - 1
        self._carry = b""

    def __bool__(self) -> bool:
        return bool(self._needles)

    def scrub(self, data: bytes) -> bytes:
        for needle in self._needles:
            data = data.replace(needle, MASK)
        return data

    def text(self, text: str) -> str:
        if not self._needles:
            return text
        return self.scrub(text.encode("utf-8", "surrogateescape")).decode(
            "utf-8", "surrogateescape"
        )

    def json(self, value: Any) -> Any:
        """A copy of a JSON value with every string scrubbed (keys included)."""
        if not self._needles:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.json(v) for v in value]
        if isinstance(value, dict):
            return {self.text(str(k)): self.json(v) for k, v in value.items()}
        return value

    def stream(self, chunk: bytes) -> bytes:
        """Scrub the next chunk of a stream. Holds back the last ``len(longest) - 1`` bytes,
        which may be the start of a secret split across chunks; :meth:`flush` releases them."""
        if not self._needles:
            return chunk
        data = self.scrub(self._carry + chunk)
        if self._keep == 0:
            self._carry = b""
            return data
        # Hold back a suffix only if it could begin a secret.
        cut = len(data)
        for start in range(max(0, len(data) - self._keep), len(data)):
            tail = data[start:]
            if any(n.startswith(tail) for n in self._needles):
                cut = start
                break
        self._carry = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        rest, self._carry = self._carry, b""
        return self.scrub(rest)
