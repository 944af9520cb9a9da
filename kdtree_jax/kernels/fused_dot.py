"""A layer's dense weights at the few rows of a decode step, with what surrounds them in the layer, as one custom
call (`impl="ffi"`: ffi/fused_dot.cc on CPU, ffi/fused_dot.cu on CUDA) or in pure JAX (`impl="xla"`,
`fused_dot_ref`).

For x [..., K] and one or two weights w [K, N] that share it:

    x'  = rms_norm(x, norm, eps)           (norm given; else x' = x)
    y   = x' . w                            fp32 accumulation, then one of
          plain:  cast to out_dtype (bf16 or f32), then y = add + y for each addend in order (bf16)
          gated:  w = [gate | up] along N: y = silu(gate) * up, [..., N / 2], bf16
    y2  = the same for w2 (plain or gated, no addends)
    xn  = x' itself, [..., K] (want_xn: the routed experts' input)

That is the layer's glue: the attention's RMSNorm + q_a/kv_a projection; the o projection + the residual add; the
MLP's RMSNorm + router logits (f32) + the shared expert's gate/up and SwiGLU, with the normalized rows for the routed
experts; the shared expert's down projection + the routed experts' output + the residual. XLA ran each of these as
2-7 kernels at M = 1 (a split-K dot and its reduction, two for a norm, the gate's multiply), each 1-8 µs whatever it
moved; the custom call is one kernel.

The custom call rounds x' as the reference does (each block of the CUDA kernel reads the whole rows of x for their
sums of squares first), so the two differ in the order of the fp32 sums (and, on the GPU, an approximate reciprocal
square root): in x' by one ulp in rare elements, where r lands x r on the other side of a rounding. On the GPU that
was enough for greedy ddtree (verify steps without the custom call) to leave ar on the tiny test model: opt-in.

The CUDA kernels take bf16 operands, at most MAX_ROWS rows, K (up to 8192) and every N multiples of 64: each block
streams 64 columns of a weight (128 bytes a row), the K split over a thread-block cluster as far as the clusters all
fit at once, launched as a programmatic dependent of the kernel ahead and, for weights that are parameters
(`FLAG_WEIGHT_PARAM`), loading their first rows before that kernel ends. Up to MAX_CORE_ROWS rows the products run
on the CUDA cores; above (up to 32 rows: a ddtree verify of up to 31 nodes, a drafter's block of 8 to 32) on the
tensor cores, the weight as mma's B operand, so the rows need no padding past 8 or 16 and the weight is read once
whatever M (FLAG_MMA takes them at M <= 4 too). Other shapes run the reference on the GPU; the CPU custom call takes
any bf16 shape.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry
from .mla_pre import rms_norm

MAX_ROWS = 32  # the CUDA kernels' rows at most (the tensor-core kernel's; the CUDA-core kernel takes up to 4)
MAX_CORE_ROWS = 4
K_TILE = 64  # the CUDA kernel: K a multiple of it
MAX_K = 8192  # the CUDA kernel: K at most
N_TILE = 64  # the CUDA kernel: every N a multiple of it
FLAG_PLAIN = 1  # a plain launch instead of a programmatic dependent one (benchmarks)
FLAG_WEIGHT_PARAM = 2  # the weights and the norm weight are parameters no kernel of the program writes: their first
#                        stages load before the wait for the kernel ahead (never for an array computed in the program)
FLAG_L2_LINES = 4  # the CUDA kernel's weight loads ask L2 for whole 256-byte lines (neighbouring blocks read the rest)
FLAG_MMA = 8  # the tensor-core kernel at M <= MAX_CORE_ROWS too (benchmarks; above it, always)
SMEM_BYTES = 227 * 1024  # an H100's or H200's shared memory a block (opt-in)
OUT_DTYPES = (jnp.bfloat16, jnp.float32)


def _check(x, w, w2, norm, adds, gated, gated2, out_dtype, out2_dtype):
    for name, a in (("x", x), ("w", w), ("w2", w2), ("norm", norm)) + tuple((f"adds[{i}]", a) for i, a in
                                                                              enumerate(adds)):
        if a is not None and (not hasattr(a, "shape") or not hasattr(a, "dtype")):
            raise TypeError(f"fused_dot: {name} must be an array, got {type(a).__name__}")
    if len(x.shape) < 1 or len(w.shape) != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fused_dot: expected x [..., K] and w [K, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    k = x.shape[-1]
    if w2 is not None and (len(w2.shape) != 2 or w2.shape[0] != k):
        raise ValueError(f"fused_dot: expected w2 [K, N2] with K = {k}, got {tuple(w2.shape)}")
    if norm is not None and tuple(norm.shape) != (k,):
        raise ValueError(f"fused_dot: expected norm [K] = [{k}], got {tuple(norm.shape)}")
    for name, ww, g in (("w", w, gated), ("w2", w2, gated2)):
        if ww is not None and g and ww.shape[1] % 2:
            raise ValueError(f"fused_dot: a gated {name} needs an even N ([gate | up]), got {tuple(ww.shape)}")
    out = w.shape[1] // 2 if gated else w.shape[1]
    if len(adds) > 2:
        raise ValueError(f"fused_dot: at most two addends, got {len(adds)}")
    for i, a in enumerate(adds):
        if tuple(a.shape) != tuple(x.shape[:-1]) + (out,):
            raise ValueError(f"fused_dot: adds[{i}] must be {tuple(x.shape[:-1]) + (out,)}, got {tuple(a.shape)}")
    for name, dt, g, has_adds in (("out_dtype", out_dtype, gated, bool(adds)),
                                  ("out2_dtype", out2_dtype, gated2, False)):
        if jnp.dtype(dt) not in [jnp.dtype(d) for d in OUT_DTYPES]:
            raise TypeError(f"fused_dot: {name} must be bfloat16 or float32, got {jnp.dtype(dt).name}")
        if (g or has_adds) and jnp.dtype(dt) != jnp.dtype(x.dtype):
            raise TypeError(f"fused_dot: a gated output or one with addends keeps x's dtype "
                            f"({jnp.dtype(x.dtype).name}), got {name}={jnp.dtype(dt).name}")


def _layer_views(w, w2, norm, layer):
    """The shapes of the layer-th of stacks w [L, K, N], w2 [L, K, N2] and norm [L, K] (`fused_dot`'s layer), as
    ShapeDtypeStructs for the checks, after checking the stacks and the index."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"fused_dot: layer must be None or an int, got {type(layer).__name__}")
    if not hasattr(w, "shape") or len(w.shape) != 3:
        raise ValueError(f"fused_dot: with layer, w must be a stack [L, K, N], got {tuple(getattr(w, 'shape', ()))}")
    n_layers = w.shape[0]
    if not 0 <= layer < n_layers:
        raise ValueError(f"fused_dot: layer must be in [0, {n_layers}) for a stack of {n_layers}, got {layer}")
    for name, a, rank in (("w2", w2, 3), ("norm", norm, 2)):
        if a is not None and (not hasattr(a, "shape") or len(a.shape) != rank or a.shape[0] != n_layers):
            raise ValueError(f"fused_dot: with layer, {name} must be a stack of {n_layers} like w, got "
                             f"{tuple(getattr(a, 'shape', ()))}")
    view = lambda a: None if a is None else jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype)
    return view(w), view(w2), view(norm)


