"""One draft_attention call on the GPU with nothing else of XLA's on it, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/draft_attention_memcheck.py B T H G D S \
        [--splits N] [--cores]

The inputs are made with NumPy on the host and copied over; the reference (`draft_attention_ref`) runs on the CPU.
Under memcheck, XLA's own GPU kernels (the reference's dots there, as the GPU tests run them) made the tool crash
with a segmentation fault in some cases (H100, 2026-12-07), which hid whether the custom call was clean; this way
the only kernels memcheck sees are the call's (and the copies). Exits 1 when the output is not finite or is further
from the reference than a bf16 bound.
"""

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("B", "T", "H", "G", "D", "S"):
        ap.add_argument(name.lower(), type=int, help=f"{name} (q [B, T, H, D], caches [B, S, G, D])")
    ap.add_argument("--splits", type=int, default=None, help="the call's num_splits (default: planned)")
    ap.add_argument("--cores", action="store_true", help="the CUDA-core kernel (mma=False)")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from kdtree_jax.kernels.draft_attention import draft_attention, draft_attention_ref
    b, t, h, g, d, s = args.b, args.t, args.h, args.g, args.d, args.s
    rng = np.random.default_rng(b * 1000 + s)
    host = [rng.standard_normal(shape).astype(np.float32).astype(jnp.bfloat16) for shape in
            ((b, t, h, d), (b, s, g, d), (b, s, g, d), (b, t, g, d), (b, t, g, d))]
    lengths = np.asarray([(0, s, s + 9, s // 3)[i % 4] for i in range(b)] if b > 1 else [s // 2], np.int32)
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    out = draft_attention(*(jax.device_put(x, gpu) for x in (*host, lengths)), d ** -0.5, num_splits=args.splits,
                          mma=not args.cores)
    out = np.asarray(jax.device_get(out), np.float32)
    with jax.default_device(cpu):
        ref = np.asarray(draft_attention_ref(*(jax.device_put(x, cpu) for x in (*host, lengths)), d ** -0.5),
                         np.float32)
    err = float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
    ok = bool(np.isfinite(out).all()) and err <= 2e-2
    print(f"draft_attention {b}x{t}x{h}x{g}x{d}x{s} splits={args.splits} {'cores' if args.cores else 'mma'}: "
          f"relative error {err:.2e}, finite {bool(np.isfinite(out).all())}: {'ok' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
