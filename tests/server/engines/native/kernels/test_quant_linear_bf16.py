"""The weight kernel's bf16 build (server/engines/native/kernels/quant_linear_bf16.py, .cpp): a tile holds the
bf16 model's weights bit for bit (one-hot rows read them back), results against a float64 reference of
the bf16 weights for every row count (one group of rows, several, a tail), bias and the fused
epilogues; a row's result bit-equal whatever its batch and the threads; the Llama runner in bf16 on
the blocks against its dense bf16 self; what it refuses. The kernel's checks run on each build
(quant_linear_bf16.BUILDS): on a CPU with AMX the AMX path and the AVX512_BF16 path that CPUs without
AMX run; elsewhere the latter twice. Skipped on a CPU without AVX512_BF16 (the library does not
compile there: the runner keeps oneDNN's bf16 GEMMs)."""

from __future__ import annotations

import pytest
import torch

from adapters_store.backbone.gguf_blocks import dequantize, quantize
from adapters_store.backbone.hardware import cpu_has_amx
from adapters_store.backbone.tiny import tiny_llama
from server.engines.native.kernels import quant_linear, quant_linear_bf16
from server.engines.native.kernels.quant_linear import QuantLinear
from server.engines.native.model.llama import Linear
from server.engines.native.model.model_runner import build_model_runner
from server.engines.native.tuning import Tuning, resolve_switch
from tests.server.engines.native.model.test_model_runner import drive
from tests.support.kernel_builds import builds_fixture

pytestmark = pytest.mark.skipif(quant_linear_bf16.load() is None,
                                reason=f"no bf16 weight kernel: {quant_linear_bf16.error()}")

N, K = 64, 96  # two panels of 32 columns; three blocks a row
BF16_ULP = 2.0**-8  # a bf16 result's rounding, relative


build = builds_fixture(quant_linear_bf16)  # QuantLinears made in a test that takes it call each build

def resolve(setting: str, *args, **kwargs) -> bool:
    """The weight_kernel switch as the runner resolves it (tuning.resolve_switch over quant_linear.why_not)."""
    return resolve_switch("weight_kernel", setting, lambda: quant_linear.why_not(*args, **kwargs))



def _weight(fmt: str, n: int = N, k: int = K, seed: int = 0):
    q = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), fmt)
    return q, dequantize(q).to(torch.bfloat16)


def _linear(fmt: str, bias: bool = False, n: int = N, k: int = K, max_rows: int = 64):
    q, w = _weight(fmt, n, k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(9)) if bias else None
    dense = Linear(w, b, torch.bfloat16, packed=False)
    return QuantLinear(q, b, dense, max_rows, torch.bfloat16), w, b


