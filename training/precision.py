"""Whether training runs under bf16 autocast ("auto"): on CUDA with bf16, on CPUs with AMX, and on
CPUs with AVX512_BF16 (no AMX) where a probe measures bf16 far faster.

A CPU's bf16 claims say little about a training step, and AVX512_BF16 CPUs disagree: on one of
this project's machines whole routing steps ran about as fast in bf16 as in float32 and a probe
near its bar flipped between processes; on another, bf16 registered tasks much faster with the same
exact match (docs/history/dtype.md has the figures).

On AVX2-only CPUs bf16 is emulated (far slower). Where AMX tiles exist, oneDNN runs bf16 GEMMs on
them. So "auto": bf16 on CUDA with bf16 support and on CPUs with AMX; on AVX512_BF16 CPUs without
AMX, bf16 where the probe (`cpu_bf16_train_speedup`, a frozen linear's forward + backward on 16
rows, once per process, ~0.3 s) measures at least TRAIN_PROBE_MIN = 1.8x: a whole step gains less
than its linears, so the bar is high, well above what the first machine's whole steps reached;
float32 elsewhere. "bf16" and "none" force it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from adapters_store.backbone.hardware import cpu_has_amx, cpu_has_avx512_bf16, cpu_time_ratio

AUTOCAST_CHOICES = ("auto", "bf16", "none")
TRAIN_PROBE_MIN = 1.8  # bf16 autocast on AVX512_BF16 CPUs where the probe measures at least this


@functools.cache
def cpu_bf16_train_speedup(d_in: int = 1024, d_out: int = 4096, rows: int = 16, rounds: int = 7,
                           calls: int = 5) -> float:
    """float32 time / bf16-autocast time of a frozen linear's forward + backward (the input's
    gradient only, as in routing adaptation) on `rows` rows, timed in CPU time on one thread
    (hardware.cpu_time_ratio); once per process."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(d_out, d_in, generator=gen) * 0.02
    x = torch.randn(rows, d_in, generator=gen)

    def calls_of(bf16: bool) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                xg = x.clone().requires_grad_(True)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    y = torch.nn.functional.linear(xg, w)
                y.float().sum().backward()
        return run

    return cpu_time_ratio(calls_of(False), calls_of(True), rounds)


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    if cpu_has_amx():
        return True
    return cpu_has_avx512_bf16() and cpu_bf16_train_speedup() >= TRAIN_PROBE_MIN


def resolve_autocast(choice: str | bool | None, device: torch.device | str = "cpu") -> bool:
    """auto/None -> bf16_is_fast(device); bf16/True -> on; none/False -> off."""
    if choice is None or choice == "auto":
        return bf16_is_fast(device)
    if isinstance(choice, bool):
        return choice
    if choice not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast must be one of {'|'.join(AUTOCAST_CHOICES)}, got {choice!r}")
    return choice == "bf16"


class FrozenBf16Weights:
    """bf16 copies of a model's frozen float32 linear weights, in place only inside `applied()`.

    Under bf16 autocast every linear casts its float32 weight to bf16 in every forward: autocast
    caches casts only for weights that require grad, and a backbone's are frozen: ~2,200 casts a
    routing step, a tenth of its time on a 2-core EPYC (docs/history/dtype.md). The copies hold the
    values autocast computes (round to nearest), so every loss is bit-equal with or without them.
    They are made at the first `applied()` and kept until `release()`: 2 bytes a parameter of the
    linears (~270 MB for the default backbone) for the life of one adaptation. Swap
    and restore happen on the calling thread, around work that owns the model (a server runs a
    job's slices on its engine thread, between its steps); outside the block the model is as it was.
    """

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        self.model, self.enabled = model, enabled
        self._copies: list[tuple[torch.nn.Module, torch.nn.Parameter]] | None = None

    def _make(self) -> list[tuple[torch.nn.Module, torch.nn.Parameter]]:
        copies = []
        with torch.no_grad():
            for module in self.model.modules():
                w = module._parameters.get("weight") if isinstance(module, torch.nn.Linear) else None
                if w is not None and w.dtype == torch.float32 and not w.requires_grad:
                    copies.append((module, torch.nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)))
        return copies

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self._copies is None:
            self._copies = self._make()
        originals = [module._parameters["weight"] for module, _ in self._copies]
        for module, copy in self._copies:
            module._parameters["weight"] = copy
        try:
            yield
        finally:
            for (module, _), original in zip(self._copies, originals, strict=True):
                module._parameters["weight"] = original

    def release(self) -> None:
        self._copies = None
