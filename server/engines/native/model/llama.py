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

`unsupported(model)` says why a model cannot run here (the engine then uses hf_runner.py, the
same flat batches through the model's own forward); a start-up self-test compares the two.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from adapters_store.backbone.gguf_blocks import QuantWeight, concat, frozen_weights, stored_blocks
from server.engines.native.core.execution import Mode
from server.engines.native.core.slots import SlotKV
from server.engines.native.core.step import StepBatch
from server.engines.native.kernels import attention_kernel as attention_kernels
from server.engines.native.kernels import elementwise_kernel as elementwise
from server.engines.native.kernels import lora_kernel as lora_kernels
from server.engines.native.kernels import panel_helper, quant_linear_bf16
from server.engines.native.kernels import quant_linear as quant_linears
from server.engines.native.kernels.quant_linear import QuantLinear
from server.engines.native.model.attention import cuda_backends, slot_attention
from server.engines.native.model.slot_lora import Group, Member, SlotLoRA, SlotLoRAStep, write_adapter
from server.engines.native.model.static_decode import StaticDecode
from server.engines.native.tuning import DEFAULT, Tuning, resolve_switch, switch

log = logging.getLogger("polyserve.engine")

ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at load (not "dynamic")
# LoRA groups: linears that read the same input (their adapters are fused the same way as the
# q|k|v and gate|up GEMMs)
GROUPS = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")), ("o", ("self_attn.o_proj",)),
          ("gate_up", ("mlp.gate_proj", "mlp.up_proj")), ("down", ("mlp.down_proj",)))


@functools.cache
def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN's packed linear ops exist in this torch build and run in `dtype` on this CPU.

    bf16 packing needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on an AVX2-only CPU the reorder
    raises, so one tiny packed GEMM is tried once per dtype and the plain path is used without it.
    """
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    try:
        with torch.inference_mode():
            w = ops._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
            ops._linear_pointwise(torch.zeros(2, 16, dtype=dtype), w, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def _base(module: nn.Module) -> nn.Module:
    """The frozen nn.Linear inside a RoutedLoRALinear (or the module itself)."""
    return getattr(module, "base", module)


def _linear(module: nn.Module) -> nn.Linear:
    """_base(module), which unsupported() has checked is an nn.Linear."""
    return cast(nn.Linear, _base(module))


def unsupported(model: nn.Module) -> str | None:
    """Why this model cannot run on the flat Llama runner, or None when it can."""
    cfg: Any = getattr(model, "config", None)  # a transformers config (not None past the model_type check)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r} (the flat runner runs {', '.join(ARCHITECTURES)})"
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
    """A frozen y = x @ W.T + b in the serving dtype; packed for oneDNN on CPU, where an activation
    or an elementwise op on the output runs inside the GEMM (oneDNN post-ops): one op, not two."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, packed: bool) -> None:
        w = weight.detach().to(dtype).contiguous()
        self.out_features, self.in_features = w.shape
        self.bias = None if bias is None else bias.detach().to(dtype).contiguous()
        self.packed = packed
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, None) if packed else w

    def __call__(self, x: torch.Tensor, act: str = "none") -> torch.Tensor:
        """act: "none" | "swish" (silu) applied to the output."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, act, [], "")
        y = F.linear(x, self.weight, self.bias)
        return F.silu(y) if act == "swish" else y

    def binary(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """(x @ W.T + b) <op> other, op "add" | "mul" (a new tensor)."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, op)
        y = F.linear(x, self.weight, self.bias)
        return y.add_(other) if op == "add" else y.mul_(other)


class Weights:
    """How the runner's linears are built: the serving dtype, oneDNN packing, and (when the weight
    kernel runs) each weight's GGUF blocks by parameter identity (quant_linear.py)."""

    def __init__(self, dtype: torch.dtype, packed: bool, blocks: dict[int, QuantWeight] | None = None) -> None:
        self.dtype, self.packed, self.blocks = dtype, packed, blocks or {}


