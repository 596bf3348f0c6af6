"""The run a results file belongs to: its id, under which its bundles go, and what it ran
with, in ``RESULTS.run.json`` beside the results file (written whole, replaced atomically).

A rerun of the same command (a resume) is the same run: it keeps the id and the bundle
directory, and adds what it ran with to ``resumed``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

#: Seconds a ``git`` query of the agent root may take before it is given up (then null).
GIT_TIMEOUT_S = 10.0
#: What replaces a secret found in the metadata, and a URL's password or query.
HIDDEN = "***"


def meta_path(results: Path) -> Path:
    """``results.jsonl`` -> ``results.run.json``, beside it."""
    path = results.with_suffix(".run.json")
    return path if path != results else results.with_name(results.name + ".run.json")


def new_run_id() -> str:
    """``20261204T230112Z-3fa2c1``: the UTC start, then 6 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def read_meta(results: Path) -> dict[str, Any] | None:
    """The metadata beside ``results``; None when there is none or it cannot be read."""
    try:
        meta = json.loads(meta_path(results).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("run_id"), str) else None


def run_id_of(results: Path) -> str:
    """The id of the run that ``results`` belongs to: the one beside it, else a new one."""
    meta = read_meta(results)
    return str(meta["run_id"]) if meta else new_run_id()


def git_state(root: Path) -> tuple[str | None, bool | None]:
    """The commit checked out at ``root`` and whether tracked files differ from it (as
    ``git describe --dirty`` says); (None, None) outside a git checkout or without git."""
    try:
        head = _git(root, "rev-parse", "HEAD")
        changes = _git(root, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head.strip() or None, bool(changes.strip())


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), *args],
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return done.stdout


def public_url(url: str | None) -> str | None:
    """``url`` without a password or a query (either may hold a key)."""
    if not url:
        return url
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            netloc = f"{parts.username}:{HIDDEN}@" + netloc.rpartition("@")[2]
    except ValueError:
        return HIDDEN
    query = HIDDEN if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _sha256(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def session(
    args: argparse.Namespace,
    spec: dict[str, Any],
    kwargs: dict[str, Any],
    *,
    log_dir: Path,
    sizes: tuple[int, int, int],
) -> dict[str, Any]:
    """What this invocation of ``isolate batch`` runs with: isolate's version, the driver's
    interpreter, the agent (root, commit, dirty state, interpreter, entrypoint), the endpoint
    and model, the records file, the options, and the spec and keyword arguments every record
    starts from (its own ``econfig`` on top). Never a secret: the key and ``--secret-env``
    values are not in ``spec`` or ``kwargs``; ``env`` values and a URL's password are left
    out. ``sizes``: the records chosen, the units (records x samples) and the concurrency."""
    from ... import __version__

    records, units, concurrency = sizes
    root = Path(spec["agent_root"]) if spec.get("agent_root") else None
    commit, dirty = git_state(root) if root is not None and root.is_dir() else (None, None)
    spec = dict(spec, env=sorted(spec.get("env") or {}), log_dir=None)
    kwargs = {k: v for k, v in kwargs.items() if k != "result_dir"}
    if "override_base_url" in kwargs:
        kwargs["override_base_url"] = public_url(kwargs["override_base_url"])
    return {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "isolate_version": __version__,
        "driver": {
            "python": sys.executable,
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "argv_flags": sorted(a.split("=")[0] for a in sys.argv[1:] if a.startswith("--")),
        },
        "agent": {
            "root": str(root) if root is not None else None,
            "commit": commit,
            "dirty": dirty,
            "python": spec.get("python"),
            "entrypoint": spec.get("entrypoint"),
        },
        "endpoint": {
            "base_url": public_url(args.base_url),
            "model": args.llm_model,
        },
        "records": {
            "path": str(args.records.absolute()),
            "sha256": _sha256(args.records),
            "chosen": records,
            "units": units,
        },
        "options": _options(args, concurrency),
        "log_dir": str(log_dir),
        "spec": spec,
        "kwargs": kwargs,
        "secret_env": sorted(args.secret_env or ()),
    }


def _options(args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    """The options of ``isolate batch`` that choose the records and shape the run."""
    return {
        "samples": args.samples,
        "limit": args.limit,
        "instance_ids": args.instance_ids,
        "shard": str(args.shard) if args.shard else None,
        "retries": args.retries,
        "retries_infra": args.retries_infra,
        "retry_timeouts": args.retry_timeouts,
        "concurrency": concurrency,
        "backend": args.backend,
    }


def write_meta(results: Path, run_id: str, now: dict[str, Any], hidden: list[str]) -> Path:
    """Write the run's metadata beside ``results``: the first invocation's at the top, each
    later one (a resume) added to ``resumed``. Any of the ``hidden`` values (the key, the
    secret_env values) found in it is replaced by ``***``. Returns the file."""
    path = meta_path(results)
    meta = read_meta(results)
    if meta is None or meta.get("run_id") != run_id:
        meta = {"run_id": run_id, "results": str(results.absolute()), **now, "resumed": []}
    else:
        meta.setdefault("resumed", []).append(now)
    text = json.dumps(meta, indent=2, default=str) + "\n"
    for value in hidden:
        if value:
            text = text.replace(json.dumps(value)[1:-1], HIDDEN)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
