"""Pure routing / combine / batched-apply math, checked against naive references."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from adapters_store.lora import batched
from adapters_store.lora.batched import (
    apply_gathered,
    apply_materialised,
    apply_routed,
    apply_skill_space,
    stack_skills,
)
from adapters_store.lora.combine import (
    check_heads,
    from_peft_lora,
    lora_delta,
    materialize,
    materialize_many,
    materialize_stacked,
    merge,
    refine_heads,
    to_peft_lora,
)
from adapters_store.lora.routing import (
    eval_weights,
    gumbel_sigmoid,
    refine_row,
    routing_weights,
    train_weights,
    uniform_weights,
)

torch.manual_seed(0)


def naive_materialize(A, B, w):
    """Per-head loop, written the slow obvious way."""
    h = A.shape[0]
    A_heads = [sum(w[k, s] * A[k, s] for s in range(A.shape[1])) for k in range(h)]
    B_heads = [sum(w[k, s] * B[k, s] for s in range(B.shape[1])) for k in range(h)]
    return torch.cat(A_heads, dim=0), torch.cat(B_heads, dim=1)


@pytest.mark.parametrize("h,S,d_in,d_out,r", [(1, 4, 16, 8, 2), (4, 3, 16, 8, 2), (8, 8, 64, 32, 4), (2, 1, 6, 10, 3)])
def test_materialize_matches_per_head_loop(h, S, d_in, d_out, r):
    A, B = torch.randn(h, S, d_in // h, r), torch.randn(h, S, r, d_out // h)
    w = eval_weights(torch.randn(h, S))
    A_t, B_t = materialize(A, B, w)
    ref_A, ref_B = naive_materialize(A, B, w)
    assert A_t.shape == (d_in, r) and B_t.shape == (r, d_out)
    assert_close(A_t, ref_A)
    assert_close(B_t, ref_B)


@pytest.mark.parametrize("h,S,d_in,d_out,r", [(1, 4, 16, 8, 2), (4, 3, 16, 8, 2), (8, 8, 64, 32, 4)])
def test_materialize_stacked_equals_one_linear_at_a_time(h, S, d_in, d_out, r):
    L = 3
    A, B = torch.randn(L, h, S, d_in // h, r), torch.randn(L, h, S, r, d_out // h)
    w = eval_weights(torch.randn(L, h, S))
    A_t, B_t = materialize_stacked(A, B, w)
    for layer in range(L):
        ref_A, ref_B = naive_materialize(A[layer], B[layer], w[layer])
        assert_close(A_t[layer], ref_A)
        assert_close(B_t[layer], ref_B)
    with pytest.raises(ValueError, match="shape mismatch"):
        materialize_stacked(A, B, w[:, :, :-1])


def test_head_k_writes_only_its_output_block():
    """Guards the B reshape: a skill that is non-zero only in head 1 changes only columns of head 1."""
    h, S, d_in, d_out, r = 4, 2, 8, 12, 2
    A = torch.randn(h, S, d_in // h, r)
    B = torch.zeros(h, S, r, d_out // h)
    B[1] = torch.randn(S, r, d_out // h)
    _, B_t = materialize(A, B, uniform_weights(h, S))
    block = d_out // h
    assert B_t[:, block : 2 * block].abs().sum() > 0
    assert B_t[:, :block].abs().sum() == 0 and B_t[:, 2 * block :].abs().sum() == 0


@pytest.mark.parametrize("h,d_in,d_out", [(3, 16, 16), (4, 16, 6), (0, 8, 8)])
def test_heads_must_divide_dims(h, d_in, d_out):
    with pytest.raises(ValueError, match="routing heads"):
        check_heads(d_in, d_out, h)


@pytest.mark.parametrize("h,heads,S,d_in,d_out,r", [(1, 4, 3, 16, 8, 2), (2, 8, 4, 16, 24, 3), (4, 8, 2, 32, 8, 2)])
def test_refined_heads_with_a_repeated_row_materialise_the_same_lora(h, heads, S, d_in, d_out, r):
    A, B = torch.randn(h, S, d_in // h, r), torch.randn(h, S, r, d_out // h)
    logits = torch.randn(h, S) * 3
    A_f, B_f = refine_heads(A, B, heads)
    assert A_f.shape == (heads, S, d_in // heads, r) and B_f.shape == (heads, S, r, d_out // heads)
    fine = refine_row(logits, heads // h)
    assert fine.shape == (heads, S)
    ref_A, ref_B = naive_materialize(A, B, eval_weights(logits))
    A_t, B_t = materialize(A_f, B_f, eval_weights(fine))
    assert_close(A_t, ref_A)
    assert_close(B_t, ref_B)
    # and each finer head owns its own slice: moving one finer head's logits changes only its block
    moved = fine.clone()
    moved[1] = -moved[1] + 5 * torch.arange(S)
    A_m, B_m = materialize(A_f, B_f, eval_weights(moved))
    rows, cols = d_in // heads, d_out // heads
    changed_rows = (A_m - A_t).abs().sum(1).nonzero().flatten().tolist()
    changed_cols = (B_m - B_t).abs().sum(0).nonzero().flatten().tolist()
    assert changed_rows == list(range(rows, 2 * rows))
    assert changed_cols == list(range(cols, 2 * cols))


@pytest.mark.parametrize("h,heads,d_in,d_out", [(2, 3, 12, 12), (4, 2, 16, 16), (2, 8, 16, 12)])
def test_refine_heads_refuses_what_is_not_a_finer_split(h, heads, d_in, d_out):
    A, B = torch.randn(h, 2, d_in // h, 2), torch.randn(h, 2, 2, d_out // h)
    with pytest.raises(ValueError, match="routing heads"):
        refine_heads(A, B, heads)


def test_eval_weights_normalise_per_head():
    w = eval_weights(torch.randn(5, 4, 8))
    assert_close(w.sum(-1), torch.ones(5, 4))
    assert (w > 0).all()


def test_gumbel_is_reproducible_and_noisy_and_differentiable():
    logits = torch.zeros(3, 8, requires_grad=True)
    a = train_weights(logits, 0.5, torch.Generator().manual_seed(1))
    b = train_weights(logits, 0.5, torch.Generator().manual_seed(1))
    c = train_weights(logits, 0.5, torch.Generator().manual_seed(2))
    assert_close(a, b)
    assert not torch.allclose(a, c)
    assert_close(a.sum(-1), torch.ones(3))
    a.pow(2).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_gumbel_low_temperature_is_nearly_binary():
    y = gumbel_sigmoid(torch.zeros(10_000), temperature=0.05, generator=torch.Generator().manual_seed(0))
    # P(|logistic noise| < 0.05 * ln 99) ~ 0.115, so ~88% of samples land within 0.01 of 0 or 1
    assert ((y < 0.01) | (y > 0.99)).float().mean() > 0.85
    assert 0.4 < y.round().mean() < 0.6  # logits 0 -> Bernoulli(0.5)
    with pytest.raises(ValueError, match="temperature"):
        gumbel_sigmoid(torch.zeros(2), temperature=0.0)


def test_routing_kinds():
    logits = torch.randn(2, 3, 4)
    assert_close(routing_weights(logits, "uniform"), torch.full((2, 3, 4), 0.25))
    assert routing_weights(logits, "hyper") is logits
    assert_close(routing_weights(logits, "sigmoid"), eval_weights(logits))
    with pytest.raises(ValueError, match="routing kind"):
        routing_weights(logits, "softmax")  # type: ignore[arg-type]


def test_eval_weights_stay_non_negative_when_every_skill_is_off():
    """Very negative logits: each sigmoid is ~1e-13, the head's sum below EPS; the weights are
    still >= 0 and finite (EPS is added to the sum, never subtracted)."""
    w = eval_weights(torch.full((3, 4), -30.0))
    assert torch.isfinite(w).all() and (w >= 0).all() and (w.sum(-1) <= 1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gumbel_sigmoid_is_the_binary_concrete_formula(dtype):
    """y = sigmoid((logits + log u - log(1 - u)) / tau), u from the generator, in the logits' dtype."""
    logits = torch.randn(4, 6, dtype=dtype)
    u = torch.rand(logits.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    want = torch.sigmoid((logits + (torch.log(u) - torch.log1p(-u))) / 0.7)
    got = gumbel_sigmoid(logits, 0.7, torch.Generator().manual_seed(3))
    assert got.dtype == dtype
    assert_close(got, want, rtol=0, atol=0)
    default = gumbel_sigmoid(logits, generator=torch.Generator().manual_seed(3))  # temperature 1
    assert_close(default, gumbel_sigmoid(logits, 1.0, torch.Generator().manual_seed(3)), rtol=0, atol=0)


def test_gumbel_sigmoid_keeps_uniform_draws_at_the_bounds_finite(monkeypatch):
    """A draw of exactly 0 (torch.rand's [0, 1) includes it) or of 1 is clamped into
    [tiny, 1 - eps] before the logs, so the noise and the weights stay finite and exact."""
    info = torch.finfo(torch.float32)
    draws = torch.tensor([0.0, 1.0, 0.5, 1.0 - 2.0**-24])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: draws.clone())
    logits = torch.tensor([0.3, -0.2, 1.0, 0.0])
    y = gumbel_sigmoid(logits, 4.0)  # a high temperature: the clamped bounds stay off 0 and 1
    u = draws.clamp(info.tiny, 1.0 - info.eps)
    assert_close(y, torch.sigmoid((logits + (torch.log(u) - torch.log1p(-u))) / 4.0), rtol=0, atol=0)
    assert (y > 0).all() and (y < 1).all()


