"""A tiny random Llama and a byte-level tokenizer, built in-process (< 1 s, no files) for tests."""

from __future__ import annotations

from typing import Any

import torch

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer() -> Any:
    """Byte-level BPE with no merges: 256 byte tokens + 3 specials (eos = <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(sorted(byte_alphabet))}
    for special in SPECIALS:
        vocab[special] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS,
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def tiny_llama(seed: int = 0, vocab_size: int = 259, hidden: int = 64, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=258,
        bos_token_id=257,
        pad_token_id=256,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()
