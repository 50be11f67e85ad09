"""What a generating request may hold, checked before the engine sees it (server/api/generation.py
runs these; server/api/openai/tokenize_routes.py shares the vocabulary bound):

    sampling limits   max_new_tokens, n, stop strings (server settings) -> 422 naming the field
    vocabulary        logit_bias, stop_token_ids, token-id prompts: ids < the vocabulary -> 422
    prompt            a token-id prompt's length and ids, a text prompt's encodability (400) and a
                      cheap length bound before tokenising; the tokenised prompt: not empty, in
                      the vocabulary, within max_prompt_tokens -> 413 context_length_exceeded
    task lookup       task_errors: a task (or mix member) not found -> 404 naming the task field; a
                      malformed task or mix id -> 422 naming the task field (code invalid_mix)

Messages name the field and never echo the input.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from adapters_store.lora.mix import MixError
from adapters_store.store.errors import TaskNotFound
from server.api.errors import ApiError
from server.engines.request import SamplingParams
from server.wiring.runtime import Runtime
from server.wiring.settings import Settings


def vocab_size(rt: Runtime) -> int:
    """The bound token ids are checked against: the backbone config's vocabulary, else the tokenizer's."""
    config = getattr(rt.backbone.model, "config", None)
    return int(getattr(config, "vocab_size", 0) or len(rt.tokenizer))


def check_in_vocab(field: str, ids: Iterable[int], vocab: int) -> None:
    """Every id < vocab; 422 naming the first one that is not."""
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise ApiError(422, "validation_error", f"{field}: token id {bad} is not in the vocabulary (ids < {vocab})",
                       param=field)


def check_sampling(params: SamplingParams, limits: Settings, vocab: int, names: dict[str, str]) -> None:
    """The sampling fields against the server's limits and the vocabulary. names: SamplingParams
    field -> the route's request field, where they differ."""
    tokens_field = names.get("max_new_tokens", "max_new_tokens")
    if params.max_new_tokens > limits.max_new_tokens:
        raise ApiError(422, "validation_error", f"{tokens_field}: must be <= {limits.max_new_tokens}",
                       param=tokens_field)
    if params.n > limits.max_n:
        raise ApiError(422, "validation_error", f"n: must be <= {limits.max_n}", param="n")
    if len(params.stop) > limits.max_stop_strings:
        raise ApiError(422, "validation_error", f"stop: at most {limits.max_stop_strings} stop strings",
                       param="stop")
    check_in_vocab("logit_bias", (t for t, _ in params.logit_bias), vocab)
    check_in_vocab("stop_token_ids", params.stop_token_ids, vocab)


def prompt_too_long(field: str, message: str) -> ApiError:
    return ApiError(413, "too_large", message, param=field, code="context_length_exceeded")


def check_token_ids(ids: list, vocab: int, max_tokens: int, field: str) -> None:
    """A token-id prompt, before anything reads it: its length, then every id an int in
    [0, vocab) (a huge integer is just out of range here, never an overflow further on)."""
    if len(ids) > max_tokens:
        raise prompt_too_long(field, f"{field} has {len(ids)} tokens, the limit is {max_tokens}")
    bad = next((i for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(422, "validation_error", f"{field}: token id at position {bad} is not in [0, {vocab})",
                       param=field)


def check_text(text: str, field: str) -> None:
    """Text a tokenizer can take: JSON may carry an unpaired UTF-16 surrogate (\\ud800), which
    is no Unicode character (the tokenizer would fail on it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, "invalid_request", f"{field}: holds an unpaired UTF-16 surrogate at position "
                       f"{err.start}", param=field) from None


def check_rendered(rendered: str | list[int], vocab: int, max_tokens: int, field: str) -> None:
    """A rendered prompt before it is tokenised: token ids in full; text encodable and not so
    long that tokenising it would be wasted work."""
    if isinstance(rendered, list):
        check_token_ids(rendered, vocab, max_tokens, field)
        return
    check_text(rendered, field)
    if len(rendered) > 16 * max_tokens + 1024:  # cheap bound before tokenising
        raise prompt_too_long(field, f"{field} is longer than max_prompt_tokens={max_tokens}")


def check_prompt_ids(ids: list[int], vocab: int, max_tokens: int, field: str) -> None:
    """The tokenised prompt the engine will run."""
    if not ids:
        raise ApiError(422, "validation_error", f"{field}: must not be empty", param=field)
    if any(t >= vocab for t in ids):
        raise ApiError(422, "validation_error", f"{field}: token ids must be < {vocab}", param=field)
    if len(ids) > max_tokens:
        raise prompt_too_long(field, f"{field} has {len(ids)} tokens, the limit is {max_tokens}")


@contextmanager
def task_errors(names: dict[str, str]) -> Iterator[None]:
    """A registry lookup of the request's task as the client sees it failing: not found -> 404
    naming the route's task field (`task` on /v1/generate, `model` on the OpenAI routes; err.task:
    the task, or the mix member, not found); a malformed task or mix id -> 422 naming that field."""
    field = names.get("task", "task")
    try:
        yield
    except TaskNotFound as err:
        raise ApiError(404, "not_found", f"{field}: task {err.task!r} not found", param=field) from None
    except ValueError as err:
        code = "invalid_mix" if isinstance(err, MixError) else None
        raise ApiError(422, "validation_error", f"{field}: {err}", param=field, code=code) from None
