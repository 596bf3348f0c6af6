"""One attempt at one record: its spec and kwargs, built exactly as ``isolate run`` builds them,
and the attempt itself, wherever it runs (the driver, or a Ray worker)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from pydantic import SecretStr, ValidationError

from ..._core.episode.launcher import run_episode
from ..._core.episode.prepare import default_episode_id
from ..._core.model.config import EpisodeSpec
from ..._core.model.outcome import EpisodeOutcome
from ...workflow import (
    ENTRYPOINT,
    default_log_dir,
    episode_kwargs,
    episode_secret_env,
    episode_spec,
    resolve_agent_root,
    sandbox_of,
    timeout_of,
)
from ...workflow._econfig import ROOT_KEYS, network_of
from ..options import UsageError, read_secret_env, read_secrets, secret_specs
from ..signature import Accepts, read_signature

#: The keyword the api key is passed as, to an entrypoint that accepts it.
KEY_KEYWORD = "override_api_key"


@dataclass(frozen=True)
class Job:
    """One attempt at one record; everything but the key, which each backend holds."""

    record: dict[str, Any]
    spec: EpisodeSpec
    kwargs: dict[str, Any]
    episode_id: str
    log_dir: Path
    secret_env: dict[str, SecretStr] = field(default_factory=dict)
    """Values travel with the job, as the key does: a Ray node has other variables."""
    results: Path | None = None
    """The results file the attempt's line goes to (named in its bundle's ``attempt.json``)."""
    sample: int | None = None
    """``--samples``: which sample of the record this attempt is."""
    secrets: dict[str, SecretStr] = field(default_factory=dict)
    """``--secret``: keyword arguments passed as secrets; they travel as the key does."""
    key_as: str | None = KEY_KEYWORD
    """The keyword the key is passed as; None for an entrypoint that takes none."""
    secret_vars: dict[str, str] = field(default_factory=dict)
    """``--secret``: keyword -> environment variable, for a replay to read the value again."""


class RecordPlan:
    """Builds each record's spec and kwargs exactly as ``isolate run`` does: the flags play the
    workflow's econfig, the record's own ``econfig`` overrides them."""

    def __init__(self, args: argparse.Namespace) -> None:
        """Raises UsageError for flags that no record could run with."""
        flags = {
            "agent_root": args.agent_root,
            "python": args.python,
            "agent_type": args.agent_type,
            "agent_config": args.agent_config,
            "llm_model": args.llm_model,
            "kill_grace": args.kill_grace,
            "cancel_grace": args.cancel_grace,
            "exit_grace": args.exit_grace,
            "preload": getattr(args, "preload", None),
        }
        self.econfig = {k: v for k, v in flags.items() if v is not None}
        self.extra_kwargs: dict[str, Any] = getattr(args, "kwargs", None) or {}
        """``--kwargs``: passed to the entrypoint as they are, after the workflow's."""
        self.secret_vars = secret_specs(getattr(args, "secret", None))
        """``--secret``: keyword -> the environment variable its value came from."""
        self.secrets = read_secrets(getattr(args, "secret", None), sys.stdin)
        """``--secret``: keyword arguments passed as secrets."""
        # As the driver started: the Ray backend later drops variables that hold the key.
        self.environ = dict(os.environ)
        #: Spec fields set by a flag of the same name, for messages that name the flag.
        self.flags = {k for k in (*flags, "entrypoint", "timeout") if getattr(args, k) is not None}
        secret_names = getattr(args, "secret_env", None)
        if secret_names:
            read_secret_env(secret_names)  # a UsageError now, not one per record
            self.econfig["secret_env"] = secret_names
        network = getattr(args, "network", None)
        if args.sandbox or args.sandbox_write or network:
            self.econfig["sandbox"] = {"write": [str(p) for p in args.sandbox_write or ()]}
        if network:
            if "none" in network and len(network) > 1:
                raise UsageError("--network none cannot be combined with hosts")
            try:
                self.econfig["sandbox_network"] = network_of(
                    "none" if network == ["none"] else network, "--network"
                )
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        self.agent_root = resolve_agent_root(self.econfig)
        self.timeout = args.timeout if args.timeout is not None else 1800.0
        self.entrypoint: str | None = args.entrypoint
        self.base_url: str | None = args.base_url
        # Absolute: Ray runs the episode in a worker whose working directory is not ours.
        self.log_dir = (args.log_dir or Path(default_log_dir())).absolute()
        out = getattr(args, "out", None)
        self.results: Path | None = Path(out).resolve() if out is not None else None
        # What is wrong with the flags is wrong for every record: say it once, before any.
        try:
            # The agent root is the one thing a record may set that the flags need not: with
            # the flags' own, their entrypoint's signature is checked here, once.
            spec, _ = self.build({}, root=False, url_needed=False)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.wants_key = self.key_as(spec) is not None
        """Whether the flags' entrypoint takes the api key (else it is not asked for)."""

    def _econfig(self, record: dict[str, Any]) -> dict[str, Any]:
        econfig = dict(self.econfig)
        if "econfig" in record:
            if not isinstance(record["econfig"], dict):
                raise ValueError('"econfig" must be a JSON object')
            econfig.update(record["econfig"])
        return econfig

    def secret_env(self, record: dict[str, Any]) -> dict[str, SecretStr]:
        """``--secret-env`` (or the record's econfig ``secret_env``) with values from here."""
        return episode_secret_env(self._econfig(record), self.environ)

    def build(
        self,
        record: dict[str, Any],
        episode_id: str | None = None,
        root: bool = True,
        url_needed: bool = True,
    ) -> tuple[EpisodeSpec, dict[str, Any]]:
        """Raises ValueError, with a one-line message, for a record that cannot run. With a
        sandbox and an ``episode_id``, the episode gets a working directory and a
        ``result_dir`` of its own in its bundle (``work/``, ``result/``): the only places it
        may write, so that nothing it writes can touch the results, another episode's bundle,
        or its own record and spec. The entrypoint gets the workflow's keywords that its
        signature accepts (all with ``**kwargs``), then ``--kwargs``; an endpoint is needed by
        the default entrypoint and one that requires ``override_base_url`` (``url_needed``:
        False where a record may still give its own)."""
        econfig = self._econfig(record)
        own = record.get("econfig") or {}
        base_url = self.base_url or record.get("base_url")
        if base_url:
            where = "--base-url" if self.base_url else 'the record\'s "base_url"'
            _check_url(str(base_url), where)
        # The record's own timeout wins over --timeout, as in the workflow.
        timeout = timeout_of(own, self.timeout)
        own_dirs = econfig.get("sandbox") not in (None, False) and episode_id is not None
        bundle = self.log_dir / (episode_id or "")
        result_dir = bundle / "result" if own_dirs else self.log_dir
        try:
            kwargs = episode_kwargs(econfig, str(base_url or ""))
            box = sandbox_of(econfig, str(result_dir), str(base_url) if base_url else None)
            spec = episode_spec(econfig, self.agent_root, timeout, None, box)
            changes: dict[str, Any] = {}
            if self.entrypoint:
                changes["entrypoint"] = self.entrypoint
            if own_dirs and spec.cwd is None:
                (bundle / "work").mkdir(parents=True, exist_ok=True)
                changes["cwd"] = bundle / "work"
            if changes:
                spec = EpisodeSpec.model_validate({**spec.model_dump(), **changes})
        except OSError as exc:
            raise ValueError(f"cannot create {bundle / 'work'}: {exc.strerror or exc}") from None
        except ValidationError as exc:
            problems = (f"{self._where(e['loc'], own)}: {_message(e)}" for e in exc.errors())
            raise ValueError("; ".join(problems)) from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"econfig: {exc}") from None
        if not base_url and url_needed and spec.entrypoint == ENTRYPOINT:
            raise ValueError(
                f'--base-url is required by {spec.entrypoint} (or "base_url" in the record)'
            )
        if root and spec.agent_root is not None and not spec.agent_root.is_dir():
            what = "is not a directory" if spec.agent_root.exists() else "does not exist"
            where = "econfig.agent_root" if any(k in own for k in ROOT_KEYS) else "--agent-root"
            raise ValueError(
                f"agent root {spec.agent_root} {what}: give the agent's checkout with {where} "
                "(or AWEAGENT_ROOT in the environment)"
            )
        kwargs["result_dir"] = str(result_dir)
        return spec, self._call(spec, kwargs, bool(base_url), url_needed)

    def _call(
        self, spec: EpisodeSpec, kwargs: dict[str, Any], with_url: bool, url_needed: bool
    ) -> dict[str, Any]:
        """The keywords ``spec``'s entrypoint gets: the workflow's that it accepts, then
        ``--kwargs``. ValueError for a call it cannot take."""
        accepts = self._accepts(spec)
        # Without url_needed, a record may still give the endpoint: the call is checked as
        # if it did.
        later = [] if with_url or url_needed else ["override_base_url"]
        if not with_url:
            if url_needed and accepts is not None and accepts.requires("override_base_url"):
                raise ValueError(
                    f'--base-url is required by {spec.entrypoint} (or "base_url" in the record)'
                )
            del kwargs["override_base_url"]
        if accepts is not None:
            kwargs = {k: v for k, v in kwargs.items() if accepts.accepts(k)}
        kwargs.update(self.extra_kwargs)
        if accepts is not None:
            key = [KEY_KEYWORD] if accepts.accepts(KEY_KEYWORD) else []
            later = [k for k in later if accepts.accepts(k) and k not in kwargs]
            problem = accepts.problem([*kwargs, *self.secrets, *key, *later])
            if problem is not None:
                raise ValueError(problem)
        return kwargs

    def _accepts(self, spec: EpisodeSpec) -> Accepts | None:
        """The entrypoint's parameters, from its interpreter; None where it cannot tell."""
        if spec.agent_root is None or not spec.agent_root.is_dir():
            return None
        return read_signature(spec.python, str(spec.agent_root), spec.entrypoint)

    def key_as(self, spec: EpisodeSpec) -> str | None:
        """The keyword the api key is passed as to ``spec``'s entrypoint; None: it takes none."""
        accepts = self._accepts(spec)
        return KEY_KEYWORD if accepts is None or accepts.accepts(KEY_KEYWORD) else None

    def _where(self, loc: tuple[int | str, ...], own: dict[str, Any]) -> str:
        """What a user set to give the spec field at ``loc``: a flag, or the record's econfig
        (which overrides the flags)."""
        field = str(loc[0]) if loc else ""
        if field in self.flags and field not in own:
            return "--" + field.replace("_", "-")
        return "econfig." + ".".join(map(str, loc))

    def check(self, record: dict[str, Any]) -> None:
        self.build(record)
        self.secret_env(record)

    def job(self, record: dict[str, Any], sample: int | None = None) -> Job:
        """One attempt at ``record``; with a ``sample`` (``--samples``), its episode id says
        which: ``<instance_id>.s<sample>.<random>``."""
        episode_id = default_episode_id(record)
        if sample is not None:
            stem, _, token = episode_id.rpartition(".")
            episode_id = f"{stem}.s{sample}.{token}"
        spec, kwargs = self.build(record, episode_id)
        secret_env = self.secret_env(record)
        return Job(
            record,
            spec,
            kwargs,
            episode_id,
            self.log_dir,
            secret_env,
            self.results,
            sample,
            self.secrets,
            self.key_as(spec),
            self.secret_vars,
        )


