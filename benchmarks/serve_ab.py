"""`kdtree-jax serve` of this tree against an older tree's, side by side in one run: the question "do the server's
new features cost anything when unused?" (within 5% of an older commit) needs both measured under the same
conditions, alternated, because one server measured in two calls differed from itself by 27-36% (one H100,
2026-12-05, `results/bench_serve/runs/2026-12-05_0198dc5_ab_h100`).

Each tree serves the embedded model from its own process (its own `Engine` and `create_app`, imported from that
tree; both kept running, compiled once, and idle while the other is measured), on a listening socket made here
with TCP_NODELAY for its connections (`tcp_listener`: the older trees' in-process server lacked it, which added ~40
ms to every request after a client's first). One client, this tree's `bench_serve.run`, measures them in turns:
repeat r sends each level to A then B (B then A on odd repeats). The report gives, per method and concurrency, the
median and range over all repeats of each side and B / A of the medians, and B / A within each process pair.

`--pairs`: how many times both servers are started (A first, then B first on odd pairs), each pair measured for
`--repeats` turns. One process keeps a speed of its own: on the 2-core CPU VM (2026-12-05) the same tree on both
sides gave B / A 0.908 at C = 4 in one pair and 1.067 in another (repeats of one pair all agreeing), so a difference
between trees means something only across pairs. The servers share a persistent compilation cache (a temporary
directory), so a restarted one loads its programs instead of compiling them again.

    python benchmarks/serve_ab.py --base /path/to/old/tree --base-lib /path/to/old/libs --pairs 3 --repeats 2
    JAX_PLATFORMS=cpu python benchmarks/serve_ab.py --base . --concurrency 1 --rounds 1 --max-tokens 4   # smoke

An older tree is imported from its directory, ahead of any installed kdtree_jax (an editable install's import hook
is set aside in that process); its kdtree_jax may keep the engine in `kdtree_jax.engine` / `kdtree_jax.serve` (before
the `serving` package) or in `kdtree_jax.serving`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def tcp_listener(host: str, port: int) -> socket.socket:
    """A listening socket of proto IPPROTO_TCP: asyncio then gives each accepted connection TCP_NODELAY. For trees
    older than `kdtree_jax.serving.serve.tcp_listener` (which a tree that has it uses instead)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen()
    return sock


def _import_tree(tree: str | None) -> None:
    """Make `tree`'s kdtree_jax the one imported (None: this process's own)."""
    if tree is None:
        return
    sys.meta_path[:] = [f for f in sys.meta_path if "_editable" not in (getattr(type(f), "__module__", "") or "")]
    sys.path.insert(0, os.path.abspath(tree))
    for name in [m for m in sys.modules if m == "kdtree_jax" or m.startswith("kdtree_jax.")]:
        del sys.modules[name]


def child(args) -> int:
    """Serve the embedded model from args.tree until SIGTERM; prints `READY <url>` once it listens, compiled."""
    _import_tree(args.tree)
    import dataclasses

    import uvicorn

    import kdtree_jax as kj
    try:
        from kdtree_jax.serving.engine import Engine
        from kdtree_jax.serving import serve
    except ImportError:  # trees from before the serving package
        from kdtree_jax.engine import Engine
        from kdtree_jax import serve

    model = kj.load("builtin")
    cfg = model.cfg
    if args.ffi_ops:
        cfg = dataclasses.replace(cfg, kernels="ffi", ffi_ops=tuple(o.strip() for o in args.ffi_ops.split(",")))
    warmup = tuple(int(n) for n in args.warmup.split(",")) if args.warmup else ()
    budget = int(args.budget) if args.budget.isdigit() else args.budget
    with Engine(model.params, cfg, method=args.method, drafter=model.drafter, budget=budget,
                max_batch=args.max_batch, max_context=args.max_context, chunk_steps=args.chunk_steps,
                eos_id=model.tokenizer.eos_id, warmup=warmup) as engine:
        app = serve.create_app(engine, model.tokenizer, "builtin")
        make_config = getattr(serve, "uvicorn_config", None)  # the tree's own protocol settings, where it has them
        config = (make_config(app, log_level="warning") if make_config is not None
                  else uvicorn.Config(app, lifespan="off", log_level="warning"))
        sock = getattr(serve, "tcp_listener", tcp_listener)("127.0.0.1", 0)
        print(f"READY http://127.0.0.1:{sock.getsockname()[1]} {kj.__file__}", flush=True)
        asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))  # until SIGTERM (uvicorn's own handler)
    return 0


