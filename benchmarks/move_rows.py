"""The accepted rows moved into place after a tree step (`model.move_accepted`, the "keep" stage's target half):
XLA's gather and in-place update per cache and layer against the `move_rows` custom call, one launch for all.

One device's caches of K2.6 on an ep=8 mesh (the latent cache is not split by heads): `--layers` layers x (latent
512 + rope key 64) bf16 rows, `--context` slots filled plus room for the tree; each row accepts a random path of
`--p` nodes out of the tree's. Each form runs as one jitted program of K moves in a row, each on the last one's caches
(as the decoding loop carries them), the caches donated; a move's time is the difference of the programs of
`--calls` and 3 x `--calls` moves over the 2 x `--calls` moves between them (a call's dispatch, ~0.3 ms with 122
arrays, cancels), median of `--repeats`. On a GPU each form's short program also runs under the profiler: its
kernels' GPU time and launches a move (the wall-clock difference can be below its resolution for one launch of a few
µs). Floor: the moved rows read and written once, at the copy bandwidth measured in the same run.

    python benchmarks/move_rows.py                         # on a GPU: results/move_rows/
    python benchmarks/move_rows.py --small --out /tmp/x    # CPU smoke run (float32, 3 layers)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def make_case(layers: int, batch: int, context: int, nodes: int, p: int, dtype, rng):
    import jax.numpy as jnp
    slots = context + nodes + 8
    caches = tuple(jnp.asarray(rng.standard_normal((batch, slots, w)), dtype)
                   for _ in range(layers) for w in (512, 64))
    path = np.full((batch, p), -1, np.int32)
    for r in range(batch):
        length = int(rng.integers(2, p + 1))
        path[r, :length] = np.concatenate([[0], np.sort(rng.choice(np.arange(1, nodes), length - 1, replace=False))])
    return caches, jnp.full((batch,), context, jnp.int32), jnp.asarray(path)


def time_move(impl: str, caches, starts, path, nodes: int, calls: int, repeats: int, profile: bool) -> dict:
    """{"wall_s": (program of 3 x calls moves - program of calls moves) / (2 x calls), median of repeats; with
    profile, "gpu_s" and "kernels": the short program's GPU time and launches over its calls moves, 3 runs}."""
    import glob
    import tempfile

    import jax
    from profile_tools import parse_trace
    from kdtree_jax.kernels.move_rows import move_rows

    def chain(k):
        def run(c, s, q):
            for _ in range(k):  # unrolled: a while loop's condition would cost more than the move
                c = move_rows(c, s, q, nodes, impl=impl)
            return c
        return jax.jit(run, donate_argnums=0)

    short, long = chain(calls), chain(3 * calls)
    caches = jax.block_until_ready(long(short(caches, starts, path), starts, path))  # compile both
    samples = []
    for _ in range(repeats):
        spans = []
        for fn in (short, long):
            t0 = time.perf_counter()
            caches = jax.block_until_ready(fn(caches, starts, path))
            spans.append(time.perf_counter() - t0)
        samples.append((spans[1] - spans[0]) / (2 * calls))
    out = dict(wall_s=statistics.median(samples))
    if profile:
        logdir, runs = tempfile.mkdtemp(prefix="kdtree_move_"), 3
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            for _ in range(runs):
                caches = short(caches, starts, path)
            jax.block_until_ready(caches)
        prof = parse_trace(sorted(glob.glob(os.path.join(logdir, "**", "perfetto_trace.json*"), recursive=True))[-1])
        out.update(gpu_s=prof["busy_us"] * 1e-6 / (runs * calls),
                   kernels=sum(n for n, _ in prof["kernels"].values()) / (runs * calls))
    return out


def write_report(out: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "move_rows.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# The accepted rows moved into place: XLA against the move_rows custom call ({meta['date']}, "
             f"{meta['device']}, commit {meta['commit']})", "",
             f"{meta['layers']} layers x 2 caches (latent 512, rope key 64, {meta['dtype']}) of one device, context "
             f"{meta['context']}, a path of {meta['p']} nodes a row; a move's time: programs of {meta['calls']} and "
             f"{3 * meta['calls']} moves in a row, the difference over {2 * meta['calls']} (dispatch cancels; median "
             f"of {meta['repeats']}). Floor: the moved "
             f"rows read and written once at {meta['copy_Bps'] / 1e12:.2f} TB/s "
             f"({'measured in this run' if meta['copy_measured'] else 'assumed: no GPU'}). "
             "`python benchmarks/move_rows.py`.", "",
             "| batch | tree nodes | XLA µs (wall) | custom call µs (wall) | XLA GPU µs | custom call GPU µs | "
             "kernels (XLA, call) | floor µs |", "|---|---|---|---|---|---|---|---|"]
    def gpu(r, form, key, fmt):
        return format(r[form][key] * (1e6 if key == "gpu_s" else 1), fmt) if key in r[form] else "-"
    for r in rows:
        lines.append(f"| {r['batch']} | {r['nodes']} | {r['xla']['wall_s'] * 1e6:.1f} | {r['ffi']['wall_s'] * 1e6:.1f}"
                     f" | {gpu(r, 'xla', 'gpu_s', '.1f')} | {gpu(r, 'ffi', 'gpu_s', '.1f')} | "
                     f"{gpu(r, 'xla', 'kernels', '.0f')}, {gpu(r, 'ffi', 'kernels', '.0f')} | "
                     f"{r['floor_s'] * 1e6:.2f} |")
    with open(os.path.join(out, "move_rows.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"B={r['batch']}\nN={r['nodes']}" for r in rows]
    x = np.arange(len(rows))
    key = "gpu_s" if all("gpu_s" in r["xla"] for r in rows) else "wall_s"
    ax.bar(x - 0.2, [r["xla"][key] * 1e6 for r in rows], 0.4, label="XLA (gather + update a cache)")
    ax.bar(x + 0.2, [r["ffi"][key] * 1e6 for r in rows], 0.4, label="move_rows (one launch)")
    ax.set_xticks(x, labels)
    ax.set_ylabel("GPU µs a step" if key == "gpu_s" else "µs a step (wall)")
    ax.set_title(f"Accepted rows moved, {meta['layers']} layers ({meta['device']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "move_rows.png"), dpi=120)
    plt.close(fig)
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "move_rows"))
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"))
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,10", help="rows, comma-separated (default 1,10)")
    ap.add_argument("--nodes", default="17,65", help="tree nodes (root included), comma-separated (default 17,65)")
    ap.add_argument("--p", type=int, default=8, help="path nodes moved a row (the drafter's block; default 8)")
    ap.add_argument("--calls", type=int, default=4, help="moves in the short program (the long one: 3x)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="3 layers, context 64, float32 (CPU smoke run)")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from common import ceilings
    if args.small:
        args.layers, args.context, args.calls, args.repeats = 3, 64, 2, 2
    dtype = jnp.float32 if args.small else jnp.bfloat16
    gpu = jax.default_backend() == "gpu"
    copy_Bps = ceilings()["copy_Bps"] if gpu else 4.0e12
    rng = np.random.default_rng(0)
    rows = []
    for b in (int(v) for v in args.batches.split(",")):
        for n in (int(v) for v in args.nodes.split(",")):
            caches, starts, path = make_case(args.layers, b, args.context, n, args.p, dtype, rng)
            moved = 2 * b * args.p * sum(c.shape[-1] * c.dtype.itemsize for c in caches)
            xla = time_move("xla", caches, starts, path, n, args.calls, args.repeats, gpu)
            caches, starts, path = make_case(args.layers, b, args.context, n, args.p, dtype, rng)
            ffi = time_move("ffi", caches, starts, path, n, args.calls, args.repeats, gpu)
            rows.append(dict(batch=b, nodes=n, xla=xla, ffi=ffi, bytes=moved, floor_s=moved / copy_Bps))
            print(f"B={b} N={n}: XLA {xla} move_rows {ffi} (s a move)", flush=True)
            del caches
    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, commit=args.commit,
                layers=args.layers, context=args.context, p=args.p, calls=args.calls, repeats=args.repeats,
                dtype=jnp.dtype(dtype).name, copy_Bps=copy_Bps, copy_measured=gpu)
    write_report(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
