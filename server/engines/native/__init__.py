"""Iteration-level continuous batching over one routed-LoRA backbone, in its own thread."""
