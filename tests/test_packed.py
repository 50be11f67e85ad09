"""Packed backbone linears (server/engines/native/packed.py): the oneDNN path really runs at
inference, matches F.linear, gives way to the dense path under autograd, follows in-place weight
changes, and the engine's greedy answers are the same packed or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from server.engines.native import packed
from server.engines.native.engine import NativeEngine
from server.engines.request import GenRequest, SamplingParams
from tests.server_fixtures import TASKS, build_store, tiny_backbone

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not packed.available(), reason="no oneDNN packed linear ops in this torch")]


def ops_run(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return {e.key for e in p.key_averages()}


def test_inference_takes_the_packed_path_and_matches_dense():
    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    x = torch.randn(5, 7, 64)
    dense = F.linear(x, lin.weight, lin.bias).detach()
    assert packed.pack_linears(lin) > 0 and type(lin) is packed.PackedLinear
    with torch.inference_mode():
        names = ops_run(lambda: lin(x))
        got = lin(x)
    assert "mkldnn::_linear_pointwise" in names
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    assert set(lin.state_dict()) == {"weight", "bias"}


def test_autograd_uses_the_dense_weight_and_its_gradients():
    torch.manual_seed(0)
    lin, ref = nn.Linear(32, 16), nn.Linear(32, 16)
    ref.load_state_dict(lin.state_dict())
    packed.pack_linears(lin)
    x1, x2 = torch.randn(4, 32, requires_grad=True), None
    x2 = x1.detach().clone().requires_grad_(True)
    names = ops_run(lambda: lin(x1).square().sum().backward())
    ref(x2).square().sum().backward()
    assert "mkldnn::_linear_pointwise" not in names
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


def test_in_place_weight_change_is_repacked():
    lin = nn.Linear(8, 8, bias=False)
    packed.pack_linears(lin)
    x = torch.randn(3, 8)
    with torch.no_grad():
        lin.weight.mul_(2.0)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
        lin.weight.copy_(torch.eye(8))
        torch.testing.assert_close(lin(x), x)


def test_setting_rule():
    assert packed.wanted("auto", "cpu", "float32")
    assert not packed.wanted("auto", "cpu", "bfloat16")
    assert not packed.wanted("auto", "cuda", "float32")
    assert not packed.wanted("off", "cpu", "float32")
    assert packed.wanted("on", "cpu", "bfloat16")


def _answers(engine, bb, adapters, jobs) -> list[str]:
    engine.start()
    try:
        reqs = []
        for prompt, task in jobs:
            ids = list(bb.tokenizer(prompt, add_special_tokens=False).input_ids)
            reqs.append(engine.submit(GenRequest(ids, SamplingParams(max_new_tokens=24, ignore_eos=True),
                                                 adapters[task], task)))
        for r in reqs:
            assert r.handle.wait(60)
        return ["".join(e.text for e in r.handle.events) for r in reqs]
    finally:
        engine.stop()


def test_engine_answers_are_the_same_packed_or_not(tmp_path):
    from adapters_store.inject import RoutedModel
    from server.adapters.cache import AdapterCache
    from server.adapters.l1 import L1Cache

    store = build_store(tmp_path)
    bb = tiny_backbone()  # a fresh model: packing changes its modules in place
    info, skills = store.load_inventory(bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    cache = AdapterCache(store, info, skills, fingerprint=bb.fingerprint, device=torch.device("cpu"),
                         dtype=torch.float32, l1=L1Cache(1 << 30))
    adapters = {t: cache.get(store.get_task(t)) for t in TASKS} | {"base": None}
    tasks = [*TASKS, "base"]
    jobs = [(p, tasks[i % len(tasks)]) for i, p in enumerate(["hello world", "a b c", "the quick fox", "xyz", "0123"])]
    plain = _answers(NativeEngine(bb.model, bb.tokenizer, rm), bb, adapters, jobs)
    assert packed.packed_count(bb.model) == 0
    engine = NativeEngine(bb.model, bb.tokenizer, rm, packed_weights=True)
    assert packed.packed_count(bb.model) == sum(1 for m in bb.model.modules() if isinstance(m, nn.Linear))
    fast = _answers(engine, bb, adapters, jobs)
    assert fast == plain
    assert len(set(plain)) > 2  # the tasks really answer differently


def test_prefill_sized_inputs_keep_the_dense_path():
    lin = nn.Linear(16, 16)
    packed.pack_linears(lin)
    big = torch.randn(packed.PACKED_MAX_TOKENS + 1, 16)
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" not in ops_run(lambda: lin(big))
        assert "mkldnn::_linear_pointwise" in ops_run(lambda: lin(big[: packed.PACKED_MAX_TOKENS]))
