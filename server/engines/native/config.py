"""The native engine's configuration: its budgets and how its model runner is built, in one value.

    max_batch_rows     KV slots: rows (choices) in flight at once
    max_batch_tokens   KV tokens in flight: prompt + max_new_tokens of every admitted request
    max_prefill_rows   requests admitted in one step
    max_queue          waiting requests beyond which submit answers QueueFull (429)
    prefix_cache_tokens
                       prompt KV kept across requests (core/prefix_cache.py), in tokens: None =
                       max_batch_tokens (as much as the rows in flight may hold), 0 = off
    max_step_tokens    tokens in one forward: every decoding row's next token + prompt chunks
    tenant_prefill_tokens
                       while a tenant's rows decode, prompt tokens of other tenants' requests in
                       one step (0: no such bound; plan_step in core/scheduler.py)
    background_share   share of engine time background slices (registration) may take under load
    dtype              the serving dtype (None: the model's own)
    threads            the engine thread's torch threads (None: the constructing thread's count)
    tuning             the internal switches, carried whole to the model runner (tuning.py):
                       the executor, packing, static decode, the kernels, and how a step runs
                       while other processes hold the CPUs (adaptive_threads, contended_helper:
                       core/execution.py)
    caps               per-tenant caps and weights (server/engines/fair.py)

`from_settings` maps the POLYSERVE_* settings onto it; tests and benchmarks build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from server.engines.dtype import serving_dtype
from server.engines.fair import TenantCaps, tenant_caps
from server.engines.native.core.prefix_cache import BLOCK as PREFIX_BLOCK
from server.engines.native.tuning import Tuning
from server.wiring.settings import Settings


@dataclass(frozen=True)
class EngineConfig:
    max_batch_rows: int = 32
    max_batch_tokens: int = 16384
    max_prefill_rows: int = 16
    max_queue: int = 256
    max_step_tokens: int = 256
    prefix_cache_tokens: int | None = None
    tenant_prefill_tokens: int = 32
    background_share: float = 0.2
    dtype: torch.dtype | None = None
    threads: int | None = None
    tuning: Tuning = field(default_factory=Tuning)
    caps: TenantCaps = field(default_factory=TenantCaps)

    def __post_init__(self) -> None:
        if not 0 < self.background_share <= 1:
            raise ValueError(f"background_share must be in (0, 1], got {self.background_share}")
        for name in ("max_batch_rows", "max_batch_tokens", "max_prefill_rows", "max_queue", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prefix_cache_tokens is not None and not (self.prefix_cache_tokens == 0
                                                         or self.prefix_cache_tokens >= PREFIX_BLOCK):
            raise ValueError(f"prefix_cache_tokens must be 0 (off) or at least {PREFIX_BLOCK} (one block), "
                             f"got {self.prefix_cache_tokens}")
        if self.tenant_prefill_tokens < 0:
            raise ValueError(f"tenant_prefill_tokens must be 0 (off) or more, got {self.tenant_prefill_tokens}")
        if self.max_step_tokens <= self.max_batch_rows:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must exceed max_batch_rows "
                             f"({self.max_batch_rows}): a step holds every decoding row's token and room for "
                             "prompt chunks")

    @property
    def prefix_cache_budget(self) -> int:
        """Tokens the prefix cache may hold (0: no cache)."""
        return self.max_batch_tokens if self.prefix_cache_tokens is None else self.prefix_cache_tokens

    @classmethod
    def from_settings(cls, settings: Settings, *, threads: int | None = None) -> EngineConfig:
        """The engine the POLYSERVE_* settings describe (server/wiring/settings.py)."""
        return cls(
            max_batch_rows=settings.max_batch_rows, max_batch_tokens=settings.max_batch_tokens,
            max_prefill_rows=settings.max_prefill_rows, max_queue=settings.max_queue,
            max_step_tokens=settings.max_step_tokens, prefix_cache_tokens=settings.prefix_cache_tokens,
            # a per-tenant policy: off with fairness off (the old single first-come-first-served engine)
            tenant_prefill_tokens=settings.tenant_prefill_tokens if settings.tenant_fairness else 0,
            background_share=settings.background_share,
            dtype=serving_dtype(settings.device, settings.dtype), threads=threads, tuning=settings.tuning,
            caps=tenant_caps(settings),
        )
