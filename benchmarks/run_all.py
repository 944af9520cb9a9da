"""Rerun every GPU benchmark in one call (within the device tool's 10-minute limit) and write the results files.

On the GPU machine, from the repository root, after building ffi/ (for example with CMake into /tmp/kd_build):

    KDTREE_JAX_FFI_DIR=/tmp/kd_build/ffi KDTREE_COMMIT=<hash> python3 benchmarks/run_all.py --out $OUT

Each benchmark runs in its own process with a time allowance (quick grids); a failing or slow one is reported and
the others still run. Each benchmark's tables land in --out/<benchmark>/, as in benchmarks/results/<benchmark>/; copy
them there (the run they replace into that folder's runs/, with a line in its manifest) and update
benchmarks/RESULTS.md. `--only name,...` runs a subset. The 2-GPU sharding benchmark is apart:
scripts/gpu_sharding.sh on the nvidia-h200-x2 kind.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (command arguments after the script, seconds allowed, extra environment). The embedded model is fp32 and
# narrow: its attention and experts run the pure-JAX path (the CUDA fast paths are for bf16 at K2 widths), the tree
# kernels run as custom calls. Each generate configuration costs ~20 s of compilation on the GPU machine, so the
# acceptance run uses 8 prompts (its batch-8 speed runs reuse those compilations) and budget 64 only.
TREE_OPS = {"KDTREE_FFI_OPS": "tree_build,tree_accept"}
BENCHMARKS = {
    "tree_build": (["tree_build.py", "--quick", "--out", "{out}/tree_build/tree_build.md"], 90, {}),
    "mla_verify": (["mla_verify.py", "--quick", "--budget", "60", "--out", "{out}/mla_verify"], 110, {}),
    "marlin_moe": (["marlin_moe.py", "--quick", "--budget", "60", "--out", "{out}/marlin_moe"], 120, {}),
    "acceptance": (["acceptance.py", "--kernels", "ffi", "--budgets", "64", "--speed-budgets", "64",
                    "--prompts", "8", "--out", "{out}/acceptance"], 170, TREE_OPS),
    "ddtree_e2e": (["ddtree_e2e.py", "--builtin", "--kernels", "ffi", "--budgets", "64", "--prompt-len", "128",
                    "--repeats", "10", "--out", "{out}/ddtree_e2e"], 100, TREE_OPS),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(BENCHMARKS))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    summary = []
    for name in names:
        cmd, allowed, extra = BENCHMARKS[name]
        cmd = [sys.executable, os.path.join(HERE, cmd[0])] + [c.format(out=args.out) for c in cmd[1:]]
        t0 = time.perf_counter()
        with open(os.path.join(args.out, f"{name}.log"), "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, **extra},
                                    timeout=allowed).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        summary.append(f"{name:12s} {str(rc):8s} {time.perf_counter() - t0:6.0f} s")
        print(summary[-1], flush=True)
    with open(os.path.join(args.out, "run_all.txt"), "w") as f:
        f.write("\n".join(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
