"""What a ``pip install`` user gets: a wheel built from this checkout, installed with no extras
into a fresh venv, run from outside the checkout."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import SLOW, Agents
from .test_batch import stderr_on_a_terminal
from .test_cli import cli_env

ROOT = Path(__file__).resolve().parents[1]
# What is not part of a source tree: another venv, caches, earlier builds.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "*.egg-info", "build", "dist", "logs", "__pycache__", ".*_cache"
)


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a fresh venv holding this checkout's wheel and its dependencies."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: a build writes build/ and *.egg-info into the tree it builds.
    source = tmp / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=_NOT_SOURCE)
    pip = [sys.executable, "-m", "pip"]
    build = [*pip, "wheel", "--no-deps", "--quiet", "--wheel-dir", str(tmp / "dist"), str(source)]
    subprocess.run(build, check=True, capture_output=True, timeout=120 * SLOW)
    [wheel] = (tmp / "dist").glob("episode_isolate-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=60 * SLOW)
    install = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=120 * SLOW)
    return venv / "bin"


def _env(tmp: Path) -> dict[str, str]:
    env = cli_env(LOG_DIR=str(tmp / "logs"))
    env.pop("PYTHONPATH", None)  # nothing of the checkout may leak in
    return env


def test_the_wheel_holds_no_extras_and_the_demo_data(wheel_venv: Path) -> None:
    code = (
        "import importlib.util, isolate, isolate._cli.demo as d; "
        "print(isolate.__file__); print(d.AGENT_ROOT); print(d.RECORDS); "
        "print(importlib.util.find_spec('rich'), importlib.util.find_spec('ray'))"
    )
    done = subprocess.run(
        [str(wheel_venv / "python"), "-I", "-c", code], capture_output=True, text=True, check=True
    )
    package, agent_root, records, extras = done.stdout.splitlines()
    venv = wheel_venv.parent
    for path in (package, agent_root, records):
        assert Path(path).is_relative_to(venv), path
    assert (Path(agent_root) / "aweagent" / "lifecycle.py").is_file()
    assert sorted(p.name for p in Path(records).iterdir()) == [
        "demo__calc-1.json",
        "demo__hang-1.json",
    ]
    assert extras == "None None"


def _isolate(wheel_venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The wheel's ``isolate`` entry point, run from ``cwd``, outside the checkout."""
    return subprocess.run(
        [str(wheel_venv / "isolate"), *args],
        cwd=cwd,
        env=_env(cwd),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120 * SLOW,
    )


def test_demo_from_the_wheel(wheel_venv: Path, tmp_path: Path) -> None:
    proc = _isolate(wheel_venv, ["demo"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all as expected" in proc.stdout
    assert "demo__hang-1   timeout" in proc.stdout


@pytest.fixture
def wheel_llm(wheel_venv: Path, tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """``isolate scripted-llm`` of the wheel: its URL and the commands its banner suggests."""
    proc = subprocess.Popen(
        [str(wheel_venv / "isolate"), "scripted-llm"],
        cwd=tmp_path,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        banner = [proc.stdout.readline() for _ in range(5)]
        match = re.search(r"serving at (http://127\.0\.0\.1:\d+/v1)", banner[0])
        assert match, banner
        suggested = [ln.strip() for ln in banner if ln.strip().startswith("isolate run ")]
        yield match.group(1), suggested
    finally:
        proc.terminate()
        assert proc.wait(timeout=10 * SLOW) == 0  # SIGTERM stops it cleanly
        if proc.stdout:
            proc.stdout.close()


def test_scripted_llm_then_the_suggested_run_from_the_wheel(
    wheel_venv: Path, wheel_llm: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, suggested = wheel_llm
    assert len(suggested) == 2
    calc = suggested[0].split()
    assert calc[:2] == ["isolate", "run"]
    assert url in calc
    assert Path(calc[2]).is_relative_to(wheel_venv.parent)  # the installed record
    proc = _isolate(wheel_venv, calc[1:], tmp_path)
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert (outcome["status"], outcome["reward"]) == ("ok", 1.0)
    assert outcome["info"]["turns"] == 4  # the whole script, so the scripted server answered
    assert "no API key given" in proc.stderr
    assert '"dummy"' in proc.stderr


def test_batch_from_the_wheel_without_rich_on_a_terminal(
    wheel_venv: Path, wheel_llm: tuple[str, list[str]], agents: Agents
) -> None:
    url, suggested = wheel_llm
    records_dir = Path(suggested[0].split()[2]).parent
    lines = []
    for name in ("demo__calc-1", "demo__hang-1"):
        record = json.loads((records_dir / f"{name}.json").read_text())
        record["econfig"] = {"env": {"PID_DIR": str(agents.pids)}}  # for the leftover check
        lines.append(json.dumps(record) + "\n")
    records = agents.tmp / "records.jsonl"
    records.write_text("".join(lines))
    out = agents.tmp / "results.jsonl"
    argv = [str(wheel_venv / "isolate"), "batch", str(records), "--out", str(out)]
    argv += ["--agent-root", str(records_dir.parent / "agent_root"), "--base-url", url]
    argv += ["--timeout", "3", "--kill-grace", "0.5", "--status-interval", "0.5"]
    # stderr a terminal: the bar would be drawn there, but rich is not installed.
    code, stdout, stderr = stderr_on_a_terminal(argv, cwd=agents.tmp, env=_env(agents.tmp))
    assert code == 0, stderr
    assert "pip install rich for a live bar" in stderr
    assert "episodes/s" in stderr  # the plain progress lines
    assert "Traceback" not in stderr
    final = {e["instance_id"]: e for e in map(json.loads, out.read_text().splitlines())}
    assert {i: (e["status"], e["final"]) for i, e in final.items()} == {
        "demo__calc-1": ("ok", True),
        "demo__hang-1": ("timeout", True),
    }
    assert " total " in stdout
    assert "resolved     1/2 (50.0%)" in stdout
