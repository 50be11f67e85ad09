"""Retrieval of a routing row for a new task from the routing rows of existing tasks.

A task of a routed inventory is its routing row, so a library of tasks is a library of points in
routing space (the LoraHub / Arrow idea of reusing adapters, here without leaving that space: a
mixture of rows is still one row). Two stages, no optimiser step:

    screen   one forward + backward at μ (uniform routing) on the training examples gives
             g = d loss / d weights (L, h, S). A candidate with weights w_c is predicted to change
             the loss by g . (w_c - w_μ) (first order); every candidate is ranked by that, however
             many there are, for the price of one training step.
    choose   the real loss on the held-out examples (the training examples when none are held
             out) of: the best-ranked row, the mean of the top k rows' logits for k in `ks`, and μ.
             The lowest wins (ties: fewer rows).

Measured on the default inventory (48 tasks) and 4 held-out compositions: the screen's first
choice was the true-loss first choice on all 4, at a tenth of the cost of scoring every candidate
by forwards (2.3 s vs 22 s on 2 cores). Each `step()` runs one forward (or forward + backward) of
at most `rows_per_step` examples, so a server runs a retrieval between decode steps like an
adaptation. The result is a "routing" AdaptResult: {"logits": (L, h, S)}.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from adapters_store.lora.inject import RoutedModel
from adapters_store.store.records import InventoryInfo
from training.adapt import AdaptResult, KnownEval
from training.adapt_config import HOLDOUT
from training.batching import FEW_SHOT_MAX_LENGTH, Encoded, collate, encode_all, within_tokens
from training.data import Example, split_examples
from training.estimate import exact_estimate
from training.loss import per_example_exact, per_example_loss, target_logits
from training.precision import resolve_autocast
from training.routing_table import row_weights

MU = "μ"  # the uniform routing: always a choice, so retrieval never ends worse than μ on held-out data
DEFAULT_KS = (1, 2, 4)
# the library a new task is retrieved from: the most recently updated tasks' rows (the screen costs
# one training step whatever their number; loading 1,024 rows reads ~30 MB)
MAX_CANDIDATES = 1024
# the screen's examples: as many training examples as one padded batch of this many tokens holds (at
# least one). The procedural suite's fit whole; long real-task examples give a few, which bounds a
# registration's retrieval time; the choice after it still scores every candidate on all the
# held-out examples (docs/RESULTS.md, "Registration time on BIG-bench-length inputs").
SCREEN_TOKENS = 1024


def mu_row(L: int, h: int, S: int, hyper: bool) -> torch.Tensor:
    """The routing row whose weights are uniform: logits 0 (sigmoid) or 1/S (hyper)."""
    return torch.full((L, h, S), 1.0 / S) if hyper else torch.zeros(L, h, S)


def mixture(rows: torch.Tensor) -> torch.Tensor:
    """(k, L, h, S) -> (L, h, S): the mean of k routing rows (logits, or embeddings for hyper)."""
    return rows.mean(dim=0)


def predicted_change(grad: torch.Tensor, weights: torch.Tensor, mu_weights: torch.Tensor) -> torch.Tensor:
    """First-order loss change of moving from μ to each candidate. grad, mu_weights: (L, h, S);
    weights: (C, L, h, S) -> (C,)."""
    return ((weights - mu_weights) * grad).flatten(1).sum(dim=1)


class Retrieval:
    """Steppable retrieval: `step()` until it returns False, then `result()` (kind "routing")."""

    def __init__(
        self,
        rm: RoutedModel,
        info: InventoryInfo,
        candidates: Mapping[str, torch.Tensor],
        examples: list[Example],
        tokenizer: Any,
        *,
        seed: int = 0,
        holdout_fraction: float = HOLDOUT,
        ks: tuple[int, ...] = DEFAULT_KS,
        rows_per_step: int = 32,
        screen_tokens: int = SCREEN_TOKENS,
        max_length: int = FEW_SHOT_MAX_LENGTH,
        autocast: bool | str | None = None,
        progress: Callable[[dict], None] | None = None,
    ) -> None:
        if not examples:
            raise ValueError("retrieval needs at least one example")
        if tuple(rm.names) != tuple(info.layer_names):
            raise ValueError("the RoutedModel's layers do not match the inventory's")
        if rows_per_step < 1 or not ks or min(ks) < 1:
            raise ValueError("rows_per_step and every k must be >= 1")
        if screen_tokens < 0:
            raise ValueError(f"screen_tokens must be >= 0 (0: no cap), got {screen_tokens}")
        L, h, S = len(info.layer_names), info.spec.n_heads, info.spec.n_skills
        self.shape = (L, h, S)
        self.routing = "hyper" if info.spec.routing == "hyper" else "sigmoid"
        self.names: list[str] = []
        rows = []
        for name, row in candidates.items():
            if tuple(row.shape) != self.shape:
                raise ValueError(f"candidate {name!r} has shape {tuple(row.shape)}, the inventory needs {self.shape}")
            self.names.append(name)
            rows.append(row.detach().float().cpu())
        self.rows = torch.stack(rows) if rows else torch.zeros(0, L, h, S)  # (C, L, h, S) logits
        self.mu = mu_row(L, h, S, self.routing == "hyper")
        self.rm, self.progress = rm, progress
        self.device = rm.layers[0].lora_A.device
        self.autocast = resolve_autocast(autocast, self.device)
        self.rows_per_step, self.ks = rows_per_step, tuple(sorted(set(ks)))
        train, held = split_examples(list(examples), holdout_fraction, seed)
        self.n_train, self.n_held = len(train), len(held)
        self.held_examples = tuple(held)
        train_encoded = encode_all(tokenizer, train, max_length)
        self.held: list[Encoded] = encode_all(tokenizer, held, max_length) or train_encoded
        # the screen's examples (SCREEN_TOKENS); 0: all of them
        self.train: list[Encoded] = train_encoded[: within_tokens([len(e.input_ids) for e in train_encoded],
                                                                  screen_tokens)]
        self.pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

        self.grad = torch.zeros(L, h, S)
        self.n_target = sum(e.n_target for e in self.train)
        self.mu_train_loss = 0.0
        self.ranked: list[int] = []  # candidate indices, best predicted first
        self.choices: dict[str, torch.Tensor] = {}
        self.held_sums: dict[str, float] = {}
        self.held_loss: dict[str, float] = {}
        self.exact_sums: dict[str, float] = {}
        self.held_exact: dict[str, float] = {}  # each choice's held-out exact match (training.loss.per_example_exact)
        self.stage = "screen" if self.names else "choose"
        self.pos = 0  # next example of the current stage
        if not self.names:
            self._plan_choices()
        self.forwards = 0
        self.cancelled = self.finished = False
        self.chosen: str | None = None
        self.started = time.perf_counter()

    # -- stages -----------------------------------------------------------------------------
    def _screen_slice(self) -> None:
        """Forward + backward at μ on the next chunk of training examples; accumulates the
        token-mean loss gradient over the whole training set."""
        chunk = self.train[self.pos : self.pos + self.rows_per_step]
        with torch.inference_mode(False), torch.enable_grad():
            w = row_weights(self.mu, self.routing, train=False).to(self.device).detach().clone().requires_grad_(True)
            self.rm.set_materialized(w, rows=len(chunk))
            with self._ctx():
                t = target_logits(self.rm.model, collate(chunk, self.pad))
                loss_sum = torch.nn.functional.cross_entropy(t.logits, t.targets, reduction="sum")
            (loss_sum / self.n_target).backward()
        assert w.grad is not None  # w requires grad and the loss depends on it
        self.grad += w.grad.detach().float().cpu()
        self.mu_train_loss += float(loss_sum.detach()) / self.n_target
        self.pos += len(chunk)
        if self.pos >= len(self.train):
            mu_w = row_weights(self.mu, self.routing, train=False)
            change = predicted_change(self.grad, row_weights(self.rows, self.routing, train=False), mu_w)
            self.predicted = change
            self.ranked = [int(i) for i in torch.argsort(change, stable=True)]
            self._plan_choices()

    def _plan_choices(self) -> None:
        self.choices = {MU: self.mu}
        for k in self.ks:
            if k <= len(self.ranked):
                self.choices[f"top{k}"] = mixture(self.rows[self.ranked[:k]])
        self.stage, self.pos = "choose", 0

    @torch.no_grad()
    def _choose_slice(self) -> None:
        """Held-out loss of every choice on the next examples: (choice, example) rows in one forward."""
        per_pass = max(1, self.rows_per_step // len(self.choices))
        chunk = self.held[self.pos : self.pos + per_pass]
        names = list(self.choices)
        weights = row_weights(torch.stack([self.choices[n] for n in names]), self.routing, train=False)
        index = torch.arange(len(names)).repeat(len(chunk))  # example-major: row e * len(names) + j -> choice j
        self.rm.set_materialized(weights.to(self.device), index)
        batch = collate([e for e in chunk for _ in names], self.pad)
        with self._ctx():
            t = target_logits(self.rm.model, batch)
            losses = per_example_loss(t).view(len(chunk), len(names))
            exact = per_example_exact(t).view(len(chunk), len(names))
        for j, name in enumerate(names):
            self.held_sums[name] = self.held_sums.get(name, 0.0) + float(losses[:, j].sum())
            self.exact_sums[name] = self.exact_sums.get(name, 0.0) + float(exact[:, j].sum())
        self.pos += len(chunk)
        if self.pos >= len(self.held):
            self.held_loss = {n: s / len(self.held) for n, s in self.held_sums.items()}
            self.held_exact = {n: s / len(self.held) for n, s in self.exact_sums.items()}
            self.chosen = min(self.held_loss, key=lambda n: (self.held_loss[n], self._k(n)))
            self.stage, self.finished = "done", True

    @staticmethod
    def _k(name: str) -> int:
        """How many rows a choice mixes (μ: 0)."""
        return int(name[3:]) if name.startswith("top") else 0

    def _ctx(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    # -- stepping (AdaptationLike) ----------------------------------------------------------
    def step(self) -> bool:
        """One forward (choose) or forward + backward (screen); False once finished or cancelled."""
        if self.finished:
            return False
        if self.cancelled:
            self.finished = True
            return False
        saved = self.rm.batch.plan, [p.requires_grad for p in self.rm.skill_parameters()]
        try:
            for p in self.rm.skill_parameters():
                p.requires_grad_(False)
            if self.stage == "screen":
                self._screen_slice()
            else:
                self._choose_slice()
            self.forwards += 1
        finally:
            plan, flags = saved
            for p, flag in zip(self.rm.skill_parameters(), flags):
                p.requires_grad_(flag)
            self.rm.batch.set(plan)
        if self.progress is not None:
            self.progress({"step": self.forwards, "steps": self.total_forwards, "phase": self.stage,
                           "elapsed": time.perf_counter() - self.started, "finished": self.finished})
        return not self.finished

    @property
    def total_forwards(self) -> int:
        per_pass = max(1, self.rows_per_step // (1 + len([k for k in self.ks if k <= max(1, len(self.names))])))
        screen = -(-len(self.train) // self.rows_per_step) if self.names else 0
        return screen + -(-len(self.held) // per_pass)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def fraction(self) -> float:
        return 1.0 if self.finished else min(0.999, self.forwards / max(1, self.total_forwards))

    def result(self) -> AdaptResult:
        if not self.finished:
            raise RuntimeError("retrieval is still running; step() until it returns False (or cancel())")
        if self.chosen is None:
            raise RuntimeError("retrieval was cancelled before it chose a row")
        k = self._k(self.chosen)
        exact = self.held_exact[self.chosen] if self.n_held else None  # else it scored the training examples
        metrics = {
            "method": "retrieve", "k": k, "retrieved": [self.names[i] for i in self.ranked[:k]],
            "ranked": [self.names[i] for i in self.ranked[:8]], "candidates": len(self.names),
            "eval_loss": self.held_loss[self.chosen], "mu_eval_loss": self.held_loss[MU],
            "held_losses": {n: round(v, 4) for n, v in self.held_loss.items()},
            "mu_train_loss": self.mu_train_loss if self.names else None,
            "n_train": self.n_train, "n_held": self.n_held, "n_screened": len(self.train), "forwards": self.forwards,
            "seconds": round(time.perf_counter() - self.started, 3),
            "eval_exact": exact, **exact_estimate(exact, self.n_held),
        }
        if not k:  # what the row is, where `retrieved` is empty
            metrics["retrieve_note"] = ("no other task to retrieve from: μ (the uniform routing)" if not self.names
                                        else "no retrieved row beat μ (the uniform routing) on the held-out loss")
        return AdaptResult("routing", {"logits": self.choices[self.chosen].clone()}, metrics, params=0)

    def known_eval(self) -> KnownEval | None:
        """The chosen row's held-out loss and exact match and the examples they were measured on, for an Adaptation that
        trains from that row on the same split; None before the choice or where nothing was held out
        (the choice then scored the training examples)."""
        if self.chosen is None or not self.n_held:
            return None
        return KnownEval(self.held_loss[self.chosen], self.held_examples, self.held_exact[self.chosen])


def retrieve(
    rm: RoutedModel,
    info: InventoryInfo,
    candidates: Mapping[str, torch.Tensor],
    examples: list[Example],
    tokenizer: Any,
    **kwargs: Any,
) -> AdaptResult:
    """Run a Retrieval to the end and return its result."""
    job = Retrieval(rm, info, candidates, examples, tokenizer, **kwargs)
    while job.step():
        pass
    return job.result()


class RetrievedAdaptation:
    """A Retrieval, then an Adaptation that starts from the retrieved row (AdaptationLike).

    `make_adaptation(init_row, init_eval)` builds the second stage once the first is done, given
    the retrieved row and its held-out loss (a KnownEval; None where the retrieval held nothing
    out), which an Adaptation on the same split need not measure again; `on_retrieved` (optional)
    receives the retrieval's result first (e.g. to serve it at once)."""

    def __init__(
        self,
        retrieval: Retrieval,
        make_adaptation: Callable[[torch.Tensor, KnownEval | None], Any],
        on_retrieved: Callable[[AdaptResult], None] | None = None,
    ) -> None:
        self.retrieval, self.make_adaptation, self.on_retrieved = retrieval, make_adaptation, on_retrieved
        self.adaptation: Any = None
        self.retrieved: AdaptResult | None = None
        self.cancelled = False

    def step(self) -> bool:
        if self.adaptation is None:
            if self.cancelled:
                self.retrieval.cancel()
            if self.retrieval.step():
                return True
            if self.cancelled or self.retrieval.chosen is None:
                return False
            self.retrieved = self.retrieval.result()
            if self.on_retrieved is not None:
                self.on_retrieved(self.retrieved)
            self.adaptation = self.make_adaptation(self.retrieved.tensors["logits"], self.retrieval.known_eval())
            return True
        return self.adaptation.step()

    def cancel(self) -> None:
        self.cancelled = True
        if self.adaptation is not None:
            self.adaptation.cancel()

    @property
    def fraction(self) -> float:
        return 0.0 if self.adaptation is None else self.adaptation.fraction

    def result(self) -> AdaptResult:
        if self.adaptation is None:
            raise RuntimeError("retrieval was cancelled before training started")
        res = self.adaptation.result()
        assert self.retrieved is not None
        r = self.retrieved.metrics
        # init: where training started: "retrieve" from the retrieved row; "mu" where the retrieval
        # kept μ (`retrieved` empty) or the method does not train a row (mu: the row was only served early)
        init: dict[str, Any]
        if not getattr(self.adaptation, "from_init_row", True):
            init = {"init": "mu", "init_note": "training started from μ; the retrieved row was only served early"}
        elif r["retrieved"]:
            init = {"init": "retrieve"}
        else:
            init = {"init": "mu", "init_note": r.get("retrieve_note")}
        res.metrics.update({**init, "retrieve_k": r["k"], "retrieved": r["retrieved"],
                            "retrieve_eval_loss": r["eval_loss"], "mu_eval_loss": r["mu_eval_loss"],
                            "retrieve_seconds": r["seconds"],
                            "seconds": round(r["seconds"] + res.metrics.get("seconds", 0.0), 3)})
        return res
