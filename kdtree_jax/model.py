"""The Kimi K2.x / DeepSeek-V3 model, functional, in one file.

Math: docs/model.md. Layout of this file:
  1. weight declarations (`ArrayInfo`, one place per weight) and the weight pytrees; `init_params`
  2. the latent KV cache
  3. blocks: RMSNorm, YaRN rope, MLA (naive for prefill, absorbed for decode and tree verify), router, MoE
  4. `forward` (teacher-forced logits) and `step` (one cached forward over new tokens, optionally a tree)

Einsum letters: b batch, t new tokens (queries), s cache slots, u new tokens as keys, d model width,
h heads, q q-LoRA rank, r kv-LoRA rank (latent), n nope head dim, p rope head dim, v value head dim,
f MLP width, e experts, v (in the vocabulary matmul only) vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import validate
from .config import ModelConfig
from .quant import Int4Array, quantize_int4
from .kernels.marlin_moe import marlin_moe
from .kernels.mla_pre import FLAG_WEIGHT_PARAM as MLA_PRE_WEIGHT_PARAM, MAX_ROWS as MLA_PRE_MAX_ROWS
from .kernels.mla_pre import apply_rope, mla_pre, rms_norm  # noqa: F401 (apply_rope, rms_norm: re-exported)
from .kernels.mla_verify import combine_lse, mask_softmax, mla_prefix, mla_verify, tree_attention_lse
from .kernels.moe_route import moe_route
from .kernels.move_rows import move_rows, write_rows
from .kernels.fused_dot import FLAG_WEIGHT_PARAM as FUSED_WEIGHT_PARAM, MAX_ROWS as FUSED_MAX_ROWS, fused_dot
from .sharding import (ShardingError, checked_sharding, current_mesh, logical_to_spec, mla_head_parallel,
                       mla_sequence_parallel, moe_expert_parallel, replicated_call, sequence_sharded,
                       take_rows_sequence, trace_context, vocab_parallel_lookup, write_rows_sequence)

# --------------------------------------------------------------------------------------------------------------
# 1. Weights: declared once (shape, dtype, logical axes, initializer); init, abstract shapes and shardings
#    are all derived from the declarations.
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Declaration of one weight: logical shape, dtype, logical axis names and initializer."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    init: str = "fan_in"  # "fan_in" (normal, std 1/sqrt(fan_in)), "ones", "small" (normal, std 0.02), "int4"
    fan_in_axes: tuple[int, ...] = (0,)  # which axes are the matmul's input (for "fan_in")


@struct.dataclass
class Attention:
    qkv_a: jax.Array  # [D, Rq + R + dr]      the projections of the normed input, as one weight: q_a (the query
    #                                         LoRA, absent when q_lora_rank is None), then kv_a (the latent and the
    #                                         shared rope key): one matmul at small M instead of two
    q_a_norm: jax.Array | None  # [Rq]
    q_b: jax.Array  # [H, dn + dr, Rq or D]  out-major, the input (contracted) axis last: at one token a decode's
    #                                         matmul is a row reduction XLA fuses into one kernel ([in, out] was a
    #                                         weight-sized product written, then reduced; format 3, docs/model.md)
    kv_a_norm: jax.Array  # [R]
    k_b: jax.Array  # [R, H, dn]            W_UK: latent -> per-head nope key
    v_b: jax.Array  # [H, dv, R]            W_UV: latent -> per-head value (the latent axis last, as q_b's input)
    o: jax.Array  # [H, dv, D]


@struct.dataclass
class MLP:
    gate_up: jax.Array  # [D, 2, F]   the SwiGLU gate (index 0) and up (index 1) projections, one matmul
    down: jax.Array  # [F, D]


@struct.dataclass
class MoE:
    router: jax.Array  # [D, E]             in the model's dtype (bf16 in K2 checkpoints); logits in fp32
    router_bias: jax.Array  # f32 [E]            e_score_correction_bias: selection only
    we_gate: jax.Array | Int4Array  # [E, F, D]   routed experts, [out, in] per expert (checkpoint order)
    we_up: jax.Array | Int4Array  # [E, F, D]
    we_down: jax.Array | Int4Array  # [E, D, F]
    shared: MLP  # F = moe_intermediate_size * n_shared_experts


@struct.dataclass
class Layer:
    attn_norm: jax.Array  # [D]
    attn: Attention
    mlp_norm: jax.Array  # [D]
    mlp: MLP | MoE


@struct.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: tuple[Layer, ...]  # the decoder layers in order, each holding its own arrays (no layer axis): the
    #                            first num_dense_layers with an MLP, the others with a MoE
    final_norm: jax.Array  # [D]
    lm_head: jax.Array  # [D, V]

    @property
    def moe_layers(self) -> tuple[Layer, ...]:
        return tuple(lp for lp in self.layers if isinstance(lp.mlp, MoE))


def _mlp_info(cfg: ModelConfig, width: int) -> MLP:
    dt, d = cfg.jnp_dtype, cfg.hidden_size
    return MLP(gate_up=ArrayInfo((d, 2, width), dt, ("embed", None, "mlp")),
               down=ArrayInfo((width, d), dt, ("mlp", "embed")))


def _attention_info(cfg: ModelConfig) -> Attention:
    dt, d, h = cfg.jnp_dtype, cfg.hidden_size, cfg.num_attention_heads
    rq, r, dn, dr, dv = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q_in = rq if rq is not None else d
    return Attention(
        qkv_a=ArrayInfo((d, (rq or 0) + r + dr), dt, ("embed", None)),
        q_a_norm=ArrayInfo((rq,), dt, ("q_lora",), "ones") if rq is not None else None,
        q_b=ArrayInfo((h, dn + dr, q_in), dt, ("heads", None, "q_lora"), fan_in_axes=(2,)),
        kv_a_norm=ArrayInfo((r,), dt, ("kv_lora",), "ones"),
        k_b=ArrayInfo((r, h, dn), dt, ("kv_lora", "heads", None)),
        v_b=ArrayInfo((h, dv, r), dt, ("heads", None, "kv_lora"), fan_in_axes=(2,)),
        o=ArrayInfo((h, dv, d), dt, ("heads", None, "embed"), fan_in_axes=(0, 1)),
    )


def _moe_info(cfg: ModelConfig) -> MoE:
    dt, d, e, f = cfg.jnp_dtype, cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    kind = "int4" if cfg.expert_format == "int4" else "fan_in"
    return MoE(router=ArrayInfo((d, e), dt, ("embed", None), "small"),
               router_bias=ArrayInfo((e,), jnp.float32, (None,), "small"),
               we_gate=ArrayInfo((e, f, d), dt, ("experts", "expert_mlp", "embed"), kind, fan_in_axes=(2,)),
               we_up=ArrayInfo((e, f, d), dt, ("experts", "expert_mlp", "embed"), kind, fan_in_axes=(2,)),
               we_down=ArrayInfo((e, d, f), dt, ("experts", "embed", "expert_mlp"), kind, fan_in_axes=(2,)),
               shared=_mlp_info(cfg, f * cfg.n_shared_experts))


def _layer_info(cfg: ModelConfig, moe: bool) -> Layer:
    dt, d = cfg.jnp_dtype, cfg.hidden_size
    return Layer(attn_norm=ArrayInfo((d,), dt, ("embed",), "ones"), attn=_attention_info(cfg),
                 mlp_norm=ArrayInfo((d,), dt, ("embed",), "ones"),
                 mlp=_moe_info(cfg) if moe else _mlp_info(cfg, cfg.intermediate_size))


def _is_info(x) -> bool:
    return isinstance(x, ArrayInfo)


def stack_info(info, n: int):
    """Prefix every declaration with a layer axis of length n (the drafter's layers, run by a scan)."""
    return jax.tree.map(lambda a: dataclasses.replace(a, shape=(n, *a.shape), axes=("layers", *a.axes),
                                                      fan_in_axes=tuple(i + 1 for i in a.fan_in_axes)),
                        info, is_leaf=_is_info)


def param_info(cfg: ModelConfig) -> Params:
    """The declaration of every weight of the model (a Params pytree of ArrayInfo)."""
    dt, d, v = cfg.jnp_dtype, cfg.hidden_size, cfg.vocab_size
    return Params(embed=ArrayInfo((v, d), dt, ("vocab", "embed"), "small"),
                  layers=tuple(_layer_info(cfg, moe=i >= cfg.num_dense_layers) for i in range(cfg.num_hidden_layers)),
                  final_norm=ArrayInfo((d,), dt, ("embed",), "ones"),
                  lm_head=ArrayInfo((d, v), dt, ("embed", "vocab")))


def _int4_struct(a: ArrayInfo, group: int) -> Int4Array:
    *lead, n_in = a.shape
    return Int4Array(packed=jax.ShapeDtypeStruct((*lead, n_in // 8), jnp.int32),
                     scale=jax.ShapeDtypeStruct((*lead, n_in // group), jnp.bfloat16))


def abstract_params(cfg: ModelConfig) -> Params:
    """ShapeDtypeStructs of every weight (INT4 experts as Int4Array of structs), without allocating."""
    return jax.tree.map(lambda a: _int4_struct(a, cfg.group_size) if a.init == "int4"
                        else jax.ShapeDtypeStruct(a.shape, a.dtype), param_info(cfg), is_leaf=_is_info)


def check_model_fits(cfg: ModelConfig, ep: int, tp: int) -> None:
    """Raise ShardingError, naming the config field, when heads, experts or MLP widths do not split over a mesh with
    these model axes."""
    if cfg.num_attention_heads % (ep * tp):
        raise ShardingError(f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by ep*tp ({ep * tp})")
    if cfg.num_moe_layers and cfg.n_routed_experts % ep:
        raise ShardingError(f"n_routed_experts ({cfg.n_routed_experts}) is not divisible by ep ({ep})")
    f = cfg.moe_intermediate_size
    if cfg.num_moe_layers and cfg.expert_format == "int4" and (f // cfg.group_size) % tp:
        # the experts' hidden dimension is split over tp, and the down projection's INT4 groups run along it
        n = f // cfg.group_size
        raise ShardingError(f"moe_intermediate_size ({f}) holds {n} INT4 group{'s' * (n != 1)} of group_size "
                            f"{cfg.group_size}, not divisible by tp ({tp}): each device must hold whole groups")
    if cfg.num_moe_layers and f % tp:
        raise ShardingError(f"moe_intermediate_size ({f}) is not divisible by tp ({tp})")
    widths = []  # the dense and shared MLPs' hidden dimension, split over ep x tp
    if cfg.num_dense_layers:
        widths.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_moe_layers and cfg.n_shared_experts:
        widths.append(("moe_intermediate_size x n_shared_experts", f * cfg.n_shared_experts))
    for name, width in widths:
        if width % (ep * tp):
            raise ShardingError(f"{name} ({width}) is not divisible by ep*tp ({ep * tp})")


def param_shardings(cfg: ModelConfig, mesh) -> Params:
    """A Params-shaped pytree of NamedSharding from the declarations and the sharding rules (Int4Array nodes:
    packed and scale split like the weight)."""

    def one(a: ArrayInfo):
        spec = logical_to_spec(a.axes)
        if a.init == "int4":
            *lead, n_in = a.shape
            return Int4Array(packed=checked_sharding(mesh, (*lead, n_in // 8), spec, f"INT4 weight {a.shape}"),
                             scale=checked_sharding(mesh, (*lead, n_in // cfg.group_size), spec,
                                                    f"INT4 scale {a.shape}"))
        return checked_sharding(mesh, a.shape, spec, f"weight {a.shape} axes {a.axes}")

    check_model_fits(cfg, mesh.shape["ep"], mesh.shape["tp"])
    return jax.tree.map(one, param_info(cfg), is_leaf=_is_info)


def shard_params(params: Params, cfg: ModelConfig, mesh) -> Params:
    """Place (or re-place) params onto the mesh according to the rules."""
    return jax.device_put(params, param_shardings(cfg, mesh))


def _init_one(a: ArrayInfo, key):
    """A float weight of declaration `a` (not INT4), from its own key."""
    if a.init == "ones":
        return jnp.ones(a.shape, a.dtype)
    if a.init == "small":
        return (0.02 * jax.random.normal(key, a.shape, jnp.float32)).astype(a.dtype)
    fan_in = math.prod(a.shape[i] for i in a.fan_in_axes)
    return (jax.random.normal(key, a.shape, jnp.float32) / math.sqrt(fan_in)).astype(a.dtype)


def _int4_experts(a: ArrayInfo, key, group: int, first, count: int, split=None) -> Int4Array:
    """Experts first .. first + count - 1 of the INT4 declaration `a` [E, out, in], one expert at a time.

    Expert e is a normal [out, in] weight with std 1/sqrt(in) from key fold_in(key, e), quantized with
    `quantize_int4`: only one expert's fp32 weight exists at any time, and an expert's values do not depend on which
    device makes it. split = (axis, index, parts) keeps part `index` of `parts` along that axis of the per-expert
    packed and scale arrays (the expert width split over the "tp" mesh axis).
    """
    fan_in = a.shape[-1]

    def one(e):
        w = jax.random.normal(jax.random.fold_in(key, e), a.shape[1:], jnp.float32) / math.sqrt(fan_in)
        q = quantize_int4(w, group)
        if split is None:
            return q
        axis, index, parts = split
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, index * (x.shape[axis] // parts),
                                                                   x.shape[axis] // parts, axis), q)

    shapes = jax.eval_shape(one, jnp.int32(0))
    empty = jax.tree.map(lambda x: jnp.zeros((count, *x.shape), x.dtype), shapes)

    def body(j, acc):
        return jax.tree.map(lambda buf, x: buf.at[j].set(x), acc, one(first + j))

    return jax.lax.fori_loop(0, count, body, empty)


def init_from_info(infos, key: jax.Array, group: int = 32, shardings=None):
    """Random weights for a pytree of declarations, each leaf from its own key (fold_in(key, leaf index)) and
    created directly in its sharding (a pytree of shardings like the weights, or None: one device). One compiled
    function per distinct declaration (the 61 layers of K2 share theirs), called per leaf. INT4 leaves are made
    expert by expert on the devices that hold them, so that no fp32 copy of an expert stack ever exists; sharded
    and unsharded results are equal bit for bit."""
    leaves, treedef = jax.tree.flatten(infos, is_leaf=_is_info)
    flat_shardings = (jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, Int4Array)) if shardings is not None
                      else [None] * len(leaves))
    out = [_leaf_initializer(a, group, sh)(key, jnp.uint32(i)) for i, (a, sh) in enumerate(zip(leaves, flat_shardings))]
    return jax.tree.unflatten(treedef, out)


@functools.cache
def _leaf_initializer(a: ArrayInfo, group: int, sharding):
    """jit(key, leaf index) -> the leaf of declaration `a` in `sharding` (cached per declaration)."""

    def make(key, i):
        k = jax.random.fold_in(key, i)
        if a.init != "int4":
            return _init_one(a, k)
        if sharding is None:
            return _int4_experts(a, k, group, 0, a.shape[0])
        return _int4_sharded(a, k, group, sharding)

    return jax.jit(make, out_shardings=sharding)


def _int4_sharded(a: ArrayInfo, key, group: int, sh: Int4Array) -> Int4Array:
    """The INT4 leaf `a` made inside shard_map: each device makes the experts (and the slice of their width) that
    its shard of sh.packed holds."""
    mesh, spec = sh.packed.mesh, sh.packed.spec
    entries = list(spec) + [None] * (len(a.shape) - len(spec))
    names = lambda e: () if e is None else (e if isinstance(e, tuple) else (e,))
    split_axes = [i for i, e in enumerate(entries[1:]) if names(e)]
    if len(split_axes) > 1:
        raise ValueError(f"INT4 weight {a.shape}: at most one axis besides the experts may be sharded, got {spec}")
    size = lambda e: math.prod(mesh.shape[n] for n in names(e))
    e_local = a.shape[0] // size(entries[0])
    data = jax.random.key_data(key)

    def local(data):
        k = jax.random.wrap_key_data(data)
        first = (jax.lax.axis_index(names(entries[0])) * e_local) if names(entries[0]) else 0
        split = None
        if split_axes:
            ax = split_axes[0]
            split = (ax, jax.lax.axis_index(names(entries[ax + 1])), size(entries[ax + 1]))
        return _int4_experts(a, k, group, first, e_local, split)

    spec_out = Int4Array(packed=sh.packed.spec, scale=sh.scale.spec)
    return jax.shard_map(local, mesh=mesh, in_specs=jax.sharding.PartitionSpec(), out_specs=spec_out,
                         check_vma=False)(data)


def init_params(cfg: ModelConfig, key: jax.Array, mesh=None) -> Params:
    """Random weights with the exact pytree layout, shapes and dtypes of a loaded checkpoint, in one compiled call.

    Matmul weights are normal with std 1/sqrt(fan_in) (activations keep their scale through the layers),
    norms are ones, the router and its selection bias are small random values (a zero bias would never test
    the biased selection). INT4 experts are random normal weights quantized with `quantize_int4`, made one expert
    at a time. With a mesh, every weight is created in its sharding (no device ever holds a replicated copy), and
    the values equal the unsharded ones for the same key.
    """
    validate.prng_key(key)
    shardings = None if mesh is None else param_shardings(cfg, mesh)
    return init_from_info(param_info(cfg), key, cfg.group_size, shardings)


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded checkpoint: config, weights (on the mesh when one was given), drafter, tokenizer and manifest."""

    cfg: ModelConfig
    params: Params
    drafter: Any  # the DFlash Drafter converted along (kdtree-convert --drafter), else None
    tokenizer: Any  # TiktokenTokenizer, or ByteTokenizer when the checkpoint has no tokenizer files
    manifest: dict


# --------------------------------------------------------------------------------------------------------------
# 2. The latent KV cache: 512 + 64 values per token per layer for K2 (never expanded per head).
# --------------------------------------------------------------------------------------------------------------


@struct.dataclass
class KVCache:
    """One buffer per layer, so that a layer's new rows are written where they lie (a donated cache is updated
    in place; no stacked array is ever sliced or re-assembled)."""

    latent: tuple[jax.Array, ...]  # L x [B, S, R]   RMSNorm_kva(c_kv) of every cached token
    k_pe: tuple[jax.Array, ...]  # L x [B, S, dr]  rope(k_pe) at the token's position (= its slot)
    lengths: jax.Array  # int32 [B]      committed tokens per row; slots >= lengths[b] are free

    @property
    def max_len(self) -> int:
        return self.latent[0].shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    """An empty cache of `max_len` slots per row. Token positions equal their slot index. Under a mesh with
    cfg.cache_sharding == "sequence", every layer's buffers are split along the slots over the model axes."""
    layers = range(cfg.num_hidden_layers)
    place = sequence_sharded if cfg.cache_sharding == "sequence" else (lambda x: x)
    zeros = lambda width: place(jnp.zeros((batch, max_len, width), cfg.jnp_dtype))
    return KVCache(latent=tuple(zeros(cfg.kv_lora_rank) for _ in layers),
                   k_pe=tuple(zeros(cfg.qk_rope_head_dim) for _ in layers),
                   lengths=jnp.zeros((batch,), jnp.int32))


# --------------------------------------------------------------------------------------------------------------
# 3. Blocks
# --------------------------------------------------------------------------------------------------------------


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dr/2] and the cos/sin multiplier ("attention factor") of YaRN or plain rope."""
    d, theta = cfg.qk_rope_head_dim, cfg.rope_theta
    extra = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / d)
    if cfg.rope_type == "default":
        return extra, 1.0
    f = cfg.rope_factor
    inter = extra / f

    def corr(rot):
        return d * math.log(cfg.rope_original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(cfg.rope_beta_fast or 32.0)), 0)
    high = min(math.ceil(corr(cfg.rope_beta_slow or 1.0)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    inv_freq = inter * ramp + extra * (1 - ramp)
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        factor = _yarn_mscale(f, cfg.rope_mscale) / _yarn_mscale(f, cfg.rope_mscale_all_dim)
    else:
        factor = _yarn_mscale(f)
    return inv_freq.astype(np.float32), float(factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """(dn + dr)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = cfg.qk_head_dim ** -0.5
    if cfg.rope_type == "yarn" and cfg.rope_mscale_all_dim:
        scale *= _yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, dr/2] in fp32 for integer positions [B, T]."""
    inv_freq, factor = rope_frequencies(cfg)
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, dr/2]
    return jnp.cos(angle) * factor, jnp.sin(angle) * factor


def _write_rows(cache: jax.Array, new: jax.Array, starts: jax.Array, cfg: ModelConfig) -> jax.Array:
    """cache [B, S, C] with new [B, T, C] written at slots starts[b] .. starts[b] + T - 1 of each row (in place;
    on a sequence-sharded cache each device writes the rows of its own block)."""
    if cfg.cache_sharding == "sequence" and current_mesh() is not None:
        return write_rows_sequence(cache, new, starts)
    return write_rows(cache, new, starts)


def _take_rows(cache: jax.Array, slots: jax.Array, cfg: ModelConfig) -> jax.Array:
    """cache [B, S, C] -> [B, P, C]: the rows at slots [B, P] of each batch row (on a sequence-sharded cache, each
    device contributes the rows it holds; no gather of the cache)."""
    if cfg.cache_sharding == "sequence" and current_mesh() is not None:
        return take_rows_sequence(cache, slots)
    return jnp.take_along_axis(cache, slots[:, :, None], axis=1)


def move_accepted(cache: KVCache, cfg: ModelConfig, starts: jax.Array, path: jax.Array, n_nodes: int) -> KVCache:
    """Move the accepted tree nodes' latents (slots starts + path[b, j]) to slots starts + j, every layer, in place.

    path [B, P] lists node indices in root-to-leaf order (padding -1: whatever lands past the accepted length is
    never read). Positions stay right: node path[j] has depth j and was roped at position starts + j.
    With the move_rows custom call on (`cfg.impl`), outside a mesh (it is not partitioned), every layer's two caches
    move in one launch; else a gather and an update per cache and layer.
    """
    if cfg.impl("move_rows") == "ffi" and current_mesh() is None:
        moved = move_rows(cache.latent + cache.k_pe, starts, path, n_nodes)
        n = len(cache.latent)
        return dataclasses.replace(cache, latent=moved[:n], k_pe=moved[n:])
    slots = starts[:, None] + jnp.clip(path, 0, n_nodes - 1)  # [B, P]
    move = lambda c: _write_rows(c, _take_rows(c, slots, cfg), starts, cfg)
    return dataclasses.replace(cache, latent=tuple(map(move, cache.latent)), k_pe=tuple(map(move, cache.k_pe)))


def _expand_kv(p: Attention, latent: jax.Array, pe: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-head keys [B, S, H, dn + dr] and values [B, S, H, dv] of latents [B, S, R] and rope keys [B, S, dr]."""
    k_nope = jnp.einsum("bsr,rhn->bshn", latent, p.k_b)  # [B, S, H, dn]
    k_rope = jnp.broadcast_to(pe[:, :, None, :], (*k_nope.shape[:3], pe.shape[-1]))
    return jnp.concatenate([k_nope, k_rope], axis=-1), jnp.einsum("bsr,hvr->bshv", latent, p.v_b)


def attention_impl(cfg: ModelConfig) -> str:
    """The naive attention's implementation (`naive_attention_lse`, a prompt piece's): "cudnn" on a GPU where the
    model runs its attention custom call (mla_verify on "ffi"), else "xla"."""
    return "cudnn" if cfg.impl("mla_verify") == "ffi" and jax.default_backend() == "gpu" else "xla"


def naive_attention_lse(q, k, v, scale: float, *, causal: bool, kv_len=None, impl: str = "xla"):
    """Softmax attention of q [B, T, H, D] over k [B, S, G, D], v [B, S, G, dv] (G key/value heads, each shared by
    H / G query heads in order; causal: query t sees keys <= t; kv_len [B]: only keys < kv_len[b]). Returns
    (out [B, T, H, dv] fp32, log-sum-exp [B, T, H] fp32; rows that see nothing: 0 and -inf). impl "cudnn": cuDNN's
    flash attention (GPU; values padded to the key width), else XLA."""
    b, t, h, d = q.shape
    s, g, dv = k.shape[1], k.shape[2], v.shape[-1]
    lens = jnp.full((b,), s, jnp.int32) if kv_len is None else kv_len.astype(jnp.int32)
    if impl == "cudnn":
        vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, d - dv))) if dv < d else v
        out, lse = jax.nn.dot_product_attention(q, k, vp, scale=scale, is_causal=causal,
                                                query_seq_lengths=jnp.full((b,), t, jnp.int32),
                                                key_value_seq_lengths=jnp.maximum(lens, 1), implementation="cudnn",
                                                return_residual=True)
        seen = (lens > 0)[:, None, None]
        return (jnp.where(seen[..., None], out[..., :dv].astype(jnp.float32), 0.0),
                jnp.where(seen, lse.astype(jnp.float32), -jnp.inf))
    f32 = jnp.float32
    if g < h:  # grouped: each key/value head serves h // g query heads
        sc = jnp.einsum("btgrd,bsgd->btgrs", q.reshape(b, t, g, h // g, d), k,
                        preferred_element_type=f32).reshape(b, t, h, s) * scale
    else:
        sc = jnp.einsum("bthd,bshd->bths", q, k, preferred_element_type=f32) * scale  # [B, T, H, S]
    visible = jnp.arange(s)[None, None, :] < lens[:, None, None]  # [B, 1, S]
    if causal:
        visible = visible & (jnp.arange(s)[None, None, :] <= jnp.arange(t)[None, :, None])
    visible = visible[:, :, None, :]  # [B, T, 1, S]
    sc = jnp.where(visible, sc, -jnp.inf)
    peak = jnp.max(sc, axis=-1)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    pr = jnp.where(visible, jnp.exp(sc - peak[..., None]), 0.0)
    total = jnp.sum(pr, axis=-1)
    if g < h:
        out = jnp.einsum("btgrs,bsgv->btgrv", pr.reshape(b, t, g, h // g, s), v.astype(f32)).reshape(b, t, h, dv)
    else:
        out = jnp.einsum("bths,bshv->bthv", pr, v.astype(f32))
    out = out / jnp.where(total == 0, 1.0, total)[..., None]
    return out, jnp.where(total > 0, peak + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def chunk_attention(p: Attention, q_nope, q_pe, c_kv, k_pe, latent, pe, starts, scale: float, impl: str):
    """A prompt piece of T tokens at slots starts[b] (equal for every row) attending in the naive form to the
    committed prefix (slots < starts[b] of the cache latent [B, S, R], pe [B, S, dr], keys and values expanded per
    head) and causally to itself (from its own c_kv [B, T, R], k_pe [B, T, dr]); the two joined by log-sum-exp.
    The naive form costs 2 x (dn + dr + dv) FLOPs per head and key, the absorbed one 2 x (2R + dr): 3.4x more for
    K2. Returns [B, T, H, dv] fp32."""
    q = jnp.concatenate([q_nope, q_pe], axis=-1)  # [B, T, H, dn + dr]
    k_pre, v_pre = _expand_kv(p, latent, pe)
    k_new, v_new = _expand_kv(p, c_kv, k_pe)
    prefix = naive_attention_lse(q, k_pre, v_pre, scale, causal=False, kv_len=starts, impl=impl)
    own = naive_attention_lse(q, k_new, v_new, scale, causal=True, impl=impl)
    return combine_lse(prefix, own)[0]


def _dot(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., K] . w [K, ...] -> [..., *w.shape[1:]], XLA's dot (fp32 accumulation when out_dtype is float32)."""
    return jnp.tensordot(x, w, axes=1, preferred_element_type=out_dtype)


def pre_impl(cfg: ModelConfig, mode: str, rows: int) -> str:
    """How an absorbed-mode layer computes its queries and cache rows from qkv_a's output: "ffi" (`kernels.mla_pre`,
    one custom call, where the config picks it, no mesh splits the model, the model has a query latent and the step
    has at most MLA_PRE_MAX_ROWS tokens) or "xla" (the model's own operations)."""
    ok = (mode == "absorbed" and cfg.impl("mla_pre") == "ffi" and current_mesh() is None and bool(cfg.q_lora_rank)
          and rows <= MLA_PRE_MAX_ROWS)
    return "ffi" if ok else "xla"


def mla(p: Attention, x, cos, sin, cfg: ModelConfig, mode: str, cache_layer=None, lengths=None, tree_mask=None,
        qkv=None, project: bool = True):
    """Multi-head latent attention of x [B, T, D]. Returns (out [B, T, D], (latent, k_pe) for the cache).

    qkv: qkv_a's output [B, T, Rq + R + dr] when the caller computed it (`_layer_fused`; x is then unused);
    project=False returns the heads' values [B, T, H, dv] instead of their o projection.

    mode "prefill": the naive form over the T tokens alone, causal (the cache, if any, starts empty).
    mode "chunk": a piece of a long prompt, written at lengths[b] (the same for every row): the naive form over the
    cached prefix and, causally, the piece itself (`chunk_attention`); on a sequence-sharded cache, "absorbed".
    mode "absorbed": the absorbed form over the cache (committed prefix) plus the T new tokens seen through
    tree_mask [B, T, T]; the new latents are written at lengths[b] first.
    """
    dt, f32 = (x if qkv is None else qkv).dtype, jnp.float32
    dn, scale = cfg.qk_nope_head_dim, softmax_scale(cfg)
    rq = cfg.q_lora_rank or 0
    if qkv is None:
        with jax.named_scope("qkv_a"):
            a = _dot(x, p.qkv_a)  # [B, T, Rq + R + dr]
    else:
        a = qkv
    out = partial(_o_projection, p, dt=dt) if project else (lambda o: o)
    if pre_impl(cfg, mode, a.shape[0] * a.shape[1]) == "ffi":  # norms, q_b, rope, cache writes, k_b: one launch
        with jax.named_scope("mla_pre"):
            q_lat, q_pe, latent, pe = mla_pre(a, p.q_a_norm, p.kv_a_norm, p.q_b, p.k_b, cos, sin, cache_layer[0],
                                              cache_layer[1], lengths.astype(jnp.int32), eps=cfg.rms_norm_eps,
                                              flags=MLA_PRE_WEIGHT_PARAM)
        with jax.named_scope("absorbed_attention"):
            o_lat = mla_verify(q_lat, q_pe, latent, pe, lengths, tree_mask, scale, impl=cfg.impl("mla_verify"))
            o = jnp.einsum("bthr,hvr->bthv", o_lat.astype(dt), p.v_b)  # [B, T, H, dv]
        return out(o), (latent, pe)
    with jax.named_scope("q"):
        cq = rms_norm(a[..., :rq], p.q_a_norm, cfg.rms_norm_eps) if rq else x  # [B, T, Rq]
        q = jnp.einsum("btr,hkr->bthk", cq, p.q_b)  # [B, T, H, dn + dr]
        q_nope, q_pe = q[..., :dn], apply_rope(q[..., dn:], cos, sin)
    with jax.named_scope("kv"):
        c_kv = rms_norm(a[..., rq:rq + cfg.kv_lora_rank], p.kv_a_norm, cfg.rms_norm_eps)  # [B, T, R]
        k_pe = apply_rope(a[..., rq + cfg.kv_lora_rank:], cos, sin)  # [B, T, dr]
    if mode == "prefill":
        with jax.named_scope("naive_attention"):
            k_nope = jnp.einsum("btr,rhn->bthn", c_kv, p.k_b)  # [B, T, H, dn]
            v = jnp.einsum("btr,hvr->bthv", c_kv, p.v_b)  # [B, T, H, dv]
            s = (jnp.einsum("bthn,buhn->bhtu", q_nope, k_nope, preferred_element_type=f32)
                 + jnp.einsum("bthp,bup->bhtu", q_pe, k_pe, preferred_element_type=f32)) * scale
            t = a.shape[1]
            causal = jnp.tril(jnp.ones((t, t), bool))
            probs = mask_softmax(s, causal[None, None])
            o = jnp.einsum("bhtu,buhv->bthv", probs.astype(dt), v)  # [B, T, H, dv]
        new_cache = None
        if cache_layer is not None:
            zeros = jnp.zeros_like(lengths)
            new_cache = (_write_rows(cache_layer[0], c_kv, zeros, cfg), _write_rows(cache_layer[1], k_pe, zeros, cfg))
    elif mode == "chunk" and not (current_mesh() is not None and cfg.cache_sharding == "sequence"):
        with jax.named_scope("chunk_attention"):
            latent, pe = _write_rows(cache_layer[0], c_kv, lengths, cfg), _write_rows(cache_layer[1], k_pe, lengths, cfg)
            o = chunk_attention(p, q_nope, q_pe, c_kv, k_pe, latent, pe, lengths, scale,
                                attention_impl(cfg))  # [B, T, H, dv]
            new_cache = (latent, pe)
    else:
        with jax.named_scope("absorbed_attention"):
            latent, pe = _write_rows(cache_layer[0], c_kv, lengths, cfg), _write_rows(cache_layer[1], k_pe, lengths, cfg)
            q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, p.k_b)  # [B, T, H, R]
            attn_impl = cfg.impl("mla_verify")
            attend = partial(mla_verify, impl=attn_impl)
            if current_mesh() is not None and cfg.cache_sharding == "sequence":
                o_lat = mla_sequence_parallel(partial(mla_prefix, impl=attn_impl), tree_attention_lse, combine_lse,
                                              q_lat, q_pe, latent, pe, c_kv, k_pe, lengths, tree_mask, scale)
            elif current_mesh() is not None and attn_impl == "ffi":
                o_lat = mla_head_parallel(attend, q_lat, q_pe, latent, pe, lengths, tree_mask, scale)
            else:
                o_lat = attend(q_lat, q_pe, latent, pe, lengths, tree_mask, scale)  # [B, T, H, R]
            o = jnp.einsum("bthr,hvr->bthv", o_lat.astype(dt), p.v_b)  # [B, T, H, dv]
            new_cache = (latent, pe)
    return out(o), new_cache


def _o_projection(p: Attention, o: jax.Array, dt) -> jax.Array:
    """The heads' values o [B, T, H, dv] -> [B, T, D]."""
    with jax.named_scope("o"):
        return jnp.einsum("bthv,hvd->btd", o.astype(dt), p.o)


def swiglu(p: MLP, x: jax.Array) -> jax.Array:
    """The gated MLP of x [..., D]."""
    gu = _dot(x, p.gate_up)  # [..., 2, F]
    return _dot(jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], p.down)


def route(p: MoE, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The sigmoid noaux_tc router on x [M, D]: (expert ids [M, k] int32, weights [M, k] fp32).

    The logits are an fp32-accumulated matmul; the choice (`kernels.moe_route`): the correction bias only chooses the
    experts, the weights are the unbiased sigmoid scores, normalized (norm_topk_prob) and scaled by
    routed_scaling_factor; with n_group > 1, only the topk_group groups with the largest sum of their two best biased
    scores compete.
    """
    return choose_experts(p, _dot(x, p.router, out_dtype=jnp.float32), cfg)  # logits [M, E]


def choose_experts(p: MoE, logits: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """`route`'s choice from the router's fp32 logits [M, E]."""
    choose = partial(moe_route, k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                     renormalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor, impl=cfg.impl("moe_route"))
    return replicated_call(choose, logits, p.router_bias.astype(jnp.float32))  # as the experts take the routing


def moe(p: MoE, x: jax.Array, cfg: ModelConfig, active: jax.Array | None = None) -> jax.Array:
    """Routed experts (top-k of the sigmoid router) plus the shared expert, for x [B, T, D]. Tokens where `active`
    bool [B, T] is False are routed to no expert (their routed part is 0; the MoE kernels read no expert weights for
    them): budget="auto" masks the draft nodes it does not verify this way."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    with jax.named_scope("router"):
        ids, w = _mask_inactive(*route(p, flat, cfg), active, cfg)
    with jax.named_scope("experts"):
        # experts_total: on an expert-parallel mesh each shard's call sees E/ep experts, and the block size of the
        # kernel is chosen from the slots per expert of the whole model's routing
        experts = partial(marlin_moe, impl=cfg.impl("marlin_moe"), experts_total=cfg.n_routed_experts)

        if current_mesh() is not None:  # the shared expert's slice added before the one all-reduce
            sh = p.shared
            return moe_expert_parallel(experts, flat, ids, w, p.we_gate, p.we_up, p.we_down, (sh.gate_up, sh.down),
                                       lambda gud, v: swiglu(MLP(*gud), v)).reshape(b, t, d)
        y = experts(flat, ids, w, p.we_gate, p.we_up, p.we_down)
    with jax.named_scope("shared_expert"):
        y = y + swiglu(p.shared, flat)
    return y.reshape(b, t, d)


def _mask_inactive(ids, w, active, cfg: ModelConfig):
    """The routing of the tokens where `active` [B, T] is False sent to no expert (id E, weight 0)."""
    if active is None:
        return ids, w
    on = active.reshape(-1, 1)
    return jnp.where(on, ids, cfg.n_routed_experts), jnp.where(on, w, 0.0)


def fused_impl(cfg: ModelConfig, mode: str, rows: int) -> str:
    """How a layer runs its dense weights and the glue around them: "ffi" (`_layer_fused`: four `kernels.fused_dot`
    calls, where the config picks it, no mesh splits the model, the model has a query latent (the attention then
    needs only qkv_a's output), the step is a decode or verify (absorbed mode) and it has at most FUSED_MAX_ROWS
    tokens, the CUDA kernel's) or "xla" (`_layer`'s own operations)."""
    ok = (mode == "absorbed" and cfg.impl("fused_dot") == "ffi" and current_mesh() is None
          and bool(cfg.q_lora_rank) and rows <= FUSED_MAX_ROWS)
    return "ffi" if ok else "xla"


def _layer_fused(h, lp: Layer, cos, sin, cfg: ModelConfig, mode: str, cache_layer, lengths, tree_mask, active):
    """`_layer` with its dense weights as four custom calls, each with its neighbours: the attention's RMSNorm +
    qkv_a; the o projection + the residual; the MLP's RMSNorm + the router's logits + the shared expert's gate/up and
    SwiGLU (+ the normalized rows, the routed experts' input); the shared expert's down, apart from the routed experts
    so that the two can run at once (XLA's two streams), then the sums (a dense layer: its norm + gate/up + SwiGLU,
    then its down + the residual). The same math, rounded in the same order (`kernels.fused_dot`)."""
    fd = partial(fused_dot, eps=cfg.rms_norm_eps, impl="ffi", flags=FUSED_WEIGHT_PARAM)
    b, t, d = h.shape
    with jax.named_scope("attention"):
        with jax.named_scope("qkv_a"):
            a = fd(h, lp.attn.qkv_a, norm=lp.attn_norm)[0]
        o, new_cache = mla(lp.attn, None, cos, sin, cfg, mode, cache_layer, lengths, tree_mask, qkv=a, project=False)
        with jax.named_scope("o"):
            hv = o.shape[-2] * o.shape[-1]
            h = fd(o.astype(h.dtype).reshape(b, t, hv), lp.attn.o.reshape(hv, d), adds=(h,))[0]
    with jax.named_scope("ffn"):
        if not isinstance(lp.mlp, MoE):
            hs = fd(h, lp.mlp.gate_up.reshape(d, -1), norm=lp.mlp_norm, gated=True)[0]
            return fd(hs, lp.mlp.down, adds=(h,))[0], new_cache
        p = lp.mlp
        with jax.named_scope("router"):
            logits, hs, xn = fd(h, p.router, w2=p.shared.gate_up.reshape(d, -1), norm=lp.mlp_norm, gated2=True,
                                out_dtype=jnp.float32, want_xn=True)
            ids, w = _mask_inactive(*choose_experts(p, logits.reshape(b * t, -1), cfg), active, cfg)
        with jax.named_scope("shared_expert"):  # independent of the routed experts: XLA may run it beside them
            s = fd(hs, p.shared.down)[0]
        with jax.named_scope("experts"):
            y = marlin_moe(xn.reshape(b * t, d), ids, w, p.we_gate, p.we_up, p.we_down, impl=cfg.impl("marlin_moe"),
                           experts_total=cfg.n_routed_experts)
        return h + (y.reshape(b, t, d) + s), new_cache


def _layer(h, lp: Layer, cos, sin, cfg: ModelConfig, mode: str, cache_layer, lengths, tree_mask, active=None):
    if fused_impl(cfg, mode, h.shape[0] * h.shape[1]) == "ffi":
        return _layer_fused(h, lp, cos, sin, cfg, mode, cache_layer, lengths, tree_mask, active)
    with jax.named_scope("attention"):
        a, new_cache = mla(lp.attn, rms_norm(h, lp.attn_norm, cfg.rms_norm_eps), cos, sin, cfg, mode,
                           cache_layer, lengths, tree_mask)
        h = h + a
    with jax.named_scope("ffn"):
        x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps)
        h = h + (moe(lp.mlp, x, cfg, active) if isinstance(lp.mlp, MoE) else swiglu(lp.mlp, x))
    return h, new_cache


# --------------------------------------------------------------------------------------------------------------
# 4. Forward passes
# --------------------------------------------------------------------------------------------------------------


@struct.dataclass
class StepOutput:
    logits: jax.Array  # f32 [B, T, V]
    hidden: jax.Array  # [L, B, T, D] output of every layer (before the final norm)
    cache: KVCache | None


def _run_layers(params: Params, cfg: ModelConfig, h, cos, sin, mode, cache: KVCache | None, tree_mask, active=None):
    """The decoder layers, unrolled (each reads its own weight and cache buffers where they lie: a scan over
    stacked layers copied each layer's weights and cache slice per step). Returns (h, every layer's output
    [L, B, T, D], updated cache). active: bool [B, T] or None, see `moe`."""
    outs, lat_out, pe_out = [], [], []
    for i, lp in enumerate(params.layers):
        cache_layer = None if cache is None else (cache.latent[i], cache.k_pe[i])
        with jax.named_scope(f"layer_{i}"):
            h, new = _layer(h, lp, cos, sin, cfg, mode, cache_layer, None if cache is None else cache.lengths,
                            tree_mask, active)
        outs.append(h)
        if new is not None:
            lat_out.append(new[0])
            pe_out.append(new[1])
    new_cache = None
    if cache is not None:
        new_cache = dataclasses.replace(cache, latent=tuple(lat_out), k_pe=tuple(pe_out))
    return h, jnp.stack(outs), new_cache


def _logits(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    with jax.named_scope("lm_head"):
        x = rms_norm(h, params.final_norm, cfg.rms_norm_eps)
        return jnp.einsum("btd,dv->btv", x, params.lm_head, preferred_element_type=jnp.float32)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """The token embeddings [B, T, D]; on a model-parallel mesh, looked up where each row lies."""
    if current_mesh() is not None:
        return vocab_parallel_lookup(params.embed, tokens)
    return params.embed[tokens]


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, return_hidden: bool = False):
    """Teacher-forced logits: tokens [B, T] int32 -> logits [B, T, V] float32 (positions 0 .. T-1, causal).

    With `return_hidden`, returns (logits, hidden [L, B, T, D]) with every decoder layer's output.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    with trace_context(params, cfg):
        out = _forward_jit(params, cfg, tokens)
    return (out.logits, out.hidden) if return_hidden else out.logits


@partial(jax.jit, static_argnames=("cfg",))
def _forward_jit(params: Params, cfg: ModelConfig, tokens: jax.Array) -> StepOutput:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = rope_tables(cfg, positions)
    h, hidden, _ = _run_layers(params, cfg, embed(params, tokens), cos, sin, "prefill", None, None)
    return StepOutput(logits=_logits(params, cfg, h), hidden=hidden, cache=None)


def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, cache: KVCache) -> StepOutput:
    """Run right-padded prompts tokens [B, T] (row b holds lengths[b] real tokens) into an empty cache.

    Writes all T slots (the padding slots stay invisible: attention only sees slots < lengths) and sets
    cache.lengths = lengths. Logits [B, T, V]; the next-token logits of row b are at lengths[b] - 1.
    """
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = rope_tables(cfg, positions)
    cache = dataclasses.replace(cache, lengths=jnp.zeros_like(lengths))
    h, hidden, cache = _run_layers(params, cfg, embed(params, tokens), cos, sin, "prefill", cache, None)
    cache = dataclasses.replace(cache, lengths=lengths.astype(jnp.int32))
    return StepOutput(logits=_logits(params, cfg, h), hidden=hidden, cache=cache)


def prefill_last(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
                 chunk: int | None = None, on_chunk=None, carry=None):
    """Run right-padded prompts tokens [B, T] into an empty cache; returns (the next-token logits [B, V] f32 at each
    row's last prompt token, the cache with lengths set, carry).

    With `chunk` (< T), the prompt goes in chunks of `chunk` tokens, each attending to the cache written so far and
    causally within itself (the naive form, `chunk_attention`), in a loop compiled once: memory is bounded by the chunk,
    not by T x T scores, and only the last token's logits are formed. Without it, one naive pass (`prefill`).
    on_chunk(carry, hidden [L, B, t, D], starts [B]) -> carry sees every layer's output of each piece (the drafter
    takes its context there). The cache needs room for T rounded up to a multiple of `chunk`.
    """
    b, t = tokens.shape
    pick = lambda x, idx: jnp.take_along_axis(x, jnp.clip(idx, 0, x.shape[1] - 1)[:, None, None], axis=1)[:, 0]
    if chunk is None or t <= chunk:
        res = prefill(params, cfg, tokens, lengths, cache)
        if on_chunk is not None:
            carry = on_chunk(carry, res.hidden, jnp.zeros_like(lengths))
        return pick(res.logits, lengths - 1), res.cache, carry
    n = -(-t // chunk)
    if cache.max_len < n * chunk:
        raise ValueError(f"prefill in chunks of {chunk}: the cache has {cache.max_len} slots, fewer than the "
                         f"{n * chunk} the padded prompt needs")
    pieces = jnp.pad(tokens, ((0, 0), (0, n * chunk - t))).reshape(b, n, chunk).transpose(1, 0, 2)  # [n, B, C]
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((chunk, chunk), bool)), (b, chunk, chunk))

    def body(state, xs):
        cache, last, carry = state
        k, toks = xs
        starts = jnp.full((b,), k * chunk, jnp.int32)
        positions = starts[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        cos, sin = rope_tables(cfg, positions)
        h, hidden, cache = _run_layers(params, cfg, embed(params, toks), cos, sin, "chunk",
                                       dataclasses.replace(cache, lengths=starts), causal)
        idx = lengths - 1 - k * chunk  # [B] the row's last prompt token, if it lies in this piece
        mine = (idx >= 0) & (idx < chunk)
        last = jnp.where(mine[:, None], _logits(params, cfg, pick(h, idx)[:, None])[:, 0], last)
        if on_chunk is not None:
            carry = on_chunk(carry, hidden, starts)
        return (cache, last, carry), None

    last = jnp.zeros((b, cfg.vocab_size), jnp.float32)
    (cache, last, carry), _ = jax.lax.scan(body, (cache, last, carry), (jnp.arange(n, dtype=jnp.int32), pieces))
    return last, dataclasses.replace(cache, lengths=lengths.astype(jnp.int32)), carry


def step(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache, depths: jax.Array | None = None,
         tree_mask: jax.Array | None = None, active: jax.Array | None = None) -> StepOutput:
    """One cached forward over T new tokens [B, T] placed after each row's committed prefix.

    Token t of row b is written at slot cache.lengths[b] + t and has position cache.lengths[b] + depths[b, t]
    (default depths = t: a plain causal continuation). tree_mask bool [B, T, T] says which new tokens each one
    sees (default: causal). cache.lengths is NOT advanced: the caller commits what it accepts.
    active bool [B, T] (default: all): tokens that are False are routed to no expert (`moe`), so they cost no
    expert weights and their outputs are meaningless; the others are exact as long as they see no inactive token
    (budget="auto" verifies a chosen, prefix-closed part of a tree this way).
    """
    b, t = tokens.shape
    if depths is None:
        depths = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if tree_mask is None:
        tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    cos, sin = rope_tables(cfg, cache.lengths[:, None] + depths)
    h, hidden, cache = _run_layers(params, cfg, embed(params, tokens), cos, sin, "absorbed", cache, tree_mask, active)
    return StepOutput(logits=_logits(params, cfg, h), hidden=hidden, cache=cache)


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """One greedy-ready decode step: tokens [B] -> (logits [B, V] f32, cache with lengths + 1). Donates cache."""
    out = step(params, cfg, tokens[:, None], cache)
    cache = dataclasses.replace(out.cache, lengths=out.cache.lengths + 1)
    return out.logits[:, 0], cache

