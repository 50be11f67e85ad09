"""Which engine a server runs: `build_engine` picks one from the settings (POLYSERVE_ENGINE).

    native   server/engines/native: continuous batching over the in-process routed backbone
    vllm     server/engines/vllm:   vLLM's async engine with tasks materialised as LoRAs
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.engines.base import Engine
from server.engines.dtype import dtype_name, serving_dtype
from server.engines.fair import tenant_caps

if TYPE_CHECKING:
    from adapters_store.backbone.load import Backbone
    from adapters_store.lora.inject import RoutedModel
    from adapters_store.store.records import InventoryInfo
    from server.infra.metrics import Metrics
    from server.wiring.settings import Settings


def build_engine(settings: Settings, backbone: Backbone, routed: RoutedModel | None, metrics: Metrics,
                 inventory: InventoryInfo | None = None,
                 threads: int | None = None) -> Engine:
    """The engine named by settings.engine, not started. backbone: adapters_store Backbone;
    routed: the RoutedModel on backbone.model (None without an inventory); inventory: its
    InventoryInfo (the vLLM engine writes tasks as PEFT LoRAs of that shape)."""
    if settings.engine == "native":
        from server.engines.native.config import EngineConfig
        from server.engines.native.core.engine import NativeEngine

        return NativeEngine(backbone.model, backbone.tokenizer, routed,
                            EngineConfig.from_settings(settings, threads=threads), metrics=metrics)
    if settings.engine == "vllm":
        return _vllm_engine(settings, backbone, metrics, inventory)
    raise ValueError(f"unknown engine {settings.engine!r} (known: native, vllm)")


def _vllm_engine(settings: Settings, backbone: Backbone, metrics: Metrics, inventory: InventoryInfo | None) -> Engine:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise RuntimeError("POLYSERVE_ENGINE=vllm needs vLLM in this environment: pip install -e '.[vllm]' "
                           f"(make vllm-env builds one); import failed: {err}") from None
    import os

    import torch

    from adapters_store.backbone.load import hf_dir
    from server.engines.vllm.engine import VllmEngine

    # adaptation jobs run in this process on the Hugging Face copy, beside vLLM's workers: a bounded
    # share of the threads (background_share of them, at least one)
    threads = settings.threads or torch.get_num_threads() or os.cpu_count() or 1
    return VllmEngine(
        str(hf_dir(settings.backbone)), backbone.tokenizer, lora_root=str(settings.home / "vllm-loras"),
        inventory=inventory, max_batch_rows=settings.max_batch_rows, max_batch_tokens=settings.max_batch_tokens,
        max_queue=settings.max_queue, dtype=dtype_name(serving_dtype(settings.device, settings.dtype)),
        metrics=metrics, extra_args=settings.vllm_args,
        background_threads=max(1, round(threads * settings.background_share)),
        max_model_len=min(settings.max_batch_tokens,
                          int(getattr(backbone.model.config, "max_position_embeddings", 0)
                              or settings.max_batch_tokens)),
        caps=tenant_caps(settings),
    )
