"""What every benchmark gets from the command: where to put files and how big to run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Context:
    run_id: str
    """Value of MARK_ENV in every process this run starts."""
    workdir: Path
    """Scratch directory for agents, pid files and logs; removed by the caller."""
    quick: bool
    """Smoke mode: a few episodes, small ballast, short deadlines."""
    skip_fresh: bool = False
    """realistic: leave out the fresh-start mode (about 3 s of CPU per episode)."""
