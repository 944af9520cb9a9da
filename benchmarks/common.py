"""Measurement helpers shared by the benchmarks: timing of queued device calls, the ceilings (copy bandwidth,
bf16 matmul rate) measured in the same run as the kernels they judge, and random draft trees."""

import json
import os
import statistics
import time

import numpy as np


def add_report_args(ap, unit: str, name: str) -> None:
    """--out, --commit, --budget and --plot, shared by the benchmarks that save numbers (.json) and redraw from them;
    --out defaults to the benchmark's folder, results/`name`/."""
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name),
                    help=f"directory for the table (.md), plot (.png) and numbers (.json) (default: results/{name}/)")
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"),
                    help="commit stamped on the results (default: $KDTREE_COMMIT)")
    ap.add_argument("--budget", type=float, default=1e9, help=f"stop starting new {unit} after this long (s)")
    ap.add_argument("--plot", metavar="JSON", help="redraw the table and plot from saved numbers")


def replot(args, write_report) -> bool:
    """With --plot: redraw the report next to the saved JSON (write_report(dir, meta, rows, sweep)); True if done."""
    if not args.plot:
        return False
    with open(args.plot) as f:
        saved = json.load(f)
    write_report(os.path.dirname(os.path.abspath(args.plot)), saved["meta"], saved["rows"], saved["sweep"])
    return True


def random_trees(b: int, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(depths int32 [B, N], ancestor-or-self mask bool [B, N, N]) of random trees rooted at node 0 (the parent of
    node i is uniform in 0..i-1)."""
    depths = np.zeros((b, n), np.int32)
    vis = np.zeros((b, n, n), bool)
    for r in range(b):
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        for i in range(n):
            depths[r, i] = 0 if i == 0 else depths[r, parents[i]] + 1
            j = i
            while j >= 0:
                vis[r, i, j] = True
                j = parents[j]
    return depths, vis


def timed(fn, args, ops: int, min_batch: float = 0.02, samples: int = 3):
    """(median seconds per op, outputs): `fn(*args)` runs `ops` ops; calls are queued back to back, then waited for."""
    import jax

    res = jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, min(50, int(min_batch / max(time.perf_counter() - t0, 1e-6))))
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            res = fn(*args)
        jax.block_until_ready(res)
        out.append((time.perf_counter() - t0) / (calls * ops))
    return statistics.median(out), res


def ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured now."""
    import jax
    import jax.numpy as jnp

    res = {}
    try:
        import cupy as cp

        a = cp.random.random(2**28, dtype=cp.float32)  # 1 GiB
        bb = cp.empty_like(a)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        for _ in range(3):
            cp.copyto(bb, a)
        times = []
        for _ in range(10):
            start.record()
            cp.copyto(bb, a)
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
        res["copy_cupy_Bps"] = 2 * a.nbytes / statistics.median(times)
        del a, bb
        cp.get_default_memory_pool().free_all_blocks()
    except ImportError:
        pass
    x = jax.random.normal(jax.random.key(0), (2**29,), jnp.bfloat16)  # 1 GiB
    copy = jax.jit(lambda v: v.copy())
    res["copy_jax_Bps"] = 2 * x.nbytes / timed(copy, (x,), 1, min_batch=0.05, samples=5)[0]
    del x
    k1, k2 = jax.random.split(jax.random.key(1))
    a = jax.random.normal(k1, (8192, 8192), jnp.bfloat16)
    bm = jax.random.normal(k2, (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda u, v: u @ v)
    res["matmul_flops"] = 2 * 8192**3 / timed(mm, (a, bm), 1, min_batch=0.05, samples=5)[0]
    res["copy_Bps"] = max(res.get("copy_cupy_Bps", 0.0), res["copy_jax_Bps"])
    return res
