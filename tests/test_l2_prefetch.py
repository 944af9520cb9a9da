"""l2_prefetch: its value is x, exactly, on every backend and under jit (x aliased to the result or copied into it);
the model with it on computes the same logits bit for bit and greedy ddtree with it equals ar; it runs only where
asked (the custom call counted in the lowered step); clear errors for bad arguments; on the GPU (marked gpu) both
request kinds (line prefetches and bulk chunks, a chunk cut short by a size off 16 bytes) return x untouched."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from kdtree_jax.kernels.l2_prefetch import PREFETCH_BUDGET, l2_prefetch, prefetch_plan
from kdtree_jax.quant import quantize_int4

from conftest import needs_gpu, step_calls, tiny_bf16_model, with_ffi_op

gpu = pytest.mark.gpu


def _weights(rng):
    return (jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16), jnp.asarray(rng.standard_normal(7), jnp.float32),
            quantize_int4(jnp.asarray(rng.standard_normal((2, 64, 64)), jnp.float32), 32),
            jnp.asarray(rng.integers(-5, 5, 13), jnp.int8))


@pytest.mark.parametrize("shape, dtype", [((3, 1, 16, 8), jnp.bfloat16), ((5,), jnp.float32), ((2, 3), jnp.int32)])
def test_value_is_x_on_the_cpu(shape, dtype):
    rng = np.random.default_rng(len(shape))
    x = jnp.asarray(rng.standard_normal(shape) * 100, dtype)
    ws = _weights(rng)
    for bulk in (0, 4096):
        got = jax.jit(lambda x, ws: l2_prefetch(x, *ws, bulk_bytes=bulk))(x, ws)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
        assert got.dtype == x.dtype and got.shape == x.shape
    text = jax.jit(lambda x, ws: l2_prefetch(x, *ws)).lower(x, ws).as_text()
    assert "kdtree_l2_prefetch" in text  # the custom call ran above, not a shortcut
    # x used again after the call: XLA copies it for the aliased result, and both stay x
    both = jax.jit(lambda x, w: (l2_prefetch(x, w) * 1, x + 0))(x, ws[0])
    np.testing.assert_array_equal(np.asarray(both[0]), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(both[1]), np.asarray(x))
    assert l2_prefetch(x, *ws, impl="xla") is x and l2_prefetch(x) is x


def test_bad_arguments_are_named():
    x = jnp.ones((2, 4), jnp.float32)
    with pytest.raises(ValueError, match="impl must be"):
        l2_prefetch(x, x, impl="cuda")
    for bad in (-16, 7, True, 1.5):
        with pytest.raises(ValueError, match="bulk_bytes must be 0 or a positive multiple of 16"):
            l2_prefetch(x, x, bulk_bytes=bad)
    with pytest.raises(TypeError, match="weight leaf 1 is not an array"):
        l2_prefetch(x, x, [1.0, 2.0])
    with pytest.raises(TypeError, match="x must be an array"):
        l2_prefetch([1.0], x)


def test_plan_keeps_the_leading_arrays_within_the_budget():
    a, b, c = (jnp.zeros((n,), jnp.bfloat16) for n in (100, 200, 50))
    assert prefetch_plan((a, b, c), budget=600) == (a, b)  # 200 + 400 bytes; c (100 more) does not fit
    assert prefetch_plan((a, b, c), budget=199) == ()
    assert len(prefetch_plan((a, b, c))) == 3 and PREFETCH_BUDGET >= 2**20


# ---------------------------------------------------------------------------------------------------------------
# The model


def _with(cfg, on: bool):
    return with_ffi_op(cfg, "l2_prefetch", on)


def _count(params, cfg, rows=1, t=1) -> int:
    return step_calls(params, cfg, "kdtree_l2_prefetch", rows=rows, t=t)


def test_decode_step_prefetches_only_where_asked():
    with jax.default_device(jax.devices("cpu")[0]):
        cfg, params = tiny_bf16_model()
        off, on = _with(cfg, False), _with(cfg, True)
        assert on.impl("l2_prefetch") == "ffi" and off.impl("l2_prefetch") == "xla"
        assert _count(params, off) == 0
        assert _count(params, on) == _count(params, on, rows=2, t=5) == cfg.num_hidden_layers  # one a layer
        assert _count(params, on, rows=2, t=40) == 0  # past PREFETCH_MAX_ROWS
        sharded = kj.shard_params(params, on, kj.make_mesh(ep=4, devices=jax.devices("cpu")[:4]))
        assert _count(sharded, on) == 0  # not on a mesh


def test_decode_and_verify_steps_are_bitwise_unchanged():
    cfg, params = tiny_bf16_model()
    from kdtree_jax.model import init_cache, prefill, step
    prompt = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    for t in (1, 5):
        outs = []
        for c in (_with(cfg, False), _with(cfg, True)):
            cache = init_cache(c, 2, 32)
            cache = prefill(params, c, prompt, jnp.asarray([6, 6], jnp.int32), cache).cache
            nxt = jnp.asarray(np.random.default_rng(t).integers(0, cfg.vocab_size, (2, t)), jnp.int32)
            outs.append(np.asarray(step(params, c, nxt, cache).logits))
        assert np.isfinite(outs[0]).all()
        np.testing.assert_array_equal(outs[1], outs[0])


def test_greedy_ddtree_with_prefetch_equals_ar():
    cfg, params = tiny_bf16_model()
    cfg = _with(cfg, True)
    drafter = kj.init_drafter(cfg, jax.random.key(4), num_layers=1, block_size=4)
    prompts = [[1, 2, 3, 4], [5, 6]]
    ar = kj.generate(params, cfg, prompts, max_new_tokens=12, method="ar").tokens
    dd = kj.generate(params, cfg, prompts, max_new_tokens=12, method="ddtree", drafter=drafter, budget=8).tokens
    assert [list(t) for t in dd] == [list(t) for t in ar]


# ---------------------------------------------------------------------------------------------------------------
# CUDA


@gpu
@needs_gpu
@pytest.mark.parametrize("bulk", [0, 4096, 16])
def test_gpu_value_is_x_and_weights_untouched(bulk):
    dev = jax.devices("gpu")[0]
    rng = np.random.default_rng(bulk)
    x = jax.device_put(jnp.asarray(rng.standard_normal((1, 1, 8, 512)), jnp.bfloat16), dev)
    ws = jax.device_put(_weights(rng) + (jnp.asarray(rng.standard_normal((7168, 1024)), jnp.bfloat16),), dev)
    before = [np.asarray(w) for w in jax.tree.leaves(ws)]
    f = jax.jit(lambda x, ws: l2_prefetch(x, *ws, bulk_bytes=bulk) + 0)
    got = f(x, ws)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
    for b, w in zip(before, jax.tree.leaves(ws)):
        np.testing.assert_array_equal(np.asarray(w), b)
    many = tuple(jnp.full((1000 + i,), i, jnp.float32, device=dev) for i in range(20))  # past 16 arrays a launch
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, m: l2_prefetch(x, *m))(x, many)), np.asarray(x))
