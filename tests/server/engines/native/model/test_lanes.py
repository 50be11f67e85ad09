"""A step's items split over lanes (server/engines/native/model/lanes.py): the split is balanced, and a
mixed step of routed, plain and base rows gives the logits and the KV cache of the same step run
whole."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from server.engines.native.core.step import Item, StepBatch
from server.engines.native.model.lanes import Lanes, logit_positions, partition
from server.engines.native.model.model_runner import build_model_runner
from server.engines.native.tuning import Tuning


def test_partition_balances_tokens_and_keeps_each_lane_in_item_order():
    assert partition([1, 1, 1, 1], 2) == [[0, 2], [1, 3]]
    # the 6-token chunk alone in one lane, the decode rows in the other
    assert partition([1, 6, 1, 1, 1, 1], 2) == [[1], [0, 2, 3, 4, 5]]
    assert partition([3, 3, 2, 2, 2], 2) == [[0, 2, 4], [1, 3]]
    assert partition([5], 2) == [[0]]  # no empty lane
    assert partition([], 3) == []
    for sizes in ([1] * 16, [1] * 13 + [40, 7, 30], [2, 9, 4, 4, 1]):
        for lanes in (2, 3):
            parts = partition(sizes, lanes)
            assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
            loads = [sum(sizes[i] for i in p) for p in parts]
            assert max(loads) - min(loads) <= max(sizes)
    with pytest.raises(ValueError, match="at least 1"):
        partition([1], 0)
    with pytest.raises(ValueError, match="at least 2"):
        Lanes(1)


def test_logit_positions_follow_the_items_logit_rows():
    b = StepBatch.build([Item(0, 0, (1, 2, 3), "all"), Item(1, 4, (5,)), Item(2, 0, (6, 7), "none"), Item(3, 2, (8,))])
    assert [(r.start, r.stop) for r in b.logit_rows] == [(0, 3), (3, 4), (4, 4), (4, 5)]
    assert logit_positions(b, [0, 3]) == [0, 1, 2, 4]
    assert logit_positions(b, [1, 2]) == [3]


def _routed_runner(tiny_model, slots: int):
    from adapters_store.lora.inject import RoutedModel
    from adapters_store.lora.spec import InventorySpec
    from server.adapter_cache.types import Adapter

    spec = InventorySpec(n_skills=3, n_heads=2, rank=4,
                         target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
    rm = RoutedModel(tiny_model, spec)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in rm.layers:
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen) * 0.3)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.3)
    runner = build_model_runner(tiny_model, rm, slots=slots, tuning=Tuning(native_executor="llama"))
    for slot in range(slots):  # three tasks by turns, every fourth row base
        w = torch.softmax(torch.randn(len(rm.layers), 2, 3, generator=gen), -1)
        runner.set_adapter(slot, None if slot % 4 == 3 else Adapter("t", "k", "routing", [], w))
    return runner, gen


def _steps(gen: torch.Generator, slots: int) -> list[list[Item]]:
    """Prompts in one step (one chunk with logits 'none'), then a mixed step: decode rows in
    gathered slots beside a second chunk, then every row decoding."""
    lens = [3 + (7 * s) % 11 for s in range(slots)]
    prompts = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in lens]
    first = [Item(s, 0, tuple(p), "none" if s == 2 else "all" if s == 1 else "last") for s, p in enumerate(prompts)
             if s != 5]
    mixed = [Item(s, lens[s], (9 + s,)) for s in range(slots) if s not in (2, 5)]
    mixed += [Item(2, lens[2], (4, 5, 6), "all"), Item(5, 0, tuple(prompts[5]))]
    last = [Item(s, lens[s] + (3 if s == 2 else 0 if s == 5 else 1), (20 + s,)) for s in range(slots)]
    return [first, mixed, last]


def test_a_mixed_step_over_lanes_equals_it_run_whole(tiny_model, one_thread):
    """Routed rows, base rows, prompt chunks and decode rows in gathered slots: logits and KV of
    two lanes match the step on one thread, and a helper lane really ran a share."""
    runner, gen = _routed_runner(tiny_model, 8)
    steps = _steps(gen, 8)
    whole = [runner.forward(StepBatch.build(items)) for items in steps]
    kv_whole = [(k.clone(), v.clone()) for k, v in zip(runner.kv.k, runner.kv.v, strict=True)]
    runner.idle()

    ran_on: list[str] = []
    compute = runner._compute_all

    def spy(batch):
        ran_on.append(threading.current_thread().name)
        return compute(batch)

    runner._compute_all = spy
    assert runner.use_lanes(2) == 2
    split = [runner.forward(StepBatch.build(items)) for items in steps]
    for got, want in zip(split, whole, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for (k, v), (k0, v0) in zip(zip(runner.kv.k, runner.kv.v, strict=True), kv_whole, strict=True):
        torch.testing.assert_close(k[:, :, :32], k0[:, :, :32], atol=1e-5, rtol=0)
        torch.testing.assert_close(v[:, :, :32], v0[:, :, :32], atol=1e-5, rtol=0)
    assert any(name.startswith("polyserve-lane") for name in ran_on)
    assert threading.current_thread().name in ran_on

    assert runner.use_lanes(1) == 1  # back to the whole step on the calling thread
    ran_on.clear()
    runner.forward(StepBatch.build([Item(s, 40, (1,)) for s in range(8)]))
    assert ran_on == [threading.current_thread().name]


def test_a_lanes_error_is_raised_after_every_lane_has_finished(one_thread):
    """The calling lane fails while a helper lane still runs: the error surfaces once the helper
    is done (nothing left writing into the KV cache behind the isolation probes); a helper's
    error surfaces too."""
    lanes = Lanes(2)
    finished: list[int] = []

    def compute(batch: StepBatch) -> torch.Tensor:
        if batch.items[0].slot == 0:  # the calling lane's share (items are dealt 0, 1, 0, 1)
            raise RuntimeError("lane failed")
        time.sleep(0.3)
        finished.append(len(batch.items))
        return torch.zeros((len(batch.items), 4))

    b = StepBatch.build([Item(s, 3, (1,)) for s in range(4)])
    with pytest.raises(RuntimeError, match="lane failed"):
        lanes.run(b, compute)
    assert finished == [2]

    def helper_fails(batch: StepBatch) -> torch.Tensor:
        if batch.items[0].slot == 1:
            raise RuntimeError("helper failed")
        return torch.zeros((len(batch.items), 4))

    with pytest.raises(RuntimeError, match="helper failed"):
        lanes.run(b, helper_fails)
    lanes.close()


def test_only_the_llama_runner_on_a_cpu_splits(tiny_base):
    assert build_model_runner(tiny_base, slots=2, tuning=Tuning(native_executor="hf")).use_lanes(2) == 1
    assert build_model_runner(tiny_base, slots=2, tuning=Tuning(native_executor="llama")).use_lanes(2) == 2
