"""OpenAI response pieces from engine results: pure functions (the routes only assemble them).

    completion logprobs (legacy shape), per token of `text`:
        tokens[i]          the token's text
        token_logprobs[i]  its logprob (None for the first prompt token: nothing conditions it)
        top_logprobs[i]    {text: logprob} of the k most likely tokens, plus the chosen one
        text_offset[i]     the character of the choice's `text` where the token starts (echo: the
                           prompt's first token is at 0; otherwise the first generated token is)
    A token that is part of a UTF-8 character is written `bytes:\\xNN...` (OpenAI's convention);
    chat entries carry each token's exact `bytes`.
    chat logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}

Logprobs are clamped to >= -9999.0 (OpenAI's floor; JSON has no -Infinity).
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any

from server.engines.request import FinalEvent, FinishReason, TokenLogprob

LOGPROB_FLOOR = -9999.0


def finish_reason(reason: FinishReason) -> str:
    return "length" if reason == "length" else "stop"


def usage(finals: Sequence[FinalEvent]) -> dict[str, Any]:
    """One prompt, summed completions over the choices; the prompt tokens the prefix cache held."""
    prompt = finals[0].prompt_tokens if finals else 0
    completion = sum(f.completion_tokens for f in finals)
    cached = finals[0].cached_tokens if finals else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) or logprob < LOGPROB_FLOOR else float(logprob)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token uses for each
    byte -> that byte (printable bytes stand for themselves, the others are shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_DECODER = _byte_decoder()


class TokenText:
    """Token id -> its bytes and its text (memoised). A byte-level BPE token's true bytes come
    from its vocabulary string; a token that is not valid UTF-8 on its own (part of a character)
    is written `bytes:\\xe2\\x80` as OpenAI does; other tokenizers fall back to decode()."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def bytes(self, token_id: int) -> bytes:
        out = self._bytes.get(token_id)
        if out is None:
            out = self._bytes[token_id] = self._compute(token_id)
        return out

    def _compute(self, token_id: int) -> builtins.bytes:  # `bytes` in this class is the method
        if self._byte_level and token_id not in self._special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in BYTE_DECODER for ch in piece):
                return bytes(BYTE_DECODER[ch] for ch in piece)
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def __call__(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def completion_logprobs(text_of: TokenText, entries: Sequence[TokenLogprob | None], ids: Sequence[int],
                        offset: int = 0) -> tuple[dict[str, list], int]:
    """The legacy logprobs object for tokens `ids` (entries[i] None: no logprob for ids[i]),
    the first starting at character `offset`; returns it and the offset after the last token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    sofar = b""
    for token_id, entry in zip(ids, entries, strict=True):
        token = text_of(token_id)
        out["tokens"].append(token)
        # characters completed before this token's first byte
        out["text_offset"].append(offset + len(sofar.decode("utf-8", errors="ignore")))
        sofar += text_of.bytes(token_id)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {text_of(t): clamp(lp) for t, lp in entry.top}
        top.setdefault(token, clamp(entry.logprob))
        out["token_logprobs"].append(clamp(entry.logprob))
        out["top_logprobs"].append(top)
    return out, offset + len(sofar.decode("utf-8", errors="replace"))


def merge_completion_logprobs(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    return {key: first[key] + second[key] for key in first}


def _chat_token(text_of: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": text_of(token_id), "logprob": clamp(logprob), "bytes": list(text_of.bytes(token_id))}


def chat_logprobs(text_of: TokenText, entries: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
    content = []
    for entry in entries:
        item = _chat_token(text_of, entry.token_id, entry.logprob)
        item["top_logprobs"] = [_chat_token(text_of, t, lp) for t, lp in entry.top[:k]]
        content.append(item)
    return {"content": content, "refusal": None}
