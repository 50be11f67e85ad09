"""What the one-adaptation benches share: their command line and the shipped inventory on the
default backbone, with one held-out task's 16 few-shot examples (the same for every run)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch

from adapters_store.backbone.load import load_backbone
from adapters_store.lora.inject import RoutedModel
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.records import InventoryInfo
from training.data import Example
from training.suite import build_suite, examples


@dataclass
class Setup:
    args: argparse.Namespace
    store: DirectoryStore
    rm: RoutedModel
    info: InventoryInfo
    skills: dict[str, torch.Tensor]  # float32, as Adaptation takes them
    tokenizer: Any
    task: str
    few: list[Example]


def parser(doc: str | None, rounds: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="a store with the shipped inventory")
    ap.add_argument("--task", type=int, default=0, help="index among the suite's held-out tasks")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def load(args: argparse.Namespace) -> Setup:
    torch.set_num_threads(args.threads)
    bb = load_backbone("default")
    store = DirectoryStore(args.store)
    info, skills = store.load_inventory(bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    rm.set_skills_trainable(False)
    task = build_suite(0).heldout_tasks[args.task]
    few = examples(task, 16, seed=1000, split="train")
    return Setup(args, store, rm, info, {k: v.float() for k, v in skills.items()}, bb.tokenizer, task.name, few)


def run_to_end(job: Any) -> float:
    """Step an Adaptation (or Retrieval) until it finishes; its wall seconds."""
    started = time.perf_counter()
    while job.step():
        pass
    return time.perf_counter() - started
