"""A step's per-row LoRA on a CPU as one native call (lora_rows.cpp) instead of torch ops: the
decode rows and the tokens of every prompt chunk (long chunks too: cheaper than two GEMMs a chunk).

With torch, a fused group's per-row LoRA is two bmm over the rows' tables plus casts (2-4 ops of
~30-40 us each at 16 rows), and the bmm reads the zeros of the block-diagonal B. The kernel reads
only each member's block, in the tables' dtype (so they can be bfloat16 like the serving weights),
sums in float32, and adds into `out` in place: one call per group, so the LoRA's share of a step
falls well below the torch ops' (bench/lora_step.py).

On by default where it builds (POLYSERVE_LORA_KERNEL=auto). The rows are shared out over the
calling thread's OpenMP team (torch's own libgomp, lora_rows.cpp): single-threaded beside the
engine's spinning OpenMP worker it gained nothing end to end. Figures: BENCHMARKS.md ("The LoRA
kernel"); what was tried: docs/history/lora-kernel.md.

Built and loaded as cpp_kernel.py says (g++ on first use, cached per machine).
Where no compiler works, `load()` says why and the torch path runs (POLYSERVE_LORA_KERNEL: auto =
use it when it builds, on = fail when it does not, off = torch ops always; docs/tuning.md).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from server.engines.native.kernels.cpp_kernel import CppKernel

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[type[ctypes.c_int64 | ctypes.c_void_p | ctypes.c_int]] = [
    _I64, _PTR, ctypes.c_int, _I64, _PTR, _PTR, ctypes.c_int, _I64, _I64, _PTR, _PTR, _PTR, ctypes.c_int, _I64,
    _I64, _I64, _I64, _I64, _PTR, _PTR]

KERNEL = CppKernel(Path(__file__).with_name("lora_rows.cpp"), "polyserve_lora_rows", _ARGTYPES, None, "LoRA",
                   headers=(Path(__file__).with_name("bf16.h"),))


def load() -> object | None:
    """The kernel's ctypes function, built on first use; None (and the reason in `error()`) where
    it cannot be built or loaded."""
    return KERNEL.load()


def error() -> str | None:
    return KERNEL.error()


def why_not(device: torch.device, dtype: torch.dtype = torch.float32, rank: int = 8) -> str | None:
    """Why the decode group's LoRA (tables of `dtype`, rank `rank`) cannot run in the kernel here
    (None: it can; builds it on first use). The switch: POLYSERVE_LORA_KERNEL (tuning.resolve_switch)."""
    why = ("it runs on CPUs only" if device.type != "cpu" else
           f"it takes float32/bfloat16 tables, not {dtype}" if dtype not in DTYPES else
           f"it takes ranks up to 64, not {rank}" if rank > 64 else None)
    if why is None and load() is None:
        why = f"the kernel is unavailable: {error()}"
    return why


DTYPES = (torch.float32, torch.bfloat16)


class TableArgs:
    """One fused group's tables as the kernel takes them: A (slots, d_in, k), B (slots, k, d_out),
    contiguous, of one dtype, allocated once (their addresses are kept), and the member columns."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, members: list[tuple[int, int]], rank: int,
                 d_in: int, d_out: int) -> None:
        if not (A.is_contiguous() and B.is_contiguous()) or A.dtype not in DTYPES or B.dtype != A.dtype:
            raise ValueError(f"the LoRA kernel needs contiguous float32/bfloat16 tables, got {A.dtype}/{B.dtype}")
        if A.shape[1:] != (d_in, len(members) * rank) or B.shape[1:] != (len(members) * rank, d_out):
            raise ValueError(f"tables {tuple(A.shape)}, {tuple(B.shape)} do not match {len(members)} members "
                             f"of rank {rank}, {d_in} -> {d_out}")
        if rank > 64:
            raise ValueError(f"the LoRA kernel takes ranks up to 64, got {rank}")
        self.A, self.B = A, B  # kept alive: the kernel reads them by address
        self.start = torch.tensor([s for s, _ in members], dtype=torch.int64)
        self.width = torch.tensor([w for _, w in members], dtype=torch.int64)
        self._const = (A.data_ptr(), B.data_ptr(), int(A.dtype == torch.bfloat16), A.stride(0), B.stride(0))
        self._shape = (d_in, d_out, rank, len(members), self.start.data_ptr(), self.width.data_ptr())
        self.d_in, self.d_out = d_in, d_out

    def rows(self, fn, x: torch.Tensor, out: torch.Tensor, n: int, slots: torch.Tensor | None,
             rows: torch.Tensor | None = None, row_end: int | None = None) -> None:
        """out[t] += x[t] @ A[s] @ B[s] for i < n, t = rows[i] (or i), s = slots[i] (or i), in place.
        x and out: rows of unit column stride (checked), float32 or bfloat16; slots, rows: contiguous
        int64 (rows all below row_end, which the caller vouches for: it built them)."""
        if n == 0:
            return
        end = n if rows is None else row_end
        if end is None or x.stride(-1) != 1 or out.stride(-1) != 1 or x.shape[-1] != self.d_in \
                or out.shape[-1] != self.d_out or x.shape[0] < end or out.shape[0] < end:
            raise ValueError(f"LoRA kernel: x {tuple(x.shape)} / out {tuple(out.shape)} for rows below {end}, "
                             f"{self.d_in} -> {self.d_out}")
        if x.dtype not in DTYPES or out.dtype not in DTYPES:
            raise ValueError(f"the LoRA kernel takes float32/bfloat16 rows, got {x.dtype} -> {out.dtype}")
        ptrs = []
        for t in (slots, rows):
            if t is not None and (t.dtype != torch.int64 or not t.is_contiguous() or t.shape[0] < n):
                raise ValueError("slots and rows must be contiguous int64 tensors with an entry per row")
            ptrs.append(0 if t is None else t.data_ptr())
        a, b, tbf, sa, sb = self._const
        fn(n, x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), a, b, tbf, sa, sb, ptrs[0], ptrs[1],
           out.data_ptr(), int(out.dtype == torch.bfloat16), out.stride(0), *self._shape)