def test_routing_weights_dispatch_and_defaults():
    logits = torch.randn(2, 3, 4)
    assert_close(routing_weights(logits), eval_weights(logits), rtol=0, atol=0)  # default: sigmoid
    g = torch.Generator
    assert_close(routing_weights(logits, "gumbel", temperature=0.5, generator=g().manual_seed(1)),
                 train_weights(logits, 0.5, g().manual_seed(1)), rtol=0, atol=0)
    assert_close(routing_weights(logits, "gumbel", generator=g().manual_seed(1)),  # default temperature 1
                 train_weights(logits, 1.0, g().manual_seed(1)), rtol=0, atol=0)
    assert_close(train_weights(logits, generator=g().manual_seed(2)),
                 train_weights(logits, 1.0, g().manual_seed(2)), rtol=0, atol=0)
    assert not torch.allclose(routing_weights(logits, "gumbel", temperature=0.5, generator=g().manual_seed(1)),
                              train_weights(logits, 1.0, g().manual_seed(1)))


def test_uniform_weights_take_the_asked_dtype():
    w = uniform_weights(2, 3, dtype=torch.float64)
    assert w.dtype == torch.float64 and w.shape == (2, 3)
    assert_close(w, torch.full((2, 3), 1 / 3, dtype=torch.float64), rtol=0, atol=0)


