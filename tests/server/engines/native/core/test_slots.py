"""The native engine's step layout, KV slots and per-slot LoRA tables (step.py, slots.py,
slot_lora.py), against plain references."""

from __future__ import annotations

import re

import pytest
import torch

from server.adapter_cache.types import Adapter
from server.engines.native.core.slots import SlotKV, SlotPool
from server.engines.native.core.step import Item, StepBatch
from server.engines.native.model.slot_lora import Group, Member, SlotLoRA, write_adapter


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


def _lora(slots=4, rank=2, kernel="off", dtype=torch.float32):
    # one layer, two groups: "qkv"-like (q 6 wide, k not adapted, v 3 wide after a 4-wide k) and "o"
    groups = [[Group(5, 6 + 4 + 3, (Member(0, 0, 6), Member(1, 10, 3))), Group(7, 5, (Member(2, 0, 5),))]]
    return SlotLoRA(groups, slots=slots, rank=rank, scale=0.5, dtype=dtype, kernel=kernel)


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
    from server.engines.native.kernels import lora_kernel

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
    from server.engines.native.kernels import lora_kernel

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
    from adapters_store.lora.combine import materialize

    g = torch.Generator().manual_seed(0)
    h, S, r = 2, 3, 2
    order = torch.tensor([1, 0, 3, 2, 5, 4])
    groups = [[Group(4, 6 + 2, (Member(2 * layer, 0, 6, order), Member(2 * layer + 1, 6, 2)))]
              for layer in range(layers)]
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


