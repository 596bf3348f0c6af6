"""The Ray backend of ``isolate batch``: every attempt is one Ray task that calls
:func:`~isolate.run_episode` on the node Ray picks, so containment, logs and the outcome are
those of a local run; the driver writes the results, with the local rules for resume and
retries. Imported only when ``--backend ray`` is chosen (``pip install 'ray>=2.9'``, the
``ray`` extra).

Ray's own retries are off (``max_retries=0``): a worker or node that dies mid-episode surfaces
as a Ray error (``WorkerCrashedError``, ``NodeDiedError``, ``ObjectLostError``, ...), recorded
as a ``crashed`` attempt with ``infra: true`` and the exception's name as ``error.type``, and
retried under ``--retries-infra``, apart from ``--retries``. The episode's shim sees its stdin
close when the worker dies and kills its tree within a second.

**Where an attempt ran:** the task is a generator whose first item is its node (Ray node id and
address), sent before the episode starts; the line's ``node`` is ``ray:<node id>@<address>``,
for a failed attempt too when the node was known before it failed (else null). The driver
measures a failed attempt's ``duration_s`` from submission, and names its ``episode_id`` (given
before submission) and ``log_path`` (where the attempt writes its log, on its node).

**Ray's output** (its processes' logs, a dying raylet's dump) never reaches the summary: while
Ray is up, file descriptor 1 of the driver is its stderr, and Ray's processes inherit that.

**The key** travels as a task argument of a few bytes. Ray inlines arguments under 100 KiB into
the task specification, sent over Ray's gRPC channels (authenticated by the cluster's token;
encrypted only if the cluster enables TLS) to the node's raylet and worker, and held in the
driver's memory until the task ends. It is not put in the object store (which can spill to
disk), Ray's task events, state API and dashboard carry no arguments, and it is never in an
environment, an argv, a log or RESULTS.jsonl. A local instance started here does not inherit an
environment variable that holds the key.

**Cancellation:** Ctrl-C cancels the running tasks (``ray.cancel``: KeyboardInterrupt in the
worker, which ends the episode as a cancelled ``run_episode`` does: the agent cleans up, then
the tree is killed) and waits up to ``cancel_grace`` + ``kill_grace`` + 5 s for them, then
disconnects (and stops a local instance).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import ray
from pydantic import SecretStr

from .job import Job, failure, run_attempt

#: Object store of a local instance: results and records are small, and Ray's default (30% of
#: memory) is a lot to reserve on a workstation (bytes).
_LOCAL_OBJECT_STORE = 256 * 1024 * 1024


def _episode(job: Job, key: SecretStr) -> Iterator[dict[str, Any]]:
    """The Ray task: its node first, then one attempt, on an event loop of its own."""
    context = ray.get_runtime_context()
    address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    yield {"node": _node_name(context.get_node_id(), address)}
    yield asyncio.run(_cancellable(job, key))


def _node_name(node_id: str, address: str) -> str:
    return f"ray:{node_id}@{address}"


async def _cancellable(job: Job, key: SecretStr) -> dict[str, Any]:
    # ray.cancel() arrives as a simulated SIGINT (``_thread.interrupt_main``), which would wait
    # for the loop to run Python code again; the loop may sleep for minutes. A loop signal
    # handler wakes it at once, and cancelling the task tears the episode down.
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    previous = signal.getsignal(signal.SIGINT)
    try:
        loop.add_signal_handler(signal.SIGINT, task.cancel)
    except (ValueError, RuntimeError):
        previous = None  # not the main thread: Ray's own interrupt still reaches the task
    try:
        return await run_attempt(job, key)
    finally:
        if previous is not None:
            loop.remove_signal_handler(signal.SIGINT)
            signal.signal(signal.SIGINT, previous)


class RayBackend:
    """Attempts as Ray tasks on an existing cluster (``address``) or a local instance."""

    def __init__(
        self,
        key: SecretStr,
        *,
        address: str | None,
        local_cpus: int | None,
        num_cpus: float,
        memory: int | None,
    ) -> None:
        self.key = key
        self.address = address
        self.local_cpus = local_cpus
        self.num_cpus = num_cpus
        self.memory = memory
        self._remote: Any = None
        self._stdout = -1

    def start(self) -> int:
        """Connect (or start a local instance); return how many tasks fit at once. Until
        :meth:`stop`, file descriptor 1 is stderr: what Ray prints is not the summary."""
        sys.stdout.flush()
        self._stdout = os.dup(1)
        os.dup2(2, 1)
        common: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
        if self.address:
            ray.init(address=self.address, **common)
        else:
            secret = self.key.get_secret_value()
            for name in [n for n, v in os.environ.items() if v == secret]:
                del os.environ[name]  # Ray's processes inherit os.environ
            ray.init(
                num_cpus=self.local_cpus,
                include_dashboard=False,
                object_store_memory=_LOCAL_OBJECT_STORE,
                _node_ip_address="127.0.0.1",
                **common,
            )
        self._remote = ray.remote(_episode)
        cpus = float(ray.cluster_resources().get("CPU", 1.0))  # type: ignore[no-untyped-call]
        return max(1, int(cpus // self.num_cpus)) if self.num_cpus > 0 else max(1, int(cpus))

    def stop(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if self._stdout >= 0:
            os.dup2(self._stdout, 1)
            os.close(self._stdout)
            self._stdout = -1

    async def run(
        self, job: Job, on_cut: Callable[[dict[str, Any]], object] | None = None
    ) -> dict[str, Any]:
        """``on_cut`` is not called: an attempt a driver's Ctrl-C cuts on a Ray worker is
        found in its bundle by the next run, as after a driver kill."""
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "max_retries": 0,
            "name": f"isolate:{job.episode_id}",
        }
        if self.memory:
            options["memory"] = self.memory
        submitted = time.monotonic()
        stream = self._remote.options(**options).remote(job, self.key)
        where: dict[str, Any] = {"node": None}
        try:
            return await _result(stream, job, submitted, where)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(ray.cancel, stream)
                with anyio.move_on_after(job.spec.cancel_grace + job.spec.kill_grace + 5.0):
                    await _result(stream, job, submitted, where)
            raise


async def _next(stream: Any) -> dict[str, Any]:
    ref = await stream.__anext__()
    value: dict[str, Any] = await asyncio.wrap_future(ref.future())
    return value


async def _result(stream: Any, job: Job, submitted: float, where: dict[str, Any]) -> dict[str, Any]:
    """The attempt's result line fields; ``where["node"]`` is set as soon as it is known."""
    try:
        if where["node"] is None:
            where.update(await _next(stream))
        value = await _next(stream)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, asyncio.CancelledError):
            return infra_failure(
                job, "TaskCancelledError", "the Ray task was cancelled", where, submitted
            )
        # Our task raised: the node cannot run it (isolate missing there, a path unwritable).
        fields = failure("setup_error", type(cause).__name__, _first_line(cause))
        fields.update(node=where["node"], episode_id=job.episode_id)
        return fields
    except (ray.exceptions.RayError, StopAsyncIteration) as exc:
        # The worker or its node died, was OOM-killed, or the task was cancelled.
        return infra_failure(job, type(exc).__name__, _first_line(exc), where, submitted)
    value["node"] = where["node"]
    return value


def infra_failure(
    job: Job, kind: str, message: str, where: dict[str, Any], submitted: float
) -> dict[str, Any]:
    """The fields of an attempt that Ray lost: ``infra``, what the driver knows of it."""
    fields = failure("crashed", kind, message)
    fields.update(
        infra=True,
        node=where["node"],
        duration_s=round(time.monotonic() - submitted, 3),
        episode_id=job.episode_id,
        log_path=str(job.log_dir / job.episode_id / f"{job.episode_id}.log"),
        containment=None,
        containment_asked=job.spec.containment,
    )
    return fields


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:500] if lines else type(exc).__name__
