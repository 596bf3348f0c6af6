"""The plan of one episode's sandbox: the Landlock rules that carve the hidden paths out of the
file system, the mounts that do what Landlock cannot, and what is missing on this machine. How
carving works, and what the rule kinds and mount operations mean: :mod:`.sandbox`.

Blocking: the plan lists the directories above each hidden path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..network.plan import NetworkPlan, plan_network

#: Devices an agent may open for reading and writing (and ioctl: terminals).
DEVICES = ("null", "zero", "full", "random", "urandom", "tty", "ptmx")
#: Directories under /dev the agent may write: pseudo-terminals, POSIX shared memory and
#: message queues (multiprocessing's locks live in /dev/shm).
DEVICE_DIRS = ("pts", "shm", "mqueue")
#: Files under a writable path that stay read-only: a shell or git reads them and runs what
#: they say, outside the sandbox, when the trainer's user next opens a shell or runs git there.
PROTECTED = (
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".bash_logout",
    ".profile",
    ".zshrc",
    ".zshenv",
    ".zprofile",
    ".zlogin",
    ".git/hooks",
    ".git/config",
)


@dataclass
class SandboxPlan:
    """What the shim's worker does for one episode's sandbox."""

    rules: list[list[str]] = field(default_factory=list)
    mounts: list[list[str]] = field(default_factory=list)
    ports: list[int] | None = None
    unshare_mounts: bool = False
    """The worker makes its own mount namespace (the episode has none)."""
    enforced: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    network: NetworkPlan | None = None

    def handshake(self, best_effort: bool) -> dict[str, Any]:
        return {
            "rules": self.rules,
            "mounts": self.mounts,
            "ports": self.ports,
            "unshare_mounts": self.unshare_mounts,
            "best_effort": best_effort,
            "network": None if self.network is None else self.network.handshake(),
        }


def under(path: str, root: str) -> bool:
    """``path`` is ``root`` or below it (both normalised)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def from_paths(
    hidden: list[str],
    writable: Sequence[str],
    network: str | tuple[str, ...] | None,
    connect: tuple[int, ...] | None,
    *,
    abi: int,
    mountns: bool,
    can_unshare: bool,
) -> SandboxPlan:
    """The rules and mounts for one episode. ``hidden``, ``writable``: real paths; ``network``,
    ``connect``: the sandbox's rules; ``abi``: the kernel's Landlock version; ``mountns``: the
    episode has a mount namespace of its own; ``can_unshare``: the worker may make one."""
    out = SandboxPlan()
    mounts = mountns or can_unshare
    out.unshare_mounts = mounts and not mountns
    writable = list(dict.fromkeys(writable))
    out.rules = read_rules(hidden)
    out.rules.extend([p, "wd" if os.path.isdir(p) else "wf"] for p in writable)
    out.enforced.append(f"reads: {len(hidden)} paths hidden")
    out.enforced.append("writes: only " + ", ".join(writable) + " and /dev/null and its like")
    if abi < 1:
        out.missing.append("file-system rules: this kernel has no Landlock")
        out.enforced.clear()
    elif abi < 3:
        out.missing.append(
            f"truncate() of files outside the writable paths: needs Landlock ABI 3, "
            f"this kernel has {abi}"
        )
    _inside_writable(out, hidden, writable, mounts)
    _hard_links(out, hidden)
    _network(out, network, connect, abi)
    out.enforced.append("no_new_privs")
    return out


