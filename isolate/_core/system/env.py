"""The child's environment: built from an allow-list, never inherited wholesale.

``inherit_env`` holds exact names, fnmatch patterns, and exclusions (``!PATTERN``). A parent
variable passes when it is named exactly, or when a pattern matches it, no exclusion does and
its name does not look like a credential. What a pattern matched but a rule held back is
*withheld*, with a reason: the episode's log names it, ``isolate doctor`` explains it.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from pydantic import SecretStr

from agent_shim.shim_wire import EPISODE_ENV, EPISODE_TAG_ENV

if TYPE_CHECKING:
    from ..model.config import EpisodeSpec

# Names that carry credentials by convention. They pass only when named exactly, never
# through a wildcard: inherit_env=("*",) must not hand the parent's OPENAI_API_KEY over.
_SECRET_LOOKING = re.compile(
    r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY|ACCESS_KEY|SESSION_KEY)",
    re.IGNORECASE,
)

#: Variables that would undo the agent's own interpreter: the trainer's PYTHONPATH (which the
#: shim puts on sys.path), PYTHONHOME, its activated virtualenv or conda env, a preloaded
#: library. The AReaL drop-in excludes them; each with the reason doctor gives.
INTERPRETER_ENV: dict[str, str] = {
    "PYTHON*": "steers Python: the trainer's setting would apply to the agent's interpreter",
    "VIRTUAL_ENV": "activates the trainer's virtualenv",
    "VIRTUAL_ENV_PROMPT": "activates the trainer's virtualenv",
    "CONDA_*": "activates the trainer's conda environment",
    "_CE_*": "activates the trainer's conda environment",
    "LD_PRELOAD": "preloads a library into every process the agent starts",
}

#: What the AReaL drop-in (and ``isolate run`` / ``batch``) pass by default: the trainer's whole
#: environment, as the in-process workflow saw it, minus credential-like names and
#: :data:`INTERPRETER_ENV`.
PASSTHROUGH_ENV: tuple[str, ...] = ("*", *(f"!{p}" for p in INTERPRETER_ENV))

CREDENTIAL = "looks like a credential: pass it with secret_env, or name it in inherit_env"
HOLDS_SECRET = "holds a secret of this episode (secrets / secret_env)"


def looks_secret(name: str) -> bool:
    """True for names such as ``OPENAI_API_KEY``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``."""
    return bool(_SECRET_LOOKING.search(name))


@functools.lru_cache(maxsize=64)
def _rules(
    inherit: tuple[str, ...],
) -> tuple[frozenset[str], re.Pattern[str] | None, re.Pattern[str] | None, tuple[str, ...]]:
    """Exact names, one regex of the patterns, one of the exclusions, and the exclusions.

    One regex each, compiled once per ``inherit``: a trainer has hundreds of variables, and this
    runs for every episode."""
    exact = frozenset(
        p for p in inherit if not p.startswith("!") and not any(c in p for c in "*?[")
    )
    exclusions = tuple(p[1:] for p in inherit if p.startswith("!"))
    patterns = [p for p in inherit if p not in exact and not p.startswith("!")]

    def matcher(items: Iterable[str]) -> re.Pattern[str] | None:
        parts = [f"(?:{fnmatch.translate(p)})" for p in items]
        return re.compile("|".join(parts)) if parts else None

    return exact, matcher(patterns), matcher(exclusions), exclusions


def _exclusion_reason(name: str, exclusions: tuple[str, ...]) -> str:
    for pattern in exclusions:
        if fnmatch.fnmatchcase(name, pattern):
            return INTERPRETER_ENV.get(pattern, f"excluded by inherit_env '!{pattern}'")
    raise AssertionError(f"{name} matched no exclusion")


#: ``_verdict`` answers: the name is not asked for; it passes.
_SKIP, _PASS = "skip", ""


def _verdict(inherit: tuple[str, ...], name: str) -> str:
    """What ``inherit`` does with a variable called ``name``: ``_SKIP``, ``_PASS`` or the reason
    it is withheld."""
    exact, include, exclude, exclusions = _rules(inherit)
    if name in exact:
        return _PASS
    if include is None or not include.fullmatch(name):
        return _SKIP  # not asked for: nothing to report
    if exclude is not None and exclude.fullmatch(name):
        return _exclusion_reason(name, exclusions)
    return CREDENTIAL if looks_secret(name) else _PASS


@functools.lru_cache(maxsize=64)
def _verdicts(inherit: tuple[str, ...]) -> dict[str, str]:
    """name -> verdict, filled as names come: a trainer's names are the same every episode."""
    return {}


