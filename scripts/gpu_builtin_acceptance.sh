#!/usr/bin/env bash
# One GPU call: distill the drafter against the shipped target, then measure acceptance and speed.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m kdtree_jax.train --out "$OUT" --resume-target kdtree_jax/builtin_model "$@" | grep -v "step .*[1-9]00 " 
python3 benchmarks/acceptance.py --model "$OUT" --out "$OUT"
