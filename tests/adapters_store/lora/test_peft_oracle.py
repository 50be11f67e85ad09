"""PEFT's Poly model is the oracle for our routed forward (tiny Llama, fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.routing import eval_weights
from adapters_store.lora.spec import InventorySpec

peft = pytest.importorskip("peft", reason="PEFT is the test oracle (pip install -e .[test])")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
N_TASKS, N_SKILLS, RANK = 3, 4, 4


def peft_poly(base: torch.nn.Module, h: int):
    config = peft.PolyConfig(
        task_type="CAUSAL_LM", r=RANK, n_tasks=N_TASKS, n_skills=N_SKILLS, n_splits=h,
        target_modules=TARGETS, init_weights=False,  # B random, so the adapters matter
    )
    torch.manual_seed(h)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # routers start near 0; make them distinct per task
        for module in model.modules():
            if hasattr(module, "poly_router") and "default" in module.poly_router:
                module.poly_router["default"].module_logits.normal_(0, 2)
    return model.eval()


def ours_from_peft(base: torch.nn.Module, pm, h: int) -> tuple[RoutedModel, torch.Tensor]:
    """Our RoutedModel with PEFT's skills; returns it and the routing logits (n_tasks, L, h, S)."""
    routed = RoutedModel(copy.deepcopy(base), InventorySpec(n_skills=N_SKILLS, n_heads=h, rank=RANK))
    peft_layers = {n[len("base_model.model."):]: m for n, m in pm.named_modules() if hasattr(m, "poly_lora_A")}
    logits = []
    with torch.no_grad():
        for name, layer in zip(routed.names, routed.layers, strict=True):
            src = peft_layers[name]
            layer.lora_A.copy_(src.poly_lora_A["default"])
            layer.lora_B.copy_(src.poly_lora_B["default"])
            logits.append(src.poly_router["default"].module_logits.view(N_TASKS, h, N_SKILLS))
    return routed, torch.stack(logits, dim=1)


@pytest.mark.parametrize("h", [1, 4])
def test_routed_forward_equals_peft_poly(tiny_base, h):
    pm = peft_poly(tiny_base, h)
    routed, logits = ours_from_peft(tiny_base, pm, h)
    input_ids = torch.randint(0, 250, (6, 7), generator=torch.Generator().manual_seed(0))
    task_ids = torch.tensor([0, 1, 2, 2, 1, 0])
    with torch.no_grad():
        expected = pm(input_ids=input_ids, task_ids=task_ids).logits
        weights = eval_weights(logits[task_ids]).transpose(0, 1)  # (L, N, h, S)
        routed.set_weights(weights)
        got = routed.model(input_ids=input_ids).logits
        base_logits = tiny_base(input_ids=input_ids).logits
    assert (expected - base_logits).abs().max() > 1e-3, "adapters must change the output for the test to mean anything"
    assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_exported_lora_loaded_by_peft_equals_our_task(tiny_base, tmp_path):
    from adapters_store.backbone.load import fingerprint
    from adapters_store.interop.peft_io import export_peft_lora, import_peft_poly
    from adapters_store.store.directory import DirectoryStore

    h = 4
    pm = peft_poly(tiny_base, h)
    pm.save_pretrained(tmp_path / "poly")
    routed, _logits = ours_from_peft(tiny_base, pm, h)
    store = DirectoryStore(tmp_path / "store")
    _, tasks = import_peft_poly(
        tmp_path / "poly", store, layer_order=routed.names, backbone_fingerprint=fingerprint(tiny_base)
    )
    assert tasks == ["task-0", "task-1", "task-2"]
    export_peft_lora(store, "task-1", tmp_path / "lora")
    lora_model = peft.PeftModel.from_pretrained(copy.deepcopy(tiny_base), tmp_path / "lora").eval()
    input_ids = torch.randint(0, 250, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = pm(input_ids=input_ids, task_ids=torch.tensor([1, 1])).logits
        got = lora_model(input_ids=input_ids).logits
    assert_close(got, expected, rtol=1e-5, atol=1e-5)
