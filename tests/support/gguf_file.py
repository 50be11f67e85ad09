"""A GGUF of a tiny Llama, written by the `gguf` package's own writer as llama.cpp's converter writes
one: Q4_1 linears with q/k rows permuted, a Q8_0 embedding and LM head, a tokenizer's string arrays
in the metadata; and the READY record the backbone cache leaves, so `stored_blocks` finds it."""

from __future__ import annotations

import json

import torch

from adapters_store.backbone import gguf_blocks
from adapters_store.backbone.gguf_blocks import dequantize, quantize


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order (the inverse of what transformers' GGUF loader undoes)."""
    n = w.shape[0]
    return w.reshape(heads, 2, n // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, directory, *, alignment: int = 32):
    """The model's linears as Q4_1 blocks and its embedding and LM head as Q8_0, in a GGUF, with the
    model's weights set to what the blocks dequantise to; a READY record as the cache writes it."""
    path = directory / "model.gguf"
    cfg = model.config
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment != 32:
        writer.add_custom_alignment(alignment)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [0.5] * 300)
    writer.add_string("general.name", "tiny")

    def put(name, param, fmt, heads=0):
        q = quantize(param.data, fmt)
        param.data.copy_(dequantize(q))
        raw = q.blocks if not heads else _permute(q.blocks, heads)
        writer.add_tensor(name, raw.numpy(), raw_dtype=getattr(gguf.GGMLQuantizationType, fmt))

    for i, layer in enumerate(model.model.layers):
        for short, hf in gguf_blocks.LAYER_TENSORS.items():
            heads = (cfg.num_attention_heads if short == "attn_q" else
                     cfg.num_key_value_heads if short == "attn_k" else 0)
            put(f"blk.{i}.{short}.weight", layer.get_submodule(hf).weight, "Q4_1", heads)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight.data.numpy())
    put("token_embd.weight", model.model.embed_tokens.weight, "Q8_0")
    put("output.weight", model.lm_head.weight, "Q8_0")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (directory / "READY").write_text(json.dumps({"source": str(path)}))
    model.config._name_or_path = str(directory)
    return path
