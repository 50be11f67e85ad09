"""Whether bf16 autocast pays off on a device.

On CUDA with bf16 support, and on CPUs whose oneDNN has bf16 kernels (AVX-512 / AVX512_BF16 /
AMX), bf16 autocast roughly halves the cost of a training or adaptation step. On an AVX2-only CPU
it is emulated and was measured ~20x slower than fp32 (82 s vs 4 s per training step of the
default backbone), so "auto" must fall back to fp32 there.
"""

from __future__ import annotations

import torch

AUTOCAST_CHOICES = ("auto", "bf16", "none")


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_autocast(choice: str | bool | None, device: torch.device | str = "cpu") -> bool:
    """auto/None -> bf16 only where it is fast; bf16/True -> on; none/False -> off."""
    if choice is None or choice == "auto":
        return bf16_is_fast(device)
    if isinstance(choice, bool):
        return choice
    if choice not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast must be one of {'|'.join(AUTOCAST_CHOICES)}, got {choice!r}")
    return choice == "bf16"
