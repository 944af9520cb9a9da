"""The next kernels' weights asked into the GPU's L2 cache while a kernel that moves few bytes runs.

At a decode step the layer's critical path holds kernels that read almost nothing from memory for a while (the
attention over a short cache: ~15 µs a layer for ~1 MB), followed by projections that stream tens of MB of weights
at a fraction of the bandwidth (small matrices never reach it alone). `l2_prefetch(x, *weights)` returns x; on a GPU
(`impl="ffi"`: ffi/l2_prefetch.cu) one short grid issues L2 prefetches for every byte of `weights` and ends, so
placed on the data path just before such a kernel, the DRAM fetches run under it and the projections after it read
L2. Nothing waits for the prefetches and nothing is computed from them: the value is x, exactly, on every backend.
On the CPU the custom call (ffi/l2_prefetch.cc) only passes x through; `impl="xla"` is x itself.

Measured in the full step on an H100 (2026-12-06, docs/full_scale.md): the dots after it ran faster, but its own
grid did not end while its requests were in flight (line prefetches 10.4 µs a layer, bulk chunks 4.9 µs), and the
1 x 1 step was 5-7% slower; the model uses it only where `ffi_ops` names it.
"""

from __future__ import annotations

import jax
import numpy as np

from . import _registry

L2_BYTES = 50 * 2**20  # the L2 of an H100 or H200
PREFETCH_BUDGET = 40 * 2**20  # at most this much asked into L2 at once (room left for what the kernels read)
MODEL_BULK_BYTES = 16384  # the model's request size: bulk chunks (line prefetches kept their grid running as long as
# the DRAM transfer: 10 µs a layer on an H100, the step 7% slower; bulk chunks 4.9 µs, the step 5% slower)


def l2_prefetch(x: jax.Array, *weights, impl: str = "ffi", bulk_bytes: int = 0) -> jax.Array:
    """x, with every leaf array of `weights` (pytrees allowed: e.g. a MoE's Int4Array) asked into L2 first on a GPU.

    impl="ffi": the custom call (CUDA: the prefetches; CPU: x passed through, aliased); impl="xla": x. bulk_bytes: 0
    issues one prefetch a 128-byte line; a positive multiple of 16 one bulk prefetch (the copy engine) a chunk of
    that many bytes. The caller keeps the weights' total within L2 (`PREFETCH_BUDGET`): past it the first lines are
    evicted by the last.
    """
    if impl not in ("ffi", "xla"):
        raise ValueError(f"l2_prefetch: impl must be 'ffi' or 'xla', got {impl!r}")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"l2_prefetch: x must be an array, got {type(x).__name__}")
    if isinstance(bulk_bytes, bool) or not isinstance(bulk_bytes, (int, np.integer)) or bulk_bytes < 0 \
            or bulk_bytes % 16:
        raise ValueError(f"l2_prefetch: bulk_bytes must be 0 or a positive multiple of 16, got {bulk_bytes!r}")
    leaves = jax.tree.leaves(weights)
    for i, w in enumerate(leaves):
        if not hasattr(w, "shape") or not hasattr(w, "dtype"):
            raise TypeError(f"l2_prefetch: weight leaf {i} is not an array ({type(w).__name__})")
    if impl == "xla" or not leaves:
        return x
    _registry.register()
    call = jax.ffi.ffi_call("kdtree_l2_prefetch", jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential",
                            input_output_aliases={0: 0})

    def kernel(x, *ws):
        return call(x, *ws, bulk_bytes=np.int64(bulk_bytes))

    return jax.lax.platform_dependent(x, *leaves, cpu=kernel, cuda=kernel, default=lambda x, *ws: x)


def prefetch_plan(arrays, budget: int = PREFETCH_BUDGET) -> tuple:
    """The leading arrays of `arrays` (in order, pytrees as their leaves) whose bytes together fit `budget`."""
    out, total = [], 0
    for a in jax.tree.leaves(arrays):
        size = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        if total + size > budget:
            break
        out.append(a)
        total += size
    return tuple(out)