def _skills(dtype=torch.float32, h=1, S=3, r=2):
    """Skills of _lora's three adapted linears: (A (h, S, d_in/h, r), B (h, S, r, d_out/h))."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(h, S, d_in // h, r, generator=g).to(dtype),
             torch.randn(h, S, r, d_out // h, generator=g).to(dtype))
            for d_in, d_out in ((5, 6), (5, 3), (7, 5))]


def test_write_adapter_clears_serves_layers_without_skills_and_refuses_by_name():
    """write_adapter: None turns an adapted slot back into a base row; a routed task on tables without
    skills (no write_routing there) is served from its materialised layers; an adapter holding
    neither, or any adapter for a backbone without tables, is refused with a message saying so."""
    lora = _lora()
    layers = _adapter(0)
    write_adapter(lora, 0, Adapter("t", "k", "lora", layers))
    assert lora.adapted[0] and lora.A[0][0][0].abs().sum() > 0
    write_adapter(lora, 0, None)
    assert not lora.adapted[0] and lora.A[0][0][0].eq(0).all() and lora.A[0][1][0].eq(0).all()
    assert lora.step(StepBatch.build([Item(0, 4, (1,))])) is None
    assert not lora.routes
    write_adapter(lora, 1, Adapter("t", "k", "routing", layers, torch.full((3, 1, 2), 0.5)))
    plain = _lora()
    plain.write(1, layers)
    for g in (0, 1):
        assert torch.equal(lora.A[0][g][1], plain.A[0][g][1]) and torch.equal(lora.B[0][g][1], plain.B[0][g][1])
    with pytest.raises(ValueError, match=r"^adapter of task 'empty' holds neither routing weights nor LoRA layers$"):
        write_adapter(lora, 2, Adapter("empty", "k", "lora", []))
    write_adapter(None, 0, None)  # a backbone without tables runs base rows
    with pytest.raises(RuntimeError, match=r"^adapters requested but the backbone has no skill inventory$"):
        write_adapter(None, 0, Adapter("t", "k", "lora", layers))
    assert lora.adapted == [False, True, False, False]


def test_slot_lora_refusals_name_what_is_wrong():
    """A mis-shaped A or B alone, a skill list of the wrong length, routing weights before the skills,
    of the wrong rank or count, or of a skill set the inventory does not have: refused, the slot left
    as it was, the message giving the shapes."""
    lora = _lora()
    with pytest.raises(ValueError, match=r"^adapter layer 0: shapes \(5, 3\), \(2, 6\) != \(5, 2\), \(2, 6\)$"):
        lora.write(1, [(torch.zeros(5, 3), torch.zeros(2, 6))] + _adapter(1)[1:])
    with pytest.raises(ValueError, match=r"^adapter layer 2: shapes \(7, 2\), \(2, 4\) != \(7, 2\), \(2, 5\)$"):
        lora.write(1, _adapter(1)[:2] + [(torch.zeros(7, 2), torch.zeros(2, 4))])
    assert not lora.routes
    with pytest.raises(RuntimeError, match=r"^write_routing needs the skills \(set_skills\)$"):
        lora.write_routing(1, torch.full((3, 1, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"^2 skill pairs for 3 adapted linears$"):
        lora.set_skills(_skills()[:2])
    lora.set_skills(_skills())
    assert lora.routes
    w = torch.full((3, 1, 3), 1 / 3)
    for bad in (torch.cat([w, w[:1]]), w[..., None]):  # a row too many; one dimension too many
        with pytest.raises(ValueError, match=rf"^routing weights of shape {re.escape(str(tuple(bad.shape)))} "
                                             r"for 3 linears$"):
            lora.write_routing(1, bad)
    with pytest.raises(ValueError, match=r"^routing weights \(1, 2\) do not match the skills' \(1, 3\)$"):
        lora.write_routing(1, w[:, :, :2])
    assert not any(lora.adapted) and lora.A[0][0].eq(0).all() and lora.A[0][1].eq(0).all()


def test_routed_tables_combine_bfloat16_skills_in_float32():
    """A bfloat16 backbone's skills are combined in float32 on a CPU (then rounded once into the
    tables), not in bfloat16: the tables equal the float32 combine of the same skill values."""
    from adapters_store.lora.combine import materialize

    skills = _skills(torch.bfloat16)
    w = torch.softmax(torch.randn(3, 1, 3, generator=torch.Generator().manual_seed(1)), -1)
    routed, plain = _lora(), _lora()
    routed.set_skills(skills)
    routed.write_routing(2, w)
    plain.write(2, [materialize(a.float(), b.float(), wi) for (a, b), wi in zip(skills, w, strict=True)])
    for g in (0, 1):
        torch.testing.assert_close(routed.A[0][g], plain.A[0][g], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(routed.B[0][g], plain.B[0][g], rtol=1e-6, atol=1e-6)
    assert routed.B[0][1][2].abs().sum() > 0


@pytest.mark.parametrize(("tables", "rows", "rank", "kernel"), [
    (torch.float32, torch.bfloat16, 2, "off"),  # a CPU without the kernel: float32 tables, bfloat16 rows
    (torch.bfloat16, torch.float32, 2, "off"),
    (torch.float64, torch.float64, 2, "auto"),  # tables the kernel does not take: torch ops
    (torch.float32, torch.float32, 65, "auto"),  # a rank the kernel does not take: torch ops
], ids=["f32-tables-bf16-rows", "bf16-tables-f32-rows", "f64", "rank-65"])
def test_slot_lora_adds_into_the_outputs_dtype_whatever_the_tables(tables, rows, rank, kernel):
    """Tables of another dtype than the activations (float32 tables beside a bfloat16 model on a CPU
    without the kernel): the rows are cast to the tables' dtype, the LoRA output added into `out` in
    its own dtype, for the decode rows (gathered slots) and each prompt chunk alike; a dtype or a
    rank the kernel does not take runs on torch ops under kernel=auto."""
    lora = _lora(rank=rank, kernel=kernel, dtype=tables)
    assert lora.kernel is None and lora.A[0][0].dtype == tables and lora.B[0][1].dtype == tables
    adapters = {0: _adapter(0, rank), 1: None, 2: _adapter(2, rank), 3: _adapter(3, rank)}
    for slot, layers in adapters.items():
        if layers is not None:
            lora.write(slot, layers)
    items = [Item(0, 4, (1,)), Item(2, 4, (1,)), Item(3, 0, (1, 2, 3)), Item(1, 0, (1, 2))]
    batch = StepBatch.build(items)
    step = lora.step(batch)
    assert step is not None
    token_slot = [items[i].slot for i in batch.decode] + [3, 3, 3, 1, 1]
    tol = {"rtol": 0.02, "atol": 0.05} if torch.bfloat16 in (tables, rows) else {"rtol": 1e-5, "atol": 1e-5}
    gen = torch.Generator().manual_seed(5)
    for group, width, d_in in ((0, 13, 5), (1, 5, 7)):
        x = torch.randn(batch.size, d_in, generator=gen).to(rows)
        base = torch.randn(batch.size, width, generator=gen).to(rows)
        out = base.clone()
        step.apply(0, group, x, out)
        assert out.dtype == rows
        for t, slot in enumerate(token_slot):
            layers = adapters[slot]
            if layers is None:
                assert torch.equal(out[t], base[t])
                continue
            exact = [(a.to(tables).double(), b.to(tables).double()) for a, b in layers]
            want = base[t].double() + _reference(x[t].to(tables).double(), exact, group).double()
            torch.testing.assert_close(out[t].double(), want, **tol)


def _layered_lora(kernel: str) -> SlotLoRA:
    """Two layers laid out differently: an "up" group the same in both (one buffer over the layers),
    a "qkv" group whose q has its outputs reordered in layer 1 only (a q/k-style column order), and
    an "o" group adapted in layer 0 only (layer 1's row is shorter). Adapted linears 0-3 are layer
    0's (up, q, v, o), 4-6 layer 1's (up, q, v)."""
    order = torch.tensor([1, 0, 3, 2, 5, 4])
    groups: list[list[Group | None]] = [
        [Group(5, 4, (Member(0, 0, 4),)), Group(5, 13, (Member(1, 0, 6), Member(2, 10, 3))),
         Group(7, 5, (Member(3, 0, 5),))],
        [Group(5, 4, (Member(4, 0, 4),)), Group(5, 13, (Member(5, 0, 6, order), Member(6, 10, 3)))],
    ]
    return SlotLoRA(groups, slots=4, rank=2, scale=0.5, dtype=torch.float32, kernel=kernel)


def _layered_adapter(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 4), (5, 6), (5, 3), (7, 5), (5, 4), (5, 6), (5, 3)]
    return [(torch.randn(d_in, 2, generator=g), torch.randn(2, d_out, generator=g)) for d_in, d_out in shapes]


@pytest.mark.parametrize("kernel", ["off", "on"], ids=["torch-ops", "native-kernel"])
def test_slot_lora_with_layers_laid_out_differently(kernel):
    """Groups that differ between layers (only in a member's output order, or adapted in one layer
    only): each layer's rows get that layer's own LoRA in its own column order, after writes, a copy
    and a clear, decode rows in gathered slots and a prompt chunk."""
    from server.engines.native.kernels import lora_kernel

    if kernel == "on" and lora_kernel.load() is None:
        pytest.skip(f"no LoRA kernel: {lora_kernel.error()}")
    lora = _layered_lora(kernel)
    adapters = {0: _layered_adapter(0), 1: _layered_adapter(2), 2: _layered_adapter(2), 3: None}
    lora.write(0, adapters[0])
    lora.write(2, adapters[2])
    lora.copy(2, 1)
    lora.write(3, _layered_adapter(3))
    lora.clear(3)
    batch = StepBatch.build([Item(1, 4, (1,)), Item(3, 4, (1,)), Item(0, 0, (1, 2, 3))])
    step = lora.step(batch)
    assert step is not None and not batch.decode_contiguous
    token_slot = [1, 3, 0, 0, 0]
    gen = torch.Generator().manual_seed(1)
    for layer, row in enumerate(lora.groups):
        for group, g in enumerate(row):
            assert g is not None
            x = torch.randn(batch.size, g.d_in, generator=gen)
            out = torch.zeros(batch.size, g.d_out)
            step.apply(layer, group, x, out)
            for t, slot in enumerate(token_slot):
                want = torch.zeros(g.d_out)
                for m in ([] if adapters[slot] is None else g.members):
                    a, b = adapters[slot][m.index]
                    y = x[t] @ a @ b * 0.5
                    want[m.start : m.start + m.width] = y if m.order is None else y[m.order]
                torch.testing.assert_close(out[t], want)


@pytest.mark.parametrize("kernel", ["off", "on"], ids=["torch-ops", "native-kernel"])
def test_only_an_adapted_prompt_gets_the_lora_beside_base_rows(kernel):
    """A base row decoding and a base prompt chunk ahead of a task's prompt chunk: the LoRA lands on
    the task's tokens (rows 3-5 of the step), none on the base rows' (rows 0-2)."""
    from server.engines.native.kernels import lora_kernel

    if kernel == "on" and lora_kernel.load() is None:
        pytest.skip(f"no LoRA kernel: {lora_kernel.error()}")
    lora = _lora(kernel=kernel)
    lora.write(0, _adapter(0))
    batch = StepBatch.build([Item(1, 4, (1,)), Item(2, 0, (1, 2)), Item(0, 0, (1, 2, 3))])
    step = lora.step(batch)
    assert step is not None
    gen = torch.Generator().manual_seed(2)
    for group, width, d_in in ((0, 13, 5), (1, 5, 7)):
        x = torch.randn(batch.size, d_in, generator=gen)
        out = torch.zeros(batch.size, width)
        step.apply(0, group, x, out)
        assert out[:3].eq(0).all()
        for t in range(3, 6):
            torch.testing.assert_close(out[t], _reference(x[t], _adapter(0), group))
