"""``isolate demo --agent mini-swe-agent``: a third-party agent's own loop, contained, timed out
and scored, against the scripted LLM speaking its tool-call format."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from pydantic import SecretStr

from isolate._cli.demo.scripted_llm import ScriptedLLM, demo_script

from .conftest import SLOW
from .test_cli import cli_env

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


def _chat(url: str, key: str, body: dict[str, object]) -> dict[str, object]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    try:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        conn.request("POST", parts.path + "/chat/completions", json.dumps(body), headers)
        response = conn.getresponse()
        assert response.status == 200, response.read()
        reply: dict[str, object] = json.loads(response.read())
        return reply
    finally:
        conn.close()


def test_a_request_offering_bash_gets_the_command_as_a_tool_call() -> None:
    with ScriptedLLM() as llm:
        llm.add_session(SecretStr("sk-tools"), demo_script("demo__calc-1", "mini-swe-agent"))
        llm.add_session(SecretStr("sk-text"), demo_script("demo__calc-1", "mini-swe-agent"))
        body = {"messages": [{"role": "user", "content": "fix it"}], "tools": [BASH_TOOL]}
        with_tools = _chat(llm.base_url, "sk-tools", body)
        without = _chat(llm.base_url, "sk-text", {"messages": body["messages"]})
    (choice,) = with_tools["choices"]  # type: ignore[misc]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function"
    assert call["function"]["name"] == "bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "cat calc.py"}
    assert choice["message"]["content"] == "Let me look at the implementation first."
    # Without the tool on offer the same reply is plain text, its command block in it.
    (plain,) = without["choices"]  # type: ignore[misc]
    assert plain["finish_reason"] == "stop"
    assert "tool_calls" not in plain["message"]
    assert "```bash\ncat calc.py\n```" in plain["message"]["content"]


def test_the_stateless_server_answers_each_agent_in_its_own_format() -> None:
    """``isolate scripted-llm``'s mode: the marker picks the record, the tools the script."""
    problem = "calc.add is wrong"
    llm = ScriptedLLM(
        {problem: demo_script("demo__calc-1")},
        tool_scripts={problem: demo_script("demo__calc-1", "mini-swe-agent")},
    )
    with llm:
        messages = [
            {"role": "user", "content": problem},
            {"role": "assistant", "content": "looking"},
        ]
        second = _chat(llm.base_url, "any", {"messages": messages, "tools": [BASH_TOOL]})
        text = _chat(llm.base_url, "any", {"messages": messages})
    (call,) = second["choices"][0]["message"]["tool_calls"]  # type: ignore[index]
    command = json.loads(call["function"]["arguments"])["command"]
    assert command == "sed -i 's/return a - b/return a + b/' calc.py"
    assert "```diff" in text["choices"][0]["message"]["content"]  # type: ignore[index]


needs_mini = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("minisweagent") is None,
    reason="mini-swe-agent is not installed (the mini-swe-agent extra)",
)


@needs_mini
@pytest.mark.slow
def test_the_mini_swe_agent_demo_runs_contained_and_scored(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "isolate", "demo", "--agent", "mini-swe-agent"],
        cwd=empty,
        env=cli_env(LOG_DIR=str(tmp_path / "logs")),
        capture_output=True,
        text=True,
        timeout=180 * SLOW,
        stdin=subprocess.DEVNULL,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "isolate demo: all as expected" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("demo__")]
    assert [r[:5] for r in rows] == [
        ["demo__calc-1", "fresh", "ok", "1", rows[0][4]],
        ["demo__calc-1", "preloaded", "ok", "1", rows[1][4]],
        ["demo__calc-1", "preloaded", "ok", "1", rows[2][4]],
        ["demo__hang-1", "preloaded", "timeout", "-", rows[3][4]],
    ]
    assert all(r[6] == "0" and r[7] == "yes" for r in rows)  # left: nothing alive after any
    assert int(rows[3][5]) >= 3  # killed: the hung command's tree
    # Where the time went: the fresh one imported the agent, the forks did not; four steps.
    assert re.search(
        r"^ +a new interpreter; imported mini-swe-agent \+ litellm in \d+\.\d\d s", out, re.M
    )
    forks = re.findall(r"^ +a fork of the template(.*)$", out, re.MULTILINE)
    # The hung one returns no info to say where its time went.
    assert [f.startswith("; no import") for f in forks] == [True, True, False]
    steps = re.findall(r"4 steps \(model call \+ command\): ((?:\d+\.\d\d ?){4}) s", out)
    assert len(steps) == 3, out
    logs = sorted((tmp_path / "logs" / "demo-mini-swe-agent").glob("demo__calc-1.*.log"))
    assert len(logs) == 3
    assert all("[isolate] episode demo__calc-1" in p.read_text() for p in logs)


def test_the_mini_swe_agent_demo_without_the_extra_says_what_to_install(tmp_path: Path) -> None:
    """An interpreter whose site-packages lack mini-swe-agent: one line, exit 2."""
    site = Path(sysconfig.get_path("purelib"))
    view = tmp_path / "site"
    view.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(("minisweagent", "mini_swe_agent")):
            (view / entry.name).symlink_to(entry)
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
        "from isolate._cli import main; sys.exit(main(['demo', '--agent', 'mini-swe-agent']))"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(root), str(view)],
        cwd=tmp_path,
        env={"PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=60 * SLOW,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == (
        f"isolate demo: error: mini-swe-agent is not installed for {sys.executable}: "
        f"{sys.executable} -m pip install 'mini-swe-agent>=2.4,<3'\n"
    )
