"""DDTree acceptance: the longest root path of the draft tree that the target agrees with, as a custom call
(`impl="ffi"`: ffi/tree_accept.cc on CPU, ffi/tree_accept.cu on CUDA) or in pure JAX (`impl="xla"`,
`tree_accept_ref`).

Walk: cur = 0 (the root); while some child c of cur has node_tokens[c] == target_tokens[cur], cur = the lowest
such c. The accepted path is the nodes visited (root first), and the next bonus token is target_tokens[cur].
`target_tokens` holds the target's choice at every node (its argmax, or a sample), so the same walk serves greedy
and sampled decoding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _registry


class Accepted(NamedTuple):
    path: jax.Array  # int32 [B, N]  accepted node indices, root (0) first, padded with -1
    length: jax.Array  # int32 [B]   nodes on the path, root included (>= 1)
    bonus: jax.Array  # int32 [B]    target_tokens at the last accepted node


def _check(node_tokens, parents, target_tokens) -> tuple[int, int]:
    arrays = {"node_tokens": node_tokens, "parents": parents, "target_tokens": target_tokens}
    for name, a in arrays.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"tree_accept: {name} must be an array, got {type(a).__name__}")
        if len(a.shape) != 2:
            raise ValueError(f"tree_accept: {name} must be [B, N], got shape {tuple(a.shape)}")
        if a.dtype != jnp.int32:
            raise TypeError(f"tree_accept: {name} must be int32, got {a.dtype}")
    shapes = {tuple(a.shape) for a in arrays.values()}
    if len(shapes) != 1:
        raise ValueError(f"tree_accept: node_tokens, parents and target_tokens must have one shape, got {shapes}")
    b, n = node_tokens.shape
    if b < 1 or n < 1:
        raise ValueError(f"tree_accept: empty inputs of shape {(b, n)}")
    return int(b), int(n)


def tree_accept(node_tokens: jax.Array, parents: jax.Array, target_tokens: jax.Array, *,
                impl: str = "ffi") -> Accepted:
    """The accepted path for int32 [B, N] node tokens, parents (parents[:, 0] = -1) and target tokens.

    impl="ffi" runs the custom call (C++ on CPU, CUDA on GPU, the reference elsewhere); impl="xla" runs
    `tree_accept_ref`. No host sync: usable under jit and inside `lax.while_loop`.
    """
    b, n = _check(node_tokens, parents, target_tokens)
    if impl == "xla":
        return tree_accept_ref(node_tokens, parents, target_tokens)
    if impl != "ffi":
        raise ValueError(f"tree_accept: impl must be 'ffi' or 'xla', got {impl!r}")
    _registry.register()
    outs = [jax.ShapeDtypeStruct((b, n), jnp.int32),  # path
            jax.ShapeDtypeStruct((b,), jnp.int32),  # length
            jax.ShapeDtypeStruct((b,), jnp.int32)]  # bonus

    def kernel(*args):
        return tuple(jax.ffi.ffi_call("kdtree_tree_accept", outs, vmap_method="sequential")(*args))

    def other(*args):
        return tuple(tree_accept_ref(*args))

    args = (node_tokens, parents, target_tokens)
    return Accepted(*jax.lax.platform_dependent(*args, cpu=kernel, cuda=kernel, default=other))


def tree_accept_ref(node_tokens: jax.Array, parents: jax.Array, target_tokens: jax.Array) -> Accepted:
    """Pure-JAX walk: one step down the tree per `while_loop` iteration, all rows at once."""
    b, n = _check(node_tokens, parents, target_tokens)
    rows = jnp.arange(b)
    idx = jnp.arange(n)

    def body(st):
        cur, length, path, done = st
        want = target_tokens[rows, cur]  # [B]
        match = (parents == cur[:, None]) & (node_tokens == want[:, None]) & (idx > 0)  # [B, N]
        step = jnp.any(match, axis=1) & ~done & (length < n)
        nxt = jnp.argmax(match, axis=1).astype(jnp.int32)  # lowest matching child
        at = jnp.minimum(length, n - 1)
        path = path.at[rows, at].set(jnp.where(step, nxt, path[rows, at]))
        return jnp.where(step, nxt, cur), length + step, path, done | ~step

    init = (jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.int32), jnp.full((b, n), -1, jnp.int32).at[:, 0].set(0),
            jnp.zeros((b,), bool))
    cur, length, path, _ = jax.lax.while_loop(lambda st: ~jnp.all(st[3]), body, init)
    return Accepted(path, length, target_tokens[rows, cur])
