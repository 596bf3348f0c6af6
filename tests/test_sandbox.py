"""The Sandbox model and its plan: validation, what is hidden and granted, and what a machine
without a feature reports as missing (the plan takes the machine's features as arguments, so
every kernel is covered here; tests/wall/test_trainer_files.py runs the attacks on this one)."""

from __future__ import annotations

import glob
import os
import tempfile
import time
from pathlib import Path

import anyio
import pytest
from pydantic import ValidationError

import isolate
from isolate._core.containment.sandbox import SandboxPlan, hidden_paths, plan_sandbox, ports_of_url

from . import _internals
from .conftest import Agents


def test_defaults() -> None:
    box = isolate.Sandbox()
    assert box.connect is None
    assert box.write == ()
    assert box.hide == ()
    assert not box.best_effort
    assert sorted(isolate.Sandbox.DEFAULT_HIDE) == [
        "~/.aws/credentials",
        "~/.cache/huggingface/token",
        "~/.config/gcloud",
        "~/.config/gh",
        "~/.docker/config.json",
        "~/.git-credentials",
        "~/.gnupg",
        "~/.kube/config",
        "~/.netrc",
        "~/.pypirc",
        "~/.ray",
        "~/.ssh",
    ]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"connect": [0]}, "0 is not a TCP port"),
        ({"connect": [70000]}, "70000 is not a TCP port"),
        ({"hide": ["relative/path"]}, "must be absolute or start with '~/'"),
        ({"hide": ["~user/x"]}, "must be absolute or start with '~/'"),
        ({"writes": ["/tmp"]}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_fields_are_rejected(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        isolate.Sandbox(**fields)  # type: ignore[arg-type]


def test_frozen_and_ports_normalised() -> None:
    box = isolate.Sandbox(connect=[443, 80, 443])
    assert box.connect == (80, 443)
    with pytest.raises(ValidationError):
        box.best_effort = True  # type: ignore[misc]


def test_hide_extends_the_defaults_for_every_home(tmp_path: Path) -> None:
    box = isolate.Sandbox(hide=["~/.config/wandb", "/srv/secrets"])
    found = hidden_paths(box, [str(tmp_path / "a"), str(tmp_path / "b")])
    for home in ("a", "b"):
        assert str(tmp_path / home / ".ssh") in found
        assert str(tmp_path / home / ".config/wandb") in found
    assert "/srv/secrets" in found


def _plan(tmp_path: Path, box: isolate.Sandbox | None = None, **machine: object) -> SandboxPlan:
    home, cwd, tmp = tmp_path / "home", tmp_path / "cwd", tmp_path / "tmp"
    for path in (home / ".ssh", cwd, tmp):
        path.mkdir(parents=True, exist_ok=True)
    args: dict[str, object] = {"abi": 7, "mountns": True, "can_unshare": False}
    args.update(machine)
    return plan_sandbox(
        box or isolate.Sandbox(),
        cwd=str(cwd),
        tmpdir=str(tmp),
        home_dirs=[str(home)],
        **args,  # type: ignore[arg-type]
    )


def test_carving_grants_the_rest_of_the_home_but_not_a_link_into_a_hidden_path(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    (home / "project").mkdir(parents=True)
    (home / ".ssh").mkdir()
    (home / "keys").symlink_to(home / ".ssh")
    (home / "up").symlink_to(tmp_path)
    found = {path: kind for path, kind in _plan(tmp_path).rules}
    assert found[str(home / "project")] == "rd"
    assert found[str(home)] == "ld"  # listing only
    for path in (home / ".ssh", home / "keys", home / "up"):
        assert str(path) not in found
    assert found[str(tmp_path / "cwd")] == "wd"
    assert found["/dev/null"] == "dev"
    assert not any(path.startswith("/dev/sd") or path == "/dev/mem" for path in found)


def _granted(rules: list[list[str]], path: Path) -> list[list[str]]:
    """The rules that give ``path`` more than a listing: on it, or on a directory above it."""
    return [
        [p, kind] for p, kind in rules if kind != "ld" and (str(path) + "/").startswith(p + "/")
    ]


@pytest.mark.parametrize("mounts", [True, False])
def test_a_hidden_symlink_hides_its_target_by_each_layer(tmp_path: Path, mounts: bool) -> None:
    """``~/.ssh -> ~/dotfiles/ssh`` and a hidden file ``~/.tokens -> ~/dotfiles/tokens``: the
    Landlock rules grant neither target (with mounts or without), and the mounts cover both
    targets, each on its own."""
    home, dotfiles = tmp_path / "home", tmp_path / "home" / "dotfiles"
    (dotfiles / "ssh").mkdir(parents=True)
    (home / ".ssh").symlink_to(dotfiles / "ssh")
    (dotfiles / "tokens").write_text("t")
    (home / ".tokens").symlink_to(dotfiles / "tokens")
    (dotfiles / "vimrc").write_text("v")
    box = isolate.Sandbox(hide=["~/.tokens"])
    done = _plan(tmp_path, box, mountns=mounts, can_unshare=False)
    for path in (dotfiles / "ssh", dotfiles / "ssh" / "id_rsa", dotfiles / "tokens"):
        assert _granted(done.rules, path) == [], path
    assert [str(dotfiles), "ld"] in done.rules
    assert [str(dotfiles / "vimrc"), "rf"] in done.rules
    hides = [m for m in done.mounts if m[0].startswith("hide-")]
    if mounts:
        assert ["hide-dir", str(dotfiles / "ssh")] in hides
        assert ["hide-file", str(dotfiles / "tokens")] in hides
    else:
        assert hides == []
        assert done.missing == []


def test_what_each_kernel_cannot_enforce_is_named(tmp_path: Path) -> None:
    assert _plan(tmp_path).missing == []
    assert "this kernel has no Landlock" in _plan(tmp_path, abi=0).missing[0]
    assert "truncate() of files outside" in _plan(tmp_path, abi=2).missing[0]
    box = isolate.Sandbox(connect=[443])
    assert "TCP connect ports: need Landlock ABI 4, this kernel has 3" in (
        _plan(tmp_path, box, abi=3).missing
    )
    assert _plan(tmp_path, box, abi=4).ports == [443]


def test_without_a_mount_namespace_a_checkouts_git_is_named(tmp_path: Path) -> None:
    no_mounts = {"mountns": False, "can_unshare": False}
    assert _plan(tmp_path, **no_mounts).missing == []  # nothing under the writable paths
    (tmp_path / "cwd" / ".git" / "hooks").mkdir(parents=True)
    (tmp_path / "cwd" / ".git" / "config").write_text("")
    missing = _plan(tmp_path, **no_mounts).missing
    assert len(missing) == 1
    assert ".git/hooks" in missing[0]
    assert "mount namespace" in missing[0]
    with_mounts = _plan(tmp_path, mountns=False, can_unshare=True)
    assert with_mounts.missing == []
    assert with_mounts.unshare_mounts
    assert ["ro", str(tmp_path / "cwd" / ".git" / "hooks")] in with_mounts.mounts


def test_ports_of_url() -> None:
    assert ports_of_url("http://127.0.0.1:8000/v1") == 8000
    assert ports_of_url("https://api.example.com/v1") == 443
    assert ports_of_url("http://proxy/v1") == 80
    assert ports_of_url("unix:///x") is None


def test_a_write_path_that_does_not_exist_is_a_setup_error(agents: Agents, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    spec = agents.spec("def run(data):\n    return 1.0\n", sandbox=isolate.Sandbox(write=[missing]))
    outcome = anyio.run(isolate.run_episode, spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert outcome.error.message == f"sandbox write path {missing} does not exist"
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"isolate-{outcome.episode_id}.*"))


def test_a_working_directory_of_slash_is_refused(agents: Agents) -> None:
    # A trainer started in / (a container's WORKDIR) would hand the agent the whole machine.
    spec = agents.spec("def run(data):\n    return 1.0\n", cwd="/", sandbox=isolate.Sandbox())
    outcome = anyio.run(isolate.run_episode, spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert "working directory / would make everything beneath it writable" in (
        outcome.error.message
    )


def test_the_private_tmpdir_is_removed_after_a_timeout(agents: Agents, tmp_path: Path) -> None:
    code = """
        import os, tempfile, time
        def run(data):
            os.makedirs(os.path.join(tempfile.gettempdir(), "deep", "er"))
            with open(os.path.join(tempfile.gettempdir(), "deep", "er", "f"), "w") as f:
                f.write("x")
            os.chmod(os.path.join(tempfile.gettempdir(), "deep"), 0o500)
            with open(os.path.join(data["cwd"], "started"), "w") as f:
                f.write(os.environ["TMPDIR"])
            time.sleep(60)
        """
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    spec = agents.spec(code, cwd=cwd, timeout=3.0, kill_grace=0.5, sandbox=isolate.Sandbox())
    outcome = anyio.run(isolate.run_episode, spec, {"cwd": str(cwd)})
    assert outcome.status == "timeout", outcome.summary() + outcome.stderr_tail
    assert outcome.sandbox is not None
    assert outcome.sandbox.tmpdir is not None
    assert (cwd / "started").read_text() == str(outcome.sandbox.tmpdir)
    assert not outcome.sandbox.tmpdir.exists()


def test_a_dead_parents_tmpdirs_are_swept_once_they_are_old(tmp_path: Path) -> None:
    """A trainer killed with sandboxed episodes running leaves their TMPDIRs: the next isolate
    process removes those of dead parents, and only once they are old enough that no clean-up
    of theirs can still be running."""
    from isolate._core.containment import sandbox as _sandbox

    me = f"{os.getpid()}-{_internals.start_time(os.getpid())}"
    dead = "999999999-1"  # no such pid
    old_dead = tmp_path / f"isolate-episode.1.o{dead}.abc123"
    young_dead = tmp_path / f"isolate-x.y.o{dead}.def456"
    alive = tmp_path / f"isolate-episode.2.o{me}.ghi789"
    other = tmp_path / "isolate-unrelated"
    for path in (old_dead, young_dead, alive, other):
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "file").write_text("x")
    (old_dead / "sub").chmod(0o500)  # as an agent may leave it
    stale = time.time() - _sandbox.STALE_TMPDIR_S - 10
    os.utime(old_dead, (stale, stale))
    os.utime(alive, (stale, stale))
    assert _sandbox.sweep_stale_tmpdirs(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (young_dead, alive, other)
    )
    assert _sandbox.sweep_stale_tmpdirs(str(tmp_path), min_age=0) == 1
    assert not young_dead.exists()
    assert alive.exists()
    assert other.exists()


def test_a_tmpdir_is_named_for_its_parent(agents: Agents) -> None:

    spec = agents.spec("import os\ndef run(data):\n    return 1.0, os.environ['TMPDIR']\n")
    spec = spec.model_copy(update={"sandbox": isolate.Sandbox(best_effort=True)})
    outcome = anyio.run(isolate.run_episode, spec, {})
    assert outcome.status == "ok", outcome.summary()
    name = Path(outcome.info).name
    owner = f"{os.getpid()}-{_internals.start_time(os.getpid())}"
    assert name.startswith(f"isolate-{outcome.episode_id}.o{owner}."), name
