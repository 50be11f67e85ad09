"""How much of a decode step's linears is dequantising the GGUF blocks, and how much the rows' own
multiply-adds, on a CPU where the native engine serves float32 on the blocks (server/engines/native/
quant_linear.py). Every linear of the Llama runner (each layer's fused linears, then the LM head) is
called once a pass with random rows, one torch thread, as a one-thread decode step calls them; then the
same over the first layer alone, whose blocks stay in the CPU's caches between passes. A pass of one
row is mostly the dequantising (every panel, whatever the rows); each further row adds its
multiply-adds; if the first layer alone runs at the same weights a second as all of them, the
dequantising is bound by its instructions, not by reading memory. `--dtype bfloat16`: the same for
the kernel's bf16 build on an AVX512_BF16 CPU (quant_linear_bf16.py), and `--dense` times the runner's oneDNN
GEMMs of the same dtype instead (the weight kernel off), for the figure it replaces.

    .venv/bin/python -m bench.kernel_linears --rows 1 8 16 --passes 10 --repeats 3
    .venv/bin/python -m bench.kernel_linears --rows 1 8 16 --dtype bfloat16 [--dense]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
import torch

from server.engines.native.kernels.quant_linear import QuantLinear
from server.engines.native.model.llama import Linear
from server.engines.native.tuning import Tuning

NAMES = ("qkv", "o", "gate", "up", "gate_up", "down")
Linears = Sequence[QuantLinear | Linear]


def kernel_linears(runner: object, layers: int | None = None, kind: type = QuantLinear) -> list:
    """The runner's linears of `kind` (QuantLinear: those on the blocks; llama.Linear: the dense
    ones) in a step's order: each layer's fused linears, then the LM head (only when every layer is
    asked for). A runner whose linears do not read blocks has no QuantLinear."""
    every = runner.layers  # type: ignore[attr-defined]
    chosen = every if layers is None else every[:layers]
    found = [lin for layer in chosen for name in NAMES if isinstance(lin := getattr(layer, name, None), kind)]
    head = runner.lm_head  # type: ignore[attr-defined]
    if layers is None and isinstance(head, kind):
        found.append(head)
    return found


def pass_ms(linears: Linears, rows: int, passes: int, repeats: int, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> list[float]:
    """ms a pass (every linear called once on `rows` random rows in `dtype`), one timing per repeat
    of `passes` passes, after one pass to warm up."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, lin.in_features, generator=gen).to(dtype) for lin in linears]

    def one() -> None:
        for lin, x in zip(linears, xs, strict=True):
            lin(x)

    one()
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(passes):
            one()
        out.append((time.perf_counter() - started) / passes * 1e3)
    return out


def weights(linears: Linears) -> int:
    return sum(lin.in_features * lin.out_features for lin in linears)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--dense", action="store_true", help="the runner's dense GEMMs (weight kernel off) instead")
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or args.passes < 1 or args.repeats < 1:
        raise SystemExit("--rows, --passes and --repeats must be at least 1")

    from adapters_store.backbone.load import load_backbone
    from server.engines.native.model.model_runner import build_model_runner

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    bb = load_backbone(args.backbone, device="cpu", dtype="float32")
    runner = build_model_runner(bb.model, None, slots=2, dtype=dtype,
                                tuning=Tuning(native_executor="llama", weight_kernel="off" if args.dense else "on"))
    kind = Linear if args.dense else QuantLinear
    sets = {"every linear": kernel_linears(runner, kind=kind), "the first layer": kernel_linears(runner, 1, kind)}
    for what, linears in sets.items():
        for rows in args.rows:
            # the first layer's pass is a layer's share of the model's: as many more passes as layers
            passes = args.passes if what == "every linear" else args.passes * len(runner.layers)
            times = pass_ms(linears, rows, passes, args.repeats, dtype=dtype)
            ms = statistics.median(times)
            print(f"{what:15s} ({len(linears)} calls, {weights(linears) / 1e6:.1f} M weights)  rows {rows:3d}: "
                  f"{ms:7.2f} ms a pass  {weights(linears) / ms / 1e6:5.2f} G weights/s  "
                  f"({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