def _message(error: Any) -> str:
    # pydantic prefixes the text of a ValueError raised by a validator.
    return str(error["msg"]).removeprefix("Value error, ")


def _check_url(url: str, where: str) -> None:
    """An episode whose endpoint is not an http(s) URL could only fail: refuse it now."""
    try:
        parts = urllib.parse.urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{where} {url!r} is not an http(s) URL such as http://127.0.0.1:8000/v1")


async def run_attempt(
    job: Job, key: SecretStr, on_cut: Callable[[dict[str, Any]], object] | None = None
) -> dict[str, Any]:
    """Run one attempt where this process is (the driver, or a Ray worker). Leaves a replay
    bundle, as ``isolate run`` does: ``isolate run --replay <log_dir>/<episode_id>``, with its
    ``attempt.json`` (which results file, instance, sample, start) for a driver that finds it
    after a crash. When a cancellation (the driver's Ctrl-C) cuts the attempt, its outcome is
    kept in the bundle all the same and its fields go to ``on_cut`` before the cancellation
    goes on."""
    bundle = job.log_dir / job.episode_id
    try:
        await anyio.to_thread.run_sync(_write_bundle, bundle, job)
    except OSError as exc:
        return failure("setup_error", "SetupError", f"cannot write to {bundle}: {exc.strerror}")
    spec = job.spec.model_copy(update={"log_dir": bundle})
    ended: list[EpisodeOutcome] = []
    try:
        outcome = await run_episode(
            spec,
            job.record,
            kwargs=job.kwargs,
            secrets=episode_secrets(job.secrets, job.key_as, key),
            episode_id=job.episode_id,
            secret_env=job.secret_env,
            on_end=ended.append,
        )
    except anyio.get_cancelled_exc_class():
        if ended and on_cut is not None:
            fields = outcome_fields(ended[0])
            fields.update(_keep_outcome(bundle, ended[0]))  # in the shield of the teardown
            on_cut(fields)
        raise
    fields = outcome_fields(outcome)
    fields.update(await anyio.to_thread.run_sync(_keep_outcome, bundle, outcome))
    return fields


