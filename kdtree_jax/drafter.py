"""The DFlash block-diffusion drafter (z-lab/dflash, arXiv:2602.06036), as published.

A few Qwen3-style decoder layers (GQA attention with q/k RMSNorm, rope, SwiGLU) with no embedding or lm_head
of their own: the block [bonus, MASK x (block_size - 1)] is embedded with the target's table, and the outputs
go through the drafter's own final norm, then the target's lm_head.
Conditioning: the outputs of a few evenly spaced target layers, concatenated and fused by a linear layer + RMSNorm
(`fc`, `hidden_norm`), are projected by every drafter layer into extra keys and values ("KV injection"). The
block attends bidirectionally to itself and to all of that context. One forward gives the per-depth
distributions q_1 .. q_{block_size - 1} that DDTree builds its tree from (docs/ddtree.md §5).

The context keys and values are cached per drafter layer (`DraftCache`) and appended as the target commits
tokens, so each step costs O(block x context), not a recomputation of the context.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from .config import ConfigError, ModelConfig
from .kernels.draft_attention import draft_attention
from .kernels.fused_dot import MAX_ROWS as FUSED_MAX_ROWS, fused_dot
from .kernels.mla_verify import combine_lse
from .model import (ArrayInfo, KVCache, Params, embed, init_from_info, naive_attention_lse, rms_norm, stack_info, step,
                    write_rows)
from .sharding import (MODEL_AXES, batch_axis, current_mesh, draft_head_parallel, draft_heads_split, fitting_sharding,
                       logical_to_spec, model_parallel)
from .validate import is_integer, is_real, prng_key, shown


@runtime_checkable
class DrafterProtocol(Protocol):
    """What the speculative methods (`kdtree_jax.ddtree`) ask of a drafter; the DFlash `Drafter` and the
    `OracleDrafter` implement it, and the methods never ask which one they hold. An implementation is a pytree (its
    weights as leaves, its shape as static data), so it passes through `jax.jit` like the target's params.

    The drafter's own state (`start`, `add_context`) rides in the decoding loop's carry; `propose` is pure.
    """

    @property
    def block_size(self) -> int:
        """The block [bonus, MASK x depth]: a step commits at most this many tokens."""

    @property
    def depth(self) -> int:
        """Draft positions per step, block_size - 1 (the tree's depth)."""

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError when this drafter cannot draft for target cfg."""

    def start(self, batch: int, max_len: int) -> Any:
        """The drafter's state for `batch` rows of up to `max_len` cache slots (a pytree, or None): every leaf has
        the rows on axis 0 (the server puts a request's row in a slot of the batch there) and, where it holds
        something per cache slot, the slots on axis 1 (the server's prefix cache keeps a prompt's first slots)."""

    def add_context(self, state: Any, hidden: jax.Array, starts: jax.Array) -> Any:
        """Take the target's hidden states [L, B, T, D] of T committed tokens at slots starts[b] + t."""

    def propose(self, target: Params, cfg: ModelConfig, state: Any, cache: KVCache, bonus: jax.Array,
                key: jax.Array) -> jax.Array:
        """Per-depth draft logits [B, depth, V] (f32) for the tokens after the bonus [B], the target's cache holding
        the committed prefix (cache.lengths[b] tokens)."""


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Static shape of a DFlash drafter and the target it was built for."""

    num_layers: int
    block_size: int  # the block [bonus, MASK x (block_size - 1)]: tree depth L = block_size - 1
    hidden_size: int  # = the target's hidden size (shared embedding and lm_head)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]  # target layers whose outputs condition the drafter
    mask_token_id: int
    vocab_size: int  # the target's
    target_num_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    dtype: str = "float32"

    def __post_init__(self):
        """Refuse a config no drafter can have, naming the field (a drafter_config.json or DFlash config.json of
        wrong content fails here, not as a shape error deep in a jitted step)."""
        def refuse(name: str, need: str) -> None:
            raise ConfigError(f"drafter config field {name!r} must be {need}, got {shown(getattr(self, name))}")

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not is_integer(value) or value < (0 if f.name == "mask_token_id" else 1)):
                refuse(f.name, "an integer >= 0" if f.name == "mask_token_id" else "an integer >= 1")
            if f.type == "float" and not (is_real(value) and math.isfinite(value) and value > 0):
                refuse(f.name, "a finite number > 0")
        if self.block_size < 2:
            refuse("block_size", "at least 2 (the bonus token and one draft position)")
        if self.num_heads % self.num_kv_heads:
            refuse("num_heads", f"a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.mask_token_id >= self.vocab_size:
            refuse("mask_token_id", f"an id in [0, {self.vocab_size}) (the vocabulary)")
        ids = self.target_layer_ids
        if not (isinstance(ids, tuple) and ids and all(is_integer(i) and 0 <= i < self.target_num_layers
                                                       for i in ids)):
            refuse("target_layer_ids", f"a non-empty list of layer ids in [0, {self.target_num_layers})")
        if self.dtype not in ("float32", "bfloat16"):
            refuse("dtype", "'float32' or 'bfloat16'")

    @property
    def depth(self) -> int:
        return self.block_size - 1

    def check_target(self, cfg: ModelConfig) -> None:
        """Raise ValueError when this drafter was built for another target than cfg."""
        for mine, theirs, what in ((self.hidden_size, cfg.hidden_size, "hidden_size"),
                                   (self.vocab_size, cfg.vocab_size, "vocab_size"),
                                   (self.target_num_layers, cfg.num_hidden_layers, "num_hidden_layers")):
            if mine != theirs:
                raise ValueError(f"the drafter was built for a target with {what}={mine}, this target has {theirs}")
        if max(self.target_layer_ids) >= cfg.num_hidden_layers:
            raise ValueError(f"drafter target_layer_ids {self.target_layer_ids} exceed the target's layers")


@struct.dataclass
class DraftLayer:
    attn_norm: jax.Array  # [D]
    q: jax.Array  # [D, Hq, hd]
    k: jax.Array  # [D, Hkv, hd]
    v: jax.Array  # [D, Hkv, hd]
    q_norm: jax.Array  # [hd]
    k_norm: jax.Array  # [hd]
    o: jax.Array  # [Hq, hd, D]
    mlp_norm: jax.Array  # [D]
    gate: jax.Array  # [D, F]
    up: jax.Array  # [D, F]
    down: jax.Array  # [F, D]


@struct.dataclass
class DrafterParams:
    fc: jax.Array  # [n_ctx * D, D]  fuses the concatenated target hidden states
    hidden_norm: jax.Array  # [D]
    layers: DraftLayer  # stacked [Ld, ...]
    norm: jax.Array  # [D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafter:
    """A drafter: its static config and its weights (a pytree; the config rides along as static data)."""

    params: DrafterParams
    cfg: DrafterConfig = dataclasses.field(metadata=dict(static=True))

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def depth(self) -> int:
        return self.cfg.depth

    def check(self, cfg: ModelConfig) -> None:
        self.cfg.check_target(cfg)

    def start(self, batch: int, max_len: int) -> DraftCache:
        """An empty context cache."""
        return init_draft_cache(self.cfg, batch, max_len)

    def add_context(self, state: DraftCache, hidden: jax.Array, starts: jax.Array) -> DraftCache:
        return append_context(self, state, hidden, starts)

    def propose(self, target: Params, cfg: ModelConfig, state: DraftCache, cache: KVCache, bonus: jax.Array,
                key: jax.Array) -> jax.Array:
        """One forward of the block (`draft`), its attention the custom call where the target's config runs it
        (ffi_ops "draft_attention", a default; on a mesh per shard of heads, where they split evenly), else XLA's
        one softmax.
        cuDNN's two flash
        attentions (`block_attention` "cudnn") were slower for one device's share of the K2.5-DFlash drafter (H100,
        2026-12-06: 1.11 against 0.80 ms a draft at batch 1, 1.33 against 1.26 at 10; docs/full_scale.md)."""
        ffi = cfg.impl("draft_attention") == "ffi" and draft_heads_split(self.cfg.num_heads, self.cfg.num_kv_heads)
        dense = "ffi" if cfg.impl("fused_dot") == "ffi" and fused_splits(self.cfg, target.lm_head.shape[1]) else "xla"
        return draft(self, target, state, cache.lengths, bonus, attention="ffi" if ffi else "xla", dense=dense)


@struct.dataclass
class DraftCache:
    """The context keys and values of every drafter layer, one array a layer (as the target's cache: a layer's whole
    buffer goes to its attention, no slice of a stacked one copied out), rows on axis 0 and slots on axis 1."""

    k: tuple[jax.Array, ...]  # per layer [B, S, Hkv, hd]  context keys (k_norm, rope at the token's position)
    v: tuple[jax.Array, ...]  # per layer [B, S, Hkv, hd]  context values


def target_layer_ids(num_target_layers: int, num_ctx: int) -> tuple[int, ...]:
    """`num_ctx` target layers spread evenly from layer 1 to layer L - 3 (DFlash's choice); small targets, where
    that range holds fewer than `num_ctx` layers, spread over all their layers instead."""
    n_layers = num_target_layers
    if num_ctx == 1:
        return (n_layers // 2,)
    lo, hi = 1, n_layers - 3
    if hi - lo + 1 < num_ctx:
        lo, hi = (1 if n_layers > num_ctx else 0), n_layers - 1
    return tuple(min(round(lo + i * (hi - lo) / (num_ctx - 1)), n_layers - 1) for i in range(num_ctx))


def drafter_info(d: DrafterConfig) -> DrafterParams:
    dt, h, f = jnp.dtype(d.dtype), d.hidden_size, d.intermediate_size
    hq, hk, hd = d.num_heads, d.num_kv_heads, d.head_dim
    layer = DraftLayer(attn_norm=ArrayInfo((h,), dt, ("embed",), "ones"),
                       q=ArrayInfo((h, hq, hd), dt, ("embed", "heads", None)),
                       k=ArrayInfo((h, hk, hd), dt, ("embed", "kv_heads", None)),
                       v=ArrayInfo((h, hk, hd), dt, ("embed", "kv_heads", None)),
                       q_norm=ArrayInfo((hd,), dt, (None,), "ones"), k_norm=ArrayInfo((hd,), dt, (None,), "ones"),
                       o=ArrayInfo((hq, hd, h), dt, ("heads", None, "embed"), fan_in_axes=(0, 1)),
                       mlp_norm=ArrayInfo((h,), dt, ("embed",), "ones"),
                       gate=ArrayInfo((h, f), dt, ("embed", "mlp")), up=ArrayInfo((h, f), dt, ("embed", "mlp")),
                       down=ArrayInfo((f, h), dt, ("mlp", "embed")))
    n_ctx = len(d.target_layer_ids)
    return DrafterParams(fc=ArrayInfo((n_ctx * h, h), dt, ("fused_ctx", "embed")),
                         hidden_norm=ArrayInfo((h,), dt, ("embed",), "ones"),
                         layers=stack_info(layer, d.num_layers), norm=ArrayInfo((h,), dt, ("embed",), "ones"))


def drafter_shardings(d: DrafterConfig, mesh) -> DrafterParams:
    """A DrafterParams-shaped pytree of NamedSharding: split over the model axes like the target (query heads and
    the MLP width over ep x tp, the key/value heads and the rows of `fc` too), each dimension the mesh does not
    divide replicated instead (`fitting_sharding`)."""
    return jax.tree.map(lambda a: fitting_sharding(mesh, a.shape, logical_to_spec(a.axes)), drafter_info(d),
                        is_leaf=lambda x: isinstance(x, ArrayInfo))


def shard_drafter(drafter: Drafter, mesh) -> Drafter:
    """The drafter's weights placed (or re-placed) in `drafter_shardings` on the mesh."""
    return dataclasses.replace(drafter, params=jax.device_put(drafter.params, drafter_shardings(drafter.cfg, mesh)))


def init_drafter(cfg: ModelConfig, key: jax.Array, num_layers: int = 1, block_size: int = 8, *,
                 num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                 intermediate_size: int | None = None, mask_token_id: int | None = None,
                 layer_ids: tuple[int, ...] | None = None, mesh=None) -> Drafter:
    """A random DFlash drafter for target `cfg` (decoding with it stays lossless; only acceptance suffers).

    Defaults follow the published drafters: the target's head count, 8x fewer KV heads, the target's dense MLP
    width, as many context layers as drafter layers, mask token = the last vocabulary id (a reserved id). With a
    mesh, every weight is made in its `drafter_shardings` (the same values as without).
    """
    prng_key(key)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    if not isinstance(block_size, int) or not 2 <= block_size <= 17:
        raise ValueError(f"block_size must be an integer in 2..17 (tree depth 1..16), got {block_size!r}")
    hq = num_heads or cfg.num_attention_heads
    hk = num_kv_heads or max(1, hq // 8)  # DrafterConfig refuses heads that are not a multiple of hk
    hd = head_dim or cfg.hidden_size // hq
    d = DrafterConfig(num_layers=num_layers, block_size=block_size, hidden_size=cfg.hidden_size, num_heads=hq,
                      num_kv_heads=hk, head_dim=hd, intermediate_size=intermediate_size or cfg.intermediate_size,
                      target_layer_ids=tuple(layer_ids or target_layer_ids(cfg.num_hidden_layers, num_layers)),
                      mask_token_id=cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
                      vocab_size=cfg.vocab_size, target_num_layers=cfg.num_hidden_layers,
                      rms_norm_eps=cfg.rms_norm_eps, dtype=cfg.dtype)
    d.check_target(cfg)
    shardings = None if mesh is None else drafter_shardings(d, mesh)
    return Drafter(params=init_from_info(drafter_info(d), key, cfg.group_size, shardings), cfg=d)


SLOT_MULTIPLE = 256  # the drafter's cache slots are rounded up to this: XLA padded a cache of other lengths (a copy
# of the values and of the probabilities a layer, for the GEMM's tiles; deviceless H200 compile, 2026-12-06)


def draft_slots(max_len: int) -> int:
    """The drafter's cache slots for a target cache of `max_len`: rounded up to SLOT_MULTIPLE (the slots past
    max_len are never written or seen)."""
    return -(-max_len // SLOT_MULTIPLE) * SLOT_MULTIPLE


def init_draft_cache(d: DrafterConfig, batch: int, max_len: int) -> DraftCache:
    """An empty context cache of `draft_slots(max_len)` slots; under a model-parallel mesh, split over the key/value
    heads like the drafter's k and v (where they divide)."""
    shape = (batch, draft_slots(max_len), d.num_kv_heads, d.head_dim)
    mesh = current_mesh()
    where = None if mesh is None else fitting_sharding(mesh, shape, logical_to_spec(("batch", None, "kv_heads", None)))
    place = (lambda x: x) if where is None else (lambda x: jax.lax.with_sharding_constraint(x, where))
    layers = lambda: tuple(place(jnp.zeros(shape, jnp.dtype(d.dtype))) for _ in range(d.num_layers))
    return DraftCache(k=layers(), v=layers())


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Qwen3 rope (rotate-half layout) of x [B, T, H, hd] at integer positions [B, T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    ang = positions.astype(jnp.float32)[..., None, None] * inv  # [B, T, 1, hd/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., :hd // 2].astype(jnp.float32), x[..., hd // 2:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _kv(lp: DraftLayer, x: jax.Array, positions: jax.Array, d: DrafterConfig):
    k = rms_norm(jnp.einsum("btd,dhk->bthk", x, lp.k), lp.k_norm, d.rms_norm_eps)
    v = jnp.einsum("btd,dhk->bthk", x, lp.v)
    return _rope(k, positions, d.rope_theta), v


def fuse_context(p: DrafterParams, d: DrafterConfig, target_hidden: jax.Array) -> jax.Array:
    """Target layer outputs [L_target, B, T, D] -> the drafter's context features [B, T, D]."""
    sel = target_hidden[jnp.asarray(d.target_layer_ids)]  # [n_ctx, B, T, D]
    cat = jnp.moveaxis(sel, 0, -2).reshape(*sel.shape[1:3], -1)  # [B, T, n_ctx * D]
    return rms_norm(cat @ p.fc, p.hidden_norm, d.rms_norm_eps)


def append_context(drafter: Drafter, cache: DraftCache, target_hidden: jax.Array, starts: jax.Array) -> DraftCache:
    """Project target hidden states [L_target, B, T, D] of T committed tokens at slots starts[b] + t into every
    drafter layer's context keys and values."""
    p, d = drafter.params, drafter.cfg
    ctx = fuse_context(p, d, target_hidden)  # [B, T, D]
    t = ctx.shape[1]
    positions = starts[:, None] + jnp.arange(t)[None, :]
    k, v = jax.vmap(lambda lp: _kv(lp, ctx, positions, d))(p.layers)  # [Ld, B, T, Hkv, hd]
    write = lambda cs, new: tuple(write_rows(c, new[i], starts) for i, c in enumerate(cs))
    return DraftCache(k=write(cache.k, k), v=write(cache.v, v))


def block_attention(q: jax.Array, ck: jax.Array, cv: jax.Array, kb: jax.Array, vb: jax.Array, lengths: jax.Array,
                    scale: float, impl: str = "xla") -> jax.Array:
    """The block's attention: queries q [B, bs, H, hd] over the context keys/values ck, cv [B, S, G, hd] below
    lengths[b] and the whole block's kb, vb [B, bs, G, hd] (G heads, each shared by H / G query heads). Returns
    [B, bs, H, hd] in q's dtype.

    impl "xla": one softmax over the context and the block together (`kernels.draft_attention_ref`, the reference;
    XLA makes ~12 kernels of it a layer). "ffi": the same as one custom call (`kernels.draft_attention`; ffi_ops
    "draft_attention", a default). "cudnn": the two parts as cuDNN's flash attention each
    (`model.naive_attention_lse`), joined by their log-sum-exp (`split_block_attention`); fewer kernels, but slower
    at one device's share of the K2.5-DFlash drafter (H100, 2026-12-06), faster only replicated at batch 10."""
    if impl == "ffi" and current_mesh() is not None:  # per shard of heads (the caller checked `draft_heads_split`)
        return draft_head_parallel(partial(draft_attention, impl="ffi"), q, ck, cv, kb, vb, lengths, scale)
    if impl in ("xla", "ffi"):
        return draft_attention(q, ck, cv, kb, vb, lengths, scale, impl=impl)
    return split_block_attention(q, ck, cv, kb, vb, lengths, scale, impl).astype(q.dtype)


def split_block_attention(q, ck, cv, kb, vb, lengths, scale: float, impl: str) -> jax.Array:
    """`block_attention` as two attentions, over the context (keys < lengths[b]) and over the block, each with its
    log-sum-exp (`model.naive_attention_lse` on `impl`), joined exactly (`combine_lse`). Returns fp32."""
    ctx = naive_attention_lse(q, ck, cv, scale, causal=False, kv_len=lengths, impl=impl)
    own = naive_attention_lse(q, kb, vb, scale, causal=False, impl=impl)
    return combine_lse(ctx, own)[0]


def draft(drafter: Drafter, target: Params, cache: DraftCache, lengths: jax.Array, bonus: jax.Array,
          attention: str = "xla", dense: str = "xla") -> jax.Array:
    """Per-depth draft logits [B, block_size - 1, V] (f32) for the tokens after `bonus` [B].

    The block [bonus, MASK, ...] sits at positions lengths[b] .. lengths[b] + block_size - 1 and sees the
    context slots < lengths[b] of `cache` plus the whole block (bidirectional). attention: `block_attention`'s impl
    ("xla", "ffi" or "cudnn"). dense: "xla", the layers' dense weights as XLA's dots, or "ffi", as
    `kernels.fused_dot` calls where the block has at most its MAX_ROWS rows (`_fused_layer`; `Drafter.propose` asks
    for it where the target's config runs fused_dot; on a mesh per shard, `_fused_draft_on_mesh`, where
    `fused_splits` holds), the final norm and the lm_head one more.
    """
    p, d = drafter.params, drafter.cfg
    b, bs = bonus.shape[0], d.block_size
    block = jnp.concatenate([bonus[:, None], jnp.full((b, bs - 1), d.mask_token_id, jnp.int32)], axis=1)
    x = embed(target, block)  # [B, bs, D]
    positions = lengths[:, None] + jnp.arange(bs)[None, :]
    scale = 1.0 / math.sqrt(d.head_dim)

    if dense == "ffi" and b * bs <= FUSED_MAX_ROWS:
        if current_mesh() is not None:
            return _fused_draft_on_mesh(drafter, target, cache, lengths, x, attention)
        with jax.named_scope("drafter"):
            attend = partial(block_attention, lengths=lengths, scale=scale, impl=attention)
            return _fused_block(x, p.layers, p.norm, target.lm_head, cache, positions, d, attend)

    def layer(x, lp, ck, cv):
        h = rms_norm(x, lp.attn_norm, d.rms_norm_eps)
        q = _rope(rms_norm(jnp.einsum("btd,dhk->bthk", h, lp.q), lp.q_norm, d.rms_norm_eps), positions, d.rope_theta)
        kb, vb = _kv(lp, h, positions, d)  # [B, bs, Hkv, hd]
        o = block_attention(q, ck, cv, kb, vb, lengths, scale, attention)
        x = x + jnp.einsum("bthk,hkd->btd", o, lp.o)
        h = rms_norm(x, lp.mlp_norm, d.rms_norm_eps)
        return x + (jax.nn.silu(h @ lp.gate) * (h @ lp.up)) @ lp.down

    with jax.named_scope("drafter"):
        for i in range(d.num_layers):  # unrolled: each layer's weights read in place (a scan copied them per step)
            x = layer(x, jax.tree.map(lambda a: a[i], p.layers), cache.k[i], cache.v[i])  # each layer's own buffer
        x = rms_norm(x[:, 1:], p.norm, d.rms_norm_eps)  # positions 1 .. bs-1 predict depths 1 .. bs-1
        return jnp.einsum("btd,dv->btv", x, target.lm_head, preferred_element_type=jnp.float32)


def _fused_block(x, stack: DraftLayer, final_norm, lm_head, cache: DraftCache, positions, d: DrafterConfig, attend,
                 reduce=None):
    """`draft`'s block on the fused path: every layer as `_fused_layer` (unrolled, each reading the stacks at its
    index), then the final norm and the lm_head (the target's, or this device's vocabulary shard of it) as one more
    fused_dot call, f32 logits [B, block_size - 1, V] of positions 1 .. bs-1."""
    for i in range(d.num_layers):
        x = _fused_layer(x, jax.tree.map(lambda a: a[i], stack), stack, i, cache.k[i], cache.v[i], positions, d,
                         attend, reduce)
    return fused_dot(x[:, 1:], lm_head, norm=final_norm, eps=d.rms_norm_eps, out_dtype=jnp.float32)[0]


def _fused_layer(x, lp: DraftLayer, stack: DraftLayer, i: int, ck, cv, positions, d: DrafterConfig, attend,
                 reduce=None):
    """`draft`'s layer i with its dense weights as four `kernels.fused_dot` calls: the attention's RMSNorm + q (its
    normalized rows out for k and v, whose single head of 112 is not a multiple of the CUDA kernel's 64 columns: XLA
    keeps those two), o + the residual add, the MLP's RMSNorm + gate and up (two weights sharing the rows; the SwiGLU
    product in XLA, as the weights are not stored joined), down + the residual add. The same math, rounded in the
    same order, as the layer of `draft`. The calls take the stacked weights of every layer (`stack`) and the index
    i: a slice of the stack passed to a custom call would be copied out first (`xla_kernels.py --program draft
    --dense ffi`: 7 copies, 129 MB a layer at K2.5-DFlash's per-device shape, as much as the calls read); `lp` (the
    layer's slices) serves the weights XLA's own operations read, which fuse their slice. attend(q, ck, cv, kb, vb):
    the block attention. reduce: None, or (inside shard_map, heads and MLP width split) the sum of the shards' f32
    partial o and down products, added to the residual after it (where the unsplit call adds in its epilogue)."""
    b, bs, dm = x.shape
    eps, hq, hd = d.rms_norm_eps, lp.q.shape[1], lp.q.shape[2]
    n_layers = stack.q.shape[0]
    rows = x.reshape(b * bs, dm)
    q, _, h = fused_dot(rows, stack.q.reshape(n_layers, dm, hq * hd), norm=stack.attn_norm, eps=eps, want_xn=True,
                        layer=i)
    q = _rope(rms_norm(q.reshape(b, bs, hq, hd), lp.q_norm, eps), positions, d.rope_theta)
    kb, vb = _kv(lp, h.reshape(b, bs, dm), positions, d)
    o = attend(q, ck, cv, kb, vb)

    def out(h, w, rows):  # h . w + rows: in the call's epilogue, or summed over the shards first
        if reduce is None:
            return fused_dot(h, w, adds=(rows,), layer=i)[0]
        return rows + reduce(fused_dot(h, w, out_dtype=jnp.float32, layer=i)[0]).astype(rows.dtype)

    rows = out(o.reshape(b * bs, hq * hd), stack.o.reshape(n_layers, hq * hd, dm), rows)
    gate, up, _ = fused_dot(rows, stack.gate, w2=stack.up, norm=stack.mlp_norm, eps=eps, layer=i)
    rows = out(jax.nn.silu(gate) * up, stack.down, rows)
    return rows.reshape(b, bs, dm)


def fused_splits(d: DrafterConfig, vocab: int) -> bool:
    """Whether `draft` can run the fused layers (dense "ffi") on the current mesh: none, or one over whose model
    axes the query heads, the MLP width and the target's vocabulary split evenly and the key/value heads too or a
    single one (replicated); then `_fused_draft_on_mesh` runs them per shard."""
    mesh = current_mesh()
    n = 1 if mesh is None else mesh.shape["ep"] * mesh.shape["tp"]
    return (mesh is None or (d.num_heads % n == 0 and d.intermediate_size % n == 0 and vocab % n == 0
                             and draft_heads_split(d.num_heads, d.num_kv_heads)))


def _fused_draft_on_mesh(drafter: Drafter, target: Params, cache: DraftCache, lengths, x, attention: str):
    """`draft`'s fused path (`fused_splits` holds) in one shard_map over the model axes: each device runs the
    layers of its query heads and MLP width (the key/value heads with them, or the one replicated) as the same
    fused_dot calls, the shards' o and down products summed by a psum each (two all-reduces a layer, as XLA's own
    partitioning of the dots), then its vocabulary shard's logits. The per-device program is the unsharded one on
    1/n of the weights: what `benchmarks/ddtree_full_scale.py` times on one GPU, plus the all-reduces."""
    p, d = drafter.params, drafter.cfg
    mesh, b, bs = current_mesh(), x.shape[0], x.shape[1]
    bt = batch_axis(b)
    spec = lambda a, axes: fitting_sharding(mesh, a.shape, logical_to_spec(axes)).spec
    placed = drafter_shardings(d, mesh)  # where the weights are (made or put there)
    layer_specs = jax.tree.map(lambda where: where.spec, placed.layers)
    cache_specs = jax.tree.map(lambda a: spec(a, ("batch", None, "kv_heads", None)), cache)
    impl = attention if attention in ("xla", "ffi") else "xla"  # (per shard, no nested shard_map)
    scale = 1.0 / math.sqrt(d.head_dim)

    def local(x, stack, final_norm, lm_head, cache, lengths):
        positions = lengths[:, None] + jnp.arange(bs)[None, :]
        attend = lambda q, ck, cv, kb, vb: draft_attention(q, ck, cv, kb, vb, lengths, scale, impl=impl)
        return _fused_block(x, stack, final_norm, lm_head, cache, positions, d, attend,
                            reduce=lambda part: jax.lax.psum(part, MODEL_AXES))

    args = (x, p.layers, p.norm, target.lm_head, cache, lengths)
    in_specs = (P(bt, None, None), layer_specs, placed.norm.spec, spec(target.lm_head, ("embed", "vocab")),
                cache_specs, P(bt))
    return model_parallel(local, args, in_specs, P(bt, None, MODEL_AXES))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    """A research stand-in for a drafter: at each depth it proposes the target's OWN distribution along the
    target's greedy continuation (computed by running the target itself), its logits multiplied by `sharpness`
    and blurred by Gaussian noise of std `noise`. Sharp and noiseless, it is a perfect greedy drafter: greedy
    decoding then accepts the whole block every step (an upper bound for tau, and a check that accepted tokens
    are really used rather than recomputed)."""

    block_size: int = dataclasses.field(default=8, metadata=dict(static=True))
    sharpness: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    noise: float = dataclasses.field(default=0.0, metadata=dict(static=True))

    @property
    def depth(self) -> int:
        return self.block_size - 1

    def check(self, cfg: ModelConfig) -> None:
        """Any target: the oracle is the target itself."""

    def start(self, batch: int, max_len: int) -> None:
        """No state: the oracle reads the target's own cache."""
        return None

    def add_context(self, state: None, hidden: jax.Array, starts: jax.Array) -> None:
        return state

    def propose(self, target: Params, cfg: ModelConfig, state: None, cache: KVCache, bonus: jax.Array,
                key: jax.Array) -> jax.Array:
        """The target's own logits [B, L, V] along its greedy continuation of the bonus, times `sharpness`, plus
        Gaussian noise of std `noise` (drawn from fold_in(key, 1))."""

        def one(carry, _):
            c, tok = carry
            res = step(target, cfg, tok[:, None], c)
            logits = res.logits[:, 0]
            c = dataclasses.replace(res.cache, lengths=res.cache.lengths + 1)
            return (c, jnp.argmax(logits, axis=-1).astype(jnp.int32)), logits

        _, logits = jax.lax.scan(one, (cache, bonus), None, length=self.depth)
        logits = jnp.moveaxis(logits, 0, 1) * self.sharpness  # [B, L, V]
        if self.noise:
            logits = logits + self.noise * jax.random.normal(jax.random.fold_in(key, 1), logits.shape)
        return logits
