"""mla_verify: the custom call against its pure-JAX reference and a float64 numpy computation, on random trees and
ragged caches; clear errors; the model with kernels="ffi" equals kernels="xla". GPU tests (marked `gpu`) run the
CUDA kernels against the CPU kernel and float64 on the device machine (JAX_PLATFORMS=cuda,cpu)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from kdtree_jax import kernels
from kdtree_jax.kernels.mla_verify import (MAX_SPLITS, combine_lse, mla_prefix, mla_verify, mla_verify_ref,
                                          plan_splits, prefix_attention_ref, tree_attention_lse)
from kdtree_jax.kernels.marlin_moe import moe_experts_ref
from kdtree_jax.model import init_cache, prefill, step

from conftest import TOL, needs_gpu, rel_err

gpu = pytest.mark.gpu


def random_tree_mask(rng, n: int) -> np.ndarray:
    """Ancestor-or-self visibility [n, n] of a random tree: node 0 is the root, parent(i) is uniform in 0..i-1."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    vis = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


def make_inputs(rng, b, n, h, s, r=32, dr=16, dtype=jnp.float32, lens=None):
    """Fresh random queries and caches (never zeros), ragged cache lengths, random trees."""
    q = rng.standard_normal((b, n, h, r)).astype(np.float32)
    qp = rng.standard_normal((b, n, h, dr)).astype(np.float32)
    lat = rng.standard_normal((b, s, r)).astype(np.float32)
    pe = rng.standard_normal((b, s, dr)).astype(np.float32)
    if lens is None:
        lens = rng.integers(0, s - n + 1, size=b)
    mask = np.stack([random_tree_mask(rng, n) for _ in range(b)])
    arrays = [jnp.asarray(x, dtype) for x in (q, qp, lat, pe)]
    return arrays + [jnp.asarray(np.asarray(lens, np.int32)), jnp.asarray(mask)]


def attend64(q, qp, lat, pe, lens, mask, scale) -> np.ndarray:
    """The definition in float64 numpy: each row sees the prefix and its tree ancestors (clamped like the model)."""
    q, qp, lat, pe = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, qp, lat, pe))
    lens, mask = np.asarray(lens), np.asarray(mask)
    b, n, h, r = q.shape
    s = lat.shape[1]
    out = np.zeros((b, n, h, r))
    for bi in range(b):
        prefix, tree0 = min(max(int(lens[bi]), 0), s), min(max(int(lens[bi]), 0), s - n)
        for ni in range(n):
            slots = np.concatenate([np.arange(prefix), tree0 + np.flatnonzero(mask[bi, ni])])
            if slots.size == 0:
                continue
            sc = (q[bi, ni] @ lat[bi, slots].T + qp[bi, ni] @ pe[bi, slots].T) * scale  # [H, K]
            w = np.exp(sc - sc.max(axis=-1, keepdims=True))
            out[bi, ni] = (w / w.sum(axis=-1, keepdims=True)) @ lat[bi, slots]
    return out


def run(args, scale, device=None, **kw):
    if device is not None:
        args = jax.device_put(args, device)
    fn = jax.jit(lambda *a: mla_verify(*a, scale, **kw))
    return fn(*args)


# (B, N, H, S, R, dr, dtype): H 8 and 64, N 1 / 16 / 64 / 257, S from 1 to 8192, both head sizes, both dtypes
CASES = [
    (1, 1, 8, 1, 32, 16, jnp.float32),
    (3, 1, 8, 50, 32, 16, jnp.bfloat16),
    (2, 16, 8, 40, 32, 16, jnp.float32),
    (2, 16, 64, 300, 32, 16, jnp.bfloat16),
    (2, 64, 8, 200, 32, 16, jnp.float32),
    (1, 257, 8, 400, 32, 16, jnp.float32),
    (1, 257, 4, 300, 32, 16, jnp.bfloat16),
    (2, 1, 8, 8192, 512, 64, jnp.bfloat16),
    (1, 1, 64, 2048, 512, 64, jnp.float32),
    (2, 16, 64, 700, 512, 64, jnp.bfloat16),
    (1, 64, 8, 512, 512, 64, jnp.float32),
]


