"""Default LoRA targets per architecture: the attention projections a model type has.

Like PEFT's per-model-type defaults, keyed by the Hugging Face ``config.model_type``, but all of the
attention's projections (input and output), fused or not: Phi-3 has one ``qkv_proj``, GPT-NeoX
and Falcon ``query_key_value``, OPT ``out_proj`` for the output. A model type not listed gets the
common ``q_proj k_proj v_proj o_proj`` when its attention has all four; otherwise there is no
guess, and the error names the model type and the linears its attention has, for ``--targets``.
"""

from __future__ import annotations

from torch import nn

from adapters_store.lora.spec import ATTENTION_TARGETS

__all__ = ["ATTENTION_BY_MODEL_TYPE", "attention_linears", "default_targets"]

_QKVO = ATTENTION_TARGETS
ATTENTION_BY_MODEL_TYPE: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
         "gemma2", "gemma3_text", "olmo", "olmo2", "olmo3", "granite", "granitemoe", "cohere", "cohere2",
         "starcoder2", "stablelm", "smollm3", "helium", "exaone4", "seed_oss", "arcee", "apertus", "phimoe",
         "glm", "glm4"),
        _QKVO,
    ),
    "phi": ("q_proj", "k_proj", "v_proj", "dense"),
    "phi3": ("qkv_proj", "o_proj"),
    "codegen": ("qkv_proj", "out_proj"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj"),
    "gptj": ("q_proj", "k_proj", "v_proj", "out_proj"),
    "gpt_neox": ("query_key_value", "dense"),
    "falcon": ("query_key_value", "dense"),
    "bloom": ("query_key_value", "dense"),
    "mpt": ("Wqkv", "out_proj"),
    # the output projection is named c_proj, as the MLP's is: targets match by last name, so only
    # the fused input projection is the attention's alone
    "gpt_bigcode": ("c_attn",),
}

_ATTENTION_WORDS = ("attn", "attention")


def attention_linears(model: nn.Module) -> list[str]:
    """The distinct last names of the nn.Linear modules inside an attention block, model order."""
    seen: dict[str, None] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and "." in name:
            parent, last = name.rsplit(".", 1)
            if any(word in parent.rsplit(".", 1)[-1].lower() for word in _ATTENTION_WORDS):
                seen.setdefault(last, None)
    return list(seen)


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """The attention projections of ``model``'s architecture (see the module doc); ValueError,
    naming the model type and its attention's linears, when none are known."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in ATTENTION_BY_MODEL_TYPE:
        return ATTENTION_BY_MODEL_TYPE[model_type]
    found = attention_linears(model)
    if set(_QKVO) <= set(found):
        return _QKVO
    what = f"model type {model_type!r}" if model_type else type(model).__name__
    has = f"its attention's nn.Linear modules are {found}" if found else "it has no nn.Linear inside an attention block"
    raise ValueError(f"no default LoRA targets are known for {what} ({has}): name them with --targets")
