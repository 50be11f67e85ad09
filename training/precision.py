"""Whether bf16 autocast pays off on a device, decided by measuring it.

On CUDA with bf16 support, bf16 autocast is used. On a CPU, whether oneDNN *claims* bf16 kernels
says little: on this project's 2-core AVX512_BF16 machine (no AMX; torch dispatching AVX2) the
claim holds, yet a routing-adaptation step of the default backbone took 45 s under bf16 autocast
against 2 s in float32, and a retrieval forward 50 s against 5 s. On an AVX2-only CPU bf16 is
emulated (82 s vs 4 s per training step). Where it pays (AMX) it roughly halves a step.

So "auto" times a small forward + backward of a linear block both ways, once per process, and
picks bf16 only when it is clearly faster (`FASTER_BY`).
"""

from __future__ import annotations

import functools
import time

import torch

AUTOCAST_CHOICES = ("auto", "bf16", "none")
FASTER_BY = 1.25  # bf16 must take at most 1/1.25 of the float32 time


def _probe_seconds(bf16: bool, rows: int = 16, d: int = 576, hidden: int = 1536) -> float:
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(hidden, d, generator=gen) / d**0.5
    w2 = torch.randn(d, hidden, generator=gen) / hidden**0.5
    x = torch.randn(rows, d, generator=gen)
    best = float("inf")
    for _ in range(3):  # the first run warms up oneDNN's kernels; the best of the rest counts
        xi = x.clone().requires_grad_(True)
        started = time.perf_counter()
        with torch.inference_mode(False), torch.enable_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(xi, w1)), w2)
            y.float().sum().backward()
        best = min(best, time.perf_counter() - started)
    return best


@functools.cache
def cpu_bf16_speedup() -> float:
    """float32 time / bf16-autocast time of the probe (> 1: bf16 is faster). Measured once."""
    return _probe_seconds(False) / _probe_seconds(True)


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        claimed = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
    return claimed and cpu_bf16_speedup() >= FASTER_BY


def resolve_autocast(choice: str | bool | None, device: torch.device | str = "cpu") -> bool:
    """auto/None -> bf16 only where it measured faster; bf16/True -> on; none/False -> off."""
    if choice is None or choice == "auto":
        return bf16_is_fast(device)
    if isinstance(choice, bool):
        return choice
    if choice not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast must be one of {'|'.join(AUTOCAST_CHOICES)}, got {choice!r}")
    return choice == "bf16"
