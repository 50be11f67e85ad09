"""Backbone loading: tiny (fast) and the real embedded default (slow)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from adapters_store.backbone.load import fingerprint, load_backbone
from adapters_store.backbone.tiny import tiny_llama


def test_tiny_backbone_is_frozen_and_fingerprinted():
    bb = load_backbone("tiny")
    assert not bb.model.training
    assert not any(p.requires_grad for p in bb.model.parameters())
    assert bb.fingerprint == load_backbone("tiny").fingerprint
    assert bb.fingerprint != fingerprint(tiny_llama(seed=1))
    assert bb.tokenizer.pad_token is not None


def test_local_hf_directory_backbone(tmp_path):
    from adapters_store.backbone.tiny import tiny_tokenizer

    model = tiny_llama(seed=3)
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    bb = load_backbone(str(tmp_path / "m"))
    assert bb.fingerprint == fingerprint(model)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_backbone(str(tmp_path / "nothing"))


def test_bad_dtype_refused():
    with pytest.raises(ValueError, match="dtype"):
        load_backbone("tiny", dtype="float8")


@pytest.mark.slow
def test_default_backbone_answers_and_reloads_fast(tmp_path_factory):
    """First load dequantises the GGUF into POLYSERVE_HOME; a fresh process reloads the same weights
    (load time is measured by bench/startup.py, not asserted on a shared CPU)."""
    bb = load_backbone("default")
    tok = bb.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = bb.model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"default backbone answer: {answer!r}")
    assert "Paris" in answer
    code = (
        "from adapters_store.backbone.load import load_backbone;"
        "bb = load_backbone('default'); print(f'{bb.load_seconds:.2f} {bb.fingerprint}')"
    )
    line = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    seconds, fp = float(line[-2]), line[-1]
    print(f"second load (fresh process, from the safetensors cache): {seconds:.2f} s")
    assert fp == bb.fingerprint  # the reload read the dequantised cache, not the GGUF again
