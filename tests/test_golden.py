"""Golden parity: the JAX model against Hugging Face transformers' DeepseekV3ForCausalLM (fp32, eager)."""

import numpy as np
import pytest
from conftest import rel_err
from hf_models import VARIANTS, build_hf_model, hf_layer_outputs, save_hf_model
from safetensors.numpy import load_file

import kdtree_jax as kj
from kdtree_converters.hf import params_from_hf

pytest.importorskip("transformers")


def load_converted(path, **overrides):
    tensors = load_file(f"{path}/model.safetensors")
    cfg = kj.ModelConfig.from_hf(path, dtype="float32", expert_format="bf16", **overrides)
    return cfg, params_from_hf(tensors.__getitem__, tensors.__contains__, cfg)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_matches_transformers(variant, tmp_path):
    model = build_hf_model(variant)
    path = save_hf_model(model, str(tmp_path / variant))
    cfg, params = load_converted(path)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 40))
    ref_logits, ref_layers = hf_layer_outputs(model, tokens)
    logits, hidden = kj.forward(params, cfg, tokens, return_hidden=True)
    assert len(ref_layers) == cfg.num_hidden_layers == hidden.shape[0]
    for i, ref in enumerate(ref_layers):
        assert rel_err(hidden[i], ref) <= 1e-5, f"layer {i}: rel err {rel_err(hidden[i], ref):.2e}"
    assert rel_err(logits, ref_logits) <= 1e-5
    assert float(np.std(ref_logits)) > 0.1  # a real signal, not a vanishing one


def test_config_from_saved_hf(tmp_path):
    model = build_hf_model("groups")
    path = save_hf_model(model, str(tmp_path / "m"))
    cfg = kj.ModelConfig.from_hf(path)
    assert (cfg.n_group, cfg.topk_group, cfg.rope_type, cfg.rope_factor) == (4, 2, "yarn", 32.0)
    assert cfg.rope_original_max_position_embeddings == 32 and cfg.q_lora_rank == 48
