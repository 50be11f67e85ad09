"""The weight kernels' panel helper (server/engines/native/kernels/panel_helper.h): a second thread takes
panels of the calls a thread makes without an OpenMP team. A call's bits must not depend on who
computed which panel, nor on a helper that is late; a second caller finds the helper taken and runs
alone; the helper stops and starts again; a runner with it gives the same logits. Each check runs on
every build of each kernel this CPU runs: the float32 kernel (quant_linear.py: its AVX2 path, and
the AVX-512 one where the CPU has it) and the bf16 one where the CPU has AVX512_BF16
(quant_linear_bf16.py)."""

from __future__ import annotations

import time
from types import ModuleType

import pytest
import torch

from adapters_store.backbone.gguf_blocks import dequantize, quantize
from adapters_store.backbone.tiny import tiny_llama
from server.engines.native.core.execution import Mode
from server.engines.native.kernels import panel_helper, quant_linear, quant_linear_bf16
from server.engines.native.kernels.quant_linear import QuantLinear
from server.engines.native.model.llama import Linear
from server.engines.native.model.model_runner import build_model_runner
from server.engines.native.tuning import Tuning
from tests.server.engines.native.model.test_model_runner import drive

K = 512  # one row is already a call large enough to share
# output columns: the float32 kernel's last panel of 12 is a partial one (43 full and 3 columns);
# the bf16 kernel takes whole panels of 32 only
COLUMNS = {torch.float32: 519, torch.bfloat16: 512}
MAX_ROWS = 64  # rows of the calls the helper's buffers hold
KERNELS = {torch.float32: quant_linear, torch.bfloat16: quant_linear_bf16}
kept: list[object] = []  # a test's linears and runners (the fixture `kernel`)


def _cases() -> list[object]:
    cases = []
    for dtype, module in KERNELS.items():
        available = module.load() is not None  # before error(): the reason is known once load() has run
        why = f"no {str(dtype).removeprefix('torch.')} weight kernel: {module.error()}"
        for name in sorted(module.BUILDS):
            marks = [] if available else [pytest.mark.skip(reason=why)]
            cases.append(pytest.param((dtype, name), id=f"{str(dtype).removeprefix('torch.')}-{name}", marks=marks))
    return cases


@pytest.fixture(params=_cases())
def kernel(request, monkeypatch) -> tuple[torch.dtype, ModuleType]:
    """The test's calls on one torch thread, through this build of this dtype's kernel; the linears
    the test keeps in `kept` stay alive until the helper has stopped (a late helper may still be
    reading their weights)."""
    dtype, name = request.param
    module = KERNELS[dtype]
    build = module.BUILDS[name]
    if build.load() is None:
        pytest.fail(f"the {name} build of {module.__name__} did not load: {build.error()}")
    monkeypatch.setattr(module, "KERNEL", build)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    kept.clear()
    yield dtype, module
    torch.set_num_threads(before)
    panel_helper.pause(module, 0)
    assert panel_helper.share(module, 0)
    kept.clear()


def _linear(dtype: torch.dtype, fmt: str, bias: bool = False) -> QuantLinear:
    n = COLUMNS[dtype]
    q = quantize(torch.randn(n, K, generator=torch.Generator().manual_seed(0)), fmt)
    b = torch.randn(n, generator=torch.Generator().manual_seed(9)) if bias else None
    lin = QuantLinear(q, b, Linear(dequantize(q).to(dtype), b, dtype, packed=False), 256, dtype)
    kept.append(lin)
    return lin


