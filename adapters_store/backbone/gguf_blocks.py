"""The quantised blocks a backbone's linears were dequantised from, so an engine can read them as
stored (0.625 or 1.06 bytes a weight) instead of as float32 (4 bytes).

The default backbone is a GGUF file (Q4_1 linears, a Q8_0 embedding tied to the LM head) that
`load.warm_default_cache` dequantises once into float32 safetensors, recording the GGUF it came
from. `stored_blocks(model)` reads that GGUF again and gives, per Hugging Face parameter name, the
blocks of every weight whose dequantisation equals the model's weight bit for bit; a weight that
differs in any bit (another file, a model changed since) is left out, so whoever uses the blocks
computes with exactly the weights the model holds.

    Q4_1: 32 weights in 20 bytes: fp16 d, fp16 m, 16 bytes of 4-bit codes (weight j in the low
          nibble of byte j, weight j + 16 in its high nibble); w = d * q + m
    Q8_0: 32 weights in 34 bytes: fp16 d, 32 int8 codes; w = d * q
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

log = logging.getLogger("polyserve.backbone")

BLOCK = 32
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
# GGUF tensor name (per layer: blk.{i}.) -> the Hugging Face Llama parameter it becomes
LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class QuantWeight:
    """An (out_features, in_features) weight as GGUF blocks: `blocks` is (out_features,
    in_features / 32 * BLOCK_BYTES[fmt]) uint8, one row of blocks per output feature."""

    fmt: str
    blocks: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])

    def rows(self, index: torch.Tensor | None) -> QuantWeight:
        """The weight with its output rows reordered (rows of blocks move whole)."""
        return self if index is None else QuantWeight(self.fmt, self.blocks[index].contiguous(), self.in_features)


def concat(weights: list[QuantWeight]) -> QuantWeight:
    """The weights' output rows one after another (a fused linear), all of one format."""
    fmts = {w.fmt for w in weights}
    ins = {w.in_features for w in weights}
    if len(fmts) != 1 or len(ins) != 1:
        raise ValueError(f"cannot fuse weights of formats {sorted(fmts)} and input sizes {sorted(ins)}")
    return QuantWeight(fmts.pop(), torch.cat([w.blocks for w in weights]).contiguous(), ins.pop())


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The float32 weight the blocks stand for, rounded as the GGUF reader rounds ((d * q) + m:
    d * q is exact in float32, so the one rounding is the addition's)."""
    n, k = weight.out_features, weight.in_features
    raw = weight.blocks.view(n, k // BLOCK, BLOCK_BYTES[weight.fmt])
    d = raw[..., 0:2].contiguous().view(torch.float16).float()
    if weight.fmt == "Q4_1":
        m = raw[..., 2:4].contiguous().view(torch.float16).float()
        qs = raw[..., 4:]
        codes = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        return (d * codes + m).reshape(n, k)
    codes = raw[..., 2:].contiguous().view(torch.int8).float()
    return (d * codes).reshape(n, k)


def quantize(weight: torch.Tensor, fmt: str) -> QuantWeight:
    """Blocks for a float weight, the way llama.cpp's reference quantiser makes them (for tests and
    benchmarks: the product only reads the blocks a GGUF stores)."""
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"format must be one of {sorted(BLOCK_BYTES)}, got {fmt!r}")
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt == "Q4_1":
        low, high = w.min(-1, keepdim=True).values, w.max(-1, keepdim=True).values
        d = ((high - low) / 15).half()
        m = low.half()
        inv = torch.where(d.float() == 0, torch.zeros_like(low), 1 / d.float())
        codes = ((w - m.float()) * inv).round().clamp(0, 15).to(torch.uint8)
        packed = codes[..., :16] | (codes[..., 16:] << 4)
        raw = torch.cat([d.view(torch.uint8), m.view(torch.uint8), packed], dim=-1)
    else:
        amax = w.abs().max(-1, keepdim=True).values
        d = (amax / 127).half()
        inv = torch.where(d.float() == 0, torch.zeros_like(amax), 1 / d.float())
        codes = (w * inv).round().clamp(-127, 127).to(torch.int8)
        raw = torch.cat([d.view(torch.uint8), codes.view(torch.uint8)], dim=-1)
    return QuantWeight(fmt, raw.reshape(n, -1).contiguous(), k)


def source_gguf(model: nn.Module) -> Path | None:
    """The GGUF a model's Hugging Face directory was dequantised from (its READY record), if any."""
    cfg: Any = getattr(model, "config", None)
    where = getattr(cfg, "_name_or_path", None) or getattr(cfg, "name_or_path", None)
    if not where:
        return None
    ready = Path(where) / "READY"
    try:
        source = json.loads(ready.read_text()).get("source")
    except (OSError, ValueError):
        return None
    return Path(source) if source and Path(source).is_file() else None


def _reverse_permute(n: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's rotary permutation of q/k (as transformers' GGUF loader
    does): HF row r is GGUF row index[r]."""
    dim = n // heads // 2
    return torch.arange(n).reshape(heads, dim, 2).transpose(1, 2).reshape(n)


# GGUF (v2, v3) metadata value types of a fixed size: type id -> bytes
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
GGML_TYPES = {3: "Q4_1", 8: "Q8_0"}  # the block formats read here (ggml type ids)


def _tensor_table(path: Path) -> dict[str, tuple[str | None, tuple[int, ...], int]]:
    """name -> (block format or None, dims as GGUF gives them (fastest first), absolute byte offset
    of its data), read from the header alone: the metadata (a tokenizer's ~100k strings) is
    skipped, not parsed into Python values."""
    with path.open("rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version}, reads 2 and 3")
        data = f.read()
    pos = 0

    def u32() -> int:
        nonlocal pos
        pos += 4
        return struct.unpack_from("<I", data, pos - 4)[0]

    def u64() -> int:
        nonlocal pos
        pos += 8
        return struct.unpack_from("<Q", data, pos - 8)[0]

    def string() -> str:
        nonlocal pos
        n = u64()
        pos += n
        return data[pos - n:pos].decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal pos
        if kind in _SCALAR_BYTES:
            pos += _SCALAR_BYTES[kind]
        elif kind == _STRING:
            n = u64()  # read first: `pos += u64()` would add to the position before the length
            pos += n
        elif kind == _ARRAY:
            inner, count = u32(), u64()
            if inner in _SCALAR_BYTES:
                pos += count * _SCALAR_BYTES[inner]
            else:
                for _ in range(count):
                    skip(inner)
        else:
            raise ValueError(f"{path}: unknown GGUF metadata type {kind}")

    alignment = 32
    for _ in range(n_kv):
        key, kind = string(), u32()
        if key == "general.alignment" and kind == 4:
            alignment = struct.unpack_from("<I", data, pos)[0]
        skip(kind)
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(u64() for _ in range(u32()))
        infos.append((name, GGML_TYPES.get(u32()), dims, u64()))
    start = 24 + pos + (-(24 + pos)) % alignment
    return {name: (fmt, dims, start + offset) for name, fmt, dims, offset in infos}


def _read_blocks(path: Path, fmt: str | None, dims: tuple[int, ...], offset: int) -> QuantWeight | None:
    if fmt is None or len(dims) != 2 or dims[0] % BLOCK:
        return None
    k, n = dims  # GGUF lists the fastest dimension first: (in_features, out_features)
    row = k // BLOCK * BLOCK_BYTES[fmt]
    raw = np.fromfile(path, dtype=np.uint8, count=n * row, offset=offset)
    if raw.size != n * row:
        raise ValueError(f"{path} ends inside a tensor")
    return QuantWeight(fmt, torch.from_numpy(raw.reshape(n, row)), k)


def frozen_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Hugging Face parameter name -> the model's tensor, with the frozen linear of every routed
    wrapper also under the name it has in the unwrapped model: a server wraps its backbone's
    adapted linears (adapters_store.lora.layer.RoutedLoRALinear keeps the frozen nn.Linear as
    `base`), so "....q_proj.weight" is then the parameter "....q_proj.base.weight"."""
    weights: dict[str, torch.Tensor] = dict(model.named_parameters())
    for name, module in model.named_modules():
        base = getattr(module, "base", None)
        if isinstance(base, nn.Linear) and f"{name}.weight" not in weights:
            weights[f"{name}.weight"] = base.weight
    return weights


def stored_blocks(model: nn.Module, gguf: Path | None = None) -> dict[str, QuantWeight]:
    """Hugging Face parameter name (e.g. "model.layers.3.mlp.up_proj.weight") -> its blocks, for
    every linear weight of a Llama model whose dequantised blocks equal the model's weight exactly,
    wrapped or not (frozen_weights). Empty when the model came from no GGUF (or the GGUF cannot be
    read)."""
    gguf = gguf or source_gguf(model)
    if gguf is None:
        return {}
    try:
        tensors = _tensor_table(gguf)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        log.warning("backbone: cannot read the blocks of %s (%s); float32 weights only", gguf, e)
        return {}
    cfg: Any = getattr(model, "config", None)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    params: Mapping[str, torch.Tensor] = frozen_weights(model)
    wanted: dict[str, tuple[str, torch.Tensor | None]] = {}
    for i in range(int(getattr(cfg, "num_hidden_layers", 0) or 0)):
        for short, hf in LAYER_TENSORS.items():
            n_heads = heads if short == "attn_q" else kv_heads if short == "attn_k" else 0
            name = f"model.layers.{i}.{hf}.weight"
            if name in params:
                perm = _reverse_permute(params[name].shape[0], n_heads) if n_heads else None
                wanted[name] = (f"blk.{i}.{short}.weight", perm)
    wanted["lm_head.weight"] = ("output.weight" if "output.weight" in tensors else "token_embd.weight", None)
    head = cast(Any, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found: dict[str, QuantWeight] = {}
    mismatched = []
    for name, (gguf_name, perm) in wanted.items():
        weight = head.weight if name == "lm_head.weight" and head is not None else params.get(name)
        entry = tensors.get(gguf_name)
        try:
            blocks = _read_blocks(gguf, *entry) if entry is not None and weight is not None else None
        except (OSError, ValueError) as e:
            log.warning("backbone: cannot read %s from %s (%s); it stays float32", gguf_name, gguf.name, e)
            continue
        if blocks is None or weight is None:
            continue
        blocks = blocks.rows(perm)
        if blocks.blocks.shape[0] == weight.shape[0] and blocks.in_features == weight.shape[1] and \
                weight.dtype == torch.float32 and torch.equal(dequantize(blocks), weight.detach().cpu()):
            found[name] = blocks
        else:
            mismatched.append(name)
    if mismatched:
        log.warning("backbone: %d weights differ from their blocks in %s (first: %s); those stay float32",
                    len(mismatched), gguf.name, mismatched[0])
    return found
