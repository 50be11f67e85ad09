"""`auto` registration: the form a task is served in, chosen by cross-validated exact match.

The candidates, cheapest first (a tie goes to the earlier one):

    demos           the task's demonstrations before every prompt, on the bare backbone
    routing         a trained routing row (retrieval, then training: training.retrieve)
    demos+routing   the demonstrations, and a routing row trained with them in its context
    full            a routing row and a copy of the skills (from FULL_FROM examples on)

Every candidate is scored on every example the way it would answer a new input:

    demos           leave-one-out: each example after the demonstrations chosen from the others
    trained forms   k-fold: the form trained on the other folds (demonstrations from them too),
                    then each example of the held-out fold scored

by teacher-forced exact match (training.loss.per_example_exact: the answer word for word, end
included, is what greedy decoding gives). A trained candidate stops as soon as it cannot beat the
best score so far even if it answered every example still unscored. The chosen form is then made
from all the examples (the same recipe as its explicit method), and the job reports each
candidate's score with its count and a 90% interval (training.estimate), and the examples'
majority answer's.

Cost, in forwards: the leave-one-out scoring is one forward over k prompts; each trained candidate
trains `folds` times. With `on_early` (a registration's `serve_early`) a first form is handed out
before anything is scored or trained: the demonstrations, or, where the examples cannot be
demonstrations, a retrieved row (`make_run("retrieve", ...)`: a retrieval on all the examples,
about two training steps). training/adapt.py and training/retrieve.py
make the final form. `step()` does one forward (or one training step) at a time, like an Adaptation,
so a server runs it between decode steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from adapters_store.lora.inject import RoutedModel
from adapters_store.store.records import InventoryInfo
from training.adapt import AdaptResult
from training.batching import FEW_SHOT_MAX_LENGTH, Encoded, collate, encode_example
from training.data import Example
from training.demos import (
    as_pairs,
    demonstration_text,
    end_ids,
    fits_on_a_line,
    majority_hits,
    select_demonstrations,
)
from training.estimate import LEVEL, MIN_HELD, wilson
from training.loss import TargetLogits, per_example_exact, target_logits
from training.precision import FrozenBf16Weights, resolve_autocast
from training.routing_table import row_weights

FORMS = ("demos", "routing", "demos+routing", "full")
FULL_FROM = 64  # examples: below this, training the skills' copy overfits (docs/RESULTS.md)
DEFAULT_FOLDS = 2  # a trained form's cost is a training per fold (docs/RESULTS.md, registration)
SCORE_TOKENS = 4096  # a scoring forward's padded tokens (rows x longest), at least one row


@dataclass
class Candidate:
    form: str
    hits: dict[int, bool] = field(default_factory=dict)  # example index -> answered word for word
    stopped: bool = False  # given up: it could no longer win

    def score(self) -> float:
        return sum(self.hits.values()) / len(self.hits) if self.hits else 0.0

    def estimate(self, k: int) -> dict[str, Any]:
        n = len(self.hits)
        out: dict[str, Any] = {"exact": round(self.score(), 4), "n": n}
        if n:
            low, high = wilson(sum(self.hits.values()), n)
            out.update(low=round(low, 4), high=round(high, 4))
        if self.stopped:
            out["stopped"] = f"stopped after {n} of {k} examples: it could no longer beat a cheaper form"
        return out


def ended_exact(t: TargetLogits, ends: torch.Tensor) -> torch.Tensor:
    """(N,) per_example_exact, where a row's last target token (its end token) may be predicted
    as any of `ends`: the answer word for word, then an end."""
    pred = t.logits.argmax(dim=-1)
    last = torch.ones_like(t.rows, dtype=torch.bool)
    last[:-1] = t.rows[1:] != t.rows[:-1]
    right = torch.where(last, torch.isin(pred, ends.to(pred.device)), pred == t.targets)
    wrong = torch.zeros(t.n_rows, device=pred.device).index_add_(0, t.rows, (~right).float())
    return (wrong == 0).float()


def folds_of(n: int, folds: int, seed: int) -> list[list[int]]:
    """Example indices in `folds` folds of near-equal size, dealt after a seeded shuffle."""
    import random

    order = list(range(n))
    random.Random(seed).shuffle(order)
    parts = max(2, min(folds, n))
    return [sorted(order[i::parts]) for i in range(parts)]


class AutoAdaptation:
    """Steppable `auto` (and `demos`) registration: `step()` until False, then `result()`.

    `make_run(form, examples, demonstrations)` builds a trained form as its explicit method does
    (an AdaptationLike: e.g. a retrieval then training, server/jobs/adaptation.py), for each fold on
    the other folds' examples, and for the chosen form on all of them; `forms` limits the candidates
    (("demos",) is the explicit `demos` method: scored, never trained)."""

    def __init__(
        self,
        rm: RoutedModel,
        info: InventoryInfo,
        skills: dict[str, torch.Tensor],
        examples: list[Example],
        tokenizer: Any,
        make_run: Callable[[str, list[Example], list[Example]], Any],
        *,
        demonstration_tokens: int,
        seed: int = 0,
        folds: int = DEFAULT_FOLDS,
        forms: Sequence[str] | None = None,
        steps: int | None = None,
        autocast: bool | str | None = None,
        progress: Callable[[dict], None] | None = None,
        on_early: Callable[[AdaptResult], None] | None = None,
    ) -> None:
        if len(examples) < 2:
            raise ValueError("auto needs at least two examples: one to score with the others")
        forms = tuple(forms) if forms is not None else FORMS
        if unknown := [f for f in forms if f not in FORMS]:
            raise ValueError(f"unknown forms {unknown}; known: {'|'.join(FORMS)}")
        self.rm, self.info, self.skills, self.tokenizer = rm, info, skills, tokenizer
        self.examples, self.make_run, self.seed, self.steps = list(examples), make_run, seed, steps
        self.budget = demonstration_tokens
        lines = fits_on_a_line(self.examples)
        self.demonstrations = select_demonstrations(self.examples, tokenizer, self.budget) if lines else []
        if not self.demonstrations:  # nothing fits the budget, or answers span lines: no form carries them
            forms = tuple(f for f in forms if not f.startswith("demos"))
        if len(self.examples) < FULL_FROM:
            forms = tuple(f for f in forms if f != "full")
        if not forms:
            why = (f"the examples' demonstrations pass the demonstration budget ({self.budget} tokens)" if lines
                   else "answers that span lines cannot be demonstrations (an answer after them ends at a newline)")
            raise ValueError(f"no candidate form: {why}, and nothing else was asked for")
        self.forms, self.folds = forms, folds_of(len(self.examples), folds, seed)
        self.candidates = {f: Candidate(f) for f in forms}
        self.progress, self.on_early = progress, on_early
        self.device = rm.layers[0].lora_A.device
        self.autocast = resolve_autocast(autocast, self.device)
        self.pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        self.ends = (torch.tensor(sorted(end_ids(tokenizer))) if self.demonstrations
                     else torch.zeros(0, dtype=torch.long))
        self.chosen: str | None = None
        self.final: Any = None
        self.cancelled = self.finished = False
        self.started = time.perf_counter()
        self.forwards = 0
        self.phase = "cv"
        self._run = self._stages()

    # -- scoring ------------------------------------------------------------------------------
    def _encoded(self, example: Example, context: str) -> Encoded:
        room = FEW_SHOT_MAX_LENGTH + len(self.tokenizer(context).input_ids)
        return encode_example(self.tokenizer, example, room, context)

    def _score(self, rows: list[tuple[int, Encoded]], adapter: Any, demonstrations: bool = False
               ) -> Iterator[dict[int, bool]]:
        """Score (index, encoded) rows under `adapter` (None: the bare backbone; (L, h, S) weights;
        or per-layer (A, B)), a forward of at most SCORE_TOKENS padded tokens at a time (each a
        step), longest first; the last value yielded is every row's hit. After demonstrations an
        answer may also end at a newline, as served (training.demos.end_ids)."""
        from training.evaluate import set_plan  # evaluate imports what this module's callers do not need

        rows = sorted(rows, key=lambda r: -len(r[1].input_ids))
        hits: dict[int, bool] = {}
        pos = 0
        bf16 = FrozenBf16Weights(self.rm.model, self.autocast)
        try:
            while pos < len(rows):
                longest = len(rows[pos][1].input_ids)
                take = max(1, min(len(rows) - pos, SCORE_TOKENS // max(1, longest)))
                chunk = rows[pos : pos + take]
                saved = self.rm.batch.plan
                try:
                    with torch.no_grad(), bf16.applied(), torch.autocast(
                            self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                        set_plan(self.rm, adapter, len(chunk))
                        t = target_logits(self.rm.model, collate([e for _, e in chunk], self.pad))
                        exact = ended_exact(t, self.ends) if demonstrations else per_example_exact(t)
                finally:
                    self.rm.batch.set(saved)
                self.forwards += 1
                hits.update({i: bool(x) for (i, _), x in zip(chunk, exact.tolist(), strict=True)})
                pos += take
                yield hits
        finally:
            bf16.release()

    def _adapter(self, result: AdaptResult) -> Any:
        if result.kind == "routing":
            routing = "hyper" if self.info.spec.routing == "hyper" else "sigmoid"
            return row_weights(result.tensors["logits"].float().to(self.device), routing, train=False)
        return [(result.tensors[f"{n}.A"].float().to(self.device), result.tensors[f"{n}.B"].float().to(self.device))
                for n in self.info.layer_names]

    # -- the stages, one unit of work per step ---------------------------------------------------
    def _best(self) -> float:
        done = [c.score() for c in self.candidates.values() if len(c.hits) == len(self.examples)]
        return max(done, default=-1.0)

    def _stages(self) -> Iterator[None]:
        k = len(self.examples)
        if "demos" in self.candidates:
            if self.on_early is not None:  # they cost nothing to serve: at once, scored or not
                self.on_early(self._demos_result({}))
            self.phase = "cv:demos"
            rows = []
            for i, ex in enumerate(self.examples):
                others = [e for j, e in enumerate(self.examples) if j != i]
                rows.append((i, self._encoded(ex, demonstration_text(
                    select_demonstrations(others, self.tokenizer, self.budget)))))
            for hits in self._score(rows, None, demonstrations=True):
                self.candidates["demos"].hits = dict(hits)
                yield
        elif self.on_early is not None:  # nothing to serve without training but a retrieved row
            self.phase = "early:retrieve"
            run = self.make_run("retrieve", self.examples, [])
            while run.step():
                if self.cancelled:
                    run.cancel()
                yield
            if self.cancelled or getattr(run, "chosen", None) is None:
                return
            self.on_early(run.result())
        for form in (f for f in self.forms if f != "demos"):
            candidate = self.candidates[form]
            self.phase = f"cv:{form}"
            for fold in self.folds:
                upper = (sum(candidate.hits.values()) + k - len(candidate.hits)) / k
                if upper <= self._best():
                    candidate.stopped = True
                    break
                held = set(fold)
                train = [e for i, e in enumerate(self.examples) if i not in held]
                demos = select_demonstrations(train, self.tokenizer, self.budget) if form == "demos+routing" else []
                run = self.make_run(form, train, demos)  # the form's own recipe, on the other folds
                while run.step():
                    if self.cancelled:
                        run.cancel()
                    yield
                if self.cancelled:
                    return
                context = demonstration_text(demos)
                rows = [(i, self._encoded(self.examples[i], context)) for i in fold]
                fold_hits: dict[int, bool] = {}
                for fold_hits in self._score(rows, self._adapter(run.result()), demonstrations=bool(demos)):
                    yield
                candidate.hits.update(fold_hits)
        scores = {f: c.score() for f, c in self.candidates.items() if not c.stopped}
        self.chosen = max(scores, key=lambda f: (scores[f], -FORMS.index(f)))
        if self.chosen == "demos":
            return
        self.phase = f"final:{self.chosen}"
        demos = self.demonstrations if self.chosen == "demos+routing" else []
        self.final = self.make_run(self.chosen, self.examples, demos)
        while self.final.step():
            if self.cancelled:
                self.final.cancel()
            yield

    def step(self) -> bool:
        if self.finished:
            return False
        try:
            next(self._run)
        except StopIteration:
            self.finished = True
        if self.cancelled and self.chosen is None:
            self.finished = True
        if self.progress is not None:
            self.progress({"phase": self.phase, "forwards": self.forwards, "finished": self.finished,
                           "elapsed": time.perf_counter() - self.started})
        return not self.finished

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def fraction(self) -> float:
        if self.finished:
            return 1.0
        done = sum(len(c.hits) for c in self.candidates.values()) + sum(
            len(self.examples) for c in self.candidates.values() if c.stopped)
        cv = done / (len(self.examples) * len(self.candidates))
        final = getattr(self.final, "fraction", 0.0) if self.final is not None else 0.0
        return 0.8 * cv + 0.2 * final

    def estimate(self) -> dict[str, Any]:
        """What the job reports and the task version keeps: each candidate's cross-validated exact
        match (n, LEVEL interval), the chosen form, the majority answer's score, a note where the
        examples are too few for the figure to be read alone."""
        k = len(self.examples)
        majority = majority_hits(self.examples)
        low, high = wilson(sum(majority), k)
        out: dict[str, Any] = {
            "chosen": self.chosen, "level": LEVEL, "folds": len(self.folds),
            "candidates": {f: c.estimate(k) for f, c in self.candidates.items()},
            "majority": {"exact": round(sum(majority) / k, 4), "n": k, "low": round(low, 4), "high": round(high, 4)},
        }
        if k < MIN_HELD:
            out["note"] = (f"too few examples for an estimate: {k} (each figure's {LEVEL:.0%} interval is wide; "
                           f"an estimate needs at least {MIN_HELD})")
        return out

    def _demos_result(self, metrics: dict[str, Any]) -> AdaptResult:
        """The demonstrations as a task version (the bare backbone: nothing trained)."""
        metrics = {"method": "demos", **metrics, "demonstrations": len(self.demonstrations)}
        return AdaptResult("demos", {}, metrics, 0, as_pairs(self.demonstrations))

    def result(self) -> AdaptResult:
        if not self.finished or self.chosen is None:
            raise RuntimeError("auto registration is unfinished or was cancelled before a form was chosen")
        estimate = self.estimate()
        chosen = estimate["candidates"][self.chosen]
        summary = {"chosen": self.chosen, "cv_exact": chosen["exact"], "cv_exact_n": chosen["n"],
                   "cv_exact_low": chosen.get("low"), "cv_exact_high": chosen.get("high"),
                   "majority_exact": estimate["majority"]["exact"], "cv_forwards": self.forwards,
                   "seconds": round(time.perf_counter() - self.started, 3)}
        if "note" in estimate:
            summary["eval_note"] = estimate["note"]
        if self.chosen == "demos":
            return self._demos_result({**summary, "estimate": estimate})
        res = self.final.result()
        # the final run's own held-out figure is replaced by the cross-validated one: it was taken on
        # a quarter of the examples, which early stopping also chose its step on
        metrics = {k: v for k, v in res.metrics.items() if not k.startswith("eval_exact") and k != "eval_note"}
        res.metrics = {**metrics, **summary, "final_seconds": metrics.get("seconds"), "estimate": estimate}
        res.demonstrations = as_pairs(self.demonstrations) if self.chosen == "demos+routing" else []
        return res

