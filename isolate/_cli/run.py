"""``isolate run``: one episode from a record or a replay bundle, with a live status line.

Exit status: 0 ok, 10 agent_error, 11 crashed, 12 timeout, 13 protocol_error, 14 setup_error;
2 bad usage; 130 interrupted (Ctrl-C or SIGTERM, after the tree is torn down).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
from pydantic import SecretStr

from .._core.episode.launcher import run_episode
from .._core.episode.prepare import default_episode_id
from .._core.model.config import EpisodeSpec
from .._core.model.outcome import EpisodeOutcome
from .._core.templates import close_templates
from ..workflow import default_log_dir
from .batch.job import write_bundle
from .options import (
    EXIT_CODES,
    EXIT_INTERRUPTED,
    UsageError,
    check_log_dir,
    preload_warning,
    read_api_key,
    read_secret_env,
    read_secrets,
)
from .signature import check_endpoint

# How often the status line is redrawn on a terminal, and a plain line printed elsewhere (s).
TTY_TICK_S = 0.5
PLAIN_TICK_S = 10.0


class RunInputs:
    """Everything one episode needs, from flags or from a replay bundle."""

    def __init__(
        self,
        record: dict[str, Any],
        spec: EpisodeSpec,
        kwargs: dict[str, Any],
        log_dir: Path,
        secret_env: dict[str, SecretStr],
        episode_id: str,
    ) -> None:
        self.record, self.spec, self.kwargs, self.log_dir = record, spec, kwargs, log_dir
        self.secret_env, self.episode_id = secret_env, episode_id
        self.secrets: dict[str, SecretStr] = {}
        """``--secret``: keyword arguments passed as secrets."""
        self.key_as: str | None = "override_api_key"
        """The keyword the key is passed as; None: the entrypoint takes none."""
        self.secret_vars: dict[str, str] = {}
        """``--secret``: keyword -> the environment variable of its value."""
        self.endpoint: tuple[str, str] | None = None
        """The model endpoint the episode is given, and where it comes from (a flag, the
        record, the bundle); None: none."""


def run_inputs(args: argparse.Namespace) -> RunInputs:
    log_dir = args.log_dir or Path(default_log_dir())
    if args.replay is not None:
        # The replay's bundle goes beside the bundle it replays: under its batch run's id.
        log_dir = args.log_dir or args.replay.absolute().parent
        given = [f for f in _AGENT_FLAGS if getattr(args, f) is not None]
        if args.record is not None or given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given) or "RECORD"
            raise UsageError(f"--replay re-runs the bundle as it was; drop {flags}")
        bundle = args.replay
        from .batch.job import bundle_changed

        try:
            changed = bundle_changed(bundle)
            if changed is not None:
                raise UsageError(f"{bundle} is not replayed: {changed} (digest.json)")
            record = json.loads((bundle / "record.json").read_text())
            spec = EpisodeSpec.model_validate_json((bundle / "spec.json").read_text())
            kwargs = json.loads((bundle / "kwargs.json").read_text())
            names = args.secret_env or _bundle_secret_env(bundle)
            key_as, secret_vars = _bundle_passing(bundle)
        except (OSError, ValueError) as exc:
            raise UsageError(f"{bundle} is not a replay bundle: {exc}") from None
        names_env = read_secret_env(names)
        inputs = RunInputs(record, spec, kwargs, log_dir, names_env, default_episode_id(record))
        inputs.key_as, inputs.secret_vars = key_as, secret_vars
        url = kwargs.get("override_base_url")
        if isinstance(url, str) and url:
            inputs.endpoint = (url, "the bundle's override_base_url")
        specs = [f"{name}={var}" for name, var in secret_vars.items()]
        inputs.secrets = read_secrets(specs, sys.stdin)
        return inputs

    if args.record is None:
        raise UsageError("give RECORD.json or --replay DIR")
    try:
        record = json.loads(args.record.read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {args.record}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"{args.record} is not valid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise UsageError(f"{args.record} must hold one JSON object (a record)")
    from .batch.job import RecordPlan  # one way to turn flags and a record into an episode

    plan = RecordPlan(args)
    episode_id = default_episode_id(record)
    try:
        spec, kwargs = plan.build(record, episode_id)
        secret_env = plan.secret_env(record)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    inputs = RunInputs(record, spec, kwargs, log_dir, secret_env, episode_id)
    inputs.secrets, inputs.key_as = plan.secrets, plan.key_as(spec)
    inputs.secret_vars = plan.secret_vars
    if plan.base_url:
        inputs.endpoint = (plan.base_url, "--base-url")
    elif isinstance(record.get("base_url"), str) and record["base_url"]:
        inputs.endpoint = (record["base_url"], 'the record\'s "base_url"')
    return inputs


def _bundle_passing(bundle: Path) -> tuple[str | None, dict[str, str]]:
    """How the bundle's episode got its secret keywords: the key's keyword (None: no key),
    and each ``--secret`` keyword's environment variable. A bundle from before this was
    written passed the key as ``override_api_key`` and nothing else."""
    path = bundle / "secrets.json"
    if not path.exists():
        return "override_api_key", {}
    found = json.loads(path.read_text())
    key_as = found.get("key_as") if isinstance(found, dict) else None
    secrets = found.get("secrets") if isinstance(found, dict) else None
    if not (key_as is None or isinstance(key_as, str)) or not isinstance(secrets, dict):
        raise ValueError("secrets.json must hold key_as and secrets")
    return key_as, {str(k): str(v) for k, v in secrets.items()}


def _bundle_secret_env(bundle: Path) -> list[str]:
    """The names of the bundle's secret_env (its values were never written)."""
    path = bundle / "secret_env.json"
    if not path.exists():
        return []
    names = json.loads(path.read_text())
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("secret_env.json must hold a list of names")
    return names


