"""The native elementwise kernel (server/engines/native/kernels/elementwise_kernel.py, elementwise.cpp):
RMSNorm against transformers' Llama formula, the rotary embedding against the complex
multiplication it replaces, rows independent of their batch, bad input refused before the kernel
writes, and the Llama runner with it equal to the runner with torch ops."""

from __future__ import annotations

import pytest
import torch

from server.engines.native.kernels import elementwise_kernel
from server.engines.native.tuning import resolve_switch

pytestmark = pytest.mark.skipif(elementwise_kernel.NORM.load() is None,
                                reason=f"no elementwise kernel: {elementwise_kernel.NORM.error()}")

def resolve(setting: str, *args, **kwargs) -> bool:
    """The elementwise_kernel switch as the runner resolves it (tuning.resolve_switch over
    elementwise_kernel.why_not)."""
    return resolve_switch("elementwise_kernel", setting, lambda: elementwise_kernel.why_not(*args, **kwargs))



def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, back to the input dtype, times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_llama_rmsnorm(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    w = (torch.randn(576, generator=g) * 0.5 + 1).to(dtype)
    got = elementwise_kernel.rms_norm(x, w, 1e-5)
    want = _hf_rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:  # the same roundings in the same places: equal but for a rare last bit
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
        assert (got != want).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_rms_norm_reads_strided_rows_and_each_row_alone():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 100, generator=g).to(torch.bfloat16)
    x, w = wide[:, 10:74], torch.randn(64, generator=g).to(torch.bfloat16)
    together = elementwise_kernel.rms_norm(x, w, 1e-6)
    assert torch.equal(together, elementwise_kernel.rms_norm(x.contiguous(), w, 1e-6))
    for i in range(5):
        assert torch.equal(elementwise_kernel.rms_norm(x[i : i + 1], w, 1e-6)[0], together[i])


def test_rms_norm_refuses_what_it_cannot_read():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="rms_norm"):
        elementwise_kernel.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)  # dtypes differ
    with pytest.raises(ValueError, match="rms_norm"):
        elementwise_kernel.rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="rms_norm"):
        elementwise_kernel.rms_norm(x.t(), torch.ones(3), 1e-6)  # columns not contiguous


def _table(positions: int, hd: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.full((positions, hd // 2), 1.5), torch.outer(torch.arange(positions).float(), inv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_the_complex_multiplication_in_place(dtype):
    heads, kvh, hd = 9, 3, 64
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(6, (heads + 2 * kvh) * hd, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 17, 3, 99, 42])
    table = _table(128, hd)
    n = heads + kvh
    qk = torch.view_as_complex(qkv[:, : n * hd].float().view(6, n, hd // 2, 2))
    want = torch.view_as_real(qk * table[positions][:, None]).reshape(6, n * hd).to(dtype)
    v = qkv[:, n * hd :].clone()
    elementwise_kernel.rope_(qkv, n, hd, positions, table)
    tol = 1e-6 if dtype == torch.float32 else 2**-7  # float32 sums in another order; bf16: one rounding
    torch.testing.assert_close(qkv[:, : n * hd], want, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, n * hd :], v)  # v untouched


def test_rope_refuses_a_position_past_the_table_and_writes_nothing():
    qkv = torch.randn(2, 4 * 8)
    before = qkv.clone()
    with pytest.raises(ValueError, match="past the table"):
        elementwise_kernel.rope_(qkv, 4, 8, torch.tensor([1, 16]), _table(16, 8))
    assert torch.equal(qkv, before)
    with pytest.raises(ValueError, match="rope"):
        elementwise_kernel.rope_(qkv, 4, 8, torch.tensor([1, 2], dtype=torch.int32), _table(16, 8))


def test_resolve():
    cpu = torch.device("cpu")
    assert resolve("auto", cpu, torch.bfloat16)
    assert not resolve("off", cpu, torch.bfloat16)
    assert not resolve("auto", cpu, torch.float16)
    with pytest.raises(ValueError, match="float16"):
        resolve("on", cpu, torch.float16)
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve("yes", cpu, torch.float32)
