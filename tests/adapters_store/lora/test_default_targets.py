"""Default LoRA targets per architecture (adapters_store.lora.targets), on small random models of
several architectures built here from transformers' own config classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from adapters_store.backbone.tiny import tiny_tokenizer
from adapters_store.lora.inject import RoutedModel, find_target_linears
from adapters_store.lora.spec import InventorySpec
from adapters_store.lora.targets import ATTENTION_BY_MODEL_TYPE, attention_linears, default_targets
from adapters_store.store.directory import DirectoryStore

VOCAB = 259  # tiny_tokenizer's
LAYERS = 2
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128, "pad_token_id": 256,
         "bos_token_id": 257, "eos_token_id": 258,
         # the GPT-2-style names (gptj, codegen, bloom, mpt)
         "n_embd": 32, "n_layer": LAYERS, "n_head": 4, "d_model": 32, "n_heads": 4, "n_layers": LAYERS,
         "ffn_dim": 64, "word_embed_proj_dim": 32, "rotary_dim": 4}

# fused or not: what the attention of each architecture is made of
EXPECTED = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "gemma2": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "olmo2": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mistral": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "starcoder2": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "phi3": ("qkv_proj", "o_proj"),
    "phi": ("q_proj", "k_proj", "v_proj", "dense"),
    "gpt_neox": ("query_key_value", "dense"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj"),
    "gptj": ("q_proj", "k_proj", "v_proj", "out_proj"),
    "codegen": ("qkv_proj", "out_proj"),
    "bloom": ("query_key_value", "dense"),
    "falcon": ("query_key_value", "dense"),
    "mpt": ("Wqkv", "out_proj"),
}


def small_model(model_type: str, seed: int = 0) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **SMALL)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_the_default_is_every_attention_projection_the_architecture_has(model_type: str) -> None:
    model = small_model(model_type)
    targets = default_targets(model)
    assert targets == EXPECTED[model_type] == ATTENTION_BY_MODEL_TYPE[model_type]
    names = find_target_linears(model, targets)
    assert len(names) == LAYERS * len(targets), names
    # each one sits in an attention block, and no attention linear is left out
    assert all(any(w in n.rsplit(".", 2)[-2].lower() for w in ("attn", "attention")) for n in names), names
    assert set(attention_linears(model)) == set(targets)

    # the skills wrap them and move the logits
    spec = InventorySpec(n_skills=2, n_heads=1, rank=2, target_modules=targets)
    rm = RoutedModel(model, spec)
    rm.reset_skills(0)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        base = model(input_ids=ids).logits
        for layer in rm.layers:
            layer.lora_B.normal_(0, 1.0)
        rm.set_weights(torch.full((len(rm.layers), 1, 1, 2), 0.5))  # (L, N, h, S)
        routed = model(input_ids=ids).logits
    assert not torch.allclose(base, routed)


def test_an_unlisted_architecture_with_q_k_v_o_gets_them() -> None:
    model = small_model("llama")
    model.config.model_type = "some-new-llama"
    assert default_targets(model) == ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_bigcode-unlisted"])
def test_no_guess_where_none_are_known(model_type: str) -> None:
    if model_type == "gpt2":  # its attention is transformers' Conv1D, which no LoRA layer here wraps
        model = small_model("gpt2")
        with pytest.raises(ValueError, match=r"model type 'gpt2' \(it has no nn.Linear inside an attention block\)"):
            default_targets(model)
    else:  # an attention whose linears are not q/k/v/o, of a type the table does not list
        model = small_model("gpt_bigcode")
        model.config.model_type = "unlisted"
        with pytest.raises(ValueError, match=r"'unlisted' \(its attention's nn.Linear modules are \['c_attn', "
                                             r"'c_proj'\]\): name them with --targets"):
            default_targets(model)


def test_polyserve_train_on_a_phi3_directory_needs_no_targets(tmp_path: Path) -> None:
    """The newcomer's case: `polyserve train --backbone DIR` on a Phi-3 (fused qkv_proj) model
    used to fail with "target modules ['q_proj', 'k_proj', 'v_proj'] match no nn.Linear"."""
    from training import cli

    src = tmp_path / "phi3"
    small_model("phi3").save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    data = tmp_path / "tasks.jsonl"
    with data.open("w") as fh:
        for task in ("swap", "copy"):
            for i in range(8):
                out = f"x{i} w{i}" if task == "swap" else f"w{i} x{i}"
                fh.write(json.dumps({"task": task, "input": f"w{i} x{i}", "output": out}) + "\n")
    store_dir = tmp_path / "store"
    args = ["--suite", str(data), "--method", "mhr", "--skills", "2", "--heads", "1", "--rank", "2", "--steps", "2",
            "--batch-size", "2", "--backbone", str(src), "--store", str(store_dir), "--no-progress",
            "--autocast", "none", "--examples-per-task", "8"]
    res = CliRunner().invoke(cli.train, args)
    assert res.exit_code == 0, res.output
    info = DirectoryStore(store_dir).inventory_info()
    assert info.spec.target_modules == ("qkv_proj", "o_proj")
    assert len(info.layer_names) == LAYERS * 2 and all(n.endswith(("qkv_proj", "o_proj")) for n in info.layer_names)
