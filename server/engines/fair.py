"""Fair admission across tenants: virtual token counters (S-LoRA's VTC) plus per-tenant caps.

The engine's waiting requests sit in one FIFO queue per tenant. Each tenant has a counter of the
service it received, weighted: prompt tokens when a request is admitted, plus every generated
token, divided by the tenant's weight. One admission pass (`Pass`, once per engine step):

    repeat:
        t = the tenant with waiting requests (not yet passed over) of least counter
            (ties: whose head request arrived first)
        head = t's oldest request
        over t's caps if admitted (rows in flight, KV tokens in flight)   -> pass over t
        does not fit the engine's free rows / KV tokens (less what is reserved)
            -> pass over t; if head has been passed over so for `patience` passes in a row,
               and nothing is reserved yet, it reserves the rows and tokens it needs
        else admit head: counter[t] += prompt tokens / weight(t)

A request that does not fit now does not block another tenant's request behind it: the others
fit around it. Within one tenant the order stays first come, first served.

Lending (`TenantCaps.lends`: fair admission with two or more tenants configured): nothing is
reserved. The engine's scheduler (server/engines/native/core/scheduler.py) starts a blocked n-choice
head split in the rows left free, and a tenant below its row share takes rows back from tenants
above theirs by preemption:

    row_shares   max_rows * weight / total weight, over the tenants active now
    reclaim      the cheapest rows to recompute of tenants above their share, never taking one
                 below it, for a tenant that stays within its share once admitted (else None)

Without lending, one head that has waited `patience` passes for room reserves it, so a large
request is not starved for good by a stream of small ones that keep taking every row that frees.

No credit for idling: a tenant that becomes active (it had nothing waiting and nothing in
flight) has its counter lifted to the least counter of the active tenants, so a tenant that was
away cannot then monopolise the engine to catch up.

Caps (None = the engine's own budget):
    max_queued   waiting requests of one tenant; default: its weighted share of the engine's
                 queue (max_queue * weight / total weight of the configured tenants), so one
                 tenant's flood can never fill the queue for the others      -> 429 "queued"
                 (with one tenant and no max_queued: the engine's queue      -> 429 as before)
    max_rows     rows (choices) one tenant has admitted at once              -> waits
    kv_share     share of the KV budget (max_batch_tokens) one tenant's admitted requests may
                 hold                                                        -> waits
A request that alone exceeds its tenant's rows or KV cap can never run: refused (permanent).

With fairness off (`fair=False`) every request joins one FIFO queue under the engine's own
max_queue and no cap applies: the engine's first-come-first-served admission, unchanged.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engines.request import GenRequest
from server.tenancy.tenants import Directory

if TYPE_CHECKING:
    from server.wiring.settings import Settings

ONE_QUEUE = ""  # the key of the single queue when fairness is off


class TenantLimit(Exception):
    """A tenant's own cap refuses a request. `limit` is "queued" | "rows" | "kv_share";
    permanent: the request can never run under this cap (else: retry after `retry_after` s)."""

    def __init__(self, tenant: str, limit: str, message: str, *, retry_after: int = 1,
                 permanent: bool = False) -> None:
        super().__init__(message)
        self.tenant, self.limit, self.retry_after, self.permanent = tenant, limit, retry_after, permanent


@dataclass(frozen=True)
class TenantCaps:
    """Per-tenant policy; weights of the configured tenants ({} = none configured)."""

    weights: dict[str, float] = field(default_factory=dict)
    max_queued: int | None = None
    max_rows: int | None = None
    kv_share: float = 1.0
    fair: bool = True
    patience: int = 16  # admission passes a blocked head waits before it reserves room
    preempt: bool = True  # a tenant below its row share takes rows back from one above (reclaim)
    hold_passes: int = 4  # lending: the rows a tenant just used stay free for it this many passes

    def __post_init__(self) -> None:
        if not 0 < self.kv_share <= 1:
            raise ValueError(f"kv_share must be in (0, 1], got {self.kv_share}")

    @property
    def per_tenant_queue(self) -> bool:
        """Whether a tenant's queue has a cap of its own (else the engine's one queue is the cap)."""
        return self.fair and (len(self.weights) >= 2 or self.max_queued is not None)

    @property
    def lends(self) -> bool:
        """Whether rows are lent and taken back (preemption, split admission): fair admission with
        tenants configured; with fairness off or a single tenant admission is as it was."""
        return self.fair and self.preempt and len(self.weights) >= 2

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def queued_cap(self, tenant: str, max_queue: int) -> int:
        """Waiting requests `tenant` may have: max_queued, and at most its weighted share."""
        total = sum(self.weights.values())
        share = max_queue if len(self.weights) < 2 else math.ceil(max_queue * self.weight(tenant) / total)
        return share if self.max_queued is None else min(share, self.max_queued)

    def rows_cap(self, max_rows: int) -> int:
        return max_rows if self.max_rows is None else min(max_rows, self.max_rows)

    def kv_cap(self, max_tokens: int) -> int:
        return max(1, math.floor(self.kv_share * max_tokens))


@dataclass
class InFlight:
    """What one tenant has admitted: rows (choices) and KV tokens (prompt + max_new per row)."""

    rows: int = 0
    tokens: int = 0


def in_flight(parts: Iterable[tuple[str, int, int]]) -> dict[str, InFlight]:
    """(tenant, rows, tokens) of each admitted request or row -> totals per tenant."""
    out: dict[str, InFlight] = {}
    for tenant, rows, tokens in parts:
        use = out.setdefault(tenant, InFlight())
        use.rows += rows
        use.tokens += tokens
    return out


def check_caps(req: GenRequest, caps: TenantCaps, *, max_rows: int, max_tokens: int) -> None:
    """TenantLimit(permanent) for a request that alone exceeds its tenant's rows or KV cap."""
    if not caps.fair:
        return
    rows, kv = caps.rows_cap(max_rows), caps.kv_cap(max_tokens)
    if req.params.n > rows:
        raise TenantLimit(req.tenant, "rows", f"n: {req.params.n} choices exceed this tenant's row limit "
                          f"(POLYSERVE_TENANT_MAX_ROWS: {rows})", permanent=True)
    if req.budget_tokens > kv:
        raise TenantLimit(req.tenant, "kv_share", f"prompt + max_tokens: {req.budget_tokens} KV tokens exceed "
                          f"this tenant's share of the KV budget (POLYSERVE_TENANT_KV_SHARE: {kv} tokens)",
                          permanent=True)


