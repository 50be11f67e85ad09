"""Flat steps through a Hugging Face model's own forward (decoders the Llama runner cannot run).

The model gets the step's tokens as one sequence (batch 1, T tokens) with each token's own
position id; its attention layers call `slot_attention` (registered with transformers'
AttentionInterface for the duration of the forward), which writes the new K/V into the slot
cache and attends per row there, exactly as the Llama runner does. The routed linears get
their rows' LoRA from per-linear slot tables (a SlotLoRA whose groups are single linears) through
the RoutedModel's AdapterBatch. Only the positions asked for go through the LM head
(`logits_to_keep` as indices), so the model's own logit post-processing applies.

It serves in the model's dtype (the model is the one adaptation jobs train on). What it cannot
express: attention that is not plain causal softmax attention over a layer's own K/V: sliding
windows are refused from the config; others (softcapping of attention scores, ALiBi) are found
by `check` at start-up, which compares a short prompt with the model's plain forward.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from server.engines.native.core.execution import Mode
from server.engines.native.core.slots import SlotKV
from server.engines.native.core.step import Item, StepBatch
from server.engines.native.model.attention import slot_attention
from server.engines.native.model.slot_lora import Group, Member, SlotLoRA, SlotLoRAStep, write_adapter
from server.engines.native.tuning import DEFAULT, Tuning

ATTENTION = "polyserve_slots"


class _Context:
    def __init__(self, kv: SlotKV, batch: StepBatch) -> None:
        self.kv, self.batch = kv, batch


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any):
    """transformers attention interface: query (1, heads, T, hd), key/value (1, kv_heads, T, hd)
    after rope -> ((1, T, heads, hd), None)."""
    ctx: _Context = kwargs["polyserve"]
    T, hd = query.shape[2], query.shape[3]
    layer = cast(int, module.layer_idx)  # an int (torch types module attributes Tensor | Module)
    out = slot_attention(ctx.kv.k[layer], ctx.kv.v[layer], query[0].transpose(0, 1),
                         key[0].transpose(0, 1), value[0].transpose(0, 1), ctx.batch, scale=scaling)
    return out.view(1, T, -1, hd), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class _SlotPlan:
    """AdapterBatch plan: adapted linear i's LoRA for the step's flat tokens from the slot tables."""

    def __init__(self, step: SlotLoRAStep | None) -> None:
        self.step = step

    def delta(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        if self.step is None:
            return None
        flat = x.reshape(-1, x.shape[-1])
        B = self.step.lora.B[layer][0]
        assert B is not None
        out = flat.new_zeros((flat.shape[0], B.shape[-1]))
        self.step.apply(layer, 0, flat, out)
        return out.view(*x.shape[:-1], -1)


class HFRunner:
    name = "hf"
    # its attention, linears, norms and rope are the model's own torch ops
    attention_kernel = weight_kernel = elementwise = panel_helper = False

    def __init__(self, model: nn.Module, routed: Any = None, *, slots: int, tuning: Tuning = DEFAULT) -> None:
        """tuning: the switches this runner reads (lora_kernel; tuning.py)."""
        cfg: Any = model.config  # a transformers config, read by name
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) and window < (
                getattr(cfg, "max_position_embeddings", 0) or window + 1):
            raise ValueError(f"sliding-window attention ({window} positions) is not supported by the native engine; "
                             "serve this model with POLYSERVE_ENGINE=vllm")
        self.model, self.routed = model, routed
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        self.vocab_size = int(cast(Any, model).get_output_embeddings().weight.shape[0])
        self.kv = SlotKV(cfg.num_hidden_layers, slots, kv_heads, head_dim, dtype=self.dtype, device=self.device)
        self.lora: SlotLoRA | None = None
        if routed is not None:
            groups: list[list[Group | None]] = [
                [Group(layer.in_features, layer.out_features, (Member(i, 0, layer.out_features),))]
                for i, layer in enumerate(routed.layers)]
            self.lora = SlotLoRA(groups, slots=slots, rank=routed.spec.rank, scale=routed.spec.scale,
                                 dtype=self.dtype, device=self.device, kernel=tuning.lora_kernel)
            self.lora.set_skills([(layer.lora_A.detach(), layer.lora_B.detach()) for layer in routed.layers])
        _register()
        self._mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)  # 4-D: used as given (ignored)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        need = batch.attention_length
        if self.max_positions is not None and need > self.max_positions:
            raise ValueError(f"{need} positions exceed the model's {self.max_positions}")
        self.kv.ensure(need, self.max_positions)
        if batch.logit_index.numel() == 0:
            index = batch.logit_index.new_zeros(1)  # the model wants >= 1 position; dropped below
        else:
            index = batch.logit_index
        config: Any = self.model.config
        before = config._attn_implementation
        previous = self.routed.batch.plan if self.routed is not None else None
        try:
            config._attn_implementation = ATTENTION
            if self.routed is not None:
                self.routed.batch.set(_SlotPlan(self.lora.step(batch) if self.lora is not None else None))
            out = self.model(input_ids=batch.tokens[None], position_ids=batch.positions[None],
                             attention_mask=self._mask, use_cache=False, logits_to_keep=index,
                             polyserve=_Context(self.kv, batch))
        finally:
            config._attn_implementation = before
            if self.routed is not None:
                self.routed.batch.set(previous)
        logits = out.logits[0].float()
        return logits[: batch.logit_index.numel()]

    def set_adapter(self, slot: int, adapter: Any) -> None:
        """The row in `slot` runs with `adapter` (None = base)."""
        write_adapter(self.lora, slot, adapter)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.kv.copy(src, dst, length)
        if self.lora is not None:
            self.lora.copy(src, dst)

    def idle(self) -> None:
        self.kv.reset()

    def set_mode(self, mode: Mode) -> Mode:
        """The team only: its linears are torch's, with no panel helper."""
        torch.set_num_threads(mode.threads)
        return Mode(mode.threads)

    def check(self, prompt: list[int], atol: float = 1e-3) -> None:
        """Start-up self-test: a prompt prefilled in two chunks, then one decode step, must give the
        logits of the model's plain forward; raises ValueError naming the gap."""
        if len(prompt) < 3:
            raise ValueError("the self-test needs a prompt of >= 3 tokens")
        previous = self.routed.batch.plan if self.routed is not None else None
        try:
            if self.routed is not None:
                self.routed.batch.set(None)  # the plain model: no adapter
            with torch.inference_mode():
                ref = self.model(input_ids=torch.tensor([prompt], device=self.device)).logits[0].float()
        finally:
            if self.routed is not None:
                self.routed.batch.set(previous)
        split = len(prompt) // 2
        first = self.forward(StepBatch.build([Item(0, 0, tuple(prompt[:split]), "all")], self.device))
        second = self.forward(StepBatch.build([Item(0, split, tuple(prompt[split:-1]), "all")], self.device))
        last = self.forward(StepBatch.build([Item(0, len(prompt) - 1, (prompt[-1],))], self.device))
        got = torch.cat([first, second, last])
        gap = float((got - ref).abs().max())
        if not gap <= atol * max(1.0, float(ref.abs().max())):
            raise ValueError(f"the model's own forward on slot-cache steps differs from its plain forward "
                             f"by {gap:.3g}: its attention is not plain causal attention over its own K/V; "
                             "it cannot be served natively")
