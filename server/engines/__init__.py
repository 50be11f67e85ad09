"""Engines: the data plane behind polyserve's API. `build_engine` picks one from the settings.

    native   server/engines/native: continuous batching over the in-process routed backbone
    vllm     server/engines/vllm:   vLLM's async engine with tasks materialised as LoRAs
"""

from __future__ import annotations

from typing import Any

from server.engines.base import Engine, EngineStopped, QueueFull

__all__ = ["Engine", "EngineStopped", "QueueFull", "build_engine"]


def build_engine(settings: Any, backbone: Any, routed: Any, metrics: Any) -> Engine:
    """The engine named by settings.engine, not started. backbone: adapters_store Backbone;
    routed: the RoutedModel on backbone.model (None without an inventory)."""
    if settings.engine == "native":
        from server.engines.native import packed
        from server.engines.native.engine import NativeEngine

        return NativeEngine(
            backbone.model, backbone.tokenizer, routed, max_batch_rows=settings.max_batch_rows,
            max_batch_tokens=settings.max_batch_tokens, max_prefill_rows=settings.max_prefill_rows,
            max_queue=settings.max_queue, skill_space_min_tasks=settings.skill_space_min_tasks,
            compact_min_padding=settings.compact_min_padding, prefill_padding=settings.prefill_padding,
            metrics=metrics, background_share=settings.background_share,
            packed_weights=packed.wanted(settings.packed_weights, settings.device, settings.torch_dtype),
        )
    raise ValueError(f"engine {settings.engine!r} is not available in this build (known: native)")
