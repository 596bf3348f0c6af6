"""Episodes that cannot start are outcomes with status setup_error that say why."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import isolate

from .conftest import Agents, both_starts

pytestmark = pytest.mark.anyio


async def test_missing_interpreter(agents: Agents, tmp_path: Path) -> None:
    spec = agents.spec("def run(d):\n    return 1.0\n", python=str(tmp_path / "no" / "python"))
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert "does not exist" in outcome.error.message
    assert str(tmp_path / "no" / "python") in outcome.error.message
    assert outcome.pid is None


async def test_interpreter_not_on_path(agents: Agents) -> None:
    spec = agents.spec("def run(d):\n    return 1.0\n", python="python-that-is-not-there")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert "python-that-is-not-there" in outcome.error.message


async def test_interpreter_that_is_not_python(agents: Agents) -> None:
    spec = agents.spec("def run(d):\n    return 1.0\n", python="/bin/false")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert "the shim did not start under /bin/false (exited with 1)" in outcome.error.message


async def test_missing_agent_root(agents: Agents, tmp_path: Path) -> None:
    spec = agents.spec("def run(d):\n    return 1.0\n", agent_root=tmp_path / "nowhere")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert f"agent root {tmp_path / 'nowhere'} does not exist" in outcome.error.message


async def test_missing_module(agents: Agents) -> None:
    spec = agents.spec("", entrypoint="no_such_module:run")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert outcome.error.type == "ModuleNotFoundError"
    assert "no_such_module" in outcome.error.message
    assert str(agents.root) in outcome.error.message  # what was tried


async def test_missing_function(agents: Agents) -> None:
    spec = agents.spec("def other(d):\n    return 1.0\n", function="run")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert outcome.error.type == "AttributeError"
    assert "run" in outcome.error.message


async def test_module_whose_import_fails(agents: Agents) -> None:
    spec = agents.spec("import dependency_the_agent_forgot\ndef run(d):\n    return 1.0\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert "dependency_the_agent_forgot" in outcome.error.message
    assert "dependency_the_agent_forgot" in outcome.error.traceback


async def test_entrypoint_not_callable(agents: Agents) -> None:
    spec = agents.spec("run = 3\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert "not a function" in outcome.error.message


async def test_missing_cwd(agents: Agents, tmp_path: Path) -> None:
    spec = agents.spec("def run(d):\n    return 1.0\n", cwd=tmp_path / "gone")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert "working directory" in outcome.error.message


async def test_cwd_is_used(agents: Agents, tmp_path: Path) -> None:
    spec = agents.spec("import os\ndef run(d):\n    return 1.0, os.getcwd()\n", cwd=tmp_path)
    outcome = await isolate.run_episode(spec, {})
    assert outcome.info == str(tmp_path)


async def test_agent_interpreter_without_isolate_or_pydantic(
    agents: Agents, bare_venv: Path
) -> None:
    spec = agents.spec(
        """
        import importlib.util, sys
        def run(data):
            missing = [m for m in ("isolate", "pydantic", "anyio", "psutil")
                       if importlib.util.find_spec(m) is None]
            return 1.0, {"prefix": sys.prefix, "missing": missing}
        """,
        python=str(bare_venv),
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.info["prefix"] == str(bare_venv.parent.parent)
    assert outcome.info["missing"] == ["isolate", "pydantic", "anyio", "psutil"]


async def test_agent_module_named_like_the_shim_is_not_shadowed(agents: Agents) -> None:
    """The shim's own directory is not on the agent's sys.path (-I): an agent module called
    ``shim`` or ``agent_shim`` is the agent's."""
    (agents.root / "shim.py").write_text("WHO = 'agent'\n")
    spec = agents.spec("import shim\ndef run(d):\n    return 1.0, shim.WHO\n")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.info == "agent"


async def test_unwritable_log_dir(agents: Agents, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    spec = agents.spec("def run(d):\n    return 1.0\n", log_dir=blocker / "logs")
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error"
    assert outcome.error is not None
    assert "log file" in outcome.error.message


@both_starts
async def test_agent_with_its_own_conflicting_pydantic(agents: Agents, bare_venv: Path) -> None:
    """The agent ships a 'pydantic 1.x' of its own; the shim imports no pydantic, so the agent
    gets exactly its own, under an interpreter where isolate is not installed."""
    package = agents.root / "pydantic"
    package.mkdir()
    (package / "__init__.py").write_text("VERSION = '1.10.13'\nclass BaseModel:\n    pass\n")
    spec = agents.spec(
        """
        import pydantic
        def run(data):
            return 1.0, {"version": pydantic.VERSION, "from": pydantic.__file__}
        """,
        python=str(bare_venv),
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "ok", outcome.summary()
    assert outcome.info == {"version": "1.10.13", "from": str(package / "__init__.py")}


@pytest.mark.parametrize("agent_first", [True, False])
def test_child_parts_never_shadow_agent_modules(tmp_path: Path, agent_first: bool) -> None:
    """``load_part`` imports ``shim_<name>.py`` privately; the agent's ``shim_<name>`` stays its."""
    import shutil
    import subprocess
    import sys

    shim_dir, agent_dir = tmp_path / "agent_shim", tmp_path / "agent"
    shim_dir.mkdir()
    agent_dir.mkdir()
    shutil.copy(isolate.shim_path(), shim_dir / "shim.py")
    shutil.copy(isolate.shim_path().with_name("shim_wire.py"), shim_dir / "shim_wire.py")
    (shim_dir / "shim_probe.py").write_text("WHOSE = 'the shim'\n")
    (agent_dir / "shim_probe.py").write_text("WHOSE = 'the agent'\n")
    code = f"""
import sys
sys.path[:0] = [{str(agent_dir)!r}]
if {agent_first!r}:
    import shim_probe
sys.path.insert(0, {str(shim_dir)!r})
import shim
del sys.path[0], sys.modules["shim"]
part = shim.load_part("probe")
assert shim.load_part("probe") is part
import shim_probe
print(part.WHOSE, "|", shim_probe.WHOSE, "|", part.__name__)
"""
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "the shim | the agent | _isolate_shim_probe"


async def test_a_limit_the_kernel_refuses_is_a_limit_error(agents: Agents) -> None:
    # Above fs.nr_open: setrlimit refuses it even for root, in the worker, before the import.
    nr_open = int(await anyio.Path("/proc/sys/fs/nr_open").read_text())
    limits = isolate.Limits(open_files=nr_open + 1)
    marker = agents.tmp / "imported"
    spec = agents.spec(
        f"open({str(marker)!r}, 'w').close()\ndef run(d):\n    return 1.0\n",
        limits=limits,
        containment="session",
    )
    outcome = await isolate.run_episode(spec, {})
    assert outcome.status == "setup_error", outcome.summary()
    assert outcome.error is not None
    assert outcome.error.type == "LimitError"
    assert f"cannot set RLIMIT_NOFILE to ({nr_open + 1}, {nr_open + 1})" in outcome.error.message
    assert not marker.exists()  # the agent was never imported
