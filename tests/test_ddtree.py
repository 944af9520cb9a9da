"""DDTree and chain speculative decoding: lossless against AR, acceptance really used, sampling exact."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from conftest import filtered_probs
from kdtree_jax.ddtree import speculative
from kdtree_jax.decoding import Sampler, prepare, run, run_compiled, step_stats
from kdtree_jax.generate import stream
from kdtree_jax.drafter import OracleDrafter

PROMPTS = {1: [[5, 17, 99, 3, 250]], 4: [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], list(range(60, 74))]}


@pytest.fixture(scope="module")
def model():
    cfg = kj.configs.tiny()
    params = kj.init_params(cfg, jax.random.key(0))
    drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=1, block_size=8)
    ar = {b: kj.generate(params, cfg, PROMPTS[b], max_new_tokens=20).tokens for b in PROMPTS}
    return cfg, params, drafter, ar


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method, budget", [("chain", None), ("ddtree", 1), ("ddtree", 4), ("ddtree", 32),
                                            ("ddtree", 128)])
def test_lossless_with_random_drafter(model, method, budget, batch):
    cfg, params, drafter, ar = model
    out = kj.generate(params, cfg, PROMPTS[batch], max_new_tokens=20, method=method, drafter=drafter,
                      budget=budget or 64)
    assert out.tokens == ar[batch]
    assert out.stats["steps"] >= 1 and out.stats["tau"] >= 1.0


@pytest.mark.parametrize("method, budget", [("chain", None), ("ddtree", 8), ("ddtree", 48)])
def test_lossless_with_partial_acceptance(model, method, budget):
    """A noisy oracle drafter accepts 1..8 tokens per step: every mix of accepts and rejects stays exact."""
    cfg, params, _, ar = model
    out = kj.generate(params, cfg, PROMPTS[4], max_new_tokens=20, method=method, drafter=OracleDrafter(8, 4.0, 4.0),
                      budget=budget or 64)
    assert out.tokens == ar[4]
    hist = out.stats["tau_histogram"]
    assert hist[1] > 0 and sum(hist[2:]) > 0  # both rejections and multi-token accepts happened


@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_oracle_drafter_reaches_full_depth(model, method):
    """A perfect drafter's block is accepted whole: tau = block size, so accepted tokens are really used."""
    cfg, params, _, ar = model
    out = kj.generate(params, cfg, PROMPTS[1], max_new_tokens=20, method=method, drafter=OracleDrafter(8, 30.0),
                      budget=16)
    assert out.tokens == ar[1]
    # 20 tokens: the prefill gives 1, then steps of 8 accepted tokens (the last one cut at max_new_tokens)
    assert out.stats["steps"] == 3
    assert out.stats["tau_histogram"][8] == 3 and out.stats["tau"] == 8.0


def test_eos_and_context_limit(model):
    cfg, params, drafter, ar = model
    eos = ar[4][1][6]
    ref = kj.generate(params, cfg, PROMPTS[4], max_new_tokens=20, eos_id=eos).tokens
    out = kj.generate(params, cfg, PROMPTS[4], max_new_tokens=20, method="ddtree", drafter=OracleDrafter(8, 4.0, 4.0),
                      budget=8, eos_id=eos)
    assert out.tokens == ref and any(len(r) < 20 for r in ref)
    small = dataclasses.replace(cfg, max_position_embeddings=64)
    prompt = [list(range(100, 110))]
    fits = 64 - 10 - 9  # prompt + new tokens + the 9 tree nodes of budget 8 fill the context exactly
    a = kj.generate(params, small, prompt, max_new_tokens=fits).tokens
    b = kj.generate(params, small, prompt, max_new_tokens=fits, method="ddtree", drafter=drafter, budget=8).tokens
    assert a == b and len(a[0]) == fits
    with pytest.raises(ValueError, match="exceeds the context"):
        kj.generate(params, small, prompt, max_new_tokens=fits + 1, method="ddtree", drafter=drafter, budget=8)


