"""MLA-absorbed attention over the latent cache with a tree mask, as a custom call (`impl="ffi"`:
ffi/mla_verify.cc on CPU, ffi/mla_verify.cu on CUDA) or in pure JAX (`impl="xla"`, `mla_verify_ref`).

One DDTree verify step (or, with N = 1, one plain decode step) of one layer: query token n of batch row b sees the
committed prefix, slots 0 .. cache_lens[b] - 1 of the cache, and the tree tokens u with tree_mask[b, n, u], whose
latents are already written at slots cache_lens[b] + u. Per head h:

    s_k = scale * (q_nope_absorbed[b, n, h] . latent_cache[b, k] + q_pe[b, n, h] . pe_cache[b, k])
    out[b, n, h] = sum_k softmax(s)_k latent_cache[b, k]          (zeros for a row that sees nothing)

This is `mla_absorbed_attention` below (including its clamping when cache_lens + N > S). Softmax and
sums are fp32; the output has the queries' dtype.

The CUDA handler's fast path takes bf16 with R = 512 and dr = 64 (Kimi K2): a flash-decoding kernel on the tensor
cores that splits the keys over blocks when the batch alone does not fill the GPU; its fp32 partial results are
extra outputs of the call, sized here (`plan_splits`). (A second, "narrow" kernel for few query rows was measured
on the H200 on 2026-12-05, was no faster than this one's best split, and was removed: docs/kernels.md.) Every
other dtype or size (R <= 1024, dr <= 256) runs a generic CUDA-core kernel: correct, not fast.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry

FAST_RANK, FAST_ROPE = 512, 64  # the head sizes of the CUDA fast path (bf16 only)
FLAG_PLAIN = 1  # the CUDA fast path's kernels launched plainly, not as programmatic dependents (PDL) of the last
_ROWS, _KEYS = 64, 64  # the fast path's query rows per block and keys per tile
MAX_SPLITS = 1024


def _check(q_nope_absorbed, q_pe, latent_cache, pe_cache, cache_lens, tree_mask, scale) -> tuple[int, ...]:
    arrays = {"q_nope_absorbed": q_nope_absorbed, "q_pe": q_pe, "latent_cache": latent_cache,
              "pe_cache": pe_cache, "cache_lens": cache_lens, "tree_mask": tree_mask}
    for name, a in arrays.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"mla_verify: {name} must be an array, got {type(a).__name__}")
    ranks = {"q_nope_absorbed": (4, "[B, N, H, R]"), "q_pe": (4, "[B, N, H, dr]"), "latent_cache": (3, "[B, S, R]"),
             "pe_cache": (3, "[B, S, dr]"), "cache_lens": (1, "[B]"), "tree_mask": (3, "[B, N, N]")}
    for name, (rank, spec) in ranks.items():
        if len(arrays[name].shape) != rank:
            raise ValueError(f"mla_verify: {name} must be {spec}, got shape {tuple(arrays[name].shape)}")
    b, n, h, r = (int(d) for d in q_nope_absorbed.shape)
    dr, s = int(q_pe.shape[-1]), int(latent_cache.shape[1])
    want = {"q_pe": (b, n, h, dr), "latent_cache": (b, s, r), "pe_cache": (b, s, dr), "cache_lens": (b,),
            "tree_mask": (b, n, n)}
    for name, shape in want.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"mla_verify: {name} has shape {tuple(arrays[name].shape)}, expected {shape} from "
                             f"q_nope_absorbed {(b, n, h, r)}, q_pe's last axis and latent_cache's S")
    if min(b, n, h, r, dr) < 1:
        raise ValueError(f"mla_verify: empty queries: B, N, H, R, dr = {(b, n, h, r, dr)}")
    if s < n:
        raise ValueError(f"mla_verify: the cache has S = {s} slots, fewer than the N = {n} tree tokens it must hold")
    dtype = q_nope_absorbed.dtype
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"mla_verify: q_nope_absorbed must be float32 or bfloat16, got {dtype}")
    for name in ("q_pe", "latent_cache", "pe_cache"):
        if arrays[name].dtype != dtype:
            raise TypeError(f"mla_verify: {name} is {arrays[name].dtype} but q_nope_absorbed is {dtype}; "
                            "queries and caches must share one dtype")
    if not jnp.issubdtype(cache_lens.dtype, jnp.integer):
        raise TypeError(f"mla_verify: cache_lens must be integer, got {cache_lens.dtype}")
    if tree_mask.dtype != jnp.bool_:
        raise TypeError(f"mla_verify: tree_mask must be bool, got {tree_mask.dtype}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"mla_verify: scale must be a Python float (static), got {type(scale).__name__}")
    return b, n, h, r, dr, s


@functools.cache
def _sm_count() -> int:
    """Multiprocessors of the first GPU (132 on an H200 when none is visible): only sizes the key splits."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return 132
    return int(getattr(gpus[0], "core_count", 132) or 132)


