"""SamplingParams.response_format -> vLLM's own structured outputs (its guided decoding backends).

    ("json_object", "")      -> StructuredOutputsParams(json_object=True)
    ("json_schema", SCHEMA)  -> StructuredOutputsParams(json=schema)
passed as vllm.SamplingParams(structured_outputs=...); a vLLM from before that name takes the
same fields as guided_decoding=GuidedDecodingParams(...). vLLM compiles the schema itself; the
route has already refused an invalid one (server.api.openai.response_format).
"""

from __future__ import annotations

import json
from typing import Any

from server.engines.request import SamplingParams


def structured_fields(p: SamplingParams) -> dict[str, Any]:
    """The fields of vLLM's structured-output parameters for `p` ({} when unconstrained)."""
    if p.response_format is None:
        return {}
    kind, text = p.response_format
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": json.loads(text)}
    # "tool_calls" (strict tools in auto) is a llguidance grammar: the route leaves it to the native engine
    raise ValueError(f"response_format: unknown type {kind!r}")


def structured_kwargs(p: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of vllm.SamplingParams (imports vLLM: call in the vLLM engine only)."""
    fields = structured_fields(p)
    if not fields:
        return {}
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:  # older vLLM
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(**fields)}
    return {"structured_outputs": StructuredOutputsParams(**fields)}