@pytest.mark.parametrize("b, n, h, s, r, dr, dtype", CASES)
def test_matches_float64_and_reference(b, n, h, s, r, dr, dtype):
    rng = np.random.default_rng(hash((b, n, h, s, r)) % 2**32)
    args = make_inputs(rng, b, n, h, s, r, dr, dtype)
    scale = float(rng.uniform(0.05, 0.2))
    out = run(args, scale)
    assert out.shape == (b, n, h, r) and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert rel_err(out, attend64(*args, scale)) <= TOL[dtype]
    assert rel_err(out, mla_verify_ref(*args, scale)) <= TOL[dtype]


def test_cache_edges_and_clamping():
    """Empty prefix, a full cache (len = S - N), and lengths past S - N (clamped the way the model's writes are)."""
    rng = np.random.default_rng(11)
    b, n, h, s = 5, 6, 8, 20
    args = make_inputs(rng, b, n, h, s, lens=[0, s - n, 3, s - 2, s + 5])
    out = run(args, 0.17)
    assert rel_err(out, attend64(*args, 0.17)) <= 1e-5
    assert rel_err(out, mla_verify_ref(*args, 0.17)) <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fully_masked_row_gives_zeros(dtype):
    """A padding row (nothing visible: empty prefix, empty tree row) is zeros, not NaN; the other rows are unharmed."""
    rng = np.random.default_rng(12)
    args = make_inputs(rng, 2, 4, 8, 16, dtype=dtype, lens=[0, 5])
    mask = np.asarray(args[5]).copy()
    mask[0, 2] = False
    mask[1, 3] = False  # row 1 still sees its 5-token prefix
    args[5] = jnp.asarray(mask)
    out = np.asarray(run(args, 0.2), np.float32)
    assert np.all(np.isfinite(out))
    assert np.all(out[0, 2] == 0.0)
    assert np.any(out[1, 3] != 0.0)
    assert rel_err(out, attend64(*args, 0.2)) <= TOL[dtype]



def prefix_lse64(q, qp, lat, pe, visible, scale):
    """(out, log-sum-exp) over slots < visible[b] in float64 numpy; rows seeing nothing: 0 and -inf."""
    q, qp, lat, pe = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, qp, lat, pe))
    b, n, h, r = q.shape
    out, lse = np.zeros((b, n, h, r)), np.full((b, n, h), -np.inf)
    for bi in range(b):
        k = min(max(int(visible[bi]), 0), lat.shape[1])
        if k == 0:
            continue
        sc = (np.einsum("nhr,sr->nhs", q[bi], lat[bi, :k]) + np.einsum("nhp,sp->nhs", qp[bi], pe[bi, :k])) * scale
        top = sc.max(-1, keepdims=True)
        p = np.exp(sc - top)
        out[bi] = np.einsum("nhs,sr->nhr", p, lat[bi, :k]) / p.sum(-1)[..., None]
        lse[bi] = top[..., 0] + np.log(p.sum(-1))
    return out, lse


def test_blocks_combined_by_log_sum_exp_equal_the_whole_attention():
    """What a sequence-sharded cache computes: the committed prefix cut into blocks (each attended alone, some
    empty), plus the new tokens through the tree mask, combined by log-sum-exp = mla_absorbed_attention."""
    rng = np.random.default_rng(7)
    b, n, h, s, blocks = 3, 5, 4, 48, 4
    q, qp, lat, pe, _, mask = make_inputs(rng, b, n, h, s)
    lens = jnp.asarray([0, 20, s - n], jnp.int32)
    want = np.asarray(mla_verify_ref(q, qp, lat, pe, lens, mask, 0.3))
    take = jax.vmap(lambda c, st: jax.lax.dynamic_slice_in_dim(c, st, n, axis=0))
    tree = tree_attention_lse(q, qp, take(lat, lens), take(pe, lens), mask, 0.3)
    width = s // blocks
    parts = [prefix_attention_ref(q, qp, lat[:, i * width:(i + 1) * width], pe[:, i * width:(i + 1) * width],
                                  jnp.clip(lens - i * width, 0, width), 0.3) for i in range(blocks)]
    out, lse = combine_lse(*parts, tree)
    assert rel_err(out, want) <= 1e-5
    whole, whole_lse = prefix_lse64(q, qp, lat, pe, lens, 0.3)
    got, got_lse = combine_lse(*parts)
    assert rel_err(got, whole) <= 1e-5
    assert np.all(np.isneginf(np.asarray(got_lse)[0])) and np.all(np.asarray(got)[0] == 0.0)  # row 0 sees nothing
    np.testing.assert_allclose(np.asarray(got_lse)[1:], whole_lse[1:], rtol=1e-5)


