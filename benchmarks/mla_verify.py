"""mla_verify on one GPU: the CUDA kernel, the XLA reference (einsum + mask + softmax) and the roofline, side by side
in one run, over H = 8 / 64 heads, N = 1 / 64 / 256 tree nodes, S = 1k .. 128k cached tokens, B = 1 / 8 rows.

roofline = max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both ceilings measured in the same run;
bytes = latent + rope cache (576 bf16 per token) + queries + output; FLOPs = 2 B N H S (576 + 512).
Every cache row is full (cache_lens = S - N), each batch row verifies its own random tree. Each timed call runs the
op on enough distinct input sets (>= 256 MB together) that the caches do not sit in L2; time = median per op.

usage: python benchmarks/mla_verify.py [--quick] [--sweep] [--profile] [--out DIR] [--commit SHA] [--budget S]
       python benchmarks/mla_verify.py --plot DIR/mla_verify.json      (redraw the table and plot from saved numbers)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

import numpy as np
from common import add_report_args, ceilings, random_trees, replot, timed

R, DR = 512, 64
SCALE = 0.1309


def cost(b: int, n: int, h: int, s: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one call with a full cache of S slots."""
    nbytes = 2 * (b * s * (R + DR) + b * n * h * (R + DR) + b * n * h * R) + 4 * b + b * n * n
    return float(nbytes), 2.0 * b * n * h * s * (R + DR + R)


def make_sets(b, n, h, s, count, seed):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    mask = jnp.asarray(random_trees(b, n, rng)[1])
    lens = jnp.full((b,), s - n, jnp.int32)
    sets = []
    for i in range(count):
        ks = jax.random.split(jax.random.key(seed * 1000 + i), 4)
        sets.append((jax.random.normal(ks[0], (b, n, h, R), jnp.bfloat16),
                     jax.random.normal(ks[1], (b, n, h, DR), jnp.bfloat16),
                     jax.random.normal(ks[2], (b, s, R), jnp.bfloat16),
                     jax.random.normal(ks[3], (b, s, DR), jnp.bfloat16), lens, mask))
    return sets


def gpu_time(fn, args, ops: int) -> float | None:
    """Seconds of GPU time per op: the kernels of the attention call (the attention kernel and the combine) summed
    from a profile of 3 calls (None where the profile shows none: a CPU run). The wall time of `timed` can
    be the host's time per custom call rather than the kernels' at the smallest cases (on the H200 it stays at
    17-19 µs from 16 to 64 splits at one token of 8 heads, where the kernel alone took 11.9 µs at 16 splits in
    benchmarks/fixed_cost.py); this cannot."""
    from profile_tools import profile_calls

    prof = profile_calls(fn, args, 3)
    us = sum(t for k, (_, t) in prof["kernels"].items() if any(w in k for w in ("MlaVerify", "Combine")))
    return us * 1e-6 / ops if us > 0 else None


def measure(b, n, h, s, ceil, with_xla=True, splits_list=(None,), profile=False) -> list[dict]:
    import jax

    from kdtree_jax.kernels.mla_verify import mla_verify, plan_splits

    nbytes, flops = cost(b, n, h, s)
    roof = max(nbytes / ceil["copy_Bps"], flops / ceil["matmul_flops"])
    count = max(1, min(32, math.ceil(256e6 / nbytes)))
    sets = make_sets(b, n, h, s, count, seed=b * 7 + n * 11 + h * 13 + s)
    xla_s, ref = None, None
    if with_xla and 16.0 * b * n * h * (s + n) < 40e9:  # the reference's fp32 score tensors must fit
        xla_sets = sets[:max(1, min(4, count))]
        xla = jax.jit(lambda st: [mla_verify(*a, SCALE, impl="xla") for a in st])
        xla_s, xla_out = timed(xla, (xla_sets,), len(xla_sets))
        ref = np.asarray(xla_out[0], np.float32)
    rows = []
    for splits in splits_list:
        ker = jax.jit(lambda st, sp=splits: [mla_verify(*a, SCALE, num_splits=sp) for a in st])
        ker_s, ker_out = timed(ker, (sets,), count)
        gpu_s = gpu_time(ker, (sets,), count) if profile else None
        err = None
        if ref is not None:
            got = np.asarray(ker_out[0], np.float32)
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) if np.all(np.isfinite(got)) else math.inf
        rows.append(dict(b=b, n=n, h=h, s=s, bytes=nbytes, flops=flops, roofline_s=roof,
                         bound="memory" if nbytes / ceil["copy_Bps"] >= flops / ceil["matmul_flops"] else "compute",
                         kernel_s=ker_s, gpu_s=gpu_s, xla_s=xla_s, rel_err_vs_xla=err,
                         splits=splits or plan_splits(b, n, h, s), sets=count))
    return rows


