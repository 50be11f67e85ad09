"""The native engine's runners against the model's own forward (transformers): a prompt in
chunks, decode steps of several rows in dense and gathered slots, the LoRA of each row."""

from __future__ import annotations

import pytest
import torch

from server.engines.dtype import serving_dtype
from server.engines.native.core.step import Item, StepBatch
from server.engines.native.kernels import attention_kernel, elementwise_kernel
from server.engines.native.model.llama import unsupported
from server.engines.native.model.model_runner import build_model_runner
from server.engines.native.tuning import Tuning


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def drive(runner, prompts: list[list[int]], nxt: list[int]):
    """Prefill prompt i in slot i (two chunks where it has > 2 tokens), then one decode step of all
    rows, then one of every other row (gathered slots). Returns [(got, want_positions)] pairs."""
    out = []
    halves = [max(1, len(p) // 2) for p in prompts]
    first = [Item(s, 0, tuple(p[:h]), "all") for s, (p, h) in enumerate(zip(prompts, halves, strict=True))]
    b = StepBatch.build(first)
    logits = runner.forward(b)
    out += [(logits[b.logit_rows[s]], (s, 0, halves[s])) for s in range(len(prompts))]
    rest = [Item(s, h, tuple(p[h:]), "all") for s, (p, h) in enumerate(zip(prompts, halves, strict=True)) if len(p) > h]
    b = StepBatch.build(rest)
    logits = runner.forward(b)
    out += [(logits[b.logit_rows[j]], (it.slot, it.start, len(prompts[it.slot]))) for j, it in enumerate(rest)]
    b = StepBatch.build([Item(s, len(p), (t,)) for s, (p, t) in enumerate(zip(prompts, nxt, strict=True))])
    logits = runner.forward(b)
    out += [(logits[b.logit_rows[s]], (s, len(p), len(p) + 1)) for s, p in enumerate(prompts)]
    odd = list(range(1, len(prompts), 2))
    b = StepBatch.build([Item(s, len(prompts[s]) + 1, (nxt[s] + 1,)) for s in odd])
    assert not b.decode_contiguous
    logits = runner.forward(b)
    out += [(logits[b.logit_rows[j]], (s, len(prompts[s]) + 1, len(prompts[s]) + 2)) for j, s in enumerate(odd)]
    return out


def check_against(model, runner, vocab: int, atol: float, rtol: float = 0.0):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 13, 1, 20)]
    nxt = [5, 6, 7, 8]
    full = [p + [t, t + 1] for p, t in zip(prompts, nxt, strict=True)]
    refs = [reference(model, f) for f in full]
    for got, (slot, a, b) in drive(runner, prompts, nxt):
        torch.testing.assert_close(got, refs[slot][a:b], atol=atol, rtol=rtol)


@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_runner_equals_the_models_forward(tiny_base, kind):
    ex = build_model_runner(tiny_base, slots=4, tuning=Tuning(native_executor=kind))
    assert ex.name == kind
    check_against(tiny_base, ex, 259, atol=1e-5)


@pytest.mark.parametrize("attention", ["on", "off"])
def test_llama_runner_equals_the_models_forward_with_and_without_the_attention_kernel(tiny_base, attention):
    if attention == "on" and attention_kernel.KERNEL.load() is None:
        pytest.skip(f"no decode attention kernel: {attention_kernel.KERNEL.error()}")
    ex = build_model_runner(tiny_base, slots=4, tuning=Tuning(native_executor="llama", attention_kernel=attention))
    assert ex.attention_kernel is (attention == "on")
    check_against(tiny_base, ex, 259, atol=1e-5)


def test_llama_runner_handles_qkv_bias_and_gqa():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=2,
                                         max_position_embeddings=256)).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None and unsupported(model) is None
    with torch.no_grad():
        for layer in model.model.layers:  # non-zero biases, so a dropped bias shows
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    check_against(model, build_model_runner(model, slots=4, tuning=Tuning(native_executor="llama")), 259, atol=1e-5)


