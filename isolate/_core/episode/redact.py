"""Scrub secret values out of everything that comes back from the child.

The agent holds its own key and may print it (an SDK's debug log, an auth error that quotes
the key, a URL with the key in its query). Nothing that isolate writes to a log, a tail or an
outcome may contain it, whole or in a piece long enough to matter.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from collections.abc import Iterator
from itertools import compress
from urllib.parse import quote, quote_plus

MASK = b"[secret]"

# Fragments of a key at least this long are masked (characters of the form they are in).
FRAGMENT_CHARS = 12
# Keys at least this long (characters) are masked in fragments; shorter ones only whole.
FRAGMENT_KEY_CHARS = 24
# ... unless a 4-character piece of the key occurs more often than this in it.
FRAGMENT_REPEATS = 2

# The sampled windows: GRAM bytes at every STRIDE-th byte of the data. Every run of
# GRAM + STRIDE - 1 = 11 <= FRAGMENT_CHARS bytes contains one, so a fragment cannot slip
# between them; 4 bytes are one machine int, so the whole sample is tested against the key's
# windows in one C-level set operation, and only a hit costs Python code.
_GRAM = 4
_STRIDE = 8
assert memoryview(bytes(_GRAM)).cast("I").itemsize == _GRAM
_HEX_ESCAPE = re.compile(rb"%[0-9A-F]{2}")


def _forms(secret: str) -> set[bytes]:
    """The byte strings a secret travels as: itself, escaped, percent-encoded."""
    escaped = {
        json.dumps(secret)[1:-1],  # a JSON string
        json.dumps(secret, ensure_ascii=False)[1:-1],
        json.dumps(secret)[1:-1].replace("/", "\\/"),  # JSON as some encoders write "/"
        json.dumps(json.dumps(secret)[1:-1])[1:-1],  # a JSON string inside a JSON string
        repr(secret)[1:-1],  # a Python repr, a traceback's locals
        secret.encode("unicode_escape").decode("ascii"),
    }
    escaped |= {form.replace("\\", "\\\\") for form in escaped}  # one escaping more
    raw = secret.encode("utf-8", "surrogatepass")
    forms = {raw, *(form.encode("utf-8", "surrogatepass") for form in escaped)}
    for encoded in (quote(raw, safe=""), quote(raw), quote_plus(raw)):  # URLs, query strings
        upper = encoded.encode("ascii")
        forms |= {upper, _HEX_ESCAPE.sub(lambda m: m[0].lower(), upper)}
    return forms


def _in_fragments(secret: str) -> bool:
    """Whether a secret is masked in fragments too: long enough, and random-looking (a random
    key of any common alphabet, hex or decimal included, all but never holds a 4-character
    piece three times). A key that repeats itself ("aaaa...", "abcabc...") carries little in
    a fragment, and data that repeats it would match at every alignment: a cost per byte in
    proportion to the key's length."""
    if len(secret) < FRAGMENT_KEY_CHARS:
        return False
    pieces = Counter(secret[i : i + 4] for i in range(len(secret) - 3))
    return max(pieces.values()) <= FRAGMENT_REPEATS