def episode_secrets(
    secrets: dict[str, SecretStr], key_as: str | None, key: SecretStr | None
) -> dict[str, SecretStr]:
    """The keyword arguments an episode gets as secrets: ``--secret``'s, and the key."""
    found = dict(secrets)
    if key_as is not None and key is not None:
        found[key_as] = key
    return found


#: The largest ``info`` a result line carries itself (bytes of JSON); a larger one is only in
#: the attempt's outcome file (``outcome_path``).
MAX_LINE_INFO = 64 * 1024


def _keep_outcome(bundle: Path, outcome: EpisodeOutcome) -> dict[str, Any]:
    """Write the whole outcome of an attempt into its bundle (each attempt has its own, as it
    has its own episode id); the line's ``info`` and ``outcome_path``."""
    path = bundle / "outcome.json"
    try:
        path.write_text(outcome.model_dump_json(indent=2) + "\n")
    except OSError:
        return keep_fields(None, outcome)  # a full disk, say: the line still says what it can
    return keep_fields(bundle, outcome)


def keep_fields(bundle: Path | None, outcome: EpisodeOutcome) -> dict[str, Any]:
    """The line's ``info`` (None when over :data:`MAX_LINE_INFO`) and ``outcome_path`` (of
    the outcome file in ``bundle``; None without one)."""
    small = len(json.dumps(outcome.info)) <= MAX_LINE_INFO
    where = str(bundle / "outcome.json") if bundle is not None else None
    return {"info": outcome.info if small else None, "outcome_path": where}


