"""A test agent with AReaL-SWEAgent's ``run_agent_with_reward`` signature.

It does whatever ``data["behaviour"]`` says, in this order: ``print`` (str to stdout),
``stderr_bytes`` (that many bytes of ``x`` lines to stderr), ``spawn`` (N background
``sleep 300``; their pids go to ``$PID_DIR/child-<i>`` when ``PID_DIR`` is set), ``sleep``
(seconds; when cancelled, a blocking clean-up of ``slow_cleanup`` seconds first),
``key_digest`` (report a digest of the api key and whether the key is in the
environment), ``report`` (write the extra dict to ``<result_dir>/<instance_id>.json`` before
going on, as a real agent writes its trace), ``crash`` (``"segv"`` or ``"exit"``), ``raise``
(message), ``reward`` (default 1.0).
Standard library only; Python 3.9+.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Optional

# Keeps the Popen objects referenced: the children are meant to outlive this coroutine.
_children: list[subprocess.Popen] = []


async def run_agent_with_reward(
    data: dict[str, Any],
    *,
    agent_type: str = "swe",
    agent_config: Optional[str] = None,
    result_dir: str = "./logs",
    override_api_key: Optional[str] = None,
    override_base_url: Optional[str] = None,
    override_llm_model: Optional[str] = None,
    override_opencode_provider: Optional[str] = None,
    override_codex_provider: Optional[str] = None,
    **_ignored: Any,
) -> tuple[float, dict[str, Any]]:
    """Act out ``data["behaviour"]``; return ``(reward, extra)``."""
    behaviour = data.get("behaviour") or {}
    received = {
        "agent_type": agent_type,
        "agent_config": agent_config,
        "result_dir": result_dir,
        "override_base_url": override_base_url,
        "override_llm_model": override_llm_model,
        "override_opencode_provider": override_opencode_provider,
        "override_codex_provider": override_codex_provider,
    }
    received.update(_ignored)
    extra: dict[str, Any] = {"kwargs": received}

    if "print" in behaviour:
        print(behaviour["print"], flush=True)
    if "stderr_bytes" in behaviour:
        _write_stderr(int(behaviour["stderr_bytes"]))
    if "spawn" in behaviour:
        extra["spawned"] = _spawn(int(behaviour["spawn"]))
    if "sleep" in behaviour:
        try:
            await asyncio.sleep(float(behaviour["sleep"]))
        except asyncio.CancelledError:
            # A clean-up that takes long (a remote sandbox torn down), blocking, as some do.
            time.sleep(float(behaviour.get("slow_cleanup", 0)))  # noqa: ASYNC251
            raise
    if behaviour.get("key_digest"):
        key = override_api_key or ""
        extra["key_digest"] = hashlib.sha256(key.encode("utf-8")).hexdigest()
        environ = "\0".join(f"{k}={v}" for k, v in os.environ.items())
        extra["env_has_key"] = bool(key) and key in environ
    if behaviour.get("report"):
        _report(data, result_dir, extra)
    if "crash" in behaviour:
        _crash(str(behaviour["crash"]))
    if "raise" in behaviour:
        raise RuntimeError(str(behaviour["raise"]))
    reward = behaviour.get("reward", 1.0)
    # Strings let a record ask for what JSON cannot carry, such as "nan".
    return (float(reward) if isinstance(reward, str) else reward), extra


def _report(data: dict[str, Any], result_dir: str, extra: dict[str, Any]) -> None:
    extra["python"] = sys.executable
    extra["nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    extra["environ"] = dict(os.environ)
    os.makedirs(result_dir, exist_ok=True)
    path = os.path.join(result_dir, "%s.json" % data.get("instance_id", "unknown"))
    with open(path, "w") as f:
        json.dump(extra, f)


def _write_stderr(total: int) -> None:
    line = b"x" * 79 + b"\n"
    chunk = line * 1024  # 80 KiB per write: fast enough for gigabytes
    out = getattr(sys.stderr, "buffer", None)
    sys.stderr.flush()
    while total > 0:
        piece = chunk[:total]
        if out is not None:
            out.write(piece)
        else:
            sys.stderr.write(piece.decode("ascii"))
        total -= len(piece)
    sys.stderr.flush()


def _spawn(count: int) -> list[int]:
    """Start ``count`` background sleeps; with PID_DIR set, wait until each wrote its pid."""
    pid_dir = os.environ.get("PID_DIR")
    pids = []
    for i in range(count):
        if pid_dir:
            # Write then rename, so a reader never sees a half-written pid.
            name = f'"$PID_DIR/child-{i}"'
            script = f"echo $$ > {name}.tmp && mv {name}.tmp {name}; exec sleep 300"
        else:
            script = "exec sleep 300"
        proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL)
        _children.append(proc)
        pids.append(proc.pid)
    if pid_dir:
        # Tests read the pid files as soon as the agent moves on: make sure they exist.
        deadline = time.monotonic() + 10.0
        for i in range(count):
            path = os.path.join(pid_dir, f"child-{i}")
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.005)
    return pids


def _crash(how: str) -> None:
    # Flush first: os._exit and a segfault both drop whatever is still buffered.
    sys.stdout.flush()
    sys.stderr.flush()
    if how == "segv":
        ctypes.string_at(0)
    elif how == "exit":
        os._exit(3)
    else:
        raise ValueError(f"unknown crash {how!r}; use 'segv' or 'exit'")
