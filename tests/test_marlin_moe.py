"""marlin_moe: the W4A16 MoE custom call against its pure-JAX reference and a float64 numpy computation, on fresh
random INT4 experts and routings (uneven ones included); the routing helper `moe_align`; clear errors; expert
parallelism in shard_map; the model with kernels="ffi" equals kernels="xla". GPU tests (marked `gpu`) run the CUDA
kernels, K2-sized experts included, against float64, the CPU kernel and the reference on the device machine
(JAX_PLATFORMS=cuda,cpu)."""

import dataclasses
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from kdtree_jax.kernels import _registry
from kdtree_jax.kernels.marlin_moe import (FLAG_DEEP, FLAG_FINE, FLAG_L2_256, FLAG_PERSIST, FLAG_SERIAL, FLAG_SYNC,
                                           FLAG_TILE, FLAG_X_L1, FLAG_FUSED, FLAG_FUSED_ONE, FLAG_GEMV, NARROW_SLOTS,
                                           STREAM_FLAGS, gemv_default, gemv_eligible,
                                           TILE_128_MIN_M, TILE_FLAGS, TILE_MIN_M,
                                           _cuda_call, block_size, choose_block_m, choose_path, marlin_moe,
                                           marlin_moe_ref, max_blocks, moe_align, moe_experts_ref, tile_eligible)
from kdtree_jax.model import forward
from kdtree_jax.quant import Int4Array, quantize_int4, unpack_int4
from kdtree_jax.sharding import moe_expert_parallel

from conftest import TOL, needs_gpu, rel_err

gpu = pytest.mark.gpu


def make_experts(rng, e, d, f, group=32):
    """Random float experts quantized to INT4 (gate, up [E, F, D], down [E, D, F])."""
    gate, up = (quantize_int4(rng.standard_normal((e, f, d)) / np.sqrt(d), group) for _ in range(2))
    down = quantize_int4(rng.standard_normal((e, d, f)) / np.sqrt(f), group)
    return gate, up, down


def make_routing(rng, m, k, e, kind="uniform"):
    """ids int32 [M, k] and weights float32 [M, k] (positive, like the router's).

    uniform: k distinct experts per token; one_expert: every token's first slot on expert 1; few: only experts 0
    and e - 1 get tokens; sentinel: about a third of the slots sent to no expert (ids >= E, as expert parallelism
    passes them); repeat: a token may pick one expert twice.
    """
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)])
    if kind == "one_expert":
        ids[:, 0] = 1
        ids[:, 1:] = np.where(ids[:, 1:] == 1, 0, ids[:, 1:])
    elif kind == "few":
        ids = rng.choice([0, e - 1], size=(m, k))
    elif kind == "sentinel":
        ids = np.where(rng.random((m, k)) < 0.35, e + rng.integers(0, 3, size=(m, k)), ids)
    elif kind == "repeat":
        ids = rng.integers(0, e, size=(m, k))
    weights = rng.uniform(0.05, 1.0, size=(m, k))
    return jnp.asarray(ids, jnp.int32), jnp.asarray(weights, jnp.float32)


_DEQUANT_CACHE: dict = {}  # (id of the packed array, expert) -> exact float32 weights (K2-sized tests reuse them)


