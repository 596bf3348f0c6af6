"""Scrub secret values out of everything that comes back from the child.

The agent holds its own key and may print it (an SDK's debug log, an auth error that quotes
the key). Nothing that isolate writes to a log, a tail or an outcome may contain it.
"""

from __future__ import annotations

import json
import re
from typing import Any

MASK = b"[secret]"


class Redactor:
    """Replace secret values in text, and in a byte stream split at arbitrary points.

    Matching is leftmost, then longest, so overlapping secrets are masked whole, and a stream
    scrubbed chunk by chunk gives exactly what scrubbing it whole would. Each secret is also
    masked as JSON writes it (``\u00e9``, ``\"``), the way a JSON log line or stdout line
    carries a key that is not plain ASCII."""

    def __init__(self, secrets: list[str]) -> None:
        forms = {form for s in secrets if s for form in (s, json.dumps(s)[1:-1])}
        needles = sorted({f.encode("utf-8", "surrogatepass") for f in forms}, key=len, reverse=True)
        self._needles = needles
        self._pattern = re.compile(b"|".join(re.escape(n) for n in needles)) if needles else None
        self._keep = len(needles[0]) - 1 if needles else 0
        self._carry = b""

    def __bool__(self) -> bool:
        return self._pattern is not None

    def scrub(self, data: bytes) -> bytes:
        if self._pattern is None:
            return data
        return self._pattern.sub(MASK, data)

    def text(self, text: str) -> str:
        if self._pattern is None:
            return text
        raw = text.encode("utf-8", "surrogatepass")
        return self.scrub(raw).decode("utf-8", "surrogatepass")

    def json(self, value: Any) -> Any:
        """A copy of a JSON value with every string scrubbed (keys included)."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.json(v) for v in value]
        if isinstance(value, dict):
            return {self.text(str(k)): self.json(v) for k, v in value.items()}
        return value

    def _hold_from(self, data: bytes, low: int) -> int:
        """The earliest position >= ``low`` from which the rest of ``data`` could still grow
        into a secret; ``len(data)`` if there is none."""
        for start in range(max(low, len(data) - self._keep), len(data)):
            tail = data[start:]
            if any(n.startswith(tail) for n in self._needles):
                return start
        return len(data)

    def stream(self, chunk: bytes) -> bytes:
        """Scrub the next chunk of a stream; bytes that may begin a secret are held back until
        the next chunk or :meth:`flush`."""
        if self._pattern is None:
            return chunk
        data = self._carry + chunk
        hold = self._hold_from(data, 0)
        out, pos = [], 0
        while True:
            match = self._pattern.search(data, pos)
            # A match starting before ``hold`` cannot change with more input: it is final.
            if match is None or match.start() >= hold:
                break
            out += [data[pos : match.start()], MASK]
            pos = match.end()
            if pos > hold:
                hold = self._hold_from(data, pos)
        out.append(data[pos:hold])
        self._carry = data[hold:]
        return b"".join(out)

    def flush(self) -> bytes:
        """The held-back rest of the stream, scrubbed."""
        rest, self._carry = self._carry, b""
        return self.scrub(rest)
