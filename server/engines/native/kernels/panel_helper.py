"""The panel helper of a weight-kernel library (panel_helper.h, one helper thread a library): started,
stopped, and read through the library's three entry points `<HELPER>`, `<HELPER>_taken` and
`<HELPER>_pause`. `kernel` is the kernel's module (quant_linear.py, quant_linear_bf16.py: its
`load()`, its `KERNEL`, read when called, so a test that swaps the build reaches that build's
helper, and its `HELPER`)."""

from __future__ import annotations

import ctypes
from types import ModuleType

_I64 = ctypes.c_int64


def share(kernel: ModuleType, inputs: int, results: int = 0, outputs: int = 0) -> bool:
    """Start the kernel's panel helper: a second thread that takes panels of each call made by a
    thread without an OpenMP team, for calls whose x holds up to `inputs` values (rows x
    in_features), whose panels' results up to `results` (rows x out_features rounded up to whole
    panels of the kernel's PANEL columns), of up to `outputs` columns (larger calls run alone);
    inputs = 0 stops it (it finishes its panel and exits). True where it runs (for 0: has stopped);
    False where the kernel or the thread is unavailable."""
    if kernel.load() is None:
        return False
    fn = kernel.KERNEL.companion(kernel.HELPER, (_I64, _I64, _I64)).load()
    return fn is not None and fn(inputs, results, outputs) == 0


def taken(kernel: ModuleType) -> int:
    """Panels whose results callers took from the kernel's helper, since the process started (0
    where the kernel is unavailable)."""
    if kernel.load() is None:
        return 0
    fn = kernel.KERNEL.companion(f"{kernel.HELPER}_taken", (), _I64).load()
    return 0 if fn is None else int(fn())


def pause(kernel: ModuleType, ns: int) -> None:
    """Tests: the kernel's helper sleeps `ns` after claiming each panel, as if descheduled mid-panel."""
    fn = kernel.KERNEL.companion(f"{kernel.HELPER}_pause", (_I64,)).load()
    if fn is None:
        raise RuntimeError(f"the {kernel.KERNEL.what} kernel is unavailable: {kernel.error()}")
    fn(ns)