def _dequant64(w: Int4Array, ex: int) -> np.ndarray:
    key = (id(w.packed), ex)
    if key not in _DEQUANT_CACHE:
        if len(_DEQUANT_CACHE) > 64:
            _DEQUANT_CACHE.clear()
        q = unpack_int4(np.asarray(w.packed[ex])).astype(np.float32)  # [out, in]
        s = np.asarray(w.scale[ex]).astype(np.float32)  # [out, in / group]
        _DEQUANT_CACHE[key] = (w.packed, q * np.repeat(s, q.shape[1] // s.shape[1], axis=1))  # q * s: exact
    return _DEQUANT_CACHE[key][1].astype(np.float64)


def experts64(x, ids, weights, gate, up, down, rows=None) -> np.ndarray:
    """The definition in float64 numpy (for the token rows `rows`, default all)."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
    if rows is not None:
        x, ids, weights = x[rows], ids[rows], weights[rows]
    out = np.zeros(x.shape)
    for ex in np.unique(ids):
        if not 0 <= ex < gate.shape[0]:
            continue
        g, u, dn = _dequant64(gate, ex), _dequant64(up, ex), _dequant64(down, ex)
        tok, slot = np.nonzero(ids == ex)
        a = x[tok] @ g.T
        h = a / (1.0 + np.exp(-a)) * (x[tok] @ u.T)
        np.add.at(out, tok, weights[tok, slot][:, None] * (h @ dn.T))
    return out


_ref = jax.jit(marlin_moe_ref)


def run(x, ids, weights, experts, device=None, **kw):
    args = (x, ids, weights, *experts)
    if device is not None:
        args = jax.device_put(args, device)
    return jax.jit(lambda *a: marlin_moe(*a, **kw))(*args)


# ------------------------------------------------------------------------------------------------------------------
# Routing helper
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m, k, e, bm, kind", [
    (1, 8, 384, 8, "uniform"), (5, 3, 8, 4, "sentinel"), (64, 8, 16, 8, "uniform"), (300, 4, 16, 16, "one_expert"),
    (40, 2, 12, 32, "few"), (33, 6, 7, 8, "repeat"), (7, 8, 384, 32, "sentinel"),
])
def test_moe_align_sorts_pads_and_labels_blocks(m, k, e, bm, kind):
    rng = np.random.default_rng(hash((m, k, e, bm, kind)) % 2**32)
    ids, _ = make_routing(rng, m, k, e, kind)
    if kind == "sentinel":
        ids = ids.at[0, 0].set(-3)  # negative ids are no expert too
    sorted_slots, block_experts = (np.asarray(a) for a in jax.jit(moe_align, static_argnums=(1, 2))(ids, e, bm))
    nb = max_blocks(m * k, e, bm)
    assert sorted_slots.shape == (nb * bm,) and block_experts.shape == (nb,)
    flat = np.asarray(ids).reshape(-1)
    want, labels = [], []
    for ex in range(e):
        slots = np.flatnonzero(flat == ex).tolist()
        pad = -len(slots) % bm
        want += slots + [m * k] * pad
        labels += [ex] * ((len(slots) + pad) // bm)
    assert len(labels) <= nb  # the static bound holds (the helper would drop slots otherwise)
    np.testing.assert_array_equal(sorted_slots[:len(want)], want)
    np.testing.assert_array_equal(block_experts, labels + [-1] * (nb - len(labels)))


def test_block_size_and_bound():
    assert block_size(1, 8, 384) == 8 and block_size(345, 8, 384) == 8  # vLLM's rule: M k / E / bm < 0.9
    assert block_size(346, 8, 384) == 16 and block_size(1024, 8, 384) == 32 and block_size(4096, 8, 384) == 32
    assert max_blocks(8, 384, 8) == 8  # M = 1, top-8: one block per touched expert
    assert max_blocks(32768, 384, 32) == (32768 + 384 * 31) // 32


def test_choose_path_by_slots_per_expert_and_m():
    """The stream path's block_size below the narrow tiles' range of slots per expert (M k / E), the tile path's
    narrow 32-slot tiles (FLAG_TILE) inside it, the 64-slot tiles from TILE_MIN_M tokens past it and 128 from
    TILE_128_MIN_M, where the shapes allow the tile path (bf16, D % 256, F % 128, group 32); e is the model's
    experts, so a shard's call picks what the whole model's density picks."""
    assert tile_eligible(7168, 2048, 32, 32, jnp.bfloat16) and tile_eligible(256, 128, 32, 32, jnp.bfloat16)
    assert not tile_eligible(7168, 2048, 32, 32, jnp.float32) and not tile_eligible(128, 128, 32, 32, jnp.bfloat16)
    assert not tile_eligible(7168, 2048, 64, 32, jnp.bfloat16) and not tile_eligible(256, 64, 32, 32, jnp.bfloat16)
    lo, hi = NARROW_SLOTS
    first, last = math.ceil(lo * 384 / 8), math.floor(hi * 384 / 8)  # K2: top-8 of 384 -> M = 384 .. 1,152
    assert (first, last) == (384, 1152)
    for m in (1, 16, 64, 256, first - 1):
        assert choose_path(m, 8, 384, True) == (block_size(m, 8, 384), STREAM_FLAGS)
        assert choose_block_m(m, 8, 384, True) == block_size(m, 8, 384)
    for m in (first, 512, 1024, last):
        assert choose_path(m, 8, 384, True) == (32, TILE_FLAGS | FLAG_TILE)
        assert choose_path(m, 8, 384, False) == (block_size(m, 8, 384), STREAM_FLAGS)  # no tile path: stream
    assert choose_path(last + 1, 8, 384, True) == (64, TILE_FLAGS)
    assert choose_path(TILE_128_MIN_M - 1, 8, 384, True) == (64, TILE_FLAGS)
    assert choose_path(TILE_128_MIN_M, 8, 384, True) == (128, TILE_FLAGS) == choose_path(8192, 8, 384, True)
    assert choose_path(TILE_128_MIN_M, 8, 48 * 8 * 4, True)[0] == 128  # 10.7 slots per expert but M past the limit
    assert choose_block_m(4096, 8, 384, False) == block_size(4096, 8, 384) == 32
    # sparse routing (2.7 slots per expert, below the narrow range) from TILE_MIN_M tokens: the 64-slot tiles
    assert choose_path(TILE_MIN_M, 8, 1536, True) == (64, TILE_FLAGS)
    assert choose_path(TILE_MIN_M - 1, 8, 1536, True) == (block_size(TILE_MIN_M - 1, 8, 1536), STREAM_FLAGS)
    # a tiny config (top-2 of 8): the same density rule, and the narrow range never takes M past TILE_128_MIN_M
    assert choose_path(32, 2, 8, True) == (32, TILE_FLAGS | FLAG_TILE)
    assert choose_path(16, 2, 8, True) == (8, STREAM_FLAGS)
    # one shard of an 8-way mesh (48 of 384 experts) at M <= 8: about one used token block per local expert touched,
    # at most PERSIST_USED of max_blocks, so the stream path's persistent grid; not from M = 16, nor on all 384
    for m, persist in ((1, True), (4, True), (8, True), (16, False), (64, False)):
        want = STREAM_FLAGS | (FLAG_PERSIST if persist else 0)
        assert choose_path(m, 8, 384, True, local=48) == (block_size(m, 8, 384), want), m
    assert choose_path(1, 8, 384, True) == (8, STREAM_FLAGS)
    for local in (384, 96, 48, 24, 12):  # never again past M = 12, whatever the shard (max_blocks grows with M)
        for tile_ok in (True, False):
            for m in range(13, 4097):
                assert not choose_path(m, 8, 384, tile_ok, local=local)[1] & FLAG_PERSIST, (local, tile_ok, m)


@pytest.mark.parametrize("m, dtype, flags, want", [
    (16, jnp.bfloat16, None, (32, TILE_FLAGS | FLAG_TILE)),  # 8 slots per expert: the narrow tiles, their flags
    (16, jnp.bfloat16, FLAG_DEEP, (32, FLAG_DEEP | FLAG_TILE)),  # given flags, the chosen path kept
    (8, jnp.bfloat16, FLAG_DEEP | FLAG_TILE, (8, FLAG_DEEP)),  # 4 slots: the stream path, a given FLAG_TILE dropped
    (16, jnp.float32, None, (16, STREAM_FLAGS)),  # no tile path for float32: the stream path's block_size
])
def test_the_chosen_path_reaches_the_cuda_call(monkeypatch, m, dtype, flags, want):
    """block_m left to `choose_path`: the CUDA call gets the chosen block_m and FLAG_TILE bit with the other flags
    as given (seen when the call is traced, on any platform), and the result is the reference's."""
    mm = importlib.import_module("kdtree_jax.kernels.marlin_moe")
    seen, real = [], mm._cuda_call
    monkeypatch.setattr(mm, "_cuda_call", lambda a, *dims: seen.append(dims[-2:]) or real(a, *dims))
    rng = np.random.default_rng(m + 5)
    experts = make_experts(rng, 4, 256, 128)
    ids, weights = make_routing(rng, m, 2, 4)
    x = jnp.asarray(rng.standard_normal((m, 256)), dtype)
    out = run(x, ids, weights, experts, flags=flags)
    assert seen and set(seen) == {want}, seen
    ref = marlin_moe_ref(x, ids, weights, *experts)
    assert np.all(np.isfinite(np.asarray(out, np.float32))) and rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("env, flags, want", [("1", None, 0), ("0", None, None), (None, None, None), ("1", 0, None),
                                               ("0", FLAG_FUSED, 0), ("one", None, FLAG_FUSED_ONE),
                                               ("0", FLAG_FUSED | FLAG_FUSED_ONE, FLAG_FUSED_ONE)])
def test_the_fused_path_reaches_its_call_where_chosen(monkeypatch, env, flags, want):
    """The fused decode path runs where KDTREE_JAX_MOE_FUSED=1 (or "one": one block an SM) leaves the flags to
    `marlin_moe`, or where FLAG_FUSED is given: the CUDA branch traces `_fused_call`, not `_cuda_call`, with
    FLAG_FUSED_ONE where chosen (seen when traced, on any platform; the CPU runs its own handler, the same
    function), and the result is the reference's. want: the FLAG_FUSED_ONE bit the call gets, None: no fused call."""
    mm = importlib.import_module("kdtree_jax.kernels.marlin_moe")
    seen, real = [], mm._fused_call
    monkeypatch.setattr(mm, "_fused_call", lambda *a: seen.append(a[1:]) or real(*a))
    if env is None:
        monkeypatch.delenv("KDTREE_JAX_MOE_FUSED", raising=False)
    else:
        monkeypatch.setenv("KDTREE_JAX_MOE_FUSED", env)
    rng = np.random.default_rng(91)
    experts = make_experts(rng, 4, 512, 512)
    ids, weights = make_routing(rng, 3, 2, 4, "sentinel")
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    out = run(x, ids, weights, experts, flags=flags)
    assert bool(seen) == (want is not None), seen
    assert all(dims[:5] == (3, 512, 2, 512, jnp.bfloat16) and dims[5] & FLAG_FUSED_ONE == want for dims in seen), seen
    assert rel_err(out, marlin_moe_ref(x, ids, weights, *experts)) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("value", ["true", "2", "on", "One"])
def test_an_unknown_fused_setting_is_refused(monkeypatch, value):
    """KDTREE_JAX_MOE_FUSED takes 0, 1 or one: anything else is an error naming the variable, not silently off."""
    monkeypatch.setenv("KDTREE_JAX_MOE_FUSED", value)
    rng = np.random.default_rng(5)
    experts = make_experts(rng, 4, 512, 512)
    ids, weights = make_routing(rng, 2, 2, 4)
    x = jnp.asarray(rng.standard_normal((2, 512)), jnp.bfloat16)
    with pytest.raises(ValueError, match="KDTREE_JAX_MOE_FUSED must be 0"):
        marlin_moe(x, ids, weights, *experts)


@pytest.mark.parametrize("m, k, d, f, dtype, group, match", [
    (1, 8, 256, 512, jnp.bfloat16, 32, "D and F multiples of 512"),  # D = 256
    (1, 8, 512, 768, jnp.bfloat16, 32, "F = 768"),
    (1, 8, 512, 512, jnp.float32, 32, "float32"),
    (1, 8, 512, 512, jnp.bfloat16, 64, "group size 32"),
    (33, 8, 512, 512, jnp.bfloat16, 32, "M k = 264"),  # past FUSED_MAX_SLOTS
    (1, 2, 8704, 512, jnp.bfloat16, 32, "up to 8192"),
])
def test_fused_flag_on_shapes_it_cannot_take_is_refused(m, k, d, f, dtype, group, match):
    rng = np.random.default_rng(3)
    experts = make_experts(rng, 4, d, f, group)
    ids, weights = make_routing(rng, m, k, 4, "repeat")
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    with pytest.raises(ValueError, match=match):
        marlin_moe(x, ids, weights, *experts, flags=FLAG_FUSED)


def test_fused_path_is_eligible_only_where_its_kernel_runs():
    mm = importlib.import_module("kdtree_jax.kernels.marlin_moe")
    assert mm.fused_eligible(1, 8, 7168, 2048, 32, 32, jnp.bfloat16)  # K2, one device's decode
    assert mm.fused_eligible(32, 8, 7168, 2048, 32, 32, jnp.bfloat16)  # 256 slots: the kernel's limit
    assert not mm.fused_eligible(33, 8, 7168, 2048, 32, 32, jnp.bfloat16)
    assert not mm.fused_eligible(0, 8, 7168, 2048, 32, 32, jnp.bfloat16)
    assert not mm.fused_eligible(1, 8, 7168, 2048, 32, 32, jnp.float32)
    assert not mm.fused_eligible(1, 8, 7168 + 256, 2048, 32, 32, jnp.bfloat16)
    assert not mm.fused_eligible(1, 8, 7168, 8192 + 512, 32, 32, jnp.bfloat16)


# ------------------------------------------------------------------------------------------------------------------
# The custom call on CPU
# ------------------------------------------------------------------------------------------------------------------

# (M, k, E, D, F, dtype, routing): M from 1 to 2048, tiny experts, both dtypes, uneven routings
CASES = [
    (1, 4, 16, 64, 32, jnp.float32, "uniform"),
    (1, 8, 8, 128, 64, jnp.bfloat16, "uniform"),
    (3, 2, 4, 64, 96, jnp.float32, "sentinel"),
    (17, 4, 16, 256, 128, jnp.bfloat16, "one_expert"),
    (64, 4, 16, 64, 32, jnp.float32, "few"),
    (64, 8, 12, 128, 64, jnp.bfloat16, "sentinel"),
    (129, 3, 6, 64, 64, jnp.float32, "repeat"),
    (2048, 4, 16, 64, 32, jnp.float32, "uniform"),
    (2048, 2, 8, 64, 32, jnp.bfloat16, "one_expert"),
]


@pytest.mark.parametrize("m, k, e, d, f, dtype, kind", CASES)
def test_matches_float64_and_reference(m, k, e, d, f, dtype, kind):
    rng = np.random.default_rng(hash((m, k, e, d, f, kind)) % 2**32)
    experts = make_experts(rng, e, d, f)
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    ids, weights = make_routing(rng, m, k, e, kind)
    out = run(x, ids, weights, experts)
    assert out.shape == (m, d) and out.dtype == dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert rel_err(out, experts64(x, ids, weights, *experts)) <= TOL[dtype]
    assert rel_err(out, _ref(x, ids, weights, *experts)) <= TOL[dtype]


@pytest.mark.parametrize("group", [8, 16, 64])
def test_other_group_sizes(group):
    rng = np.random.default_rng(group)
    experts = make_experts(rng, 8, 128, 64, group)
    x = jnp.asarray(rng.standard_normal((9, 128)), jnp.float32)
    ids, weights = make_routing(rng, 9, 3, 8)
    assert rel_err(run(x, ids, weights, experts), experts64(x, ids, weights, *experts)) <= 1e-5


def test_no_routed_slot_gives_zeros():
    """Every slot sent to no expert (a shard with nothing to do), and k = 0, give exact zeros."""
    rng = np.random.default_rng(3)
    experts = make_experts(rng, 4, 64, 32)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    ids = jnp.full((5, 2), 4, jnp.int32)
    out = run(x, ids, jnp.ones((5, 2), jnp.float32), experts)
    assert np.all(np.asarray(out, np.float32) == 0.0)
    empty = marlin_moe(x, jnp.zeros((5, 0), jnp.int32), jnp.zeros((5, 0)), *experts)
    assert empty.shape == (5, 64) and np.all(np.asarray(empty, np.float32) == 0.0)


def test_impl_xla_float_experts_and_vmap():
    rng = np.random.default_rng(4)
    experts = make_experts(rng, 6, 64, 32)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    ids, weights = make_routing(rng, 4, 2, 6)
    ref = _ref(x, ids, weights, *experts)
    np.testing.assert_array_equal(jax.jit(lambda *a: marlin_moe(*a, impl="xla"))(x, ids, weights, *experts), ref)
    dense = [w.dequantize() for w in experts]  # float experts: no INT4 kernel, the reference runs
    np.testing.assert_array_equal(jax.jit(marlin_moe)(x, ids, weights, *dense),
                                  jax.jit(moe_experts_ref)(x, ids, weights, *dense))
    out = jax.vmap(lambda a, i, w: marlin_moe(a, i, w, *experts))(jnp.stack([x, -x]), jnp.stack([ids, ids]),
                                                                  jnp.stack([weights, weights]))
    assert rel_err(out[0], ref) <= 1e-5 and rel_err(out[1], _ref(-x, ids, weights, *experts)) <= 1e-5
    for w in (experts, dense):  # impl="dense": every expert on every token, INT4 or float, the same function
        assert rel_err(jax.jit(lambda *a: marlin_moe(*a, impl="dense"))(x, ids, weights, *w), ref) <= 1e-5


def test_expert_parallel_in_shard_map():
    """The custom call inside the model's shard_map dispatch (local ids, sentinel E_local for other shards' slots,
    tp-split expert widths) equals the unsharded reference."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    rng = np.random.default_rng(5)
    e, d, f = 16, 64, 128
    experts = make_experts(rng, e, d, f)
    x = jnp.asarray(rng.standard_normal((6, d)), jnp.float32)
    ids, weights = make_routing(rng, 6, 4, e)
    mesh = kj.make_mesh(tp=2, ep=4)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda *a: moe_expert_parallel(marlin_moe, *a))(x, ids, weights, *experts)
    assert rel_err(out, experts64(x, ids, weights, *experts)) <= 1e-5


def test_expert_parallel_shards_choose_the_block_size_of_the_whole_routing(monkeypatch):
    """On an ep mesh each shard's call holds E/ep experts, but its M k slots spread over all E (the other shards'
    go nowhere): the model passes experts_total=E so that the block size comes from M k / E, the slots per expert
    of every shard, not from M k / (E/ep), which is ep times more."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    mm = importlib.import_module("kdtree_jax.kernels.marlin_moe")  # (the package re-exports the function's name)
    seen = []
    real = mm.choose_path
    monkeypatch.setattr(mm, "choose_path", lambda m, k, e, ok, local=None: seen.append((m, k, e, local))
                        or real(m, k, e, ok, local))
    cfg = kj.configs.tiny(kernels="ffi")
    mesh = kj.make_mesh(ep=4, dp=2)
    params = kj.init_params(cfg, jax.random.key(0), mesh=mesh)
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    with jax.set_mesh(mesh):
        sharded = forward(params, cfg, tokens)
    assert seen and all(e == cfg.n_routed_experts for _, _, e, _ in seen), seen
    assert {m for m, *_ in seen} == {10} and {k for _, k, *_ in seen} == {cfg.num_experts_per_tok}
    assert {local for *_, local in seen} == {cfg.n_routed_experts // 4}  # the shard's own experts (FLAG_PERSIST)
    seen.clear()
    assert rel_err(sharded, forward(kj.init_params(cfg, jax.random.key(0)), cfg, tokens)) <= 1e-5
    assert seen and all(e == local == cfg.n_routed_experts for _, _, e, local in seen)
    rng = np.random.default_rng(9)
    x, (ids, w), experts = jnp.ones((3, 64), jnp.float32), make_routing(rng, 3, 2, 16), make_experts(rng, 16, 64, 32)
    for bad in (8, 16.0, True):
        with pytest.raises(ValueError, match="experts_total must be an integer >= the 16 experts"):
            marlin_moe(x, ids, w, *experts, experts_total=bad)


def _bad(**change):
    rng = np.random.default_rng(6)
    gate, up, down = make_experts(rng, 4, 64, 32)
    ids, weights = make_routing(rng, 3, 2, 4)
    args = dict(x=jnp.zeros((3, 64), jnp.float32), ids=ids, weights=weights, we_gate=gate, we_up=up, we_down=down)
    args.update(change)
    return args


_E = make_experts(np.random.default_rng(7), 4, 64, 32)


@pytest.mark.parametrize("change, error, match", [
    (dict(x=jnp.zeros((3, 64, 1))), ValueError, r"x must be \[M, D\]"),
    (dict(x=jnp.zeros((3, 64), jnp.float16)), TypeError, "float32 or bfloat16"),
    (dict(x=jnp.zeros((3, 128))), ValueError, "x has D = 128"),
    (dict(ids=jnp.zeros((4, 2), jnp.int32)), ValueError, r"ids must be \[M, k\]"),
    (dict(ids=jnp.zeros((3, 2), jnp.float32)), TypeError, "ids must be integer"),
    (dict(weights=jnp.zeros((3, 3))), ValueError, "weights has shape"),
    (dict(weights=jnp.zeros((3, 2), jnp.int32)), TypeError, "weights must be floating"),
    (dict(we_up=_E[2]), ValueError, "we_up"),
    (dict(we_down=_E[0]), ValueError, r"we_down must be \[E, D, F\]"),
    (dict(we_gate=Int4Array(_E[0].packed.astype(jnp.uint32), _E[0].scale)), TypeError, "packed must be int32"),
    (dict(we_gate=Int4Array(_E[0].packed, _E[0].scale.astype(jnp.float32))), TypeError, "scale must be bfloat16"),
    (dict(we_gate=Int4Array(_E[0].packed, jnp.ones((4, 32, 3), jnp.bfloat16))), ValueError, "does not match its"),
    (dict(we_up=_E[1].dequantize()), TypeError, "all Int4Array or all float"),
    (dict(x=[[1.0]]), TypeError, "x must be an array"),
])
def test_bad_input_is_a_clear_error(change, error, match):
    with pytest.raises(error, match=match):
        marlin_moe(**_bad(**change))


def test_bad_impl_and_block_m():
    with pytest.raises(ValueError, match="impl"):
        marlin_moe(**_bad(), impl="triton")
    with pytest.raises(ValueError, match="block_m"):
        marlin_moe(**_bad(), block_m=12)
    with pytest.raises(ValueError, match="tile path"):  # float32, D = 64: not for the tile path
        marlin_moe(**_bad(), block_m=64)
    with pytest.raises(ValueError, match="tile path"):  # the narrow tiles too
        marlin_moe(**_bad(), block_m=32, flags=FLAG_TILE)


def test_model_ffi_equals_xla():
    """kernels="ffi" routes the routed experts (and the absorbed attention) through the custom calls."""
    cfg = kj.configs.tiny()
    params = kj.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 256, size=(2, 11)), jnp.int32)
    ffi = dataclasses.replace(cfg, kernels="ffi")
    logits = [jax.jit(forward, static_argnums=1)(params, c, tokens) for c in (cfg, ffi)]
    assert rel_err(logits[1], logits[0]) <= 1e-5


