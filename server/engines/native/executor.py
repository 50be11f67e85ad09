"""The model side of the native engine: what runs one flat step (step.StepBatch), and which one.

    llama.LlamaExecutor   Llama-family decoders (llama, mistral without a sliding window, qwen2):
                          the engine's own forward, fused and packed linears, the serving dtype
    hf_executor.HFExecutor every other Hugging Face decoder: its own forward on the flat batch, its
                          attention routed to the slot cache; the model's dtype

Both keep a slot KV cache and per-slot LoRA tables (slots.py, slot_lora.py) and run the same
steps; the engine does not know which one it drives.

Serving dtype ("auto"): bfloat16 on CUDA and on CPUs with AMX (oneDNN runs bf16 GEMMs on its
tiles: a 16-row decode step's linears 3.3x faster than float32 on this project's AMX machine,
BENCHMARKS.md); on a CPU with AVX512_BF16 but no AMX, whichever a probe at start measures faster:
CPUs of that kind disagree (one of this project's machines ran bf16 at 0.8x float32, its AMD EPYC
a whole decode step 1.62x faster, bench/linear_paths.py), so the probe times the serving path's own
packed linear at a decode shape in both dtypes and picks bfloat16 only at >= 1.25x (far from the
ratios seen either side, so processes of one machine agree); float32 elsewhere (AVX2: bf16 is
emulated).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from typing import Any, Protocol

import torch

from server.engines.native.step import StepBatch
from training.precision import bf16_is_fast, cpu_has_amx, cpu_has_avx512_bf16

log = logging.getLogger("polyserve.engine")

KINDS = ("auto", "llama", "hf")


class Executor(Protocol):
    name: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_positions: int | None

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits (R, V) float32 at batch.logit_index; writes the items' K/V into their slots."""
        ...

    def set_adapter(self, slot: int, adapter: Any) -> None:
        """The row in `slot` runs with `adapter` (None = base); raises if it cannot."""
        ...

    def copy_slot(self, src: int, dst: int, length: int) -> None: ...

    def idle(self) -> None: ...


BF16_PROBE_MIN = 1.25  # bfloat16 where the probe measures it at least this much faster


@functools.cache
def cpu_bf16_speedup(d_in: int = 1024, d_out: int = 4096, rows: int = 16, rounds: int = 7, calls: int = 10) -> float:
    """float32 time / bfloat16 time of the serving path's linear (packed for oneDNN where that dtype can be)
    on `rows` rows, interleaved rounds, medians; once per process (~0.2 s)."""
    from server.engines.native.llama import Linear, packing_available

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(d_out, d_in, generator=gen) * 0.02
    x = torch.randn(rows, d_in, generator=gen)
    runs: dict[torch.dtype, tuple[Linear, torch.Tensor, list[float]]] = {
        dt: (Linear(w, None, dt, packing_available(dt)), x.to(dt), []) for dt in (torch.float32, torch.bfloat16)}
    with torch.inference_mode():
        for _ in range(rounds):
            for lin, xd, times in runs.values():
                lin(xd)
                t = time.perf_counter()
                for _ in range(calls):
                    lin(xd)
                times.append(time.perf_counter() - t)
    return statistics.median(runs[torch.float32][2]) / statistics.median(runs[torch.bfloat16][2])


def auto_dtype(device: torch.device | str) -> tuple[torch.dtype, str]:
    """The "auto" serving dtype and why (for the start-up log)."""
    device = torch.device(device)
    if device.type != "cpu":
        fast = bf16_is_fast(device)
        return (torch.bfloat16, "CUDA with bf16") if fast else (torch.float32, f"{device.type} without fast bf16")
    if cpu_has_amx():
        return torch.bfloat16, "the CPU has AMX"
    if not cpu_has_avx512_bf16():
        return torch.float32, "the CPU has neither AMX nor AVX512_BF16"
    speedup = cpu_bf16_speedup()
    pick = torch.bfloat16 if speedup >= BF16_PROBE_MIN else torch.float32
    return pick, (f"AVX512_BF16 without AMX: the probe ran a linear on 16 rows {speedup:.2f}x as fast "
                  f"in bfloat16 (bfloat16 from {BF16_PROBE_MIN}x)")


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


def build_executor(model: torch.nn.Module, routed: Any = None, *, slots: int, dtype: torch.dtype | None = None,
                   kind: str = "auto", packed: bool | None = None, static_decode: bool | None = None,
                   lora_kernel: str = "auto") -> Executor:
    """kind auto: the Llama executor where it can run the model, else the HF one. dtype None: the
    model's own. routed: the RoutedModel (its adapted linears get per-slot LoRA tables).
    lora_kernel: the decode rows' LoRA in the native CPU kernel (lora_kernel.py): auto | on | off."""
    from server.engines.native.hf_executor import HFExecutor
    from server.engines.native.llama import LlamaExecutor, unsupported

    if kind not in KINDS:
        raise ValueError(f"executor must be one of {', '.join(KINDS)}, got {kind!r}")
    model_dtype = next(model.parameters()).dtype
    dtype = dtype or model_dtype
    reason = unsupported(model)
    if kind == "llama" and reason is not None:
        raise ValueError(f"the Llama executor cannot run this model: {reason}")
    if kind == "llama" or (kind == "auto" and reason is None):
        adapted = list(routed.names) if routed is not None else None
        spec = routed.spec if routed is not None else None
        skills = [(layer.lora_A.detach(), layer.lora_B.detach()) for layer in routed.layers] if routed else None
        return LlamaExecutor(model, dtype=dtype, slots=slots, packed=packed, adapted=adapted,
                             rank=spec.rank if spec else 0, scale=spec.scale if spec else 1.0, skills=skills,
                             static_decode=static_decode, lora_kernel=lora_kernel)
    if reason is not None:
        log.info("native engine: the model's own forward (%s)", reason)
    if dtype != model_dtype:
        log.warning("native engine: the model's own forward serves in the dtype it was loaded in (%s), not %s",
                    model_dtype, dtype)
    executor = HFExecutor(model, routed, slots=slots, lora_kernel=lora_kernel)
    executor.check(list(range(1, min(17, executor.vocab_size))))
    return executor
