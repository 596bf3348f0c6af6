"""The child's environment: built from an allow-list, never inherited wholesale."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping

from .config import EPISODE_ENV

# Names that carry credentials by convention. They pass only when named exactly, never
# through a wildcard: inherit_env=("*",) must not hand the parent's OPENAI_API_KEY over.
_SECRET_LOOKING = re.compile(
    r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY|ACCESS_KEY|SESSION_KEY)",
    re.IGNORECASE,
)


def looks_secret(name: str) -> bool:
    """True for names such as ``OPENAI_API_KEY``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``."""
    return bool(_SECRET_LOOKING.search(name))


def build_env(
    parent: Mapping[str, str],
    inherit: Iterable[str],
    extra: Mapping[str, str],
    episode_id: str,
) -> dict[str, str]:
    """The child's environment: allow-listed parent names, then ``extra``, then the episode tag."""
    exact = {p for p in inherit if not any(c in p for c in "*?[")}
    patterns = [p for p in inherit if p not in exact]
    env: dict[str, str] = {}
    for name, value in parent.items():
        if name in exact:
            env[name] = value
        elif not looks_secret(name) and any(fnmatch.fnmatchcase(name, p) for p in patterns):
            env[name] = value
    env.update(extra)
    env[EPISODE_ENV] = episode_id
    return env
