"""schemathesis hooks for tests/tools/fuzz_api.py (loaded through SCHEMATHESIS_HOOKS).

`polyserve_positive_data_acceptance` is schemathesis's positive_data_acceptance (a request the
schema accepts must not be refused) with one exception no JSON Schema can state: a prompt longer
than POLYSERVE_MAX_PROMPT_TOKENS *tokens* is refused with 413 (polyserve's routes) or 400 with
code `context_length_exceeded` (the OpenAI routes), and the refusals of SEMANTIC_CODES. Every other
400/422 for valid data fails.
"""

from __future__ import annotations

import json

import schemathesis

ACCEPTED = {401, 403, 404, 409, 413, 429}
# refusals no JSON Schema can state, each with its own code: a JSON Schema in response_format that
# does not compile (or a field that conflicts with it), a LoRA's bytes that are not a servable LoRA,
# a mix that names a task twice or names `base` (the document states this one as a `not` pattern),
# a chat whose input message (a task's: the last user message) is empty, tools whose schemas do not
# compile or a conversation whose tool messages answer no call, a combination of vLLM's extensions
SEMANTIC_CODES = {"invalid_response_format", "invalid_adapter", "invalid_mix", "empty_input", "invalid_tools",
                  "invalid_extension"}


@schemathesis.check
def polyserve_positive_data_acceptance(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return
    status = response.status_code
    if status < 400 or status >= 500 or status in ACCEPTED:  # 5xx: not_a_server_error reports them
        return
    try:
        error = json.loads(response.content).get("error", {})
    except (ValueError, AttributeError):
        error = {}
    if status == 400 and isinstance(error, dict) and error.get("code") == "context_length_exceeded":
        return
    if status in (400, 422) and isinstance(error, dict) and error.get("code") in SEMANTIC_CODES:
        return
    raise AssertionError(f"Schema-valid request rejected with {status}: {response.content[:300]!r}")
