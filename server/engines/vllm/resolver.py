"""vLLM LoRA resolver plugin: vLLM's own OpenAI server answers `model=<task id>` from a polyserve
store, so users keep vLLM's server, metrics and deployment stack.

    pip install polyserve into vLLM's environment (the entry point `polyserve` in the group
    `vllm.general_plugins` calls `register()` in every vLLM process), then
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server \\
        --model "$(polyserve backbone-path)" --enable-lora --max-lora-rank R

A request for a model name vLLM does not know reaches `resolve_lora(base_model, task)`:

    task id valid, task ready in the store (POLYSERVE_STORE, default $POLYSERVE_HOME/store)
    store's backbone fingerprint == the served model's (computed once from its directory)
    adapter: the server's cache tiers (L1, L2 Redis at POLYSERVE_REDIS_URL with the server's keys,
    codec and seal, else computed from the store), then written once as a PEFT LoRA directory under
    $POLYSERVE_HOME/vllm-loras/<task>-<key digest>/ -> LoRARequest(task, a stable id, the directory)

A re-registered task has a new version, hence a new directory and id: vLLM never serves a stale
adapter under the old id. Anything else returns None (vLLM answers 404) and logs why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Any

from server.engines.vllm.lora_dirs import LoraDirectories

log = logging.getLogger("polyserve.vllm_resolver")
RESOLVER_NAME = "polyserve"
# The resolver's own L1: a few materialised adapters (vLLM keeps the loaded ones itself).
L1_BYTES = 256 * 2**20


class StoreResolver:
    """The part that does not need vLLM: task id -> PEFT LoRA directory, or None with a reason.

    The adapter comes through the server's own cache tiers (server/adapter_cache: L1, Redis with
    the server's keys, codec and seal, then the store) and is written by the vLLM engine's own
    PEFT-directory writer (lora_dirs.py), so the plugin and `POLYSERVE_ENGINE=vllm` serve the same
    bytes under the same rules."""

    def __init__(self, store: str | Path, out_dir: str | Path, redis_url: str | None = None,
                 redis_prefix: str = "polyserve", *, cache_dir: str | Path | None = None) -> None:
        from adapters_store.store import open_store

        self.store = open_store(store, cache_dir=cache_dir)
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.redis_url, self.redis_prefix = redis_url, redis_prefix
        self._cache: Any = None
        self._dirs: dict[str, LoraDirectories] = {}  # served model name -> its directories
        self._served: dict[str, str | None] = {}  # served model name -> fingerprint (None: unknown)
        self._lock = threading.Lock()

    def _served_fingerprint(self, base_model: str) -> str | None:
        with self._lock:
            if base_model not in self._served:
                from adapters_store.backbone.load import fingerprint_hf_dir

                try:
                    self._served[base_model] = fingerprint_hf_dir(base_model) if Path(base_model).is_dir() else None
                except Exception as err:  # noqa: BLE001 - any unreadable directory: cannot verify
                    log.warning("cannot fingerprint the served model %r: %s", base_model, err)
                    self._served[base_model] = None
            return self._served[base_model]

    def resolve(self, base_model: str, task: str) -> tuple[Path, int] | str:
        """(directory, lora id) or the reason it cannot be served."""
        from adapters_store.store.errors import TaskNotFound
        from adapters_store.store.ids import validate_task_id

        try:
            validate_task_id(task)
            record = self.store.get_task(task)
        except (ValueError, TaskNotFound):
            return f"no task {task!r} in the store {self.store.location}"
        if record.status != "ready":
            return f"task {task!r} is {record.status}, not ready"
        info = self.store.inventory_info()
        served = self._served_fingerprint(base_model)
        if served is None:
            return (f"the served model {base_model!r} is not a readable Hugging Face directory, so the "
                    "store's backbone cannot be verified; serve with --model \"$(polyserve backbone-path)\"")
        if served != info.backbone_fingerprint:
            return (f"the store {self.store.location} was built for backbone {info.backbone_name or '?'} "
                    f"({info.backbone_fingerprint}), the served model is {served}")
        adapter = self._adapter_cache().get(record)
        with self._lock:
            dirs = self._dirs.get(base_model)
            if dirs is None:
                dirs = self._dirs[base_model] = LoraDirectories(self.out, info, base_model)
        _, lora_id, path = dirs.ensure(adapter)
        return path, lora_id

    def _adapter_cache(self) -> Any:
        """The server's cache tiers over this store, built on first use (the skills load once)."""
        with self._lock:
            if self._cache is None:
                import torch

                from server.adapter_cache.breaker import CircuitBreaker
                from server.adapter_cache.cache import AdapterCache
                from server.adapter_cache.l1 import L1Cache
                from server.adapter_cache.l2 import RedisTier
                from server.adapter_cache.signing import cache_secret

                info, skills = self.store.load_inventory()
                l2 = None
                if self.redis_url:
                    l2 = RedisTier(self.redis_url, ttl_seconds=24 * 3600, socket_timeout=0.5, connect_timeout=0.5,
                                   breaker=CircuitBreaker(3, 10.0))
                secret = cache_secret(os.environ.get("POLYSERVE_CACHE_SECRET"), self.store) if l2 else None
                self._cache = AdapterCache(self.store, info, skills, fingerprint=info.backbone_fingerprint,
                                           device=torch.device("cpu"), dtype=torch.float32, l1=L1Cache(L1_BYTES),
                                           l2=l2, prefix=self.redis_prefix, routing_layers=True, secret=secret)
            return self._cache


def _resolver_class() -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class PolyserveResolver(LoRAResolver):
        def __init__(self, inner: StoreResolver) -> None:
            self.inner = inner

        async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
            found = await asyncio.to_thread(self.inner.resolve, base_model_name, lora_name)
            if isinstance(found, str):
                log.warning("polyserve resolver: %s", found)
                return None
            path, lora_id = found
            return LoRARequest(lora_name=lora_name, lora_int_id=lora_id, lora_path=str(path))

    return PolyserveResolver


def register() -> None:
    """The `vllm.general_plugins` entry point (vLLM may call it more than once per process)."""
    from vllm.lora.resolver import LoRAResolverRegistry

    if RESOLVER_NAME in LoRAResolverRegistry.get_supported_resolvers():
        return
    from adapters_store.backbone.home import default_store, polyserve_home

    store = default_store()
    inner = StoreResolver(store, polyserve_home() / "vllm-loras", os.environ.get("POLYSERVE_REDIS_URL") or None,
                          os.environ.get("POLYSERVE_REDIS_PREFIX", "polyserve"),
                          cache_dir=polyserve_home() / "inventories")
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, _resolver_class()(inner))
    log.info("polyserve LoRA resolver registered for the store %s", store)
