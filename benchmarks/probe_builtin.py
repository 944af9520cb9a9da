"""A quick look at generate on this machine: the embedded model, ar / chain / ddtree (budgets 16 and 64), two short
prompts, each call timed twice (the first includes compilation), tau, and whether the tokens equal greedy AR's.

    python benchmarks/probe_builtin.py                            # pure-JAX kernels
    python benchmarks/probe_builtin.py tree_build,tree_accept     # those custom calls, the rest in pure JAX
"""

from __future__ import annotations

import dataclasses
import sys
import time

import kdtree_jax as kj


def main(argv: list[str]) -> int:
    ops = argv[0] if argv else ""
    model = kj.load("builtin")
    cfg = model.cfg if not ops else dataclasses.replace(model.cfg, kernels="ffi", ffi_ops=tuple(ops.split(",")))
    prompts = [list(b"def fibonacci(n):\n"), list(b"import os\nimport sys\n\n")]
    ar = None
    for method, budget in (("ar", 1), ("chain", 1), ("ddtree", 16), ("ddtree", 64)):
        for rep in range(2):
            t = time.perf_counter()
            out = kj.generate(model.params, cfg, prompts, max_new_tokens=32, method=method, drafter=model.drafter,
                              budget=budget)
            print(f"{ops or 'xla'} {method} {budget} rep{rep}: {time.perf_counter() - t:.2f}s tau "
                  f"{out.stats['tau']:.2f} {out.stats['tokens_per_s']:.0f} tok/s", flush=True)
        if ar is None:
            ar = out.tokens
        else:
            print("  equal AR:", out.tokens == ar, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
