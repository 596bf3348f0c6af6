"""Running a batch: the retry rules, and the scheduler that keeps N instances going and
writes each attempt's result as it comes."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
from pydantic import SecretStr

from ..._core.episode.infra import ENTRYPOINT_SIGNATURE
from ..._core.model.outcome import EpisodeOutcome
from ..._core.templates import close_templates
from .io import Record, Records, Results, Unit
from .job import (
    ATTEMPT_FILE,
    Job,
    RecordPlan,
    failure,
    keep_fields,
    outcome_fields,
    run_attempt,
)
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
    lost, the driver stopped mid-attempt), counted apart from ``retries``."""

    rerun: frozenset[str] = frozenset()
    """``--rerun``: the statuses (and ``infra``) whose final results run once more."""
    infra_runs: int = 3
    """``--infra-runs``: the runs of a results file an episode's own infrastructure error
    (``infra_kind``: its endpoint, its entrypoint's signature) may end for a unit before that
    result is final: an agent that raises such errors itself is not run again forever."""

    def again(
        self,
        status: str,
        attempt: int,
        *,
        infra: bool = False,
        infra_failures: int = 0,
        infra_kind: str | None = None,
    ) -> bool:
        """Whether attempt number ``attempt`` (from 1) ending in ``status`` gets another;
        ``infra_failures``: how many of the unit's attempts so far, this one included, were
        infrastructure failures (``infra``: whether this one was; ``infra_kind``: the kind of
        an episode's own, which an entrypoint's signature would only repeat)."""
        if infra_kind == ENTRYPOINT_SIGNATURE:
            return False
        if infra:
            return infra_failures <= self.retries_infra
        retryable = status in RETRYABLE or (status == "timeout" and self.retry_timeouts)
        return retryable and attempt - infra_failures <= self.retries

    def done(self, last: dict[str, Any] | None) -> bool:
        """Whether an instance whose latest result line is ``last`` needs no more attempts.
        A ``setup_error`` is the run's configuration, not the instance: it runs again; so does
        an episode that the infrastructure failed (``infra_kind``: its endpoint, its
        entrypoint's signature), which says nothing of the agent, unless it ended
        ``infra_runs`` runs (:meth:`gave_up`)."""
        if last is None or last["status"] == "setup_error":
            return False
        if last.get("infra_kind"):
            return self.gave_up(last)
        return not self.again(
            last["status"],
            last["attempt"],
            infra=bool(last.get("infra")),
            infra_failures=int(last.get("infra_failures") or 0),
        )

    def gave_up(self, last: dict[str, Any]) -> bool:
        """Whether ``last``, an episode's own infrastructure error, is final: the runs that
        ended with one for its unit (``infra_runs`` of the line) reached the cap."""
        return bool(last.get("infra_kind")) and int(last.get("infra_runs") or 0) >= (
            self.infra_runs
        )

    def wanted(self, last: dict[str, Any] | None) -> bool:
        """Whether a run starting now runs the unit whose latest line is ``last``: it is not
        done, or its final status is one ``--rerun`` names (``infra``: any infrastructure
        failure)."""
        if not self.done(last):
            return True
        assert last is not None
        return last["status"] in self.rerun or ("infra" in self.rerun and bool(last.get("infra")))


class Backend(Protocol):
    async def run(
        self, job: Job, on_cut: Callable[[dict[str, Any]], object] | None = None
    ) -> dict[str, Any]: ...


class LocalBackend:
    """Episodes as children of this process."""

    def __init__(self, key: SecretStr) -> None:
        self.key = key

    async def run(
        self, job: Job, on_cut: Callable[[dict[str, Any]], object] | None = None
    ) -> dict[str, Any]:
        return await run_attempt(job, self.key, on_cut)


#: Seconds before the first retry of an attempt whose endpoint failed it; doubled for each
#: further one, up to :data:`INFRA_BACKOFF_MAX_S`: an endpoint that is restarting gets time.
INFRA_BACKOFF_S = 1.0
INFRA_BACKOFF_MAX_S = 30.0


def infra_backoff(failures: int) -> float:
    """Seconds to wait before another attempt after ``failures`` infrastructure failures."""
    return float(min(INFRA_BACKOFF_MAX_S, INFRA_BACKOFF_S * 2 ** max(0, failures - 1)))


def driver_cut(fields: dict[str, Any], how: str) -> dict[str, Any]:
    """The fields of an attempt the driver's end cut short: an infrastructure failure
    (``crashed``, ``infra``), with what its outcome says (duration, log, kills)."""
    cut = dict(fields)
    first = (fields.get("error") or {}).get("message")
    cut.update(
        status="crashed",
        reward=None,
        infra=True,
        error={"type": "DriverStopped", "message": how + (f" ({first})" if first else "")},
    )
    return cut


