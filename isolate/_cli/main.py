"""The ``isolate`` command line: ``run`` (and ``--replay``), ``batch``, ``doctor``, ``demo``.

Exit status of ``isolate run``: 0 ok, 10 agent_error, 11 crashed, 12 timeout, 13 protocol_error,
14 setup_error; 2 bad usage; 130 interrupted (Ctrl-C or SIGTERM, after the tree is torn down).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import anyio
import psutil
from pydantic import SecretStr

from .._core.config import EpisodeSpec
from .._core.errors import ArgumentError
from .._core.launcher import _default_episode_id, run_episode
from .._core.outcome import EpisodeOutcome

EXIT_CODES = {
    "ok": 0,
    "agent_error": 10,
    "crashed": 11,
    "timeout": 12,
    "protocol_error": 13,
    "setup_error": 14,
}
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# How often the status line is redrawn on a terminal, and a plain line printed elsewhere (s).
_TTY_TICK_S = 0.5
_PLAIN_TICK_S = 10.0


class UsageError(Exception):
    """Bad command-line input; the message is shown as is, with exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="isolate",
        allow_abbrev=False,  # "--api-key" must not be taken for "--api-key-file"
        description="Run coding-agent episodes in fresh processes; always get the tree back.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        allow_abbrev=False,
        help="run one episode from a record, or replay a bundle",
        description="Run one episode from RECORD.json, as the AReaL workflow would. "
        "Exit status: 0 ok, 10 agent_error, 11 crashed, 12 timeout, 13 protocol_error, "
        "14 setup_error, 2 usage, 130 interrupted.",
    )
    run.add_argument("record", nargs="?", type=Path, help="JSON file holding one record")
    run.add_argument("--replay", type=Path, metavar="DIR", help="re-run a replay bundle")
    _agent_options(run)
    _key_options(run)
    run.add_argument(
        "--status-interval",
        type=float,
        metavar="SECONDS",
        help=f"status refresh (default {_TTY_TICK_S:g} on a terminal, else {_PLAIN_TICK_S:g})",
    )

    from .batch import add_batch_parser  # here: _batch builds on this module's options

    add_batch_parser(sub)

    doctor = sub.add_parser(
        "doctor", allow_abbrev=False, help="check an agent checkout without running an episode"
    )
    doctor.add_argument("--agent-root", type=Path, help="agent checkout (default: as `run`)")
    doctor.add_argument("--python", help="the agent's interpreter (default: this one)")
    doctor.add_argument("--entrypoint", help="module:function to check")

    sub.add_parser("demo", help="run two real episodes against a scripted LLM on 127.0.0.1")
    return parser


def _agent_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("agent (defaults resolve as SWEAgentWorkflow's)")
    group.add_argument("--agent-root", help="checkout; else AWEAGENT_ROOT, ..., ../AReaL-SWEAgent")
    group.add_argument("--python", help="the agent's interpreter (default: this one)")
    group.add_argument("--entrypoint", help="module:function (default: aweagent's lifecycle)")
    group.add_argument("--agent-type", help="swe, cc, oh, opencode, codex, ... (default: swe)")
    group.add_argument("--agent-config", help="agent config name (default: per agent type)")
    group.add_argument("--llm-model", help="model name (default: env LLM_MODEL)")
    group.add_argument("--base-url", help="OpenAI-compatible endpoint the agent calls")
    group.add_argument("--timeout", type=float, help="seconds (default: 1800)")
    group.add_argument("--kill-grace", type=float, help="seconds from SIGTERM to SIGKILL (5)")
    group.add_argument(
        "--log-dir", type=Path, help="where bundles go (default: env LOG_DIR, ./logs)"
    )


def _key_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "api key (never on the command line; order: file, env name, OPENAI_API_KEY, prompt, "
        "'dummy')"
    )
    group.add_argument("--api-key-file", type=Path, metavar="PATH", help="read the key from PATH")
    group.add_argument("--api-key-env", metavar="NAME", help="read the key from env variable NAME")


def read_api_key(args: argparse.Namespace, stdin: TextIO) -> SecretStr:
    if args.api_key_file is not None:
        try:
            text = args.api_key_file.read_text().strip()
        except OSError as exc:
            raise UsageError(
                f"cannot read --api-key-file {args.api_key_file}: {exc.strerror}"
            ) from None
        if not text:
            raise UsageError(f"--api-key-file {args.api_key_file} is empty")
        return SecretStr(text)
    if args.api_key_env is not None:
        value = os.environ.get(args.api_key_env)
        if not value:
            raise UsageError(f"--api-key-env: environment variable {args.api_key_env} is not set")
        return SecretStr(value)
    if os.environ.get("OPENAI_API_KEY"):
        return SecretStr(os.environ["OPENAI_API_KEY"])
    if stdin.isatty():
        return SecretStr(getpass.getpass("API key (not echoed): ") or "dummy")
    return SecretStr("dummy")


