"""Model configuration: one frozen, static dataclass, and the mapping from a Hugging Face config.json.

`ModelConfig` is hashable and registered as a static pytree node, so it passes straight through `jax.jit`.
Edit it with `dataclasses.replace`. `ModelConfig.from_hf` reads DeepSeek-V3 / Kimi-K2 `config.json` files
and the K2.5 / K2.6 multimodal wrapper that holds the language model under `text_config`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax

from .validate import shown

DTYPES = ("float32", "bfloat16")
EXPERT_FORMATS = ("bf16", "int4")
KERNELS = ("xla", "ffi", "dense")
FFI_OPS = ("tree_build", "tree_accept", "mla_verify", "marlin_moe", "moe_route", "move_rows", "mla_pre", "fused_dot",
           "draft_attention")
# The custom calls kernels="ffi" runs unless ffi_ops names others. move_rows (the accepted
# rows of every layer's caches moved in one launch) is on: its GPU tests pass and, on an H100 (2026-12-06), XLA's move
# took 118-170 µs a step at 61 layers where the custom call's was below the wall-clock method's resolution. mla_pre
# (the projections between qkv_a and the attention in one launch, 7 kernels a layer fewer) is on: its GPU tests pass
# and on an H100 (2026-12-06, 40 layers, three A/Bs) the step at 1 x 1 was 2-5% faster, at 1 x 17 within +-1.5%.
# fused_dot (a decode step's dense weights with their norms, SwiGLU and residual adds: 4 launches for ~14) is
# opt-in: on an H100 (2026-12-06) the 40-layer step at 1 x 1 was 1.02x at best, and with it greedy ddtree left ar on
# the GPU once (docs/full_scale.md). Two custom calls measured slower than XLA's operations were removed (2026-12-07):
# small_dot (the dense matmuls of a decode or verify step) and l2_prefetch (a layer's next weights asked into L2).
# draft_attention (the drafter's block attention in two launches for ~12 kernels a layer) is on: on an H100
# (2026-12-07) its tensor-core kernel took one device's share of the K2.5-DFlash drafter from 0.86 to 0.74 ms a draft
# at batch 1 and from 1.36 to 1.14 at batch 10, and memcheck found nothing in either kernel.
DEFAULT_FFI_OPS = ("tree_build", "tree_accept", "mla_verify", "marlin_moe", "moe_route", "move_rows", "mla_pre",
                   "draft_attention")
CACHE_SHARDINGS = ("replicated", "sequence")


class ConfigError(ValueError):
    """A config.json key is missing, unsupported or contradicts another one."""


# How a config.json value of each field type must look (the field's annotation, first word: "int | None" -> int).
_JSON_TYPES = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
               "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
               "bool": lambda v: isinstance(v, bool),
               "str": lambda v: isinstance(v, str),
               "tuple": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)}


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that fixes the shapes and the math of a DeepSeek-V3-architecture model (Kimi K2.x).

    Field names follow the Hugging Face config where one exists. `dtype` is the storage and matmul dtype of
    the weights and activations ("float32" or "bfloat16"); attention softmax, router and norms run in fp32.
    `expert_format` says how routed experts are held: "bf16" (dense arrays in `dtype`) or "int4"
    (compressed-tensors symmetric group-32 values, see `kdtree_jax.quant`). `kernels` selects the custom
    calls ("ffi") or their pure-JAX references ("xla"); "dense" is "xla" with every routed expert evaluated on
    every token (the same function, plain dense matmuls: for training small models).
    """

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432  # dense SwiGLU (layers below first_k_dense_replace)
    moe_intermediate_size: int = 2048  # per routed expert; the shared expert uses this x n_shared_experts
    num_hidden_layers: int = 61
    num_attention_heads: int = 64
    q_lora_rank: int | None = 1536  # None: queries come from one q_proj without the low-rank path
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.827
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50000.0
    # YaRN (rope_type "yarn"); rope_type "default" ignores the rest.
    rope_type: str = "yarn"
    rope_factor: float = 32.0
    rope_beta_fast: float = 1.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    rope_original_max_position_embeddings: int = 4096
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163585
    # Project settings (not in config.json).
    dtype: str = "bfloat16"
    expert_format: str = "int4"
    kernels: str = "xla"
    ffi_ops: tuple[str, ...] = DEFAULT_FFI_OPS  # with kernels="ffi": which custom calls to use (the rest: pure JAX)
    group_size: int = 32  # INT4 quantization group along the input dimension
    # Under a mesh that splits the model: "replicated" (every device holds every row's whole latent cache; heads
    # split) or "sequence" (each device holds 1/N of every row's slots; attention partial per device, combined)
    cache_sharding: str = "replicated"

    def __post_init__(self):
        self.validate()

    # ----------------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.num_dense_layers

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the latent plus the shared rope key (512 + 64 for K2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def impl(self, op: str) -> str:
        """The implementation of kernel `op` (one of FFI_OPS) that this model runs, the `impl=` argument of the
        op's function in `kdtree_jax.kernels`: "ffi" (the custom call: kernels="ffi" and op in ffi_ops), "dense"
        (marlin_moe with kernels="dense": every expert on every token, for training) or "xla" (the pure-JAX
        reference). The model, the speculative step and the benchmarks all pick kernels here."""
        if op not in FFI_OPS:
            raise ValueError(f"unknown kernel {op!r} (known: {FFI_OPS})")
        if self.kernels == "ffi" and op in self.ffi_ops:
            return "ffi"
        return "dense" if self.kernels == "dense" and op == "marlin_moe" else "xla"

    def validate(self) -> None:
        """Raise ConfigError naming the field when the config cannot describe a model we run."""
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ConfigError(f"expert_format must be one of {EXPERT_FORMATS}, got {self.expert_format!r}")
        if self.kernels not in KERNELS:
            raise ConfigError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.cache_sharding not in CACHE_SHARDINGS:
            raise ConfigError(f"cache_sharding must be one of {CACHE_SHARDINGS}, got {self.cache_sharding!r}")
        unknown = set(self.ffi_ops) - set(FFI_OPS)
        if unknown:
            raise ConfigError(f"ffi_ops has unknown custom calls {sorted(unknown)} (known: {FFI_OPS})")
        if self.rope_type not in ("yarn", "default"):
            raise ConfigError(f"rope_scaling type {self.rope_type!r} is not supported (yarn or default)")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even (rope rotates pairs), got {self.qk_rope_head_dim}")
        # numbers the model divides by, takes logs or powers of: finite and > 0 (the mscales finite and >= 0)
        for name in ("rope_theta", "rms_norm_eps", "routed_scaling_factor", "rope_factor", "rope_beta_fast",
                     "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim"):
            value, low = getattr(self, name), ">= 0" if "mscale" in name else "> 0"
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or (
                    value < 0 if "mscale" in name else value <= 0):
                raise ConfigError(f"{name} must be a finite number {low}, got {value!r}")
        if self.num_moe_layers:
            if self.n_routed_experts < 1 or not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise ConfigError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..n_routed_experts "
                    f"({self.n_routed_experts})")
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                raise ConfigError(
                    f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
            per_group = self.n_routed_experts // self.n_group
            if self.n_group > 1 and per_group < 2:
                raise ConfigError(f"n_group {self.n_group} leaves fewer than 2 experts per group")
            if self.num_experts_per_tok > per_group * self.topk_group:
                raise ConfigError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in the kept groups "
                    f"(topk_group {self.topk_group} x {per_group})")
        if self.expert_format == "int4":
            for name in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, name) % self.group_size:
                    raise ConfigError(
                        f"expert_format='int4' needs {name} ({getattr(self, name)}) divisible by the group size "
                        f"{self.group_size}")

    # ----------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict, **overrides: Any) -> "ModelConfig":
        """Build a config from a Hugging Face `config.json` (a path, a directory holding it, or a dict).

        Reads DeepSeek-V3 and Kimi-K2 configs, and the K2.5/K2.6 wrapper (`text_config`). Both spellings of
        the rope settings are read (`rope_scaling` from transformers 4.x, `rope_parameters` from 5.x).
        `overrides` replace fields afterwards (for example `dtype="float32"`).
        """
        if isinstance(path_or_dict, dict):
            raw = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.exists(path):
                raise ConfigError(f"no config.json at {path}")
            with open(path) as f:
                raw = json.load(f)
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        check_hf_config(raw)
        if "text_config" in raw:
            raw = dict(raw["text_config"])
        return cls(**{**_fields_from_hf(raw), **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(d) - set(fields)
        if unknown:
            raise ConfigError(f"unknown config fields: {sorted(unknown)}")
        for key, value in d.items():  # the JSON's types, checked by name (not a comparison failing deep inside)
            kind = str(fields[key].type)
            if value is None and "None" in kind:
                continue
            ok = _JSON_TYPES.get(kind.split(" ")[0].split("[")[0], lambda v: True)
            if not ok(value):
                raise ConfigError(f"config field {key!r} must be {kind}, got {value!r}")
        return cls(**{**d, **({"ffi_ops": tuple(d["ffi_ops"])} if "ffi_ops" in d else {})})


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


# ----------------------------------------------------------------------------------------------------------------
# config.json: the JSON types of what ModelConfig.from_hf reads
# ----------------------------------------------------------------------------------------------------------------

# The keys ModelConfig.from_hf copies into the ModelConfig fields of the same name; the first eight are required.
HF_CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
                    "q_lora_rank", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
                    "topk_group", "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor", "rms_norm_eps",
                    "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_theta")
HF_REQUIRED = HF_CONFIG_FIELDS[:8]
# Other keys it reads: their kinds. The rope settings' keys are read from rope_scaling or rope_parameters.
HF_OTHER_KEYS = {"num_key_value_heads": "int", "num_nextn_predict_layers": "int"}
HF_ROPE_KEYS = {"rope_theta": "float", "factor": "float", "beta_fast": "float", "beta_slow": "float",
                "mscale": "float", "mscale_all_dim": "float", "original_max_position_embeddings": "int",
                "rope_type": "str", "type": "str"}


def check_hf_config(raw: dict[str, Any]) -> None:
    """Raise ConfigError naming the field when a value of a Hugging Face config.json that `ModelConfig.from_hf`
    reads (first thing it does) has the wrong JSON type: a string where a number belongs (`"vocab_size": "264"`), a
    list where an object does (`"rope_parameters": [1]`). Without it the mapping fails deep inside ("'<' not
    supported between instances of 'str' and 'int'") or takes some silently (`int("3")`). The message has the form
    of ModelConfig.from_dict's: `config field 'vocab_size' must be int, got '264'`. A missing required key is left to
    the mapping, which names it; null is refused for a required key and passes for the others, as it reads them."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(ModelConfig)}
    top, prefix = raw, ""
    if "text_config" in raw:  # the K2.5 / K2.6 wrapper
        if not isinstance(raw["text_config"], dict):
            raise ConfigError(f"config field 'text_config' must be an object, got {shown(raw['text_config'])}")
        raw, prefix = raw["text_config"], "text_config."

    def refuse(key: str, what: str, value) -> None:
        raise ConfigError(f"config field {prefix + key!r} must be {what}, got {shown(value)}")

    for key in HF_CONFIG_FIELDS:
        if key not in raw or (raw[key] is None and key not in HF_REQUIRED):
            continue
        value, kind = raw[key], kinds[key]
        if key in ("bos_token_id", "eos_token_id") and isinstance(value, list):  # from_hf takes the first
            if not value or not all(_JSON_TYPES["int"](v) for v in value):
                refuse(key, "int, or a list of ints", value)
        elif not _JSON_TYPES[kind.split(" ")[0]](value) and not (value is None and "None" in kind):
            refuse(key, kind, value)
    for key, kind in HF_OTHER_KEYS.items():
        if raw.get(key) is not None and not _JSON_TYPES[kind](raw[key]):
            refuse(key, kind, raw[key])
    for rope_key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(rope_key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            refuse(rope_key, "an object", rope)
        for key, kind in HF_ROPE_KEYS.items():
            if rope.get(key) is not None and not _JSON_TYPES[kind](rope[key]):
                refuse(f"{rope_key}.{key}", kind, rope[key])
    quantization = {prefix + "quantization_config": raw.get("quantization_config"),
                    "quantization_config": top.get("quantization_config")}  # the wrapper's is at the top
    for key, q in quantization.items():
        if q is not None and not isinstance(q, dict):
            raise ConfigError(f"config field {key!r} must be an object, got {shown(q)}")


def _fields_from_hf(raw: dict) -> dict:
    """Map a (text) config.json dict onto ModelConfig fields, with errors that name the key."""
    for key in _REQUIRED:
        if key not in raw:
            raise ConfigError(f"config.json is missing required key {key!r}")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads", raw["num_attention_heads"])
    if kv_heads != heads:
        raise ConfigError(f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) for MLA")
    if raw.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq {raw['moe_layer_freq']} is not supported (only 1)")
    if raw.get("attention_bias", False):
        raise ConfigError("attention_bias=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (silu)")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"scoring_func {raw['scoring_func']!r} is not supported (sigmoid)")
    if raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"topk_method {raw['topk_method']!r} is not supported (noaux_tc)")

    out: dict[str, Any] = {k: raw[k] for k in _REQUIRED}
    for key in ("intermediate_size", "moe_intermediate_size", "q_lora_rank", "n_routed_experts", "n_shared_experts",
                "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob",
                "routed_scaling_factor", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        if key in raw:
            out[key] = raw[key]
    if out.get("n_routed_experts") is None:  # a dense DeepSeek-style model: every layer is dense
        out["n_routed_experts"] = 0
        out["first_k_dense_replace"] = raw["num_hidden_layers"]
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(out.get(key), list):
            out[key] = out[key][0]

    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if raw.get("rope_scaling") and raw.get("rope_parameters") and raw["rope_scaling"] != raw["rope_parameters"]:
        raise ConfigError("rope_scaling and rope_parameters are both present and differ")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    if "rope_theta" in rope and "rope_theta" in raw and not math.isclose(rope["rope_theta"], raw["rope_theta"]):
        raise ConfigError(f"rope_theta {raw['rope_theta']} contradicts rope_parameters.rope_theta {rope['rope_theta']}")
    out["rope_theta"] = float(theta)
    rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    out["rope_type"] = rope_type
    if rope_type == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if key not in rope:
                raise ConfigError(f"rope_scaling (yarn) is missing key {key!r}")
        out.update(rope_factor=float(rope["factor"]),
                   rope_beta_fast=float(rope.get("beta_fast", 32.0)),
                   rope_beta_slow=float(rope.get("beta_slow", 1.0)),
                   rope_mscale=float(rope.get("mscale", 1.0)),
                   rope_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
                   rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise ConfigError(f"rope_scaling type {rope_type!r} is not supported (yarn or default)")
    return out


def user_cache_dir(name: str) -> str:
    """kdtree-jax/<name> in the user cache directory ($XDG_CACHE_HOME, else ~/.cache): where compiled programs and
    measured cost models are kept across runs."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kdtree-jax", name)
