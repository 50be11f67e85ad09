"""The native engine's scheduler: which waiting requests join the batch, and what one step holds.

    admit        waiting requests, in the order of the fair queue (server/engines/fair.py: the
                 tenant with the least weighted service first, FIFO within a tenant), while all
                 of these hold:
                     rows      every admitted request takes n KV slots (one per choice)
                     KV tokens prompt + max_new_tokens of everything in flight <= max_batch_tokens
                     prefill   prompt tokens still waiting for their forward stay under one
                               step's room (max_step_tokens less the decoding rows)
                     burst     at most max_prefill_rows requests per step
    plan_step    every decoding row's next token, then prompt chunks of the admitted requests in
                 admission order while the step's token budget lasts (chunked prefill: a long
                 prompt is spread over several steps, the decoding rows never wait for it)

Pure bookkeeping over the engine's rows and prefills: no forward, no sampling, no events. The
engine calls `admit` under its queue lock (submit() pushes from other threads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.engines.fair import FairQueue, in_flight
from server.engines.native.config import EngineConfig
from server.engines.native.slots import SlotPool
from server.engines.native.step import Item, LogitsWanted
from server.engines.request import GenRequest, TokenLogprob


@dataclass(eq=False)
class Prefill:
    """An admitted request whose prompt is not all in its KV slot yet."""

    req: GenRequest
    slots: list[int]  # n slots: slots[0] receives the prompt, the others wait for the forked choices
    done: int = 0  # prompt tokens already in slots[0]
    prompt_lp: list[TokenLogprob | None] | None = None
    failed: bool = False

    @property
    def remaining(self) -> int:
        return len(self.req.prompt_ids) - self.done


@dataclass
class Admission:
    admitted: list[Prefill]  # took their slots; their adapters are not set yet
    cancelled: list[GenRequest]  # cancelled while waiting: to be answered, never admitted


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting = FairQueue(config.caps, max_queue=config.max_queue, max_rows=config.max_batch_rows,
                                 max_tokens=config.max_batch_tokens)

    def admit(self, rows: list[Any], prefills: list[Prefill], pool: SlotPool) -> Admission:
        """Pop what fits (see the module docstring); each admitted request takes its n slots."""
        cfg = self.config
        tokens = sum(len(r.req.prompt_ids) + r.req.params.max_new_tokens for r in rows)
        tokens += sum(p.req.budget_tokens for p in prefills)
        running = len(rows) + sum(p.req.params.n for p in prefills)
        pending = sum(p.remaining for p in prefills)
        room = max(1, cfg.max_step_tokens - len(rows))
        picker = self.waiting.begin(in_flight(
            [(r.req.tenant, 1, len(r.req.prompt_ids) + r.req.params.max_new_tokens) for r in rows]
            + [(p.req.tenant, p.req.params.n, p.req.budget_tokens) for p in prefills]))
        admitted: list[Prefill] = []
        while self.waiting and pending < room and len(admitted) < cfg.max_prefill_rows:
            req = picker.next(cfg.max_batch_rows - running, cfg.max_batch_tokens - tokens)
            if req is None:
                break
            tokens += req.budget_tokens
            running += req.params.n
            pending += len(req.prompt_ids)
            prefill = Prefill(req, [])
            prefill.slots = pool.take(prefill, req.params.n)
            admitted.append(prefill)
        return Admission(admitted, list(picker.cancelled))

    def plan_step(self, rows: list[Any], prefills: list[Prefill]) -> tuple[list[Item], list[Any]]:
        """(items, owners): every decoding row's next token, then prompt chunks (admission order)
        while the step's token budget lasts."""
        items: list[Item] = []
        owners: list[Any] = []
        for row in rows:
            items.append(Item(row.slot, row.length, (row.last_token,)))
            owners.append(row)
        budget = self.config.max_step_tokens - len(items)
        for prefill in prefills:
            if budget <= 0:
                break
            prompt = prefill.req.prompt_ids
            size = min(prefill.remaining, budget)
            last = prefill.done + size == len(prompt)
            wanted: LogitsWanted = "all" if prefill.prompt_lp is not None else "last" if last else "none"
            items.append(Item(prefill.slots[0], prefill.done, tuple(prompt[prefill.done : prefill.done + size]), wanted))
            owners.append(prefill)
            budget -= size
        return items, owners
