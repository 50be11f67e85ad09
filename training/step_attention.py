"""The backbone's attention inside a training step on CPU: eager, not SDPA.

A training step runs attention forward and backward. On CPU, SDPA picks its flash-attention
kernel, whose backward runs far below the GEMMs' speed; the eager attention (two batched GEMMs
and a softmax) runs its backward on the same GEMMs as the linears. Measured on a BIG-bench
training step of the default backbone, BENCHMARKS.md ("Other questions": training step) has the
figures and the command. The swap is of a transformers config field read in every forward, set and restored on
the calling thread around work that owns the model, as the serving engine's runner does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

TRAINING_ATTENTION = "eager"


@contextlib.contextmanager
def training_attention(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Inside the block the model's attention is eager when it runs on CPU (as it was elsewhere)."""
    config: Any = getattr(model, "config", None)
    if device.type != "cpu" or config is None or not hasattr(config, "_attn_implementation"):
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = TRAINING_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
