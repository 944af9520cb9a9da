"""DDTree tree build (Ringel & Romano, Algorithm 1): the `budget` best prefixes of the drafter's per-depth
distributions, as a custom call (`impl="ffi"`: ffi/tree_build.cc on CPU, ffi/tree_build.cu on CUDA) or in pure JAX
(`impl="xla"`, `tree_build_ref`).

Definition, shared by every implementation:
* Per depth d, log p_d(v) = x_dv - logsumexp(x_d) over the vocabulary, for the logits x sanitized (NaN -> -2^20,
  clamped to +-2^20). A node is a prefix (v_1..v_d), d <= L, scored by sum_i log p_i(v_i).
* Only the K = min(budget, V) best tokens of each depth are candidates (Lemma 1); a depth's tokens are ranked by
  logit, ties by smaller token id.
* Tie rule: nodes are ordered by score (higher first), then depth (shallower first), then their path of per-depth
  ranks read lexicographically (smaller first). The tree is the first `budget` nodes of that order, stored in that
  order (the pop order of the best-first search); it is prefix-closed and each parent precedes its children.
* The custom calls score in 64-bit fixed point (2^-32 nats, exact sums, so mathematically tied paths tie exactly) and
  compute the log-sum-exp with the same float32 operations on CPU and GPU: the two kernels return identical arrays
  (ffi/common.h). The reference scores in float32, so it can order near-ties (scores within ~1e-5) differently.

The CUDA kernel keeps at most 4096 nodes (budget <= 4096); the CPU kernel and the reference take any budget.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry

_CLAMP = float(2**20)


class Tree(NamedTuple):
    """A draft tree of N = budget nodes below the root (node 0, the bonus token, is not stored)."""

    tokens: jax.Array  # int32 [B, N]          token of tree node i + 1
    parents: jax.Array  # int32 [B, N]         parent of tree node i + 1, in 0..i (0 = the root)
    depths: jax.Array  # int32 [B, N]          depth of tree node i + 1, 1..L
    visibility: jax.Array  # bool [B, N+1, N+1]  row i: the ancestors of tree node i, itself included


def _check(draft_logits, budget) -> tuple[int, int, int]:
    if not hasattr(draft_logits, "shape") or not hasattr(draft_logits, "dtype"):
        raise TypeError(f"tree_build: draft_logits must be an array, got {type(draft_logits).__name__}")
    if len(draft_logits.shape) != 3:
        raise ValueError(f"tree_build: draft_logits must be [B, L, V], got shape {tuple(draft_logits.shape)}")
    if draft_logits.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"tree_build: draft_logits must be float32 or bfloat16, got {draft_logits.dtype}")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"tree_build: budget must be a Python int (static), got {type(budget).__name__}")
    b, l, v = (int(s) for s in draft_logits.shape)
    if not 1 <= l <= 16:
        raise ValueError(f"tree_build: tree depth L = {l} must be in 1..16")
    if b < 1 or v < 1:
        raise ValueError(f"tree_build: empty draft_logits of shape {(b, l, v)}")
    if not 1 <= budget <= l * v:
        raise ValueError(f"tree_build: budget = {budget} must be in 1..L*V = {l * v}")
    return b, l, v


def _out_types(b: int, n: int) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct((b, n), jnp.int32),  # tokens
            jax.ShapeDtypeStruct((b, n), jnp.int32),  # parents
            jax.ShapeDtypeStruct((b, n), jnp.int32),  # depths
            jax.ShapeDtypeStruct((b, n + 1, n + 1), jnp.bool_)]  # visibility


def tree_build(draft_logits: jax.Array, budget: int, *, impl: str = "ffi") -> Tree:
    """The DDTree of `budget` nodes for draft_logits [B, L, V] (float32 or bfloat16); see the module docstring.

    impl="ffi" runs the custom call (C++ on CPU, CUDA on GPU, the reference on other platforms); impl="xla" runs
    `tree_build_ref`. Works under jit and inside loops (budget is static).
    """
    b, l, v = _check(draft_logits, budget)
    if impl == "xla":
        return tree_build_ref(draft_logits, budget)
    if impl != "ffi":
        raise ValueError(f"tree_build: impl must be 'ffi' or 'xla', got {impl!r}")
    _registry.register()
    n = int(budget)
    outs = _out_types(b, n)
    workspace = jax.ShapeDtypeStruct((_registry.tree_build_workspace_bytes(b, l, v, n),), jnp.uint8)

    def cpu(x):
        return tuple(jax.ffi.ffi_call("kdtree_tree_build", outs, vmap_method="sequential")(x))

    def cuda(x):
        return tuple(jax.ffi.ffi_call("kdtree_tree_build", outs + [workspace], vmap_method="sequential")(x)[:4])

    def other(x):
        return tuple(tree_build_ref(x, n))

    return Tree(*jax.lax.platform_dependent(draft_logits, cpu=cpu, cuda=cuda, default=other))


def _tree_build_levels_cpu(draft_logits: jax.Array, budget: int) -> Tree:
    """The CUDA kernel's level-by-level algorithm run sequentially by the CPU library (for tests, CPU only)."""
    b, _, _ = _check(draft_logits, budget)
    _registry.register()
    return Tree(*jax.ffi.ffi_call("kdtree_tree_build_levels", _out_types(b, int(budget)))(draft_logits))


def _sanitize(x: jax.Array) -> jax.Array:
    x = jnp.where(jnp.isnan(x), -_CLAMP, x.astype(jnp.float32))
    return jnp.clip(x, -_CLAMP, _CLAMP) + 0.0


