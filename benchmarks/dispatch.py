"""Does a jitted call hold the calling thread until it ends? The serving engine dispatches a decoding chunk (a
`lax.while_loop` whose trip count depends on the rows' progress) and then reads the first tokens of the requests it
just prefilled, expecting the dispatch to return at once; if the call holds the thread for the whole loop (a
backend reading the loop's condition back to the host every trip, on the calling thread), every new request's first
token waits for the chunk too.

For three programs of the same work (T trips of a [N, N] matmul and tanh): a while_loop whose stop is computed on the
device (as the engine's), a fori_loop of a fixed count, and the trips unrolled, it prints how long the call took to
return against how long until its result was ready (median of --repeats, after a compiling call):

    python benchmarks/dispatch.py                    # this machine's default backend
    python benchmarks/dispatch.py --out DIR          # also DIR/dispatch_<platform>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp


def programs(trips: int):
    def body(y):
        return jnp.tanh(y @ y) * 0.5

    @jax.jit
    def device_stop(x, limit):  # the stop depends on values computed in the loop, as the engine's chunk
        def cond(c):
            i, y = c
            return (i < limit) & jnp.isfinite(y[0, 0])
        return jax.lax.while_loop(cond, lambda c: (c[0] + 1, body(c[1])), (0, x))[1]

    @jax.jit
    def fixed(x):
        return jax.lax.fori_loop(0, trips, lambda i, y: body(y), x)

    @jax.jit
    def unrolled(x):
        for _ in range(trips):
            x = body(x)
        return x

    return {"while_loop, stop on the device": lambda x: device_stop(x, trips), "fori_loop": fixed,
            "unrolled": unrolled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048, help="the matmul's size (default 2048)")
    ap.add_argument("--trips", type=int, default=64, help="loop trips (default 64)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write dispatch_<platform>.json here")
    args = ap.parse_args()
    x = jnp.full((args.n, args.n), 0.01, jnp.float32)
    rows = []
    for name, f in programs(args.trips).items():
        f(x).block_until_ready()
        returned, ready = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            y = f(x)
            t1 = time.perf_counter()
            y.block_until_ready()
            returned.append(t1 - t0)
            ready.append(time.perf_counter() - t0)
        r, d = statistics.median(returned), statistics.median(ready)
        rows.append(dict(program=name, returned_ms=1e3 * r, ready_ms=1e3 * d, held_fraction=r / d))
        print(f"{name}: the call returned after {1e3 * r:.2f} ms, its result ready after {1e3 * d:.2f} ms "
              f"({100 * r / d:.0f}% of it on the calling thread)", flush=True)
    device = jax.devices()[0]
    meta = dict(date=datetime.date.today().isoformat(), device=getattr(device, "device_kind", device.platform),
                platform=device.platform, jax=jax.__version__, n=args.n, trips=args.trips, repeats=args.repeats,
                xla_flags=os.environ.get("XLA_FLAGS", ""), commit=os.environ.get("KDTREE_COMMIT", ""))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"dispatch_{device.platform}.json")
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
