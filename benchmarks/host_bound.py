"""Is the full-scale decoding step bound by the host? (issue 19's "GPU idle ~1/3 of every step").

The program one GPU of an ep=8 mesh runs for full K2.6 (61 layers, `full_scale.per_device_model`, random weights),
one prefilled state (C rows, context 4,096), the decoding loop of one method run `--steps` steps: the step time
(`budget.time_loop`, marginal: runs of 2k minus runs of k steps), and one profiled run: the GPU's busy time per
step (kernels and copies on its streams), its span, and the host events per step by name (XLA's thunks, kernel
launches, command buffers), so that a step whose GPU idles can be told apart: launched one kernel at a time by
the host (thousands of launch events per step) or replayed from CUDA graphs (command-buffer events).

Run once per XLA_FLAGS setting, one process each (the flags are read at start):

    python benchmarks/host_bound.py --out DIR --tag default
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/host_bound.py --out DIR --tag no_graphs
    python benchmarks/host_bound.py --small --out /tmp/x   # CPU smoke run (3 layers)

Writes DIR/host_bound_<tag>.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from auto_budget import _full_scale_model, _meta  # noqa: E402
from profile_tools import profile_calls, top_kernels  # noqa: E402

from kdtree_jax import budget as bud  # noqa: E402
from kdtree_jax.ddtree import speculative  # noqa: E402
from kdtree_jax.decoding import Sampler, advance  # noqa: E402
from kdtree_jax.sharding import trace_context  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "host_bound"),
                    help="directory for host_bound_<tag>.json (default: results/host_bound/)")
    ap.add_argument("--tag", default="default", help="names the run (e.g. the XLA_FLAGS setting)")
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"))
    ap.add_argument("--small", action="store_true", help="3 layers of tiny widths (CPU smoke run)")
    ap.add_argument("--budgets", default="16,128", help="fixed DDTree budgets to run (comma-separated)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="k of the marginal timing (runs of k and 2k steps)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.steps < 1 or args.repeats < 1 or args.concurrency < 1 or min(budgets) < 1:
        ap.error("--steps, --repeats, --concurrency and every budget must be >= 1")

    cfg, params, drafter = _full_scale_model(args.small)
    context = 256 if args.small else 4096
    out = dict(meta=dict(_meta(args), xla_flags=os.environ.get("XLA_FLAGS", ""), tag=args.tag),
               layers=cfg.num_hidden_layers, context=context, concurrency=args.concurrency, steps=args.steps, rows=[])
    widest = speculative(cfg, "ddtree", drafter, max(budgets))
    s0 = bud.prefilled(widest, params, cfg, args.concurrency, context,
                       **bud.calibration_geometry(cfg, widest, context, args.steps)[2])
    for b in budgets:
        m = speculative(cfg, "ddtree", drafter, b)
        t = time.perf_counter()
        sec = bud.time_loop(m, params, cfg, s0, args.steps, args.repeats, marginal=True)

        def call(_):
            with trace_context(params, cfg):
                return advance(m, params, cfg, jax.tree.map(jnp.copy, s0), jnp.int32(args.steps),
                               sampler=Sampler()).out

        prof = profile_calls(call, (None,), 2)
        k = args.steps
        host = sorted(((name, n / k, us / k) for name, (n, us) in prof["host"].items()), key=lambda r: -r[1])
        row = dict(budget=b, step_s=sec, wall_s=time.perf_counter() - t, busy_us=prof["busy_us"] / k,
                   span_us=prof["span_us"] / k, launches=sum(n for n, _ in prof["kernels"].values()) / k,
                   kernels=[(name, n / k, us / k) for name, n, us in top_kernels(prof, 25)], host=host[:40])
        out["rows"].append(row)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"host_bound_{args.tag}.json"), "w") as f:
            json.dump(out, f, indent=1)
        print(f"[{args.tag}] fixed {b}: {1e3 * sec:.2f} ms per step (marginal); GPU busy {row['busy_us'] / 1e3:.2f} ms, "
              f"span {row['span_us'] / 1e3:.2f} ms, {row['launches']:.0f} GPU events per step", flush=True)
        for name, n, us in host[:12]:
            print(f"    host {name[:70]:70s} {n:8.1f} per step {us:9.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
