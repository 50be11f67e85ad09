"""Apply LoRA adapters to a batch whose rows belong to different tasks. Pure functions.

Both formulations are exact and give, for every row n (pseudo-code):

    for n in range(N):
        y[n] += x[n] @ A_t(n) @ B_t(n) * scale          # A_t(n), B_t(n): row n's task LoRA

(i) gathered (materialised): the caller passes each row's cached A_t/B_t (a table of the G
    distinct tasks plus a row -> table index); two batched GEMMs.
(ii) skill space (never materialises): with w(n) the row's (h, S) routing weights,
        u[n, k, s] = x[n, head k] @ A[k, s]                     one GEMM, width S*r, per head
        v[n]       = sum_k sum_s w(n)[k, s] * u[n, k, s]         (N, T, r)
        y[n, head k] = [w(n)[k, 1] v, ..., w(n)[k, S] v] @ stack_s B[k, s]   one GEMM, depth S*r
     which equals (i) because A_t and B_t are linear in w. Weight traffic: S*r*(d_in + d_out)
     whatever the number of distinct tasks.
A row with no adapter (task `base`) has zero weights (skill space) or a zero LoRA (gathered).
`apply_routed` takes routing weights and picks between (i), with the rows' LoRAs materialised on the
spot, and (ii) by their cost.
"""

from __future__ import annotations

import torch

from adapters_store.lora.combine import materialize_many


def apply_gathered(
    x: torch.Tensor, A_table: torch.Tensor, B_table: torch.Tensor, index: torch.Tensor, scale: float
) -> torch.Tensor:
    """x: (N, T, d_in); A_table: (G, d_in, r); B_table: (G, r, d_out); index: (N,) in [0, G)
    -> delta (N, T, d_out). With one table every row uses it: two plain GEMMs over all tokens,
    no per-row copies of the adapter (a training batch of one task)."""
    if A_table.shape[0] == 1:
        return (x @ A_table[0].to(x.dtype)) @ B_table[0].to(x.dtype) * scale
    A_rows = A_table.index_select(0, index).to(x.dtype)  # (N, d_in, r)
    B_rows = B_table.index_select(0, index).to(x.dtype)  # (N, r, d_out)
    return torch.bmm(torch.bmm(x, A_rows), B_rows) * scale


def stack_skills(A: torch.Tensor, B: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay one layer's skills out for the skill-space GEMMs (do it once, not per forward).

    A: (h, S, d_in/h, r) -> A_cat (h, d_in/h, S*r);  B: (h, S, r, d_out/h) -> B_cat (h, S*r, d_out/h) * scale
    """
    h, n_skills, d_in_h, r = A.shape
    A_cat = A.permute(0, 2, 1, 3).reshape(h, d_in_h, n_skills * r).contiguous()
    B_cat = (B.reshape(h, n_skills * r, -1) * scale).contiguous()
    return A_cat, B_cat


def apply_stacked_skills(x: torch.Tensor, A_cat: torch.Tensor, B_cat: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: (N, T, d_in); A_cat, B_cat from stack_skills; w: (N, h*S) or (N, h, S) -> delta (N, T, d_out).

        u[k, n, s]   = x[n, head k] @ A[k, s]              one bmm over heads, width S*r
        v[n]         = sum_{k,s} w[n, k, s] u[k, n, s]      one bmm over rows -> (N, T, r)
        y[n, head k] = [w[n,k,1] v, ..., w[n,k,S] v] @ stack_s B[k, s]   one bmm over heads
    """
    N, T, _ = x.shape
    h, d_in_h, sr = A_cat.shape
    w = w.reshape(N, -1).to(x.dtype)
    hs = w.shape[1]
    n_skills, r = hs // h, sr * h // hs
    u = torch.bmm(x.reshape(N * T, h, d_in_h).transpose(0, 1), A_cat.to(x.dtype))  # (h, N*T, S*r)
    u = u.view(h, N * T, n_skills, r).transpose(0, 1).reshape(N * T, hs, r)  # (N*T, h*S, r)
    wt = w.repeat_interleave(T, dim=0) if T > 1 else w  # (N*T, h*S)
    v = torch.bmm(wt.unsqueeze(1), u)  # (N*T, 1, r)
    z = (wt.unsqueeze(2) * v).view(N * T, h, sr).transpose(0, 1)  # (h, N*T, S*r)
    y = torch.bmm(z, B_cat.to(x.dtype))  # (h, N*T, d_out/h)
    return y.transpose(0, 1).reshape(N, T, -1)


def apply_skill_space(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, w: torch.Tensor, scale: float
) -> torch.Tensor:
    """x: (N, T, d_in); A: (h, S, d_in/h, r); B: (h, S, r, d_out/h); w: (N, h, S)
    -> delta (N, T, d_out). Differentiable in x, A, B and w."""
    A_cat, B_cat = stack_skills(A, B, scale)
    return apply_stacked_skills(x, A_cat, B_cat, w)


def apply_materialised(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, w: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same delta as apply_skill_space, through each row's own LoRA: materialise the N rows'
    A_t (N, d_in, r) and B_t (N, r, d_out) from the skills, then two batched GEMMs. Differentiable
    in x, A, B and w."""
    A_rows, B_rows = materialize_many(A, B, w)
    return torch.bmm(torch.bmm(x, A_rows.to(x.dtype)), B_rows.to(x.dtype)) * scale


def apply_routed(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, w: torch.Tensor, scale: float
) -> torch.Tensor:
    """x: (N, T, d_in); A: (h, S, d_in/h, r); B: (h, S, r, d_out/h); w: (N, h, S) -> delta (N, T, d_out),
    by the cheaper exact formulation. Differentiable in x, A, B and w (training and evaluation use it).

    Multiply-adds of each, per linear, d = d_in + d_out:
        skill space   N*T * S*r*d          (every token goes through all S skills' factors)
        materialised  N * S*r*d  +  N*T * r*d     (each row's LoRA once, then one rank-r LoRA a token)
    With more than one token a row (training, scoring, a prompt) materialising costs
    (S + T) / (S*T) of skill space, and its backward keeps (N, d, r) tables where skill space keeps
    (N*T, h*S*r) activations. With one token a row (a decode step) the two cost the same and skill
    space reads the skills once whatever N, where materialising writes N tables."""
    if x.shape[1] > 1:
        return apply_materialised(x, A, B, w, scale)
    return apply_skill_space(x, A, B, w, scale)
