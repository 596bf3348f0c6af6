"""The test toolkit's own checks can fail: what the leftover fixture relies on sees what it
must see, and nothing of a concurrent run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import isolate

from . import _internals
from .conftest import Agents, live_children, own_leaves, run_marker, wait_for

ESCAPE = """
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(300)
"""


def test_an_escaped_untagged_process_is_still_seen(subreaper: bool, tmp_path: Path) -> None:
    # Double fork, setsid, no environment at all: only the subreaper keeps it in view.
    assert subreaper, "the test process could not become a child subreaper"
    pid_file = tmp_path / "pid"
    subprocess.run([sys.executable, "-c", textwrap.dedent(ESCAPE), str(pid_file)], env={})
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 10.0, "the pid"))
    try:
        assert pid in [p.pid for p in live_children()]
        assert psutil.Process(pid).ppid() == os.getpid()  # re-parented to us, not to PID 1
    finally:
        proc = psutil.Process(pid)
        proc.kill()
        proc.wait(10)


def test_the_run_marker_is_no_prefix_of_another_runs() -> None:
    mine = run_marker(Path("/tmp/pytest-of-root/pytest-1"))
    assert mine in b"A=1\0PID_DIR=/tmp/pytest-of-root/pytest-1/test_x0/pids\0"
    assert mine not in b"A=1\0PID_DIR=/tmp/pytest-of-root/pytest-12/test_x0/pids\0"
    assert mine not in b"A=1\0MY_PID_DIR=/tmp/pytest-of-root/pytest-1/test_x0/pids\0"


def test_agents_left_names_this_tests_processes_only(agents: Agents) -> None:
    tag = {isolate.EPISODE_ENV: "toolkit"}
    mine = subprocess.Popen(["sleep", "300"], env={**tag, "PID_DIR": str(agents.pids)})
    other = subprocess.Popen(["sleep", "300"], env={**tag, "PID_DIR": f"{agents.pids}2"})
    try:
        wait_for(lambda: agents.left(), 10.0, "the stand-in to show")
        assert [p.pid for p in agents.left()] == [mine.pid]
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait()
    assert agents.left() == []


def test_a_cgroup_leaf_left_behind_is_seen() -> None:
    groups = _internals.cgroups()
    if groups.v2 is None:
        pytest.skip(f"containment 'cgroup' is not available here: {groups.problem}")
    owner = groups.v2 / _internals.owner_name()
    made_owner = not owner.exists()
    leaf = owner / "toolkit-leftover"
    leaf.mkdir(parents=True)
    try:
        assert leaf in own_leaves()
    finally:
        leaf.rmdir()
        if made_owner:
            owner.rmdir()
    assert leaf not in own_leaves()


SKIPPING = """
import pytest

def test_fine():
    pass

def test_skips():
    pytest.skip("containment 'cgroup' is not available here: no cgroup v2 tree is mounted")
"""


@pytest.mark.parametrize("ci", ["", "true"], ids=["off CI", "on CI"])
def test_a_skipped_containment_test_fails_on_ci_only(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    pytester.makepyfile(test_containment=SKIPPING, test_other=SKIPPING.replace("containment", "x"))
    monkeypatch.setenv("CI", ci)
    result = pytester.runpytest_inprocess("-p", "tests._skips")
    why = "containment 'cgroup' is not available here: no cgroup v2 tree is mounted"
    if ci:
        result.assert_outcomes(passed=2, failed=1, skipped=1)  # test_other's skip stays one
        result.stdout.fnmatch_lines([f"*a containment test skipped on CI*{why}*"])
        result.stdout.fnmatch_lines(["skipped: 1 (1 x x 'cgroup' is not available here*)"])
    else:
        result.assert_outcomes(passed=2, skipped=2)
        result.stdout.fnmatch_lines([f"skipped: 2 (1 x {why}; 1 x x 'cgroup' is not*)"])
        assert sum(line.startswith("skipped: ") for line in result.outlines) == 1
