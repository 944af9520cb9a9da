"""draft_attention: the DFlash drafter's block attention as one custom call (C++ on CPU; CUDA, marked gpu) against a
float64 NumPy softmax written here and against the pure-JAX reference, on fresh random inputs with context lengths
of 0, inside and past the cache; the drafter's block with it; greedy ddtree with it on; its argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_gpu, rel_err

import kdtree_jax as kj
from kdtree_jax.kernels.draft_attention import draft_attention, draft_attention_ref, plan_splits

TOL = {"float32": 2e-5, "bfloat16": 2e-2}  # relative error bound by dtype


def _inputs(rng, b, t, h, g, d, s, dtype, device=None):
    """Random q, ck, cv, kb, vb (the caches past the lengths random too: they must not be read) and lengths of 0,
    inside the cache, S, and past S (clamped)."""
    put = (lambda x: jax.device_put(x, device)) if device is not None else jnp.asarray
    arrays = [put(jnp.asarray(rng.standard_normal(shape), dtype)) for shape in
              ((b, t, h, d), (b, s, g, d), (b, s, g, d), (b, t, g, d), (b, t, g, d))]
    lengths = np.asarray([0, s, s + 5, *rng.integers(1, s, size=max(b - 3, 0))][:b], np.int32)
    return (*arrays, put(jnp.asarray(lengths)))


def _numpy(q, ck, cv, kb, vb, lengths, scale):
    """float64: each query row over its kv head's context below the length and the whole block."""
    q, ck, cv, kb, vb = (np.asarray(a, np.float64) for a in (q, ck, cv, kb, vb))
    b, t, h, d = q.shape
    s, g = ck.shape[1], ck.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        n = int(np.clip(lengths[r], 0, s))
        for head in range(h):
            kv = head // (h // g)
            keys = np.concatenate([ck[r, :n, kv], kb[r, :, kv]])
            values = np.concatenate([cv[r, :n, kv], vb[r, :, kv]])
            scores = q[r, :, head] @ keys.T * scale  # [T, keys]
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[r, :, head] = (p / p.sum(axis=1, keepdims=True)) @ values
    return out


def _check(args, scale, dtype, **kw):
    got = jax.jit(lambda *a: draft_attention(*a, scale, **kw))(*args)
    assert got.shape == args[0].shape and got.dtype == dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()
    want = _numpy(*args, scale)
    assert rel_err(np.asarray(got, np.float64), want) <= TOL[jnp.dtype(dtype).name]
    ref = jax.jit(lambda *a: draft_attention_ref(*a, scale))(*args)
    assert rel_err(np.asarray(got, np.float64), np.asarray(ref, np.float64)) <= TOL[jnp.dtype(dtype).name]
    return got


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("b, t, h, g, d, s", [(4, 8, 8, 1, 112, 40), (3, 4, 8, 2, 16, 24), (1, 3, 6, 3, 20, 9),
                                               (5, 8, 4, 4, 8, 70)])
def test_cpu_kernel_equals_float64_softmax(dtype, b, t, h, g, d, s):
    """The C++ handler on random inputs: one and several kv heads, head dims not a power of two, lengths 0, S and
    past S; within the dtype's bound of a float64 softmax and of the reference."""
    rng = np.random.default_rng(b * 1000 + h * 10 + d)
    _check(_inputs(rng, b, t, h, g, d, s, dtype), d ** -0.5, dtype)


def test_cpu_kernel_ignores_the_cache_past_the_length():
    """Values past lengths[b] (here NaN) never reach the output; changing a value inside the length does."""
    rng = np.random.default_rng(3)
    q, ck, cv, kb, vb, lengths = _inputs(rng, 3, 4, 4, 2, 16, 20, jnp.float32)
    lengths = jnp.asarray([5, 0, 12], jnp.int32)
    run = jax.jit(lambda *a: draft_attention(*a, 0.25))
    base = run(q, ck, cv, kb, vb, lengths)
    poisoned = [c.at[:, 12:].set(jnp.nan).at[1].set(jnp.nan).at[0, 5:].set(jnp.nan) for c in (ck, cv)]
    np.testing.assert_array_equal(np.asarray(run(q, *poisoned, kb, vb, lengths)), np.asarray(base))
    moved = run(q, ck, cv.at[2, 11].add(1.0), kb, vb, lengths)
    assert rel_err(moved[2], base[2]) > 1e-4 and np.array_equal(np.asarray(moved[:2]), np.asarray(base[:2]))


