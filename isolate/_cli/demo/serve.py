"""``isolate scripted-llm``: the demo's scripted LLM as a server of its own, so that
``isolate run`` (and ``isolate batch``) can be tried end to end without a real model."""

from __future__ import annotations

import importlib.util
import signal
import sys

from . import AGENT_ROOT, RECORDS, load_records
from .scripted_llm import ScriptedLLM, demo_script

_STOP = {signal.SIGINT, signal.SIGTERM}


def scripted_llm(port: int) -> int:
    """Serve until Ctrl-C or SIGTERM; 0 then, 1 when the port cannot be bound."""
    records = load_records()
    # The agent sends the record's problem statement: it tells which script a request is in.
    by_problem = {str(r["problem_statement"]): i for i, r in records.items()}
    scripts = {problem: demo_script(i) for problem, i in by_problem.items()}
    tool_scripts = {p: demo_script(i, "mini-swe-agent") for p, i in by_problem.items()}

    def on_reply(problem: str, turn: int, replies: int) -> None:
        where = f"reply {turn} of {replies}" if turn <= replies else "past the script: SUBMIT"
        print(f"isolate scripted-llm: {by_problem[problem]}: {where}", file=sys.stderr, flush=True)

    llm = ScriptedLLM(scripts, port=port, on_reply=on_reply, tool_scripts=tool_scripts)
    # Blocked before the server thread starts, so that it inherits the mask and only this
    # thread takes the signals, in sigwait.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP)
    try:
        try:
            llm.start()
        except OSError as exc:
            print(
                f"isolate scripted-llm: error: cannot listen on 127.0.0.1:{port}: "
                f"{exc.strerror or exc}",
                file=sys.stderr,
            )
            return 1
        try:
            _banner(llm.base_url, sorted(records))
            signal.sigwait(_STOP)
        finally:
            llm.close()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    print("isolate scripted-llm: stopped", file=sys.stderr)
    return 0


def _banner(url: str, ids: list[str]) -> None:
    run = f"isolate run {RECORDS}/{{}}.json --agent-root {AGENT_ROOT} --base-url {url}"
    lines = [
        f"isolate scripted-llm: serving at {url} (any API key; Ctrl-C stops)",
        f"  records {RECORDS}: {', '.join(ids)}",
        "try, in another terminal:",
        "  " + run.format("demo__calc-1"),
        # The hung agent's clean-up hangs too: cut it short, as the README does.
        "  " + run.format("demo__hang-1") + " --timeout 3 --cancel-grace 2",
    ]
    if importlib.util.find_spec("minisweagent") is not None:
        lines.append("  " + run.format("demo__calc-1") + " --entrypoint mini_swe_demo:run")
    print("\n".join(lines), flush=True)
