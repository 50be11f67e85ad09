"""The adapter cache: L1 (in-process LRU) -> L2 (Redis, optional) -> L3 (compute from the store).

    get(record):
        key = polyserve:v1:{fingerprint}:{inventory}:{task}:{record.cache_version}
        L1 hit                                  -> adapter
        L2 hit (bytes decode)                   -> adapter, add to L1
        L2 entry that does not decode           -> counted (result="corrupt"), deleted, then L3
        L3: load routing row / LoRA, materialise -> adapter, add to L1, write L2
Concurrent misses of one key compute once (single flight). Blocking: call from a worker thread,
never from the event loop nor the engine thread.

routing_layers=False (the native engine, which combines a routed task's tables from its routing
weights straight into the row's slot: engines/native/model/slot_lora.py): a routed task's adapter holds
only its mixing weights (L, h, S), a few KB instead of every layer's materialised LoRA, so L1 holds
routing rows. They go to L2 under their own key (suffix ":w"), so a replica that needs the
materialised adapter (the vLLM engine) never finds a weights-only entry under its key. Plain-LoRA
tasks (kind "lora") are materialised in both modes.

get_mix(mix, records): a per-request mix of routed tasks (adapters_store.lora.mix) goes through the same
tiers under a key made of the mix and its members' versions ("...:mix:{digest}"); L3 sums the
members' routing weights (their own entries, L1 first), and materialises the layers only where a
task would be (routing_layers=True: one LoRA per distinct mix, as the vLLM engine needs).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Literal

import torch

from adapters_store.lora.mix import Mix, mix_weights
from adapters_store.store.contract import AdapterStore
from adapters_store.store.materialize import layers_from_weights, task_layers, task_weights
from adapters_store.store.records import InventoryInfo, TaskRecord
from server.adapter_cache import codec, signing
from server.adapter_cache.l1 import L1Cache
from server.adapter_cache.l2 import RedisTier, adapter_key
from server.adapter_cache.types import Adapter
from server.infra.metrics import Metrics

log = logging.getLogger("polyserve.cache")

EntryState = Literal["absent", "loading", "resident"]


class AdapterCache:
    def __init__(self, store: AdapterStore, info: InventoryInfo, skills: dict[str, torch.Tensor], *,
                 fingerprint: str, device: torch.device, dtype: torch.dtype, l1: L1Cache,
                 l2: RedisTier | None = None, prefix: str = "polyserve", metrics: Metrics | None = None,
                 routing_layers: bool = True, secret: bytes | None = None) -> None:
        self.store, self.info, self.fingerprint = store, info, fingerprint
        self.routing_layers = routing_layers
        self.skills = {k: v.to(device=device, dtype=torch.float32) for k, v in skills.items()}
        self.device, self.dtype = device, dtype
        self.l1, self.l2, self.prefix, self.metrics = l1, l2, prefix, metrics
        self._inflight: dict[str, Future[Adapter]] = {}
        self._lock = threading.Lock()
        # L2 entries sealed with an HMAC under this secret (signing.py); None: plain (tools, tests)
        self.secret = secret

    def key(self, record: TaskRecord) -> str:
        key = adapter_key(self.prefix, self.fingerprint, self.info.version, record.id, record.cache_version)
        return key + ":w" if self._weights_only(record) else key

    def _weights_only(self, record: TaskRecord) -> bool:
        return (record.kind or "routing") == "routing" and not self.routing_layers

    def state(self, record: TaskRecord) -> EntryState:
        key = self.key(record)
        if key in self.l1:
            return "resident"
        with self._lock:
            return "loading" if key in self._inflight else "absent"

    def _count(self, tier: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.adapter_cache.labels(tier=tier, result=result).inc()

    def get(self, record: TaskRecord) -> Adapter:
        key = self.key(record)
        kind = record.kind or "routing"
        return self._get(key, record.id, kind, not self._weights_only(record),
                         lambda: self.materialize(record, key))

    def get_mix(self, mix: Mix, records: list[TaskRecord]) -> Adapter:
        """The adapter of a mix of routed tasks (adapters_store.lora.mix): records[i] is the record of
        mix.tasks[i]. Keyed by the mix and every member's cache_version, so a changed member is a
        new key; through the same tiers as a task (L1 -> L2 -> combine from the members)."""
        if [r.id for r in records] != list(mix.tasks):
            raise ValueError("mix members and records differ")
        digest = hashlib.sha256(repr((mix.parts, [r.cache_version for r in records])).encode()).hexdigest()[:24]
        key = adapter_key(self.prefix, self.fingerprint, self.info.version, "mix", digest)
        key += "" if self.routing_layers else ":w"
        return self._get(key, mix.canonical, "routing", self.routing_layers,
                         lambda: self._materialize_mix(mix, records, key))

    def _materialize_mix(self, mix: Mix, records: list[TaskRecord], key: str) -> Adapter:
        started = time.perf_counter()
        members = [self.get(r) for r in records]
        if any(m.weights is None for m in members):
            raise ValueError("a mix member has no routing weights")
        with torch.no_grad():
            stacked = torch.stack([m.weights.to(self.device, torch.float32) for m in members])  # type: ignore[union-attr]
            weights = mix_weights(stacked, torch.tensor(mix.weights, dtype=torch.float64))
            layers = []
            if self.routing_layers:
                layers = [(a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous())
                          for a, b in layers_from_weights(self.info, self.skills, weights)]
        self._count("l3", "hit")
        if self.metrics is not None:
            self.metrics.materialize_seconds.observe(time.perf_counter() - started)
        return Adapter(mix.canonical, key, "routing", layers, weights)

    def _get(self, key: str, task: str, kind: str, layers: bool, compute: Callable[[], Adapter]) -> Adapter:
        adapter = self.l1.get(key)
        if adapter is not None:
            self._count("l1", "hit")
            return adapter
        self._count("l1", "miss")
        with self._lock:
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = self._inflight[key] = Future()
        assert future is not None
        if not owner:
            return future.result()
        try:
            adapter = self._load(key, task, kind, layers, compute)
            self.l1.add(adapter)
            future.set_result(adapter)
            return adapter
        except BaseException as err:
            future.set_exception(err)
            raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _load(self, key: str, task: str, kind: str, layers: bool, compute: Callable[[], Adapter]) -> Adapter:
        if self.l2 is not None:
            data = self.l2.get(key)
            if isinstance(data, Exception):
                self._count("l2", "error")
            elif data is None:
                self._count("l2", "miss")
            else:
                try:
                    if self.secret is not None:
                        data = signing.unseal(self.secret, key, data)
                    adapter = codec.decode(data, key, task, kind, self.info, self.device, self.dtype,
                                           layers=layers)
                    self._count("l2", "hit")
                    return adapter
                except ValueError as err:  # undecodable: a miss; drop it, recompute, overwrite
                    log.warning("dropping an undecodable L2 entry: %s", err)
                    self._count("l2", "corrupt")
                    self.l2.delete(key)
        adapter = compute()
        if self.l2 is not None:
            payload = codec.encode(adapter)
            self.l2.set(key, payload if self.secret is None else signing.seal(self.secret, key, payload))
        return adapter

    def materialize(self, record: TaskRecord, key: str | None = None) -> Adapter:
        """L3: skills + routing row (or the task's own LoRA) -> adapter on the model device."""
        started = time.perf_counter()
        kind = record.kind or "routing"
        tensors = self.store.load_weights(record)
        with torch.no_grad():
            tensors = {k: v.to(device=self.device, dtype=torch.float32) for k, v in tensors.items()}
            weights = task_weights(self.info, tensors["logits"]) if kind == "routing" else None
            layers = []
            if not self._weights_only(record):
                layers = [(a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous())
                          for a, b in task_layers(self.info, self.skills, kind, tensors)]
        adapter = Adapter(record.id, key or self.key(record), kind, layers, weights)
        self._count("l3", "hit")
        if self.metrics is not None:
            self.metrics.materialize_seconds.observe(time.perf_counter() - started)
        return adapter

    def forget(self, task: str) -> int:
        """Drop a task's L1 entries (deleted / replaced); L2 keys expire by TTL (versioned anyway)."""
        return self.l1.discard_task(task)