def test_refine_row_factor_bounds():
    logits = torch.randn(2, 3)
    assert torch.equal(refine_row(logits, 1), logits)  # factor 1: the same row
    assert torch.equal(refine_row(logits, 2), logits[[0, 0, 1, 1]])
    with pytest.raises(ValueError, match="factor must be >= 1, got 0"):
        refine_row(logits, 0)


def test_uniform_equals_mean_lora():
    A, B = torch.randn(1, 5, 8, 2), torch.randn(1, 5, 2, 6)
    A_t, B_t = materialize(A, B, uniform_weights(1, 5))
    assert_close(A_t, A[0].mean(0))
    assert_close(B_t, B[0].mean(0))


def test_export_and_merge_conventions():
    d_in, d_out, r = 8, 6, 2
    A_t, B_t = torch.randn(d_in, r), torch.randn(r, d_out)
    W = torch.randn(d_out, d_in)
    x = torch.randn(3, d_in)
    lora_A, lora_B = to_peft_lora(A_t, B_t)
    assert lora_A.shape == (r, d_in) and lora_B.shape == (d_out, r)
    # PEFT: y = x W^T + (x lora_A^T) lora_B^T * alpha / r, alpha = 1
    assert_close(x @ W.T + (x @ lora_A.T) @ lora_B.T / r, x @ W.T + lora_delta(x, A_t, B_t, 1 / r))
    assert_close(x @ merge(W, A_t, B_t, 1 / r).T, x @ W.T + lora_delta(x, A_t, B_t, 1 / r))
    back_A, back_B = from_peft_lora(lora_A, lora_B)
    assert_close(back_A, A_t) and assert_close(back_B, B_t)


