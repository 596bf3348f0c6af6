"""Promise: a template's fork is refused when it shares a live sibling's IPC namespace, and
only then. A namespace's inode is reused once it is freed, and an exiting process leaves its
namespaces before its pidfd says it has exited: ``still_in`` looks at where the sibling is
now. Real processes: a sleeper, the zombie it becomes, and an unprivileged reader."""

from __future__ import annotations

import os
import subprocess

from isolate._core.templates import namespaces

from .conftest import as_nobody, nobody, wait_for

__all__ = ["nobody"]  # a fixture, used by name


def _ipc(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/ipc").st_ino


def test_a_live_process_is_in_its_namespace_and_a_zombie_in_none() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        mine = _ipc("self")
        assert namespaces.still_in(sleeper.pid, "ipc", mine)
        assert not namespaces.still_in(sleeper.pid, "ipc", mine + 1)
        sleeper.kill()
        # Not reaped yet: a zombie has left its namespaces, though its pid is still its own.
        wait_for(lambda: _state(sleeper.pid) == "Z", 10, "the sleeper to be a zombie")
        assert not namespaces.still_in(sleeper.pid, "ipc", mine)
    finally:
        sleeper.kill()
        sleeper.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


CHECK = """
import sys
from isolate._core.templates import namespaces
print(namespaces.still_in(int(sys.argv[1]), "ipc", int(sys.argv[2])))
"""


def test_a_process_it_cannot_look_at_counts_as_in_it(nobody: tuple[str, dict[str, str]]) -> None:
    """An unprivileged parent cannot read the namespaces of another user's process: then the
    sibling counts as sharing, and the fork is refused rather than let through."""
    python, env = nobody
    # The control: this (root) process reads its own, and the answer follows the inode.
    mine = _ipc("self")
    assert namespaces.still_in(os.getpid(), "ipc", mine + 1) is False
    for inode in (mine, mine + 1):
        out = as_nobody(
            [python, "-c", CHECK, str(os.getpid()), str(inode)],
            env={**os.environ, **env},
            timeout=60,
        )
        assert (out.returncode, out.stdout.strip()) == (0, "True"), out.stderr[-2000:]
