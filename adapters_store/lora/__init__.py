"""The routed-LoRA math: pure functions over tensors (routing, combine, batched), the routed linear
and its injection into a backbone (layer, inject), per-request mixes, routing similarity, the
inventory's hyper-parameters (spec) and default targets per architecture (targets). PEFT's
tuners/poly and vLLM's lora/ are its models."""
