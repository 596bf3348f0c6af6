"""Promise: ``isolate doctor`` says what the wall is built of on this machine and what is
missing, and without the stronger layers (no Landlock, no namespaces) episodes still run at what
is left. No attack here: each layer is taken away for real (a filter that makes Landlock's
system calls fail, a machine without namespaces) and doctor's words are checked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .. import _internals
from ..conftest import SLOW
from ..teardown._trees import needs
from ..test_cli import SCRIPTED, isolate_cli
from ._attacks import linux_only

pytestmark = pytest.mark.anyio


# Makes the landlock_* system calls fail with ENOSYS for this process and all it starts, as on
# a kernel without Landlock, then runs the command in argv.
NO_LANDLOCK = r"""
import ctypes, os, struct, sys
ALLOW, ENOSYS = 0x7FFF0000, 0x00050000 | 38
program = [
    (0x20, 0, 0, 0),  # load the system call number
    (0x35, 0, 2, 444),  # < landlock_create_ruleset: allow
    (0x25, 1, 0, 446),  # > landlock_restrict_self: allow
    (0x06, 0, 0, ENOSYS),
    (0x06, 0, 0, ALLOW),
]
code = b"".join(struct.pack("HBBI", *op) for op in program)
buf = ctypes.create_string_buffer(code)
fprog = struct.pack("HxxxxxxQ", len(program), ctypes.addressof(buf))
fbuf = ctypes.create_string_buffer(fprog)
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p] + [ctypes.c_ulong] * 2
assert libc.prctl(38, 1, None, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.addressof(fbuf), 0, 0) == 0, ctypes.get_errno()  # SECCOMP filter
os.execv(sys.argv[1], sys.argv[1:])
"""


# Run as root: a mount namespace with every cgroup tree read-only, then a user namespace that
# allows no further ones and no CAP_SYS_ADMIN: no cgroup layer, no PID namespace.
WITHOUT_NAMESPACES = """
set -e
for point in $CGROUP_MOUNTS; do mount -o remount,bind,ro "$point"; done
exec unshare --user --map-root-user sh -c '
    echo 0 > /proc/sys/user/max_user_namespaces
    exec setpriv --inh-caps=-sys_admin --bounding-set=-sys_admin "$@"' sh "$@"
"""


@pytest.mark.parametrize("landlock", [False, True], ids=["nothing", "landlock only"])
def test_without_the_stronger_layers_episodes_run_and_doctor_says_what_is_missing(
    tmp_path: Path, landlock: bool
) -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv to take the layers away for real")
    if landlock:
        needs("landlock")
    script = tmp_path / "without.sh"
    script.write_text(WITHOUT_NAMESPACES)
    mounts = [p for t, _, p, _ in _internals.mounts() if t in ("cgroup", "cgroup2")]
    command = [sys.executable, "-m", "isolate", "doctor", "--agent-root", str(SCRIPTED)]
    if not landlock:
        command = [sys.executable, "-c", NO_LANDLOCK, *command]
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", str(script), *command],
        capture_output=True,
        text=True,
        timeout=120 * SLOW,
        env={**os.environ, "CGROUP_MOUNTS": " ".join(mounts)},
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr  # a weaker layer is a warning, not a failure
    assert "warn  layer cgroup: not available: cgroup tree" in out
    assert "warn  layer pidns: not available: namespaces not permitted" in out
    used = "landlock" if landlock else "session"
    assert f"ok    containment auto: {used}\n" in out
    assert f"containment {used})" in out  # the shim's round trip ran there
    assert f"warn  at {used} an agent can still, whatever it runs:" in out
    # Root inside that user namespace is the host's root: its file access is not walled.
    assert "warn  the trainer runs as root, and so does the agent" in out
    assert "info  to add pidns: PID namespaces: allow user namespaces" in out
    assert "info  to add cgroup: a delegated cgroup v2 subtree" in out
    if landlock:
        assert "ok    layer landlock: available" in out
        assert "kill the trainer" not in out
        assert "to add landlock" not in out
    else:
        assert "warn  layer landlock: not available: the kernel has no Landlock" in out
        assert "- kill the trainer and every sibling episode" in out
        assert "info  to add landlock: Landlock ABI 6" in out


@linux_only
@pytest.mark.parametrize("containment", ["cgroup+pidns", "pidns", "cgroup", "landlock"])
def test_doctor_says_what_the_combination_builds(containment: str) -> None:
    needs(containment)
    proc = isolate_cli("doctor", "--agent-root", str(SCRIPTED), "--containment", containment)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    world = f"ok    at {containment} the episode's world is built for it: PID, mount, IPC, UTS"
    assert (world in proc.stdout) is ("pidns" in containment), proc.stdout
    if os.geteuid() == 0:
        sysrq = "reboot the machine through /proc/sysrq-trigger"
        assert (sysrq in proc.stdout) is ("pidns" not in containment), proc.stdout
