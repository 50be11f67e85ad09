"""Multi-task pre-training of a skill inventory and the training tasks' routing rows.

One step (pseudo-code):

    rows      = sample (task, example) pairs                    # uniform | proportional | uncertainty
    w         = routing_table.weights(tasks, train=True)        # (L, N, h, S), Gumbel-sigmoid
    rm.set_weights(w)                                           # each row its own task's mix
    loss      = CE on target tokens                             # prompt masked out
    loss.backward(); clip; AdamW(routing lr 0.1 wd 0 | skills lr 1e-3 wd wd); lr warm-up/decay

Checkpoints publish the inventory and every task's routing row to the store (so a partially
trained store is usable) and write the full trainer state for --resume.

Under torchrun the step is data-parallel (training/distributed.py): every rank draws the same
global batch and its Gumbel noise, runs its slice of the rows, and the gradients are summed, so N
processes train what one does; rank 0 alone writes and shows progress.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from adapters_store.backbone.load import Backbone
from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.spec import InventorySpec
from adapters_store.lora.targets import default_targets
from adapters_store.store.directory import DirectoryStore
from training import checkpoint as ckpt
from training.batch_sampling import SAMPLINGS, draw_candidates, draw_rows, most_uncertain
from training.batching import DEFAULT_MAX_LENGTH, collate, encode_all
from training.data import Example
from training.distributed import (
    DistContext,
    all_gather_shards,
    all_reduce_sum,
    barrier,
    broadcast_from_main,
    check_batch,
    shard_bounds,
)
from training.loss import normalised_entropy, target_logits, token_loss
from training.precision import AUTOCAST_CHOICES, FrozenBf16Weights, resolve_autocast
from training.routing_table import METHODS, RoutingTable, method_shape
from training.step_attention import training_attention


@dataclass
class TrainConfig:
    method: str = "mhr"
    n_skills: int = 8
    n_heads: int = 8
    rank: int = 8
    targets: tuple[str, ...] = ()  # () = the backbone architecture's attention projections
    steps: int = 1000
    batch_size: int = 8
    lr_routing: float = 0.1
    lr_skills: float = 1e-3
    weight_decay: float = 0.01  # skills only; routing logits never decay
    warmup: float = 0.06  # fraction of steps
    grad_clip: float = 1.0
    temperature: float = 1.0
    gumbel: bool = True
    sampling: str = "uniform"
    uncertainty_pool: int = 1  # candidates per task for MT-Uncertainty sampling
    max_length: int = DEFAULT_MAX_LENGTH
    autocast: str = "auto"  # auto = bf16 only where the CPU has fast bf16 kernels
    seed: int = 0
    checkpoint_every: int = 0  # 0: only at the end
    save_dtype: str = "float32"
    suite: str = "procedural"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {'|'.join(METHODS)}, got {self.method!r}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {'|'.join(SAMPLINGS)}, got {self.sampling!r}")
        if self.autocast not in AUTOCAST_CHOICES:
            raise ValueError(f"autocast must be one of {'|'.join(AUTOCAST_CHOICES)}, got {self.autocast!r}")
        if self.save_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"save_dtype must be float32 or bfloat16, got {self.save_dtype!r}")
        for name in ("steps", "batch_size", "n_skills", "n_heads", "rank", "uncertainty_pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup is a fraction of steps in [0, 1), got {self.warmup}")

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["targets"] = list(self.targets)
        return data


def lr_multiplier(step: int, total: int, warmup: float) -> float:
    """Linear warm-up over warmup*total steps, then linear decay to 10% at the last step."""
    n_warm = max(1, round(warmup * total))
    if step < n_warm:
        return (step + 1) / n_warm
    frac = (step - n_warm) / max(1, total - n_warm)
    return 1.0 - 0.9 * min(1.0, frac)


def build_optimizer(table: RoutingTable, rm: RoutedModel, cfg: TrainConfig) -> torch.optim.AdamW:
    groups = [{"params": rm.skill_parameters(), "lr": cfg.lr_skills, "weight_decay": cfg.weight_decay,
               "name": "skills"}]
    if table.trainable:
        groups.append({"params": [table.logits], "lr": cfg.lr_routing, "weight_decay": 0.0, "name": "routing"})
    for g in groups:
        g["base_lr"] = g["lr"]
    return torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8)


class Trainer:
    """Owns the routed model, the routing table, the optimizer and the data of one run."""

    def __init__(self, cfg: TrainConfig, backbone: Backbone, tasks: dict[str, list[Example]],
                 store: DirectoryStore | None = None, dist: DistContext | None = None,
                 shard_backbone: bool = False) -> None:
        """dist: this process's rank (default: the only one). shard_backbone: FSDP over the frozen
        backbone (training/shard_backbone.py), for backbones one device cannot hold."""
        if not tasks:
            raise ValueError("no training tasks")
        if not cfg.targets:  # the architecture's default (adapters_store.lora.targets); ValueError if none known
            cfg = replace(cfg, targets=default_targets(backbone.model))
        self.cfg, self.backbone, self.store = cfg, backbone, store
        self.device = backbone.device
        self.dist = dist if dist is not None else DistContext(device=self.device)
        world = self.dist.world_size
        check_batch(cfg.batch_size, world)
        if cfg.sampling == "uncertainty" and (len(tasks) * cfg.uncertainty_pool < world
                                              or min(cfg.batch_size, len(tasks) * cfg.uncertainty_pool) % world):
            raise ValueError(f"uncertainty sampling over {world} ranks needs at least batch_size = "
                             f"{cfg.batch_size} candidates (tasks x uncertainty_pool) to split evenly")
        self.task_names = list(tasks)
        shape = method_shape(cfg.method, len(tasks), cfg.n_skills, cfg.n_heads)
        self.spec = InventorySpec(shape.n_skills, shape.n_heads, cfg.rank, cfg.targets, shape.routing)
        self.rm = RoutedModel(backbone.model, self.spec)
        self.rm.reset_skills(cfg.seed)
        self.rm.set_skills_trainable(True)
        self.table = RoutingTable(cfg.method, self.task_names, len(self.rm.layers), self.spec, seed=cfg.seed + 1)
        self.table.to(self.device)
        self.sharded = shard_backbone
        if shard_backbone:
            from training.shard_backbone import shard_frozen_backbone

            shard_frozen_backbone(backbone.model, self.rm.skill_parameters(), self.dist)
        self.opt = build_optimizer(self.table, self.rm, cfg)
        tok = backbone.tokenizer
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.data = [encode_all(tok, tasks[t], cfg.max_length) for t in self.task_names]
        self.sizes = [len(d) for d in self.data]
        self.rng = random.Random(cfg.seed)
        self.gumbel_gen = torch.Generator().manual_seed(cfg.seed + 2)
        self.bf16 = resolve_autocast(cfg.autocast, self.device.type)
        # bf16 copies of the frozen linears' weights instead of autocast's casts in every forward; not
        # of an FSDP-sharded backbone, whose weights are gathered per block
        self.bf16_weights = FrozenBf16Weights(backbone.model, self.bf16 and not shard_backbone)
        self.step = 0
        self.tokens = 0
        self.elapsed = 0.0
        self.last_loss = float("nan")

    # -- one step ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _step_context(self) -> Iterator[None]:
        with (self.bf16_weights.applied(), training_attention(self.backbone.model, self.device),
              torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)):
            yield

    def _rows(self) -> list[tuple[int, int]]:
        """The global batch's (task, example) rows: the same on every rank."""
        cfg, ctx = self.cfg, self.dist
        if cfg.sampling != "uncertainty":
            return draw_rows(self.sizes, cfg.batch_size, cfg.sampling, self.rng)
        cands = draw_candidates(self.sizes, cfg.uncertainty_pool, self.rng)
        lo, hi = shard_bounds(len(cands), ctx.rank, ctx.world_size)  # each rank scores its share
        batch = collate([self.data[t][i] for t, i in cands[lo:hi]], self.pad_id)
        idx = torch.tensor([t for t, _ in cands[lo:hi]], device=self.device)
        with torch.no_grad(), self._step_context():
            self.rm.set_weights(self.table.weights(idx, train=False))
            scores = normalised_entropy(target_logits(self.rm.model, batch, whole_model=self.sharded))
        scores = all_gather_shards(scores.float(), len(cands), ctx)
        return [cands[i] for i in most_uncertain(scores, cfg.batch_size)]

    def train_step(self) -> float:
        cfg, ctx = self.cfg, self.dist
        started = time.perf_counter()
        rows = self._rows()
        lo, hi = shard_bounds(len(rows), ctx.rank, ctx.world_size)
        batch = collate([self.data[t][i] for t, i in rows[lo:hi]], self.pad_id)
        idx = torch.tensor([t for t, _ in rows], device=self.device)
        mult = lr_multiplier(self.step, cfg.steps, cfg.warmup)
        for g in self.opt.param_groups:
            g["lr"] = g["base_lr"] * mult
        # the noise of every row of the global batch, so that a row's draw does not depend on the world size
        w = self.table.weights(idx, train=True, temperature=cfg.temperature, generator=self.gumbel_gen,
                               gumbel=cfg.gumbel)  # (L, N, h, S)
        self.rm.set_weights(w[:, lo:hi])
        with self._step_context():
            out = target_logits(self.rm.model, batch, whole_model=self.sharded)
            if ctx.active:  # this rank's part of the global batch's mean over its target tokens
                loss = F.cross_entropy(out.logits, out.targets, reduction="sum") / sum(
                    self.data[t][i].n_target for t, i in rows)
            else:
                loss = token_loss(out)
        loss.backward()
        params = [p for g in self.opt.param_groups for p in g["params"]]
        if ctx.active:
            for p in params:
                if p.grad is None:  # every rank joins the sum with the same layout
                    p.grad = torch.zeros_like(p)
            reported = loss.detach().float().reshape(1)
            all_reduce_sum([p.grad for p in params if p.grad is not None] + [reported], ctx)
            loss = reported[0]
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.rm.set_weights(None)
        self.step += 1
        self.tokens += sum(len(self.data[t][i].input_ids) for t, i in rows)  # the global batch's
        self.elapsed += time.perf_counter() - started
        self.last_loss = float(loss.detach())
        return self.last_loss

    # -- the loop ------------------------------------------------------------------------------
    def run(self, progress: bool = True) -> list[float]:
        from tqdm import tqdm

        cfg, main = self.cfg, self.dist.is_main
        losses: list[float] = []
        ema = None
        # one starting point for every rank, whatever each read (--resume / --init-from read the same files)
        broadcast_from_main([p for g in self.opt.param_groups for p in g["params"]], self.dist)
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not (progress and main), desc=f"train {cfg.method}",
                   dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 30.0)
        while self.step < cfg.steps:
            loss = self.train_step()
            losses.append(loss)
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{self.tokens / max(self.elapsed, 1e-9):.0f}",
                            refresh=False)
            if self.store is not None and main and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.checkpoint()
        bar.close()
        self.bf16_weights.release()
        if self.store is not None and main:
            self.checkpoint(final=True)
        barrier(self.dist)  # the store is complete when any rank returns
        return losses

    # -- persistence ---------------------------------------------------------------------------
    def publish(self, store: DirectoryStore, final: bool = False) -> None:
        """Inventory + every training task's routing row into the store."""
        dtype = torch.bfloat16 if (final and self.cfg.save_dtype == "bfloat16") else torch.float32
        bb = self.backbone
        store.save_inventory(
            self.spec, self.rm.names, self.rm.layer_dims(), {k: v.cpu() for k, v in self.rm.skill_tensors().items()},
            backbone_fingerprint=bb.fingerprint, backbone_name=bb.name, dtype=dtype,
            made_by={"method": self.cfg.method, "step": self.step, "config": self.cfg.to_json(),
                     "tasks": self.task_names, "final": final},
        )
        for i, task in enumerate(self.task_names):
            store.put_routing(
                task, self.table.logits[i].detach().cpu().clone(), method=self.cfg.method,
                source={"kind": "pretraining", "suite": self.cfg.suite, "examples": self.sizes[i],
                        "step": self.step},
            )

    def checkpoint(self, final: bool = False) -> None:
        assert self.store is not None
        self.publish(self.store, final=final)
        self.save_state(self.store.root)

    def save_state(self, root: Path) -> None:
        tensors = {f"skill.{k}": v for k, v in self.rm.skill_tensors().items()}
        tensors["routing.logits"] = self.table.logits.detach()
        opt_tensors, opt_meta = ckpt.optimizer_to_flat(self.opt)
        tensors.update(opt_tensors)
        tensors["rng.gumbel"] = self.gumbel_gen.get_state()
        tensors["rng.table"] = self.table.generator.get_state()
        meta = {"step": self.step, "tokens": self.tokens, "elapsed": self.elapsed, "last_loss": self.last_loss,
                "config": self.cfg.to_json(), "task_names": self.task_names, "optimizer": opt_meta,
                "python_rng": ckpt.python_rng_to_json(self.rng.getstate()),
                "backbone_fingerprint": self.backbone.fingerprint}
        ckpt.save_state(root, tensors, meta)

    def warm_start(self, source: DirectoryStore) -> list[str]:
        """Start from another store's trained inventory: its skills, and the routing row of every task
        both runs share. Tasks new to this run keep their fresh rows. Returns the tasks carried over.

        This is how an inventory grows to a wider suite without paying again for the steps it has
        already had; the optimizer's moments and the lr schedule start afresh (a new run). This run
        may also be larger than the source (more skills, more adapted linears): training/grow.py."""
        from training.grow import check_growable, grow_row, grow_skills

        info, skills = source.load_inventory(expected_fingerprint=self.backbone.fingerprint)
        src_names, names = tuple(info.layer_names), tuple(self.rm.names)
        same = info.spec == self.spec and src_names == names
        if not same:  # a larger shape grows from it (training/grow.py); anything else is refused
            try:
                check_growable(info.spec, src_names, self.spec, names)
            except ValueError as err:
                raise ValueError(f"--init-from: the inventory in {source.root} ({_shape(info.spec, src_names)}) "
                                 f"cannot start this run ({_shape(self.spec, names)}): {err}") from None
        self.rm.load_skills(grow_skills({k: v.float() for k, v in skills.items()}, self.rm.skill_tensors()))
        rows = source.routing_rows(limit=sys.maxsize)  # every ready row made for this inventory
        carried = [task for task in self.task_names if task in rows]
        with torch.no_grad():
            for task in carried:
                i = self.task_names.index(task)
                self.table.logits[i].copy_(grow_row(rows[task].float(), src_names, self.table.logits[i], names))
        # the inventory's lineage, in every store this run publishes (made_by.config.extra)
        self.cfg.extra["init_from"] = {
            "inventory_version": info.version, "steps": info.made_by.get("step"),
            "suite": info.made_by.get("config", {}).get("suite"), "tasks_carried": len(carried),
            **({} if same else {"grown_from": {"n_skills": info.spec.n_skills, "linears": len(src_names)}}),
        }
        return carried

    def load_state(self, root: Path) -> None:
        tensors, meta = ckpt.load_state(root)
        if meta["task_names"] != self.task_names:
            raise ValueError("the checkpoint was trained on other tasks; cannot resume")
        if meta["backbone_fingerprint"] != self.backbone.fingerprint:
            raise ValueError("the checkpoint was trained on another backbone; cannot resume")
        saved = {k: meta["config"][k] for k in ("method", "n_skills", "n_heads", "rank")}
        mine = {k: getattr(self.cfg, k) for k in saved}
        if saved != mine:
            raise ValueError(f"checkpoint config {saved} differs from this run's {mine}; cannot resume")
        self.rm.load_skills({k[len("skill."):]: v for k, v in tensors.items() if k.startswith("skill.")})
        with torch.no_grad():
            self.table.logits.copy_(tensors["routing.logits"])
        ckpt.optimizer_from_flat(self.opt, tensors, meta["optimizer"])
        self.gumbel_gen.set_state(tensors["rng.gumbel"])
        self.table.generator.set_state(tensors["rng.table"])
        self.rng.setstate(ckpt.python_rng_from_json(meta["python_rng"]))
        self.step, self.tokens, self.elapsed = int(meta["step"]), int(meta["tokens"]), float(meta["elapsed"])
        self.last_loss = float(meta["last_loss"])