def test_drafter_block_with_the_custom_call():
    """The drafter's whole block (`drafter.draft`) with its attention as the custom call equals the XLA one, and
    greedy ddtree with ffi_ops draft_attention gives the AR tokens on the embedded model."""
    import dataclasses

    from kdtree_jax.drafter import append_context, draft, init_draft_cache

    model = kj.load("builtin")
    cfg, params, drafter = model.cfg, model.params, model.drafter
    rng = np.random.default_rng(7)
    hidden = jnp.asarray(rng.standard_normal((cfg.num_hidden_layers, 2, 9, cfg.hidden_size)), jnp.float32)
    cache = append_context(drafter, init_draft_cache(drafter.cfg, 2, 32), hidden.astype(cfg.jnp_dtype),
                           jnp.zeros((2,), jnp.int32))
    lengths, bonus = jnp.asarray([9, 4], jnp.int32), jnp.asarray([65, 101], jnp.int32)
    want, got = (jax.jit(lambda c, impl=impl: draft(drafter, params, c, lengths, bonus, attention=impl))(cache)
                 for impl in ("xla", "ffi"))
    assert np.isfinite(np.asarray(got)).all() and rel_err(got, want) <= TOL[cfg.jnp_dtype.name]
    ids = [model.tokenizer.encode("def parse(line):\n    "), model.tokenizer.encode("import os\n")]
    on = dataclasses.replace(cfg, kernels="ffi", ffi_ops=(*cfg.ffi_ops, "draft_attention"))
    ar = kj.generate(params, cfg, ids, max_new_tokens=24, method="ar").tokens
    out = kj.generate(params, on, ids, max_new_tokens=24, method="ddtree", drafter=drafter, budget=16)
    assert out.tokens == ar and out.stats["tau"] > 1.0


def test_arguments_are_checked(monkeypatch):
    rng = np.random.default_rng(0)
    q, ck, cv, kb, vb, lengths = _inputs(rng, 2, 4, 4, 2, 8, 10, jnp.float32)
    with pytest.raises(ValueError, match="G dividing H"):
        draft_attention(q, ck[:, :, :1].repeat(3, axis=2), cv[:, :, :1].repeat(3, axis=2), kb[:, :, :1].repeat(3, 2),
                        vb[:, :, :1].repeat(3, 2), lengths, 0.5)
    with pytest.raises(ValueError, match="expected q"):
        draft_attention(q, ck, cv, kb[:, :3], vb, lengths, 0.5)
    with pytest.raises(TypeError, match="share one dtype"):
        draft_attention(q, ck.astype(jnp.bfloat16), cv, kb, vb, lengths, 0.5)
    with pytest.raises(TypeError, match="int32"):
        draft_attention(q, ck, cv, kb, vb, lengths.astype(jnp.int64 if jax.config.x64_enabled else jnp.float32), 0.5)
    with pytest.raises(ValueError, match="scale"):
        draft_attention(q, ck, cv, kb, vb, lengths, float("nan"))
    with pytest.raises(ValueError, match="impl"):
        draft_attention(q, ck, cv, kb, vb, lengths, 0.5, impl="cuda")
    with pytest.raises(ValueError, match="num_splits"):
        draft_attention(q, ck, cv, kb, vb, lengths, 0.5, num_splits=0)
    with pytest.raises(TypeError, match="mma"):
        draft_attention(q, ck, cv, kb, vb, lengths, 0.5, mma="yes")
    monkeypatch.setenv("KDTREE_JAX_DRAFT_MMA", "yes")
    with pytest.raises(ValueError, match="KDTREE_JAX_DRAFT_MMA must be 0 or 1"):
        draft_attention(q, ck, cv, kb, vb, lengths, 0.5)


