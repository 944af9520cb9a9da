"""fused_dot: the custom call (C++ on CPU; CUDA, marked gpu) and its pure-JAX reference against a float64 numpy
computation of the layer's math on the same bf16 inputs (fresh random inputs, never zeros; NaN never passes); the
normalized rows equal to the reference's but for rare 1-2 ulp roundings; the CUDA kernel at one device's K2.6 shapes
at every split; the model with it equal to the model without within bf16 rounding; greedy ddtree (whose verify steps
run XLA's operations) with it equal to ar (whose decode steps run the custom call); clear errors for bad arguments."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from kdtree_jax.kernels.fused_dot import (FLAG_L2_LINES, FLAG_MMA, FLAG_PLAIN, FLAG_WEIGHT_PARAM, MAX_CORE_ROWS,
                                          MAX_ROWS, SMEM_BYTES, cuda_smem_bytes, fused_dot, fused_dot_ref,
                                          on_cuda_path, on_ffi_path)

from conftest import needs_gpu, step_calls, tiny_bf16_model, with_ffi_op

gpu = pytest.mark.gpu
EPS = 1e-6
BF = jnp.bfloat16


def make(rng, lead, k, n, n2=0, norm=True, adds=0, gated=False):
    """Random bf16 operands: x with a few large channels (as a residual stream has), weights ~ 1/sqrt(K), a norm
    weight near 1, addends of the output's shape."""
    x = rng.standard_normal(lead + (k,))
    x[..., rng.integers(0, k, 3)] *= 20.0
    out = n // 2 if gated else n
    return dict(x=jnp.asarray(x, BF), w=jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), BF),
                w2=jnp.asarray(rng.standard_normal((k, n2)) / np.sqrt(k), BF) if n2 else None,
                norm=jnp.asarray(1.0 + 0.3 * rng.standard_normal(k), BF) if norm else None,
                adds=tuple(jnp.asarray(rng.standard_normal(lead + (out,)), BF) for _ in range(adds)))


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def expected(ops, gated, gated2, want_xn=True):
    """float64 of the layer's math on the reference's normalized rows (bf16, as the model rounds them), with each
    output's error bound: the custom call's normalized rows may differ from the reference's by 1-2 bf16 ulps in rare
    elements (its sums of squares in another order; 2^-7 of sum |x'| |w| allowed), fp32 accumulation (K 2^-23 of it),
    then the roundings of the epilogue."""
    x, norm = ops["x"], ops["norm"]
    xs = fused_dot_ref(x, ops["w"][:, :16], norm=norm, eps=EPS, want_xn=True)[2]  # the reference's x' (bf16)
    xs64 = f64(xs).reshape(-1, x.shape[-1])
    k = x.shape[-1]

    def seg(w, g):
        w64 = f64(w)
        a, scale = xs64 @ w64, np.abs(xs64) @ np.abs(w64)
        err = (2.0**-7 + k * 2.0**-23) * scale + 2.0**-8 * np.abs(a)  # |computed a, rounded - exact a|
        if not g:
            return a, err
        f = w64.shape[1] // 2
        gate, up, eg, eu = a[:, :f], a[:, f:], err[:, :f], err[:, f:]
        silu = gate / (1.0 + np.exp(-gate))
        h = silu * up
        bound = 1.1 * eg * (np.abs(up) + eu) + np.abs(silu) * eu + 2.0**-7 * (np.abs(gate * up) + np.abs(h))
        return h, bound

    y, e = seg(ops["w"], gated)
    for a in ops["adds"]:
        a64 = f64(a).reshape(y.shape)
        y = a64 + y
        e = e + 2.0**-8 * (np.abs(y) + np.abs(a64))
    y2 = seg(ops["w2"], gated2) if ops["w2"] is not None else None
    return (y, e), y2, xs


def check(got, want, dtype):
    y, bound = want
    g = f64(got).reshape(y.shape)
    assert got.dtype == dtype
    assert np.isfinite(g).all()
    if dtype == jnp.float32:
        bound = bound - 2.0**-8 * np.abs(y)  # no output rounding
    assert (np.abs(g - y) <= bound + 1e-30).all(), float(np.max(np.abs(g - y) / (bound + 1e-30)))


