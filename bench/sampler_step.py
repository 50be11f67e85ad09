"""Time of the native engine's sampler alone (sampling.sample_tokens on random (N, V) logits), per
variant, side by side in one process; optionally against an older tree's sampler.

    flock -x /tmp/polyserve-cpu.lock .venv/bin/python -m bench.sampler_step --vocab 49152 --rows 1 16 32

    # before/after: the sampler of another commit, loaded from an exported tree
    git archive REV | tar -x -C /tmp/base
    flock -x /tmp/polyserve-cpu.lock .venv/bin/python -m bench.sampler_step --baseline /tmp/base

A baseline tree whose sampler has `sample_tokens(logits, rows)` is timed for every variant, on the
same rows; one exposing only `choose_tokens(logits, greedy, temperature, top_k, top_p, generators)`
(the sampler before n/logprobs/penalties) for the greedy and sampled variants.
Reports the median of `--repeats` timings of `--iters` calls each, in microseconds per call (the
current and the baseline sampler take turns, so both see the same machine load).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from server.engines.native.sample.processors import RowProcessors
from server.engines.native.sample.sampling import RowSampler, sample_tokens
from server.engines.request import SamplingParams


def median_us(fns: list[Callable[[], object]], iters: int, repeats: int) -> list[float]:
    """Median microseconds per call of each fn; the fns take turns, so they share conditions."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            started = time.perf_counter()
            for _ in range(iters):
                fn()
            ts.append((time.perf_counter() - started) / iters)
    return [statistics.median(ts) * 1e6 for ts in times]


def load_baseline(root: str):
    path = Path(root) / "server" / "engines" / "native" / "sampling.py"
    spec = importlib.util.spec_from_file_location("baseline_sampling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def variants(n: int, vocab: int) -> dict[str, Callable[[], list[RowSampler]]]:
    def gen():
        return torch.Generator().manual_seed(0)

    penalties = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    procs = RowProcessors.build(penalties, [t % vocab for t in range(0, 400, 7)], vocab)  # a 58-token prompt
    assert procs is not None
    for t in range(0, 300, 3):  # 100 generated tokens
        procs.observe(t % vocab)
    return {
        "greedy": lambda: [RowSampler() for _ in range(n)],
        "sampled T.8 p.9": lambda: [RowSampler(0.8, 0, 0.9, gen()) for _ in range(n)],
        "sampled T.8": lambda: [RowSampler(0.8, 0, 1.0, gen()) for _ in range(n)],
        "greedy+penalties": lambda: [RowSampler(processors=procs) for _ in range(n)],
        "greedy+logprobs5": lambda: [RowSampler(logprobs=5) for _ in range(n)],
    }


def line_for(logits: torch.Tensor, name: str, rows: list[RowSampler], old, iters: int, repeats: int) -> str:
    n, vocab = logits.shape
    fns: list[Callable[[], object]] = [lambda: sample_tokens(logits, rows)]
    if old is not None and hasattr(old, "sample_tokens"):
        fns.append(lambda: old.sample_tokens(logits, rows))
    elif old is not None and name in ("greedy", "sampled T.8 p.9", "sampled T.8"):
        greedy = name == "greedy"
        temp, top_p = (0.0, 1.0) if greedy else (0.8, 0.9 if "p.9" in name else 1.0)
        gens = [None if greedy else torch.Generator().manual_seed(0) for _ in range(n)]
        fns.append(lambda: old.choose_tokens(logits, [greedy] * n, [temp] * n, [0] * n, [top_p] * n, gens))
    times = median_us(fns, iters, repeats)
    line = f"V={vocab:6d} rows={n:3d} {name:18s} {times[0]:10.1f} us"
    if len(times) == 2:
        line += f"   baseline {times[1]:10.1f} us   now/baseline x{times[0] / times[1]:.3f}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[259, 49152])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline", default=None, help="an exported older tree whose sampler to time too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old = load_baseline(args.baseline) if args.baseline else None
    for vocab in args.vocab:
        for n in args.rows:
            logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1)) * 3
            for name, make in variants(n, vocab).items():
                print(line_for(logits, name, make(), old, args.iters, args.repeats), flush=True)


if __name__ == "__main__":
    main()
