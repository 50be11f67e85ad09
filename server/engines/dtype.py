"""The serving dtype: one decision, used by both engines and by the backbone's loader.

"auto" picks bfloat16 on CUDA with bf16 support and on CPUs with AMX (oneDNN runs bf16 GEMMs on its
tiles). CPUs with AVX512_BF16 but no AMX disagree about bf16 (some run its GEMMs on 16 rows slower
than float32, others a whole decode step much faster: BENCHMARKS.md, "Serving dtype"), so there a
probe at start times the serving path's own packed linear in both dtypes on the row counts a decode
step has as its rows finish (1 to 16) and picks bfloat16 where its linears are at least as fast
(BF16_PROBE_MIN): the rest of a bf16 step (the KV cache and attention, half the bytes) costs no more,
so at parity on the linears the whole step is already faster. float32 elsewhere: on AVX2 bf16 is
emulated.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from adapters_store.backbone.hardware import cpu_has_amx, cpu_has_avx512_bf16, cpu_time_ratio

log = logging.getLogger("polyserve.engine")

BF16_PROBE_MIN = 1.0  # bfloat16 where the probe measures its linears at least this fast
PROBE_ROWS = (1, 4, 8, 16)  # a decode step's rows as requests finish, up to the default batch


@functools.cache
def cpu_bf16_speedup(d_in: int = 1024, d_out: int = 4096, rows: tuple[int, ...] = PROBE_ROWS, rounds: int = 7,
                     calls: int = 5) -> float:
    """float32 time / bfloat16 time of the serving path's linear (packed for oneDNN where that dtype can be),
    a call on each of `rows` row counts, timed in CPU time on one thread (hardware.cpu_time_ratio); once
    per process (~0.3 s)."""
    from server.engines.native.model.llama import Linear, packing_available

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(d_out, d_in, generator=gen) * 0.02
    xs = [torch.randn(n, d_in, generator=gen) for n in rows]
    runs = {dt: (Linear(w, None, dt, packing_available(dt)), [x.to(dt) for x in xs])
            for dt in (torch.float32, torch.bfloat16)}

    def calls_of(dt: torch.dtype) -> Callable[[], None]:
        lin, xds = runs[dt]

        def run() -> None:
            with torch.inference_mode():
                for _ in range(calls):
                    for xd in xds:
                        lin(xd)
        return run

    return cpu_time_ratio(calls_of(torch.float32), calls_of(torch.bfloat16), rounds)


def auto_dtype(device: torch.device | str) -> tuple[torch.dtype, str]:
    """The "auto" serving dtype and why (for the start-up log)."""
    device = torch.device(device)
    if device.type != "cpu":
        fast = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return (torch.bfloat16, "CUDA with bf16") if fast else (torch.float32, f"{device.type} without fast bf16")
    if cpu_has_amx():
        return torch.bfloat16, "the CPU has AMX"
    if not cpu_has_avx512_bf16():
        return torch.float32, "the CPU has neither AMX nor AVX512_BF16"
    speedup = cpu_bf16_speedup()
    pick = torch.bfloat16 if speedup >= BF16_PROBE_MIN else torch.float32
    return pick, (f"AVX512_BF16 without AMX: the probe ran a linear on {'/'.join(map(str, PROBE_ROWS))} rows "
                  f"{speedup:.2f}x as fast in bfloat16 (bfloat16 from {BF16_PROBE_MIN}x)")


def serving_dtype(device: torch.device | str, setting: str | None = None) -> torch.dtype:
    """POLYSERVE_DTYPE: float32 | bfloat16 | float16, or None/"auto" (see the module doc)."""
    if setting in (None, "auto"):
        dtype, why = auto_dtype(device)
        log.info("serving dtype auto: %s (%s)", str(dtype).removeprefix("torch."), why)
        return dtype
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if setting not in dtypes:
        raise ValueError(f"dtype must be auto, {', '.join(dtypes)}; got {setting!r}")
    return dtypes[setting]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the spelling of POLYSERVE_DTYPE and of vLLM's --dtype)."""
    return str(dtype).removeprefix("torch.")


def backbone_dtype(device: str, setting: str | None = None) -> torch.dtype:
    """The loaded Hugging Face model's dtype (adaptation jobs train on it): float32 on CPU (the
    native engine keeps its own copy in the serving dtype), the serving dtype elsewhere."""
    return torch.float32 if device == "cpu" else serving_dtype(device, setting)
