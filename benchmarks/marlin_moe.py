"""marlin_moe on one GPU at the Kimi K2 shape (E = 384, hidden 7,168, inter 2,048, top-8, INT4 group 32, bf16
activations) and at the per-device shape of an 8-GPU expert-parallel mesh (48 local experts; the same top-8 of 384
routing, each shard seeing its own slots and the id 48 = no expert for the others' slots, about one local slot per
token), for M = 1, 2, 4, ..., 4,096 tokens: the CUDA kernel against the bandwidth floor measured in the same run.

floor = bytes of the distinct experts the routing touches (24.77 MB each: packed nibbles + bf16 scales) / copy
bandwidth (bytes read + written by a 1 GiB device copy, measured now); FLOPs floor = 2 * 3 * F * D * routed slots /
the bf16 matmul rate of an 8192^3 product measured now. Routing: k = 8 distinct uniform random experts per token,
fresh for every input set; each timed batch (one jitted call) runs the op on several sets (different experts: 32 up
to M = 256, so that the host's dispatch of the batch stays under its GPU time, else 4), so the weights do not sit in
L2 between calls; time = median per op.

Variants (--variants, comma separated): `after` = marlin_moe as shipped (block_m and path by M); `before` = the
kernel of an older build (--baseline-lib: a libkdtree_jax_cuda.so whose handler was compiled as KdMarlinMoeCudaOld,
called as that version did: block_m = block_size(M), no flags); `base` = the --baseline-lib handler of a build with
today's attributes, called exactly as `after` (an A/B of two kernel versions in one run); `local` = the defaults but
the block size chosen from the shard's own experts (as before 2026-12-01: at the per-device shape M k / 48
overstated the slots per expert 8-fold); `stream` / `tile64` / `tile128` force a path, `stream8` / `stream16` /
`stream32` the stream path with that block size, `tile16` / `tile32` the tile path's narrow tiles (FLAG_TILE)
(`+l2`, `+sync`, `+deep`, `+serial`, `+fine`, `+persist`, `+xl1`, `+fused` add FLAG_L2_256, FLAG_SYNC, FLAG_DEEP,
FLAG_SERIAL, FLAG_FINE, FLAG_PERSIST, FLAG_X_L1, FLAG_FUSED (`after+fused`: the fused decode path, one launch;
`after+fusedone`: it on one block an SM);
`after+deep` = the defaults plus FLAG_DEEP, `after+serial` the defaults with the stream path's kernels launched
plainly, one after the other).
`triton` = benchmarks/triton_moe.py, a Triton W4A16 fused MoE of the vLLM family on the same inputs (torch shares
the JAX buffers), its block shapes tuned per M, timed per op over the same sets as CUDA-graph replays (align, both
gemms and the combine; its row says "graph", or "eager" where the capture failed and host dispatch is included).
Each variant's output is compared with `after`'s (rel err).

usage: python benchmarks/marlin_moe.py [--quick] [--shapes k2,device] [--variants after,before] [--ms 1,64,4096]
                                       [--baseline-lib PATH] [--xla] [--out DIR] [--commit SHA] [--budget SECONDS]
       python benchmarks/marlin_moe.py --plot DIR/marlin_moe.json      (redraw the table and plot from saved numbers)
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib
import json
import math
import os
import statistics
import time

import numpy as np
from common import add_report_args, ceilings, replot, timed

E, D, F, TOPK, GROUP = 384, 7168, 2048, 8, 32
EP = 8  # the per-device shape: E / EP local experts
EXPERT_BYTES = (3 * F * D) // 2 + 2 * (3 * F * D) // GROUP  # nibbles + bf16 scales of gate, up and down
SETS = 4  # routing sets per timed batch of the kernel above SMALL_M tokens
SMALL_SETS, SMALL_M = 32, 256  # up to SMALL_M tokens: 32 sets per batch, so that dispatching the batch (host time:
# 6-17 us per custom call in batches of 32, 18-22 in batches of 4, H200 2026-12-02,
# results/marlin_moe/runs/2026-12-02_daa4b82_stages/marlin_stages.txt) stays under the GPU time; with 4 sets the
# per-device M = 1 call measured 38 us per op, with 32 sets 25 us
GOALS = ("goals (issue 18): >= 75% of the bandwidth floor for M <= 64 and for M = 256 .. 1,024 (<= 3 ms at M = "
         "1,024 on the K2 shape); M = 4,096 within 1.5x of max(bytes floor, FLOPs floor); the same at the per-device "
         "shape")
BASELINE_TARGET = "kdtree_marlin_moe_before"


def variants_at(spec: str, m: int | None = None) -> list[str]:
    """The extra variants that --variants-at gives M = m ('1,16=stream,tile64;4096=tile128': stream and tile64 at
    M = 1 and 16), or at any M (m None), each once, in the order given."""
    out = []
    for group in spec.split(";"):
        if "=" not in group:
            continue
        ms, names = group.split("=", 1)
        if m is None or str(m) in [x.strip() for x in ms.split(",")]:
            out += [v.strip() for v in names.split(",") if v.strip() and v.strip() not in out]
    return out


def sets_for(m: int) -> int:
    """Routing sets in one timed batch of the kernel at M tokens."""
    return SMALL_SETS if m <= SMALL_M else SETS


def experts(n_experts: int, seed: int = 0):
    """Random INT4 experts of the K2 widths, built on the device: (gate, up [n, F, D], down [n, D, F]) Int4Array."""
    import jax
    import jax.numpy as jnp

    from kdtree_jax.quant import Int4Array

    def one(key, rows, cols):
        k1, k2 = jax.random.split(key)
        packed = jax.lax.bitcast_convert_type(jax.random.bits(k1, (n_experts, rows, cols // 8), jnp.uint32),
                                              jnp.int32)
        scale = jax.random.uniform(k2, (n_experts, rows, cols // GROUP), jnp.float32, 0.5, 1.5) / (4 * math.sqrt(cols))
        return Int4Array(packed, scale.astype(jnp.bfloat16))

    make = jax.jit(one, static_argnums=(1, 2))
    keys = jax.random.split(jax.random.key(seed), 3)
    return make(keys[0], F, D), make(keys[1], F, D), make(keys[2], D, F)


def routing_sets(m: int, count: int, seed: int, local: int | None):
    """`count` (x [M, D] bf16, ids [M, 8] int32, weights [M, 8] fp32) with fresh uniform top-8-of-384 routings; with
    `local`, the ids of shard 0 of an expert-parallel mesh (ids < local kept, the others = local: no expert, their
    weights 0, as `sharding.moe_expert_parallel` passes them). Also the distinct experts and routed slots of each."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    sets, touched, routed = [], [], []
    for i in range(count):
        ids = np.argsort(rng.random((m, E)), axis=1)[:, :TOPK].astype(np.int32)
        w = rng.uniform(0.1, 1.0, size=(m, TOPK)).astype(np.float32)
        w /= w.sum(axis=1, keepdims=True)
        if local is not None:
            mine = ids < local
            ids, w = np.where(mine, ids, local).astype(np.int32), np.where(mine, w, 0.0).astype(np.float32)
        x = jax.random.normal(jax.random.key(seed * 100 + i), (m, D), jnp.bfloat16)
        sets.append((x, jnp.asarray(ids), jnp.asarray(w)))
        valid = ids[ids < (local or E)]
        touched.append(len(np.unique(valid)))
        routed.append(valid.size)
    return sets, touched, routed


