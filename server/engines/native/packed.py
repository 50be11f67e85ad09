"""Frozen backbone linears with their weights packed once into oneDNN's blocked layout (CPU).

A decode step multiplies ~16 rows by every weight matrix of the model: it is bound by reading the
weights, and MKL's sgemm re-packs each weight on every call. Reordering each weight once into
oneDNN's layout (what inductor's weight freezing does) and calling oneDNN's linear on it made a
16-row decode step of SmolLM2-135M 1.7x faster here (bench/profile_engine.py, BENCHMARKS.md).

    pack_linears(model)      every plain nn.Linear becomes a PackedLinear (same parameters,
                             same state_dict, one extra packed copy of the weight)
    PackedLinear.forward     inference (autograd off), CPU, float32, at most PACKED_MAX_TOKENS
                             tokens (decode steps): the packed path; anything else (prefills,
                             adaptation's backward, other dtypes, GPU): F.linear
    set_packed(model, on)    switch the packed path on/off without unpacking (benchmarks)

The packed copy is rebuilt when the weight changes in place (its version counter) or moves.
Cost: one more copy of every linear weight in memory (the dense one stays for autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Above this many tokens in one call (a prefill) MKL's dense GEMM was as fast or faster here.
PACKED_MAX_TOKENS = 128


def available() -> bool:
    """oneDNN's packed linear ops exist in this torch build and oneDNN is usable."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise"))


class PackedLinear(nn.Linear):
    """An nn.Linear with a lazily packed inference copy of its weight (see the module docstring)."""

    _packed: torch.Tensor | None
    _packed_key: tuple[int, int, torch.device] | None
    use_packed: bool

    def _init_packed(self) -> None:
        self._packed, self._packed_key, self.use_packed = None, None, True

    def _packed_weight(self) -> torch.Tensor:
        w = self.weight
        key = (w._version, w.data_ptr(), w.device)
        if self._packed is None or self._packed_key != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.use_packed and not torch.is_grad_enabled() and x.device.type == "cpu"
                and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and x.numel() <= PACKED_MAX_TOKENS * self.in_features):
            bias = None if self.bias is None else self.bias.detach()
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` into a PackedLinear (in place; parameters, hooks and
    state_dict unchanged) and pack its weight now. Returns the bytes of the packed copies."""
    if not available():
        raise RuntimeError("this torch build has no oneDNN packed linear ops")
    extra = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
        if isinstance(module, PackedLinear):
            if not hasattr(module, "_packed"):
                module._init_packed()
            extra += module._packed_weight().numel() * module.weight.element_size()
    return extra


def set_packed(model: nn.Module, on: bool) -> None:
    """Use (or bypass) the packed path in every PackedLinear of `model`."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.use_packed = on


def wanted(setting: str, device: str, dtype: str) -> bool:
    """POLYSERVE_PACKED_WEIGHTS: auto = on for float32 on CPU where oneDNN has the ops."""
    if setting == "off":
        return False
    if setting == "on":
        if not available():
            raise RuntimeError("POLYSERVE_PACKED_WEIGHTS=on, but this torch build has no oneDNN packed linear ops")
        return True
    return device == "cpu" and dtype == "float32" and available()


def packed_count(model: nn.Module) -> int:
    return sum(isinstance(m, PackedLinear) for m in model.modules())
