"""The model side of the native engine: what runs one flat step (step.StepBatch), and which one.

    llama.LlamaRunner   Llama-family decoders (llama, mistral without a sliding window, qwen2):
                          the engine's own forward, fused and packed linears, the serving dtype
    hf_runner.HFRunner every other Hugging Face decoder: its own forward on the flat batch, its
                          attention routed to the slot cache; the model's dtype

Both keep a slot KV cache and per-slot LoRA tables (slots.py, slot_lora.py) and run the same
steps; the engine does not know which one it drives.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from server.engines.native.core.execution import Mode
from server.engines.native.core.slots import SlotKV
from server.engines.native.core.step import StepBatch
from server.engines.native.model.slot_lora import SlotLoRA
from server.engines.native.tuning import DEFAULT, Tuning

log = logging.getLogger("polyserve.engine")

class ModelRunner(Protocol):
    name: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_positions: int | None
    kv: SlotKV  # every row's KV, one slot a row (the prefix cache copies blocks in and out)
    lora: SlotLoRA | None  # the per-slot adapter tables (None: no routed linears)
    # which of the runner's paths run in a C++ kernel (the engine's start-up log states them)
    attention_kernel: bool
    weight_kernel: bool  # the linears read the backbone's GGUF blocks
    elementwise: bool
    panel_helper: bool  # one-thread steps may share their linears' panels with a helper thread

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits (R, V) float32 at batch.logit_index; writes the items' K/V into their slots."""
        ...

    def set_adapter(self, slot: int, adapter: Any) -> None:
        """The row in `slot` runs with `adapter` (None = base); raises if it cannot."""
        ...

    def copy_slot(self, src: int, dst: int, length: int) -> None: ...

    def set_mode(self, mode: Mode) -> Mode:
        """Run the next steps in `mode` (core/execution.py): its OpenMP team on the calling thread,
        and the panel helper where asked and the runner has one; returns the Mode it runs."""
        ...

    def idle(self) -> None: ...


def build_model_runner(model: torch.nn.Module, routed: Any = None, *, slots: int, dtype: torch.dtype | None = None,
                       tuning: Tuning = DEFAULT) -> ModelRunner:
    """tuning.native_executor auto: the Llama runner where it can run the model, else the HF one;
    the rest of `tuning` goes to the runner whole (tuning.py). dtype None: the model's own.
    routed: the RoutedModel (its adapted linears get per-slot LoRA tables)."""
    from server.engines.native.model.hf_runner import HFRunner
    from server.engines.native.model.llama import LlamaRunner, unsupported

    kind = tuning.native_executor
    model_dtype = next(model.parameters()).dtype
    dtype = dtype or model_dtype
    reason = unsupported(model)
    if kind == "llama" and reason is not None:
        raise ValueError(f"the Llama runner cannot run this model: {reason}")
    if kind == "llama" or (kind == "auto" and reason is None):
        adapted = list(routed.names) if routed is not None else None
        spec = routed.spec if routed is not None else None
        skills = [(layer.lora_A.detach(), layer.lora_B.detach()) for layer in routed.layers] if routed else None
        return LlamaRunner(model, dtype=dtype, slots=slots, adapted=adapted, rank=spec.rank if spec else 0,
                           scale=spec.scale if spec else 1.0, skills=skills, tuning=tuning)
    if reason is not None:
        log.info("native engine: the model's own forward (%s)", reason)
    if dtype != model_dtype:
        log.warning("native engine: the model's own forward serves in the dtype it was loaded in (%s), not %s",
                    model_dtype, dtype)
    runner = HFRunner(model, routed, slots=slots, tuning=tuning)
    runner.check(list(range(1, min(17, runner.vocab_size))))
    return runner
