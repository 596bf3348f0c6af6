"""Watch a process tree from outside: ``python -I _watch.py PID_DIR EXPECTED [env]``.

A separate process, so polling does not compete for the measured parent's GIL. Every 2 ms it
reads PID_DIR's pid files (noting each pid's start time on first sight) and the state of every
known pid in /proc. A zombie, a missing pid or a pid with another start time counts as gone.
Stdin lines: ``pid N`` adds a pid to watch (the isolate shim); ``stop`` ends the watch and
prints one JSON line: ready_at (all EXPECTED pid files seen), gone_at (first moment, after
ready, that every watched pid was gone), and the pids still alive at stop.

With ``env``, a recorded pid is the tree's own number for itself, which inside a PID namespace
is not the host's: each is looked up among the processes whose environment holds
``PID_DIR=PID_DIR``, by the innermost pid in their ``NSpid`` line.
"""

import json
import os
import select
import sys
import time


def stat(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2 :].split()
    return rest[0].decode(), int(rest[19])


def alive(pid, start):
    s = stat(pid)
    return s is not None and s[0] not in "ZX" and (start is None or s[1] == start)


def tagged(pid_dir):
    """The tree's own pid -> host pid of every process with ``PID_DIR=pid_dir`` in its env."""
    needle = f"PID_DIR={pid_dir}\0".encode()
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            if not (env.startswith(needle) or b"\0" + needle in env):
                continue
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        out[int(line.split()[-1])] = int(name)
        except (OSError, ValueError):
            continue
    return out


def main():
    pid_dir, expected = sys.argv[1], int(sys.argv[2])
    by_env = sys.argv[3:] == ["env"]
    tracked = {}  # name -> [pid, start or None]
    ready_at = gone_at = None
    stdin = sys.stdin.fileno()
    buf = b""
    end = time.monotonic() + 600  # never outlive a forgotten watch
    while time.monotonic() < end:
        readable, _, _ = select.select([stdin], [], [], 0.002)
        if readable:
            chunk = os.read(stdin, 4096)
            buf += chunk
            lines = buf.split(b"\n")
            buf = lines.pop()
            if not chunk:
                lines.append(b"stop")
            if b"stop" in lines:
                break
            for line in lines:
                if line.startswith(b"pid "):
                    pid = int(line.split()[1])
                    s = stat(pid)
                    tracked["_shim"] = [pid, s[1] if s else None]
        if ready_at is None:
            try:
                names = os.listdir(pid_dir)
            except OSError:
                names = []
            for name in names:
                if name.endswith(".tmp") or name[0] == "_" or name in tracked:
                    continue
                try:
                    with open(os.path.join(pid_dir, name)) as f:
                        pid = int(f.read())
                except (OSError, ValueError):
                    continue
                if by_env:
                    pid = tagged(pid_dir).get(pid)
                    if pid is None:
                        continue  # gone before it was seen, or not yet exec'd: look again
                s = stat(pid)
                tracked[name] = [pid, s[1] if s else None]
            if len([n for n in tracked if n[0] != "_"]) >= expected:
                ready_at = time.monotonic()
        elif gone_at is None:
            if not any(alive(pid, start) for pid, start in tracked.values()):
                gone_at = time.monotonic()
    left = {name: pid for name, (pid, start) in tracked.items() if alive(pid, start)}
    out = {"ready_at": ready_at, "gone_at": gone_at, "tracked": tracked, "alive": left}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
