"""What the job runner (server/jobs/runner.py) asks of an adaptation, and what it commits.

An adaptation is stepped one slice at a time by the engine thread and built by the runner's
builder thread; training/adapt.py (Adaptation), training/retrieve.py (Retrieval,
RetrievedAdaptation) and the tests' fakes all fit. Protocols, so that server/jobs/ reads
training's shapes without importing training at start-up (server/jobs/adaptation.py imports it
only when a job is built).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from server.jobs.model import Job


class AdaptationResult(Protocol):
    """A finished adaptation's tensors (training/adapt.py's AdaptResult): "routing" commits
    {"logits": (L, h, S)} as the task's routing row, "lora" commits "<layer>.A" / "<layer>.B",
    "demos" commits no tensors; any kind may carry `demonstrations`, read with getattr."""

    @property
    def kind(self) -> str: ...

    @property
    def tensors(self) -> dict[str, torch.Tensor]: ...

    @property
    def metrics(self) -> dict[str, Any]: ...


class AdaptationLike(Protocol):
    def step(self) -> bool: ...
    def cancel(self) -> None: ...
    def result(self) -> AdaptationResult: ...


# the progress callback an adaptation calls with its numbers ("step", "steps", "phase", losses...)
Progress = Callable[[dict[str, Any]], None]
# (job, examples as dicts, progress callback) -> a steppable adaptation
AdaptationFactory = Callable[[Job, list[dict[str, str]], Progress], AdaptationLike]
