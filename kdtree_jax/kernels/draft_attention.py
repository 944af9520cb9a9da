"""The DFlash drafter's block attention as one custom call (`impl="ffi"`: ffi/draft_attention.cc on CPU,
ffi/draft_attention.cu on CUDA) or in pure JAX (`impl="xla"`, `draft_attention_ref`).

The drafter's block of T tokens (the bonus and T - 1 masks) attends, with grouped-query heads, to the context keys
and values its layer cached for the committed tokens and to the block's own keys and values, both ways. XLA runs
that as 12 kernels a layer (the scores of the two parts, a two-stage max and sum, slices, the two products and
their sum: `python benchmarks/xla_kernels.py --program draft`), each a few microseconds whatever it moves, six
layers a draft. The CUDA kernel is flash decoding: blocks of 64 query rows of one key/value head take a share of
the keys each, in tiles of 32, with an online softmax in fp32, and a second kernel joins the shares (the split
count is planned here, `plan_splits`, and sizes the call's fp32 scratch outputs). Two kernels compute a block:
on the tensor cores (the default, for bf16 with head dims a multiple of 16: on an H100, 0.68-0.75x the GPU time of
XLA's kernels for the sharded and replicated drafters at batch 1 and the sharded one at batch 10, 1.15x for the
replicated one at batch 10: `benchmarks/draft_attention.py`), or on the CUDA cores when asked (`mma=False` or
KDTREE_JAX_DRAFT_MMA=0; slower than XLA's kernels but at one device's batch 1). Other dtypes and head dims run
XLA's operations on a GPU unless a kernel is asked for.

Differences from the reference: the CUDA-core kernel keeps the probabilities in fp32 for the products (the
reference and the tensor-core kernel round them to bf16 first), and both sum in another order.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry

MAX_DIM = 128  # the CUDA kernel's head dim at most
ROWS = 64  # the CUDA kernel's query rows a block
KEYS = 32  # the CUDA kernel's keys a tile
MAX_SPLITS = 256
SMS = 132  # an H100's or H200's multiprocessors: only sizes the splits
DTYPES = (jnp.float32, jnp.bfloat16)


def _check(q, ck, cv, kb, vb, lengths, scale) -> None:
    named = dict(q=q, ck=ck, cv=cv, kb=kb, vb=vb, lengths=lengths)
    for name, a in named.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"draft_attention: {name} must be an array, got {type(a).__name__}")
    if any(len(a.shape) != 4 for a in (q, ck, cv, kb, vb)):
        raise ValueError("draft_attention: q, ck, cv, kb and vb must be 4-D, got "
                         + ", ".join(f"{n} {tuple(a.shape)}" for n, a in named.items() if n != "lengths"))
    b, t, h, d = q.shape
    s, g = ck.shape[1], ck.shape[2]
    if (tuple(ck.shape) != (b, s, g, d) or tuple(cv.shape) != (b, s, g, d) or tuple(kb.shape) != (b, t, g, d)
            or tuple(vb.shape) != (b, t, g, d) or g < 1 or h % g or tuple(lengths.shape) != (b,)):
        raise ValueError(f"draft_attention: expected q [B, T, H, D], ck/cv [B, S, G, D], kb/vb [B, T, G, D] with G "
                         f"dividing H, lengths [B]; got q {tuple(q.shape)}, ck {tuple(ck.shape)}, cv "
                         f"{tuple(cv.shape)}, kb {tuple(kb.shape)}, vb {tuple(vb.shape)}, lengths "
                         f"{tuple(lengths.shape)}")
    if q.dtype not in DTYPES or any(a.dtype != q.dtype for a in (ck, cv, kb, vb)):
        raise TypeError(f"draft_attention: q, ck, cv, kb and vb must share one dtype of float32 or bfloat16, got "
                        f"{', '.join(str(a.dtype) for a in (q, ck, cv, kb, vb))}")
    if lengths.dtype != jnp.int32:
        raise TypeError(f"draft_attention: lengths must be int32, got {lengths.dtype}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale):
        raise ValueError(f"draft_attention: scale must be a finite number, got {scale!r}")


def plan_splits(b: int, t: int, h: int, g: int, s: int, sms: int = SMS) -> int:
    """Key splits of the CUDA kernel: enough blocks for two on every multiprocessor, each split at least one tile of
    keys (of the cache's S + T; the kernel divides the row's own keys, lengths[b] + T)."""
    blocks = b * g * math.ceil(t * (h // g) / ROWS)
    tiles = math.ceil((s + t) / KEYS)
    return max(1, min(MAX_SPLITS, tiles, math.ceil(2 * sms / max(blocks, 1))))


def draft_attention(q: jax.Array, ck: jax.Array, cv: jax.Array, kb: jax.Array, vb: jax.Array, lengths: jax.Array,
                    scale: float, *, impl: str = "ffi", num_splits: int | None = None,
                    mma: bool | None = None) -> jax.Array:
    """Queries q [B, T, H, D] over the context keys/values ck, cv [B, S, G, D] below lengths[b] (clamped to 0..S)
    and the whole block's kb, vb [B, T, G, D] (G heads, each shared by H / G query heads: head h uses h // (H / G)).
    Returns [B, T, H, D] in q's dtype; fp32 scores, softmax and sums.

    impl="ffi": the custom call (C++ on CPU; CUDA for head dims up to 128, else the reference); impl="xla":
    `draft_attention_ref`. num_splits overrides `plan_splits` (benchmarks). On a GPU, mma picks the kernel: True,
    the tensor cores where they apply (bf16, a head dim a multiple of 16), else the CUDA cores; False, the CUDA
    cores; None (the default), KDTREE_JAX_DRAFT_MMA=1 or 0 if set, else the tensor cores where they apply and XLA's
    operations (the reference) where not: the CUDA-core kernel was slower than them in 3 of 4 drafter shapes, the
    tensor-core kernel faster in 3 of 4 (H100, 2026-12-07, `benchmarks/draft_attention.py`). Not
    partitioned: under a mesh, call it per shard of heads (`sharding.draft_head_parallel`, as
    `drafter.block_attention` does).
    """
    _check(q, ck, cv, kb, vb, lengths, scale)
    if impl == "xla":
        return draft_attention_ref(q, ck, cv, kb, vb, lengths, scale)
    if impl != "ffi":
        raise ValueError(f"draft_attention: impl must be 'ffi' or 'xla', got {impl!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer))
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"draft_attention: num_splits must be an int in 1..{MAX_SPLITS}, got {num_splits!r}")
    _registry.register()
    b, t, h, d = q.shape
    s, g = ck.shape[1], ck.shape[2]
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if mma is not None and not isinstance(mma, (bool, np.bool_)):
        raise TypeError(f"draft_attention: mma must be a bool or None, got {mma!r}")
    env = os.environ.get("KDTREE_JAX_DRAFT_MMA", "")
    if env not in ("", "0", "1"):
        raise ValueError(f"KDTREE_JAX_DRAFT_MMA must be 0 or 1 (or unset), got {env!r}")
    chosen = mma if mma is not None else {"0": False, "1": True}.get(env)
    tensor_cores = q.dtype == jnp.bfloat16 and d % 16 == 0
    splits = num_splits or plan_splits(b, t, h, g, s)
    rows = g * t * (h // g)
    scratch = [jax.ShapeDtypeStruct((b, rows, splits, d), jnp.float32),  # unnormalized partial rows
               jax.ShapeDtypeStruct((b, rows, splits, 2), jnp.float32)]  # their (row max, row sum)
    attrs = dict(scale=np.float32(scale))

    def cpu(*args):
        return jax.ffi.ffi_call("kdtree_draft_attention", out, vmap_method="sequential")(*args, **attrs)

    def cuda(*args):
        return jax.ffi.ffi_call("kdtree_draft_attention", [out, *scratch], vmap_method="sequential")(
            *args, **attrs, mma=np.int32(chosen is not False))[0]

    def other(*args):
        return draft_attention_ref(*args, scale)

    args = (q, ck, cv, kb, vb, lengths)
    if d > MAX_DIM or (chosen is None and not tensor_cores):  # the CUDA-core kernel only when asked for
        return jax.lax.platform_dependent(*args, cpu=cpu, default=other)
    return jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=other)


def draft_attention_ref(q, ck, cv, kb, vb, lengths, scale: float) -> jax.Array:
    """Pure JAX: one softmax over the context and the block together (fp32 scores; the probabilities rounded to q's
    dtype before the products, as XLA's fused products read them)."""
    b, bs, h, hd = q.shape
    g, f32 = ck.shape[2], jnp.float32
    q = q.reshape(b, bs, g, h // g, hd)
    seen = jnp.arange(ck.shape[1])[None, :] < lengths[:, None]  # [B, S]
    s_ctx = jnp.einsum("btgrk,bsgk->btgrs", q, ck, preferred_element_type=f32) * scale
    s_blk = jnp.einsum("btgrk,bugk->btgru", q, kb, preferred_element_type=f32) * scale
    s_ctx = jnp.where(seen[:, None, None, None, :], s_ctx, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    s = ck.shape[1]
    o = (jnp.einsum("btgrs,bsgk->btgrk", probs[..., :s].astype(q.dtype), cv)
         + jnp.einsum("btgru,bugk->btgrk", probs[..., s:].astype(q.dtype), vb))
    return o.reshape(b, bs, h, hd)
