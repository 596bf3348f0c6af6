"""The teardown benchmark's process tree: 20 processes, then wait.

Standard library only: this file runs as an isolate agent module (copied into the agent root),
as a pebble task (imported), and as a plain script (``python -I _treebuild.py PID_DIR MODE``).
Every process of the tree records its pid as a file in PID_DIR; ``_start`` and ``_ready`` hold
CLOCK_MONOTONIC times (system-wide on Linux, so comparable across processes).

The tree, besides the root (the process running this code):
  3 x  sh -> sleep                       6
  2 x  sh -> sh -> sleep                 6
  3 x  sleep, children of the root       3
  1 x  sh with two background sleeps     3
  1 x  daemon: double-forked, setsid()   1   (its first parent exits at once)
With MODE "ignore" every process ignores SIGTERM (an ignored signal survives exec).
"""

import os
import signal
import subprocess
import sys
import time

TREE_SIZE = 20
LIFETIME = 300  # seconds: nothing outlives a failed cleanup for long
REC = 'echo $$ > "$PID_DIR/$N.tmp" && mv "$PID_DIR/$N.tmp" "$PID_DIR/$N"'


def _rec_last(name):
    """Shell: record the pid of the last background job as ``name``."""
    return f'echo $! > "$PID_DIR/{name}.tmp" && mv "$PID_DIR/{name}.tmp" "$PID_DIR/{name}"'


def _record(pid_dir, name, value):
    tmp = os.path.join(pid_dir, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(value))
    os.rename(tmp, os.path.join(pid_dir, name))


def build(pid_dir, ignore_term):
    _record(pid_dir, "_start", repr(time.monotonic()))
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    env = dict(os.environ, PID_DIR=pid_dir)
    sleep = f"sleep {LIFETIME}"
    _record(pid_dir, "root", os.getpid())
    procs = []

    def sh(script):
        procs.append(subprocess.Popen(["sh", "-c", script], env=env))

    for i in range(3):
        sh(f"N=pair{i}; {REC}; {sleep} & {_rec_last(f'pair{i}-sleep')}; wait")
    for i in range(2):
        inner = f"N=chain{i}-b; {REC}; {sleep} & {_rec_last(f'chain{i}-c')}; wait"
        sh(f"N=chain{i}-a; {REC}; sh -c '{inner}' & wait")
    for i in range(3):
        child = subprocess.Popen(["sleep", str(LIFETIME)], env=env)
        _record(pid_dir, f"sleep{i}", child.pid)
    sh(f"N=fan; {REC}; {sleep} & {_rec_last('fan-1')}; {sleep} & {_rec_last('fan-2')}; wait")
    daemon = f"N=daemon; {REC}; exec {sleep}"
    first = subprocess.Popen(
        ["sh", "-c", f"setsid sh -c '{daemon}' </dev/null >/dev/null 2>&1 &"], env=env
    )
    first.wait()  # the daemon's first parent is gone: the daemon is an orphan now
    end = time.monotonic() + 30
    while time.monotonic() < end:
        names = [n for n in os.listdir(pid_dir) if not n.endswith(".tmp") and n[0] != "_"]
        if len(names) >= TREE_SIZE:
            _record(pid_dir, "_ready", repr(time.monotonic()))
            break
        time.sleep(0.005)
    return procs


def hang(pid_dir, ignore_term):
    build(pid_dir, ignore_term)
    time.sleep(LIFETIME)


def isolate_entry(data, **kwargs):
    """isolate agent entrypoint: the worker process is the root."""
    hang(os.environ["PID_DIR"], data["ignore_term"])
    return 0.0


def pebble_entry(pid_dir, ignore_term):
    """pebble task: the pool's worker process is the root."""
    hang(pid_dir, ignore_term)
    return 0.0


if __name__ == "__main__":
    hang(sys.argv[1], sys.argv[2] == "ignore")
