#!/usr/bin/env bash
# Train the shipped default inventory (MHR, S=8, h=8, r=8, attention q/k/v/o) for the embedded
# SmolLM2-135M-Instruct backbone on CPU, then copy it into training/default_inventory/ (inventory +
# every training task's routing row). Five stages (docs/RESULTS.md, "The shipped inventory"); the
# first three on the first suite's 24 words (they made `fair500`), the others on the open vocabulary:
#   1. the procedural suite's 48 training tasks, 2,000 steps from scratch (~54 min on 2 idle cores);
#   2. the wide suite (the same 48 plus 160 more pairs and triples, the same 16 held-out tasks kept
#      out), 1,200 steps started from stage 1's skills and rows (--init-from; ~41 min);
#   3. a wider suite of 500 tasks (every pair and 381 triples that come no nearer to a held-out or a
#      far held-out task than stage 2's), 1,200 steps from stage 2 (~35 min);
#   4. the same 500 tasks with inputs of the open vocabulary's training words and made-up strings,
#      1,200 steps from stage 3 (~38 min on 2 idle cores; it made `open1200`);
#   5. the same again plus 1,500 training sentences for each of the 115 word-level tasks
#      (training.vocab.training_sentence), 1,500 steps from stage 4 with proportional sampling, so
#      that the word tasks also take sentences (~52 min on 2 idle cores; it made `sent1500`).
# It was trained with bf16 autocast on an AVX512_BF16 CPU; on an AVX2-only CPU bf16 is emulated
# (~20x slower): pass --autocast none after STORE_DIR there (later flags win).
#   usage: scripts/train_default_inventory.sh [STORE_DIR] [extra polyserve train flags]
#          (default /tmp/default_store; stages 1-4 go to STORE_DIR.stage1, .stage2, .stage3, .stage4)
set -euo pipefail
STORE="${1:-/tmp/default_store}"
cd "$(dirname "$0")/.."
COMMON=(--method mhr --skills 8 --heads 8 --rank 8 --batch-size 16 --lr-routing 0.1 --lr-skills 5e-3
        --weight-decay 0.01 --warmup 0.06 --temperature 1.0 --sampling uniform --examples-per-task 500 --seed 0
        --backbone default --autocast bf16 --save-dtype bfloat16 --checkpoint-every 200 --threads 2)
export OMP_WAIT_POLICY=PASSIVE
nice -n 5 .venv/bin/polyserve train --suite procedural24 --steps 2000 "${COMMON[@]}" --store "$STORE.stage1" "${@:2}"
.venv/bin/python -m scripts.wide_suite --pairs 100 --triples 92 --vocab legacy --out "$STORE.wide_suite.jsonl"
nice -n 5 .venv/bin/polyserve train --suite "$STORE.wide_suite.jsonl" --steps 1200 "${COMMON[@]}" \
  --init-from "$STORE.stage1" --store "$STORE.stage2" "${@:2}"
.venv/bin/python -m scripts.wide_suite --pairs 103 --triples 381 --vocab legacy --out "$STORE.wide500_suite.jsonl"
nice -n 5 .venv/bin/polyserve train --suite "$STORE.wide500_suite.jsonl" --steps 1200 "${COMMON[@]}" \
  --init-from "$STORE.stage2" --store "$STORE.stage3" "${@:2}"
.venv/bin/python -m scripts.wide_suite --pairs 103 --triples 381 --out "$STORE.open500_suite.jsonl"
nice -n 5 .venv/bin/polyserve train --suite "$STORE.open500_suite.jsonl" --steps 1200 "${COMMON[@]}" \
  --init-from "$STORE.stage3" --store "$STORE.stage4" "${@:2}"
.venv/bin/python -m scripts.wide_suite --pairs 103 --triples 381 --sentences 1500 --out "$STORE.sent500_suite.jsonl"
nice -n 5 .venv/bin/polyserve train --suite "$STORE.sent500_suite.jsonl" --steps 1500 "${COMMON[@]}" \
  --sampling proportional --examples-per-task 2000 --init-from "$STORE.stage4" --store "$STORE" "${@:2}"
.venv/bin/python -m training.shipped_inventory --from-store "$STORE"
