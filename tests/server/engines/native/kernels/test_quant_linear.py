"""The weight kernel (server/engines/native/kernels/quant_linear.py, quant_linear.cpp): linears read from
GGUF blocks against a float64 reference of the weights the blocks stand for, every row-count tail
and column tail, bias and the fused epilogues; a row's result bit-equal whatever its batch and the
threads; the Llama runner on a backbone with blocks equal to the model's forward; how the setting
resolves where it cannot run. The kernel's checks run on each build (quant_linear.BUILDS): on an
AVX-512 CPU the AVX-512 path and the AVX2 path that CPUs without AVX-512 run."""

from __future__ import annotations

import logging

import pytest
import torch

from adapters_store.backbone.gguf_blocks import dequantize, quantize
from adapters_store.backbone.tiny import tiny_llama
from server.engines.native.kernels import quant_linear
from server.engines.native.kernels.quant_linear import QuantLinear
from server.engines.native.model.llama import Linear
from server.engines.native.model.model_runner import build_model_runner
from server.engines.native.tuning import Tuning, resolve_switch
from tests.server.engines.native.model.test_model_runner import check_against
from tests.support.kernel_builds import builds_fixture

pytestmark = pytest.mark.skipif(quant_linear.KERNEL.load() is None,
                                reason=f"no weight kernel: {quant_linear.KERNEL.error()}")

N, K = 31, 96  # two panels of 12 columns and a tail of 7; three blocks a row


build = builds_fixture(quant_linear)  # QuantLinears made in a test that takes it call each build

def resolve(setting: str, *args, **kwargs) -> bool:
    """The weight_kernel switch as the runner resolves it (tuning.resolve_switch over quant_linear.why_not)."""
    return resolve_switch("weight_kernel", setting, lambda: quant_linear.why_not(*args, **kwargs))



