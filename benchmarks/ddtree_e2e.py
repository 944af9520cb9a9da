"""Time per speculative step, split into its stages: drafter, tree build, verify, accept, compaction.

A model of K2 widths with few layers (default: hidden 7168, 64 heads, MLA 1536/512, 1 dense + 1 MoE layer of
E experts of width 2048 top-8, vocabulary 163,840; `--tiny` for a CPU smoke run), random weights, a random DFlash
drafter of the K2.5-DFlash shape (block 8). For ar, chain and ddtree at each budget and batch size: each stage
jitted alone and timed (median of repeats, inputs from a real step), the whole step jitted as in `generate`, and
tokens/s = tau / step time for a given tau. Writes a table (.md) and the raw numbers (.json) into --out.

    python benchmarks/ddtree_e2e.py --kernels ffi      # on the GPU machine: results/ddtree_e2e/
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kdtree_jax as kj  # noqa: E402
from kdtree_jax.ddtree import accept, verify  # noqa: E402
from kdtree_jax.decoding import Sampler, loop_step, start  # noqa: E402
from kdtree_jax.generate import make_method  # noqa: E402


def timeit(fn, *args, repeats: int = 20) -> float:
    """Median wall time (s) of fn(*args) after a warm-up, synchronizing on the result."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def k2_widths(layers: int, experts: int, kernels: str) -> kj.ModelConfig:
    return kj.configs.k2_6(num_hidden_layers=layers, n_routed_experts=experts, max_position_embeddings=8192,
                           kernels=kernels)


def tiny_widths(kernels: str) -> kj.ModelConfig:
    return kj.configs.tiny(kernels=kernels)


def bench(cfg, params, drafter, batch: int, prompt_len: int, method: str, budget: int, repeats: int) -> dict:
    """Each stage of one step of `method` (the public stages of kdtree_jax.ddtree) jitted and timed alone, on the
    inputs of a real step after a prefill of `prompt_len` tokens, then the whole loop step."""
    rng = np.random.default_rng(0)
    m = make_method(cfg, method, drafter, max(budget, 1))
    greedy, key = Sampler(), jax.random.key(0)
    n = max(m.extra_slots, 1)
    tokens = jnp.asarray(rng.integers(0, min(cfg.vocab_size, 50000), size=(batch, prompt_len)), jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    state = start(m, params, cfg, tokens, lengths, key, jnp.int32(-1), sampler=greedy, cache_len=prompt_len + n + 64,
                  max_new=64)
    out = {"batch": batch, "method": method, "budget": None if method != "ddtree" else budget, "nodes": n}
    f_step = jax.jit(lambda m, p, s: loop_step(m, p, cfg, s, greedy))
    if method == "ar":
        out["verify_s"] = out["step_s"] = timeit(f_step, m, params, state, repeats=repeats)
        return out
    f_draft = jax.jit(lambda m, p, s: m.propose(p, cfg, s, greedy))
    dlogits = f_draft(m, params, state)
    out["draft_s"] = timeit(f_draft, m, params, state, repeats=repeats)
    f_tree = jax.jit(lambda m, dl, bonus: m.build(cfg, dl, bonus))
    tree = f_tree(m, dlogits, state.last)
    out["tree_build_s"] = timeit(f_tree, m, dlogits, state.last, repeats=repeats)
    f_verify = jax.jit(lambda p, t, c: verify(p, cfg, t, c, key, greedy))
    target, res = f_verify(params, tree, state.cache)
    out["verify_s"] = timeit(f_verify, params, tree, state.cache, repeats=repeats)
    f_accept = jax.jit(lambda t, tt: accept(cfg, t, tt, min(n, m.tokens_per_step)))
    path = f_accept(tree, target)
    out["accept_s"] = timeit(f_accept, tree, target, repeats=repeats)
    f_keep = jax.jit(lambda m, r, d, starts, path: m.keep(cfg, r, d, starts, path))
    out["compaction_s"] = timeit(f_keep, m, res, state.draft, state.cache.lengths, path, repeats=repeats)
    out["step_s"] = timeit(f_step, m, params, state, repeats=repeats)
    out["overhead_share"] = (out["tree_build_s"] + out["accept_s"] + out["compaction_s"]) / out["step_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ddtree_e2e"),
                    help="output directory (default: results/ddtree_e2e/)")
    ap.add_argument("--kernels", default="xla", choices=("xla", "ffi"))
    ap.add_argument("--tiny", action="store_true", help="the tiny config (CPU smoke run)")
    ap.add_argument("--builtin", action="store_true", help="the embedded trained model and its drafter")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--budgets", default="16,64,256,512")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tau", type=float, default=4.4, help="ddtree's tau, to turn step times into tokens/s")
    ap.add_argument("--chain-tau", type=float, default=3.1, help="chain's tau, the same for chain")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.builtin:
        model = kj.load("builtin")
        cfg, params, drafter = dataclasses.replace(model.cfg, kernels=args.kernels), model.params, model.drafter
    else:
        cfg = tiny_widths(args.kernels) if args.tiny else k2_widths(args.layers, args.experts, args.kernels)
        params = kj.init_params(cfg, jax.random.key(0))
        drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=1 if args.tiny else 6, block_size=8,
                                  num_kv_heads=None if args.tiny else 8)
    ops = os.environ.get("KDTREE_FFI_OPS")  # e.g. "tree_build,tree_accept": the other ops in pure JAX
    if ops:
        cfg = dataclasses.replace(cfg, ffi_ops=tuple(ops.split(",")))
    device = str(jax.devices()[0].device_kind)
    meta = dict(date=datetime.date.today().isoformat(), device=device, commit=os.environ.get("KDTREE_COMMIT", "?"),
                jax=jax.__version__, kernels=args.kernels, ffi_ops=cfg.ffi_ops, cfg=dataclasses.asdict(cfg),
                drafter=str(drafter.cfg))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        configs = [("ar", 0), ("chain", 0)] + [("ddtree", int(b)) for b in args.budgets.split(",")]
        for method, budget in configs:
            r = bench(cfg, params, drafter, batch, args.prompt_len, method, budget, args.repeats)
            rows.append(r)
            print(json.dumps(r), flush=True)
            write(args, meta, rows, quiet=True)  # what is measured survives a time limit
    write(args, meta, rows)
    return 0


