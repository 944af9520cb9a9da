"""The weight and cache layout at scale: random init made in its sharding (equal to the unsharded init, with a
loaded checkpoint's layout and distributions, never an fp32 expert stack), and a decode step that updates the
latent cache where it lies (no cache-sized copy, every cache buffer donated through)."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from kdtree_jax.model import (ArrayInfo, Int4Array, _leaf_initializer, abstract_params, decode_step, init_cache,
                              param_info)
from kdtree_jax.quant import unpack_int4
from kdtree_jax.model import param_shardings

N = jax.device_count()


def _cfg(**kw):
    # widths divisible by 8 shards, INT4 experts with group-32 scales
    return kj.configs.tiny(**{**dict(num_attention_heads=8, n_routed_experts=16, moe_intermediate_size=256), **kw})


MESHES = {8: [dict(ep=8), dict(tp=2, ep=4), dict(dp=2, ep=2, tp=2)], 2: [dict(ep=2), dict(tp=2)]}.get(N, [])


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_sharded_init_equals_unsharded(axes):
    """8 simulated CPU devices (tests/conftest.py), or the 2 GPUs of a 2-GPU machine."""
    cfg = _cfg()
    mesh = kj.make_mesh(**axes)
    ref = kj.init_params(cfg, jax.random.key(7))
    sharded = kj.init_params(cfg, jax.random.key(7), mesh=mesh)
    want = param_shardings(cfg, mesh)
    for a, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(want)):
        assert a.sharding.is_equivalent_to(s, a.ndim), (a.shape, a.sharding, s)
    experts = sharded.moe_layers[0].mlp.we_gate.packed
    assert len({str(sh.index) for sh in experts.addressable_shards}) == mesh.shape["ep"] * mesh.shape["tp"]
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_init_layout_and_distributions():
    cfg = _cfg(hidden_size=256, kv_lora_rank=64, q_lora_rank=128)
    params = kj.init_params(cfg, jax.random.key(3))
    structs = abstract_params(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(structs)
    for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(structs)):
        assert (a.shape, a.dtype) == (s.shape, s.dtype)
    infos = jax.tree.leaves(param_info(cfg), is_leaf=lambda x: isinstance(x, ArrayInfo))
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int4Array))
    assert len(infos) == len(leaves)
    seen_int4 = 0
    for info, x in zip(infos, leaves):
        if info.init == "ones":
            assert np.all(np.asarray(x) == 1)
            continue
        if info.init == "int4":
            seen_int4 += 1
            q = np.asarray(unpack_int4(x.packed))
            assert q.min() >= -7 and q.max() <= 7 and q.min() == -7 and q.max() == 7  # max|w| / 7 scaling
            assert x.scale.dtype == jnp.bfloat16
            w = np.asarray(x.dequantize(jnp.float32))
            want_std = 1 / math.sqrt(info.shape[-1])
        else:
            w = np.asarray(x, np.float64)
            fan_in = math.prod(info.shape[i] for i in info.fan_in_axes)
            want_std = 0.02 if info.init == "small" else 1 / math.sqrt(fan_in)
        assert abs(w.mean()) < 0.2 * want_std + 3 * want_std / math.sqrt(w.size), info
        spread = 0.15 + 3 / math.sqrt(2 * w.size)  # the sample std of n normals has a relative std of ~1/sqrt(2n)
        assert abs(w.std() / want_std - 1) < spread, (info, w.std(), want_std)
    assert seen_int4 == 3 * cfg.num_moe_layers
    # distinct keys per leaf and per layer: two layers' weights differ
    a, b = params.moe_layers[0], params.moe_layers[1]
    assert not np.array_equal(np.asarray(a.attn.q_b), np.asarray(b.attn.q_b))
    assert not np.array_equal(np.asarray(a.mlp.we_up.packed), np.asarray(b.mlp.we_up.packed))


def test_int4_init_never_holds_an_fp32_expert_stack():
    cfg = _cfg(hidden_size=512, moe_intermediate_size=512, n_routed_experts=32)
    info = param_info(cfg).moe_layers[0].mlp.we_gate
    compiled = _leaf_initializer(info, cfg.group_size, None).lower(jax.random.key(0), jnp.uint32(0)).compile()
    fp32_stack, fp32_expert = math.prod(info.shape) * 4, math.prod(info.shape[1:]) * 4
    out_bytes = compiled.memory_analysis().output_size_in_bytes  # the packed nibbles and scales
    temp = compiled.memory_analysis().temp_size_in_bytes
    # scratch: the loop's copy of the INT4 output and a few experts' fp32 weights, never the fp32 stack
    assert temp < out_bytes + 4 * fp32_expert < fp32_stack / 2, (temp, out_bytes, fp32_expert, fp32_stack)


def test_decode_step_updates_the_cache_in_place():
    cfg = kj.configs.tiny()
    params = kj.init_params(cfg, jax.random.key(0))
    b = 2

    def compiled(s):
        cache = dataclasses.replace(init_cache(cfg, b, s), lengths=jnp.array([5, 9], jnp.int32))
        return decode_step.lower(params, cfg, jnp.zeros((b,), jnp.int32), cache).compile()

    small, large = compiled(1024), compiled(8192)
    # scratch grows with the context only by the attention scores (heads x slots), not by a copy of any layer's
    # cache (the scan over stacked layers copied the whole cache per step)
    per_slot = (large.memory_analysis().temp_size_in_bytes - small.memory_analysis().temp_size_in_bytes) / 7168
    layer_per_slot = b * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert per_slot < layer_per_slot / 2, (per_slot, layer_per_slot)
    s = 8192
    hlo = large.as_text()
    aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", hlo).group(1)
    assert aliases.count("may-alias") + aliases.count("must-alias") >= 2 * cfg.num_hidden_layers
    cache_shapes = {f"[{b},{s},{cfg.kv_lora_rank}]", f"[{b},{s},{cfg.qk_rope_head_dim}]"}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = \w+(\[[\d,]*\])\S* ([\w\-]+)\(", line)
        if m and m.group(1) in cache_shapes:
            assert m.group(2) not in ("copy", "concatenate", "slice", "dynamic-slice"), line
    # and the step still computes the model: cached decode = teacher-forced logits
    tokens = jnp.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]], jnp.int32)
    ref = kj.forward(params, cfg, tokens)
    cache = init_cache(cfg, 1, 16)
    for i in range(tokens.shape[1]):
        logits, cache = decode_step(params, cfg, tokens[:, i], cache)
        np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(ref[0, i]), rtol=2e-4, atol=2e-4)