@pytest.mark.parametrize("h,T", [(1, 1), (1, 3), (4, 1), (4, 3)])
def test_skill_space_equals_gathered_equals_per_row(h, T):
    N, S, d_in, d_out, r = 5, 4, 16, 8, 2
    A, B = torch.randn(h, S, d_in // h, r), torch.randn(h, S, r, d_out // h)
    x = torch.randn(N, T, d_in)
    w = eval_weights(torch.randn(N, h, S))
    w[2] = 0  # a row with no adapter
    A_tab, B_tab = materialize_many(A, B, w)
    index = torch.arange(N)
    y_skill = apply_skill_space(x, A, B, w, 0.5)
    y_gath = apply_gathered(x, A_tab, B_tab, index, 0.5)
    for n in range(N):
        A_t, B_t = materialize(A, B, w[n])
        assert_close(y_skill[n], lora_delta(x[n], A_t, B_t, 0.5), rtol=1e-5, atol=1e-5)
    assert_close(y_skill, y_gath, rtol=1e-5, atol=1e-5)
    assert_close(apply_materialised(x, A, B, w, 0.5), y_skill, rtol=1e-5, atol=1e-5)
    assert_close(apply_routed(x, A, B, w, 0.5), y_skill, rtol=1e-5, atol=1e-5)
    assert y_skill[2].abs().max() == 0


@pytest.mark.parametrize("T", [1, 3])
def test_materialised_and_skill_space_have_the_same_gradients(T):
    """Training backpropagates through apply_routed into x, the skills and the routing weights:
    both formulations must give the same gradients, not only the same values (float64)."""
    N, h, S, d_in, d_out, r = 4, 2, 3, 8, 6, 2
    g = torch.Generator().manual_seed(7)
    leaves = [torch.randn(N, T, d_in, generator=g, dtype=torch.float64),
              torch.randn(h, S, d_in // h, r, generator=g, dtype=torch.float64),
              torch.randn(h, S, r, d_out // h, generator=g, dtype=torch.float64),
              torch.rand(N, h, S, generator=g, dtype=torch.float64)]
    probe = torch.randn(N, T, d_out, generator=g, dtype=torch.float64)
    grads = []
    for fn in (apply_skill_space, apply_materialised):
        xs = [t.clone().requires_grad_(True) for t in leaves]
        (fn(*xs, 0.5) * probe).sum().backward()
        grads.append([t.grad for t in xs])
    for got, want in zip(grads[1], grads[0], strict=True):
        assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T,path", [(1, "apply_skill_space"), (2, "apply_materialised"), (64, "apply_materialised")])
def test_apply_routed_materialises_rows_of_more_than_one_token(T, path, monkeypatch):
    called = []
    for name in ("apply_skill_space", "apply_materialised"):
        real = getattr(batched, name)
        monkeypatch.setattr(batched, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    A, B = torch.randn(2, 3, 4, 2), torch.randn(2, 3, 2, 3)
    batched.apply_routed(torch.randn(2, T, 8), A, B, torch.rand(2, 2, 3), 1.0)
    assert called == [path]


def test_gathered_table_shared_by_rows():
    A_tab, B_tab = torch.randn(2, 8, 2), torch.randn(2, 2, 4)
    x = torch.randn(3, 1, 8)
    y = apply_gathered(x, A_tab, B_tab, torch.tensor([1, 0, 1]), 1.0)
    assert_close(y[0], x[0] @ A_tab[1] @ B_tab[1])
    assert_close(y[1], x[1] @ A_tab[0] @ B_tab[0])


@pytest.mark.parametrize("G", [1, 3], ids=["one-table", "gathered"])
def test_batched_paths_run_in_the_inputs_dtype_whatever_the_tables(G):
    """float32 tables and skills applied to float64 activations: each path casts them to x's
    dtype (a mixed-dtype bmm raises) and equals the float64 computation."""
    N, T, h, S, d_in, d_out, r = 3, 2, 2, 4, 8, 6, 2
    A, B = torch.randn(h, S, d_in // h, r), torch.randn(h, S, r, d_out // h)
    w = eval_weights(torch.randn(N, h, S))
    x = torch.randn(N, T, d_in, dtype=torch.float64)
    A_tab, B_tab = materialize_many(A, B, w[:G])
    index = torch.arange(N) % G
    got = apply_gathered(x, A_tab, B_tab, index, 0.5)
    want = apply_gathered(x, A_tab.double(), B_tab.double(), index, 0.5)
    assert got.dtype == torch.float64
    assert_close(got, want)
    skill = apply_skill_space(x, A, B, w, 0.5)
    assert skill.dtype == torch.float64
    assert_close(skill, apply_skill_space(x, A.double(), B.double(), w.double(), 0.5))
    mat = apply_materialised(x, A, B, w, 0.5)
    assert mat.dtype == torch.float64
    # float32 tables
    assert_close(mat, apply_materialised(x, A.double(), B.double(), w.double(), 0.5), rtol=1e-5, atol=1e-6)
    for default, one in zip(stack_skills(A, B), stack_skills(A, B, 1.0), strict=True):  # default scale 1
        assert torch.equal(default, one)


# -- combine.py: dtypes, refusals and their messages (mutation audit) ------------------------------
def test_check_heads_message_gives_both_remainders():
    from adapters_store.lora.combine import check_heads

    with pytest.raises(ValueError, match=r"d_in % h = 2, d_out % h = 0"):
        check_heads(10, 12, 4)
    with pytest.raises(ValueError, match=r"d_in % h = 0, d_out % h = 3"):
        check_heads(12, 15, 4)


def test_lora_delta_and_merge_compute_in_the_activations_and_weights_dtype():
    """float32 tables applied to float64 activations (and merged into a float64 weight) are cast
    to float64 first: the result equals the float64 computation."""
    from adapters_store.lora.combine import lora_delta, merge

    g = torch.Generator().manual_seed(3)
    A_t, B_t = torch.randn(6, 2, generator=g), torch.randn(2, 4, generator=g)
    x, W = torch.randn(3, 6, dtype=torch.float64, generator=g), torch.randn(4, 6, dtype=torch.float64, generator=g)
    got = lora_delta(x, A_t, B_t, 0.5)
    assert got.dtype == torch.float64
    assert_close(got, (x @ A_t.double()) @ B_t.double() * 0.5)
    merged = merge(W, A_t, B_t, 0.5)
    assert merged.dtype == torch.float64
    assert_close(merged, W + 0.5 * (A_t.double() @ B_t.double()).T)


def test_materialize_takes_float64_routing_weights_for_float32_skills():
    """Routing weights in another dtype than the skills are cast to the skills' dtype."""
    from adapters_store.lora.combine import materialize_many, materialize_stacked

    g = torch.Generator().manual_seed(4)
    A, B = torch.randn(2, 3, 4, 2, generator=g), torch.randn(2, 3, 2, 5, generator=g)
    w = torch.rand(1, 2, 3, dtype=torch.float64, generator=g)
    A_t, B_t = materialize_many(A, B, w)
    want_A, want_B = materialize_many(A, B, w.float())
    assert A_t.dtype == torch.float32 and torch.equal(A_t, want_A) and torch.equal(B_t, want_B)
    A_s, B_s = materialize_stacked(A.unsqueeze(0), B.unsqueeze(0), w)
    assert A_s.dtype == torch.float32 and torch.equal(A_s, want_A) and torch.equal(B_s, want_B)


def test_combine_refusals_name_the_shapes():
    from adapters_store.lora.combine import materialize_many, refine_heads

    A = torch.zeros(2, 3, 4, 2)
    bad_B = torch.zeros(2, 4, 2, 5)  # another skill count; w fits A
    with pytest.raises(ValueError, match=r"shape mismatch: A \(2, 3, 4, 2\), B \(2, 4, 2, 5\), w \(1, 2, 3\)"):
        materialize_many(A, bad_B, torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"shape mismatch: A \(2, 3, 4, 2\), B \(2, 4, 2, 5\)$"):
        refine_heads(A, bad_B, 4)


def test_refine_heads_to_the_same_count_is_the_identity():
    from adapters_store.lora.combine import refine_heads

    g = torch.Generator().manual_seed(5)
    A, B = torch.randn(2, 3, 4, 2, generator=g), torch.randn(2, 3, 2, 6, generator=g)
    A_f, B_f = refine_heads(A, B, 2)
    assert torch.equal(A_f, A) and torch.equal(B_f, B)
