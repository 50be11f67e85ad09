"""What the start-up dtype probes read beside busy processes: the serving probe
(`server.engines.dtype.cpu_bf16_speedup`, bf16 from `BF16_PROBE_MIN`) and the training probe
(`training.precision.cpu_bf16_train_speedup`, bf16 autocast from 1.8x), each in a fresh process, as
a server would take them at start-up, with `--busy N` busy loops running (bench/contention.py's).

    .venv/bin/python -m bench.experiments.dtype_probe --busy 0 6 --processes 6
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.contention import ROOT, busy_processes

PROBE = ("import json; from server.engines.dtype import cpu_bf16_speedup; "
         "from training.precision import cpu_bf16_train_speedup; "
         "print(json.dumps({'serving': cpu_bf16_speedup(), 'training': cpu_bf16_train_speedup()}))")


def probe_once() -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 6], help="busy loops beside the probes")
    ap.add_argument("--processes", type=int, default=6, help="fresh processes a level")
    args = ap.parse_args()
    for n in args.busy:
        with busy_processes(n):
            reads = [probe_once() for _ in range(args.processes)]
        for name in ("serving", "training"):
            xs = ", ".join(f"{r[name]:.2f}" for r in reads)
            print(f"beside {n} busy: {name} probe {xs}", flush=True)


if __name__ == "__main__":
    main()
