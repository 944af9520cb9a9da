"""XLA flags that overlap the many small kernels of a decode or verify step on a GPU; the `kdtree-jax` commands add
them to XLA_FLAGS before jax starts (`KDTREE_JAX_XLA_FLAGS=0` leaves XLA_FLAGS as it is).

`--xla_gpu_enable_pdl=true` launches XLA's kernels as programmatic dependents (the next one starts while the one
before it ends); `--xla_gpu_executable_num_compute_streams=2` with `--xla_gpu_graph_enable_concurrent_region=true`
lets independent work (the shared expert beside the routed experts) run on a second stream, inside CUDA graphs
too. `--xla_disable_hlo_passes=dot-merger` keeps XLA from merging dots that share an input into one dot over the
concatenation of their other operands: with weights as those operands, the concatenation is a copy of the weights
at every step (the drafter's q, k and v, 16 MB a layer on one device of eight, and its gate and up, 66 MB, sliced out
of the stacked layers and copied too; seen in the compiled HLO, `benchmarks/xla_kernels.py --program draft`). They
are added only where jax can use a CUDA GPU (its CUDA plugin is installed and JAX_PLATFORMS allows it):
XLA aborts on a flag it does not know, and a CPU-only install has no reason to take that risk. XLA reads XLA_FLAGS
once, when its first backend starts: from Python, set them before the first computation
(`os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ.get("XLA_FLAGS", ""))`). What they gain is measured in
docs/full_scale.md.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import MutableMapping

GPU_FLAGS = ("--xla_gpu_enable_pdl=true", "--xla_gpu_executable_num_compute_streams=2",
             "--xla_gpu_graph_enable_concurrent_region=true", "--xla_disable_hlo_passes=dot-merger")
OPT_OUT = "KDTREE_JAX_XLA_FLAGS"  # "0": the commands leave XLA_FLAGS alone


def with_gpu_flags(current: str) -> str:
    """`current` (an XLA_FLAGS value) plus each of GPU_FLAGS whose flag it does not set already: a value the user
    gave wins."""
    given = {f.split("=", 1)[0] for f in current.split()}
    return " ".join([current.strip(), *(f for f in GPU_FLAGS if f.split("=", 1)[0] not in given)]).strip()


def cuda_possible(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether jax may start a CUDA backend: a CUDA plugin of jax is installed and JAX_PLATFORMS (if set) names it."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def apply_gpu_flags(environ: MutableMapping[str, str] = os.environ, gpu: bool | None = None) -> None:
    """environ["XLA_FLAGS"] = with_gpu_flags(its value) where jax may use a CUDA GPU (`gpu`, default
    `cuda_possible(environ)`), unless environ[OPT_OUT] is "0"."""
    gpu = cuda_possible(environ) if gpu is None else gpu
    if gpu and environ.get(OPT_OUT, "1").strip() != "0":
        environ["XLA_FLAGS"] = with_gpu_flags(environ.get("XLA_FLAGS", ""))