@pytest.mark.parametrize("elementwise", ["on", "off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_runner_equals_the_models_forward_with_and_without_the_elementwise_kernel(tiny_base, elementwise, dtype):
    if elementwise == "on" and elementwise_kernel.NORM.load() is None:
        pytest.skip(f"no elementwise kernel: {elementwise_kernel.NORM.error()}")
    ex = build_model_runner(tiny_base, slots=4, dtype=dtype,
                            tuning=Tuning(native_executor="llama", elementwise_kernel=elementwise))
    assert ex.elementwise is (elementwise == "on")
    if dtype == torch.float32:
        check_against(tiny_base, ex, 259, atol=1e-5)
    else:
        check_against(tiny_base, ex, 259, atol=0.1, rtol=0.05)


def test_llama_runner_in_bfloat16_stays_near_float32(tiny_base):
    ex = build_model_runner(tiny_base, slots=4, dtype=torch.bfloat16, tuning=Tuning(native_executor="llama"))
    assert ex.dtype == torch.bfloat16 and ex.kv.dtype == torch.bfloat16
    check_against(tiny_base, ex, 259, atol=0.1, rtol=0.05)


def test_a_dtype_onednn_cannot_pack_here_runs_unpacked(tiny_base, monkeypatch):
    """On an AVX2-only CPU oneDNN's bf16 reorder raises: the runner (and the dtype probe) must
    fall back to plain GEMMs for that dtype instead of failing, and keep packing the other."""
    from server.engines.native.model import llama

    real = torch.ops.mkldnn
    reorder = real._reorder_linear_weight

    class Ops:  # torch.ops.mkldnn with a bf16 reorder that fails like it does without AVX-512
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def _reorder_linear_weight(w, *args):
            if w.dtype == torch.bfloat16:
                raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
            return reorder(w, *args)

    llama.packing_available.cache_clear()
    monkeypatch.setattr(llama.torch.ops, "mkldnn", Ops())
    try:
        assert not llama.packing_available(torch.bfloat16)
        ex = build_model_runner(tiny_base, slots=4, dtype=torch.bfloat16, tuning=Tuning(native_executor="llama"))
        assert not ex.packed
        check_against(tiny_base, ex, 259, atol=0.1, rtol=0.05)
        if torch.backends.mkldnn.is_available():
            assert llama.packing_available(torch.float32)
    finally:
        llama.packing_available.cache_clear()


def test_other_architectures_run_on_the_models_own_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=259, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                       bos_token_id=0, eos_token_id=0)).eval()
    assert "gpt2" in unsupported(model)
    ex = build_model_runner(model, slots=4)
    assert ex.name == "hf"
    check_against(model, ex, 259, atol=1e-5)
    with pytest.raises(ValueError, match="cannot run"):
        build_model_runner(model, slots=4, tuning=Tuning(native_executor="llama"))


def test_attention_the_slot_cache_cannot_express_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    model = MistralForCausalLM(MistralConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                             sliding_window=4)).eval()
    assert "sliding-window" in unsupported(model)
    with pytest.raises(ValueError, match="sliding-window"):
        build_model_runner(model, slots=2)


def test_serving_dtype_setting():
    assert serving_dtype("cpu", "float32") == torch.float32
    assert serving_dtype("cpu", "bfloat16") == torch.bfloat16
    assert serving_dtype("cpu", None) in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        serving_dtype("cpu", "int8")


def test_auto_dtype_reads_the_cpu_and_probes_only_avx512_bf16_without_amx(monkeypatch):
    from server.engines import dtype as dtypes

    def no_probe():
        raise AssertionError("probed")

    def cpu(amx, bf16, speedup=None):
        monkeypatch.setattr(dtypes, "cpu_has_amx", lambda: amx)
        monkeypatch.setattr(dtypes, "cpu_has_avx512_bf16", lambda: bf16)
        monkeypatch.setattr(dtypes, "cpu_bf16_speedup", no_probe if speedup is None else lambda: speedup)
        return dtypes.auto_dtype("cpu")

    assert cpu(amx=True, bf16=True)[0] == torch.bfloat16
    assert cpu(amx=False, bf16=False)[0] == torch.float32
    dtype, why = cpu(amx=False, bf16=True, speedup=1.62)
    assert dtype == torch.bfloat16 and "1.62x" in why
    assert cpu(amx=False, bf16=True, speedup=0.8)[0] == torch.float32
    assert cpu(amx=False, bf16=True, speedup=dtypes.BF16_PROBE_MIN)[0] == torch.bfloat16
    assert dtypes.auto_dtype("meta")[0] == torch.float32


