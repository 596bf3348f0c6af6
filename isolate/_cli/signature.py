"""What an entrypoint accepts, learnt without running the agent's code in this process: a short
``python -c`` under the agent's interpreter imports it (as an episode's shim would) and prints
its parameters; here they become an :class:`inspect.Signature` that calls are checked against.
Also the check that a model endpoint answers."""

from __future__ import annotations

import functools
import inspect
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from .._core.system.env import PASSTHROUGH_ENV, split_env
from .._core.system.shim import shim_path
from .options import UsageError

#: Seconds the import of an entrypoint may take when its signature is read.
IMPORT_TIMEOUT_S = 60.0
#: Seconds the endpoint has to answer before a run or a batch starts.
ENDPOINT_TIMEOUT_S = 5.0

# Runs under the agent's interpreter (stdlib only, 3.9+); answers in one JSON line on a
# private copy of stdout, whatever the agent's modules print at import.
_READ_SIGNATURE = r"""
import inspect, json, os, sys
answer = os.dup(1)
os.dup2(2, 1)
root, entry, shim = sys.argv[1:4]
sys.path.insert(0, os.path.dirname(shim))
import shim as episode_shim
del sys.path[0], sys.modules["shim"]
try:
    target = episode_shim.load_part("worker").load_entrypoint(entry, root)
    params = inspect.signature(target).parameters.values()
    report = {"params": [[p.name, int(p.kind), p.default is not p.empty] for p in params]}
except BaseException as exc:
    report = {"error": "%s: %s" % (type(exc).__name__, exc)}
os.write(answer, (json.dumps(report) + "\n").encode())
"""


_KINDS = {
    int(kind): kind
    for kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.KEYWORD_ONLY,
        inspect.Parameter.VAR_KEYWORD,
    )
}


class Accepts:
    """The parameters of an entrypoint, as its interpreter reported them."""

    def __init__(self, entrypoint: str, params: list[tuple[str, int, bool]]) -> None:
        self.entrypoint = entrypoint
        self.signature = inspect.Signature(
            [
                inspect.Parameter(
                    name,
                    _KINDS[kind],
                    default=None if has_default else inspect.Parameter.empty,
                )
                for name, kind, has_default in params
            ]
        )
        kinds = {p.kind for p in self.signature.parameters.values()}
        self.any_keyword = inspect.Parameter.VAR_KEYWORD in kinds
        """It takes ``**kwargs``: every keyword is passed."""

    def accepts(self, name: str) -> bool:
        """Whether a keyword argument ``name`` can be passed."""
        param = self.signature.parameters.get(name)
        if param is not None and param.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        ):
            return True
        return self.any_keyword

    def requires(self, name: str) -> bool:
        """Whether the call fails without keyword ``name``."""
        param = self.signature.parameters.get(name)
        return param is not None and param.default is inspect.Parameter.empty

    def problem(self, names: Iterable[str]) -> str | None:
        """Why ``entrypoint(data, **{name: ...})`` cannot be called, or None."""
        try:
            self.signature.bind(None, **dict.fromkeys(names))
        except TypeError as exc:
            return f"{self.entrypoint}{self.signature} cannot be called with (data, keywords " + (
                f"{', '.join(sorted(names)) or 'none'}): {exc}"
            )
        return None


@functools.lru_cache(maxsize=16)
def read_signature(python: str, agent_root: str, entrypoint: str) -> Accepts | None:
    """The parameters of ``entrypoint``, imported under ``python`` with ``agent_root`` first on
    its path and the environment an agent gets; None when it cannot be imported there (its
    episodes then say why, as a ``setup_error``). Blocking; cached per arguments."""
    environ, _ = split_env(os.environ, PASSTHROUGH_ENV)
    argv = [python, "-I", "-c", _READ_SIGNATURE, agent_root, entrypoint, str(shim_path())]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=environ,
            cwd=agent_root if Path(agent_root).is_dir() else None,
        )
    except OSError:
        return None
    try:
        out, _ = proc.communicate(timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the import started and left
        except OSError:
            pass
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        report = json.loads(lines[-1])
        params = [(str(n), int(k), bool(d)) for n, k, d in report["params"]]
        if any(k not in _KINDS for _, k, _ in params):
            return None
    except (IndexError, ValueError, KeyError, TypeError):
        return None
    return Accepts(entrypoint, params)


def endpoint_problem(url: str, timeout: float = ENDPOINT_TIMEOUT_S) -> str | None:
    """Why the endpoint at ``url`` does not answer an HTTP GET within ``timeout`` seconds (no
    connection, or a 5xx status), or None. Any other status, 401 and 404 included, is an
    answer: the server is there."""
    request = urllib.request.Request(url, method="GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:
        if exc.code < 500:
            return None
        return f"it answered {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        reason = exc.reason
        text = getattr(reason, "strerror", None) or str(reason)
        return f"no connection: {text}"
    except (OSError, ValueError) as exc:  # a timeout, a reset mid-answer, a bad URL
        return f"no answer: {getattr(exc, 'strerror', None) or exc or type(exc).__name__}"


def check_endpoint(url: str, where: str = "--base-url") -> None:
    """Refuse to start a run or a batch whose endpoint (given as ``where``) does not answer:
    its episodes would only fail for it. Raises :class:`UsageError`, one line."""
    problem = endpoint_problem(url)
    if problem is not None:
        raise UsageError(
            f"{where} {url} does not answer ({problem}); nothing was run "
            "(--no-endpoint-check starts anyway)"
        )