def _rows(m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _near(got: torch.Tensor, want: torch.Tensor) -> None:
    """got (bf16) is want (float64) rounded once to bf16, give or take a float32 sum's last bits."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=BF16_ULP, atol=1e-4)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_a_tile_holds_the_bf16_models_weights_bit_for_bit(fmt, build):
    """One-hot rows pick out single weights: y[r, n] = w[n, k_r] exactly (one product with 1, the
    rest zeros). 21 blocks: every block's scales, both halves of each tile's columns."""
    k = 21 * 32
    lin, w, _ = _linear(fmt, k=k)
    eye = torch.eye(k, dtype=torch.bfloat16)
    got = torch.cat([lin(eye[i : i + 16]) for i in range(0, k, 16)])  # (k, N): got[k, n] = w[n, k]
    assert torch.equal(got, w.T)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 15, 16, 17, 33])
def test_kernel_equals_the_float64_reference_of_the_bf16_weights(fmt, rows, build):
    lin, w, _ = _linear(fmt)
    x = _rows(rows, seed=rows)
    _near(lin(x), x.double() @ w.double().T)


@pytest.mark.parametrize("op", ["swish", "add", "mul"])
@pytest.mark.parametrize("rows", [3, 20])
def test_bias_and_the_fused_epilogues(op, rows, build):
    lin, w, b = _linear("Q4_1", bias=True)
    x, other = _rows(rows, seed=3), _rows(rows, k=N, seed=4)
    y = x.double() @ w.double().T + b.double()
    if op == "swish":
        got, want = lin(x, "swish"), torch.nn.functional.silu(y)
    else:
        got, want = lin.binary(x, other, op), (y + other.double() if op == "add" else y * other.double())
    _near(got, want)
    assert got.shape == (rows, N) and got.data_ptr() != other.data_ptr()  # a new tensor, as oneDNN's


def test_silu_of_large_and_tiny_values(build):
    """The kernel's own exp: silu saturates to x for large x and to -0 for very negative x."""
    lin, _, _ = _linear("Q8_0")
    x = _rows(4) * 40  # outputs in the hundreds, both signs
    y = (x.double() @ lin.dense.weight.double().T)
    _near(lin(x, "swish"), torch.nn.functional.silu(y))


def test_strided_rows_are_read_by_their_stride(build):
    lin, _, _ = _linear("Q8_0")
    wide = _rows(5, k=2 * K, seed=4)
    x = wide[:, K:]  # rows 2K apart
    assert torch.equal(lin(x), lin(x.contiguous()))


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(build):
    lin, _, _ = _linear("Q4_1", bias=True, n=128)  # four panels: two threads each take some
    x = _rows(20, seed=5)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(20)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (2, 5, 8, 9, 16, 17, 20):
                assert torch.equal(lin(x[:m]), alone[:m]), (threads, m)
    finally:
        torch.set_num_threads(before)


def test_bad_shapes_and_arguments_are_refused():
    q, _ = _weight("Q4_1", n=48)
    with pytest.raises(ValueError, match="multiples of 32 columns"):
        quant_linear_bf16.tiles(q)
    lin, _, _ = _linear("Q4_1")
    with pytest.raises(ValueError, match="wants"):
        lin(torch.randn(2, K))  # float32 rows to a bf16 linear
    with pytest.raises(ValueError, match="other"):
        lin.binary(_rows(2), _rows(3, k=N), "add")
    fn = quant_linear_bf16.load()
    x, out = _rows(1), torch.empty(1, N, dtype=torch.bfloat16)
    w = quant_linear_bf16.tiles(_weight("Q4_1")[0])
    # an unknown format, K not a multiple of the block, N not of the panel, add without other: -1
    assert fn(7, 1, K, x.data_ptr(), K, w.data_ptr(), N, 0, out.data_ptr(), N, 0, 0, 0) == -1
    assert fn(0, 1, K - 8, x.data_ptr(), K, w.data_ptr(), N, 0, out.data_ptr(), N, 0, 0, 0) == -1
    assert fn(0, 1, K, x.data_ptr(), K, w.data_ptr(), N - 16, 0, out.data_ptr(), N, 0, 0, 0) == -1
    assert fn(0, 1, K, x.data_ptr(), K, w.data_ptr(), N, 0, out.data_ptr(), N, 2, 0, 0) == -1


def test_the_llama_runner_in_bf16_on_blocks_stays_with_its_dense_self(tmp_path):
    from tests.support.gguf_file import write_gguf

    pytest.importorskip("gguf")
    model = tiny_llama(seed=0)
    write_gguf(model, tmp_path)
    on = build_model_runner(model, slots=4, dtype=torch.bfloat16,
                            tuning=Tuning(native_executor="llama", weight_kernel="on"))
    off = build_model_runner(model, slots=4, dtype=torch.bfloat16,
                             tuning=Tuning(native_executor="llama", weight_kernel="off"))
    assert on.weight_kernel and not off.weight_kernel
    layer = on.layers[0]
    assert all(isinstance(lin, QuantLinear) and lin.dtype == torch.bfloat16
               for lin in (layer.qkv, layer.o, layer.gate, layer.up, layer.down))
    assert isinstance(on.lm_head, Linear)  # 259 columns: not whole panels, so the dense bf16 GEMM
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in (7, 13, 1, 20)]
    nxt = [5, 6, 7, 8]
    for (got, where), (want, same) in zip(drive(on, prompts, nxt), drive(off, prompts, nxt), strict=True):
        assert where == same
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_the_builds_are_separate_libraries_and_say_how_they_multiply():
    native, plain = quant_linear_bf16.BUILDS["native"], quant_linear_bf16.BUILDS["avx512_bf16"]
    assert native is quant_linear_bf16.KERNEL and plain.flags == ("-mno-amx-tile",)
    assert native.load() is not None and plain.load() is not None and native.load() is not plain.load()
    assert quant_linear_bf16.path() == ("AMX" if cpu_has_amx() else "AVX512_BF16")


def test_the_avx512_bf16_build_does_not_use_amx(monkeypatch):
    monkeypatch.setattr(quant_linear_bf16, "KERNEL", quant_linear_bf16.BUILDS["avx512_bf16"])
    assert quant_linear_bf16.path() == "AVX512_BF16"


def test_the_setting_resolves_bf16_to_the_bf16_build():
    cpu, blocks = torch.device("cpu"), {"w": _weight("Q4_1")[0]}
    assert resolve("auto", cpu, torch.bfloat16, blocks) is True
    assert resolve("off", cpu, torch.bfloat16, blocks) is False
    assert resolve("auto", cpu, torch.bfloat16, {}) is False
