"""The OpenAPI document, exact: every status a route can answer with its error schema, SSE and
Prometheus bodies, auth only where keys are configured, and the limits of this server's settings
as schema bounds (what the schema accepts, the server accepts, up to the prompt's token count).

    ERRORS[kind] / OPENAI_ERRORS[kind]   `responses=` of a route (kind: what the route does)
    install(app, settings)              app.openapi() post-processes FastAPI's document
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from server.api.deps import require_api_key, require_tenant_key
from server.api.errors import all_routes, is_openai_path
from server.api.schemas import ErrorResponse, OpenAIErrorResponse
from server.wiring.settings import Settings

WHY = {
    400: "Bad request: a field the server refuses (named in `param`), or a malformed Content-Length",
    401: "Missing or invalid API key (only when POLYSERVE_API_KEYS / POLYSERVE_ADMIN_KEYS are set)",
    403: "What only an admin key may do (POLYSERVE_ADMIN_KEYS): a `shared` task, a LoRA import, "
         "deleting a shared task",
    404: "Unknown task, model or job",
    409: "Conflict: the task exists, is not ready, or the job already finished",
    413: "Request body over POLYSERVE_MAX_BODY_BYTES, or prompt over POLYSERVE_MAX_PROMPT_TOKENS",
    422: "A field failed validation (named in `param`)",
    429: "Overloaded: retry after `Retry-After` seconds",
    503: "Starting (backbone not loaded yet) or shutting down",
    504: "The generation did not finish within POLYSERVE_REQUEST_TIMEOUT_SECONDS",
}
# what each generating route does by default, and whether it wraps the input in the task's format
ROUTE_DESCRIPTIONS = {
    "generate": "polyserve's own route. Greedy by default (temperature 0; set temperature, top_p, top_k, seed "
                "to sample). The prompt is the task's input: it is wrapped in the prompt format the task was "
                "trained with (the task's `prompt_template`, e.g. `Input: {input}\nOutput:`) and the answer "
                "comes back without the separator. `base` gets the same wrapping.",
    "completions": "OpenAI-compatible. Samples at temperature 1 by default, as OpenAI does (send temperature 0 "
                   "for the greedy answer /v1/generate gives). The prompt is sent raw, as vLLM does for a LoRA "
                   "(lm-eval and vLLM's benchmarks rely on it): the task's prompt format is not added, so to ask "
                   "a task as it was trained, format the input with its `prompt_template` (GET /v1/models/{model} "
                   "or /v1/tasks/{task}).",
    "chat": "OpenAI-compatible. Samples at temperature 1 by default, as OpenAI does. For a task, the last user "
            "message is its input, wrapped in the task's trained prompt format as /v1/generate does (other "
            "messages are not shown to it); for `base`, the backbone's chat template renders the conversation.",
}

OPENAI_WHY = {**WHY, 400: "Bad request (OpenAI's status for invalid fields, `param` names the field), "
              "or a prompt over the context limit (`code` context_length_exceeded)"}

_KINDS: dict[str, tuple[int, ...]] = {
    "generate": (400, 401, 404, 409, 413, 422, 429, 503, 504),
    "read": (401, 503),
    "search": (401, 422, 503),  # a read with a bounded query parameter
    "lookup": (401, 404, 503),
    "register": (400, 401, 403, 409, 413, 422, 429, 503),
    "delete": (401, 403, 404, 409, 503),
    "cancel": (400, 401, 404, 409, 413, 503),
    "usage": (401, 422, 503),
}


def _responses(codes: Iterable[int], model: type, why: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": model, "description": why[code]} for code in codes}


ERRORS = {kind: _responses(codes, ErrorResponse, WHY) for kind, codes in _KINDS.items()}
OPENAI_ERRORS = {kind: _responses((c for c in codes if c != 422), OpenAIErrorResponse, OPENAI_WHY)
                 for kind, codes in _KINDS.items()}
SSE_200: dict[int | str, dict[str, Any]] = {200: {
    "description": "The answer; with `stream: true` Server-Sent Events (`data: {json}` lines, an error "
                   "event `data: {\"error\": {...}}` if it fails mid-way, then `data: [DONE]`)",
    "content": {"text/event-stream": {"schema": {  # one event (OpenAPI 3.1: `schema` describes each event)
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string", "description": "a JSON chunk, a JSON error, or [DONE]"},
                       "event": {"type": "string"}, "id": {"type": "string"}}}}},
}}
PROMETHEUS_200: dict[int | str, dict[str, Any]] = {200: {
    "description": "Prometheus text exposition format",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}}


def api_routes(app: FastAPI) -> list[Any]:
    """Every API route with its effective state (router prefix and dependencies applied; see
    server.api.errors.all_routes for the FastAPI versions)."""
    return [r for r in all_routes(app.routes) if isinstance(getattr(r, "original_route", r), APIRoute)]


def dependency_calls(route: Any) -> set[Callable]:
    """Every dependency callable a route runs (router-level ones included)."""
    seen, stack = set(), list(route.dependant.dependencies)
    while stack:
        dep = stack.pop()
        if dep.call is not None:
            seen.add(dep.call)
        stack.extend(dep.dependencies)
    return seen


def _set_bound(schema: dict, key: str, value: int) -> None:
    """Set `key` on the schema or on its non-null anyOf branch of the matching kind; a default
    beyond a maximum is lowered to it (the route does the same)."""
    branches = schema.get("anyOf", [schema])
    for branch in branches:
        if key == "maximum" and branch.get("type") == "integer":
            branch[key] = value
        if key in ("maxItems", "minItems") and branch.get("type") == "array":
            branch[key] = value
    if key == "maximum" and isinstance(schema.get("default"), int) and schema["default"] > value:
        schema["default"] = value


def _bounds(settings: Settings) -> dict[str, dict[str, tuple[str, int]]]:
    tokens = ("maximum", settings.max_new_tokens)
    stop = ("maxItems", settings.max_stop_strings)
    n = ("maximum", settings.max_n)
    return {
        "GenerateRequest": {"max_new_tokens": tokens, "stop": stop},
        "CompletionRequest": {"max_tokens": tokens, "stop": stop, "n": n, "min_tokens": tokens},
        "ChatRequest": {"max_tokens": tokens, "max_completion_tokens": tokens, "stop": stop, "n": n,
                        "min_tokens": tokens},
        "ResponsesRequest": {"max_output_tokens": tokens},
        "RegisterRequest": {"examples": ("maxItems", settings.max_examples_per_task),
                            "steps": ("maximum", settings.max_job_steps)},
    }


def below_pattern(n: int) -> str:
    """A regex for the decimal integers 0 <= x < n (no leading zeros), n >= 1.

    >>> import re; [x for x in range(300) if re.fullmatch(below_pattern(259), str(x))] == list(range(259))
    True
    """
    top = str(n - 1)
    width = len(top)
    alts = ["[0-9]"] if width > 1 else [f"[0-{top}]"]
    if width > 2:
        alts.append(f"[1-9][0-9]{{1,{width - 2}}}")
    if width > 1:  # width digits, <= top: a smaller digit at position i, then anything
        for i, digit in enumerate(top):
            low = 1 if i == 0 else 0
            if int(digit) - 1 >= low:
                rest = width - i - 1
                alts.append(top[:i] + f"[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
        alts.append(top)
    return "^(" + "|".join(alts) + ")$"


def _vocab_bound(schemas: dict, vocab: int) -> None:
    """logit_bias keys are token ids below the vocabulary size."""
    pattern = below_pattern(vocab)
    for name, schema in schemas.items():
        bias = schema.get("properties", {}).get("logit_bias")
        if bias is None or not (name.startswith(("CompletionRequest", "ChatRequest"))):
            continue
        bias["propertyNames"] = {"pattern": pattern}
        for branch in bias.get("anyOf", []):
            if "patternProperties" in branch:
                branch["patternProperties"] = {pattern: next(iter(branch["patternProperties"].values()))}


def _prompts_bound(schemas: dict, limit: int) -> None:
    """A list of prompts (strings or token-id lists) holds at most `limit` of them; a single
    token-id prompt keeps its own bound (the prompt's tokens)."""
    for name, schema in schemas.items():
        prompt = schema.get("properties", {}).get("prompt")
        if prompt is None or not name.startswith("CompletionRequest"):
            continue
        for branch in prompt.get("anyOf", []):
            if branch.get("type") == "array" and branch.get("items", {}).get("type") in ("string", "array"):
                branch["maxItems"] = limit


def _token_ids_bound(node: Any, top: int) -> None:
    """Every token-id integer (minimum 0) below `node` is at most `top`."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = top
        for value in node.values():
            _token_ids_bound(value, top)
    elif isinstance(node, list):
        for value in node:
            _token_ids_bound(value, top)


TOKEN_ID_FIELDS = {"CompletionRequest": ("prompt", "stop_token_ids"), "ChatRequest": ("stop_token_ids",),
                   "DetokenizeRequest": ("tokens",)}


def build(app: FastAPI, settings: Settings) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    any_keys = bool(settings.api_keys or settings.admin_keys)
    for route in api_routes(app):
        calls = dependency_calls(route)
        keyed = require_tenant_key in calls  # needs a key whenever any is configured
        guarded = (any_keys if keyed else bool(settings.api_keys)) and (keyed or require_api_key in calls)
        for method in route.methods:
            op = doc["paths"][route.path_format][method.lower()]
            responses = op["responses"]
            if not guarded:
                op.pop("security", None)
                responses.pop("401", None)
            if not (keyed and any_keys):  # without keys everyone is an admin
                responses.pop("403", None)
            if "422" in responses and (is_openai_path(route.path_format) or 422 not in route.responses):
                responses.pop("422")
    if not any_keys:
        doc.get("components", {}).pop("securitySchemes", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for model, fields in _bounds(settings).items():
        for name, schema in schemas.items():
            if name == model or name.startswith(model + "-"):
                for field, (key, value) in fields.items():
                    if field in schema.get("properties", {}):
                        _set_bound(schema["properties"][field], key, value)
    for name, schema in schemas.items():  # a second bound on `examples`: the fewest a registration takes
        if (name == "RegisterRequest" or name.startswith("RegisterRequest-")) and "examples" in schema.get(
                "properties", {}):
            _set_bound(schema["properties"]["examples"], "minItems", settings.min_examples_per_task)
    _prompts_bound(schemas, settings.max_prompts_per_request)
    _query_bounds(doc, {("/v1/usage", "get", "window"): ("maximum", settings.usage_window_max_seconds)})
    return doc


def _query_bounds(doc: dict[str, Any], bounds: dict[tuple[str, str, str], tuple[str, int]]) -> None:
    """Query parameters bounded by a setting (the route refuses beyond it with 422)."""
    for (path, method, name), (key, value) in bounds.items():
        for param in doc["paths"].get(path, {}).get(method, {}).get("parameters", []):
            if param.get("name") == name and param.get("in") == "query":
                _set_bound(param["schema"], key, value)


def install(app: FastAPI, settings: Settings) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = build(app, settings)
        runtime = getattr(app.state, "runtime", None)
        if runtime is None:  # the vocabulary is not known yet: not cached
            return doc
        from server.api.validation import vocab_size

        schemas = doc.get("components", {}).get("schemas", {})
        _vocab_bound(schemas, vocab_size(runtime))
        for name, schema in schemas.items():
            for model, fields in TOKEN_ID_FIELDS.items():
                if name == model or name.startswith(model + "-"):
                    for field in fields:
                        _token_ids_bound(schema.get("properties", {}).get(field), vocab_size(runtime) - 1)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
