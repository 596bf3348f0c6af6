"""Everything decided before the episode's process starts: the arguments checked, the paths,
the wall (containment layers, cgroup leaves, sandbox; see ``wall``), the exec environment, and
the handshake, built in one place from those."""

from __future__ import annotations

import json
import os
import re
import secrets as _secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from agent_shim.shim_wire import EPISODE_VARS, PROTOCOL_VERSION

from .. import containment as _containment
from ..containment import sandbox as _sandbox
from ..containment import wall as _wall
from ..model.config import EpisodeSpec, is_env_name
from ..model.errors import ArgumentError, SetupProblem
from ..model.sandbox_config import SandboxReport
from ..network.netserve import EpisodeNetwork
from ..system import admission as _admission
from ..system.env import describe_withheld, spec_env
from .redact import Redactor

#: The shim enforces its own deadline this long after the parent's (seconds): defence in depth
#: for a parent that is stopped or hung, never the normal path.
SHIM_DEADLINE_MARGIN_S = 2.0


@dataclass(frozen=True)
class Request:
    """The arguments of one ``run_episode``, checked."""

    spec: EpisodeSpec
    data: Any
    kwargs: dict[str, Any]
    secrets: dict[str, SecretStr]
    secret_env: dict[str, SecretStr]
    episode_id: str
    nonce: str  # marks the shim's frames: a line without it is not one
    tag: str  # in its processes' environment, this episode's alone (EPISODE_TAG_ENV)
    redact: Redactor  # scrubs every secret above from what comes back

    @classmethod
    def check(
        cls,
        spec: EpisodeSpec,
        data: Any,
        kwargs: Mapping[str, Any],
        secrets: Mapping[str, str | SecretStr],
        episode_id: str | None,
        secret_env: Mapping[str, str | SecretStr],
    ) -> Request:
        """Raises :class:`ArgumentError`, never echoing a secret's value."""
        for name in list(kwargs) + list(secrets):
            if not isinstance(name, str) or not name.isidentifier():
                raise ArgumentError(f"keyword argument names must be identifiers, got {name!r}")
        both = sorted(set(kwargs) & set(secrets))
        if both:
            raise ArgumentError(f"keys in both kwargs and secrets: {', '.join(both)}")
        wrapped = {k: _secret(k, v) for k, v in secrets.items()}
        env = _secret_env(spec, secret_env)
        eid = default_episode_id(data) if episode_id is None else episode_id
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", eid):
            raise ArgumentError(f"episode_id must be 1-200 of [A-Za-z0-9_.-], got {episode_id!r}")
        try:
            json.dumps({"data": data, "kwargs": dict(kwargs)}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ArgumentError(f"data and kwargs must be JSON-serialisable: {exc}") from None
        values = [s.get_secret_value() for s in [*wrapped.values(), *env.values()]]
        return cls(
            spec,
            data,
            dict(kwargs),
            wrapped,
            env,
            eid,
            nonce=_secrets.token_hex(16),
            tag=_secrets.token_hex(16),
            redact=Redactor(values),
        )


def default_episode_id(data: Any) -> str:
    """The record's ``instance_id`` (made safe for a file name) plus 8 random hex digits."""
    base = data.get("instance_id") if isinstance(data, Mapping) else None
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(base))[:80] if base else "episode"
    return f"{stem}.{_secrets.token_hex(4)}"


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_episode` made: the checked paths, the resolved containment and the wall
    built for it. Its wall's leaves and TMPDIR, and its network, are the caller's to remove."""

    agent_root: str | None
    wall: _wall.Wall
    network: EpisodeNetwork | None
    rlimits: dict[str, list[int]]  # the wall's, with the fd limit the child gets

    @property
    def containment(self) -> str:
        """The combination of layers, resolved."""
        return self.wall.containment

    @property
    def layers(self) -> tuple[str, ...]:
        return self.wall.layers

    @property
    def userns(self) -> bool | None:
        return self.wall.userns

    @property
    def leaves(self) -> _containment.Leaves | None:
        return self.wall.leaves

    @property
    def sandbox(self) -> _sandbox.PreparedSandbox | None:
        return self.wall.sandbox

    def close_network(self, note: Callable[[str], None]) -> None:
        """Close the listeners and the proxy's connections; say what was refused."""
        if self.network is not None:
            self.network.close()
            summary = self.network.egress.summary()
            if summary is not None:
                note(summary)

    def report(self, missing: list[str] | None, redact: Redactor) -> SandboxReport | None:
        """What the sandbox enforced, for the outcome; ``missing`` from the worker's frame."""
        if self.sandbox is None:
            return None
        refused = self.network.egress.refused if self.network is not None else {}
        shown = [redact.text(m) for m in missing or []]
        return self.sandbox.report(shown, _sandbox.landlock_abi(), refused)


class Unprepared(SetupProblem):
    """:func:`prepare_episode` could not make what the episode needs; ``containment`` is the
    combination resolved by then (``"session"`` when it failed before), for the outcome."""

    def __init__(self, message: str, containment: str) -> None:
        super().__init__(message)
        self.containment = containment


def prepare_episode(req: Request, shim: Path, note: Callable[[str], None]) -> Prepared:
    """Check what can be checked before spawning, pick the containment, make the leaves and the
    sandbox; blocking. Raises :class:`Unprepared`, with nothing of its own left behind."""
    spec = req.spec
    containment = "session"
    try:
        agent_root = _check_paths(spec, shim)
        plan = _wall.plan(spec)
        # The combination, kept for the outcome even when its wall cannot be made.
        containment = plan.containment
        # A template's episode may adopt a parked fork's leaves: made once it does not.
        wall = plan.make(spec, req.episode_id, leaves_later=bool(spec.preload))
    except SetupProblem as exc:
        raise Unprepared(str(exc), containment) from None
    network = None
    if wall.sandbox is not None and wall.sandbox.plan.network is not None:
        network = EpisodeNetwork(wall.sandbox.plan.network, note)
    rlimits = {name: list(pair) for name, pair in wall.rlimits.items()}
    return Prepared(agent_root, wall, network, _admission.child_rlimits(rlimits))


def make_leaves(prep: Prepared) -> None:
    """Make the leaves :func:`prepare_episode` only named (a template's episode, which takes a
    parked fork's where it gets one); nothing if made. Blocking; raises :class:`Unprepared`
    (what was made is the caller's to remove, as it holds ``prep``)."""
    leaves = prep.leaves
    if leaves is not None and not leaves.made:
        try:
            leaves.create()
        except SetupProblem as exc:
            raise Unprepared(str(exc), prep.containment) from None


def _check_paths(spec: EpisodeSpec, shim: Path) -> str | None:
    """The agent root, absolute; raises :class:`SetupProblem` for a path that cannot work."""
    agent_root = None
    if spec.agent_root is not None:
        root = spec.agent_root.expanduser().absolute()
        if not root.is_dir():
            what = "is not a directory" if root.exists() else "does not exist"
            raise SetupProblem(f"agent root {root} {what}")
        agent_root = str(root)
    if spec.cwd is not None and not spec.cwd.is_dir():
        raise SetupProblem(f"working directory {spec.cwd} does not exist")
    if os.sep in spec.python:
        python = Path(spec.python)
        if not python.exists():
            raise SetupProblem(f"interpreter {spec.python} does not exist")
        if not os.access(python, os.X_OK) or python.is_dir():
            raise SetupProblem(f"interpreter {spec.python} is not an executable file")
    if not shim.is_file():
        raise SetupProblem(f"shim {shim} is missing from the installation")
    return agent_root


def exec_env(req: Request, prep: Prepared) -> tuple[dict[str, str], str | None]:
    """The shim's exec environment, and the line that names what it withholds (or None)."""
    # The secret_env names go in the handshake, never in the exec environment.
    env, withheld = spec_env(req.spec, req.episode_id, req.secrets, req.secret_env, req.tag)
    return prep.wall.exec_env(env), describe_withheld(withheld) if withheld else None


def handshake(
    req: Request, prep: Prepared, env: Mapping[str, str], *, forked: bool, pid1: bool = False
) -> dict[str, Any]:
    """The handshake's public part (everything but the secrets): a pure function of the
    request, what was prepared and the exec environment. ``forked``: for a template's fork;
    ``pid1``: for a shim the parent started as PID 1 of a PID namespace of its own."""
    spec = req.spec
    public: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "nonce": req.nonce,
        "entrypoint": spec.entrypoint,
        "agent_root": prep.agent_root,
        "data": req.data,
        "kwargs": req.kwargs,
        "deadline": spec.timeout + spec.kill_grace + SHIM_DEADLINE_MARGIN_S,
        "kill_grace": spec.kill_grace,
        "cancel_grace": spec.cancel_grace,
        "exit_grace": spec.exit_grace,
        "max_info_bytes": spec.max_info_bytes,
        "containment": prep.containment,
    }
    if prep.rlimits:
        public["rlimits"] = prep.rlimits
    if prep.userns is not None:
        public["userns"] = prep.userns
    if pid1:
        public["pid1"] = True
    if prep.leaves is not None:
        public["cgroups"] = prep.leaves.join()
    wall = prep.wall
    # A template fork's sandbox, carved from the template's: the template's mounts are its
    # forks', and a fork can make none of its own.
    carved = wall if wall.in_template else None
    if prep.sandbox is not None:
        none_of_its_own = {"mounts": [], "unshare_mounts": False} if carved is not None else {}
        public["sandbox"] = {**prep.sandbox.handshake, **none_of_its_own}
    if spec.preload or carved is not None:
        # A template's fork has the template's exec environment: its own temporary directory
        # comes in the handshake, so episodes that differ only there share one template.
        own = {k: env[k] for k in _wall.TEMP_ENV if k in env}
        public["temp_env"] = carved.temp_env() if carved is not None else own
    if forked:
        public["forked"] = True
        if "pidns" in prep.layers:
            public["scoped"] = True  # its PID namespace is shared: a domain of its own
    return public


def _secret(name: str, value: object) -> SecretStr:
    if isinstance(value, SecretStr):
        return value
    if not isinstance(value, str):
        # Say what is wrong without echoing the value.
        raise ArgumentError(
            f"secret {name!r} must be a str or SecretStr, not {type(value).__name__}"
        )
    return SecretStr(value)


def _secret_env(
    spec: EpisodeSpec, secret_env: Mapping[str, str | SecretStr]
) -> dict[str, SecretStr]:
    """``secret_env`` checked and wrapped: names a process environment can hold, values
    without NUL (said without echoing them), none that the spec's ``env`` sets as well."""
    out: dict[str, SecretStr] = {}
    for name, value in secret_env.items():
        if not isinstance(name, str) or not is_env_name(name) or name in EPISODE_VARS:
            raise ArgumentError(f"secret_env: invalid variable name {name!r}")
        secret = _secret(name, value)
        if "\x00" in secret.get_secret_value():
            raise ArgumentError(f"secret_env: the value of {name} contains a NUL byte")
        out[name] = secret
    both = sorted(set(out) & set(spec.env))
    if both:
        raise ArgumentError(f"variables in both secret_env and spec.env: {', '.join(both)}")
    return out