def grid(quick: bool):
    hs, ns, bs = (8, 64), (1, 64, 256), (1, 8)
    ss = (32768, 131072, 8192, 1024)
    if quick:
        return [(1, 1, 8, 32768), (1, 1, 64, 32768), (8, 1, 64, 32768), (1, 64, 8, 32768), (1, 64, 64, 32768),
                (1, 256, 8, 32768), (8, 64, 8, 32768), (1, 64, 8, 131072), (1, 1, 64, 131072), (1, 256, 64, 8192)]
    return [(b, n, h, s) for s in ss for h in hs for n in ns for b in bs]


def sweep_cases():
    return [(1, 1, 8, 32768), (1, 1, 64, 32768), (1, 1, 64, 131072), (8, 1, 64, 32768), (1, 64, 64, 32768)]


def write_report(out_dir: str, meta: dict, rows: list[dict], sweep: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "mla_verify.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, sweep=sweep), f, indent=1)
    us = lambda x: "-" if x is None else f"{x * 1e6:,.1f}"
    pct = lambda t, roof: "-" if t is None else f"{100 * roof / t:.0f}%"
    lines = [
        "# mla_verify: CUDA kernel vs XLA reference vs roofline",
        "",
        f"{meta['date']}, {meta['device']}, commit {meta['commit']}, jax {meta['jax']}.",
        (f"Ceilings measured in the same run: copy {meta['copy_Bps'] / 1e12:.2f} TB/s (bytes read + written; "
         f"cupy memcpy {meta.get('copy_cupy_Bps', 0) / 1e12:.2f}, XLA copy {meta['copy_jax_Bps'] / 1e12:.2f}), "
         f"bf16 matmul {meta['matmul_flops'] / 1e12:.0f} TFLOP/s (8192^3, random data)."),
        ("roofline = max(bytes / copy bandwidth, FLOPs / matmul rate); bytes = cache (576 bf16 per token) + queries "
         "+ output; FLOPs = 2 B N H S (576 + 512). Full caches (cache_lens = S - N), a random tree per batch row, "
         "bf16, R = 512, dr = 64. `splits` = key splits per (batch row, 64-row query tile). "
         "XLA is skipped (-) where its fp32 score tensors would not fit."),
        "",
        ("| B | N | H | S | bound | roofline µs | kernel µs | kernel % roofline | XLA µs | XLA % roofline | "
         "speedup vs XLA | splits | rel err vs XLA |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["h"], r["n"], r["b"], r["s"])):
        speed = "-" if r["xla_s"] is None else f"{r['xla_s'] / r['kernel_s']:.1f}x"
        err = "-" if r["rel_err_vs_xla"] is None else f"{r['rel_err_vs_xla']:.1e}"
        lines.append(f"| {r['b']} | {r['n']} | {r['h']} | {r['s']:,} | {r['bound']} | {us(r['roofline_s'])} | "
                     f"{us(r['kernel_s'])} | {pct(r['kernel_s'], r['roofline_s'])} | {us(r['xla_s'])} | "
                     f"{pct(r['xla_s'], r['roofline_s'])} | {speed} | {r['splits']} | {err} |")
    if sweep:
        # a kernel column only for saved numbers that name one (the 2026-12-05 runs of the removed narrow kernel)
        named = any("kernel" in r for r in sweep)
        col, rule = (" kernel |", "---|") if named else ("", "")
        lines += ["", "## Key splits (decode regime)", "",
                  "kernel µs: wall time per op of queued calls (at the smallest cases it can be the host's time per "
                  "custom call, not the kernels'); GPU µs: the attention kernels' own time per op from a profile "
                  "(with --profile).", "",
                  f"| B | N | H | S |{col} splits | kernel µs | GPU µs | % roofline |",
                  f"|---|---|---|---|{rule}---|---|---|---|"]
        for r in sweep:
            lines.append(f"| {r['b']} | {r['n']} | {r['h']} | {r['s']:,} | "
                         + (f"{r.get('kernel', 'wide')} | " if named else "")
                         + f"{r['splits']} | {us(r['kernel_s'])} | {us(r.get('gpu_s'))} | "
                         f"{pct(r['kernel_s'], r['roofline_s'])} |")
    with open(os.path.join(out_dir, "mla_verify.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if rows:
        plot(out_dir, meta, rows)


def plot(out_dir: str, meta: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hs, ns = sorted({r["h"] for r in rows}), sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(len(hs), len(ns), figsize=(4.2 * len(ns), 3.4 * len(hs)), squeeze=False, sharey=True)
    for i, h in enumerate(hs):
        for j, n in enumerate(ns):
            ax = axes[i][j]
            for b, color in ((1, "tab:blue"), (8, "tab:orange")):
                sel = sorted((r for r in rows if r["h"] == h and r["n"] == n and r["b"] == b), key=lambda r: r["s"])
                if not sel:
                    continue
                ax.plot([r["s"] for r in sel], [100 * r["roofline_s"] / r["kernel_s"] for r in sel], "o-",
                        color=color, label=f"kernel B={b}")
                xs = [r for r in sel if r["xla_s"] is not None]
                ax.plot([r["s"] for r in xs], [100 * r["roofline_s"] / r["xla_s"] for r in xs], "s--", color=color,
                        alpha=0.6, label=f"XLA B={b}")
            ax.axhline(70, color="gray", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_title(f"H={h}, N={n}")
            ax.set_xlabel("S (cached tokens)")
            if j == 0:
                ax.set_ylabel("% of roofline")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"mla_verify vs roofline: {meta['device']}, {meta['date']}, commit {meta['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "mla_verify.png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="ten configurations instead of the full grid")
    ap.add_argument("--sweep", action="store_true", help="also time several key-split counts in the decode regime")
    ap.add_argument("--profile", action="store_true",
                    help="in the sweep, also the kernels' GPU time per op from a profile (not bounded by host time)")
    ap.add_argument("--sweep-at", metavar="B:N:H:S,...",
                    help="sweep only these cases (splits 1, 2, 4, .. 128; no grid)")
    add_report_args(ap, "configurations", "mla_verify")
    args = ap.parse_args()
    if replot(args, write_report):
        return

    ceil = ceilings()
    import jax

    dev = jax.devices()[0]
    meta = dict(date=datetime.date.today().isoformat(), device=f"{dev.device_kind} ({dev.platform})",
                commit=args.commit, jax=jax.__version__, **ceil)
    print(f"ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, matmul {ceil['matmul_flops'] / 1e12:.0f} TFLOP/s",
          flush=True)
    start = time.perf_counter()
    rows, sweep = [], []
    for b, n, h, s in ([] if args.sweep_at else grid(args.quick)):
        if time.perf_counter() - start > args.budget:
            print(f"budget reached: skipping B={b} N={n} H={h} S={s}", flush=True)
            continue
        r = measure(b, n, h, s, ceil)[0]
        rows.append(r)
        xla = "-" if r["xla_s"] is None else f"{r['xla_s'] * 1e6:.1f}"
        print(f"B={b} N={n} H={h} S={s}: kernel {r['kernel_s'] * 1e6:.1f} us "
              f"({100 * r['roofline_s'] / r['kernel_s']:.0f}% of roofline), XLA {xla} us, "
              f"splits {r['splits']}, err {r['rel_err_vs_xla']}", flush=True)
    if args.sweep or args.sweep_at:
        from kdtree_jax.kernels.mla_verify import plan_splits

        cases = ([tuple(int(v) for v in c.split(":")) for c in args.sweep_at.split(",")] if args.sweep_at
                 else sweep_cases())
        for b, n, h, s in cases:
            if time.perf_counter() - start > args.budget:
                break
            base = plan_splits(b, n, h, s)
            options = sorted({max(1, base // 4), max(1, base // 2), base, 2 * base, max(1, s // 64 // 16)})
            if args.sweep_at:
                options = sorted({base, *(2 ** i for i in range(8) if 2 ** i <= -(-(s + n) // 64))})
            for r in measure(b, n, h, s, ceil, with_xla=False, splits_list=options, profile=args.profile):
                sweep.append(r)
                gpu = "" if r["gpu_s"] is None else f", GPU {r['gpu_s'] * 1e6:.1f} us"
                print(f"sweep B={b} N={n} H={h} S={s} splits {r['splits']}: "
                      f"{r['kernel_s'] * 1e6:.1f} us{gpu}", flush=True)
    write_report(args.out, meta, rows, sweep)


if __name__ == "__main__":
    main()
