"""Which Host names a server answers to. A server bound to a loopback address is reachable only
from this machine, but a web page can rebind its own DNS name to 127.0.0.1 and then read our
answers (DNS rebinding); it still sends its own name in the Host header, so a loopback server
accepts only loopback names, the bound host, and what `--allowed-hosts` adds. Plain functions,
no web imports, so presets and the CLI can ask `is_loopback_host` cheaply."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (localhost, 127.0.0.0/8, ::1)."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name part of a Host header: 'a.b:8000' -> 'a.b', '[::1]:80' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.rstrip(".")


def allowed_host_names(bind_host: str, extra: Iterable[str]) -> frozenset[str] | None:
    """Host names to accept, or None for any. A loopback bind, or any bind given `extra`, accepts
    the loopback names, the bound host and `extra` (this machine's own clients, such as the TUI,
    keep working); a non-loopback bind without `extra` accepts any; '*' turns the check off."""
    given = [host_name(h) for h in extra if h.strip()]
    if "*" in given or (not given and not is_loopback_host(bind_host)):
        return None
    return frozenset([*given, *LOOPBACK_NAMES, host_name(bind_host)])