FIXED_TILES = 6  # a block's fixed cost in key tiles: ~10 µs against ~1.75 µs a tile (H200, 2026-12-05 split sweep)


def plan_splits(b: int, n: int, h: int, s: int, sms: int | None = None) -> int:
    """Key splits per (batch row, 64-row query tile) of the CUDA fast path.

    One block per multiprocessor (the kernel takes ~225 KB of shared memory). A block pays a fixed cost before its
    first key tile (64 keys, 73.7 KB) of about FIXED_TILES tiles, so the time of a split is modelled as waves x
    (FIXED_TILES + key tiles a block), and the split with the least of it is taken (ties: the fewest splits). A
    split's fp32 partial output (rows x 2 KB, written and read back by the combine, from L2) may be up to twice the
    bytes it streams. On the H200's split sweep (2026-12-05, 4k context) this picks the fastest measured split at
    1 x 1, 1 x 9 and 1 x 17 (64, 32, 32), 13 at 10 x 1 (12 measured fastest) and 128 at 1 x 1 and 131k (119-128 the
    fastest), where the rule before it (at least 4 key tiles a split, partials under half the bytes streamed, the
    fewest splits keeping 90% of the SMs busy) took 16, 8, 8, 12 and 119: 15.0, 23.4 and 23.8 µs against 12.8,
    15.1 and 15.6 at the first three.
    """
    sms = _sm_count() if sms is None else sms
    work = b * math.ceil(n * h / _ROWS)
    if work >= sms:
        return 1
    rows = min(_ROWS, n * h)
    tiles = math.ceil(s / _KEYS)
    least = max(1, math.ceil(rows * 2 * 2048 / (2 * _KEYS * 1152)))  # key tiles a split at least
    cap = max(1, min(tiles // least, MAX_SPLITS))

    def cost(splits: int) -> int:
        return math.ceil(work * splits / sms) * (FIXED_TILES + math.ceil(tiles / splits))

    return min(range(1, cap + 1), key=lambda sp: (cost(sp), sp))


def launch_flags() -> np.int64:
    """The CUDA fast path's launch flags, from KDTREE_JAX_MLA_PDL (read at trace time): "1" 0 (both kernels
    programmatic dependents of the kernel before them), "0" or unset FLAG_PLAIN (plain launches: the default until
    the PDL launches have run their GPU tests and been timed); any other value is refused."""
    value = os.environ.get("KDTREE_JAX_MLA_PDL", "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"KDTREE_JAX_MLA_PDL must be 1 (PDL launches) or 0 (plain, the default), got {value!r}")
    return np.int64(0 if value == "1" else FLAG_PLAIN)


def mla_verify(q_nope_absorbed: jax.Array, q_pe: jax.Array, latent_cache: jax.Array, pe_cache: jax.Array,
               cache_lens: jax.Array, tree_mask: jax.Array, scale: float, *, impl: str = "ffi",
               num_splits: int | None = None) -> jax.Array:
    """Attention of the absorbed queries over the latent cache; see the module docstring.

    q_nope_absorbed [B, N, H, R] and q_pe [B, N, H, dr], latent_cache [B, S, R] and pe_cache [B, S, dr] (one dtype,
    float32 or bfloat16; the N tree tokens already written at cache_lens[b] ..), cache_lens int [B], tree_mask bool
    [B, N, N], scale a static float -> [B, N, H, R] in the queries' dtype.

    impl="ffi" runs the custom call (C++ on CPU, CUDA on GPU, the reference on other platforms); impl="xla" runs
    `mla_verify_ref`. num_splits overrides `plan_splits` for the CUDA fast path (benchmarks). No host sync.
    """
    b, n, h, r, dr, s = _check(q_nope_absorbed, q_pe, latent_cache, pe_cache, cache_lens, tree_mask, scale)
    if impl == "xla":
        return mla_verify_ref(q_nope_absorbed, q_pe, latent_cache, pe_cache, cache_lens, tree_mask, scale)
    if impl != "ffi":
        raise ValueError(f"mla_verify: impl must be 'ffi' or 'xla', got {impl!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer))
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"mla_verify: num_splits must be an int in 1..{MAX_SPLITS}, got {num_splits!r}")
    _registry.register()
    out = jax.ShapeDtypeStruct((b, n, h, r), q_nope_absorbed.dtype)
    fast = q_nope_absorbed.dtype == jnp.bfloat16 and r == FAST_RANK and dr == FAST_ROPE
    splits = (num_splits or plan_splits(b, n, h, s)) if fast else 1
    rows = n * h if splits > 1 else 0
    scratch = [jax.ShapeDtypeStruct((b, splits, rows, r), jnp.float32),  # normalized partial outputs
               jax.ShapeDtypeStruct((b, splits, rows, 2), jnp.float32)]  # their (row max, row sum)
    attrs = dict(scale=np.float32(scale))

    def cpu(*args):
        return jax.ffi.ffi_call("kdtree_mla_verify", out, vmap_method="sequential")(*args, **attrs)

    def cuda(*args):
        return jax.ffi.ffi_call("kdtree_mla_verify", [out, *scratch], vmap_method="sequential")(
            *args, **attrs, flags=launch_flags())[0]

    def other(*args):
        return mla_verify_ref(*args, scale)

    args = (q_nope_absorbed, q_pe, latent_cache, pe_cache, cache_lens.astype(jnp.int32), tree_mask)
    return jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=other)


def mla_verify_ref(q_nope_absorbed: jax.Array, q_pe: jax.Array, latent_cache: jax.Array, pe_cache: jax.Array,
                   cache_lens: jax.Array, tree_mask: jax.Array, scale: float) -> jax.Array:
    """Pure JAX (einsum + mask + softmax, `mla_absorbed_attention`), cast to the queries' dtype."""
    out = mla_absorbed_attention(q_nope_absorbed, q_pe, latent_cache, pe_cache, cache_lens, tree_mask, scale)
    return out.astype(q_nope_absorbed.dtype)


def mask_softmax(scores: jax.Array, visible: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax over `axis` of fp32 scores where `visible`; a row with nothing visible gives zeros, not NaN."""
    scores = jnp.where(visible, scores, -jnp.inf)
    peak = jnp.max(scores, axis=axis, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    p = jnp.where(visible, jnp.exp(scores - peak), 0.0)
    total = jnp.sum(p, axis=axis, keepdims=True)
    return p / jnp.where(total == 0, 1.0, total)


def mla_absorbed_attention(q_lat, q_pe, latent, k_pe, lengths, tree_mask, scale):
    """Absorbed MLA over the latent cache, each new token seeing the committed prefix and its tree ancestors.

    q_lat [B, T, H, R] (q_nope @ W_UK), q_pe [B, T, H, dr], latent [B, S, R], k_pe [B, S, dr] with the T new
    tokens already written at slots lengths[b] .. lengths[b] + T - 1, lengths [B], tree_mask bool [B, T, T]
    (query t sees new token u). Returns the latent output [B, T, H, R] in fp32 (softmax and sums in fp32).
    This is the function of the `mla_verify` custom call.
    """
    t = q_lat.shape[1]
    f32 = jnp.float32
    with jax.named_scope("prefix"):
        s_pre = (jnp.einsum("bthr,bsr->bths", q_lat, latent, preferred_element_type=f32)
                 + jnp.einsum("bthp,bsp->bths", q_pe, k_pe, preferred_element_type=f32)) * scale
        seen = jnp.arange(latent.shape[1])[None, :] < lengths[:, None]  # [B, S]
    with jax.named_scope("tree"):
        take = jax.vmap(lambda c, s: jax.lax.dynamic_slice_in_dim(c, s, t, axis=0))
        lat_new, pe_new = take(latent, lengths), take(k_pe, lengths)  # [B, T, R], [B, T, dr]
        s_new = (jnp.einsum("bthr,bur->bthu", q_lat, lat_new, preferred_element_type=f32)
                 + jnp.einsum("bthp,bup->bthu", q_pe, pe_new, preferred_element_type=f32)) * scale
    scores = jnp.concatenate([s_pre, s_new], axis=-1)  # [B, T, H, S + T]
    visible = jnp.concatenate([jnp.broadcast_to(seen[:, None, None, :], s_pre.shape),
                               jnp.broadcast_to(tree_mask[:, :, None, :], s_new.shape)], axis=-1)
    p = mask_softmax(scores, visible)
    s = latent.shape[1]
    out = jnp.einsum("bths,bsr->bthr", p[..., :s], latent.astype(f32))
    return out + jnp.einsum("bthu,bur->bthr", p[..., s:], lat_new.astype(f32))


def prefix_attention_ref(q_lat, q_pe, latent, pe, visible, scale):
    """Attention of the queries over slots 0 .. visible[b] - 1 of the cache alone, with its log-sum-exp.

    q_lat [B, T, H, R], q_pe [B, T, H, dr], latent [B, S, R], pe [B, S, dr], visible int [B] (any value; clamped
    to 0 .. S by the comparison). Returns (out [B, T, H, R] fp32, normalized; lse [B, T, H] fp32, the natural log of
    the sum of exp(scale * score) over the visible slots, -inf for a row that sees nothing, whose out is 0).
    Partial results over disjoint slot sets combine exactly with `combine_lse`.
    """
    f32 = jnp.float32
    s = (jnp.einsum("bthr,bsr->bths", q_lat, latent, preferred_element_type=f32)
         + jnp.einsum("bthp,bsp->bths", q_pe, pe, preferred_element_type=f32)) * scale  # [B, T, H, S]
    seen = (jnp.arange(latent.shape[1])[None, :] < visible[:, None])[:, None, None, :]  # [B, 1, 1, S]
    return _normalized_lse(jnp.where(seen, s, -jnp.inf), seen, latent.astype(f32))


def tree_attention_lse(q_lat, q_pe, new_lat, new_pe, tree_mask, scale):
    """Attention of the T new tokens' queries over the new tokens themselves through tree_mask [B, T, T], with its
    log-sum-exp: new_lat [B, T, R], new_pe [B, T, dr] (the latents being written this step); the other arguments
    and the results as in `prefix_attention_ref`."""
    f32 = jnp.float32
    s = (jnp.einsum("bthr,bur->bthu", q_lat, new_lat, preferred_element_type=f32)
         + jnp.einsum("bthp,bup->bthu", q_pe, new_pe, preferred_element_type=f32)) * scale  # [B, T, H, T]
    seen = tree_mask[:, :, None, :]  # [B, T, 1, T]
    return _normalized_lse(jnp.where(seen, s, -jnp.inf), seen, new_lat.astype(f32))


def _normalized_lse(s, seen, values):
    """(softmax(s) @ values, logsumexp(s)) over the last axis of masked fp32 scores s [B, T, H, K]."""
    peak = jnp.max(s, axis=-1)  # [B, T, H]
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    p = jnp.where(seen, jnp.exp(s - peak[..., None]), 0.0)
    total = jnp.sum(p, axis=-1)
    out = jnp.einsum("bthk,bkr->bthr", p, values) / jnp.where(total == 0, 1.0, total)[..., None]
    return out, jnp.where(total > 0, peak + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def combine_lse(*parts):
    """One attention result from partial ones over disjoint key sets: parts of (out [..., R] normalized, lse [...]).
    Returns (out, lse) as if the keys had been attended together; rows no part saw stay 0 / -inf."""
    peak = functools.reduce(jnp.maximum, [lse for _, lse in parts])
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = [jnp.where(jnp.isfinite(lse), jnp.exp(lse - peak), 0.0) for _, lse in parts]
    total = sum(weights)
    out = sum(w[..., None] * o for (o, _), w in zip(parts, weights)) / jnp.where(total == 0, 1.0, total)[..., None]
    return out, jnp.where(total > 0, peak + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def mla_prefix(q_lat: jax.Array, q_pe: jax.Array, latent: jax.Array, pe: jax.Array, visible: jax.Array,
               scale: float, *, impl: str = "ffi", num_splits: int | None = None):
    """`prefix_attention_ref` on the CUDA fast path of the custom call where it applies (bf16, R = 512, dr = 64,
    S >= T; the tree mask all false, so only slots < visible count): the kernel runs with at least two key splits
    and its fp32 partials and (row max, row sum) stats are combined here into the output and the log-sum-exp.
    Elsewhere (CPU, other shapes, impl="xla") the pure-JAX reference. Used per device on a sequence-sharded
    cache, where each device attends over its own block of slots."""
    b, t, h, r = (int(d) for d in q_lat.shape)
    dr, s = int(q_pe.shape[-1]), int(latent.shape[1])
    fast = impl == "ffi" and q_lat.dtype == jnp.bfloat16 and r == FAST_RANK and dr == FAST_ROPE and s >= t
    if not fast:
        return prefix_attention_ref(q_lat, q_pe, latent, pe, visible, scale)
    _check(q_lat, q_pe, latent, pe, visible, jnp.zeros((b, t, t), bool), scale)
    _registry.register()
    splits = max(2, num_splits or plan_splits(b, t, h, s))
    m = t * h
    shapes = [jax.ShapeDtypeStruct((b, t, h, r), q_lat.dtype), jax.ShapeDtypeStruct((b, splits, m, r), jnp.float32),
              jax.ShapeDtypeStruct((b, splits, m, 2), jnp.float32)]

    def cuda(q, qp, lat, pe_, vis):
        none = jnp.zeros((b, t, t), bool)
        _, part, stats = jax.ffi.ffi_call("kdtree_mla_verify", shapes, vmap_method="sequential")(
            q, qp, lat, pe_, vis, none, scale=np.float32(scale), flags=launch_flags())
        peak2, rowsum = stats[..., 0], stats[..., 1]  # [B, splits, M]: log2-scaled row max, row sum
        top = jnp.max(jnp.where(rowsum > 0, peak2, -jnp.inf), axis=1)  # [B, M]
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        w = jnp.where(rowsum > 0, rowsum * jnp.exp2(peak2 - top[:, None]), 0.0)  # [B, splits, M]
        total = jnp.sum(w, axis=1)
        out = jnp.einsum("bsm,bsmr->bmr", w, part) / jnp.where(total == 0, 1.0, total)[..., None]
        lse = jnp.where(total > 0, (top + jnp.log2(jnp.where(total > 0, total, 1.0))) * math.log(2.0), -jnp.inf)
        return out.reshape(b, t, h, r), lse.reshape(b, t, h)

    def other(q, qp, lat, pe_, vis):
        return prefix_attention_ref(q, qp, lat, pe_, vis, scale)

    args = (q_lat, q_pe, latent, pe, visible.astype(jnp.int32))
    return jax.lax.platform_dependent(*args, cuda=cuda, default=other)
