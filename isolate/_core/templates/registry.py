"""The templates of this process, one per key: started on first use, shared by the episodes
of that key, refused for good when unusable, replaced when dead, closed by
:func:`close_templates`.

Everything here but :func:`acquire`, :func:`park`, :func:`try_start` and
:func:`close_templates` blocks: run it in a worker thread.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from pydantic import SecretStr

from agent_shim.shim_wire import EPISODE_VARS, json_file, receive_message, send_message

from .. import containment as _containment
from ..containment import sandbox as _sandbox
from ..containment import wall as _wall
from ..model.config import EpisodeSpec
from ..model.errors import ArgumentError, IsolateError, SetupProblem
from ..system import admission as _admission
from ..system.env import spec_env
from ..system.shim import boot_path
from . import namespaces as _namespaces
from . import sizing as _sizing
from .pool import MAX_PARKED
from .process import Template


@dataclass
class _Entry:
    """The template of one key, or why that key gets none."""

    name: str
    template: Template | None = None
    starting: bool = False
    pending: Template | None = None
    """The template being started, until it is ready or refused."""
    refused: str | None = None
    restarts: int = 0
    closed: bool = False
    parked: int | None = None
    """How many forks its template keeps parked when a caller chose (``isolate.park``), a new
    one too; None: as many as its episodes' bursts (``burst``)."""


_lock = threading.Lock()
#: Held from a template's spawn until it is ``pending``: close_templates() then sees it.
_spawn_lock = threading.Lock()
_entries: dict[tuple[Any, ...], _Entry] = {}


def preload_list(spec: EpisodeSpec) -> tuple[str, ...]:
    return () if isinstance(spec.preload, bool) else spec.preload


def _key(
    spec: EpisodeSpec, env: dict[str, str], agent_root: str | None, level: str
) -> tuple[Any, ...]:
    # The fork's worker sets the TMPDIR itself (the handshake's ``temp_env``): not part of the
    # key, or every sandboxed episode (a private TMPDIR each) had a template.
    per_episode = (*EPISODE_VARS, *_wall.TEMP_ENV)
    return (
        spec.python,
        agent_root,
        spec.entrypoint,
        tuple(sorted((k, v) for k, v in env.items() if k not in per_episode)),
        str(spec.cwd.absolute()) if spec.cwd is not None else os.getcwd(),
        spec.containment,
        level,
        preload_list(spec),
        # The importer is walled in as its episodes are: their limits and sandbox are its.
        spec.limits.model_dump_json() if spec.limits is not None else None,
        spec.sandbox.model_dump_json() if spec.sandbox is not None else None,
        # Should the parent die, the template's PID 1 gives its episodes this long to clean up.
        spec.cancel_grace,
    )


def unusable(spec: EpisodeSpec, level: str) -> str | None:
    """Why no template can give episodes of ``spec`` at ``level`` what a fresh start gives
    them, or None. Blocking (a probe may run)."""
    layers = _containment.layers(level)
    if spec.sandbox is not None and spec.sandbox.network is not None:
        problem = _namespaces.network_problem(level)
        if problem is not None:
            return (
                f"a template cannot give each episode a network namespace of its own {problem}:"
                " episodes with Sandbox(network=...) start fresh"
            )
    if "pidns" in layers:
        if not hasattr(os, "pidfd_open"):
            return "a template in a PID namespace needs pidfds (Linux 5.3)"
        problem = _containment.landlock().problem
        if problem is not None:
            return (
                "the episodes of a template share its PID namespace, and only a Landlock "
                f"domain of their own keeps them from signalling each other ({problem})"
            )
        try:
            how = _wall.plan(spec, level).limits
        except SetupProblem:
            return None  # refused at the start as an episode of that level would be
        if "RLIMIT_NPROC" in how.rlimits:
            return (
                "limits.max_processes without a pids cgroup counts the processes of a user "
                "namespace, which a template's episodes share: add the 'cgroup' layer"
            )
    return None


