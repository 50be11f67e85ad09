"""The native per-row LoRA kernel (server/engines/native/kernels/lora_kernel.py, lora_rows.cpp) against
torch: every storage dtype, gathered slots, strided rows, members with gaps, ranks with and
without a compiled-in specialisation; and how the setting resolves where it cannot run."""

from __future__ import annotations

import pytest
import torch

from server.engines.native.kernels import lora_kernel
from server.engines.native.tuning import resolve_switch

pytestmark = pytest.mark.skipif(lora_kernel.load() is None, reason=f"no LoRA kernel: {lora_kernel.error()}")

def resolve(setting: str, *args, **kwargs) -> bool:
    """The lora_kernel switch as the runner resolves it (tuning.resolve_switch over lora_kernel.why_not)."""
    return resolve_switch("lora_kernel", setting, lambda: lora_kernel.why_not(*args, **kwargs))



def _tables(slots, d_in, members, rank, d_out, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = len(members) * rank
    A = torch.randn(slots, d_in, k, generator=g) * 0.1
    B = torch.zeros(slots, k, d_out)
    for j, (start, width) in enumerate(members):
        B[:, j * rank : (j + 1) * rank, start : start + width] = torch.randn(slots, rank, width, generator=g) * 0.1
    return A.to(dtype), B.to(dtype)


def _want(x, out, A, B, slots, n):
    idx = torch.arange(n) if slots is None else slots[:n]
    u = torch.bmm(x[:n].double().unsqueeze(1), A[idx].double())
    return out[:n].double() + torch.bmm(u, B[idx].double()).squeeze(1)


@pytest.mark.parametrize("rank", [8, 3, 16])
@pytest.mark.parametrize("tables", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gathered", [False, True])
def test_kernel_equals_torch(rank, tables, rows, gathered):
    d_in, d_out, slots, n = 37, 50, 6, 5  # d_in not a multiple of 4: the remainder loop runs
    members = [(0, 20), (27, 9), (40, 10)]  # columns 20..27 belong to no member: left alone
    A, B = _tables(slots, d_in, members, rank, d_out, tables)
    args = lora_kernel.TableArgs(A, B, members, rank, d_in, d_out)
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(n + 2, d_in + 11, generator=g).to(rows)
    x = wide[:, 3 : 3 + d_in]  # row stride != d_in
    out = torch.randn(n + 2, d_out, generator=g).to(rows)
    slot_t = torch.tensor([4, 0, 5, 2, 4, 1, 3]) if gathered else None
    before = out.clone()
    want = _want(x, out, A, B, slot_t, n)
    args.rows(lora_kernel.load(), x, out, n, slot_t)
    tol = 1e-5 if rows == torch.float32 else 2e-2  # a bf16 output is rounded once
    torch.testing.assert_close(out[:n].double(), want, atol=tol, rtol=tol)
    assert torch.equal(out[n:], before[n:]), "rows past n are not touched"
    assert torch.equal(out[:, 20:27], before[:, 20:27]), "columns of no member are not touched"


def test_listed_rows_take_their_own_slots_and_others_stay():
    """The decode rows and short prompt chunks of a step in one call: rows named by index."""
    members = [(0, 12)]
    A, B = _tables(5, 16, members, 4, 12, torch.float32)
    args = lora_kernel.TableArgs(A, B, members, 4, 16, 12)
    x, out = torch.randn(9, 16), torch.randn(9, 12)
    rows, slots = torch.tensor([0, 1, 5, 6, 7]), torch.tensor([3, 0, 4, 4, 4])
    want = out.double().clone()
    for t, s in zip(rows.tolist(), slots.tolist(), strict=True):
        want[t] += (x[t].double() @ A[s].double()) @ B[s].double()
    args.rows(lora_kernel.load(), x, out, 5, slots, rows, row_end=8)
    torch.testing.assert_close(out.double(), want)
    with pytest.raises(ValueError, match="rows below 10"):
        args.rows(lora_kernel.load(), x, out, 5, slots, rows, row_end=10)


def test_a_row_does_not_depend_on_its_batch():
    members = [(0, 24)]
    A, B = _tables(4, 40, members, 8, 24, torch.bfloat16)
    args = lora_kernel.TableArgs(A, B, members, 8, 40, 24)
    x = torch.randn(4, 40).bfloat16()
    alone = torch.zeros(1, 24).bfloat16()
    args.rows(lora_kernel.load(), x[2:3], alone, 1, torch.tensor([2]))
    together = torch.zeros(4, 24).bfloat16()
    args.rows(lora_kernel.load(), x, together, 4, None)
    assert torch.equal(together[2], alone[0])


# (d_in, members, rank, d_out): the shipped kind of shape (multiples of 8 everywhere), then an odd
# d_in, a rank without a compiled-in specialisation and widths that are no multiple of 8
SHAPES = [(72, [(0, 24), (24, 8), (32, 8)], 8, 40), (37, [(0, 20), (27, 9), (40, 43)], 3, 83)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=["whole-vectors", "tails"])
def test_prompt_runs_and_threads_change_no_token(dtype, threads, shape):
    """Decode rows and runs of one slot's tokens (1 to 9, as prompt chunks arrive), shared out over
    one or two OpenMP threads: every token equals torch, and equals itself computed alone, bit for bit."""
    d_in, members, rank, d_out = shape
    A, B = _tables(6, d_in, members, rank, d_out, dtype, seed=3)
    args = lora_kernel.TableArgs(A, B, members, rank, d_in, d_out)
    fn = lora_kernel.load()
    slots = [0, 1, 2] + [3] * 9 + [4] * 4 + [5] * 3 + [1] * 5 + [2] + [0] * 6  # decode rows, then runs
    n = len(slots)
    x = torch.randn(n, d_in).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.randn(n, d_out).to(dtype)
        before = out.clone()
        slot_t = torch.tensor(slots)
        args.rows(fn, x, out, n, slot_t)
        for t, s in enumerate(slots):
            alone = before[t : t + 1].clone()
            args.rows(fn, x[t : t + 1], alone, 1, slot_t[t : t + 1])
            assert torch.equal(out[t], alone[0]), f"token {t} (slot {s}) differs from itself alone"
    finally:
        torch.set_num_threads(previous)
    want = _want(x, before, A, B, slot_t, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_bad_arguments_are_refused_before_the_kernel_runs():
    members = [(0, 8)]
    A, B = _tables(2, 4, members, 2, 8, torch.float32)
    args = lora_kernel.TableArgs(A, B, members, 2, 4, 8)
    fn = lora_kernel.load()
    with pytest.raises(ValueError, match="rows below 2"):
        args.rows(fn, torch.zeros(4, 2).t(), torch.zeros(2, 8), 2, None)
    with pytest.raises(ValueError, match="rows below 3"):
        args.rows(fn, torch.zeros(2, 4), torch.zeros(2, 8), 3, None)
    with pytest.raises(ValueError, match="an entry per row"):
        args.rows(fn, torch.zeros(2, 4), torch.zeros(2, 8), 2, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="float32/bfloat16 rows"):
        args.rows(fn, torch.zeros(2, 4, dtype=torch.float16), torch.zeros(2, 8), 2, None)
    with pytest.raises(ValueError, match="do not match"):
        lora_kernel.TableArgs(A, B, members + [(8, 0)], 2, 4, 8)
    with pytest.raises(ValueError, match="contiguous"):
        lora_kernel.TableArgs(A.transpose(1, 2), B, members, 2, 4, 8)


def test_setting_resolves_where_the_kernel_cannot_run():
    cpu = torch.device("cpu")
    assert resolve("auto", cpu) and not resolve("off", cpu)
    assert not resolve("auto", torch.device("cuda"))
    assert not resolve("auto", cpu, torch.float16)
    assert not resolve("auto", cpu, rank=65)
    with pytest.raises(ValueError, match="CPUs only"):
        resolve("on", torch.device("cuda"))
    with pytest.raises(ValueError, match="float16"):
        resolve("on", cpu, torch.float16)
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve("yes", cpu)


def unloaded(monkeypatch, kernel):
    """The kernel loads afresh in this test; what it had loaded is back after it."""
    monkeypatch.setattr(kernel, "_fn", None)
    monkeypatch.setattr(kernel, "_error", None)


def test_no_compiler_falls_back_under_auto_and_fails_under_on(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    unloaded(monkeypatch, lora_kernel.KERNEL)
    cpu = torch.device("cpu")
    assert resolve("auto", cpu) is False
    assert "no-such-compiler" in (lora_kernel.error() or "")
    with pytest.raises(ValueError, match="unavailable"):
        resolve("on", cpu)


def test_a_broken_source_is_reported_not_loaded(monkeypatch, tmp_path):
    bad = tmp_path / "lora_rows.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(lora_kernel.KERNEL, "source", bad)
    monkeypatch.setenv("POLYSERVE_HOME", str(tmp_path))
    unloaded(monkeypatch, lora_kernel.KERNEL)
    assert lora_kernel.load() is None
    assert "failed" in (lora_kernel.error() or "")
    assert not list((tmp_path / "kernels").glob("*.so")), "no library left behind"
