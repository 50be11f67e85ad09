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
"""

from __future__ import annotations

import torch


def apply_gathered(
    x: torch.Tensor, A_table: torch.Tensor, B_table: torch.Tensor, index: torch.Tensor, scale: float
) -> torch.Tensor:
    """x: (N, T, d_in); A_table: (G, d_in, r); B_table: (G, r, d_out); index: (N,) in [0, G)
    -> delta (N, T, d_out)."""
    A_rows = A_table.index_select(0, index).to(x.dtype)  # (N, d_in, r)
    B_rows = B_table.index_select(0, index).to(x.dtype)  # (N, r, d_out)
    return torch.bmm(torch.bmm(x, A_rows), B_rows) * scale


def apply_skill_space(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, w: torch.Tensor, scale: float
) -> torch.Tensor:
    """x: (N, T, d_in); A: (h, S, d_in/h, r); B: (h, S, r, d_out/h); w: (N, h, S)
    -> delta (N, T, d_out)."""
    N, T, _d_in = x.shape
    h, n_skills, d_in_h, r = A.shape
    d_out_h = B.shape[-1]
    w = w.to(x.dtype)
    # Down-projection against every skill of every head at once.
    xh = x.reshape(N * T, h, d_in_h).transpose(0, 1)  # (h, N*T, d_in/h)
    A_cat = A.to(x.dtype).permute(0, 2, 1, 3).reshape(h, d_in_h, n_skills * r)  # (h, d_in/h, S*r)
    u = torch.bmm(xh, A_cat).reshape(h, N, T, n_skills, r)  # (h, N, T, S, r)
    wk = w.permute(1, 0, 2)[:, :, None, :, None]  # (h, N, 1, S, 1)
    v = (u * wk).sum(dim=(0, 3))  # (N, T, r)
    # Up-projection: per head, the row's weighted copies of v against the stacked B.
    z = (v.unsqueeze(0).unsqueeze(3) * wk).reshape(h, N * T, n_skills * r)  # (h, N*T, S*r)
    B_cat = B.to(x.dtype).reshape(h, n_skills * r, d_out_h)  # (h, S*r, d_out/h)
    y = torch.bmm(z, B_cat)  # (h, N*T, d_out/h)
    return y.transpose(0, 1).reshape(N, T, h * d_out_h) * scale
