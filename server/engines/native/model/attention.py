"""Attention of a flat step batch over the slot KV cache (one layer). Pure apart from the writes.

    write k, v of every item at its slot's positions start .. end - 1
    decode group (n one-token items, step.StepBatch.decode):
        kernel (CPU, attention_kernel.py): each row's k, v written and its own slot's positions
                read in place, one call
        SDPA:   q (n, kv_heads, rep, hd)  x  K[slots, :, :L]   masked by each row's length
                (grouped-query attention folded into the query length: the rep query heads that
                share a kv head are that head's "queries"; no copy of K/V per query head)
    each chunk: causal SDPA of its c queries over its slot's first start + c positions

On CUDA a dynamic step's SDPA calls run without cuDNN's attention (cuda_backends): cuDNN builds
a plan per new shape, and a dynamic step's shapes are new every step (the decode group's mask
width grows by one, each chunk has its own length), so its planning cost CPU time on every call
(BENCHMARKS.md, "The native engine on a GPU"). The captured static steps keep torch's choice:
their shapes are fixed per bucket.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from server.engines.native.core.step import StepBatch
from server.engines.native.kernels.attention_kernel import decode_attention

# the backends a dynamic step may use on CUDA (torch still picks among them per call): all but cuDNN's
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cuda_backends(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The SDPA backends for a dynamic step's attention on device (no restriction off CUDA)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(CUDA_BACKENDS)


def slot_attention(K: torch.Tensor, V: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   batch: StepBatch, scale: float | None = None, kernel: bool = False) -> torch.Tensor:
    """K, V (slots, kv_heads, capacity, hd) of this layer; q (T, heads, hd), k/v (T, kv_heads, hd)
    of the batch's flat tokens -> attention output (T, heads * hd). kernel: the decode group in
    the native kernel (the caller has checked it loads: attention_kernel.why_not)."""
    T, heads, hd = q.shape
    kvh = k.shape[1]
    out = q.new_empty((T, heads * hd))
    n = batch.n_decode
    if n:
        slots, mask = batch.decode_slots_t, batch.decode_mask
        assert slots is not None and mask is not None
        width = mask.shape[-1]
        if kernel:  # the kernel writes each row's k, v at its position, then attends
            assert batch.decode_ends_t is not None
            if width > K.shape[2] or batch.decode_slots[-1] >= K.shape[0]:  # the kernel reads by address
                raise ValueError(f"decode rows up to slot {batch.decode_slots[-1]}, {width} positions: "
                                 f"past the KV cache {tuple(K.shape)}")
            decode_attention(q[:n], K, V, slots, batch.decode_ends_t, hd**-0.5 if scale is None else scale, out[:n],
                             k[:n], v[:n])
        else:
            pos = batch.positions[:n]
            K[slots, :, pos] = k[:n]
            V[slots, :, pos] = v[:n]
            if batch.decode_contiguous:
                keys, values = K[:n, :, :width], V[:n, :, :width]
            else:
                keys, values = K[:, :, :width].index_select(0, slots), V[:, :, :width].index_select(0, slots)
            att = F.scaled_dot_product_attention(q[:n].reshape(n, kvh, heads // kvh, hd), keys, values,
                                                 attn_mask=mask, scale=scale)
            out[:n] = att.reshape(n, heads * hd)
    for chunk in batch.chunks:
        it, a, b = chunk.item, chunk.offset, chunk.offset + len(chunk.item.tokens)
        K[it.slot, :, it.start : it.end] = k[a:b].transpose(0, 1)
        V[it.slot, :, it.start : it.end] = v[a:b].transpose(0, 1)
        keys, values = K[it.slot : it.slot + 1, :, : it.end], V[it.slot : it.slot + 1, :, : it.end]
        att = F.scaled_dot_product_attention(q[a:b].transpose(0, 1).unsqueeze(0), keys, values, attn_mask=chunk.mask,
                                             is_causal=chunk.mask is None, enable_gqa=kvh != heads, scale=scale)
        out[a:b] = att[0].transpose(0, 1).reshape(b - a, heads * hd)
    return out