def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square p-value, merging categories whose expected count is below 5 into one bin."""
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(jax.scipy.special.gammaincc((len(obs) - 1) / 2.0, stat / 2.0))


@pytest.mark.parametrize("method, sampling", [("ddtree", dict(temperature=1.0)),
                                             ("ddtree", dict(temperature=0.8, top_k=40, top_p=0.9)),
                                             ("chain", dict(temperature=0.6, top_k=100, top_p=0.8))])
def test_sampling_matches_target_distribution(model, method, sampling):
    """At temperature > 0 (with top-k and top-p filters), the second generated token (the first one produced by a
    tree verify step) follows the target's marginal sum_t1 p(t1 | prompt) p(t2 | prompt, t1), p the filtered
    distribution (numpy reference). Chi-square, fixed seed, alarm at p < 1e-3."""
    cfg, params, _, _ = model
    prompt = [9, 8, 7, 6]
    n = 3000
    out = kj.generate(params, cfg, [prompt] * n, max_new_tokens=2, method=method, drafter=OracleDrafter(8),
                      budget=16, seed=123, **sampling)
    toks = np.array(out.tokens)
    assert toks.shape == (n, 2)
    v = cfg.vocab_size
    p1 = filtered_probs(kj.forward(params, cfg, jnp.array([prompt]))[0, -1], **sampling)
    seqs = jnp.array([prompt + [t] for t in range(v)])
    p2_given = filtered_probs(kj.forward(params, cfg, seqs)[:, -1], **sampling)  # [V, V]
    p2 = p1 @ p2_given
    assert _chi2_pvalue(np.bincount(toks[:, 0], minlength=v), n * p1) > 1e-3
    assert _chi2_pvalue(np.bincount(toks[:, 1], minlength=v), n * p2) > 1e-3
    assert out.stats["tau_histogram"][2] > n // 10  # the tree's nodes were accepted often, not just the bonus


def test_loop_makes_no_host_transfers(model):
    """generate's compiled function (the one test_lossless_with_random_drafter compiled) runs without a transfer."""
    cfg, params, drafter, ar = model
    method = speculative(cfg, "ddtree", drafter, 32)
    req = prepare(cfg, PROMPTS[4], 20, Sampler(), None, extra_slots=method.extra_slots)
    m, p, toks, lens, key, eos = jax.device_put((method, params, jnp.asarray(req.tokens), jnp.asarray(req.lengths),
                                                 jax.random.key(0), jnp.int32(-1)))
    args = (m, p, cfg, toks, lens, key, eos)
    static = dict(sampler=req.sampler, cache_len=req.cache_len, max_new=req.max_new, chunk=req.chunk)
    run_compiled(run, args, static)  # compiled outside the guard
    with jax.transfer_guard("disallow"):
        state, _ = run_compiled(run, args, static)
    assert int(state.steps) >= 1
    assert [r[:n].tolist() for r, n in zip(state.out, state.num_out)] == ar[4]


def test_compiled_programs_kept_are_the_most_recent(model, monkeypatch):
    """run_compiled keeps COMPILED_KEPT executables, dropping the least recently used: a process that compiles
    program after program must not hold them all (each holds memory mappings; Linux allows 65,530)."""
    from kdtree_jax import decoding

    cfg = model[0]
    monkeypatch.setattr(decoding, "COMPILED_KEPT", 2)
    monkeypatch.setattr(decoding, "_COMPILED", {})
    twice = jax.jit(lambda cfg, x: 2 * x, static_argnames="cfg")

    def call(n):
        out, timing = run_compiled(twice, (cfg, jnp.arange(n, dtype=jnp.float32)), {})
        np.testing.assert_array_equal(np.asarray(out), 2 * np.arange(n))
        return [key[2][-1][0] for key in decoding._COMPILED]  # the shapes kept, least recently used first

    assert call(3) == [(3,)]
    assert call(4) == [(3,), (4,)]
    assert call(3) == [(4,), (3,)]  # a hit makes it the most recent
    assert call(5) == [(3,), (5,)]  # the least recently used, 4, is dropped
    decoding.clear_compiled()
    assert decoding._COMPILED == {}