def test_the_bf16_probe_times_both_dtypes():
    from server.engines.dtype import cpu_bf16_speedup

    ratio = cpu_bf16_speedup(d_in=64, d_out=128, rows=(1, 4), rounds=3, calls=2)  # small: a smoke test of the path
    assert 0 < ratio < float("inf")


@pytest.mark.parametrize("adapter_kind", ["routing", "lora"])
@pytest.mark.parametrize("kind,targets", [
    ("llama", ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")),
    ("llama", ("q_proj", "v_proj", "gate_proj", "up_proj")),  # k not adapted; the MLP's gate|up path
    ("hf", ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")),
], ids=["llama", "llama-mlp", "hf"])
def test_each_slots_lora_equals_the_routed_models_forward(tiny_model, kind, targets, adapter_kind):
    """Rows of three tasks and a base row in one step: each row's logits are those of the routed
    model run alone with that task's materialised LoRA (gathered path, one task). A routed task's
    tables are combined from its routing weights; a plain LoRA's copied from its layers."""
    from adapters_store.lora.inject import RoutedModel
    from adapters_store.lora.spec import InventorySpec
    from server.adapter_cache.types import Adapter

    spec = InventorySpec(n_skills=3, n_heads=2, rank=4, target_modules=targets)
    rm = RoutedModel(tiny_model, spec)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in rm.layers:
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen) * 0.3)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.3)
    weights = [torch.softmax(torch.randn(len(rm.layers), 2, 3, generator=gen), -1) for _ in range(3)]
    adapters = []
    for w in weights:
        rm.set_materialized(w)
        plan = rm.batch.plan
        layers = [(a[0].clone(), b[0].clone()) for a, b in zip(plan.A_tables, plan.B_tables, strict=True)]
        adapters.append(Adapter("t", "k", "routing", [], w) if adapter_kind == "routing"
                        else Adapter("t", "k", "lora", layers, None))
    ex = build_model_runner(tiny_model, rm, slots=4, tuning=Tuning(native_executor=kind))
    prompts = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in (5, 9, 3, 6)]
    for slot, adapter in enumerate([*adapters, None]):
        ex.set_adapter(slot, adapter)
    b = StepBatch.build([Item(s, 0, tuple(p), "all") for s, p in enumerate(prompts)])
    got = ex.forward(b)
    b2 = StepBatch.build([Item(s, len(p), (11,)) for s, p in enumerate(prompts)])
    got2 = ex.forward(b2)
    for slot, p in enumerate(prompts):
        if slot < 3:
            rm.set_materialized(weights[slot])
        else:
            rm.batch.set(None)
        want = reference(tiny_model, p + [11])
        torch.testing.assert_close(got[b.logit_rows[slot]], want[: len(p)], atol=1e-5, rtol=0)
        torch.testing.assert_close(got2[b2.logit_rows[slot]], want[len(p) :], atol=1e-5, rtol=0)
    rm.batch.set(None)
    plain = reference(tiny_model, prompts[0])
    assert (got[b.logit_rows[0]] - plain).abs().max() > 1e-2  # the adapters really change the answer


