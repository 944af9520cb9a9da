"""Prefix reuse in `kdtree-jax serve`, embedded model: the time to first token of a prompt that begins with a
1,500-character held-out prefix (bytes are tokens: ~1,500 tokens) followed by a 50-character question, cold (a prefix
the server has not seen: the whole prompt prefilled) against warm (the prefix of the request just before: its cache
rows copied, the question alone prefilled). For each method a local server (the same engine and app, on 127.0.0.1)
with a prefix cache, and one without (where warm is cold again), measured by `kdtree-jax bench-serve
--shared-prefix`'s client; results in results/prefix_cache/<name>.{json,md}, stamped with the date, the device and
the commit.

    JAX_PLATFORMS=cpu python benchmarks/prefix_cache.py --name prefix_cache_cpu
    python3 benchmarks/prefix_cache.py --name prefix_cache_h200 --ffi-ops tree_build,tree_accept   # on a GPU
"""

import argparse
import dataclasses
import os

import jax

import kdtree_jax as kj
from kdtree_jax.serving import bench_serve
from kdtree_jax.serving.engine import Engine
from kdtree_jax.serving.serve import BackgroundServer, create_app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ar,ddtree", help="comma-separated, from ar, chain, ddtree (default: both)")
    ap.add_argument("--budget", type=int, default=16, help="ddtree's node budget (default: 16)")
    ap.add_argument("--prefix-chars", type=int, default=1500, help="characters of the shared prefix (default: 1500)")
    ap.add_argument("--question-chars", type=int, default=50, help="characters of each question (default: 50)")
    ap.add_argument("--rounds", type=int, default=5, help="cold / warm pairs timed per server (default: 5)")
    ap.add_argument("--prefix-cache-gb", type=float, default=1.0, help="the servers' prefix cache (default: 1)")
    ap.add_argument("--max-batch", type=int, default=4, help="server slots (default: 4)")
    ap.add_argument("--ffi-ops", default="", metavar="OPS",
                    help="custom calls to use, comma-separated, e.g. tree_build,tree_accept (default: none, pure JAX)")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "results", "prefix_cache"),
                    help="output directory (default: benchmarks/results/prefix_cache/)")
    ap.add_argument("--name", default="prefix_cache", help="output file name without extension")
    ap.add_argument("--log-compiles", action="store_true",
                    help="print every compilation (its function and shapes, with the time) as it starts: which request "
                         "compiled what (on an H100 the first timed warm request took 22-24 s after the warm-up's)")
    args = ap.parse_args()
    if args.log_compiles:
        import logging
        import time

        class Compiles(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if msg.startswith(("Compiling", "Finished")):
                    print(f"[{time.strftime('%H:%M:%S')}] compile: {msg[:300]}", flush=True)

        logging.getLogger("jax").addHandler(Compiles())
        jax.config.update("jax_log_compiles", True)

    model = kj.load("builtin")
    cfg = model.cfg
    if args.ffi_ops:
        cfg = dataclasses.replace(cfg, kernels="ffi", ffi_ops=tuple(o.strip() for o in args.ffi_ops.split(",")))
    title = "kdtree-jax serve, embedded model: time to first token with a shared prefix, cold and warm"
    loads, runs = [], []

    def note() -> str:
        return (f"Kernels: {'custom calls ' + args.ffi_ops + ', the rest' if args.ffi_ops else 'all'} in pure JAX. "
                "Cold: the whole prompt padded to a power of two and prefilled in one pass; warm: the prefix's rows "
                "(a power of two of slots) copied into the slot and the rest run as cached forwards after them. "
                "Without a prefix cache both are cold. Other jobs may share the machine: 1-minute load average "
                f"{', '.join(loads)} (on {os.cpu_count()} cores).")

    for method in [m.strip() for m in args.methods.split(",")]:
        for gb in (args.prefix_cache_gb, 0.0):
            label = f"{method}, prefix cache {gb:g} GB"
            print(f"## {label}", flush=True)
            loads.append(f"{os.getloadavg()[0]:.1f} before {label}")
            with Engine(model.params, cfg, method=method, drafter=model.drafter, budget=args.budget,
                        max_batch=args.max_batch, max_context=cfg.max_position_embeddings,
                        eos_id=model.tokenizer.eos_id, prefix_cache_bytes=int(gb * 1e9)) as engine:
                server = BackgroundServer(create_app(engine, model.tokenizer, "builtin"))
                try:
                    runs.append(bench_serve.prefix_ttft(server.url, prefix_chars=args.prefix_chars,
                                                        question_chars=args.question_chars, rounds=args.rounds,
                                                        log=lambda line: print(line, flush=True)))
                finally:
                    server.stop()
            bench_serve.write(runs, args.out, args.name, title, note())  # what has run so far
    print("wrote", ", ".join(bench_serve.write(runs, args.out, args.name, title, note())))


if __name__ == "__main__":
    main()