def register_baseline(path: str) -> None:
    """Registers the handler KdMarlinMoeCudaOld of an older libkdtree_jax_cuda.so as BASELINE_TARGET (CUDA)."""
    import jax

    lib = ctypes.CDLL(path)
    jax.ffi.register_ffi_target(BASELINE_TARGET, jax.ffi.pycapsule(lib.KdMarlinMoeCudaOld), platform="CUDA")


def baseline_call(x, ids, weights, we_gate, we_up, we_down):
    """The older kernel as that version called it: block_m = block_size(M) (8 / 16 / 32), no attributes."""
    import jax
    import jax.numpy as jnp

    mm = importlib.import_module("kdtree_jax.kernels.marlin_moe")
    block_size, max_blocks = mm.block_size, mm.max_blocks

    m, k, e = x.shape[0], ids.shape[1], we_gate.shape[0]
    bm = block_size(m, k, e)
    nb = max_blocks(m * k, e, bm)
    outs = [jax.ShapeDtypeStruct((m, D), x.dtype), jax.ShapeDtypeStruct((nb * bm,), jnp.int32),
            jax.ShapeDtypeStruct((nb,), jnp.int32), jax.ShapeDtypeStruct((m * k, F), x.dtype),
            jax.ShapeDtypeStruct((m * k, D), x.dtype)]
    args = (x, ids, weights, we_gate.packed, we_gate.scale, we_up.packed, we_up.scale, we_down.packed, we_down.scale)
    return jax.ffi.ffi_call(BASELINE_TARGET, outs, vmap_method="sequential")(*args)[0]


