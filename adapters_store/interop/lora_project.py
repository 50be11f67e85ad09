"""Projecting a plain LoRA onto the inventory: the routing row whose combined adapter best
approximates it, by least squares in weight space.

For every adapted linear l, the uploaded LoRA's update is D_l = A_l B_l (d_in, d_out) (the store's
plain-LoRA tensors, lora_import.convert) and a routing row gives A_l(w), B_l(w) (combine.materialize,
w = routing weights of the logits z). The fit minimises the relative squared error of the updates

    E(z) = sum_l || A_l(w) B_l(w) - D_l ||_F^2  /  sum_l || D_l ||_F^2

over the logits z (L, h, S) by Adam from μ (z = 0). Every term is a trace of rank-r products, so no
(d_in, d_out) matrix is ever formed:

    || A B - A_u B_u ||^2 = tr(A^T A  B B^T) - 2 tr(A_u^T A  B B_u^T) + tr(A_u^T A_u  B_u B_u^T)

It compares updates, not factors: a LoRA trained elsewhere has its own basis (A R, R^-1 B is the
same update), and only the update is the model's behaviour. E is not convex in z (the adapter is
bilinear in w): the answer is a local optimum, reported with its error.
"""

from __future__ import annotations

from typing import Any

import torch

from adapters_store.lora.combine import materialize_stacked
from adapters_store.lora.routing import routing_weights
from adapters_store.store.records import InventoryInfo


def _groups(info: InventoryInfo) -> dict[tuple[int, int], list[int]]:
    """Linears of one (d_in, d_out), by index: each group is combined in one stacked call."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, dims in enumerate(info.layer_dims):
        groups.setdefault(tuple(dims), []).append(i)  # type: ignore[arg-type]
    return groups


def tr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum over the batch of tr(x[g] @ y[g]); x, y (G, r, r)."""
    return (x * y.transpose(1, 2)).sum()


def update_error(info: InventoryInfo, skills: dict[str, torch.Tensor], logits: torch.Tensor,
                 target: dict[str, torch.Tensor]) -> torch.Tensor:
    """E(z) above (a scalar tensor, differentiable in logits (L, h, S))."""
    w = routing_weights(logits, "hyper" if info.spec.routing == "hyper" else "sigmoid")
    num = logits.new_zeros(())
    den = logits.new_zeros(())
    for index in _groups(info).values():
        names = [info.layer_names[i] for i in index]
        A_sk = torch.stack([skills[f"{n}.A"] for n in names]).float()
        B_sk = torch.stack([skills[f"{n}.B"] for n in names]).float()
        A, B = materialize_stacked(A_sk, B_sk, w[index])  # (G, d_in, r), (G, r, d_out)
        Au = torch.stack([target[f"{n}.A"] for n in names]).float()
        Bu = torch.stack([target[f"{n}.B"] for n in names]).float()
        aa, bb = A.transpose(1, 2) @ A, B @ B.transpose(1, 2)  # (G, r, r)
        ua, bu = Au.transpose(1, 2) @ A, B @ Bu.transpose(1, 2)
        uu, vv = Au.transpose(1, 2) @ Au, Bu @ Bu.transpose(1, 2)
        num = num + tr(aa, bb) - 2 * tr(ua, bu) + tr(uu, vv)
        den = den + tr(uu, vv)
    return num / den.clamp_min(1e-30)


def fit_routing(info: InventoryInfo, skills: dict[str, torch.Tensor], target: dict[str, torch.Tensor], *,
                steps: int = 300, lr: float = 0.1) -> tuple[torch.Tensor, dict[str, float]]:
    """The fitted logits (L, h, S) and {"error_mu", "error", "steps"}: sqrt(E) at μ and at the fit."""
    shape = (len(info.layer_names), info.spec.n_heads, info.spec.n_skills)
    logits = torch.zeros(shape, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=lr)
    with torch.no_grad():
        start = float(update_error(info, skills, logits, target))
    best, best_logits = start, logits.detach().clone()
    for _ in range(steps):
        opt.zero_grad()
        loss = update_error(info, skills, logits, target)
        if float(loss.detach()) < best:  # the logits this loss is of (before the step)
            best, best_logits = float(loss.detach()), logits.detach().clone()
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = float(update_error(info, skills, best_logits, target))
    return best_logits, {"error_mu": start**0.5, "error": final**0.5, "steps": steps}


def project_task(store, task: str, *, steps: int = 300) -> dict[str, Any]:
    """Replace the plain-LoRA task `task` by its fitted routing row (a new version, kilobytes);
    returns the fit report (relative error of the updates at μ and at the fit)."""
    record = store.get_task(task)
    if record.kind != "lora":
        raise ValueError(f"task {task!r} is not a plain LoRA")
    info, skills = store.load_inventory()
    target = store.load_weights(record)
    logits, report = fit_routing(info, skills, target, steps=steps)
    routed = store.put_routing(task, logits, method="lora-projected",
                               source={**record.source, "projected_from_version": record.version,
                                       "fit_error": report["error"]})
    return {**report, "version": routed.version, "params_before": record.params, "params_after": routed.params}
