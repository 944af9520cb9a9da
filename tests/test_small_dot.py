"""small_dot: the custom call (C++ on CPU; CUDA, marked gpu) and its pure-JAX reference against a float64 numpy
product of the same bf16 inputs, on fresh random inputs; the model with small_dot equal to the model with XLA's
dots within bf16 rounding, and greedy ddtree with it equal to ar; clear errors for bad arguments."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from kdtree_jax.kernels.small_dot import FLAG_PLAIN, FLAG_WEIGHT_PARAM, on_fast_path, small_dot, small_dot_ref

from conftest import needs_gpu

gpu = pytest.mark.gpu
# every custom call but fused_dot, which takes the dense matmuls of a decode step over from small_dot when on
SMALL_DOT_OPS = tuple(op for op in kj.config.FFI_OPS if op != "fused_dot")

# (lead dims of x, K, w's dims after K): decode / verify rows, one on each side of every token-tile size
CPU_CASES = [((1,), 64, (64,)), ((9,), 128, (192,)), ((2, 8), 192, (4, 64)), ((33,), 64, (128,)), ((64,), 128, (64,))]


def inputs(rng, lead, k, tail):
    x = jnp.asarray(rng.standard_normal(lead + (k,)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k,) + tail) / np.sqrt(k), jnp.bfloat16)
    return x, w


def check_product(y, x, w, out_dtype):
    """|y - x.w| within one rounding to out_dtype plus fp32 accumulation (K eps32 of sum |x| |w|); no NaN."""
    x64 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    w64 = np.asarray(w, np.float64).reshape(w.shape[0], -1)
    exact, scale = x64 @ w64, np.abs(x64) @ np.abs(w64)
    got = np.asarray(y, np.float64).reshape(exact.shape)
    assert y.dtype == out_dtype and y.shape == x.shape[:-1] + w.shape[1:]
    assert np.isfinite(got).all()
    rounding = 2.0**-8 * np.abs(exact) if out_dtype == jnp.bfloat16 else 0.0
    bound = rounding + x.shape[-1] * 2.0**-23 * scale + 1e-30
    assert (np.abs(got - exact) <= bound).all(), float(np.max(np.abs(got - exact) / bound))


@pytest.mark.parametrize("lead, k, tail", CPU_CASES)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_cpu_kernel_is_the_product(lead, k, tail, out_dtype):
    rng = np.random.default_rng(hash((lead, k, tail)) % 2**32)
    x, w = inputs(rng, lead, k, tail)
    assert on_fast_path(x, w)
    y = jax.jit(lambda a, b: small_dot(a, b, out_dtype=out_dtype))(x, w)
    check_product(y, x, w, out_dtype)
    check_product(small_dot_ref(x, w, out_dtype=out_dtype), x, w, out_dtype)


def test_off_the_fast_path_runs_the_reference():
    rng = np.random.default_rng(7)
    for lead, k, tail, dtype in [((3,), 100, (30,), jnp.bfloat16), ((65,), 64, (64,), jnp.bfloat16),
                                 ((2,), 64, (64,), jnp.float32)]:
        x, w = (a.astype(dtype) for a in inputs(rng, lead, k, tail))
        assert not on_fast_path(x, w)
        np.testing.assert_array_equal(small_dot(x, w), small_dot_ref(x, w))


def test_bad_arguments_are_named():
    x, w = inputs(np.random.default_rng(1), (2,), 128, (64,))
    with pytest.raises(ValueError, match=r"expected x \[..., K\] and w \[K, ...\]"):
        small_dot(x, w[:64])
    with pytest.raises(TypeError, match="out_dtype must be bfloat16 or float32"):
        small_dot(x, w, out_dtype=jnp.int32)
    with pytest.raises(ValueError, match="split must be 0 or one of 1, 2, 4, 8 dividing K / 64 = 2"):
        small_dot(x, w, split=4)
    with pytest.raises(ValueError, match="impl must be"):
        small_dot(x, w, impl="cuda")
    with pytest.raises(TypeError, match="x must be an array"):
        small_dot([[1.0]], w)


def _bf16_model():
    """The tiny model in bf16: its o projection, dense MLP and shared expert's gate_up are on the fast path, its
    q / kv projections, router and shared down are not (K or N not a multiple of 64)."""
    cfg = kj.configs.tiny(dtype="bfloat16")
    return cfg, kj.init_params(cfg, jax.random.key(3))


def test_model_with_small_dot_equals_xla_dots_within_rounding():
    cfg, params = _bf16_model()
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 7))
    xla = dataclasses.replace(cfg, kernels="ffi")
    ffi = dataclasses.replace(cfg, kernels="ffi", ffi_ops=SMALL_DOT_OPS)
    assert xla.impl("small_dot") == "xla" and ffi.impl("small_dot") == "ffi"
    a, b = (np.asarray(kj.forward(params, c, tokens), np.float64) for c in (xla, ffi))
    assert np.isfinite(b).all()
    # The two differ at most where bf16 dots round (XLA's CPU dot happens to sum in the same order, and the two are
    # then bitwise equal): a loose bound; and a control that the custom call is in the program.
    assert np.max(np.abs(a - b)) <= 0.05 * np.max(np.abs(a)), np.max(np.abs(a - b))
    calls = [jax.jit(lambda p, t, c=c: kj.model.forward(p, c, t)).lower(params, tokens).as_text().count(
        "kdtree_small_dot") for c in (xla, ffi)]
    assert calls[0] == 0 and calls[1] >= 4, calls


def _step_calls(params, cfg, target="kdtree_small_dot") -> int:
    """Custom calls to `target` in the lowered decode step (the absorbed attention over a cache) of 2 rows x 1."""
    from kdtree_jax.model import init_cache, step
    from kdtree_jax.sharding import trace_context
    cache = init_cache(cfg, 2, 16)
    tokens = jnp.ones((2, 1), jnp.int32)
    with trace_context(params, cfg):
        text = jax.jit(lambda p, c, t: step(p, cfg, t, c).logits).lower(params, cache, tokens).as_text()
    return text.count(f'"{target}"') + text.count(f"@{target}")


def test_decode_step_runs_small_dot_only_where_the_config_asks():
    # The o projection of the absorbed attention once took the attention kernel's impl (mla_verify "ffi") for its
    # own and ran small_dot whatever ffi_ops said, and on a mesh too, where the custom call is not partitioned.
    # On the CPU devices (a mesh of 4 of them), also where a GPU is the default device.
    with jax.default_device(jax.devices("cpu")[0]):
        _small_dot_only_where_asked()


def _small_dot_only_where_asked():
    cfg, params = _bf16_model()
    off = dataclasses.replace(cfg, kernels="ffi")
    on = dataclasses.replace(cfg, kernels="ffi", ffi_ops=SMALL_DOT_OPS)
    assert off.impl("mla_verify") == "ffi" and off.impl("small_dot") == "xla"
    assert _step_calls(params, off, "kdtree_mla_verify") >= 1  # the control: the attention kernel is in the program
    assert _step_calls(params, off) == 0
    assert _step_calls(params, on) >= cfg.num_hidden_layers  # at least every layer's o projection
    sharded = kj.shard_params(params, on, kj.make_mesh(ep=4, devices=jax.devices("cpu")[:4]))
    assert _step_calls(sharded, on) == 0


def test_greedy_ddtree_with_small_dot_equals_ar():
    cfg, params = _bf16_model()
    cfg = dataclasses.replace(cfg, kernels="ffi", ffi_ops=SMALL_DOT_OPS)
    drafter = kj.init_drafter(cfg, jax.random.key(4), num_layers=1, block_size=4)
    prompts = [[1, 2, 3, 4], [5, 6]]
    ar = kj.generate(params, cfg, prompts, max_new_tokens=12, method="ar").tokens
    dd = kj.generate(params, cfg, prompts, max_new_tokens=12, method="ddtree", drafter=drafter, budget=8).tokens
    assert [list(t) for t in dd] == [list(t) for t in ar]


# One device's share of K2.6 (ep=8): q_a + kv_a, q_b, o, the shared expert's gate + up and down, the router.
GPU_CASES = [((1,), 7168, (2112,)), ((9,), 1536, (8, 192)), ((17,), 1024, (7168,)), ((64,), 7168, (2, 256)),
             ((33,), 256, (7168,)), ((10, 1), 7168, (384,))]


def _poison(count):
    junk = jnp.full((count,), jnp.nan, jnp.float32, device=jax.devices("gpu")[0])
    junk.block_until_ready()
    junk.delete()


@gpu
@needs_gpu
@pytest.mark.parametrize("lead, k, tail", GPU_CASES)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_kernel_is_the_product_at_every_split(lead, k, tail, out_dtype):
    rng = np.random.default_rng(hash(("gpu", lead, k, tail)) % 2**32)
    gpu_dev, cpu_dev = jax.devices("gpu")[0], jax.devices("cpu")[0]
    x, w = inputs(rng, lead, k, tail)
    cpu = jax.jit(lambda a, b: small_dot(a, b, out_dtype=out_dtype))(jax.device_put(x, cpu_dev),
                                                                       jax.device_put(w, cpu_dev))
    xg, wg = jax.device_put(x, gpu_dev), jax.device_put(w, gpu_dev)
    for split in [s for s in (0, 1, 2, 4, 8) if (k // 64) % max(s, 1) == 0]:
        for flags in (0, FLAG_PLAIN, FLAG_WEIGHT_PARAM):
            _poison(2 * int(np.prod(lead)) * int(np.prod(tail)) + 4096)
            f = jax.jit(lambda a, b: small_dot(a, b, out_dtype=out_dtype, split=split, flags=flags))
            y = f(xg, wg)
            check_product(y, x, w, out_dtype)
    check_product(cpu, x, w, out_dtype)  # the CPU handler, which sums in another order, within the same bound


@gpu
@needs_gpu
def test_gpu_kernel_reads_a_weight_computed_just_before_it():
    """Without FLAG_WEIGHT_PARAM, w is read only after the wait for the kernel ahead: a w that kernel writes (here a
    scale of the weight, fused into the kernel right before the custom call) is the new one, every time."""
    rng = np.random.default_rng(12)
    x, w = (jax.device_put(a, jax.devices("gpu")[0]) for a in inputs(rng, (1,), 7168, (2112,)))
    f = jax.jit(lambda a, b, c: small_dot(a, b * c))
    for scale in (1.0, -2.0, 0.5, 4.0):  # powers of two: w * scale is exact in bf16
        check_product(f(x, w, jnp.bfloat16(scale)), x, w * jnp.bfloat16(scale), jnp.bfloat16)


@gpu
@needs_gpu
def test_gpu_kernel_is_deterministic_and_under_a_command_buffer():
    rng = np.random.default_rng(11)
    x, w = (jax.device_put(a, jax.devices("gpu")[0]) for a in inputs(rng, (9,), 7168, (2112,)))

    @jax.jit
    def chain(a, b):
        for _ in range(3):  # several calls in one program (XLA may capture them in a command buffer)
            a = jnp.concatenate([small_dot(a, b)[:, :2048]] * 4, axis=1)[:, :7168] * 0.01
        return a

    first = np.asarray(chain(x, w))
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(first, np.asarray(chain(x, w)))


# ---------------------------------------------------------------------------------------------------------------
# The CUDA kernel's data movement, emulated lane by lane in numpy (it runs here, where no GPU is). A transcription
# of ffi/small_dot.cu's index math: the swizzled cp.async copies into the ring (each copy group lands only when a
# cp.async.wait_group lets it, so a wrong wait count reads a stale slot), ldmatrix (.trans) as PTX defines which
# lane receives which elements, mma.m16n8k16's fragment layouts, the partials through shared memory and the
# cluster's sum in rank order. It checks the kernel's indexing, not the hardware: the GPU tests above do that.
# ---------------------------------------------------------------------------------------------------------------

BN, BK, ROW, STAGES = 64, 64, 128, 8  # ffi/small_dot.cu: kBN, kBK, kRow (bytes), kStages


def swizzled(base: int, row: int, chunk: int) -> int:  # byte address
    return base + row * ROW + ((chunk ^ (row & 7)) << 4)


class Ring:
    """Shared memory of one block as bf16 elements, with cp.async groups that land on wait_group."""

    def __init__(self, nbytes):
        self.mem = np.full(nbytes // 2, np.nan)  # never-written memory reads as NaN
        self.pending, self.open = [], []

    def copy16(self, dst, values):
        self.open.append((dst, np.asarray(values, np.float64)))

    def commit(self):
        self.pending.append(self.open)
        self.open = []

    def wait(self, n):  # cp.async.wait_group n: all but the newest n groups have landed
        while len(self.pending) > n:
            for dst, v in self.pending.pop(0):
                self.mem[dst // 2:dst // 2 + 8] = v

    def rows8(self, addrs):  # 8 consecutive bf16 at each byte address
        return np.stack([self.mem[a // 2:a // 2 + 8] for a in addrs])


def ldmatrix(ring, addrs, trans):
    """x4: lane i gives the address of row i % 8 of matrix i / 8. Register j of lane (g, t): elements 2t, 2t + 1
    of row g of matrix j, or with .trans element g of rows 2t and 2t + 1. Returns [32 lanes, 4 regs, 2]."""
    rows = ring.rows8(addrs).reshape(4, 8, 8)  # [matrix, row, element]
    out = np.zeros((32, 4, 2))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(4):
            out[lane, j] = rows[j, [2 * t, 2 * t + 1], g] if trans else rows[j, g, [2 * t, 2 * t + 1]]
    return out


def mma(acc, a, b0, b1):
    """acc [32, 4] += A B: A 16 x 16 from a [32, 4, 2] (regs: rows g / g + 8, cols 2t.. / 2t + 8..), B 16 x 8 from
    b0, b1 [32, 2] (k 2t.. / 2t + 8.., column g); C's lane (g, t): rows g, g + 8, columns 2t, 2t + 1."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[lane, 0], a[lane, 1]
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[lane, 2], a[lane, 3]
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b0[lane], b1[lane]
    C = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane] += [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]


