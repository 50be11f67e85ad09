"""bench.kernel_linears on a tiny Llama with GGUF blocks: the runner's kernel linears are found in a
step's order (every layer's, then the head; the first layer alone without the head), each timing is
a positive figure per repeat, and a runner on float32 weights has none (its dense linears are the
same ones, for --dense)."""

import pytest

from adapters_store.backbone.tiny import tiny_llama
from bench.kernel_linears import kernel_linears, main, pass_ms, weights
from server.engines.native.kernels.quant_linear import QuantLinear
from server.engines.native.model.llama import Linear
from server.engines.native.model.model_runner import build_model_runner
from server.engines.native.tuning import Tuning


def test_the_linears_are_the_runners_kernel_ones_in_step_order(tmp_path):
    from tests.support.gguf_file import write_gguf

    pytest.importorskip("gguf")
    model = tiny_llama(seed=0)
    write_gguf(model, tmp_path)
    runner = build_model_runner(model, slots=2, tuning=Tuning(native_executor="llama", weight_kernel="on"))
    every = kernel_linears(runner)
    layer = runner.layers[0]
    assert every[:4] == [layer.qkv, layer.o, layer.gate, layer.up] and every[-1] is runner.lm_head
    assert len(every) == 5 * len(runner.layers) + 1 and all(isinstance(lin, QuantLinear) for lin in every)
    first = kernel_linears(runner, layers=1)
    assert first == every[:5]
    assert weights(first) == sum(p.numel() for n, p in model.model.layers[0].named_parameters()
                                 if n.endswith("proj.weight"))
    times = pass_ms(first, rows=3, passes=2, repeats=4)
    assert len(times) == 4 and all(t > 0 for t in times)
    off = build_model_runner(model, slots=2, tuning=Tuning(native_executor="llama", weight_kernel="off"))
    assert kernel_linears(off) == []
    dense = kernel_linears(off, kind=Linear)  # --dense: the same linears as oneDNN GEMMs
    assert len(dense) == len(every) and weights(dense) == weights(every)


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit, match="at least 1"):
        main(["--rows", "0"])