def test_impl_xla_is_the_reference_and_vmap_works():
    rng = np.random.default_rng(13)
    args = make_inputs(rng, 2, 3, 4, 12)
    np.testing.assert_array_equal(mla_verify(*args, 0.3, impl="xla"), mla_verify_ref(*args, 0.3))
    stacked = [jnp.stack([a, a]) for a in args]
    out = jax.vmap(lambda *a: mla_verify(*a, 0.3))(*stacked)
    assert rel_err(out[1], mla_verify_ref(*args, 0.3)) <= 1e-5


def test_plan_splits_fills_the_gpu_and_keeps_tiles_per_split():
    # the least waves x (FIXED_TILES + key tiles a block), then the fewest splits; blocks of 64 query rows
    assert plan_splits(1, 1, 8, 4096, sms=132) == 64  # 64 key tiles: one a block
    assert plan_splits(1, 9, 8, 4096, sms=132) == 32  # 2 row tiles; 64 rows of partials: 2 key tiles a split
    assert plan_splits(1, 17, 8, 4096, sms=132) == 32  # 3 row tiles: 64 splits would be two waves
    assert plan_splits(10, 1, 8, 4096, sms=132) == 13  # 10 x 13 = 130 blocks, 5 key tiles a block
    assert plan_splits(1, 65, 8, 4096, sms=132) == 13  # 9 row tiles x 13 = 117 blocks, 5 key tiles
    assert plan_splits(10, 17, 8, 4096, sms=132) == 4  # 30 row tiles x 4 = 120 blocks
    assert plan_splits(10, 65, 8, 4096, sms=132) == 4  # 90 row tiles: 3 waves of 16 tiles beat 1 of 64
    assert plan_splits(1, 1, 8, 131072, sms=132) == 128  # 2048 tiles: 16 a block
    assert plan_splits(1, 1, 64, 1024, sms=132) == 8
    assert plan_splits(8, 256, 64, 32768, sms=132) == 1  # 2048 row tiles already fill the GPU
    assert plan_splits(1, 64, 64, 32768, sms=132) == 2  # 64 row tiles x 2 = 128 blocks: one wave
    assert plan_splits(8, 1, 64, 32768, sms=132) == 16
    for b, n, h, s in ((1, 1, 8, 64), (3, 5, 8, 100), (1, 1, 8, 10**6), (2, 40, 16, 4096)):
        assert 1 <= plan_splits(b, n, h, s, sms=132) <= MAX_SPLITS


def _bad(**change):
    rng = np.random.default_rng(14)
    q, qp, lat, pe, lens, mask = make_inputs(rng, 2, 3, 4, 10)
    args = dict(q_nope_absorbed=q, q_pe=qp, latent_cache=lat, pe_cache=pe, cache_lens=lens, tree_mask=mask, scale=0.1)
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, match", [
    (dict(q_nope_absorbed=jnp.zeros((2, 3, 4))), ValueError, r"q_nope_absorbed must be \[B, N, H, R\]"),
    (dict(q_pe=jnp.zeros((2, 3, 5, 16))), ValueError, "q_pe has shape"),
    (dict(latent_cache=jnp.zeros((2, 10, 16))), ValueError, "latent_cache has shape"),
    (dict(pe_cache=jnp.zeros((3, 10, 16))), ValueError, "pe_cache has shape"),
    (dict(cache_lens=jnp.zeros((3,), jnp.int32)), ValueError, "cache_lens has shape"),
    (dict(tree_mask=jnp.zeros((2, 3, 4), bool)), ValueError, "tree_mask has shape"),
    (dict(latent_cache=jnp.zeros((2, 2, 32)), pe_cache=jnp.zeros((2, 2, 16))), ValueError, "fewer than the N"),
    (dict(q_nope_absorbed=jnp.zeros((2, 3, 4, 32), jnp.float16)), TypeError, "float32 or bfloat16"),
    (dict(latent_cache=jnp.zeros((2, 10, 32), jnp.bfloat16)), TypeError, "share one dtype"),
    (dict(cache_lens=jnp.zeros((2,), jnp.float32)), TypeError, "cache_lens must be integer"),
    (dict(tree_mask=jnp.zeros((2, 3, 3), jnp.int32)), TypeError, "tree_mask must be bool"),
    (dict(scale=jnp.float32(0.1)), TypeError, "scale must be a Python float"),
    (dict(q_pe=[[1.0]]), TypeError, "q_pe must be an array"),
])
def test_bad_input_is_a_clear_error(change, error, match):
    with pytest.raises(error, match=match):
        mla_verify(**_bad(**change))


