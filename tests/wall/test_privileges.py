"""Promise: an agent holds no privilege to take its wall down or to forge its reward. The
hostile agent of ``_attacks.HOSTILE`` knows the shim; at every combination (and as an
unprivileged trainer's agent) it undoes the mounts made for it, unshares, ptraces and reads the
memory of its supervisor, takes the worker's and supervisor's fds, and reads its own capability
sets. Each attack's result is a word, collected in the episode's info. Which layer answers:

- ``mount``, ``umount``, ``unshare``, ``setns``, ``keyctl``, ``bpf``: the syscall filter
  (``EPERM``), behind it the capability sets (no ``SYS_ADMIN``).
- ``ptrace``, ``process_vm_readv``, ``/proc/PID/mem`` of the supervisor: the filter, and the
  supervisor is not dumpable; in a PID namespace it is PID 1.
- ``pidfd_getfd`` of the worker's and supervisor's fds (a forged result frame): the filter; the
  nonce is not in the agent's memory, so the reward stays the agent's own.
- capabilities: the shim keeps only ``KEPT_CAPS`` (root) or none (an unprivileged trainer);
  ``NET_BIND_SERVICE`` only in a network namespace of the episode's own, so a root agent binds
  no port below 1024 of the machine's (``EACCES``).

Destructive attacks on ``/proc`` run only where the agent has a mount namespace of its own."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import anyio
import pytest

import isolate

from .. import _internals
from ..conftest import Agents, episode_processes
from ..teardown._trees import tree
from ._attacks import (
    HOSTILE,
    KEPT_CAPS,
    cap_findings,
    combination,
    compare,
    expected_caps,
    expected_findings,
    host_mnt,
    hostile_as_nobody,
    standin,
    x86_64_linux,
)

pytestmark = [pytest.mark.anyio, x86_64_linux]
__all__ = ["combination", "standin"]  # fixtures, used by name


async def test_the_hostile_agent_is_refused_everything_and_keeps_its_own_reward(
    agents: Agents, standin: subprocess.Popen[bytes], combination: str
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the root agent's attacks: the trainer here is not root")
    scratch = agents.tmp / "scratch"
    scratch.mkdir()
    spec = agents.spec(HOSTILE, containment=combination, exit_grace=2.0, timeout=60.0)
    data = {
        "trainer": standin.pid,
        "host_mnt": host_mnt(),
        "scratch": str(scratch),
        "binaries": True,
    }
    outcome = await isolate.run_episode(spec, data)
    # The agent's own reward: nothing it started wrote a result frame.
    assert (outcome.status, outcome.reward) == ("ok", 0.25), (
        outcome.summary() + "\n" + outcome.stderr_tail[-3000:]
    )
    assert outcome.containment == combination
    found = dict(outcome.info)
    expected = expected_findings(combination, root=True)
    assert {**compare(found, expected), **cap_findings(found, root=True)} == {
        **expected,
        **expected_caps(root=True, found=found),
    }
    if "pidns" in _internals.layers(combination):
        assert max(found["pids"]) < 100, found["pids"]  # only its own episode's
    assert standin.poll() is None
    assert not await anyio.Path(scratch).is_mount()
    assert tree(agents) == []


PARENT = """
import anyio, json, os, sys
import isolate

work = sys.argv[1]

async def main():
    outcomes = {}

    async def one(containment):
        spec = isolate.EpisodeSpec(
            agent_root=os.path.join(work, "agent_root"),
            entrypoint="hostile:run",
            containment=containment,
            timeout=60.0,
            kill_grace=1.0,
            exit_grace=2.0,
            log_dir=os.path.join(work, "logs"),
            cwd=work,
            env={"PID_DIR": os.path.join(work, "pids")},
        )
        data = {
            "trainer": os.getpid(),
            "host_mnt": os.stat("/proc/self/ns/mnt").st_ino,
            "scratch": os.path.join(work, "scratch"),
            "binaries": False,
        }
        outcome = await isolate.run_episode(spec, data)
        outcomes[containment] = json.loads(outcome.model_dump_json())

    async with anyio.create_task_group() as tg:
        for containment in ("auto", "pidns"):
            tg.start_soon(one, containment)
    print(json.dumps({"uid": os.getuid(), "python": sys.executable, "outcomes": outcomes}))