def variant_fn(name: str, m: int, e: int):
    """(callable(x, ids, w, gate, up, down) -> out, block_m, path "stream" / "tile") of a variant, for M tokens and e
    (local) experts of the
    model's E: called as the model calls it (experts_total=E, the block size from the whole routing's density)."""
    mm = importlib.import_module("kdtree_jax.kernels.marlin_moe")  # (the package re-exports the function's name)

    if name == "before":
        return baseline_call, mm.block_size(m, TOPK, e), "stream"
    if name == "base":  # the baseline library's handler, with the path, block_m and flags `after` would pass
        bm, flags = mm.choose_path(m, TOPK, E, True, local=e)

        def call(x, ids, w, g, u, d):
            args = (x, ids.astype("int32"), w.astype("float32"), g.packed, g.scale, u.packed, u.scale, d.packed,
                    d.scale)
            return mm._cuda_call(args, m, D, TOPK, e, F, x.dtype, bm, flags, target=BASELINE_TARGET)[0]
        return call, bm, path_name(mm, bm, flags)
    base, *mods = name.split("+")
    flags = sum({"l2": mm.FLAG_L2_256, "sync": mm.FLAG_SYNC, "serial": mm.FLAG_SERIAL, "deep": mm.FLAG_DEEP,
                 "fine": mm.FLAG_FINE, "persist": mm.FLAG_PERSIST, "xl1": mm.FLAG_X_L1, "fused": mm.FLAG_FUSED,
                 "fusedone": mm.FLAG_FUSED | mm.FLAG_FUSED_ONE}[x]
                for x in mods)
    if base in ("tile16", "tile32"):  # the tile path's narrow tiles (FLAG_TILE), with the tile path's flags
        flags |= mm.FLAG_TILE | mm.TILE_FLAGS
    bm = {"after": None, "stream": mm.block_size(m, TOPK, E), "stream8": 8, "stream16": 16, "stream32": 32,
          "tile16": 16, "tile32": 32, "tile64": 64,
          "tile128": 128,
          "local": mm.choose_block_m(m, TOPK, e, True)}[base]  # local: the block size chosen by e (before 2026-12-01)
    chosen_bm, chosen_flags = mm.choose_path(m, TOPK, E if base == "after" else e, True, local=e)
    shown = bm or chosen_bm
    if base == "after":  # the defaults (path, block_m, flags), plus any flags named
        flags = None if not mods else flags | chosen_flags
    elif base == "local":  # block_m given: the chosen flags passed too, so the path is the one chosen by e
        flags |= chosen_flags
    used = chosen_flags if flags is None else flags
    return (lambda *a: mm.marlin_moe(*a, block_m=bm, flags=flags, experts_total=E)), shown, path_name(mm, shown, used)


def path_name(mm, block_m: int, flags: int) -> str:
    """The path marlin_moe takes with this block size and flags: "fused", "tile", "stream" or "stream+persist"."""
    if flags & mm.FLAG_FUSED:
        return "fused"
    if block_m in mm.TILE_BLOCKS or (block_m in mm.NARROW_TILE_BLOCKS and flags & mm.FLAG_TILE):
        return "tile"
    return "stream+persist" if flags & mm.FLAG_PERSIST else "stream"


