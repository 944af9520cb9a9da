"""Tiny Hugging Face DeepseekV3 models for golden tests: built with transformers, randomized, saved to disk."""

from __future__ import annotations

import os

import numpy as np

YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 32, "rope_theta": 50000.0}

BASE = dict(vocab_size=264, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16,
            num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=2.827, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True,
            max_position_embeddings=1024, initializer_range=0.1, bos_token_id=256, eos_token_id=257)

# name -> overrides of BASE: the variants the golden tests cover
VARIANTS = {
    "yarn": dict(rope_parameters=YARN),
    "groups": dict(rope_parameters=YARN, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4),
    "two_dense": dict(rope_parameters=YARN, num_hidden_layers=4, first_k_dense_replace=2),
    "no_q_lora": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, q_lora_rank=None),
}


def build_hf_model(variant: str, seed: int = 0, **overrides):
    """A random fp32 DeepseekV3ForCausalLM with eager attention, non-trivial norms and router bias (overrides: config
    fields changed from the variant's)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**{**BASE, **VARIANTS[variant], **overrides})
    model = DeepseekV3ForCausalLM(cfg).eval().to(torch.float32)
    model.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros by default: randomize so selection uses it
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    return model


def save_hf_model(model, path: str) -> str:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_layer_outputs(model, tokens: np.ndarray):
    """(logits [B, T, V], [every decoder layer's output [B, T, D]]) from transformers, in float64 numpy."""
    import torch

    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append((o[0] if isinstance(o, tuple) else o)))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits
    finally:
        for h in hooks:
            h.remove()
    return logits.double().numpy(), [o.double().numpy() for o in outs]
