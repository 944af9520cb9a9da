"""Sharded = unsharded on 8 simulated CPU devices (tests/conftest.py asks XLA for 8 host devices)."""

import jax
import numpy as np
import pytest
from conftest import rel_err

import kdtree_jax as kj
from kdtree_jax.sharding import ShardingError, current_mesh, param_shardings

MESHES = [dict(tp=8), dict(tp=2, ep=4), dict(ep=8), dict(dp=2, ep=2, tp=2)]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts)")
    # widths divisible by 8 shards, INT4 packs and group-32 scales included
    cfg = kj.configs.tiny(num_attention_heads=8, n_routed_experts=16, moe_intermediate_size=256)
    params = kj.init_params(cfg, jax.random.key(0))
    drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=1, block_size=4)
    tokens = np.random.default_rng(0).integers(0, 256, size=(4, 16))
    ref = dict(logits=kj.forward(params, cfg, tokens),
               ar=kj.generate(params, cfg, PROMPTS, max_new_tokens=8).tokens,
               ddtree=kj.generate(params, cfg, PROMPTS, max_new_tokens=8, method="ddtree", drafter=drafter,
                                  budget=8).tokens)
    return cfg, params, drafter, tokens, ref


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_sharded_forward_equals_single_device(model, axes):
    cfg, params, _, tokens, ref = model
    mesh = kj.make_mesh(**axes)
    sharded = kj.shard_params(params, cfg, mesh)
    moe = sharded.moe_layers.mlp.we_gate.packed
    assert moe.sharding.spec[1] == "ep" and len(moe.addressable_shards) == 8  # experts really split
    with jax.set_mesh(mesh):
        assert current_mesh() is not None  # the MoE takes the shard_map expert-parallel path
    assert rel_err(kj.forward(sharded, cfg, tokens), ref["logits"]) <= 1e-5


@pytest.mark.parametrize("axes", [dict(tp=2, ep=4), dict(dp=2, ep=2, tp=2)],
                         ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_sharded_generation_equals_single_device(model, axes):
    cfg, params, drafter, _, ref = model
    sharded = kj.shard_params(params, cfg, kj.make_mesh(**axes))
    assert kj.generate(sharded, cfg, PROMPTS, max_new_tokens=8).tokens == ref["ar"]
    out = kj.generate(sharded, cfg, PROMPTS, max_new_tokens=8, method="ddtree", drafter=drafter, budget=8)
    assert out.tokens == ref["ddtree"] == ref["ar"]


def test_bad_meshes_are_clear_errors(model):
    cfg, _, _, _, _ = model
    with pytest.raises(ShardingError, match="does not match the 8 devices"):
        kj.make_mesh(tp=3)
    with pytest.raises(ShardingError, match="n_routed_experts"):
        param_shardings(kj.configs.tiny(num_attention_heads=8, n_routed_experts=12, moe_intermediate_size=256),
                        kj.make_mesh(ep=8))
    with pytest.raises(ShardingError, match="num_attention_heads"):
        param_shardings(kj.configs.tiny(), kj.make_mesh(tp=8))
    with pytest.raises(ShardingError, match="not divisible"):
        param_shardings(kj.configs.tiny(num_attention_heads=8, n_routed_experts=16), kj.make_mesh(tp=8))


def test_sharded_custom_calls_equal_single_device(model):
    """kernels="ffi": mla_verify per head shard, the tree kernels replicated, the MoE kernel per expert shard,
    all inside shard_map; tokens and logits equal the unsharded pure-JAX results."""
    import dataclasses

    cfg, params, drafter, tokens, ref = model
    ffi = dataclasses.replace(cfg, kernels="ffi")
    sharded = kj.shard_params(params, ffi, kj.make_mesh(dp=2, ep=2, tp=2))
    assert rel_err(kj.forward(sharded, ffi, tokens), ref["logits"]) <= 1e-5
    out = kj.generate(sharded, ffi, PROMPTS, max_new_tokens=8, method="ddtree", drafter=drafter, budget=8)
    assert out.tokens == ref["ddtree"]