def _fused(modules: list[nn.Module], weights: Weights,
           rows: list[torch.Tensor | None] | None = None) -> Linear | QuantLinear:
    """One Linear over the modules' outputs side by side; rows[i] reorders module i's outputs.
    Where every module's weight has blocks, a QuantLinear over them (the float32 Linear kept for
    steps of many rows)."""
    lins = [_linear(m) for m in modules]
    rows = rows or [None] * len(lins)
    weight = torch.cat([m.weight if r is None else m.weight[r] for m, r in zip(lins, rows, strict=True)])
    biases = [m.bias if m.bias is None or r is None else m.bias[r] for m, r in zip(lins, rows, strict=True)]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else m.weight.new_zeros(m.out_features)
                          for b, m in zip(biases, lins, strict=True)])
    dense = Linear(weight, bias, weights.dtype, weights.packed)
    quant = [weights.blocks.get(id(m.weight)) for m in lins]
    if not weights.blocks or any(q is None for q in quant):
        return dense
    fused = concat([cast(QuantWeight, q).rows(r) for q, r in zip(quant, rows, strict=True)])
    if weights.dtype == torch.bfloat16 and fused.out_features % quant_linear_bf16.PANEL:
        return dense  # the bf16 build's panels: no tail of columns
    return QuantLinear(fused, bias, dense, quant_linears.MAX_ROWS, weights.dtype)


def interleave_halves(heads: int, head_dim: int) -> torch.Tensor:
    """Output-row order of a q/k projection that puts each head's rotary pairs side by side:
    new row 2i <- old row i, new row 2i + 1 <- old row i + head_dim/2 (per head). Rope is then one
    complex multiplication; q . k is unchanged (q and k of a head get the same order)."""
    half = head_dim // 2
    one = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)  # (head_dim,)
    return (torch.arange(heads)[:, None] * head_dim + one[None, :]).reshape(-1)


class _Layer:
    # layer: a transformers decoder layer, read by name (torch types its submodules Tensor | Module)
    def __init__(self, layer: Any, weights: Weights, heads: int, kv_heads: int,
                 head_dim: int, fuse_mlp: bool) -> None:
        dtype = weights.dtype
        self.norm1 = layer.input_layernorm.weight.detach().to(dtype)
        self.eps1 = float(getattr(layer.input_layernorm, "variance_epsilon",
                                  getattr(layer.input_layernorm, "eps", 1e-6)))
        self.norm2 = layer.post_attention_layernorm.weight.detach().to(dtype)
        self.eps2 = float(getattr(layer.post_attention_layernorm, "variance_epsilon",
                                  getattr(layer.post_attention_layernorm, "eps", 1e-6)))
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj], weights,
                          [interleave_halves(heads, head_dim), interleave_halves(kv_heads, head_dim), None])
        self.o = _fused([attn.o_proj], weights)
        self.down = _fused([mlp.down_proj], weights)
        # gate and up as two GEMMs with oneDNN post-ops (silu(gate) fused, then * up fused) unless an
        # adapter must reach gate/up before the activation: then one gate|up GEMM, LoRA, silu * up
        self.fuse_mlp = fuse_mlp
        if fuse_mlp:
            self.gate = _fused([mlp.gate_proj], weights)
            self.up = _fused([mlp.up_proj], weights)
        else:
            self.gate_up = _fused([mlp.gate_proj, mlp.up_proj], weights)


# rows of the LM head's calls the panel helper takes: a step's logit rows (one a decoding row)
HEAD_ROWS = 64


