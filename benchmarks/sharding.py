"""Per-layer time of K2-width layers on 1 and 2 GPUs, with the communication share, and a projection to 8 GPUs.

Layers of full K2 width (hidden 7,168, 64 heads, MLA 1536/512, 384 INT4 experts of 2,048, top-8), random weights.
For each device count n (1 and, when present, 2: mesh ep=n so experts split n ways and heads over ep x tp) and each
shape (decode: T = 1 token per row; verify: T = budget + 1 tree nodes per row) at batch 1 and 10, the per-layer
time is the difference of a 2-MoE-layer and a 1-MoE-layer model's step (embedding, head and launch costs cancel).
The communication share is measured directly: the all-reduces of one layer (those in the compiled layer scan's
loop body) timed alone on the same mesh with the same message sizes. The projection (written into the results)
scales the per-device compute of the n = 2 run to 8 devices and adds the all-reduce time.

    python benchmarks/sharding.py --kernels ffi      # on a 2-GPU machine: results/sharding/
    python benchmarks/sharding.py --small --out /tmp/x                         # CPU smoke run (simulate devices)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kdtree_jax as kj  # noqa: E402
from common import random_trees, timed  # noqa: E402
from kdtree_jax.sharding import trace_context  # noqa: E402
from kdtree_jax.model import init_cache, step  # noqa: E402

K2_LAYERS = 60  # MoE layers of K2.6 (plus one dense)
REFERENCE = {"C=1": 138.7, "C=10": 517.0}  # SGLang DDTree, Kimi K2.6 on 8x RTX PRO 6000 (issue #9)


def layer_cfg(n_moe: int, small: bool, kernels: str) -> kj.ModelConfig:
    base = dict(num_hidden_layers=n_moe, first_k_dense_replace=0, kernels=kernels, max_position_embeddings=4096)
    if small:
        return kj.configs.tiny(**{**base, "num_attention_heads": 8, "moe_intermediate_size": 256,
                                  "n_routed_experts": 16})
    return kj.configs.k2_6(**base)


def step_time(cfg, mesh, batch: int, t: int, context: int, rng) -> tuple[float, str]:
    """(seconds of one cached step of T new tokens per row after `context` tokens, compiled HLO text)."""
    params = kj.init_params(cfg, jax.random.key(0))
    if mesh is not None:
        params = kj.shard_params(params, cfg, mesh)
    cache = init_cache(cfg, batch, context + t + 8)
    cache = dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))
    tokens = jnp.asarray(rng.integers(0, 1000, size=(batch, t)), jnp.int32)
    depths, vis = random_trees(batch, t, rng)
    fn = jax.jit(lambda p, c, tok, d, m: step(p, cfg, tok, c, depths=d, tree_mask=m).logits)
    args = (params, cache, tokens, jnp.asarray(depths), jnp.asarray(vis))
    with trace_context(params, cfg):
        compiled = fn.lower(*args).compile()
    seconds, _ = timed(compiled, args, 1, min_batch=0.05, samples=5)
    return seconds, compiled.as_text()


def allreduce_bytes(hlo: str, layer: int = 0) -> list[int]:
    """Bytes of each all-reduce of decoder layer `layer` (its named scope "layer_i/") in compiled HLO text."""
    sizes = []
    for line in hlo.splitlines():
        m = re.search(r"= \(?(.*?)\)? all-reduce(?:-start)?\(", line)
        if not m or f"/layer_{layer}/" not in line:
            continue
        for dt, dims in re.findall(r"(bf16|f32|f16|s32)\[([0-9,]*)\]", m.group(1)):
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            sizes.append(n * (2 if dt in ("bf16", "f16") else 4))
    return sizes


def allreduce_time(mesh, nbytes: int, repeats: int = 20) -> float:
    """Seconds of one psum of `nbytes` of fp32 over every device of the mesh (`repeats` of them in one program)."""
    axes = ("dp", "ep", "tp")
    spec = jax.sharding.PartitionSpec(axes)
    ndev = len(mesh.devices.flat)
    x = jax.device_put(jnp.ones((ndev, max(nbytes // 4, 1)), jnp.float32), jax.sharding.NamedSharding(mesh, spec))
    body = lambda v: jax.lax.fori_loop(0, repeats, lambda i, a: jax.lax.psum(a, axes) / ndev, v)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    return timed(f, (x,), repeats, min_batch=0.0, samples=5)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sharding"),
                    help="output directory (default: results/sharding/)")
    ap.add_argument("--kernels", default="xla", choices=("xla", "ffi"))
    ap.add_argument("--small", action="store_true", help="narrow layers (CPU smoke run)")
    ap.add_argument("--budget", type=int, default=64, help="verify: budget + 1 tree nodes per row")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per row")
    ap.add_argument("--batches", default="1,10")
    ap.add_argument("--tau", type=float, default=4.4, help="tokens per verify step for the projection")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    counts = ([2] if jax.device_count() >= 2 else []) + [1]  # 2 first: the projection needs it
    rows = []
    for n in counts:
        mesh = None if n == 1 else kj.make_mesh(ep=n, devices=jax.devices()[:n])
        for batch in (int(b) for b in args.batches.split(",")):
            for shape, t in (("decode", 1), ("verify", args.budget + 1)):
                t1, hlo1 = step_time(layer_cfg(1, args.small, args.kernels), mesh, batch, t, args.context, rng)
                t2, _ = step_time(layer_cfg(2, args.small, args.kernels), mesh, batch, t, args.context, rng)
                layer = max(t2 - t1, 1e-9)
                row = dict(devices=n, batch=batch, shape=shape, tokens=t, layer_s=layer, one_layer_model_s=t1)
                if mesh is not None:  # the all-reduces of one layer
                    per_layer = allreduce_bytes(hlo1)
                    comm = sum(allreduce_time(mesh, b) for b in per_layer)
                    row.update(allreduces_per_layer=len(per_layer), allreduce_bytes=per_layer, comm_s=comm,
                               comm_share=comm / layer)
                rows.append(row)
                print(json.dumps(row), flush=True)
                write(args, rows, quiet=True)  # what is measured survives a time limit
    write(args, rows)
    return 0


def write(args, rows, quiet: bool = False) -> None:
    device = str(jax.devices()[0].device_kind)
    meta = dict(date=datetime.date.today().isoformat(), device=device, commit=os.environ.get("KDTREE_COMMIT", "?"),
                jax=jax.__version__, kernels=args.kernels, small=args.small, budget=args.budget,
                context=args.context, tau=args.tau)
    with open(os.path.join(args.out, "sharding.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    ms = lambda s: f"{1e3 * s:.3f}"
    lines = [f"# Per-layer step time, K2 widths ({meta['date']}, {device}, commit {meta['commit']}, "
             f"kernels={args.kernels}{', SMALL smoke config' if args.small else ''})", "",
             f"Per MoE layer (difference of 2- and 1-layer models), context {args.context}, verify = "
             f"{args.budget + 1} tree nodes per row.", "",
             "| devices | batch | step | tokens/row | ms per layer | all-reduces | comm ms | comm share |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        comm = (f"{r['allreduces_per_layer']} | {ms(r['comm_s'])} | {100 * r['comm_share']:.0f}%" if "comm_s" in r
                else "- | - | -")
        lines.append(f"| {r['devices']} | {r['batch']} | {r['shape']} | {r['tokens']} | {ms(r['layer_s'])} | {comm} |")
    two = [r for r in rows if r["devices"] == 2]
    if two:
        lines += ["", "## Projection to 8 GPUs (full K2.6: 60 MoE layers + 1 dense)", "",
                  "Model: per-layer time on 8 GPUs = (2-GPU per-layer time - its measured communication) x 2/8 "
                  "(each GPU holds 1/8 of the experts and heads instead of 1/2; decode and verify are "
                  "weight-streaming-bound, so compute scales with the bytes each GPU holds) + the same all-reduces "
                  "on 8 GPUs, taken here as the 2-GPU time (ring all-reduce time per byte is nearly flat in the "
                  "device count on NVLink; an assumption to check on 8 GPUs). Step = 61 x per-layer time; "
                  f"tokens/s = concurrency x tau / step, tau = {args.tau} for ddtree, 1 for ar.", "",
                  "| batch (concurrency) | method | projected step ms | projected tokens/s | SGLang DDTree reference |",
                  "|---|---|---|---|---|"]
        for r in two:
            per8 = (r["layer_s"] - r["comm_s"]) * 2 / 8 + r["comm_s"]
            stepms = (K2_LAYERS + 1) * per8
            tau = 1.0 if r["shape"] == "decode" else args.tau
            method = "ar" if r["shape"] == "decode" else f"ddtree (budget {args.budget})"
            ref = REFERENCE.get(f"C={r['batch']}", "-")
            lines.append(f"| {r['batch']} | {method} | {1e3 * stepms:.2f} | {r['batch'] * tau / stepms:.0f} | "
                         f"{ref} tok/s |")
    with open(os.path.join(args.out, "sharding.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
