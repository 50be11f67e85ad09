"""Wire schemas of polyserve's own API (pydantic); never internal objects."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adapters_store.backbone.prompt import PROMPT_TEMPLATES
from adapters_store.lora.mix import MAX_MIX_CHARS, MIX_SCHEMA_EXTRA, MODEL_ID_PATTERN
from adapters_store.store.records import TaskRecord
from server.api.wire import Bool, Number

DESCRIPTION_DOC = "what the task does, in words (the registration's, or the suite's for a shipped task)"
EXAMPLES_DOC = "a few input/output pairs that show it (the first ones its registration sent)"
QUALITY_DOC = "a shipped task's measured exact match (null for a registered task: its job's estimate is in metrics)"
PROMPT_FORMAT_DOC = "the name of the prompt format the task was trained with (null for `base`)"
PROMPT_TEMPLATE_DOC = ("that format's text: `{input}` is replaced by the input and the model answers after one "
                       "space. /v1/generate and chat add it; /v1/completions sends the prompt raw, so a raw "
                       "caller formats the input with it")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(pattern=MODEL_ID_PATTERN, max_length=MAX_MIX_CHARS, json_schema_extra=MIX_SCHEMA_EXTRA,
                      examples=["base"])
    prompt: str = Field(min_length=1, json_schema_extra={"pattern": r"\S"},
                        description="the task's input; wrapped in the task's trained prompt format (not empty)")
    max_new_tokens: Annotated[int, Field(ge=1), Number] = Field(
        default=64, description="default: 64, or the server's limit if lower")
    temperature: Annotated[float, Field(ge=0.0, le=100.0), Number] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0), Number] = 1.0
    top_k: Annotated[int, Field(ge=0), Number] = 0
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list)
    seed: Annotated[int, Number] | None = Field(default=None, description="any integer (used modulo 2**63)")
    stream: Bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str) -> str:
        if not value.strip():  # the task's format around nothing: the adapter answers made-up text
            raise ValueError("must not be empty or only whitespace")
        return value


class GenerateResponse(BaseModel):
    id: str
    task: str
    text: str
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage


class ExampleOut(BaseModel):
    input: str
    output: str


class QualityOut(BaseModel):
    """What a shipped task was measured to do (docs/RESULTS.md, "Each shipped task's measured quality")."""

    heldout_exact: float = Field(description="greedy exact match on test inputs of English words never trained on")
    sentences_exact: float | None = Field(
        default=None, description="the same on ordinary sentences (word-level tasks only; null for the others)")
    n: int = Field(description="test inputs each figure was measured on")
    measured: str = Field(description="the day it was measured (YYYY-MM-DD)")
    below_floor: bool = Field(
        default=False, description="held-out exact match below the shipped floor: installed only on request "
        "(POLYSERVE_SHIPPED_BELOW_FLOOR)")


class TaskOut(BaseModel):
    id: str
    status: Literal["ready", "training", "failed"]
    method: str
    version: int
    created_at: float
    updated_at: float
    params: int
    kind: str | None = None
    inventory_version: str | None = None
    job_id: str | None = None
    error: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    prompt_format: str | None = Field(default=None, description=PROMPT_FORMAT_DOC)
    prompt_template: str | None = Field(default=None, description=PROMPT_TEMPLATE_DOC)
    description: str | None = Field(default=None, description=DESCRIPTION_DOC)
    examples: list[ExampleOut] = Field(default_factory=list, description=EXAMPLES_DOC)
    quality: QualityOut | None = Field(default=None, description=QUALITY_DOC)
    demonstrations: list[ExampleOut] = Field(
        default_factory=list, description="what this version puts before every prompt, in its prompt format "
        "(methods auto, demos, demos+routing); counted in usage as prompt tokens, never echoed")


class TaskList(BaseModel):
    data: list[TaskOut]


class ErrorDetail(BaseModel):
    """polyserve's error: `param` names the offending field, `code` a stable reason (or null)."""

    type: str
    message: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error | authentication_error | rate_limit_error | server_error")
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorDetail


class ModelOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = Field(default=None, description="the backbone")
    parent: str | None = Field(default=None, description="`base` for a task")
    description: str | None = Field(default=None, description=DESCRIPTION_DOC)
    quality: QualityOut | None = Field(default=None, description=QUALITY_DOC)
    prompt_format: str | None = Field(default=None, description=PROMPT_FORMAT_DOC)
    prompt_template: str | None = Field(default=None, description=PROMPT_TEMPLATE_DOC)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelOut]

def task_out(record: TaskRecord) -> TaskOut:
    """A stored task record as the API shows it."""
    return TaskOut(
        id=record.id, status=record.status, method=record.method, version=record.version,
        created_at=record.created_at, updated_at=record.updated_at, params=record.params, kind=record.kind,
        inventory_version=record.inventory_version, job_id=record.job_id, error=record.error,
        metrics=record.metrics, **prompt_fields(record), description=record.description,
        examples=_pairs(record.examples), quality=quality_out(record), demonstrations=_pairs(record.demonstrations),
    )


def quality_out(record: TaskRecord) -> QualityOut | None:
    """A record's measured quality as the API shows it (None where it has none)."""
    return QualityOut(**record.quality) if record.quality else None


def _pairs(pairs: list[dict[str, str]]) -> list[ExampleOut]:
    return [ExampleOut(input=e["input"], output=e["output"]) for e in pairs
            if isinstance(e, dict) and isinstance(e.get("input"), str) and isinstance(e.get("output"), str)]


def matches(record: TaskRecord, search: str) -> bool:
    """GET /v1/tasks?search=: every word of `search` in the task's id or description (any case)."""
    text = f"{record.id} {record.description or ''}".casefold()
    return all(word in text for word in search.casefold().split())


def prompt_fields(record: TaskRecord) -> dict[str, Any]:
    """A task's prompt format, by name and as text (the text None for a format this server does not know)."""
    return {"prompt_format": record.prompt_format, "prompt_template": PROMPT_TEMPLATES.get(record.prompt_format)}