def read_rules(hidden: list[str]) -> list[list[str]]:
    """The read rules: every existing directory above a hidden path, and /dev (raw disks),
    listed only, with a rule for each of its entries but the way down."""
    carved = {"/dev"}
    for path in hidden:
        parent = os.path.dirname(path)
        while True:
            if os.path.isdir(parent):
                carved.add(parent)
            if parent == "/":
                break
            parent = os.path.dirname(parent)
    hidden_set = set(hidden)
    rules = []
    for directory in sorted(carved):
        rules.append([directory, "ld"])  # listing only (READ_DIR)
        for entry, is_dir, is_link in _entries(directory):
            path = os.path.join(directory, entry)
            # /dev/stdout and the like lead into /proc, which has a rule of its own.
            if directory == "/dev" and entry not in DEVICE_DIRS + DEVICES:
                continue
            if not is_link:
                # Carved directories are real paths, so is this entry; only a hidden path or
                # a carved directory (it has rules of its own) can be it.
                if path in hidden_set or path in carved:
                    continue
            else:
                # A symlink is granted at its target (the shim never follows a rule's path):
                # never one that leads into or above a hidden path (``~/keys -> ~/.ssh``).
                path = os.path.realpath(path)
                if path in carved or any(under(path, h) or under(h, path) for h in hidden):
                    continue
                is_dir = os.path.isdir(path)
            if directory == "/dev" and entry in DEVICES:
                rules.append([path, "dev"])
            elif directory == "/dev" and entry in DEVICE_DIRS:
                rules.append([path, "wd"])
            else:
                rules.append([path, "rd" if is_dir else "rf"])
    return rules


def _inside_writable(
    out: SandboxPlan, hidden: list[str], writable: list[str], mounts: bool
) -> None:
    """What Landlock cannot subtract from a writable path: mounts where there may be some
    (``mounts``), else written down as missing."""
    inside = [h for h in hidden if any(under(h, w) for w in writable) and os.path.lexists(h)]
    protect = [
        os.path.join(w, name)
        for w in writable
        if os.path.isdir(w)
        for name in PROTECTED
        if os.path.lexists(os.path.join(w, name)) and not os.path.islink(os.path.join(w, name))
    ]
    if not mounts:
        if protect:
            out.missing.append(
                "read-only " + ", ".join(protect) + " inside a writable path: needs a mount "
                "namespace (containment with pidns, or root)"
            )
        if inside:
            out.missing.append(
                "hidden " + ", ".join(inside) + " inside a writable path: needs a mount namespace"
            )
        return
    # A view, not a veto: everything read-only, then each writable path writable again.
    out.mounts.append(["view", "/"])
    out.mounts.extend(["rw", w] for w in writable)
    out.enforced.append(
        "read-only view: no mode, owner, time or attribute changes outside " + ", ".join(writable)
    )
    for w in writable:
        git = os.path.join(w, ".git")
        if os.path.isdir(git) and not os.path.islink(git):
            out.mounts.append(["pin", git])
    out.mounts.extend(["ro", p] for p in protect)
    for path in hidden:
        if os.path.isdir(path) and not os.path.islink(path):
            out.mounts.append(["hide-dir", path])
        elif os.path.isfile(path) and not os.path.islink(path):
            out.mounts.append(["hide-file", path])
    if protect:
        out.enforced.append("read-only: " + ", ".join(protect))
    out.enforced.append("hidden paths read as empty (mounts)")


def _hard_links(out: SandboxPlan, hidden: list[str]) -> None:
    """A hidden file's other names are readable where they are: said, not hidden."""
    for path in hidden:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not os.path.isdir(path) and st.st_nlink > 1:
            out.missing.append(
                f"hidden {path} has {st.st_nlink - 1} other hard link(s), readable where they are"
            )


def _network(
    out: SandboxPlan,
    network: str | tuple[str, ...] | None,
    connect: tuple[int, ...] | None,
    abi: int,
) -> None:
    if network is not None:
        out.network = plan_network(network)
        out.enforced.append(out.network.describe())
    if connect is None:
        return
    if abi < 4:
        out.missing.append(
            f"TCP connect ports: need Landlock ABI 4, this kernel has {abi or 'no Landlock'}"
        )
        return
    out.ports = list(connect)
    if out.network is not None:
        # The proxy and the carried ports, inside the episode's namespace.
        out.ports = sorted({*out.ports, *out.network.ports})
    ports = ", ".join(map(str, connect)) or "none"
    out.enforced.append(f"TCP connect only to ports {ports}")


def _entries(directory: str) -> list[tuple[str, bool, bool]]:
    """(name, is a directory, is a symlink) of each entry."""
    try:
        with os.scandir(directory) as it:
            return [(e.name, _is_dir(e), e.is_symlink()) for e in it]
    except OSError:
        return []


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False