_AGENT_FLAGS = (
    "agent_root",
    "python",
    "entrypoint",
    "agent_type",
    "agent_config",
    "llm_model",
    "base_url",
    "kwargs",
    "timeout",
    "kill_grace",
    "cancel_grace",
    "exit_grace",
    "sandbox",
    "sandbox_write",
    "network",
    "preload",
)


def _bundle_of(inputs: RunInputs) -> Path:
    """Write the run's replay bundle, and say where it is; its path."""
    bundle = (inputs.log_dir / inputs.episode_id).absolute()
    check_log_dir(inputs.log_dir)
    passing = {"key_as": inputs.key_as, "secrets": inputs.secret_vars}
    write_bundle(
        bundle, inputs.record, inputs.spec, inputs.kwargs, sorted(inputs.secret_env), passing
    )
    print(f"isolate: episode {inputs.episode_id}, bundle {bundle}", file=sys.stderr)
    return bundle


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, default=str) + "\n")


async def run_command(args: argparse.Namespace) -> int:
    inputs = run_inputs(args)
    if inputs.endpoint is not None and not args.no_endpoint_check:
        await anyio.to_thread.run_sync(check_endpoint, *inputs.endpoint)
    # Asked for only now: not for an entrypoint that takes no key, nor before a usage error.
    key = read_api_key(args, sys.stdin) if inputs.key_as is not None else None
    episode_id = inputs.episode_id
    bundle = _bundle_of(inputs)
    spec = inputs.spec.model_copy(update={"log_dir": bundle})
    from .batch.job import episode_secrets

    outcome: EpisodeOutcome | None = None
    interrupted = False
    status = _Status(spec, bundle / f"{episode_id}.log", args.status_interval)
    episode_scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            nonlocal interrupted
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    if not interrupted:
                        interrupted = True
                        print(f"\nisolate: {_cancelling(spec)}", file=sys.stderr)
                        episode_scope.cancel()
                    elif status.pid is not None:
                        print("isolate: killing the episode's processes now", file=sys.stderr)
                        status.kill()

        def ended(result: EpisodeOutcome) -> None:
            nonlocal outcome
            outcome = result  # also when interrupted: then run_episode raises, not returns

        async def episode() -> None:
            with episode_scope:
                async with anyio.create_task_group() as inner:
                    inner.start_soon(status.run)
                    try:
                        await run_episode(
                            spec,
                            inputs.record,
                            kwargs=inputs.kwargs,
                            secrets=episode_secrets(inputs.secrets, inputs.key_as, key),
                            episode_id=episode_id,
                            on_start=status.started,
                            secret_env=inputs.secret_env,
                            on_end=ended,
                        )
                    finally:
                        status.clear()
                        inner.cancel_scope.cancel()
                        await close_templates()  # --preload: the one episode is over
            tg.cancel_scope.cancel()

        tg.start_soon(watch_signals)
        tg.start_soon(episode)

    if outcome is None:
        return EXIT_INTERRUPTED  # interrupted before the episode could begin
    return _finish(outcome, interrupted, bundle, status.killed)


