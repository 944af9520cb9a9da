"""One fused_dot call on the GPU with nothing else of XLA's on it, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/fused_dot_memcheck.py M K N \
        [--n2 N2] [--gated] [--adds A] [--split S] [--flags F]

The inputs are made with NumPy on the host and copied over; the reference (`fused_dot_ref`) runs on the CPU (XLA's
own GPU kernels under memcheck made the tool crash in some cases on an H100, 2026-12-07: see
scripts/draft_attention_memcheck.py). Exits 1 when an output is not finite or is further from the reference than a
bf16 bound.
"""

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("m", type=int, help="rows of x")
    ap.add_argument("k", type=int, help="K")
    ap.add_argument("n", type=int, help="columns of w")
    ap.add_argument("--n2", type=int, default=0, help="columns of a second weight sharing x (default none)")
    ap.add_argument("--gated", action="store_true", help="w = [gate | up], SwiGLU out")
    ap.add_argument("--adds", type=int, default=0, help="residual addends (0-2)")
    ap.add_argument("--split", type=int, default=0, help="blocks sharing K (default: chosen)")
    ap.add_argument("--flags", type=int, default=0, help="fused_dot's flags")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from kdtree_jax.kernels.fused_dot import fused_dot, fused_dot_ref
    bf = jnp.bfloat16
    rng = np.random.default_rng(args.m * 1000 + args.k)
    out = args.n // 2 if args.gated else args.n
    host = dict(x=rng.standard_normal((args.m, args.k)), w=rng.standard_normal((args.k, args.n)) / np.sqrt(args.k),
                norm=1.0 + 0.3 * rng.standard_normal(args.k),
                adds=[rng.standard_normal((args.m, out)) for _ in range(args.adds)])
    if args.n2:
        host["w2"] = rng.standard_normal((args.k, args.n2)) / np.sqrt(args.k)
    kw = dict(gated=args.gated, eps=1e-6)

    def on(dev):
        put = lambda a: jax.device_put(np.asarray(a, np.float32).astype(bf), dev)  # noqa: E731
        return dict(x=put(host["x"]), w=put(host["w"]), norm=put(host["norm"]), adds=tuple(map(put, host["adds"])),
                    w2=put(host["w2"]) if args.n2 else None)

    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    got = fused_dot(**on(gpu), **kw, want_xn=True, split=args.split, flags=args.flags)
    got = [np.asarray(jax.device_get(a), np.float32) for a in got if a is not None]
    with jax.default_device(cpu):
        want = [np.asarray(a, np.float32) for a in fused_dot_ref(**on(cpu), **kw, want_xn=True) if a is not None]
    ok = True
    for name, a, b in zip(("y", "y2", "xn")[:len(got)] if args.n2 else ("y", "xn"), got, want):
        err = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
        good = bool(np.isfinite(a).all()) and err <= 2e-2
        ok &= good
        print(f"fused_dot M={args.m} K={args.k} N={args.n} {name}: relative error {err:.2e}: "
              f"{'ok' if good else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
