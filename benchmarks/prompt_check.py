"""Is a difference in the embedded model's acceptance between two machines the prompts or the machine?

The benchmark prompts (`kdtree-jax bench`, `benchmarks/auto_budget.py`) are windows of the held-out files of the
running Python's standard library, so two Python versions draw different text. This script decodes (ddtree,
budgets 16 and 64, greedy, 128 new tokens, batch 1) both this Python's prompts and prompts saved on another machine,
with the tree kernels as custom calls and in pure JAX, and prints tau and whether the tokens equal ar's:

    python benchmarks/prompt_check.py --save prompts.json        # on machine A: keep A's prompts
    python benchmarks/prompt_check.py --saved prompts.json       # on machine B (any backend): A's and B's prompts
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

import kdtree_jax as kj  # noqa: E402
from kdtree_jax.cli import _bench_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", help="write this Python's prompts here and stop")
    ap.add_argument("--saved", help="also decode the prompts saved by --save on another machine")
    args = ap.parse_args()
    model = kj.load("builtin")
    here = _bench_prompts(model.tokenizer, 1, 128, 0)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(dict(python=sys.version.split()[0], prompts=here), f)
        return
    sets = [(f"python {sys.version.split()[0]} (here)", here)]
    if args.saved:
        saved = json.load(open(args.saved))
        sets.append((f"python {saved['python']} (saved)", saved["prompts"]))
    print(f"backend {jax.default_backend()}; prompts equal: {len(sets) > 1 and sets[0][1] == sets[1][1]}")
    for name, prompts in sets:
        for ops in (("tree_build", "tree_accept"), ()):
            cfg = dataclasses.replace(model.cfg, kernels="ffi" if ops else "xla", ffi_ops=ops or model.cfg.ffi_ops)
            ar = kj.generate(model.params, cfg, prompts, max_new_tokens=128, method="ar").tokens
            for b in (16, 64):
                out = kj.generate(model.params, cfg, prompts, max_new_tokens=128, method="ddtree",
                                  drafter=model.drafter, budget=b)
                print(f"{name}, tree kernels {'custom calls' if ops else 'pure JAX'}, budget {b}: tau "
                      f"{out.stats['tau']:.2f}, {out.stats['steps']} steps, = ar {out.tokens == ar}", flush=True)


if __name__ == "__main__":
    main()