def measure(shape: str, m: int, weights, bw: float, flops: float, variants, with_xla: bool,
            triton_budget: float = 45.0) -> list[dict]:
    import jax

    from kdtree_jax.kernels.marlin_moe import marlin_moe_ref

    local = E // EP if shape == "device" else None
    sets, touched, routed = routing_sets(m, sets_for(m), seed=m + (7919 if local else 0), local=local)
    floor = statistics.mean(touched) * EXPERT_BYTES / bw
    flops_floor = 2 * 3 * F * D * statistics.mean(routed) / flops
    rows, outs = [], {}
    if with_xla:
        try:
            xla = jax.jit(lambda st, ex: [marlin_moe_ref(*a, *ex) for a in st])
            xla_s, ref_out = timed(xla, (sets[:1], weights), 1, min_batch=0.05, samples=3)
            outs["xla"] = np.asarray(ref_out[0], np.float32)
            rows.append(dict(shape=shape, m=m, variant="xla", time_s=xla_s, block_m=None))
        except jax.errors.JaxRuntimeError as e:  # out of memory: it dequantizes every expert per call
            print(f"XLA reference failed at M={m}: {str(e).splitlines()[0][:160]}", flush=True)
    for name in variants:
        if name == "triton":  # the Triton anchor (benchmarks/triton_moe.py), tuned per M, timed over the same sets
            try:
                import triton_moe

                got = triton_moe.measure_jax(sets, weights, m, TOPK, local or E, budget_s=triton_budget)
            except Exception as e:  # noqa: BLE001 - no triton / torch there, or it failed: report and go on
                print(f"{shape} M={m} triton: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            outs[name] = got["out"]
            bm, bn, bk, warps, stages = got["config"]
            rows.append(dict(shape=shape, m=m, variant=name, time_s=got["time_s"], block_m=bm,
                             path=f"triton {bm}x{bn}x{bk} w{warps} s{stages}, best of {len(got['tried'])}, "
                                  f"{got['timing']}"))
            continue
        fn, bm, path = variant_fn(name, m, local or E)
        ker = jax.jit(lambda st, ex, fn=fn: [fn(*a, *ex) for a in st])
        try:
            ker_s, ker_out = timed(ker, (sets, weights), len(sets), min_batch=0.05, samples=5)
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            print(f"{shape} M={m} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        outs[name] = np.asarray(ker_out[0], np.float32)
        rows.append(dict(shape=shape, m=m, variant=name, time_s=ker_s, block_m=bm, path=path))
    want = outs.get("after", outs.get("xla"))
    for r in rows:
        r.update(sets=len(sets), touched=statistics.mean(touched), routed=statistics.mean(routed), floor_s=floor,
                 flops_floor_s=flops_floor)
        got = outs[r["variant"]]
        r["finite"] = bool(np.all(np.isfinite(got)))
        r["rel_err"] = (None if want is None or got is want else
                        float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)) if r["finite"]
                        else math.inf)
    return rows


def sets_text(rows: list[dict]) -> str:
    """How many input sets each M's batches held ("32 up to M = 256, 4 above"; rows saved before the count was
    recorded held 4)."""
    by = sorted({(r["m"], r.get("sets", SETS)) for r in rows})
    counts = sorted({n for _, n in by}, reverse=True)
    if len(counts) <= 1:
        return str(counts[0] if counts else SETS)
    parts = [f"{n} up to M = {max(m for m, c in by if c == n):,}" for n in counts[:-1]]
    return ", ".join(parts) + f", {counts[-1]} above"


def shown_path(row: dict | None) -> str:
    """A row's block_m and path ("32 tile"), "-" for no row."""
    return "-" if row is None else f"{row['block_m']} {row.get('path', '')}".strip()


