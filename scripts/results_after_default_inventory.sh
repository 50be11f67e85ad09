#!/usr/bin/env bash
# The measurements of docs/RESULTS.md, on a trained default store (reduced protocol, see RESULTS.md).
#   usage: scripts/results_after_default_inventory.sh [STORE_DIR] [OUT_DIR]
set -euo pipefail
STORE="${1:-/tmp/default_store}"
OUT="${2:-/tmp/results}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE
RUN="nice -n 5 .venv/bin"
$RUN/polyserve routing-plot --store "$STORE" --out docs/routing.png
# few-shot on held-out tasks: zero-shot mu and MHR-z first (all tasks and seeds), then MHR-mu, then MHR full
for methods in mu0,routing mu full; do
  $RUN/python -m scripts.compare_methods --store "$STORE" --label mhr --tasks 4 --seeds 0,1,2 --k 16 \
    --n-test 16 --methods "$methods" --out "$OUT/compare.json"
  if [ "$methods" = "mu0,routing" ]; then
    # multitask accuracy of the pre-trained routing rows on the 48 training tasks (test split)
    $RUN/polyserve eval --store "$STORE" --n 16 --split test --threads 2 --json-out "$OUT/eval_train.json" > /dev/null
  fi
done
.venv/bin/python -m scripts.summarise_compare "$OUT/compare.json" > "$OUT/compare.md"