def _agree(a: bytes, i: int, b: bytes, j: int, most: int) -> int:
    """How many bytes ``a[i:]`` and ``b[j:]`` have in common at their start, at most ``most``."""
    # Galloping, then a binary search, on slice comparisons (memcmp, not a byte loop in
    # Python): a few comparisons for the short agreements of near misses, log2 for long ones.
    lo, step = 0, 1
    while step <= most and a[i : i + step] == b[j : j + step]:
        lo, step = step, step * 2
    hi = min(step, most + 1)  # a[i:i+hi] and b[j:j+hi] differ, or hi is past most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[i : i + mid] == b[j : j + mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _agree_back(a: bytes, i: int, b: bytes, j: int, most: int) -> int:
    """How many bytes ``a[:i]`` and ``b[:j]`` have in common at their end, at most ``most``."""
    lo, step = 0, 1
    while step <= most and a[i - step : i] == b[j - step : j]:
        lo, step = step, step * 2
    hi = min(step, most + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[i - mid : i] == b[j - mid : j]:
            lo = mid
        else:
            hi = mid
    return lo


def _windows(forms: list[_Form], size: int) -> Iterator[bytes]:
    """Every ``size``-byte window of every form."""
    for form in forms:
        for offset in range(len(form.data) - size + 1):
            yield form.data[offset : offset + size]


def _is_char_start(form: bytes, at: int) -> bool:
    return at >= len(form) or form[at] & 0xC0 != 0x80  # not a UTF-8 continuation byte


class _Form:
    """One form of a key that is masked in fragments."""

    __slots__ = ("data", "ascii")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.ascii = data.isascii()

    def next_char(self, at: int) -> int:
        """The first character boundary at or after byte offset ``at``."""
        while not _is_char_start(self.data, at):
            at += 1
        return at

    def prev_char(self, at: int) -> int:
        """The last character boundary at or before byte offset ``at``."""
        while not _is_char_start(self.data, at):
            at -= 1
        return at

    def chars(self, start: int, end: int) -> int:
        """Characters in ``data[start:end]`` (byte offsets on character boundaries)."""
        if self.ascii:
            return end - start
        return sum(1 for byte in self.data[start:end] if byte & 0xC0 != 0x80)


class _Stretch:
    """A maximal run of the data that equals a form at one alignment (data offsets)."""

    __slots__ = ("start", "end", "form", "offset")

    def __init__(self, start: int, end: int, form: _Form, offset: int) -> None:
        self.start, self.end, self.form, self.offset = start, end, form, offset

    def clipped(self, pos: int) -> tuple[int, int] | None:
        """The match this stretch gives when matching resumes at ``pos``, if one."""
        start = self.start
        if start < pos:
            start = pos
            if not self.form.ascii:  # begin on a whole character of the form
                start += self.form.next_char(self.offset + pos - self.start) - (
                    self.offset + pos - self.start
                )
        if start >= self.end:
            return None
        base = self.offset - self.start
        if self.form.chars(base + start, base + self.end) < FRAGMENT_CHARS:
            return None
        return start, self.end


class _Search:
    """One search of the data for stretches of the forms: the stretches grown so far, by form
    and alignment, and those long enough to mask."""

    __slots__ = ("forms", "grams", "data", "ways", "spans", "found")

    def __init__(
        self, forms: list[_Form], grams: dict[int, list[tuple[int, int]]], data: bytes
    ) -> None:
        self.forms, self.grams, self.data, self.ways = forms, grams, data, len(forms)
        self.spans: dict[int, list[tuple[int, int]]] = {}  # form and alignment -> stretches
        self.found: list[_Stretch] = []

    def around(self, at: int, gram: int) -> int:
        """Grow every stretch that holds the window ``gram`` at ``at``, then, from each grown
        one, those across its ends; the furthest end reached (-1 if none)."""
        grown = []
        for index, offset in self.grams[gram]:
            if not self.known(index, at, offset):
                span = self.grow(index, at, offset)
                if span is not None:
                    grown.append(span)
        data, end, grams = self.data, len(self.data), self.grams
        reached = -1
        while grown:
            start, stop = grown.pop()
            reached = max(reached, stop)
            for window in (start - 1, stop - _GRAM + 1):  # across each end
                if window < 0 or window + _GRAM > end:
                    continue
                there = int.from_bytes(data[window : window + _GRAM], sys.byteorder)
                for index, offset in grams.get(there) or ():
                    if not self.known(index, window, offset):
                        span = self.grow(index, window, offset)
                        if span is not None:
                            grown.append(span)
        return reached

    def known(self, index: int, at: int, offset: int) -> bool:
        """Whether the window at ``at``, as ``offset`` of form ``index``, lies in a stretch
        grown already."""
        there = self.spans.get((at - offset) * self.ways + index)
        return there is not None and any(lo <= at and at + _GRAM <= hi for lo, hi in there)

    def grow(self, index: int, at: int, offset: int) -> tuple[int, int] | None:
        """The maximal stretch around the window at ``at``, as ``offset`` of form ``index``,
        if it is long enough to mask (it then goes to ``found`` too); else None."""
        data, form = self.data, self.forms[index]
        text = form.data
        base = at - offset
        if base >= 0 and data.startswith(text, base):
            start, stop = base, base + len(text)  # the whole form: often, and cheap
        else:
            start = at - _agree_back(data, at, text, offset, min(at, offset))
            # Too short unless the rest of 12 bytes (never fewer than characters) follows:
            # one comparison decides the near misses that data made to hit the samples is
            # full of.
            need = start + FRAGMENT_CHARS - at
            if data[at : at + need] != text[offset : offset + need]:
                return None
            stop = at + _agree(data, at, text, offset, min(len(data) - at, len(text) - offset))
        self.spans.setdefault(base * self.ways + index, []).append((start, stop))
        first, last = start - base, stop - base
        if not form.ascii:  # whole characters only, so a mask never cuts one
            first, last = form.next_char(first), form.prev_char(last)
        if last <= first or form.chars(first, last) < FRAGMENT_CHARS:
            return None
        self.found.append(_Stretch(base + first, base + last, form, first))
        return start, stop


class Redactor:
    """Replace secret values in text, and in a byte stream split at arbitrary points.

    Each secret is masked with ``[secret]`` in every form it takes in transit: itself; as JSON
    writes it (``\\u00e9``, ``\\"``, also with ``\\/`` and inside another JSON string); as a
    Python repr or ``unicode_escape`` writes it, and each escaped form with its backslashes
    doubled; percent-encoded (``quote`` with safe ``""`` and ``"/"``, ``quote_plus``), with
    upper- or lower-case hex digits.

    A secret of at least 24 characters is also masked in fragments: any stretch of at least 12
    characters of one of its forms, masked whole however long, so a key that a logger cut or
    wrapped leaves at most pieces shorter than 12. Shorter secrets are masked only whole, and
    so are secrets that repeat a 4-character piece more than twice. The bounds: 12
    characters of a random key carry about 70 bits in the base64-like alphabets keys use (48
    in hex), which ordinary text does not match by chance; a secret shorter than 24
    characters, or one that repeats itself, is likelier a password or a word, whose
    12-character pieces may be ordinary text.

    Matching is leftmost, then longest, so overlapping secrets are masked whole, and a stream
    scrubbed chunk by chunk gives exactly what scrubbing it whole would."""

    def __init__(self, secrets: list[str]) -> None:
        whole: set[bytes] = set()
        pieces: set[bytes] = set()
        for secret in secrets:
            if secret:
                (pieces if _in_fragments(secret) else whole).update(_forms(secret))
        needles = sorted(whole, key=len, reverse=True)
        self._needles = needles
        # Longest first: at one position the alternation takes the first that matches.
        self._pattern = re.compile(b"|".join(re.escape(n) for n in needles)) if needles else None
        self._keep = len(needles[0]) - 1 if needles else 0
        self._forms = [_Form(form) for form in sorted(pieces)]
        self._longest = max((len(form.data) for form in self._forms), default=0)
        # Every GRAM-byte window of every form, as the int a sample of the data reads as:
        # int -> [(index of the form, offset in it)].
        self._grams: dict[int, list[tuple[int, int]]] = {}
        for index, form in enumerate(self._forms):
            for offset in range(len(form.data) - _GRAM + 1):
                # The native byte order: how a sample of the data, cast to "I", reads.
                gram = int.from_bytes(form.data[offset : offset + _GRAM], sys.byteorder)
                self._grams.setdefault(gram, []).append((index, offset))
        self._gram_set = frozenset(self._grams)
        self._eights = frozenset(_windows(self._forms, 2 * _GRAM))
        self._carry = b""

    def __bool__(self) -> bool:
        return self._pattern is not None or bool(self._forms)

    def _hits(self, samples: memoryview, first: int) -> Iterator[int]:
        """The data offsets of the samples from index ``first`` on that are windows of a form;
        lazily, so that skipping samples costs nothing."""
        return compress(
            range(first * _STRIDE, len(samples) * _STRIDE, _STRIDE),
            map(self._gram_set.__contains__, samples[first:]),
        )

    def _stretches(self, data: bytes) -> list[_Stretch]:
        """The maximal stretches of ``data`` that equal at least 12 characters of a form and
        may be masked, ordered by start. A stretch that lies inside another is left out where
        that is cheaper: the other one always masks at least as much."""
        if not self._forms:
            return []
        # Views of the data, no copy; they go with the last reference, as soon as here.
        samples = memoryview(data)[: len(data) // _GRAM * _GRAM].cast("I")[:: _STRIDE // _GRAM]
        if self._gram_set.isdisjoint(samples):  # the common case, all in C
            return []
        search = _Search(self._forms, self._grams, data)
        eights = self._eights
        covered = 0  # the data up to here lies in stretches grown already
        hits = self._hits(samples, 0)
        while (at := next(hits, -1)) >= 0:
            # A cheap test first: 12 bytes of a form around these 4 hold 8 bytes of a form
            # at one of two places.
            if (at < _GRAM or data[at - _GRAM : at + _GRAM] not in eights) and data[
                at : at + 2 * _GRAM
            ] not in eights:
                continue
            reached = search.around(at, samples[at // _STRIDE])
            if reached > covered:
                # Skip the samples that lie in what was grown and kept: a stretch that
                # overlaps it and reaches past it holds the window just across one of its
                # ends, and was grown from there above.
                covered = reached
                hits = self._hits(samples, -(-(covered - _GRAM + 1) // _STRIDE))
        search.found.sort(key=lambda s: s.start)
        return search.found

    def _spans(self, data: bytes) -> Iterator[tuple[int, int]]:
        """The matches in ``data``, left to right, each the leftmost then longest from where
        the last one ended."""
        stretches = self._stretches(data)
        pattern = self._pattern
        pos, nxt = 0, 0  # nxt: the first stretch that starts at or after pos
        active: list[_Stretch] = []  # stretches that start before pos and end after it
        match = pattern.search(data) if pattern is not None else None
        while True:
            if pattern is not None and match is not None and match.start() < pos:
                match = pattern.search(data, pos)  # overlapped by the last match
            best = match.span() if match is not None else None
            kept = []
            for stretch in active:
                span = stretch.clipped(pos)
                if span is None:
                    continue  # only shrinks as pos grows: drop it
                kept.append(stretch)
                if best is None or span[0] < best[0] or span[0] == best[0] and span[1] > best[1]:
                    best = span
            active = kept
            k = nxt
            while k < len(stretches) and (best is None or stretches[k].start <= best[0]):
                stretch = stretches[k]
                if best is None or stretch.start < best[0] or stretch.end > best[1]:
                    best = stretch.start, stretch.end
                k += 1
            if best is None:
                return
            yield best
            pos = best[1]
            while nxt < len(stretches) and stretches[nxt].start < pos:
                active.append(stretches[nxt])
                nxt += 1

    def scrub(self, data: bytes) -> bytes:
        if not self:
            return data
        out, pos = [], 0
        for start, end in self._spans(data):
            out += [data[pos:start], MASK]
            pos = end
        if not out:
            return data
        out.append(data[pos:])
        return b"".join(out)

    def text(self, text: str) -> str:
        if not self:
            return text
        raw = text.encode("utf-8", "surrogatepass")
        return self.scrub(raw).decode("utf-8", "surrogatepass")

    def _hold_from(self, data: bytes, low: int) -> int:
        """The earliest position >= ``low`` from which the rest of ``data`` could still grow
        into a match or begin one; ``len(data)`` if there is none."""
        end = len(data)
        hold = end
        for start in range(max(low, end - self._keep), end):
            tail = data[start:]
            if any(n.startswith(tail) for n in self._needles):
                hold = start
                break
        if self._forms:
            # A tail that is part of a form may grow into a fragment. If data[p:] is, so is
            # every shorter tail: binary search for the longest.
            lo, hi = max(low, end - self._longest), end
            while lo < hi:
                mid = (lo + hi) // 2
                tail = data[mid:]
                if any(tail in form.data for form in self._forms):
                    hi = mid
                else:
                    lo = mid + 1
            hold = min(hold, lo)
        return hold

    def stream(self, chunk: bytes) -> bytes:
        """Scrub the next chunk of a stream; bytes that may begin a secret, or a fragment that
        reaches the end and may grow, are held back until the next chunk or :meth:`flush`."""
        if not self:
            return chunk
        data = self._carry + chunk
        hold = self._hold_from(data, 0)
        out, pos = [], 0
        for start, end in self._spans(data):
            # A match starting before ``hold`` cannot change with more input: it is final.
            if start >= hold:
                break
            out += [data[pos:start], MASK]
            pos = end
            if pos > hold:
                hold = self._hold_from(data, pos)
        out.append(data[pos:hold])
        self._carry = data[hold:]
        return b"".join(out)

    def flush(self) -> bytes:
        """The held-back rest of the stream, scrubbed."""
        rest, self._carry = self._carry, b""
        return self.scrub(rest)