def test_bad_impl_and_splits():
    with pytest.raises(ValueError, match="impl"):
        mla_verify(**_bad(), impl="triton")
    with pytest.raises(ValueError, match="num_splits"):
        mla_verify(**_bad(), num_splits=0)


@pytest.fixture(scope="module")
def tiny():
    cfg = kj.configs.tiny()
    return cfg, kj.init_params(cfg, jax.random.key(0))


def test_launch_flags_follow_the_environment(monkeypatch):
    """KDTREE_JAX_MLA_PDL: unset or 0 plain launches (FLAG_PLAIN), 1 programmatic dependents (0); others refused."""
    from kdtree_jax.kernels.mla_verify import FLAG_PLAIN, launch_flags
    monkeypatch.delenv("KDTREE_JAX_MLA_PDL", raising=False)
    assert launch_flags() == FLAG_PLAIN
    for value, want in (("0", FLAG_PLAIN), ("1", 0), (" 1 ", 0)):
        monkeypatch.setenv("KDTREE_JAX_MLA_PDL", value)
        assert launch_flags() == want
    monkeypatch.setenv("KDTREE_JAX_MLA_PDL", "yes")
    with pytest.raises(ValueError, match="KDTREE_JAX_MLA_PDL"):
        launch_flags()


def test_model_ffi_equals_xla_for_decode_and_tree_verify(tiny, monkeypatch):
    """kernels="ffi" routes the absorbed attention through mla_verify; same logits as kernels="xla"."""
    cfg, params = tiny
    if not hasattr(kernels, "marlin_moe"):  # only the attention is under test here
        monkeypatch.setattr(kernels, "marlin_moe", moe_experts_ref, raising=False)
    ffi = dataclasses.replace(cfg, kernels="ffi")
    rng = np.random.default_rng(15)
    prompt = jnp.asarray(rng.integers(0, 256, size=(2, 9)), jnp.int32)
    pre = prefill(params, cfg, prompt, jnp.array([9, 6], jnp.int32), init_cache(cfg, 2, 32))
    nxt = jnp.asarray(rng.integers(0, 256, size=(2, 1)), jnp.int32)
    decode = [jax.jit(step, static_argnums=1)(params, c, nxt, pre.cache).logits for c in (cfg, ffi)]
    assert rel_err(decode[1], decode[0]) <= 1e-5
    vis = jnp.asarray(np.stack([random_tree_mask(rng, 6) for _ in range(2)]))
    depths = jnp.sum(vis, axis=-1, dtype=jnp.int32) - 1
    nodes = jnp.asarray(rng.integers(0, 256, size=(2, 6)), jnp.int32)
    tree = [jax.jit(step, static_argnums=1)(params, c, nodes, pre.cache, depths, vis).logits for c in (cfg, ffi)]
    assert rel_err(tree[1], tree[0]) <= 1e-5


# ------------------------------------------------------------------------------------------------------------------
# GPU (the device machine): CUDA kernels against float64 and the CPU kernel
# ------------------------------------------------------------------------------------------------------------------


def _poison(shape):
    """Leave NaN in freshly freed device memory, which the next output buffers are likely to reuse."""
    junk = jnp.full(shape, jnp.nan, jnp.float32, device=jax.devices("gpu")[0])
    junk.block_until_ready()
    junk.delete()


# (B, N, H, S, splits): the bf16 K2 fast path in its regimes (decode N = 1, trees up to 257 nodes), S up to 70k,
# planned and forced key splits (more splits than tiles leaves some blocks empty).
GPU_CASES = [
    (1, 1, 8, 1, None),
    (1, 1, 8, 100, None),
    (4, 1, 64, 8192, None),
    (2, 1, 8, 70000, None),
    (3, 16, 8, 4096, None),
    (2, 64, 64, 2048, None),
    (1, 257, 8, 8192, None),
    (2, 16, 64, 3000, 1),
    (2, 16, 64, 3000, 7),
    (1, 1, 8, 600, 64),
    (1, 17, 8, 4096, None),  # one device's verify of 16 nodes
    (10, 1, 8, 4096, None),  # one device's decode at C = 10
    (10, 17, 8, 4096, None),  # one device's verify at C = 10
    (16, 4, 8, 2048, None),  # 16 batch rows of 32 query rows each
]


