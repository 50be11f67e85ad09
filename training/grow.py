"""Grow a trained inventory into a larger one: more skills, more adapted linears. Pure functions.

A warm start (`polyserve train --init-from`) normally needs the same shape. Growing lets an inventory
gain capacity without paying again for the steps it has had:

    skills   the source's S_src skills become skills 0..S_src-1 of each linear both inventories adapt;
             the new skills and the new linears keep their fresh init (A random, B = 0)
    rows     a carried task's logits for the shared linears' old skills are the source's; its logits
             for the new skills start at NEW_SKILL_LOGIT; the new linears' logits keep their fresh
             (near-μ) init

Why NEW_SKILL_LOGIT is low rather than 0: mixing weights are the sigmoid of the logits normalised
over skills, so new skills at logit 0 would take a large share of every head and shrink the trained
adapter (A_t and B_t are both mixed: the delta falls with the square of that share). At -4 the new
skills start with about 2% of the sigmoid mass each; Adam moves a logit by about the routing lr per
step whatever its gradient, so they take weight within tens of steps where the loss asks for it.

Shapes as in `adapters_store.lora.combine`: A (h, S, d_in/h, r), B (h, S, r, d_out/h), a row (L, h, S).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adapters_store.lora.spec import InventorySpec

NEW_SKILL_LOGIT = -4.0


def check_growable(source: InventorySpec, source_names: Sequence[str], target: InventorySpec,
                   target_names: Sequence[str]) -> None:
    """Raise ValueError unless `target` is `source` with at least as many skills and a superset of its
    adapted linears (the same routing, heads and rank)."""
    if source.routing != "sigmoid" or target.routing != "sigmoid":
        raise ValueError("only sigmoid-routed inventories (poly, mhr) can grow")
    for name in ("n_heads", "rank"):
        if getattr(source, name) != getattr(target, name):
            raise ValueError(f"cannot grow {name}: the source has {getattr(source, name)}, "
                             f"this run {getattr(target, name)}")
    if target.n_skills < source.n_skills:
        raise ValueError(f"cannot shrink skills: the source has {source.n_skills}, this run {target.n_skills}")
    missing = [n for n in source_names if n not in set(target_names)]
    if missing:
        raise ValueError(f"this run does not adapt {len(missing)} linear(s) the source does, e.g. {missing[0]}")


def grow_skills(source: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`fresh` (the target's initial "<linear>.A"/".B" tensors) with the source's skills written into
    skills 0..S_src-1 of every linear both have. Inputs are not modified."""
    out = {}
    for key, init in fresh.items():
        grown = init.detach().clone()
        if key in source:
            old = source[key]
            if old.shape[0] != grown.shape[0] or old.shape[2:] != grown.shape[2:] or old.shape[1] > grown.shape[1]:
                raise ValueError(f"{key}: the source's {tuple(old.shape)} does not fit in {tuple(grown.shape)}")
            grown[:, : old.shape[1]] = old.to(grown.dtype)
        out[key] = grown
    return out


def grow_row(source_row: torch.Tensor, source_names: Sequence[str], fresh_row: torch.Tensor,
             target_names: Sequence[str], new_skill_logit: float = NEW_SKILL_LOGIT) -> torch.Tensor:
    """One task's routing row (L_src, h, S_src) grown into the target's (L, h, S), from `fresh_row`
    (the target's initial row for that task)."""
    if source_row.shape[0] != len(source_names) or fresh_row.shape[0] != len(target_names):
        raise ValueError("a row has one entry per adapted linear, in the order of its names")
    s_src = source_row.shape[-1]
    grown = fresh_row.detach().clone()
    where = {name: i for i, name in enumerate(target_names)}
    for i, name in enumerate(source_names):
        j = where[name]
        grown[j, :, :s_src] = source_row[i].to(grown.dtype)
        grown[j, :, s_src:] = new_skill_logit
    return grown
