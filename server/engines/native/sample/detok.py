"""Incremental detokenisation and stop strings for one row.

Decoding token by token breaks multi-byte characters and merges; like TGI/vLLM we decode a
window `tokens[prefix:]` and emit only the part past `tokens[prefix:read]` once it no longer ends
in an incomplete character. Stop strings are searched in the accumulated text; the longest
suffix that could still begin a stop string is held back so a stream never shows part of one.

vLLM's options: skip_special_tokens (specials add no text, the default), include_stop (the stop
string stays at the end of the text), min_tokens (stop strings are looked for only once more than
min_tokens tokens were added, as vLLM's detokenizer does, and only occurrences that end in text not
searched before count).
"""

from __future__ import annotations

from typing import Any


def _holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: tuple[str, ...] = (), *,
                 skip_special_tokens: bool = True, include_stop: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.added = 0  # tokens added so far
        self.searched = 0  # characters of text already searched for stop strings (or passed by, min_tokens)
        self.ids: list[int] = list(prompt_ids[-6:])  # a little context for merges at the boundary
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""  # generated text so far (after any stop cut)
        self.sent = 0  # characters of text already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; returns the new text safe to emit now (maybe "")."""
        self.ids.append(token_id)
        self.added += 1
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        if self.stops and not self.stopped and self.added > self.min_tokens:
            cut, found = -1, ""
            for stop in self.stops:  # only occurrences that end in text not searched yet
                pos = self.text.find(stop, max(0, self.searched - len(stop) + 1))
                if pos != -1 and (cut == -1 or pos < cut):
                    cut, found = pos, stop
            if cut != -1:
                self.text = self.text[: cut + len(found)] if self.include_stop else self.text[:cut]
                self.stopped = True
        self.searched = len(self.text)
        held = 0 if self.stopped else _holdback(self.text, self.stops)
        limit = max(len(self.text) - held, self.sent)
        out = self.text[self.sent : limit]
        self.sent = limit
        return out

    def flush(self) -> str:
        """At the end of the row: everything not yet emitted (held-back stop prefixes and an
        incomplete trailing character included)."""
        out = ""
        if not self.stopped:
            before = self._decode(self.ids[self.prefix : self.read])
            after = self._decode(self.ids[self.prefix :])
            if len(after) > len(before):
                self.text += after[len(before) :]
                self.prefix = self.read = len(self.ids)
            out = self._release()
        out += self.text[self.sent :]
        self.sent = len(self.text)
        return out
