"""The native engine's linears read from the backbone's own GGUF blocks (quant_linear.cpp) instead of
float32 copies, on CPUs where the engine serves float32 (no AVX-512 bf16); on a CPU with AVX512_BF16,
where it serves bf16, its bf16 build does the same for bf16 copies (quant_linear_bf16.py).

A decode step of the default backbone on such a CPU is mostly the linears reading their weights
from memory: 4 bytes a weight as float32, about a sixth of that as stored (Q4_1 linears, a Q8_0 LM
head; the figures: BENCHMARKS.md, "Linears on the GGUF blocks").
The kernel dequantises a few output columns at a time into a cache-resident float32 panel, with the
same rounding as the loader (adapters_store/backbone/gguf_blocks.py, which hands over only blocks
that reproduce the model's weights bit for bit), then runs float32 FMAs: the same weights and the
same float32 arithmetic as the float32 path, in a fixed summation order per output (so a row's
result does not depend on the other rows of its step). On an AVX-512 CPU it runs 16 floats an
instruction, on an AVX2 one 8 (two paths of one source; `BUILDS` has both, for tests and benches).

POLYSERVE_WEIGHT_KERNEL: auto = where the backbone has blocks, the engine runs on a CPU and the
kernel for its dtype builds (float32: AVX2, FMA, F16C; bf16: AVX512_BF16, with AMX where the CPU has
it); on = fail where it cannot; off = dense GEMMs always. Calls of more than MAX_ROWS rows (prompt chunks longer
than the default step) keep oneDNN's GEMM, faster for many rows, on the dense copy kept for them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from adapters_store.backbone.gguf_blocks import BLOCK, BLOCK_BYTES, QuantWeight
from server.engines.native.kernels import quant_linear_bf16 as bf16
from server.engines.native.kernels.cpp_kernel import CppKernel

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SOURCE = Path(__file__).with_name("quant_linear.cpp")
KERNEL = CppKernel(_SOURCE, "polyserve_quant_linear",
                   [_INT, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _PTR, _I64], _INT,
                   "quantised-weight linear", headers=(_SOURCE.with_name("panel_helper.h"),))
# the build for this CPU, and the one a CPU without AVX-512 gets (the kernel has a path for each):
# on an AVX-512 CPU tests check both and bench/engine_ab.py compares them
BUILDS = {"native": KERNEL, "avx2": KERNEL.with_flags(("-mno-avx512f",))}
FORMATS = {"Q4_1": 0, "Q8_0": 1}
OPS = {"none": 0, "swish": 1, "add": 2, "mul": 3}
HELPER = "polyserve_quant_linear_helper"  # the panel helper's entry points (panel_helper.py)
PANEL = 12  # output columns a panel of the kernel covers
# more rows than this in one call (prompt chunks longer than the default step): oneDNN's float32
# GEMM, faster than the kernel for many rows (bench/weight_formats.py)
MAX_ROWS = 256


def load() -> object | None:
    """The kernel's ctypes function, built on first use; None (and the reason in `error()`) where it
    cannot be built or loaded."""
    return KERNEL.load()


def error() -> str | None:
    return KERNEL.error()


def why_not(device: torch.device, dtype: torch.dtype, blocks: Mapping[str, QuantWeight]) -> str | None:
    """Why the runner's linears cannot read the blocks here (None: they can; builds the kernel for
    `dtype` on first use). The switch: POLYSERVE_WEIGHT_KERNEL (tuning.resolve_switch)."""
    why = ("it runs on CPUs only" if device.type != "cpu" else
           f"it computes in float32 or bf16; the engine serves {str(dtype).removeprefix('torch.')}"
           if dtype not in (torch.float32, torch.bfloat16)
           else "the backbone has no GGUF blocks that match its weights" if not blocks else None)
    if why is None and dtype == torch.bfloat16 and bf16.load() is None:
        why = f"its bf16 build is unavailable: {bf16.error()}"
    elif why is None and dtype == torch.float32 and load() is None:
        why = f"the kernel is unavailable: {error()}"
    return why


def columns(weight: QuantWeight) -> torch.Tensor:
    """The blocks as the kernel reads them: each output column's row holds its blocks' codes, then
    their fp16 d, then (Q4_1) their fp16 m, the same bytes as the GGUF's interleaved blocks. So the
    kernel converts a column's scales a vector at a time, not two scalar conversions a block."""
    n, nb = weight.out_features, weight.in_features // BLOCK
    raw = weight.blocks.view(n, nb, BLOCK_BYTES[weight.fmt])
    parts = [raw[..., 4:], raw[..., 0:2], raw[..., 2:4]] if weight.fmt == "Q4_1" else [raw[..., 2:], raw[..., 0:2]]
    return torch.cat([part.reshape(n, -1) for part in parts], dim=1).contiguous()


class QuantLinear:
    """A frozen y = x @ W.T (+ b) with W as GGUF blocks, in float32 or bf16; the same calls as
    llama.Linear. Rows beyond `max_rows` go to `dense` (the Linear of the same weight in `dtype`)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, dense: object, max_rows: int,
                 dtype: torch.dtype = torch.float32) -> None:
        if weight.fmt not in FORMATS:
            raise ValueError(f"the weight kernel reads {sorted(FORMATS)} blocks, not {weight.fmt}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the weight kernel computes in float32 or bf16, not {dtype}")
        fn = load() if dtype == torch.float32 else bf16.load()
        if fn is None:
            raise RuntimeError("the weight kernel is unavailable: "
                               f"{error() if dtype == torch.float32 else bf16.error()}")
        self._fn: Any = fn
        self.fmt, self.dtype = weight.fmt, dtype
        # kept alive: the kernel reads it by address (not the blocks too)
        self._columns = columns(weight) if dtype == torch.float32 else bf16.tiles(weight)
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.dense = dense
        self.max_rows = max_rows
        self._fmt = FORMATS[weight.fmt]
        self._w = self._columns.data_ptr()
        self._b = 0 if self.bias is None else self.bias.data_ptr()

    def _run(self, x: torch.Tensor, op: str, other: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"weight kernel: x {tuple(x.shape)} {x.dtype}, "
                             f"wants (rows, {self.in_features}) {self.dtype}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        out = torch.empty((m, self.out_features), dtype=self.dtype)
        ptr, stride = 0, 0
        if other is not None:
            if other.shape != out.shape or other.dtype != self.dtype:
                raise ValueError(f"weight kernel: other {tuple(other.shape)} {other.dtype}, wants "
                                 f"{tuple(out.shape)} {self.dtype}")
            if other.stride(1) != 1:
                other = other.contiguous()
            ptr, stride = other.data_ptr(), other.stride(0)
        rc = self._fn(self._fmt, m, self.in_features, x.data_ptr(), x.stride(0), self._w, self.out_features,
                      self._b, out.data_ptr(), out.stride(0), OPS[op], ptr, stride)
        if rc != 0:
            raise ValueError(f"weight kernel refused {self.fmt} x {tuple(x.shape)} -> {self.out_features}")
        return out

    def __call__(self, x: torch.Tensor, act: str = "none") -> torch.Tensor:
        """act: "none" | "swish" (silu) applied to the output."""
        if x.shape[0] > self.max_rows:
            return self.dense(x, act)  # type: ignore[operator]
        return self._run(x, act, None)

    def binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """(x @ W.T + b) <op> other, op "add" | "mul" (a new tensor)."""
        if x.shape[0] > self.max_rows:
            return self.dense.binary(x, other, op)  # type: ignore[attr-defined]
        return self._run(x, op, other)
