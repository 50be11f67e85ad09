"""Time of one `polyserve train` step (forward, backward, optimizer) of the default backbone, per
variant of how it computes, side by side in one process on the same batches.

    flock -x /tmp/polyserve-cpu.lock .venv/bin/python -m bench.train_step --suite bigbench --skills 16
    flock -x /tmp/polyserve-cpu.lock .venv/bin/python -m bench.train_step --suite procedural --skills 8

Variants (`--variants`, comma-separated, any of):
    skill-space  the rows' LoRA through the skill-space GEMMs (batched.apply_skill_space), autocast
                 casting the frozen weights in every forward, SDPA attention: how a step ran before
    routed       batched.apply_routed: rows of more than one token materialise their LoRA
    copies       routed, with bf16 copies of the frozen weights (precision.FrozenBf16Weights)
    eager        copies, with eager attention in the step (training/step_attention.py): the trainer
One Trainer draws `--batches` batches once; every round times each variant on those same batches
(the optimizer keeps stepping: the cost of a step does not depend on the weights' values).
Reports each variant's median over rounds of the mean step time, and its ratio to the first.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import adapters_store.lora.layer as lora_layer
import training.trainer as trainer_module
from adapters_store.backbone.load import load_backbone
from adapters_store.lora.batched import apply_routed, apply_skill_space
from training.data import Example
from training.step_attention import training_attention
from training.trainer import TrainConfig, Trainer

VARIANTS = ("skill-space", "routed", "copies", "eager")


def suite_tasks(name: str, n_tasks: int) -> dict[str, list[Example]]:
    if name == "bigbench":
        from training.bigbench import training_suite

        tasks = training_suite(500)
    else:
        from training.suite import build_suite, examples

        tasks = {t.name: examples(t, 500, seed=0, split="train") for t in build_suite(0).train_tasks}
    return {t: tasks[t] for t in sorted(tasks)[:n_tasks]}


def configure(trainer: Trainer, variant: str) -> None:
    lora_layer.apply_routed = apply_skill_space if variant == "skill-space" else apply_routed  # type: ignore[attr-defined]
    trainer.bf16_weights.enabled = trainer.bf16 and variant in ("copies", "eager")
    trainer.bf16_weights.release()
    attention: Any = training_attention if variant == "eager" else lambda model, device: contextlib.nullcontext()
    trainer_module.training_attention = attention  # type: ignore[attr-defined]


def time_steps(trainer: Trainer, batches: list[list[tuple[int, int]]]) -> float:
    feed = iter(batches)
    draw: Callable[[], list[tuple[int, int]]] = lambda: next(feed)
    trainer._rows = draw  # type: ignore[method-assign]
    started = time.perf_counter()
    for _ in batches:
        trainer.train_step()
    return (time.perf_counter() - started) / len(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=["bigbench", "procedural"], default="bigbench")
    ap.add_argument("--tasks", type=int, default=200, help="the suite's first N tasks (by name)")
    ap.add_argument("--skills", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--autocast", default="bf16", choices=["bf16", "none"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    bb = load_backbone("default")
    attention = getattr(bb.model.config, "_attn_implementation", "?")  # outside the steps
    cfg = TrainConfig(method="mhr", n_skills=args.skills, n_heads=8, rank=8, batch_size=args.batch_size,
                      lr_skills=5e-3, autocast=args.autocast, steps=10_000, max_length=args.max_length)
    trainer = Trainer(cfg, bb, suite_tasks(args.suite, args.tasks))
    batches = [trainer._rows() for _ in range(args.batches)]
    tokens = [max(len(trainer.data[t][i].input_ids) for t, i in rows) for rows in batches]
    print(f"{args.suite}: {len(trainer.task_names)} tasks, S={args.skills}, batch {args.batch_size}, padded lengths "
          f"{tokens}, bf16 autocast {trainer.bf16}, attention {attention} outside the steps, "
          f"{args.threads} threads", flush=True)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for v in variants:  # warm each path once
        configure(trainer, v)
        time_steps(trainer, batches[:1])
    for r in range(args.rounds):
        for v in variants:
            configure(trainer, v)
            times[v].append(time_steps(trainer, batches))
        print(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f} s" for v in variants), flush=True)
    first = statistics.median(times[variants[0]])
    for v in variants:
        med = statistics.median(times[v])
        print(f"{v:12s} {med:6.2f} s a step  x{med / first:.2f}")


if __name__ == "__main__":
    main()
