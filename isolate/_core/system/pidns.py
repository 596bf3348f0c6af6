"""A fresh shim started as PID 1 of a PID namespace of its own, from any thread of the parent.

``unshare(CLONE_NEWPID)`` moves no process: it names the PID namespace that the caller's next
children are born in. The kernel keeps that name per thread, and the call needs no single
thread (unlike a user namespace). So a worker thread of the parent, which holds
CAP_SYS_ADMIN, may make the namespace, start the shim (its first child there, so its PID 1),
and return to its own namespace for its later children. The shim then makes only the other
namespaces, and no relay process waits outside its PID namespace for its exit
(docs/containment.md). Other threads, and so the trainer's own children, are never affected.

An unprivileged parent cannot: a PID namespace needs a user namespace around it, and a process
with threads cannot make one. Its shim makes both and keeps its relay.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

from ..model.errors import SetupProblem

CLONE_NEWPID = 0x20000000


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12
        os.unshare(flags)
        return
    _libc_call("unshare", flags)


def _setns(fd: int, flags: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12
        os.setns(fd, flags)
        return
    _libc_call("setns", fd, flags)


def _libc_call(name: str, *args: int) -> None:
    import ctypes

    if getattr(_libc(), name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


@functools.cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def born_in_new() -> Iterator[None]:
    """Within the block, the first process this thread creates is PID 1 of a new PID
    namespace (and any later one is in it too, while PID 1 lives: create one). After it the
    thread's children are born in its own namespace again. :class:`SetupProblem` when the
    kernel refuses the namespace; OSError (a full fd table) when the thread's own cannot be
    held open."""
    own = os.open("/proc/thread-self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            _unshare(CLONE_NEWPID)
        except OSError as exc:
            raise SetupProblem(
                f"cannot make a PID namespace for the shim: {exc.strerror or exc}"
            ) from None
        try:
            yield
        finally:
            # Back to the namespace the thread is in: its own, where a thread may always
            # return. Should the kernel refuse anyway, this thread's later children could not be
            # born (once PID 1 is gone): each such start fails with the kernel's error.
            try:
                _setns(own, CLONE_NEWPID)
            except OSError as exc:  # pragma: no cover - the kernel allows it
                raise SetupProblem(
                    f"cannot return to the parent's PID namespace: {exc.strerror or exc}"
                ) from None
    finally:
        os.close(own)
