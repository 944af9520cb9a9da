"""The model itself: INT4 experts, cached decode against teacher forcing, the absorbed form, config errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_gpu, rel_err

import kdtree_jax as kj
from kdtree_jax.model import KVCache, init_cache, prefill, step
from kdtree_jax.quant import Int4Array, pack_int4, quantize_int4, unpack_int4


@pytest.fixture(scope="module")
def tiny():
    cfg = kj.configs.tiny()
    return cfg, kj.init_params(cfg, jax.random.key(0))


def test_pack_unpack_round_trip_bit_exact():
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 8, size=(3, 5, 64), dtype=np.int8)
    packed = pack_int4(q)
    assert packed.dtype == np.int32 and packed.shape == (3, 5, 8)
    np.testing.assert_array_equal(unpack_int4(packed), q)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed))), q)
    np.testing.assert_array_equal(np.asarray(pack_int4(jnp.asarray(q))), packed)
    # the compressed-tensors rule, written out for one word: nibble i holds q[i] + 8, least significant first
    word = sum(int(q[0, 0, i] + 8) << (4 * i) for i in range(8))
    assert np.uint32(packed[0, 0, 0].view(np.uint32)) == word


def test_quantize_int4_error_bounded():
    w = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32)
    qa = quantize_int4(w, 32)
    deq = np.asarray(qa.dequantize())
    step_size = np.repeat(np.asarray(qa.scale, np.float32), 32, axis=-1)
    assert np.all(np.abs(deq - w) <= 0.5 * step_size + 1e-3 * np.abs(w))
    assert rel_err(deq, w) < 0.1


def test_int4_model_equals_dequantized_model(tiny):
    cfg, params = tiny
    assert isinstance(params.moe_layers[0].mlp.we_gate, Int4Array)
    deq = jax.tree.map(lambda x: x.dequantize(jnp.float32) if isinstance(x, Int4Array) else x, params,
                       is_leaf=lambda x: isinstance(x, Int4Array))
    cfg_dense = dataclasses.replace(cfg, expert_format="bf16")
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, 24))
    a = kj.forward(params, cfg, tokens)
    b = kj.forward(deq, cfg_dense, tokens)
    assert rel_err(a, b) <= 1e-6


def test_absorbed_step_equals_naive_forward(tiny):
    """Prefill a prefix, then feed the rest as new tokens through the absorbed form: same logits as forward."""
    cfg, params = tiny
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 20)), jnp.int32)
    ref = kj.forward(params, cfg, tokens)
    cache = init_cache(cfg, 2, 64)
    lengths = jnp.array([12, 7], jnp.int32)
    pre = prefill(params, cfg, tokens[:, :12], lengths, cache)
    # row 0 continues at 12, row 1 at 7: feed each row's next 8 tokens
    nxt = jnp.stack([tokens[0, 12:20], tokens[1, 7:15]])
    out = step(params, cfg, nxt, pre.cache)
    assert rel_err(out.logits[0], ref[0, 12:20]) <= 1e-5
    assert rel_err(out.logits[1], ref[1, 7:15]) <= 1e-5
    assert rel_err(pre.logits[0, :12], ref[0, :12]) <= 1e-5


def test_tree_mask_step_equals_separate_branches(tiny):
    """Two sibling branches verified in one step with a tree mask equal each branch run on its own."""
    cfg, params = tiny
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(1, 9)), jnp.int32)
    a, b, c = (int(x) for x in rng.integers(0, cfg.vocab_size, size=3))
    # nodes: 0 = root r, 1 = a (child of r), 2 = b (child of r), 3 = c (child of a)
    r = int(prompt[0, -1])
    pre = prefill(params, cfg, prompt[:, :-1], jnp.array([8], jnp.int32), init_cache(cfg, 1, 32))
    vis = jnp.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], bool)
    tree = step(params, cfg, jnp.array([[r, a, b, c]], jnp.int32), pre.cache, depths=jnp.array([[0, 1, 1, 2]]),
                tree_mask=vis)
    ref_ac = kj.forward(params, cfg, jnp.concatenate([prompt, jnp.array([[a, c]])], axis=1))[0, -3:]
    ref_b = kj.forward(params, cfg, jnp.concatenate([prompt, jnp.array([[b]])], axis=1))[0, -1]
    assert rel_err(tree.logits[0, [0, 1, 3]], ref_ac) <= 1e-5
    assert rel_err(tree.logits[0, 2], ref_b) <= 1e-5


def test_cached_greedy_decode_equals_teacher_forced_rollout(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (3, 11, 6)]
    out = kj.generate(params, cfg, prompts, max_new_tokens=12)
    for p, gen in zip(prompts, out.tokens):
        assert len(gen) == 12
        full = jnp.asarray([p + gen], jnp.int32)
        logits = kj.forward(params, cfg, full)[0]
        tf = np.asarray(jnp.argmax(logits[len(p) - 1:-1], axis=-1))
        np.testing.assert_array_equal(tf, gen)
    assert out.stats["steps"] == 11 and out.stats["tau"] == 1.0


def test_decode_step_donates_and_advances(tiny):
    cfg, params = tiny
    prompt = jnp.asarray(np.random.default_rng(7).integers(0, 256, size=(2, 5)), jnp.int32)
    pre = prefill(params, cfg, prompt, jnp.array([5, 5], jnp.int32), init_cache(cfg, 2, 16))
    nxt = jnp.argmax(pre.logits[:, -1], axis=-1).astype(jnp.int32)
    logits, cache = kj.decode_step(params, cfg, nxt, pre.cache)
    assert isinstance(cache, KVCache) and cache.lengths.tolist() == [6, 6]
    ref = kj.forward(params, cfg, jnp.concatenate([prompt, nxt[:, None]], axis=1))[:, -1]
    assert rel_err(logits, ref) <= 1e-5


def test_sampling_is_seeded_and_varies(tiny):
    cfg, params = tiny
    a = kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=16, temperature=1.0, seed=1).tokens
    b = kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=16, temperature=1.0, seed=1).tokens
    c = kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=16, temperature=1.0, seed=2).tokens
    assert a == b and a != c
    greedy = kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=16).tokens
    assert kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=16, temperature=1.0, top_k=1, seed=2).tokens == greedy


def test_eos_stops_a_row(tiny):
    cfg, params = tiny
    free = kj.generate(params, cfg, [[5, 6, 7], [9]], max_new_tokens=10).tokens
    eos = free[0][3]  # make the 4th greedy token of row 0 the EOS
    out = kj.generate(params, cfg, [[5, 6, 7], [9]], max_new_tokens=10, eos_id=eos).tokens
    assert out[0] == free[0][:free[0].index(eos) + 1]
    assert out[1] == (free[1][:free[1].index(eos) + 1] if eos in free[1] else free[1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[1, 2, 999]]), "outside the vocabulary"),
    (dict(prompts=[[1, -1]]), "outside the vocabulary"),
    (dict(prompts=[[]]), "non-empty"),
    (dict(prompts=[]), "non-empty"),
    (dict(prompts=[1, 2, 3]), "list of prompts"),
    (dict(prompts=[[1.5, 2.0]]), "integer token ids"),
    (dict(prompts=np.zeros((2, 3, 4), np.int32)), r"\[B, T\]"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=3000), "exceeds the context"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(method="beam"), "method"),
    (dict(eos_id=10**6), "eos_id"),
])
def test_bad_input_is_a_clear_error(tiny, kwargs, match):
    cfg, params = tiny
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        kj.generate(params, cfg, **args)


def test_config_errors_name_the_key():
    from kdtree_jax.config import ConfigError

    good = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
                n_routed_experts=8, num_experts_per_tok=2)
    assert kj.ModelConfig.from_hf(good).hidden_size == 64
    bad = dict(good)
    del bad["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        kj.ModelConfig.from_hf(bad)
    with pytest.raises(ConfigError, match="rope_parameters"):
        kj.ModelConfig.from_hf({**good, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                         "original_max_position_embeddings": 8},
                                "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 8}})
    with pytest.raises(ConfigError, match="n_group"):
        kj.ModelConfig.from_hf({**good, "n_group": 3})
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        kj.ModelConfig.from_hf({**good, "num_key_value_heads": 2})
    wrapped = kj.ModelConfig.from_hf({"model_type": "kimi_k25", "text_config": {**good, "rope_theta": 5e4}})
    assert wrapped.rope_theta == 5e4
    assert kj.configs.k2_6().kv_cache_dim == 576


def test_one_switch_picks_every_kernel():
    """cfg.impl(op) is the `impl=` the model and the speculative step pass to each kernel."""
    ops = ("tree_build", "tree_accept", "mla_verify", "marlin_moe")
    assert [kj.configs.tiny().impl(op) for op in ops] == ["xla"] * 4
    assert [kj.configs.tiny(kernels="ffi").impl(op) for op in ops] == ["ffi"] * 4
    assert [kj.configs.tiny(kernels="ffi", ffi_ops=("tree_build", "mla_verify")).impl(op) for op in ops] == [
        "ffi", "xla", "ffi", "xla"]
    assert [kj.configs.tiny(kernels="dense").impl(op) for op in ops] == ["xla", "xla", "xla", "dense"]
    with pytest.raises(ValueError, match="unknown kernel"):
        kj.configs.tiny().impl("flash_attention")


def test_dense_experts_equal_routed_experts(tiny):
    cfg, params = tiny
    tokens = np.random.default_rng(8).integers(0, cfg.vocab_size, size=(2, 16))
    a = kj.forward(params, cfg, tokens)
    b = kj.forward(params, dataclasses.replace(cfg, kernels="dense"), tokens)
    assert rel_err(b, a) <= 1e-5


@pytest.mark.parametrize("start", [0, 5, 13, 40])  # 13 and 40: past the room left, clamped as dynamic_update_slice does
def test_one_row_cache_write_equals_the_batched_write(start):
    """`_write_rows` takes a plain dynamic_update_slice for one row (the vmapped form is a scatter, which made XLA
    read the old rows back on a GPU): both write the same, on fresh random rows, clamping the start alike."""
    from kdtree_jax.model import _write_rows
    cfg = kj.configs.tiny()
    rng = np.random.default_rng(start)
    cache = jnp.asarray(rng.standard_normal((1, 16, 8)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((1, 3, 8)), jnp.float32)
    starts = jnp.asarray([start], jnp.int32)
    got = _write_rows(cache, new, starts, cfg)
    want = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=0))(cache, new, starts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(cache))  # the write happened


def test_drafter_one_row_context_write_equals_a_row_of_the_batched_write():
    from kdtree_jax.drafter import append_context
    cfg = kj.configs.tiny()
    drafter = kj.init_drafter(cfg, jax.random.key(2), num_layers=2, block_size=4)
    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.standard_normal((cfg.num_hidden_layers, 2, 3, cfg.hidden_size)), jnp.float32)
    starts = jnp.asarray([5, 5], jnp.int32)
    two = append_context(drafter, drafter.start(2, 32), hidden, starts)  # the vmapped write
    one = append_context(drafter, drafter.start(1, 32), hidden[:, :1], starts[:1])  # the plain one
    assert len(one.k) == len(two.k) == 2  # one array a drafter layer
    for got, want in zip(one.k + one.v, two.k + two.v):
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
        assert np.abs(np.asarray(got[0, 5:8])).sum() > 0 and not np.asarray(got[0, 8:]).any()


def _block_attention_inputs(dtype, b=3, bs=4, h=8, g=2, hd=16, s=40, seed=5):
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return arr(b, bs, h, hd), arr(b, s, g, hd), arr(b, s, g, hd), arr(b, bs, g, hd), arr(b, bs, g, hd)


@pytest.mark.parametrize("g", [1, 2, 8])
def test_drafter_split_attention_equals_one_softmax(g):
    """The drafter's block attention as two attentions joined by their log-sum-exp (the form cuDNN runs) equals the
    one softmax over context and block, for grouped heads (8 query heads over 1, 2, 8 key/value heads) and rows
    that see no context, part of it or all of it."""
    from kdtree_jax.drafter import block_attention, split_block_attention
    q, ck, cv, kb, vb = _block_attention_inputs(jnp.float32, g=g)
    lengths = jnp.asarray([0, 17, 40], jnp.int32)
    want = block_attention(q, ck, cv, kb, vb, lengths, 0.25, "xla")
    got = split_block_attention(q, ck, cv, kb, vb, lengths, 0.25, "xla")
    assert rel_err(got, want) <= 1e-5
    # the context below each row's length counts, and only it: a key past it changed changes nothing
    ck2 = ck.at[1, 17:].set(100.0)
    np.testing.assert_allclose(np.asarray(split_block_attention(q, ck2, cv, kb, vb, lengths, 0.25, "xla")),
                               np.asarray(got), rtol=1e-6, atol=1e-6)
    assert rel_err(split_block_attention(q, ck.at[1, 16].set(3.0), cv, kb, vb, lengths, 0.25, "xla"), got) > 1e-4


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("h, g, hd", [(8, 1, 112), (64, 8, 112)])
def test_gpu_drafter_cudnn_attention_matches_xla(h, g, hd):
    """The drafter's block attention on cuDNN (two flash attentions joined by their log-sum-exp) equals the XLA
    reference on fresh random bf16 inputs at K2.5-DFlash's head shapes (one device's share of 8 and all heads),
    rows seeing no context, part of it and all of it; then a whole draft of the embedded drafter both ways."""
    from kdtree_jax.drafter import block_attention
    q, ck, cv, kb, vb = _block_attention_inputs(jnp.bfloat16, b=3, bs=16, h=h, g=g, hd=hd, s=4112, seed=7)
    lengths = jnp.asarray([0, 700, 4096], jnp.int32)
    fn = lambda impl: jax.jit(lambda *a: block_attention(*a, lengths, hd ** -0.5, impl))(q, ck, cv, kb, vb)
    got, want = fn("cudnn"), fn("xla")
    assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == want.shape
    assert rel_err(got, want) <= 2e-2

    from kdtree_jax.drafter import draft
    cfg = kj.configs.tiny(dtype="bfloat16")
    d = kj.init_drafter(cfg, jax.random.key(9), num_layers=2, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64)
    rng = np.random.default_rng(8)
    cache = d.start(2, 64)
    cache = type(cache)(**{f: tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in getattr(cache, f))
                           for f in ("k", "v")})
    args = (d, kj.init_params(cfg, jax.random.key(10)), cache, jnp.asarray([5, 40], jnp.int32),
            jnp.asarray([3, 9], jnp.int32))
    got, want = (jax.jit(lambda *a, impl=impl: draft(*a, attention=impl))(*args) for impl in ("cudnn", "xla"))
    assert rel_err(got, want) <= 2e-2