# --- run ------------------------------------------------------------------------------------


class Prepared:
    """Everything one episode needs, from flags or from a replay bundle."""

    def __init__(
        self, record: dict[str, Any], spec: EpisodeSpec, kwargs: dict[str, Any], log_dir: Path
    ) -> None:
        self.record, self.spec, self.kwargs, self.log_dir = record, spec, kwargs, log_dir


def prepare_run(args: argparse.Namespace) -> Prepared:
    log_dir = args.log_dir or Path(os.environ.get("LOG_DIR", "./logs"))
    if args.replay is not None:
        given = [f for f in _AGENT_FLAGS if getattr(args, f) is not None]
        if args.record is not None or given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given) or "RECORD"
            raise UsageError(f"--replay re-runs the bundle as it was; drop {flags}")
        bundle = args.replay
        try:
            record = json.loads((bundle / "record.json").read_text())
            spec = EpisodeSpec.model_validate_json((bundle / "spec.json").read_text())
            kwargs = json.loads((bundle / "kwargs.json").read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{bundle} is not a replay bundle: {exc}") from None
        return Prepared(record, spec, kwargs, log_dir)

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
    from .batch.job import Plan  # one way to turn flags and a record into an episode

    try:
        spec, kwargs = Plan(args).build(record)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return Prepared(record, spec, kwargs, log_dir)


_AGENT_FLAGS = (
    "agent_root",
    "python",
    "entrypoint",
    "agent_type",
    "agent_config",
    "llm_model",
    "base_url",
    "timeout",
    "kill_grace",
)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, default=str) + "\n")


async def run_command(args: argparse.Namespace, key: SecretStr) -> int:
    prep = prepare_run(args)
    episode_id = _default_episode_id(prep.record)
    bundle = (prep.log_dir / episode_id).absolute()
    spec = prep.spec.model_copy(update={"log_dir": bundle})
    bundle.mkdir(parents=True, exist_ok=True)
    _write_json(bundle / "record.json", prep.record)
    (bundle / "spec.json").write_text(prep.spec.model_dump_json(indent=2) + "\n")
    _write_json(bundle / "kwargs.json", prep.kwargs)
    print(f"isolate: episode {episode_id}, bundle {bundle}", file=sys.stderr)

    outcome: EpisodeOutcome | None = None
    interrupted = False
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            nonlocal interrupted
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    interrupted = True
                    print("\nisolate: interrupted, tearing the episode down", file=sys.stderr)
                    tg.cancel_scope.cancel()
                    return

        async def episode() -> None:
            nonlocal outcome
            status = _Status(spec, bundle / f"{episode_id}.log", args.status_interval)
            async with anyio.create_task_group() as inner:
                inner.start_soon(status.run)
                try:
                    outcome = await run_episode(
                        spec,
                        prep.record,
                        kwargs=prep.kwargs,
                        secrets={"override_api_key": key},
                        episode_id=episode_id,
                        on_start=status.started,
                    )
                finally:
                    status.clear()
                    inner.cancel_scope.cancel()
            tg.cancel_scope.cancel()

        tg.start_soon(watch_signals)
        tg.start_soon(episode)

    if interrupted or outcome is None:
        return EXIT_INTERRUPTED
    _write_json(bundle / "outcome.json", outcome.model_dump(mode="json"))
    print(outcome.model_dump_json())
    print(f"isolate: {outcome.summary()}", file=sys.stderr)
    if outcome.log_path:
        print(f"isolate: log {outcome.log_path}", file=sys.stderr)
    print(f"isolate: replay with: isolate run --replay {bundle}", file=sys.stderr)
    return EXIT_CODES[outcome.status]


class _Status:
    """The live status line (a terminal) or periodic plain lines (anything else), on stderr."""

    def __init__(self, spec: EpisodeSpec, log_path: Path, interval: float | None) -> None:
        self.spec, self.log_path = spec, log_path
        self.pid: int | None = None
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.interval = interval or (_TTY_TICK_S if self.tty else _PLAIN_TICK_S)

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


# --- entry point ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            key = read_api_key(args, sys.stdin)
            return anyio.run(run_command, args, key)
        if args.command == "batch":
            from .batch import batch_command

            return batch_command(args)
        if args.command == "doctor":
            from .doctor import doctor

            return doctor(args.agent_root, args.python, args.entrypoint)
        from .demo import demo

        return anyio.run(demo)
    except UsageError as exc:
        print(f"isolate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ArgumentError as exc:
        print(f"isolate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
