"""marlin_moe on one GPU at the Kimi K2 shape (E = 384, hidden 7,168, inter 2,048, top-8, INT4 group 32, bf16
activations): the CUDA kernel, the XLA reference (dequantize + ragged_dot) and the bandwidth floor, side by side
in one run, for M = 1, 2, 4, ..., 4,096 tokens.

floor = bytes of the distinct experts the routing touches (24.77 MB each: packed nibbles + bf16 scales) / copy
bandwidth, measured in the same run (bytes read + written by a 1 GiB device copy, as docs/anchors.md).
Routing: k = 8 distinct uniform random experts per token, fresh for every input set; each timed batch runs the op
on several sets (different experts), so the weights do not sit in L2 between calls; time = median per op.
The two regimes: streaming-bound while M grows (more experts touched), then a plateau once all 384 are touched.

usage: python benchmarks/marlin_moe.py [--quick] [--sweep] [--no-xla] [--out DIR] [--commit SHA] [--budget SECONDS]
       python benchmarks/marlin_moe.py --plot DIR/marlin_moe.json      (redraw the table and plot from saved numbers)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time

import numpy as np
from common import add_report_args, ceilings, replot, timed

E, D, F, TOPK, GROUP = 384, 7168, 2048, 8, 32
EXPERT_BYTES = (3 * F * D) // 2 + 2 * (3 * F * D) // GROUP  # nibbles + bf16 scales of gate, up and down
SETS = 4  # routing sets per timed batch of the kernel
GOALS = "goals (issue 6): >= 75% of the floor for M <= 64; all experts touched within 1.25x of the floor; >= 3x XLA"


def k2_experts(seed: int = 0):
    """Random INT4 experts of the K2 shape, built on the device: (gate, up [E, F, D], down [E, D, F]) Int4Array."""
    import jax
    import jax.numpy as jnp

    from kdtree_jax.quant import Int4Array

    def one(key, rows, cols):
        k1, k2 = jax.random.split(key)
        packed = jax.lax.bitcast_convert_type(jax.random.bits(k1, (E, rows, cols // 8), jnp.uint32), jnp.int32)
        scale = jax.random.uniform(k2, (E, rows, cols // GROUP), jnp.float32, 0.5, 1.5) / (4 * math.sqrt(cols))
        return Int4Array(packed, scale.astype(jnp.bfloat16))

    make = jax.jit(one, static_argnums=(1, 2))
    keys = jax.random.split(jax.random.key(seed), 3)
    return make(keys[0], F, D), make(keys[1], F, D), make(keys[2], D, F)


def routing_sets(m: int, count: int, seed: int):
    """`count` (x [M, D] bf16, ids [M, 8] int32, weights [M, 8] fp32) with fresh uniform routings, and the number of
    distinct experts each touches."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    sets, touched = [], []
    for i in range(count):
        ids = np.argsort(rng.random((m, E)), axis=1)[:, :TOPK].astype(np.int32)
        w = rng.uniform(0.1, 1.0, size=(m, TOPK)).astype(np.float32)
        x = jax.random.normal(jax.random.key(seed * 100 + i), (m, D), jnp.bfloat16)
        sets.append((x, jnp.asarray(ids), jnp.asarray(w / w.sum(axis=1, keepdims=True))))
        touched.append(len(np.unique(ids)))
    return sets, touched


