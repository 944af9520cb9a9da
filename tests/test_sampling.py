"""The Sampler: its filtered distribution against a numpy reference, greedy and top_k=1, clear errors; the serve
engine's RowSampler (options and keys per row) against it, row by row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import filtered_probs
from kdtree_jax import Sampler
from kdtree_jax.serving.engine import RowSampler


def _logits(seed: int, shape=(12, 300)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.3, 6.0, size=(shape[0], 1))  # flat to peaked rows
    return (scale * rng.standard_normal(shape)).astype(np.float32)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, 20, None), (1.3, None, 0.9),
                                                       (0.9, 50, 0.8), (2.0, 3, 0.5), (1.0, 1000, 0.999)])
def test_filtered_distribution_matches_numpy(temperature, top_k, top_p):
    logits = _logits(int(temperature * 10) + (top_k or 0))
    sampler = Sampler(temperature, top_k, top_p)
    got = np.asarray(jax.nn.softmax(jax.jit(sampler.logits)(jnp.asarray(logits)), axis=-1), np.float64)
    want = filtered_probs(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(got > 0, want > 0)  # the same tokens kept
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    if top_k is not None:
        assert ((got > 0).sum(axis=-1) <= top_k).all()
    if top_p is not None:
        assert (((got > 0) * filtered_probs(logits, temperature, top_k)).sum(axis=-1) >= top_p - 1e-6).all()


def test_ties_are_kept_together():
    x = jnp.array([[3.0, 2.0, 2.0, 1.0, 0.0]])
    assert np.isfinite(Sampler(1.0, top_k=2).logits(x)).tolist() == [[True, True, True, False, False]]
    probs = np.asarray(jax.nn.softmax(x[0]))
    top_p = float(probs[0] + probs[1] / 2)  # the nucleus reaches into the tie: both tied tokens stay
    assert np.isfinite(Sampler(1.0, top_p=top_p).logits(x)).tolist() == [[True, True, True, False, False]]


def test_greedy_and_top_k_1_choose_the_argmax():
    logits = jnp.asarray(_logits(3))
    best = np.argmax(np.asarray(logits), axis=-1)
    assert Sampler().greedy and np.array_equal(Sampler().choose(logits, None), best)
    keys = jax.random.split(jax.random.key(0), 5)
    for key in keys:
        assert np.array_equal(Sampler(0.9, top_k=1).choose(logits, key), best)
    draws = np.stack([Sampler(5.0).choose(logits, key) for key in keys])
    assert (draws != best).any()  # a hot sampler does not always take the argmax
    np.testing.assert_array_equal(Sampler(0.0, 5, 0.5).logits(logits), logits)  # greedy: the logits as they are


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=True), "temperature"), (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_p="0.9"), "top_p"),
])
def test_bad_options_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampler(**kwargs)


def test_static_and_hashable():
    a, b = Sampler(0.7, 40, 0.9), Sampler(0.7, 40, 0.9)
    assert a == b and hash(a) == hash(b) and Sampler(0.7, 40, 1.0) == Sampler(0.7, 40)  # top_p = 1 is no filter
    assert jax.tree.leaves(a) == []  # static: compiled into the loop, never traced


ROWS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.9), (0.9, 50, 0.8), (2.0, 3, 0.5), (1.0, 1, 1.0),
        (0.5, 1000, 0.999), (1.0, 2, 1.0), (1.0, 0, 0.3), (0.0, 5, 0.5), (1.0, 300, 0.6)]


def _row_sampler(rows, filtered=True) -> RowSampler:
    """A RowSampler of rows (temperature, top_k, top_p), each with its own key."""
    t, k, p = (np.array(c, d) for c, d in zip(zip(*rows), (np.float32, np.int32, np.float32)))
    keys = jax.random.split(jax.random.key(0), len(rows))
    return RowSampler(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p), keys, filtered)


def _with_ties(seed: int) -> np.ndarray:
    """Rows of _logits rounded to a coarse grid: many tokens tie (with the k-th of some top_k too)."""
    return np.round(_logits(seed) * 2) / 2


def test_row_sampler_is_the_sampler_row_by_row():
    """The server's per-row options (traced) give exactly the static Sampler's filtered logits, ties included; the
    unfiltered form (no row with top_k or top_p) is the same as the filtered one where no row asks for a filter."""
    logits = jnp.asarray(np.stack([_with_ties(1), _logits(2)], axis=1))  # [B, 2, V]: as the tree's nodes
    got = np.asarray(jax.jit(lambda s, x: s.logits(x))(_row_sampler(ROWS), logits))
    for b, (t, k, p) in enumerate(ROWS):
        want = np.asarray(Sampler(t, k or None, p).logits(logits[b:b + 1]))[0]
        np.testing.assert_array_equal(got[b], want, err_msg=str(ROWS[b]))
    kept = np.isfinite(got[:, 0]).sum(axis=-1)
    assert kept[2] > 20 and kept[5] > 3  # ties with the k-th token are kept
    plain = [(t, 0, 1.0) for t, _, _ in ROWS]
    unfiltered = _row_sampler(plain, filtered=False).logits(logits)
    np.testing.assert_array_equal(unfiltered, _row_sampler(plain).logits(logits))


def test_row_sampler_draws_each_row_with_its_own_key():
    """A row's draw depends on its key and the step key alone (not on its place or the other rows); greedy and
    top_k=1 rows take the argmax."""
    logits = jnp.asarray(_logits(5))
    sampler = _row_sampler(ROWS)
    step = jax.random.key(9)
    got = np.asarray(jax.jit(lambda s, x, k: s.choose(x, k))(sampler, logits, step))
    for b in range(len(ROWS)):
        alone = jax.tree.map(lambda a: a[b:b + 1], sampler)
        assert alone.choose(logits[b:b + 1], step)[0] == got[b]
    best = np.argmax(np.asarray(logits), axis=-1)
    assert got[0] == best[0] and got[6] == best[6] and got[10] == best[10]
    other = np.asarray(sampler.choose(logits, jax.random.key(10)))
    hot = RowSampler(jnp.full((12,), 5.0), jnp.zeros((12,), jnp.int32), jnp.ones((12,)), sampler.key)
    assert (other != got).any() and (np.asarray(hot.choose(logits, step)) != best).any()


def test_a_temperature_near_float32s_smallest_normal_number_is_greedy():
    """Issue 46, fourth probe round: temperature 1.2e-38 is accepted (float32's normal range), but logits divided by
    it overflowed to inf and the draw took the first such token, not the most likely one (the embedded model wrote
    ' Tab a cacc ' for ' the number '). The largest logit is made 0 before the division."""
    logits = jnp.asarray(_logits(7) * 10)
    best = np.argmax(np.asarray(logits), axis=-1)
    tiny = float(np.finfo(np.float32).tiny)
    for key in jax.random.split(jax.random.key(0), 3):
        assert np.array_equal(Sampler(tiny).choose(logits, key), best)
        assert np.array_equal(Sampler(tiny, top_k=5, top_p=0.9).choose(logits, key), best)
    for filtered in (True, False):  # the engine's rows
        rows = _row_sampler([(tiny, 0, 1.0)] * len(best), filtered)
        assert np.array_equal(rows.choose(logits, jax.random.key(1)), best)
