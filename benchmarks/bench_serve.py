"""Serving throughput and latency of the embedded model by concurrency: for each method, a local `kdtree-jax serve`
(the same engine and app, on 127.0.0.1) measured by `kdtree-jax bench-serve`'s client; the runs side by side in
results/bench_serve/<name>.{json,md,png}, stamped with the date, the device and the commit. Each engine compiles its
prefills for the benchmark's prompt lengths before it serves (`Engine(warmup=...)`), so that no timed request waits
for one.

    JAX_PLATFORMS=cpu python benchmarks/bench_serve.py --name bench_serve_cpu
    python3 benchmarks/bench_serve.py --methods ar,ddtree --budget 16,auto --name bench_serve_auto   # auto as well
    python3 benchmarks/bench_serve.py --name bench_serve_h200 --ffi-ops tree_build,tree_accept   # scripts/gpu_serve.sh
"""

import argparse
import dataclasses
import json
import os

import kdtree_jax as kj
from kdtree_jax import cli
from kdtree_jax.serving import bench_serve
from kdtree_jax.budget_policy import check_tiers
from kdtree_jax.serving.engine import Engine
from kdtree_jax.serving.serve import BackgroundServer, create_app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ar,ddtree", help="comma-separated, from ar, chain, ddtree (default: both)")
    ap.add_argument("--budget", default="16",
                    help="ddtree node budgets, comma-separated, 'auto' among them for budget='auto' (one run each; "
                         "default: 16)")
    ap.add_argument("--max-budget", type=int, default=64, help="budget auto: the largest tree (default: 64)")
    ap.add_argument("--cost-model", default=None, metavar="PATH",
                    help="budget auto: a saved cost model for --max-batch rows (default: the one kept for this setup, "
                         "else measured when the engine starts)")
    ap.add_argument("--tiers", default=None, metavar="SIZES", type=cli._tiers,
                    help="budget auto: the tree sizes compiled, comma-separated, 0 allowed (autoregressive steps where "
                         "no tree pays; default: the engine's)")
    ap.add_argument("--max-batch", type=int, default=10, help="server slots (default: 10)")
    ap.add_argument("--chunk-steps", type=int, default=4, help="decoding steps per compiled call (default: 4)")
    ap.add_argument("--max-context", type=int, default=512, help="cache slots per request (default: 512)")
    ap.add_argument("--concurrency", default="1,2,4,8,10", help="comma-separated (default: 1,2,4,8,10)")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client per level (default: 2)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: 64)")
    ap.add_argument("--prompt-chars", type=int, default=200,
                    help="characters per prompt (default: 200: byte prompts of at most 256 tokens)")
    ap.add_argument("--ffi-ops", default="", metavar="OPS",
                    help="custom calls to use, comma-separated, e.g. tree_build,tree_accept (default: none, pure JAX)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_serve"),
                    help="output directory (default: benchmarks/results/bench_serve/)")
    ap.add_argument("--name", default="bench_serve", help="output file name without extension")
    ap.add_argument("--base", default=None, metavar="JSON",
                    help="an earlier run's .json (another commit, run just before on the same machine): the report "
                         "adds each level's aggregate tok/s and TTFT p50 against it")
    args = ap.parse_args()
    base_runs = None
    if args.base is not None:  # read before any engine runs, so that a wrong path fails at once
        with open(args.base) as f:
            base_runs = json.load(f)
    budgets = [b.strip() if b.strip() == "auto" else int(b) for b in args.budget.split(",")]
    tiers = args.tiers
    if tiers is not None:  # checked before any engine runs, not when the auto one starts
        if "auto" not in budgets:
            ap.error("--tiers: for budget auto only (add auto to --budget)")
        try:
            tiers = check_tiers(tiers, args.max_budget)
        except ValueError as e:
            ap.error(f"--tiers: {e}")

    model = kj.load("builtin")
    cfg = model.cfg
    if args.ffi_ops:
        cfg = dataclasses.replace(cfg, kernels="ffi", ffi_ops=tuple(o.strip() for o in args.ffi_ops.split(",")))
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = bench_serve.heldout_prompts(max(levels) * args.rounds, args.prompt_chars, 0)  # those `run` sends
    warmup = tuple(sorted({len(model.tokenizer.encode(p)) for p in prompts}))
    methods = [m.strip() for m in args.methods.split(",")]
    jobs = [(m, b) for m in methods for b in (budgets if m == "ddtree" else [None])]
    runs, loads = [], []
    title = "kdtree-jax serve, embedded model: throughput and time to first token by concurrency"

    def note(loads: list[str]) -> str:
        return (f"Each decoding step computes all {args.max_batch} slots, free ones included (fixed shapes). Where "
                "the step is compute-bound (a CPU) a low concurrency pays for the empty slots and speculation pays "
                "for every tree node; on a GPU, where a step of a small batch is bound by reading the weights, both "
                f"cost little. Kernels: {'custom calls ' + args.ffi_ops + ', the rest' if args.ffi_ops else 'all'} "
                f"in pure JAX. Other jobs may share the machine: 1-minute load average {', '.join(loads)} (on "
                f"{os.cpu_count()} cores).")

    for method, budget in jobs:
        name = f"{method} {budget}" if method == "ddtree" else method
        print(f"## {name}", flush=True)
        loads.append(f"{os.getloadavg()[0]:.1f} before {name}")
        with Engine(model.params, cfg, method=method, drafter=model.drafter, budget=64 if budget is None else budget,
                    max_budget=args.max_budget, cost_model=args.cost_model, tiers=tiers, max_batch=args.max_batch,
                    max_context=args.max_context, chunk_steps=args.chunk_steps, eos_id=model.tokenizer.eos_id,
                    warmup=warmup) as engine:
            server = BackgroundServer(create_app(engine, model.tokenizer, "builtin"))
            try:
                runs.append(bench_serve.run(server.url, levels, rounds=args.rounds, max_tokens=args.max_tokens,
                                            prompt_chars=args.prompt_chars, log=lambda line: print(line, flush=True)))
            finally:
                server.stop()
        # what has run so far, in case a later engine fails or the call runs out of time
        bench_serve.write(runs, args.out, args.name, title, note(loads), with_plot=False)
    text = note(loads) + ("" if base_runs is None else "\n\n" + against(runs, base_runs))
    print("wrote", ", ".join(bench_serve.write(runs, args.out, args.name, title, text)))


def against(runs: list[dict], base_runs: list[dict]) -> str:
    """A table of this run's aggregate tok/s and TTFT p50 over the base run's, per method and concurrency level
    that both measured."""
    def key(run: dict) -> tuple:
        return run["setup"]["server"]["method"], run["setup"]["server"]["budget"]

    base = {key(r): {row["concurrency"]: row for row in r["rows"]} for r in base_runs}
    commit = base_runs[0]["setup"].get("commit") if base_runs else None
    lines = [f"Against the base run (commit {commit}, run just before this one on the same machine): this run / "
             "base.", "", "| method | concurrency | aggregate tok/s | x base | TTFT p50 ms | x base |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        method, budget = key(run)
        name = f"{method}@{budget}" if budget is not None else method
        for row in run["rows"]:
            b = base.get((method, budget), {}).get(row["concurrency"])
            if b is None:
                continue
            lines.append(f"| {name} | {row['concurrency']} | {row['aggregate_tok_s']:.1f} | "
                         f"{row['aggregate_tok_s'] / b['aggregate_tok_s']:.3f} | {row['ttft_p50_s'] * 1e3:.0f} | "
                         f"{row['ttft_p50_s'] / b['ttft_p50_s']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