def write_report(out_dir: str, meta: dict, rows: list[dict], sweep=None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "marlin_moe.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, sweep=sweep or []), f, indent=1)
    us = lambda x: "-" if x is None else f"{x * 1e6:,.1f}"
    pct = lambda r: "-" if r is None else f"{100 * r['floor_s'] / r['time_s']:.0f}%"
    err = lambda r: "-" if r is None or r.get("rel_err") is None else f"{r['rel_err']:.1e}"
    lines = [
        "# marlin_moe: the CUDA kernel vs the bandwidth floor (Kimi K2 MoE layer, and one GPU of an 8-GPU mesh)",
        "",
        f"{meta['date']}, {meta['device']}, commit {meta['commit']}, jax {meta['jax']}.",
        (f"Experts of the K2 widths: hidden {D}, inter {F}, INT4 group {GROUP}, bf16 activations, top-{TOPK} of {E} "
         f"uniform random routing. Measured in the same run: copy bandwidth {meta['copy_Bps'] / 1e12:.2f} TB/s "
         f"(bytes read + written), bf16 matmul {meta['matmul_flops'] / 1e12:.0f} TFLOP/s. floor = distinct experts "
         f"touched x {EXPERT_BYTES / 1e6:.2f} MB / copy bandwidth; FLOPs floor = 2 x 3 F D x routed slots / matmul "
         f"rate. Time = median per op of jitted batches over {sets_text(rows)} input sets (a batch's dispatch on the "
         "host must not outlast its GPU time). `before` (`base`: that build called as `after`) = "
         + meta.get("before", "-")
         + "; `after` = this commit (path and block_m chosen by M; `+persist`: the stream path's FLAG_PERSIST)."),
        GOALS + ".",
    ]
    shapes = [s for s in ("k2", "device") if any(r["shape"] == s for r in rows)]
    titles = {"k2": f"K2 shape: {E} experts", "device": f"per-device shape: {E // EP} local experts (ep = {EP})"}
    for shape in shapes:
        sr = [r for r in rows if r["shape"] == shape]
        by = {(r["m"], r["variant"]): r for r in sr}
        lines += ["", f"## {titles[shape]}", "",
                  ("| M | experts touched | floor µs | FLOPs floor µs | before µs | before % of floor | after µs | "
                   "after % of floor | after µs / token | speedup | after block_m | rel err after vs before |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for m in sorted({r["m"] for r in sr}):
            a, b = by.get((m, "after")), by.get((m, "before"))
            ref = a or b
            if ref is None:
                continue
            speed = "-" if a is None or b is None else f"{b['time_s'] / a['time_s']:.2f}x"
            e_ab = "-" if b is None or b.get("rel_err") is None else f"{b['rel_err']:.1e}"
            lines.append(f"| {m:,} | {ref['touched']:.1f} | {us(ref['floor_s'])} | {us(ref['flops_floor_s'])} | "
                         f"{us(b and b['time_s'])} | {pct(b)} | {us(a and a['time_s'])} | {pct(a)} | "
                         f"{us(a and a['time_s'] / m)} | {speed} | {shown_path(a)} | {e_ab} |")
        others = sorted({r["variant"] for r in sr} - {"after", "before"})
        if others:
            lines += ["", f"Other variants ({titles[shape]}): time µs (% of floor; rel err vs after)", "",
                      "| M | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
            for m in sorted({r["m"] for r in sr}):
                cells = []
                for v in others:
                    r = by.get((m, v))
                    cells.append("-" if r is None else f"{us(r['time_s'])} ({pct(r)}; {err(r)})")
                lines.append(f"| {m:,} | " + " | ".join(cells) + " |")
    notes = meta.get("notes") or []
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
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

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    # (base: the baseline build, called as after; triton: the Triton anchor, benchmarks/triton_moe.py)
    styles = {"after": "o-", "before": "s--", "base": "s--", "triton": "^-."}
    for shape, color in (("k2", "C0"), ("device", "C1")):
        sr = [r for r in rows if r["shape"] == shape]
        if not sr:
            continue
        ms = sorted({r["m"] for r in sr})
        floor = {r["m"]: r["floor_s"] for r in sr}
        left.plot(ms, [1e3 * floor[m] for m in ms], ":", color=color, label=f"{shape}: bandwidth floor")
        for v, st in styles.items():
            vr = sorted((r for r in sr if r["variant"] == v), key=lambda r: r["m"])
            if not vr:
                continue
            left.plot([r["m"] for r in vr], [1e3 * r["time_s"] for r in vr], st, color=color, label=f"{shape}: {v}")
            right.plot([r["m"] for r in vr], [100 * r["floor_s"] / r["time_s"] for r in vr], st, color=color,
                       label=f"{shape}: {v}")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("M (tokens)")
    left.set_ylabel("ms per call")
    left.legend(fontsize=7)
    left.grid(alpha=0.3, which="both")
    right.axhline(75, color="gray", lw=0.8, ls=":", label="goal: 75% of the floor")
    right.set_xscale("log", base=2)
    right.set_xlabel("M (tokens)")
    right.set_ylabel("% of bandwidth floor")
    right.set_ylim(0, 105)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    fig.suptitle(f"marlin_moe: {meta['device']}, {meta['date']}, commit {meta['commit']}, "
                 f"copy {meta['copy_Bps'] / 1e12:.2f} TB/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "marlin_moe.png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="M = 1, 4, 16, 64, 256, 1024, 4096 only")
    ap.add_argument("--ms", help="comma-separated M values (overrides --quick)")
    ap.add_argument("--shapes", default="k2,device", help="k2, device or both (comma separated)")
    ap.add_argument("--variants", default="after,before", help="comma separated (see above)")
    ap.add_argument("--variants-at", default="", help="more variants at some M: '1,16=stream,tile64;4096=tile128'")
    ap.add_argument("--variants-at-shapes", default="k2", help="the shapes --variants-at applies to")
    ap.add_argument("--baseline-lib", help="older libkdtree_jax_cuda.so with the handler KdMarlinMoeCudaOld")
    ap.add_argument("--before-label", default="the kernel before issue 18",
                    help="what `before` / `base` is, for the table")
    ap.add_argument("--triton-budget", type=float, default=45.0,
                    help="seconds of tuning the Triton anchor per shape and M (compilation included)")
    ap.add_argument("--xla", action="store_true", help="also time the XLA reference (slow; fails at large M)")
    ap.add_argument("--profile", metavar="SHAPE:M:VARIANT", help="run that op twice and exit (for ncu; several "
                    "comma separated)")
    add_report_args(ap, "sizes", "marlin_moe")
    args = ap.parse_args()
    if replot(args, write_report):
        return

    import jax

    if args.profile:
        for spec in args.profile.split(","):
            shape, m, name = spec.split(":")
            if name in ("before", "base", "triton"):
                raise SystemExit(f"--profile: {name} is not profiled here (this build's marlin_moe variants only)")
            local = E // EP if shape == "device" else None
            weights = experts(local or E)
            seed = 1
            while True:  # a routing that touches no local expert (likely at the device shape, M = 1) says nothing
                (x, ids, w), = (got := routing_sets(int(m), 1, seed=seed, local=local))[0]
                if got[1][0] > 0:
                    break
                seed += 1
            fn = jax.jit(variant_fn(name, int(m), local or E)[0])
            for _ in range(2):
                jax.block_until_ready(fn(x, ids, w, *weights))
            del weights
        return
    variants = [v for v in args.variants.split(",") if v]
    notes, unmeasured = [], set()
    if {"before", "base"} & set(variants + variants_at(args.variants_at)):
        try:
            if not args.baseline_lib:
                raise OSError("no --baseline-lib")
            register_baseline(args.baseline_lib)
        except (OSError, AttributeError) as e:
            notes.append(f"`before` / `base` not measured: {e}")
            print(notes[-1], flush=True)
            unmeasured = {"before", "base"}
            variants = [v for v in variants if v not in unmeasured]
    ceil = ceilings()
    bw, flops = ceil["copy_Bps"], ceil["matmul_flops"]
    dev = jax.devices()[0]
    meta = dict(date=datetime.date.today().isoformat(), device=f"{dev.device_kind} ({dev.platform})",
                commit=args.commit, jax=jax.__version__, copy_Bps=bw, matmul_flops=flops, before=args.before_label,
                triton_budget_s=args.triton_budget,
                notes=notes)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, matmul {flops / 1e12:.0f} TFLOP/s; expert {EXPERT_BYTES / 1e6:.2f} MB",
          flush=True)
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    else:
        ms = [1, 4, 16, 64, 256, 1024, 4096] if args.quick else [2**i for i in range(13)]
    start = time.perf_counter()
    rows = []
    for shape in [s for s in args.shapes.split(",") if s]:
        weights = experts(E // EP if shape == "device" else E)
        for m in ms:
            if time.perf_counter() - start > args.budget:
                print(f"budget reached: skipping {shape} M={m}", flush=True)
                continue
            more = variants_at(args.variants_at, m) if shape in args.variants_at_shapes.split(",") else []
            more = [v for v in more if v not in unmeasured]
            got = measure(shape, m, weights, bw, flops, variants + [v for v in more if v not in variants],
                          args.xla and m <= 256, args.triton_budget)
            rows += got
            for r in got:
                print(f"{shape} M={m} {r['variant']:>14}: {r['time_s'] * 1e6:10,.1f} us "
                      f"({100 * r['floor_s'] / r['time_s']:3.0f}% of floor {r['floor_s'] * 1e6:,.0f} us, FLOPs floor "
                      f"{r['flops_floor_s'] * 1e6:,.0f} us) block_m {shown_path(r)} err {r['rel_err']}", flush=True)
            write_report(args.out, meta, rows)  # partial results survive a timeout
        del weights
    write_report(args.out, meta, rows)


if __name__ == "__main__":
    main()
