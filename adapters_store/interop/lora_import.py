"""Bring your own LoRA: a PEFT LoRA (adapter_config + safetensors) -> a plain-LoRA task of the store.

What is accepted: peft_type LORA for this store's backbone (base_model_name_or_path names it),
adapting a subset of the inventory's linears (its target modules) with the shapes the backbone
has, rank r <= the inventory's rank R, no DoRA, no modules_to_save, no bias, no per-module rank
or alpha patterns, no fan_in_fan_out. Everything else is refused with ImportRefused naming why.

Conversion (PEFT: y += dropout(x) @ lora_A.T @ lora_B.T * s, s = alpha / r, or alpha / sqrt(r)
with use_rslora; the store: y += x @ A_t @ B_t / R, every task at the inventory's rank R):

    A_t = [lora_A.T | 0]             (d_in, R)    rank r padded with zero columns
    B_t = [lora_B.T * s * R ; 0]     (R, d_out)   so that A_t @ B_t / R = lora_A.T @ lora_B.T * s
    a linear the LoRA does not adapt: A_t = 0, B_t = 0

An exported routed task (peft_io.write_peft_lora: r = R, alpha = 1, s = 1/R) comes back exactly.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from adapters_store.store.records import InventoryInfo

PREFIXES = ("base_model.model.",)
SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_A.default.weight": "A",
            ".lora_B.default.weight": "B"}


class ImportRefused(ValueError):
    """The LoRA cannot be served as a task of this store (the message says why)."""


def _norm(name: str) -> str:
    return Path(str(name).rstrip("/")).name.lower()


def check_base_model(config: dict[str, Any], info: InventoryInfo, aliases: tuple[str, ...] = ()) -> None:
    """base_model_name_or_path must name the store's backbone (its name, a path or hub id ending in
    it, or one of `aliases`, e.g. the default backbone's local directory)."""
    name = config.get("base_model_name_or_path")
    if not name or not isinstance(name, str):
        raise ImportRefused("wrong base model: adapter_config.base_model_name_or_path is missing; it must name "
                            f"the backbone {info.backbone_name!r}")
    accepted = {_norm(info.backbone_name), *(_norm(a) for a in aliases)}
    if _norm(name) not in accepted and name not in aliases:
        raise ImportRefused(f"wrong base model: the LoRA is for {name[:120]!r}, this store serves "
                            f"the backbone {info.backbone_name!r}")