@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_a_base_row_moved_into_a_tasks_slot_runs_without_its_adapter(tiny_model, kind):
    """Slot compaction moves a base row into a slot that held a task's row (copy_slot): its
    next decode step, beside a row that keeps its task, gives the plain model's logits."""
    from adapters_store.lora.inject import RoutedModel
    from adapters_store.lora.spec import InventorySpec
    from server.adapter_cache.types import Adapter

    rm = RoutedModel(tiny_model, InventorySpec(n_skills=3, n_heads=2, rank=4))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in rm.layers:
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen) * 0.3)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.3)
    weights = [torch.softmax(torch.randn(len(rm.layers), 2, 3, generator=gen), -1) for _ in range(2)]
    ex = build_model_runner(tiny_model, rm, slots=3, tuning=Tuning(native_executor=kind))
    prompts = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in (6, 4, 5)]
    for slot, adapter in enumerate([Adapter("a", "ka", "routing", [], weights[0]), None,
                                    Adapter("b", "kb", "routing", [], weights[1])]):
        ex.set_adapter(slot, adapter)
    ex.forward(StepBatch.build([Item(s, 0, tuple(p)) for s, p in enumerate(prompts)]))
    ex.copy_slot(1, 0, len(prompts[1]))  # slot 0's row left; the base row of slot 1 moves down
    b = StepBatch.build([Item(0, len(prompts[1]), (11,)), Item(2, len(prompts[2]), (12,))])
    got = ex.forward(b)
    rm.batch.set(None)
    torch.testing.assert_close(got[b.logit_rows[0]], reference(tiny_model, prompts[1] + [11])[-1:], atol=1e-5, rtol=0)
    rm.set_materialized(weights[1])
    torch.testing.assert_close(got[b.logit_rows[1]], reference(tiny_model, prompts[2] + [12])[-1:], atol=1e-5, rtol=0)
    rm.set_materialized(weights[0])
    tasked = reference(tiny_model, prompts[1] + [11])[-1:]
    assert (got[b.logit_rows[0]] - tasked).abs().max() > 1e-2  # the task's tables would change the answer
    rm.batch.set(None)


def test_static_decode_steps_equal_the_dynamic_ones(tiny_model):
    """The CUDA-graph path's padded, fixed-shape decode (static_decode.py), run eagerly here: rows
    padded into the spare slot, attention over the whole KV capacity, LoRA always on, give the
    dynamic path's logits; prompt chunks still take the dynamic path."""
    from adapters_store.lora.inject import RoutedModel
    from adapters_store.lora.spec import InventorySpec
    from server.adapter_cache.types import Adapter
    from server.engines.native.model.static_decode import bucket

    rm = RoutedModel(tiny_model, InventorySpec(n_skills=3, n_heads=2, rank=4))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in rm.layers:
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.3)
    weights = torch.softmax(torch.randn(len(rm.layers), 2, 3, generator=gen), -1)
    runners = [build_model_runner(tiny_model, rm, slots=6, tuning=Tuning(static_decode=flag)) for flag in ("off", "on")]
    assert runners[0].static is None and runners[1].static is not None
    prompts = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in (4, 9, 6)]
    outs = []
    for ex in runners:
        for slot in range(3):
            ex.set_adapter(slot, Adapter("t", "k", "routing", [], weights) if slot != 1 else None)
            ex.forward(StepBatch.build([Item(slot, 0, tuple(prompts[slot]))]))
        step = StepBatch.build([Item(s, len(p), (7 + s,)) for s, p in enumerate(prompts)])  # 3 rows -> bucket 4
        outs.append((ex.forward(step), ex.forward(StepBatch.build([Item(2, len(prompts[2]) + 1, (5,))]))))
    assert bucket(3, 6) == 4 and bucket(7, 6) is None
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    spare = runners[1].spare_slot
    assert runners[1].kv.k[0][spare].abs().sum() > 0  # the padding row wrote into the spare slot only
    assert runners[0].kv.k[0][spare].abs().sum() == 0


class _FakeGraph:
    """Stands in for a CUDA graph on the CPU: remembers the runner's KV and rope tensors it was
    captured over and fails a replay once they were replaced (a real graph would read freed memory)."""

    def __init__(self, runner, b) -> None:
        self.runner, self.b, self.tensors = runner, b, self.read(runner)

    @staticmethod
    def read(runner) -> list[torch.Tensor]:
        return [*runner.kv.k, *runner.kv.v, runner._rope]

    def replay(self) -> None:
        now = self.read(self.runner)
        assert all(a is b for a, b in zip(self.tensors, now, strict=True)), "a graph replayed over replaced tensors"
        self.b.out = self.runner.static.forward(self.b.batch)


