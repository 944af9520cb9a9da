"""The fixed cost of the small-M custom calls: is it their work, or a cold start?

In the full per-device step (results/full_scale) the custom calls take far longer than their work at C = 1: the
routing kernel ~10 µs, `MlaVerifyKernel` ~17 µs at 4k context (the cache read is ~1 µs), the MoE GEMMs ~15 µs for one
expert, while XLA's small fusions take 1-3 µs. One explanation: their code (large, unrolled, run once per layer by
few warps) is fetched cold each layer, since the weight stream evicts it from L2. This benchmark times each op's
kernels (GPU time per launch, from a profile) in two settings inside one compiled loop:

    hot    the op called `--calls` times in a row, each call's inputs depending on the last one's output
    cold   the same, each call first waiting for a pass over a buffer 4x the L2 (`--flush-mb`), as a layer's weights
           pass between two calls of the same kernel in the full step

Cases, one device's share of K2.6 on an ep=8 mesh at C = 1 (`--small`: tiny shapes for a CPU smoke run, wall times
only): moe_route (M = 1, E = 384, k = 8), mla_verify (B = 1, N = 1, H = 8, S = 4,096; and N = 17), marlin_moe (M = 1,
48 local experts, one of the 8 slots local: the stream path (the GEMV path switched off: KDTREE_JAX_MOE_GEMV=0 while
it is traced) with its programmatic dependent launches and with plain ones (flag FLAG_SERIAL); the GEMV decode path,
FLAG_GEMV, the default at K2's shapes, with one and with all eight slots local, and the stream path with eight),
mla_pre (M = 1 and 17, 8 heads, Rq = 1,536: the custom call and XLA's own operations), and the control:
XLA's own fusion of an RMSNorm over [1, 7168]. For the MoE, also the span from its first kernel's start to its last
kernel's end: with programmatic dependent launch each kernel starts early and waits for the one before it, so the
per-kernel times overstate each kernel and the chain's length is only seen whole.

    python benchmarks/fixed_cost.py                          # on a GPU: results/fixed_cost/
    python benchmarks/fixed_cost.py --small --out /tmp/x     # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from profile_tools import profile_calls  # noqa: E402

MOE_CHAIN = ("AlignKernel", "CombineKernel8")  # the MoE's first and last kernel at M = 1 (bf16, k = 8)
GEMV_CHAIN = ("GemvUpKernel", "GemvDownKernel")  # the same on the GEMV decode path (FLAG_GEMV; its combine in gemv2)


def _stream_path(call):
    """call() with the GEMV decode path switched off while it runs (it runs when the op is traced): the MoE's
    stream path with its default flags."""
    before = os.environ.get("KDTREE_JAX_MOE_GEMV")
    os.environ["KDTREE_JAX_MOE_GEMV"] = "0"
    try:
        return call()
    finally:
        if before is None:
            del os.environ["KDTREE_JAX_MOE_GEMV"]
        else:
            os.environ["KDTREE_JAX_MOE_GEMV"] = before


def cases(small: bool):
    """{name: (fn(inputs, dep) -> output, inputs)}: dep is a scalar the inputs are perturbed by (zero in value, it
    orders the call after whatever computed it)."""
    import jax
    import jax.numpy as jnp

    from kdtree_jax.kernels.marlin_moe import FLAG_GEMV, FLAG_SERIAL, marlin_moe
    from kdtree_jax.kernels.mla_verify import mla_verify
    from kdtree_jax.kernels.moe_route import moe_route
    from kdtree_jax.quant import Int4Array

    key = iter(jax.random.split(jax.random.key(0), 32))
    e, d, f, local = (16, 256, 128, 4) if small else (384, 7168, 2048, 48)
    s, h, r, dr = (256, 8, 512, 64) if small else (4096, 8, 512, 64)
    bf = jnp.bfloat16
    out = {}

    logits = jax.random.normal(next(key), (1, e), jnp.float32)
    bias = 0.05 * jax.random.normal(next(key), (e,), jnp.float32)
    out["moe_route M=1"] = (lambda a, dep: moe_route(a[0] + dep, a[1], k=8, scale=2.827)[1], (logits, bias))

    for n in (1, 17):
        q = jax.random.normal(next(key), (1, n, h, r), bf)
        qp = jax.random.normal(next(key), (1, n, h, dr), bf)
        lat = jax.random.normal(next(key), (1, s, r), bf)
        pe = jax.random.normal(next(key), (1, s, dr), bf)
        lens, mask = jnp.full((1,), s - n, jnp.int32), jnp.tril(jnp.ones((1, n, n), bool))
        out[f"mla_verify 1x{n} S={s}"] = (
            lambda a, dep: mla_verify(a[0] + dep.astype(bf), *a[1:], 0.1), (q, qp, lat, pe, lens, mask))

    def int4(rows, cols):
        packed = jax.lax.bitcast_convert_type(jax.random.bits(next(key), (local, rows, cols // 8), jnp.uint32),
                                              jnp.int32)
        return Int4Array(packed, (0.01 * jnp.ones((local, rows, cols // 32))).astype(bf))

    x = jax.random.normal(next(key), (1, d), bf)
    ids = jnp.asarray([[3] + [local] * 7], jnp.int32)  # one local slot, seven on other devices' experts
    weights = jnp.asarray([[0.3] + [0.0] * 7], jnp.float32)
    experts = (int4(f, d), int4(f, d), int4(d, f))
    out["marlin_moe M=1 (1 local)"] = (  # the stream path
        lambda a, dep: _stream_path(lambda: marlin_moe(a[0] + dep.astype(bf), a[1], a[2], *a[3], experts_total=e)),
        (x, ids, weights, experts))
    out["marlin_moe M=1 (1 local), plain launches"] = (  # the same without programmatic dependent launch
        lambda a, dep: marlin_moe(a[0] + dep.astype(bf), a[1], a[2], *a[3], experts_total=e, flags=FLAG_SERIAL),
        (x, ids, weights, experts))
    if not small:  # the GEMV decode path (K2's shapes only): one local slot, and all eight local (one GPU)
        everywhere = jnp.asarray([[3, 7, 11, 19, 23, 29, 31, 40]], jnp.int32)
        for label, ii, ww in (("1 local", ids, weights), ("8 local", everywhere, jnp.full((1, 8), 0.1, jnp.float32))):
            out[f"marlin_moe M=1 ({label}), GEMV path"] = (
                lambda a, dep: marlin_moe(a[0] + dep.astype(bf), a[1], a[2], *a[3], experts_total=e, flags=FLAG_GEMV),
                (x, ii, ww, experts))
        out["marlin_moe M=1 (8 local)"] = (  # the stream path
            lambda a, dep: _stream_path(lambda: marlin_moe(a[0] + dep.astype(bf), a[1], a[2], *a[3],
                                                           experts_total=e)),
            (x, everywhere, jnp.full((1, 8), 0.1, jnp.float32), experts))

    # mla_pre at one device's share (8 heads, Rq 1536): the custom call and XLA's own operations (its reference);
    # the caches are carried by the loop (fn returns (y, new inputs)), so that both update them in place
    from kdtree_jax.kernels.mla_pre import mla_pre
    hq, rq = (2, 512) if small else (8, 1536)
    q_b = (0.03 * jax.random.normal(next(key), (hq, 192, rq), jnp.float32)).astype(bf)
    k_b = (0.1 * jax.random.normal(next(key), (r, hq, 128), jnp.float32)).astype(bf)
    qn, kvn = (1.0 + 0.1 * jax.random.normal(next(key), (w,), jnp.float32).astype(bf) for w in (rq, r))
    for n in (1, 17):
        a = jax.random.normal(next(key), (1, n, rq + r + dr), bf)
        ang = jax.random.uniform(next(key), (1, n, dr // 2), jnp.float32, 0.0, 6.28)
        caches = (jax.random.normal(next(key), (1, s, r), bf), jax.random.normal(next(key), (1, s, dr), bf))
        for impl in ("ffi", "xla"):
            def pre(args, dep, impl=impl):
                a, qn, kvn, q_b, k_b, cos, sin, lat, pe, starts = args
                q_lat, q_pe, lat, pe = mla_pre(a + dep.astype(bf), qn, kvn, q_b, k_b, cos, sin, lat, pe, starts,
                                               eps=1e-6, impl=impl)
                return (q_lat, (a, qn, kvn, q_b, k_b, cos, sin, lat, pe, starts))
            label = "custom call" if impl == "ffi" else "XLA reference"
            out[f"mla_pre 1x{n} ({label})"] = (pre, (a, qn, kvn, q_b, k_b, jnp.cos(ang), jnp.sin(ang), *caches,
                                                      jnp.full((1,), s - n, jnp.int32)))

    norm = jnp.ones((d,), bf)

    def rms(a, dep):
        xf = (a[0] + dep.astype(bf)).astype(jnp.float32)
        return (a[1] * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(bf))

    out["control: XLA rms_norm [1, 7168]" if not small else "control: XLA rms_norm"] = (rms, (x, norm))
    return out


def loop(fn, calls: int, flush: bool):
    """jit(inputs, buffer) -> ...: `calls` calls of fn, each after the last (and after a pass over buffer)."""
    import jax
    import jax.numpy as jnp

    def body(_, carry):
        inputs, buf, dep = carry
        if flush:
            buf = buf * jnp.asarray(1.0001, buf.dtype)
            dep = dep + 0.0 * jnp.sum(buf, dtype=jnp.float32)  # every element read (a slice would let XLA skip it)
        y = fn(inputs, dep)
        if isinstance(y, tuple):  # (output, the inputs of the next call): state the op updates in place
            y, inputs = y
        return inputs, buf, 0.0 * jnp.sum(y.astype(jnp.float32))

    return jax.jit(lambda inputs, buf: jax.lax.fori_loop(0, calls, body, (inputs, buf, jnp.float32(0.0)))[2])


def measure(name, fn, inputs, calls: int, flush_bytes: int, gpu: bool) -> dict:
    import jax
    import jax.numpy as jnp

    buf = jnp.ones((flush_bytes // 2,), jnp.bfloat16)
    row = dict(case=name)
    for mode in ("hot", "cold"):
        run = loop(fn, calls, mode == "cold")
        jax.block_until_ready(run(inputs, buf))
        t0 = time.perf_counter()
        jax.block_until_ready(run(inputs, buf))
        row[f"{mode}_wall_us"] = 1e6 * (time.perf_counter() - t0) / calls
        if gpu:
            chain = (GEMV_CHAIN if "GEMV" in name else MOE_CHAIN) if name.startswith("marlin_moe") else None
            prof = profile_calls(lambda a, b: run(a, b), (inputs, buf), 3, chain=chain)
            if chain is not None and prof["chain_us"]:
                row[f"{mode}_chain_us"] = float(np.median(prof["chain_us"]))
            # every kernel launched about once a call or more, however slow (the report shows the hot run's kernels:
            # the flush pass's own appear in the cold run only, and an op kernel that shares a name with one of them
            # is marked there by its launch count)
            row[f"{mode}_kernels"] = {k: [n / calls, us / max(n, 1e-9)] for k, (n, us) in prof["kernels"].items()
                                      if n >= calls * 0.9}
    return row


def write_report(out_dir: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fixed_cost.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Fixed cost of the small-M custom calls ({meta['date']}, {meta['device']}, commit {meta['commit']})",
             "",
             f"GPU time per launch from a profile, each op called {meta['calls']} times in one compiled loop: hot "
             f"(back to back) and cold (each call after a pass over {meta['flush_mb']} MB, which evicts the L2). "
             "`python benchmarks/fixed_cost.py`. A kernel launched more often cold than hot shares its name with a "
             "kernel of the flush pass, which its cold time then includes: marked, not a measurement of the op.", "",
             "| case | kernel | launches a call (hot / cold) | hot µs | cold µs | cold - hot µs |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        hot, cold = r.get("hot_kernels"), r.get("cold_kernels")
        if hot is None:
            lines.append(f"| {r['case']} | (wall time, no GPU profile) | - | {r['hot_wall_us']:.1f} | "
                         f"{r['cold_wall_us']:.1f} | {r['cold_wall_us'] - r['hot_wall_us']:.1f} |")
            continue
        for k in sorted(hot, key=lambda k: -hot[k][1]):
            c = cold.get(k, [0, float("nan")])
            mixed = abs(c[0] - hot[k][0]) > 0.05
            diff = "(with the flush's)" if mixed else f"{c[1] - hot[k][1]:.1f}"
            lines.append(f"| {r['case']} | `{k[:60]}` | {hot[k][0]:.1f} / {c[0]:.1f} | {hot[k][1]:.1f} | "
                         f"{c[1]:.1f} | {diff} |")
    chains = [r for r in rows if "hot_chain_us" in r]
    if chains:
        lines += ["", f"The MoE as one span: from the start of `{MOE_CHAIN[0]}` to the end of the next "
                  f"`{MOE_CHAIN[1]}` (on the GEMV path from `{GEMV_CHAIN[0]}` to `{GEMV_CHAIN[1]}`; median over the "
                  "profiled calls). With programmatic dependent launch a kernel starts while the one before it runs "
                  "and waits for it, so its time above includes that wait; the span counts the chain once.", "",
                  "| case | hot span µs | cold span µs |", "|---|---|---|"]
        lines += [f"| {r['case']} | {r['hot_chain_us']:.1f} | {r.get('cold_chain_us', float('nan')):.1f} |"
                  for r in chains]
    with open(os.path.join(out_dir, "fixed_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "fixed_cost"))
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"))
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--calls", type=int, default=50, help="calls of each op per compiled loop")
    ap.add_argument("--flush-mb", type=int, default=256, help="the buffer passed over before each cold call")
    ap.add_argument("--replot", metavar="JSON", help="rewrite the table next to a saved fixed_cost.json")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        write_report(os.path.dirname(os.path.abspath(args.replot)), saved["meta"], saved["rows"])
        return 0
    import jax

    gpu = jax.default_backend() == "gpu"
    flush_mb = args.flush_mb if not args.small else 4
    meta = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind), commit=args.commit,
                calls=args.calls, flush_mb=flush_mb)
    rows = []
    for name, (fn, inputs) in cases(args.small).items():
        rows.append(measure(name, fn, inputs, args.calls, flush_mb << 20, gpu))
        print(f"{name}: hot {rows[-1]['hot_wall_us']:.1f} µs, cold {rows[-1]['cold_wall_us']:.1f} µs a call (wall)",
              flush=True)
        write_report(args.out, meta, rows)
    print(open(os.path.join(args.out, "fixed_cost.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