@gpu
@needs_gpu
@pytest.mark.parametrize("b, n, h, s, splits", GPU_CASES)
def test_gpu_fast_path_matches_float64_and_cpu_kernel(b, n, h, s, splits):
    rng = np.random.default_rng(hash((b, n, h, s, splits or 0)) % 2**32)
    args = make_inputs(rng, b, n, h, s, 512, 64, jnp.bfloat16)
    _poison((b, n * h, 2048))
    out = run(args, 0.13, device=jax.devices("gpu")[0], num_splits=splits)
    assert out.devices() == {jax.devices("gpu")[0]}
    host = np.asarray(out, np.float32)
    assert np.all(np.isfinite(host))
    assert rel_err(host, attend64(*args, 0.13)) <= 1e-2
    if b * n * h * s <= 4_000_000:  # the single-threaded CPU kernel is slow beyond this
        assert rel_err(host, run(args, 0.13, device=jax.devices("cpu")[0])) <= 1e-2


@gpu
@needs_gpu
@pytest.mark.parametrize("b, n, h, s, r, dr, dtype", [
    (2, 16, 8, 300, 32, 16, jnp.float32),
    (2, 5, 4, 64, 32, 16, jnp.bfloat16),
    (1, 16, 64, 2048, 512, 64, jnp.float32),
])
def test_gpu_generic_path_matches_float64(b, n, h, s, r, dr, dtype):
    rng = np.random.default_rng(hash((b, n, h, s, r)) % 2**32)
    args = make_inputs(rng, b, n, h, s, r, dr, dtype)
    _poison((b, n * h, r))
    out = run(args, 0.11, device=jax.devices("gpu")[0])
    assert rel_err(out, attend64(*args, 0.11)) <= TOL[dtype]


@gpu
@needs_gpu
@pytest.mark.parametrize("r, dr", [(512, 64), (32, 16)])
def test_gpu_fully_masked_rows_and_clamping(r, dr):
    rng = np.random.default_rng(16)
    b, n, h, s = 4, 8, 8, 300
    args = make_inputs(rng, b, n, h, s, r, dr, jnp.bfloat16, lens=[0, s - n, 17, s + 9])
    mask = np.asarray(args[5]).copy()
    mask[0, 3] = False
    args[5] = jnp.asarray(mask)
    _poison((b, n * h, r))
    out = np.asarray(run(args, 0.2, device=jax.devices("gpu")[0]), np.float32)
    assert np.all(np.isfinite(out)) and np.all(out[0, 3] == 0.0)
    assert rel_err(out, attend64(*args, 0.2)) <= 1e-2


@gpu
@needs_gpu
@pytest.mark.parametrize("b, n, h, s, splits", [(1, 1, 64, 16384, None), (8, 1, 64, 4096, None),
                                                (2, 17, 64, 2048, None), (3, 4, 8, 300, 64)])
def test_gpu_prefix_attention_with_lse_matches_float64(b, n, h, s, splits):
    """mla_prefix on the CUDA fast path (the kernel's partials and stats combined in JAX) = float64, output and
    log-sum-exp, with blocks seen whole, in part and not at all (the rows of a sequence-sharded cache)."""
    rng = np.random.default_rng(hash((b, n, h, s)) % 2**32)
    q, qp, lat, pe, _, _ = make_inputs(rng, b, n, h, s, 512, 64, jnp.bfloat16)
    visible = np.array([0, s, s + 50, 77, 1, s // 2, 5, s - 1][:b], np.int32)
    _poison((b, 16, n * h, 512))
    gpu0 = jax.devices("gpu")[0]
    args = [jax.device_put(x, gpu0) for x in (q, qp, lat, pe, jnp.asarray(visible))]
    out, lse = jax.jit(lambda *a: mla_prefix(*a, 0.07, num_splits=splits))(*args)
    want, want_lse = prefix_lse64(q, qp, lat, pe, visible, 0.07)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(lse))
    assert rel_err(out, want) <= 1e-2
    seen = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=2e-3, atol=2e-2)
