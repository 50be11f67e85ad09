"""Refuse to serve a non-loopback address with no key at all (everything, task changes included,
would be open to the network), unless POLYSERVE_ALLOW_UNAUTHENTICATED=1 says it is meant."""

from __future__ import annotations

import ipaddress

from server.wiring.settings import Settings


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost`; anything else (0.0.0.0, ::, a name) may be reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_error(host: str, settings: Settings) -> str | None:
    """Why serving `host` with these settings is refused, or None."""
    if settings.api_keys or settings.admin_keys or settings.allow_unauthenticated or is_loopback(host):
        return None
    return (f"refusing to serve {host} with no API key: every route, task changes included, would be open to "
            "the network. Set POLYSERVE_API_KEYS (and POLYSERVE_ADMIN_KEYS), serve 127.0.0.1, or set "
            "POLYSERVE_ALLOW_UNAUTHENTICATED=1 if that is really meant")
