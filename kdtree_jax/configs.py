"""Presets: the full Kimi K2.6 model and a tiny model of the same architecture for tests and demos.

Both return frozen `ModelConfig`s; edit them with `dataclasses.replace`.
"""

from __future__ import annotations

from .config import ModelConfig


def k2_6(**overrides) -> ModelConfig:
    """Kimi K2.6, the language model of the `kimi_k25` multimodal wrapper (its `text_config`).

    Sources (see docs/model.md §1 and §7):
    - dimensions, router and YaRN fields: the verbatim Kimi-K2-Instruct config.json vendored in
      jax-ml/jax-llm-examples `kimi_k2/kimi_k2_jax/third_party/k2_config.json` (hidden 7168, 61 layers, 64 heads,
      384 routed + 1 shared experts, top-8, q/kv LoRA 1536/512, head dims 128/64/128, theta 50000,
      routed_scaling_factor 2.827, first_k_dense_replace 1, vocab 163840);
    - K2.5/K2.6 differences, from secondary sources only (TensorRT-LLM auto_deploy `KimiK25Config` and
      third-party tests): max_position_embeddings 262144, YaRN factor 64, rms_norm_eps 1e-5. Check against the
      real config.json: `ModelConfig.from_hf(path)` reads it exactly.
    - routed experts are compressed-tensors INT4, symmetric, group 32 (everything else bf16).
    """
    cfg = dict(rms_norm_eps=1e-5, rope_factor=64.0, max_position_embeddings=262144, dtype="bfloat16",
               expert_format="int4")
    return ModelConfig(**{**cfg, **overrides})


# Byte-level vocabulary of the tiny and random models: 256 bytes, then the special tokens.
BYTE_VOCAB = 256
TINY_BOS, TINY_EOS, TINY_PAD, TINY_MASK = 256, 257, 258, 259


def tiny(**overrides) -> ModelConfig:
    """A tiny model with every K2 feature (MLA with LoRA queries, YaRN, sigmoid router with bias, shared
    expert, one dense layer, INT4 experts) in fp32, small enough for CPU tests in seconds."""
    cfg = dict(vocab_size=264, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
               qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=16,
               n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1,
               routed_scaling_factor=2.827, rms_norm_eps=1e-6, rope_theta=50000.0, rope_factor=32.0,
               rope_original_max_position_embeddings=64, max_position_embeddings=2048,
               bos_token_id=TINY_BOS, eos_token_id=TINY_EOS, dtype="float32", expert_format="int4")
    return ModelConfig(**{**cfg, **overrides})
