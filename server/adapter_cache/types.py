"""A task's adapter, materialised and ready for the batched forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Adapter:
    """layers[l] = (A_t (d_in, r), B_t (r, d_out)) on the model device in the model dtype.

    `weights` (L, h, S) are the routing mixing weights (kind "routing" only): with them the
    skill-space path can serve the task without the materialised tables.
    """

    task: str
    key: str  # versioned cache key: a new routing version is a new key
    kind: str  # "routing" | "lora"
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    weights: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        total = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.layers)
        if self.weights is not None:
            total += self.weights.numel() * self.weights.element_size()
        return total
