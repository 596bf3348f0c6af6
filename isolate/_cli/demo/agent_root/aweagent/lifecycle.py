"""A tiny but genuine SWE agent loop with AReaL-SWEAgent's ``run_agent_with_reward`` signature.

Each turn asks an OpenAI-compatible chat-completions endpoint for the next step. A reply may
hold one fenced block: ```bash``` (run in the repository) or ```diff``` (applied with
``git apply``); a reply containing the word SUBMIT ends the loop. The record's ``eval_script``
then decides the reward. Standard library only; Python 3.9+.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from typing import Any, Optional

MAX_TURNS = 20
# Enough of a command's output for the model to read; the rest only costs tokens.
MAX_OUTPUT_CHARS = 10000
# A stuck socket must not outlive the episode forever, yet real models can be slow.
HTTP_TIMEOUT_S = 600.0

SYSTEM_PROMPT = """You are a software engineer fixing an issue in a git repository.
Reply with exactly one fenced block per turn:
- ```bash
  <command>
  ``` to run a shell command in the repository (you will see its output), or
- ```diff
  <unified diff>
  ``` to apply a patch with `git apply`.
When the issue is fixed, reply with the single word SUBMIT."""

_BLOCK = re.compile(r"```(bash|diff)[ \t]*\n(.*?)```", re.DOTALL)
_SUBMIT = re.compile(r"\bSUBMIT\b")
_GIT_IDENTITY = ["-c", "user.name=aweagent", "-c", "user.email=aweagent@example.invalid"]


async def run_agent_with_reward(
    data: dict[str, Any],
    *,
    agent_type: str = "swe",
    agent_config: Optional[str] = None,
    result_dir: str = "./logs",
    override_api_key: Optional[str] = None,
    override_base_url: Optional[str] = None,
    override_llm_model: Optional[str] = None,
    override_opencode_provider: Optional[str] = None,
    override_codex_provider: Optional[str] = None,
    **_ignored: Any,
) -> tuple[float, dict[str, Any]]:
    """Solve one SWE-bench-shaped record; return ``(reward, extra)``.

    ``result_dir`` and the provider overrides are accepted for signature compatibility only:
    this agent writes nothing outside its temporary directory.
    """
    if not override_base_url:
        raise ValueError("override_base_url is required (the chat-completions endpoint)")
    llm = _Chat(override_base_url, override_api_key, override_llm_model or "demo-model")
    work = tempfile.mkdtemp(prefix="aweagent-")
    try:
        repo = os.path.join(work, "repo")
        await asyncio.to_thread(_make_repo, repo, data.get("repo_files") or {})
        print(f"{data.get('instance_id', '?')}: repository ready in {repo}", flush=True)
        turns = await _loop(llm, work, repo, str(data.get("problem_statement", "")))
        print("running eval_script", flush=True)
        script = str(data.get("eval_script", ""))
        eval_exit, output = await asyncio.to_thread(_run_bash, script, repo, work)
        reward = 1.0 if eval_exit == 0 else 0.0
        print(f"eval exit {eval_exit}, reward {reward}\n{_clip(output)}", flush=True)
        extra = {
            "turns": turns,
            "eval_exit": eval_exit,
            "agent_type": agent_type,
            "agent_config": agent_config,
        }
        return reward, extra
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def _loop(llm: _Chat, work: str, repo: str, problem: str) -> int:
    """The agent loop; returns how many model turns it took."""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix this issue:\n\n" + problem},
    ]
    turns = 0
    while turns < MAX_TURNS:
        turns += 1
        reply = await asyncio.to_thread(llm.complete, messages)
        messages.append({"role": "assistant", "content": reply})
        block = _BLOCK.search(reply)
        # SUBMIT counts outside the block only: `echo SUBMIT` is a command, not a decision.
        prose = reply if block is None else reply[: block.start()] + reply[block.end() :]
        submit = _SUBMIT.search(prose) is not None
        if block is None:
            if submit:
                print(f"turn {turns}: submit", flush=True)
                break
            print(f"turn {turns}: no action in reply", flush=True)
            observation = "Reply with one ```bash``` or ```diff``` block, or SUBMIT."
        elif block.group(1) == "bash":
            print(f"turn {turns}: running bash", flush=True)
            code, output = await asyncio.to_thread(_run_bash, block.group(2), repo, work)
            observation = f"exit code {code}\n{_clip(output)}"
        else:
            print(f"turn {turns}: applying diff", flush=True)
            observation = await asyncio.to_thread(_apply, block.group(2), repo, work)
        if submit:
            # An action and SUBMIT in one reply: act, then stop.
            print(f"turn {turns}: submit", flush=True)
            break
        messages.append({"role": "user", "content": observation})
    return turns


class _Chat:
    """A minimal OpenAI-compatible chat-completions client on urllib."""

    def __init__(self, base_url: str, api_key: Optional[str], model: str) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self._key = api_key
        self.model = model

    def complete(self, messages: list[dict[str, str]]) -> str:
        body = json.dumps({"model": self.model, "messages": messages}).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = "Bearer " + self._key
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                payload = json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            raise RuntimeError(
                f"chat completion failed: HTTP {exc.code}: {self._scrub(_error_message(exc))}"
            ) from None
        except urllib.error.URLError as exc:
            raise RuntimeError(f"cannot reach {self.url}: {self._scrub(str(exc.reason))}") from None
        try:
            content = payload["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RuntimeError("chat completion response has no choices[0].message") from None
        return content or ""

    def _scrub(self, text: str) -> str:
        # A misbehaving server might echo the key; it must not reach a traceback.
        return text.replace(self._key, "***") if self._key else text


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The server's error message: OpenAI's ``{"error": {"message": ...}}`` or the raw body."""
    try:
        raw = exc.read().decode("utf-8", "replace")
    except OSError:
        return exc.reason or "no details"
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.strip()[:500]
    return str(message) or str(exc.reason)


