"""Iteration-level continuous batching over one routed-LoRA backbone, in its own thread.

    config.py   EngineConfig: the engine's budgets, its dtype and threads, in one value
    tuning.py   Tuning: the internal switches, carried whole to the model runner
    core/       the engine loop, the scheduler, KV slots, the flat step, the prefix cache,
                how a step runs on the CPUs
    model/      the model runners and what they run: attention, slot LoRA, static decode
    sample/     logits to tokens and text: sampling, processors, logprobs, grammar masks, rows
    kernels/    the C++ kernels and their loaders
"""
