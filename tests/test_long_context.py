"""Long prompts: chunked prefill (each piece attends to the cache written so far) equals the one-pass prefill, in
bounded memory, and generation on top of it gives the same greedy tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_gpu, rel_err

import kdtree_jax as kj
from kdtree_jax.model import init_cache, naive_attention_lse, prefill, prefill_last


@pytest.fixture(scope="module")
def tiny():
    cfg = kj.configs.tiny()
    return cfg, kj.init_params(cfg, jax.random.key(0))


def _prompts(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def test_chunked_prefill_equals_one_pass(tiny):
    cfg, params = tiny
    lengths = [64, 37, 16, 5, 17]  # last tokens in every piece, on and off piece boundaries
    t = 64
    tokens = np.zeros((len(lengths), t), np.int32)
    for i, p in enumerate(_prompts(lengths, cfg.vocab_size)):
        tokens[i, :len(p)] = p
    tokens, lens = jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)
    ref = prefill(params, cfg, tokens, lens, init_cache(cfg, len(lengths), 80))
    ref_last = np.asarray(ref.logits)[np.arange(len(lengths)), np.asarray(lengths) - 1]
    fn = jax.jit(lambda p, tok, ln: prefill_last(p, cfg, tok, ln, init_cache(cfg, len(lengths), 80), 16))
    last, cache, _ = fn(params, tokens, lens)
    assert rel_err(last, ref_last) <= 1e-5
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    for layer in range(cfg.num_hidden_layers):
        for got, want in ((cache.latent[layer], ref.cache.latent[layer]), (cache.k_pe[layer], ref.cache.k_pe[layer])):
            for row, n in enumerate(lengths):  # the committed slots; the rest is free space
                assert rel_err(got[row, :n], want[row, :n]) <= 1e-5
    # the callback sees every layer's output of every piece (summed here over positions), at its start slot
    def on_chunk(carry, hidden, starts):
        total, first = carry
        return total + hidden.sum(axis=2), first + jnp.sum(starts == 0)

    zero = (jnp.zeros((cfg.num_hidden_layers, len(lengths), cfg.hidden_size)), jnp.int32(0))
    _, _, (total, first) = prefill_last(params, cfg, tokens, lens, init_cache(cfg, len(lengths), 80), 16, on_chunk,
                                        zero)
    assert rel_err(total, ref.hidden.sum(axis=2)) <= 1e-5
    assert int(first) == len(lengths)  # one piece starts at slot 0


def test_chunked_prefill_memory_is_bounded_by_the_chunk(tiny):
    cfg, params = tiny
    b, t = 1, 1024
    tokens, lens = jnp.zeros((b, t), jnp.int32), jnp.full((b,), t, jnp.int32)

    def temp(chunk):
        fn = jax.jit(lambda p, tok, ln: prefill_last(p, cfg, tok, ln, init_cache(cfg, b, t), chunk)[0])
        return fn.lower(params, tokens, lens).compile().memory_analysis().temp_size_in_bytes

    one_pass, chunked = temp(None), temp(64)
    scores = b * cfg.num_attention_heads * t * t * 4  # one layer's fp32 [B, H, T, T] of the one-pass form
    assert one_pass >= scores
    assert chunked < one_pass / 4, (chunked, one_pass)  # grows with chunk x context, not context squared


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_generation_after_chunked_prefill_equals_one_pass(tiny, method):
    cfg, params = tiny
    drafter = kj.init_drafter(cfg, jax.random.key(2), num_layers=1, block_size=4)
    prompts = _prompts([70, 33, 19], cfg.vocab_size, seed=3)
    kw = dict(max_new_tokens=12, method=method, drafter=drafter, budget=8)
    one = kj.generate(params, cfg, prompts, prefill_chunk=0, **kw)
    chunked = kj.generate(params, cfg, prompts, prefill_chunk=16, **kw)
    assert chunked.tokens == one.tokens
    if method == "ddtree":  # and lossless: the AR tokens
        assert chunked.tokens == kj.generate(params, cfg, prompts, max_new_tokens=12, prefill_chunk=16).tokens


@pytest.mark.parametrize("bad", [-1, 8, 48, 1.5, True, "16"])
def test_bad_prefill_chunk_is_a_clear_error(tiny, bad):
    cfg, params = tiny
    with pytest.raises(ValueError, match="prefill_chunk"):
        kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=2, prefill_chunk=bad)


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_nonfinite_logits_are_an_error_not_token_0(tiny, method):
    cfg, params = tiny
    drafter = kj.init_drafter(cfg, jax.random.key(2), num_layers=1, block_size=4)
    bad = params.layers[-1]  # a NaN in the last layer's output projection: every logit of every row is NaN
    bad = bad.__class__(**{**bad.__dict__, "attn": bad.attn.__class__(**{**bad.attn.__dict__,
                                                                       "o": bad.attn.o.at[0, 0, 0].set(jnp.nan)})})
    params = params.__class__(**{**params.__dict__, "layers": params.layers[:-1] + (bad,)})
    with pytest.raises(FloatingPointError, match=r"NaN or inf logits for prompt\(s\) \[0, 1\]"):
        kj.generate(params, cfg, [[1, 2, 3], [4, 5]], max_new_tokens=4, method=method, drafter=drafter, budget=4)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("causal, lens", [(True, None), (False, [0, 700, 1024])])
def test_gpu_cudnn_chunk_attention_matches_xla(causal, lens):
    """The naive chunk attention on cuDNN's flash kernel (values padded 128 -> 192, its log-sum-exp returned)
    equals the XLA form on fresh random bf16 inputs, output and log-sum-exp; a row that sees nothing is 0 / -inf."""
    rng = np.random.default_rng(3)
    b, t, h, s = 3, 256, 8, 1024 if lens else 256
    q, k = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in ((b, t, h, 192), (b, s, h, 192)))
    v = jnp.asarray(rng.standard_normal((b, s, h, 128)), jnp.bfloat16)
    kv = None if lens is None else jnp.asarray(lens, jnp.int32)
    fn = lambda impl: jax.jit(lambda *a: naive_attention_lse(*a, 0.072, causal=causal, kv_len=kv, impl=impl))(q, k, v)
    (out, lse), (want, want_lse) = fn("cudnn"), fn("xla")
    out, lse, want, want_lse = (np.asarray(x, np.float32) for x in (out, lse, want, want_lse))
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(lse))
    assert rel_err(out, want) <= 2e-2
    seen = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-2, atol=2e-2)
