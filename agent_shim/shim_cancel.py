"""Child-side part of isolate: cancel the agent inside its own process.

Loaded by shim.py with ``load_part("cancel")`` only when an episode ends early (deadline,
cancel request, the parent's death) and for async entrypoints: a normal episode never imports
it. Standard library only, Python 3.9+.

The supervisor sends the worker SIGINT, then SIGCONT (a stopped worker wakes with the signal
pending). A sync entrypoint gets ``KeyboardInterrupt`` in its main thread, also while blocked in
a sleep, a read or ``subprocess.wait``; an async one gets ``CancelledError`` in its main task at
its current ``await`` (``run_async`` sets that up the same way on every Python version: before
3.11 ``asyncio.run`` has no SIGINT handler of its own). Only the worker is told: its
subprocesses keep running while it cleans up.
"""

import os
import select
import sys
import time

shim = sys.modules["_isolate_shim"]
signal = shim.signal


def cancel_worker(worker_pid, status, grace, wake_fd, flags, reap):
    """Cancel the worker and wait until it exits, ``grace`` seconds at most (or until the
    supervisor is told to terminate). Returns (worker's status from ``reap``, how the clean-up
    went: ``"finished"`` or ``"cut short"``)."""
    for sig in (signal.SIGINT, signal.SIGCONT):
        try:
            os.kill(worker_pid, sig)
        except OSError:
            pass  # exited meanwhile: reap says so
    end = time.monotonic() + grace
    poller = select.poll()
    poller.register(wake_fd, select.POLLIN)  # SIGCHLD and SIGTERM write to it
    while True:
        status, _ = reap(worker_pid, status)
        if status is not None:
            return status, "finished"
        remaining = end - time.monotonic()
        if remaining <= 0 or flags.get("terminated"):
            return status, "cut short"
        if poller.poll(min(remaining, 3600.0) * 1000):
            try:
                os.read(wake_fd, 4096)
            except BlockingIOError:
                pass


def run_async(awaitable):
    """``asyncio.run`` of the entrypoint's awaitable, with SIGINT cancelling its main task."""
    import asyncio

    async def main():
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, asyncio.current_task().cancel)
        return await awaitable

    return asyncio.run(main())
