"""Namespaces of its own for each fork of a template: what the parent asks of the template,
checks of each fork, and the ids it maps.

Where a template has a PID namespace and the parent is root, each fork makes a user namespace and,
in it, IPC and UTS ones (``agent_shim/shim_parked.py``: ``own_namespaces``) before the template
reports it; a mount namespace too, with its own ``/dev/pts``, ``/dev/shm`` and ``/dev/mqueue``
(mounted by the fork; under a sandbox, whose Landlock rules forbid the fork mounts, by the
template's outer process), and a network one where the sandbox has a network. The parent then checks
that the fork's IPC namespace is neither the importer's nor a sibling's, and maps the fork's ids,
each to itself: root inside stays the owner of what the trainer's root owns, and the capabilities
the agent keeps act on the objects of the fork's own namespaces only (not on the host's network
namespace, its devices or its System V objects). The map is the parent's to write: mapping root
needs CAP_SETFCAP outside, which no process of the template holds.

An unprivileged parent's template lives in a user namespace of its own, whose parent the
parent is not in: each fork maps its own ids there, or, under a sandbox, whose Landlock rules
keep it from doing so (the maps are files in /proc), the template's outer process maps them
while the fork is dumpable (:func:`maps`), once it has found the fork's namespaces made in
the fork's own user namespace. With a network, each fork makes a network namespace too
(docs/sandbox.md). Blocking.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Literal

from .. import containment as _containment
from ..containment import sandbox as _sandbox
from ..containment import wall as _wall
from .forked import TemplateGone

#: Every id to itself (the whole 32-bit range): ownership reads as it does outside.
IDENTITY = b"0 0 4294967295\n"


def wanted(wall: _wall.Wall) -> bool:
    """Whether the forks of a template walled in by ``wall`` make namespaces of their own:
    with a PID namespace, where the trainer is root (the parent maps their ids), or where it
    is not and the template has no sandbox (each fork maps its own) or one with a read-only
    view (whose Landlock rules keep a fork from its maps: the template's outer process writes
    them, :func:`maps`)."""
    if "pidns" not in wall.layers or _problem() is not None:
        return False
    return wall.userns is False or wall.sandbox is None or mounted_by_the_template(wall)


def kinds(wall: _wall.Wall) -> tuple[str, ...]:
    """The namespaces besides user, IPC and UTS each fork of a template walled in by ``wall``
    makes, named to the template in its wall (``fork_unshare``; ``shim_parked.unshare_flags``
    turns them into flags): a mount namespace, for a ``/dev/pts``, ``/dev/shm`` and
    ``/dev/mqueue`` of its own; a network one
    with a sandbox's network. Under a sandbox, only where its view of the file system is
    read-only (:func:`mounted_by_the_template`)."""
    mnt = ("mnt",) if wall.sandbox is None or mounted_by_the_template(wall) else ()
    if wall.sandbox is not None and wall.sandbox.plan.network is not None:
        return (*mnt, "net")
    return mnt


def mounted_by_the_template(wall: _wall.Wall) -> bool:
    """Whether the template's outer process mounts each fork's ``/dev/pts``, ``/dev/shm`` and
    ``/dev/mqueue`` (``agent_shim/shim_outer.py``): under a sandbox, whose Landlock rules forbid the
    fork any mount, and whose view of the file system is read-only (``/dev`` among it)."""
    return wall.sandbox is not None and ["view", "/"] in wall.sandbox.plan.mounts


def template_message(wall: _wall.Wall) -> dict[str, Any]:
    """What a template's importer enters (``Wall.template_message``), with what its forks
    make of their own. Under a sandbox, its Landlock rule for ``/dev/shm`` goes to ``/dev``:
    the walk up from a file in a fork's own ``/dev/shm`` never meets the mount point (Landlock
    skips the roots of the mounts it crosses), but meets ``/dev``, which the sandbox's
    read-only view keeps from any change of its own."""
    message = wall.template_message()
    message["fork_unshare"] = list(kinds(wall))
    message["fork_maps"] = maps(wall)
    sandbox = message.get("sandbox")
    if sandbox is not None and mounted_by_the_template(wall):
        rules = [r for r in sandbox["rules"] if r != ["/dev/shm", "wd"]]
        message["sandbox"] = {**sandbox, "rules": [*rules, ["/dev", "wd"]]}
    return message


def maps(wall: _wall.Wall) -> Literal["parent", "own", "template"]:
    """Who maps the ids of each fork of a template walled in by ``wall``: the parent, where
    the trainer is root; else (the parent is not in the parent user namespace of the forks',
    the template's, and may not) the fork itself, or, under a sandbox, whose Landlock rules
    keep it from its maps in /proc, the template's outer process."""
    if wall.userns is not True:
        return "parent"
    return "own" if wall.sandbox is None else "template"


def own_ipc(pid: int, name: str, shared: Callable[[int], bool]) -> int:
    """The inode of the IPC namespace of the fork ``pid`` of template ``name``, which must not
    be ``shared`` (a live sibling's; for a root parent, the importer's too). A fork of an
    unprivileged trainer's sandboxed template is dumpable until the template maps its ids,
    and the template's outer process checks it is not the template's. Raises
    :class:`TemplateGone`."""
    ipc = namespace(pid, "ipc")
    if ipc is None:
        raise TemplateGone(f"template {name}: its fork {pid} is gone, or not dumpable")
    if shared(ipc):
        raise TemplateGone(f"template {name}: its fork {pid} shares an IPC namespace")
    return ipc


def network_problem(containment: str) -> str | None:
    """Why the forks of a template at ``containment`` cannot each have a network namespace of
    their own (for ``Sandbox(network=...)``), or None. Blocking (probes may run)."""
    if "pidns" not in _containment.layers(containment):
        return "at a combination without pidns"
    problem = _problem() or _sandbox.network_problem()
    return f"here: {problem}" if problem is not None else None


def shared(containment: str) -> str:
    """What the forks of one template at ``containment`` (without a sandbox) share, in words
    (``isolate doctor``). Blocking (a probe may run)."""
    layers = _containment.layers(containment)
    if "pidns" not in layers:
        return "its forks share the machine's namespaces, as fresh episodes at this level do"
    if _problem() is None:
        return (
            "its forks share its PID namespace; each has user, IPC, UTS and mount namespaces, "
            "and a /dev/shm, of its own"
        )
    return (
        "its forks share its PID, mount, IPC and UTS namespaces and /dev/shm (a System V "
        "object one episode makes, a sibling can reach): run episodes that must not share them "
        "fresh"
    )


@functools.cache
def _problem() -> str | None:
    """Why this process cannot give a fork a user namespace, or None; probed once."""
    return _sandbox.userns_problem()


def namespace(pid: int | str, kind: str) -> int | None:
    """The inode of process ``pid``'s namespace of ``kind`` (``ipc``, ``user``); None if the
    process is gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def still_in(pid: int, kind: str, inode: int) -> bool:
    """Whether process ``pid`` is in the namespace of ``kind`` whose inode is ``inode`` now.
    False once it has left its namespaces, as an exiting process does before its pidfd says
    it has exited, or is gone; True where it cannot be told (the process is not dumpable and
    this one unprivileged)."""
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino == inode
    except FileNotFoundError:
        return False
    except OSError:
        return True


def adopt(
    pid: int,
    importer: int | None,
    name: str,
    shared: Callable[[int], bool],
    kinds: tuple[str, ...],
) -> int:
    """Check that the fork ``pid`` of template ``name`` has an IPC namespace of its own (not
    the importer's, nor a live sibling's: ``shared(inode)``), and namespaces of ``kinds``
    (``mnt``, ``net``) that are not the importer's, then map its user namespace's ids, which
    only a user namespace made since, whose ids are not mapped yet, takes: the fork's IPC
    namespace's inode. Raises :class:`TemplateGone`."""
    if importer is None:
        raise TemplateGone(f"template {name}: its fork {pid} is gone")
    ipc = own_ipc(pid, name, lambda inode: inode == namespace(importer, "ipc") or shared(inode))
    for kind in kinds:
        if namespace(pid, kind) in (None, namespace(importer, kind)):
            raise TemplateGone(f"template {name}: its fork {pid} shares its {kind} namespace")
    for which in ("uid_map", "gid_map"):
        try:
            fd = os.open(f"/proc/{pid}/{which}", os.O_WRONLY)
            try:
                os.write(fd, IDENTITY)
            finally:
                os.close(fd)
        except OSError as exc:
            # Written already (not a new user namespace), or not a child of ours.
            raise TemplateGone(
                f"template {name}: cannot map the ids of its fork {pid} ({exc.strerror})"
            ) from None
    return ipc