def check_xn(xn, xs):
    """The normalized rows: the reference's, except where the row's scale, summed in another order (and on the GPU an
    approximate reciprocal square root), lands x r on the other side of a bf16 rounding: then 1-2 ulps apart (x r
    rounded, then times the norm weight, rounded)."""
    got, want = f64(xn), f64(xs)
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= 2.0**-6 * np.abs(want)).all(), float(np.max(np.abs(got - want)))
    assert np.mean(got == want) >= 0.99  # nearly all bit for bit


def run(ops, impl="ffi", **kw):
    names = ("x", "w", "w2", "norm", "adds")
    f = jax.jit(lambda x, w, w2, norm, adds: fused_dot(x, w, w2=w2, norm=norm, adds=adds, eps=EPS, impl=impl, **kw))
    return f(*(ops[n] for n in names))


# (lead, K, N, N2, norm, addends, gated, gated2, out dtype): the four calls of a layer and the edges around them
CASES = [
    ((1,), 128, 96, 0, True, 0, False, False, BF),  # the attention's norm + q_a/kv_a
    ((3,), 64, 64, 0, False, 1, False, False, BF),  # o + the residual
    ((2, 3), 128, 48, 64, True, 0, False, True, jnp.float32),  # the MLP's norm + router (f32) + shared gate/up
    ((5,), 64, 64, 0, False, 2, False, False, BF),  # the shared down + the experts' output + the residual
    ((17,), 192, 128, 0, True, 0, True, False, BF),  # a dense layer's gate/up
    ((33,), 64, 32, 32, False, 0, False, False, jnp.float32),  # past the CUDA kernel's rows (the CPU call takes it)
]


@pytest.mark.parametrize("lead, k, n, n2, norm, adds, gated, gated2, dt", CASES)
def test_cpu_call_and_reference_are_the_layer_math(lead, k, n, n2, norm, adds, gated, gated2, dt):
    rng = np.random.default_rng(hash((lead, k, n, n2, adds)) % 2**32)
    ops = make(rng, lead, k, n, n2, norm, adds, gated)
    assert on_ffi_path(ops["x"], ops["w"], ops["w2"], ops["norm"], ops["adds"])
    want, want2, xs = expected(ops, gated, gated2)
    for impl in ("ffi", "xla"):
        y, y2, xn = run(ops, impl, gated=gated, gated2=gated2, out_dtype=dt, want_xn=True)
        check(y, want, dt)
        if n2:
            check(y2, want2, BF)
        else:
            assert y2 is None
        check_xn(xn, xs)


def test_off_the_custom_call_runs_the_reference():
    rng = np.random.default_rng(7)
    ops = make(rng, (2,), 64, 32)
    ops = {k: (jax.tree.map(lambda a: a.astype(jnp.float32), v) if v is not None else None) for k, v in ops.items()}
    assert not on_ffi_path(ops["x"], ops["w"], ops["w2"], ops["norm"], ops["adds"])
    got, want = run(ops), run(ops, "xla")
    np.testing.assert_array_equal(got[0], want[0])
    x = jnp.ones((MAX_ROWS + 1, 64), BF)
    assert not on_cuda_path(x, jnp.ones((64, 64), BF)) and not on_cuda_path(x[:1, :48], jnp.ones((48, 64), BF))
    assert on_cuda_path(x[:4], jnp.ones((64, 128), BF)) and not on_cuda_path(x[:1], jnp.ones((64, 48), BF))
    assert on_cuda_path(x[:MAX_ROWS], jnp.ones((64, 128), BF))
    # K = 1216 = 64 x 19: only split 1 divides K / 64, and 32 rows of a 1216 slice are past a block's shared memory
    wide = jnp.ones((MAX_ROWS, 1216), BF)
    assert cuda_smem_bytes(MAX_ROWS, 1216, 1) > SMEM_BYTES and not on_cuda_path(wide, jnp.ones((1216, 64), BF))
    assert on_cuda_path(wide[:8], jnp.ones((1216, 64), BF))
    assert not on_cuda_path(x[:1], jnp.ones((64, 64), BF), jnp.ones((64, 32), BF))