def on_ffi_path(x, w, w2=None, norm=None, adds=()) -> bool:
    """Whether the custom call takes these operands at all (else `fused_dot` runs the reference everywhere): every
    array bf16 and at least one row. Which of them the CUDA kernel takes: `on_cuda_path`."""
    arrays = [x, w] + [a for a in (w2, norm) if a is not None] + list(adds)
    return all(a.dtype == jnp.bfloat16 for a in arrays) and math.prod(x.shape[:-1]) >= 1


def on_cuda_path(x, w, w2=None, flags: int = 0) -> bool:
    """Whether the CUDA kernel takes these shapes: at most MAX_ROWS rows, K a multiple of K_TILE up to MAX_K whose
    slice at some split fits a block's shared memory (`cuda_smem_bytes`), each N a multiple of N_TILE."""
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    ns = [w.shape[1]] + ([w2.shape[1]] if w2 is not None else [])
    return (1 <= m <= MAX_ROWS and 0 < k <= MAX_K and k % K_TILE == 0
            and all(n > 0 and n % N_TILE == 0 for n in ns)
            and any((k // K_TILE) % s == 0 and cuda_smem_bytes(m, k, s, flags) <= SMEM_BYTES
                    for s in (1, 2, 4, 8, 16)))


def cuda_smem_bytes(m: int, k: int, split: int, flags: int = 0) -> int:
    """A block's shared memory in the CUDA kernel for m rows and a K slice of k / split (ffi/fused_dot.cu's
    SmemBytes): x' of the slice in fp32 (rows padded to the kernel's 1, 2, 4, 8, 16 or 32; the tensor-core kernel's
    rows by 8 floats), the warps' partials and the block's, the norm weights."""
    mma = m > MAX_CORE_ROWS or bool(flags & FLAG_MMA)
    mm = next(r for r in ((8, 16, 32) if mma else (1, 2, 4)) if m <= r)
    kslice = k // split
    return 4 * (mm * (kslice + (8 if mma else 0)) + 8 * mm * N_TILE + mm * N_TILE + 8 * mm + mm + kslice)


def fused_dot(x: jax.Array, w: jax.Array, *, w2: jax.Array | None = None, norm: jax.Array | None = None,
              eps: float = 1e-6, gated: bool = False, gated2: bool = False, adds=(), out_dtype=None,
              out2_dtype=None, want_xn: bool = False, impl: str = "ffi", split: int = 0, flags: int = 0,
              layer: int | None = None):
    """(y, y2, xn) for x [..., K] and w [K, N] (and w2 [K, N2]); see the module docstring. y2 is None without w2,
    xn None unless want_xn.

    layer: None, or an index into stacks: w [L, K, N], w2 [L, K, N2] and norm [L, K] (a drafter's layers in one
    array), of which the layer-th are used. The custom call reads them in place; given a slice `w[i]` instead, XLA
    would copy it out of the stack before every call (a custom call's operand is a buffer of its own), as many bytes
    as the call reads.

    impl="ffi" runs the custom call where `on_ffi_path` holds (C++ on CPU; CUDA where `on_cuda_path` also holds,
    else the reference), impl="xla" runs `fused_dot_ref`. split: the CUDA kernel's blocks per 64 columns that share
    K (0: chosen; else 1, 2, 4, 8 or 16 dividing K / 64, whose K slice fits a block's shared memory,
    `cuda_smem_bytes`); flags: FLAG_PLAIN, FLAG_WEIGHT_PARAM (only for weights that are inputs of the program, never
    written in it), FLAG_L2_LINES, FLAG_MMA. No host sync.
    """
    adds = tuple(adds)
    out_dtype = getattr(x, "dtype", jnp.float32) if out_dtype is None else out_dtype
    out2_dtype = getattr(x, "dtype", jnp.float32) if out2_dtype is None else out2_dtype
    stacks = (w, w2, norm)
    if layer is not None:
        w, w2, norm = _layer_views(w, w2, norm, layer)
    _check(x, w, w2, norm, adds, gated, gated2, out_dtype, out2_dtype)
    if impl not in ("ffi", "xla"):
        raise ValueError(f"fused_dot: impl must be 'ffi' or 'xla', got {impl!r}")
    k = x.shape[-1]
    if isinstance(split, bool) or split not in (0, 1, 2, 4, 8, 16) or (split and (k % K_TILE or
                                                                                (k // K_TILE) % split)):
        raise ValueError(f"fused_dot: split must be 0 or one of 1, 2, 4, 8, 16 dividing K / {K_TILE}, got {split!r}")
    m = math.prod(x.shape[:-1])
    if split and 1 <= m <= MAX_ROWS and cuda_smem_bytes(m, k, split, flags) > SMEM_BYTES:
        raise ValueError(f"fused_dot: split {split} leaves a K slice of {k // split} too long for a block's shared "
                         f"memory at {m} rows ({cuda_smem_bytes(m, k, split, flags)} bytes); use a larger split or 0")
    pick = (lambda a: a) if layer is None else (lambda a: None if a is None else a[layer])  # the reference's slices
    kw = dict(w2=pick(stacks[1]), norm=pick(stacks[2]), eps=eps, gated=gated, gated2=gated2, adds=adds,
              out_dtype=out_dtype, out2_dtype=out2_dtype, want_xn=want_xn)
    if impl == "xla" or not on_ffi_path(x, w, w2, norm, adds):
        return fused_dot_ref(x, pick(stacks[0]), **kw)
    _registry.register()
    lead = tuple(x.shape[:-1])
    n, n2 = w.shape[1], (w2.shape[1] if w2 is not None else 0)
    bf = jnp.bfloat16
    shapes = (jax.ShapeDtypeStruct((m, n // 2 if gated else n), out_dtype),
              jax.ShapeDtypeStruct((m, n2 // 2 if gated2 else n2), out2_dtype),
              jax.ShapeDtypeStruct((m if want_xn else 0, k), bf))
    attrs = dict(eps=np.float32(eps), gated0=np.int64(gated), gated1=np.int64(gated2), layer=np.int64(layer or 0),
                 split=np.int64(split), flags=np.int64(flags))
    empty = jnp.zeros((0,), bf)
    operands = (x.reshape(m, k), stacks[0], stacks[1] if w2 is not None else jnp.zeros((k, 0), bf),
                stacks[2] if norm is not None else empty,
                adds[0].reshape(m, -1) if len(adds) > 0 else empty, adds[1].reshape(m, -1) if len(adds) > 1 else empty)

    def call(*ops):
        return tuple(jax.ffi.ffi_call("kdtree_fused_dot", shapes, vmap_method="sequential")(*ops, **attrs))

    def other(xx, ww, ww2, nn, a0, a1):
        y, y2, xn = fused_dot_ref(xx, pick(ww), **kw | dict(w2=pick(ww2) if w2 is not None else None,
                                                           norm=pick(nn) if norm is not None else None,
                                                     adds=(a0, a1)[:len(adds)]))
        return y, (y2 if y2 is not None else jnp.zeros(shapes[1].shape, out2_dtype)), (
            xn if xn is not None else jnp.zeros(shapes[2].shape, bf))

    cuda = call if on_cuda_path(x, w, w2, flags) else other
    y, y2, xn = jax.lax.platform_dependent(*operands, cpu=call, cuda=cuda, default=other)
    return (y.reshape(lead + y.shape[1:]), y2.reshape(lead + y2.shape[1:]) if w2 is not None else None,
            xn.reshape(lead + (k,)) if want_xn else None)


def fused_dot_ref(x: jax.Array, w: jax.Array, *, w2=None, norm=None, eps: float = 1e-6, gated: bool = False,
                  gated2: bool = False, adds=(), out_dtype=None, out2_dtype=None, want_xn: bool = False):
    """Pure JAX, the model's own operations: (y, y2, xn) as in the module docstring."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    out2_dtype = x.dtype if out2_dtype is None else out2_dtype
    xs = rms_norm(x, norm, eps) if norm is not None else x

    def one(ww, g, dt):
        y = jnp.tensordot(xs, ww, axes=1, preferred_element_type=jnp.float32)
        if not g:
            return y.astype(dt)
        f = ww.shape[1] // 2
        gate, up = y[..., :f].astype(x.dtype), y[..., f:].astype(x.dtype)
        return jax.nn.silu(gate) * up

    y = one(w, gated, out_dtype)
    for a in adds:
        y = a + y
    return y, (one(w2, gated2, out2_dtype) if w2 is not None else None), (xs if want_xn else None)
