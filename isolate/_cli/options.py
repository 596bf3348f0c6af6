"""What the subcommands share: exit statuses, the usage error, the agent and key options."""

from __future__ import annotations

import argparse
import getpass
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from pydantic import SecretStr

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
#: 128 + SIGPIPE: what a shell reports for a process killed by a closed pipe.
EXIT_BROKEN_PIPE = 141


def preload_warning(reason: str) -> str:
    """The line that says, once per reason, why ``--preload`` gave no template."""
    from .._core.templates import remedy

    text = f"warning: --preload gave no template ({reason}); episodes start fresh"
    fix = remedy(reason)
    return f"{text}. {fix[0].upper()}{fix[1:]}" if fix else text


class UsageError(Exception):
    """Bad command-line input; the message is shown as is, with exit status 2."""


def check_log_dir(path: Path) -> None:
    """Say, as a UsageError, why bundles cannot be written under ``path`` (``--log-dir``).
    Leaves nothing behind: directories made for the check are removed again."""
    made: list[Path] = []
    try:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(20, "not a directory")
        missing = path
        while not missing.exists():
            made.append(missing)
            missing = missing.parent
        path.mkdir(parents=True, exist_ok=True)
        trial = path / f".isolate-write-check.{os.getpid()}"
        trial.touch()
        trial.unlink()
    except OSError as exc:
        raise UsageError(
            f"--log-dir {path}: {exc.strerror or exc}; give a directory this user can write "
            "(default: env LOG_DIR, else ./logs)"
        ) from None
    finally:
        for directory in made:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                pass


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 for any free one."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return port


