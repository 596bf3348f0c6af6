"""A scripted OpenAI-compatible chat-completions server, for demos and tests.

Each bearer key is its own session with a fixed list of replies, returned in order; once the
list is used up every further reply is ``SUBMIT``. Unknown keys get HTTP 401. Keys are held
only as :class:`~pydantic.SecretStr` and never echoed.

::

    with ScriptedLLM() as llm:
        llm.add_session(key, demo_script("demo__calc-1"))
        ...  # point the agent at llm.base_url with key

Given ``scripts`` (marker text -> replies), a request with any other key is answered from the
script whose marker appears in the conversation, at the turn its assistant messages count: no
state, so an episode can be run again with the same key (``isolate scripted-llm``). A request
that offers a ``bash`` tool (mini-swe-agent's format) is answered from ``tool_scripts`` instead,
and a reply's ```` ```bash ```` block goes back as a call of that tool.
"""

from __future__ import annotations

import hmac
import json
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from pydantic import SecretStr

__all__ = ["AGENTS", "ScriptedLLM", "demo_script"]

_DONE = "SUBMIT"
#: Largest request body read (bytes); a chat history bigger than this is not a demo.
_MAX_BODY = 64 * 1024 * 1024


class _Session:
    def __init__(self, api_key: SecretStr, replies: list[str]) -> None:
        self.api_key = api_key
        self.replies = list(replies)
        self.served = 0


class ScriptedLLM:
    """Serve ``POST /v1/chat/completions`` on 127.0.0.1 from per-key scripts.

    ``requests`` counts every HTTP request received, ``rejected`` the ones refused with 401.
    ``port`` 0 takes a free one. ``on_reply(marker, turn, replies)`` is called for each reply
    given from ``scripts``.
    """

    def __init__(
        self,
        scripts: Mapping[str, list[str]] | None = None,
        port: int = 0,
        on_reply: Callable[[str, int, int], None] | None = None,
        tool_scripts: Mapping[str, list[str]] | None = None,
    ) -> None:
        self._scripts = {marker: list(replies) for marker, replies in (scripts or {}).items()}
        self._tool_scripts = {m: list(replies) for m, replies in (tool_scripts or {}).items()}
        self._port = port
        self._on_reply = on_reply
        self._lock = threading.Lock()
        self._sessions: list[_Session] = []
        self._requests = 0
        self._rejected = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # --- sessions ---------------------------------------------------------------------------

    def add_session(self, api_key: SecretStr, replies: list[str]) -> None:
        """Register a key and the replies its requests get, in order."""
        if not api_key.get_secret_value():
            raise ValueError("api_key must not be empty")
        with self._lock:
            if self._find(api_key.get_secret_value()) is not None:
                raise ValueError("a session with this api key already exists")
            self._sessions.append(_Session(api_key, replies))

    def served(self, api_key: SecretStr) -> int:
        """How many replies the session of ``api_key`` has been given."""
        with self._lock:
            session = self._find(api_key.get_secret_value())
            if session is None:
                raise KeyError("no session with this api key")
            return session.served

    @property
    def requests(self) -> int:
        """HTTP requests received, on any path."""
        with self._lock:
            return self._requests

    @property
    def rejected(self) -> int:
        """Requests refused with 401 (missing or unknown key)."""
        with self._lock:
            return self._rejected

    def _find(self, key: str) -> _Session | None:
        """The session whose key equals ``key``; call with the lock held."""
        found = None
        wanted = key.encode("utf-8")
        # Compare against every session, not stopping at a match: constant work per key.
        for session in self._sessions:
            if hmac.compare_digest(wanted, session.api_key.get_secret_value().encode("utf-8")):
                found = session
        return found

    def _authenticate(self, key: str | None) -> _Session | bool:
        """Count a chat request; its session, True for any other key when there are scripts,
        False (counted as rejected) for a missing or unknown key."""
        with self._lock:
            self._requests += 1
            session = self._find(key) if key else None
            if session is not None:
                return session
            if key and (self._scripts or self._tool_scripts):
                return True
            self._rejected += 1
            return False

    def _scripted_reply(self, body: dict[str, Any]) -> str | None:
        """The reply for a conversation from ``scripts``, or None when no marker is in it."""
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        text = "\n".join(str(m.get("content", "")) for m in messages if m.get("role") == "user")
        scripts = self._tool_scripts if _bash_tool(body) else self._scripts
        for marker, replies in scripts.items():
            if marker in text:
                turn = sum(1 for m in messages if m.get("role") == "assistant")
                if self._on_reply is not None:
                    self._on_reply(marker, turn + 1, len(replies))
                return replies[turn] if turn < len(replies) else _DONE
        return None

    def _next_reply(self, session: _Session) -> str:
        with self._lock:
            index = session.served
            session.served += 1
        return session.replies[index] if index < len(session.replies) else _DONE

    def _count_request(self) -> None:
        with self._lock:
            self._requests += 1

    # --- server lifecycle -------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``; the server must be started."""
        if self._server is None:
            raise RuntimeError("ScriptedLLM is not started")
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}/v1"

    def start(self) -> None:
        """Bind the port on 127.0.0.1 and serve in a daemon thread; OSError if it is taken."""
        if self._server is not None:
            raise RuntimeError("ScriptedLLM is already started")
        server = _Server(("127.0.0.1", self._port), _Handler)
        server.llm = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="scripted-llm", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port. Safe to call more than once."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> ScriptedLLM:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 resets connections when many episodes call at once.
    request_queue_size = 1024
    llm: ScriptedLLM


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:  # http.server calls do_<METHOD>
        llm = self.server.llm
        # Read the body before any answer: closing with unread data can reset the connection,
        # and the client would see a reset instead of our status.
        body = self._read_json()
        if self.path.rstrip("/") != "/v1/chat/completions":
            llm._count_request()
            self._send(404, _error("not found", "not_found_error"))
            return
        session = llm._authenticate(self._bearer())
        if session is False:
            self._send(401, _error("invalid api key", "invalid_request_error"))
            return
        if body is None:
            self._send(400, _error("request body must be a JSON object", "invalid_request_error"))
            return
        if isinstance(session, _Session):
            reply: str | None = llm._next_reply(session)
        else:
            reply = llm._scripted_reply(body)
        if reply is None:
            message = "no script for this conversation; the scripted LLM knows the demo records"
            self._send(400, _error(message, "invalid_request_error"))
            return
        self._send(200, _completion(body, reply))

    def do_GET(self) -> None:  # http.server calls do_<METHOD>
        self.server.llm._count_request()
        self._send(404, _error("not found", "not_found_error"))

    def _bearer(self) -> str | None:
        header = self.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        return key if scheme.lower() == "bearer" and key else None

    def _read_json(self) -> dict[str, Any] | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if length <= 0 or length > _MAX_BODY:
            return None  # unread: the reply closes the connection anyway
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a demo server should not write to stderr per request


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


