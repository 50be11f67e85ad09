"""Adapter <-> bytes for the Redis tier: safetensors only (never pickle), shapes checked on load."""

from __future__ import annotations

import torch
from safetensors.torch import load, save

from adapters_store.store.records import InventoryInfo
from server.adapter_cache.types import Adapter


def encode(adapter: Adapter) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    for i, (a, b) in enumerate(adapter.layers):
        tensors[f"{i}.A"] = a.detach().contiguous().cpu()
        tensors[f"{i}.B"] = b.detach().contiguous().cpu()
    if adapter.weights is not None:
        tensors["weights"] = adapter.weights.detach().contiguous().cpu()
    return save(tensors, {"key": adapter.key, "task": adapter.task, "kind": adapter.kind})


def decode(data: bytes, key: str, task: str, kind: str, info: InventoryInfo,
           device: torch.device, dtype: torch.dtype, layers: bool = True) -> Adapter:
    """Raises ValueError when the bytes are not a safetensors file (truncated, garbage: safetensors
    raises its own SafetensorError there) or do not hold this inventory's adapter shapes.
    layers=False: a routed task's weights-only entry (server/adapter_cache/cache.py) is expected."""
    try:
        tensors = load(data)
    except Exception as err:  # SafetensorError, OverflowError...: all mean undecodable
        raise ValueError(f"cached adapter {key!r}: not a safetensors file ({type(err).__name__})") from err
    r = info.spec.rank
    tables = []
    for i, (d_in, d_out) in enumerate(info.layer_dims if layers else []):
        a, b = tensors.get(f"{i}.A"), tensors.get(f"{i}.B")
        if a is None or b is None or tuple(a.shape) != (d_in, r) or tuple(b.shape) != (r, d_out):
            raise ValueError(f"cached adapter {key!r}: layer {i} missing or mis-shaped")
        tables.append((a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)))
    if len(tensors) - ("weights" in tensors) != 2 * len(tables):
        raise ValueError(f"cached adapter {key!r}: unexpected tensors")
    if not layers and "weights" not in tensors:
        raise ValueError(f"cached adapter {key!r}: routing weights missing")
    if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        raise ValueError(f"cached adapter {key!r}: non-finite values")
    weights = tensors.get("weights")
    want = (len(info.layer_names), info.spec.n_heads, info.spec.n_skills)
    if weights is not None and tuple(weights.shape) != want:
        raise ValueError(f"cached adapter {key!r}: routing weights mis-shaped")
    return Adapter(task, key, kind, tables, None if weights is None else weights.to(device))
