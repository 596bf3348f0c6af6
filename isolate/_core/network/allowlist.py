"""An episode's network allow-list: rules, their syntax, and whether a destination passes.

A destination is checked as requested, before any resolution:

- a name matches a rule ``*``, a rule ``*.suffix`` (subdomains only, not ``suffix`` itself), or a
  rule naming it; case does not matter;
- an IP literal matches a rule naming it, or ``*`` unless the trainer keeps it to itself:
  loopback, link-local (the metadata service at 169.254.169.254), unspecified (0.0.0.0/8; Linux
  routes 0.0.0.0 to loopback), multicast, another cloud's metadata address, or an address of
  this machine's own interfaces (a server bound to 0.0.0.0 listens there too);
- ``localhost`` and ``*.localhost`` are loopback by name. They need a rule naming them
  (``localhost:8000``, ``*.localhost``): ``*`` does not let them through, as it does not let
  ``127.0.0.1`` through.

The parent resolves names itself. A name under ``localhost`` may use only the loopback
addresses it resolves to, and any other name none of the addresses kept above. That way DNS
cannot point an allowed wildcard name at the trainer's loopback or at the metadata service.

A refusal (HTTP 403, SOCKS 0x02) is counted in :attr:`.egress.Egress.refused` and noted once per
destination. A malformed request (400, 431) or an allowed destination that cannot be reached
(502, SOCKS 0x04 or 0x05) is not a refusal.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

import psutil

IP: TypeAlias = "ipaddress.IPv4Address | ipaddress.IPv6Address"

NOT_LISTED = "not in the allow-list"
_DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = re.compile(r"[a-z0-9_-]{1,63}")
_PORT = re.compile(r"[0-9]{1,5}")
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
# Metadata services that are not link-local: AWS over IPv6, Alibaba Cloud.
_METADATA = frozenset(
    {ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")}
)


@dataclass(frozen=True)
class Rule:
    """One allowed destination."""

    host: str
    """Lower-case: ``*`` (any host), ``*.example.com`` (any subdomain, not example.com itself),
    ``example.com``, an IPv4 literal, or an IPv6 literal without brackets."""
    port: int | None
    """The TCP port; None for any port."""


def parse_rules(entries: Iterable[str]) -> tuple[Rule, ...]:
    """Rules from ``host``, ``host:port``, ``*.host:port``, ``[::1]:8000``, ``1.2.3.4:80``.

    Deduplicated, in order. IPv6 literals go in brackets: ``::1:8000`` could be either.
    Raises ValueError naming the first bad entry."""
    rules: dict[Rule, None] = {}
    for entry in entries:
        try:
            rules.setdefault(_parse_rule(entry), None)
        except ValueError as exc:
            raise ValueError(f"network rule {entry!r}: {exc}") from None
    return tuple(rules)


def rule_for_url(url: str) -> Rule:
    """The rule that lets an episode reach the endpoint at ``url`` (http or https; the port
    defaults to 80 or 443). The error message leaves out the URL: it may carry a key."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"an endpoint URL must be http:// or https://, not {scheme or 'bare'!r}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ValueError("the endpoint URL has a malformed port") from None
    if not host:
        raise ValueError("the endpoint URL names no host")
    if "*" in host:
        raise ValueError("the endpoint URL's host is a pattern, not a host")
    if port == 0:
        raise ValueError("the endpoint URL has port 0")
    try:
        return Rule(_rule_host(host), _DEFAULT_PORTS[scheme] if port is None else port)
    except ValueError as exc:
        raise ValueError(f"the endpoint URL's host: {exc}") from None


def forwards(rules: Iterable[Rule]) -> list[tuple[str, int]]:
    """The (address, port) pairs the child listens on in its namespace, one for each loopback
    rule with a port; the parent forwards each to the same address and port on the host.
    ``localhost`` is forwarded as 127.0.0.1. Sorted, deduplicated."""
    found: set[tuple[str, int]] = set()
    for rule in rules:
        if rule.port is None:
            continue
        if rule.host == "localhost":
            found.add(("127.0.0.1", rule.port))
            continue
        ip = ip_of(rule.host)
        if ip is not None and ip.is_loopback:
            found.add((str(ip), rule.port))
    return sorted(found)