def split_env(
    parent: Mapping[str, str],
    inherit: Iterable[str],
    *,
    secret_values: Collection[str] = (),
) -> tuple[dict[str, str], dict[str, str]]:
    """The parent variables ``inherit`` passes, and those it withholds (name -> reason).

    A variable whose value is one of ``secret_values`` never passes, named exactly or not."""
    rules = tuple(inherit)
    known = _verdicts(rules)
    if len(known) > 100_000:  # an environment whose names keep changing
        known.clear()
    secrets = {v for v in secret_values if v}
    passed: dict[str, str] = {}
    withheld: dict[str, str] = {}
    for name, value in parent.items():
        verdict = known.get(name)
        if verdict is None:
            verdict = known[name] = _verdict(rules, name)
        if verdict == _SKIP:
            continue
        if value in secrets:
            withheld[name] = HOLDS_SECRET
        elif verdict:
            withheld[name] = verdict
        else:
            passed[name] = value
    return passed, withheld


def episode_env(
    inherit: Iterable[str],
    own: Mapping[str, str],
    episode_id: str,
    *,
    tag: str,
    secret_values: Collection[str] = (),
    delivered: Iterable[str] = (),
) -> tuple[dict[str, str], dict[str, str]]:
    """The exec environment of an episode's shim (or a template's), but its sandbox's TMPDIR:
    what ``inherit`` passes of ours, less the ``delivered`` names (the handshake carries
    them), then ``own`` (the spec's), the episode's id and its ``tag``; and what was withheld
    (name -> reason)."""
    env, withheld = split_env(os.environ, inherit, secret_values=secret_values)
    for name in delivered:
        env.pop(name, None)
        withheld.pop(name, None)
    env.update(own)
    env[EPISODE_ENV] = episode_id
    env[EPISODE_TAG_ENV] = tag
    return env, withheld


def spec_env(
    spec: EpisodeSpec,
    episode_id: str,
    secrets: Mapping[str, str | SecretStr] | None = None,
    secret_env: Mapping[str, str | SecretStr] | None = None,
    tag: str | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """:func:`episode_env` for ``spec``: the one builder of the base environment of an episode,
    a template and a parked fork. An inherited variable that holds the value of one of
    ``secrets`` or ``secret_env`` is withheld; ``secret_env``'s names are left out (the
    handshake carries them). ``tag``: the episode's own (default: its id, for a template's
    environment, which each fork tags anew)."""
    given = [*(secrets or {}).values(), *(secret_env or {}).values()]
    values = [v.get_secret_value() if isinstance(v, SecretStr) else str(v) for v in given]
    return episode_env(
        spec.inherit_env,
        spec.env,
        episode_id,
        tag=episode_id if tag is None else tag,
        secret_values=values,
        delivered=secret_env or {},
    )


def describe_withheld(withheld: Mapping[str, str]) -> str:
    """One line naming withheld variables, grouped by reason; names only, never values."""
    groups: dict[str, list[str]] = {}
    for name, reason in withheld.items():
        groups.setdefault(reason.split(":")[0].split(" (")[0], []).append(name)
    parts = [f"{', '.join(sorted(names))} ({why})" for why, names in sorted(groups.items())]
    return "withheld from the agent's environment: " + "; ".join(parts) + " (isolate doctor)"
