"""Fixtures shared by the adaptation tests (test_adapt.py, test_auto.py)."""

from __future__ import annotations

import pytest
import torch

from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.spec import InventorySpec
from adapters_store.store.records import InventoryInfo


@pytest.fixture
def inventory(tiny_model):
    """A RoutedModel with non-trivial skills (B != 0, so routing gradients are not zero)."""
    rm = RoutedModel(tiny_model, InventorySpec(n_skills=4, n_heads=2, rank=4))
    rm.reset_skills(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in rm.layers:
            layer.lora_B.normal_(0, 0.3, generator=gen)
    info = InventoryInfo(rm.spec, tuple(rm.names), tuple(rm.layer_dims()), "fp", "tiny", "v1", 0.0)
    skills = {k: v.clone() for k, v in rm.skill_tensors().items()}
    return rm, info, skills