class Scheduler:
    """Keeps ``concurrency`` instances going; each runs its attempts one after the other."""

    def __init__(
        self,
        records: Records,
        plan: RecordPlan,
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
            infra_runs = int(last.get("infra_runs") or 0) if last else 0
            again = True
            while again:
                attempt += 1
                cut: list[dict[str, Any]] = []
                try:
                    fields = await self._attempt(record, sample, cut.append)
                except anyio.get_cancelled_exc_class():
                    if cut:  # the driver's Ctrl-C: the attempt's line says so
                        how = "the driver was interrupted while this attempt ran"
                        entry = line_of(
                            self.policy,
                            (record.instance_id, sample),
                            self.samples is not None,
                            attempt,
                            driver_cut(cut[0], how),
                            infra_failures + 1,
                            infra_runs,
                        )
                        with anyio.CancelScope(shield=True):
                            await self._write(entry)
                    raise
                infra_failures += bool(fields.get("infra") or fields.get("infra_kind"))
                entry = line_of(
                    self.policy,
                    (record.instance_id, sample),
                    self.samples is not None,
                    attempt,
                    fields,
                    infra_failures,
                    infra_runs,
                )
                again = not entry["final"] and self.policy.again(
                    entry["status"],
                    attempt,
                    infra=entry["infra"],
                    infra_failures=infra_failures,
                    infra_kind=entry.get("infra_kind"),
                )
                if again and entry.get("infra_kind"):
                    await anyio.sleep(infra_backoff(infra_failures))
                with anyio.CancelScope(shield=True):
                    if not await self._write(entry, again):
                        return
        finally:
            slots.release()

    async def _write(self, entry: dict[str, Any], again: bool = True) -> bool:
        """Append one result line; False (and the run stops) when it cannot be written."""
        try:
            await anyio.to_thread.run_sync(self.results.append, entry)
        except OSError as exc:
            self.failure = f"cannot write {self.results.path}: {exc.strerror}"
            self._stop()
            return False
        self.view.finished_entry(entry, again)
        return True

    async def _attempt(
        self, record: Record, sample: int, on_cut: Callable[[dict[str, Any]], object]
    ) -> dict[str, Any]:
        try:
            data = await anyio.to_thread.run_sync(self.records.read, record)
            job = self.plan.job(data, sample if self.samples is not None else None)
        except (OSError, ValueError) as exc:
            return failure("setup_error", "SetupError", str(exc))
        self.view.started((record.instance_id, sample))
        try:
            return await self.backend.run(job, on_cut)
        finally:
            self.view.running -= 1


def line_of(
    policy: RetryPolicy,
    unit: Unit,
    with_sample: bool,
    attempt: int,
    fields: dict[str, Any],
    infra_failures: int,
    infra_runs: int = 0,
) -> dict[str, Any]:
    """The result line of attempt number ``attempt`` at ``unit``; ``infra_runs``: the runs
    before this one that an episode's own infrastructure error ended for the unit (the line
    counts this run too when it is one)."""
    entry: dict[str, Any] = {"instance_id": unit[0]}
    if with_sample:
        entry["sample"] = unit[1]
    entry.update(attempt=attempt, final=False)
    entry.update(fields)
    infra = bool(fields.get("infra") or fields.get("infra_kind"))
    entry.update(infra=infra, infra_failures=infra_failures)
    entry["infra_runs"] = infra_runs + bool(entry.get("infra_kind"))
    # Final exactly when a rerun would skip it: a setup error is not (the run's configuration
    # failed, and the next run tries again).
    entry["final"] = policy.done(entry)
    entry["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return entry


def lost_attempts(results: Results, log_dir: Path) -> list[tuple[float, Path, dict[str, Any]]]:
    """The attempts of ``results`` that began but have no line: a driver killed while they
    ran (or between an attempt's end and its line). From each bundle's ``attempt.json``,
    oldest first: (start, bundle, what ``attempt.json`` says)."""
    mine = str(results.path.resolve())  # as attempt.json has it: the same file by any path
    found = []
    try:
        bundles = list(log_dir.iterdir())
    except OSError:
        return []
    for bundle in bundles:
        if bundle.name in results.episode_ids:
            continue
        try:
            attempt = json.loads((bundle / ATTEMPT_FILE).read_text())
        except (OSError, ValueError):
            continue  # not an attempt of a batch, or of one from before attempt files
        if not isinstance(attempt, dict) or attempt.get("results") != mine:
            continue
        found.append((float(attempt.get("started_at") or 0.0), bundle, attempt))
    return sorted(found, key=lambda item: item[0])


def record_lost(results: Results, log_dir: Path, policy: RetryPolicy) -> int:
    """Give every lost attempt of ``results`` (see :func:`lost_attempts`) its line: the
    outcome its bundle kept, or else an infrastructure failure (``DriverStopped``) with the
    true duration and log. Returns how many. Blocking: call before the run."""
    count = 0
    for started, bundle, attempt in lost_attempts(results, log_dir):
        unit = (str(attempt.get("instance_id", "")), int(attempt.get("sample") or 0))
        last = results.last.get(unit)
        infra_failures = int(last.get("infra_failures") or 0) if last else 0
        log = bundle / f"{bundle.name}.log"
        try:
            outcome = EpisodeOutcome.model_validate_json((bundle / "outcome.json").read_bytes())
        except (OSError, ValueError):
            outcome = None
        if outcome is not None:  # it ended; the driver went before its line was written
            fields = outcome_fields(outcome)
            fields.update(keep_fields(bundle, outcome))
            infra_failures += outcome.infra is not None
        else:
            fields = driver_cut(
                failure("crashed", "DriverStopped", ""),
                "the driver stopped while this attempt ran; its episode ended with it",
            )
            try:
                ended = max(p.stat().st_mtime for p in (bundle, log) if p.exists())
            except OSError:
                ended = started
            fields.update(
                episode_id=bundle.name,
                duration_s=round(max(0.0, ended - started), 3),
                log_path=str(log) if log.exists() else None,
            )
            infra_failures += 1
        entry = line_of(
            policy,
            unit,
            attempt.get("sample") is not None,
            (last["attempt"] if last else 0) + 1,
            fields,
            infra_failures,
            int(last.get("infra_runs") or 0) if last else 0,
        )
        entry["recovered"] = True
        results.append(entry)
        count += 1
    return count
