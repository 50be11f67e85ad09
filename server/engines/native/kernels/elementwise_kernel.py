"""A layer's RMSNorms and its rotary embedding on a CPU as one native call each (elementwise.cpp)
instead of torch ops.

torch's rms_norm is ~8 ops (casts, pow, mean, add, rsqrt, muls) and the rope a cast, a complex
view, a multiplication and a cast back. Between GEMMs that stream a layer's weights each op starts
from cold caches, so on one thread a decode step of 16 rows spent about as much on these few
thousand numbers as on its attention. The kernel does each in one pass, in float32, rounding as
transformers' Llama does (RMSNorm: normalise, round, times the weight; rope: one rounding).

On by default where it builds (POLYSERVE_ELEMENTWISE_KERNEL=auto; on = fail where it does not,
off = torch ops), built and loaded as cpp_kernel.py says. Figures: BENCHMARKS.md ("The elementwise
kernel").
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from server.engines.native.kernels.cpp_kernel import CppKernel

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_HERE = Path(__file__)
_HEADERS = (_HERE.with_name("bf16.h"),)
NORM = CppKernel(_HERE.with_name("elementwise.cpp"), "polyserve_rms_norm",
                 [_I64, _I64, _PTR, _I64, _PTR, ctypes.c_float, _PTR, _INT], _INT, "elementwise", headers=_HEADERS)
ROPE = CppKernel(_HERE.with_name("elementwise.cpp"), "polyserve_rope",
                 [_I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _INT], _INT, "elementwise", headers=_HEADERS)

DTYPES = (torch.float32, torch.bfloat16)


def why_not(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a layer's norms and rope cannot run in the kernel here (None: they can; builds it on
    first use). The switch: POLYSERVE_ELEMENTWISE_KERNEL (tuning.resolve_switch)."""
    why = ("it runs on CPUs only" if device.type != "cpu" else
           f"it takes float32/bfloat16 activations, not {dtype}" if dtype not in DTYPES else None)
    if why is None and (NORM.load() is None or ROPE.load() is None):
        why = f"the kernel is unavailable: {NORM.error() or ROPE.error()}"
    return why


def _fn(kernel: CppKernel):
    fn = kernel.load()
    if fn is None:
        raise RuntimeError(f"the elementwise kernel is unavailable: {kernel.error()}")
    return fn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, d) on the CPU, each row contiguous; weight (d,) contiguous, of x's dtype -> a new (T, d)
    tensor: x / rms(x) * weight. Called twice a layer: the checks are the few the kernel needs."""
    fn = _fn(NORM)
    rows, d = x.shape
    if x.dtype not in DTYPES or weight.dtype != x.dtype or weight.shape != (d,) or x.stride(1) != 1 \
            or not weight.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"elementwise rms_norm: x {tuple(x.shape)} {x.dtype} strides {x.stride()}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}")
    out = x.new_empty((rows, d))
    if fn(rows, d, x.data_ptr(), x.stride(0) if rows > 1 else d, weight.data_ptr(), eps, out.data_ptr(),
          x.dtype == torch.bfloat16) != 0:
        raise ValueError(f"elementwise rms_norm refused x {tuple(x.shape)}")
    return out


def rope_(qk: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, table: torch.Tensor) -> None:
    """Rotates the first `heads` heads of each row of qk (T, >= heads * head_dim; unit column stride)
    in place, each head's dims in rotary-pair order, by table[positions] ((P, head_dim / 2) complex64;
    positions (T,) int64)."""
    fn = _fn(ROPE)
    rows = qk.shape[0]
    if (qk.dim() != 2 or qk.dtype not in DTYPES or qk.shape[1] < heads * head_dim or qk.stride(1) != 1
            or table.dtype != torch.complex64 or not table.is_contiguous() or table.dim() != 2
            or table.shape[1] * 2 != head_dim or positions.dtype != torch.int64 or not positions.is_contiguous()
            or positions.shape != (rows,)):
        raise ValueError(f"elementwise rope: qk {tuple(qk.shape)} {qk.dtype}, "
                         f"table {tuple(table.shape)} {table.dtype}, "
                         f"positions {tuple(positions.shape)} {positions.dtype}")
    if fn(rows, qk.data_ptr(), qk.stride(0), heads, head_dim, positions.data_ptr(), table.data_ptr(),
          table.shape[0], int(qk.dtype == torch.bfloat16)) != 0:
        raise ValueError(f"elementwise rope refused {rows} rows: a position past the table's {table.shape[0]}")
