"""A dense matmul for the few rows of a decode or verify step, as a custom call (`impl="ffi"`: ffi/small_dot.cc on
CPU, ffi/small_dot.cu on CUDA) or in pure JAX (`impl="xla"`, `small_dot_ref`).

y [..., N] = x [..., K] . w [K, ...] (w's dimensions after the first flattened to N), bf16 inputs, accumulated in
fp32 and rounded once to `out_dtype` (bf16 or f32), as XLA's dot with `preferred_element_type=float32` followed
by a cast.

At one device's share of K2.6 a dense weight is 1.5-30 MB, and XLA's dot kernel takes 4-8 us whatever it reads.
The CUDA kernel streams the weight once with the whole GPU (blocks of 64 columns, K split over a thread-block
cluster when the columns alone do not cover the SMs), launched as a programmatic dependent of the kernel ahead; when
w is a parameter that no kernel of the program writes (`FLAG_WEIGHT_PARAM`: the model's weights), it starts loading
w before that kernel ends. It takes M <= 64 rows and K, N multiples of 64; other shapes, other dtypes and
other platforms run the reference.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry

MAX_ROWS = 64  # the CUDA kernel's rows (4 token tiles of 8 ... 8 tiles)
TILE = 64  # K and N must be multiples of it
FLAG_PLAIN = 1  # a plain launch instead of a programmatic dependent one (benchmarks)
FLAG_WEIGHT_PARAM = 2  # w is a parameter no kernel of the program writes: its first stages load before the wait for
#                        the kernel ahead (a w computed in the program, e.g. cast or transposed, must not set it)
OUT_DTYPES = (jnp.bfloat16, jnp.float32)


def _shapes(x, w, out_dtype) -> tuple[int, int, int, tuple[int, ...], tuple[int, ...]]:
    for name, a in (("x", x), ("w", w)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"small_dot: {name} must be an array, got {type(a).__name__}")
    if len(x.shape) < 1 or len(w.shape) < 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"small_dot: expected x [..., K] and w [K, ...] (at least 2 dimensions), got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if jnp.dtype(out_dtype) not in [jnp.dtype(d) for d in OUT_DTYPES]:
        raise TypeError(f"small_dot: out_dtype must be bfloat16 or float32, got {jnp.dtype(out_dtype).name}")
    lead, tail = tuple(x.shape[:-1]), tuple(w.shape[1:])
    return math.prod(lead), int(x.shape[-1]), math.prod(tail), lead, tail


def on_fast_path(x, w) -> bool:
    """Whether the custom call takes these operands (else `small_dot` runs the reference): bf16 x and w, at most
    MAX_ROWS rows and K, N multiples of TILE."""
    m, k, n = math.prod(x.shape[:-1]), x.shape[-1], math.prod(w.shape[1:])
    return (x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and 1 <= m <= MAX_ROWS and k > 0 and k % TILE == 0
            and n % TILE == 0 and n > 0)


def small_dot(x: jax.Array, w: jax.Array, *, out_dtype=None, impl: str = "ffi", split: int = 0,
              flags: int = 0) -> jax.Array:
    """x [..., K] . w [K, ...] -> [..., *w.shape[1:]] in out_dtype (default x's dtype); see the module docstring.

    impl="ffi" runs the custom call where `on_fast_path` holds (C++ on CPU, CUDA on GPU), else the reference;
    impl="xla" runs `small_dot_ref`. split: the CUDA kernel's blocks per 64 columns that share K (0: chosen from
    the SM count; else 1, 2, 4 or 8 dividing K / 64); flags: FLAG_PLAIN, FLAG_WEIGHT_PARAM (only for a w that is an
    input of the program, never written in it). No host sync.
    """
    out_dtype = getattr(x, "dtype", jnp.float32) if out_dtype is None else out_dtype
    m, k, n, lead, tail = _shapes(x, w, out_dtype)
    if impl not in ("ffi", "xla"):
        raise ValueError(f"small_dot: impl must be 'ffi' or 'xla', got {impl!r}")
    if isinstance(split, bool) or split not in (0, 1, 2, 4, 8) or (split and (k // TILE) % split):
        raise ValueError(f"small_dot: split must be 0 or one of 1, 2, 4, 8 dividing K / {TILE} = {k // TILE}, "
                         f"got {split!r}")
    if impl == "xla" or not on_fast_path(x, w):
        return small_dot_ref(x, w, out_dtype=out_dtype)
    _registry.register()
    out = jax.ShapeDtypeStruct((m, n), out_dtype)
    attrs = dict(split=np.int64(split), flags=np.int64(flags))

    def call(a, b):
        return jax.ffi.ffi_call("kdtree_small_dot", out, vmap_method="sequential")(a, b, **attrs)

    def other(a, b):
        return small_dot_ref(a, b, out_dtype=out_dtype)

    y = jax.lax.platform_dependent(x.reshape(m, k), w.reshape(k, n), cpu=call, cuda=call, default=other)
    return y.reshape(lead + tail)


def small_dot_ref(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """Pure JAX: the dot over x's last and w's first dimension, accumulated in fp32, cast once to out_dtype."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = jnp.tensordot(x, w, axes=1, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
