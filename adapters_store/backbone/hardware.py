"""What this machine's CPU can do for bf16, asked by serving (engines/dtype.py) and training
(training/precision.py) alike. Facts only; each side decides what to do with them."""

from __future__ import annotations

from pathlib import Path

import torch


def cpu_has_amx() -> bool:
    """The CPU has AMX tiles (and the OS lets torch use them)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def cpu_has_avx512_bf16() -> bool:
    try:
        return any(line.startswith("flags") and " avx512_bf16" in line
                   for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False