def check_config(config: dict[str, Any], info: InventoryInfo) -> float:
    """Refuse what the engines cannot serve; returns PEFT's scaling s."""
    if config.get("peft_type") != "LORA":
        raise ImportRefused(f"adapter_config.peft_type: {str(config.get('peft_type'))[:32]!r} is not LORA")
    if config.get("use_dora"):
        raise ImportRefused("DoRA (use_dora) is not supported: only plain LoRA weights are served")
    if config.get("modules_to_save"):
        raise ImportRefused("modules_to_save is not supported: the task would replace whole modules")
    if config.get("bias", "none") not in (None, "none"):
        raise ImportRefused(f"bias {str(config.get('bias'))[:16]!r} is not supported: only bias 'none'")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ImportRefused("rank_pattern / alpha_pattern are not supported: one rank and alpha for every module")
    if config.get("fan_in_fan_out"):
        raise ImportRefused("fan_in_fan_out (Conv1D layers) is not supported")
    if config.get("layers_to_transform") or config.get("layers_pattern"):
        raise ImportRefused("layers_to_transform / layers_pattern are not supported")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise ImportRefused("adapter_config.r: must be a positive integer")
    if r > info.spec.rank:
        raise ImportRefused(f"rank {r} is above the limit: this inventory serves ranks up to {info.spec.rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise ImportRefused("adapter_config.lora_alpha: must be a positive number")
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def _split_key(key: str) -> tuple[str, str]:
    """'base_model.model.<layer>.lora_A.weight' -> (layer, 'A')."""
    body = key
    for prefix in PREFIXES:
        body = body.removeprefix(prefix)
    for suffix, which in SUFFIXES.items():
        if body.endswith(suffix):
            return body[: -len(suffix)], which
    raise ImportRefused(f"tensor {key[:120]!r} is not a LoRA A/B weight of a linear (unsupported target)")


def convert(config: dict[str, Any], tensors: dict[str, torch.Tensor], info: InventoryInfo,
            aliases: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The store's plain-LoRA tensors ("<layer>.A" (d_in, R), "<layer>.B" (R, d_out)) of a PEFT
    LoRA, or ImportRefused."""
    check_base_model(config, info, aliases)
    scaling = check_config(config, info)
    r, R = int(config["r"]), info.spec.rank
    dims = dict(zip(info.layer_names, info.layer_dims, strict=True))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        layer, which = _split_key(key)
        if layer not in dims:
            raise ImportRefused(f"unsupported target: {layer[:120]!r} is not one of the inventory's adapted "
                                f"linears (target modules {', '.join(info.spec.target_modules)})")
        pairs.setdefault(layer, {})[which] = value
    if not pairs:
        raise ImportRefused("the adapter holds no LoRA weights")
    out: dict[str, torch.Tensor] = {}
    for layer, (d_in, d_out) in dims.items():
        A_t, B_t = torch.zeros(d_in, R), torch.zeros(R, d_out)
        if layer in pairs:
            pair = pairs[layer]
            if set(pair) != {"A", "B"}:
                raise ImportRefused(f"layer {layer!r}: lora_A and lora_B must both be present")
            a, b = pair["A"].float(), pair["B"].float()
            if tuple(a.shape) != (r, d_in) or tuple(b.shape) != (d_out, r):
                raise ImportRefused(f"layer {layer!r}: shapes {tuple(a.shape)}, {tuple(b.shape)} are not "
                                    f"({r}, {d_in}), ({d_out}, {r}) (another base model, or another rank)")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ImportRefused(f"layer {layer!r}: non-finite weights")
            A_t[:, :r] = a.T
            B_t[:r] = b.T * (scaling * R)
        out[f"{layer}.A"], out[f"{layer}.B"] = A_t, B_t
    return out


def read_dir(src: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """adapter_config.json and adapter_model.safetensors of a PEFT directory (never pickle)."""
    import json

    from safetensors.torch import load_file

    src = Path(src)
    config_path, weights_path = src / "adapter_config.json", src / "adapter_model.safetensors"
    if not config_path.is_file():
        raise ImportRefused(f"{src}: no adapter_config.json")
    if not weights_path.is_file():
        raise ImportRefused(f"{src}: no adapter_model.safetensors (a .bin checkpoint is never loaded)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as err:
        raise ImportRefused(f"{config_path}: not JSON ({err})") from None
    if not isinstance(config, dict):
        raise ImportRefused(f"{config_path}: not a JSON object")
    return config, load_file(str(weights_path))


def backbone_aliases(info: InventoryInfo) -> tuple[str, ...]:
    """Other names a LoRA may give this store's backbone: for the embedded default, the local
    directory `polyserve backbone-path` prints (what `polyserve export` writes) and its cache name."""
    from adapters_store.backbone.load import DEFAULT_CACHE_NAME, DEFAULT_NAME, default_hf_dir

    if info.backbone_name != DEFAULT_NAME:
        return ()
    return (str(default_hf_dir()), DEFAULT_CACHE_NAME)


def import_lora(store, task: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], *,
                source: dict[str, Any] | None = None, method: str = "lora-import", owner: str | None = None,
                shared: bool = False, max_tasks: int | None = None):
    """Register the LoRA as the plain-LoRA task `task` (a new id); returns its TaskRecord.
    `owner`/`shared`: who may see it (None: everyone, as for shipped tasks), written with the
    placeholder the weights then replace, so the task is never visible to others in between.
    Raises ImportRefused, ValueError (bad id), TaskExists, TaskLimit (`max_tasks` reached)."""
    import time

    from adapters_store.store.errors import TaskExists, TaskLimit
    from adapters_store.store.ids import validate_new_task_id
    from adapters_store.store.records import TaskRecord

    validate_new_task_id(task)
    info = store.inventory_info()
    lora = convert(config, tensors, info, backbone_aliases(info))
    with store.task_lock(task):
        if store.has_task(task):
            raise TaskExists(f"task {task!r} already exists")
        if max_tasks is not None and len(store.task_stamps()) >= max_tasks:
            raise TaskLimit(f"this store already holds {max_tasks} tasks (POLYSERVE_MAX_TASKS); delete one first")
        meta = {"peft_r": int(config["r"]), "peft_alpha": config.get("lora_alpha", 8),
                "base_model": str(config.get("base_model_name_or_path"))[:200], **(source or {})}
        if owner is not None or shared:
            now = time.time()
            store.put_record(TaskRecord(id=task, method=method, status="training", version=0, created_at=now,
                                        updated_at=now, owner=owner, shared=shared))
        return store.put_lora(task, lora, method=method, source=meta)
