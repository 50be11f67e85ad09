"""Does a smaller weight format make the native engine's linears cheaper on this CPU? One linear of
each shape of the default backbone (q|k|v, gate|up, down, the LM head), at decode-sized row counts,
run as the engine runs it (float32, packed once for oneDNN), as torch's int4 weight-only GEMM
(`aten._weight_int4pack_mm_for_cpu`, 4-bit codes in groups of 32 with a scale and a zero each: the
shipped Q4_1 GGUF's block layout, which would keep the checkpoint's own weights at 1/7 of the bytes
read a step), and as the engine's weight kernel on the same blocks (server/engines/native/
quant_linear.py: Q4_1, and Q8_0 for the LM head as the GGUF stores it). Random weights; they take
turns; medians of `--repeats` timings. A repeated call finds its weight in the cache (all but the LM
head): in the model the float32 weights stream from memory, which these timings leave out.

    .venv/bin/python -m bench.weight_formats --rows 1 8 16 --threads 1
"""

from __future__ import annotations

import argparse

import torch

from adapters_store.backbone.gguf_blocks import dequantize, quantize
from bench.sampler_step import median_us
from server.engines.native.kernels.quant_linear import QuantLinear

# (in, out) of the default backbone's fused linears and LM head (SmolLM2-135M: d 576, MLP 1,536,
# 9 query and 3 key/value heads of 64, vocabulary 49,152)
SHAPES = {"q|k|v": (576, 960), "gate|up": (576, 3072), "down": (1536, 576), "lm head": (576, 49152)}
GROUP = 32


def int4_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes packed for torch's kernel, its scales and zeros, the weight they stand for in float32)."""
    blocks = torch.randn(n, k // GROUP, GROUP, generator=gen)
    low, high = blocks.min(-1).values, blocks.max(-1).values
    scale = (high - low) / 15
    codes = ((blocks - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    weight = (codes * scale[..., None] + low[..., None]).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(n, k), 1)
    # torch's kernel computes (code - 8) * scale + zero
    scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros, weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.threads} thread(s), ms a call (medians of {args.repeats} x {args.iters})")
    for name, (k, n) in SHAPES.items():
        packed, scales_and_zeros, weight = int4_weight(n, k, gen)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        blocks = quantize(weight, "Q8_0" if name == "lm head" else "Q4_1")
        kernel = QuantLinear(blocks, None, None, max_rows=1 << 30)
        kernel_weight = dequantize(blocks)
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)
            err = float((int4 - x @ weight.T).abs().max() / (x @ weight.T).abs().max())
            want = x.double() @ kernel_weight.double().T
            kernel_err = float((kernel(x).double() - want).abs().max() / want.abs().max())
            fp32_us, int4_us, kernel_us = median_us([
                lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),  # noqa: B023
                lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros),  # noqa: B023
                lambda: kernel(x),  # noqa: B023
            ], args.iters, args.repeats)
            fp32_ms, int4_ms, kernel_ms = fp32_us / 1e3, int4_us / 1e3, kernel_us / 1e3
            print(f"  {name:8s} {k:5d} x {n:6d}, {m:3d} rows: float32 packed {fp32_ms:8.3f}   int4 {int4_ms:9.3f}"
                  f" (x{int4_ms / fp32_ms:5.1f}, error {err:.1e})   weight kernel {kernel_ms:8.3f}"
                  f" (x{kernel_ms / fp32_ms:5.2f}, error {kernel_err:.1e})", flush=True)

if __name__ == "__main__":
    main()
