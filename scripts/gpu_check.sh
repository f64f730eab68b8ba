#!/usr/bin/env bash
# The GPU check of the cross-scoring kernel (issue 13), in one call on a lent CUDA machine:
# tests/gpu, then bench/cross_scoring.py on every shape with SmolLM2 and the Qwen2.5-1.5B shape,
# in float32 and bfloat16, plus tiny-random with 64 distinct prompts (the launch-bound case).
# Prints one JSON object per benchmark (also written to $OUT/bench.jsonl when $OUT is set).
#
#   bash scripts/gpu_check.sh [SMOLLM2.gguf]
#
# Without a GGUF path, SmolLM2 runs as smollm2-135m-shape: its published configuration with
# random weights (the same speed; the GGUF is 98 MB, more than one call may carry). When the
# folder .whl/ holds wheels (transformers >= 5.24 and gguf, see docs/benchmarks.md), they are
# installed first with --no-deps into $SITE, since the machine reaches no registry.
set -u
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/collapse-monitor-site}
PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    pip install --quiet --no-deps --target "$SITE" .whl/*.whl && PYTHONPATH="$SITE:$PWD"
fi
export PYTHONPATH
PY=${PYTHON:-python}
OUT=${OUT:-}
SMOL=${1:-smollm2-135m-shape}

"$PY" -c 'import json, torch, transformers; print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.cuda.is_available(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}))'
timeout 300 "$PY" -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -n 15

bench() {
    local line
    line=$(timeout 240 "$PY" bench/cross_scoring.py --max-batch-tokens 262144 --naive-micro-batch 32 "$@" 2>&1 | tail -n 1)
    echo "$line"
    if [ -n "$OUT" ]; then echo "$line" >>"$OUT/bench.jsonl"; fi
}
bench --model tiny-random --shape first-turn --prompts 64
for model in "$SMOL" qwen2.5-1.5b-shape; do
    for dtype in float32 bfloat16; do
        for shape in first-turn multi-turn trajectory; do
            bench --model "$model" --shape "$shape" --dtype "$dtype"
        done
    done
done
