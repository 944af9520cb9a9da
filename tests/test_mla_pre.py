"""mla_pre: the projections between qkv_a and the attention of an MLA layer (norms, q_b, rope, k_b absorption and the
two cache writes) as one custom call (C++ on CPU, CUDA on GPU, marked gpu) against the pure-JAX reference and a
float64 numpy computation of the module's definition, on fresh random inputs; cache rows outside the written ones
untouched, written ones overwritten (NaN never leaks), in place under donation; clear errors; the model with "mla_pre"
in ffi_ops equals it without (logits, caches, greedy ar and ddtree tokens) and runs the custom call only where asked."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_gpu, rel_err

import kdtree_jax as kj
from kdtree_jax.kernels.mla_pre import MAX_ROWS, mla_pre, mla_pre_ref

gpu = pytest.mark.gpu
EPS = 1e-6
TARGET = "kdtree_mla_pre"


def bound(dtype) -> float:
    """The relative norm error allowed for each output against the reference."""
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2


NAMES = ("q_lat", "q_pe", "latent", "pe")


def _case(rng, b, t, h, s, starts, rq=64, r=32, dn=16, dr=8, dtype=jnp.float32, device=None):
    """The ten arguments of mla_pre (a, q_a_norm, kv_a_norm, q_b, k_b, cos, sin, latent, pe, starts) filled with
    random values of a model's magnitudes (never zeros); caches random too, so untouched rows are checkable."""
    normal = lambda *shape: rng.standard_normal(shape)
    theta = rng.uniform(-np.pi, np.pi, (b, t, dr // 2))
    mscale = 1.0 + 0.2 * rng.random()  # the YaRN attention factor folded into the tables
    arrays = [normal(b, t, rq + r + dr), 1.0 + 0.1 * normal(rq), 1.0 + 0.1 * normal(r),
              normal(h, dn + dr, rq) / np.sqrt(rq), normal(r, h, dn) / np.sqrt(dn)]
    args = [jnp.asarray(x, dtype) for x in arrays]
    args += [jnp.asarray(mscale * np.cos(theta), jnp.float32), jnp.asarray(mscale * np.sin(theta), jnp.float32)]
    args += [jnp.asarray(normal(b, s, r), dtype), jnp.asarray(normal(b, s, dr), dtype)]
    args.append(jnp.asarray(np.asarray(starts, np.int32)))
    if device is not None:
        args = [jax.device_put(x, device) for x in args]
    return args


def _run(args, impl="ffi", donate=False):
    fn = lambda *x: mla_pre(*x, eps=EPS, impl=impl)
    return jax.jit(fn, donate_argnums=(7, 8) if donate else ())(*args)


def _ref(args, device=None):
    if device is not None:
        args = [jax.device_put(x, device) for x in args]
    return jax.jit(lambda *x: mla_pre_ref(*x[:7], x[7], x[8], x[9], eps=EPS))(*args)


def _slots(starts, t, s):
    """The first slot each row's T new rows land at: starts clamped to 0 .. S - T (dynamic_update_slice's rule)."""
    return [min(max(int(x), 0), s - t) for x in np.asarray(starts)]


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def _check(got, want, args, dtype, note=""):
    """got = want within the dtype's bound, output by output; no NaN; the cache rows outside the written window
    bit-identical to the input caches; the written rows = the reference's."""
    a, latent_in, pe_in, starts = args[0], args[7], args[8], args[9]
    b, t = a.shape[:2]
    h, s = args[3].shape[0], latent_in.shape[1]
    r, dr = latent_in.shape[2], pe_in.shape[2]
    shapes = [(b, t, h, r), (b, t, h, dr), latent_in.shape, pe_in.shape]
    for name, g, w, shape in zip(NAMES, got, want, shapes):
        assert g.shape == tuple(shape) and g.dtype == dtype, (name, g.shape, g.dtype, note)
        assert not np.any(np.isnan(_f32(g))), f"NaN in {name} {note}"
        err = rel_err(_f32(g), _f32(w))
        assert err <= bound(dtype), f"{name}: relative error {err} {note}"
    for g_cache, w_cache, old in ((got[2], want[2], latent_in), (got[3], want[3], pe_in)):
        g_cache, w_cache, old = _f32(g_cache), _f32(w_cache), _f32(old)
        for row, d in enumerate(_slots(starts, t, s)):
            outside = np.r_[0:d, d + t:s]
            np.testing.assert_array_equal(g_cache[row, outside], old[row, outside], err_msg=f"row {row} {note}")
            written = g_cache[row, d:d + t]
            assert rel_err(written, w_cache[row, d:d + t]) <= bound(dtype), (row, d, note)
            assert not np.array_equal(written, old[row, d:d + t]), (row, d, note)  # really written


def _rope64(x, cos, sin):
    if x.ndim == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    out = np.empty_like(x)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out


def _numpy_pre(args):
    """The module docstring's definition in float64 numpy (no intermediate rounding)."""
    a, qn, kvn, qb, kb, cos, sin, latent, pe = (np.asarray(_f32(x), np.float64) for x in args[:9])
    rq, r, dn = qn.shape[0], kvn.shape[0], kb.shape[2]
    t, s = a.shape[1], latent.shape[1]
    norm = lambda x, w: w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
    q = np.einsum("btr,hkr->bthk", norm(a[..., :rq], qn), qb)
    q_lat = np.einsum("bthn,rhn->bthr", q[..., :dn], kb)
    q_pe = _rope64(q[..., dn:], cos, sin)
    c_kv, k_pe = norm(a[..., rq:rq + r], kvn), _rope64(a[..., rq + r:], cos, sin)
    latent, pe = latent.copy(), pe.copy()
    for row, d in enumerate(_slots(args[9], t, s)):
        latent[row, d:d + t], pe[row, d:d + t] = c_kv[row], k_pe[row]
    return q_lat, q_pe, latent, pe


# (B, T) with H: one token, a few rows of a few tokens, one row of a 17-node tree (more rows than a SIMD width)
SHAPES = [(1, 1), (2, 3), (1, 17)]
S = 40


def _starts(rng, b, t, h):
    """Random starts with 0 (odd H) or one past S - T (even H: clamped) in row 0, and S - 1 (clamped) in the last
    row of several."""
    starts = rng.integers(0, S - t + 1, size=b)
    starts[0] = 0 if h % 2 else S - t + 1 + h
    if b > 1:
        starts[-1] = S - 1
    return starts


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("h", [1, 2, 3])
@pytest.mark.parametrize("b, t", SHAPES)
def test_cpu_kernel_equals_reference(b, t, h, dtype):
    rng = np.random.default_rng(1000 * b + 100 * t + 10 * h + (dtype == jnp.bfloat16))
    args = _case(rng, b, t, h, S, _starts(rng, b, t, h), dtype=dtype)
    got, want = _run(args), _ref(args)
    _check(got, want, args, dtype, note=f"B={b} T={t} H={h} {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("b, t, starts", [(2, 3, [5, S + 7]), (1, 17, [30]), (3, 2, [0, S - 2, 17])])
def test_cpu_kernel_and_reference_are_the_float64_definition(b, t, starts):
    """float32: the custom call and the reference both equal the docstring's math in float64 (so the reference is
    not merely agreeing with the kernel); starts past S - T clamp to S - T like dynamic_update_slice."""
    rng = np.random.default_rng(b * 10 + t)
    args = _case(rng, b, t, 2, S, starts, rq=48, r=24, dn=8, dr=6)
    want = _numpy_pre(args)
    for impl in ("ffi", "xla"):
        got = _run(args, impl)
        for name, g, w in zip(NAMES, got, want):
            assert rel_err(_f32(g), w) <= 1e-5, (impl, name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_poisoned_target_rows_are_overwritten(dtype):
    """The cache rows about to be written hold NaN: every result is finite and equals the reference computed from
    the clean caches (the kernel never reads the slots it writes)."""
    rng = np.random.default_rng(21)
    b, t, h = 3, 4, 2
    starts = [0, S + 3, 9]
    clean = _case(rng, b, t, h, S, starts, dtype=dtype)
    poisoned = list(clean)
    lat, pe = _f32(clean[7]).copy(), _f32(clean[8]).copy()
    for row, d in enumerate(_slots(starts, t, S)):
        lat[row, d:d + t] = np.nan
        pe[row, d:d + t] = np.nan
    poisoned[7], poisoned[8] = jnp.asarray(lat, dtype), jnp.asarray(pe, dtype)
    got = _run(poisoned)
    for name, g in zip(NAMES, got):
        assert np.all(np.isfinite(_f32(g))), name
    _check(got, _ref(clean), clean, dtype)


def test_donated_caches_are_updated_in_place_with_the_same_result():
    """Under jit with the caches donated, the results equal the undonated call's, bit for bit, and the donated
    input buffers are consumed (the custom call aliases them to its results)."""
    rng = np.random.default_rng(31)
    for dtype in (jnp.float32, jnp.bfloat16):
        args = _case(rng, 2, 3, 3, S, [4, S], dtype=dtype)
        want = _run(args)
        copies = list(args)
        copies[7], copies[8] = jnp.array(args[7], copy=True), jnp.array(args[8], copy=True)
        got = _run(copies, donate=True)
        assert copies[7].is_deleted() and copies[8].is_deleted()
        for name, g, w in zip(NAMES, got, want):
            np.testing.assert_array_equal(_f32(g), _f32(w), err_msg=name)
        _check(got, _ref(args), args, dtype)


def test_in_a_loop_each_call_sees_the_last_ones_writes():
    """A fori_loop whose carry holds the caches (as the decoding loop's does): three steps writing at starts + 2 i
    give the reference's caches (every step's rows in place, the earlier ones kept)."""
    rng = np.random.default_rng(41)
    args = _case(rng, 2, 2, 2, S, [3, 20])
    a, rest, starts = args[0], args[1:7], args[9]

    def run(impl):
        def body(i, carry):
            lat, pe, acc = carry
            q_lat, q_pe, lat, pe = mla_pre(a * (1.0 + i), *rest, lat, pe, starts + 2 * i, eps=EPS, impl=impl)
            return lat, pe, acc + jnp.sum(q_lat) + jnp.sum(q_pe)
        return jax.jit(lambda lat, pe: jax.lax.fori_loop(0, 3, body, (lat, pe, jnp.float32(0))))(args[7], args[8])

    got, want = run("ffi"), run("xla")
    for g, w in zip(got, want):
        assert rel_err(_f32(g), _f32(w)) <= 1e-5
    lat_in = _f32(args[7])
    for row, st in enumerate([3, 20]):
        np.testing.assert_array_equal(_f32(got[0])[row, :st], lat_in[row, :st])
        np.testing.assert_array_equal(_f32(got[0])[row, st + 6:], lat_in[row, st + 6:])
        assert not np.any(np.all(_f32(got[0])[row, st:st + 6] == lat_in[row, st:st + 6], axis=-1))


def test_vmap_runs_each_slice():
    """vmap over a leading axis (vmap_method="sequential") = the reference slice by slice."""
    rng = np.random.default_rng(51)
    cases = [_case(rng, 2, 3, 2, S, [1, 30]) for _ in range(2)]
    stacked = [jnp.stack(xs) for xs in zip(*cases)]
    got = jax.jit(jax.vmap(lambda *x: mla_pre(*x, eps=EPS)))(*stacked)
    for i, args in enumerate(cases):
        for name, g, w in zip(NAMES, got, _ref(args)):
            assert rel_err(_f32(g[i]), _f32(w)) <= 1e-5, (i, name)


def test_impl_xla_is_the_reference():
    rng = np.random.default_rng(61)
    args = _case(rng, 2, 3, 2, S, [0, S])
    for g, w in zip(_run(args, "xla"), _ref(args)):
        np.testing.assert_array_equal(_f32(g), _f32(w))


def _bad(**change):
    rng = np.random.default_rng(71)
    names = ("a", "q_a_norm", "kv_a_norm", "q_b", "k_b", "cos", "sin", "latent", "pe", "starts")
    args = dict(zip(names, _case(rng, 2, 3, 2, 10, [0, 4])))
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, match", [
    (dict(q_b=jnp.ones((2 * 24, 64))), ValueError, r"q_b \["),
    (dict(a=jnp.ones((6, 104))), ValueError, r"a \[B, T, C\]"),
    (dict(latent=jnp.ones((2, 10, 32, 1))), ValueError, r"latent \[B, S, R\]"),
    (dict(a=jnp.ones((2, 3, 106))), ValueError, "a's last axis 106"),
    (dict(k_b=jnp.ones((32, 3, 16))), ValueError, "k_b has shape"),
    (dict(q_a_norm=jnp.ones((63,))), ValueError, "q_a_norm has shape"),
    (dict(kv_a_norm=jnp.ones((32, 1))), ValueError, "kv_a_norm has shape"),
    (dict(cos=jnp.ones((2, 3, 5))), ValueError, "cos has shape"),
    (dict(sin=jnp.ones((2, 1, 4))), ValueError, "sin has shape"),
    (dict(pe=jnp.ones((2, 10, 16))), ValueError, "pe has shape"),
    (dict(starts=jnp.zeros((3,), jnp.int32)), ValueError, "starts has shape"),
    (dict(latent=jnp.ones((2, 2, 32)), pe=jnp.ones((2, 2, 8))), ValueError, "3 new tokens for a cache of 2"),
    (dict(cos=jnp.ones((2, 3, 4), jnp.bfloat16)), TypeError, "cos must be float32"),
    (dict(sin=jnp.ones((2, 3, 4), jnp.float16)), TypeError, "sin must be float32"),
    (dict(starts=np.zeros((2,), np.int64)), TypeError, "starts must be int32"),
    (dict(starts=jnp.zeros((2,), jnp.float32)), TypeError, "starts must be int32"),
    (dict(q_b=jnp.ones((2, 24, 64), jnp.bfloat16)), TypeError, "q_b is bfloat16 but a is float32"),
    (dict(pe=jnp.ones((2, 10, 8), jnp.bfloat16)), TypeError, "pe is bfloat16"),
    (dict(a=jnp.ones((2, 3, 104), jnp.float16)), TypeError, "a must be float32 or bfloat16"),
    (dict(k_b=[[1.0]]), TypeError, "k_b must be an array"),
])
def test_bad_input_is_a_clear_error(change, error, match):
    with pytest.raises(error, match=match):
        mla_pre(**_bad(**change), eps=EPS)


def test_bad_impl():
    with pytest.raises(ValueError, match="impl must be 'ffi' or 'xla', got 'bogus'"):
        mla_pre(**_bad(), eps=EPS, impl="bogus")


# ------------------------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """The tiny fp32 model with kernels="ffi" without and with mla_pre in ffi_ops (the default has it), and its
    params."""
    on = kj.configs.tiny(kernels="ffi")
    off = dataclasses.replace(on, ffi_ops=tuple(op for op in on.ffi_ops if op != "mla_pre"))
    assert "mla_pre" in kj.config.DEFAULT_FFI_OPS
    assert off.impl("mla_pre") == "xla" and on.impl("mla_pre") == "ffi"
    return off, on, kj.init_params(on, jax.random.key(0))


def _step_calls(params, cfg, b=2, t=1, target=TARGET) -> int:
    """Custom calls to `target` in the lowered step (absorbed mode) of b rows x t new tokens over a cache."""
    from kdtree_jax.model import init_cache, step
    from kdtree_jax.sharding import trace_context
    cache = init_cache(cfg, b, 32)
    tokens = jnp.ones((b, t), jnp.int32)
    with trace_context(params, cfg):
        text = jax.jit(lambda p, c, x: step(p, cfg, x, c).logits).lower(params, cache, tokens).as_text()
    return text.count(f'"{target}"') + text.count(f"@{target}")


def test_decode_step_runs_mla_pre_only_where_the_config_asks(tiny):
    off, on, params = tiny
    with jax.default_device(jax.devices("cpu")[0]):
        assert _step_calls(params, off, target="kdtree_mla_verify") >= 1  # control: custom calls are counted
        assert _step_calls(params, off) == 0
        assert _step_calls(params, on) == on.num_hidden_layers  # every layer's projections: one call each
        assert _step_calls(params, on, b=2, t=16) == on.num_hidden_layers  # a verify step of 32 tokens
        assert 2 * 17 > MAX_ROWS and _step_calls(params, on, b=2, t=17) == 0  # more tokens: the model's own ops


def _random_cache(cfg, b, s, rng):
    from kdtree_jax.model import init_cache
    cache = init_cache(cfg, b, s)
    rand = lambda xs: tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in xs)
    return dataclasses.replace(cache, latent=rand(cache.latent), k_pe=rand(cache.k_pe))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_step_with_mla_pre_equals_without(tiny, dtype):
    """Decode (T = 1) and a 5-node tree verify over a prefilled cache: logits and caches with mla_pre on = off."""
    from kdtree_jax.model import prefill, step
    off, on, params = tiny
    if dtype == "bfloat16":
        off, on = (dataclasses.replace(c, dtype=dtype) for c in (off, on))
        params = kj.init_params(on, jax.random.key(0))
    rng = np.random.default_rng(81)
    prompt = jnp.asarray(rng.integers(0, off.vocab_size, size=(2, 7)), jnp.int32)
    cache = _random_cache(off, 2, 24, rng)  # slots past the prompt hold junk: only the written ones may change
    pre = jax.jit(prefill, static_argnums=1)(params, off, prompt, jnp.asarray([7, 4], jnp.int32), cache).cache
    mask = jnp.asarray(np.tril(np.ones((5, 5), bool)) & (rng.random((2, 5, 5)) < 0.6) | np.eye(5, dtype=bool))
    mask = mask.at[:, :, 0].set(True)
    depths = jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
    for tokens, extra in ((prompt[:, :1], ()), (prompt[:, 2:7], (depths, mask))):
        outs = [jax.jit(step, static_argnums=1)(params, c, tokens, pre, *extra) for c in (off, on)]
        got, want = (np.asarray(o.logits, np.float64) for o in (outs[1], outs[0]))
        assert np.all(np.isfinite(got))
        if dtype == "float32":
            assert rel_err(got, want) <= 1e-5
        else:  # bf16: the kernel rounds where the model does but sums in its own order
            assert np.max(np.abs(got - want)) <= 0.05 * np.max(np.abs(want))
        for g, w in zip(outs[1].cache.latent + outs[1].cache.k_pe, outs[0].cache.latent + outs[0].cache.k_pe):
            assert rel_err(_f32(g), _f32(w)) <= bound(dtype)


def test_greedy_ar_and_ddtree_with_mla_pre_equal_without(tiny):
    off, on, params = tiny
    drafter = kj.init_drafter(on, jax.random.key(1), num_layers=1, block_size=4)
    prompts = [[5, 6, 7, 8], [9, 10]]
    ar_off = kj.generate(params, off, prompts, max_new_tokens=10, method="ar").tokens
    ar_on = kj.generate(params, on, prompts, max_new_tokens=10, method="ar").tokens
    dd_on = kj.generate(params, on, prompts, max_new_tokens=10, method="ddtree", drafter=drafter, budget=6).tokens
    assert all(len(t) == 10 for t in ar_off)
    assert [list(t) for t in ar_on] == [list(t) for t in ar_off]
    assert [list(t) for t in dd_on] == [list(t) for t in ar_off]


# ------------------------------------------------------------------------------------------------------------------
# GPU (the device machine: JAX_PLATFORMS=cuda,cpu pytest -m gpu): the CUDA kernel against the reference on the CPU
# ------------------------------------------------------------------------------------------------------------------


def _poison(count):
    """Leave NaN in freshly freed device memory, which the next output buffers are likely to reuse."""
    junk = jnp.full((count,), jnp.nan, jnp.float32, device=jax.devices("gpu")[0])
    junk.block_until_ready()
    junk.delete()


def _gpu_case(seed, b, t, h, rq, s=300, dn=128, dr=64, r=512, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, s - t + 1, size=b)
    starts[0] = 0
    if b > 1:
        starts[-1] = s + 11  # clamped to S - T
    return _case(rng, b, t, h, s, starts, rq=rq, r=r, dn=dn, dr=dr, dtype=dtype, device=jax.devices("gpu")[0])


def _gpu_lowered_calls(args) -> int:
    text = jax.jit(lambda *x: mla_pre(*x, eps=EPS)).lower(*args).as_text()
    return text.count(f'"{TARGET}"') + text.count(f"@{TARGET}")


# B x T = 1 (decode at one row), 9 (decode at C = 9), 17 (a 16-node tree + root), 32 (MAX_ROWS)
GPU_ROWS = [(1, 1), (9, 1), (1, 17), (2, 16)]


@gpu
@needs_gpu
@pytest.mark.parametrize("rq", [1536, 512])
@pytest.mark.parametrize("h", [1, 8])
@pytest.mark.parametrize("b, t", GPU_ROWS)
def test_gpu_fast_path_equals_reference(b, t, h, rq):
    args = _gpu_case(b * 1000 + t * 10 + h + rq, b, t, h, rq)
    assert _gpu_lowered_calls(args) == 1  # the CUDA kernel, not the fallback
    _poison(4 * b * t * h * 512 + 2 * b * 300 * 576)
    got = _run(args)
    assert got[0].devices() == {jax.devices("gpu")[0]}
    _check(got, _ref(args, jax.devices("cpu")[0]), args, jnp.bfloat16, note=f"gpu B={b} T={t} H={h} Rq={rq}")


@gpu
@needs_gpu
@pytest.mark.parametrize("b, t, h", [(1, 1, 8), (2, 16, 8), (9, 1, 1)])
def test_gpu_poisoned_donated_caches_never_leak_nan(b, t, h):
    """Donated caches with NaN in the rows to be written, and NaN left in freed memory for the results: nothing
    comes back NaN, and the results equal the reference from the clean caches."""
    clean = _gpu_case(7000 + 100 * b + 10 * t + h, b, t, h, 1536)
    want = _ref(clean, jax.devices("cpu")[0])
    lat, pe = _f32(clean[7]).copy(), _f32(clean[8]).copy()
    for row, d in enumerate(_slots(clean[9], t, 300)):
        lat[row, d:d + t] = np.nan
        pe[row, d:d + t] = np.nan
    poisoned = list(clean)
    poisoned[7], poisoned[8] = (jax.device_put(jnp.asarray(x, jnp.bfloat16), jax.devices("gpu")[0]) for x in (lat, pe))
    _poison(4 * b * t * h * 512)
    got = _run(poisoned, donate=True)
    for name, g in zip(NAMES, got):
        assert np.all(np.isfinite(_f32(g))), name
    _check(got, want, clean, jnp.bfloat16, note="gpu poisoned")


@gpu
@needs_gpu
@pytest.mark.parametrize("b, t, h, rq, dn, dr, r, dtype", [
    (3, 11, 8, 1536, 128, 64, 512, jnp.bfloat16),  # B T = 33 > MAX_ROWS
    (1, 9, 8, 1536, 64, 64, 512, jnp.bfloat16),  # dn = 64
    (2, 3, 4, 320, 128, 64, 512, jnp.bfloat16),  # Rq not a multiple of 256
    (1, 2, 2, 768, 128, 64, 512, jnp.bfloat16),  # Rq a multiple of 256 without a kernel instance (FAST_RQ)
    (1, 9, 8, 512, 128, 64, 512, jnp.float32),  # float32
    (2, 3, 2, 64, 16, 8, 32, jnp.bfloat16),  # the CPU tests' small heads
])
def test_gpu_off_the_fast_path_falls_back_and_matches(b, t, h, rq, dn, dr, r, dtype):
    rng = np.random.default_rng(b * 1000 + t * 10 + h + rq + dn)
    args = _case(rng, b, t, h, 300, [0, 295, 7][:b], rq=rq, r=r, dn=dn, dr=dr, dtype=dtype,
                 device=jax.devices("gpu")[0])
    assert _gpu_lowered_calls(args) == 0  # the reference on the GPU
    got = _run(args)
    _check(got, _ref(args, jax.devices("cpu")[0]), args, dtype, note="gpu fallback")


@gpu
@needs_gpu
@pytest.mark.parametrize("b, t, h", [(1, 1, 8), (2, 16, 8), (1, 17, 1)])
def test_gpu_two_calls_are_bit_identical(b, t, h):
    args = _gpu_case(8000 + 100 * b + 10 * t + h, b, t, h, 1536)
    first = [_f32(x) for x in _run(args)]
    _poison(4 * b * t * h * 512)
    second = [_f32(x) for x in _run(args)]
    for name, x, y in zip(NAMES, first, second):
        np.testing.assert_array_equal(x, y, err_msg=name)