# ------------------------------------------------------------------------------------------------------------------
# GPU (the device machine): the CUDA kernels against float64, the CPU kernel and the reference
# ------------------------------------------------------------------------------------------------------------------

K2_D, K2_F = 7168, 2048


def _poison(shape):
    """Leave NaN in freshly freed device memory, which the next output buffers are likely to reuse."""
    junk = jnp.full(shape, jnp.nan, jnp.float32, device=jax.devices("gpu")[0])
    junk.block_until_ready()
    junk.delete()


def random_experts(key, e, d, f, group=32):
    """Random INT4 experts built on the device (random nibbles, scales ~ 1 / (4 sqrt(fan-in))), K2-sized fast."""
    def one(key, rows, cols):
        k1, k2 = jax.random.split(key)
        packed = jax.lax.bitcast_convert_type(jax.random.bits(k1, (e, rows, cols // 8), jnp.uint32), jnp.int32)
        scale = jax.random.uniform(k2, (e, rows, cols // group), jnp.float32, 0.5, 1.5) / (4 * np.sqrt(cols))
        return Int4Array(packed, scale.astype(jnp.bfloat16))
    keys = jax.random.split(key, 3)
    with jax.default_device(jax.devices("gpu")[0]):
        return one(keys[0], f, d), one(keys[1], f, d), one(keys[2], d, f)


@gpu
@needs_gpu
@pytest.mark.parametrize("m, k, e, bm, kind", [
    (1, 8, 384, 8, "uniform"), (64, 8, 384, 8, "sentinel"), (700, 8, 384, 16, "uniform"),
    (2048, 8, 64, 32, "one_expert"), (300, 4, 16, 8, "few"), (4096, 8, 384, 32, "repeat"),
    (3, 8, 384, 64, "uniform"), (1024, 8, 384, 64, "sentinel"), (4096, 8, 384, 128, "uniform"),
    (2048, 8, 48, 128, "few"),
])
def test_gpu_align_stage_equals_moe_align(m, k, e, bm, kind):
    """The CUDA align stage (stable, deterministic) writes exactly moe_align's arrays in the blocks it uses."""
    rng = np.random.default_rng(hash((m, k, e, bm)) % 2**32)
    ids, weights = make_routing(rng, m, k, e, kind)
    d, f = 256, 128
    _registry.register()
    experts = random_experts(jax.random.key(1), e, d, f)
    x = jax.random.normal(jax.random.key(2), (m, d), jnp.bfloat16)
    args = jax.device_put((x, ids, weights), jax.devices("gpu")[0])
    flat = [args[0], args[1], args[2]] + [a for w in experts for a in (w.packed, w.scale)]
    outs = jax.jit(lambda *a: _cuda_call(a, m, d, k, e, f, jnp.bfloat16, bm))(*flat)
    sorted_slots, block_experts = (np.asarray(a) for a in jax.jit(moe_align, static_argnums=(1, 2))(ids, e, bm))
    np.testing.assert_array_equal(np.asarray(outs[2])[:-1], block_experts)
    assert int(outs[2][-1]) == int(np.sum(block_experts >= 0))  # the used blocks, for the stream path's FLAG_PERSIST
    used = int(np.sum(block_experts >= 0)) * bm
    np.testing.assert_array_equal(np.asarray(outs[1])[:used], sorted_slots[:used])


# (M, k, E, routing, block_m, flags): decode and tree-verify sizes up to 2048 tokens on K2-sized experts, both paths
# (block_m None: the default for M; 8 / 16 / 32 the stream path, 64 / 128 the tile path), the tile path's mma.sync
# variant, the L2 prefetch flag, the stream path's plain launches and the tile path's narrow tiles (16 / 32 with
# FLAG_TILE)
K2_CASES = [
    (1, 8, 16, "uniform", None, None), (7, 8, 16, "sentinel", None, None), (64, 8, 16, "uniform", None, None),
    (3, 8, 16, "one_expert", None, FLAG_SERIAL), (96, 8, 16, "repeat", 16, FLAG_SERIAL | FLAG_L2_256),
    (64, 8, 16, "uniform", 32, 0), (256, 8, 16, "one_expert", None, None), (2048, 8, 16, "uniform", 32, 0),
    (512, 8, 16, "few", 16, FLAG_L2_256), (2048, 8, 16, "uniform", None, None), (512, 8, 16, "few", 64, 0),
    (1024, 8, 16, "sentinel", 128, 0), (128, 8, 16, "repeat", 64, FLAG_L2_256 | FLAG_DEEP),
    (1024, 8, 16, "uniform", 64, FLAG_SYNC), (700, 8, 16, "one_expert", 128, FLAG_DEEP),
    (600, 8, 16, "uniform", None, FLAG_L2_256 | FLAG_DEEP),
    (1024, 8, 16, "uniform", 32, FLAG_TILE | FLAG_L2_256), (256, 8, 16, "few", 16, FLAG_TILE),
    (700, 8, 16, "one_expert", 32, FLAG_TILE), (300, 8, 16, "sentinel", 32, FLAG_TILE | FLAG_SYNC),
    (24, 8, 16, "uniform", None, None), (40, 8, 16, "few", None, FLAG_DEEP),  # 12 / 20 slots per expert: the
    (44, 8, 16, "uniform", 32, FLAG_TILE | FLAG_FINE | FLAG_L2_256),  # default path is the narrow tiles
]  # (`choose_path`); 22 slots per expert with FLAG_FINE: tiles of 24 token columns
K2_CASES += [  # the stream path's persistent grid (FLAG_PERSIST): resident blocks looping over the used units
    (1, 8, 16, "uniform", 8, FLAG_PERSIST), (7, 8, 16, "sentinel", 8, FLAG_PERSIST),
    (64, 8, 16, "few", 8, FLAG_PERSIST | FLAG_SERIAL), (96, 8, 16, "repeat", 16, FLAG_PERSIST),
    (256, 8, 16, "one_expert", 32, FLAG_PERSIST | FLAG_L2_256),
    (1, 8, 16, "uniform", 8, FLAG_X_L1 | FLAG_PERSIST), (24, 8, 16, "few", 16, FLAG_X_L1),  # x prefetched into L1
    (64, 8, 16, "sentinel", 32, FLAG_X_L1 | FLAG_SERIAL),
]


K2_CASES += [  # the fused decode path (FLAG_FUSED): one launch, its own sort, every routing kind, up to 256 slots
    (1, 8, 16, "uniform", None, FLAG_FUSED), (7, 8, 16, "sentinel", None, FLAG_FUSED),
    (3, 8, 16, "one_expert", None, FLAG_FUSED), (24, 8, 16, "few", None, FLAG_FUSED),
    (17, 8, 16, "repeat", None, FLAG_FUSED), (32, 8, 16, "uniform", None, FLAG_FUSED),
    (4, 8, 64, "uniform", None, FLAG_FUSED),  # 64 experts, 16 local: a quarter of the slots here
    (1, 8, 16, "uniform", None, FLAG_FUSED | FLAG_FUSED_ONE),  # one block an SM
    (17, 8, 16, "sentinel", None, FLAG_FUSED | FLAG_FUSED_ONE),
]

GEMV_CASES = [  # the GEMV decode path (FLAG_GEMV): no align, a warp a weight row, up to 64 slots, every routing kind
    (1, 8, 16, "uniform", None, FLAG_GEMV), (1, 8, 16, "sentinel", None, FLAG_GEMV),
    (4, 8, 16, "repeat", None, FLAG_GEMV), (3, 8, 16, "one_expert", None, FLAG_GEMV),
    (8, 8, 16, "few", None, FLAG_GEMV), (2, 8, 64, "uniform", None, FLAG_GEMV),  # 64 experts, 16 local
    (1, 8, 16, "uniform", None, FLAG_GEMV | FLAG_SERIAL),  # plain launches
]


@pytest.fixture(scope="module")
def k2_experts():
    return random_experts(jax.random.key(0), 16, K2_D, K2_F)


@gpu
@needs_gpu
@pytest.mark.parametrize("m, k, e, kind, bm, flags", GEMV_CASES)
def test_gpu_gemv_path_k2_shapes(k2_experts, m, k, e, kind, bm, flags):
    test_gpu_fast_path_k2_shapes(k2_experts, m, k, e, kind, bm, flags)


@gpu
@needs_gpu
@pytest.mark.parametrize("d, f, m, kind", [(2048, 1024, 2, "uniform"), (4096, 2048, 3, "repeat"),
                                           (8192, 1024, 1, "sentinel")])
def test_gpu_gemv_path_other_shapes(d, f, m, kind):
    """The GEMV path's other instances (its warps' group counts 8, 16 and 32 for gate/up, 8 and 16 for down) against
    the reference, with the output poisoned first."""
    experts = random_experts(jax.random.key(d + f), 16, d, f)
    rng = np.random.default_rng(d + f + m)
    ids, weights = make_routing(rng, m, 8, 16, kind)
    x = jax.random.normal(jax.random.key(m + d), (m, d), jnp.bfloat16)
    _poison((m * 8, d + f))
    gpu0 = jax.devices("gpu")[0]
    host = np.asarray(run(x, ids, weights, experts, device=gpu0, flags=FLAG_GEMV), np.float32)
    assert np.all(np.isfinite(host))
    ref = _ref(*jax.device_put((x, ids, weights, *experts), gpu0))
    assert rel_err(host, ref) <= 1e-2


@gpu
@needs_gpu
@pytest.mark.parametrize("m, k, e, kind, bm, flags", K2_CASES)
def test_gpu_fast_path_k2_shapes(k2_experts, m, k, e, kind, bm, flags):
    rng = np.random.default_rng(hash((m, k, kind, bm or 0, flags)) % 2**32)
    ids, weights = make_routing(rng, m, k, e, kind)
    x = jax.random.normal(jax.random.key(m + 7 * (flags or 0)), (m, K2_D), jnp.bfloat16)
    _poison((m * k, K2_D + K2_F))
    gpu0 = jax.devices("gpu")[0]
    out = run(x, ids, weights, k2_experts, device=gpu0, block_m=bm, flags=flags)
    assert out.devices() == {gpu0}
    host = np.asarray(out, np.float32)
    assert np.all(np.isfinite(host))
    ref = _ref(*jax.device_put((x, ids, weights, *k2_experts), gpu0))
    assert rel_err(host, ref) <= 1e-2
    rows = np.array([0, m - 1]) if m > 1 else np.array([0])  # float64 on the host is slow at this size: two tokens
    assert rel_err(host[rows], experts64(x, ids, weights, *k2_experts, rows=rows)) <= 1e-2
    again = run(x, ids, weights, k2_experts, device=gpu0, block_m=bm, flags=flags)
    np.testing.assert_array_equal(np.asarray(again, np.float32), host)  # fixed-order reductions: bitwise repeatable


@gpu
@needs_gpu
@pytest.mark.parametrize("bm, flags", [(128, 0), (64, FLAG_L2_256), (128, FLAG_SYNC), (64, FLAG_SYNC),
                                       (128, FLAG_DEEP | FLAG_L2_256), (64, FLAG_DEEP), (32, FLAG_TILE | FLAG_L2_256),
                                       (16, FLAG_TILE), (32, FLAG_TILE | FLAG_SYNC), (16, FLAG_TILE | FLAG_DEEP),
                                       (32, FLAG_TILE | FLAG_FINE | FLAG_L2_256), (64, FLAG_FINE),
                                       (32, FLAG_TILE | FLAG_FINE | FLAG_SYNC)])
def test_gpu_tile_path_every_tile_width(bm, flags):
    """Experts with 1 to 300 slots: full and partial tiles of every width the tile path instantiates (the slot count
    rounded up to 8, 16, 32, 48, ..., 128; 24 with FLAG_FINE), experts with no slot, and one slot of each token sent
    to no expert; against float64 and the CPU kernel."""
    rng = np.random.default_rng(bm + 3 * flags)
    counts = [1, 5, 9, 16, 17, 20, 24, 25, 31, 33, 47, 49, 64, 65, 79, 81, 96, 97, 112, 113, 127, 128, 129, 200, 300]
    e, d, f = len(counts) + 2, 512, 256
    experts = make_experts(rng, e, d, f)
    owner = np.repeat(rng.permutation(e)[:len(counts)], counts)
    rng.shuffle(owner)
    m = len(owner)
    ids = np.stack([owner, np.full(m, e)], axis=1)[:, rng.permutation(2)]  # [M, 2]: one real slot, one dropped
    ids, weights = jnp.asarray(ids, jnp.int32), jnp.asarray(rng.uniform(0.05, 1.0, size=(m, 2)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    _poison((m * 2, d + f))
    out = run(x, ids, weights, experts, device=jax.devices("gpu")[0], block_m=bm, flags=flags)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert rel_err(out, experts64(x, ids, weights, *experts)) <= 1e-2
    assert rel_err(out, run(x, ids, weights, experts, device=jax.devices("cpu")[0])) <= 1e-2


# (M, k, E, D, F, dtype, routing, block_m): the fast paths on small experts (vs float64 and the CPU kernel), and the
# generic path (float32; D off the multiples of 128; group 16)
SMALL_CASES = [
    (1, 8, 8, 256, 128, jnp.bfloat16, "uniform", None),
    (33, 4, 8, 256, 128, jnp.bfloat16, "sentinel", 8),
    (100, 4, 8, 128, 256, jnp.bfloat16, "repeat", 16),
    (300, 8, 8, 384, 128, jnp.bfloat16, "one_expert", 32),
    (50, 4, 16, 64, 32, jnp.float32, "uniform", None),
    (50, 4, 16, 64, 32, jnp.bfloat16, "few", None),
    (20, 4, 8, 256, 128, jnp.float32, "sentinel", None),
    (300, 8, 8, 512, 256, jnp.bfloat16, "one_expert", 128),
    (100, 4, 8, 256, 128, jnp.bfloat16, "sentinel", 64),
    (129, 3, 6, 768, 384, jnp.bfloat16, "repeat", None),
]


@gpu
@needs_gpu
@pytest.mark.parametrize("m, k, e, d, f, dtype, kind, bm", SMALL_CASES)
def test_gpu_small_experts_match_float64_and_cpu_kernel(m, k, e, d, f, dtype, kind, bm):
    rng = np.random.default_rng(hash((m, k, e, d, f, kind)) % 2**32)
    experts = make_experts(rng, e, d, f)
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    ids, weights = make_routing(rng, m, k, e, kind)
    _poison((m * k, d + f))
    out = run(x, ids, weights, experts, device=jax.devices("gpu")[0], block_m=bm)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert rel_err(out, experts64(x, ids, weights, *experts)) <= TOL[dtype]
    assert rel_err(out, run(x, ids, weights, experts, device=jax.devices("cpu")[0])) <= TOL[dtype]


@gpu
@needs_gpu
@pytest.mark.parametrize("group", [16, 64])
def test_gpu_other_groups_take_the_generic_path(group):
    rng = np.random.default_rng(9 + group)
    experts = make_experts(rng, 8, 256, 128, group=group)
    x = jnp.asarray(rng.standard_normal((12, 256)), jnp.bfloat16)
    ids, weights = make_routing(rng, 12, 4, 8)
    out = run(x, ids, weights, experts, device=jax.devices("gpu")[0])
    assert rel_err(out, experts64(x, ids, weights, *experts)) <= 1e-2


@gpu
@needs_gpu
@pytest.mark.parametrize("m, path", [(1, 0), (64, 0), (1, FLAG_GEMV)])
def test_gpu_programmatic_launches_equal_plain_ones(k2_experts, m, path):
    """Four calls in a chain (each output the next input) on K2-sized experts: a path's kernels launched as
    programmatic dependents (each starting while the one before it ends) give the bits of plain launches, so no
    kernel reads what the one before it has not written yet. path: 0 the stream path (flags 0, not None: at M = 1
    the default is the GEMV decode path, whose sums run in another order), FLAG_GEMV that path."""
    gpu0 = jax.devices("gpu")[0]
    rng = np.random.default_rng(11 + m)
    routes = [make_routing(rng, m, 8, 16) for _ in range(4)]
    x = jax.device_put(jax.random.normal(jax.random.key(m), (m, K2_D), jnp.bfloat16), gpu0)
    args = jax.device_put(routes, gpu0)

    def chain(x, routes, experts, flags):
        for ids, weights in routes:
            x = marlin_moe(x, ids, weights, *experts, flags=flags)
        return x

    chained = jax.jit(chain, static_argnums=3)
    plain = np.asarray(chained(x, args, k2_experts, path | FLAG_SERIAL), np.float32)
    assert np.all(np.isfinite(plain)) and np.any(plain != 0)
    np.testing.assert_array_equal(np.asarray(chained(x, args, k2_experts, path), np.float32), plain)


@gpu
@needs_gpu
@pytest.mark.parametrize("m, kind, bm", [(1, "uniform", 8), (4, "sentinel", 8), (16, "uniform", 8), (33, "few", 16),
                                         (64, "sentinel", 8), (150, "repeat", 32), (300, "one_expert", 8)])
def test_gpu_persistent_grid_gives_the_grids_bits(k2_experts, m, kind, bm):
    """FLAG_PERSIST (as many blocks as fit, each looping over the used token blocks x row sets) computes every unit
    as the one-block-per-unit grid does: the same output and the same h for every routed slot, for routings that use
    few or all of the token blocks max_blocks allows (sentinel: a third of the slots to no expert, as on an
    expert-parallel shard), with and without programmatic launches. The persistent runs go first, on poisoned
    memory, so that a unit they skip cannot borrow the grid's results."""
    gpu0 = jax.devices("gpu")[0]
    rng = np.random.default_rng(31 + m)
    ids, weights = make_routing(rng, m, 8, 16, kind)
    x = jax.random.normal(jax.random.key(m + 5), (m, K2_D), jnp.bfloat16)
    flat = jax.device_put([x, ids, weights] + [a for w in k2_experts for a in (w.packed, w.scale)], gpu0)
    routed = (np.asarray(ids) >= 0).reshape(-1) & (np.asarray(ids) < 16).reshape(-1)  # slots with an expert
    got = {}
    for flags in (FLAG_PERSIST, FLAG_PERSIST | FLAG_SERIAL, 0):
        _poison((m * 8, K2_D + K2_F))
        outs = jax.jit(lambda *a, flags=flags: _cuda_call(a, m, K2_D, 8, 16, K2_F, jnp.bfloat16, bm, flags))(*flat)
        got[flags] = (np.asarray(outs[0], np.float32), np.asarray(outs[3], np.float32)[routed])
    out, h = got[0]
    assert np.all(np.isfinite(out)) and np.any(out != 0) and np.all(np.isfinite(h)) and np.any(h != 0)
    for flags in (FLAG_PERSIST, FLAG_PERSIST | FLAG_SERIAL):
        np.testing.assert_array_equal(got[flags][0], out)
        np.testing.assert_array_equal(got[flags][1], h)


@gpu
@needs_gpu
def test_gpu_scratch_of_the_wrong_size_is_refused():
    """The CUDA call's sorted / block_expert scratch must be [max_blocks * block_m] and [max_blocks + 1]: a caller
    that declares block_expert [max_blocks] (the layout before the used-block count) is refused with the sizes,
    rather than run on the generic kernel."""
    gpu0 = jax.devices("gpu")[0]
    rng = np.random.default_rng(3)
    experts = make_experts(rng, 8, 256, 128)
    ids, weights = make_routing(rng, 4, 2, 8)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    flat = jax.device_put([x, ids, weights] + [a for w in experts for a in (w.packed, w.scale)], gpu0)
    _registry.register()
    nb = max_blocks(8, 8, 8)
    for sorted_n, experts_n in ((nb * 8, nb), (nb * 8 + 3, nb + 1), (nb * 12, nb + 1), (0, 0)):
        outs = [jax.ShapeDtypeStruct((4, 256), jnp.bfloat16), jax.ShapeDtypeStruct((sorted_n,), jnp.int32),
                jax.ShapeDtypeStruct((experts_n,), jnp.int32), jax.ShapeDtypeStruct((8, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)]
        call = jax.ffi.ffi_call("kdtree_marlin_moe", outs, vmap_method="sequential")
        with pytest.raises(Exception, match="scratch sorted must be"):
            jax.block_until_ready(jax.jit(lambda *a: call(*a, flags=np.int64(0)))(*flat))


@gpu
@needs_gpu
def test_gpu_inside_a_loop():
    """Several calls in one lax.scan (XLA may capture the body as a CUDA graph: the handler is
    kCmdBufferCompatible) give the single calls' results."""
    rng = np.random.default_rng(10)
    experts = jax.device_put(make_experts(rng, 8, 256, 128), jax.devices("gpu")[0])
    xs = jnp.asarray(rng.standard_normal((3, 16, 256)), jnp.bfloat16)
    routes = [make_routing(rng, 16, 4, 8) for _ in range(3)]
    ids, weights = jnp.stack([r[0] for r in routes]), jnp.stack([r[1] for r in routes])
    args = jax.device_put((xs, ids, weights), jax.devices("gpu")[0])

    def body(carry, a):
        return carry, marlin_moe(a[0], a[1], a[2], *experts)

    looped = jax.jit(lambda a: jax.lax.scan(body, 0, a)[1])(args)
    for i in range(3):
        single = run(xs[i], ids[i], weights[i], experts, device=jax.devices("gpu")[0])
        np.testing.assert_array_equal(np.asarray(looped[i], np.float32), np.asarray(single, np.float32))


@gpu
@needs_gpu
def test_gpu_model_ffi_equals_xla():
    cfg = kj.configs.tiny()
    gpu0 = jax.devices("gpu")[0]
    params = jax.device_put(kj.init_params(cfg, jax.random.key(0)), gpu0)
    tokens = jax.device_put(jnp.asarray(np.random.default_rng(8).integers(0, 256, size=(2, 11)), jnp.int32), gpu0)
    ffi = dataclasses.replace(cfg, kernels="ffi")
    logits = [jax.jit(forward, static_argnums=1)(params, c, tokens) for c in (cfg, ffi)]
    assert rel_err(logits[1], logits[0]) <= 1e-4


@gpu
@needs_gpu
@pytest.mark.parametrize("m, kind", [(1, "uniform"), (9, "sentinel"), (32, "few"), (5, "repeat")])
def test_gpu_fused_path_equals_the_reference_and_its_h(k2_experts, m, kind):
    """The fused kernel on poisoned memory: its output equals the reference within bf16 rounding, its h scratch
    equals silu(gate) * up of the reference for every routed slot (in expert order), and a slot list where no slot
    has a local expert gives zeros."""
    gpu0 = jax.devices("gpu")[0]
    mm = importlib.import_module("kdtree_jax.kernels.marlin_moe")
    rng = np.random.default_rng(71 + m)
    ids, weights = make_routing(rng, m, 8, 16, kind)
    x = jax.random.normal(jax.random.key(m + 9), (m, K2_D), jnp.bfloat16)
    flat = jax.device_put([x, ids, weights] + [a for w in k2_experts for a in (w.packed, w.scale)], gpu0)
    _poison((m * 8, 2 * K2_D + 2 * K2_F))
    outs = jax.jit(lambda *a: mm._fused_call(a, m, K2_D, 8, K2_F, jnp.bfloat16))(*flat)
    out = np.asarray(outs[0], np.float32)
    assert np.all(np.isfinite(out)) and np.any(out != 0)
    assert rel_err(out, _ref(*flat[:3], *k2_experts)) <= 1e-2
    flat_ids = np.asarray(ids).reshape(-1)
    routed = [s for s in np.argsort(np.where((flat_ids >= 0) & (flat_ids < 16), flat_ids, 99), kind="stable")
              if 0 <= flat_ids[s] < 16]  # slots in expert order: the kernel's places
    h = np.asarray(outs[2], np.float32)[:len(routed)]
    g, u = (np.asarray(w.dequantize(jnp.float32)) for w in k2_experts[:2])
    xs = np.asarray(x, np.float32)[[s // 8 for s in routed]]
    a = np.einsum("sd,sfd->sf", xs, g[flat_ids[routed]])
    want = a / (1.0 + np.exp(-a)) * np.einsum("sd,sfd->sf", xs, u[flat_ids[routed]])
    assert np.all(np.isfinite(h)) and rel_err(h, want) <= 1e-2
    none = jax.device_put(jnp.full((m, 8), 16, jnp.int32), gpu0)  # every slot another shard's
    _poison((m * 8, 2 * K2_D + 2 * K2_F))
    zero = jax.jit(lambda *a: mm._fused_call(a, m, K2_D, 8, K2_F, jnp.bfloat16)[0])(flat[0], none, *flat[2:])
    np.testing.assert_array_equal(np.asarray(zero, np.float32), 0.0)


@gpu
@needs_gpu
@pytest.mark.parametrize("m", [1, 17])
def test_gpu_fused_path_in_a_chain_equals_the_stream_path(k2_experts, m):
    """Four fused calls in a chain (each output the next input), as consecutive layers run them: each equals the
    stream path's call on the same input within bf16 rounding, so no call reads another's counters or scratch."""
    gpu0 = jax.devices("gpu")[0]
    rng = np.random.default_rng(13 + m)
    routes = jax.device_put([make_routing(rng, m, 8, 16) for _ in range(4)], gpu0)
    x = jax.device_put(jax.random.normal(jax.random.key(m), (m, K2_D), jnp.bfloat16), gpu0)

    @jax.jit
    def chain(x, routes, experts):
        outs = []
        for ids, weights in routes:
            fused = marlin_moe(x, ids, weights, *experts, flags=FLAG_FUSED)
            outs.append((fused, marlin_moe(x, ids, weights, *experts)))
            y = fused.astype(jnp.float32)  # the next input at unit scale (the MoE is quadratic in a small x)
            x = (y / jnp.sqrt(jnp.mean(y * y) + 1e-30)).astype(jnp.bfloat16)
        return outs

    for fused, stream in chain(x, routes, k2_experts):
        fused, stream = np.asarray(fused, np.float32), np.asarray(stream, np.float32)
        assert np.all(np.isfinite(fused)) and np.any(fused != 0)
        assert rel_err(fused, stream) <= 1e-2


def test_gemv_path_eligibility_and_switch(monkeypatch):
    """The GEMV decode path takes K2's shapes at few slots only; asking for it elsewhere is refused by name; its
    switch (KDTREE_JAX_MOE_GEMV) takes 0 or 1."""
    assert gemv_eligible(1, 8, 7168, 2048, 32, 32, jnp.bfloat16)
    assert gemv_eligible(8, 8, 7168, 2048, 32, 32, jnp.bfloat16) and not gemv_eligible(9, 8, 7168, 2048, 32, 32,
                                                                                       jnp.bfloat16)
    assert not gemv_eligible(1, 8, 7168, 2048, 32, 32, jnp.float32)
    assert not gemv_eligible(1, 8, 256, 128, 32, 32, jnp.bfloat16)
    rng = np.random.default_rng(3)
    experts = make_experts(rng, 4, 256, 128)
    ids, weights = make_routing(rng, 2, 2, 4)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    with pytest.raises(ValueError, match="FLAG_GEMV needs bfloat16 x, group size 32"):
        marlin_moe(x, ids, weights, *experts, flags=FLAG_GEMV)
    for value, want in (("0", 0), ("", FLAG_GEMV), ("1", FLAG_GEMV)):
        monkeypatch.setenv("KDTREE_JAX_MOE_GEMV", value)
        assert gemv_default() == want
    monkeypatch.setenv("KDTREE_JAX_MOE_GEMV", "yes")
    with pytest.raises(ValueError, match="KDTREE_JAX_MOE_GEMV must be 0"):
        gemv_default()