def emulate_block(x, w, m, k, n, split, nt, rank, tile):
    """One block's partials red [8 nt tokens, 64 columns], as SmallDotKernel computes them."""
    stages, col0 = k // BK // split, tile * BN
    k0 = rank * stages * BK
    w_bytes, stage = BK * ROW, BK * ROW + 8 * nt * ROW
    ring = Ring(STAGES * stage)

    def copy_w(s):
        dst = (s % STAGES) * stage
        for tid in range(128):
            for i in range(BK * 8 // 128):
                r, c = tid // 8 + i * 16, tid % 8
                ring.copy16(swizzled(dst, r, c), w[k0 + s * BK + r, col0 + c * 8:col0 + c * 8 + 8])

    def copy_x(s):
        dst = (s % STAGES) * stage + w_bytes
        for e in range(64 * nt):
            r, c = e // 8, e % 8
            src = x[r, k0 + s * BK + c * 8:k0 + s * BK + c * 8 + 8] if r < m else np.zeros(8)
            ring.copy16(swizzled(dst, r, c), src)

    for s in range(STAGES - 1):
        if s < stages:
            copy_w(s)
        ring.commit()
    for s in range(min(STAGES - 1, stages)):
        copy_x(s)
    ring.commit()
    acc = np.zeros((4, nt, 32, 4))  # [warp, token tile, lane, reg]
    lanes = np.arange(32)
    mat, mrow = lanes // 8, lanes % 8
    for i in range(stages):
        ring.wait(0 if i == 0 else STAGES - 2)
        if i + STAGES - 1 < stages:
            copy_w(i + STAGES - 1)
            copy_x(i + STAGES - 1)
        ring.commit()
        ws = (i % STAGES) * stage
        xs = ws + w_bytes
        for warp in range(4):
            for kk in (0, 32):
                wr, wc = kk + mrow + 8 * (mat // 2), 2 * warp + mat % 2
                a0 = ldmatrix(ring, [swizzled(ws, r, c) for r, c in zip(wr, wc)], trans=True)
                a1 = ldmatrix(ring, [swizzled(ws, r + 16, c) for r, c in zip(wr, wc)], trans=True)
                for t in range(nt):
                    b = ldmatrix(ring, [swizzled(xs, 8 * t + r, kk // 8 + j) for r, j in zip(mrow, mat)], trans=False)
                    mma(acc[warp, t], a0, b[:, 0], b[:, 1])
                    mma(acc[warp, t], a1, b[:, 2], b[:, 3])
    ring.wait(0)
    red = np.full((8 * nt, BN), np.nan)
    for warp in range(4):
        for lane in range(32):
            g, q = lane // 4, lane % 4
            for t in range(nt):
                for h in range(2):
                    col = 16 * warp + g + 8 * h
                    red[8 * t + 2 * q, col], red[8 * t + 2 * q + 1, col] = acc[warp, t, lane, 2 * h:2 * h + 2]
    return red


def emulate(x, w, split):
    m, k = x.shape
    n = w.shape[1]
    nt = 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8
    y = np.full((m, n), np.nan)
    for tile in range(n // BN):
        reds = [emulate_block(x, w, m, k, n, split, nt, r, tile).reshape(-1) for r in range(split)]
        total = m * BN
        for rank in range(split):  # each rank finishes its share of the tile, the ranks' partials in rank order
            for e in range(rank * (total // split), (rank + 1) * (total // split)):
                s = 0.0
                for r in range(split):
                    s += reds[r][e]
                y[e // BN, tile * BN + e % BN] = s
    return y


@pytest.mark.parametrize("m, k, n, split", [(1, 64, 64, 1), (9, 1024, 128, 1), (3, 512, 64, 2), (17, 256, 64, 4),
                                            (40, 128, 64, 2)])
def test_emulated_cuda_kernel_computes_the_product(m, k, n, split):
    rng = np.random.default_rng(m * 1000 + k + split)
    x = np.asarray(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), np.float64)
    w = np.asarray(jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16), np.float64)
    y = emulate(x, w, split)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, x @ w, rtol=1e-9, atol=1e-9 * (np.abs(x) @ np.abs(w)).max())
