"""No-op episode bodies for the baselines. Kept tiny: spawned children import this module."""

from __future__ import annotations

import os
from typing import Any


def run(data: Any) -> float:
    return 1.0


def mp_episode(conn: Any) -> None:
    """Body of a ``multiprocessing.Process`` per episode: send the reward back, exit."""
    conn.send(run({}))
    conn.close()


def areal_task(env: dict[str, str], data: Any) -> float:
    """AReaL's ``subproc`` pattern: credentials go into the shared worker's environment."""
    os.environ.update(env)
    return run(data)


async def coroutine(data: Any) -> float:
    return 1.0