def measure(m: int, experts, bw: float, with_xla: bool, block_ms=(None,)) -> list[dict]:
    import jax

    from kdtree_jax.kernels.marlin_moe import block_size, marlin_moe, marlin_moe_ref

    sets, touched = routing_sets(m, SETS, seed=m)
    floor = statistics.mean(touched) * EXPERT_BYTES / bw
    xla_s, ref, err_note = None, None, None
    if with_xla:
        try:
            xla = jax.jit(lambda st, ex: [marlin_moe_ref(*a, *ex) for a in st])
            xla_s, ref_out = timed(xla, (sets[:1], experts), 1, min_batch=0.05, samples=3)
            ref = np.asarray(ref_out[0], np.float32)
        except jax.errors.JaxRuntimeError as e:  # out of memory: it dequantizes all 384 experts (34 GB) per call
            err_note = f"XLA reference failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(err_note, flush=True)
    rows = []
    for bm in block_ms:
        ker = jax.jit(lambda st, ex, bm=bm: [marlin_moe(*a, *ex, block_m=bm) for a in st])
        ker_s, ker_out = timed(ker, (sets, experts), len(sets), min_batch=0.05, samples=5)
        got = np.asarray(ker_out[0], np.float32)
        err = None
        if ref is not None:
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if np.all(np.isfinite(got)) else math.inf
        rows.append(dict(m=m, touched=statistics.mean(touched), bytes=statistics.mean(touched) * EXPERT_BYTES,
                         floor_s=floor, kernel_s=ker_s, xla_s=xla_s, rel_err_vs_xla=err,
                         block_m=bm or block_size(m, TOPK, E), finite=bool(np.all(np.isfinite(got))),
                         note=err_note))
    return rows


