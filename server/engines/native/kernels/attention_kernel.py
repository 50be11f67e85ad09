"""The decode group's attention on a CPU as one native call per layer (decode_attention.cpp)
instead of torch's SDPA over gathered, padded slots.

SDPA needs the rows' keys and values as one (n, kv_heads, L, hd) batch: when the decode rows'
slots are not 0..n-1 that is a gather of every row's cache up to the longest row, and every row
is padded to the longest and masked. Its CPU flash kernel then runs a small GEMM per block of
positions. The kernel reads each row's own slot in place, only its own positions, with the
query heads that share a kv head together; float32 sums whatever the storage. Rows are
independent: a row's output is the same in any batch.

On by default where it builds (POLYSERVE_ATTENTION_KERNEL=auto; on = fail where it does not,
off = SDPA always), built and loaded as cpp_kernel.py says. Figures: BENCHMARKS.md ("The
long-prompt flood").
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from server.engines.native.kernels.cpp_kernel import CppKernel

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGTYPES = [_I64, _PTR, _I64, _INT, _PTR, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64,
             ctypes.c_float, _PTR, _INT, _PTR, _PTR, _I64, _I64]

KERNEL = CppKernel(Path(__file__).with_name("decode_attention.cpp"), "polyserve_decode_attention", _ARGTYPES,
                   ctypes.c_int, "decode attention", headers=(Path(__file__).with_name("bf16.h"),))

DTYPES = (torch.float32, torch.bfloat16)
MAX_REP, MAX_HEAD_DIM = 16, 256  # as decode_attention.cpp


def why_not(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the decode group's attention cannot run in the kernel here (None: it can; builds it on
    first use). The switch: POLYSERVE_ATTENTION_KERNEL (tuning.resolve_switch)."""
    rep = heads // kv_heads
    why = ("it runs on CPUs only" if device.type != "cpu" else
           f"it takes a float32/bfloat16 KV cache, not {dtype}" if dtype not in DTYPES else
           f"it takes up to {MAX_REP} query heads per kv head, not {rep}" if rep > MAX_REP else
           f"it takes head dims up to {MAX_HEAD_DIM}, not {head_dim}" if head_dim > MAX_HEAD_DIM else None)
    if why is None and KERNEL.load() is None:
        why = f"the kernel is unavailable: {KERNEL.error()}"
    return why


def decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, slots: torch.Tensor, ends: torch.Tensor,
                     scale: float, out: torch.Tensor, k: torch.Tensor | None = None,
                     v: torch.Tensor | None = None) -> None:
    """q (n, heads, hd), each row's heads contiguous (rows may be apart: a view of a wider row);
    K, V (slots, kv_heads, capacity, hd) of one layer; slots, ends (n,) int64: row i attends to
    K[slot[i], :, :ends[i]]. k, v (n, kv_heads, hd), as q, in the cache's dtype: each row's new key
    and value, written at position ends[i] - 1 first (None: K and V already hold them).
    Writes out (n, heads * hd), of q's dtype; query head h reads kv head h // (heads / kv_heads)."""
    fn = KERNEL.load()
    if fn is None:
        raise RuntimeError(f"the decode attention kernel is unavailable: {KERNEL.error()}")
    n, heads, hd = q.shape
    kvh = K.shape[1]
    if (K.shape != V.shape or K.stride() != V.stride() or K.stride(-1) != 1 or K.dtype != V.dtype
            or K.dtype not in DTYPES or q.dtype not in DTYPES or out.dtype != q.dtype or K.shape[-1] != hd
            or heads % kvh or not _rows_of(q, heads * hd) or not out.is_contiguous() or out.shape != (n, heads * hd)):
        raise ValueError(f"decode attention kernel: q {tuple(q.shape)} {q.dtype}, K/V {tuple(K.shape)} {K.dtype}, "
                         f"out {tuple(out.shape)} {out.dtype}")
    if (k is None) != (v is None) or (k is not None and v is not None and (
            k.shape != (n, kvh, hd) or v.shape != k.shape or k.dtype != K.dtype or v.dtype != K.dtype
            or not _rows_of(k, kvh * hd) or not _rows_of(v, kvh * hd))):
        raise ValueError(f"decode attention kernel: new keys/values must be ({n}, {kvh}, {hd}) of {K.dtype}, "
                         f"rows of contiguous heads")
    for t in (slots, ends):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (n,):
            raise ValueError("slots and ends must be contiguous int64 tensors with an entry per row")
    if n == 0:
        return
    rc = fn(n, q.data_ptr(), q.stride(0) if n > 1 else heads * hd, int(q.dtype == torch.bfloat16),
            K.data_ptr(), V.data_ptr(), int(K.dtype == torch.bfloat16), slots.data_ptr(), ends.data_ptr(),
            K.stride(0), K.stride(1), K.stride(2),
            kvh, heads // kvh, hd, scale, out.data_ptr(), int(out.dtype == torch.bfloat16),
            None if k is None else k.data_ptr(), None if v is None else v.data_ptr(),
            _row_stride(k, kvh * hd), _row_stride(v, kvh * hd))
    if rc != 0:
        raise ValueError(f"decode attention kernel refused q {tuple(q.shape)}, K {tuple(K.shape)}: "
                         "a row with no position, or a shape past its limits")


def _row_stride(t: torch.Tensor | None, width: int) -> int:
    return 0 if t is None else t.stride(0) if t.shape[0] > 1 else width


def _rows_of(t: torch.Tensor, width: int) -> bool:
    """t (n, a, b) with each row's a * b = width elements contiguous (rows any distance apart)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2] and (t.shape[0] <= 1 or t.stride(0) >= width)
