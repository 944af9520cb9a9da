"""tree_build speed, side by side in one run: the CUDA kernel, the C++ CPU kernel, the pure-JAX reference on the GPU,
and the Python heapq builder of the DDTree reference code (top-K and log-softmax on the GPU, copied to the host, then
a heapq loop per request, as liranringel/ddtree and the SGLang port do), against the floor of reading the logits once
from HBM at the measured copy bandwidth.

    python benchmarks/tree_build.py [--out TABLE.md] [--quick]   # default: results/tree_build/tree_build.md

Timing: the GPU kernel runs S distinct inputs inside one jitted function (no dispatch gaps, no L2 reuse) and is
reported per call as the median over repeats; the CPU kernel and the references are timed call by call.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import os
import platform
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.kernels import tree_build, tree_build_ref

HBM_BYTES_PER_S = 4.27e12  # H200 device-to-device copy, read + write counted (docs/anchors.md)


def ddtree_heapq(top_lp: np.ndarray, top_id: np.ndarray, budget: int):
    """build_ddtree_tree of liranringel/ddtree (ddtree.py) for one request: top_lp/top_id [L, K] on the host."""
    depth_limit, k = top_lp.shape
    heap = [(-float(top_lp[0, 0]), (0,), 0, 1, 0, float(top_lp[0, 0]))]
    tokens, depths, parents = [], [], [-1]
    child_maps = [{}]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        idx = len(tokens) + 1
        tok = int(top_id[depth - 1, rank])
        tokens.append(tok)
        depths.append(depth)
        parents.append(parent)
        child_maps.append({})
        child_maps[parent][tok] = idx
        if rank + 1 < k:
            sib = logw - float(top_lp[depth - 1, rank]) + float(top_lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sib))
        if depth < depth_limit:
            child = logw + float(top_lp[depth, 0])
            heapq.heappush(heap, (-child, ranks + (0,), idx, depth + 1, 0, child))
    n = len(tokens) + 1
    vis = np.zeros((n, n), bool)
    vis[0, 0] = True
    for i in range(1, n):
        vis[i, :i] = vis[parents[i], :i]
        vis[i, i] = True
    return tokens, depths, parents, vis


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(gpu) -> float:
    """Bytes per second of a large device-to-device pass (read + write counted)."""
    x = jax.device_put(jnp.ones((256, 1024, 1024), jnp.float32), gpu)  # 1 GiB
    f = jax.jit(lambda a: a * 1.0001)
    jax.block_until_ready(f(x))
    t = median_time(lambda: f(x), 10)
    return 2 * x.nbytes / t


def logits_sets(key, s: int, shape, dtype, device):
    """s fresh random logit arrays on the device: normal, times a per-(row, depth) scale in [1, 6]."""

    @jax.jit
    def make(k):
        k1, k2 = jax.random.split(k)
        scale = jnp.exp(jax.random.uniform(k2, shape[:2] + (1,), minval=0.0, maxval=np.log(6.0)))
        return (jax.random.normal(k1, shape) * scale).astype(dtype)

    with jax.default_device(device):
        return [make(k) for k in jax.random.split(key, s)]


def bench_config(b, depth, v, n, dtype, key, gpu, cpu, bw, quick):
    """Seconds per call of each implementation for one configuration, and the read floor."""
    nbytes = b * depth * v * jnp.dtype(dtype).itemsize
    s = max(4, min(32, int(2e9 // nbytes)))
    xs = logits_sets(key, s, (b, depth, v), dtype, gpu)

    many = jax.jit(lambda *xs: sum(tree_build(x, n).tokens[:, 0].sum() for x in xs))
    jax.block_until_ready(many(*xs))
    t_cuda = median_time(lambda: many(*xs), 7 if quick else 15) / s

    x_cpu = jax.device_put(xs[0], cpu)
    f_cpu = jax.jit(lambda x: tree_build(x, n))
    jax.block_until_ready(f_cpu(x_cpu))
    t_cpu = median_time(lambda: f_cpu(x_cpu), 1 if b * depth * n >= 16 * 7 * 1024 else 3)

    f_ref = jax.jit(lambda x: tree_build_ref(x, n))
    jax.block_until_ready(f_ref(xs[0]))
    t_ref = median_time(lambda: f_ref(xs[0]), 3)

    k = min(n, v)

    @jax.jit
    def topk_logsoftmax(x):
        x = x.astype(jnp.float32)
        top, ids = jax.lax.top_k(x, k)
        return top - jax.nn.logsumexp(x, axis=-1, keepdims=True), ids

    jax.block_until_ready(topk_logsoftmax(xs[0]))

    def heapq_run():
        lp, ids = topk_logsoftmax(xs[0])
        lp, ids = np.asarray(lp), np.asarray(ids)
        return [ddtree_heapq(lp[i], ids[i], n) for i in range(b)]

    t_heapq = min(median_time(heapq_run, 1), median_time(heapq_run, 1))
    return b, depth, n, jnp.dtype(dtype).name, t_cuda, t_cpu, t_ref, t_heapq, nbytes / bw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tree_build",
                                                  "tree_build.md"),
                    help="write the markdown table here (default: results/tree_build/tree_build.md)")
    ap.add_argument("--quick", action="store_true", help="fewer configurations and repeats")
    args = ap.parse_args()
    cpu = jax.devices("cpu")[0]
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        print("no GPU: timing the CPU in its place (smoke test only)")
        gpu = cpu
    measured = copy_bandwidth(gpu)
    bw = HBM_BYTES_PER_S if gpu is not cpu else measured
    v = 163840
    f32, bf16 = jnp.float32, jnp.bfloat16
    configs = [(b, depth, n, f32) for b in (1, 16) for depth in (7, 15) for n in (64, 256, 1024)]
    configs += [(16, 7, 256, bf16), (16, 15, 256, bf16)]
    if args.quick:
        configs = [(16, 15, 256, f32), (16, 7, 256, f32), (1, 7, 64, f32)]
    if gpu is cpu:
        configs, v = [(2, 7, 64, f32)], 4096
    keys = jax.random.split(jax.random.key(0), len(configs))
    rows = []
    for (b, depth, n, dtype), key in zip(configs, keys):
        row = bench_config(b, depth, v, n, dtype, key, gpu, cpu, bw, args.quick)
        rows.append(row)
        t_cuda, t_cpu, t_ref, t_heapq, floor = row[4:]
        print(f"B={b:2d} L={depth:2d} N={n:4d} {row[3]:8s} cuda {t_cuda * 1e6:8.1f} us  cpu {t_cpu * 1e3:8.2f} ms  "
              f"ref(gpu) {t_ref * 1e3:8.2f} ms  heapq {t_heapq * 1e3:8.2f} ms  floor {floor * 1e6:7.1f} us  "
              f"x{t_heapq / t_cuda:7.0f} vs heapq  {t_cuda / floor:4.2f}x floor", flush=True)

    commit = os.environ.get("KD_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False,
                                                           capture_output=True, text=True).stdout.strip()
    lines = [
        "# tree_build benchmark",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        (f"- device: {gpu.device_kind}; host CPU: {platform.processor() or platform.machine()} "
         f"({os.cpu_count()} cores), CPU kernel single-threaded"),
        f"- commit: {commit}; jax {jax.__version__}",
        f"- logits: [B, L, {v}], fresh random normal x per-depth scale in [1, 6]",
        (f"- floor: logits bytes / {bw / 1e12:.2f} TB/s (H200 copy bandwidth measured with PyTorch; an XLA "
         f"elementwise pass measured {measured / 1e12:.2f} TB/s in this run)"),
        "",
        ("| B | L | budget | dtype | CUDA kernel | C++ CPU kernel | pure-JAX ref (GPU) | Python heapq (ddtree.py) "
         "| read floor | CUDA vs heapq | CUDA / floor |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b, depth, n, dt, t_cuda, t_cpu, t_ref, t_heapq, floor in rows:
        lines.append(f"| {b} | {depth} | {n} | {dt} | {t_cuda * 1e6:.1f} us | {t_cpu * 1e3:.1f} ms | "
                     f"{t_ref * 1e3:.2f} ms | {t_heapq * 1e3:.2f} ms | {floor * 1e6:.1f} us | "
                     f"{t_heapq / t_cuda:.0f}x | {t_cuda / floor:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
