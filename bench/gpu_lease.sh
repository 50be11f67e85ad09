#!/usr/bin/env bash
# One lent GPU machine's whole check, in one call (a lease is minutes): the graphs' answers
# (gpu_check), the standard workload (gpu_bench.sh) and a decode step's profile (profile_engine),
# on a random model of the default backbone's shape. Logs go to $OUT (or /tmp/gpu-lease).
#
# Here, once per checkout (BENCHMARKS.md, "The native engine on a GPU", says why a random model):
#   printf '/.whl/\n/.gpu/\n' >> .git/info/exclude
#   .venv/bin/python -m bench.random_backbone default .gpu/smollm2 --shape-only
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       pydantic pydantic-core pydantic-settings annotated-types typing-inspection typing-extensions \
#       python-dotenv gguf redis fastapi starlette 'llguidance>=1.7.6,<1.10'
# There (the device tool's run, carry [".gpu", ".whl"]):
#   bench/gpu_lease.sh [VARIANTS] [more gpu_bench.sh arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
VARIANTS=${1:-abdc}
shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
BACKBONE=/tmp/smollm2-random
python3 -m bench.random_backbone .gpu/smollm2 "$BACKBONE" > "$OUT/setup.log" 2>&1 || { tail "$OUT/setup.log"; exit 1; }
echo "== gpu_check (float32, graphs vs dynamic vs solo)"
python3 -m bench.gpu_check --backbone "$BACKBONE" --device cuda --tokens 300 --rounds 2 > "$OUT/check.log" 2>&1
echo "gpu_check rc=$?"; grep -E "batched vs solo|graphs captured|Error|error" "$OUT/check.log" | tail -8
echo "== gpu_bench.sh VARIANTS=$VARIANTS $*"
PYTHON=python3 VARIANTS=$VARIANTS bench/gpu_bench.sh "$BACKBONE" "$@" > "$OUT/bench.log" 2>&1
echo "gpu_bench rc=$?"; grep -vE "it/s\]|^\s*$|Warning|warn" "$OUT/bench.log" | tail -30
echo "== profile_engine (decode step of 64 rows, graphs on)"
python3 -m bench.profile_engine --backbone "$BACKBONE" --device cuda --dtype bfloat16 --batch 64 --requests 128 \
    --op-steps 20 > "$OUT/profile.log" 2>&1
echo "profile_engine rc=$?"; grep -vE "it/s\]|Warning|warn" "$OUT/profile.log" | tail -25
