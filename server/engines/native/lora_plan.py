"""Per-batch adapter plans for the routed model, and the rule that picks one.

Two exact formulations (adapters_store.batched); the engine sets one plan per batch
*composition* (rows -> adapters) and keeps it until the composition changes:

    gathered (RowPlan):     for n in rows:  y[n] += x[n] @ A_t(n) @ (B_t(n) * scale)
                            per-layer tables pre-gathered per row (N, d_in, r), (N, r, d_out) -> two bmm,
                            no gather, no scale multiply at forward time. Rows without an adapter
                            (`base`) hold zeros, so they get exactly + 0.
    skill space:            for n in rows:  y[n] += skill-space(x[n], A, B, w(n)) * scale
                            reads the S skills once whatever the number of tasks; S x the FLOPs.

Cost rule (per adapted linear, decode step, N_a adapted rows, G distinct adapted tasks):
    gathered    reads N_a*r*(d_in+d_out) numbers,  2*N_a*r*(d_in+d_out) FLOPs, 2 kernels
    skill space reads   S*r*(d_in+d_out) numbers,  2*N*S*r*(d_in+d_out) FLOPs, ~8 kernels
On a memory-bound accelerator the skill-space path wins once G > S (more distinct adapters than
skills). On a CPU the step is compute-bound; measured per decode step (SmolLM2-135M, S=8, h=8,
r=8, one task per row, 1 thread): 16 rows base 87.1 / gathered 91.4 / skill 91.7 ms, 32 rows
131.9 / 140.3 / 141.9 ms — a tie per step; end to end (k=64, (a)/(b) in BENCHMARKS.md) gathered
wins at 16 rows (0.95-0.98 vs 0.89) and skill space at 32 rows (0.94 vs 0.89): per-row tables
cost N_a*r*(d_in+d_out) of traffic and a restack on every composition change, skill plans
neither. So: skill space iff every adapted row has routing weights and (G >= min_tasks or
N_a >= min_rows); auto: CUDA min_tasks = S + 1; CPU min_rows = 3*S. settings.skill_space_min_tasks
> 0 sets min_tasks (and disables the row rule). Plain-LoRA tasks (kind "lora") force gathered.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from adapters_store.batched import apply_stacked_skills, stack_skills
from adapters_store.layer import AdapterBatch
from server.adapters.types import Adapter

NEVER = 1 << 30


@dataclass
class RowPlan:
    """Per layer l: A[l] (N, d_in, r), B[l] (N, r, d_out) with the LoRA scale folded into B."""

    A: list[torch.Tensor]
    B: list[torch.Tensor]

    @property
    def rows(self) -> int:
        return self.A[0].shape[0] if self.A else 0


@dataclass
class SkillPlan:
    """Skill space with tables laid out once (not per forward): per layer l
    A_cat[l] (h, d_in/h, S*r), B_cat[l] (h, S*r, d_out/h) with the scale folded in (shared by
    every plan), and the rows' weights w (L, N, h*S)."""

    A_cat: list[torch.Tensor]
    B_cat: list[torch.Tensor]
    w: torch.Tensor

    @property
    def rows(self) -> int:
        return self.w.shape[1]