#: A reply's command block, which becomes a ``bash`` tool call when the request offers one.
_BASH_BLOCK = re.compile(r"```bash\n(.*?)\n```", re.DOTALL)


def _bash_tool(body: dict[str, Any]) -> bool:
    """Whether the request offers a function tool named ``bash`` (mini-swe-agent's)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return False
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == "bash":
            return True
    return False


def _message(body: dict[str, Any], reply: str) -> tuple[dict[str, Any], str]:
    """The assistant message for ``reply``, and its finish reason."""
    block = _BASH_BLOCK.search(reply) if _bash_tool(body) else None
    if block is None:
        return {"role": "assistant", "content": reply}, "stop"
    call = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": block.group(1)})},
    }
    text = (reply[: block.start()] + reply[block.end() :]).strip()
    return {"role": "assistant", "content": text or None, "tool_calls": [call]}, "tool_calls"


def _completion(body: dict[str, Any], reply: str) -> dict[str, Any]:
    messages = body.get("messages")
    prompt = messages if isinstance(messages, list) else []
    # Word counts stand in for tokens: enough for code that reads ``usage``.
    prompt_tokens = sum(
        len(str(m.get("content", "")).split()) for m in prompt if isinstance(m, dict)
    )
    completion_tokens = len(reply.split())
    message, finish_reason = _message(body, reply)
    return {
        "id": f"chatcmpl-scripted-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": 0,
        "model": str(body.get("model") or "scripted"),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


# --- the demo records' scripts (the records/ folder next to this file) -----------------------

_CALC_FIX = "\n".join(
    [
        "--- a/calc.py",
        "+++ b/calc.py",
        "@@ -3,7 +3,7 @@",
        " ",
        " def add(a, b):",
        '     """Return the sum of a and b."""',
        "-    return a - b",
        "+    return a + b",
        " ",
        " ",
        " def mul(a, b):",
        "",  # the patch ends with a newline
    ]
)

# A background process, a setsid'ed tree, and a foreground sleep: only a launcher that kills
# the whole tree (session, subreaper orphans and all) ends this.
_HANG = "(sleep 300 &) ; (setsid sh -c 'sleep 300 & sleep 300' &) ; sleep 300"

_DEMO_SCRIPTS: dict[str, list[str]] = {
    "demo__calc-1": [
        "Let me look at the implementation first.\n\n```bash\ncat calc.py\n```",
        "`add` subtracts instead of adding. Fixing it:\n\n```diff\n" + _CALC_FIX + "```",
        "```bash\npython3 -c 'import calc; print(calc.add(2, 3))'\n```",
        "The fix works. SUBMIT",
    ],
    "demo__hang-1": [
        "Let me start the service and watch it.\n\n```bash\n" + _HANG + "\n```",
    ],
}


#: mini-swe-agent's replies: one command a turn, run as its ``bash`` tool, and its own way to
#: submit (the first output line of a command that succeeds).
_MINI_SCRIPTS: dict[str, list[str]] = {
    "demo__calc-1": [
        "Let me look at the implementation first.\n\n```bash\ncat calc.py\n```",
        "`add` subtracts instead of adding. Fixing it:\n\n"
        "```bash\nsed -i 's/return a - b/return a + b/' calc.py\n```",
        "```bash\npython3 -c 'import calc; print(calc.add(2, 3))'\n```",
        "The fix works.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
    ],
    "demo__hang-1": _DEMO_SCRIPTS["demo__hang-1"],
}

#: The agents the scripts speak to: the packaged demo agent, and mini-swe-agent.
AGENTS = ("demo", "mini-swe-agent")


def demo_script(instance_id: str, agent: str = "demo") -> list[str]:
    """The scripted replies for a demo record (``records/<instance_id>.json``), in the action
    format of ``agent`` (one of :data:`AGENTS`)."""
    scripts = _MINI_SCRIPTS if agent == "mini-swe-agent" else _DEMO_SCRIPTS
    try:
        return list(scripts[instance_id])
    except KeyError:
        known = ", ".join(sorted(scripts))
        raise KeyError(f"no demo script for {instance_id!r} (known: {known})") from None
