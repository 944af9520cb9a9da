"""moe_route: the custom call (C++ on CPU; CUDA, marked gpu) and its pure-JAX reference against an independent float64
numpy routing, on fresh random logits; near-ties judged by the choice values; clear errors for bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.kernels.moe_route import moe_route, moe_route_ref

from conftest import needs_gpu

gpu = pytest.mark.gpu

# (M, E, k, n_group, topk_group): K2 (384 experts, top-8, no groups), DeepSeek-V3-style groups, one device's share
CASES = [(1, 384, 8, 1, 1), (17, 384, 8, 1, 1), (65, 48, 1, 1, 1), (9, 256, 8, 8, 4), (5, 16, 4, 4, 2),
         (33, 64, 6, 2, 1)]


def routing64(logits, bias, k, n_group, topk_group, renormalize=True, scale=1.0):
    """The definition in float64 numpy, written apart from the kernels: (ids [M, k], weights [M, k], choice [M, E])."""
    x = np.asarray(logits, np.float64)
    score = 1.0 / (1.0 + np.exp(-x))
    choice = score + np.asarray(bias, np.float64)
    m, e = choice.shape
    per = e // n_group
    if n_group > 1:
        group = np.sort(choice.reshape(m, n_group, per), axis=-1)[..., -2:].sum(-1)  # [M, G] two best per group
        keep = np.argsort(-group, axis=-1, kind="stable")[:, :topk_group]
        allowed = np.zeros((m, n_group), bool)
        np.put_along_axis(allowed, keep, True, axis=-1)
        choice = np.where(np.repeat(allowed, per, axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(score, ids, axis=-1)
    if renormalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return ids, w * scale, choice


def separated_inputs(rng, m, e, n_group, topk_group, k):
    """Logits and bias whose choices are well apart (0.25/E to 0.5/E between neighbours; the kept groups and the k-th
    expert decided by >= 1e-5), so that float32 rounding cannot reorder them: exact ids are required."""
    rows = []
    bias = rng.uniform(-0.2, 0.2, e)
    while len(rows) < m:
        choice = rng.permutation(0.25 + 0.5 * np.cumsum(rng.uniform(1, 2, e)) / (2 * e))
        score = choice - bias
        logit = np.log(score / (1 - score)).astype(np.float32)
        _, _, masked = routing64(logit[None], bias.astype(np.float32), k, n_group, topk_group)
        per = e // n_group
        group = np.sort(choice.reshape(n_group, per), axis=-1)[:, -2:].sum(-1)
        top = np.sort(masked[0])[::-1]
        if (n_group == 1 or np.diff(np.sort(group)[::-1])[topk_group - 1:topk_group].min(initial=-1) <= -1e-5) and \
                (k == e or top[k - 1] - top[k] >= 1e-5):
            rows.append(logit)
    return jnp.asarray(np.stack(rows)), jnp.asarray(bias, jnp.float32)


def realistic_inputs(rng, m, e):
    return (jnp.asarray(2.0 * rng.standard_normal((m, e)), jnp.float32),
            jnp.asarray(0.05 * rng.standard_normal(e), jnp.float32))


def route(logits, bias, k, n_group, topk_group, impl, device=None, **kw):
    if device is not None:
        logits, bias = jax.device_put((logits, bias), device)
    fn = jax.jit(lambda lg, b: moe_route(lg, b, k=k, n_group=n_group, topk_group=topk_group, impl=impl, **kw))
    ids, w = fn(logits, bias)
    return np.asarray(ids), np.asarray(w)


def assert_same_routing(ids, w, want_ids, want_w, choice, tie=1e-6):
    """ids equal to want_ids, except where a swapped pair of experts has choices within `tie` (a near-tie that
    float32 rounding may order either way); weights equal (rel 1e-6) where the ids are."""
    assert ids.shape == want_ids.shape and np.all((ids >= 0) & (ids < choice.shape[1]))
    for r in range(ids.shape[0]):
        assert len(set(ids[r])) == ids.shape[1], f"row {r}: an expert chosen twice {ids[r]}"
        for j in np.flatnonzero(ids[r] != want_ids[r]):
            got, want = choice[r, ids[r, j]], choice[r, want_ids[r, j]]
            assert abs(got - want) <= tie, f"row {r}, slot {j}: {ids[r, j]} ({got}) for {want_ids[r, j]} ({want})"
    same = ids == want_ids
    np.testing.assert_allclose(w[same], want_w[same], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("m, e, k, n_group, topk_group", CASES)
def test_exact_on_separated_choices(impl, m, e, k, n_group, topk_group):
    rng = np.random.default_rng(hash((m, e, k, n_group, topk_group)) % 2**32)
    logits, bias = separated_inputs(rng, m, e, n_group, topk_group, k)
    ids, w = route(logits, bias, k, n_group, topk_group, impl, scale=2.5)
    want_ids, want_w, _ = routing64(logits, bias, k, n_group, topk_group, scale=2.5)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6)
    assert ids.dtype == np.int32 and w.dtype == np.float32


@pytest.mark.parametrize("m, e, k, n_group, topk_group", CASES)
def test_kernel_equals_reference_on_random_logits(m, e, k, n_group, topk_group):
    rng = np.random.default_rng(7 + m * e)
    logits, bias = realistic_inputs(rng, m, e)
    ids, w = route(logits, bias, k, n_group, topk_group, "ffi", renormalize=False)
    want_ids, want_w, choice = routing64(logits, bias, k, n_group, topk_group, renormalize=False)
    assert_same_routing(ids, w, want_ids, want_w, choice)
    ref_ids, ref_w = route(logits, bias, k, n_group, topk_group, "xla", renormalize=False)
    assert_same_routing(ids, w, ref_ids, ref_w, choice)


def test_ties_go_to_the_lower_index():
    logits = jnp.asarray(np.repeat(np.float32([[0.5, -0.3, 0.5, 0.5, -0.3, 0.1]]), 3, 0))
    bias = jnp.zeros((6,), jnp.float32)
    for impl in ("ffi", "xla"):
        ids, w = route(logits, bias, 4, 1, 1, impl)
        np.testing.assert_array_equal(ids, [[0, 2, 3, 5]] * 3)
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_matches_the_reference_under_vmap_and_with_no_tokens():
    rng = np.random.default_rng(3)
    logits, bias = realistic_inputs(rng, 12, 32)
    batched = jax.vmap(lambda lg: moe_route(lg, bias, k=4, impl="ffi"))(logits.reshape(3, 4, 32))
    flat = moe_route_ref(logits, bias, k=4)
    np.testing.assert_array_equal(np.asarray(batched[0]).reshape(12, 4), np.asarray(flat[0]))
    ids, w = moe_route(jnp.zeros((0, 32), jnp.float32), bias, k=4, impl="ffi")
    assert ids.shape == (0, 4) and w.shape == (0, 4)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(k=0), ValueError, "k must be a positive int"),
    (dict(k=4, n_group=3), ValueError, "do not describe a routing"),
    (dict(k=4, n_group=4, topk_group=5), ValueError, "do not describe a routing"),
    (dict(k=9, n_group=4, topk_group=1), ValueError, "do not describe a routing"),
    (dict(k=2.0), ValueError, "k must be a positive int"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    logits, bias = realistic_inputs(np.random.default_rng(0), 2, 32)
    with pytest.raises(error, match=match):
        moe_route(logits, bias, **kwargs)


def test_bad_shapes_and_dtypes_are_named():
    logits, bias = realistic_inputs(np.random.default_rng(1), 2, 32)
    with pytest.raises(ValueError, match=r"expected logits \[M, E\] and bias \[E\]"):
        moe_route(logits, bias[:16], k=2)
    with pytest.raises(TypeError, match="logits must be float32"):
        moe_route(logits.astype(jnp.bfloat16), bias, k=2)


def _poison(shape):
    junk = jnp.full(shape, jnp.nan, jnp.float32, device=jax.devices("gpu")[0])
    junk.block_until_ready()
    junk.delete()


@gpu
@needs_gpu
@pytest.mark.parametrize("m, e, k, n_group, topk_group", CASES + [(650, 384, 8, 1, 1), (3, 2048, 32, 64, 8)])
def test_gpu_exact_on_separated_choices_and_equal_to_cpu(m, e, k, n_group, topk_group):
    rng = np.random.default_rng(hash(("gpu", m, e, k, n_group)) % 2**32)
    logits, bias = separated_inputs(rng, m, e, n_group, topk_group, k)
    _poison((2 * m * k + 1024,))
    ids, w = route(logits, bias, k, n_group, topk_group, "ffi", device=jax.devices("gpu")[0], scale=2.827)
    want_ids, want_w, _ = routing64(logits, bias, k, n_group, topk_group, scale=2.827)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6)
    logits, bias = realistic_inputs(rng, m, e)
    gids, gw = route(logits, bias, k, n_group, topk_group, "ffi", device=jax.devices("gpu")[0])
    cids, cw = route(logits, bias, k, n_group, topk_group, "ffi", device=jax.devices("cpu")[0])
    assert_same_routing(gids, gw, cids, cw, routing64(logits, bias, k, n_group, topk_group)[2])