def _launch(tree: str, lib: str | None, args, method: str, warmup: str,
            cache: str | None = None) -> subprocess.Popen:
    """Start a server process of `tree` (it compiles, then prints READY; `_ready` waits for that)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if cache:  # compiled programs kept on disk for the next pair's servers
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if lib:
        env["KDTREE_JAX_FFI_DIR"] = lib
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--tree", tree, "--method", method,
            "--budget", str(args.budget), "--max-batch", str(args.max_batch), "--max-context", str(args.max_context),
            "--chunk-steps", str(args.chunk_steps), "--warmup", warmup, "--ffi-ops", args.ffi_ops]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _ready(proc: subprocess.Popen, tree: str, t0: float) -> str:
    """The URL of a launched server once it listens, compiled."""
    lines = []
    for line in proc.stdout:
        if line.startswith("READY "):
            _, url, where = line.split()
            print(f"  {tree}: serving from {where} ({time.monotonic() - t0:.0f} s to compile)", flush=True)
            # keep reading its output, so that a full pipe never blocks the server while it is measured
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return url
        lines.append(line)
    tail = "".join(lines[-20:])
    raise RuntimeError(f"the server of {tree} exited ({proc.wait()}) before it listened; its last output:\n{tail}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def compare(runs: dict[str, list[list[dict]]], labels: tuple[str, str], pairs: int = 1) -> list[dict]:
    """Per concurrency, from each side's repeats (lists of bench_serve rows, `pairs` process pairs of equally many
    repeats, in order): the medians, ranges and B / A over all of them, and B / A of the medians of each pair."""
    a, b = labels
    per = len(runs[a]) // pairs
    out = []
    for i, row in enumerate(runs[a][0]):
        entry = {"concurrency": row["concurrency"]}
        for key in ("aggregate_tok_s", "per_request_tok_s", "ttft_p50_s"):
            for side in labels:
                values = [rep[i][key] for rep in runs[side]]
                entry[f"{side}_{key}"] = statistics.median(values)
                entry[f"{side}_{key}_range"] = (min(values), max(values))
            entry[f"ratio_{key}"] = entry[f"{b}_{key}"] / entry[f"{a}_{key}"]
            entry[f"pair_ratios_{key}"] = [
                statistics.median(rep[i][key] for rep in runs[b][k * per:(k + 1) * per])
                / statistics.median(rep[i][key] for rep in runs[a][k * per:(k + 1) * per]) for k in range(pairs)]
        out.append(entry)
    return out


def report(results: dict, labels: tuple[str, str]) -> str:
    a, b = labels
    setup = results["setup"]
    lines = [f"# kdtree-jax serve: {b} against {a}, side by side ({setup['date']}, {setup['device']})", "",
             f"`{setup['command']}`", "",
             f"Embedded model, {setup['max_batch']} slots, chunk_steps {setup['chunk_steps']}; {setup['rounds']} "
             f"requests per client per level, {setup['max_tokens']} tokens each (greedy, ignore_eos); "
             f"{setup.get('pairs', 1)} process pair(s) (A started first, then B first), {setup['repeats']} repeats "
             f"each, alternated (A B, then B A); medians over all repeats, [min, max] beside them. A = {a} "
             f"({setup['trees'][a]}), B = {b} ({setup['trees'][b]}). Both servers listen with TCP_NODELAY.", ""]
    for method, rows in results["methods"].items():
        lines += [f"## {method}", "", "| C | aggregate tok/s A | B | B / A | per-request tok/s A | B | B / A | "
                  "TTFT p50 ms A | B |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            def cell(side, key, scale=1.0):
                lo, hi = r[f"{side}_{key}_range"]
                return f"{scale * r[f'{side}_{key}']:.1f} [{scale * lo:.1f}, {scale * hi:.1f}]"
            lines.append(f"| {r['concurrency']} | {cell(a, 'aggregate_tok_s')} | {cell(b, 'aggregate_tok_s')} | "
                         f"{r['ratio_aggregate_tok_s']:.3f} | {cell(a, 'per_request_tok_s')} | "
                         f"{cell(b, 'per_request_tok_s')} | {r['ratio_per_request_tok_s']:.3f} | "
                         f"{cell(a, 'ttft_p50_s', 1e3)} | {cell(b, 'ttft_p50_s', 1e3)} |")
        lines += ["", "B / A of aggregate tok/s within each process pair: " + "; ".join(
            f"C = {r['concurrency']}: " + ", ".join(f"{x:.3f}" for x in r["pair_ratios_aggregate_tok_s"])
            for r in rows if "pair_ratios_aggregate_tok_s" in r), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the older tree (A)")
    ap.add_argument("--base-lib", default=None, help="its built FFI libraries (KDTREE_JAX_FFI_DIR for its server)")
    ap.add_argument("--base-label", default="base", help="A's name in the report (default: base)")
    ap.add_argument("--label", default="this", help="B's name in the report (default: this)")
    ap.add_argument("--methods", default="ar", help="comma-separated (default: ar)")
    ap.add_argument("--budget", default="16", help="ddtree's budget (default: 16)")
    ap.add_argument("--max-batch", type=int, default=10)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--chunk-steps", type=int, default=4)
    ap.add_argument("--concurrency", default="1,4,10")
    ap.add_argument("--rounds", type=int, default=8, help="requests per client per level (default: 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="alternations of the two servers in each pair (default: 3)")
    ap.add_argument("--pairs", type=int, default=2,
                    help="times both servers are started, the first of them alternating (default: 2)")
    ap.add_argument("--ffi-ops", default="", help="custom calls for both servers (default: none, pure JAX)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_serve"))
    ap.add_argument("--name", default="serve_ab")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--method", default="ar", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    if not args.base:
        ap.error("--base is required")
    if args.repeats < 1 or args.pairs < 1:
        ap.error("--repeats and --pairs must be at least 1")
    sys.path.insert(0, ROOT)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the servers' processes hold the device's memory
    import jax

    from kdtree_jax.serving import bench_serve

    device = f"{jax.devices()[0].device_kind} ({jax.devices()[0].platform})"

    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = bench_serve.heldout_prompts(max(levels) * args.rounds, args.prompt_chars, 0)  # those `run` sends
    warmup = ",".join(str(n) for n in sorted({len(p.encode()) for p in prompts}))  # byte tokens
    labels = (args.base_label, args.label)
    trees = {args.base_label: (os.path.abspath(args.base), args.base_lib), args.label: (ROOT, None)}
    results = {"methods": {}, "raw": {}}
    cache = tempfile.mkdtemp(prefix="serve_ab_cache_")
    try:
        for method in [m.strip() for m in args.methods.split(",")]:
            print(f"## {method}", flush=True)
            runs = {side: [] for side in labels}
            for pair in range(args.pairs):
                servers = {}
                try:
                    t0 = time.monotonic()  # both launched at once, so that they compile side by side
                    for side in (labels if pair % 2 == 0 else labels[::-1]):
                        servers[side] = (_launch(*trees[side], args, method, warmup, cache), None)
                    for side in list(servers):
                        servers[side] = (servers[side][0], _ready(servers[side][0], trees[side][0], t0))
                    for rep in range(args.repeats):
                        for side in (labels if rep % 2 == 0 else labels[::-1]):
                            got = bench_serve.run(servers[side][1], levels, rounds=args.rounds,
                                                  max_tokens=args.max_tokens, prompt_chars=args.prompt_chars,
                                                  log=lambda line: None)
                            runs[side].append(got["rows"])
                            print(f"  pair {pair + 1} repeat {rep + 1} {side}: " + ", ".join(
                                f"C={r['concurrency']} {r['aggregate_tok_s']:.1f} tok/s" for r in got["rows"]),
                                flush=True)
                finally:
                    for proc, _ in servers.values():
                        _stop(proc)
            results["methods"][method] = compare(runs, labels, args.pairs)
            results["raw"][method] = runs
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    results["setup"] = dict(date=datetime.date.today().isoformat(), device=device,
                            command="python benchmarks/serve_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
                            trees={side: trees[side][0] for side in labels}, max_batch=args.max_batch,
                            chunk_steps=args.chunk_steps, rounds=args.rounds, max_tokens=args.max_tokens,
                            repeats=args.repeats, pairs=args.pairs, concurrency=levels)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    text = report(results, labels)
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