async def acquire(
    spec: EpisodeSpec,
    env: dict[str, str],
    agent_root: str | None,
    level: str,
    note: Callable[[str], None],
    refused_because: Callable[[str], None] = lambda reason: None,
) -> Template | None:
    """The running template for an episode of ``spec`` whose exec environment would be
    ``env``, started (or restarted) if need be; None when its key is refused (the reason goes
    to ``note``, and to ``refused_because``): the episode starts fresh."""
    key = _key(spec, env, agent_root, level)
    name = "template." + hashlib.sha256(repr(key).encode()).hexdigest()[:12]
    while True:
        died = None
        with _lock:
            entry = _entries.setdefault(key, _Entry(name))
            template, starter = entry.template, False
            if entry.refused is None and template is not None:
                if template.alive():
                    return template
                entry.template, died = None, template
                entry.restarts += 1
            if entry.refused is None and not entry.starting:
                entry.starting = starter = True
        if died is not None:
            note(
                f"template {name} (pid {died.pid}) {died.death()}; starting a new one "
                f"(restart {entry.restarts})"
            )
            died.release_fds()
            threading.Thread(target=died.close, daemon=True).start()  # reap it, remove its leaf
        if starter:
            problem = await anyio.to_thread.run_sync(unusable, spec, level)
            if problem is not None:
                with _lock:
                    entry.starting, entry.refused = False, problem
        if entry.refused is not None:
            _refused(entry.refused, note, refused_because)
            return None
        if not starter:
            await anyio.sleep(0.01)  # another episode is starting it: wait for that
            continue
        started: tuple[Template | None, str | None] = (None, None)
        try:
            # The episode's environment, tagged with the template's name: each fork tags anew.
            tagged = {**env, **dict.fromkeys(EPISODE_VARS, name)}
            started = await _start(spec, tagged, agent_root, level, entry)
        finally:
            template, refused = _settle(entry, *started)
        if template is None:
            assert refused is not None
            _refused(refused, note, refused_because)
            return None
        note(f"template {name} started (pid {template.pid})")
        if entry.parked is not None:  # a new template after one that died: its pool too
            template.sized = True
            if entry.parked:
                _sizing.resize(template, entry.parked)
        return template


def _refused(reason: str, note: Callable[[str], None], because: Callable[[str], None]) -> None:
    note(f"preload refused: {reason}; this episode starts fresh")
    because(reason)


def _settle(
    entry: _Entry, started: Template | None, refused: str | None
) -> tuple[Template | None, str | None]:
    """Record how a start ended in its entry; (template, None) or (None, why)."""
    with _lock:
        entry.starting, entry.pending = False, None
        if entry.closed and started is not None:  # close_templates() ran while it started
            started.release_fds()
            threading.Thread(target=started.close, daemon=True).start()
            started, refused = None, "templates were closed while this one started"
        entry.template, entry.refused = started, refused
    return started, refused


async def _start(
    spec: EpisodeSpec, env: dict[str, str], agent_root: str | None, level: str, entry: _Entry
) -> tuple[Template | None, str | None]:
    """Start a template and wait until it has preloaded: (template, None) or (None, reason)."""
    try:
        template = await anyio.to_thread.run_sync(_spawn, spec, env, level, entry)
    except SetupProblem as exc:
        return None, str(exc)
    template.fds = _admission.hold_fds(3, entry.name)  # control, life, the importer's pidfd
    try:
        message = {
            "t": "preload",
            "entrypoint": spec.entrypoint,
            "agent_root": agent_root,
            "preload": list(preload_list(spec)),
            "cancel_grace": spec.cancel_grace,
        }
        try:
            # The wall goes as a file: a sandbox's rules can outgrow a control message.
            if template.own_namespaces:
                walled = _namespaces.template_message(template.wall)
            else:
                walled = template.wall.template_message()
            wall = json_file(walled)
            try:
                send_message(template.control, message, [wall])
            finally:
                os.close(wall)
            await anyio.wait_readable(template.control.fileno())
            reply, fds = receive_message(template.control)
        except (OSError, ValueError):  # it died (ECONNRESET), or said something else
            reply, fds = None, []
        problem = None
        if reply is not None and reply.get("t") == "ready":
            problem = template.ready(fds.pop(0) if fds else None)
        for fd in fds:
            os.close(fd)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(template.close, 0.0)  # busy importing: no EOF seen
            template.release_fds()
        raise
    if reply is not None and reply.get("t") == "ready" and problem is None:
        return template, None
    died = None
    if problem is None and (reply is None or reply.get("t") != "refused"):
        died = await anyio.to_thread.run_sync(template.death)  # before close() ends its socket
    await anyio.to_thread.run_sync(template.close)
    template.release_fds()
    if problem is not None:
        return None, problem
    if died is None:
        return None, str(reply.get("reason") if reply is not None else "refused")
    log = spec.log_dir / f"{entry.name}.log" if spec.log_dir is not None else None
    where = f"; see {log}" if log is not None else ""
    return None, f"the template {died} while importing{where}"


