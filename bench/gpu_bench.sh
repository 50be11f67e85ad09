#!/usr/bin/env bash
# serve_bench on a CUDA machine, bfloat16, one run: the native engine (a, b, d) and PEFT Poly +
# generate (c); where a CUDA vLLM environment exists (POLYSERVE_VLLM_PYTHON, with `pip install vllm`
# there: the `vllm` extra pulls the CPU wheel), also vLLM with the exported LoRAs (E), vLLM bare (F)
# and polyserve on its vLLM engine (G).
#
# The native engine replays CUDA graphs of its decode steps (server/engines/native/model/static_decode.py);
# `bench/gpu_bench.sh default --static-decode off` measures it without them, and
# `.venv/bin/python -m bench.profile_engine --device cuda --dtype bfloat16 --batch 64 --requests 128`
# prints a full decode step's time (and, with --static-decode off, its kernel launches).
# Run `python -m bench.gpu_check --device cuda --backbone B --tokens 300 --rounds 2` first: the
# graphs' answers against each request run alone. Where the backbone's weights cannot travel,
# bench/random_backbone.py makes a random model of its shape (BENCHMARKS.md, "The native engine on
# a GPU").
#
#   bench/gpu_bench.sh [BACKBONE] [more serve_bench arguments]
#   BACKBONE: default (the embedded SmolLM2-135M-Instruct) or a Hugging Face directory
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BACKBONE=${1:-default}
shift || true
VARIANTS=${VARIANTS:-abdc}
if [ -x "${POLYSERVE_VLLM_PYTHON:-.venv-vllm/bin/python}" ]; then VARIANTS=${VARIANTS}EFG; fi
exec "$PY" bench/serve_bench.py --device cuda --dtype bfloat16 --backbone "$BACKBONE" --tasks 48 --requests 256 \
    --batch 64 --out-min 4 --out-max 256 --out-dist loguniform --variants "$VARIANTS" "$@"