def tree_build_ref(draft_logits: jax.Array, budget: int) -> Tree:
    """Pure-JAX Algorithm 1: a best-first search over a frontier array, one pop per `fori_loop` step."""
    b, l, v = _check(draft_logits, budget)
    n = int(budget)
    k = min(n, v)
    x = _sanitize(draft_logits)  # [B, L, V]
    lse = jax.nn.logsumexp(x, axis=-1)  # [B, L]
    top_x, top_id = jax.lax.top_k(x, k)  # [B, L, K], ties: lower id first
    cum_lse = jnp.cumsum(lse, axis=-1)  # [B, L]  score(node) = sum of its logits - cum_lse[depth - 1]
    rows = jnp.arange(b)
    slots = n + 1  # every pop frees or reuses its slot and adds at most one child
    big = jnp.int32(2**30)

    def pop(i, st):
        f_score, f_sum, f_depth, f_par, f_j, f_ranks, nxt, node_sum, node_score, out = st
        # best candidate: max score, then min depth, then the lexicographically smallest rank path
        live = f_depth > 0
        best = jnp.max(jnp.where(live, f_score, -jnp.inf), axis=1, keepdims=True)
        c = live & (f_score == best)
        c &= f_depth == jnp.min(jnp.where(c, f_depth, big), axis=1, keepdims=True)
        for pos in range(l):
            col = jnp.where(c, f_ranks[:, :, pos], big)
            c &= col == jnp.min(col, axis=1, keepdims=True)
        s = jnp.argmax(c, axis=1)  # [B]
        d, p, j = f_depth[rows, s], f_par[rows, s], f_j[rows, s]  # [B]
        score, psum = f_score[rows, s], f_sum[rows, s]
        ranks = f_ranks[rows, s]  # [B, L]
        tokens, parents, depths = out
        out = (tokens.at[:, i - 1].set(top_id[rows, d - 1, j]), parents.at[:, i - 1].set(p),
               depths.at[:, i - 1].set(d))
        node_sum = node_sum.at[:, i].set(psum)
        node_score = node_score.at[:, i].set(score)
        # the popped slot takes the next sibling (same parent, rank j + 1), or empties
        jn = jnp.minimum(j + 1, k - 1)
        sib_sum = node_sum[rows, p] + top_x[rows, d - 1, jn]
        sib_score = jnp.minimum(sib_sum - cum_lse[rows, d - 1], node_score[rows, p])
        has_sib = j + 1 < k
        f_score = f_score.at[rows, s].set(jnp.where(has_sib, sib_score, -jnp.inf))
        f_sum = f_sum.at[rows, s].set(sib_sum)
        f_depth = f_depth.at[rows, s].set(jnp.where(has_sib, d, 0))
        f_j = f_j.at[rows, s].set(jn)
        f_ranks = f_ranks.at[rows, s, jnp.clip(d - 1, 0, l - 1)].set(jn)
        # a new slot takes the first child (rank 0 at depth d + 1)
        has_child = d < l
        dc = jnp.minimum(d, l - 1)
        ch_sum = psum + top_x[rows, dc, 0]
        ch_score = jnp.minimum(ch_sum - cum_lse[rows, dc], score)
        ns = jnp.where(has_child, nxt, slots)  # out of range -> dropped
        f_score = f_score.at[rows, ns].set(ch_score, mode="drop")
        f_sum = f_sum.at[rows, ns].set(ch_sum, mode="drop")
        f_depth = f_depth.at[rows, ns].set(d + 1, mode="drop")
        f_par = f_par.at[rows, ns].set(i, mode="drop")
        f_j = f_j.at[rows, ns].set(0, mode="drop")
        f_ranks = f_ranks.at[rows, ns].set(ranks.at[rows, dc].set(0), mode="drop")
        nxt = nxt + has_child
        return f_score, f_sum, f_depth, f_par, f_j, f_ranks, nxt, node_sum, node_score, out

    first_sum = top_x[:, 0, 0]
    init = (jnp.full((b, slots), -jnp.inf).at[:, 0].set(jnp.minimum(first_sum - cum_lse[:, 0], 0.0)),
            jnp.zeros((b, slots)).at[:, 0].set(first_sum),
            jnp.zeros((b, slots), jnp.int32).at[:, 0].set(1),  # depth 0 = empty slot
            jnp.zeros((b, slots), jnp.int32),
            jnp.zeros((b, slots), jnp.int32),
            jnp.full((b, slots, l), -1, jnp.int32).at[:, 0, 0].set(0),
            jnp.ones((b,), jnp.int32),
            jnp.zeros((b, n + 1)),
            jnp.zeros((b, n + 1)),
            (jnp.zeros((b, n), jnp.int32),) * 3)
    *_, (tokens, parents, depths) = jax.lax.fori_loop(1, n + 1, pop, init)
    return Tree(tokens, parents, depths, _visibility(parents, l))


def _visibility(parents: jax.Array, l: int) -> jax.Array:
    """bool [B, N+1, N+1] ancestor mask from parents [B, N] (pointer jumping: depth <= L)."""
    b, n = parents.shape
    up = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parents], axis=1)  # [B, N+1], the root is its own parent
    cols = jnp.arange(n + 1)
    cur = jnp.broadcast_to(cols, (b, n + 1))
    vis = jnp.zeros((b, n + 1, n + 1), bool)
    for _ in range(l + 1):
        vis |= cur[:, :, None] == cols[None, None, :]
        cur = jnp.take_along_axis(up, cur, axis=1)
    return vis
