"""vLLM LoRA resolver plugin: vLLM's own OpenAI server answers `model=<task id>` from a polyserve
store, so users keep vLLM's server, metrics and deployment stack.

    pip install polyserve into vLLM's environment (the entry point `polyserve` in the group
    `vllm.general_plugins` calls `register()` in every vLLM process), then
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server \\
        --model "$(polyserve backbone-path)" --enable-lora --max-lora-rank R

A request for a model name vLLM does not know reaches `resolve_lora(base_model, task)`:

    task id valid, task ready in the store (POLYSERVE_STORE, default $POLYSERVE_HOME/store)
    store's backbone fingerprint == the served model's (computed once from its directory)
    adapter: L2 Redis (POLYSERVE_REDIS_URL, the server's keys and codec) or computed from the
    store, then written once as a PEFT LoRA directory under $POLYSERVE_HOME/vllm-loras/
    <task>-<version>-<digest>/ -> LoRARequest(task, a stable id from that name, the directory)

A re-registered task has a new version, hence a new directory and id: vLLM never serves a stale
adapter under the old id. Anything else returns None (vLLM answers 404) and logs why.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("polyserve.vllm_resolver")
RESOLVER_NAME = "polyserve"


def lora_int_id(name: str) -> int:
    """A stable positive 31-bit id for a (task, version, digest) directory name (vLLM needs an int)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % (2**31 - 1) + 1


class StoreResolver:
    """The part that does not need vLLM: task id -> PEFT LoRA directory, or None with a reason."""

    def __init__(self, store_dir: str | Path, out_dir: str | Path, redis_url: str | None = None,
                 redis_prefix: str = "polyserve") -> None:
        from adapters_store.store import Store

        self.store = Store(store_dir)
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.redis_url, self.redis_prefix = redis_url, redis_prefix
        self._l2: Any = None
        self._served: dict[str, str | None] = {}  # served model name -> fingerprint (None: unknown)
        self._lock = threading.Lock()

    def _served_fingerprint(self, base_model: str) -> str | None:
        with self._lock:
            if base_model not in self._served:
                from adapters_store.backbone import fingerprint_hf_dir

                try:
                    self._served[base_model] = fingerprint_hf_dir(base_model) if Path(base_model).is_dir() else None
                except Exception as err:  # noqa: BLE001 - any unreadable directory: cannot verify
                    log.warning("cannot fingerprint the served model %r: %s", base_model, err)
                    self._served[base_model] = None
            return self._served[base_model]

    def resolve(self, base_model: str, task: str) -> tuple[Path, int] | str:
        """(directory, lora id) or the reason it cannot be served."""
        from adapters_store.errors import TaskNotFound
        from adapters_store.ids import validate_task_id

        try:
            validate_task_id(task)
            record = self.store.get_task(task)
        except (ValueError, TaskNotFound):
            return f"no task {task!r} in the store {self.store.root}"
        if record.status != "ready":
            return f"task {task!r} is {record.status}, not ready"
        info = self.store.inventory_info()
        served = self._served_fingerprint(base_model)
        if served is None:
            return (f"the served model {base_model!r} is not a readable Hugging Face directory, so the "
                    "store's backbone cannot be verified; serve with --model \"$(polyserve backbone-path)\"")
        if served != info.backbone_fingerprint:
            return (f"the store {self.store.root} was built for backbone {info.backbone_name or '?'} "
                    f"({info.backbone_fingerprint}), the served model is {served}")
        name = f"{task}-{record.version}-{record.digest}"
        target = self.out / name
        if not (target / "adapter_config.json").is_file():
            self._write(record, info, target, base_model)
        return target, lora_int_id(name)

    def _write(self, record: Any, info: Any, target: Path, base_model: str) -> None:
        from adapters_store.peft_io import write_peft_lora

        layers = self._layers(record, info)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        write_peft_lora(info, layers, tmp, base_model=base_model,
                        provenance={"task": record.id, "version": record.version, "inventory_version": info.version})
        try:
            os.rename(tmp, target)  # atomic; another process may have won the race: same content
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)

    def _layers(self, record: Any, info: Any) -> list:
        """The adapter from Redis (the server's key and codec) when configured, else the store."""
        import torch

        from adapters_store.materialize import task_layers
        from server.adapters import codec, signing
        from server.adapters.l2 import adapter_key

        l2 = self._redis()
        key = adapter_key(self.redis_prefix, info.backbone_fingerprint, info.version, record.id, record.cache_version)
        configured = os.environ.get("POLYSERVE_CACHE_SECRET")
        secret = signing.cache_secret(configured, getattr(self.store, "root", ""), self.store) if l2 else b""
        if l2 is not None:
            data = l2.get(key)
            if isinstance(data, bytes):
                try:
                    return codec.decode(signing.unseal(secret, key, data), key, record.id, record.kind, info,
                                        torch.device("cpu"), torch.float32).layers
                except ValueError as err:
                    log.warning("%s; recomputing", err)
        _, skills = self.store.load_inventory()
        layers = task_layers(info, {k: v.float() for k, v in skills.items()}, record.kind or "",
                             self.store.load_weights(record))
        if l2 is not None:
            from server.adapters.types import Adapter

            l2.set(key, signing.seal(secret, key, codec.encode(Adapter(record.id, key, record.kind or "", layers))))
        return layers

    def _redis(self) -> Any:
        if not self.redis_url:
            return None
        if self._l2 is None:
            from server.adapters.breaker import CircuitBreaker
            from server.adapters.l2 import RedisTier

            self._l2 = RedisTier(self.redis_url, ttl_seconds=24 * 3600, socket_timeout=0.5, connect_timeout=0.5,
                                 breaker=CircuitBreaker(3, 10.0))
        return self._l2


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
    from adapters_store.home import default_store, polyserve_home

    store = default_store()
    inner = StoreResolver(store, polyserve_home() / "vllm-loras", os.environ.get("POLYSERVE_REDIS_URL") or None,
                          os.environ.get("POLYSERVE_REDIS_PREFIX", "polyserve"))
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, _resolver_class()(inner))
    log.info("polyserve LoRA resolver registered for the store %s", store)