def _make_repo(repo: str, files: dict[str, str]) -> None:
    """Write ``files`` under ``repo`` and commit them, so ``git apply`` has a base."""
    os.makedirs(repo)
    root = os.path.realpath(repo)
    for rel, text in files.items():
        path = os.path.realpath(os.path.join(repo, rel))
        # Never write outside the temporary directory, whatever the record says.
        if os.path.isabs(rel) or os.path.commonpath([root, path]) != root or path == root:
            raise ValueError(f"repo_files: path {rel!r} leaves the repository")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    _git(repo, "-c", "init.defaultBranch=main", "init", "-q")
    _git(repo, "add", "-A")
    _git(
        repo,
        *_GIT_IDENTITY,
        "-c",
        "commit.gpgsign=false",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "base",
    )


def _git(repo: str, *args: str) -> None:
    done = subprocess.run(
        ["git", *args],
        cwd=repo,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    if done.returncode != 0:
        output = done.stdout.decode("utf-8", "replace").strip()
        raise RuntimeError(f"git {' '.join(args)} failed ({done.returncode}): {output}")


def _run_bash(command: str, repo: str, work: str) -> tuple[int, str]:
    """Run ``command`` with bash in ``repo``; return (exit code, stdout+stderr).

    Output goes to a file, not a pipe: a background process the command leaves behind would
    hold a pipe open and make "read to EOF" hang. No timeout here: the launcher owns the
    deadline and kills the whole tree.
    """
    with tempfile.TemporaryFile(dir=work) as out:
        code = subprocess.run(
            ["bash", "-c", command], cwd=repo, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        ).returncode
        out.seek(0)
        return code, out.read().decode("utf-8", "replace")


def _apply(patch: str, repo: str, work: str) -> str:
    """Apply a unified diff with ``git apply``; return the observation for the model."""
    if not patch.endswith("\n"):
        patch += "\n"  # git apply rejects a patch whose last line is unterminated
    fd, path = tempfile.mkstemp(suffix=".diff", dir=work)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(patch)
        done = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", path],
            cwd=repo,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    finally:
        os.unlink(path)
    if done.returncode == 0:
        return "patch applied"
    return "patch failed:\n" + _clip(done.stdout.decode("utf-8", "replace"))


def _clip(text: str) -> str:
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    half = MAX_OUTPUT_CHARS // 2
    return (
        f"{text[:half]}\n... [{len(text) - MAX_OUTPUT_CHARS} characters elided] ...\n"
        + text[-half:]
    )
