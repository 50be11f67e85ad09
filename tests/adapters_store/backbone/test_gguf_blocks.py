"""adapters_store/backbone/gguf_blocks.py: the blocks of a GGUF a model was dequantised from, found
by Hugging Face name, in Hugging Face row order (q/k un-permuted), and handed over only where they
reproduce the model's weight bit for bit. The GGUFs here are written by the `gguf` package's own
writer (as llama.cpp's converter writes them: q/k rows permuted, a tokenizer's string arrays in the
metadata)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from adapters_store.backbone import gguf_blocks
from adapters_store.backbone.gguf_blocks import QuantWeight, concat, dequantize, quantize, stored_blocks
from adapters_store.backbone.tiny import tiny_llama
from tests.support.gguf_file import write_gguf as _write

pytest.importorskip("gguf")


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_quantize_then_dequantize_stays_within_half_a_step(fmt):
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(0))
    q = quantize(w, fmt)
    assert q.blocks.dtype == torch.uint8 and q.blocks.shape == (24, 3 * gguf_blocks.BLOCK_BYTES[fmt])
    back = dequantize(q).view(24, 3, 32)
    blocks = w.view(24, 3, 32)
    step = (blocks.amax(-1) - blocks.amin(-1)) / 15 if fmt == "Q4_1" else blocks.abs().amax(-1) / 127
    err = (back - blocks).abs().amax(-1)
    assert (err <= step * 0.5 + 1e-3 * blocks.abs().amax(-1)).all()  # + the fp16 rounding of d and m
    assert torch.equal(dequantize(quantize(back.view(24, 96), fmt)), back.view(24, 96))  # a fixed point


def test_rows_and_concat_move_whole_rows_of_blocks():
    a = quantize(torch.randn(4, 64), "Q4_1")
    b = quantize(torch.randn(3, 64), "Q4_1")
    index = torch.tensor([3, 1, 0, 2])
    assert torch.equal(dequantize(a.rows(index)), dequantize(a)[index])
    assert torch.equal(dequantize(concat([a, b])), torch.cat([dequantize(a), dequantize(b)]))
    with pytest.raises(ValueError, match="cannot fuse"):
        concat([a, quantize(torch.randn(2, 64), "Q8_0")])
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(2, 40), "Q4_1")


@pytest.mark.parametrize("alignment", [32, 64])
def test_every_linear_comes_back_in_hugging_face_row_order(tmp_path, alignment):
    model = tiny_llama(hidden=64)
    _write(model, tmp_path, alignment=alignment)
    found = stored_blocks(model)
    names = {n for n, p in model.named_parameters() if n.endswith("proj.weight")} | {"lm_head.weight"}
    assert set(found) == names
    params = dict(model.named_parameters())
    for name, blocks in found.items():
        assert isinstance(blocks, QuantWeight)
        assert blocks.fmt == ("Q8_0" if name == "lm_head.weight" else "Q4_1")
        assert torch.equal(dequantize(blocks), params[name].detach())


def test_a_wrapped_linear_is_found_under_its_unwrapped_name(tmp_path):
    """A server wraps its adapted linears (RoutedModel: the frozen one becomes `q_proj.base`); their
    blocks are still found, by the names the unwrapped model has, and stand for the wrapped weight."""
    from adapters_store.lora.inject import RoutedModel
    from adapters_store.lora.spec import InventorySpec

    model = tiny_llama(hidden=64)
    _write(model, tmp_path)
    RoutedModel(model, InventorySpec(n_skills=2, n_heads=2, rank=4, target_modules=("q_proj", "o_proj")))
    found = stored_blocks(model)
    assert len(found) == 2 * 7 + 1
    wrapped = model.model.layers[1].self_attn.q_proj.base.weight
    assert torch.equal(dequantize(found["model.layers.1.self_attn.q_proj.weight"]), wrapped.detach())
    assert "model.layers.1.self_attn.q_proj.base.weight" not in found


def test_a_weight_that_differs_in_one_bit_is_left_out(tmp_path, caplog):
    model = tiny_llama(hidden=64)
    _write(model, tmp_path)
    w = model.model.layers[1].mlp.up_proj.weight
    w.data[3, 5] = torch.nextafter(w.data[3, 5], torch.tensor(1.0))
    with caplog.at_level(logging.WARNING, logger="polyserve.backbone"):
        found = stored_blocks(model)
    assert "model.layers.1.mlp.up_proj.weight" not in found
    assert "model.layers.1.mlp.down_proj.weight" in found and len(found) == 2 * 7  # 14 linears + head - 1
    assert "1 weights differ" in caplog.text


def test_a_model_from_no_gguf_or_an_unreadable_one_has_no_blocks(tmp_path, caplog):
    model = tiny_llama(hidden=64)
    assert stored_blocks(model) == {}  # no READY record
    (tmp_path / "model.gguf").write_bytes(b"not a gguf at all, just bytes")
    (tmp_path / "READY").write_text(json.dumps({"source": str(tmp_path / "model.gguf")}))
    model.config._name_or_path = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="polyserve.backbone"):
        assert stored_blocks(model) == {}
    assert "not a GGUF file" in caplog.text


def test_a_truncated_file_is_refused_not_read_past_its_end(tmp_path, caplog):
    model = tiny_llama(hidden=64)
    path = _write(model, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])  # into output.weight, the last tensor written
    with caplog.at_level(logging.WARNING, logger="polyserve.backbone"):
        found = stored_blocks(model)
    assert "lm_head.weight" not in found and "model.layers.1.mlp.down_proj.weight" in found
    assert "ends inside a tensor" in caplog.text
    assert gguf_blocks._tensor_table(path)["blk.0.attn_k.weight"][1] == (64, 32)  # (in, out), as GGUF lists