#: The file of an attempt's bundle that says whose attempt it is, written before it starts.
ATTEMPT_FILE = "attempt.json"


def _write_bundle(bundle: Path, job: Job) -> None:
    passing = {"key_as": job.key_as, "secrets": job.secret_vars}
    write_bundle(bundle, job.record, job.spec, job.kwargs, sorted(job.secret_env), passing)
    if job.results is not None:
        attempt = {
            "results": str(job.results),
            "instance_id": str(job.record.get("instance_id", "")),
            "sample": job.sample,
            "started_at": time.time(),
        }
        (bundle / ATTEMPT_FILE).write_text(json.dumps(attempt) + "\n")


#: The files of a replay bundle that decide what a replay runs; ``digest.json`` holds their
#: SHA-256, so that a bundle changed after it ran is refused, not run.
BUNDLE_FILES = ("record.json", "spec.json", "kwargs.json", "secret_env.json", "secrets.json")


def write_bundle(
    bundle: Path,
    record: dict[str, Any],
    spec: EpisodeSpec,
    kwargs: dict[str, Any],
    secret_env: list[str],
    passing: dict[str, Any] | None = None,
) -> None:
    """The replay bundle of one attempt (``isolate run --replay BUNDLE``): what it ran, the
    names of its ``secret_env`` (never a value), how its secret keywords were passed
    (``passing``: ``key_as``, the key's keyword or None, and ``secrets``, each ``--secret``
    keyword's environment variable; never a value), and their digest."""
    bundle.mkdir(parents=True, exist_ok=True)
    texts = {
        "record.json": json.dumps(record, indent=2, default=str) + "\n",
        "spec.json": spec.model_dump_json(indent=2) + "\n",
        "kwargs.json": json.dumps(kwargs, indent=2, default=str) + "\n",
    }
    if secret_env:
        texts["secret_env.json"] = json.dumps(secret_env) + "\n"
    if passing is not None:
        texts["secrets.json"] = json.dumps(passing, indent=2) + "\n"
    for name, text in texts.items():
        (bundle / name).write_text(text)
    digest = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in texts.items()}
    (bundle / "digest.json").write_text(json.dumps(digest, indent=2) + "\n")


