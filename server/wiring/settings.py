"""Process settings: one pydantic-settings object read from POLYSERVE_* environment variables.

Model/adapter hyper-parameters live in dataclasses (adapters_store.lora.spec); wire schemas live in
server.api.schemas. Nothing here is CPU-specific: device and dtype come from the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from adapters_store.backbone.home import polyserve_home
from adapters_store.store.location import is_dsn
from server.engines.native.tuning import Tuning


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting is never echoed (keys, secrets, URLs with passwords)
    model_config = SettingsConfigDict(env_prefix="POLYSERVE_", extra="ignore", hide_input_in_errors=True)

    home: Path = Field(default_factory=polyserve_home)
    store: str | None = None  # a directory (default: $POLYSERVE_HOME/store) or a postgresql:// DSN
    backbone: str = "default"  # "default" | "tiny" | a local HF directory
    engine: Literal["native", "vllm"] = "native"  # the data plane (server.engines)
    device: str = "cpu"
    threads: int | None = Field(default=None, ge=1)  # torch intra-op threads (None = usable CPUs: server/infra/cpus.py)
    # serving dtype: float32 | bfloat16 | float16, or auto (the machine decides: server/engines/dtype.py)
    dtype: str | None = None
    # vllm engine: other vLLM engine arguments as a JSON object, e.g. {"tensor_parallel_size": 2}
    vllm_args: Annotated[dict[str, Any], NoDecode] = Field(default_factory=dict)
    redis_url: str | None = None  # unset = no L2 cache
    redis_prefix: str = "polyserve"
    redis_ttl_seconds: int = Field(default=24 * 3600, ge=1)
    redis_socket_timeout: float = Field(default=0.05, gt=0)
    redis_connect_timeout: float = Field(default=0.05, gt=0)
    redis_breaker_failures: int = Field(default=3, ge=1)
    redis_breaker_cooldown: float = Field(default=10.0, gt=0)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # task/job mutation keys (server.api.deps: the rule when only one of the two lists is set)
    admin_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # server-side deadline of one generation, queueing included: 504 / a stream's error event
    request_timeout_seconds: float = Field(default=600.0, gt=0)

    # limits
    max_batch_rows: int = Field(default=32, ge=1)
    max_batch_tokens: int = Field(default=16384, ge=16)  # prompt + max_new tokens of the rows in flight
    max_prefill_rows: int = Field(default=16, ge=1)  # requests admitted in one step
    # prompt KV kept across requests (native engine); None = max_batch_tokens, 0 = off
    prefix_cache_tokens: int | None = Field(default=None, ge=0)
    # tokens in one forward: every decoding row's next token + prompt chunks (chunked prefill)
    max_step_tokens: int = Field(default=256, ge=2)
    # native engine: while a tenant's rows decode, prompt tokens of other tenants' requests in one
    # step (engines/native/core/scheduler.py); 0 = no such bound. Another tenant's long prompt is then
    # spread thin over the steps a short request decodes in, instead of a few steps that cost
    # several decode steps each (BENCHMARKS.md, "The long-prompt flood")
    tenant_prefill_tokens: int = Field(default=32, ge=0)
    # at least 1 (0 never served: the native engine refused it at start, vLLM's queue was always full)
    max_queue: int = Field(default=256, ge=1)
    max_prompt_tokens: int = Field(default=2048, ge=1)
    max_new_tokens: int = Field(default=1024, ge=1)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_examples_per_task: int = Field(default=1000, ge=1)
    # POST /v1/tasks with fewer examples: 422 naming this (docs/operations.md says why this default)
    min_examples_per_task: int = Field(default=4, ge=1)
    # a registered task's demonstrations (methods auto, demos, demos+routing): at most this many
    # tokens of its examples go before every prompt it serves (training/demos.py), and at most half
    # of max_prompt_tokens (demonstration_budget), so that the caller keeps room for its own
    max_demonstration_tokens: int = Field(default=1024, ge=0)

    @property
    def demonstration_budget(self) -> int:
        return min(self.max_demonstration_tokens, self.max_prompt_tokens // 2)
    max_job_steps: int = Field(default=5000, ge=1)  # POST /v1/tasks `steps` above this: 422
    max_queued_jobs: int = Field(default=16, ge=1)  # unfinished jobs of this replica; beyond: 429
    job_retention_seconds: float = Field(default=7 * 24 * 3600, gt=0)  # finished jobs + their files
    max_stop_strings: int = Field(default=8, ge=0)
    max_n: int = Field(default=8, ge=1)  # choices per request (OpenAI `n`)
    # prompts in one /v1/completions request (a list `prompt`): each is its own request in the queue
    max_prompts_per_request: int = Field(default=64, ge=1, le=1024)
    l1_cache_bytes: int = Field(default=1 << 30, ge=0)
    warmup: bool = True
    # while requests are in flight, adaptation jobs get at most this share of the engine's time
    background_share: float = Field(default=0.2, gt=0, le=1)
    rescan_seconds: float = Field(default=1.0, gt=0)  # store re-scan for changes made by other replicas
    # registration jobs: local = this server runs them; off = it only enqueues them for `polyserve worker`s
    jobs: Literal["local", "off"] = "local"
    job_lease_seconds: float = Field(default=30.0, gt=0)  # a worker's claim; heartbeats renew it (lease / 3)
    job_max_attempts: int = Field(default=3, ge=1)  # runs of a job whose runners died; then it fails
    job_poll_seconds: float = Field(default=0.2, gt=0)  # a worker's idle wait between claims
    # tenants (server/tenancy/tenants.py; admission: server/engines/fair.py). None = the engine's own limit
    tenant_max_queued: int | None = Field(default=None, ge=1)  # default: the tenant's weighted share of max_queue
    tenant_max_rows: int | None = Field(default=None, ge=1)
    tenant_kv_share: float = Field(default=1.0, gt=0, le=1)
    tenant_fairness: bool = True  # off: one first-come-first-served queue, no per-tenant caps
    max_tasks: int | None = Field(default=None, ge=1)  # registered tasks in the store; beyond: 409 task_limit
    # one tenant's registrations (server/jobs/service.py; admins and key-less servers are exempt):
    # tasks it owns, default its weighted share of max_tasks (none without max_tasks): 409 tenant_task_limit
    tenant_max_tasks: int | None = Field(default=None, ge=1)
    # its jobs queued or running, default its weighted share of max_queued_jobs: 429 tenant_job_limit
    tenant_max_jobs: int | None = Field(default=None, ge=1)
    # L2 entries carry an HMAC under this secret, shared by the replicas (server/adapter_cache/l2.py)
    cache_secret: str | None = None
    # serving a non-loopback address with no key at all needs this (server/wiring/exposure.py)
    allow_unauthenticated: bool = False
    usage_window_max_seconds: int = Field(default=24 * 3600, ge=60)  # GET /v1/usage keeps this much history
    # also install the shipped tasks measured below the quality floor, marked `below_floor`
    # (training/shipped_inventory.py; the offline commands read the same variable there)
    shipped_below_floor: bool = False
    # the native engine's internal switches (docs/tuning.md): each read from its own POLYSERVE_*
    # variable (POLYSERVE_LORA_KERNEL, ...) by Tuning.from_env, not from one POLYSERVE_TUNING
    tuning: Tuning = Field(default_factory=Tuning)

    @model_validator(mode="before")
    @classmethod
    def _read_tuning(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "tuning" not in data:
            return {**data, "tuning": Tuning.from_env()}
        if not isinstance(data["tuning"], Tuning):
            raise ValueError("set each tuning switch as its own POLYSERVE_* variable "  # noqa: TRY004 - pydantic reports ValueError
                             "(docs/tuning.md), not POLYSERVE_TUNING")
        return data

    @field_validator("api_keys", "admin_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [k.strip() for k in value.split(",") if k.strip()]
        if isinstance(value, list):
            from server.tenancy.tenants import parse_entry

            for entry in value:
                parse_entry(entry)  # ValueError naming the tenant, never the key
        return value

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _parse_vllm_args(cls, value: Any) -> Any:
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"vllm_args must be a JSON object: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("vllm_args must be a JSON object (vLLM engine argument -> value)")  # noqa: TRY004 - pydantic reports ValueError
        return value

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not (value == "cpu" or value.startswith("cuda") or value == "mps"):
            raise ValueError(f"device must be cpu, cuda[:N] or mps, got {value!r}")
        return value

    @field_validator("store", mode="before")
    @classmethod
    def _store_as_text(cls, value: object) -> object:
        return str(value) if isinstance(value, Path) else value

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str | None) -> str | None:
        if value is not None and value not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {value!r}")
        return None if value == "auto" else value

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        if self.store is None:
            self.store = str(self.home / "store")
        if self.max_step_tokens <= self.max_batch_rows:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must exceed max_batch_rows "
                             f"({self.max_batch_rows}): a step holds every decoding row's token and prompt chunks")
        if self.min_examples_per_task > self.max_examples_per_task:
            raise ValueError(f"min_examples_per_task ({self.min_examples_per_task}) must not exceed "
                             f"max_examples_per_task ({self.max_examples_per_task})")
        return self

    @property
    def store_dir(self) -> Path:
        """The store's directory (a directory store only: a DSN has none)."""
        location = self.store_location
        if is_dsn(location):
            raise ValueError("POLYSERVE_STORE is a PostgreSQL DSN, not a directory")
        return Path(location)

    @property
    def store_location(self) -> str:
        """The store: a postgresql:// DSN as given, or the directory with ~ expanded."""
        assert self.store is not None
        if is_dsn(self.store):
            return self.store
        return str(Path(self.store).expanduser())
