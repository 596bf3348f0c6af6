"""The realistic section's two fork-based contenders, run under the agent's own interpreter.

- ``forkserver``: ``multiprocessing.get_context("forkserver")`` with the agent module preloaded
  in the fork server (``set_forkserver_preload``), one ``Process`` per episode whose target
  imports the agent (already imported there) and sends ``agent.run(data)`` back over a Pipe.
- ``floor``: ``os.fork()`` of this process, which imported the agent; the child writes
  ``agent.run(data)`` to a pipe and leaves by ``os._exit(0)``, the parent reads and reaps it.

bench/realistic.py copies this file into a directory of its own and runs it as
``python -s -P -c "import sys, _fork_arms; _fork_arms.main(sys.argv[1:])" ARM COUNTS SCRATCH``
with the agent's root and that directory in PYTHONPATH (so the fork server, which in Python
3.11 does not take its parent's sys.path, finds both). Standard library only (the agent's venv
has no isolate, no psutil). One JSON line on stdout:

- ``start_s``: until the first episode is back (the fork server's start and its import of the
  agent; for the floor, the import), ``first_line`` and ``launch``: samples (s) of ``seq``
  sequential no-op episodes after one more warm-up;
- ``cpu_per_episode``: over those, this process's RUSAGE_SELF and RUSAGE_CHILDREN plus every
  live descendant's own and reaped children's CPU from ``/proc/PID/stat`` (the fork server,
  which reaps the episodes; the resource tracker);
- ``pss_kib``: PSS (``smaps_rollup``) of this process and every descendant with ``held``
  episodes open at once, divided by ``held``; ``pss_parts_kib`` splits it;
- ``throughput``: 1-second episodes per second, ``throughput`` of them, ``concurrency`` at once;
- ``burst_started``, ``burst_returned``: ``burst`` one-second episodes started at once, the
  seconds from the first request until all have started (their first line), and returned;
- ``left``: descendants still alive after the arm closed (should be none).

``pss_kib``, ``throughput`` and the burst only when ``counts`` names them (``held``,
``throughput``, ``burst``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import resource
import select
import sys
import time
import traceback
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Preloaded in the fork server: the agent, and this module (the episodes' target lives here).
PRELOAD = ["agent", "_fork_arms"]


def episode(conn: Any, data: dict[str, Any]) -> None:
    """The forkserver episode: the agent is already imported in the fork server (the result
    says whether it was, so a preload that failed cannot pass unnoticed)."""
    preloaded = "agent" in sys.modules
    import agent

    conn.send((agent.run(data), preloaded))
    conn.close()


# --- /proc -------------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def descendants(root: int) -> list[int]:
    """Live descendants of ``root`` (zombies left out)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] not in "ZX":
                children.setdefault(int(st[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _children(parent: int, pids: list[int]) -> list[int]:
    return [p for p in pids if (st := _stat(p)) is not None and int(st[1]) == parent]


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_cpu() -> float:
    """CPU seconds of this process, its reaped children and its live descendants (their own and
    their reaped children's: the fork server reaps the episodes)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    for pid in descendants(os.getpid()):
        st = _stat(pid)
        if st is not None:  # utime stime cutime cstime: fields 14-17 of /proc/PID/stat
            total += sum(int(x) for x in st[11:15]) / CLK_TCK
    return total


# --- the two arms ------------------------------------------------------------------------------


class ForkServer:
    """One ``Process`` per episode from a fork server that preloaded the agent."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.live: dict[int, Any] = {}

    def start(self, data: dict[str, Any]) -> Any:
        r, w = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=episode, args=(w, data))
        p.start()
        w.close()
        self.live[r.fileno()] = p
        return r

    def finish(self, r: Any) -> Any:
        p = self.live.pop(r.fileno())
        try:
            result, preloaded = r.recv()
        finally:
            r.close()
            p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"forkserver episode exited with {p.exitcode}")
        if not preloaded:
            raise RuntimeError("the fork server did not preload the agent")
        return result

    def fileno(self, r: Any) -> int:
        return int(r.fileno())

    def close(self) -> None:
        for p in self.live.values():
            p.kill()
            p.join()
        self.live.clear()
        from multiprocessing import forkserver, resource_tracker

        forkserver._forkserver._stop()  # closes its alive pipe, waits for it
        resource_tracker._resource_tracker._stop()


class Floor:
    """``os.fork()`` of this process, the agent imported; the child leaves by ``os._exit``."""

    def __init__(self) -> None:
        import agent

        self.agent = agent
        self.live: dict[int, int] = {}  # read fd -> pid

    def start(self, data: dict[str, Any]) -> int:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the episode
            code = 1
            try:
                os.close(r)
                blob = pickle.dumps(self.agent.run(data))
                while blob:
                    blob = blob[os.write(w, blob) :]
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(w)
        self.live[r] = pid
        return r

    def finish(self, r: int) -> Any:
        pid = self.live.pop(r)
        chunks = []
        try:
            while chunk := os.read(r, 65536):
                chunks.append(chunk)
        finally:
            os.close(r)
            _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"forked episode ended with wait status {status}")
        return pickle.loads(b"".join(chunks))

    def fileno(self, r: int) -> int:
        return r

    def close(self) -> None:
        for r, pid in self.live.items():
            try:
                os.kill(pid, 9)
            except OSError:
                pass
            os.waitpid(pid, 0)
            os.close(r)
        self.live.clear()


