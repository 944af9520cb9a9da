"""benchmarks/trace_replay.py: acceptance replayed from the embedded model's trace. Replayed through the real
loop with the embedded target itself, it must give what the real ddtree gives (tokens and accepted lengths); with
random target weights, the same accepted lengths and the trace's text (what the full-scale benchmark relies on)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from kdtree_jax.budget_policy import BudgetPolicy, CostModel
from kdtree_jax.ddtree import speculative
from kdtree_jax.decoding import Sampler, run
from kdtree_jax.train import corpus_split, load_tokens, windows

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from trace_replay import record, traced  # noqa: E402

PROMPT, POSITIONS, NEW = 48, 40, 32


@pytest.fixture(scope="module")
def embedded():
    model = kj.load("builtin")
    _, held = corpus_split()
    prompts = windows(load_tokens(held), np.random.default_rng(3), 2, PROMPT).tolist()
    return model, prompts, record(model, prompts, POSITIONS)


def _loop(method, params, cfg, prompts):
    tokens = jnp.asarray(prompts, jnp.int32)
    lengths = jnp.full((len(prompts),), PROMPT, jnp.int32)
    s = run(method, params, cfg, tokens, lengths, jax.random.key(0), jnp.int32(-1), sampler=Sampler(),
            cache_len=PROMPT + NEW + 64, max_new=NEW)
    return np.asarray(s.out), np.asarray(s.accepted)


def test_record_shapes_and_text(embedded):
    model, prompts, trace = embedded
    depth = model.drafter.depth
    assert trace.logp.shape == (2, POSITIONS, depth, model.cfg.vocab_size)
    ar = np.asarray(kj.generate(model, prompts, max_new_tokens=POSITIONS + depth + 1, method="ar").tokens)
    assert np.array_equal(np.asarray(trace.bonus), ar[:, :POSITIONS])
    cont = np.asarray(trace.cont)
    assert cont.shape == (2, POSITIONS, depth + 1)
    for p in (0, 7, POSITIONS - 1):
        assert np.array_equal(cont[:, p], ar[:, p + 1:p + depth + 2])
    lp = np.asarray(trace.logp)
    assert np.all(np.isfinite(lp)) and np.allclose(np.exp(lp).sum(-1), 1.0, atol=1e-4)


def test_replay_equals_the_real_method(embedded):
    model, prompts, trace = embedded
    method = speculative(model.cfg, "ddtree", model.drafter, 4)
    want_out, want_acc = _loop(method, model.params, model.cfg, prompts)
    got_out, got_acc = _loop(traced(method, trace), model.params, model.cfg, prompts)
    assert np.array_equal(got_out, want_out)
    assert np.array_equal(got_acc, want_acc)
    assert want_acc[:, 2:].sum() > 0  # some step accepted drafted tokens: the comparison is not vacuous


def test_replay_ignores_the_target_weights(embedded):
    """Random target weights: the same accepted lengths as the real pair, and the trace's text committed."""
    model, prompts, trace = embedded
    method = speculative(model.cfg, "ddtree", model.drafter, 16)
    _, want_acc = _loop(method, model.params, model.cfg, prompts)
    noise = kj.init_params(model.cfg, jax.random.key(9))
    got_out, got_acc = _loop(traced(method, trace), noise, model.cfg, prompts)
    assert np.array_equal(got_acc, want_acc)
    # (the first token is the prefill's, the random target's own; the loop commits the rest)
    assert np.array_equal(got_out[:, 1:], np.asarray(trace.bonus)[:, 1:NEW])


def test_replay_under_auto(embedded):
    """budget="auto" (two tiers, a made-up cost model): it runs through the driver's phases and commits the trace's
    text, whatever the tiers it picks."""
    model, prompts, trace = embedded
    cost = CostModel.from_points((4, 16), batch=2, points=[[(2, 1e-3), (10, 1.2e-3)], [(2, 1.1e-3), (34, 2e-3)]])
    method = speculative(model.cfg, "ddtree", model.drafter, 16, policy=BudgetPolicy.choosing(cost))
    noise = kj.init_params(model.cfg, jax.random.key(9))
    out, acc = _loop(traced(method, trace), noise, model.cfg, prompts)
    assert np.array_equal(out[:, 1:], np.asarray(trace.bonus)[:, 1:NEW])
    assert acc[:, 2:].sum() > 0


def test_traced_refuses_what_it_cannot_replay(embedded):
    model, _, trace = embedded
    with pytest.raises(ValueError, match="replays ddtree"):
        traced(speculative(model.cfg, "chain", model.drafter, None), trace)
    short = type(trace)(bonus=trace.bonus, cont=trace.cont[:, :, :3], logp=trace.logp)
    with pytest.raises(ValueError, match="tokens after each position"):
        traced(speculative(model.cfg, "ddtree", model.drafter, 8), short)
    with pytest.raises(ValueError, match="do not split"):
        trace.chain(3)


def test_chain_and_offset(embedded):
    """Two texts as one stream: position P is the second text's first; an offset starts every row there (and wraps
    past the end), for the same compiled loop."""
    _, _, trace = embedded
    one = trace.chain(1)
    assert one.positions == 2 * POSITIONS
    for name in ("bonus", "cont", "logp"):
        a, b = np.asarray(getattr(trace, name)), np.asarray(getattr(one, name))
        assert np.array_equal(b[0, :POSITIONS], a[0]) and np.array_equal(b[0, POSITIONS:], a[1])
    moved = one.at(POSITIONS)
    assert int(moved.offset) == POSITIONS and int(one.at(2 * POSITIONS + 3).offset) == 3
    assert jax.tree.structure(moved) == jax.tree.structure(one)
