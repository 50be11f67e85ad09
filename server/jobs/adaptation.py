"""What a registration job runs, given what registration trains on: shared by the server's
in-process runner (server.jobs.service) and the fleet's workers (server.fleet.worker).

    retrieve        a Retrieval alone (no gradient step)
    routing         a Retrieval, then training from the retrieved row (from mu when the store
                    holds no other task)
    mu / full       an Adaptation
    demos           the task's demonstrations on the bare backbone, scored leave-one-out
                    (training.auto), nothing trained
    demos+routing   an Adaptation of a routing row with the demonstrations in its context
    auto            every form cross-validated, then the best made as its method would
                    (training.auto)
    serve_early     routing, mu, full retrieve first and `on_early(result)` commits the retrieved
                    row; auto commits its demonstrations at once (a retrieved row where the
                    examples cannot be demonstrations), then weighs the forms
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
    demonstration_tokens: int = 1024  # Settings.demonstration_budget (POLYSERVE_MAX_DEMONSTRATION_TOKENS)


def make_adaptation(model: TrainingModel, job: Job, examples: list[dict[str, str]],
                    progress: Progress, on_early: Callable[[AdaptationResult], None] | None) -> AdaptationLike:
    from training.adapt import Adaptation
    from training.adapt_config import AdaptConfig
    from training.auto import AutoAdaptation
    from training.data import Example
    from training.demos import fits_on_a_line, select_demonstrations
    from training.retrieve import MAX_CANDIDATES, Retrieval, RetrievedAdaptation

    exs = [Example(job.task, e["input"], e["output"]) for e in examples]
    seed = job.seed or 0

    def trained(method: str, demonstrations: list[Example], early: bool, examples: list[Example] = exs):
        """`method` as its explicit registration trains it on `examples` (routing: retrieval first)."""
        def adaptation(init_row=None, init_eval=None):
            config = AdaptConfig(method=method, steps=job.steps, seed=seed)
            trains_row = method in ("routing", "full")
            return Adaptation(model.routed, model.info, model.skills, examples, model.tokenizer, config,
                              progress=progress, init_row=init_row if trains_row else None,
                              init_eval=init_eval if trains_row else None, demonstrations=demonstrations or None)

        if demonstrations or (method != "routing" and not early):
            return adaptation()
        candidates = model.store.routing_rows(limit=MAX_CANDIDATES, exclude=job.task)
        if not candidates and not early:
            return adaptation()
        retrieval = Retrieval(model.routed, model.info, candidates, examples, model.tokenizer, seed=seed)
        return RetrievedAdaptation(retrieval, adaptation, on_retrieved=on_early if early else None)

    def retrieval(examples: list[Example]) -> Retrieval:
        candidates = model.store.routing_rows(limit=MAX_CANDIDATES, exclude=job.task)
        return Retrieval(model.routed, model.info, candidates, examples, model.tokenizer, seed=seed,
                         progress=progress)

    def auto_run(form: str, examples: list[Example], demos: list[Example]) -> AdaptationLike:
        if form == "retrieve":  # serve_early's first version where there are no demonstrations
            return retrieval(examples)
        return trained("routing" if form == "demos+routing" else form, demos, False, examples)

    budget = model.demonstration_tokens
    if job.method in ("auto", "demos"):
        return AutoAdaptation(model.routed, model.info, model.skills, exs, model.tokenizer, auto_run,
                              demonstration_tokens=budget, seed=seed, steps=job.steps, progress=progress,
                              forms=("demos",) if job.method == "demos" else None,
                              on_early=on_early if job.serve_early and job.method == "auto" else None)
    if job.method == "demos+routing":
        if not fits_on_a_line(exs):
            raise ValueError("demos+routing: answers that span lines cannot be demonstrations")
        demos = select_demonstrations(exs, model.tokenizer, budget)
        if not demos:
            raise ValueError(f"demos+routing: no example fits the demonstration budget ({budget} tokens, "
                             "POLYSERVE_MAX_DEMONSTRATION_TOKENS)")
        return trained("routing", demos, False)
    if job.method == "retrieve":
        return retrieval(exs)
    return trained(job.method, [], job.serve_early)
