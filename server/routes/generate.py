"""POST /v1/generate: polyserve's own endpoint (applies the task's training prompt format).

The model answers after the format's separator (training.prompt.TARGET_SEPARATOR); the text
returned, streamed or not, is the answer without it.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from server import generation
from server.deps import ApiKey, RuntimeDep
from server.engine.request import FinalEvent, SamplingParams
from server.schemas import GenerateRequest, GenerateResponse, Usage
from training.prompt import format_prompt, strip_separator

router = APIRouter(prefix="/v1", tags=["generate"], dependencies=[ApiKey])


@router.post("/generate", response_model=GenerateResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
async def generate(body: GenerateRequest, request: Request, rt: RuntimeDep):
    params = SamplingParams(max_new_tokens=body.max_new_tokens, temperature=body.temperature,
                            top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=tuple(body.stop))
    req = await generation.prepare(rt, body.task, lambda: format_prompt(body.prompt), params)
    generation.submit(rt, req)
    if not body.stream:
        result = await generation.collect(request, req)
        return GenerateResponse(id=req.id, task=body.task, text=strip_separator(result.text),
                                finish_reason=result.finish.finish_reason,
                                usage=Usage(prompt_tokens=result.finish.prompt_tokens,
                                            completion_tokens=result.finish.completion_tokens))

    async def stream():
        first = True  # the separator can only lead the first non-empty piece of text
        async for event in generation.events(request, req):
            text = event.text
            if first and text:
                text, first = strip_separator(text), False
            if isinstance(event, FinalEvent):
                usage = {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens}
                yield generation.sse(json.dumps({"id": req.id, "task": body.task, "text": text,
                                                 "finish_reason": event.finish_reason, "usage": usage}))
                yield generation.sse("[DONE]")
            elif text:
                yield generation.sse(json.dumps({"id": req.id, "task": body.task, "text": text,
                                                 "finish_reason": None}))

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
