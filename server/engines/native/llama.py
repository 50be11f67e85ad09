"""The native engine's model: a Llama-family decoder run on a flat batch (step.StepBatch).

Built once from the loaded Hugging Face model (whose fp32 copy stays for adaptation jobs): its
frozen weights are copied into the serving dtype, the linears that read one input are fused
(q|k|v -> one GEMM, gate|up -> one GEMM) and, on CPU, packed once into oneDNN's blocked layout
(MKL would re-pack each weight on every call; bf16 packed GEMMs use AMX where the CPU has it).

    forward(batch) for every layer l:
        h        = rms_norm(x)                               x: (T, d) flat tokens of all rows
        qkv      = h @ W_qkv (+ bias)   + LoRA_qkv(slot)     one GEMM; LoRA per row (slot_lora)
        q, k     = rope(q, k, positions)                     per-token positions, no padding
        KV[slot, :, pos] = k, v                              written in place (slots.SlotKV)
        attn     = decode group: one SDPA over slots [n, kv_heads, rep, hd] (GQA folded into
                   the query length), masked by each row's length;  chunks: one causal SDPA each
        x       += attn @ W_o + LoRA_o
        x       += down(silu(gate) * up) with gate|up one GEMM, LoRA on both
    logits = lm_head(rms_norm(x[logit_index]))             only the positions asked for (fp32)

`unsupported(model)` says why a model cannot run here (the engine then uses hf_executor.py, the
same flat batches through the model's own forward); a start-up self-test compares the two.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from server.engines.native.attention import slot_attention
from server.engines.native.slot_lora import Group, Member, SlotLoRA, SlotLoRAStep
from server.engines.native.slots import SlotKV
from server.engines.native.step import StepBatch

ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at load (not "dynamic")
GROUPS = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")), ("o", ("self_attn.o_proj",)),
          ("gate_up", ("mlp.gate_proj", "mlp.up_proj")), ("down", ("mlp.down_proj",)))


def packing_available() -> bool:
    """oneDNN's packed linear ops exist in this torch build and oneDNN is usable."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise"))


def _base(module: nn.Module) -> nn.Module:
    """The frozen nn.Linear inside a RoutedLoRALinear (or the module itself)."""
    return getattr(module, "base", module)


def unsupported(model: nn.Module) -> str | None:
    """Why this model cannot run on the flat Llama executor, or None when it can."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r} (the flat executor runs {', '.join(ARCHITECTURES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and window < cfg.max_position_embeddings:
        return f"sliding-window attention ({window})"
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ROPE_TYPES:
        return f"rope type {rope_type!r}"
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        return "no model.layers / model.rotary_emb"
    for layer in decoder.layers:
        for _, names in GROUPS:
            for name in names:
                try:
                    mod = _base(layer.get_submodule(name))
                except AttributeError:
                    return f"no {name} in a decoder layer"
                if not isinstance(mod, nn.Linear):
                    return f"{name} is a {type(mod).__name__}, not an nn.Linear"
    return None


class Linear:
    """A frozen y = x @ W.T + b in the serving dtype; packed for oneDNN on CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, packed: bool) -> None:
        w = weight.detach().to(dtype).contiguous()
        self.out_features, self.in_features = w.shape
        self.bias = None if bias is None else bias.detach().to(dtype).contiguous()
        self.packed = packed
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, None) if packed else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _fused(modules: list[nn.Module], dtype: torch.dtype, packed: bool) -> Linear:
    lins = [_base(m) for m in modules]
    weight = torch.cat([m.weight for m in lins])
    biases = [m.bias for m in lins]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else m.weight.new_zeros(m.out_features)
                          for b, m in zip(biases, lins, strict=True)])
    return Linear(weight, bias, dtype, packed)


class _Layer:
    def __init__(self, layer: nn.Module, dtype: torch.dtype, packed: bool) -> None:
        self.norm1 = layer.input_layernorm.weight.detach().to(dtype)
        self.eps1 = float(getattr(layer.input_layernorm, "variance_epsilon", getattr(layer.input_layernorm, "eps", 1e-6)))
        self.norm2 = layer.post_attention_layernorm.weight.detach().to(dtype)
        self.eps2 = float(getattr(layer.post_attention_layernorm, "variance_epsilon",
                                  getattr(layer.post_attention_layernorm, "eps", 1e-6)))
        self.linears = [_fused([layer.get_submodule(n) for n in names], dtype, packed) for _, names in GROUPS]


