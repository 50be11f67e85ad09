"""Tenants: who is calling, by name, from the configured keys.

    POLYSERVE_API_KEYS   = entry,entry,...     entry = key | name:key | name:key:weight
    POLYSERVE_ADMIN_KEYS = the same forms       (admin tenants)

A bare key is the tenant `default`. Names match NAME_RE; a weight is a finite number > 0 (its
share of the engine under fair scheduling, default 1). Several keys may share one name (one
tenant, key rotation); they must then agree on the weight. Metrics, logs and the usage ledger
only ever see names, never keys.

With no keys configured at all, every request is the tenant `default` (nothing changes: one
tenant is first come, first served, and owns nothing exclusively).

The caller's tenant travels with the request in a context variable (`current()`), set by the
auth dependency (server.api.deps) in the request's own task, so the generation path, the
registration path and the engine submit see it without every route threading it through.
"""

from __future__ import annotations

import contextvars
import hmac
import math
import re
from dataclasses import dataclass

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
DEFAULT = "default"


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    admin: bool = False


ANONYMOUS = Tenant(DEFAULT, 1.0, admin=True)  # no keys configured: everyone, allowed everything

_current: contextvars.ContextVar[Tenant] = contextvars.ContextVar("polyserve_tenant", default=ANONYMOUS)


def current() -> Tenant:
    """The tenant of the request being served (ANONYMOUS outside a request, or with no keys)."""
    return _current.get()


def set_current(tenant: Tenant) -> None:
    _current.set(tenant)


def weighted_share(total: int, weights: dict[str, float], tenant: str) -> int:
    """One tenant's part of a limit shared by the configured tenants: total * weight / total
    weight, rounded up (at least 1); the whole limit when fewer than two tenants are configured."""
    if len(weights) < 2:
        return total
    return max(1, math.ceil(total * weights.get(tenant, 1.0) / sum(weights.values())))


def parse_entry(entry: str) -> tuple[str, str, float]:
    """`key` | `name:key` | `name:key:weight` -> (name, key, weight); ValueError naming what is
    wrong (never the key itself)."""
    parts = entry.split(":")
    if len(parts) == 1:
        name, key, weight = DEFAULT, parts[0], "1"
    elif len(parts) == 2:
        name, key, weight = parts[0], parts[1], "1"
    elif len(parts) == 3:
        name, key, weight = parts
    else:
        raise ValueError("a key entry is key, name:key or name:key:weight (keys cannot hold ':')")
    if not NAME_RE.match(name):
        raise ValueError(f"tenant name {name!r} must match {NAME_RE.pattern}")
    if not key:
        raise ValueError(f"tenant {name!r}: empty key")
    try:
        w = float(weight)
    except ValueError:
        raise ValueError(f"tenant {name!r}: weight {weight!r} is not a number") from None
    if not (math.isfinite(w) and w > 0):
        raise ValueError(f"tenant {name!r}: weight must be a finite number > 0, got {weight!r}")
    return name, key, w


class Directory:
    """The configured tenants and their keys (built once from the settings)."""

    def __init__(self, api_entries: list[str], admin_entries: list[str]) -> None:
        self._keys: list[tuple[bytes, Tenant]] = []
        weights: dict[str, float] = {}
        admins: set[str] = set()
        # admin entries first: a key listed in both lists is an admin key
        parsed = [(parse_entry(e), True) for e in admin_entries] + [(parse_entry(e), False) for e in api_entries]
        for (name, _, weight), admin in parsed:
            if weights.setdefault(name, weight) != weight:
                raise ValueError(f"tenant {name!r} is given two different weights")
            if admin:
                admins.add(name)
        for (name, key, weight), admin in parsed:
            self._keys.append((key.encode(), Tenant(name, weight, admin=admin)))
        self.has_api_keys, self.has_admin_keys = bool(api_entries), bool(admin_entries)
        self.weights = weights  # name -> weight, every configured tenant
        self.admin_names = frozenset(admins)
        # ownership isolation needs identified inference callers: with only admin keys the
        # inference routes are open and everyone sees everything, as before tenants
        self.isolated = self.has_api_keys

    @property
    def configured(self) -> bool:
        """Any key at all (else every request is ANONYMOUS)."""
        return bool(self._keys)

    @property
    def names(self) -> list[str]:
        return sorted(self.weights)

    def lookup(self, token: str) -> Tenant | None:
        """The tenant of a bearer token (constant-time against every key), or None."""
        supplied, found = token.encode(), None
        for key, tenant in self._keys:
            if hmac.compare_digest(supplied, key) and found is None:
                found = tenant
        return found
