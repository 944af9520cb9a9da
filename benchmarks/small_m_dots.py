"""XLA's bf16 dots at small M on one device's weights: the time per dot against its bytes floor, by weight layout
and by XLA's GEMM backend, measured side by side in one process.

For each weight shape [K -> N] of the per-device program of an ep=8 K2.6 mesh (q_a + kv_a, q_b, o, the shared
expert's gate + up and down, the router, the dense MLP, the vocabulary shard) and each M, one jitted chain of L
distinct weights (L x the weight's bytes > 4 x the L2, so no weight is read from L2): x -> x @ W_i, the next input
the last one scaled by one column of the product (a dependence, fused into the next dot's input). Variants:
  layout "kn": W stored [K, N] (x @ W, the model's layout, except q_b's); "nk": W stored [N, K] (the contraction
  over W's last axis, contiguous per output row: the model's q_b and v_b since checkpoint format 3); "auto": W logically [K, N] in the device layout XLA picks for the program
  (jit with Format(Layout.AUTO), the weights put in the compiled program's input formats); backend "default"
  (XLA's choice: reduction fusions at M = 1, Triton GEMMs or cuBLAS above) or "cublas" (compiler option
  xla_gpu_enable_triton_gemm=false). (The committed results also have the layouts "ffi" and "ffi_plain", a custom
  call of the project's for these dots, never faster than XLA's and removed on 2026-12-07.)
Per dot: the wall time of the chain / L (queued calls, median), the bytes floor (weight + x + y at the copy
bandwidth measured in the same run) and the ratio.

    python benchmarks/small_m_dots.py                   # on a GPU (~2 minutes)
    python benchmarks/small_m_dots.py --quick --out /tmp/d   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import ceilings, timed  # noqa: E402

# [K -> N] of one device of ep=8 (64 heads / 8, vocabulary / 8, dense width / 8, shared expert / 8)
SHAPES = {"qkv_a": (7168, 2112), "q_b": (1536, 1536), "o": (1024, 7168), "shared_gate_up": (7168, 512),
          "shared_down": (256, 7168), "router": (7168, 384), "dense_gate_up": (7168, 4608),
          "dense_down": (2304, 7168), "lm_head": (7168, 20480)}
MS = (1, 10, 17, 65, 170)
L2_BYTES = 50 * 2**20


LAYOUTS = ("kn", "nk", "auto")


def chain(layout: str):
    def dot(x, w):
        return x @ w if layout == "kn" else jnp.einsum("mk,nk->mn", x, w)

    def f(x, ws):
        y = None
        for w in ws:
            y = dot(x, w)
            x = x * (1 + 1e-3 * y[:, :1]).astype(x.dtype)
        return y
    return f


def measure(name: str, k: int, n: int, m: int, layout: str, backend: str, bw: float, quick: bool) -> dict:
    wbytes = k * n * 2
    count = 2 if quick else max(6, int(np.ceil(4 * L2_BYTES / wbytes)))
    key = jax.random.key(hash((k, n)) % 2**31)
    shape = (n, k) if layout == "nk" else (k, n)
    ws = [jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * 0.02 for i in range(count)]
    x = jax.random.normal(jax.random.fold_in(key, 999), (m, k), jnp.bfloat16)
    opts = {"xla_gpu_enable_triton_gemm": False} if backend == "cublas" else None
    if layout == "auto":
        from jax.experimental.layout import Format, Layout

        fn = jax.jit(chain("kn"), in_shardings=(None, [Format(Layout.AUTO)] * count))
        fn = fn.lower(x, ws).compile(compiler_options=opts)
        ws = [jax.device_put(w, fmt) for w, fmt in zip(ws, fn.input_formats[0][1])]
        picked = fn.input_formats[0][1][0].layout.major_to_minor
    else:
        fn = jax.jit(chain(layout)).lower(x, ws).compile(compiler_options=opts)
        picked = None
    sec, _ = timed(fn, (x, ws), count, min_batch=0.02, samples=5)
    floor = (wbytes + 2 * m * (k + n)) / bw
    del ws
    return dict(name=name, k=k, n=n, m=m, layout=layout, backend=backend, dots=count, us=sec * 1e6, picked=picked,
                floor_us=floor * 1e6, x_floor=sec / floor, tbps=wbytes / sec / 1e12)


def write_report(out: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "small_m_dots.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    variants = sorted({(r["layout"], r["backend"]) for r in rows})
    lines = [f"# XLA's bf16 dots at small M, one device's weights of ep=8 K2.6 ({meta['date']}, {meta['device']}, "
             f"commit {meta['commit']})", "",
             f"`{meta['command']}`; jax {meta['jax']}; copy bandwidth measured in this run "
             f"{meta['copy_Bps'] / 1e12:.2f} TB/s. Each cell: µs per dot (a chain of distinct weights, each dot's "
             "input depending on the last) and, in parentheses, the dot over its bytes floor.", ""]
    head = "| weight | K -> N | MB | M | " + " | ".join(f"{lay} / {be}" for lay, be in variants) + " | floor µs |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    by = {(r["name"], r["m"], r["layout"], r["backend"]): r for r in rows}
    for name, (k, n) in SHAPES.items():
        for m in sorted({r["m"] for r in rows}):
            cells = [by.get((name, m, lay, be)) for lay, be in variants]
            if not any(cells):
                continue
            fl = next(c for c in cells if c)["floor_us"]
            lines.append(f"| {name} | {k} -> {n} | {k * n * 2 / 1e6:.1f} | {m} | " + " | ".join(
                f"{c['us']:.1f} ({c['x_floor']:.1f}x)" if c else "-" for c in cells) + f" | {fl:.1f} |")
    with open(os.path.join(out, "small_m_dots.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(variants), figsize=(4.5 * len(variants), 4), sharey=True, squeeze=False)
    for ax, (lay, be) in zip(axes[0], variants):
        for name in SHAPES:
            pts = sorted((r["m"], r["x_floor"]) for r in rows if r["name"] == name and (r["layout"], r["backend"])
                         == (lay, be))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log")
        ax.set_title(f"{lay} / {be}")
        ax.set_xlabel("M (tokens)")
        ax.axhline(1.0, color="k", lw=0.5)
    axes[0][0].set_ylabel("time / bytes floor")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "small_m_dots.png"), dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "small_m_dots"), help="folder for the .md, .json and .png")
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"),
                    help="commit stamped on the results")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts M, comma-separated")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="weights, comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="variants, comma-separated, of: " + ", ".join(LAYOUTS))
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: two dots a chain, default backend only")
    ap.add_argument("--replot", metavar="JSON", help="rewrite the report from saved numbers")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        write_report(os.path.dirname(os.path.abspath(args.replot)), saved["meta"], saved["rows"])
        return 0
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        ap.error(f"unknown weights {unknown}; known: {', '.join(SHAPES)}")
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    if set(layouts) - set(LAYOUTS):
        ap.error(f"unknown layouts {sorted(set(layouts) - set(LAYOUTS))}; known: {', '.join(LAYOUTS)}")
    ms = [int(v) for v in args.ms.split(",")]
    gpu = jax.default_backend() == "gpu"
    bw = ceilings()["copy_Bps"] if not args.quick else 1e11
    backends = ("default", "cublas") if gpu and not args.quick else ("default",)
    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, commit=args.commit,
                jax=jax.__version__, copy_Bps=bw, command="python benchmarks/small_m_dots.py " + " ".join(
                    argv if argv is not None else sys.argv[1:]))
    rows = []
    t0 = time.perf_counter()
    for name in names:
        k, n = SHAPES[name]
        for m in ms:
            for layout in layouts:
                for be in backends:
                    r = measure(name, k, n, m, layout, be, bw, args.quick)
                    rows.append(r)
                    print(f"{name:15s} M={m:4d} {layout}/{be:7s} {r['us']:8.2f} us  {r['x_floor']:5.2f}x floor  "
                          f"{r['tbps']:.2f} TB/s  picked {r['picked']}  [{time.perf_counter() - t0:.0f} s]",
                          flush=True)
        write_report(args.out, meta, rows)
    write_report(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
