"""Hyper-parameters of a skill inventory (validated dataclass, no behaviour)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

RoutingKind = Literal["sigmoid", "hyper"]

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class InventorySpec:
    """Shape of an inventory: S skills, h routing heads (1 = Poly, > 1 = MHR), rank r.

    `routing` is how a task's stored routing row becomes mixing weights at inference:
    "sigmoid" (Poly/MHR: normalised sigmoid of logits) or "hyper" (raw task embedding).
    """

    n_skills: int = 8
    n_heads: int = 1
    rank: int = 8
    target_modules: tuple[str, ...] = ATTENTION_TARGETS
    routing: RoutingKind = "sigmoid"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("n_skills", "n_heads", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.target_modules:
            raise ValueError("target_modules must name at least one linear (e.g. q_proj)")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.routing not in ("sigmoid", "hyper"):
            raise ValueError(f"routing must be 'sigmoid' or 'hyper', got {self.routing!r}")

    @property
    def scale(self) -> float:
        """LoRA scaling, PEFT's convention: lora_alpha = 1, so alpha / r = 1 / r."""
        return 1.0 / self.rank

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["target_modules"] = list(self.target_modules)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InventorySpec:
        known = {k: data[k] for k in ("n_skills", "n_heads", "rank", "routing", "extra") if k in data}
        return cls(target_modules=tuple(data.get("target_modules", ATTENTION_TARGETS)), **known)
