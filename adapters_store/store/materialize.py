"""A stored task -> its plain per-layer LoRA (A_t, B_t). Pure over tensors loaded from the store."""

from __future__ import annotations

import torch

from adapters_store.lora.combine import materialize_many
from adapters_store.lora.routing import eval_weights, routing_weights
from adapters_store.store.records import InventoryInfo

LayerLoRA = tuple[torch.Tensor, torch.Tensor]  # A_t (d_in, r), B_t (r, d_out)


def task_weights(info: InventoryInfo, logits: torch.Tensor) -> torch.Tensor:
    """Stored routing row (L, h, S) -> inference mixing weights (L, h, S)."""
    if info.spec.routing == "hyper":
        return routing_weights(logits, "hyper")
    return eval_weights(logits)


def mu_weights(info: InventoryInfo) -> torch.Tensor:
    """μ routing (zero-shot default): every head averages all skills. (L, h, S)."""
    L, h, n_skills = len(info.layer_names), info.spec.n_heads, info.spec.n_skills
    return torch.full((L, h, n_skills), 1.0 / n_skills)


def layers_from_weights(
    info: InventoryInfo, skills: dict[str, torch.Tensor], weights: torch.Tensor
) -> list[LayerLoRA]:
    """Materialise every layer for mixing weights (L, h, S)."""
    out = []
    for layer, name in enumerate(info.layer_names):
        A_t, B_t = materialize_many(skills[f"{name}.A"], skills[f"{name}.B"], weights[layer].unsqueeze(0))
        out.append((A_t[0], B_t[0]))
    return out


def layers_from_lora(info: InventoryInfo, lora: dict[str, torch.Tensor]) -> list[LayerLoRA]:
    """A task stored as its own LoRA ("<layer>.A" (d_in, r), "<layer>.B" (r, d_out))."""
    return [(lora[f"{name}.A"], lora[f"{name}.B"]) for name in info.layer_names]


def task_layers(
    info: InventoryInfo, skills: dict[str, torch.Tensor], kind: str, tensors: dict[str, torch.Tensor]
) -> list[LayerLoRA]:
    """kind "routing" (tensors = {"logits": (L, h, S)}) or "lora" -> per-layer (A_t, B_t)."""
    if kind == "routing":
        return layers_from_weights(info, skills, task_weights(info, tensors["logits"].float()))
    if kind == "lora":
        return layers_from_lora(info, tensors)
    raise ValueError(f"unknown adapter kind {kind!r}")
