"""Per-task routing logits of a multi-task training run, and the methods that shape them.

    logits: (n_tasks, L, h, S)     one routing row (L, h, S) per task
    weights(task_idx (N,)) -> (L, N, h, S), the per-row plan RoutedModel.set_weights reads

    method      h      S          row                         trained   weights
    poly        1      S          init U(-1e-3, 1e-3)          yes       Gumbel-sigmoid (train) / sigmoid (eval)
    mhr         h      S          init U(-1e-3, 1e-3)          yes       same
    shared      1      1          0                            no        1 (every task uses the one skill)
    private     1      n_tasks    +-FIXED on its own skill     no        one-hot on skill t
    random-mu   h      S          +-FIXED on a random half     no        1/(S/2) on the chosen half
    hyper       h      S          1/S + U(-1e-3, 1e-3)         yes       the raw embedding (no sigmoid, no
                                                                         normalisation; starts at μ)

Fixed rows are stored as logits +-FIXED so that the normalised sigmoid of the stored row is
(to float precision) exactly the fixed routing: every method stores and serves the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from adapters_store.lora.routing import eval_weights, train_weights
from adapters_store.lora.spec import InventorySpec

Method = Literal["poly", "mhr", "shared", "private", "random-mu", "hyper"]
METHODS: tuple[str, ...] = ("mhr", "poly", "shared", "private", "random-mu", "hyper")
FIXED = 30.0  # sigmoid(-30) = 9e-14: a fixed row's weights are exact to fp32
INIT = 1e-3


@dataclass(frozen=True)
class MethodShape:
    n_skills: int
    n_heads: int
    routing: Literal["sigmoid", "hyper"]
    trainable: bool


def method_shape(method: str, n_tasks: int, n_skills: int, n_heads: int) -> MethodShape:
    """Inventory shape that `method` imposes (e.g. Poly forces h = 1, private S = n_tasks)."""
    if method == "mhr":
        return MethodShape(n_skills, n_heads, "sigmoid", True)
    if method == "poly":
        return MethodShape(n_skills, 1, "sigmoid", True)
    if method == "shared":
        return MethodShape(1, 1, "sigmoid", False)
    if method == "private":
        return MethodShape(n_tasks, 1, "sigmoid", False)
    if method == "random-mu":
        if n_skills < 2:
            raise ValueError("random-mu needs at least 2 skills")
        return MethodShape(n_skills, n_heads, "sigmoid", False)
    if method == "hyper":
        return MethodShape(n_skills, n_heads, "hyper", True)
    raise ValueError(f"method must be one of {'|'.join(METHODS)}, got {method!r}")


def init_rows(method: str, n_tasks: int, L: int, h: int, S: int, generator: torch.Generator,
              first_task: int = 0) -> torch.Tensor:
    """Initial routing rows (n_tasks, L, h, S) for tasks first_task .. first_task + n_tasks - 1."""
    noise = (torch.rand(n_tasks, L, h, S, generator=generator) * 2 - 1) * INIT
    if method in ("poly", "mhr"):
        return noise
    if method == "hyper":
        return noise + 1.0 / S
    if method == "shared":
        return torch.zeros(n_tasks, L, h, S)
    if method == "private":
        rows = torch.full((n_tasks, L, h, S), -FIXED)
        for i in range(n_tasks):
            t = first_task + i
            if t >= S:
                raise ValueError(f"private routing has {S} skills, too few for task #{t}")
            rows[i, :, :, t] = FIXED
        return rows
    if method == "random-mu":
        keys = torch.rand(n_tasks, L, h, S, generator=generator)
        chosen = keys.argsort(dim=-1)[..., : S // 2]  # a random half of the skills per (task, layer, head)
        rows = torch.full((n_tasks, L, h, S), -FIXED)
        rows.scatter_(-1, chosen, FIXED)
        return rows
    raise ValueError(f"unknown method {method!r}")


class RoutingTable(nn.Module):
    """Routing rows of the training tasks; `add_task` appends without touching existing rows."""

    def __init__(self, method: str, task_names: list[str], L: int, spec: InventorySpec, seed: int = 0) -> None:
        super().__init__()
        # private may reserve spare skills for tasks added later (S >= n_tasks)
        n_for_shape = spec.n_skills if method == "private" and spec.n_skills >= len(task_names) else len(task_names)
        shape = method_shape(method, n_for_shape, spec.n_skills, spec.n_heads)
        if (shape.n_skills, shape.n_heads, shape.routing) != (spec.n_skills, spec.n_heads, spec.routing):
            raise ValueError(f"inventory {spec} does not fit method {method!r} ({shape})")
        self.method = method
        self.task_names = list(task_names)
        self.L, self.h, self.S = L, spec.n_heads, spec.n_skills
        self.trainable = shape.trainable
        self.routing = shape.routing
        self.generator = torch.Generator().manual_seed(seed)
        rows = init_rows(method, len(task_names), L, self.h, self.S, self.generator)
        self.logits = nn.Parameter(rows, requires_grad=self.trainable)  # (n_tasks, L, h, S)

    @property
    def n_tasks(self) -> int:
        return len(self.task_names)

    def index(self, task: str) -> int:
        return self.task_names.index(task)

    def add_task(self, name: str) -> int:
        """Append a fresh row for `name`; existing rows keep their exact values. Returns its index.

        (The Parameter object is replaced: rebuild optimizers that held the old one.)
        """
        if name in self.task_names:
            raise ValueError(f"task {name!r} already has a routing row")
        row = init_rows(self.method, 1, self.L, self.h, self.S, self.generator, first_task=self.n_tasks)
        with torch.no_grad():
            grown = torch.cat([self.logits.detach(), row.to(self.logits.dtype)], dim=0)
        self.logits = nn.Parameter(grown, requires_grad=self.trainable)
        self.task_names.append(name)
        return self.n_tasks - 1

    def weights(
        self,
        task_idx: torch.Tensor,
        train: bool = False,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        gumbel: bool = True,
    ) -> torch.Tensor:
        """task_idx: (N,) -> mixing weights (L, N, h, S) for RoutedModel.set_weights."""
        rows = self.logits.index_select(0, task_idx)  # (N, L, h, S)
        return row_weights(rows, self.routing, train=train and self.trainable, temperature=temperature,
                           generator=generator, gumbel=gumbel).transpose(0, 1)

    def row(self, task: str) -> torch.Tensor:
        """The stored form of one task's routing: (L, h, S) logits (or embedding for hyper)."""
        return self.logits[self.index(task)].detach().clone()


def row_weights(
    rows: torch.Tensor, routing: str, *, train: bool, temperature: float = 1.0,
    generator: torch.Generator | None = None, gumbel: bool = True,
) -> torch.Tensor:
    """Routing rows (..., h, S) -> weights (..., h, S). Pure.

    hyper: the row itself. sigmoid: Gumbel-sigmoid + normalisation when training with noise,
    normalised sigmoid otherwise.
    """
    if routing == "hyper":
        return rows
    if train and gumbel:
        return train_weights(rows, temperature, generator)
    return eval_weights(rows)