def _fake_graphs(runner) -> list[tuple[int, object]]:
    """Turn graphs on for a CPU runner's StaticDecode with _FakeGraph captures; returns the
    (bucket, pool) of each capture."""
    static = runner.static
    log: list[tuple[int, object]] = []

    def capture(b) -> None:
        if static._pool is None:
            static._pool = object()
        b.graph = _FakeGraph(runner, b)
        b.out = static.forward(b.batch)
        log.append((len(b.batch.decode), static._pool))

    static.graphs = True
    static._capture = capture
    return log


def test_graphs_are_captured_again_when_the_kv_cache_is_replaced_at_the_same_capacity(tiny_model):
    """A cache that grew and then shrank back when the engine went idle has its old capacity at new
    addresses: every graph is captured again (in a fresh pool), not replayed over freed memory, and
    the logits still equal the dynamic path's."""
    from server.engines.native.core.slots import MIN_CAPACITY

    runners = [build_model_runner(tiny_model, None, slots=4, tuning=Tuning(static_decode=flag))
               for flag in ("off", "on")]
    log = _fake_graphs(runners[1])
    outs: list[list[torch.Tensor]] = [[], []]
    for ex, out in zip(runners, outs, strict=True):
        for slot in range(3):
            ex.forward(StepBatch.build([Item(slot, 0, (3 + slot, 4, 5))]))
        out.append(ex.forward(StepBatch.build([Item(s, 3, (9 + s,)) for s in range(3)])))  # bucket 4
        out.append(ex.forward(StepBatch.build([Item(0, 4, (8,))])))  # bucket 1
        ex.forward(StepBatch.build([Item(3, 0, tuple(range(1, 40)) * 5)]))  # 195 positions: the cache grows
        assert ex.kv.capacity > MIN_CAPACITY
        ex.idle()  # ... and shrinks back: same capacity, new tensors
        assert ex.kv.capacity == MIN_CAPACITY
        for slot in range(3):
            ex.forward(StepBatch.build([Item(slot, 0, (3 + slot, 4, 5))]))
        out.append(ex.forward(StepBatch.build([Item(s, 3, (9 + s,)) for s in range(3)])))
        out.append(ex.forward(StepBatch.build([Item(0, 4, (8,))])))
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert [size for size, _ in log] == [4, 1, 4, 1]
    assert log[0][1] is log[1][1] and log[2][1] is log[3][1] and log[0][1] is not log[2][1]


def test_graphs_are_captured_again_when_the_rope_table_grows(tiny_model):
    """The rope table is read by address too: a row past its length replaces it."""
    runner = build_model_runner(tiny_model, None, slots=2, tuning=Tuning(static_decode="on"))
    log = _fake_graphs(runner)
    runner.forward(StepBatch.build([Item(0, 0, (1, 2, 3))]))
    runner.forward(StepBatch.build([Item(0, 3, (4,))]))
    kv_version = runner.kv.version
    runner.kv.ensure(1024)  # room first, so only the rope table changes at the next step
    runner.forward(StepBatch.build([Item(0, 4, (5,))]))
    layout = runner.static.layout()
    runner._rope_table(600)
    assert runner.static.layout() != layout and runner.kv.version == kv_version + 1
    runner.forward(StepBatch.build([Item(0, 5, (6,))]))
    assert len(log) == 3


def test_every_dynamic_steps_attention_runs_under_the_devices_backend_choice(tiny_base, monkeypatch):
    # on CUDA that choice leaves cuDNN's attention out (attention.cuda_backends); here it checks the
    # wiring: the runner asks for it with the batch's device around every layer's attention
    import contextlib

    from server.engines.native.model import llama

    inside: list[torch.device] = []
    calls: list[bool] = []

    @contextlib.contextmanager
    def recording(device):
        inside.append(device)
        try:
            yield
        finally:
            inside.pop()

    attend = llama.slot_attention
    monkeypatch.setattr(llama, "cuda_backends", recording)
    monkeypatch.setattr(llama, "slot_attention", lambda *a, **kw: (calls.append(bool(inside)), attend(*a, **kw))[1])
    ex = build_model_runner(tiny_base, slots=4, tuning=Tuning(native_executor="llama"))
    check_against(tiny_base, ex, 259, atol=1e-5)
    assert calls and all(calls)
