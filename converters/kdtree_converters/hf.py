"""Hugging Face tensor names -> this project's weight pytree, one layer at a time.

The functions take `get(name) -> np.ndarray` and `has(name) -> bool` over the checkpoint's tensor names
(without any `language_model.` prefix; FP8 already dequantized by the caller). Linear weights are stored
[out, in] by Hugging Face and computed as x @ W.T; here they are [in, out] (or split per head), except the
routed experts, which keep [out, in] so that INT4 values are repacked bit-exactly, never requantized.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kdtree_jax.checkpoint import CheckpointError
from kdtree_jax.config import ConfigError, ModelConfig
from kdtree_jax.drafter import DrafterConfig, DraftLayer, DrafterParams
from kdtree_jax.model import MLP, Attention, Layer, MoE, Params
from kdtree_jax.quant import Int4Array, quantize_int4
from kdtree_jax.validate import is_integer, is_real, shown

Getter = Callable[[str], np.ndarray]


def _np_dtype(cfg: ModelConfig):
    return np.float32 if cfg.dtype == "float32" else ml_dtypes.bfloat16


def checked(get: Getter, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """get(name), with a CheckpointError naming the tensor when it is missing or has another shape."""
    try:
        a = get(name)
    except KeyError:
        raise CheckpointError(f"missing tensor {name!r}") from None
    if tuple(a.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def _transposed(a: np.ndarray, tile: int = 256) -> np.ndarray:
    """a.T [n, m] of a [m, n] as a new C-contiguous array, copied tile by tile as unsigned integers of the same width
    (bit-exact; numpy's element-by-element copy of a large transpose misses the cache and is ~6x slower)."""
    src = a.view(f"u{a.dtype.itemsize}")
    out = np.empty(a.shape[::-1], src.dtype)
    for i in range(0, a.shape[0], tile):
        for j in range(0, a.shape[1], tile):
            out[j:j + tile, i:i + tile] = src[i:i + tile, j:j + tile].T
    return out.view(a.dtype)


def _linear(get: Getter, name: str, n_out: int, n_in: int, dt) -> np.ndarray:
    """HF Linear weight [out, in] -> [in, out] in dtype dt (transposed in the source dtype: no fp32 copies)."""
    return _transposed(checked(get, name, (n_out, n_in))).astype(dt, copy=False)


def _vec(get: Getter, name: str, n: int, dt) -> np.ndarray:
    return checked(get, name, (n,)).astype(dt)


def _mlp(get: Getter, prefix: str, d: int, f: int, dt) -> MLP:
    gate, up = (_linear(get, f"{prefix}.{name}_proj.weight", f, d, dt) for name in ("gate", "up"))
    return MLP(gate_up=np.stack([gate, up], axis=1), down=_linear(get, f"{prefix}.down_proj.weight", d, f, dt))


def _attention(get: Getter, prefix: str, cfg: ModelConfig, dt) -> Attention:
    d, h, rq, r = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    kv_a = _linear(get, f"{prefix}.kv_a_proj_with_mqa.weight", r + dr, d, dt)
    if rq is None:
        qkv_a, q_a_norm = kv_a, None
        q_b = checked(get, f"{prefix}.q_proj.weight", (h * (dn + dr), d)).astype(dt, copy=False).reshape(h, dn + dr, d)
    else:
        qkv_a = np.concatenate([_linear(get, f"{prefix}.q_a_proj.weight", rq, d, dt), kv_a], axis=1)
        q_a_norm = _vec(get, f"{prefix}.q_a_layernorm.weight", rq, dt)
        q_b = checked(get, f"{prefix}.q_b_proj.weight", (h * (dn + dr), rq)).astype(dt, copy=False)
        q_b = q_b.reshape(h, dn + dr, rq)
    kv_b = checked(get, f"{prefix}.kv_b_proj.weight", (h * (dn + dv), r)).astype(np.float32).reshape(h, dn + dv, r)
    o = _linear(get, f"{prefix}.o_proj.weight", d, h * dv, dt).reshape(h, dv, d)
    return Attention(qkv_a=qkv_a, q_a_norm=q_a_norm, q_b=q_b,
                     kv_a_norm=_vec(get, f"{prefix}.kv_a_layernorm.weight", r, dt),
                     k_b=np.ascontiguousarray(kv_b[:, :dn, :].transpose(2, 0, 1)).astype(dt),
                     v_b=np.ascontiguousarray(kv_b[:, dn:, :]).astype(dt), o=o)  # q_b and v_b as HF stores them


def expert_weight(get: Getter, has: Callable[[str], bool], name: str, n_out: int, n_in: int, cfg: ModelConfig):
    """One routed expert's projection `name` (without suffix) in the model's expert format, [out, in].

    INT4 sources (`weight_packed` int32 [out, in/8], `weight_scale` [out, in/32]) are kept bit-exactly when the
    target format is int4 and dequantized for bf16; float sources are quantized for int4.
    """
    g = cfg.group_size
    if has(f"{name}.weight_packed"):
        packed = checked(get, f"{name}.weight_packed", (n_out, n_in // 8))
        scale = checked(get, f"{name}.weight_scale", (n_out, n_in // g))
        if has(f"{name}.weight_shape"):
            ws = tuple(int(v) for v in np.asarray(get(f"{name}.weight_shape")).reshape(-1))
            if ws != (n_out, n_in):
                raise CheckpointError(f"tensor {name}.weight_shape says {ws}, expected {(n_out, n_in)}")
        q = Int4Array(packed=np.ascontiguousarray(packed.view(np.int32)), scale=scale.astype(ml_dtypes.bfloat16))
        if cfg.expert_format == "int4":
            return q
        return np.asarray(q.dequantize(jnp.float32)).astype(_np_dtype(cfg))
    w = checked(get, f"{name}.weight", (n_out, n_in))
    if cfg.expert_format == "int4":
        q = quantize_int4(jnp.asarray(w.astype(np.float32)), g)
        return Int4Array(packed=np.asarray(q.packed), scale=np.asarray(q.scale))
    return w.astype(_np_dtype(cfg))


def _stack_experts(items, n: int):
    """Stack n per-expert weights as they are produced: one expert in flight, never a list of all of them."""
    out = None
    for j, x in enumerate(items):
        if out is None:
            out = jax.tree.map(lambda a: np.empty((n, *a.shape), a.dtype), x)
        for o, a in zip(jax.tree.leaves(out), jax.tree.leaves(x)):
            o[j] = a
    return out


def _moe(get: Getter, has, prefix: str, cfg: ModelConfig, dt) -> MoE:
    d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    experts = {proj: _stack_experts((expert_weight(get, has, f"{prefix}.experts.{j}.{proj}_proj", *shape, cfg)
                                     for j in range(e)), e)
               for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f)))}
    return MoE(router=_linear(get, f"{prefix}.gate.weight", e, d, dt),
               router_bias=_vec(get, f"{prefix}.gate.e_score_correction_bias", e, np.float32),  # noaux_tc's
               we_gate=experts["gate"], we_up=experts["up"], we_down=experts["down"],
               shared=_mlp(get, f"{prefix}.shared_experts", d, f * cfg.n_shared_experts, dt))


def layer_from_hf(get: Getter, has: Callable[[str], bool], cfg: ModelConfig, i: int) -> Layer:
    """Decoder layer i as numpy arrays (unstacked)."""
    dt, d, p = _np_dtype(cfg), cfg.hidden_size, f"model.layers.{i}"
    mlp = (_mlp(get, f"{p}.mlp", d, cfg.intermediate_size, dt) if i < cfg.num_dense_layers
           else _moe(get, has, f"{p}.mlp", cfg, dt))
    return Layer(attn_norm=_vec(get, f"{p}.input_layernorm.weight", d, dt),
                 attn=_attention(get, f"{p}.self_attn", cfg, dt),
                 mlp_norm=_vec(get, f"{p}.post_attention_layernorm.weight", d, dt), mlp=mlp)


def top_from_hf(get: Getter, has: Callable[[str], bool], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The embedding, final norm and lm_head (the embedding when the head is tied)."""
    dt, d, v = _np_dtype(cfg), cfg.hidden_size, cfg.vocab_size
    embed = checked(get, "model.embed_tokens.weight", (v, d)).astype(dt)
    if cfg.tie_word_embeddings and not has("lm_head.weight"):
        head = np.ascontiguousarray(embed.T)
    else:
        head = _linear(get, "lm_head.weight", v, d, dt)
    return {"embed": embed, "final_norm": _vec(get, "model.norm.weight", d, dt), "lm_head": head}


def params_from_hf(get: Getter, has: Callable[[str], bool], cfg: ModelConfig) -> Params:
    """The whole model in memory (small models and tests; `kdtree-convert` streams large ones)."""
    layers = tuple(jax.tree.map(jnp.asarray, layer_from_hf(get, has, cfg, i)) for i in range(cfg.num_hidden_layers))
    top = {k: jnp.asarray(v) for k, v in top_from_hf(get, has, cfg).items()}
    return Params(layers=layers, **top)


# ----------------------------------------------------------------------------------------------------------------
# DFlash drafters (z-lab/dflash checkpoints: a Qwen3-style config with `dflash_config`, tensors `fc`, `hidden_norm`,
# `norm` and `layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
# post_attention_layernorm, mlp.{gate,up,down}_proj}`, optionally under `model.`)
# ----------------------------------------------------------------------------------------------------------------

_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


# The keys drafter_config_from_hf reads and their JSON kinds; the _DFLASH_KEYS sit in dflash_config or at the top.
_DRAFTER_KEYS = {"hidden_size": "int", "num_hidden_layers": "int", "num_attention_heads": "int",
                 "intermediate_size": "int", "num_key_value_heads": "int", "head_dim": "int", "vocab_size": "int",
                 "num_target_layers": "int", "rms_norm_eps": "float", "rope_theta": "float"}
_DFLASH_KEYS = {"block_size": "int", "mask_token_id": "int", "target_layer_ids": "a list of ints"}


def _check_drafter_types(raw: dict) -> None:
    """Raise ConfigError naming the key when a value drafter_config_from_hf reads has the wrong JSON type (a string
    where a number belongs, a number where a list does); null passes for the optional keys, as they are read."""
    def refuse(key: str, kind: str, value) -> None:
        raise ConfigError(f"drafter config field {key!r} must be {kind}, got {shown(value)}")

    ok = {"int": is_integer, "float": is_real,
          "a list of ints": lambda v: isinstance(v, list) and all(is_integer(x) for x in v)}
    for name, value in (("dflash_config", raw.get("dflash_config")), ("rope_parameters", raw.get("rope_parameters")),
                        ("rope_scaling", raw.get("rope_scaling"))):
        if value is not None and not isinstance(value, dict):
            refuse(name, "an object", value)
    dflash = raw.get("dflash_config") or {}
    top = {**_DRAFTER_KEYS, **_DFLASH_KEYS}
    for where, table, prefix in ((raw, top, ""), (dflash, _DFLASH_KEYS, "dflash_config.")):
        for key, kind in table.items():
            if where.get(key) is not None and not ok[kind](where[key]):
                refuse(prefix + key, kind, where[key])
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_theta") is not None and not is_real(rope["rope_theta"]):
        refuse("rope_parameters.rope_theta", "float", rope["rope_theta"])


def drafter_config_from_hf(raw: dict, target: ModelConfig):
    """The DrafterConfig of a DFlash config.json, checked against the target it drafts for."""
    _check_drafter_types(raw)
    dflash = raw.get("dflash_config") or {}
    if any(k in dflash for k in _DFLASH2_KEYS):
        raise ConfigError("this is a DFlash2 drafter (convolutions / candidate selector): only DFlash is supported")
    pick = lambda key: dflash.get(key, raw.get(key))
    for key in ("block_size", "mask_token_id", "target_layer_ids"):
        if pick(key) is None:
            raise ConfigError(f"drafter config.json is missing {key!r} (in dflash_config or at the top level)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in raw:
            raise ConfigError(f"drafter config.json is missing required key {key!r}")
    if raw["hidden_size"] != target.hidden_size:
        raise ConfigError(f"drafter hidden_size {raw['hidden_size']} != the target's {target.hidden_size}")
    if raw.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ConfigError(f"drafter vocab_size {raw['vocab_size']} != the target's {target.vocab_size}")
    n_target = raw.get("num_target_layers", target.num_hidden_layers)
    if n_target != target.num_hidden_layers:
        raise ConfigError(f"the drafter was trained for a target of {n_target} layers, this one has "
                          f"{target.num_hidden_layers}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"drafter rope type {rope.get('rope_type')!r} is not supported (default)")
    heads = raw["num_attention_heads"]
    return DrafterConfig(num_layers=raw["num_hidden_layers"], block_size=pick("block_size"),
                         hidden_size=raw["hidden_size"], num_heads=heads,
                         num_kv_heads=raw.get("num_key_value_heads", heads),
                         head_dim=raw.get("head_dim") or (raw["hidden_size"] // heads if heads > 0 else 0),
                         intermediate_size=raw["intermediate_size"],
                         target_layer_ids=tuple(pick("target_layer_ids")),
                         mask_token_id=pick("mask_token_id"), vocab_size=target.vocab_size,
                         target_num_layers=target.num_hidden_layers, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                         rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1e6))), dtype=target.dtype)


def drafter_tensor_shapes(d, pre: str) -> dict[str, tuple[int, ...]]:
    """The HF name and shape of every tensor drafter_from_hf reads for DrafterConfig d (names under prefix pre)."""
    h, hq, hk, hd, f = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size
    out = {f"{pre}fc.weight": (h, len(d.target_layer_ids) * h), f"{pre}hidden_norm.weight": (h,),
           f"{pre}norm.weight": (h,)}
    for i in range(d.num_layers):
        p = f"{pre}layers.{i}"
        out.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                    f"{p}.self_attn.q_proj.weight": (hq * hd, h), f"{p}.self_attn.k_proj.weight": (hk * hd, h),
                    f"{p}.self_attn.v_proj.weight": (hk * hd, h), f"{p}.self_attn.o_proj.weight": (h, hq * hd),
                    f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,),
                    f"{p}.mlp.gate_proj.weight": (f, h), f"{p}.mlp.up_proj.weight": (f, h),
                    f"{p}.mlp.down_proj.weight": (h, f)})
    return out


def drafter_from_hf(get: Getter, has: Callable[[str], bool], d):
    """DFlash drafter weights (DrafterParams of numpy arrays, layers stacked) in the dtype of DrafterConfig d."""
    dt = np.float32 if d.dtype == "float32" else ml_dtypes.bfloat16
    pre = "model." if has("model.fc.weight") else ""
    h, hq, hk, hd, f = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size
    n_ctx = len(d.target_layer_ids)

    def layer(i: int) -> DraftLayer:
        p = f"{pre}layers.{i}"
        return DraftLayer(attn_norm=_vec(get, f"{p}.input_layernorm.weight", h, dt),
                          q=_linear(get, f"{p}.self_attn.q_proj.weight", hq * hd, h, dt).reshape(h, hq, hd),
                          k=_linear(get, f"{p}.self_attn.k_proj.weight", hk * hd, h, dt).reshape(h, hk, hd),
                          v=_linear(get, f"{p}.self_attn.v_proj.weight", hk * hd, h, dt).reshape(h, hk, hd),
                          q_norm=_vec(get, f"{p}.self_attn.q_norm.weight", hd, dt),
                          k_norm=_vec(get, f"{p}.self_attn.k_norm.weight", hd, dt),
                          o=_linear(get, f"{p}.self_attn.o_proj.weight", h, hq * hd, dt).reshape(hq, hd, h),
                          mlp_norm=_vec(get, f"{p}.post_attention_layernorm.weight", h, dt),
                          gate=_linear(get, f"{p}.mlp.gate_proj.weight", f, h, dt),
                          up=_linear(get, f"{p}.mlp.up_proj.weight", f, h, dt),
                          down=_linear(get, f"{p}.mlp.down_proj.weight", h, f, dt))

    layers = [layer(i) for i in range(d.num_layers)]
    return DrafterParams(fc=_linear(get, f"{pre}fc.weight", h, n_ctx * h, dt),
                         hidden_norm=_vec(get, f"{pre}hidden_norm.weight", h, dt),
                         layers=jax.tree.map(lambda *xs: np.stack(xs), *layers),
                         norm=_vec(get, f"{pre}norm.weight", h, dt))
