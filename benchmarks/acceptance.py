"""Acceptance and speed of the embedded model on held-out standard-library files: ar vs chain vs ddtree.

For each method (chain; ddtree at each budget) on the same held-out prompts: tau (tokens committed per verify
step, bonus included), whether the tokens equal greedy AR's (they must: lossless), and wall-clock tokens/s of
ar, chain and ddtree at batch 1 and 8 (compile time excluded, reported apart). Writes a table (.md), the raw
numbers (.json) and a plot (.png) into --out.

    python benchmarks/acceptance.py            # on the GPU machine: results/acceptance/
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kdtree_jax as kj  # noqa: E402
from kdtree_jax.builtin import load_builtin  # noqa: E402
from kdtree_jax.train import corpus_split, load_tokens, windows  # noqa: E402


def commit() -> str:
    if os.environ.get("KDTREE_COMMIT"):
        return os.environ["KDTREE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(__file__)).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# e.g. KDTREE_FFI_OPS=tree_build,tree_accept: those custom calls, the rest in pure JAX (with --kernels ffi)
FFI_OPS = tuple(os.environ.get("KDTREE_FFI_OPS", ",".join(kj.config.DEFAULT_FFI_OPS)).split(","))


def run(model, prompts, method, budget, new_tokens, kernels):
    cfg = dataclasses.replace(model.cfg, kernels=kernels, ffi_ops=FFI_OPS)
    kw = dict(max_new_tokens=new_tokens, method=method, drafter=model.drafter, budget=budget)
    kj.generate(model.params, cfg, prompts, **kw)  # compile (cached) and warm up
    return kj.generate(model.params, cfg, prompts, **kw)


def divergence(model, prompts, ar_tokens, tokens) -> dict:
    """Where greedy speculative tokens differ from AR: for each differing row, the first differing position and
    the AR model's logit margin (top-1 minus top-2, teacher-forced on AR's own tokens) there. A tiny margin means
    a floating-point near-tie (verify and AR sum in different orders), not a logic error. One batched forward."""
    rows = [i for i, (a, b) in enumerate(zip(ar_tokens, tokens)) if a != b]
    if not rows:
        return dict(rows_differing=0, first_positions=[], ar_margins=[])
    firsts = [next((k for k in range(min(len(ar_tokens[i]), len(tokens[i]))) if ar_tokens[i][k] != tokens[i][k]),
                   min(len(ar_tokens[i]), len(tokens[i]))) for i in rows]
    seqs = [prompts[i] + ar_tokens[i] for i in rows]
    width = max(len(s) for s in seqs)
    batch = np.zeros((len(seqs), width), np.int32)  # right padding: causal, so earlier positions are unaffected
    for r, s in enumerate(seqs):
        batch[r, :len(s)] = s
    logits = np.asarray(kj.forward(model.params, model.cfg, batch))
    margins = []
    for r, (i, j) in enumerate(zip(rows, firsts)):
        top = np.sort(logits[r, len(prompts[i]) + j - 1])[-2:]
        margins.append(float(top[1] - top[0]))
    return dict(rows_differing=len(rows), first_positions=firsts, ar_margins=margins)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="embedded-model directory (default: the package's)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "acceptance"),
                    help="output directory (default: results/acceptance/)")
    ap.add_argument("--budgets", default="8,16,32,64,128,256,512")
    ap.add_argument("--speed-budgets", default="32,64,256")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kernels", default="xla", choices=("xla", "ffi"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model = load_builtin(args.model)
    _, held_files = corpus_split()
    held = load_tokens(held_files)
    rng = np.random.default_rng(0)
    prompts = windows(held, rng, args.prompts, args.prompt_len).tolist()
    device = str(jax.devices()[0].device_kind)
    print(f"device {device}, python {platform.python_version()}, {len(held_files)} held-out files, "
          f"{args.prompts} prompts of {args.prompt_len} bytes, {args.new_tokens} new tokens", flush=True)

    ar = run(model, prompts, "ar", 1, args.new_tokens, args.kernels)
    rows = []
    configs = [("chain", None)] + [("ddtree", int(b)) for b in args.budgets.split(",")]
    for method, budget in configs:
        out = run(model, prompts, method, budget or 1, args.new_tokens, args.kernels)
        rows.append(dict(method=method, budget=budget, tau=out.stats["tau"], steps=out.stats["steps"],
                         lossless=out.tokens == ar.tokens, histogram=out.stats["tau_histogram"],
                         divergence=divergence(model, prompts, ar.tokens, out.tokens)))
        print(f"tau  {method:6s} budget {str(budget):>4s}: tau {out.stats['tau']:.3f}  lossless "
              f"{rows[-1]['lossless']}  {rows[-1]['divergence']}", flush=True)

    speed = []
    for batch in (1, 8):
        ps = prompts[:batch]
        for method, budget in [("ar", None), ("chain", None)] + [("ddtree", int(b))
                                                                  for b in args.speed_budgets.split(",")]:
            out = run(model, ps, method, budget or 1, args.new_tokens, args.kernels)
            speed.append(dict(batch=batch, method=method, budget=budget, tokens_per_s=out.stats["tokens_per_s"],
                              wall_s=out.stats["wall_s"], tau=out.stats["tau"], steps=out.stats["steps"]))
            print(f"speed batch {batch} {method:6s} budget {str(budget):>4s}: {out.stats['tokens_per_s']:9.1f} tok/s "
                  f"tau {out.stats['tau']:.2f}", flush=True)
    for s in speed:
        base = next(x for x in speed if x["batch"] == s["batch"] and x["method"] == "ar")
        s["speedup_vs_ar"] = s["tokens_per_s"] / base["tokens_per_s"]

    meta = dict(date=datetime.date.today().isoformat(), device=device, commit=commit(),
                python=platform.python_version(), jax=jax.__version__, kernels=args.kernels, ffi_ops=FFI_OPS,
                prompts=args.prompts,
                prompt_len=args.prompt_len, new_tokens=args.new_tokens, heldout_files=len(held_files))
    with open(os.path.join(args.out, "acceptance.json"), "w") as f:
        json.dump(dict(meta=meta, tau=rows, speed=speed), f, indent=1)
    ops = f" ({', '.join(FFI_OPS)})" if args.kernels == "ffi" else ""
    lines = [f"# Acceptance and speed of the embedded model ({meta['date']}, {device}, commit {meta['commit']})", "",
             f"Held-out standard-library files of Python {meta['python']} ({len(held_files)} files), {args.prompts} "
             f"prompts of {args.prompt_len} bytes, {args.new_tokens} new tokens, greedy, jax {jax.__version__}, "
             f"kernels={args.kernels}{ops}. tau = tokens committed per verify step, bonus included.", "",
             "Rows differing from AR: how many of the prompts, and the largest AR logit margin (top-1 minus top-2) "
             "at a first difference: a near-zero margin is a floating-point near-tie between the verify and the "
             "AR computation, not a logic error.", "",
             "| method | budget | tau | verify steps | tokens equal AR | rows differing | max margin there |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['budget'] or '-'} | {r['tau']:.3f} | {r['steps']} | {r['lossless']} | "
              f"{r['divergence']['rows_differing']}/{args.prompts} | "
              f"{max(r['divergence']['ar_margins'], default=0.0):.2e} |" for r in rows]
    lines += ["", "| batch | method | budget | tokens/s | speedup vs ar | tau |", "|---|---|---|---|---|---|"]
    lines += [f"| {s['batch']} | {s['method']} | {s['budget'] or '-'} | {s['tokens_per_s']:.1f} | "
              f"{s['speedup_vs_ar']:.2f}x | {s['tau']:.2f} |" for s in speed]
    with open(os.path.join(args.out, "acceptance.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        tree = [r for r in rows if r["method"] == "ddtree"]
        chain = next(r for r in rows if r["method"] == "chain")
        ax[0].semilogx([r["budget"] for r in tree], [r["tau"] for r in tree], "o-", label="ddtree")
        ax[0].axhline(chain["tau"], color="gray", ls="--", label="chain (DFlash)")
        ax[0].set(xlabel="node budget", ylabel="tau (tokens per verify step)", title="Acceptance, held-out stdlib")
        ax[0].legend()
        for batch, color in ((1, "C0"), (8, "C1")):
            sel = [s for s in speed if s["batch"] == batch]
            ax[1].bar([f"{s['method']}{'' if s['budget'] is None else s['budget']}\nB={batch}" for s in sel],
                      [s["tokens_per_s"] for s in sel], color=color)
        ax[1].set(ylabel="tokens/s", title=f"Speed ({device})")
        ax[1].tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "acceptance.png"), dpi=120)
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
