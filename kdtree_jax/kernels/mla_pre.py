"""The projections between qkv_a and the attention of one MLA layer at a decode or verify step, as one custom call
(`impl="ffi"`: ffi/mla_pre.cc on CPU, ffi/mla_pre.cu on CUDA) or in pure JAX (`impl="xla"`, `mla_pre_ref`).

From a = x . qkv_a [B, T, Rq + R + dr] (the query latent, the key-value latent and the rope key of T new tokens):

    cq    = rms_norm(a[..., :Rq], q_a_norm)                     [B, T, Rq]
    q     = cq . q_b                                           [B, T, H, dn + dr]   (q_b stored [H, dn + dr, Rq])
    q_lat = q[..., :dn] . k_b  (absorbed)                      [B, T, H, R]         (k_b stored [R, H, dn])
    q_pe  = rope(q[..., dn:])                                  [B, T, H, dr]
    c_kv  = rms_norm(a[..., Rq:Rq + R], kv_a_norm) -> latent cache rows starts[b] .. starts[b] + T - 1
    k_pe  = rope(a[..., Rq + R:])                  -> rope-key cache rows, the same slots

with the model's rounding points (every product and norm in fp32, rounded to the activations' dtype where the model
rounds). In XLA these are eight kernels a layer at one token (two norms' sums of squares, a normalization, q_b,
k_b, the rope concatenation and the two cache writes), each a few µs of launch and ramp for ~6 MB of weights; the
CUDA kernel does them in one launch: a thread-block cluster per head, its blocks splitting q_b's rows and sharing
the head's q_nope through distributed shared memory for the absorption (docs/kernels.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry
from .move_rows import write_rows

FLAG_WEIGHT_PARAM = 1  # q_b, k_b and the norms are program inputs no kernel writes: loaded before the PDL wait
MAX_ROWS = 32  # tokens (B x T) of one call on the CUDA fast path; more run the reference
FAST_SHAPE = dict(dn=128, dr=64, r=512)  # the CUDA fast path's head sizes (Kimi K2 / DeepSeek-V3), bf16
FAST_RQ = (512, 1024, 1536, 2048)  # and query-latent widths (its kernel's instances)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """w * normalize(x), normalized in fp32 and cast back before the weight (as Hugging Face does)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B, T, (H,) dr]; the output keeps the interleaved order."""
    if x.ndim == 4:  # per-head queries: broadcast the tables over heads
        cos, sin = cos[:, :, None], sin[:, :, None]
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = pairs[..., 0].astype(jnp.float32), pairs[..., 1].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def _check(a, q_a_norm, kv_a_norm, q_b, k_b, cos, sin, latent, pe, starts) -> tuple[int, ...]:
    arrays = dict(a=a, q_a_norm=q_a_norm, kv_a_norm=kv_a_norm, q_b=q_b, k_b=k_b, cos=cos, sin=sin, latent=latent,
                  pe=pe, starts=starts)
    for name, x in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"mla_pre: {name} must be an array, got {type(x).__name__}")
    if len(a.shape) != 3 or len(q_b.shape) != 3 or len(k_b.shape) != 3 or len(latent.shape) != 3:
        raise ValueError(f"mla_pre: a [B, T, C], q_b [H, dn + dr, Rq], k_b [R, H, dn] and latent [B, S, R] expected, "
                         f"got {tuple(a.shape)}, {tuple(q_b.shape)}, {tuple(k_b.shape)}, {tuple(latent.shape)}")
    b, t, c = (int(d) for d in a.shape)
    h, dq, rq = (int(d) for d in q_b.shape)
    r, dn = int(k_b.shape[0]), int(k_b.shape[2])
    dr, s = dq - dn, int(latent.shape[1])
    want = dict(q_a_norm=(rq,), kv_a_norm=(r,), k_b=(r, h, dn), cos=(b, t, dr // 2), sin=(b, t, dr // 2),
                latent=(b, s, r), pe=(b, s, dr), starts=(b,))
    for name, shape in want.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"mla_pre: {name} has shape {tuple(arrays[name].shape)}, expected {shape} (from a "
                             f"{(b, t, c)}, q_b {(h, dq, rq)} and latent's S = {s})")
    if c != rq + r + dr or dr < 2 or dr % 2 or min(b, t, h, dn, rq) < 1:
        raise ValueError(f"mla_pre: a's last axis {c} must be Rq + R + dr = {rq} + {r} + {dr} (dr even, >= 2)")
    if t > s:
        raise ValueError(f"mla_pre: {t} new tokens for a cache of {s} slots")
    dtype = a.dtype
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"mla_pre: a must be float32 or bfloat16, got {dtype}")
    for name in ("q_a_norm", "kv_a_norm", "q_b", "k_b", "latent", "pe"):
        if arrays[name].dtype != dtype:
            raise TypeError(f"mla_pre: {name} is {arrays[name].dtype} but a is {dtype}; one dtype is expected")
    for name in ("cos", "sin"):
        if arrays[name].dtype != jnp.float32:
            raise TypeError(f"mla_pre: {name} must be float32, got {arrays[name].dtype}")
    if starts.dtype != jnp.int32:
        raise TypeError(f"mla_pre: starts must be int32, got {starts.dtype}")
    return b, t, h, dn, dr, rq, r, s


def mla_pre(a: jax.Array, q_a_norm: jax.Array, kv_a_norm: jax.Array, q_b: jax.Array, k_b: jax.Array,
            cos: jax.Array, sin: jax.Array, latent: jax.Array, pe: jax.Array, starts: jax.Array, *, eps: float,
            impl: str = "ffi", flags: int = 0) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(q_lat [B, T, H, R], q_pe [B, T, H, dr], latent, pe) of a [B, T, Rq + R + dr]; see the module docstring.

    q_a_norm [Rq], kv_a_norm [R], q_b [H, dn + dr, Rq], k_b [R, H, dn], latent [B, S, R] and pe [B, S, dr] in a's
    dtype (float32 or bfloat16); cos, sin float32 [B, T, dr / 2] (the rope tables at the tokens' positions, the
    attention factor included); starts int32 [B], >= 0 (the cache lengths): the first slot written in each row (a
    start past S - T writes at S - T, as `dynamic_update_slice` clamps; a negative start is not defined: the
    kernels clamp it to 0, the reference's `dynamic_update_slice` counts it from the end). The caches come back
    with the T rows written (in place).

    impl="ffi": the custom call (C++ on CPU; CUDA on GPU for bf16 with dn = 128, dr = 64, R = 512, Rq in FAST_RQ
    and B T <= MAX_ROWS, the reference otherwise and on other platforms); impl="xla": `mla_pre_ref`. Not
    partitioned: under a mesh, use the reference. flags: FLAG_WEIGHT_PARAM only where the weights are the
    program's inputs (the model's), so that the CUDA kernel may read them before the kernel before it has ended.
    """
    b, t, h, dn, dr, rq, r, s = _check(a, q_a_norm, kv_a_norm, q_b, k_b, cos, sin, latent, pe, starts)
    if impl == "xla":
        return mla_pre_ref(a, q_a_norm, kv_a_norm, q_b, k_b, cos, sin, latent, pe, starts, eps=eps)
    if impl != "ffi":
        raise ValueError(f"mla_pre: impl must be 'ffi' or 'xla', got {impl!r}")
    _registry.register()
    m = b * t
    outs = [jax.ShapeDtypeStruct((m, h, r), a.dtype), jax.ShapeDtypeStruct((m, h, dr), a.dtype),
            jax.ShapeDtypeStruct(latent.shape, latent.dtype), jax.ShapeDtypeStruct(pe.shape, pe.dtype)]
    fast = (a.dtype == jnp.bfloat16 and (dn, dr, r) == tuple(FAST_SHAPE.values()) and m <= MAX_ROWS
            and rq in FAST_RQ)

    def call(a, qn, kvn, qb, kb, cos, sin, starts, latent, pe):
        q_lat, q_pe, latent, pe = jax.ffi.ffi_call("kdtree_mla_pre", outs, vmap_method="sequential",
                                                   input_output_aliases={8: 2, 9: 3})(
            a.reshape(m, -1), qn, kvn, qb, kb, cos.reshape(m, -1), sin.reshape(m, -1), starts, latent, pe,
            eps=np.float32(eps), flags=np.int64(flags))
        return q_lat.reshape(b, t, h, r), q_pe.reshape(b, t, h, dr), latent, pe

    def other(a, qn, kvn, qb, kb, cos, sin, starts, latent, pe):
        return mla_pre_ref(a, qn, kvn, qb, kb, cos, sin, latent, pe, starts, eps=eps)

    args = (a, q_a_norm, kv_a_norm, q_b, k_b, cos, sin, starts, latent, pe)
    return tuple(jax.lax.platform_dependent(*args, cpu=call, cuda=call if fast else other, default=other))


def mla_pre_ref(a: jax.Array, q_a_norm: jax.Array, kv_a_norm: jax.Array, q_b: jax.Array, k_b: jax.Array,
                cos: jax.Array, sin: jax.Array, latent: jax.Array, pe: jax.Array, starts: jax.Array, *,
                eps: float) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure JAX: the model's own operations (`model.mla`'s absorbed mode, in its order)."""
    rq, dn = q_a_norm.shape[0], k_b.shape[2]
    r = kv_a_norm.shape[0]
    cq = rms_norm(a[..., :rq], q_a_norm, eps)
    q = jnp.einsum("btr,hkr->bthk", cq, q_b)  # [B, T, H, dn + dr]
    q_nope, q_pe = q[..., :dn], apply_rope(q[..., dn:], cos, sin)
    c_kv = rms_norm(a[..., rq:rq + r], kv_a_norm, eps)
    k_pe = apply_rope(a[..., rq + r:], cos, sin)
    latent, pe = write_rows(latent, c_kv, starts), write_rows(pe, k_pe, starts)
    q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, k_b)
    return q_lat, q_pe, latent, pe
