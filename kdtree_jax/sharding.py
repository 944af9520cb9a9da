"""Sharding: one mesh, one table of logical axis -> mesh axes, and the weight shardings derived from it.

Mesh axes: "dp" (batch), "ep" (experts), "tp" (tensor). Attention heads, the dense MLP width and the
vocabulary are split over every model-parallel device ("ep" x "tp"); routed experts over "ep" and each
expert's width over "tp". The MLA latent cache is replicated over the model axes (every head reads all of it).
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import logical_to_mesh_axes
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .quant import Int4Array

MESH_AXES = ("dp", "ep", "tp")

# The logical-axis rules as flax's logical partitioning takes them: (logical axis, mesh axes) pairs, a tuple of mesh
# axes sharding over their product, None replicated; a logical axis absent here is an error.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", "dp"),
    ("heads", ("ep", "tp")),
    ("mlp", ("ep", "tp")),
    ("vocab", ("ep", "tp")),
    ("experts", "ep"),
    ("expert_mlp", "tp"),
    ("embed", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("kv_heads", ("ep", "tp")),  # the drafter's GQA key/value heads (split where they divide, else replicated)
    ("fused_ctx", ("ep", "tp")),  # the drafter's fused target hidden states (the rows of its fc)
    ("layers", None),
)


class ShardingError(ValueError):
    """A mesh that cannot hold the model (an axis not divisible, colliding rules, unknown axes)."""


def make_mesh(tp: int = 1, ep: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A Mesh of shape (dp, ep, tp) over `devices` (default: all of jax.devices(), local or global).

    Over several hosts the devices go in process order, so "tp" (innermost) stays inside a host and "ep" and "dp"
    cross hosts: an expert stays whole on its device, and the per-layer all-reduces are small (14-28 KB per
    decode step at K2 widths) and bound by latency either way. A tp group that would span hosts is an error.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, n in (("tp", tp), ("ep", ep), ("dp", dp)):
        if not isinstance(n, int) or n < 1:
            raise ShardingError(f"{name} must be an integer >= 1, got {n!r}")
    if dp * ep * tp != len(devices):
        raise ShardingError(f"dp * ep * tp = {dp}*{ep}*{tp} = {dp * ep * tp} does not match the {len(devices)} "
                            f"devices")
    grid = np.array(devices).reshape(dp, ep, tp)
    hosts = np.vectorize(lambda d: d.process_index)(grid)
    if np.any(hosts != hosts[..., :1]):
        per_host = len(devices) // len(set(hosts.flat))
        raise ShardingError(f"tp = {tp} would put one tensor-parallel group on several hosts; keep tp <= the "
                            f"{per_host} devices of one host (and let ep or dp span the hosts)")
    return Mesh(grid, MESH_AXES)


def logical_to_spec(axes: tuple[str | None, ...]) -> P:
    """PartitionSpec of an array with these logical axes under RULES (flax's `logical_to_mesh_axes`). A logical axis
    without a rule, or two that map the same mesh axis (flax would leave the second one replicated), is an error."""
    rules = dict(RULES)
    if unknown := [ax for ax in axes if ax is not None and ax not in rules]:
        raise ShardingError(f"logical axis {unknown[0]!r} has no sharding rule")
    try:
        spec = logical_to_mesh_axes(axes, RULES)
    except ValueError as e:  # a logical axis named twice
        raise ShardingError(f"logical axes {axes}: {e}") from None
    if left := [ax for ax, got in zip(axes, spec) if ax is not None and got != rules[ax]]:
        raise ShardingError(f"logical axes {axes} map a mesh axis twice: {left[0]!r} -> {rules[left[0]]} is taken")
    return spec


def _axis_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def checked_sharding(mesh: Mesh, shape, spec: P, what: str) -> NamedSharding:
    """NamedSharding(mesh, spec) after checking that every sharded dimension divides over its devices."""
    for dim, entry in zip(shape, spec):
        n = _axis_size(mesh, entry)
        if dim % n:
            raise ShardingError(f"{what}: dimension {dim} is not divisible by the {n} devices of mesh axes {entry}")
    return NamedSharding(mesh, spec)


def fitting_sharding(mesh: Mesh, shape, spec: P) -> NamedSharding:
    """NamedSharding(mesh, spec), each dimension that its mesh axes do not divide replicated instead (for weights
    split where their sizes allow, such as a drafter's few key/value heads)."""
    return NamedSharding(mesh, P(*(e if dim % _axis_size(mesh, e) == 0 else None for dim, e in zip(shape, spec))))


def mesh_of(tree) -> Mesh | None:
    """The mesh the arrays of `tree` are placed on (None when they are not on a multi-device mesh)."""
    for leaf in jax.tree.leaves(tree):
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
            return sh.mesh
    return None


def use_mesh_of(tree):
    """A context that makes the mesh of `tree` current while tracing (a no-op for unsharded trees)."""
    mesh = mesh_of(tree)
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def current_mesh():
    """The mesh set while tracing, when it is one of ours and splits the model (else None)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.axis_names) != set(MESH_AXES) or mesh.shape["ep"] * mesh.shape["tp"] == 1:
        return None
    return mesh


def _batch_axis(mesh, batch: int):
    """"dp" when the batch splits evenly over it, else None (replicated)."""
    return "dp" if batch % mesh.shape["dp"] == 0 and mesh.shape["dp"] > 1 else None


def mla_head_parallel(attend, q_lat, q_pe, latent, k_pe, lengths, tree_mask, scale):
    """The absorbed-attention kernel per shard: heads split over ("ep", "tp"), the batch over "dp", the latent
    cache (shared by every head) replicated over the model axes. No communication: each head is independent."""
    mesh = current_mesh()
    bt = _batch_axis(mesh, q_lat.shape[0])
    heads = P(bt, None, ("ep", "tp"), None)
    fn = lambda q, qp, lat, pe, ln, tm: attend(q, qp, lat, pe, ln, tm, scale)
    return jax.shard_map(fn, mesh=mesh, in_specs=(heads, heads, P(bt, None, None), P(bt, None, None), P(bt),
                                                  P(bt, None, None)),
                         out_specs=heads, check_vma=False)(q_lat, q_pe, latent, k_pe, lengths, tree_mask)


def draft_heads_split(heads: int, kv_heads: int) -> bool:
    """Whether `draft_head_parallel` can run the drafter's block attention per shard on the current mesh: the query
    heads split evenly over the model axes, and the key/value heads too or a single one (replicated)."""
    mesh = current_mesh()
    n = 1 if mesh is None else mesh.shape["ep"] * mesh.shape["tp"]
    return heads % n == 0 and (kv_heads % n == 0 or kv_heads == 1)


def draft_head_parallel(attend, q, ck, cv, kb, vb, lengths, scale):
    """The drafter's block-attention kernel per shard (`draft_heads_split` must hold): query heads split over
    ("ep", "tp"), the key/value heads with them (each shard's query heads use its own kv heads) or, when there is
    one, replicated; the batch over "dp". No communication."""
    mesh = current_mesh()
    bt = _batch_axis(mesh, q.shape[0])
    heads = P(bt, None, MODEL_AXES, None)
    kv = heads if ck.shape[2] > 1 else P(bt, None, None, None)
    fn = lambda q, ck, cv, kb, vb, ln: attend(q, ck, cv, kb, vb, ln, scale)
    return jax.shard_map(fn, mesh=mesh, in_specs=(heads, kv, kv, kv, kv, P(bt)), out_specs=heads,
                         check_vma=False)(q, ck, cv, kb, vb, lengths)


MODEL_AXES = ("ep", "tp")


def cache_spec(mesh, batch: int) -> P:
    """PartitionSpec of one layer's sequence-sharded cache [B, S, C]: slots split over the model axes."""
    return P(_batch_axis(mesh, batch), MODEL_AXES, None)


def sequence_sharded(x: jax.Array) -> jax.Array:
    """x [B, S, C] constrained to the sequence-sharded cache layout of the current mesh (as is without one)."""
    mesh = current_mesh()
    if mesh is None:
        return x
    n = mesh.shape["ep"] * mesh.shape["tp"]
    if x.shape[1] % n:
        raise ShardingError(f"a sequence-sharded cache needs its {x.shape[1]} slots divisible by ep*tp = {n}")
    return jax.lax.with_sharding_constraint(x, cache_spec(mesh, x.shape[0]))


def _local_slots(s_local: int) -> jax.Array:
    """Global slot index [S_local] of this device's slots (its block of the model axes)."""
    return jax.lax.axis_index(MODEL_AXES) * s_local + jnp.arange(s_local)


def write_rows_sequence(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """cache [B, S, C] (sequence-sharded) with new [B, T, C] written at slots starts[b] + t: each device writes the
    rows that fall into its block, in place; no communication."""
    mesh = current_mesh()
    bt = _batch_axis(mesh, cache.shape[0])

    def local(c, n, st):
        s_loc = c.shape[1]
        slot = st[:, None] + jnp.arange(n.shape[1])[None, :] - jax.lax.axis_index(MODEL_AXES) * s_loc  # [B, T]
        slot = jnp.where((slot >= 0) & (slot < s_loc), slot, s_loc)  # not mine: out of range, dropped
        rows = jnp.arange(c.shape[0])[:, None]
        return c.at[rows, slot].set(n, mode="drop")

    return jax.shard_map(local, mesh=mesh, in_specs=(cache_spec(mesh, cache.shape[0]), P(bt), P(bt)),
                         out_specs=cache_spec(mesh, cache.shape[0]), check_vma=False)(cache, new, starts)


def mla_sequence_parallel(attend_prefix, attend_tree, combine, q_lat, q_pe, latent, k_pe, new_lat, new_pe, lengths,
                          tree_mask, scale):
    """Absorbed MLA over a sequence-sharded latent cache (the function of `kernels.mla_verify.mla_absorbed_attention`).

    Queries come split by heads; each device gathers every head's query (small) and attends over the committed
    prefix in its own block of slots with `attend_prefix(q, q_pe, latent, pe, visible, scale) -> (out, lse)` (the
    custom call where it applies). One all-to-all sends each device the (output, log-sum-exp) partials of its own
    heads from every device, which it joins by log-sum-exp (`combine`): two collectives per layer in all. The new
    tokens seen through the tree mask, `attend_tree(q, q_pe, new_lat [B, T, R], new_pe [B, T, dr], tree_mask
    [B, T, T], scale) -> (out, lse)` for this device's heads, are folded in the same way. Returns [B, T, H, R]
    fp32, split by heads like the queries.
    """
    mesh = current_mesh()
    bt = _batch_axis(mesh, q_lat.shape[0])
    heads = P(bt, None, MODEL_AXES, None)

    def local(q, qp, lat, pe, nl, npe, ln, tm):
        r = q.shape[3]
        both = jax.lax.all_gather(jnp.concatenate([q, qp], axis=-1), MODEL_AXES, axis=2, tiled=True)  # [B, T, H, .]
        s_loc = lat.shape[1]
        visible = jnp.clip(ln - jax.lax.axis_index(MODEL_AXES) * s_loc, 0, s_loc)  # [B] committed slots here
        out, lse = attend_prefix(both[..., :r], both[..., r:], lat, pe, visible, scale)  # [B, T, H, R], [B, T, H]
        part = jnp.concatenate([out, lse[..., None]], axis=-1)[None]  # [1, B, T, H, R + 1]
        part = jax.lax.all_to_all(part, MODEL_AXES, 3, 0, tiled=True)  # [N, B, T, H_loc, R + 1]: my heads, from all
        parts = [(part[i, ..., :-1], part[i, ..., -1]) for i in range(part.shape[0])]
        return combine(*parts, attend_tree(q, qp, nl, npe, tm, scale))[0]

    rows = P(bt, None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, cache_spec(mesh, latent.shape[0]),
                                                     cache_spec(mesh, latent.shape[0]), rows, rows, P(bt), rows),
                         out_specs=heads, check_vma=False)(q_lat, q_pe, latent, k_pe, new_lat, new_pe, lengths,
                                                            tree_mask)


def _owned_rows(idx: jax.Array, block: int, take) -> jax.Array:
    """Inside shard_map over the model axes, for a table split into blocks of `block` rows: the rows at global
    indices idx (take(local index) reads them from this device's block), summed over the devices, each contributing
    the rows it holds and zeros for the rest: the same full result on every device, the table never gathered."""
    loc = idx - jax.lax.axis_index(MODEL_AXES) * block
    rows = take(jnp.clip(loc, 0, block - 1))  # [..., C]
    mine = ((loc >= 0) & (loc < block))[..., None]
    return jax.lax.psum(jnp.where(mine, rows, jnp.zeros_like(rows)), MODEL_AXES)


def vocab_parallel_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of a table [V, D] split by rows over the model axes (the "vocab" rule) at ids int [B, T] -> [B, T, D].
    Left to the partitioner, a lookup of a single id becomes a dynamic slice, for which XLA gathers the whole
    table (2.3 GB for K2's embedding, 8.4 ms per decode step on 2 H200s at batch 1)."""
    mesh = current_mesh()
    bt = _batch_axis(mesh, ids.shape[0])
    local = lambda tab, i: _owned_rows(i, tab.shape[0], lambda loc: jnp.take(tab, loc, axis=0))
    return jax.shard_map(local, mesh=mesh, in_specs=(P(MODEL_AXES, None), P(bt, None)), out_specs=P(bt, None, None),
                         check_vma=False)(table, ids)


def take_rows_sequence(cache: jax.Array, slots: jax.Array) -> jax.Array:
    """Rows at global slots [B, P] of a sequence-sharded cache [B, S, C] -> [B, P, C], the same on every device of
    the model axes."""
    mesh = current_mesh()
    bt = _batch_axis(mesh, cache.shape[0])
    local = lambda c, sl: _owned_rows(sl, c.shape[1], lambda loc: jnp.take_along_axis(c, loc[:, :, None], axis=1))
    return jax.shard_map(local, mesh=mesh, in_specs=(cache_spec(mesh, cache.shape[0]), P(bt)), out_specs=P(bt),
                         check_vma=False)(cache, slots)


@contextlib.contextmanager
def trace_context(params, cfg):
    """What tracing a model function needs: the mesh of sharded params made current (expert and head
    parallelism in shard_map), and true fp32 matmuls for fp32 models (not TF32 on GPUs), so that the verify and
    the AR computation round alike far more often."""
    with use_mesh_of(params), jax.default_matmul_precision("highest" if cfg.dtype == "float32" else "default"):
        yield


def model_parallel(fn, args: tuple, in_specs: tuple, out_specs):
    """fn(*args) per shard of the current mesh (shard_map, replication unchecked): fn sees each argument's local
    block under its spec and reduces over MODEL_AXES itself where it must (the drafter's fused layers)."""
    return jax.shard_map(fn, mesh=current_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def batch_axis(batch: int):
    """The mesh axis a batch of this size splits over on the current mesh ("dp" where it divides), else None."""
    return _batch_axis(current_mesh(), batch)


def replicated_call(fn, *args):
    """fn(*args) on every device of the current mesh with replicated inputs and outputs (the DDTree step's small
    custom calls run inside shard_map, never through the default all-gather of an unsharded custom call);
    a plain call without a mesh."""
    mesh = current_mesh()
    if mesh is None:
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(*args)


def moe_expert_parallel(experts, x, ids, weights, we_gate, we_up, we_down, shared=None, shared_fn=None):
    """Routed experts (and the shared expert) under expert parallelism, dispatch and combine written out in
    shard_map.

    x [M, D] and the routing (ids, weights [M, k]) are replicated; each "ep" shard holds E/ep experts, each "tp"
    shard a slice of every expert's width F. A shard runs `experts` (the reference or the custom call) on the
    slots routed to its own experts (the others get the id E_local: nothing), adds shared_fn(its slice of the
    shared expert's width, x) when given, and the partial outputs are summed over "ep" and "tp" with one psum (one
    collective for the whole feed-forward block).
    """
    mesh = current_mesh()
    up, down = P("ep", "tp", None), P("ep", None, "tp")
    spec = lambda w, s: Int4Array(packed=s, scale=s) if isinstance(w, Int4Array) else s
    shared_spec = None
    if shared is not None:  # (gate_up [D, 2, F], down [F, D]), F split like the "mlp" axis
        shared_spec = (logical_to_spec(("embed", None, "mlp")), logical_to_spec(("mlp", "embed")))

    def local(x, ids, weights, g, u, d, sh):
        e_loc = g.shape[0]
        lid = ids - jax.lax.axis_index("ep") * e_loc
        mine = (lid >= 0) & (lid < e_loc)
        y = experts(x, jnp.where(mine, lid, e_loc), jnp.where(mine, weights, 0.0), g, u, d).astype(jnp.float32)
        if sh is not None:
            y = y + shared_fn(sh, x).astype(jnp.float32)
        return jax.lax.psum(y, ("ep", "tp")).astype(x.dtype)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), spec(we_gate, up), spec(we_up, up),
                                                     spec(we_down, down), shared_spec),
                         out_specs=P(), check_vma=False)(x, ids, weights, we_gate, we_up, we_down, shared)
