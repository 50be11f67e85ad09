"""A training step's attention: eager on CPU inside the step, the model's own outside it."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import training.trainer as trainer_module
from adapters_store.backbone.load import Backbone, fingerprint
from training.step_attention import TRAINING_ATTENTION, training_attention
from training.suite import examples, parse_task
from training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def make_trainer(model, tokenizer) -> Trainer:
    tasks = {t: examples(parse_task(t), 8, seed=0, split="train") for t in ("upper", "rev-words")}
    cfg = TrainConfig(method="mhr", n_skills=4, n_heads=2, rank=4, steps=3, batch_size=4, lr_skills=1e-2,
                      autocast="none", seed=0)
    return Trainer(cfg, Backbone(model, tokenizer, "tiny", fingerprint(model), 0.0), tasks)


def test_a_training_step_runs_eager_attention_and_gives_the_model_its_own_back(tiny_base, tokenizer):
    model = copy.deepcopy(tiny_base)
    assert model.config._attn_implementation == "sdpa"
    seen: list[str] = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, _: seen.append(m.config._attn_implementation))
    trainer = make_trainer(model, tokenizer)
    trainer.train_step()
    assert seen == [TRAINING_ATTENTION]
    assert model.config._attn_implementation == "sdpa"


def test_eager_and_sdpa_steps_train_the_same(tiny_base, tokenizer, monkeypatch):
    """The swap changes how attention is computed, not what: float32 losses agree to rounding."""
    eager = make_trainer(copy.deepcopy(tiny_base), tokenizer)
    eager_losses = [eager.train_step() for _ in range(3)]
    monkeypatch.setattr(trainer_module, "training_attention", lambda model, device: contextlib.nullcontext())
    sdpa = make_trainer(copy.deepcopy(tiny_base), tokenizer)
    sdpa_losses = [sdpa.train_step() for _ in range(3)]
    assert eager_losses == pytest.approx(sdpa_losses, rel=1e-5)


def test_off_cpu_and_after_an_error_the_attention_is_the_models(tiny_base):
    model = copy.deepcopy(tiny_base)
    with training_attention(model, torch.device("cuda")):
        assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), training_attention(model, torch.device("cpu")):
        assert model.config._attn_implementation == TRAINING_ATTENTION
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
