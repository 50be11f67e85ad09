"""Backbone load time in a fresh process, from the dequantised safetensors cache under
POLYSERVE_HOME (the first load ever dequantises the GGUF and is not measured here).

    .venv/bin/python -m bench.startup --repeats 5

Prints each load's seconds and the median. Timings live here, not in tests: a shared CI CPU
makes any fixed bound either flaky or meaningless.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CODE = "from adapters_store.backbone.load import load_backbone; print(load_backbone({name!r}).load_seconds)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", default="default")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    subprocess.run([sys.executable, "-c", CODE.format(name=args.backbone)], check=True, capture_output=True)  # warm
    seconds = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", CODE.format(name=args.backbone)],
                             check=True, capture_output=True, text=True).stdout.split()
        seconds.append(float(out[-1]))
        print(f"load: {seconds[-1]:.2f} s")
    print(f"median of {len(seconds)}: {statistics.median(seconds):.2f} s")


if __name__ == "__main__":
    main()
