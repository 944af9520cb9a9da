"""The drafter's block attention alone: XLA's operations (`draft_attention_ref`, what the drafter runs by default)
against the `draft_attention` custom call, at the splits `plan_splits` picks and at others, beside its floor.

Shapes of the K2.5-DFlash-shaped drafter: one device's share on an ep=8 mesh (8 query heads, 1 kv head of 112) and
the replicated drafter (64 / 8), a block of 8 queries over `--context` cached slots (the cache holds 256 more), at
each of `--batches`; the custom call on the CUDA cores at each of `--splits`, and with `--mma` on the tensor cores
at each of them. Each form runs as one jitted program of `--chain` calls in a row (each call's output is the
next one's queries, so none can be skipped), under the profiler: GPU time a call is the kernels' busy time over the
calls, launches a call likewise; wall time a call from `common.timed` (dispatch included). Floor: the bytes a call
must move (the context's keys and values below the length, the block's, the queries and the output) at the copy
bandwidth measured in the same run.

    python benchmarks/draft_attention.py                        # on a GPU: results/draft_attention/
    python benchmarks/draft_attention.py --small --out /tmp/x   # CPU smoke run (the C++ handler; no profile)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

SHAPES = {"sharded": (8, 1, 112), "replicated": (64, 8, 112)}  # query heads, kv heads, head dim
BLOCK = 8


def make_case(b: int, h: int, g: int, d: int, context: int, slack: int, dtype, rng):
    import jax.numpy as jnp
    s = context + slack

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)
    return (arr(b, BLOCK, h, d), arr(b, s, g, d), arr(b, s, g, d), arr(b, BLOCK, g, d), arr(b, BLOCK, g, d),
            jnp.full((b,), context, jnp.int32))


def measure(impl: str, splits: int | None, case, chain: int, profile: bool, mma: bool = False) -> dict:
    import jax
    from common import timed
    from profile_tools import profile_calls
    from kdtree_jax.kernels.draft_attention import draft_attention

    d = case[0].shape[-1]

    @jax.jit
    def run(q, ck, cv, kb, vb, lengths):
        for _ in range(chain):
            q = draft_attention(q, ck, cv, kb, vb, lengths, d ** -0.5, impl=impl, num_splits=splits, mma=mma)
        return q
    wall, _ = timed(run, case, chain)
    out = dict(wall_s=wall)
    if profile:
        prof = profile_calls(run, case, 5)
        out.update(gpu_s=prof["busy_us"] * 1e-6 / chain,
                   kernels=sum(n for n, _ in prof["kernels"].values()) / chain)
    return out


def write_report(out: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "draft_attention.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    key = "gpu_s" if meta["profiled"] else "wall_s"
    lines = [f"# The drafter's block attention alone: XLA against the draft_attention custom call ({meta['date']}, "
             f"{meta['device']}, commit {meta['commit']})", "",
             f"A block of {BLOCK} queries over {meta['context']} cached slots, {meta['dtype']}; "
             f"{meta['chain']} calls in one program, "
             + ("GPU time a call (the kernels' busy time; the profiler)" if meta["profiled"] else
                "wall time a call (no GPU: not profiled)")
             + f". Floor: the bytes a call moves at {meta['copy_Bps'] / 1e12:.2f} TB/s "
             f"({'measured in this run' if meta['profiled'] else 'assumed'}). "
             f"`{meta.get('command', 'python benchmarks/draft_attention.py')}`.",
             "", "| drafter | heads / kv, dim | batch | form | splits | µs a call | kernels | x floor | vs XLA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        xla = next(x for x in rows if x["shape"] == r["shape"] and x["batch"] == r["batch"] and x["form"] == "xla")
        kern = f"{r['kernels']:.0f}" if "kernels" in r else "-"
        lines.append(f"| {r['shape']} | {r['h']} / {r['g']}, {r['d']} | {r['batch']} | {r['form']} | "
                     f"{r.get('splits') or '-'} | {r[key] * 1e6:.1f} | {kern} | {r[key] / r['floor_s']:.1f} | "
                     f"{r[key] / xla[key]:.2f}x |")
    with open(os.path.join(out, "draft_attention.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = sorted({(r["shape"], r["batch"]) for r in rows}, key=lambda c: (c[0] != "sharded", c[1]))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, max(sum(1 for r in rows if (r["shape"], r["batch"]) == c) for c in cases))
    for i, c in enumerate(cases):
        group = [r for r in rows if (r["shape"], r["batch"]) == c]
        for j, r in enumerate(group):
            ax.bar(i + (j - (len(group) - 1) / 2) * width, r[key] * 1e6, width * 0.9,
                   color="tab:gray" if r["form"] == "xla" else "tab:orange" if "mma" in r["form"] else "tab:blue")
            ax.text(i + (j - (len(group) - 1) / 2) * width, r[key] * 1e6,
                    "xla" if r["form"] == "xla" else f"{'m' if 'mma' in r['form'] else ''}{r['splits']}", ha="center",
                    va="bottom", fontsize=6)
        ax.hlines(group[0]["floor_s"] * 1e6, i - 0.4, i + 0.4, colors="k", linestyles=":")
    ax.set_xticks(range(len(cases)), [f"{s}\nbatch {b}" for s, b in cases])
    ax.set_ylabel("GPU µs a call" if key == "gpu_s" else "µs a call (wall)")
    ax.set_title(f"Drafter block attention: XLA (gray) vs custom call by splits (blue; tensor cores orange, m)\n"
                 f"floor dotted; {meta['device']}, {meta['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "draft_attention.png"), dpi=120)
    plt.close(fig)
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "draft_attention"))
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"))
    ap.add_argument("--context", type=int, default=4096, help="cached slots filled (default 4096)")
    ap.add_argument("--batches", default="1,10", help="batch rows, comma-separated (default 1,10)")
    ap.add_argument("--shapes", default="sharded,replicated", help=f"of {','.join(SHAPES)} (default both)")
    ap.add_argument("--splits", default="plan,16,32,64", help="the custom call's splits: plan (plan_splits' choice) "
                    "and integers, comma-separated (default plan,16,32,64)")
    ap.add_argument("--chain", type=int, default=8, help="calls in one program (default 8)")
    ap.add_argument("--mma", action="store_true", help="also the tensor-core kernel (mma=True) at each of --splits")
    ap.add_argument("--small", action="store_true", help="context 64, float32, chain 2 (CPU smoke run)")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from common import ceilings
    from kdtree_jax.kernels.draft_attention import plan_splits
    if args.small:
        args.context, args.chain = 64, 2
    dtype = jnp.float32 if args.small else jnp.bfloat16
    gpu = jax.default_backend() == "gpu"
    copy_Bps = ceilings()["copy_Bps"] if gpu else 4.0e12
    slack = 256
    rng = np.random.default_rng(0)
    rows = []
    for shape in args.shapes.split(","):
        h, g, d = SHAPES[shape]
        for b in (int(v) for v in args.batches.split(",")):
            case = make_case(b, h, g, d, args.context, slack, dtype, rng)
            item = jnp.dtype(dtype).itemsize
            moved = item * b * d * (2 * g * (args.context + BLOCK) + 2 * BLOCK * h)
            planned = plan_splits(b, BLOCK, h, g, args.context + slack)
            forms = [("xla", None)] + sorted({("ffi", planned if v == "plan" else int(v))
                                              for v in args.splits.split(",")}, key=lambda f: f[1])
            if args.mma:
                forms += [("ffi mma", splits) for form, splits in forms if form == "ffi"]
            for form, splits in forms:
                r = measure("xla" if form == "xla" else "ffi", splits, case, args.chain, gpu, mma=form == "ffi mma")
                label = f"{form} (planned)" if form != "xla" and splits == planned else form
                r.update(shape=shape, h=h, g=g, d=d, batch=b, form=label, splits=splits, bytes=moved,
                         floor_s=moved / copy_Bps)
                rows.append(r)
                print(f"{shape} B={b} {r['form']} splits={splits}: {r}", flush=True)
            del case
    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, commit=args.commit,
                context=args.context, chain=args.chain, dtype=jnp.dtype(dtype).name, copy_Bps=copy_Bps,
                profiled=gpu, command=shlex.join(["python", "benchmarks/draft_attention.py",
                                                   *(sys.argv[1:] if argv is None else argv)]))
    write_report(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
