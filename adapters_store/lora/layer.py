"""The routed-LoRA linear and the per-forward adapter assignment it reads.

Every RoutedLoRALinear of a model shares one AdapterBatch. The caller sets it explicitly
before a forward (which row uses which adapter) and it stays set until replaced, so HF
`generate()` (including beam search and num_return_sequences, whose row expansion is
detected and followed), and gradient-checkpoint recomputation during backward all see the
same assignment — nothing is passed through hooks that vanish after the forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from adapters_store.lora.batched import apply_gathered, apply_routed
from adapters_store.lora.combine import check_heads
from adapters_store.lora.spec import InventorySpec


@dataclass
class SkillSpacePlan:
    """weights: (L, N, h, S) — row n's mixing weights for every adapted layer (zeros = no adapter)."""

    weights: torch.Tensor


@dataclass
class GatheredPlan:
    """Per layer l: A_tables[l] (G, d_in, r), B_tables[l] (G, r, d_out); index (N,) row -> table."""

    A_tables: list[torch.Tensor]
    B_tables: list[torch.Tensor]
    index: torch.Tensor


class OwnPlan(Protocol):
    """A plan that computes its rows' LoRA outputs itself (e.g. the serving engine's per-slot
    tables over a flat batch of tokens): delta(layer, x) -> LoRA output of `layer` for x, or None."""

    def delta(self, layer: int, x: torch.Tensor) -> torch.Tensor | None: ...


class AdapterBatch:
    """Row -> adapter assignment of the next forward(s), shared by all layers of one model."""

    def __init__(self) -> None:
        self.plan: SkillSpacePlan | GatheredPlan | OwnPlan | None = None
        self._expanded: dict[int, SkillSpacePlan | GatheredPlan] = {}

    @property
    def rows(self) -> int:
        if isinstance(self.plan, SkillSpacePlan):
            return self.plan.weights.shape[1]
        if isinstance(self.plan, GatheredPlan):
            return self.plan.index.shape[0]
        return 0

    def set(self, plan: SkillSpacePlan | GatheredPlan | OwnPlan | None) -> None:
        self.plan = plan
        self._expanded = {}

    def clear(self) -> None:
        self.set(None)

    def _plan_for(self, n: int) -> SkillSpacePlan | GatheredPlan:
        """The plan for a forward of n rows; n = k * rows means each row was repeated k times in
        place (HF's repeat_interleave for beams / return sequences)."""
        assert isinstance(self.plan, (SkillSpacePlan, GatheredPlan))
        rows = self.rows
        if n == rows:
            return self.plan
        if rows == 0 or n % rows:
            raise ValueError(f"adapter batch has {rows} rows but the forward got {n}")
        if n not in self._expanded:
            k = n // rows
            if isinstance(self.plan, SkillSpacePlan):
                self._expanded[n] = SkillSpacePlan(self.plan.weights.repeat_interleave(k, dim=1))
            else:
                p = self.plan
                self._expanded[n] = GatheredPlan(p.A_tables, p.B_tables, p.index.repeat_interleave(k))
        return self._expanded[n]

    def delta(
        self, layer: int, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float
    ) -> torch.Tensor | None:
        """LoRA output of `layer` for x (N, T, d_in) or (N, d_in), or None when no plan is set."""
        if self.plan is None:
            return None
        if not isinstance(self.plan, (SkillSpacePlan, GatheredPlan)):
            return self.plan.delta(layer, x)
        squeeze = x.dim() == 2
        x3 = x.unsqueeze(1) if squeeze else x
        plan = self._plan_for(x3.shape[0])
        if isinstance(plan, SkillSpacePlan):
            out = apply_routed(x3, A, B, plan.weights[layer], scale)
        else:
            out = apply_gathered(x3, plan.A_tables[layer], plan.B_tables[layer], plan.index, scale)
        return out.squeeze(1) if squeeze else out


class RoutedLoRALinear(nn.Module):
    """y = base(x) + LoRA delta of each row's adapter, as assigned in the shared AdapterBatch.

    Holds the inventory's skills for this linear: lora_A (h, S, d_in/h, r), lora_B (h, S, r, d_out/h).
    """

    def __init__(self, base: nn.Linear, layer: int, spec: InventorySpec, batch: AdapterBatch) -> None:
        super().__init__()
        d_in, d_out = base.in_features, base.out_features
        h, n_skills, r = spec.n_heads, spec.n_skills, spec.rank
        check_heads(d_in, d_out, h)
        self.base = base
        self.layer = layer
        self.scale = spec.scale
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = nn.Parameter(torch.zeros(h, n_skills, d_in // h, r, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(h, n_skills, r, d_out // h, dtype=dtype, device=device))
        self.batch = batch  # plain attribute: shared, not a submodule

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def reset_skills(self, generator: torch.Generator | None = None) -> None:
        """A like nn.Linear's default init of each (r, d_in/h) block; B = 0 (adapter starts as a no-op)."""
        with torch.no_grad():
            bound = 1.0 / math.sqrt(self.lora_A.shape[2])
            a = torch.rand(self.lora_A.shape, generator=generator, dtype=torch.float32) * 2 - 1
            self.lora_A.copy_(a * bound)
            self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        d = self.batch.delta(self.layer, x, self.lora_A, self.lora_B, self.scale)
        return y if d is None else y + d.to(y.dtype)

    def extra_repr(self) -> str:
        h, n_skills, _, r = self.lora_A.shape
        return f"layer={self.layer}, heads={h}, skills={n_skills}, rank={r}"
