"""The one prompt format shared by training, evaluation and serving.

The prompt deliberately does *not* name the task: the task identity is carried
by the adapter that is routed/loaded for the request, so the same input text is
formatted identically whichever task it is sent to.

>>> format_prompt("cat dog 3")
'Input: cat dog 3\\nOutput:'
>>> format_prompt("cat dog 3") + format_target("3 dog cat")
'Input: cat dog 3\\nOutput: 3 dog cat'
"""

from __future__ import annotations

from typing import Any

PROMPT_TEMPLATE = "Input: {input}\nOutput:"
TARGET_SEPARATOR = " "  # between "Output:" and the answer; not part of the answer
# The name of this format, recorded in every task record (adapters_store.store.records.TaskRecord
# .prompt_format) so that serving renders a task's inputs the way its adapter was trained.
PROMPT_FORMAT = "input-output"
# each known format's text: `{input}` is replaced by the input, the answer follows TARGET_SEPARATOR
PROMPT_TEMPLATES = {PROMPT_FORMAT: PROMPT_TEMPLATE}


def format_prompt(input: str) -> str:
    """Format the model input (everything the model is conditioned on)."""
    return PROMPT_TEMPLATE.format(input=input)


def format_prompt_as(prompt_format: str, input: str) -> str:
    """format_prompt for a task whose record names `prompt_format`; ValueError if unknown.

    >>> format_prompt_as("input-output", "x")
    'Input: x\\nOutput:'
    """
    if prompt_format != PROMPT_FORMAT:
        raise ValueError(f"unknown prompt format {prompt_format!r} (this server knows {PROMPT_FORMAT!r})")
    return format_prompt(input)


def format_target(output: str) -> str:
    """Format the completion the model is trained to produce after the prompt.

    A single leading space separates it from ``"Output:"``; the caller appends
    the tokenizer's EOS token.

    >>> format_target("CAT")
    ' CAT'
    """
    return TARGET_SEPARATOR + output


def strip_separator(generated: str) -> str:
    """The answer in a generation that followed ``format_prompt``: drops the separator.

    >>> strip_separator(" CAT")
    'CAT'
    """
    return generated.removeprefix(TARGET_SEPARATOR)


def demonstration_token_ids(tokenizer: Any, text: str, special_tokens: bool = True) -> list[int]:
    """The ids of a demonstration text as they come out of `text + prompt` tokenised whole, for a
    prompt that starts with a non-space (as a task's formatted prompt does), but computed from the
    text alone, so that every prompt of the task begins with the same ids (the prefix cache's).

    The text ends in a blank line. Tokenised alone, a byte-level BPE merges its two newlines into
    one token ("\\n\\n") that it never makes before a word; tokenised with the prompt, they are two.
    So the body is tokenised, then each trailing whitespace character on its own."""
    body = text.rstrip()
    ids = list(tokenizer(body, add_special_tokens=special_tokens).input_ids)
    for char in text[len(body):]:
        ids += tokenizer(char, add_special_tokens=False).input_ids
    return ids
