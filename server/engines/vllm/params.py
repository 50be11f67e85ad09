"""polyserve SamplingParams -> vLLM SamplingParams (pure: no engine, importable without vLLM
only for the mapping; the caller passes vLLM's classes)."""

from __future__ import annotations

from typing import Any

from server.engines.request import GenRequest, SamplingParams


def vllm_kwargs(p: SamplingParams) -> dict[str, Any]:
    """The keyword arguments of vllm.SamplingParams that give the same sampling as `p`.

    Greedy is temperature 0 (vLLM's argmax); top_k 0 is vLLM's "off" (0 or -1); a seed applies
    to the request (vLLM draws the n choices from one generator, so seeded choices are
    reproducible but not the native engine's seed + i per choice).
    """
    kwargs: dict[str, Any] = {
        "n": p.n,
        "max_tokens": p.max_new_tokens,
        "temperature": 0.0 if p.greedy else p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "seed": p.seed,
        "stop": list(p.stop) or None,
        "ignore_eos": p.ignore_eos,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
        "logprobs": p.logprobs,
        "prompt_logprobs": p.prompt_logprobs,
        "skip_special_tokens": p.skip_special_tokens,
        "min_tokens": p.min_tokens,
        "stop_token_ids": list(p.stop_token_ids) or None,
        "include_stop_str_in_output": p.include_stop_str_in_output,
        "min_p": p.min_p,
    }
    if p.logit_bias:
        kwargs["logit_bias"] = {int(t): float(b) for t, b in p.logit_bias}
    return kwargs


def cache_salt(req: GenRequest) -> str:
    """vLLM's cache_salt for a request: its tenant and its own salt, so vLLM's prefix cache reuses
    a prompt's KV only within the tenant (and salt) that computed it."""
    return repr((req.tenant, req.cache_salt))