def test_a_stack_is_read_at_its_layer_in_place():
    """layer=i with stacks w [L, K, N], w2 [L, K, N2], norm [L, K]: the custom call gives exactly what it gives for
    the i-th slices passed alone, and the reference the same math; the call's operands are the whole stacks (no
    slice of them for XLA to copy out)."""
    rng = np.random.default_rng(21)
    n_layers, lead, k, n, n2 = 3, (2, 3), 128, 64, 128
    layers = [make(rng, lead, k, n, n2, True, 1) for _ in range(n_layers)]
    x, add = layers[0]["x"], layers[0]["adds"][0]
    w, w2, norm = (jnp.stack([ops[name] for ops in layers]) for name in ("w", "w2", "norm"))
    fns = {impl: jax.jit(lambda x, w, w2, norm, add, i, impl=impl: fused_dot(
        x, w, w2=w2, norm=norm, adds=(add,), eps=EPS, want_xn=True, impl=impl, layer=i), static_argnums=5)
        for impl in ("ffi", "xla")}
    for impl, stacked in fns.items():
        for i in range(n_layers):
            got = stacked(x, w, w2, norm, add, i)
            alone = run(dict(layers[i], x=x, adds=(add,)), impl, want_xn=True)
            for g, a in zip(got, alone):
                np.testing.assert_array_equal(f64(g), f64(a))
            want, want2, xs = expected(dict(layers[i], x=x, adds=(add,)), False, False)
            check(got[0], want, BF)
            check(got[1], want2, BF)
            check_xn(got[2], xs)
    text = fns["ffi"].lower(x, w, w2, norm, add, 2).as_text()
    calls = [line for line in text.splitlines() if "kdtree_fused_dot" in line]
    assert calls and all(f"tensor<{n_layers}x{k}x{n}xbf16>" in c and f"tensor<{n_layers}x{k}xbf16>" in c
                         for c in calls), calls
    assert "layer = 2" in calls[0]
    with pytest.raises(ValueError, match=r"layer must be in \[0, 3\) for a stack of 3, got 3"):
        fused_dot(x, w, layer=3)
    with pytest.raises(ValueError, match=r"with layer, w must be a stack \[L, K, N\]"):
        fused_dot(x, w[0], layer=0)
    with pytest.raises(ValueError, match="with layer, norm must be a stack of 3 like w"):
        fused_dot(x, w, norm=norm[0], layer=1)
    with pytest.raises(TypeError, match="layer must be None or an int"):
        fused_dot(x, w, layer=1.0)


def test_bad_arguments_are_named():
    ops = make(np.random.default_rng(1), (2,), 128, 64)
    x, w = ops["x"], ops["w"]
    with pytest.raises(ValueError, match=r"expected x \[..., K\] and w \[K, N\]"):
        fused_dot(x, w[:64])
    with pytest.raises(ValueError, match=r"expected norm \[K\] = \[128\]"):
        fused_dot(x, w, norm=jnp.ones((64,), BF))
    with pytest.raises(ValueError, match=r"expected w2 \[K, N2\]"):
        fused_dot(x, w, w2=w[:64])
    with pytest.raises(ValueError, match="gated w needs an even N"):
        fused_dot(x, w[:, :63], gated=True)
    with pytest.raises(ValueError, match=r"adds\[0\] must be \(2, 64\)"):
        fused_dot(x, w, adds=(jnp.ones((2, 32), BF),))
    with pytest.raises(ValueError, match="at most two addends"):
        fused_dot(x, w, adds=(jnp.ones((2, 64), BF),) * 3)
    with pytest.raises(TypeError, match="out_dtype must be bfloat16 or float32"):
        fused_dot(x, w, out_dtype=jnp.int32)
    with pytest.raises(TypeError, match="keeps x's dtype"):
        fused_dot(x, w, adds=(jnp.ones((2, 64), BF),), out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="split must be 0 or one of 1, 2, 4, 8, 16 dividing K / 64"):
        fused_dot(x, w, split=4)
    with pytest.raises(ValueError, match="impl must be"):
        fused_dot(x, w, impl="cuda")
    with pytest.raises(TypeError, match="x must be an array"):
        fused_dot([[1.0]], w)
    big = jnp.ones((MAX_ROWS, 7168), BF), jnp.ones((7168, 64), BF)  # 32 rows of a 7168 slice: ~1 MB of x'
    with pytest.raises(ValueError, match="too long for a block's shared memory at 32 rows"):
        fused_dot(*big, split=1)
    assert cuda_smem_bytes(MAX_ROWS, 7168, 8) <= SMEM_BYTES  # (a split that fits passes the check)


# ---------------------------------------------------------------------------------------------------------------
# The model


