"""Converting a DFlash drafter checkpoint along with its target (kdtree-convert --drafter)."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import kdtree_jax as kj
from kdtree_jax.config import ConfigError
from kdtree_converters.convert import convert
from kdtree_jax.checkpoint import CheckpointError

from hf_models import build_hf_model, save_hf_model


def write_dflash(path: str, drafter, overrides: dict | None = None, drop: str | None = None) -> str:
    """Write `drafter` in the z-lab/dflash checkpoint layout (HF Linear weights [out, in], Qwen3 names)."""
    d, p = drafter.cfg, jax.tree.map(np.asarray, drafter.params)
    t = {"fc.weight": p.fc.T, "hidden_norm.weight": p.hidden_norm, "norm.weight": p.norm}
    for i in range(d.num_layers):
        lp = jax.tree.map(lambda x: x[i], p.layers)
        pre = f"layers.{i}"
        t.update({f"{pre}.input_layernorm.weight": lp.attn_norm, f"{pre}.post_attention_layernorm.weight": lp.mlp_norm,
                  f"{pre}.self_attn.q_proj.weight": lp.q.reshape(d.hidden_size, -1).T,
                  f"{pre}.self_attn.k_proj.weight": lp.k.reshape(d.hidden_size, -1).T,
                  f"{pre}.self_attn.v_proj.weight": lp.v.reshape(d.hidden_size, -1).T,
                  f"{pre}.self_attn.o_proj.weight": lp.o.reshape(-1, d.hidden_size).T,
                  f"{pre}.self_attn.q_norm.weight": lp.q_norm, f"{pre}.self_attn.k_norm.weight": lp.k_norm,
                  f"{pre}.mlp.gate_proj.weight": lp.gate.T, f"{pre}.mlp.up_proj.weight": lp.up.T,
                  f"{pre}.mlp.down_proj.weight": lp.down.T})
    if drop:
        del t[drop]
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": d.hidden_size,
              "num_hidden_layers": d.num_layers, "num_attention_heads": d.num_heads,
              "num_key_value_heads": d.num_kv_heads, "head_dim": d.head_dim, "intermediate_size": d.intermediate_size,
              "rms_norm_eps": d.rms_norm_eps, "vocab_size": d.vocab_size, "num_target_layers": d.target_num_layers,
              "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
              "dflash_config": {"block_size": d.block_size, "mask_token_id": d.mask_token_id,
                                "target_layer_ids": list(d.target_layer_ids)}}
    config.update(overrides or {})
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in t.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = save_hf_model(build_hf_model("yarn"), str(tmp_path_factory.mktemp("hf") / "target"))
    cfg = kj.ModelConfig.from_hf(path, dtype="float32", expert_format="bf16")
    drafter = kj.init_drafter(cfg, jax.random.key(3), num_layers=2, block_size=4, num_kv_heads=2)
    return path, cfg, drafter


def test_drafter_converts_loads_and_drafts_identically(target, tmp_path):
    src, cfg, drafter = target
    out = str(tmp_path / "ckpt")
    convert(src, out, dtype="float32", drafter=write_dflash(str(tmp_path / "dflash"), drafter), progress=False)
    model = kj.load(out)
    assert model.drafter.cfg == drafter.cfg
    for a, b in zip(jax.tree.leaves(model.drafter.params), jax.tree.leaves(drafter.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompts = [[5, 6, 7, 8], [9, 10]]
    ar = kj.generate(model, prompts, max_new_tokens=12).tokens
    loaded = kj.generate(model, prompts, max_new_tokens=12, method="ddtree", budget=6)
    direct = kj.generate(model.params, model.cfg, prompts, max_new_tokens=12, method="ddtree", drafter=drafter,
                         budget=6)
    assert loaded.tokens == direct.tokens == ar
    assert loaded.stats["tau_histogram"] == direct.stats["tau_histogram"]


@pytest.mark.parametrize("overrides, drop, error, match", [
    ({"dflash_config": {"block_size": 4, "mask_token_id": 1, "target_layer_ids": [1], "selector_rank": 8}}, None,
     ConfigError, "DFlash2"),
    ({"hidden_size": 32}, None, ConfigError, "hidden_size"),
    ({"num_target_layers": 7}, None, ConfigError, "target of 7 layers"),
    ({"dflash_config": {"block_size": 4, "target_layer_ids": [1]}}, None, ConfigError, "mask_token_id"),
    (None, "layers.1.self_attn.k_norm.weight", CheckpointError, "layers.1.self_attn.k_norm.weight"),
    ({"dflash_config": {"block_size": "four", "mask_token_id": 1, "target_layer_ids": [1]}}, None, ConfigError,
     "drafter config field 'dflash_config.block_size' must be int, got 'four'"),
    ({"dflash_config": {"block_size": 4, "mask_token_id": 1, "target_layer_ids": 7}}, None, ConfigError,
     "field 'dflash_config.target_layer_ids' must be a list of ints, got 7"),
    ({"dflash_config": [4]}, None, ConfigError, "field 'dflash_config' must be an object"),
    ({"num_attention_heads": 0}, None, ConfigError, "field 'num_heads' must be an integer >= 1, got 0"),
    ({"num_attention_heads": 2.5}, None, ConfigError, "field 'num_attention_heads' must be int, got 2.5"),
    ({"rms_norm_eps": "tiny"}, None, ConfigError, "field 'rms_norm_eps' must be float"),
    ({"rms_norm_eps": -1e-6}, None, ConfigError, "field 'rms_norm_eps' must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}, None, ConfigError,
     "field 'rope_parameters.rope_theta' must be float"),
    ({"dflash_config": {"block_size": 1, "mask_token_id": 1, "target_layer_ids": [1]}}, None, ConfigError,
     "field 'block_size' must be at least 2"),
    ({"dflash_config": {"block_size": 4, "mask_token_id": 10**6, "target_layer_ids": [1]}}, None, ConfigError,
     "field 'mask_token_id' must be an id in"),
    ({"dflash_config": {"block_size": 4, "mask_token_id": 1, "target_layer_ids": []}}, None, ConfigError,
     "field 'target_layer_ids' must be a non-empty list"),
    ({"dflash_config": {"block_size": 4, "mask_token_id": 1, "target_layer_ids": [-1]}}, None, ConfigError,
     "field 'target_layer_ids' must be a non-empty list of layer ids in"),
])
def test_bad_drafter_is_a_clear_error_and_leaves_nothing(target, tmp_path, overrides, drop, error, match):
    src, _, drafter = target
    bad = write_dflash(str(tmp_path / "dflash"), drafter, overrides, drop)
    out = tmp_path / "ckpt"
    with pytest.raises(error, match=match):
        convert(src, str(out), dtype="float32", drafter=bad, progress=False)
    assert not out.exists() and not any(p.name.startswith(".ckpt") for p in tmp_path.iterdir())


def _retype_norm(path):
    t = load_file(os.path.join(path, "model.safetensors"))
    t["norm.weight"] = t["norm.weight"].astype(np.int8)
    save_file(t, os.path.join(path, "model.safetensors"))


def _drop_down_proj(path):
    t = load_file(os.path.join(path, "model.safetensors"))
    del t["layers.1.mlp.down_proj.weight"]
    save_file(t, os.path.join(path, "model.safetensors"))


def _second_copy(path):
    shutil.copy(os.path.join(path, "model.safetensors"), os.path.join(path, "model-2.safetensors"))


def _extra_layer(path):
    t = load_file(os.path.join(path, "model.safetensors"))
    t["layers.5.mlp.down_proj.weight"] = t["layers.1.mlp.down_proj.weight"]
    save_file(t, os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("damage, error, message", [
    (_retype_norm, CheckpointError, "tensor 'norm.weight' is int8, expected F32, BF16, F16 or F64"),
    (_drop_down_proj, CheckpointError, "missing tensor 'layers.1.mlp.down_proj.weight'"),
    (_second_copy, CheckpointError, "tensor 'fc.weight' is in both model-2.safetensors and model.safetensors"),
    (_extra_layer, ConfigError, "the safetensors hold layer(s) 5, beyond config.json's num_hidden_layers=2"),
])
def test_bad_drafter_tensors_are_found_from_the_headers(target, tmp_path, damage, error, message):
    """An integer drafter tensor was cast and converted, a tensor in two files or a layer past the config's taken
    silently, and a missing tensor found only after every target layer was converted, which that failure then
    discarded: all are refused by --dry-run now, before the target is read (issue 46, eighth probe round)."""
    src, _, drafter = target
    bad = write_dflash(str(tmp_path / "dflash"), drafter)
    damage(bad)
    for dry_run in (True, False):
        with pytest.raises(error, match=re.escape(message)):
            convert(src, str(tmp_path / "ckpt"), dtype="float32", drafter=bad, progress=False, dry_run=dry_run)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dflash"]