def _rows(dtype: torch.dtype, m: int, k: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _share(dtype: torch.dtype, module: ModuleType) -> None:
    panel = module.PANEL
    assert panel_helper.share(module, MAX_ROWS * K, MAX_ROWS * -(-COLUMNS[dtype] // panel) * panel, COLUMNS[dtype])


def until_the_helper_took_panels(module: ModuleType, taken: int, calls, seconds: float = 60.0) -> None:
    """Repeat `calls` (which check their own results) until the helper has taken a panel: on a busy
    host the helper thread may not run during the first calls, and whether it wins any given
    panel is a race. Only a helper that never runs for a minute fails."""
    deadline = time.monotonic() + seconds
    while panel_helper.taken(module) <= taken:
        assert time.monotonic() < deadline, "the helper thread took no panel in a minute of calls"
        calls()


def test_the_panel_helper_changes_no_bit(kernel):
    dtype, module = kernel
    lin = _linear(dtype, "Q4_1", bias=True)
    x, other = _rows(dtype, 70, seed=6), _rows(dtype, 70, k=COLUMNS[dtype], seed=7)
    sizes = (1, 5, 8, 16, 17, 40, 64, 65)  # 65: beyond the helper's buffers, the caller alone
    calls = [(m, op) for m in sizes for op in ("none", "swish", "add", "mul")]

    def run(m: int, op: str) -> torch.Tensor:
        return lin.binary(x[:m], other[:m], op) if op in ("add", "mul") else lin(x[:m], op)

    want = {c: run(*c) for c in calls}
    _share(dtype, module)
    taken = panel_helper.taken(module)

    def every_call() -> None:
        for c in calls:
            assert torch.equal(run(*c), want[c]), c

    for _ in range(20):
        every_call()
    until_the_helper_took_panels(module, taken, every_call)


def test_a_late_helper_is_redone_by_the_caller_and_its_late_results_never_read(kernel):
    """The helper sleeps after each claim, as if descheduled mid-panel: the caller computes the
    claimed panel itself instead of waiting, and the helper's results, landing during later calls,
    are never used."""
    dtype, module = kernel
    lin = _linear(dtype, "Q8_0")
    xs = [_rows(dtype, m, seed=10 + i) for i, m in enumerate((3, 16, 1, 9, 16, 2) * 3)]
    want = [lin(x) for x in xs]
    _share(dtype, module)
    panel_helper.pause(module, 200_000)
    for x, w in zip(xs, want, strict=True):
        assert torch.equal(lin(x), w)
    panel_helper.pause(module, 20_000_000)
    started = time.perf_counter()
    for x, w in zip(xs, want, strict=True):
        assert torch.equal(lin(x), w)
    # waiting for the helper would take 20 ms a call; the 18 calls alone take a few ms
    assert time.perf_counter() - started < 0.25


def test_callers_on_two_threads_share_one_helper(kernel):
    """A caller that finds the helper taken (lanes) runs alone."""
    from concurrent.futures import ThreadPoolExecutor

    from server.infra import openmp

    dtype, module = kernel
    lin = _linear(dtype, "Q4_1")
    xs = [_rows(dtype, 8, seed=20 + i) for i in range(2)]
    want = [lin(x) for x in xs]
    _share(dtype, module)
    with ThreadPoolExecutor(1, initializer=openmp.one_thread) as pool:
        for _ in range(100):
            other = pool.submit(lambda: [lin(xs[1]) for _ in range(10)])
            mine = [lin(xs[0]) for _ in range(10)]
            assert all(torch.equal(y, want[0]) for y in mine)
            assert all(torch.equal(y, want[1]) for y in other.result())


def test_the_helper_stops_and_starts_again(kernel):
    dtype, module = kernel
    lin = _linear(dtype, "Q4_1")
    x = _rows(dtype, 4, seed=30)
    want = lin(x)
    for _ in range(3):
        _share(dtype, module)
        assert torch.equal(lin(x), want)
        assert panel_helper.share(module, 0)
        assert torch.equal(lin(x), want)


def test_the_llama_runner_with_the_panel_helper_gives_the_same_logits(tmp_path, kernel):
    """What the engine runs without its team beside busy processes: the runner's linears share their
    panels with the helper; every logit is the same as on the engine thread alone."""
    from tests.support.gguf_file import write_gguf

    pytest.importorskip("gguf")
    dtype, module = kernel
    model = tiny_llama(seed=0, hidden=256)  # linears large enough to share
    write_gguf(model, tmp_path)
    runner = build_model_runner(model, slots=4, dtype=dtype, tuning=Tuning(native_executor="llama", weight_kernel="on"))
    kept.append(runner)
    assert runner.panel_helper
    assert not build_model_runner(model, slots=4, dtype=dtype,
                                  tuning=Tuning(native_executor="llama", weight_kernel="off")).panel_helper
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in (7, 13, 1, 20)]
    nxt = [5, 6, 7, 8]
    threads = torch.get_num_threads()
    alone = drive(runner, prompts, nxt)
    assert runner.set_mode(Mode(1, helper=True)) == Mode(1, helper=True)
    taken = panel_helper.taken(module)

    def same_logits() -> None:
        shared = drive(runner, prompts, nxt)
        for (got, where), (want, same) in zip(shared, alone, strict=True):
            assert where == same and torch.equal(got, want)

    same_logits()
    until_the_helper_took_panels(module, taken, same_logits)
    assert runner.set_mode(Mode(threads)) == Mode(threads)  # the helper's thread joined
    assert torch.get_num_threads() == threads
