"""multiprocessing and concurrent.futures inside the agent work as under plain python, with
every start method: the shim never runs again in a spawned child, and functions of the agent's
modules pickle by reference."""

from __future__ import annotations

import os
import sys
import time

import pytest

import isolate

from .conftest import SLOW, Agents, episode_processes

pytestmark = pytest.mark.anyio

PY39 = os.path.expanduser("~/.pyenv/versions/3.9.18/bin/python3.9")
PY313 = os.path.expanduser("~/.pyenv/versions/3.13.0/bin/python3.13")

AGENT = """
import multiprocessing, os, sys
from concurrent.futures import ProcessPoolExecutor

def square(x):  # pickled by reference: module and name
    return x * x, os.getpid(), sys.argv

def run(data):
    ctx = multiprocessing.get_context(data["method"])
    if data["pool"] == "Pool":
        with ctx.Pool(2) as pool:
            results = pool.map(square, range(6))
    else:
        with ProcessPoolExecutor(2, mp_context=ctx) as pool:
            results = list(pool.map(square, range(6)))
    values = [r[0] for r in results]
    pids = {r[1] for r in results}
    return float(sum(values)), {
        "values": values,
        "elsewhere": os.getpid() not in pids,
        "argv": results[0][2],
    }
"""


def interpreters() -> list[object]:
    found: list[object] = [pytest.param(sys.executable, id="project")]
    for path in (PY39, PY313):
        missing = pytest.mark.skip(reason=f"{path} is not installed")
        marks = () if os.path.exists(path) else missing
        found.append(pytest.param(path, id=os.path.basename(path), marks=marks))
    return found


@pytest.mark.parametrize("python", interpreters())
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("pool", ["Pool", "ProcessPoolExecutor"])
async def test_process_pools_work_with_every_start_method(
    agents: Agents, python: str, method: str, pool: str
) -> None:
    spec = agents.spec(AGENT, python=python, timeout=60.0, kill_grace=0.5)
    started = time.monotonic()
    outcome = await isolate.run_episode(spec, {"method": method, "pool": pool})
    assert outcome.status == "ok", outcome.summary() + outcome.stderr_tail[-2000:]
    assert outcome.reward == 55.0
    assert outcome.info == {
        "values": [0, 1, 4, 9, 16, 25],
        "elsewhere": True,
        "argv": [spec.entrypoint],
    }
    assert "no handshake" not in outcome.stderr_tail  # the shim never ran again
    # Well before the timeout: a hang would wait for it.
    assert time.monotonic() - started < 15.0 * SLOW
    assert not episode_processes(f"PID_DIR={agents.pids}".encode())