def skill_tables(routed_model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer A_cat (h, d_in/h, S*r) and B_cat (h, S*r, d_out/h) * scale, laid out once."""
    tables = [stack_skills(layer.lora_A.detach(), layer.lora_B.detach(), layer.scale)
              for layer in routed_model.layers]
    return [a for a, _ in tables], [b for _, b in tables]


class ServingAdapterBatch(AdapterBatch):
    """AdapterBatch that also understands RowPlan and SkillPlan (installed on every RoutedLoRALinear)."""

    @property
    def rows(self) -> int:
        if isinstance(self.plan, (RowPlan, SkillPlan)):
            return self.plan.rows
        return super().rows

    def delta(self, layer, x, A, B, scale):  # type: ignore[override]
        plan = self.plan
        if isinstance(plan, SkillPlan):
            x3 = x.unsqueeze(1) if x.dim() == 2 else x
            if x3.shape[0] != plan.rows:
                raise ValueError(f"adapter plan has {plan.rows} rows but the forward got {x3.shape[0]}")
            out = apply_stacked_skills(x3, plan.A_cat[layer], plan.B_cat[layer], plan.w[layer])
            return out.squeeze(1) if x.dim() == 2 else out
        if not isinstance(plan, RowPlan):
            return super().delta(layer, x, A, B, scale)
        x3 = x.unsqueeze(1) if x.dim() == 2 else x  # (N, T, d_in)
        if x3.shape[0] != plan.rows:
            raise ValueError(f"adapter plan has {plan.rows} rows but the forward got {x3.shape[0]}")
        out = torch.bmm(torch.bmm(x3, plan.A[layer]), plan.B[layer])  # (N, T, d_out)
        return out.squeeze(1) if x.dim() == 2 else out


def install(routed_model) -> ServingAdapterBatch:
    """Give a RoutedModel's layers a ServingAdapterBatch (they share one; plain attribute)."""
    batch = ServingAdapterBatch()
    routed_model.batch = batch
    for layer in routed_model.layers:
        layer.batch = batch
    return batch


def auto_threshold(n_skills: int, device: torch.device) -> tuple[int, int]:
    """(min distinct tasks, min adapted rows) from which the skill-space path is used."""
    return (n_skills + 1, NEVER) if device.type == "cuda" else (NEVER, 3 * n_skills)


def choose_path(adapters: list[Adapter | None], min_tasks: int, min_rows: int = NEVER) -> str:
    """'none' | 'gathered' | 'skill'. adapters: one entry per row (None = base)."""
    used = [a for a in adapters if a is not None]
    if not used:
        return "none"
    distinct = {id(a): a for a in used}
    big = len(distinct) >= min_tasks or len(used) >= min_rows
    if big and all(a.weights is not None for a in distinct.values()):
        return "skill"
    return "gathered"


def build_row_plan(adapters: list[Adapter | None], dims: list[tuple[int, int]], rank: int,
                   scale: float, device: torch.device, dtype: torch.dtype) -> RowPlan:
    """Stack each row's tables; zeros for base rows."""
    A_rows, B_rows = [], []
    for layer, (d_in, d_out) in enumerate(dims):
        zero_a = zero_b = None
        a_list, b_list = [], []
        for adapter in adapters:
            if adapter is None:
                if zero_a is None:
                    zero_a = torch.zeros(d_in, rank, device=device, dtype=dtype)
                    zero_b = torch.zeros(rank, d_out, device=device, dtype=dtype)
                a_list.append(zero_a)
                b_list.append(zero_b)
            else:
                a, b = adapter.layers[layer]
                a_list.append(a)
                b_list.append(b)
        A_rows.append(torch.stack(a_list))
        B_rows.append(torch.stack(b_list) * scale)
    return RowPlan(A_rows, B_rows)


def build_skill_plan(adapters: list[Adapter | None], shape: tuple[int, int, int], device: torch.device,
                     dtype: torch.dtype, tables: tuple[list[torch.Tensor], list[torch.Tensor]]) -> SkillPlan:
    """Rows' weights (L, N, h*S); zeros for base rows."""
    zeros = torch.zeros(shape, device=device)
    per_row = [zeros if a is None else a.weights.to(device) for a in adapters]  # type: ignore[union-attr]
    w = torch.stack(per_row, dim=1).to(dtype)  # (L, N, h, S)
    return SkillPlan(tables[0], tables[1], w.reshape(shape[0], len(adapters), -1).contiguous())


class Planner:
    """Builds the plan of a composition once; `apply` is a no-op while the composition holds."""

    max_plans = 4

    def __init__(self, routed_model, threshold: int = 0) -> None:
        self.rm = routed_model
        self.batch = install(routed_model) if routed_model is not None else None
        if routed_model is not None:
            first = routed_model.layers[0].lora_A
            self.device, self.dtype = first.device, first.dtype
            spec = routed_model.spec
            self.min_tasks, self.min_rows = (threshold, NEVER) if threshold else auto_threshold(
                spec.n_skills, self.device)
            self.dims = routed_model.layer_dims()
            self.shape = (len(routed_model.layers), spec.n_heads, spec.n_skills)
        # a few recent compositions (prefill and decode alternate); the adapters are kept so their
        # ids cannot be reused by new objects while a key refers to them
        self._plans: OrderedDict[tuple[int, ...], tuple[Any, str, list[Adapter | None]]] = OrderedDict()
        self._key: tuple[int, ...] | None = None
        self._tables: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.last_path = "none"
        self.rebuilds = 0

    def apply(self, adapters: list[Adapter | None]) -> bool:
        """Set the plan for rows using `adapters`; returns whether it had to be rebuilt."""
        if self.batch is None:
            if any(a is not None for a in adapters):
                raise RuntimeError("adapters requested but the backbone has no skill inventory")
            return False
        key = tuple(0 if a is None else id(a) for a in adapters)
        if key == self._key and self.batch.plan is self._plans[key][0]:
            return False
        rebuilt = key not in self._plans
        if rebuilt:
            path = choose_path(adapters, self.min_tasks, self.min_rows)
            plan: Any = None
            if path == "skill":
                if self._tables is None:
                    self._tables = skill_tables(self.rm)
                plan = build_skill_plan(adapters, self.shape, self.device, self.dtype, self._tables)
            elif path == "gathered":
                plan = self._derive_row_plan(adapters)
            self._plans[key] = (plan, path, list(adapters))
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
            self.rebuilds += 1
        self._plans.move_to_end(key)
        plan, self.last_path, _ = self._plans[key]
        self.batch.set(plan)
        self._key = key
        return rebuilt

    def _derive_row_plan(self, adapters: list[Adapter | None]) -> RowPlan:
        """A RowPlan for `adapters`, re-using rows of the most recent cached RowPlan (rows with the
        same adapter hold identical tables): one index_select per layer instead of restacking
        every row (3x cheaper at 32 rows); only adapters new to the batch are stacked."""
        spec = self.rm.spec
        source = next((v for v in reversed(self._plans.values()) if isinstance(v[0], RowPlan)), None)
        if source is None:
            return build_row_plan(adapters, self.dims, spec.rank, spec.scale, self.device, self.dtype)
        src_plan, _, src_adapters = source
        pos: dict[int, int] = {}
        for i, a in enumerate(src_adapters):
            pos.setdefault(0 if a is None else id(a), i)
        missing: dict[int, Adapter | None] = {}
        for a in adapters:
            k = 0 if a is None else id(a)
            if k not in pos and k not in missing:
                missing[k] = a
        if len(missing) * 2 > len(adapters):
            return build_row_plan(adapters, self.dims, spec.rank, spec.scale, self.device, self.dtype)
        for j, k in enumerate(missing):
            pos[k] = len(src_adapters) + j
        index = torch.tensor([pos[0 if a is None else id(a)] for a in adapters], device=self.device)
        if not missing:
            return RowPlan([t.index_select(0, index) for t in src_plan.A], [t.index_select(0, index) for t in src_plan.B])
        extra = build_row_plan(list(missing.values()), self.dims, spec.rank, spec.scale, self.device, self.dtype)
        return RowPlan(
            [torch.cat([s, e]).index_select(0, index) for s, e in zip(src_plan.A, extra.A, strict=True)],
            [torch.cat([s, e]).index_select(0, index) for s, e in zip(src_plan.B, extra.B, strict=True)],
        )

    def invalidate(self) -> None:
        """Forget the plans (e.g. after background work changed the model's plan or skills)."""
        self._plans.clear()
        self._key = None
        self._tables = None  # background work may have changed the skills
