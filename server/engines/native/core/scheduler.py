"""The native engine's scheduler: which waiting requests join the batch, and what one step holds.

    admit        waiting requests, in the order of the fair queue (server/engines/fair.py: the
                 tenant with the least weighted service first, FIFO within a tenant), while all
                 of these hold:
                     rows      every admitted request takes n KV slots (one per choice)
                     KV tokens prompt + max_new_tokens of everything in flight <= max_batch_tokens
                     prefill   prompt tokens still waiting for their forward stay under one
                               step's room (max_step_tokens less the decoding rows), each
                               tenant's own under fair admission (another tenant's long
                               prompt never holds a short one out)
                     burst     at most max_prefill_rows requests per step
                 then preempted rows resume in the rows left over (see below)
    plan_step    every decoding row's next token, then prompt chunks of the admitted requests in
                 admission order while the step's token budget lasts (chunked prefill: a long
                 prompt is spread over several steps, the decoding rows never wait for it);
                 optionally, while a tenant's rows decode, other tenants' chunks share a
                 smaller budget (tenant_prefill_tokens)

Rows are lent, and taken back by preemption (fair admission only). No tenant has rows held for
it: a tenant alone may fill every row. When a tenant's head request finds no room, and after
admitting it the tenant would still hold no more than its weighted share of the rows
(max_batch_rows * weight / total weight of the tenants with rows in flight or requests
waiting), rows of tenants above their share are preempted, the cheapest to recompute first,
never taking a tenant below its share (fair.reclaim):

    preempt      the row leaves its KV slot; its Row (sampler, detokenizer, logprobs, what was
                 sent) waits here, in preemption order
    resume       once rows are free after the admission pass (or first, once it has waited
                 `patience` passes), it takes one slot, its prompt + generated tokens are
                 recomputed as a prefill (no logits, nothing sampled or sent), and it decodes
                 on from the token it had sampled: the client sees only a pause

    hold         the rows a tenant held until just now stay free for it for `hold_passes`
                 passes (up to its share): a tenant sending one request after another takes
                 its row back without a preemption, and no row is recomputed for it; one that
                 stays away leaves its rows to be lent again

Why preemption and not only a reservation that follows demand: rows are taken n at a time (a request
with n=4 takes 4), so any reservation for a small tenant (1 row) leaves the rest of a 4-row hole
idle, and the small tenant's requests come and go faster than a reservation can follow. Measured
on the two-tenant benchmark's mix (32 rows, the flood's n=4 requests, the small tenant's 1-row
requests), a static 28-row cap kept 28.7 rows busy against FCFS's 31.9. Preemption lends every
row and costs one recompute of the cheapest row (the newest flood request's, a few dozen
positions) per small request. vLLM preempts by recompute the same way (its newest request).

Pure bookkeeping over the engine's rows and prefills: no forward, no sampling, no events, no KV
moves (the engine frees the preempted rows' slots, then gives the admitted their slots). The
engine calls `admit` under its queue lock (submit() pushes from other threads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.engines.fair import FairQueue, InFlight, Lent, Pass, in_flight, reclaim, row_shares
from server.engines.native.config import EngineConfig
from server.engines.native.core.step import Item, LogitsWanted
from server.engines.request import GenRequest, TokenLogprob


@dataclass(eq=False)
class Prefill:
    """An admitted request whose prompt is not all in its KV slot yet, or (`resume`) a preempted
    row whose prompt + generated tokens go back into a slot before it decodes on."""

    req: GenRequest
    slots: list[int]  # slots[0] receives the tokens; the others wait for the forked choices
    done: int = 0  # tokens already in slots[0]
    prompt_lp: list[TokenLogprob | None] | None = None
    failed: bool = False
    resume: Any = None  # the preempted Row (one slot), or None: a new request
    width: int = 0  # slots a new request takes: n, or fewer when it starts split (0 = n)
    tokens: list[int] = field(default_factory=list)  # what goes into slots[0]: the prompt, or prompt + generated
    hashes: list[bytes] = field(default_factory=list)  # prefix-cache names of its full blocks (prefix_cache.chain)
    stored: int = 0  # of which the prefix cache holds (found there, or stored from slots[0])

    def __post_init__(self) -> None:
        if self.resume is None:
            self.tokens = self.req.prompt_ids

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done

    @property
    def rows(self) -> int:
        return 1 if self.resume is not None else self.width or self.req.params.n

    @property
    def budget(self) -> int:
        """KV tokens it holds against max_batch_tokens."""
        return self.req.budget_tokens if self.rows == self.req.params.n else self.rows * row_budget(self.req)


def row_budget(req: GenRequest) -> int:
    return len(req.prompt_ids) + req.params.max_new_tokens


@dataclass(eq=False)
class Preempted:
    row: Any  # the engine's Row, out of its slot
    tokens: list[int]  # the positions its slot held: prompt + generated but the last (pending) token
    waited: int = 0  # admission passes since it was preempted


@dataclass
class Admission:
    admitted: list[Prefill]  # to take their slots (after the preempted free theirs); adapters not set yet
    cancelled: list[GenRequest]  # cancelled while waiting: to be answered, never admitted
    preempted: list[Any] = field(default_factory=list)  # rows to leave their slots (they wait here)
    cancelled_rows: list[Any] = field(default_factory=list)  # preempted rows cancelled while waiting


class Scheduler:
    def __init__(self, config: EngineConfig, cached: Callable[[Prefill], int] | None = None) -> None:
        """cached: the prompt tokens of an admitted request that the prefix cache will fill (they
        need no forward, so they take none of a step's room)."""
        self.config = config
        self.cached = cached
        self.waiting = FairQueue(config.caps, max_queue=config.max_queue, max_rows=config.max_batch_rows,
                                 max_tokens=config.max_batch_tokens)
        self.preempted: list[Preempted] = []  # oldest first
        self._pending: dict[str, int] = {}  # during a pass: prompt tokens admitted, not yet forwarded, by _room_key
        self._room = 1  # during a pass: one step's room for them
        self._passes = 0
        self._recent: dict[str, tuple[int, int]] = {}  # tenant -> (rows it held, pass) while it held any

    def admit(self, rows: list[Any], prefills: list[Prefill]) -> Admission:
        """Pop what fits (see the module docstring), preempting rows for a tenant below its share."""
        cfg = self.config
        self._tokens = sum(row_budget(r.req) for r in rows) + sum(p.budget for p in prefills)
        self._running = len(rows) + sum(p.rows for p in prefills)
        self._pending = {}
        for p in prefills:
            self._pending[self._room_key(p.req)] = self._pending.get(self._room_key(p.req), 0) + p.remaining
        self._room = max(1, cfg.max_step_tokens - len(rows))
        picker = self.waiting.begin(in_flight(
            [(r.req.tenant, 1, row_budget(r.req)) for r in rows]
            + [(p.req.tenant, p.rows, p.budget) for p in prefills]), [e.row.req.tenant for e in self.preempted])
        self._hold(picker)
        out = Admission([], [])
        keep = []
        for entry in self.preempted:
            if entry.row.finish is not None:
                continue  # a choice that started split and ended on its first token
            if entry.row.req.handle.cancelled.is_set():
                out.cancelled_rows.append(entry.row)  # the engine answers it
                continue
            entry.waited += 1
            keep.append(entry)
        self.preempted = keep
        overdue = [e for e in self.preempted if e.waited > cfg.caps.patience]
        self._resume(overdue, picker, out)  # a row that waited long enough goes first
        lendable = {id(r): r for r in rows}
        tried: set[str] = set()
        while self.waiting and len(out.admitted) < cfg.max_prefill_rows:
            if "" in self._pending and not self._has_room(""):
                break  # one queue (no fairness): its prompts fill the room
            picker.passed.update(t for t in self._pending if not self._has_room(t))  # theirs do
            req = picker.next(cfg.max_batch_rows - self._running, cfg.max_batch_tokens - self._tokens)
            if req is None:
                if not self._make_room(picker, lendable, out, tried):
                    break
                continue
            self._take(Prefill(req, []), out)
        self._resume(list(self.preempted), picker, out)
        self._split(picker, out)
        out.cancelled = list(picker.cancelled)
        return out

    def defer(self, row: Any) -> None:
        """A choice of a request that started split: it waits for a slot (its prompt is recomputed)."""
        self.preempted.append(Preempted(row, list(row.req.prompt_ids)))

    def _split(self, picker: Pass, out: Admission) -> None:
        """Rows still free while a head waits for more: it starts in them, split (lending only).
        Its other choices are sampled with the first ones, then wait for slots as preempted rows
        do. A 4-choice request is not left waiting for 4 free rows while 1-3 sit idle."""
        cfg = self.config
        caps = cfg.caps
        if not caps.lends:
            return
        for key in list(picker.blocked):
            free = cfg.max_batch_rows - self._running - picker.reserved.rows - picker.kept(key)
            if free < 1 or len(out.admitted) >= cfg.max_prefill_rows:
                return
            head = picker.head(key)
            if not self._has_room(self._room_key(head)):
                continue
            use = picker.use.get(key, InFlight())
            width = min(free, head.params.n - 1, caps.rows_cap(cfg.max_batch_rows) - use.rows)
            budget = width * row_budget(head)
            if (width < 1 or self._tokens + budget > cfg.max_batch_tokens - picker.reserved.tokens
                    or use.tokens + budget > caps.kv_cap(cfg.max_batch_tokens)):
                continue
            picker.blocked.remove(key)
            self._take(Prefill(picker.take(key, width, budget), [], width=width), out)

    def _hold(self, picker: Pass) -> None:
        """Rows a tenant held until just now stay free for it for `hold_passes` passes (lending
        only), up to its share: a tenant whose requests come one after another takes its row
        back without preempting anyone, and the row lent meanwhile needs no recompute."""
        caps = self.config.caps
        if not caps.lends:
            return
        self._passes += 1
        for t, u in picker.use.items():
            if u.rows:
                self._recent[t] = (u.rows, self._passes)
        self._recent = {t: v for t, v in self._recent.items() if self._passes - v[1] <= caps.hold_passes}
        active = [t for t, share in picker.shares.items()]
        for t, (rows, _) in self._recent.items():
            share = row_shares(caps, [*active, t], self.config.max_batch_rows)[t]
            held = min(rows, int(share)) - picker.use.get(t, InFlight()).rows
            if held > 0:
                picker.held[t] = held

    def _take(self, prefill: Prefill, out: Admission) -> None:
        self._tokens += prefill.budget
        self._running += prefill.rows
        key = self._room_key(prefill.req)
        work = prefill.remaining - (self.cached(prefill) if self.cached is not None else 0)
        self._pending[key] = self._pending.get(key, 0) + work
        out.admitted.append(prefill)

    def _room_key(self, req: GenRequest) -> str:
        """Whose prompts share a step's room: each tenant's own (fair admission), or everyone's."""
        return req.tenant if self.config.caps.fair else ""

    def _has_room(self, key: str) -> bool:
        """Prompt tokens admitted and not yet forwarded stay under one step's room, per tenant
        under fair admission: another tenant's long prompt never holds a short one out."""
        return self._pending.get(key, 0) < self._room

    def _make_room(self, picker: Pass, lendable: dict[int, Any], out: Admission, tried: set[str]) -> bool:
        """Preempt rows for the first blocked tenant that may reclaim them; whether it did."""
        cfg = self.config
        if not cfg.caps.lends:
            return False
        use, shares = picker.use, picker.shares
        lent: list[Lent] | None = None
        for key in picker.blocked:
            if key in tried:
                continue
            tried.add(key)
            head = picker.head(key)
            if use.get(key, InFlight()).rows + head.params.n > shares.get(key, 0.0):
                continue  # at or above its share: it waits (the common case under a flood: no list built)
            if lent is None:
                lent = [Lent(r.req.tenant, r.length, row_budget(r.req), r) for r in lendable.values()]
            need_rows = head.params.n - (cfg.max_batch_rows - self._running - picker.reserved.rows - picker.kept(key))
            need_tokens = head.budget_tokens - (cfg.max_batch_tokens - self._tokens - picker.reserved.tokens)
            victims = reclaim(key, need_rows, need_tokens, lent, use, shares)
            if not victims:
                continue
            for v in victims:
                row = lendable.pop(id(v.row))
                use[v.tenant].rows -= 1
                use[v.tenant].tokens -= v.tokens
                self._running -= 1
                self._tokens -= v.tokens
                out.preempted.append(row)
                generated = row.generated_ids[:row.length - len(row.req.prompt_ids)]
                self.preempted.append(Preempted(row, list(row.req.prompt_ids) + generated))
            picker.retry(key)
            return True
        return False

    def _resume(self, entries: list[Preempted], picker: Pass, out: Admission) -> None:
        """Preempted rows take the rows left over, oldest first, within their tenant's caps."""
        cfg = self.config
        caps = cfg.caps
        for entry in entries:
            row = entry.row
            if row in out.preempted:
                continue  # preempted in this very pass
            if len(out.admitted) >= cfg.max_prefill_rows:
                return
            if not self._has_room(self._room_key(row.req)):
                continue
            budget = row_budget(row.req)
            if (self._running + 1 > cfg.max_batch_rows - picker.reserved.rows - picker.kept(row.req.tenant)
                    or self._tokens + budget > cfg.max_batch_tokens - picker.reserved.tokens):
                continue  # rows held for another tenant, or no room: a later one may be another's
            if caps.fair:
                use = picker.use.setdefault(row.req.tenant, InFlight())
                if (use.rows + 1 > caps.rows_cap(cfg.max_batch_rows)
                        or use.tokens + budget > caps.kv_cap(cfg.max_batch_tokens)):
                    continue
                use.rows += 1
                use.tokens += budget
            if picker.held.get(row.req.tenant):
                picker.held[row.req.tenant] -= 1
            self.preempted.remove(entry)
            self._take(Prefill(row.req, [], resume=row, tokens=entry.tokens), out)

    def plan_step(self, rows: list[Any], prefills: list[Prefill]) -> tuple[list[Item], list[Any]]:
        """(items, owners): every decoding row's next token, then prompt chunks (admission order)
        while the step's token budget lasts. A resumed row's chunks want no logits.

        Tenants' steps (tenant_prefill_tokens > 0): while rows of some tenant decode, the prompt
        chunks of the *other* tenants' requests (new prompts, resumed rows' recomputes) hold at
        most tenant_prefill_tokens tokens of the step, and the shortest prompts go first
        (Sarathi-Serve's chunked-prefill budget, applied between tenants); a tenant's own chunks,
        and steps with no other tenant decoding, keep the whole max_step_tokens. A long prompt is
        then spread thin over the steps another tenant decodes in, instead of filling a few of
        them (on a CPU a step of a few hundred prompt tokens costs several decode steps); the
        prompt's own rows start later (README, "Tenants").
        """
        items: list[Item] = []
        owners: list[Any] = []
        for row in rows:
            items.append(Item(row.slot, row.length, (row.last_token,)))
            owners.append(row)
        budget = self.config.max_step_tokens - len(items)
        bound = self.config.tenant_prefill_tokens
        decoding = {row.req.tenant for row in rows}
        if bound and len(decoding | {p.req.tenant for p in prefills}) > 1:
            # a short prompt's rows start decoding at once; a long one loses a few tokens of one step
            prefills = sorted(prefills, key=lambda p: p.remaining)
        else:
            bound = 0
        foreign = bound  # prompt tokens left this step for chunks that delay another tenant's rows
        for prefill in prefills:
            if budget <= 0:
                break
            delays_others = bool(bound) and bool(decoding - {prefill.req.tenant})
            size = min(prefill.remaining, budget, foreign if delays_others else budget)
            if size <= 0:
                continue
            tokens = prefill.tokens
            last = prefill.done + size == len(tokens)
            wanted: LogitsWanted = ("none" if prefill.resume is not None else "all" if prefill.prompt_lp is not None
                      else "last" if last else "none")
            items.append(Item(prefill.slots[0], prefill.done, tuple(tokens[prefill.done : prefill.done + size]),
                              wanted))
            owners.append(prefill)
            budget -= size
            if delays_others:
                foreign -= size
        return items, owners
