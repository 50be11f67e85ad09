#!/usr/bin/env bash
# docs/RESULTS.md §8: all six pre-training methods at one equal, reduced budget on the default
# backbone, then the held-out few-shot comparison (Shared fine-tune, Poly-z, MHR-z, MHR-mu, MHR
# full, zero-shot mu) and the multitask accuracy of each method. Re-entrant: finished phases are
# skipped (a trained store is marked by OUT/METHOD.train.json, the trainer's last line).
#   usage: scripts/matched_budget.sh [OUT_DIR=/tmp/m300] [STEPS=300]
# Two lanes of one thread each keep the 2 cores busy (~2 h on this project's AVX2 CPU, fp32).
set -euo pipefail
OUT="${1:-/tmp/m300}"
STEPS="${2:-300}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE
BIN="nice -n 5 .venv/bin"

train() {  # METHOD [extra args]: the default inventory's recipe (RESULTS.md §1) at STEPS steps
  local m=$1; shift
  [ -s "$OUT/$m.train.json" ] && return 0
  $BIN/polyserve train --suite procedural --method "$m" "$@" --rank 8 --steps "$STEPS" --batch-size 16 \
    --lr-routing 0.1 --lr-skills 5e-3 --weight-decay 0.01 --warmup 0.06 --temperature 1.0 \
    --sampling uniform --examples-per-task 500 --seed 0 --backbone default --autocast none \
    --save-dtype bfloat16 --checkpoint-every 100 --threads 1 --store "$OUT/$m" > "$OUT/$m.log" 2>&1
  tail -n 1 "$OUT/$m.log" > "$OUT/$m.train.json"
}

compare() {  # LABEL METHODS: held-out tasks, reduced protocol of RESULTS.md §3
  $BIN/python -m scripts.compare_methods --store "$OUT/$1" --label "$1" --tasks 4 --seeds 0,1,2 --k 16 \
    --n-test 16 --methods "$2" --threads 1 --out "$OUT/compare_$1.json"
}

evaluate() {  # METHOD: multitask accuracy on the 48 training tasks, 16 test-split examples each
  [ -s "$OUT/eval_$1.json" ] && return 0
  $BIN/polyserve eval --store "$OUT/$1" --n 16 --split test --threads 1 --json-out "$OUT/eval_$1.json" > /dev/null
}

( train mhr --skills 8 --heads 8 && train shared && train random-mu --skills 8 --heads 8 ) &
( train poly --skills 8 --heads 1 && train private && train hyper --skills 8 --heads 8 ) &
wait
( compare mhr mu0,routing && compare shared mu && evaluate mhr && evaluate shared && evaluate random-mu ) &
( compare poly routing && evaluate poly && evaluate private && evaluate hyper && compare mhr mu,full ) &
wait
.venv/bin/python -m scripts.summarise_compare "$OUT"/compare_*.json > "$OUT/heldout.md"
.venv/bin/python -m scripts.summarise_multitask mhr="$OUT/eval_mhr.json" poly="$OUT/eval_poly.json" \
  shared="$OUT/eval_shared.json" private="$OUT/eval_private.json" random-mu="$OUT/eval_random-mu.json" \
  hyper="$OUT/eval_hyper.json" > "$OUT/multitask.md"
cat "$OUT/heldout.md" "$OUT/multitask.md"
