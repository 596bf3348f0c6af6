"""The shim's Landlock wrappers (``agent_shim/shim_landlock.py``), each restriction applied in
a child process of its own (a restriction can never be lifted: never in the test runner)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import isolate

from .conftest import SLOW, is_gone

# Loads the part the way the shim does, then runs the test's code; prints one JSON line.
_PRELUDE = """
import json, os, signal, sys
sys.path.insert(0, {shim_dir!r})
import shim
del sys.path[0], sys.modules["shim"]
L = shim.load_part("landlock")
out = {{}}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except OSError as exc:
        out[name] = "refused: " + os.strerror(exc.errno)
"""


def run_child(code: str, python: str = sys.executable) -> dict[str, Any]:
    """Run ``code`` (after the prelude) in a fresh interpreter; the ``out`` dict it filled."""
    shim_dir = str(isolate.shim_path().parent)
    source = _PRELUDE.format(shim_dir=shim_dir) + textwrap.dedent(code) + "\nprint(json.dumps(out))"
    proc = subprocess.run(
        [python, "-I", "-c", source], capture_output=True, text=True, timeout=30 * SLOW
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def abi() -> int:
    return int(run_child("out['abi'] = L.abi()")["abi"])


@pytest.fixture(scope="module")
def landlock_abi() -> int:
    version = abi()
    if version == 0:
        pytest.skip("this kernel has no Landlock (or it is disabled)")
    return version


@pytest.fixture
def stand_in() -> Any:
    """A process outside any Landlock domain, as the trainer is."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_abi_and_refused_masks(landlock_abi: int) -> None:
    out = run_child("out['errata'] = L.errata(); out['abi'] = L.abi()")
    assert out["abi"] == landlock_abi
    assert type(out["errata"]) is int
    from_abi_1 = run_child(
        "out['r'] = L.refused(1, fs=L.FS_READ_FILE | L.FS_REFER, net=L.NET_BIND_TCP,"
        " scoped=L.SCOPE_SIGNAL)"
    )
    assert from_abi_1["r"] == [1 << 13, 1, 2]
    assert run_child("out['r'] = L.refused(6, fs=L.FS_IOCTL_DEV, scoped=3)")["r"] == [0, 0, 0]


@pytest.mark.parametrize("python", [sys.executable, "~/.pyenv/versions/3.9.18/bin/python3.9"])
def test_scoped_signals_and_ptrace_are_refused_outside_the_domain(
    landlock_abi: int, stand_in: subprocess.Popen[bytes], python: str
) -> None:
    if landlock_abi < 6:
        pytest.skip(f"Landlock ABI {landlock_abi} has no scoped signals (6 needed)")
    interpreter = Path(python).expanduser()
    if not interpreter.exists():
        pytest.skip(f"{interpreter} is not installed")
    code = f"""
    import ctypes
    target = {stand_in.pid}
    ruleset = L.create_ruleset(scoped=L.SCOPE_SIGNAL | L.SCOPE_ABSTRACT_UNIX_SOCKET)
    L.restrict_self(ruleset)
    os.close(ruleset)
    child = os.fork()  # inside the domain
    if child == 0:
        signal.pause()
    attempt("kill", lambda: os.kill(target, signal.SIGKILL))
    attempt("mem", lambda: open("/proc/%d/mem" % target, "rb").close())
    libc = ctypes.CDLL(None, use_errno=True)
    out["ptrace"] = libc.ptrace(16, target, None, None)  # PTRACE_ATTACH
    attempt("own child", lambda: os.kill(child, signal.SIGKILL))
    """
    out = run_child(code + "\n    os.waitpid(child, 0)", str(interpreter))
    assert out["kill"] == "refused: Operation not permitted"
    assert out["mem"] == "refused: Permission denied"
    assert out["ptrace"] == -1
    assert out["own child"] == "allowed"  # the domain's own processes stay reachable
    assert not is_gone(stand_in.pid)


def test_an_abstract_socket_outside_the_domain_cannot_be_reached(landlock_abi: int) -> None:
    if landlock_abi < 6:
        pytest.skip(f"Landlock ABI {landlock_abi} has no abstract unix socket scope (6 needed)")
    name = f"\0isolate-test-{id(landlock_abi)}-{__name__}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(name)
        server.listen(1)
        code = f"""
        import socket
        def connect():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect({name!r})
        attempt("before", connect)
        ruleset = L.create_ruleset(scoped=L.SCOPE_ABSTRACT_UNIX_SOCKET)
        L.restrict_self(ruleset)
        attempt("after", connect)
        """
        out = run_child(code)
    assert out == {"before": "allowed", "after": "refused: Operation not permitted"}


def test_path_rules_allow_only_beneath_their_directory(landlock_abi: int, tmp_path: Path) -> None:
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    for d in (inside, outside):
        d.mkdir()
        (d / "f").write_text("x")
    code = f"""
    ruleset = L.create_ruleset(fs=L.FS_READ_FILE)
    L.add_path_rule(ruleset, {str(inside)!r}, L.FS_READ_FILE)
    L.restrict_self(ruleset)
    attempt("inside", lambda: open({str(inside / "f")!r}).read())
    attempt("outside", lambda: open({str(outside / "f")!r}).read())
    """
    assert run_child(code) == {"inside": "allowed", "outside": "refused: Permission denied"}


def test_port_rules_allow_only_their_port(landlock_abi: int) -> None:
    if landlock_abi < 4:
        pytest.skip(f"Landlock ABI {landlock_abi} has no TCP rules (4 needed)")
    code = """
    import socket
    def bind(port):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            return s.getsockname()[1]
    with socket.socket() as probe:  # a free port, found before the restriction
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    ruleset = L.create_ruleset(net=L.NET_BIND_TCP)
    L.add_port_rule(ruleset, free, L.NET_BIND_TCP)
    L.restrict_self(ruleset)
    attempt("allowed port", lambda: bind(free))
    attempt("other port", lambda: bind(free + 1 if free < 65535 else free - 1))
    """
    out = run_child(code)
    assert out == {"allowed port": "allowed", "other port": "refused: Permission denied"}


def test_rights_this_abi_lacks_are_an_error_not_a_silent_no_op(landlock_abi: int) -> None:
    out = run_child(
        """
        attempt("unknown right", lambda: L.create_ruleset(fs=1 << 60))
        attempt("nothing handled", lambda: L.create_ruleset())
        """
    )
    assert out["unknown right"] == "refused: Invalid argument"
    assert out["nothing handled"].startswith("refused: ")
