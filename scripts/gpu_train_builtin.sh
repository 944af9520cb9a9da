#!/usr/bin/env bash
# Train the embedded model on the GPU machine (one call): install over the image's jax, train, save to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"
pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
python3 -m kdtree_jax.train --out "$OUT" "$@"