def bundle_changed(bundle: Path) -> str | None:
    """Which file of ``bundle`` no longer matches its digest, in words; None when none. A
    bundle without a digest (written before there was one) is taken as it is."""
    path = bundle / "digest.json"
    if not path.exists():
        return None
    digest = json.loads(path.read_text())
    if not isinstance(digest, dict):
        return "digest.json is not an object"
    for name in BUNDLE_FILES:
        file = bundle / name
        if name not in digest:
            if file.exists():
                return f"{name} was added after it ran"
            continue
        if not file.exists():
            return f"{name} was removed after it ran"
        if hashlib.sha256(file.read_bytes()).hexdigest() != digest[name]:
            return f"{name} was changed after it ran"
    return None


def outcome_fields(outcome: EpisodeOutcome) -> dict[str, Any]:
    """What a result line says about an outcome. The outcome holds no secret; the stderr tail
    and ``info`` stay out (they are in the log)."""
    error = outcome.error
    return {
        "status": outcome.status,
        "reward": outcome.reward,
        "duration_s": round(outcome.duration_s, 3),
        "admission_s": round(outcome.timings.admission_s, 3),  # of it, waiting for fds
        "exit": outcome.exit_description,
        "exit_code": outcome.exit_code,
        "signal": outcome.signal,
        "killed": outcome.killed,
        "containment": outcome.containment,
        "start": outcome.start,
        "preload_refused": outcome.preload_refused,
        "infra_kind": outcome.infra,
        "error": {"type": error.type, "message": error.message} if error else None,
        "log_path": str(outcome.log_path) if outcome.log_path else None,
        "episode_id": outcome.episode_id,
        "node": socket.gethostname(),
    }


def failure(status: str, kind: str, message: str) -> dict[str, Any]:
    """Result fields for an attempt that ended before or outside ``run_episode``."""
    fields = outcome_fields(EpisodeOutcome(status="setup_error"))
    # No episode reported a containment: none is claimed.
    fields.update(
        status=status,
        exit="exit unknown",
        error={"type": kind, "message": message},
        containment=None,
    )
    return fields