def write_report(out_dir: str, meta: dict, rows: list[dict], sweep: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "marlin_moe.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, sweep=sweep), f, indent=1)
    us = lambda x: "-" if x is None else f"{x * 1e6:,.1f}"
    pct = lambda t, floor: "-" if t is None else f"{100 * floor / t:.0f}%"
    lines = [
        "# marlin_moe: CUDA kernel vs XLA reference vs bandwidth floor (Kimi K2 MoE layer)",
        "",
        f"{meta['date']}, {meta['device']}, commit {meta['commit']}, jax {meta['jax']}.",
        (f"E = {E}, hidden {D}, inter {F}, top-{TOPK}, INT4 group {GROUP}, bf16 activations, uniform random routing. "
         f"Copy bandwidth measured in the same run: {meta['copy_Bps'] / 1e12:.2f} TB/s (bytes read + written). "
         f"floor = distinct experts touched x {EXPERT_BYTES / 1e6:.2f} MB / copy bandwidth. XLA = "
         "`marlin_moe_ref` (dequantize every expert, sort, ragged_dot)."),
        GOALS + ".",
        "",
        ("| M | experts touched | floor µs | kernel µs | kernel µs / token | kernel % of floor | XLA µs | "
         "XLA % of floor | speedup vs XLA | block_m | rel err vs XLA |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["m"]):
        speed = "-" if r["xla_s"] is None else f"{r['xla_s'] / r['kernel_s']:.1f}x"
        err = "-" if r["rel_err_vs_xla"] is None else f"{r['rel_err_vs_xla']:.1e}"
        lines.append(f"| {r['m']:,} | {r['touched']:.1f} | {us(r['floor_s'])} | {us(r['kernel_s'])} | "
                     f"{us(r['kernel_s'] / r['m'])} | {pct(r['kernel_s'], r['floor_s'])} | {us(r['xla_s'])} | "
                     f"{pct(r['xla_s'], r['floor_s'])} | {speed} | {r['block_m']} | {err} |")
    notes = sorted({r["note"] for r in rows if r.get("note")})
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    if sweep:
        lines += ["", "## Token block size (block_m)", "", "| M | block_m | kernel µs | % of floor |",
                  "|---|---|---|---|"]
        for r in sorted(sweep, key=lambda r: (r["m"], r["block_m"])):
            lines.append(f"| {r['m']:,} | {r['block_m']} | {us(r['kernel_s'])} | {pct(r['kernel_s'], r['floor_s'])} |")
    with open(os.path.join(out_dir, "marlin_moe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        plot(out_dir, meta, rows)
    except ImportError as e:
        print(f"no plot ({e}); redraw later with --plot {os.path.join(out_dir, 'marlin_moe.json')}", flush=True)


def plot(out_dir: str, meta: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["m"])
    ms = [r["m"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(ms, [1e3 * r["kernel_s"] for r in rows], "o-", label="marlin_moe kernel")
    xs = [r for r in rows if r["xla_s"] is not None]
    left.plot([r["m"] for r in xs], [1e3 * r["xla_s"] for r in xs], "s--", label="XLA reference")
    left.plot(ms, [1e3 * r["floor_s"] for r in rows], "k:", label="bandwidth floor")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("M (tokens)")
    left.set_ylabel("ms per call")
    left.legend(fontsize=8)
    left.grid(alpha=0.3, which="both")
    right.plot(ms, [100 * r["floor_s"] / r["kernel_s"] for r in rows], "o-", label="kernel")
    right.plot([r["m"] for r in xs], [100 * r["floor_s"] / r["xla_s"] for r in xs], "s--", label="XLA reference")
    right.axhline(75, color="gray", lw=0.8, ls=":", label="goal for M <= 64")
    right.axhline(80, color="gray", lw=0.8, ls="-.", label="1.25x of floor")
    right.set_xscale("log", base=2)
    right.set_xlabel("M (tokens)")
    right.set_ylabel("% of bandwidth floor")
    right.set_ylim(0, 105)
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(f"marlin_moe, Kimi K2 MoE layer: {meta['device']}, {meta['date']}, commit {meta['commit']}, "
                 f"copy {meta['copy_Bps'] / 1e12:.2f} TB/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "marlin_moe.png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="M = 1, 4, 16, 64, 256, 1024, 4096 only")
    ap.add_argument("--sweep", action="store_true", help="also time block_m = 8, 16, 32 at a few M")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA reference")
    add_report_args(ap, "sizes")
    args = ap.parse_args()
    if replot(args, write_report):
        return

    import jax

    bw = ceilings()["copy_Bps"]
    dev = jax.devices()[0]
    meta = dict(date=datetime.date.today().isoformat(), device=f"{dev.device_kind} ({dev.platform})",
                commit=args.commit, jax=jax.__version__, copy_Bps=bw)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; expert {EXPERT_BYTES / 1e6:.2f} MB", flush=True)
    experts = k2_experts()
    ms = [1, 4, 16, 64, 256, 1024, 4096] if args.quick else [2**i for i in range(13)]
    start = time.perf_counter()
    rows, sweep = [], []
    for m in ms:
        if time.perf_counter() - start > args.budget:
            print(f"budget reached: skipping M={m}", flush=True)
            continue
        r = measure(m, experts, bw, with_xla=not args.no_xla)[0]
        rows.append(r)
        xla = "-" if r["xla_s"] is None else f"{r['xla_s'] * 1e6:,.0f} us"
        print(f"M={m}: {r['touched']:.0f} experts, floor {r['floor_s'] * 1e6:,.0f} us, kernel "
              f"{r['kernel_s'] * 1e6:,.0f} us ({100 * r['floor_s'] / r['kernel_s']:.0f}% of floor, block_m "
              f"{r['block_m']}), XLA {xla}, err {r['rel_err_vs_xla']}", flush=True)
        write_report(args.out, meta, rows, sweep)  # partial results survive a timeout
    if args.sweep:
        for m in (16, 64, 256, 512, 1024, 4096):
            if time.perf_counter() - start > args.budget:
                break
            for r in measure(m, experts, bw, with_xla=False, block_ms=(8, 16, 32)):
                sweep.append(r)
                print(f"sweep M={m} block_m {r['block_m']}: {r['kernel_s'] * 1e6:,.0f} us "
                      f"({100 * r['floor_s'] / r['kernel_s']:.0f}% of floor)", flush=True)
            write_report(args.out, meta, rows, sweep)
    write_report(args.out, meta, rows, sweep)


if __name__ == "__main__":
    main()