class LlamaRunner:
    """The flat-batch forward over a slot KV cache and per-slot LoRA tables (see module doc)."""

    name = "llama"

    def __init__(self, model: nn.Module, *, dtype: torch.dtype, slots: int, adapted: list[str] | None = None,
                 rank: int = 0, scale: float = 1.0, skills: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 lora_dtype: torch.dtype | None = None, tuning: Tuning = DEFAULT) -> None:
        """adapted: the qualified names of the routed linears (the inventory's order); skills: their
        (A, B) skill tensors, so routed tasks are written from their routing weights. tuning: the
        switches (tuning.py): packed_weights (auto: on a CPU where oneDNN has the ops),
        static_decode (decode steps padded to fixed shapes and, on CUDA, replayed as graphs:
        static_decode.py; auto: on CUDA only) and the four kernels (lora_kernel.py,
        attention_kernel.py, quant_linear.py, elementwise_kernel.py). The KV cache and the adapter
        tables get one spare slot for padding."""
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the flat Llama runner cannot run this model: {reason}")
        cfg: Any = model.config  # a transformers config, read by name
        self.device = next(model.parameters()).device
        self.dtype = dtype
        packed = switch(tuning.packed_weights)
        if packed is None:
            packed = self.device.type == "cpu" and packing_available(dtype)
        self.packed = packed
        self.heads: int = cfg.num_attention_heads
        self.kv_heads: int = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.hidden: int = cfg.hidden_size
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        decoder: Any = model.model  # transformers modules, read by name
        groups = self._groups(model, adapted) if adapted else None
        mlp_adapted = groups is not None and any(row[2] is not None for row in groups)
        head = cast(Any, model).get_output_embeddings()
        weights = Weights(dtype, packed, self._blocks(model, head, tuning.weight_kernel))
        self.weight_kernel = bool(weights.blocks)
        self.panel_helper = self.weight_kernel and self.device.type == "cpu"  # the blocks' kernel has it
        self._helper_on = False  # its thread runs (set_mode)
        with torch.no_grad():
            self.layers = [_Layer(layer, weights, self.heads, self.kv_heads, self.head_dim, not mlp_adapted)
                           for layer in decoder.layers]
            self.embed = decoder.embed_tokens.weight.detach().to(dtype).contiguous()
            self.norm = decoder.norm.weight.detach().to(dtype)
            self.norm_eps = float(getattr(decoder.norm, "variance_epsilon", getattr(decoder.norm, "eps", 1e-6)))
            self.lm_head = _fused([head], weights)
        self.vocab_size = self.lm_head.out_features
        rotary = decoder.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().float().to(self.device)
        self._rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self._rope = torch.empty(0, dtype=torch.complex64)
        self._rope_version = 0  # bumped whenever the table is replaced (as SlotKV.version)
        self._rope_table(256)
        self.spare_slot = slots  # never given to a row: static decode steps pad into it
        self.attention_kernel = resolve_switch("attention_kernel", tuning.attention_kernel,
                                               lambda: attention_kernels.why_not(self.device, dtype, self.heads,
                                                                                 self.kv_heads, self.head_dim))
        self.elementwise = resolve_switch("elementwise_kernel", tuning.elementwise_kernel,
                                          lambda: elementwise.why_not(self.device, dtype))
        self.kv = SlotKV(len(self.layers), slots + 1, self.kv_heads, self.head_dim, dtype=dtype, device=self.device)
        self.lora: SlotLoRA | None = None
        if groups is not None:
            # tables in the serving dtype, except float32 on a CPU without the kernel (torch's bf16
            # bmm of a decode group is slower than float32 there: bench/lora_step.py)
            kernel = resolve_switch("lora_kernel", tuning.lora_kernel,
                                    lambda: lora_kernels.why_not(self.device, dtype, rank))
            if lora_dtype is None:
                lora_dtype = torch.float32 if self.device.type == "cpu" and not kernel else dtype
            self.lora = SlotLoRA(groups, slots=slots + 1, rank=rank, scale=scale, dtype=lora_dtype, device=self.device,
                                 kernel="on" if kernel else "off")
            if skills is not None:
                self.lora.set_skills(skills)
        static_decode = switch(tuning.static_decode)
        if static_decode is None:
            static_decode = self.device.type == "cuda"
        self.static: StaticDecode | None = None
        if static_decode:
            self.static = StaticDecode(self._static_compute, spare_slot=self.spare_slot, largest=slots,
                                       device=self.device, capacity=lambda: self.kv.capacity,
                                       layout=lambda: (self.kv.version, self._rope_version))

    # -- building ------------------------------------------------------------------------------
    def _blocks(self, model: nn.Module, head: nn.Module, setting: str) -> dict[int, QuantWeight]:
        """Each weight's GGUF blocks by parameter identity, where the weight kernel runs."""
        if setting == "off" or self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
            # "on": says why not
            resolve_switch("weight_kernel", setting, lambda: quant_linears.why_not(self.device, self.dtype, {}))
            return {}
        by_name = stored_blocks(model)
        if not resolve_switch("weight_kernel", setting,
                              lambda: quant_linears.why_not(self.device, self.dtype, by_name)):
            return {}
        params = frozen_weights(model)  # the adapted linears are wrapped by now (RoutedModel)
        params.setdefault("lm_head.weight", _linear(head).weight)
        found = {id(params[name]): blocks for name, blocks in by_name.items() if name in params}
        linears = sum(isinstance(m, nn.Linear) for m in model.modules())
        how = f"bf16, {quant_linear_bf16.path()}" if self.dtype == torch.bfloat16 else "float32"
        log.info("weight kernel: %d of the model's %d linears read their GGUF blocks (%s)", len(found), linears, how)
        return found

    def _groups(self, model: nn.Module, adapted: list[str]) -> list[list[Group | None]]:
        """Where each adapted linear (by qualified name, in the inventory's order) sits in the
        fused groups."""
        index = {name: i for i, name in enumerate(adapted)}
        names = {id(m): n for n, m in model.named_modules()}
        order = {"self_attn.q_proj": interleave_halves(self.heads, self.head_dim),  # as the fused q|k rows
                 "self_attn.k_proj": interleave_halves(self.kv_heads, self.head_dim)}
        out: list[list[Group | None]] = []
        seen = 0
        for layer in cast(Any, model).model.layers:
            prefix = names[id(layer)]
            row: list[Group | None] = []
            for _, members in GROUPS:
                mods = [layer.get_submodule(m) for m in members]
                start, found = 0, []
                for name, mod in zip(members, mods, strict=True):
                    width = _linear(mod).out_features
                    qualified = f"{prefix}.{name}"
                    if qualified in index:
                        found.append(Member(index[qualified], start, width, order.get(name)))
                    start += width
                seen += len(found)
                row.append(Group(_linear(mods[0]).in_features, start, tuple(found)) if found else None)
            out.append(row)
        if seen != len(adapted):
            raise ValueError(f"{len(adapted) - seen} adapted linears are not attention/MLP linears of the decoder")
        return out

    def _rope_table(self, length: int) -> None:
        """exp(i * position * inv_freq) * scaling for positions 0..P-1: (P, head_dim/2) complex64."""
        if length <= self._rope.shape[0]:
            return
        size = 1 << max(8, math.ceil(math.log2(length)))
        if self.max_positions is not None:
            size = max(length, min(size, self.max_positions))
        freqs = torch.outer(torch.arange(size, device=self.device, dtype=torch.float32), self._inv_freq)
        self._rope = torch.polar(torch.full_like(freqs, self._rope_scale), freqs)
        self._rope_version += 1

    # -- forward -------------------------------------------------------------------------------
    def set_mode(self, mode: Mode) -> Mode:
        """The calling thread's team for the next steps; with `mode.helper` on a one-thread step,
        the weight kernel's panel helper (panel_helper.h) takes panels of its linears (its thread
        starts; without it, it is joined). Returns the Mode that runs: no helper where the linears
        have none. Its buffers hold a call of up to MAX_ROWS rows (the LM head's: HEAD_ROWS);
        larger calls run on the calling thread alone."""
        torch.set_num_threads(mode.threads)
        if not self.panel_helper:
            return Mode(mode.threads)
        kernel = quant_linear_bf16 if self.dtype == torch.bfloat16 else quant_linears
        if not (mode.helper and mode.threads == 1):
            if self._helper_on:
                panel_helper.share(kernel, 0)
                self._helper_on = False
            return Mode(mode.threads)
        body = [lin for layer in self.layers for lin in vars(layer).values() if isinstance(lin, QuantLinear)]
        head = [self.lm_head] if isinstance(self.lm_head, QuantLinear) else []
        rows, panel = quant_linears.MAX_ROWS, kernel.PANEL

        def padded(lin: QuantLinear) -> int:  # out_features in whole panels
            return -(-lin.out_features // panel) * panel

        inputs = rows * max(lin.in_features for lin in body + head)
        results = max([rows * padded(lin) for lin in body] + [HEAD_ROWS * padded(lin) for lin in head])
        self._helper_on = panel_helper.share(kernel, inputs, results, max(lin.out_features for lin in body + head))
        return Mode(1, helper=self._helper_on)

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
        if self.static is not None and self.static.fits(batch):
            return self.static.run(batch)
        with cuda_backends(batch.tokens.device):
            return self._compute_all(batch)

    def _compute_all(self, batch: StepBatch) -> torch.Tensor:
        return self._compute(batch, self.lora.step(batch) if self.lora is not None else None)

    def _static_compute(self, batch: StepBatch) -> torch.Tensor:
        """A static decode step: the LoRA work always runs (rows may change adapters between replays)."""
        lora = None
        if self.lora is not None:
            lora = SlotLoRAStep(self.lora, batch.n_decode, batch.decode_slots_t, [])
        return self._compute(batch, lora)

    def _compute(self, batch: StepBatch, lora: SlotLoRAStep | None) -> torch.Tensor:
        x = F.embedding(batch.tokens, self.embed)  # (T, d)
        # the kernel reads the table by position itself
        rope = None if self.elementwise else self._rope[batch.positions][:, None]  # (T, 1, hd/2) complex
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, rope, batch, lora)
        if batch.logit_index.numel() == 0:
            return x.new_zeros((0, self.vocab_size), dtype=torch.float32)
        h = self._norm(x.index_select(0, batch.logit_index), self.norm, self.norm_eps)
        return self.lm_head(h).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.elementwise:
            return elementwise.rms_norm(x, weight, eps)
        return F.rms_norm(x, (self.hidden,), weight, eps)

    def _rotate(self, qkv: torch.Tensor, rope: torch.Tensor | None, batch: StepBatch) -> torch.Tensor:
        """q|k of qkv rotated -> (T, heads + kv_heads, hd); q|k rows are in rotary-pair order
        (interleave_halves): rope = one complex multiplication per pair."""
        T, n, hd = qkv.shape[0], self.heads + self.kv_heads, self.head_dim
        if rope is None:  # the kernel, in place
            elementwise.rope_(qkv, n, hd, batch.positions, self._rope)
            return qkv[:, : n * hd].view(T, n, hd)
        qk = torch.view_as_complex(qkv[:, : n * hd].float().view(T, n, hd // 2, 2))
        return torch.view_as_real(qk * rope).view(T, n, hd).to(qkv.dtype)

    def _layer(self, i: int, layer: _Layer, x: torch.Tensor, rope: torch.Tensor | None, batch: StepBatch,
               lora: SlotLoRAStep | None) -> torch.Tensor:
        T = x.shape[0]
        heads, kvh, hd = self.heads, self.kv_heads, self.head_dim
        h = self._norm(x, layer.norm1, layer.eps1)
        qkv = layer.qkv(h)
        if lora is not None:
            lora.apply(i, 0, h, qkv)
        v = qkv[:, (heads + kvh) * hd :].view(T, kvh, hd)
        qk = self._rotate(qkv, rope, batch)
        attn = slot_attention(self.kv.k[i], self.kv.v[i], qk[:, :heads], qk[:, heads:], v, batch,
                              kernel=self.attention_kernel)  # (T, heads*hd)
        x = layer.o.binary(attn, x, "add")  # the residual add inside the GEMM
        if lora is not None:
            lora.apply(i, 1, attn, x)
        h = self._norm(x, layer.norm2, layer.eps2)
        if layer.fuse_mlp:
            act = layer.up.binary(h, layer.gate(h, "swish"), "mul")  # silu(h Wg) * (h Wu): two GEMMs, no other op
        else:
            gu = layer.gate_up(h)
            if lora is not None:
                lora.apply(i, 2, h, gu)
            gate, up = gu.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out = layer.down.binary(act, x, "add")
        if lora is not None:
            lora.apply(i, 3, act, out)
        return out

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
        """The row in `slot` runs with `adapter` (None = base)."""
        write_adapter(self.lora, slot, adapter)
