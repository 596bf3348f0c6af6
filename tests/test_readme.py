"""The README's examples, run as they stand (a port number aside), from the checkout's root."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

from .conftest import SLOW
from .test_cli import cli_env

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: The command line in full, which the README's table of commands links to.
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()
#: Where ``pip`` put the ``isolate`` entry point of the environment running the tests.
SCRIPTS = Path(sysconfig.get_path("scripts"))
README_PORT = "8000"


def _block(after: str, language: str) -> str:
    """The first fenced ``language`` block after the text ``after`` in the README."""
    start = README.index(after)
    match = re.compile(rf"^```{language}\n(.*?)^```", re.DOTALL | re.MULTILINE)
    found = match.search(README, start)
    assert found, f"no {language} block after {after!r}"
    return found.group(1)


def _commands(block: str) -> list[str]:
    """Shell commands of a block, continuation lines joined."""
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _start_llm(command: list[str], tmp: Path) -> tuple[subprocess.Popen[str], str]:
    """Start ``isolate scripted-llm`` on a free port; the process and its host:port."""
    assert command[:2] == ["isolate", "scripted-llm"]
    argv = [str(SCRIPTS / "isolate"), *command[1:]]
    argv[argv.index(README_PORT)] = "0"  # the README's port may be taken on this machine
    proc = subprocess.Popen(
        argv,
        cwd=tmp,
        env=cli_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    match = re.search(r"http://(127\.0\.0\.1:\d+)/v1", first)
    if not match:
        proc.kill()
        proc.wait()
        raise AssertionError(f"no address in {first!r}")
    return proc, match.group(1)


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.terminate()
    code = proc.wait(timeout=10 * SLOW)
    if proc.stdout:
        proc.stdout.close()
    return code


def test_trying_it_without_a_model(tmp_path: Path) -> None:
    commands = _commands(_block("### Trying it without a model", "bash"))
    assert [c.split()[1] if c.startswith("isolate") else c for c in commands] == [
        "scripted-llm",
        "run",
        "run",
        "kill %1",
    ]
    server, address = _start_llm(shlex.split(commands[0].removesuffix("&")), tmp_path)
    try:
        runs = []
        for command in commands[1:3]:
            argv = shlex.split(command.replace(f"127.0.0.1:{README_PORT}", address))
            proc = subprocess.run(
                [str(SCRIPTS / "isolate"), *argv[1:]],
                cwd=ROOT,
                env=cli_env(LOG_DIR=str(tmp_path / "logs")),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60 * SLOW,
            )
            runs.append((proc.returncode, json.loads(proc.stdout)))
            assert "isolate: replay with: isolate run --replay " in proc.stderr
    finally:
        assert _stop(server) == 0  # `kill %1` sends SIGTERM
    [(calc_code, calc), (hang_code, hang)] = runs
    assert (calc_code, calc["status"], calc["reward"]) == (0, "ok", 1.0)
    assert (hang_code, hang["status"]) == (12, "timeout")
    assert hang["killed"] >= 3  # the sleeps the script starts, setsid'ed ones included
    assert len(list((tmp_path / "logs").iterdir())) == 2  # a replay bundle each


def test_your_own_agent_runs_from_any_directory(tmp_path: Path) -> None:
    """From an empty directory, with no server: only what an install gives."""
    code = _block("## Your own agent, from any directory", "python")
    script = tmp_path / "example.py"
    script.write_text(code)
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=empty,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60 * SLOW,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok 1.0 17\n"
    assert sorted(p.name for p in empty.iterdir()) == []  # it left nothing where it ran


def test_the_commands_scripted_llm_prints_run_as_printed(tmp_path: Path) -> None:
    """From an empty directory: the calc episode ends ok (exit 0), the hang one timeout
    (exit 12) in seconds, its clean-up cut short as the command says."""
    server, _ = _start_llm(["isolate", "scripted-llm", "--port", README_PORT], tmp_path)
    try:
        assert server.stdout is not None
        lines = [server.stdout.readline() for _ in range(2)]  # after the address line
        assert lines[-1].strip() == "try, in another terminal:", lines
        # The third, mini-swe-agent's loop on the calc task, where that extra is installed.
        mini = importlib.util.find_spec("minisweagent") is not None
        commands = [shlex.split(server.stdout.readline()) for _ in range(3 if mini else 2)]
        codes: list[int] = []
        durations: list[float] = []
        for command in commands:
            assert command[:2] == ["isolate", "run"]
            proc = subprocess.run(
                [str(SCRIPTS / "isolate"), *command[1:]],
                cwd=tmp_path,
                env=cli_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30 * SLOW,
            )
            codes.append(proc.returncode)
            durations.append(json.loads(proc.stdout)["duration_s"])
    finally:
        _stop(server)
    assert codes == ([0, 12, 0] if mini else [0, 12])
    # Its agent's clean-up hangs: with the default --cancel-grace (30 s) it would take 33 s.
    assert durations[1] < 30.0, durations


def test_the_first_example_runs(tmp_path: Path) -> None:
    code = _block("## The first example", "python")
    assert f"127.0.0.1:{README_PORT}" in code
    server, address = _start_llm(["isolate", "scripted-llm", "--port", README_PORT], tmp_path)
    try:
        script = tmp_path / "example.py"
        script.write_text(code.replace(f"127.0.0.1:{README_PORT}", address))
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=ROOT,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=60 * SLOW,
        )
    finally:
        _stop(server)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok 1.0\n"


def test_the_run_synopsis_names_every_option_of_run() -> None:
    proc = subprocess.run(
        [str(SCRIPTS / "isolate"), "run", "--help"], capture_output=True, text=True, check=True
    )
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", proc.stdout)) - {"--help"}
    assert {"--replay", "--status-interval", "--base-url", "--api-key-env"} <= options
    start = CLI_DOC.index("- `isolate run RECORD.json")
    synopsis = CLI_DOC[start : CLI_DOC.index("- `isolate doctor", start)]
    # Named whole: --sandbox is not named by --sandbox-write.
    missing = sorted(o for o in options if not re.search(rf"{o}(?![\w-])", synopsis))
    assert missing == [], f"docs/cli.md's `isolate run` synopsis lacks {missing}"


#: The pages whose relative links must resolve: the README and every page under docs/.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.DOTALL | re.MULTILINE)
_CODE_SPAN = re.compile(r"`[^`]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, every character but letters, digits, spaces,
    hyphens and underscores dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (fenced blocks skipped), repeats numbered as
    GitHub numbers them (``x``, ``x-1``, ...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        base = _anchor(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def _relative_links(path: Path) -> list[str]:
    """The targets of a markdown file's links that are not URLs (code blocks and spans skipped)."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", path.read_text()))
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_anchor_function_follows_github() -> None:
    assert _anchor("What the agent's process looks like") == "what-the-agents-process-looks-like"
    assert _anchor("Past one machine: `--backend ray`") == "past-one-machine---backend-ray"
    assert _anchor("Many episodes at once: the open-file limit") == (
        "many-episodes-at-once-the-open-file-limit"
    )
    assert (
        _anchor("Set-up: two commands on a fresh clone") == "set-up-two-commands-on-a-fresh-clone"
    )


def test_every_relative_link_resolves() -> None:
    assert len(PAGES) > 5
    broken, checked = [], 0
    for page in PAGES:
        for link in _relative_links(page):
            checked += 1
            file, _, anchor = link.partition("#")
            target = (page.parent / file).resolve() if file else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and (target.suffix != ".md" or anchor not in _anchors(target)):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert checked > 40  # the links were found at all
    assert broken == []


def test_the_readme_links_every_docs_page() -> None:
    linked = {
        (ROOT / link.partition("#")[0]).resolve() for link in _relative_links(ROOT / "README.md")
    }
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert missing == [], f"README.md's Documentation list lacks {missing}"


def test_the_readme_is_a_front_door() -> None:
    assert len(README.splitlines()) < 300
