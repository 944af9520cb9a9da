#!/usr/bin/env bash
# Train the embedded model on the GPU machine (one call): install over the image's jax, train, save to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
# Pure Python: no build needed (the image's pip cannot import scikit-build-core as a build backend).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m kdtree_jax.train --out "$OUT" "$@"
