"""The Sampler: its filtered distribution against a numpy reference, greedy and top_k=1, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import filtered_probs
from kdtree_jax import Sampler


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
