"""``isolate batch RECORDS.jsonl --out RESULTS.jsonl``: every record in its own contained
episode, N at once, each result appended (fsynced) as it finishes; rerun to resume.

Exit status: 0 every record has a final result; 1 some have none (a ``setup_error``, which a
rerun tries again, or RESULTS.jsonl could not be written); 2 bad usage, bad records or a Ray
cluster that cannot be reached, before anything runs; 130 interrupted (Ctrl-C or SIGTERM,
after the running episodes are torn down).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..install import install_hint, install_line
from ..options import (
    EXIT_INTERRUPTED,
    UsageError,
    agent_options,
    check_log_dir,
    endpoint_check_option,
    key_options,
    positive_seconds,
    read_api_key,
)
from .selection import count, id_list, shard

if TYPE_CHECKING:
    from .io import Record, Records, Results, Unit
    from .job import RecordPlan
    from .scheduler import Backend, RetryPolicy

#: At most this many invalid lines are listed; the rest are counted.
_SHOWN_ERRORS = 20
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def default_concurrency() -> int:
    """Two episodes per CPU, at most 32: agents mostly wait for the model, then run tests."""
    return min(32, 2 * (os.cpu_count() or 1))


def add_batch_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    batch = sub.add_parser(
        "batch",
        allow_abbrev=False,
        help="run every record of a JSONL file, with progress, resume and retries",
        description="Run every record of RECORDS.jsonl in its own episode, N at once; append "
        "one JSON line per finished attempt to RESULTS.jsonl. Rerunning the same command "
        "resumes. Exit status: 0 every record has a final result, 1 some have none, 2 usage "
        "or invalid records, 130 interrupted.",
    )
    batch.add_argument("records", type=Path, metavar="RECORDS.jsonl", help="one record a line")
    batch.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="RESULTS.jsonl",
        help="results, one line per finished attempt; appended to, and read back to resume",
    )
    _run_options(batch.add_argument_group("batch"))
    _pick_options(
        batch.add_argument_group(
            "evaluation (records chosen by --instance-ids, then --shard, then --limit)"
        )
    )
    agent_options(batch)
    key_options(batch)
    endpoint_check_option(batch)
    ray = batch.add_argument_group(f"ray (needs Ray: {install_hint('ray')})")
    ray.add_argument("--backend", choices=("local", "ray"), default="local")
    ray.add_argument("--ray-address", help="an existing cluster (default: start a local one)")
    ray.add_argument("--ray-local-cpus", type=int, help="CPUs of a local instance (default: all)")
    ray.add_argument("--ray-num-cpus", type=float, default=1.0, help="CPUs per episode (1)")
    ray.add_argument("--ray-memory", metavar="BYTES", help="memory per episode, e.g. 4GiB")


def _run_options(run: argparse._ArgumentGroup) -> None:
    run.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help=f"episodes at once (default: 2 per CPU, at most 32; here {default_concurrency()}; "
        "with --backend ray: the cluster's CPUs / --ray-num-cpus)",
    )
    run.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="K",
        help="extra attempts for crashed and protocol_error, never agent_error (default 0)",
    )
    run.add_argument(
        "--retries-infra",
        type=int,
        default=3,
        metavar="K",
        help="extra attempts for infrastructure failures (a Ray worker or node lost, the "
        "driver stopped mid-attempt), apart from --retries (default 3)",
    )
    run.add_argument(
        "--infra-runs",
        type=count,
        default=3,
        metavar="N",
        help="runs of this results file that an endpoint or entrypoint-signature failure may "
        "end for a record before it is final (default 3)",
    )
    run.add_argument("--retry-timeouts", action="store_true", help="retry timeouts too")
    run.add_argument(
        "--rerun",
        type=rerun_kinds,
        metavar="KINDS",
        help="run once more the records whose final result is one of KINDS, comma-separated: "
        "agent_error, crashed, timeout, protocol_error, ok, or infra (any infrastructure failure)",
    )
    run.add_argument(
        "--skip-invalid", action="store_true", help="skip invalid records instead of stopping"
    )
    run.add_argument(
        "--status-interval",
        type=positive_seconds,
        metavar="SECONDS",
        help="progress refresh (default 0.5 on a terminal, else a plain line every 30)",
    )


def _pick_options(pick: argparse._ArgumentGroup) -> None:
    pick.add_argument(
        "--samples",
        type=count,
        metavar="K",
        help="K attempts per record, each a sample of its own with its own episode; the "
        "summary shows pass@k",
    )
    pick.add_argument("--limit", type=count, metavar="N", help="only the first N records")
    pick.add_argument(
        "--instance-ids", type=id_list, metavar="A,B", help="only the records with these ids"
    )
    pick.add_argument(
        "--shard",
        type=shard,
        metavar="I/N",
        help="only the records whose position modulo N is I (from 0)",
    )


def add_report_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    report = sub.add_parser(
        "report",
        allow_abbrev=False,
        help="summarize a results file of isolate batch",
        description="Summarize RESULTS.jsonl, as `isolate batch --out` writes it, without "
        "running anything: the last line of each instance (and sample) is its result. "
        "With two files, compare them instance by instance: solved by one only, by both, "
        "by neither, status changes, and where their runs' metadata differ. "
        "Exit status: 0, 1 the plot could not be written, 2 bad usage or not a results file.",
    )
    report.add_argument(
        "results",
        type=Path,
        nargs="+",
        metavar="RESULTS.jsonl",
        help="the results file; two: compare their runs result by result",
    )
    report.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    report.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="also draw the results over time and their durations, as a PNG "
        f"(needs matplotlib: {install_hint('report')})",
    )


#: What ``--rerun`` may name: the final statuses, and ``infra``.
RERUN_KINDS = ("ok", "agent_error", "crashed", "timeout", "protocol_error", "infra")


def rerun_kinds(text: str) -> str:
    """An argparse type: a comma-separated list of :data:`RERUN_KINDS`."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    wrong = [k for k in kinds if k not in RERUN_KINDS]
    if not kinds or wrong:
        raise argparse.ArgumentTypeError(
            f"{(wrong or [text])[0]!r} is not one of {', '.join(RERUN_KINDS)}"
        )
    return ",".join(kinds)