def write(args, meta: dict, rows: list[dict], quiet: bool = False) -> None:
    """The raw numbers (.json) and the table (.md) of the rows measured so far."""
    device = meta["device"]
    tag = f"{'builtin_' if args.builtin else 'tiny_' if args.tiny else ''}{args.kernels}"
    with open(os.path.join(args.out, f"ddtree_e2e_{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    name = ("the embedded model" if args.builtin else "tiny" if args.tiny
            else f"K2 widths, {args.layers} layers, {args.experts} experts")
    ms = lambda r, k: f"{1e3 * r[k]:.3f}" if k in r else "-"
    lines = [f"# DDTree step breakdown ({meta['date']}, {device}, commit {meta['commit']}, kernels={args.kernels})", "",
             f"Model: {name}; custom calls: {', '.join(meta['ffi_ops']) if args.kernels == 'ffi' else 'none'}; "
             f"prompt {args.prompt_len}; times in ms (median of {args.repeats}). Each stage is jitted and timed "
             "alone, so each carries one dispatch (~0.1 ms on a GPU) that the fused step does not: on a small model "
             "the stages sum to more than the step and the build+accept+compact share is an upper bound. "
             f"tokens/s = batch x tau / step with tau = {args.tau} for ddtree, {args.chain_tau} for chain, 1 for ar.",
             *([""] + [meta["note"]] if meta.get("note") else []), "",
             "| batch | method | nodes | drafter | tree build | verify | accept | compaction | step | "
             "build+accept+compact share | tokens/s at tau |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = {"ar": 1.0, "chain": args.chain_tau}.get(r["method"], args.tau)
        lines.append(f"| {r['batch']} | {r['method']}{'' if r['budget'] is None else r['budget']} | {r['nodes']} | "
                     f"{ms(r, 'draft_s')} | {ms(r, 'tree_build_s')} | {ms(r, 'verify_s')} | {ms(r, 'accept_s')} | "
                     f"{ms(r, 'compaction_s')} | {ms(r, 'step_s')} | "
                     f"{100 * r['overhead_share']:.1f}% |" if "overhead_share" in r else
                     f"| {r['batch']} | {r['method']} | {r['nodes']} | - | - | {ms(r, 'verify_s')} | - | - | "
                     f"{ms(r, 'step_s')} | - |")
        lines[-1] += f" {r['batch'] * t / r['step_s']:.0f} |"
    with open(os.path.join(args.out, f"ddtree_e2e_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