def _with(cfg, on: bool):
    return with_ffi_op(cfg, "fused_dot", on)


def test_decode_step_with_fused_dot_equals_without_within_rounding():
    cfg, params = tiny_bf16_model()
    from kdtree_jax.model import init_cache, prefill, step
    prompt = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    outs = []
    for c in (_with(cfg, False), _with(cfg, True)):
        cache = init_cache(c, 2, 32)
        cache = prefill(params, c, prompt, jnp.asarray([6, 6], jnp.int32), cache).cache
        nxt = jnp.asarray([[3], [9]], jnp.int32)
        outs.append(np.asarray(step(params, c, nxt, cache).logits, np.float64))
    a, b = outs
    assert np.isfinite(b).all()
    assert np.max(np.abs(a - b)) <= 0.05 * np.max(np.abs(a)), np.max(np.abs(a - b))


def test_decode_step_runs_fused_dot_only_where_asked():
    with jax.default_device(jax.devices("cpu")[0]):
        cfg, params = tiny_bf16_model()
        off, on = _with(cfg, False), _with(cfg, True)
        assert on.impl("fused_dot") == "ffi" and off.impl("fused_dot") == "xla"
        count = partial(step_calls, target="kdtree_fused_dot")
        assert count(params, off) == 0
        # four a layer: norm + q_a/kv_a, o + residual, norm + router/gate-up (or the dense gate/up), down + adds
        assert count(params, on) == 4 * cfg.num_hidden_layers
        assert count(params, on, rows=1, t=MAX_ROWS + 1) == 0  # past MAX_ROWS: the model's own operations
        sharded = kj.shard_params(params, on, kj.make_mesh(ep=4, devices=jax.devices("cpu")[:4]))
        assert count(sharded, on) == 0


