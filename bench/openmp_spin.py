"""libgomp's throttled spin: what a second thread's OpenMP pool costs every parallel op (server/infra/openmp.py).

Each setting runs in its own process (libgomp reads its environment once, at load):
  1. per-op time of a (8, 28, 576) float32 `mul` (above torch's parallel grain: one OpenMP region)
     on the main thread, alone;
  2. the same while another thread that has run one parallel op stays alive (its own pool: more
     pool threads than CPUs, libgomp throttles spinning);
  3. CPU seconds the process burns over 2 s of idling after each (a pool that never sleeps shows here).

    .venv/bin/python -m bench.openmp_spin [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "libgomp defaults": {},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "ACTIVE + GOMP_SPINCOUNT=300000 (polyserve)": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"},
}

CHILD = r"""
import json, threading, time, sys
import torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.randn(8, 28, 576)

def per_op(n=3000):
    for _ in range(300):
        x.mul(1.01)
    t = time.perf_counter()
    for _ in range(n):
        x.mul(1.01)
    return (time.perf_counter() - t) / n * 1e6

alone = per_op()
c0 = time.process_time()
time.sleep(2.0)
idle_alone = time.process_time() - c0
release = threading.Event()
def other():
    torch.randn(8, 28, 576).mul(2.0)
    release.wait()
th = threading.Thread(target=other)
th.start()
time.sleep(0.3)
second = per_op()
c0 = time.process_time()
time.sleep(2.0)
idle = time.process_time() - c0
release.set()
th.join()
print(json.dumps({"alone_us": alone, "second_pool_us": second, "idle_alone_s": idle_alone, "idle_cpu_s": idle}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    print("| setting | mul alone (us) | mul, second pool alive (us) | slowdown | idle CPU s / 2 s (one pool, two) |")
    print("|---|---:|---:|---:|---:|")
    for name, extra in SETTINGS.items():
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.threads)], env={**base, **extra},
                                 check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        alone = statistics.median(r["alone_us"] for r in runs)
        second = statistics.median(r["second_pool_us"] for r in runs)
        idle1 = statistics.median(r["idle_alone_s"] for r in runs)
        idle2 = statistics.median(r["idle_cpu_s"] for r in runs)
        print(f"| {name} | {alone:.1f} | {second:.1f} | {second / alone:.2f}x | {idle1:.2f}, {idle2:.2f} |")


if __name__ == "__main__":
    main()
