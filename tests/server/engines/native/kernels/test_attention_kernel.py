"""The native decode-attention kernel (server/engines/native/kernels/attention_kernel.py,
decode_attention.cpp) against a float64 reference: every storage dtype, grouped-query shapes,
head dims with and without a compiled-in specialisation, rows in any slots with their own
lengths; a row's output does not depend on its batch; and how the setting resolves where it
cannot run."""

from __future__ import annotations

import pytest
import torch

from server.engines.native.kernels import attention_kernel
from server.engines.native.tuning import resolve_switch

pytestmark = pytest.mark.skipif(attention_kernel.KERNEL.load() is None,
                                reason=f"no decode attention kernel: {attention_kernel.KERNEL.error()}")

def resolve(setting: str, *args, **kwargs) -> bool:
    """The attention_kernel switch as the runner resolves it (tuning.resolve_switch over attention_kernel.why_not)."""
    return resolve_switch("attention_kernel", setting, lambda: attention_kernel.why_not(*args, **kwargs))



def _cache(slots, kvh, cap, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, kvh, cap, hd, generator=g).to(dtype),
            torch.randn(slots, kvh, cap, hd, generator=g).to(dtype))


def _want(q, K, V, slots, ends, scale):
    """float64 softmax attention of each row over its own slot's first ends[i] positions."""
    n, heads, hd = q.shape
    rep = heads // K.shape[1]
    out = torch.empty(n, heads, hd, dtype=torch.float64)
    for i in range(n):
        for h in range(heads):
            keys = K[slots[i], h // rep, : ends[i]].double()
            values = V[slots[i], h // rep, : ends[i]].double()
            p = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = p @ values
    return out.reshape(n, heads * hd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,hd", [(9, 3, 64), (4, 4, 128), (8, 2, 24), (16, 1, 64)])
def test_kernel_equals_the_reference(dtype, heads, kvh, hd):
    K, V = _cache(7, kvh, 40, hd, dtype)
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([5, 0, 3, 6])
    ends = torch.tensor([40, 1, 17, 9])  # the whole cache, a single position, and in between
    q = torch.randn(4, heads, hd, generator=g).to(dtype)
    out = torch.full((4, heads * hd), float("nan"), dtype=dtype)
    attention_kernel.decode_attention(q, K, V, slots, ends, hd**-0.5, out)
    want = _want(q, K, V, slots.tolist(), ends.tolist(), hd**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_a_row_is_the_same_alone_as_in_any_batch():
    K, V = _cache(6, 3, 64, 64, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(5, 9, 64, generator=g).to(torch.bfloat16)
    slots, ends = torch.tensor([4, 1, 0, 5, 2]), torch.tensor([64, 3, 50, 12, 33])
    together = torch.empty(5, 9 * 64, dtype=torch.bfloat16)
    attention_kernel.decode_attention(q, K, V, slots, ends, 0.125, together)
    for i in range(5):
        alone = torch.empty(1, 9 * 64, dtype=torch.bfloat16)
        attention_kernel.decode_attention(q[i : i + 1].contiguous(), K, V, slots[i : i + 1], ends[i : i + 1], 0.125,
                                          alone)
        assert torch.equal(alone[0], together[i])


def test_bad_shapes_are_refused_before_the_kernel_reads_anything():
    K, V = _cache(2, 2, 8, 16, torch.float32)
    q = torch.randn(1, 4, 16)
    out = torch.empty(1, 64)
    one, zero = torch.tensor([1]), torch.tensor([0])
    with pytest.raises(ValueError, match="no position"):
        attention_kernel.decode_attention(q, K, V, one, zero, 0.25, out)  # a row with no position
    with pytest.raises(ValueError, match="int64"):
        attention_kernel.decode_attention(q, K, V, one.int(), one, 0.25, out)
    with pytest.raises(ValueError, match="decode attention kernel"):
        attention_kernel.decode_attention(q, K, V, one, one, 0.25, torch.empty(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="decode attention kernel"):
        attention_kernel.decode_attention(torch.randn(1, 3, 16), K, V, one, one, 0.25, torch.empty(1, 48))


def test_the_setting_resolves_by_device_dtype_and_shape():
    cpu = torch.device("cpu")
    assert resolve("auto", cpu, torch.bfloat16, 9, 3, 64)
    assert not resolve("off", cpu, torch.bfloat16, 9, 3, 64)
    assert not resolve("auto", torch.device("cuda"), torch.bfloat16, 9, 3, 64)
    assert not resolve("auto", cpu, torch.float16, 9, 3, 64)
    assert not resolve("auto", cpu, torch.float32, 32, 1, 64)  # 32 query heads a kv head
    assert not resolve("auto", cpu, torch.float32, 2, 1, 512)
    with pytest.raises(ValueError, match="head dims"):
        resolve("on", cpu, torch.float32, 2, 1, 512)
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve("yes", cpu, torch.float32, 2, 1, 64)


def test_no_compiler_falls_back_under_auto_and_fails_under_on(monkeypatch, tmp_path):
    monkeypatch.setattr(attention_kernel.KERNEL, "_fn", None)  # loads afresh here, restored after
    monkeypatch.setattr(attention_kernel.KERNEL, "_error", None)
    monkeypatch.setenv("POLYSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu = torch.device("cpu")
    assert resolve("auto", cpu, torch.float32, 4, 2, 64) is False
    with pytest.raises(ValueError, match="unavailable"):
        resolve("on", cpu, torch.float32, 4, 2, 64)


def test_the_wheel_ships_every_file_the_native_kernels_compile():
    """An installed server builds its kernels from package data: each source and the headers it
    includes must match the package-data globs (pyproject.toml), or it falls back to torch ops."""
    import tomllib
    from pathlib import Path

    from server.engines.native.kernels import lora_kernel, quant_linear

    root = Path(__file__).resolve().parents[5]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["server"]
    for kernel in (lora_kernel.KERNEL, attention_kernel.KERNEL, quant_linear.KERNEL):
        for path in (kernel.source, *kernel.headers):
            rel = path.relative_to(root / "server")
            assert any(rel.match(g) for g in globs), f"{rel} is not in the wheel ({globs})"
        local = [line.split('"')[1] for line in kernel.source.read_text().splitlines() if line.startswith('#include "')]
        assert sorted(local) == sorted(h.name for h in kernel.headers), "a local include the build key misses"


def test_dynamic_steps_on_cuda_leave_cudnn_attention_out_and_restore_it():
    # cuDNN plans per new shape and a dynamic step's shapes change every step; the switch is
    # torch's process-wide flag, so it must come back after the step
    from server.engines.native.model.attention import cuda_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with cuda_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with cuda_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_keys_and_values_are_written_at_each_rows_last_position_from_strided_rows(dtype):
    """The call that writes each row's k, v (views of one wider q|k|v row, as the runner passes
    them) equals writing them first and attending with a contiguous q."""
    heads, kvh, hd = 9, 3, 64
    K, V = _cache(6, kvh, 32, hd, dtype)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, (heads + 2 * kvh) * hd, generator=g).to(dtype)
    q = qkv[:, : heads * hd].view(3, heads, hd)
    k = qkv[:, heads * hd : (heads + kvh) * hd].view(3, kvh, hd)
    v = qkv[:, (heads + kvh) * hd :].view(3, kvh, hd)
    slots, ends = torch.tensor([4, 0, 2]), torch.tensor([7, 1, 32])
    K2, V2 = K.clone(), V.clone()
    for i, (s, e) in enumerate(zip(slots.tolist(), ends.tolist(), strict=True)):
        K2[s, :, e - 1], V2[s, :, e - 1] = k[i], v[i]
    want = torch.empty(3, heads * hd, dtype=dtype)
    attention_kernel.decode_attention(q.contiguous(), K2, V2, slots, ends, 0.125, want)
    got = torch.empty(3, heads * hd, dtype=dtype)
    attention_kernel.decode_attention(q, K, V, slots, ends, 0.125, got, k, v)
    assert torch.equal(got, want)
    assert torch.equal(K, K2) and torch.equal(V, V2)  # written where the row's new position is, nowhere else


def test_new_keys_need_values_and_the_caches_dtype():
    K, V = _cache(2, 2, 8, 16, torch.float32)
    q, out, one = torch.randn(1, 4, 16), torch.empty(1, 64), torch.tensor([1])
    k = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="new keys/values"):
        attention_kernel.decode_attention(q, K, V, one, one, 0.25, out, k, None)
    with pytest.raises(ValueError, match="new keys/values"):
        attention_kernel.decode_attention(q, K, V, one, one, 0.25, out, k.bfloat16(), k.bfloat16())