def _parse_rule(entry: str) -> Rule:
    if not entry:
        raise ValueError("empty")
    if "://" in entry:
        raise ValueError("a rule is host[:port], without a scheme")
    odd = next((c for c in entry if c.isspace() or not c.isprintable()), None)
    if odd is not None:
        raise ValueError(f"contains {odd!r}")
    for char, what in (("/", "path"), ("?", "query"), ("#", "fragment"), ("@", "user")):
        if char in entry:
            raise ValueError(f"a rule is host[:port], without a {what}")
    host, port = split_authority(entry)
    return Rule(_rule_host(host), port)


def _rule_host(host: str) -> str:
    """``host`` of a rule, normalised; ValueError when it is none."""
    if host == "*":
        return host
    if host.startswith("*."):
        name = _name(host[2:])
        if name is None:
            raise ValueError(f"{host[2:]!r} after '*.' is not a host name")
        return "*." + name
    if "*" in host:
        raise ValueError("'*' stands only for a whole host or a leading label ('*.example.com')")
    ip = ip_of(host)
    if ip is not None:
        return str(ip)
    name = _name(host)
    if name is None:
        raise ValueError(f"{host!r} is not a host name or an IP address")
    return name


def split_authority(text: str) -> tuple[str, int | None]:
    """``host[:port]`` or ``[v6]:port`` as (host, port or None); ValueError when malformed."""
    if text.startswith("["):
        end = text.find("]")
        host, rest = text[1:end], text[end + 1 :]
        if end < 0 or "%" in host:
            raise ValueError("malformed bracketed IPv6 address")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} in brackets is not an IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise ValueError("only ':port' may follow ']'")
        return host, _port(rest[1:]) if rest else None
    if text.count(":") > 1:
        raise ValueError("an IPv6 address goes in brackets, as in [::1]:8000")
    host, colon, port = text.partition(":")
    if not host:
        raise ValueError("no host")
    return host, _port(port) if colon else None


def _port(text: str) -> int:
    if not _PORT.fullmatch(text) or not 0 < int(text) < 65536:
        raise ValueError(f"bad port {text!r}")
    return int(text)


def _name(text: str) -> str | None:
    """``text`` as a lower-case host name (one trailing dot dropped), or None if it is none."""
    if not text.isascii():
        return None
    name = text.lower().removesuffix(".")
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return None
    # To getaddrinfo, "127.1" and "2130706433" are addresses, not names.
    return None if labels[-1].isdigit() else name


def ip_of(text: str) -> IP | None:
    """``text`` as an IP address, IPv4-mapped IPv6 as IPv4; None if it is not one."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_local_name(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost")


def reserved(ip: IP, own: frozenset[IP]) -> str | None:
    """What kind of address the trainer keeps to itself ``ip`` is, or None if it is none."""
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_unspecified or ip in _THIS_NETWORK:
        return "an unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if ip in _METADATA:
        return "a cloud metadata address"
    if ip in own:
        return "an address of this machine"
    return None


def own_addresses() -> frozenset[IP]:
    """The addresses of this machine's interfaces, read anew: interfaces come and go."""
    found = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                ip = ip_of(address.address.partition("%")[0])
                if ip is not None:
                    found.add(ip)
    return frozenset(found)


@dataclass(frozen=True)
class Destination:
    """A destination as requested: a normalised name or IP literal, and a port."""

    host: str
    ip: IP | None  # set for an IP literal
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def destination(host: str, port: int) -> Destination:
    if not 0 < port < 65536:
        raise ValueError("bad port")
    ip = ip_of(host)
    if ip is not None:
        return Destination(str(ip), ip, port)
    name = _name(host)
    if name is None:
        raise ValueError("malformed host")
    return Destination(name, None, port)


def refusal(rules: Iterable[Rule], dest: Destination) -> str | None:
    """Why ``dest`` is refused, or None when a rule lets it through."""
    hosts = {rule.host for rule in rules if rule.port in (None, dest.port)}
    if dest.host in hosts:
        return None  # a rule names it
    if dest.ip is not None:
        if "*" not in hosts:
            return NOT_LISTED
        kind = reserved(dest.ip, own_addresses())
        return None if kind is None else f"{kind} needs a rule naming it"
    if is_local_name(dest.host):
        if any(host.startswith("*.") and dest.host.endswith(host[1:]) for host in hosts):
            return None
        return "localhost needs a rule naming it" if "*" in hosts else NOT_LISTED
    labels = dest.host.split(".")
    suffixes = {"*." + ".".join(labels[i:]) for i in range(1, len(labels))}
    return None if "*" in hosts or hosts & suffixes else NOT_LISTED
