"""Errors of the infrastructure around an agent, told apart from the agent's own: an episode
that could not reach its model endpoint, or whose entrypoint could not be called with the
arguments it was given. Such an ``agent_error`` says nothing about the agent; its outcome's
``infra`` names the kind (see :func:`infra_kind`)."""

from __future__ import annotations

import re

from ..model.outcome import ErrorInfo

ENDPOINT_UNREACHABLE = "endpoint unreachable"
"""No connection to the endpoint: refused, reset, no route, a name that does not resolve."""
ENDPOINT_ERROR = "endpoint error"
"""The endpoint (or a proxy before it) answered 5xx: it is there but cannot serve."""
ENTRYPOINT_SIGNATURE = "entrypoint signature"
"""The entrypoint could not be called with the arguments given (the call itself raised
``TypeError``, before any line of the entrypoint ran)."""

INFRA_KINDS = (ENDPOINT_UNREACHABLE, ENDPOINT_ERROR, ENTRYPOINT_SIGNATURE)

# Exception names (the last dotted part) that mean no connection was made, or it was lost
# before an answer: the standard library's, httpx/httpcore's, requests', aiohttp's, openai's
# and litellm's.
_UNREACHABLE = frozenset(
    {
        "ConnectionRefusedError",
        "ConnectionResetError",
        "ConnectionAbortedError",
        "gaierror",
        "ConnectError",
        "ConnectTimeout",
        "RemoteProtocolError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "APIConnectionError",
        "NewConnectionError",
        "MaxRetryError",
    }
)
# Exception names that mean the endpoint answered 5xx.
_SERVER_ERROR = frozenset(
    {
        "InternalServerError",
        "ServiceUnavailableError",
        "BadGatewayError",
        "GatewayTimeoutError",
    }
)
# The line of a traceback that names an exception: ``pkg.mod.Name: message`` or ``Name``.
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::(.*)|$)", re.M)
# urllib's HTTPError and the text of most clients' 5xx errors.
_HTTP_5XX = re.compile(r"\b(?:HTTP Error|status(?: code)?:?|Error code:) ?5\d\d\b", re.I)


def infra_kind(error: ErrorInfo | None, at_call: bool = False) -> str | None:
    """The kind of infrastructure error an agent's ``error`` is, or None when it is the
    agent's own. ``at_call``: the worker saw the error raised by the call of the entrypoint
    itself (no frame of the entrypoint on its traceback). Reads the error's type and message
    and each exception of its traceback's chain (``raise ... from``, or raised while handling
    another), so that an agent's own wrapper around a connection error still counts."""
    if error is None:
        return None
    if at_call and error.type == "TypeError":
        return ENTRYPOINT_SIGNATURE
    chain = [(error.type, error.message), *_EXC_LINE.findall(error.traceback)]
    names = {name.rpartition(".")[2] for name, _ in chain}
    if names & _UNREACHABLE:
        return ENDPOINT_UNREACHABLE
    if names & _SERVER_ERROR or any(_HTTP_5XX.search(text) for _, text in chain):
        return ENDPOINT_ERROR
    return None
