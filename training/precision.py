"""Whether training runs under bf16 autocast ("auto"): on CUDA with bf16, and on CPUs with AMX.

A CPU's bf16 claims say little about a training step. Measured on this project's 2-core
AVX512_BF16 machine (no AMX), routing-adaptation steps of the default backbone (4 examples):

    float32 0.62-0.85 s, bf16 autocast 0.52-0.85 s per step; paired in one process, bf16 ran
    0.87x to 1.2x the speed of float32 (4 pairs) - little, and at bf16's precision

while a probe of one linear block (16-128 rows, forward + backward) measured bf16 1.2-2.9x faster:
a probe that small does not stand for a step (norms, attention, the casts of every weight), and
the choice it made flipped between processes of the same machine, so results depended on a coin
toss. On AVX2-only CPUs bf16 is emulated (a step 82 s against 4 s). Where AMX tiles exist, oneDNN
runs bf16 GEMMs on them, the case bf16 autocast is for. So "auto" reads the hardware, the same way
every time: bf16 on CUDA with bf16 support and on CPUs with AMX, float32 elsewhere; "bf16" and
"none" force it.
"""

from __future__ import annotations

import torch

AUTOCAST_CHOICES = ("auto", "bf16", "none")


def cpu_has_amx() -> bool:
    """The CPU has AMX tiles (and the OS lets torch use them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    return cpu_has_amx()


def resolve_autocast(choice: str | bool | None, device: torch.device | str = "cpu") -> bool:
    """auto/None -> bf16 on CUDA with bf16 and on CPUs with AMX; bf16/True -> on; none/False -> off."""
    if choice is None or choice == "auto":
        return bf16_is_fast(device)
    if isinstance(choice, bool):
        return choice
    if choice not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast must be one of {'|'.join(AUTOCAST_CHOICES)}, got {choice!r}")
    return choice == "bf16"
