"""What a registration job runs, given what registration trains on: shared by the server's
in-process runner (server.jobs.service) and the fleet's workers (server.fleet.worker).

    retrieve        a Retrieval alone (no gradient step)
    routing         a Retrieval, then training from the retrieved row (from mu when the store
                    holds no other task)
    mu / full       an Adaptation
    serve_early     every method retrieves first; `on_early(result)` commits the retrieved row
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from adapters_store.lora.inject import RoutedModel
from adapters_store.store.contract import AdapterStore
from adapters_store.store.records import InventoryInfo
from server.jobs.contract import AdaptationLike, AdaptationResult, Progress
from server.jobs.model import Job


@dataclass(frozen=True)
class TrainingModel:
    """The backbone copy registration trains on: the routed model with the inventory's skills
    (float32, on its device), the tokenizer, and the store retrieval reads candidates from."""

    routed: RoutedModel
    info: InventoryInfo
    skills: dict[str, torch.Tensor]
    tokenizer: Any
    store: AdapterStore


def make_adaptation(model: TrainingModel, job: Job, examples: list[dict[str, str]],
                    progress: Progress, on_early: Callable[[AdaptationResult], None] | None) -> AdaptationLike:
    from training.adapt import Adaptation
    from training.adapt_config import AdaptConfig
    from training.data import Example
    from training.retrieve import MAX_CANDIDATES, Retrieval, RetrievedAdaptation

    exs = [Example(job.task, e["input"], e["output"]) for e in examples]
    seed = job.seed or 0

    def adaptation(init_row=None, init_eval=None):
        config = AdaptConfig(method=job.method, steps=job.steps, seed=seed)
        trains_row = job.method in ("routing", "full")
        return Adaptation(model.routed, model.info, model.skills, exs, model.tokenizer, config, progress=progress,
                          init_row=init_row if trains_row else None, init_eval=init_eval if trains_row else None)

    if job.method not in ("retrieve", "routing") and not job.serve_early:
        return adaptation()
    candidates = model.store.routing_rows(limit=MAX_CANDIDATES, exclude=job.task)
    if job.method == "routing" and not candidates and not job.serve_early:
        return adaptation()
    retrieval = Retrieval(model.routed, model.info, candidates, exs, model.tokenizer, seed=seed,
                          progress=progress if job.method == "retrieve" else None)
    if job.method == "retrieve":
        return retrieval
    return RetrievedAdaptation(retrieval, adaptation, on_retrieved=on_early if job.serve_early else None)
