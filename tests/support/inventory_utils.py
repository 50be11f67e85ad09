"""A routed inventory on the tiny model whose skills all differ (B != 0), for tests of the routing math."""

from __future__ import annotations

import torch

from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.spec import InventorySpec
from adapters_store.store.records import InventoryInfo


def make_inventory(model, routing: str = "sigmoid", b_std: float = 0.5, n_skills: int = 4, n_heads: int = 2,
                   rank: int = 4) -> tuple[RoutedModel, InventoryInfo, dict[str, torch.Tensor]]:
    """(RoutedModel, its InventoryInfo, a copy of its skills); B drawn N(0, b_std) with a fixed seed, so
    routing gradients and mixes are not zero."""
    rm = RoutedModel(model, InventorySpec(n_skills=n_skills, n_heads=n_heads, rank=rank, routing=routing))
    rm.reset_skills(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in rm.layers:
            layer.lora_B.normal_(0, b_std, generator=gen)
    info = InventoryInfo(rm.spec, tuple(rm.names), tuple(rm.layer_dims()), "fp", "tiny", "v1", 0.0)
    return rm, info, {k: v.clone() for k, v in rm.skill_tensors().items()}
