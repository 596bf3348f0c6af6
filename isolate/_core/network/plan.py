"""An episode's network, when its sandbox sets ``network``: what the worker sets up in its own
network namespace (``agent_shim/shim_net.py``) and what the parent serves for it
(:mod:`.egress`).

The namespace has a loopback interface only. With an allow-list, the worker listens there on
the proxy's port and on each loopback entry's own port (the LLM endpoint on the trainer's
``127.0.0.1:8000``, say), and hands those listeners to the parent, which accepts on them: the
proxy checks each destination against the allow-list, a loopback entry's listener is carried
to the same address and port on the machine. The agent's clients find the proxy through the
usual variables; loopback stays direct, inside the namespace, where it reaches the agent's own
servers and the carried ports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .allowlist import Rule, forwards, parse_rules

#: The proxy's port inside the namespace (squid's), or the next one a carried port leaves free.
PROXY_PORT = 3128
_LOOPBACK = "localhost,127.0.0.1,::1"


@dataclass(frozen=True)
class NetworkPlan:
    """What one episode's network is: no network (``rules`` None), or an allow-list."""

    rules: tuple[Rule, ...] | None
    forwards: list[tuple[str, int]] = field(default_factory=list)
    proxy_port: int | None = None

    @property
    def listen(self) -> list[tuple[str, int]]:
        """The listeners the worker makes, the proxy's first."""
        if self.proxy_port is None:
            return []
        return [("127.0.0.1", self.proxy_port), *self.forwards]

    @property
    def ports(self) -> list[int]:
        """The TCP ports the agent connects to inside the namespace."""
        return sorted({port for _, port in self.listen})

    def env(self) -> dict[str, str]:
        """The proxy's variables, upper and lower case (clients read one or the other)."""
        if self.proxy_port is None:
            return {}
        url = f"http://127.0.0.1:{self.proxy_port}"
        out: dict[str, str] = {}
        for name, value in (
            ("HTTP_PROXY", url),
            ("HTTPS_PROXY", url),
            ("ALL_PROXY", url),
            ("NO_PROXY", _LOOPBACK),
        ):
            out[name] = out[name.lower()] = value
        return out

    def handshake(self) -> dict[str, Any]:
        return {"listen": [list(pair) for pair in self.listen], "env": self.env()}

    def describe(self) -> str:
        """One line for ``outcome.sandbox.enforced``."""
        if self.rules is None:
            return "network: none (a namespace with loopback only)"
        shown = ", ".join(_entry(rule) for rule in self.rules) or "nothing"
        return f"network: only through the proxy, to {shown}"


def _entry(rule: Rule) -> str:
    host = f"[{rule.host}]" if ":" in rule.host else rule.host
    return host if rule.port is None else f"{host}:{rule.port}"


def plan_network(network: str | tuple[str, ...]) -> NetworkPlan:
    """The plan for a sandbox's ``network`` ("none" or allow-list entries, valid already)."""
    if network == "none":
        return NetworkPlan(rules=None)
    rules = parse_rules(network)
    carried = forwards(rules)
    taken = {port for _, port in carried}
    port = PROXY_PORT
    while port in taken:
        port += 1
    return NetworkPlan(rules=rules, forwards=carried, proxy_port=port)
