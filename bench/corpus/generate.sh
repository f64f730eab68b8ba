#!/usr/bin/env bash
# Regenerates bench/corpus/smollm2.json.gz: two 1-thread processes share each stage.
# Usage: nice -n 5 bench/corpus/generate.sh > /tmp/corpus.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=$PWD
gen() { "$PY" -m bench.corpus.generate "$@" 2> >(grep -v -i warn >&2); }
gen healthy --prompts 0:8 & a=$!
gen healthy --prompts 8:16 & b=$!
wait $a $b
gen templates
gen score --shard 0/2 & a=$!
gen score --shard 1/2 & b=$!
wait $a $b
gen merge
