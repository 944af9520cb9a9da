"""The all-reduces of one decoder layer on the devices at hand: how many a layer issues at each cell, and what each
costs with every all-reduce candidate that the platform offers, side by side in one run.

A layer issues two all-reduces on an expert-parallel mesh: after attention (the heads' partial outputs) and after
the feed-forward block (routed and shared experts summed in one psum, `sharding.moe_expert_parallel`). The count is
read from the compiled step of a 2-layer model of K2's widths (`--small`: a tiny one) on the mesh ep = devices, at
each cell (C rows x T tokens: decode T = 1, verify T = budget + 1). Each candidate is timed in its own process,
since XLA reads its flags once:

    xla            XLA's default all-reduce (NCCL on GPUs)
    one_shot       --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true: XLA's one-kernel all-reduce
    nccl_symmetric --xla_gpu_experimental_enable_nccl_symmetric_buffers=true: NCCL's symmetric-memory kernels
    user_buffers   --xla_gpu_enable_nccl_user_buffers=true: NCCL's registered (zero-copy) buffers

at the message sizes a layer sends on an 8-device mesh: [C x T, 7168] in bf16 after attention and in fp32 after the
experts. A candidate whose flag this jaxlib does not know is reported as such (XLA aborts on an unknown flag).
On a CPU (simulated devices) only `xla` runs: the others are GPU flags.

    python benchmarks/collectives.py                          # on a machine of 2 or more GPUs: results/collectives/
    python benchmarks/collectives.py --small --out /tmp/x     # CPU smoke run (XLA_FLAGS=--xla_force_host_..._count=8)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

CANDIDATES = {
    "xla": "",
    "one_shot": "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true",
    "nccl_symmetric": "--xla_gpu_experimental_enable_nccl_symmetric_buffers=true",
    "user_buffers": "--xla_gpu_enable_nccl_user_buffers=true",
}
CELLS = [(1, 1), (1, 17), (1, 65), (10, 1), (10, 17), (10, 65)]  # (C rows, T tokens per row)
HIDDEN = 7168


def messages(c: int, t: int, hidden: int = HIDDEN, act_bytes: int = 2) -> list[int]:
    """Bytes of a layer's two all-reduces at C x T tokens: attention's output in the activations' dtype (bf16 for
    K2), the experts' sum in fp32."""
    return [c * t * hidden * act_bytes, c * t * hidden * 4]


def count_per_layer(small: bool, cells) -> dict[str, list[int]]:
    """{"CxT": [bytes of each all-reduce of layer 1]} from the compiled 2-layer step on the mesh ep = devices."""
    import jax

    import kdtree_jax as kj
    from sharding import allreduce_bytes, layer_cfg, step_time

    mesh = kj.make_mesh(ep=jax.device_count())
    rng = np.random.default_rng(0)
    out = {}
    for c, t in cells:
        _, hlo = step_time(layer_cfg(2, small, "xla"), mesh, c, t, 64 if small else 1024, rng)
        out[f"{c}x{t}"] = allreduce_bytes(hlo, layer=1)
    return out


def time_candidate(sizes: list[int]) -> dict[str, float]:
    """{bytes: seconds of one all-reduce of that many bytes over every device} in this process."""
    import jax

    import kdtree_jax as kj
    from sharding import allreduce_time

    mesh = kj.make_mesh(ep=jax.device_count())
    return {str(n): allreduce_time(mesh, n) for n in sizes}


def known_flag(flag: str) -> bool:
    """Whether this jaxlib accepts `flag` in XLA_FLAGS (it aborts on one it does not know)."""
    if not flag:
        return True
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()}
    run = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.ones(1).block_until_ready()"],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    return run.returncode == 0


def run_candidate(name: str, sizes: list[int]) -> dict:
    """Time `sizes` in a child process started with the candidate's flag."""
    flag = CANDIDATES[name]
    if not known_flag(flag):
        return dict(status=f"flag unknown to this jaxlib: {flag}")
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()}
    code = (f"import json, sys; sys.path[:0] = {[os.path.dirname(os.path.abspath(__file__))]!r}; "
            f"import collectives; print(json.dumps(collectives.time_candidate({sizes!r})))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                         check=False)
    if run.returncode:
        return dict(status="failed: " + " ".join(run.stderr.split()[-40:]))
    return dict(status="ok", seconds=json.loads(run.stdout.strip().splitlines()[-1]))


def write_report(out_dir: str, meta: dict, counts: dict, results: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "collectives.json"), "w") as f:
        json.dump(dict(meta=meta, counts=counts, results=results), f, indent=1)
    names = list(results)
    lines = [f"# One layer's all-reduces on {meta['devices']} {meta['platform']} devices ({meta['date']}, "
             f"{meta['device']}, commit {meta['commit']})", "",
             "All-reduces a layer issues (compiled 2-layer step, mesh ep = devices) and the time of one all-reduce of "
             "each message size of an 8-device mesh, per candidate (`python benchmarks/collectives.py`).", "",
             "| cell | all-reduces in the layer (bytes) | messages on 8 devices (bytes) | "
             + " | ".join(f"{n} µs" for n in names) + " | best µs a layer |",
             "|---|---|---|" + "---|" * len(names) + "---|"]
    for c, t in meta["cells"]:
        sizes = messages(c, t, meta["hidden"], meta["act_bytes"])
        per = []
        for n in names:
            secs = results[n].get("seconds")
            per.append(None if secs is None else [secs[str(s)] for s in sizes])
        ok = [sum(p) for p in per if p]
        cols = [" + ".join(f"{1e6 * v:.1f}" for v in p) if p else "-" for p in per]
        best = f"{1e6 * min(ok):.1f}" if ok else "-"
        layer = counts.get(f"{c}x{t}", [])
        lines.append(f"| {c} x {t} | {len(layer)} ({layer}) | {sizes} | " + " | ".join(cols) + f" | {best} |")
    lines += [""] + [f"- `{n}`: {results[n]['status']}" for n in names]
    with open(os.path.join(out_dir, "collectives.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "collectives"))
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"))
    ap.add_argument("--small", action="store_true", help="tiny layers and messages (CPU smoke run)")
    args = ap.parse_args(argv)
    import jax

    if jax.device_count() < 2:
        print("needs 2 or more devices (GPUs, or XLA_FLAGS=--xla_force_host_platform_device_count=8 on a CPU)")
        return 2
    gpu = jax.default_backend() == "gpu"
    from sharding import layer_cfg

    cfg = layer_cfg(2, args.small, "xla")
    hidden, act_bytes = cfg.hidden_size, np.dtype(cfg.jnp_dtype).itemsize
    cells = CELLS[:2] if args.small else CELLS
    meta = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                platform=jax.default_backend(), devices=jax.device_count(), commit=args.commit, cells=cells,
                hidden=hidden, act_bytes=act_bytes)
    counts = count_per_layer(args.small, cells)
    sizes = sorted({s for c, t in cells for s in messages(c, t, hidden, act_bytes)})
    results = {n: (run_candidate(n, sizes) if gpu or n == "xla" else dict(status="GPU flag: not run on a CPU"))
               for n in CANDIDATES}
    write_report(args.out, meta, counts, results)
    print(open(os.path.join(args.out, "collectives.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