def _spawn(spec: EpisodeSpec, env: dict[str, str], level: str, entry: _Entry) -> Template:
    """Start the template's process, walled in as its episodes are; SetupProblem."""
    # Its own leaf, with the episodes' limits: never killed or counted with an episode.
    wall = _wall.plan(spec, level).make(spec, entry.name)
    env = wall.exec_env(env)
    own_namespaces = _namespaces.wanted(wall)  # a probe, the first time
    with _spawn_lock:
        return _spawn_locked(spec, env, entry, wall, own_namespaces)


def _spawn_locked(
    spec: EpisodeSpec, env: dict[str, str], entry: _Entry, wall: _wall.Wall, own_namespaces: bool
) -> Template:
    name = entry.name
    leaves, sandbox = wall.leaves, wall.sandbox
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    life, its_life = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    log: Any = subprocess.DEVNULL

    def undo() -> None:
        mine.close()
        life.close()
        if leaves is not None:
            leaves.remove()
        if sandbox is not None:
            _sandbox.remove_tmpdir(sandbox.tmpdir)

    try:
        if spec.log_dir is not None:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(Path(spec.log_dir) / f"{name}.log", "ab")  # noqa: SIM115
        popen = subprocess.Popen(
            [spec.python, "-I", str(boot_path()), "--template", str(its_life.fileno())],
            stdin=theirs.fileno(),
            stdout=log,
            stderr=log,
            env=env,
            cwd=spec.cwd,
            start_new_session=True,
            close_fds=True,
            pass_fds=(its_life.fileno(),),
        )
    except OSError as exc:
        undo()
        raise SetupProblem(f"cannot start a template: {exc.strerror or exc}") from None
    finally:
        theirs.close()
        its_life.close()
        if log is not subprocess.DEVNULL:
            log.close()
    if leaves is not None and "pidns" not in wall.layers:
        # With a PID namespace the outer process and PID 1 stay outside the leaf (its kill
        # must not end the namespace its episodes live in); the importer joins it itself.
        leaves.move(popen.pid)
    life.setblocking(False)
    template = Template(popen, mine, life, name, wall, own_namespaces)
    with _lock:
        entry.pending, closed = template, entry.closed
    if closed:  # close_templates() ran meanwhile, and could not see this one
        template.close(0.0)
        raise SetupProblem("templates were closed while this one started")
    return template


async def try_start(spec: EpisodeSpec) -> tuple[str | None, float]:
    """Start a template for ``spec`` as its first episode would, outside the registry, and
    close it again: (why it would be refused, or None; seconds until it was ready)."""
    entry = _Entry("template.doctor")
    env, _ = spec_env(spec, entry.name)
    root = str(spec.agent_root.expanduser().absolute()) if spec.agent_root is not None else None
    try:
        found = await anyio.to_thread.run_sync(_wall.plan, spec)
    except SetupProblem as exc:
        return str(exc), 0.0
    level = found.containment
    problem = await anyio.to_thread.run_sync(unusable, spec, level)
    if problem is not None:
        return problem, 0.0
    started = time.monotonic()
    template, refused = await _start(spec, env, root, level, entry)
    seconds = time.monotonic() - started
    if template is not None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(template.close)
        template.release_fds()
    return refused, seconds


