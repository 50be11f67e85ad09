"""Plain records kept in the store's JSON files."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from adapters_store.lora.spec import InventorySpec

TaskStatus = Literal["ready", "training", "failed"]
AdapterKind = Literal["routing", "lora", "demos"]  # demos: the demonstrations on the bare backbone
# adapters_store.backbone.prompt.PROMPT_FORMAT: the format every task so far was trained with (and the default
# for records written before the field existed)
DEFAULT_PROMPT_FORMAT = "input-output"
# a task record's `examples`: a few input/output pairs that show what it does (the first ones a
# registration sent, or the suite's for a shipped task), not its training data
MAX_RECORD_EXAMPLES = 3
MAX_DESCRIPTION_CHARS = 500


@dataclass(frozen=True)
class InventoryInfo:
    """inventory.json: what the skills are, which backbone they belong to, how they were made."""

    spec: InventorySpec
    layer_names: tuple[str, ...]
    layer_dims: tuple[tuple[int, int], ...]
    backbone_fingerprint: str
    backbone_name: str
    version: str  # digest of the skills' bytes: a retrained inventory is a new version
    created_at: float
    made_by: dict[str, Any] = field(default_factory=dict)
    format_version: int = 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["spec"] = self.spec.to_json()
        data["layer_names"] = list(self.layer_names)
        data["layer_dims"] = [list(d) for d in self.layer_dims]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InventoryInfo:
        return cls(
            spec=InventorySpec.from_json(data["spec"]),
            layer_names=tuple(data["layer_names"]),
            layer_dims=tuple((int(a), int(b)) for a, b in data["layer_dims"]),
            backbone_fingerprint=data["backbone_fingerprint"],
            backbone_name=data.get("backbone_name", ""),
            version=data["version"],
            created_at=float(data["created_at"]),
            made_by=data.get("made_by", {}),
            format_version=int(data.get("format_version", 1)),
        )

    @property
    def routing_params(self) -> int:
        """Numbers in one task's routing row: L layers x h heads x S skills."""
        return len(self.layer_names) * self.spec.n_heads * self.spec.n_skills


@dataclass(frozen=True)
class TaskRecord:
    """tasks/<id>/task.json. `file` names the weights (routing logits or a plain LoRA)."""

    id: str
    method: str
    status: TaskStatus
    version: int
    created_at: float
    updated_at: float
    kind: AdapterKind | None = None
    file: str | None = None
    digest: str | None = None
    params: int = 0
    source: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    job_id: str | None = None
    error: str | None = None
    inventory_version: str | None = None
    prompt_format: str = DEFAULT_PROMPT_FORMAT  # how the task's inputs were rendered in training
    owner: str | None = None  # the tenant that registered it (None: shipped / before tenants = shared)
    shared: bool = False  # every tenant may see and use it (server/registry/ownership.py)
    description: str | None = None  # what the task does, in words (a registration's, or the suite's)
    examples: list[dict[str, str]] = field(default_factory=list)  # at most MAX_RECORD_EXAMPLES pairs
    # served before every prompt of this version (training/demos.py), {"input", "output"} each; with
    # kind "demos", on the bare backbone. The owner's data: seen only by whoever may see the task
    demonstrations: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskRecord:
        return cls(**{k: v for k, v in data.items() if k in _TASK_FIELDS})

    @property
    def cache_version(self) -> str:
        """Identifies the weights' content (for cache keys): never reused for other weights."""
        return f"{self.version}-{self.digest}"


# the field names, worked out once (from_json runs for every record a listing or request reads)
_TASK_FIELDS = frozenset(f.name for f in fields(TaskRecord))
