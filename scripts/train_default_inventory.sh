#!/usr/bin/env bash
# Train the shipped default inventory (MHR, S=8, h=8, r=8, attention q/k/v/o) for the embedded
# SmolLM2-135M-Instruct backbone on the procedural suite, on CPU (~40-60 min on 2 idle cores), then
# copy it into training/default_inventory/ (inventory + the 48 training tasks' routing rows).
# It was trained with bf16 autocast on an AVX512_BF16 CPU; on an AVX2-only CPU bf16 is emulated
# (~20x slower): pass --autocast none after STORE_DIR there (later flags win).
#   usage: scripts/train_default_inventory.sh [STORE_DIR]   (default /tmp/default_store)
set -euo pipefail
STORE="${1:-/tmp/default_store}"
cd "$(dirname "$0")/.."
OMP_WAIT_POLICY=PASSIVE nice -n 5 .venv/bin/polyserve train --suite procedural --method mhr --skills 8 --heads 8 --rank 8 \
  --steps 2000 --batch-size 16 --lr-routing 0.1 --lr-skills 5e-3 --weight-decay 0.01 --warmup 0.06 \
  --temperature 1.0 --sampling uniform --examples-per-task 500 --seed 0 --backbone default \
  --autocast bf16 --save-dtype bfloat16 --checkpoint-every 200 --threads 2 --store "$STORE" "${@:2}"
.venv/bin/python -m training.default_inventory --from-store "$STORE"
