"""The native engine's linears read from the backbone's own GGUF blocks in bf16 (quant_linear_bf16.cpp),
where the engine serves bf16: the weight kernel's bf16 build, for CPUs with AVX512_BF16.

A decode step of the default backbone is mostly its linears reading their weights: 2 bytes a weight
in bf16, 0.625 (Q4_1) or 1.06 (Q8_0) as stored. The kernel dequantises each 32-input x 16-column piece
of a weight into a tile of bf16, rounded as the bf16 model's weights were, and multiplies the rows'
bf16 activations with it in float32 sums: the bf16 model's weights and arithmetic, in one fixed
summation order per output (a row's result does not depend on the other rows of its step). It
differs from oneDNN's bf16 GEMM only in that order (the last bits of a float32 sum before its
rounding to bf16). On a CPU with AMX the tiles are AMX tiles (an AMX multiply of up to 16 rows costs
next to nothing beside the dequantising); without AMX, AVX512_BF16 dot products multiply from a tile
kept in L1. `BUILDS` has both paths where the CPU has AMX, for tests and benches.

Chosen with quant_linear.why_not (POLYSERVE_WEIGHT_KERNEL) where the engine serves bf16, and called
through quant_linear.QuantLinear, which keeps oneDNN's GEMM on the dense bf16 weight for calls of
more than MAX_ROWS rows.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from adapters_store.backbone.gguf_blocks import BLOCK, BLOCK_BYTES, QuantWeight
from adapters_store.backbone.hardware import cpu_has_avx512_bf16
from server.engines.native.kernels.cpp_kernel import CppKernel

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SOURCE = Path(__file__).with_name("quant_linear_bf16.cpp")
KERNEL = CppKernel(_SOURCE, "polyserve_quant_linear_bf16",
                   [_INT, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _PTR, _I64], _INT,
                   "bf16 quantised-weight linear", headers=(_SOURCE.with_name("panel_helper.h"),))
# the build for this CPU (AMX where it has AMX), and the one a CPU without AMX gets
BUILDS = {"native": KERNEL, "avx512_bf16": KERNEL.with_flags(("-mno-amx-tile",))}
FORMATS = {"Q4_1": 0, "Q8_0": 1}
OPS = {"none": 0, "swish": 1, "add": 2, "mul": 3}
HELPER = "polyserve_bf16_helper"  # the panel helper's entry points (panel_helper.py)
PANEL = 32  # output columns a panel of the kernel covers: a weight's out_features must divide by it
_denied: str | None = None
_granted = False  # the process holds what the kernel needs: later loads (one a linear at start-up) skip the checks


def load() -> object | None:
    """The kernel's ctypes function, built on first use, once the process holds the AMX tile state
    where the build uses AMX; None (and the reason in `error()`) where it cannot be built, loaded or
    granted."""
    global _denied, _granted
    if _granted:
        return KERNEL.load()
    if _denied is None and not cpu_has_avx512_bf16():
        _denied = "the CPU has no AVX512_BF16"  # known before a build that would fail on its #error
    if _denied is not None:
        return None
    fn = KERNEL.load()
    if fn is None:
        return None
    init = KERNEL.companion("polyserve_bf16_init").load()
    rc = -1 if init is None else init()
    if rc != 0:
        _denied = f"the kernel refused the AMX tile state (arch_prctl: {rc})"
        return None
    _granted = True
    return fn


def path() -> str | None:
    """How the loaded build multiplies: "AMX" or "AVX512_BF16" (None where it did not load)."""
    if load() is None:
        return None
    uses_amx = KERNEL.companion("polyserve_bf16_uses_amx").load()
    return None if uses_amx is None else ("AMX" if uses_amx() else "AVX512_BF16")


def error() -> str | None:
    return KERNEL.error() or KERNEL.companion("polyserve_bf16_init").error() or _denied


def tiles(weight: QuantWeight) -> torch.Tensor:
    """The blocks as the kernel reads them: for each 32 output columns, block after block of 32
    inputs, for each half of the columns the 16 rows of a tile's codes in VNNI order (row p:
    each column's codes for inputs 2p and 2p + 1; Q4_1 packs row code i in byte i's low nibble and
    code i + 16 in its high one), then the 16 columns' fp16 d, then (Q4_1) their fp16 m: the GGUF's
    bytes, regrouped so that the kernel reads a panel as one stream."""
    n, k = weight.out_features, weight.in_features
    if n % PANEL or k % BLOCK:
        raise ValueError(f"the bf16 weight kernel takes multiples of {PANEL} columns and {BLOCK} inputs, "
                         f"not {n} x {k}")
    nb, panels = k // BLOCK, n // 16
    raw = weight.blocks.view(n, nb, BLOCK_BYTES[weight.fmt])
    if weight.fmt == "Q4_1":
        codes = raw[..., 4:]
        q = torch.cat([codes & 0x0F, codes >> 4], dim=-1)  # (n, nb, 32): input j's code
        scales = [raw[..., 0:2], raw[..., 2:4]]
    else:
        q, scales = raw[..., 2:], [raw[..., 0:2]]
    # (panel, column, block, pair, 2) -> (panel, block, pair, column, 2): a tile's rows
    rows = q.reshape(panels, 16, nb, 16, 2).permute(0, 2, 3, 1, 4).reshape(panels, nb, 16, 32)
    if weight.fmt == "Q4_1":
        rows = rows[..., :16] | (rows[..., 16:] << 4)
    parts = [rows.reshape(panels, nb, -1)]
    parts += [s.reshape(panels, 16, nb, 2).permute(0, 2, 1, 3).reshape(panels, nb, 32) for s in scales]
    records = torch.cat(parts, dim=-1)  # (16-column tile, block, record)
    return records.reshape(panels // 2, 2, nb, -1).transpose(1, 2).contiguous()
