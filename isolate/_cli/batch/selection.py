"""Which records of RECORDS.jsonl a batch runs, and how often: ``--instance-ids``, ``--shard``,
``--limit`` (applied in that order) and ``--samples``; and pass@k over the samples."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..options import UsageError
from .io import Record

#: The k of pass@k that a report shows, besides the largest number of samples it has.
PASS_KS = (1, 2, 5, 10, 20, 50, 100)


def count(text: str) -> int:
    """An argparse type: a whole number of at least 1 (argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return value


@dataclass(frozen=True)
class Shard:
    index: int
    total: int

    def __str__(self) -> str:
        return f"{self.index}/{self.total}"


def shard(text: str) -> Shard:
    """An argparse type: ``I/N`` with 0 <= I < N."""
    index, slash, total = text.partition("/")
    try:
        value = Shard(int(index), int(total)) if slash else None
    except ValueError:
        value = None
    if value is None or not 0 <= value.index < value.total:
        raise argparse.ArgumentTypeError(
            f"must be I/N with 0 <= I < N (shard I of N, from 0), such as 0/4; not {text!r}"
        )
    return value


def id_list(text: str) -> list[str]:
    """An argparse type: comma-separated instance ids, at least one."""
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if not ids:
        raise argparse.ArgumentTypeError("must name at least one instance id, as A,B")
    return list(dict.fromkeys(ids))


def select(
    items: Sequence[Record],
    ids: list[str] | None,
    part: Shard | None,
    limit: int | None,
    path: Path,
) -> list[Record]:
    """The records to run, in file order: those ``ids`` name, then those of the shard (by
    their position among the records left), then the first ``limit``. Raises UsageError for
    an id no valid record of ``path`` has."""
    chosen = list(items)
    if ids is not None:
        known = {r.instance_id for r in chosen}
        unknown = [i for i in ids if i not in known]
        if unknown:
            shown = ", ".join(repr(i) for i in unknown[:10])
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise UsageError(
                f"--instance-ids: no valid record of {path} has instance_id {shown}{more}; "
                "nothing was run"
            )
        wanted = set(ids)
        chosen = [r for r in chosen if r.instance_id in wanted]
    if part is not None:
        chosen = [r for n, r in enumerate(chosen) if n % part.total == part.index]
    if limit is not None:
        chosen = chosen[:limit]
    return chosen


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of the chance that at least one of ``k`` samples resolves, from
    ``n`` samples of which ``c`` resolved: 1 - C(n-c, k) / C(n, k). Needs n >= k."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class PassAtK:
    k: int
    value: float
    """The estimator, averaged over ``instances``."""
    instances: int
    """The instances with at least k samples: those it is averaged over."""


def pass_at_ks(samples: Iterable[tuple[int, int]]) -> list[PassAtK]:
    """pass@k for each k of PASS_KS up to the largest n, and that n, from ``(n, c)`` per
    instance: n samples with a final result, c of them resolved. Empty when no instance has
    more than one sample."""
    counts = [(n, c) for n, c in samples if n > 0]
    most = max((n for n, _ in counts), default=0)
    if most < 2:
        return []
    found = []
    for k in sorted({k for k in PASS_KS if k <= most} | {most}):
        values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
        found.append(PassAtK(k, sum(values) / len(values), len(values)))
    return found


def pass_lines(found: list[PassAtK], instances: int, sizes: Iterable[int]) -> list[str]:
    """The summary's lines for ``found``: ``pass@k  value``, with how many instances each is
    over when that is not all ``instances`` with a result; ``sizes`` are their sample counts."""
    sizes = list(sizes)
    if not found or not sizes:
        return []
    low, high = min(sizes), max(sizes)
    each = f"{high} samples each" if low == high else f"{low}-{high} samples"
    lines = []
    for n, p in enumerate(found):
        note = f"  ({instances} instance{'s' * (instances != 1)}, {each})" if n == 0 else ""
        if p.instances != instances:
            note = f"  (over the {p.instances} instances with {p.k} or more samples)"
        lines.append(f"{f'pass@{p.k}':<11}  {p.value:.3f}{note}")
    return lines