async def park(
    spec: EpisodeSpec,
    n: int,
    *,
    secrets: Mapping[str, str | SecretStr] | None = None,
    secret_env: Mapping[str, str | SecretStr] | None = None,
    wait: bool = True,
) -> int:
    """Keep ``n`` forks of ``spec``'s template parked ahead of demand, and wait until they
    are: an episode of ``spec`` then starts with a hand-over (see docs/templates.md). Starts
    the template if need be. The pool is refilled in the background, up to ``n``, once no
    fork has been taken from it for a short quiet period (once empty, as soon as no episode
    waits for a fork); ``n=0`` empties it. The size holds from then on: a template ``park``
    never sized keeps as many forks parked as the most of its episodes that ran at once in its
    last burst. ``secrets`` and ``secret_env``: those the episodes will get (only their
    names and values matter: an inherited variable that holds one is withheld, which changes
    the template). ``wait=False``: return once the template is started and the pool sized,
    while its thread parks the forks. Returns how many are parked (at the return).

    Raises :class:`ArgumentError` for a bad ``n`` (not an int from 0 to 1024) or a spec
    without ``preload``, and :class:`IsolateError` when no template can be used for ``spec``
    (the reason its episodes would start fresh) or, when it waits, a fork cannot be parked
    (memory or process numbers short of the pool's floor among the reasons:
    ``pool.MIN_AVAILABLE``).
    """
    if not isinstance(wait, bool):
        raise ArgumentError(f"park: wait must be a bool, got {wait!r}")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_PARKED:
        raise ArgumentError(f"park: n must be an int from 0 to {MAX_PARKED}, got {n!r}")
    if not spec.preload:
        raise ArgumentError("park: the spec has no preload, so its episodes fork no template")
    env, _ = spec_env(spec, "parked", secrets, secret_env)
    root = str(spec.agent_root.expanduser().absolute()) if spec.agent_root is not None else None
    try:
        found = await anyio.to_thread.run_sync(_wall.plan, spec)
    except SetupProblem as exc:
        raise IsolateError(f"park: {exc}") from None
    why: list[str] = []
    template = await acquire(spec, env, root, found.containment, lambda text: None, why.append)
    if template is None:
        raise IsolateError(f"park: no template for this spec: {why[0] if why else 'refused'}")
    with _lock:
        for entry in _entries.values():
            if entry.template is template:
                entry.parked = n
        template.sized = True
    pool = _sizing.resize(template, n)
    while wait and not pool.filled() and pool.problem is None:  # noqa: ASYNC110 - its thread fills it
        await anyio.sleep(0.005)
    if wait and pool.problem is not None and not pool.filled():
        raise IsolateError(f"park: cannot park a fork of {template.name}: {pool.problem}")
    return min(n, len(pool.parked))


def remedy(refused: str) -> str | None:
    """How to get a template used after it was refused for ``refused``, where a fix is known."""
    if "litellm" in refused:
        return (
            "litellm starts that thread at import unless LITELLM_LOCAL_MODEL_COST_MAP=True is "
            "in the agent's environment (econfig env, EpisodeSpec.env)"
        )
    return None


def started_templates() -> list[Template]:
    """The templates running now (for diagnostics and tests)."""
    with _lock:
        return [e.template for e in _entries.values() if e.template is not None]


async def close_templates() -> None:
    """Stop every preloaded template (and forget refusals), leaving no template process behind.
    Episodes forked from them run on to their normal end. The next episode with
    ``preload`` starts a new template.

    **Cancellation:** shielded; the templates are gone when this returns or raises.
    """
    with anyio.CancelScope(shield=True):
        for template in await anyio.to_thread.run_sync(close_all):
            template.release_fds()


def close_all() -> list[Template]:
    """:func:`close_templates`, blocking, for code outside an event loop; returns the templates
    it closed (their fds are still counted in their loop's budget)."""
    with _lock:
        entries = list(_entries.values())
        _entries.clear()
        for entry in entries:
            entry.closed = True
    templates = [e.template for e in entries if e.template is not None]
    for template in templates:
        template.control.close()  # all of them at once, then wait for each
    for template in templates:
        template.close()
    with _spawn_lock:
        pending = [e.pending for e in entries if e.pending is not None]
    for template in pending:
        # Still importing, it would not notice an EOF; its starter sees it die.
        template.popen.kill()
        template.popen.wait()
    return templates