class LlamaExecutor:
    """The flat-batch forward over a slot KV cache and per-slot LoRA tables (see module doc)."""

    name = "llama"

    def __init__(self, model: nn.Module, *, dtype: torch.dtype, slots: int, packed: bool | None = None,
                 adapted: list[str] | None = None, rank: int = 0, scale: float = 1.0,
                 lora_dtype: torch.dtype | None = None) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the flat Llama executor cannot run this model: {reason}")
        cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = dtype
        if packed is None:
            packed = self.device.type == "cpu" and packing_available()
        self.packed = packed
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.hidden = cfg.hidden_size
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        decoder = model.model
        with torch.no_grad():
            self.layers = [_Layer(layer, dtype, packed) for layer in decoder.layers]
            self.embed = decoder.embed_tokens.weight.detach().to(dtype).contiguous()
            self.norm = decoder.norm.weight.detach().to(dtype)
            self.norm_eps = float(getattr(decoder.norm, "variance_epsilon", getattr(decoder.norm, "eps", 1e-6)))
            head = model.get_output_embeddings()
            self.lm_head = Linear(head.weight, getattr(head, "bias", None), dtype, packed)
        self.vocab_size = self.lm_head.out_features
        rotary = decoder.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().float().to(self.device)
        self._rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos = self._sin = torch.empty(0)
        self._rope_table(256)
        self.kv = SlotKV(len(self.layers), slots, self.kv_heads, self.head_dim, dtype=dtype, device=self.device)
        self.lora: SlotLoRA | None = None
        if adapted:
            lora_dtype = lora_dtype or (torch.float32 if self.device.type == "cpu" else dtype)
            self.lora = SlotLoRA(self._groups(model, adapted), slots=slots, rank=rank, scale=scale,
                                 dtype=lora_dtype, device=self.device)

    # -- building ------------------------------------------------------------------------------
    def _groups(self, model: nn.Module, adapted: list[str]) -> list[list[Group | None]]:
        """Where each adapted linear (by qualified name, in the inventory's order) sits in the
        fused groups."""
        index = {name: i for i, name in enumerate(adapted)}
        names = {id(m): n for n, m in model.named_modules()}
        out: list[list[Group | None]] = []
        seen = 0
        for layer in model.model.layers:
            prefix = names[id(layer)]
            row: list[Group | None] = []
            for _, members in GROUPS:
                mods = [layer.get_submodule(m) for m in members]
                start, found = 0, []
                for name, mod in zip(members, mods, strict=True):
                    width = _base(mod).out_features
                    qualified = f"{prefix}.{name}"
                    if qualified in index:
                        found.append(Member(index[qualified], start, width))
                    start += width
                seen += len(found)
                row.append(Group(_base(mods[0]).in_features, start, tuple(found)) if found else None)
            out.append(row)
        if seen != len(adapted):
            raise ValueError(f"{len(adapted) - seen} adapted linears are not attention/MLP linears of the decoder")
        return out

    def _rope_table(self, length: int) -> None:
        """cos/sin (P, head_dim) of positions 0..P-1, computed in fp32, kept in the serving dtype."""
        if length <= self._cos.shape[0]:
            return
        size = 1 << max(8, math.ceil(math.log2(length)))
        if self.max_positions is not None:
            size = max(length, min(size, self.max_positions))
        freqs = torch.outer(torch.arange(size, device=self.device, dtype=torch.float32), self._inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = (emb.cos() * self._rope_scale).to(self.dtype)
        self._sin = (emb.sin() * self._rope_scale).to(self.dtype)

    # -- forward -------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> None:
        """Room in the KV cache and the rope table for this step (may allocate)."""
        need = batch.attention_length
        if self.max_positions is not None and need > self.max_positions:
            raise ValueError(f"{need} positions exceed the model's {self.max_positions}")
        self.kv.ensure(need, self.max_positions)
        self._rope_table(need)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits (R, V) float32 at batch.logit_index; writes the items' K/V into their slots."""
        self.prepare(batch)
        lora = self.lora.step(batch) if self.lora is not None else None
        x = F.embedding(batch.tokens, self.embed)  # (T, d)
        cos, sin = self._cos[batch.positions][:, None], self._sin[batch.positions][:, None]  # (T, 1, hd)
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, cos, sin, batch, lora)
        if batch.logit_index.numel() == 0:
            return x.new_zeros((0, self.vocab_size), dtype=torch.float32)
        h = x.index_select(0, batch.logit_index)
        h = F.rms_norm(h, (self.hidden,), self.norm, self.norm_eps)
        return self.lm_head(h).float()

    def _layer(self, i: int, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               batch: StepBatch, lora: SlotLoRAStep | None) -> torch.Tensor:
        T = x.shape[0]
        heads, kvh, hd = self.heads, self.kv_heads, self.head_dim
        qkv_lin, o_lin, gu_lin, down_lin = layer.linears
        h = F.rms_norm(x, (self.hidden,), layer.norm1, layer.eps1)
        qkv = qkv_lin(h)
        if lora is not None:
            lora.apply(i, 0, h, qkv)
        qk = qkv[:, : (heads + kvh) * hd].view(T, heads + kvh, hd)
        half = hd // 2
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        qk = qk * cos + rotated * sin
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kvh) * hd :].view(T, kvh, hd)
        attn = slot_attention(self.kv.k[i], self.kv.v[i], q, k, v, batch)  # (T, heads * hd)
        o = o_lin(attn)
        if lora is not None:
            lora.apply(i, 1, attn, o)
        x = x + o
        h = F.rms_norm(x, (self.hidden,), layer.norm2, layer.eps2)
        gu = gu_lin(h)
        if lora is not None:
            lora.apply(i, 2, h, gu)
        gate, up = gu.chunk(2, dim=-1)
        act = F.silu(gate) * up
        down = down_lin(act)
        if lora is not None:
            lora.apply(i, 3, act, down)
        return x + down

    # -- slots ---------------------------------------------------------------------------------
    def idle(self) -> None:
        """No row in flight: give back the KV memory a long row made the cache grow to."""
        self.kv.reset()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """dst gets src's KV positions [0, length) and adapter tables."""
        self.kv.copy(src, dst, length)
        if self.lora is not None:
            self.lora.copy(src, dst)

    def set_adapter(self, slot: int, adapter: Any) -> None:
        """The row in `slot` runs with `adapter` (server.adapters.types.Adapter; None = base)."""
        if adapter is None:
            if self.lora is not None:
                self.lora.clear(slot)
            return
        if self.lora is None:
            raise RuntimeError("adapters requested but the backbone has no skill inventory")
        self.lora.write(slot, adapter.layers)
