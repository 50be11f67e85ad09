"""Trainer state on disk: safetensors for tensors, JSON for everything else (never pickle).

    <store>/training/state.safetensors   skills, routing logits, AdamW moments, torch RNG states
    <store>/training/state.json          step, config, task names, Python RNG, AdamW scalars

state.json is written last and names the digest of the tensors file, so a crash between
the two writes leaves the previous, consistent pair detectable (digest mismatch -> refuse).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from adapters_store.store.atomic import atomic_write_bytes, atomic_write_json, read_json
from adapters_store.store.directory import tensors_digest

STATE_DIR = "training"


def state_paths(store_root: Path) -> tuple[Path, Path]:
    d = Path(store_root) / STATE_DIR
    return d / "state.safetensors", d / "state.json"


def has_state(store_root: Path) -> bool:
    return state_paths(store_root)[1].is_file()


def optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """AdamW state -> ({"opt.<i>.<key>": tensor}, JSON-able rest)."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"opt.{idx}.{key}"] = value
            else:
                scalars[f"{idx}.{key}"] = float(value)
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"scalars": scalars, "param_groups": groups}


def optimizer_from_flat(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("opt."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = value
    for name, value in meta["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = torch.tensor(value)
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_state(store_root: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    st_path, json_path = state_paths(store_root)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write_bytes(st_path, st_save(tensors))
    atomic_write_json(json_path, {**meta, "tensors_digest": tensors_digest(tensors)})


def load_state(store_root: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    st_path, json_path = state_paths(store_root)
    meta = read_json(json_path)
    tensors = st_load(st_path.read_bytes())
    if tensors_digest(tensors) != meta.get("tensors_digest"):
        raise RuntimeError(f"{st_path} does not match {json_path} (interrupted checkpoint?)")
    return tensors, meta


def python_rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def python_rng_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
