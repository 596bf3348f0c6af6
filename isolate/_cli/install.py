"""The ``pip install`` lines the commands print for an optional part: lines that work from a
clone and from a wheel alike (the distribution is not on PyPI under its name)."""

from __future__ import annotations

import shlex
import sys

#: What each extra of pyproject.toml installs (a test keeps the two the same).
EXTRAS: dict[str, tuple[str, ...]] = {
    "mini-swe-agent": ("mini-swe-agent>=2.4,<3",),
    "ray": ("ray>=2.9",),
    "batch": ("rich>=13",),
    "report": ("matplotlib>=3.7",),
}


def requirements(extra: str) -> str:
    """The extra's requirements as shell words: ``'matplotlib>=3.7'``."""
    return " ".join(shlex.quote(r) for r in EXTRAS[extra])


def install_line(extra: str) -> str:
    """The command that installs ``extra`` into the interpreter running isolate:
    ``/venv/bin/python -m pip install 'matplotlib>=3.7'``."""
    return f"{shlex.quote(sys.executable)} -m pip install {requirements(extra)}"


def install_hint(extra: str) -> str:
    """For help texts, which cannot know the interpreter: ``pip install 'ray>=2.9'``."""
    return f"pip install {requirements(extra)}"
