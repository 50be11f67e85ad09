"""Wire schemas of polyserve's own API (pydantic); never internal objects."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from adapters_store.ids import TASK_ID_PATTERN


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(pattern=TASK_ID_PATTERN, max_length=64)
    prompt: str
    max_new_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False


class GenerateResponse(BaseModel):
    id: str
    task: str
    text: str
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage


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


class TaskList(BaseModel):
    data: list[TaskOut]