def _shape(spec: InventorySpec, names: tuple[str, ...]) -> str:
    return f"S={spec.n_skills} h={spec.n_heads} r={spec.rank} {spec.routing} on {len(names)} linears"


#: Named suites: the procedural suite's 48 training tasks, on its open vocabulary of training words
#: or on the first suite's 24 words (kept to compare older inventories on the data they saw).
NAMED_SUITES = {"procedural": "train", "procedural24": "legacy"}


def suite_tasks(suite: str, examples_per_task: int, seed: int) -> dict[str, list[Example]]:
    """Training tasks: a named suite (NAMED_SUITES) or a JSONL file."""
    from training.data import group_by_task, load_jsonl
    from training.suite import build_suite, examples

    if suite == "bigbench":  # the BIG-bench suite's training tasks (scripts/bigbench_suite.py builds it)
        from training.bigbench import training_suite

        return training_suite(examples_per_task)
    if suite in NAMED_SUITES:
        return {t.name: examples(t, examples_per_task, seed=seed, split="train", vocab=NAMED_SUITES[suite])
                for t in build_suite(0).train_tasks}
    groups = group_by_task(load_jsonl(suite))
    return {t: exs[:examples_per_task] for t, exs in groups.items()}


def describe(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_json(), sort_keys=True)
