"""INT4 weights: the compressed-tensors `pack-quantized` format (symmetric, group 32) as a small pytree.

A weight W [out, in] is held as integers q in [-8, 7] and one bf16 scale per `group` inputs:

    W[o, k] = q[o, k] * scale[o, k // group]

The integers are stored as unsigned nibbles q + 8, eight per int32 word, least significant first along the
input dimension, exactly as Kimi K2-Thinking / K2.5 / K2.6 ship them (`weight_packed` [out, in/8] int32,
`weight_scale` [out, in/32] bf16; docs/model.md §7). Leading axes (experts) are allowed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NIBBLES_PER_WORD = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Array:
    """Packed symmetric INT4 weights with per-group bf16 scales, input dimension last."""

    packed: jax.Array  # int32 [..., out, in / 8]: nibble i of word j holds q[8j + i] + 8
    scale: jax.Array  # bf16 [..., out, in / group]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape [..., out, in]."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * NIBBLES_PER_WORD)

    @property
    def group_size(self) -> int:
        return self.shape[-1] // self.scale.shape[-1]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weights [..., out, in] (exact: every q * scale is representable in fp32)."""
        q = unpack_int4(self.packed).astype(jnp.float32)  # [..., out, in]
        s = jnp.repeat(self.scale.astype(jnp.float32), self.group_size, axis=-1)  # [..., out, in]
        return (q * s).astype(dtype)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """int32 [..., n/8] -> int8 [..., n] with values in [-8, 7] (works on jax and numpy arrays)."""
    xp = jnp if isinstance(packed, jax.Array) else np
    words = packed.astype(xp.uint32)[..., None]  # [..., n/8, 1]
    shifts = xp.arange(NIBBLES_PER_WORD, dtype=xp.uint32) * 4  # [8]
    nibbles = (words >> shifts) & 0xF  # [..., n/8, 8]
    q = nibbles.astype(xp.int8) - 8
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * NIBBLES_PER_WORD)


def pack_int4(q) -> np.ndarray | jax.Array:
    """int [..., n] with values in [-8, 7] -> int32 [..., n/8], nibble q + 8, least significant first."""
    xp = jnp if isinstance(q, jax.Array) else np
    if q.shape[-1] % NIBBLES_PER_WORD:
        raise ValueError(f"the packed dimension ({q.shape[-1]}) must be a multiple of {NIBBLES_PER_WORD}")
    if xp is np and (np.min(q) < -8 or np.max(q) > 7):
        raise ValueError(f"INT4 values must lie in [-8, 7], got [{np.min(q)}, {np.max(q)}]")
    nib = (q.astype(xp.int32) + 8).astype(xp.uint32)
    nib = nib.reshape(*q.shape[:-1], q.shape[-1] // NIBBLES_PER_WORD, NIBBLES_PER_WORD)
    shifts = xp.arange(NIBBLES_PER_WORD, dtype=xp.uint32) * 4
    words = xp.sum(nib << shifts, axis=-1, dtype=xp.uint32)
    return words.view(xp.int32) if xp is np else jax.lax.bitcast_convert_type(words, jnp.int32)


def quantize_int4(w, group_size: int = 32) -> Int4Array:
    """Symmetric per-group quantization of float weights [..., out, in] (scale = max|w| / 7, as K2's QAT
    checkpoints use 15 of the 16 codes). Used to make random INT4 models and test checkpoints."""
    w = jnp.asarray(w, jnp.float32)
    if w.shape[-1] % group_size:
        raise ValueError(f"the input dimension ({w.shape[-1]}) must be a multiple of the group size {group_size}")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    scale = (jnp.max(jnp.abs(g), axis=-1) / 7.0).astype(jnp.bfloat16)  # [..., out, in/group]
    s = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))[..., None]
    q = jnp.clip(jnp.round(g / s), -8, 7).astype(jnp.int8).reshape(w.shape)
    return Int4Array(packed=pack_int4(q), scale=scale)


def dequantize(w) -> jax.Array:
    """Float weights from either an Int4Array or a plain array (returned as is)."""
    return w.dequantize() if isinstance(w, Int4Array) else w
