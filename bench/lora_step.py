"""What routed adapters add to one native-engine forward, by kind of step, interleaved in one process.

One Llama runner of the default backbone (serving dtype), a random inventory of the shipped
shape (S=8 skills, h=8 heads, rank 8, q/k/v/o), every slot holding a different routed task.
Times, per step kind, the forward with adapters off (every row base), with the decode rows' LoRA
in the native kernel, and as torch ops:

    decode   --rows rows, one token each, --context positions in the cache
    mixed    --rows - 1 decode rows and one prompt chunk of --chunk tokens (chunked prefill)
    prefill  one prompt chunk of --chunk tokens
    prompts  --rows prompts of --short tokens each (a step that admits many short prompts)

    .venv/bin/python -m bench.lora_step --threads 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
import torch

from adapters_store.backbone.load import load_backbone
from server.engines.dtype import serving_dtype
from server.engines.native.core.step import Item, StepBatch
from server.engines.native.model.llama import LlamaRunner
from server.engines.native.tuning import Tuning

TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--chunk", type=int, default=240)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = serving_dtype("cpu", args.dtype)
    bb = load_backbone("default")
    gen = torch.Generator().manual_seed(0)
    names, skills = [], []
    for i, layer in enumerate(bb.model.model.layers):
        for t in TARGETS:
            lin = layer.get_submodule(t)
            names.append(f"model.layers.{i}.{t}")
            skills.append((torch.randn(8, 8, lin.in_features // 8, 8, generator=gen) * 0.05,
                           torch.randn(8, 8, 8, lin.out_features // 8, generator=gen) * 0.05))
    runners = {mode: LlamaRunner(bb.model, dtype=dtype, slots=args.rows, adapted=names, rank=8, scale=1 / 8,
                                     skills=skills, tuning=Tuning(lora_kernel=mode)) for mode in ("on", "off")}
    for ex in runners.values():
        for slot in range(args.rows):
            ex.set_adapter(slot, None)
    prompts = [tuple(torch.randint(100, 20000, (args.context,), generator=gen).tolist()) for _ in range(args.rows)]
    chunk = tuple(torch.randint(100, 20000, (args.chunk,), generator=gen).tolist())
    steps = {
        "decode": StepBatch.build([Item(s, args.context, (42,)) for s in range(args.rows)]),
        "mixed": StepBatch.build([Item(s, args.context, (42,)) for s in range(args.rows - 1)]
                                 + [Item(args.rows - 1, 0, chunk)]),
        "prefill": StepBatch.build([Item(0, 0, chunk)]),
        "prompts": StepBatch.build([Item(s, 0, p[: args.short]) for s, p in enumerate(prompts)]),
    }
    for ex in runners.values():
        ex.forward(StepBatch.build([Item(s, 0, p) for s, p in enumerate(prompts)]))

    def routed(ex: LlamaRunner, on: bool) -> None:
        for slot in range(args.rows):
            if on:
                w = torch.softmax(torch.randn(len(names), 8, 8, generator=torch.Generator().manual_seed(slot)), -1)
                ex.lora.write_routing(slot, w)  # type: ignore[union-attr]
            else:
                ex.lora.clear(slot)  # type: ignore[union-attr]

    modes = {"adapters off": ("off", False), "LoRA, native kernel": ("on", True), "LoRA, torch ops": ("off", True)}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for label, (kernel, on) in modes.items():
            ex = runners[kernel]
            routed(ex, on)
            for kind, batch in steps.items():
                ex.forward(batch)
                t = time.perf_counter()
                for _ in range(args.steps):
                    ex.forward(batch)
                times.setdefault((label, kind), []).append((time.perf_counter() - t) / args.steps)
    print(f"{dtype}, {args.rows} rows, {args.context} positions, chunk {args.chunk}, {args.threads} threads, "
          f"medians of {args.repeats} x {args.steps} steps")
    for kind in steps:
        base = statistics.median(times[("adapters off", kind)])
        cells = []
        for label in modes:
            m = statistics.median(times[(label, kind)])
            cells.append(f"{label} {m * 1e3:7.2f} ms ({m / base:.3f})")
        print(f"  {kind:8s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