def parse_size(text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise UsageError(f"--ray-memory: {text!r} is not a size such as 4GiB or 512M")
    scale = 1024 ** " kmgt".index(match.group(2).lower() or " ")
    return int(float(match.group(1)) * scale)


def _check_options(args: argparse.Namespace) -> None:
    if args.concurrency is not None and args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    if args.retries < 0:
        raise UsageError("--retries must be 0 or more")
    if args.retries_infra < 0:
        raise UsageError("--retries-infra must be 0 or more")
    if args.backend != "ray":
        given = [f for f in ("ray_address", "ray_local_cpus", "ray_memory") if getattr(args, f)]
        if given or args.ray_num_cpus != 1.0:
            flag = "--" + (given[0] if given else "ray_num_cpus").replace("_", "-")
            raise UsageError(f"{flag} needs --backend ray")
    args.ray_memory_bytes = parse_size(args.ray_memory) if args.ray_memory else None
    if args.ray_address and args.ray_local_cpus:
        raise UsageError("--ray-local-cpus is for a local instance; drop it or --ray-address")
    if args.out.absolute() == args.records.absolute():
        raise UsageError("--out must not be the records file")


def _load(args: argparse.Namespace, plan: RecordPlan) -> Records:
    from .io import Records

    try:
        records = Records(args.records)
    except OSError as exc:
        raise UsageError(f"cannot read {args.records}: {exc.strerror}") from None
    records.check(plan.check)
    errors = records.errors
    for error in errors[:_SHOWN_ERRORS]:
        word = "skipping " if args.skip_invalid else ""
        print(f"isolate: {word}{error}", file=sys.stderr)
    if len(errors) > _SHOWN_ERRORS:
        print(f"isolate: ... and {len(errors) - _SHOWN_ERRORS} more", file=sys.stderr)
    if errors and not args.skip_invalid:
        records.close()
        raise UsageError(
            f"{len(errors)} invalid record(s) in {args.records}; nothing was run. "
            "Fix them, or pass --skip-invalid"
        )
    return records


def _remove_if_empty(path: Path) -> None:
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass  # never made, or not ours to remove


def _backend(args: argparse.Namespace, key: Any) -> tuple[Backend, Any]:
    from .scheduler import LocalBackend

    if args.backend == "local":
        return LocalBackend(key), None
    try:
        from .ray_backend import RayBackend
    except ImportError as exc:
        raise UsageError(f"--backend ray needs Ray: {install_line('ray')} ({exc})") from None
    backend = RayBackend(
        key,
        address=args.ray_address,
        local_cpus=args.ray_local_cpus,
        num_cpus=args.ray_num_cpus,
        memory=args.ray_memory_bytes,
    )
    return backend, backend


def batch_command(args: argparse.Namespace) -> int:
    import anyio

    from .io import Results
    from .job import RecordPlan
    from .scheduler import RetryPolicy, Scheduler
    from .selection import select
    from .view import View, summary

    _check_options(args)
    rerun = frozenset((args.rerun or "").split(",")) - {""}
    policy = RetryPolicy(
        args.retries, args.retry_timeouts, args.retries_infra, rerun, args.infra_runs
    )
    plan = RecordPlan(args)
    records = _load(args, plan)
    try:
        chosen = select(records.items, args.instance_ids, args.shard, args.limit, args.records)
        check_log_dir(plan.log_dir)
        if args.backend == "ray" and importlib.util.find_spec("ray") is None:
            raise UsageError(f"--backend ray needs Ray: {install_line('ray')}")
    except UsageError:
        records.close()
        raise
    fresh = not args.out.exists()  # a results file this run made and left empty goes again
    results = Results(args.out)
    ray_backend: Any = None
    started = False
    try:
        run_id = _open_results(args, results, plan, policy)
        keys, todo, done = _units(args, chosen, results, policy)
        key = _key(args, plan) if todo else None
        backend, ray_backend = _backend(args, key)
        concurrency = args.concurrency
        if ray_backend is not None and todo:
            fit = _start_ray(args, ray_backend)
            if fit is None:
                return 2
            concurrency = concurrency or fit
        concurrency = concurrency or default_concurrency()
        if todo:
            _write_meta(args, plan, run_id, (len(chosen), len(keys), concurrency), key)
        view = View(len(keys), done, args.status_interval)
        scheduler = Scheduler(records, plan, results, policy, backend, view, args.samples)
        started = True
        with view:
            if todo:
                anyio.run(scheduler.run, todo, concurrency)
    finally:
        if ray_backend is not None:
            ray_backend.stop()
        results.close()
        records.close()
        if fresh and not started:
            _remove_if_empty(args.out)
    final = {u: e for u, e in results.last.items() if policy.done(e)}
    kept = {"samples": args.samples, "results": args.out, "log_dir": plan.log_dir, "run": run_id}
    summary(sys.stdout, keys, final, _not_final(results, policy), view, **kept)
    return _exit_status(keys, final, scheduler.failure, scheduler.interrupted)


def _not_final(results: Results, policy: RetryPolicy) -> dict[Unit, dict[str, Any]]:
    """The latest lines the next run runs again: setup errors, and infrastructure errors of an
    episode's own (an endpoint, a signature) that are not final."""
    return {
        u: e
        for u, e in results.last.items()
        if e["status"] == "setup_error" or (e.get("infra_kind") and not policy.done(e))
    }


def _open_results(
    args: argparse.Namespace, results: Results, plan: RecordPlan, policy: RetryPolicy
) -> str:
    """Open the results file, saying what an earlier, stopped run left unfinished in it.
    Returns the run's id (the one beside the results file: a resume; else a new one) and
    points ``plan`` at the run's bundle directory, ``<log-dir>/<run id>``."""
    from .io import BatchError
    from .runmeta import run_id_of
    from .scheduler import record_lost

    try:
        results.open()
    except BatchError as exc:
        raise UsageError(str(exc)) from None
    run_id = run_id_of(args.out)
    base = plan.log_dir
    plan.log_dir = log_dir = base / run_id
    if results.dropped:
        print(
            f"isolate: ignored a partial last line of {args.out} ({len(results.dropped)} "
            "bytes): the driver was stopped while writing it; that episode runs again",
            file=sys.stderr,
        )
    try:
        # The bundles of a run from before run ids lie in the log directory itself.
        lost = sum(record_lost(results, where, policy) for where in (log_dir, base))
    except OSError as exc:
        raise UsageError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    if lost:
        print(
            f"isolate: {lost} attempt(s) of an earlier run had no line in {args.out} (its "
            f"driver was stopped): recorded from their bundles in {log_dir}",
            file=sys.stderr,
        )
    return run_id


def _write_meta(
    args: argparse.Namespace,
    plan: RecordPlan,
    run_id: str,
    sizes: tuple[int, int, int],
    key: Any,
) -> None:
    """Write (or, on a resume, add to) the run's metadata beside the results file; the key
    and the ``--secret-env`` values are kept out of it."""
    from .runmeta import session, write_meta

    spec, kwargs = plan.build(
        {} if plan.base_url else {"base_url": "http://127.0.0.1/v1"}, root=False
    )
    if not plan.base_url:
        kwargs["override_base_url"] = None  # each record gives its own
    now = session(
        args,
        spec.model_dump(mode="json"),
        kwargs,
        log_dir=plan.log_dir,
        sizes=sizes,
    )
    hidden = [key.get_secret_value()] if key is not None else []
    hidden += [v.get_secret_value() for v in plan.secret_env({}).values()]
    try:
        write_meta(args.out, run_id, now, hidden)
    except OSError as exc:
        raise UsageError(f"cannot write the run's metadata: {exc.strerror or exc}") from None


def _units(
    args: argparse.Namespace, chosen: list[Record], results: Results, policy: RetryPolicy
) -> tuple[list[Unit], list[tuple[Record, int]], Counter[str]]:
    """Every (instance, sample) of the run, those still to run, and the final statuses of the
    others (a resumed run: said on stderr)."""
    samples = args.samples or 1
    units = [(r, n) for r in chosen for n in range(samples)]
    keys = [(r.instance_id, n) for r, n in units]
    todo = [(r, n) for r, n in units if policy.wanted(results.last.get((r.instance_id, n)))]
    pending = {(r.instance_id, n) for r, n in todo}
    done = Counter(results.last[u]["status"] for u in keys if u not in pending)
    again = sum(policy.done(results.last.get(u)) for u in pending)
    if done or again:
        what = "samples" if args.samples else "instances"
        rerun = f" ({again} of them again: --rerun {args.rerun})" if again else ""
        print(
            f"isolate: resuming: {sum(done.values()) + again} of {len(keys)} {what} already "
            f"have a final result in {args.out}; {len(todo)} to run{rerun}",
            file=sys.stderr,
        )
    return keys, todo, done


def _key(args: argparse.Namespace, plan: RecordPlan) -> Any:
    """Before a run: the endpoint checked (unless told not to), then the key read, when the
    entrypoint takes one (else None)."""
    if plan.base_url and args.backend == "local" and not args.no_endpoint_check:
        from ..signature import check_endpoint

        check_endpoint(plan.base_url)
    return read_api_key(args, sys.stdin) if plan.wants_key else None


def _start_ray(args: argparse.Namespace, ray_backend: Any) -> int | None:
    """Start Ray; the concurrency that fits it, or None once the error is said."""
    try:
        fit: int = ray_backend.start()
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError...
        ray_backend.stop()
        where = args.ray_address or "a local instance"
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        hint = (
            "; check the address, and a cluster's token auth (RAY_AUTH_MODE=token "
            "with RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
            if args.ray_address
            else ""
        )
        print(
            f"isolate: error: cannot start Ray ({where}): {first or type(exc).__name__}{hint}",
            file=sys.stderr,
        )
        return None
    return fit


def _exit_status(
    ids: list[Unit], final: dict[Unit, dict[str, Any]], failure: str | None, interrupted: bool
) -> int:
    if failure:
        print(f"isolate: error: {failure}", file=sys.stderr)
        return 1
    if interrupted:
        return EXIT_INTERRUPTED
    missing = [i for i in ids if i not in final or final[i]["status"] == "setup_error"]
    if missing:
        what = "instance(s)" if all(n == 0 for _, n in ids) else "sample(s)"
        print(
            f"isolate: {len(missing)} {what} without a final result (a setup_error or an "
            "error of the infrastructure runs again on the next run)",
            file=sys.stderr,
        )
        return 1
    return 0