class FairQueue:
    """The engine's waiting requests (not thread-safe: the engine holds its lock around push,
    a pass and drain; `charge` runs on the engine thread)."""

    def __init__(self, caps: TenantCaps, *, max_queue: int, max_rows: int, max_tokens: int) -> None:
        self.caps = caps
        self.max_queue, self.max_rows, self.max_tokens = max_queue, max_rows, max_tokens
        self._queues: dict[str, deque[GenRequest]] = {}
        self._counter: dict[str, float] = {}
        self._in_flight: dict[str, InFlight] = {}  # as of the last pass
        self._skips: dict[str, int] = {}  # passes in a row that a tenant's head found no room
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _key(self, req: GenRequest) -> str:
        return req.tenant if self.caps.fair else ONE_QUEUE

    def counter(self, tenant: str) -> float:
        return self._counter.get(tenant, 0.0)

    def tenants(self) -> list[str]:
        """The tenants with requests waiting."""
        return [k for k, v in self._queues.items() if v]

    def waiting(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def push(self, req: GenRequest) -> str | None:
        """Queue `req`; returns None, or the limit that refuses it: "queue" (the engine's queue is
        full: fairness off) or "queued" (its tenant's cap)."""
        key = self._key(req)
        if not self.caps.per_tenant_queue:
            if self._len >= self.max_queue:
                return "queue"
        elif self.waiting(key) >= self.caps.queued_cap(key, self.max_queue):
            return "queued"
        queue = self._queues.setdefault(key, deque())
        if not queue and key not in self._in_flight:
            self._lift(key)
        queue.append(req)
        self._len += 1
        return None

    def _lift(self, tenant: str) -> None:
        """`tenant` becomes active: no credit for the time it was away."""
        active = [self.counter(t) for t, q in self._queues.items() if q and t != tenant]
        active += [self.counter(t) for t in self._in_flight if t != tenant]
        if active:
            self._counter[tenant] = max(self.counter(tenant), min(active))

    def charge(self, tenant: str, tokens: int) -> None:
        """`tenant` received `tokens` of service (generated tokens; prompts are charged at admission)."""
        if self.caps.fair:
            self._counter[tenant] = self.counter(tenant) + tokens / self.caps.weight(tenant)

    def drain(self) -> list[GenRequest]:
        """Every waiting request, oldest first (shutdown)."""
        out = sorted((r for q in self._queues.values() for r in q), key=lambda r: r.arrival)
        self._queues.clear()
        self._len = 0
        return out

    def begin(self, in_flight_now: dict[str, InFlight], others: Iterable[str] = ()) -> Pass:
        """Start one admission pass, given what each tenant has admitted right now; `others`:
        tenants active besides (preempted rows waiting), for the row shares."""
        self._in_flight = {t: u for t, u in in_flight_now.items() if u.rows}
        shares = row_shares(self.caps, [*self._in_flight, *self.tenants(), *others], self.max_rows)
        return Pass(self, {t: InFlight(u.rows, u.tokens) for t, u in in_flight_now.items()}, shares)

    def _pop(self, key: str) -> GenRequest:
        queue = self._queues[key]
        req = queue.popleft()
        self._skips.pop(key, None)
        if not queue:
            del self._queues[key]
        self._len -= 1
        return req


class Pass:
    """One admission pass: `next(free_rows, free_tokens)` pops the next request to admit, or None."""

    def __init__(self, queue: FairQueue, use: dict[str, InFlight], shares: dict[str, float] | None = None) -> None:
        self.q = queue
        self.use = use
        self.shares = shares or {}  # each active tenant's share of the rows (row_shares)
        self.held: dict[str, int] = {}  # rows kept free for a tenant that was just using them
        self.passed: set[str] = set()
        self.reserved = InFlight()
        self.cancelled: list[GenRequest] = []  # popped: the engine answers them
        self.blocked: list[str] = []  # passed over for want of room (not their own caps), in pass order

    def _may_reserve(self, key: str, n: int) -> bool:
        """Lending rows (see `TenantCaps.lends`), nothing is held for a head: it starts split in
        whatever rows are free, or a tenant within its share takes rows back by preemption; a
        reservation would only idle rows."""
        return not self.q.caps.lends

    def kept(self, key: str) -> int:
        """Free rows `key` may not take: those held for other tenants."""
        return sum(self.held.values()) - self.held.get(key, 0)

    def head(self, key: str) -> GenRequest:
        return self.q._queues[key][0]

    def retry(self, key: str) -> None:
        """Room was made for `key`'s head (preemption): the pass may consider it again."""
        self.passed.discard(key)
        if key in self.blocked:
            self.blocked.remove(key)

    def _order(self) -> Iterator[str]:
        q = self.q
        keys = [k for k, v in q._queues.items() if v and k not in self.passed]
        keys.sort(key=lambda k: (q.counter(k), q._queues[k][0].arrival))
        return iter(keys)

    def next(self, free_rows: int, free_tokens: int) -> GenRequest | None:
        q = self.q
        while True:
            key = next(self._order(), None)
            if key is None:
                return None
            head = q._queues[key][0]
            if head.handle.cancelled.is_set():
                self.cancelled.append(q._pop(key))
                continue
            n, tokens = head.params.n, head.budget_tokens
            if q.caps.fair:
                use = self.use.setdefault(key, InFlight())
                rows_cap, kv_cap = q.caps.rows_cap(q.max_rows), q.caps.kv_cap(q.max_tokens)
                # a cap below the engine's own budget; at the engine's budget it is want of room (below)
                if ((use.rows + n > rows_cap and rows_cap < q.max_rows)
                        or (use.tokens + tokens > kv_cap and kv_cap < q.max_tokens)):
                    self.passed.add(key)  # at its own cap: it waits, reserving nothing
                    continue
            if n > free_rows - self.reserved.rows - self.kept(key) or tokens > free_tokens - self.reserved.tokens:
                skips = q._skips[key] = q._skips.get(key, 0) + 1
                if skips > q.caps.patience and not self.reserved.rows and self._may_reserve(key, n):
                    self.reserved = InFlight(n, tokens)  # waited long enough: hold room
                self.passed.add(key)
                self.blocked.append(key)
                continue
            return self.take(key, n, tokens)

    def take(self, key: str, rows: int, tokens: int) -> GenRequest:
        """Pop `key`'s head, admitted with `rows` rows and `tokens` KV tokens (fewer than it asks
        for when it starts split: the engine's own choice)."""
        q = self.q
        req = q._pop(key)
        if key in self.held:
            self.held[key] = max(0, self.held[key] - rows)
        if q.caps.fair:
            use = self.use.setdefault(key, InFlight())
            use.rows += rows
            use.tokens += tokens
            q._counter[key] = q.counter(key) + len(req.prompt_ids) / q.caps.weight(key)
        return req


def row_shares(caps: TenantCaps, tenants: Iterable[str], max_rows: int) -> dict[str, float]:
    """Each active tenant's weighted share of the engine's rows: max_rows * weight / total weight."""
    active = set(tenants)
    total = sum(caps.weight(t) for t in active)
    return {t: max_rows * caps.weight(t) / total for t in active}


@dataclass(frozen=True)
class Lent:
    """A decoding row that may be taken back: its tenant, what recomputing it costs (the
    positions its slot holds), its KV tokens (prompt + max_new), and the row itself."""

    tenant: str
    cost: int
    tokens: int
    row: object


def reclaim(tenant: str, rows: int, tokens: int, lent: Iterable[Lent], use: dict[str, InFlight],
            shares: dict[str, float]) -> list[Lent] | None:
    """The rows to preempt so that `tenant` gets `rows` rows and `tokens` KV tokens more, or None.

    Only a tenant below its share after the admission may reclaim (use + rows <= share), and only
    from tenants above theirs, never taking one below its share; the cheapest rows to recompute
    go first. None when that cannot free enough (nothing is taken then)."""
    if rows <= 0 and tokens <= 0:
        return []
    if use.get(tenant, InFlight()).rows + max(rows, 0) > shares.get(tenant, 0.0):
        return None
    left = {t: u.rows for t, u in use.items()}
    out: list[Lent] = []
    for cand in sorted(lent, key=lambda c: c.cost):
        if rows <= 0 and tokens <= 0:
            break
        if cand.tenant == tenant or left.get(cand.tenant, 0) - 1 < shares.get(cand.tenant, 0.0):
            continue
        left[cand.tenant] -= 1
        out.append(cand)
        rows -= 1
        tokens -= cand.tokens
    return out if rows <= 0 and tokens <= 0 else None


def check_submit_caps(req: GenRequest, caps: TenantCaps, others: Iterable[GenRequest], *, max_queue: int,
                      max_rows: int, max_tokens: int, retry_after: int) -> None:
    """For an engine that schedules internally (vLLM): the caps apply before a request reaches it.
    `others`: the requests it holds now. TenantLimit when `req`'s tenant would exceed its queued,
    rows or KV cap counting everything it has in the engine."""
    if not caps.fair:
        return
    check_caps(req, caps, max_rows=max_rows, max_tokens=max_tokens)
    mine = [r for r in others if r.tenant == req.tenant]
    rows, tokens = sum(r.params.n for r in mine), sum(r.budget_tokens for r in mine)
    # requests beyond what the engine runs at once are its queue
    if len(mine) + 1 - max_rows > caps.queued_cap(req.tenant, max_queue):
        raise TenantLimit(req.tenant, "queued", f"this tenant already has {len(mine)} requests in the engine "
                          "(POLYSERVE_TENANT_MAX_QUEUED)", retry_after=retry_after)
    if caps.max_rows is not None and rows + req.params.n > caps.rows_cap(max_rows):
        raise TenantLimit(req.tenant, "rows", f"this tenant already has {rows} rows in flight "
                          f"(POLYSERVE_TENANT_MAX_ROWS: {caps.rows_cap(max_rows)})", retry_after=retry_after)
    if caps.kv_share < 1 and tokens + req.budget_tokens > caps.kv_cap(max_tokens):
        raise TenantLimit(req.tenant, "kv_share", f"this tenant already holds {tokens} KV tokens in flight "
                          f"(POLYSERVE_TENANT_KV_SHARE: {caps.kv_cap(max_tokens)} tokens)", retry_after=retry_after)


def tenant_caps(settings: Settings) -> TenantCaps:
    """The per-tenant caps and weights of the configured keys (server.engines.fair)."""
    return TenantCaps(weights=Directory(settings.api_keys, settings.admin_keys).weights,
                      max_queued=settings.tenant_max_queued, max_rows=settings.tenant_max_rows,
                      kv_share=settings.tenant_kv_share, fair=settings.tenant_fairness)
