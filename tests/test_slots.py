"""The native engine's step layout, KV slots and per-slot LoRA tables (step.py, slots.py,
slot_lora.py), against plain references."""

from __future__ import annotations

import pytest
import torch

from server.engines.native.slot_lora import Group, Member, SlotLoRA
from server.engines.native.slots import SlotKV, SlotPool
from server.engines.native.step import Item, StepBatch


def test_step_layout_puts_the_decode_group_first_in_slot_order():
    items = [Item(3, 10, (7,)), Item(0, 0, (1, 2, 3), "all"), Item(1, 4, (9,)), Item(2, 5, (4, 5), "none")]
    b = StepBatch.build(items)
    assert b.tokens.tolist() == [9, 7, 1, 2, 3, 4, 5]  # slot 1, slot 3, then the chunks in order
    assert b.positions.tolist() == [4, 10, 0, 1, 2, 5, 6]
    assert b.decode == [2, 0] and b.decode_slots == [1, 3] and not b.decode_contiguous
    assert b.decode_mask is not None and b.decode_mask.shape == (2, 1, 1, 11)
    assert b.decode_mask[0, 0, 0].tolist() == [True] * 5 + [False] * 6  # slot 1 sees positions 0..4
    assert b.logit_index.tolist() == [1, 2, 3, 4, 0]  # item order: last of item 0, all of item 1, item 2
    assert [(r.start, r.stop) for r in b.logit_rows] == [(0, 1), (1, 4), (4, 5), (5, 5)]
    assert b.chunks[0].mask is None  # a chunk from position 0: plain causal
    assert b.chunks[1].mask.tolist() == [[True] * 6 + [False], [True] * 7]  # from position 5
    assert b.attention_length == 11
    assert StepBatch.build([Item(0, 3, (1,)), Item(1, 2, (2,))]).decode_contiguous
    with pytest.raises(ValueError, match="share a slot"):
        StepBatch.build([Item(0, 0, (1,)), Item(0, 1, (2,))])


def test_subset_keeps_only_the_chosen_items():
    b = StepBatch.build([Item(0, 0, (1, 2)), Item(1, 3, (5,)), Item(2, 1, (6,))])
    sub = b.subset([0, 2])
    assert [it.slot for it in sub.items] == [0, 2] and sub.tokens.tolist() == [6, 1, 2]


def test_pool_keeps_slots_dense_by_moving_the_highest_down():
    pool = SlotPool(4)
    a, b = pool.take("a"), pool.take("b", 2)
    assert (a, b) == ([0], [1, 2]) and pool.free_slots == 1
    assert pool.free(0) == (2, 0, "b")  # b's second slot moves into the hole
    assert pool.holders == ["b", "b"]
    assert pool.free(1) is None and pool.used == 1
    with pytest.raises(RuntimeError):
        pool.take("c", 4)
    with pytest.raises(RuntimeError):
        pool.free(3)


def test_slot_kv_grows_keeping_contents_copies_and_resets():
    kv = SlotKV(2, 3, 2, 4, dtype=torch.float32, capacity=8)
    kv.k[1][2, :, :5] = 1.5
    assert kv.ensure(20) and kv.capacity == 32
    assert kv.k[1][2, :, :5].eq(1.5).all() and kv.k[1][2, :, 5:].eq(0).all()
    assert not kv.ensure(32)
    kv.copy(2, 0, 3)
    assert kv.k[1][0, :, :3].eq(1.5).all() and kv.k[1][0, :, 3:].eq(0).all()
    with pytest.raises(ValueError, match="exceed"):
        kv.ensure(100, limit=64)
    kv.reset(8)
    assert kv.capacity == 8


def _lora(slots=4, rank=2, kernel="off"):
    # one layer, two groups: "qkv"-like (q 6 wide, k not adapted, v 3 wide after a 4-wide k) and "o"
    groups = [[Group(5, 6 + 4 + 3, (Member(0, 0, 6), Member(1, 10, 3))), Group(7, 5, (Member(2, 0, 5),))]]
    return SlotLoRA(groups, slots=slots, rank=rank, scale=0.5, dtype=torch.float32, kernel=kernel)


def _adapter(seed: int, rank=2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, rank, generator=g), torch.randn(rank, 6, generator=g)),
            (torch.randn(5, rank, generator=g), torch.randn(rank, 3, generator=g)),
            (torch.randn(7, rank, generator=g), torch.randn(rank, 5, generator=g))]


def _reference(x: torch.Tensor, layers, group: int) -> torch.Tensor:
    """The fused group's LoRA output for one token, member by member."""
    if group == 0:
        out = torch.zeros(13)
        out[0:6] = x @ layers[0][0] @ layers[0][1] * 0.5
        out[10:13] = x @ layers[1][0] @ layers[1][1] * 0.5
        return out
    return x @ layers[2][0] @ layers[2][1] * 0.5


