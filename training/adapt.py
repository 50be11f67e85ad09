"""Few-shot adaptation of one new task on a shared RoutedModel, one step at a time.

The server runs an Adaptation between decode steps of its engine on its own RoutedModel, so a
step borrows the model and gives it back as it found it:

    previous plan, skills' requires_grad  -> saved
    set this adaptation's plan (skill-space weights or gathered tables) -> forward/backward
    -> optimizer step on this adaptation's own tensors only -> restore what was saved

The shared skills are never written: they are frozen for "routing", and "mu"/"full" train
copies. Methods (what is trained -> what is stored):

    routing   a new routing row (L, h, S), init U(-1e-3, 1e-3) (≈ μ)   -> routing row
              or `init_row` (a retrieved row, training.retrieve) + that noise
    mu        the skills' average LoRA (μ, collapsed): per layer (d_in, r), (r, d_out) -> plain LoRA
    plain-lora  a LoRA of the inventory's rank on the same linears, PEFT's initialisation (A uniform
              in ±1/sqrt(d_in), B = 0): what a user without an inventory trains  -> plain LoRA
    full      a new routing row + a copy of the skills, materialised     -> plain LoRA
              differentiably every step

Part of the examples is held out (none for a routing run on many examples: AdaptConfig.budget);
the held-out loss and exact match are measured every `eval_every` steps and the best-so-far tensors
are kept (by `select`; early stopping with `patience` evaluations); a caller that has
already scored `init_row` on the same held-out split (a retrieval) passes that loss (KnownEval) and
the first evaluation is not run again. The hyper-parameters come in one AdaptConfig
(training/adapt_config.py), checked when it is made.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from adapters_store.lora.combine import materialize_many
from adapters_store.lora.inject import RoutedModel
from adapters_store.store.materialize import layers_from_weights, mu_weights
from adapters_store.store.records import InventoryInfo
from training.adapt_config import AdaptConfig
from training.batching import Encoded, collate, encode_all, encode_example, within_tokens
from training.data import Example, split_examples
from training.demos import as_pairs, context_for, demonstration_text, select_demonstrations
from training.estimate import exact_estimate
from training.loss import per_example_exact, per_example_loss, target_logits, token_loss
from training.precision import FrozenBf16Weights, resolve_autocast
from training.routing_table import INIT, row_weights

#: Methods whose trained tensors are one LoRA per linear (A (1, d_in, r), B (1, r, d_out)).
_SINGLE_LORA = ("mu", "plain-lora")
FULL_ROW_LR = 0.1
# demos+routing: a training example is trained after this many of the other demonstrations, within
# this many tokens (at least one): a step's cost stays near a routing step's
TRAIN_DEMONSTRATIONS = 4
TRAIN_DEMONSTRATION_TOKENS = 256


@dataclass
class AdaptResult:
    kind: Literal["routing", "lora", "demos"]
    # routing: {"logits": (L, h, S)}; lora: {"<layer>.A", "<layer>.B"}; demos: {} (the bare backbone)
    tensors: dict[str, torch.Tensor]
    metrics: dict[str, Any] = field(default_factory=dict)
    params: int = 0  # numbers trained for this task
    # the examples served before every prompt of the task (training/demos.py), as {"input", "output"}
    demonstrations: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class KnownEval:
    """The held-out loss of an Adaptation's `init_row`, measured by its caller (a retrieval's choice
    scores its row on the same split), and the held-out examples it was measured on."""

    loss: float
    held: tuple[Example, ...]
    exact: float | None = None  # held-out exact match; an Adaptation selecting on it needs it


EVAL_CHUNK = 16  # held-out examples evaluated per step() (one forward, as long as a training step)


class Adaptation:
    """Steppable few-shot adaptation. `step()` until it returns False, then `result()`."""

    def __init__(
        self,
        rm: RoutedModel,
        info: InventoryInfo,
        skills: dict[str, torch.Tensor],
        examples: list[Example],
        tokenizer: Any,
        config: AdaptConfig | None = None,
        *,
        progress: Callable[[dict], None] | None = None,
        init_row: torch.Tensor | None = None,
        init_eval: KnownEval | None = None,
        demonstrations: list[Example] | None = None,
    ) -> None:
        config = config if config is not None else AdaptConfig()
        if not examples:
            raise ValueError("adaptation needs at least one example")
        if tuple(rm.names) != tuple(info.layer_names):
            raise ValueError("the RoutedModel's layers do not match the inventory's")
        method = config.method
        self.config, self.rm, self.info, self.method, self.tokenizer = config, rm, info, method, tokenizer
        self.steps, self.max_steps, holdout = config.budget(len(examples))
        self.warmup = max(1, self.steps // 10)
        self.lr = config.resolved_lr
        self.progress, self.eval_every, self.patience = progress, max(1, config.eval_every), config.patience
        train, held = split_examples(list(examples), holdout, config.seed)
        self.n_train, self.n_held = len(train), len(held)
        # demos+routing: every example trains and is scored after the task's demonstrations (but its
        # own), so the row learns what they leave out; the served prompt carries them all
        # (training rows see TRAIN_DEMONSTRATIONS of them, within TRAIN_DEMONSTRATION_TOKENS: a step's
        # tokens, and so its time, stay near a routing step's even for long examples; held-out rows
        # see all of them, as served, so the cross-validation scores what is served)
        self.demonstrations = list(demonstrations or [])
        self.rng = random.Random(config.seed)
        self.train = self._encode(tokenizer, train, config.max_length, TRAIN_DEMONSTRATIONS)
        self.held = self._encode(tokenizer, held, config.max_length)
        self.batch_size = max(1, min(config.resolved_batch_size, len(self.train)))
        self.step_tokens = config.resolved_step_tokens
        self.pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        self.order: list[int] = []
        gen = torch.Generator().manual_seed(config.seed)
        self.device = rm.layers[0].lora_A.device
        self.autocast = resolve_autocast(config.autocast, self.device)  # None = bf16 only where it is fast
        self._bf16_weights = FrozenBf16Weights(rm.model, self.autocast)  # no per-forward weight casts
        L, h, S = len(info.layer_names), info.spec.n_heads, info.spec.n_skills
        self.hyper = info.spec.routing == "hyper"
        # the top `trained_share` of the adapted linears train their routing; the ones below keep
        # the initial row (retrieved, or μ) and a backward pass stops at the first trained one
        self.frozen_layers = L - max(1, round(L * config.trained_share))

        self.row: torch.Tensor | None = None
        self.from_init_row = init_row is not None  # training starts from a given row (else μ's, or the skills')
        self.A: list[torch.Tensor] = []
        self.B: list[torch.Tensor] = []
        groups: list[dict[str, Any]] = []
        if init_row is not None and (method not in ("routing", "full") or tuple(init_row.shape) != (L, h, S)):
            raise ValueError(f"init_row must be a routing row {(L, h, S)} and the method routing or full")
        if method in ("routing", "full"):
            row = (torch.rand(L, h, S, generator=gen) * 2 - 1) * INIT + (1.0 / S if self.hyper else 0.0)
            if init_row is not None:  # e.g. a retrieved row (training.retrieve), plus the same small noise
                row = row - (1.0 / S if self.hyper else 0.0) + init_row.detach().float().cpu()
            self.row = row.to(self.device).requires_grad_(True)
            row_lr = self.lr if method == "routing" else FULL_ROW_LR
            groups.append({"params": [self.row], "lr": row_lr, "weight_decay": 0.0})
        if method == "mu":
            for A_t, B_t in layers_from_weights(info, skills, mu_weights(info)):
                self.A.append(A_t.float().to(self.device, copy=True).unsqueeze(0).requires_grad_(True))  # (1, d_in, r)
                self.B.append(B_t.float().to(self.device, copy=True).unsqueeze(0).requires_grad_(True))  # (1, r, d_out)
            groups.append({"params": self.A + self.B, "lr": self.lr, "weight_decay": 0.0})
        if method == "plain-lora":
            for A_t, B_t in layers_from_weights(info, skills, mu_weights(info)):  # only their shapes
                (d_in, r), d_out = A_t.shape, B_t.shape[1]
                A = (torch.rand(1, d_in, r, generator=gen) * 2 - 1) / math.sqrt(d_in)
                self.A.append(A.to(self.device).requires_grad_(True))
                self.B.append(torch.zeros(1, r, d_out, device=self.device).requires_grad_(True))
            groups.append({"params": self.A + self.B, "lr": self.lr, "weight_decay": 0.0})
        if method == "full":
            for name in info.layer_names:
                self.A.append(skills[f"{name}.A"].float().to(self.device, copy=True).requires_grad_(True))
                self.B.append(skills[f"{name}.B"].float().to(self.device, copy=True).requires_grad_(True))
            groups.append({"params": self.A + self.B, "lr": self.lr, "weight_decay": 0.0})
        self.params = sum(p.numel() for g in groups for p in g["params"]) - self.frozen_layers * h * S
        self.opt = torch.optim.AdamW(groups)
        for g in self.opt.param_groups:
            g["base_lr"] = g["lr"]

        self.step_count = 0
        self.evals = 0
        self.since_best = 0
        self.best_loss = float("inf")
        self.best_exact = -1.0
        self.select = config.select
        self.best: dict[str, torch.Tensor] | None = None
        self.best_step = 0
        self.initial_eval_loss: float | None = None
        self.last_loss = float("nan")
        self.last_eval_loss = float("nan")
        self.cancelled = False
        self.finished = False
        self.started = time.perf_counter()
        self._need_eval = True  # evaluate the initial point first (μ for routing/mu)
        # progress through the held-out set (one chunk a slice)
        self._eval_pos, self._eval_total, self._eval_exact = 0, 0.0, 0.0
        if (init_eval is not None and init_row is not None and held and tuple(held) == init_eval.held
                and (init_eval.exact is not None or self.select == "loss")):
            # the caller scored init_row on this very split: that evaluation is not run twice (the
            # row trains from init_row plus the INIT noise, a logit change the loss does not see)
            self._record_eval(init_eval.loss, init_eval.exact)
            self._need_eval = False

    def _encode(self, tokenizer: Any, examples: list[Example], max_length: int, sample: int = 0) -> list[Encoded]:
        """Encoded examples; after demonstrations but their own where the task has them: all the
        others (as served), or `sample` of them (drawn once per example, seeded) within
        TRAIN_DEMONSTRATION_TOKENS tokens (the first, if none fits)."""
        if not self.demonstrations:
            return encode_all(tokenizer, examples, max_length)
        room = max_length + len(tokenizer(demonstration_text(self.demonstrations)).input_ids)
        out = []
        for ex in examples:
            others = [d for d in self.demonstrations if d is not ex]
            if sample:
                if len(others) > sample:
                    others = [others[i] for i in sorted(self.rng.sample(range(len(others)), sample))]
                others = select_demonstrations(others, tokenizer, TRAIN_DEMONSTRATION_TOKENS) or others[:1]
            out.append(encode_example(tokenizer, ex, room, context_for(ex, others)))
        return out

    # -- the task's adapter as the RoutedModel reads it -----------------------------------------
    def _weights(self) -> torch.Tensor:
        assert self.row is not None
        return row_weights(self.row, "hyper" if self.hyper else "sigmoid", train=False)  # (L, h, S)

    def _set_plan(self, n_rows: int) -> None:
        if self.method == "routing":  # one task: its LoRA materialised (differentiably), shared by every row
            self.rm.set_materialized(self._weights(), rows=n_rows, frozen_layers=self.frozen_layers)
            return
        index = torch.zeros(n_rows, dtype=torch.long, device=self.device)
        if self.method in _SINGLE_LORA:
            self.rm.set_gathered(self.A, self.B, index)
            return
        w = self._weights()
        tables = [materialize_many(A, B, w[layer].unsqueeze(0)) for layer, (A, B) in enumerate(zip(self.A, self.B))]
        self.rm.set_gathered([a for a, _ in tables], [b for _, b in tables], index)

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """The stored form of the current parameters."""
        with torch.no_grad():
            if self.method == "routing":
                assert self.row is not None
                return {"logits": self.row.detach().to("cpu", copy=True)}
            out: dict[str, torch.Tensor] = {}
            pairs: list[tuple[torch.Tensor, ...]]  # (A_t, B_t) per layer
            if self.method in _SINGLE_LORA:
                pairs = [(A[0], B[0]) for A, B in zip(self.A, self.B)]
            else:
                w = self._weights()
                pairs = [tuple(t[0] for t in materialize_many(A, B, w[i].unsqueeze(0)))
                         for i, (A, B) in enumerate(zip(self.A, self.B))]
            for name, (A_t, B_t) in zip(self.info.layer_names, pairs):
                out[f"{name}.A"] = A_t.detach().to("cpu", copy=True)
                out[f"{name}.B"] = B_t.detach().to("cpu", copy=True)
            return out

    # -- stepping ------------------------------------------------------------------------------
    def _borrow(self) -> tuple[Any, list[bool]]:
        return self.rm.batch.plan, [p.requires_grad for p in self.rm.skill_parameters()]

    def _give_back(self, saved: tuple[Any, list[bool]]) -> None:
        plan, flags = saved
        for p, flag in zip(self.rm.skill_parameters(), flags):
            p.requires_grad_(flag)
        self.rm.batch.set(plan)

    def _ctx(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    def _train_step(self) -> None:
        if len(self.order) < self.batch_size:
            perm = list(range(len(self.train)))
            self.rng.shuffle(perm)
            self.order += perm
        take = within_tokens([len(self.train[i].input_ids) for i in self.order[: self.batch_size]], self.step_tokens)
        picked, self.order = self.order[:take], self.order[take:]
        batch = collate([self.train[i] for i in picked], self.pad)
        mult = min(1.0, (self.step_count + 1) / self.warmup)
        for g in self.opt.param_groups:
            g["lr"] = g["base_lr"] * mult
        with torch.inference_mode(False), torch.enable_grad():
            self._set_plan(batch.input_ids.shape[0])
            with self._ctx():
                loss = token_loss(target_logits(self.rm.model, batch))
            loss.backward()
            params = [p for g in self.opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.step_count += 1
        self.last_loss = float(loss.detach())

    @torch.no_grad()
    def _eval_slice(self) -> bool:
        """Evaluate the next EVAL_CHUNK held-out examples; True once the whole held-out set is
        done (then the result is recorded). One slice stays as short as one training step, so a
        server running this between decode steps keeps its background share even with hundreds
        of held-out examples."""
        if not self.held:  # nothing held out: the latest parameters are the best
            self.best, self.best_step = self._snapshot(), self.step_count
            return True
        chunk = self.held[self._eval_pos : self._eval_pos + EVAL_CHUNK]
        self._set_plan(len(chunk))
        with self._ctx():
            t = target_logits(self.rm.model, collate(chunk, self.pad))
            self._eval_total += float(per_example_loss(t).sum())
            self._eval_exact += float(per_example_exact(t).sum())
        self._eval_pos += len(chunk)
        if self._eval_pos < len(self.held):
            return False
        loss, exact = self._eval_total / len(self.held), self._eval_exact / len(self.held)
        self._eval_pos, self._eval_total, self._eval_exact = 0, 0.0, 0.0
        self._record_eval(loss, exact)
        return True

    def _improves(self, loss: float, exact: float | None) -> bool:
        if self.select == "exact" and exact is not None and exact != self.best_exact:
            return exact > self.best_exact
        return loss < self.best_loss

    def _record_eval(self, loss: float, exact: float | None) -> None:
        """One whole held-out evaluation (mean loss, exact match): the best-so-far tensors and early
        stopping, by `select` (exact: exact match first, the loss between equals)."""
        self.evals += 1
        self.last_eval_loss = loss
        if self.initial_eval_loss is None:
            self.initial_eval_loss = loss
        if self._improves(loss, exact):
            self.best_loss, self.best, self.best_step, self.since_best = loss, self._snapshot(), self.step_count, 0
            self.best_exact = -1.0 if exact is None else exact
        else:
            self.since_best += 1

    def step(self) -> bool:
        """One optimisation step, or one held-out evaluation every `eval_every` steps.
        Returns False once finished (steps done, early-stopped or cancelled)."""
        if self.finished:
            return False
        if self.cancelled:
            self.finished = True
            self._bf16_weights.release()
            return False
        saved = self._borrow()
        try:
            for p in self.rm.skill_parameters():
                p.requires_grad_(False)
            phase = "eval" if self._need_eval else "train"
            with self._bf16_weights.applied():
                if self._need_eval:
                    if not self._eval_slice():
                        return True  # more of the held-out set next slice
                    self._need_eval = False
                    if self.held and self.since_best >= self.patience:
                        self.finished = True
                    elif self.step_count >= self.steps:
                        if self.held and self.since_best == 0 and self.step_count < self.max_steps:
                            self.steps = min(self.max_steps, self.steps + self.eval_every)
                        else:
                            self.finished = True
                else:
                    self._train_step()
                    self._need_eval = self.step_count % self.eval_every == 0 or self.step_count >= self.steps
        finally:
            self._give_back(saved)
        if self.finished:
            self._bf16_weights.release()
        if self.progress is not None:
            self.progress({"step": self.step_count, "steps": self.steps, "phase": phase,
                           "loss": _finite(self.last_loss), "eval_loss": _finite(self.last_eval_loss),
                           "best_eval_loss": _finite(self.best_loss),
                           "elapsed": time.perf_counter() - self.started, "finished": self.finished})
        return not self.finished

    def cancel(self) -> None:
        """Stop at the next step(); result() then holds the best tensors seen so far (if any)."""
        self.cancelled = True

    @property
    def fraction(self) -> float:
        return 1.0 if self.finished else min(1.0, self.step_count / max(1, self.steps))

    def result(self) -> AdaptResult:
        if not self.finished:
            raise RuntimeError("adaptation is still running; step() until it returns False (or cancel())")
        tensors = self.best if self.best is not None else self._snapshot()
        exact = self.best_exact if self.held and self.best_exact >= 0 else None
        metrics = {
            "method": self.method, "steps_run": self.step_count, "steps": self.steps, "max_steps": self.max_steps,
            "best_step": self.best_step,
            "train_loss": _finite(self.last_loss), "eval_loss": _finite(self.best_loss) if self.held else None,
            "eval_exact": exact, "select": self.select,
            "initial_eval_loss": self.initial_eval_loss, "n_train": self.n_train, "n_held": self.n_held,
            "seconds": round(time.perf_counter() - self.started, 3), "cancelled": self.cancelled,
            "stored_params": sum(t.numel() for t in tensors.values()),
            **exact_estimate(exact, self.n_held),  # its n, an interval, a note below the floor
        }
        kind: Literal["routing", "lora"] = "routing" if self.method == "routing" else "lora"
        if self.demonstrations:
            metrics["demonstrations"] = len(self.demonstrations)
        return AdaptResult(kind, tensors, metrics, self.params, as_pairs(self.demonstrations))


def _finite(x: float) -> float | None:
    """JSON-safe metric: None until measured (NaN/inf never reach a job record)."""
    return x if math.isfinite(x) else None


def adapt(
    rm: RoutedModel,
    info: InventoryInfo,
    skills: dict[str, torch.Tensor],
    examples: list[Example],
    tokenizer: Any,
    config: AdaptConfig | None = None,
    *,
    progress: Callable[[dict], None] | None = None,
    init_row: torch.Tensor | None = None,
    init_eval: KnownEval | None = None,
    demonstrations: list[Example] | None = None,
) -> AdaptResult:
    """Run an Adaptation to the end and return its result."""
    job = Adaptation(rm, info, skills, examples, tokenizer, config, progress=progress, init_row=init_row,
                     init_eval=init_eval, demonstrations=demonstrations)
    while job.step():
        pass
    return job.result()