def _seconds(text: str, least: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (least == "greater than 0" and value == 0):
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds {least}, not {text!r}"
        )
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: finite seconds > 0 (argparse names the flag in its message)."""
    return _seconds(text, "greater than 0")


def seconds(text: str) -> float:
    """An argparse type: finite seconds >= 0."""
    return _seconds(text, "of 0 or more")


_BASE_URL_HELP = (
    "OpenAI-compatible endpoint the agent calls (needed by the default entrypoint, or one "
    "that requires override_base_url)"
)
_KWARGS_HELP = (
    "more keyword arguments for the entrypoint, a JSON object (never a secret: see --secret)"
)


def agent_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("agent (defaults resolve as SWEAgentWorkflow's)")
    group.add_argument("--agent-root", help="checkout; else AWEAGENT_ROOT, ..., ../AReaL-SWEAgent")
    group.add_argument("--python", help="the agent's interpreter (default: this one)")
    group.add_argument("--entrypoint", help="module:function (default: aweagent's lifecycle)")
    group.add_argument("--agent-type", help="swe, cc, oh, opencode, codex, ... (default: swe)")
    group.add_argument("--agent-config", help="agent config name (default: per agent type)")
    group.add_argument("--llm-model", help="model name (default: env LLM_MODEL)")
    group.add_argument("--base-url", help=_BASE_URL_HELP)
    group.add_argument("--kwargs", type=json_object, metavar="JSON", help=_KWARGS_HELP)
    group.add_argument("--timeout", type=positive_seconds, help="seconds (default: 1800)")
    group.add_argument("--kill-grace", type=seconds, help="seconds from SIGTERM to SIGKILL (5)")
    group.add_argument(
        "--cancel-grace",
        type=seconds,
        help="seconds a timed-out or cancelled agent gets to run its clean-up (30)",
    )
    group.add_argument(
        "--exit-grace",
        type=seconds,
        help="seconds for the agent's normal exit after its result (10)",
    )
    group.add_argument(
        "--log-dir", type=Path, help="where bundles go (default: env LOG_DIR, ./logs)"
    )
    group.add_argument(
        "--sandbox",
        action="store_const",
        const=True,
        help="run the agent in the default Sandbox(): hidden credentials, writes only to its "
        "cwd, TMPDIR and the log dir (see docs/sandbox.md)",
    )
    group.add_argument(
        "--sandbox-write",
        action="append",
        type=Path,
        metavar="PATH",
        help="also let the sandboxed agent write PATH (repeatable; implies --sandbox)",
    )
    group.add_argument(
        "--network",
        action="append",
        metavar="HOST[:PORT]",
        help="let the sandboxed agent reach only HOST (a '*.' prefix for subdomains; any port "
        "unless given) and the LLM endpoint, through an egress proxy, in a network of its own "
        "(repeatable; 'none': its own loopback only, the LLM endpoint unreachable too; "
        "implies --sandbox; docs/sandbox.md: Network)",
    )
    group.add_argument(
        "--preload",
        action="store_true",
        default=None,
        help="fork each episode from a template that imported the agent once (docs/templates.md: "
        "Preloaded templates)",
    )


def endpoint_check_option(parser: argparse.ArgumentParser) -> None:
    """``--no-endpoint-check``, of ``run`` and ``batch`` alike."""
    parser.add_argument(
        "--no-endpoint-check",
        action="store_true",
        help="start without checking that the endpoint (--base-url) answers",
    )


def key_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "api key (never on the command line; order: file, env name, OPENAI_API_KEY, prompt, "
        "'dummy')"
    )
    group.add_argument("--api-key-file", type=Path, metavar="PATH", help="read the key from PATH")
    group.add_argument("--api-key-env", metavar="NAME", help="read the key from env variable NAME")
    group.add_argument(
        "--secret-env",
        action="append",
        metavar="NAME",
        help="hand env variable NAME to the agent as a secret, set only in its os.environ "
        "(repeatable; the value is read from this environment)",
    )
    group.add_argument(
        "--secret",
        action="append",
        metavar="NAME[=VAR]",
        help="pass the entrypoint keyword NAME as a secret, its value from env variable VAR "
        "(default NAME), else a no-echo prompt (repeatable; never on argv, in a log or bundle)",
    )


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
        typed = getpass.getpass("API key (not echoed): ")
        if typed:
            return SecretStr(typed)
        why = "an empty key was typed"
    else:
        why = "stdin is not a terminal to ask on"
    # As the workflow does; said, so that a 401 from the endpoint is not a mystery.
    print(
        f"isolate: no API key given (--api-key-file, --api-key-env, OPENAI_API_KEY) and {why}: "
        'using "dummy"',
        file=sys.stderr,
    )
    return SecretStr("dummy")


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (``--kwargs``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {text!r}")
    return value


def secret_specs(specs: list[str] | None) -> dict[str, str]:
    """``--secret NAME[=VAR]`` values: keyword NAME -> environment variable VAR."""
    found: dict[str, str] = {}
    for spec in specs or ():
        name, _, var = spec.partition("=")
        name, var = name.strip(), (var.strip() or name.strip())
        if not name.isidentifier():
            raise UsageError(f"--secret {spec!r}: {name!r} is not a keyword name")
        found[name] = var
    return found


def read_secrets(specs: list[str] | None, stdin: TextIO) -> dict[str, SecretStr]:
    """``--secret NAME[=VAR]``: keyword NAME with the value of env variable VAR (default NAME),
    else one typed at a no-echo prompt when stdin is a terminal."""
    found: dict[str, SecretStr] = {}
    for name, var in secret_specs(specs).items():
        value = os.environ.get(var)
        if not value and stdin.isatty():
            value = getpass.getpass(f"{name} (secret, not echoed): ")
        if not value:
            raise UsageError(
                f"--secret {name}: environment variable {var} is not set (and no terminal to "
                "ask on)"
            )
        found[name] = SecretStr(value)
    return found


def read_secret_env(names: list[str] | None) -> dict[str, SecretStr]:
    """``--secret-env`` names with their values from this process's environment."""
    missing = [name for name in names or () if name not in os.environ]
    if missing:
        raise UsageError(f"--secret-env: environment variable {missing[0]} is not set")
    return {name: SecretStr(os.environ[name]) for name in names or ()}
