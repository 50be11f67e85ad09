"""Materialise a task's LoRA from the skill inventory; export and merge. Pure functions.

Shapes, per adapted nn.Linear d_in -> d_out (PEFT Poly layout):

    A: (h, S, d_in/h, r)      B: (h, S, r, d_out/h)      w: (h, S)     scale = 1/r

    A_t[k] = sum_s w[k, s] * A[k, s]     # (d_in/h, r);  A_t = concat_k A_t[k] along d_in  -> (d_in, r)
    B_t[k] = sum_s w[k, s] * B[k, s]     # (r, d_out/h); B_t = concat_k B_t[k] along d_out -> (r, d_out)
    y = base(x) + (x @ A_t @ B_t) * scale

Head k reads input rows [k*d_in/h, (k+1)*d_in/h) of A_t and writes output columns
[k*d_out/h, (k+1)*d_out/h) of B_t.
"""

from __future__ import annotations

import torch


def check_heads(d_in: int, d_out: int, h: int) -> None:
    """Raise a clear error unless h routing heads split both d_in and d_out evenly."""
    if h < 1:
        raise ValueError(f"number of routing heads must be >= 1, got {h}")
    if d_in % h or d_out % h:
        raise ValueError(
            f"{h} routing heads must divide both d_in={d_in} and d_out={d_out} "
            f"(d_in % h = {d_in % h}, d_out % h = {d_out % h}); pick h among the common divisors"
        )


def materialize(A: torch.Tensor, B: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One task's plain LoRA from the skills.

    A: (h, S, d_in/h, r), B: (h, S, r, d_out/h), w: (h, S) -> A_t: (d_in, r), B_t: (r, d_out)
    """
    A_t, B_t = materialize_many(A, B, w.unsqueeze(0))
    return A_t[0], B_t[0]


def materialize_many(
    A: torch.Tensor, B: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """G tasks at once. w: (G, h, S) -> A_t: (G, d_in, r), B_t: (G, r, d_out)."""
    h, n_skills, d_in_h, r = A.shape
    d_out_h = B.shape[-1]
    if B.shape[:3] != (h, n_skills, r) or w.shape[1:] != (h, n_skills):
        raise ValueError(f"shape mismatch: A {tuple(A.shape)}, B {tuple(B.shape)}, w {tuple(w.shape)}")
    w = w.to(A.dtype)
    A_t = torch.einsum("gks,ksdr->gkdr", w, A).reshape(-1, h * d_in_h, r)  # (G, d_in, r)
    B_t = torch.einsum("gks,ksrd->gkrd", w, B)  # (G, h, r, d_out/h)
    B_t = B_t.permute(0, 2, 1, 3).reshape(-1, r, h * d_out_h)  # (G, r, d_out): head k -> cols block k
    return A_t, B_t


def materialize_stacked(
    A: torch.Tensor, B: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One task, L linears of one shape at once (e.g. every layer's q_proj).
    A: (L, h, S, d_in/h, r), B: (L, h, S, r, d_out/h), w: (L, h, S) -> A_t (L, d_in, r), B_t (L, r, d_out)."""
    L, h, n_skills, d_in_h, r = A.shape
    if B.shape[:4] != (L, h, n_skills, r) or w.shape != (L, h, n_skills):
        raise ValueError(f"shape mismatch: A {tuple(A.shape)}, B {tuple(B.shape)}, w {tuple(w.shape)}")
    w = w.to(A.dtype)
    A_t = torch.einsum("lks,lksdr->lkdr", w, A).reshape(L, h * d_in_h, r)
    B_t = torch.einsum("lks,lksrd->lrkd", w, B).reshape(L, r, h * B.shape[-1])  # head k -> cols block k
    return A_t, B_t


def refine_heads(A: torch.Tensor, B: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same skills laid out for `heads` routing heads, a multiple m of their h.

    A: (h, S, d_in/h, r), B: (h, S, r, d_out/h) -> (heads, S, d_in/heads, r), (heads, S, r, d_out/heads).
    Head k's block of rows (of A) and columns (of B) splits into the finer heads k*m .. k*m + m - 1,
    so a routing row repeated m times along its heads (`routing.refine_row`) materialises the same
    LoRA; a row trained at the finer layout can mix skills differently within each old block.
    """
    h, n_skills, d_in_h, r = A.shape
    d_out_h = B.shape[-1]
    if B.shape[:3] != (h, n_skills, r):
        raise ValueError(f"shape mismatch: A {tuple(A.shape)}, B {tuple(B.shape)}")
    if heads < h or heads % h:
        raise ValueError(f"routing heads can only be refined to a multiple of {h}, got {heads}")
    check_heads(h * d_in_h, h * d_out_h, heads)
    m = heads // h
    A_f = A.reshape(h, n_skills, m, d_in_h // m, r).transpose(1, 2).reshape(heads, n_skills, d_in_h // m, r)
    B_f = B.reshape(h, n_skills, r, m, d_out_h // m).permute(0, 3, 1, 2, 4).reshape(heads, n_skills, r, d_out_h // m)
    return A_f.contiguous(), B_f.contiguous()


def lora_delta(x: torch.Tensor, A_t: torch.Tensor, B_t: torch.Tensor, scale: float) -> torch.Tensor:
    """x: (..., d_in) -> (..., d_out):  (x @ A_t @ B_t) * scale."""
    return (x @ A_t.to(x.dtype)) @ B_t.to(x.dtype) * scale


def to_peft_lora(A_t: torch.Tensor, B_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard PEFT LoRA weights: lora_A.weight (r, d_in) = A_t.T, lora_B.weight (d_out, r) = B_t.T.

    With lora_alpha = 1 and rank r, PEFT's scaling alpha/r equals our 1/r.
    """
    return A_t.T.contiguous(), B_t.T.contiguous()


def from_peft_lora(lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of to_peft_lora: (r, d_in), (d_out, r) -> A_t (d_in, r), B_t (r, d_out)."""
    return lora_A.T.contiguous(), lora_B.T.contiguous()


def merge(W: torch.Tensor, A_t: torch.Tensor, B_t: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense weight of the adapted linear. W: (d_out, d_in) (nn.Linear layout) -> same shape.

    W_t = W + scale * (A_t @ B_t).T
    """
    return W + scale * (A_t.to(W.dtype) @ B_t.to(W.dtype)).T