def test_drafter_block_with_fused_dot_equals_without_within_rounding():
    """The drafter's block (`drafter.draft`) with its dense weights as fused_dot calls (four a layer, reading the
    stacked weights in place, and one for the final norm and the lm_head) equals the XLA one within bf16 rounding,
    on the CPU custom call; past MAX_ROWS rows it keeps XLA's dots."""
    from kdtree_jax.drafter import append_context, draft, init_draft_cache
    cfg, params = tiny_bf16_model()
    drafter = kj.init_drafter(cfg, jax.random.key(4), num_layers=2, block_size=4)
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.standard_normal((cfg.num_hidden_layers, 2, 9, cfg.hidden_size)), BF)
    cache = append_context(drafter, init_draft_cache(drafter.cfg, 2, 32), hidden, jnp.zeros((2,), jnp.int32))
    lengths, bonus = jnp.asarray([9, 4], jnp.int32), jnp.asarray([65, 101], jnp.int32)
    fns = {dense: jax.jit(lambda c, dense=dense: draft(drafter, params, c, lengths, bonus, dense=dense))
           for dense in ("xla", "ffi")}
    want, got = (np.asarray(fns[dense](cache), np.float64) for dense in ("xla", "ffi"))
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - want)) <= 0.05 * np.max(np.abs(want)), np.max(np.abs(got - want))
    lines = [line for line in fns["ffi"].lower(cache).as_text().splitlines() if "kdtree_fused_dot" in line]
    assert len(lines) == 4 * drafter.cfg.num_layers + 1, len(lines)  # and the final norm + lm_head
    stacked = re.compile(rf"tensor<{drafter.cfg.num_layers}x\d+x\d+xbf16>")  # the stacked weights, no slice copied
    assert sum(bool(stacked.search(line)) for line in lines) == 4 * drafter.cfg.num_layers, lines[0]
    big = init_draft_cache(drafter.cfg, MAX_ROWS // 4 + 1, 32)  # (MAX_ROWS / 4 + 1) x a block of 4: past MAX_ROWS
    past = jax.jit(lambda c: draft(drafter, params, c, jnp.zeros((MAX_ROWS // 4 + 1,), jnp.int32),
                                   jnp.ones((MAX_ROWS // 4 + 1,), jnp.int32), dense="ffi"))
    assert past.lower(big).as_text().count("kdtree_fused_dot") == 0


def test_greedy_ddtree_with_fused_dot_equals_ar():
    cfg, params = tiny_bf16_model()
    cfg = _with(cfg, True)
    drafter = kj.init_drafter(cfg, jax.random.key(4), num_layers=1, block_size=4)
    prompts = [[1, 2, 3, 4], [5, 6]]
    ar = kj.generate(params, cfg, prompts, max_new_tokens=12, method="ar").tokens
    dd = kj.generate(params, cfg, prompts, max_new_tokens=12, method="ddtree", drafter=drafter, budget=8).tokens
    ch = kj.generate(params, cfg, prompts, max_new_tokens=12, method="chain", drafter=drafter).tokens
    assert [list(t) for t in dd] == [list(t) for t in ar] == [list(t) for t in ch]


# ---------------------------------------------------------------------------------------------------------------
# CUDA: one device's share of K2.6 (ep=8): the four calls of a MoE layer, a dense layer's two, at the rows of a
# decode (1), up to the CUDA-core kernel's most (4), and on the tensor cores past it: 5, 8 (a drafter's block), 9
# and 17 (a verify of budget 8 and 16: the first rows of the second and third 8-row group), 32 (the most)

GPU_CASES = [
    ((1,), 7168, 2112, 0, True, 0, False, False, BF),  # norm + q_a/kv_a
    ((4,), 7168, 2112, 0, True, 0, False, False, BF),
    ((1,), 1024, 7168, 0, False, 1, False, False, BF),  # o + residual
    ((3,), 1024, 7168, 0, False, 1, False, False, BF),
    ((1,), 7168, 384, 512, True, 0, False, True, jnp.float32),  # norm + router + shared gate/up (+ xn)
    ((2,), 7168, 384, 512, True, 0, False, True, jnp.float32),
    ((1,), 256, 7168, 0, False, 2, False, False, BF),  # shared down + experts + residual
    ((2, 2), 256, 7168, 0, False, 2, False, False, BF),
    ((1,), 7168, 4608, 0, True, 0, True, False, BF),  # a dense layer's norm + gate/up
    ((2,), 2304, 7168, 0, False, 1, False, False, BF),  # its down + residual
    ((5,), 7168, 2112, 0, True, 0, False, False, BF),  # the tensor cores
    ((8,), 7168, 4608, 0, True, 0, True, False, BF),
    ((9,), 1024, 7168, 0, False, 1, False, False, BF),
    ((17,), 7168, 384, 512, True, 0, False, True, jnp.float32),
    ((2, 8), 2304, 7168, 0, False, 2, False, False, BF),
    ((32,), 7168, 2112, 0, True, 0, False, False, BF),
    ((31,), 256, 7168, 0, False, 2, False, False, BF),
]


def _poison(count):
    junk = jnp.full((count,), jnp.nan, jnp.float32, device=jax.devices("gpu")[0])
    junk.block_until_ready()
    junk.delete()


def _on(ops, dev):
    return {k: jax.device_put(v, dev) if v is not None else None for k, v in ops.items()}


@gpu
@needs_gpu
@pytest.mark.parametrize("lead, k, n, n2, norm, adds, gated, gated2, dt", GPU_CASES)
def test_gpu_kernel_is_the_layer_math_at_every_split(lead, k, n, n2, norm, adds, gated, gated2, dt):
    rng = np.random.default_rng(hash(("gpu", lead, k, n, n2, adds)) % 2**32)
    ops = make(rng, lead, k, n, n2, norm, adds, gated)
    assert on_cuda_path(ops["x"], ops["w"], ops["w2"])
    want, want2, xs = expected(ops, gated, gated2)
    cpu = run(_on(ops, jax.devices("cpu")[0]), gated=gated, gated2=gated2, out_dtype=dt, want_xn=True)
    check(cpu[0], want, dt)
    g_ops = _on(ops, jax.devices("gpu")[0])
    m = int(np.prod(lead))
    splits = [s for s in (0, 1, 2, 4, 8, 16) if (k // 64) % max(s, 1) == 0
              and (s == 0 or cuda_smem_bytes(m, k, s) <= SMEM_BYTES)]
    # every split that fits with the model's flags; the other flags (plain launch, whole L2 lines, the tensor cores
    # at M <= 4) with the chosen split
    runs = [(s, FLAG_WEIGHT_PARAM) for s in splits] + [(0, f) for f in (0, FLAG_PLAIN, FLAG_L2_LINES)]
    if m <= MAX_CORE_ROWS:
        runs += [(0, FLAG_MMA | FLAG_WEIGHT_PARAM), (16 if (k // 64) % 16 == 0 else 0, FLAG_MMA)]
    for split, flags in runs:
        _poison(4 * int(np.prod(lead)) * (n + n2 + k) + 4096)
        y, y2, xn = run(g_ops, gated=gated, gated2=gated2, out_dtype=dt, want_xn=True, split=split, flags=flags)
        check(y, want, dt)
        if n2:
            check(y2, want2, BF)
        check_xn(xn, xs)


@gpu
@needs_gpu
@pytest.mark.parametrize("lead", [(1,), (8,)])
def test_gpu_kernel_reads_a_stack_at_its_layer(lead):
    """A drafter layer's q (norm, 8 heads of 112) and gate/up read from stacks of 3 layers at layer 2 (an element
    offset of 2 K N into the weights, 2 K into the norm), on both kernels: each layer's own math."""
    rng = np.random.default_rng(13 + lead[0])
    n_layers, k = 3, 7168
    layers = [make(rng, lead, k, 896, 0, True) for _ in range(n_layers)]
    x = layers[0]["x"]
    stacks = {name: jnp.stack([ops[name] for ops in layers]) for name in ("w", "norm")}
    ups = jnp.stack([jnp.asarray(rng.standard_normal((k, 2304)) / np.sqrt(k), BF) for _ in range(n_layers)])
    gates = jnp.stack([jnp.asarray(rng.standard_normal((k, 2304)) / np.sqrt(k), BF) for _ in range(n_layers)])
    dev = jax.devices("gpu")[0]
    g = {name: jax.device_put(a, dev) for name, a in dict(stacks, x=x, ups=ups, gates=gates).items()}
    q = jax.jit(lambda x, w, nw: fused_dot(x, w, norm=nw, eps=EPS, want_xn=True, layer=2, flags=FLAG_WEIGHT_PARAM))
    mlp = jax.jit(lambda x, w, w2, nw: fused_dot(x, w, w2=w2, norm=nw, eps=EPS, layer=2, flags=FLAG_WEIGHT_PARAM))
    _poison(4 * lead[0] * (896 + 4608 + k) + 4096)
    y, _, xn = q(g["x"], g["w"], g["norm"])
    want, _, xs = expected(dict(layers[2], x=x), False, False)
    check(y, want, BF)
    check_xn(xn, xs)
    gate, up, _ = mlp(g["x"], g["gates"], g["ups"], g["norm"])
    ops = dict(layers[2], x=x, w=gates[2], w2=ups[2])
    want_gate, want_up, _ = expected(ops, False, False)
    check(gate, want_gate, BF)
    check(up, want_up, BF)


@gpu
@needs_gpu
def test_gpu_kernel_reads_a_weight_computed_just_before_it():
    """Without FLAG_WEIGHT_PARAM the weights are read only after the wait for the kernel ahead: a weight that kernel
    writes (a scale of w fused right before the call) is the new one, every time."""
    rng = np.random.default_rng(12)
    ops = _on(make(rng, (1,), 7168, 2112), jax.devices("gpu")[0])
    f = jax.jit(lambda x, w, nw, c: fused_dot(x, w * c, norm=nw, eps=EPS)[0])
    for scale in (1.0, -2.0, 0.5, 4.0):  # powers of two: w * scale is exact in bf16
        want = expected(dict(ops, w=ops["w"] * jnp.bfloat16(scale)), False, False)[0]
        check(f(ops["x"], ops["w"], ops["norm"], jnp.bfloat16(scale)), want, BF)


@gpu
@needs_gpu
def test_gpu_kernel_is_deterministic_and_under_a_command_buffer():
    rng = np.random.default_rng(11)
    ops = _on(make(rng, (4,), 7168, 2112, 512), jax.devices("gpu")[0])

    @jax.jit
    def chain(x, w, w2, nw):
        for _ in range(3):  # several calls in one program (XLA may capture them in a command buffer)
            y, y2, xn = fused_dot(x, w, w2=w2, norm=nw, gated2=True, want_xn=True, eps=EPS)
            x = (jnp.concatenate([y] * 4, axis=1)[:, :7168] + xn).astype(BF)
        return x, y2

    first = jax.tree.map(np.asarray, chain(ops["x"], ops["w"], ops["w2"], ops["norm"]))
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in first)
    again = jax.tree.map(np.asarray, chain(ops["x"], ops["w"], ops["w2"], ops["norm"]))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
