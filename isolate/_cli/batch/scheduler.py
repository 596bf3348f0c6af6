"""Running a batch: the retry rules, and the scheduler that keeps N instances going and
writes each attempt's result as it comes."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from pydantic import SecretStr

from ..._core.templates import close_templates
from .io import Record, Records, Results
from .job import Job, Plan, failure, run_attempt
from .view import View

#: Statuses worth another attempt under ``--retries``: the episode's process failed, not the
#: agent's code.
RETRYABLE = ("crashed", "protocol_error")


@dataclass(frozen=True)
class RetryPolicy:
    retries: int
    """Extra attempts after the first, for ``crashed`` and ``protocol_error``."""
    retry_timeouts: bool
    """Whether ``timeout`` is retried too."""
    retries_infra: int = 3
    """Extra attempts for infrastructure failures (``infra: true``: a Ray worker or node
    lost), counted apart from ``retries``."""

    def again(
        self, status: str, attempt: int, *, infra: bool = False, infra_failures: int = 0
    ) -> bool:
        """Whether attempt number ``attempt`` (from 1) ending in ``status`` gets another;
        ``infra_failures``: how many of the unit's attempts so far, this one included, were
        infrastructure failures (``infra``: whether this one was)."""
        if infra:
            return infra_failures <= self.retries_infra
        retryable = status in RETRYABLE or (status == "timeout" and self.retry_timeouts)
        return retryable and attempt - infra_failures <= self.retries

    def done(self, last: dict[str, Any] | None) -> bool:
        """Whether an instance whose latest result line is ``last`` needs no more attempts.
        A ``setup_error`` is the run's configuration, not the instance: it runs again."""
        if last is None or last["status"] == "setup_error":
            return False
        return not self.again(
            last["status"],
            last["attempt"],
            infra=bool(last.get("infra")),
            infra_failures=int(last.get("infra_failures") or 0),
        )


class Backend(Protocol):
    async def run(self, job: Job) -> dict[str, Any]: ...


class LocalBackend:
    """Episodes as children of this process."""

    def __init__(self, key: SecretStr) -> None:
        self.key = key

    async def run(self, job: Job) -> dict[str, Any]:
        return await run_attempt(job, self.key)


class Scheduler:
    """Keeps ``concurrency`` instances going; each runs its attempts one after the other."""

    def __init__(
        self,
        records: Records,
        plan: Plan,
        results: Results,
        policy: RetryPolicy,
        backend: Backend,
        view: View,
        samples: int | None = None,
    ) -> None:
        self.records, self.plan, self.results = records, plan, results
        self.policy, self.backend, self.view = policy, backend, view
        self.samples = samples
        """``--samples``, if given: each line then says its sample."""
        self.interrupted = False
        self.failure: str | None = None
        self._work: anyio.CancelScope | None = None

    async def run(self, todo: list[tuple[Record, int]], concurrency: int) -> None:
        """Run each ``(record, sample)`` of ``todo`` until it has a final result."""
        self._work = anyio.CancelScope()
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._watch_signals)
            outer.start_soon(self.view.ticker)
            with self._work:
                slots = anyio.Semaphore(concurrency)
                try:
                    async with anyio.create_task_group() as tg:
                        for record, sample in todo:
                            await slots.acquire()
                            tg.start_soon(self._unit, record, sample, slots)
                finally:
                    await close_templates()  # with --preload; the batch's episodes are done
            outer.cancel_scope.cancel()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if self.interrupted:
                    self.view.note("still tearing the running episodes down")
                    continue
                self.interrupted = True
                self.view.note(
                    f"interrupted: launching no more; tearing down {self.view.running} running "
                    "episode(s); rerun the same command to resume"
                )
                self._stop()

    def _stop(self) -> None:
        assert self._work is not None
        self._work.cancel()

    async def _unit(self, record: Record, sample: int, slots: anyio.Semaphore) -> None:
        """The attempts at one sample of one record, one after the other."""
        try:
            last = self.results.last.get((record.instance_id, sample))
            attempt = last["attempt"] if last else 0
            infra_failures = int(last.get("infra_failures") or 0) if last else 0
            again = True
            while again:
                attempt += 1
                fields = await self._attempt(record, sample)
                infra = bool(fields.get("infra"))
                infra_failures += infra
                again = self.policy.again(
                    fields["status"], attempt, infra=infra, infra_failures=infra_failures
                )
                entry: dict[str, Any] = {"instance_id": record.instance_id}
                if self.samples is not None:
                    entry["sample"] = sample
                entry.update(attempt=attempt, final=False)
                entry.update(fields)
                entry.update(infra=infra, infra_failures=infra_failures)
                # Final exactly when a rerun would skip it: a setup error is not (the run's
                # configuration failed, and the next run tries again).
                entry["final"] = self.policy.done(entry)
                entry["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                with anyio.CancelScope(shield=True):
                    try:
                        await anyio.to_thread.run_sync(self.results.append, entry)
                    except OSError as exc:
                        self.failure = f"cannot write {self.results.path}: {exc.strerror}"
                        self._stop()
                        return
                self.view.finished_entry(entry)
        finally:
            slots.release()

    async def _attempt(self, record: Record, sample: int) -> dict[str, Any]:
        try:
            data = await anyio.to_thread.run_sync(self.records.read, record)
            job = self.plan.job(data, sample if self.samples is not None else None)
        except (OSError, ValueError) as exc:
            return failure("setup_error", "SetupError", str(exc))
        self.view.running += 1
        try:
            return await self.backend.run(job)
        finally:
            self.view.running -= 1
