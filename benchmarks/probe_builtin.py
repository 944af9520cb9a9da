"""Probe: the embedded model's ddtree generate on this machine with given kernels; times compile and run."""
import dataclasses, sys, time
import kdtree_jax as kj
ops = sys.argv[1]
m = kj.load("builtin")
cfg = dataclasses.replace(m.cfg, kernels="ffi" if ops else "xla", ffi_ops=tuple(ops.split(",")) if ops else m.cfg.ffi_ops)
prompts = [list(b"def fibonacci(n):\n"), list(b"import os\nimport sys\n\n")]
for method, budget in (("ar", 1), ("chain", 1), ("ddtree", 16), ("ddtree", 64)):
    for rep in range(2):
        t = time.perf_counter()
        out = kj.generate(m.params, cfg, prompts, max_new_tokens=32, method=method, drafter=m.drafter, budget=budget)
        print(f"{ops or 'xla'} {method} {budget} rep{rep}: {time.perf_counter() - t:.2f}s tau {out.stats['tau']:.2f} "
              f"{out.stats.get('tokens_per_s', 0):.0f} tok/s", flush=True)
    if method == "ar":
        ar = out.tokens
    else:
        print("  equal AR:", out.tokens == ar, flush=True)
