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


def cpu_has_avx512() -> bool:
    """The CPU has AVX-512 (its foundation, avx512f)."""
    return _cpu_flag("avx512f")


def cpu_has_avx512_bf16() -> bool:
    return _cpu_flag("avx512_bf16")


def _cpu_flag(name: str) -> bool:
    """`name` is one of the CPU's flags in /proc/cpuinfo (False where there is none)."""
    try:
        return any(line.startswith("flags") and name in line.split(":", 1)[-1].split()
                   for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False
