"""The ``isolate`` command line: ``run`` (and ``--replay``), ``batch``, ``report``, ``doctor``,
``demo``, ``scripted-llm``.

Exit status of ``isolate run``: 0 ok, 10 agent_error, 11 crashed, 12 timeout, 13 protocol_error,
14 setup_error; 2 bad usage; 130 interrupted (Ctrl-C or SIGTERM, after the tree is torn down).
Any command: 141 when the reader of its output went away (as if killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from .._core.model.errors import ArgumentError
from .batch import add_batch_parser, add_report_parser
from .install import install_hint
from .options import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    UsageError,
    agent_options,
    endpoint_check_option,
    key_options,
    port_number,
    positive_seconds,
)
from .run import PLAIN_TICK_S, TTY_TICK_S, run_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="isolate",
        allow_abbrev=False,  # "--api-key" must not be taken for "--api-key-file"
        description="Run coding-agent episodes in fresh processes; always get the tree back.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"isolate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    add_batch_parser(sub)
    add_report_parser(sub)
    _add_doctor_parser(sub)
    _add_demo_parsers(sub)
    return parser


def _add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    agent_options(run)
    key_options(run)
    endpoint_check_option(run)
    run.add_argument(
        "--status-interval",
        type=positive_seconds,
        metavar="SECONDS",
        help=f"status refresh (default {TTY_TICK_S:g} on a terminal, else {PLAIN_TICK_S:g})",
    )


def _add_doctor_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser(
        "doctor",
        allow_abbrev=False,
        help="check an agent checkout without running an episode",
        description="Check what this machine gives an episode (containment layers, sandbox, "
        "network) and whether the agent checkout imports and takes the workflow's arguments, "
        "without running an episode. One verdict a line. Exit status: 0 every check passed, "
        "1 one failed, 2 usage.",
    )
    doctor.add_argument("--agent-root", type=Path, help="agent checkout (default: as `run`)")
    doctor.add_argument("--python", help="the agent's interpreter (default: this one)")
    doctor.add_argument("--entrypoint", type=_entrypoint, help="module:function to check")
    doctor.add_argument(
        "--containment",
        default="auto",
        type=_containment,
        help="containment to check, as EpisodeSpec.containment (default: auto)",
    )
    doctor.add_argument(
        "--preload",
        action="store_true",
        help="also start a preloaded template of the agent: is it used, or why not",
    )


def _add_demo_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="run real episodes against a scripted LLM on 127.0.0.1",
        description="Run three real episodes of the packaged demo agent against a scripted LLM "
        "on 127.0.0.1: one solves its task, one hangs and is timed out with its tree, one has a "
        "key the server never issued. With --agent mini-swe-agent, four episodes of "
        "mini-swe-agent's own loop instead: fresh, preloaded twice, and one that hangs. Needs no "
        "model, key or network. Exit status: 0 when all end as expected, 1 otherwise, 2 when "
        "the agent is not installed.",
    )
    demo.add_argument(
        "--agent",
        choices=("demo", "mini-swe-agent"),
        default="demo",
        help="the packaged demo agent (default), or mini-swe-agent (needs it installed: "
        f"{install_hint('mini-swe-agent')})",
    )
    llm = sub.add_parser(
        "scripted-llm",
        allow_abbrev=False,
        help="serve the demo's scripted LLM on 127.0.0.1, to try `isolate run` with",
        description="Serve the demo's scripted chat-completions replies on 127.0.0.1 until "
        "Ctrl-C. Accepts any API key; prints the `isolate run` commands to try.",
    )
    llm.add_argument("--port", type=port_number, default=0, help="TCP port (default: a free one)")


def _entrypoint(value: str) -> str:
    """``--entrypoint`` as ``EpisodeSpec`` takes it: the same words for the same mistake."""
    from .._core.model.config import EpisodeSpec

    try:
        return EpisodeSpec._check_entrypoint(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _containment(value: str) -> str:
    from .._core.model.config import check_containment

    try:
        return check_containment(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _command(args: argparse.Namespace) -> int:
    if args.command == "run":
        return anyio.run(run_command, args)
    if args.command == "batch":
        from .batch import batch_command

        return batch_command(args)
    if args.command == "report":
        from .batch.report import report_command

        return report_command(args)
    if args.command == "doctor":
        from .doctor import doctor

        return doctor(args.agent_root, args.python, args.entrypoint, args.containment, args.preload)
    if args.command == "scripted-llm":
        from .demo.serve import scripted_llm

        return scripted_llm(args.port)
    if args.agent == "mini-swe-agent":
        from .demo.mini import mini_demo

        return anyio.run(mini_demo)
    from .demo import demo

    return anyio.run(demo)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = _command(args)
        sys.stdout.flush()  # here, so that a reader gone by now is caught below too
        return status
    except UsageError as exc:
        print(f"isolate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ArgumentError as exc:
        print(f"isolate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`isolate doctor | head -3`): stop as quietly as a process
        # killed by SIGPIPE would, and keep the interpreter's exit flush from complaining.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
