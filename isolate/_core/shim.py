"""Where the child-side program lives: the ``agent_shim`` package beside ``isolate``."""

from __future__ import annotations

from pathlib import Path


def shim_path() -> Path:
    """Path of the child-side program (``agent_shim/shim.py``) started under the agent's Python."""
    import agent_shim

    return Path(agent_shim.__file__).with_name("shim.py")


def _boot_path() -> Path:
    """What the parent runs: ``agent_shim/boot.py`` imports shim.py from its cached bytecode."""
    return shim_path().with_name("boot.py")
