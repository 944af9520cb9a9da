"""Operations in budget="auto"'s plan: `node_scores` + `BudgetPolicy.choose`, compiled on this machine's backend.

On the embedded model the plan's small kernels are what auto pays over a fixed budget (issue 19); this counts the
instructions of the optimized HLO's entry computation (each a kernel or a library call on a GPU), leaving out
parameters, tuples, bitcasts and constants, for a tree of N nodes, depth L, vocabulary V and tiers 16/32/64/128.

    python benchmarks/plan_ops.py                  # B = 1 and 10, N = 128, L = 16, V = 4096
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kdtree_jax import budget as bud  # noqa: E402
from kdtree_jax.budget_policy import node_scores  # noqa: E402

TIERS = (16, 32, 64, 128)
SKIP = ("parameter", "tuple", "get-tuple-element", "bitcast", "constant")


def entry_ops(fn, *args) -> list[str]:
    """The opcodes of the optimized entry computation of jit(fn)(*args), without SKIP."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    body = entry[:entry.index("\n}")].split("\n")[1:]
    ops = [m.group(1) for m in (re.search(r"= \S+ ([a-z\-]+)\(", line) for line in body) if m]
    return [op for op in ops if op not in SKIP]


def plan_args(b: int, n: int, l: int, v: int):
    cost = bud.CostModel.from_points(TIERS, b, [[(1.0, 1e-3), (b * (n + 1.0), 2e-3)]] * len(TIERS))
    return (bud.BudgetPolicy.choosing(cost), jnp.zeros((b, l, v)), jnp.zeros((b, n + 1), jnp.int32),
            jnp.zeros((b, n + 1), jnp.int32), jnp.zeros((b, n + 1, n + 1), bool), jnp.ones((b,), bool),
            jnp.zeros((b,), jnp.int32))


def plan(policy, logits, tokens, depths, visibility, live, context):
    return policy.choose(node_scores(logits, tokens, depths, visibility), visibility, live, context, 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,10", help="batch sizes (comma-separated)")
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args(argv)
    print(f"backend {jax.default_backend()}, N {args.nodes}, L {args.depth}, V {args.vocab}, tiers {TIERS}")
    for b in (int(x) for x in args.batch.split(",")):
        a = plan_args(b, args.nodes, args.depth, args.vocab)
        both, scores = entry_ops(plan, *a), entry_ops(node_scores, *a[1:5])
        print(f"B={b}: plan {len(both)} operations (node_scores alone {len(scores)}); "
              + ", ".join(f"{k} {both.count(k)}" for k in sorted(set(both))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
