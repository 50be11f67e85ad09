"""Wire schemas for task registration and jobs (pydantic)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adapters_store.store.ids import TASK_ID_PATTERN
from adapters_store.store.records import MAX_DESCRIPTION_CHARS, MAX_RECORD_EXAMPLES
from server.api.wire import Bool, Number

MAX_FIELD_CHARS = 4096
# the methods with a form to serve before their training ends (serve_early)
SERVE_EARLY_METHODS = ("auto", "routing", "mu", "full")


class ExampleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str = Field(min_length=1, max_length=MAX_FIELD_CHARS)
    output: str = Field(min_length=1, max_length=MAX_FIELD_CHARS)


BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"


class RegisterRequest(BaseModel):
    """POST /v1/tasks. The upper bounds of the example count and of `steps` are settings, checked
    in the route (and stated in the OpenAPI document, server.api.api_docs)."""

    # `retrieve` and `demos` train nothing: with them, `steps` must be absent or null (422 otherwise)
    # lora: adapter and adapter_config are required, examples are not; any other method needs examples
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [
        {"if": {"properties": {"method": {"enum": ["retrieve", "demos"]}}, "required": ["method"]},
         "then": {"properties": {"steps": {"type": "null"}}}},
        # serve_early serves a form before training (auto: the demonstrations; the others: a retrieved row)
        {"if": {"properties": {"serve_early": {"const": True}}, "required": ["serve_early"]},
         "then": {"properties": {"method": {"enum": list(SERVE_EARLY_METHODS)}}}},
        {"if": {"properties": {"method": {"const": "lora"}}, "required": ["method"]},
         "then": {"required": ["adapter", "adapter_config"],
                  "properties": {"adapter": {"type": "string"}, "adapter_config": {"type": "object"}}},
         "else": {"required": ["examples"], "properties": {"examples": {"type": "array"}}}},
    ]})

    task: str = Field(pattern=TASK_ID_PATTERN, max_length=64, json_schema_extra={"not": {"enum": ["base"]}},
                      description="a new task id (`base` is reserved)")
    examples: list[ExampleIn] | None = Field(default=None, min_length=1, description="required, except with lora; "
                                             f"the first {MAX_RECORD_EXAMPLES} are shown with the task")
    description: str | None = Field(default=None, min_length=1, max_length=MAX_DESCRIPTION_CHARS,
                                    json_schema_extra={"pattern": r"\S"},
                                    description="what the task does, in words: shown by GET /v1/tasks and "
                                    "/v1/models, and searched by GET /v1/tasks?search=")
    method: Literal["auto", "routing", "retrieve", "demos", "demos+routing", "mu", "full", "lora"] = Field(
        "auto", description="auto: cross-validate demos, routing, demos+routing (and full from 64 examples) on "
        "the examples and keep the best (the job's `estimate` says how each scored); "
        "demos: the first examples that fit POLYSERVE_MAX_DEMONSTRATION_TOKENS go before every prompt, on the "
        "bare backbone (nothing trained); demos+routing: those demonstrations and a routing row trained with "
        "them in its context; "
        "routing: retrieve a starting row from the existing tasks, then train it; "
        "retrieve: the retrieved row alone (no training, ready in seconds); mu / full: train a plain LoRA; "
        "lora: import `adapter` + `adapter_config` (a PEFT LoRA) as a plain-LoRA task (server.api.lora_tasks)")
    # method lora (bring your own LoRA): adapter_model.safetensors as base64, and its adapter_config.json
    # standard base64 with padding, as the route decodes it (validate=True): the bytes' shape is
    # stated here; what they hold (a safetensors LoRA this store can serve) no schema can say
    adapter: str | None = Field(default=None, min_length=4, pattern=BASE64_PATTERN,
                                json_schema_extra={"contentEncoding": "base64"},
                                description="lora: adapter_model.safetensors, base64 (standard alphabet, padded)")
    adapter_config: dict[str, Any] | None = Field(default=None, description="lora: the adapter_config.json object")
    project: Bool = Field(False, description="lora: replace the LoRA by its fitted routing row (kilobytes)")
    # numbers as JSON Schema says (server.api.wire): 5 or 5.0, never "5" or true
    steps: Annotated[int, Field(ge=1, le=100_000), Number] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**31), Number] | None = None
    serve_early: Bool = Field(False, description="serve a first version while training goes on: with routing, mu "
                              "and full the retrieved starting routing; with auto the demonstrations, at once "
                              "(the retrieved routing where the examples cannot be demonstrations). The result "
                              "becomes the next version. `retrieve` is served as soon as it is done either way")
    shared: Bool = Field(False, description="every tenant may see and use the task (admin keys only; "
                         "otherwise a task is its registering tenant's)")


    @field_validator("description")
    @classmethod
    def _description_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty or only whitespace")
        return value.strip() if value is not None else None


class JobError(BaseModel):
    type: str
    message: str


class JobOut(BaseModel):
    id: str
    object: Literal["polyserve.job"] = "polyserve.job"
    task: str
    method: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    created_at: float
    started_at: float | None
    finished_at: float | None
    progress: float
    metrics: dict[str, Any]
    error: JobError | None
    steps: int | None = None
    seed: int | None = None
    n_examples: int = 0
    serve_early: bool = False
    live_version: int | None = Field(None, description="the task's version this job made servable so far "
                                     "(serve_early: the retrieved one, then the trained one)")


class JobEventOut(BaseModel):
    created_at: float
    level: str
    type: str
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


class JobEvents(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobEventOut]
