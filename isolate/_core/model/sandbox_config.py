"""The sandbox's configuration (:class:`Sandbox`) and what it enforced (:class:`SandboxReport`):
data only, imported by the spec and the outcome. What makes the sandbox: :mod:`.sandbox`."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, field_validator


class Sandbox(BaseModel):
    """What an episode's agent may read, write and connect to (Linux, Landlock; see
    docs/sandbox.md). Reads are allowed everywhere but ``DEFAULT_HIDE`` and ``hide``; writes only in
    the working directory, a private ``TMPDIR``, ``/dev/null`` and its like, and ``write``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    DEFAULT_HIDE: ClassVar[tuple[str, ...]] = (
        "~/.ssh",
        "~/.aws/credentials",
        "~/.netrc",
        "~/.docker/config.json",
        "~/.kube/config",
        "~/.cache/huggingface/token",
        "~/.ray",
        "~/.gnupg",
        "~/.config/gcloud",
        "~/.git-credentials",
        "~/.pypirc",
        "~/.config/gh",
    )

    hide: tuple[str, ...] = ()
    """Paths hidden in addition to ``DEFAULT_HIDE``; ``~`` is each home: the agent's ``HOME``,
    the parent's, and the user's from the password database."""
    write: tuple[Path, ...] = ()
    """Directories (or files) the agent may write besides its working directory and TMPDIR;
    each must exist."""
    connect: tuple[int, ...] | None = None
    """TCP ports the agent may connect to (Landlock ABI 4); None leaves the network alone."""
    network: Literal["none"] | tuple[str, ...] | None = None
    """None: the trainer's network. ``"none"``: no network at all, loopback of its own only.
    Entries ``host[:port]`` (``"api.openai.com"``, ``"*.github.com:443"``, ``"127.0.0.1:8000"``):
    the agent reaches those through an egress proxy and nothing else (docs/sandbox.md,
    "Network")."""
    best_effort: bool = False
    """Run even where the machine cannot enforce part of this; ``outcome.sandbox`` says what
    was. By default such an episode is a ``setup_error`` naming what is missing."""

    @field_validator("hide")
    @classmethod
    def _check_hide(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not (path.startswith("/") or path == "~" or path.startswith("~/")):
                raise ValueError(f"hide: {path!r} must be absolute or start with '~/'")
            if "\x00" in path:
                raise ValueError("hide: paths cannot contain NUL")
        return value

    @field_validator("write")
    @classmethod
    def _check_write(cls, value: tuple[Path, ...]) -> tuple[Path, ...]:
        for path in value:
            if "\x00" in str(path):
                raise ValueError("write: paths cannot contain NUL")
        return value

    @field_validator("network")
    @classmethod
    def _check_network(cls, value: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        if value is None or value == "none":
            return value
        from ..network.allowlist import parse_rules

        parse_rules(value)  # raises ValueError naming the entry
        return tuple(dict.fromkeys(value))

    @field_validator("connect")
    @classmethod
    def _check_connect(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        for port in value:
            if not 0 < port < 65536:
                raise ValueError(f"connect: {port} is not a TCP port (1-65535)")
        return tuple(sorted(set(value)))


class SandboxReport(BaseModel):
    """What the sandbox of one episode enforced (``outcome.sandbox``)."""

    model_config = ConfigDict(frozen=True)

    landlock_abi: int
    """The kernel's Landlock ABI version; 0: no Landlock."""
    mounts: bool
    """Whether the episode had a mount namespace for read-only and hiding mounts."""
    enforced: tuple[str, ...] = ()
    """What was enforced, one line each."""
    missing: tuple[str, ...] = ()
    """What the profile asked for and this machine could not enforce (best_effort only)."""
    tmpdir: Path | None = None
    """The episode's private TMPDIR (removed at teardown)."""
    refused: dict[str, int] = {}
    """Destinations the network's proxy refused, ``host:port`` to how many times."""
