"""Promise: the wall leaves an agent its work. Behind every layer an agent still runs git, a
venv with pip, pytest, gcc, strace and apt-get; a mini-SWE-agent-style loop, the scripted agent
with its venv and the demo's agent finish with their reward; ``sandbox=None`` changes nothing.
No layer answers here: each test fails if one refuses what it should allow."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import anyio
import pytest
from pydantic import SecretStr

import isolate

from ..conftest import Agents
from ..teardown._trees import tree
from ._attacks import World, combination, needs_landlock, needs_net, world, x86_64_linux

pytestmark = pytest.mark.anyio
__all__ = ["combination", "world"]  # fixtures, used by name


TINY_BACKEND = """
import base64, hashlib, os, zipfile

NAME, VERSION = "tinypkg", "0.1"
DIST = "%s-%s" % (NAME, VERSION)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, NAME, "__init__.py"), "rb") as f:
        source = f.read()
    entries = [
        (NAME + "/__init__.py", source),
        (DIST + ".dist-info/METADATA", b"Metadata-Version: 2.1\\nName: tinypkg\\nVersion: 0.1\\n"),
        (
            DIST + ".dist-info/WHEEL",
            b"Wheel-Version: 1.0\\nGenerator: tiny\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
        ),
    ]
    record = []
    for path, data in entries:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        record.append("%s,sha256=%s,%d" % (path, digest.decode(), len(data)))
    record.append(DIST + ".dist-info/RECORD,,")
    wheel = DIST + "-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as whl:
        for path, data in entries:
            whl.writestr(path, data)
        whl.writestr(DIST + ".dist-info/RECORD", "\\n".join(record) + "\\n")
    return wheel
"""


TINY_PYPROJECT = """
[build-system]
requires = []
build-backend = "tinybackend"
backend-path = ["."]

[project]
name = "tinypkg"
version = "0.1"
"""


WORKER = r"""
import os, subprocess, sys
from concurrent.futures import ThreadPoolExecutor

def sh(command, cwd, env=None, expect=None):
    done = subprocess.run(
        command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=120,
        env=None if env is None else {**os.environ, **env},
    )
    out = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        return "exit %d: %s" % (done.returncode, out[-600:])
    if expect is not None and expect not in out:
        return "no %r in: %s" % (expect, out[-600:])
    return "ok"

def run(data):
    here = os.getcwd()
    py = sys.executable
    for name in ("git", "venv", "pytest", "gcc"):
        os.mkdir(os.path.join(here, name))
    with open(os.path.join(here, "git", "README"), "w") as f:
        f.write("work\n")
    with open(os.path.join(here, "pytest", "test_tiny.py"), "w") as f:
        f.write("def test_tiny():\n    assert 1 + 1 == 2\n")
    with open(os.path.join(here, "gcc", "hello.c"), "w") as f:
        f.write('#include <stdio.h>\nint main(void) { puts("hello from gcc"); return 0; }\n')
    steps = {
        "git": (
            "git init -q && git add README"
            " && git -c user.name=agent -c user.email=agent@example.invalid commit -q -m work"
            " && git log --oneline",
            "git", None, "work",
        ),
        "venv + pip": (
            '"%s" -m venv --without-pip v'
            ' && "%s" -m pip --python v/bin/python install -q --no-index --no-build-isolation'
            ' --no-cache-dir --disable-pip-version-check "%s"'
            ' && v/bin/python -c "import tinypkg; print(tinypkg.hello())"'
            % (py, py, data["package"]),
            "venv", None, "hi from tinypkg",
        ),
        "pytest": (
            '"%s" -m pytest -q -p no:cacheprovider test_tiny.py' % py,
            "pytest", {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, "1 passed",
        ),
    }
    if data["gcc"]:
        steps["gcc"] = ("gcc -o hello hello.c && ./hello", "gcc", None, "hello from gcc")
    if data["strace"]:
        steps["strace"] = ("strace -f -o /dev/null true", ".", None, None)
    if data["apt"]:
        steps["apt-get --version"] = ("apt-get --version", ".", None, "apt ")
        # Only the dpkg database, not the package lists: the same work, quicker.
        os.makedirs(os.path.join(here, "lists", "partial"))
        steps["apt-get -s install"] = (
            "apt-get -s -o Dir::State::Lists=%s install apt" % os.path.join(here, "lists"),
            ".", None, "apt is already the newest version",
        )
    with ThreadPoolExecutor(len(steps)) as pool:
        futures = {
            name: pool.submit(sh, command, os.path.join(here, cwd), env, expect)
            for name, (command, cwd, env, expect) in steps.items()
        }
    return 1.0, {name: future.result() for name, future in futures.items()}
"""


def tiny_package(root: Path) -> Path:
    package = root / "tinypkg-src"
    (package / "tinypkg").mkdir(parents=True)
    (package / "tinypkg" / "__init__.py").write_text('def hello():\n    return "hi from tinypkg"\n')
    (package / "tinybackend.py").write_text(TINY_BACKEND)
    (package / "pyproject.toml").write_text(TINY_PYPROJECT)
    return package


@x86_64_linux
@pytest.mark.parametrize("sandbox", [None, isolate.Sandbox()], ids=["default", "sandbox"])
async def test_the_agent_can_still_do_its_work(
    agents: Agents, combination: str, tmp_path: Path, sandbox: isolate.Sandbox | None
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    tools = {
        "gcc": shutil.which("gcc") is not None,
        "strace": shutil.which("strace") is not None,
        "apt": shutil.which("apt-get") is not None and os.geteuid() == 0,
    }
    spec = agents.spec(WORKER, containment=combination, cwd=work, timeout=120.0, sandbox=sandbox)
    outcome = await isolate.run_episode(spec, {"package": str(tiny_package(tmp_path)), **tools})
    assert outcome.status == "ok", outcome.summary()
    expected = {"git": "ok", "venv + pip": "ok", "pytest": "ok"}
    if tools["gcc"]:
        expected["gcc"] = "ok"
    if tools["strace"]:
        expected["strace"] = "ok"
    if tools["apt"]:
        expected["apt-get --version"] = "ok"
        expected["apt-get -s install"] = "ok"
    assert dict(outcome.info) == expected
    assert tree(agents) == []


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
