"""Rows moved within every batch row of several caches at once, as one custom call (`impl="ffi"`:
ffi/move_rows.cc on CPU, ffi/move_rows.cu on CUDA) or in pure JAX (`impl="xla"`, `move_rows_ref`).

After a tree step the accepted nodes' latents sit at slots starts[b] + node; the next step wants them at
starts[b] + depth (`model.move_accepted`). In XLA that is a gather and an in-place update per cache and layer (122
kernels a step for K2's 61 layers and two caches); the custom call moves every cache's rows in one launch, each
block staging its rows before it writes them (a source may be another row's destination).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry


def _check(caches, starts, path, n_nodes) -> None:
    if not caches:
        raise ValueError("move_rows: no caches")
    for name, a in {"starts": starts, "path": path}.items():
        if not hasattr(a, "shape") or a.dtype != jnp.int32:
            raise TypeError(f"move_rows: {name} must be an int32 array")
    if len(starts.shape) != 1 or len(path.shape) != 2 or path.shape[0] != starts.shape[0]:
        raise ValueError(f"move_rows: starts must be [B] and path [B, P], got {tuple(starts.shape)} and "
                         f"{tuple(path.shape)}")
    if not isinstance(n_nodes, (int, np.integer)) or n_nodes < 1:
        raise ValueError(f"move_rows: n_nodes must be an integer >= 1, got {n_nodes!r}")
    b, p = path.shape
    s, dtype = caches[0].shape[1] if len(caches[0].shape) == 3 else None, caches[0].dtype
    for i, c in enumerate(caches):
        if len(c.shape) != 3 or c.shape[0] != b or c.shape[1] != s or c.dtype != dtype:
            raise ValueError(f"move_rows: every cache must be [B, S, C] with one B, S and dtype ({b}, {s}, "
                             f"{dtype}); cache {i} is {tuple(c.shape)} {c.dtype}")
    if p > s:
        raise ValueError(f"move_rows: path of {p} nodes for a cache of {s} slots")


def move_rows(caches: Sequence[jax.Array], starts: jax.Array, path: jax.Array, n_nodes: int, *,
              impl: str = "ffi") -> tuple[jax.Array, ...]:
    """Every cache [B, S, C_i] (one B, S and dtype; any widths) with its rows at slots
    starts[b] + clip(path[b, j], 0, n_nodes - 1) moved to slots starts[b] + j, j < P (path int32 [B, P]; a start
    past S - P writes at S - P, as `dynamic_update_slice` clamps). Sources must lie in the cache (starts[b] + n_nodes
    <= S: the loop's cache has room for the tree); the custom call clamps one that does not to the last slot.

    impl="ffi": one custom call for all caches, in place (C++ on CPU, CUDA on GPU, the reference elsewhere);
    impl="xla": `move_rows_ref`. Not partitioned: under a mesh, call it per device or use the reference.
    """
    caches = tuple(caches)
    _check(caches, starts, path, n_nodes)
    if impl == "xla":
        return move_rows_ref(caches, starts, path, n_nodes)
    if impl != "ffi":
        raise ValueError(f"move_rows: impl must be 'ffi' or 'xla', got {impl!r}")
    _registry.register()
    outs = [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches]

    def kernel(starts, path, *caches):
        call = jax.ffi.ffi_call("kdtree_move_rows", outs, vmap_method="sequential",
                                input_output_aliases={2 + i: i for i in range(len(caches))})
        return tuple(call(starts, path, *caches, n_nodes=np.int64(n_nodes)))

    def other(starts, path, *caches):
        return move_rows_ref(caches, starts, path, n_nodes)

    return tuple(jax.lax.platform_dependent(starts, path, *caches, cpu=kernel, cuda=kernel, default=other))


def move_rows_ref(caches: Sequence[jax.Array], starts: jax.Array, path: jax.Array,
                  n_nodes: int) -> tuple[jax.Array, ...]:
    """Pure JAX: per cache, the source rows gathered, then written at starts[b] (`write_rows`)."""
    slots = starts[:, None] + jnp.clip(path, 0, n_nodes - 1)  # [B, P]
    return tuple(write_rows(c, jnp.take_along_axis(c, slots[:, :, None], axis=1), starts) for c in caches)


def write_rows(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """cache [B, S, ...] with new [B, T, ...] written at slots starts[b] .. starts[b] + T - 1 of each row (in place;
    a start past S - T is clamped to it)."""
    if cache.shape[0] == 1:  # one row: a plain update (the vmapped one is a scatter, whose out-of-bounds rule made
        # XLA read the old rows back and select: one more kernel per cache and layer at batch 1; both clamp the start)
        return jax.lax.dynamic_update_slice_in_dim(cache, new, starts[0], axis=1)
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=0))(cache, new, starts)
