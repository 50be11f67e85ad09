"""How many tokens a top-p nucleus holds on a backbone's own text: the backbone samples `--tokens`
tokens after each of a few prompts, and at every step the nucleus of its next-token distribution
(`sampling.apply_top_p` on `sampling.scale`'s logits, as a sampled row) is counted. Tells which
of top-p's candidate stages (`sampling.NUCLEUS_CANDIDATES`, then the full sort) real rows end in.

    .venv/bin/python -m bench.nucleus_sizes --settings 0.8:0.9 1.0:0.95 1.0:0.9
"""

from __future__ import annotations

import argparse
import statistics

import torch

from adapters_store.backbone.load import load_backbone
from server.engines.native.sample.sampling import NUCLEUS_CANDIDATES, apply_top_p, scale

PROMPTS = ("Write a short story about a dragon.", "What is the capital of France?", "List three uses of copper.",
           "Explain how a bicycle works.", "Translate 'good morning' into Spanish.",
           "Write a Python function that adds two numbers.")


def nucleus_sizes(model, tokenizer, temperature: float, top_p: float, tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    sizes = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            for _ in range(tokens):
                nucleus = apply_top_p(scale(model(ids).logits[0, -1].float(), temperature), top_p)
                sizes.append(int((~torch.isinf(nucleus)).sum()))
                ids = torch.cat([ids, torch.multinomial(torch.softmax(nucleus, -1), 1, generator=gen)[None]], dim=1)
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--settings", nargs="+", default=["0.8:0.9", "1.0:0.95"], help="temperature:top_p pairs")
    ap.add_argument("--tokens", type=int, default=48, help="sampled tokens after each prompt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    bb = load_backbone(args.backbone)
    model = bb.model.eval()
    for setting in args.settings:
        temperature, top_p = (float(v) for v in setting.split(":"))
        sizes = sorted(nucleus_sizes(model, bb.tokenizer, temperature, top_p, args.tokens, args.seed))
        n = len(sizes)
        stages = ", ".join(f"within {c}: {sum(s <= c for s in sizes) / n:.3f}" for c in NUCLEUS_CANDIDATES)
        print(f"T={temperature} top_p={top_p}: {n} steps, median {statistics.median(sizes)}, "
              f"p90 {sizes[int(0.9 * n)]}, p99 {sizes[int(0.99 * n)]}, max {sizes[-1]}; {stages}", flush=True)


if __name__ == "__main__":
    main()
