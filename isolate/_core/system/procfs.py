"""The few readers of ``/proc/PID/stat`` that psutil cannot stand in for.

psutil gives a process's parent, state and start time too, but each call builds a ``Process``
(a read of ``stat`` and of the boot time), reports its start time as float seconds since the
epoch (no good as an identity that must match the clock ticks a name was written with), and
reads a thread group's state from its leader only, which hides a leader that exited before
its threads. These readers do one read each and stay on the clock the kernel counts in.
"""

from __future__ import annotations

import os

#: The states of a process that is gone but for its entry: zombie, dead.
GONE = (b"Z", b"X", b"x")


def stat_fields(pid: int, task: int | None = None) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` (of thread ``task`` of it, if given) after the command
    name, starting with the state; None when it cannot be read."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields follow the last ')'.
    fields = data[data.rfind(b")") + 1 :].split()
    return fields or None


def start_time(pid: int) -> int | None:
    """Start time of a live (non-zombie) process, in clock ticks since boot; else None. With
    the pid it names one process for as long as the machine runs."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in GONE or len(fields) < 20:
        return None
    return int(fields[19])


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``; None when it cannot be read."""
    fields = stat_fields(pid)
    try:
        return int(fields[1]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def exited(pid: int) -> bool:
    """Whether ``pid`` is a zombie, dead, or no longer there."""
    fields = stat_fields(pid)
    return fields is None or fields[0] in GONE


def has_live_thread(pid: int) -> bool:
    """Whether any thread of ``pid`` is other than dead or a zombie. The state of the process
    is its main thread's only, so a leader that exited hides its live threads."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        fields = stat_fields(pid, int(tid))
        if fields is not None and fields[0] not in GONE:
            return True
    return False


def ns_pids(pid: int) -> list[int] | None:
    """The numbers of process ``pid`` in each PID namespace it is in, from ours inwards
    (``NSpid`` in ``/proc/PID/status``); None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return [int(n) for n in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


def ns_pid(pid: int) -> int | None:
    """The number of process ``pid`` in its own PID namespace; None if it is gone."""
    levels = ns_pids(pid)
    return levels[-1] if levels else None