@pytest.mark.parametrize("kernel", ["off", "on"], ids=["torch-ops", "native-kernel"])
@pytest.mark.parametrize("slots_of_decode", [[0, 1, 2], [0, 2, 3]], ids=["dense", "gathered"])
def test_slot_lora_equals_each_rows_own_lora(slots_of_decode, kernel):
    from server.engines.native import lora_kernel

    if kernel == "on" and lora_kernel.load() is None:
        pytest.skip(f"no LoRA kernel: {lora_kernel.error()}")
    lora = _lora(kernel=kernel)
    assert (lora.kernel is not None) == (kernel == "on")
    adapters = {0: _adapter(0), 1: None, 2: _adapter(2), 3: _adapter(3)}
    for slot, layers in adapters.items():
        if layers is None:
            lora.clear(slot)
        else:
            lora.write(slot, layers)
    items = [Item(s, 4, (1,)) for s in slots_of_decode] + [Item(1 if 1 not in slots_of_decode else 3, 0, (1, 2, 3))]
    batch = StepBatch.build(items)
    step = lora.step(batch)
    assert step is not None
    token_slot = [items[i].slot for i in batch.decode] + [items[-1].slot] * 3
    for group, width, d_in in ((0, 13, 5), (1, 5, 7)):
        x = torch.randn(batch.size, d_in)
        out = torch.zeros(batch.size, width)
        step.apply(0, group, x, out)
        for t, slot in enumerate(token_slot):
            want = torch.zeros(width) if adapters[slot] is None else _reference(x[t], adapters[slot], group)
            torch.testing.assert_close(out[t], want)


def test_slot_lora_copy_clear_and_no_work_for_base_rows():
    lora = _lora()
    lora.write(0, _adapter(0))
    lora.copy(0, 3)
    for a in (lora.A[0][0], lora.B[0][0], lora.A[0][1]):
        assert torch.equal(a[3], a[0])
    lora.clear(3)
    assert lora.A[0][0][3].eq(0).all() and not lora.adapted[3]
    assert lora.step(StepBatch.build([Item(1, 2, (5,)), Item(3, 0, (1, 2))])) is None  # base rows only
    with pytest.raises(ValueError, match="shapes"):
        lora.write(1, [(torch.zeros(5, 3), torch.zeros(3, 6))] + _adapter(1)[1:])
    with pytest.raises(ValueError, match="layers"):
        lora.write(1, _adapter(1)[:2])


@pytest.mark.parametrize("kernel", ["off", "on"], ids=["torch-ops", "native-kernel"])
def test_copy_from_a_base_row_clears_the_destination(kernel):
    """A base row moved into a slot that held another task's row (slot compaction) runs without
    an adapter, not the previous row's task, beside an adapted row."""
    from server.engines.native import lora_kernel

    if kernel == "on" and lora_kernel.load() is None:
        pytest.skip(f"no LoRA kernel: {lora_kernel.error()}")
    lora = _lora(kernel=kernel)
    lora.write(0, _adapter(0))
    lora.write(3, _adapter(3))
    lora.clear(1)
    lora.copy(1, 3)
    assert not lora.adapted[3] and lora.A[0][0][3].eq(0).all() and lora.A[0][1][3].eq(0).all()
    batch = StepBatch.build([Item(0, 4, (1,)), Item(3, 4, (1,))])
    step = lora.step(batch)
    assert step is not None  # slot 0's row has an adapter: the LoRA runs over both rows
    for group, width, d_in in ((0, 13, 5), (1, 5, 7)):
        x = torch.randn(2, d_in)
        out = torch.zeros(2, width)
        step.apply(0, group, x, out)
        torch.testing.assert_close(out[0], _reference(x[0], _adapter(0), group))
        assert out[1].eq(0).all()  # the base row
    assert lora.step(StepBatch.build([Item(3, 0, (1, 2))])) is None  # slot 3 alone: no LoRA work at all


@pytest.mark.parametrize("layers", [3, 1], ids=["stacked", "one-layer"])
def test_tables_from_routing_weights_equal_the_materialised_adapters(layers):
    """write_routing (the combine straight into the slot) writes exactly what write() writes from
    the materialised adapter of the same weights; an MHR skill set (h=2), q/k-style column order."""
    from adapters_store.combine import materialize

    g = torch.Generator().manual_seed(0)
    h, S, r = 2, 3, 2
    order = torch.tensor([1, 0, 3, 2, 5, 4])
    groups = [[Group(4, 6 + 2, (Member(2 * layer, 0, 6, order), Member(2 * layer + 1, 6, 2)))] for layer in range(layers)]
    skills = [(torch.randn(h, S, 4 // h, r, generator=g), torch.randn(h, S, r, w // h, generator=g))
              for _ in range(layers) for w in (6, 2)]
    weights = torch.softmax(torch.randn(2 * layers, h, S, generator=g), -1)
    materialised = [materialize(a, b, w) for (a, b), w in zip(skills, weights, strict=True)]
    routed = SlotLoRA(groups, slots=3, rank=r, scale=0.5, dtype=torch.float32)
    plain = SlotLoRA(groups, slots=3, rank=r, scale=0.5, dtype=torch.float32)
    routed.set_skills(skills)
    routed.write_routing(1, weights)
    plain.write(1, materialised)
    for layer in range(layers):
        torch.testing.assert_close(routed.A[layer][0], plain.A[layer][0])
        torch.testing.assert_close(routed.B[layer][0], plain.B[layer][0])
    assert plain.B[0][0][1].abs().sum() > 0 and routed.adapted[1]
    with pytest.raises(ValueError, match="routing weights"):
        routed.write_routing(0, weights[:, :, :2])
