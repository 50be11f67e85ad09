"""Interop with PEFT: export a task as a standard LoRA; import a PEFT Poly/MHR checkpoint.

Export (what PEFT, vLLM and LoRAX load): adapter_config.json with peft_type LORA, r, lora_alpha = 1
(PEFT's alpha/r = our 1/r), and adapter_model.safetensors with
    base_model.model.<layer>.lora_A.weight = A_t.T  (r, d_in)
    base_model.model.<layer>.lora_B.weight = B_t.T  (d_out, r)
Import: a PEFT Poly checkpoint stores per adapted layer poly_lora_A (h, S, d_in/h, r),
poly_lora_B (h, S, r, d_out/h) — our layout — and poly_router.module_logits (n_tasks, h*S).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from adapters_store.lora.combine import to_peft_lora
from adapters_store.lora.spec import InventorySpec
from adapters_store.store.atomic import atomic_write_json
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.errors import StoreError
from adapters_store.store.ids import validate_new_task_id
from adapters_store.store.materialize import task_layers
from adapters_store.store.records import InventoryInfo

PREFIX = "base_model.model."


def export_peft_lora(store: DirectoryStore, task: str, out_dir: str | Path, base_model: str = "") -> Path:
    info, skills = store.load_inventory()
    record = store.get_task(task)
    layers = task_layers(info, skills, record.kind or "", store.load_weights(record))
    provenance = {"task": task, "version": record.version, "inventory_version": info.version}
    return write_peft_lora(info, layers, out_dir, base_model=base_model, provenance=provenance)


def write_peft_lora(info: InventoryInfo, layers: list[tuple[torch.Tensor, torch.Tensor]], out_dir: str | Path,
                    *, base_model: str = "", provenance: dict[str, Any] | None = None) -> Path:
    """A materialised adapter (per layer A_t (d_in, r), B_t (r, d_out)) as a PEFT LoRA directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, (A_t, B_t) in zip(info.layer_names, layers, strict=True):
        lora_A, lora_B = to_peft_lora(A_t.float(), B_t.float())
        tensors[f"{PREFIX}{name}.lora_A.weight"] = lora_A
        tensors[f"{PREFIX}{name}.lora_B.weight"] = lora_B
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": info.spec.rank,
        "lora_alpha": 1,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": list(info.spec.target_modules),
        "base_model_name_or_path": base_model or info.backbone_name,
        "inference_mode": True,
    }
    atomic_write_json(out / "adapter_config.json", config)
    atomic_write_json(out / "polyserve.json", provenance or {})
    return out


def _task_names(n_tasks: int, mapping: str | Path | None) -> list[str]:
    if mapping is None:
        return [f"task-{i}" for i in range(n_tasks)]
    data: Any = json.loads(Path(mapping).read_text())
    names = data if isinstance(data, list) else [data[str(i)] for i in range(n_tasks)]
    if len(names) != n_tasks:
        raise StoreError(f"mapping names {len(names)} tasks, the checkpoint has {n_tasks}")
    return [validate_new_task_id(n) for n in names]


def import_peft_poly(
    src: str | Path, store: DirectoryStore, *, layer_order: list[str], backbone_fingerprint: str,
    backbone_name: str = "", mapping: str | Path | None = None, replace: bool = False,
) -> tuple[InventoryInfo, list[str]]:
    """Turn a PEFT Poly/MHR checkpoint into this store's inventory + one routing row per task.

    layer_order: the backbone's adapted linears in model order (RoutedModel.names); the
    checkpoint must adapt exactly those.
    """
    src = Path(src)
    config = json.loads((src / "adapter_config.json").read_text())
    if config.get("peft_type") != "POLY":
        raise StoreError(f"{src} is a {config.get('peft_type')!r} adapter, expected POLY")
    if store.has_inventory() and not replace:
        raise StoreError(f"{store.root} already has an inventory; pass replace=True (--replace) to overwrite")
    raw = load_file(str(src / "adapter_model.safetensors"))
    found = {k[len(PREFIX):].split(".poly_lora_A")[0] for k in raw if ".poly_lora_A" in k}
    if found != set(layer_order):
        raise StoreError(
            f"{src} adapts {len(found)} linears, the backbone's target modules are {len(layer_order)} "
            f"other ones (e.g. {sorted(found ^ set(layer_order))[:3]})"
        )
    names = list(layer_order)
    skills, logits = {}, []
    for name in names:
        A, B = raw[f"{PREFIX}{name}.poly_lora_A"], raw[f"{PREFIX}{name}.poly_lora_B"]
        skills[f"{name}.A"], skills[f"{name}.B"] = A, B
        logits.append(raw[f"{PREFIX}{name}.poly_router.module_logits"])
    h, n_skills, _, r = skills[f"{names[0]}.A"].shape
    if r != int(config["r"]) or n_skills != int(config["n_skills"]) or h != int(config.get("n_splits", 1)):
        raise StoreError("adapter_config.json disagrees with the tensors' shapes (r, n_skills, n_splits)")
    dims = [(skills[f"{n}.A"].shape[2] * h, skills[f"{n}.B"].shape[3] * h) for n in names]
    targets = config.get("target_modules") or sorted({n.rsplit(".", 1)[-1] for n in names})
    spec = InventorySpec(n_skills=n_skills, n_heads=h, rank=r, target_modules=tuple(sorted(set(targets))))
    info = store.save_inventory(
        spec, names, dims, skills, backbone_fingerprint=backbone_fingerprint, backbone_name=backbone_name,
        made_by={"method": "import-peft-poly", "source": str(src)},
    )
    table = torch.stack(logits)  # (L, n_tasks, h*S)
    task_ids = _task_names(table.shape[1], mapping)
    for t, task in enumerate(task_ids):
        store.put_routing(task, table[:, t].reshape(len(names), h, n_skills).clone(),
                          method="poly" if h == 1 else "mhr",
                          source={"imported_from": str(src), "peft_task_index": t})
    return info, task_ids
