"""Where the child-side program lives (the ``agent_shim`` package beside ``isolate``), and the
one way to run its probes."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: How long a probe may take (seconds) before it counts as failed.
PROBE_TIMEOUT_S = 10.0


def shim_path() -> Path:
    """Path of the child-side program (``agent_shim/shim.py``) started under the agent's Python."""
    import agent_shim

    return Path(agent_shim.__file__).with_name("shim.py")


def boot_path() -> Path:
    """What the parent runs: ``agent_shim/boot.py`` imports shim.py from its cached bytecode."""
    return shim_path().with_name("boot.py")


@dataclass(frozen=True)
class Probe:
    """How one probe of the shim ended."""

    problem: str | None
    """None when it exited 0; else its last line of stderr, or why it did not run."""
    stdout: str


def probe(*args: str) -> Probe:
    """Run ``shim.py ARGS`` (``--probe-pidns``, ``--probe-landlock``, ``--probe-net``) in a
    short-lived child of this interpreter, with an empty environment: never the parent's,
    which may hold keys. Blocking."""
    argv = [sys.executable, "-I", str(shim_path()), *args]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env={},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Probe(f"the probe failed: {exc}", "")
    stdout = done.stdout.decode("ascii", "replace")
    if done.returncode == 0:
        return Probe(None, stdout)
    lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
    return Probe(lines[-1] if lines else f"probe exit {done.returncode}", stdout)