def test_bad_speculative_input(model):
    cfg, params, drafter, _ = model
    gen = lambda **kw: kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match="budget"):
        gen(method="ddtree", drafter=drafter, budget=0)
    with pytest.raises(ValueError, match="budget"):
        gen(method="ddtree", drafter=drafter, budget=7 * cfg.vocab_size + 1)
    with pytest.raises(ValueError, match="needs a drafter"):
        gen(method="chain")
    other = kj.init_drafter(dataclasses.replace(cfg, num_hidden_layers=4), jax.random.key(2))
    with pytest.raises(ValueError, match="built for a target"):
        gen(method="ddtree", drafter=other)
    small = dataclasses.replace(cfg, max_position_embeddings=64)
    with pytest.raises(ValueError, match="speculative slots"):
        kj.generate(params, small, [[1, 2, 3]], max_new_tokens=4, method="ddtree", drafter=drafter, budget=100)
    with pytest.raises(ValueError, match="block_size"):
        kj.init_drafter(cfg, jax.random.key(3), block_size=1)


def _drain(run):
    """(the chunks a stream yielded, the final loop state it returned)."""
    chunks = []
    while True:
        try:
            chunks.append(next(run))
        except StopIteration as end:
            return chunks, end.value


@pytest.mark.parametrize("method", ["ar", "chain", "ddtree"])
def test_streaming_gives_generate_tokens_and_stats(model, method):
    """generate.stream (the CLI's output) resumes the compiled loop a few steps at a time from its donated state:
    the chunks put together are generate's tokens (= ar's) and the final state gives generate's steps and tau."""
    cfg, params, drafter, ar = model
    kw = dict(max_new_tokens=20, method=method, drafter=drafter, budget=32)
    want = kj.generate(params, cfg, PROMPTS[1], **kw)
    chunks, final = _drain(stream(params, cfg, PROMPTS[1][0], every=2, **kw))
    assert len(chunks) > 1  # really streamed
    assert sum(chunks, []) == want.tokens[0] == ar[1][0]
    stats = step_stats(final)
    assert stats["tau"] == pytest.approx(want.stats["tau"]) and stats["steps"] == want.stats["steps"]
    assert stats["tau_histogram"] == want.stats["tau_histogram"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TableDrafter:
    """A third drafter, written against kj.DrafterProtocol alone: fixed per-depth logits table [L, V], whatever the
    context, and a state that counts the context pieces it was given."""

    table: jax.Array

    @property
    def block_size(self) -> int:
        return self.table.shape[0] + 1

    @property
    def depth(self) -> int:
        return self.table.shape[0]

    def check(self, cfg) -> None:
        if self.table.shape[1] != cfg.vocab_size:
            raise ValueError("the table's vocabulary is not the target's")

    def start(self, batch, max_len):
        return jnp.zeros((batch,), jnp.int32)

    def add_context(self, state, hidden, starts):
        return state + 1

    def propose(self, target, cfg, state, cache, bonus, key):
        return jnp.broadcast_to(self.table, (bonus.shape[0], *self.table.shape))


@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_any_drafter_of_the_protocol(model, method):
    """The speculative methods ask a drafter only for the protocol: a new kind of drafter works unchanged, and its
    state rides in the loop (one context piece from the prefill, one per step). Sampling at temperature 0.9 with
    top_k=1 (the same filter on the drafter's logits: one token per depth left) is greedy decoding."""
    cfg, params, _, ar = model
    drafter = TableDrafter(jax.random.normal(jax.random.key(7), (5, cfg.vocab_size)))
    assert isinstance(drafter, kj.DrafterProtocol)
    chunks, final = _drain(stream(params, cfg, PROMPTS[1][0], max_new_tokens=20, method=method, drafter=drafter,
                                  budget=8, temperature=0.9, top_k=1, seed=3))
    assert sum(chunks, []) == ar[1][0]
    assert final.draft.tolist() == [int(final.steps) + 1]
    with pytest.raises(ValueError, match="vocabulary"):
        kj.generate(params, cfg, PROMPTS[1], method=method, drafter=TableDrafter(jnp.zeros((5, 7))))