def _finish(outcome: EpisodeOutcome, interrupted: bool, bundle: Path, killed: int) -> int:
    """Write the bundle's outcome.json, say how the episode ended; the exit status.
    ``killed``: the processes a second Ctrl-C killed before the teardown could count them."""
    if killed > outcome.killed:
        outcome = outcome.model_copy(update={"killed": killed})
    _write_json(bundle / "outcome.json", outcome.model_dump(mode="json"))
    if interrupted:
        print(f"isolate: interrupted: {outcome.summary()}", file=sys.stderr)
        print(f"isolate: outcome {bundle / 'outcome.json'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(outcome.model_dump_json())
    print(f"isolate: {outcome.summary()}", file=sys.stderr)
    if outcome.preload_refused is not None:
        print(f"isolate: {preload_warning(outcome.preload_refused)}", file=sys.stderr)
    if outcome.log_path:
        print(f"isolate: log {outcome.log_path}", file=sys.stderr)
    print(f"isolate: replay with: isolate run --replay {bundle}", file=sys.stderr)
    return EXIT_CODES[outcome.status]


def _cancelling(spec: EpisodeSpec) -> str:
    """What the first Ctrl-C (or SIGTERM) starts, and how to cut it short."""
    if spec.cancel_grace > 0:
        return (
            f"interrupted: the agent is cancelled and gets up to {spec.cancel_grace:g} s to "
            "clean up (--cancel-grace), then its processes are killed; interrupt again to "
            "kill them now"
        )
    return "interrupted: killing the episode's processes"


class _Status:
    """The live status line (a terminal) or periodic plain lines (anything else), on stderr."""

    def __init__(self, spec: EpisodeSpec, log_path: Path, interval: float | None) -> None:
        self.spec, self.log_path = spec, log_path
        self.pid: int | None = None
        self.killed = 0
        """Processes killed by a second Ctrl-C, the shim apart."""
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.interval = interval or (TTY_TICK_S if self.tty else PLAIN_TICK_S)

    def kill(self) -> None:
        """SIGKILL the episode's shim and every process of its tree now; the teardown that
        follows takes whatever escaped. ``killed`` counts those signalled here, the shim
        apart (as ``EpisodeOutcome.killed`` does)."""
        if self.pid is None:
            return
        try:
            shim = psutil.Process(self.pid)
            tree = shim.children(recursive=True)
        except psutil.Error:
            shim, tree = None, []
        procs = [p for p in [*reversed(tree), shim] if p is not None]
        for proc in procs:
            # All stopped first: none reacts to another's death (an agent's clean-up that ends
            # when its children do), and none dies with the shim's namespace uncounted.
            try:
                proc.suspend()
            except psutil.Error:
                pass
        for proc in procs:  # the deepest first, the shim last
            try:
                proc.kill()  # psutil checks the pid was not reused
            except psutil.Error:
                continue  # gone already
            self.killed += proc is not shim

    def started(self, pid: int) -> None:
        self.pid = pid
        print(f"isolate: started (pid {pid}), log {self.log_path}", file=sys.stderr)

    def _count(self) -> int:
        if self.pid is None:
            return 0
        try:
            return 1 + len(psutil.Process(self.pid).children(recursive=True))
        except psutil.Error:
            return 0

    def _last_line(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.interval)
            count = await anyio.to_thread.run_sync(self._count)
            last = await anyio.to_thread.run_sync(self._last_line)
            elapsed = time.monotonic() - self.start
            text = f"[{elapsed:7.1f}s / {self.spec.timeout:g}s] {count} procs | {last}"
            if self.tty:
                width = _columns() - 1
                sys.stderr.write("\r\x1b[2K" + text[:width])
            else:
                sys.stderr.write(f"isolate: {text[:200]}\n")
            sys.stderr.flush()

    def clear(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


def _columns() -> int:
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        columns = 0
    # A terminal that reports no size (a fresh pseudo-terminal) still gets a useful line.
    return columns if columns >= 20 else 100