def _cuda_lowering(dtype, d, **kw) -> str:
    """The StableHLO of one call lowered for CUDA (no GPU needed to lower)."""
    q, kb = jax.ShapeDtypeStruct((1, 4, 4, d), dtype), jax.ShapeDtypeStruct((1, 4, 2, d), dtype)
    c, lengths = jax.ShapeDtypeStruct((1, 32, 2, d), dtype), jax.ShapeDtypeStruct((1,), jnp.int32)
    fn = jax.jit(lambda *a: draft_attention(*a, 0.25, **kw))
    return fn.trace(q, c, c, kb, kb, lengths).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype, d, kw, env, expect", [
    (jnp.bfloat16, 16, {}, None, "mma = 1"),         # the default: the tensor cores where they apply ...
    (jnp.float32, 16, {}, None, None),               # ... else XLA's operations
    (jnp.bfloat16, 20, {}, None, None),
    (jnp.bfloat16, 16, {"mma": False}, None, "mma = 0"),  # the CUDA-core kernel only when asked for
    (jnp.float32, 16, {"mma": False}, None, "mma = 0"),
    (jnp.float32, 16, {"mma": True}, None, "mma = 1"),    # (the handler takes the CUDA cores for float32)
    (jnp.bfloat16, 16, {}, "0", "mma = 0"),
    (jnp.float32, 16, {}, "1", "mma = 1"),
    (jnp.bfloat16, 16, {"mma": True}, "0", "mma = 1"),    # the argument over the variable
])
def test_cuda_lowering_picks_the_kernel(monkeypatch, dtype, d, kw, env, expect):
    if env is None:
        monkeypatch.delenv("KDTREE_JAX_DRAFT_MMA", raising=False)
    else:
        monkeypatch.setenv("KDTREE_JAX_DRAFT_MMA", env)
    text = _cuda_lowering(dtype, d, **kw)
    if expect is None:
        assert "kdtree_draft_attention" not in text and "dot_general" in text
    else:
        assert "kdtree_draft_attention" in text and expect in text


def test_plan_splits():
    """Two blocks a multiprocessor at one row, each split at least one tile of keys, one split when the rows fill
    the GPU."""
    assert plan_splits(1, 8, 8, 1, 4352) == 137  # ceil(4360 / 32) tiles, below 2 x 132 blocks
    assert plan_splits(10, 8, 8, 1, 4352) == 27
    assert plan_splits(1, 8, 8, 1, 40) == 2
    assert plan_splits(300, 8, 64, 8, 4352) == 1


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mma", [False, True], ids=["cores", "mma"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("b, t, h, g, d, s, splits", [(1, 8, 8, 1, 112, 4352, None), (10, 8, 8, 1, 112, 4352, None),
                                                       (2, 8, 64, 8, 112, 1000, None), (3, 4, 8, 2, 16, 100, 1),
                                                       (3, 4, 8, 2, 16, 100, 7), (2, 5, 130, 1, 128, 50, None),
                                                       (2, 3, 6, 3, 20, 90, 5), (2, 8, 8, 1, 112, 300, 256)])
def test_gpu_kernel_equals_float64_softmax(mma, dtype, b, t, h, g, d, s, splits):
    """The CUDA kernel: one device's share of the K2.5-DFlash drafter at batch 1 and 10 (8 heads, 1 kv head of
    112, a 4k context), the replicated one (64 / 8), one and several splits, more than 64 rows a kv head (130
    heads: three row tiles), head dim 128; a head dim of 20 (bf16 rows not a multiple of 16 bytes: the
    element-at-a-time loads), 256 splits (most of them empty, the combine's groups uneven); lengths 0, S and past
    S. Each on the CUDA cores and with mma=True: the tensor-core kernel for bf16 with a head dim a multiple of 16,
    the CUDA cores for the others (float32, the head dim of 20)."""
    rng = np.random.default_rng(b + h + d)
    args = _inputs(rng, b, t, h, g, d, s, dtype, device=jax.devices("gpu")[0])
    _check(args, d ** -0.5, dtype, num_splits=splits, mma=mma)


def test_benchmark_smoke(tmp_path):
    """benchmarks/draft_attention.py --small runs on the CPU (the C++ handler) and writes its table, numbers and
    plot: XLA's row first, then the custom call at each split count asked for."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import draft_attention as bench
    assert bench.main(["--small", "--out", str(tmp_path), "--batches", "2", "--shapes", "sharded",
                       "--splits", "3"]) == 0
    saved = json.load(open(tmp_path / "draft_attention.json"))
    assert [(r["form"], r["splits"]) for r in saved["rows"]] == [("xla", None), ("ffi", 3)]
    # the context's keys and values below the length (64 + the block's 8), the queries and the output; f32
    assert saved["rows"][0]["bytes"] == 4 * 2 * 112 * (2 * 1 * (64 + 8) + 2 * 8 * 8)
    assert (tmp_path / "draft_attention.png").stat().st_size > 0
    assert "| sharded | 8 / 1, 112 | 2 | ffi | 3 |" in (tmp_path / "draft_attention.md").read_text()
