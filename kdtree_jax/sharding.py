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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from .model import ArrayInfo, param_info
from .quant import Int4Array

MESH_AXES = ("dp", "ep", "tp")

# logical axis -> mesh axes (a tuple shards over their product); absent or None = replicated
RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("dp",),
    "heads": ("ep", "tp"),
    "mlp": ("ep", "tp"),
    "vocab": ("ep", "tp"),
    "experts": ("ep",),
    "expert_mlp": ("tp",),
    "embed": None,
    "q_lora": None,
    "kv_lora": None,
    "layers": None,
}


class ShardingError(ValueError):
    """A mesh that cannot hold the model (an axis not divisible, colliding rules, unknown axes)."""


def make_mesh(tp: int = 1, ep: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A Mesh of shape (dp, ep, tp) over `devices` (default: all of jax.devices(), local or global)."""
    devices = list(jax.devices() if devices is None else devices)
    for name, n in (("tp", tp), ("ep", ep), ("dp", dp)):
        if not isinstance(n, int) or n < 1:
            raise ShardingError(f"{name} must be an integer >= 1, got {n!r}")
    if dp * ep * tp != len(devices):
        raise ShardingError(f"dp * ep * tp = {dp}*{ep}*{tp} = {dp * ep * tp} does not match the {len(devices)} "
                            f"devices")
    return Mesh(np.array(devices).reshape(dp, ep, tp), MESH_AXES)


def logical_to_spec(axes: tuple[str | None, ...]) -> P:
    """PartitionSpec for logical axes under RULES; a mesh axis used twice in one array is an error."""
    used, spec = set(), []
    for ax in axes:
        mesh_axes = RULES.get(ax) if ax is not None else None
        if ax is not None and ax not in RULES:
            raise ShardingError(f"logical axis {ax!r} has no sharding rule")
        if mesh_axes:
            clash = used.intersection(mesh_axes)
            if clash:
                raise ShardingError(f"logical axes {axes} map mesh axis {sorted(clash)} twice")
            used.update(mesh_axes)
            spec.append(mesh_axes if len(mesh_axes) > 1 else mesh_axes[0])
        else:
            spec.append(None)
    return P(*spec)


def _axis_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def _checked_sharding(mesh: Mesh, shape, spec: P, what: str) -> NamedSharding:
    for dim, entry in zip(shape, spec):
        n = _axis_size(mesh, entry)
        if dim % n:
            raise ShardingError(f"{what}: dimension {dim} is not divisible by the {n} devices of mesh axes {entry}")
    return NamedSharding(mesh, spec)


def param_shardings(cfg: ModelConfig, mesh: Mesh):
    """A Params-shaped pytree of NamedSharding (Int4Array nodes: packed and scale split like the weight)."""

    def one(a: ArrayInfo):
        spec = logical_to_spec(a.axes)
        if a.init == "int4":
            *lead, n_in = a.shape
            g = cfg.group_size
            return Int4Array(packed=_checked_sharding(mesh, (*lead, n_in // 8), spec, f"INT4 weight {a.shape}"),
                             scale=_checked_sharding(mesh, (*lead, n_in // g), spec, f"INT4 scale {a.shape}"))
        return _checked_sharding(mesh, a.shape, spec, f"weight {a.shape} axes {a.axes}")

    _check_model_fits(cfg, mesh)
    return jax.tree.map(one, param_info(cfg), is_leaf=lambda x: isinstance(x, ArrayInfo))


def _check_model_fits(cfg: ModelConfig, mesh: Mesh) -> None:
    model_par = mesh.shape["ep"] * mesh.shape["tp"]
    if cfg.num_attention_heads % model_par:
        raise ShardingError(f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by ep*tp "
                            f"({model_par})")
    if cfg.num_moe_layers and cfg.n_routed_experts % mesh.shape["ep"]:
        raise ShardingError(f"n_routed_experts ({cfg.n_routed_experts}) is not divisible by ep ({mesh.shape['ep']})")


def shard_params(params, cfg: ModelConfig, mesh: Mesh):
    """Place (or re-place) params onto the mesh according to the rules."""
    return jax.device_put(params, param_shardings(cfg, mesh))


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
    if shared is not None:  # (gate [D, F], up [D, F], down [F, D]), F split like the "mlp" axis
        cols, rows = logical_to_spec(("embed", "mlp")), logical_to_spec(("mlp", "embed"))
        shared_spec = (cols, cols, rows)

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
