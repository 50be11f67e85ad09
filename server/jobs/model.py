"""A job's record and its state machine (queued -> running -> succeeded | failed | cancelled).

Shape after OpenAI fine-tuning jobs; `to_public()` is what `GET /v1/jobs/{id}` returns.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
TRANSITIONS: dict[str, frozenset[str]] = {
    "queued": frozenset({"running", "cancelled", "failed"}),
    "running": frozenset({"succeeded", "failed", "cancelled"}),
}
MAX_EVENTS = 500


class IllegalTransition(Exception):
    pass


def new_job_id() -> str:
    return f"job-{secrets.token_hex(8)}"


@dataclass
class Job:
    id: str
    task: str
    method: str
    status: JobStatus = "queued"
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    progress: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: dict[str, str] | None = None
    steps: int | None = None
    seed: int | None = None
    n_examples: int = 0
    serve_early: bool = False
    live_version: int | None = None  # the task version this job made servable (serve_early: two)
    owner: str = ""  # the replica running it
    tenant: str | None = None  # who registered its task (server/registry/ownership.py); None = everyone's
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL

    def add_event(self, kind: str, message: str, level: str = "info", **data: Any) -> None:
        """OpenAI fine-tuning style event: created_at, level, type, message, data."""
        self.events.append({"created_at": time.time(), "level": level, "type": kind,
                            "message": message, "data": data})
        del self.events[:-MAX_EVENTS]

    def transition(self, status: JobStatus, *, error: dict[str, str] | None = None) -> bool:
        """Move to `status`; returns False if already there, raises on an illegal move."""
        if status == self.status:
            return False
        if status not in TRANSITIONS.get(self.status, frozenset()):
            raise IllegalTransition(f"job {self.id} cannot go from {self.status} to {status}")
        now = time.time()
        self.status = status
        if status == "running":
            self.started_at = now
        if status in TERMINAL:
            self.finished_at = now
        if status == "succeeded":
            self.progress = 1.0
        self.error = error
        self.add_event("status", f"job {status}" + (f": {error['message']}" if error else ""),
                       level="error" if status == "failed" else "info", status=status)
        return True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_public(self) -> dict[str, Any]:
        data = self.to_json()
        for private in ("events", "owner", "tenant"):
            data.pop(private)
        return data