# --- the measurements --------------------------------------------------------------------------


def _held(arm: Any, box: str, n: int) -> tuple[float, dict[str, int]]:
    """PSS per episode (KiB) with ``n`` episodes open at once, and its parts."""
    os.makedirs(box)
    handles = []
    try:
        for i in range(n):
            handles.append(arm.start({"hold": True, "dir": box, "i": i}))
        deadline = time.monotonic() + 900
        while len(os.listdir(box)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(os.listdir(box))} of {n} episodes up")
            time.sleep(0.01)
        me = os.getpid()
        others = descendants(me)
        # The floor's children are its episodes; the fork server's are the server and the
        # resource tracker, the episodes the server's children.
        helpers = set() if isinstance(arm, Floor) else set(_children(me, others))
        parts = {
            "driver": pss_kib(me),
            "episodes": sum(pss_kib(p) for p in others if p not in helpers),
            "helpers": sum(pss_kib(p) for p in helpers),
            "processes": 1 + len(others),
        }
    finally:
        open(os.path.join(box, "go"), "w").close()
        for h in handles:
            arm.finish(h)
    total = parts["driver"] + parts["episodes"] + parts["helpers"]
    return total / n, parts


def _throughput(arm: Any, total: int, concurrency: int) -> float:
    poll = select.poll()
    running: dict[int, Any] = {}
    started = done = 0
    t0 = time.monotonic()
    while done < total:
        while len(running) < concurrency and started < total:
            h = arm.start({"sleep": 1.0})
            running[arm.fileno(h)] = h
            poll.register(arm.fileno(h), select.POLLIN)
            started += 1
        for fd, _ in poll.poll():
            poll.unregister(fd)
            arm.finish(running.pop(fd))
            done += 1
    return total / (time.monotonic() - t0)


def _burst(arm: Any, n: int) -> tuple[float, float]:
    """(seconds until all ``n`` one-second episodes started, until all returned), started at
    once: the time from the first request to the last first line, and to the last result."""
    t0 = time.time()
    handles = [arm.start({"sleep": 1.0}) for _ in range(n)]
    firsts = [arm.finish(h)[1]["first_line"] for h in handles]
    return max(firsts) - t0, time.time() - t0


def measure(arm_name: str, counts: dict[str, Any], scratch: str) -> dict[str, Any]:
    out: dict[str, Any] = {"arm": arm_name}
    t0 = time.monotonic()
    arm = ForkServer() if arm_name == "forkserver" else Floor()
    try:
        arm.finish(arm.start({}))  # the fork server's start, or nothing more for the floor
        out["start_s"] = time.monotonic() - t0
        arm.finish(arm.start({}))  # warm-up
        firsts, launches = [], []
        cpu0 = tree_cpu()
        for _ in range(counts["seq"]):
            t, m = time.time(), time.monotonic()
            _, info = arm.finish(arm.start({}))
            launches.append(time.monotonic() - m)
            firsts.append(info["first_line"] - t)
        out["cpu_per_episode"] = (tree_cpu() - cpu0) / counts["seq"]
        out["first_line"], out["launch"] = firsts, launches
        if "held" in counts:
            out["pss_kib"], out["pss_parts_kib"] = _held(
                arm, os.path.join(scratch, "held"), counts["held"]
            )
        if "throughput" in counts:
            out["throughput"] = _throughput(arm, counts["throughput"], counts["concurrency"])
        if "burst" in counts:
            out["burst_started"], out["burst_returned"] = _burst(arm, counts["burst"])
    finally:
        arm.close()
    out["left"] = descendants(os.getpid())
    return out


def main(argv: list[str]) -> None:
    arm_name, counts, scratch = argv
    print(json.dumps(measure(arm_name, json.loads(counts), scratch)), flush=True)
