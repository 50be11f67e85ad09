"""Plain records kept in the store's JSON files."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from datetime import date
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
# a task record's `quality`: what a shipped task was measured to do (training/shipped_inventory.py):
# exact match on held-out words and, for a word-level task, on sentences, over `n` inputs each, on
# the day `measured`; `below_floor` marks a task under the shipped floor (installed only on request)
QUALITY_FIGURES = ("heldout_exact", "sentences_exact")
QUALITY_KEYS = frozenset({*QUALITY_FIGURES, "n", "measured", "below_floor"})


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
    # measured quality of these weights (QUALITY_KEYS; empty: never measured, as for a registered task)
    quality: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskRecord:
        return cls(**{k: v for k, v in data.items() if k in _TASK_FIELDS})

    @property
    def cache_version(self) -> str:
        """Identifies the weights' content (for cache keys): never reused for other weights."""
        return f"{self.version}-{self.digest}"


def check_quality(quality: dict[str, Any]) -> dict[str, Any]:
    """A record's `quality` as stored, or ValueError: empty, or `heldout_exact` (with
    `sentences_exact` where measured) each a fraction in [0, 1], `n` the inputs each was measured
    on, `measured` an ISO date, `below_floor` a bool; nothing else."""
    if not quality:
        return {}
    if not isinstance(quality, dict) or not set(quality) <= QUALITY_KEYS or "heldout_exact" not in quality:
        raise ValueError(f"quality is an object with heldout_exact and only {sorted(QUALITY_KEYS)}")
    for key in QUALITY_FIGURES:
        value = quality.get(key)
        if key in quality and (isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1):
            raise ValueError(f"quality.{key} is a fraction in [0, 1], got {value!r}")
    n = quality.get("n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"quality.n is the number of inputs measured (>= 1), got {n!r}")
    measured = quality.get("measured")
    try:
        date.fromisoformat(measured)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"quality.measured is an ISO date (YYYY-MM-DD), got {measured!r}") from None
    below = quality.get("below_floor", False)
    if below is not True and below is not False:
        raise ValueError(f"quality.below_floor is a bool, got {below!r}")
    return dict(quality)


# the field names, worked out once (from_json runs for every record a listing or request reads)
_TASK_FIELDS = frozenset(f.name for f in fields(TaskRecord))
