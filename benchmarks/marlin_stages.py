"""Where a small marlin_moe call's time goes, stage by stage (H200; timing only, the results are not checked).

Builds copies of `ffi/marlin_moe.cu` whose handler returns early (nvcc, one library per stage, the handler exported
under its own name): `0` before the align stage (a custom call that launches nothing: the host's dispatch),
`1` after the align stage, `2` after gate/up, `3` after down, `99` the whole call. Each is timed as
`benchmarks/marlin_moe.py` times the kernel (jitted batches over several input sets, median per op), for the
per-device shape (48 local experts) and the K2 shape at small M. The differences between consecutive stages are
what each stage adds, where the batch is bound by the GPU (stage 0 says how much host time a batch has to cover).

    python benchmarks/marlin_stages.py [--sets 32] [--stages 0,1,2,3,99] [--out DIR]
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/marlin_stages.py ...   (command buffers off)

Writes DIR/marlin_stages.txt (one line per shape and M: the time per op of each stage).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import importlib
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import timed  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# (text in the handler, what goes before it or after it): the early returns, each under `#if KD_STOP == n`
PATCHES = [
    ("  if (stream_ok || tile_ok) {\n", "  if (KD_STOP == 0) return ffi::Error::Success();\n", "before"),
    ('if (ffi::Error e = LastError("align launch"); e.failure()) return e;\n',
     "    if (KD_STOP == 1) return ffi::Error::Success();\n", "after"),
    ('  return LaunchGemm<NT, false, kL2, kPersist>(stream, g2,', "  if (KD_STOP == 2) return ffi::Error::Success();\n",
     "before"),
    ("    return Launch(CombineKernel8,", "    if (KD_STOP == 3) return ffi::Error::Success();\n", "before"),
]


def patched_source(src: str) -> str:
    """The handler's source with the early returns (each place must occur exactly once)."""
    for where, line, side in PATCHES:
        if src.count(where) != 1:
            raise SystemExit(f"marlin_stages: the handler changed: {where.strip()!r} found {src.count(where)} times")
        src = src.replace(where, line + where if side == "before" else where + line)
    return src


def build(stages: list[str], out_dir: str) -> dict[str, str]:
    """{stage: path of its library}, built in parallel."""
    import jax

    with open(os.path.join(ROOT, "ffi", "marlin_moe.cu")) as f:
        src = patched_source(f.read())
    cu = os.path.join(out_dir, "marlin_stages.cu")
    with open(cu, "w") as f:
        f.write(src)

    def one(stage):
        lib = os.path.join(out_dir, f"stage{stage}.so")
        cmd = ["nvcc", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
               "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-diag-suppress=940,2473,177", f"-DKD_STOP={stage}",
               f"-DKdMarlinMoeCuda=KdMoeStage{stage}", f"-I{jax.ffi.include_dir()}", f"-I{os.path.join(ROOT, 'ffi')}",
               cu, "-o", lib]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return stage, lib

    with concurrent.futures.ThreadPoolExecutor(len(stages)) as pool:
        return dict(pool.map(one, stages))


def stage_call(stage: str, m: int, e: int, bm: int, flags: int):
    """fn(x, ids, w, gate, up, down) -> out calling the stage's handler as `marlin_moe` calls the real one."""
    mm = importlib.import_module("kdtree_jax.kernels.marlin_moe")
    from marlin_moe import D, F

    def fn(x, ids, w, g, u, d):
        args = (x, ids, w, g.packed, g.scale, u.packed, u.scale, d.packed, d.scale)
        return mm._cuda_call(args, m, D, ids.shape[1], e, F, x.dtype, bm, flags, target=f"kd_stage{stage}")[0]
    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", type=int, default=32, help="input sets per timed batch (default 32)")
    ap.add_argument("--stages", default="0,1,2,3,99", help="comma separated, of 0, 1, 2, 3, 99")
    ap.add_argument("--device-ms", default="1,4,16,64", help="M values at the per-device shape")
    ap.add_argument("--k2-ms", default="1,16", help="M values at the K2 shape")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "marlin_moe"),
                    help="directory for marlin_stages.txt (default: results/marlin_moe/)")
    args = ap.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    if not set(stages) <= {"0", "1", "2", "3", "99"}:
        ap.error(f"--stages must be of 0, 1, 2, 3, 99; got {args.stages!r}")
    if args.sets < 1:
        ap.error("--sets must be at least 1")

    import jax

    import marlin_moe as bench
    mm = importlib.import_module("kdtree_jax.kernels.marlin_moe")
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="marlin_stages_") as tmp:
        for stage, lib in build(stages, tmp).items():
            handle = ctypes.CDLL(lib)
            jax.ffi.register_ffi_target(f"kd_stage{stage}", jax.ffi.pycapsule(getattr(handle, f"KdMoeStage{stage}")),
                                        platform="CUDA")
        lines = [f"marlin_moe stages, {jax.devices()[0].device_kind}, {args.sets} input sets per batch, "
                 f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; µs per op after each stage "
                 "(0 = no launch, 1 = align, 2 = gate/up, 3 = down, 99 = whole)"]
        print(lines[0], flush=True)
        for shape, ms in (("device", args.device_ms), ("k2", args.k2_ms)):
            local = bench.E // bench.EP if shape == "device" else None
            e = local or bench.E
            weights = bench.experts(e)
            for m in [int(v) for v in ms.split(",") if v]:
                sets, touched, _ = bench.routing_sets(m, args.sets, seed=m + (7919 if local else 0), local=local)
                bm, flags = mm.choose_path(m, bench.TOPK, bench.E, True, local=e)
                cells = []
                for stage in stages:
                    fn = stage_call(stage, m, e, bm, flags)
                    batch = jax.jit(lambda st, ex, fn=fn: [fn(*a, *ex) for a in st])
                    t, _ = timed(batch, (sets, weights), len(sets), min_batch=0.05, samples=7)
                    cells.append(f"stage{stage} {t * 1e6:7.1f}")
                lines.append(f"{shape} M={m} block_m={bm} flags={flags} touched={np.mean(touched):.1f}: "
                             + "  ".join(cells))
                print(lines[-1], flush=True)
            del weights
    with open(os.path.join(args.out, "marlin_stages.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
