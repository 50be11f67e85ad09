"""A randomly initialised model of a backbone's exact shape, as a Hugging Face directory: the same
config, tokenizer and FLOPs per token, none of the weights. For timing on a machine the real
weights cannot travel to (a lent GPU machine takes only a small working tree, smaller than the
default backbone's GGUF): speed depends on shapes, not on values.

    python -m bench.random_backbone default OUT --shape-only   # config + tokenizer (a few MB)
    python -m bench.random_backbone OUT OUT2                   # OUT2 = OUT + seeded random weights
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

SHAPE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def copy_shape(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    copied = [name for name in SHAPE_FILES if (src / name).is_file()]
    if "config.json" not in copied:
        raise SystemExit(f"{src} has no config.json: not a Hugging Face model directory")
    for name in copied:
        shutil.copy2(src / name, out / name)


def write_random(src: Path, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    copy_shape(src, out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="'default' (the embedded backbone) or a Hugging Face directory")
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape-only", action="store_true", help="copy config and tokenizer, write no weights")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.source == "default":
        from adapters_store.backbone.load import hf_dir

        src = hf_dir("default")
    else:
        src = Path(args.source)
    if args.shape_only:
        copy_shape(src, args.out)
    else:
        write_random(src, args.out, args.seed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
