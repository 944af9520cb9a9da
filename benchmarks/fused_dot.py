"""The dense calls of a layer at a decode step's few rows: the `fused_dot` custom call against XLA's own operations for
the same math (its reference, which is what the model runs without it), and both against the bytes floor, side by
side in one process.

For each call of one device's share of an ep=8 K2.6 layer and each M, one jitted chain of L distinct weight sets
(L x their bytes > 4 x the L2, so no weight is read from L2), each call's input depending on the last one's output
(scaled by one of its columns: a small fusion between calls, the same in both variants):

    attn_in     RMSNorm + q_a/kv_a                               7168 -> 2112
    o_res       o projection + the residual                      1024 -> 7168
    ffn_in      RMSNorm + router logits (f32) + the shared expert's gate/up and SwiGLU + the normalized rows
                                                                 7168 -> 384 + 512
    shared_out  the shared expert's down + the experts' output + the residual    256 -> 7168
    dense_in    a dense layer's RMSNorm + gate/up + SwiGLU       7168 -> 4608
    dense_out   its down + the residual                          2304 -> 7168

Per call: the wall time of the chain / L (queued calls, median), the bytes floor (weights + inputs + outputs at the
copy bandwidth measured in the same run), the ratio, and the custom call's speedup over XLA's operations.

    python benchmarks/fused_dot.py                         # on a GPU (~1 minute)
    python benchmarks/fused_dot.py --quick --out /tmp/f    # CPU smoke run (tiny shapes)
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from common import ceilings, timed  # noqa: E402
from kdtree_jax.kernels.fused_dot import MAX_CORE_ROWS, MAX_ROWS  # noqa: E402

# name: (K, N, N2, norm, addends, gated, gated2, out dtype, want_xn)
CALLS = {"attn_in": (7168, 2112, 0, True, 0, False, False, "bfloat16", False),
         "o_res": (1024, 7168, 0, False, 1, False, False, "bfloat16", False),
         "ffn_in": (7168, 384, 512, True, 0, False, True, "float32", True),
         "shared_out": (256, 7168, 0, False, 2, False, False, "bfloat16", False),
         "dense_in": (7168, 4608, 0, True, 0, True, False, "bfloat16", False),
         "dense_out": (2304, 7168, 0, False, 1, False, False, "bfloat16", False)}
QUICK = {"attn_in": (128, 96), "o_res": (64, 128), "ffn_in": (128, 32), "shared_out": (64, 128),
         "dense_in": (128, 64), "dense_out": (64, 128)}
MS = (1, 2, 4)
L2_BYTES = 50 * 2**20


def call_bytes(k, n, n2, norm, adds, gated, gated2, dt, want_xn, m) -> int:
    """Weights once, x, the addends and the outputs (bf16 but a float32 first output)."""
    outs = m * ((n // 2 if gated else n) * (4 if dt == "float32" else 2) + (n2 // 2 if gated2 else n2) * 2)
    return 2 * (k * (n + n2) + (k if norm else 0) + m * k * (1 + want_xn) + adds * m * (n // 2 if gated else n)) + outs


def chain(spec, variant: str, flags: int):
    from kdtree_jax.kernels.fused_dot import fused_dot

    k, n, n2, norm, adds, gated, gated2, dt, want_xn = spec

    def f(x, sets):
        y = None
        for w, w2, nw, extra in sets:
            y, y2, xn = fused_dot(x, w, w2=w2, norm=nw, adds=extra, gated=gated, gated2=gated2,
                                  out_dtype=jnp.dtype(dt), want_xn=want_xn, impl="ffi" if variant == "fused" else "xla",
                                  flags=flags)
            dep = y[:, :1].astype(jnp.float32)
            if y2 is not None:
                dep = dep + y2[:, :1].astype(jnp.float32)
            if xn is not None:
                dep = dep + xn[:, :1].astype(jnp.float32)
            x = x * (1 + 1e-3 * dep).astype(x.dtype)
        return y
    return f


def measure(name: str, spec, m: int, variant: str, bw: float, quick: bool, flags: int = 2) -> dict:
    k, n, n2, norm, adds, gated, gated2, dt, want_xn = spec
    wbytes = 2 * k * (n + n2)
    count = 2 if quick else max(6, int(np.ceil(4 * L2_BYTES / wbytes)))
    key = jax.random.key(hash((name, k, n)) % 2**31)
    bf = jnp.bfloat16
    out = n // 2 if gated else n

    def one(i):
        ks = jax.random.split(jax.random.fold_in(key, i), 4)
        return ((jax.random.normal(ks[0], (k, n), bf) * 0.02),
                (jax.random.normal(ks[1], (k, n2), bf) * 0.02) if n2 else None,
                (1 + 0.1 * jax.random.normal(ks[2], (k,), bf)) if norm else None,
                tuple(jax.random.normal(jax.random.fold_in(ks[3], j), (m, out), bf) for j in range(adds)))

    sets = [one(i) for i in range(count)]
    x = jax.random.normal(jax.random.fold_in(key, 999), (m, k), bf)
    fn = jax.jit(chain(spec, variant, flags))
    sec, _ = timed(fn, (x, sets), count, min_batch=0.02, samples=5)
    floor = call_bytes(*spec, m) / bw
    del sets
    label = "XLA's operations" if variant == "xla" else ("fused_dot" if flags == 2 else f"fused_dot, flags {flags}")
    return dict(name=name, k=k, n=n, n2=n2, m=m, variant=label, flags=flags, calls=count, us=sec * 1e6,
                floor_us=floor * 1e6, x_floor=sec / floor)


def write_report(out: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fused_dot.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = [f"# A layer's dense calls at small M: fused_dot against XLA's operations ({meta['date']}, "
             f"{meta['device']}, commit {meta['commit']})", "",
             f"`{meta['command']}`; jax {meta['jax']}; copy bandwidth measured in this run "
             f"{meta['copy_Bps'] / 1e12:.2f} TB/s. Each cell: µs per call (a chain of distinct weights, each call's "
             "input depending on the last) and, in parentheses, the call over its bytes floor; speedup: XLA's "
             "operations over the first fused_dot column. Flags: 2 = the weights' first stages loaded before the "
             "wait for the kernel ahead (the model's), 4 = whole 256-byte L2 lines asked for, 8 = the tensor-core "
             "kernel at M <= 4 (past 4 it always runs).", "",
             "| call | K -> N | MB | M | " + " | ".join(variants) + " | speedup | floor µs |",
             "|" + "---|" * (len(variants) + 6)]
    by = {(r["name"], r["m"], r["variant"]): r for r in rows}
    fused = next((v for v in variants if v.startswith("fused_dot")), None)
    for name in CALLS:
        for m in sorted({r["m"] for r in rows}):
            cells = [by.get((name, m, v)) for v in variants]
            if not any(cells):
                continue
            c = next(r for r in cells if r)
            shape = f"{c['k']} -> {c['n']}" + (f" + {c['n2']}" if c["n2"] else "")
            f, x = by.get((name, m, fused)), by.get((name, m, "XLA's operations"))
            speed = f"{x['us'] / f['us']:.2f}x" if f and x else "-"
            lines.append(f"| {name} | {shape} | {2 * c['k'] * (c['n'] + c['n2']) / 1e6:.1f} | {m} | " + " | ".join(
                f"{r['us']:.1f} ({r['x_floor']:.1f}x)" if r else "-" for r in cells) +
                f" | {speed} | {c['floor_us']:.1f} |")
    with open(os.path.join(out, "fused_dot.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "fused_dot"), help="folder for the .md and .json")
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"),
                    help="commit stamped on the results")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts M, comma-separated (at most "
                    f"{MAX_ROWS}, the custom call's rows on a GPU; the tensor cores past {MAX_CORE_ROWS})")
    ap.add_argument("--calls", default=",".join(CALLS), help="calls, comma-separated, of: " + ", ".join(CALLS))
    ap.add_argument("--flags", default="2", help="fused_dot's flags, one column each, comma-separated (2: the "
                    "model's, FLAG_WEIGHT_PARAM; 6: + FLAG_L2_LINES; 10: + FLAG_MMA, the tensor cores at M <= 4)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, two calls a chain")
    ap.add_argument("--replot", metavar="JSON", help="rewrite the report from saved numbers")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        write_report(os.path.dirname(os.path.abspath(args.replot)), saved["meta"], saved["rows"])
        return 0
    names = [s.strip() for s in args.calls.split(",") if s.strip()]
    if set(names) - set(CALLS):
        ap.error(f"unknown calls {sorted(set(names) - set(CALLS))}; known: {', '.join(CALLS)}")
    ms = [int(v) for v in args.ms.split(",")]
    flag_list = [int(v) for v in args.flags.split(",")]
    if any(not 1 <= m <= MAX_ROWS for m in ms):
        ap.error(f"--ms: each M must be in 1..{MAX_ROWS} (the custom call's rows on a GPU), got {ms}")
    bw = ceilings()["copy_Bps"] if not args.quick else 1e11
    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, commit=args.commit,
                jax=jax.__version__, copy_Bps=bw, command="python benchmarks/fused_dot.py " + " ".join(
                    argv if argv is not None else sys.argv[1:]))
    rows = []
    t0 = time.perf_counter()
    for name in names:
        spec = CALLS[name]
        if args.quick:
            spec = QUICK[name] + spec[2:]
            spec = (spec[0], spec[1], 32 if spec[2] else 0) + spec[3:]
        for m in ms:
            for variant, flags in [("fused", fl) for fl in flag_list] + [("xla", 0)]:
                r = measure(name, spec, m, variant, bw, args.quick, flags)
                rows.append(r)
                print(f"{name:11s} M={m:3d} {r['variant']:24s} {r['us']:8.2f} us  {r['x_floor']:5.2f}x floor  "
                      f"[{time.perf_counter() - t0:.0f} s]", flush=True)
        write_report(args.out, meta, rows)
    print(open(os.path.join(args.out, "fused_dot.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