def _weight(fmt: str, n: int = N, k: int = K, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = quantize(torch.randn(n, k, generator=g), fmt)
    return q, dequantize(q)


def _linear(fmt: str, bias: bool = False, max_rows: int = 64):
    q, w = _weight(fmt)
    b = torch.randn(N, generator=torch.Generator().manual_seed(9)) if bias else None
    return QuantLinear(q, b, Linear(w, b, torch.float32, packed=False), max_rows), w, b


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 13])
def test_kernel_equals_the_float64_reference(fmt, rows, build):
    lin, w, _ = _linear(fmt)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ w.double().T
    torch.testing.assert_close(lin(x).double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_a_long_row_reads_every_blocks_scales(fmt, build):
    """21 blocks a row: a column's scales convert a vector at a time (16 or 8) and then one by one;
    every block's d (and m) must reach its own weights."""
    k = 21 * 32
    q, w = _weight(fmt, k=k, seed=3)
    lin = QuantLinear(q, None, Linear(w, None, torch.float32, packed=False), 64)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(lin(x).double(), x.double() @ w.double().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["swish", "add", "mul"])
def test_bias_and_the_fused_epilogues(op, build):
    lin, w, b = _linear("Q4_1", bias=True)
    g = torch.Generator().manual_seed(3)
    x, other = torch.randn(6, K, generator=g), torch.randn(6, N, generator=g)
    y = x.double() @ w.double().T + b.double()
    if op == "swish":
        got, want = lin(x, "swish"), torch.nn.functional.silu(y)
    else:
        got, want = lin.binary(x, other, op), (y + other.double() if op == "add" else y * other.double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got.shape == (6, N) and got.data_ptr() != other.data_ptr()  # a new tensor, as oneDNN's


def test_strided_rows_are_read_by_their_stride(build):
    lin, _, _ = _linear("Q8_0")
    wide = torch.randn(5, 2 * K, generator=torch.Generator().manual_seed(4))
    x = wide[:, K:]  # rows 2K apart
    torch.testing.assert_close(lin(x), lin(x.contiguous()), atol=0, rtol=0)


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(build):
    lin, _, _ = _linear("Q4_1", bias=True)
    x = torch.randn(13, K, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([lin(x[i : i + 1]) for i in range(13)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (2, 3, 4, 5, 8, 13):
                assert torch.equal(lin(x[:m]), alone[:m]), (threads, m)
    finally:
        torch.set_num_threads(before)


def test_the_builds_are_separate_libraries():
    native, avx2 = quant_linear.BUILDS["native"], quant_linear.BUILDS["avx2"]
    assert native is quant_linear.KERNEL and avx2.flags == ("-mno-avx512f",)
    assert native.load() is not None and avx2.load() is not None
    assert native.load() is not avx2.load()


def test_more_rows_than_max_rows_go_to_the_float32_linear():
    lin, _, _ = _linear("Q4_1", max_rows=4)
    calls = []

    class Dense:
        def __call__(self, x, act="none"):
            calls.append(("call", x.shape[0], act))
            return torch.zeros(x.shape[0], N)

        def binary(self, x, other, op):
            calls.append(("binary", x.shape[0], op))
            return torch.zeros(x.shape[0], N)

    lin.dense = Dense()
    x = torch.randn(5, K)
    lin(x[:4])
    lin(x)
    lin.binary(x, torch.zeros(5, N), "add")
    assert calls == [("call", 5, "none"), ("binary", 5, "add")]


def test_bad_shapes_and_arguments_are_refused():
    lin, _, _ = _linear("Q4_1")
    with pytest.raises(ValueError, match="wants"):
        lin(torch.randn(2, K + 32))
    with pytest.raises(ValueError, match="wants"):
        lin(torch.randn(2, K, dtype=torch.float64))
    with pytest.raises(ValueError, match="other"):
        lin.binary(torch.randn(2, K), torch.randn(3, N), "add")
    fn = quant_linear.load()
    x, out = torch.randn(1, K), torch.empty(1, N)
    q, _ = _weight("Q4_1")
    # an unknown format, and K not a multiple of the block: the kernel answers -1, reads nothing
    assert fn(7, 1, K, x.data_ptr(), K, q.blocks.data_ptr(), N, 0, out.data_ptr(), N, 0, 0, 0) == -1
    assert fn(0, 1, K - 8, x.data_ptr(), K, q.blocks.data_ptr(), N, 0, out.data_ptr(), N, 0, 0, 0) == -1
    assert fn(0, 1, K, x.data_ptr(), K, q.blocks.data_ptr(), N, 0, out.data_ptr(), N, 2, 0, 0) == -1  # add, no other


def _gguf_model(tmp_path):
    from tests.support.gguf_file import write_gguf

    pytest.importorskip("gguf")
    model = tiny_llama(seed=0)
    write_gguf(model, tmp_path)
    return model


def test_the_llama_runner_on_blocks_equals_the_models_forward(tmp_path):
    model = _gguf_model(tmp_path)
    on = build_model_runner(model, slots=4, tuning=Tuning(native_executor="llama", weight_kernel="on"))
    assert on.weight_kernel
    layer = on.layers[0]
    assert all(isinstance(lin, QuantLinear) for lin in (layer.qkv, layer.o, layer.gate, layer.up, layer.down,
                                                         on.lm_head))
    check_against(model, on, 259, atol=1e-5)
    off = build_model_runner(model, slots=4, tuning=Tuning(native_executor="llama", weight_kernel="off"))
    assert not off.weight_kernel and isinstance(off.layers[0].qkv, Linear)


def test_a_served_model_reads_every_linear_from_the_blocks_with_its_adapted_ones_wrapped(tmp_path, caplog):
    """A server wraps the adapted linears (RoutedModel) before it builds the runner: their frozen
    weights must still be found by name, not served from the float32 copies."""
    from adapters_store.lora.inject import RoutedModel
    from adapters_store.lora.spec import InventorySpec

    model = _gguf_model(tmp_path)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")
    rm = RoutedModel(model, InventorySpec(n_skills=2, n_heads=2, rank=4, target_modules=targets))
    with caplog.at_level(logging.INFO, logger="polyserve.engine"):
        on = build_model_runner(model, rm, slots=4, tuning=Tuning(native_executor="llama", weight_kernel="on"))
    layer = on.layers[0]
    assert all(isinstance(lin, QuantLinear) for lin in (layer.qkv, layer.o, layer.gate, layer.up, layer.down,
                                                         on.lm_head))
    assert "15 of the model's 15 linears read their GGUF blocks" in caplog.text
    check_against(model, on, 259, atol=1e-5)


def test_the_setting_resolves_by_device_dtype_and_blocks(tmp_path, monkeypatch):
    from server.engines.native.kernels import quant_linear_bf16

    cpu = torch.device("cpu")
    blocks = {"w": _weight("Q4_1")[0]}
    assert resolve("off", cpu, torch.float32, blocks) is False
    assert resolve("auto", cpu, torch.float32, blocks) is True
    assert resolve("auto", cpu, torch.float32, {}) is False
    with pytest.raises(ValueError, match="no GGUF blocks"):
        resolve("on", cpu, torch.float32, {})
    with pytest.raises(ValueError, match="serves float16"):
        resolve("on", cpu, torch.float16, blocks)
    # bf16 takes the bf16 build; a CPU without AVX512_BF16 keeps dense GEMMs, without trying to build it
    monkeypatch.setattr(quant_linear_bf16, "cpu_has_avx512_bf16", lambda: False)
    monkeypatch.setattr(quant_linear_bf16, "_denied", None)
    monkeypatch.setattr(quant_linear_bf16, "_granted", False)
    monkeypatch.setattr(quant_linear_bf16.KERNEL, "load", lambda: pytest.fail("built without AVX512_BF16"))
    assert resolve("auto", cpu, torch.bfloat16, blocks) is False
    with pytest.raises(ValueError, match=r"bf16 build is unavailable: the CPU has no AVX512_BF16"):
        resolve("on", cpu, torch.bfloat16, blocks)
    with pytest.raises(ValueError, match="CPUs only"):
        resolve("on", torch.device("cuda"), torch.float32, blocks)
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve("yes", cpu, torch.float32, blocks)
    # a runner asked for "on" where the backbone has no blocks (the tiny model, no GGUF) fails at build
    with pytest.raises(ValueError, match="no GGUF blocks"):
        build_model_runner(tiny_llama(seed=0), slots=2, tuning=Tuning(native_executor="llama", weight_kernel="on"))
    with pytest.raises(ValueError, match="no AVX512_BF16"):
        build_model_runner(_gguf_model(tmp_path), slots=2, dtype=torch.bfloat16,
                           tuning=Tuning(native_executor="llama", weight_kernel="on"))


def test_no_compiler_falls_back_under_auto_and_fails_under_on(monkeypatch, tmp_path):
    monkeypatch.setattr(quant_linear.KERNEL, "_fn", None)  # loads afresh here, restored after
    monkeypatch.setattr(quant_linear.KERNEL, "_error", None)
    monkeypatch.setenv("POLYSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu, blocks = torch.device("cpu"), {"w": _weight("Q8_0")[0]}
    assert resolve("auto", cpu, torch.float32, blocks) is False
    with pytest.raises(ValueError, match="unavailable"):
        resolve("on", cpu, torch.float32, blocks)