anyio.run(main)
"""


def test_the_unprivileged_trainers_agent_has_no_capability_and_is_refused() -> None:
    with hostile_as_nobody("isolate-hostile-nobody-", HOSTILE, PARENT) as (work, report):
        assert episode_processes(f"PID_DIR={work}/pids".encode()) == []
        expected = expected_findings("pidns", root=False)
        for requested, outcome in report["outcomes"].items():
            assert (outcome["status"], outcome["reward"]) == ("ok", 0.25), (
                requested,
                outcome["status"],
                outcome["error"],
                outcome["stderr_tail"][-2000:],
            )
            assert outcome["containment"] == "pidns", requested  # auto: pidns in a userns
            found = outcome["info"]
            assert {
                "requested": requested,
                **compare(found, expected),
                **cap_findings(found, root=False),
            } == {
                "requested": requested,
                **expected,
                **expected_caps(root=False, found=found),
            }


# Bits of linux/capability.h, for the names doctor and the README give.
CAPABILITY_BITS = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "NET_BIND_SERVICE": 10,
    "SYS_CHROOT": 18,
    "AUDIT_WRITE": 29,
}


def test_the_parent_names_the_capabilities_the_shim_keeps() -> None:
    import agent_shim.shim

    named = sorted(CAPABILITY_BITS[name] for name in _internals.KEPT_CAPABILITIES)
    assert named == sorted(agent_shim.shim.load_part("worker").KEPT_CAPABILITIES)
    assert sum(1 << bit for bit in named) == 0x200404FB  # as docs/containment.md gives CapEff


#: Binds a port below 1024 on loopback: the errno's name, or "bound".
LOW_PORT = """
import errno, socket
def run(data):
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", data["port"]))
        except OSError as exc:
            return 1.0, errno.errorcode[exc.errno]
    return 1.0, "bound"
"""


def privileged_port() -> int:
    """A port below the machine's ``ip_unprivileged_port_start`` that this (root) process binds
    on loopback and lets go: the control. Skips where every port is unprivileged."""
    start = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    for port in range(min(start, 1024) - 1, 511, -1):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    pytest.skip(f"no privileged port is free here (unprivileged from {start})")


@pytest.mark.parametrize("preload", [False, True], ids=["fresh", "template"])
@pytest.mark.parametrize("own_network", [False, True], ids=["the machines", "its own"])
async def test_a_root_agent_binds_a_privileged_port_only_in_a_network_of_its_own(
    agents: Agents, preload: bool, own_network: bool
) -> None:
    if os.geteuid() != 0:
        pytest.skip("a root agent's capability: the trainer here is not root")
    port = privileged_port()
    box = isolate.Sandbox(network="none") if own_network else None
    spec = agents.spec(LOW_PORT, preload=preload, sandbox=box)
    outcome = await isolate.run_episode(spec, {"port": port})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.info == ("bound" if own_network else "EACCES")
    await isolate.close_templates()
    assert tree(agents) == []


#: This process's capability sets and those of a program it execs, as /proc shows them.
CAP_SETS = """
import subprocess
def sets(status):
    return {line[:6]: line.split()[1] for line in status.splitlines() if line.startswith("Cap")}
def run(data):
    with open("/proc/self/status") as f:
        mine = sets(f.read())
    shown = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True)
    return 1.0, {"caps": mine, "child caps": sets(shown.stdout)}
"""


@pytest.mark.parametrize("start", ["fresh", "forked", "parked"])
@pytest.mark.parametrize("own_network", [False, True], ids=["the machines", "its own"])
async def test_a_root_agent_and_what_it_execs_keep_the_kept_capabilities_only(
    agents: Agents, start: str, own_network: bool
) -> None:
    """Each fork of a template makes a user namespace of its own, which gives it every
    capability again, bounding set included; a parked fork cuts its bounding set ahead of its
    episode, its worker the rest. None of them may come back through an exec."""
    if os.geteuid() != 0:
        pytest.skip("a root agent's capabilities: the trainer here is not root")
    box = isolate.Sandbox(network="none") if own_network else None
    spec = agents.spec(CAP_SETS, preload=start != "fresh", sandbox=box)
    if start == "parked":
        await isolate.park(spec, 1)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary() + "\n" + outcome.stderr_tail[-3000:]
    assert outcome.start == ("fresh" if start == "fresh" else "template"), outcome.preload_refused
    kept = sorted(KEPT_CAPS + (["CAP_NET_BIND_SERVICE"] if own_network else []))
    expected = {
        key: kept if isinstance(value, list) and value == KEPT_CAPS else value
        for key, value in expected_caps(root=True, found=outcome.info).items()
    }
    assert cap_findings(outcome.info, root=True) == expected
    await isolate.close_templates()
    assert tree(agents) == []
