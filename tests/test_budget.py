"""budget="auto": the per-step choice against a brute force, lossless decoding (greedy and sampled), the masked
nodes' isolation in the masked step, calibration files, no cache copy in the compiled loop, clear errors."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from conftest import filtered_probs, rel_err
from kdtree_jax import budget as bud
from kdtree_jax.budget import BudgetPolicy, CostModel
from kdtree_jax.budget_policy import RELIABILITY_BINS, node_scores, reliability_bin, reliability_counts
from kdtree_jax.ddtree import ddtree_tree, speculative
from kdtree_jax.decoding import Sampler, advance, start
from kdtree_jax.drafter import OracleDrafter
from kdtree_jax.model import init_cache, moe, prefill, step, swiglu
from test_ddtree import _chi2_pvalue

PROMPTS = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], list(range(60, 74))]


@pytest.fixture(scope="module")
def model():
    cfg = kj.configs.tiny()
    params = kj.init_params(cfg, jax.random.key(0))
    drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=1, block_size=8)
    ar = kj.generate(params, cfg, PROMPTS, max_new_tokens=24).tokens
    return cfg, params, drafter, ar


def _cost(tiers, batch, slope, step=0.1, replan=1, fixed=None):
    """A cost model rising by `slope` seconds per verified token from 1 s, each tier `step` s dearer than the last."""
    return CostModel.from_points(tiers, batch, [[(1, 1.0 + step * i), (1e5, 1.0 + step * i + slope * 1e5)]
                                                for i in range(len(tiers))], replan=replan, fixed=fixed)


def _random_tree(b, n, depth, v, seed):
    logits = jax.random.normal(jax.random.key(seed), (b, depth, v)) * 3
    tree = ddtree_tree(logits, jnp.zeros((b,), jnp.int32), n, "xla")
    return logits, tree


def test_choose_is_the_best_ratio_and_prefix_closed():
    b, n, depth, v = 3, 12, 4, 9
    logits, tree = _random_tree(b, n, depth, v, 0)
    scores = node_scores(logits, tree.tokens, tree.depths, tree.visibility)
    # a node's score is its parent's plus its own log-probability: never above its parent's
    par = np.asarray(tree.parents)
    s = np.asarray(scores)
    assert all(s[r, i] <= s[r, par[r, i]] + 1e-6 for r in range(b) for i in range(1, n + 1))
    live = jnp.array([True, False, True])
    ctx = jnp.array([10, 20, 30])
    rng = np.random.default_rng(1)
    for trial in range(18):
        tiers = (4, n)
        pts = [sorted((float(m), float(t)) for m, t in zip(rng.uniform(1, 40, 4), rng.uniform(0.5, 3, 4)))
               for _ in tiers]
        switch = rng.uniform(0, 1) if trial % 2 else 0.0
        current = (None, 0, 1)[trial % 3]
        # from trial 6: plans every `replan`-th step, the fixed programs' costs measured (or the curves' ends)
        replan = 1 if trial < 6 else int(rng.integers(2, 8))
        fixed = rng.uniform(0.3, 3, len(tiers)) if trial % 4 else None
        cost = CostModel.from_points(tiers, b, pts, per_context=rng.uniform(0, 0.01), context=12.0, switch=switch,
                                     replan=replan, fixed=fixed)
        choose = jax.jit(BudgetPolicy.choosing(cost).choose, static_argnames="current")
        tier, active = choose(scores, tree.visibility, live, ctx, current=current)
        tier, active = int(tier), np.asarray(active)
        # brute force in numpy, float64
        p = np.where(np.asarray(live)[:, None], np.exp(s[:, 1:].astype(np.float64)), 0.0)
        n_live, ctx_sum = int(np.asarray(live).sum()), float(np.asarray(ctx)[np.asarray(live)].sum())
        best = []
        for t, size in enumerate(tiers):
            srt = np.sort(np.where(np.arange(n) < size, p, 0).ravel())[::-1]
            gain = np.concatenate([[0.0], np.cumsum(srt)])
            m = np.arange(len(gain))
            tok, sec = np.asarray(cost.tokens[t], np.float64), np.asarray(cost.seconds[t], np.float64)
            base = np.interp(n_live + m, tok, sec)
            c = np.maximum(base + float(cost.per_context) * (ctx_sum - n_live * 12.0), 0.01 * base)
            c = c + (np.float32(switch) if current not in (None, t) else 0.0)  # a change of tier
            tokens = n_live + gain
            if replan > 1:  # the replan - 1 steps of the tier's fixed program after this one: every node
                f = float(cost.fixed[t])
                c = c + (replan - 1) * max(f + float(cost.per_context) * (ctx_sum - n_live * 12.0), 0.01 * f)
                tokens = tokens + (replan - 1) * (n_live + gain[-1])
            ratio = np.where(m <= n_live * size, tokens / c, -np.inf)
            best.append((ratio.max(), int(ratio.argmax())))
        want_tier = int(np.argmax([r for r, _ in best]))
        assert tier == want_tier, trial
        chosen = active[:, 1:]
        assert chosen.sum() == best[want_tier][1], trial  # the m most probable nodes (no closure loss here)
        assert not active[1].any() and active[[0, 2], 0].all()  # dead rows verify nothing; live roots always
        assert not chosen[:, tiers[tier]:].any()
        for r in range(b):  # prefix-closed: every chosen node's parent is chosen (or the root)
            for i in np.flatnonzero(chosen[r]) + 1:
                assert active[r, par[r, i]]
        if chosen.sum():  # the chosen nodes are the most probable ones
            assert p[chosen].min() >= p[~chosen & (np.arange(n) < tiers[tier])].max(initial=0) - 1e-6


def test_step_seconds_of_every_tier_equal_numpy_interp():
    """CostModel.all_step_seconds (every tier in one pass: segments' rises summed) against np.interp per tier, in
    float64: random curves of 1 to 8 points (padded tiers repeat their last point), tokens below, inside and beyond
    each curve and exactly at its points."""
    rng = np.random.default_rng(7)
    for trial in range(40):
        tiers = tuple(sorted(rng.choice(np.arange(1, 200), rng.integers(1, 5), replace=False).tolist()))
        pts = [[(float(x), float(rng.uniform(1e-3, 5e-2))) for x in np.unique(rng.integers(1, 300, rng.integers(1, 9)))]
               for _ in tiers]
        cost = CostModel.from_points(tiers, 2, pts, per_context=float(rng.uniform(0, 1e-6)),
                                     context=float(rng.uniform(0, 5000)))
        tok, sec = np.asarray(cost.tokens, np.float64), np.asarray(cost.seconds, np.float64)
        m = np.concatenate([rng.uniform(-10, 400, (len(tiers), 30)), tok], axis=1).astype(np.float32)
        live, ctx = 2.0, float(rng.uniform(0, 1e4))
        got = np.asarray(cost.all_step_seconds(jnp.asarray(m), jnp.float32(live), jnp.float32(ctx)), np.float64)
        for t in range(len(tiers)):
            base = np.interp(m[t].astype(np.float64), tok[t], sec[t])
            want = np.maximum(base + float(cost.per_context) * (ctx - live * float(cost.context)), 0.01 * base)
            assert np.all(np.isfinite(got[t])) and np.max(np.abs(got[t] - want) / want) < 1e-5, (trial, t)
            one = np.asarray(cost.step_seconds(t, jnp.asarray(m[t]), jnp.float32(live), jnp.float32(ctx)))
            np.testing.assert_array_equal(one, got[t].astype(np.float32))


def test_forced_policy_verifies_the_first_nodes():
    b, n = 2, 8
    logits, tree = _random_tree(b, n, 3, 7, 2)
    scores = node_scores(logits, tree.tokens, tree.depths, tree.visibility)
    policy = BudgetPolicy.choosing(_cost((4, 8), b, 0.0))
    for t, r in ((0, 0), (0, 3), (0, 8), (1, 5), (1, 8)):
        tier, active = policy.forced(t, r).choose(scores, tree.visibility, jnp.array([True, True]), jnp.zeros(2))
        want = min(r, (4, 8)[t])
        assert int(tier) == t and np.asarray(active).sum(axis=1).tolist() == [1 + want] * b
    for bad in ((2, 4), (-1, 4), (0, -1)):  # a tier no loop runs would never end the loop
        with pytest.raises(ValueError, match="tier_index|nodes per row"):
            policy.forced(*bad)
    for current, t in ((None, 0), (0, 1), (1, 0)):  # alternating: the tier the step before did not use
        tier, active = policy.alternating(8).choose(scores, tree.visibility, jnp.array([True, True]), jnp.zeros(2),
                                                    current)
        assert int(tier) == t and np.asarray(active).sum(axis=1).tolist() == [1 + (4, 8)[t]] * b


@pytest.mark.parametrize("slope, tiers", [(0.0, None), (0.02, None), (1.0, (16,)), (0.02, (3, 16))])
def test_auto_is_lossless(model, slope, tiers):
    """Greedy: exactly the AR tokens, whatever the cost model makes it verify (all, few, a mix per step)."""
    cfg, params, drafter, ar = model
    t = bud.check_tiers(bud.default_tiers(16) if tiers is None else tiers, 16)
    out = kj.generate(params, cfg, PROMPTS, max_new_tokens=24, method="ddtree", drafter=drafter, budget="auto",
                      max_budget=16, tiers=tiers, cost_model=_cost(t, len(PROMPTS), slope, 0.0 if slope == 0 else 0.1))
    assert out.tokens == ar
    assert out.stats["budget"] == "auto" and out.stats["steps"] >= 1
    hist = out.stats["nodes_histogram"]
    assert sum(hist) == sum(out.stats["tau_histogram"]) and len(hist) <= 17
    if slope == 0.0:
        assert out.stats["nodes"] > 8  # every node costs nothing: most of the tree is verified
    if slope == 1.0:
        assert hist[0] > 0  # so costly that some steps verify the root alone


@pytest.mark.parametrize("tiers, slope", [((16,), 1.0), ((4, 8, 16), 0.02)])
def test_auto_planning_every_third_step_is_lossless(model, tiers, slope):
    """replan 3: a planned step, then up to two steps of the planned tier's fixed program (its every node): exactly
    the AR tokens, and the histogram shows the two kinds of step."""
    cfg, params, drafter, ar = model
    fixed = [0.01] * len(tiers)  # the fixed steps between plans cheap: a planned step's nodes must pay for themselves
    out = kj.generate(params, cfg, PROMPTS, max_new_tokens=24, method="ddtree", drafter=drafter, budget="auto",
                      max_budget=16, tiers=tiers, cost_model=_cost(tiers, len(PROMPTS), slope, 0.1, 3, fixed))
    assert out.tokens == ar
    h = out.stats["nodes_histogram"]  # bins up to the largest count seen
    hist = np.zeros(17, int)
    hist[:len(h)] = h
    assert hist.sum() == sum(out.stats["tau_histogram"])
    if tiers == (16,):  # planned: the root alone (every node too dear); between: the whole tree of 16
        assert hist[0] > 0 and hist[16] > 0 and hist[0] + hist[16] == hist.sum()
        assert hist[16] <= 2 * hist[0]  # a live row's fixed steps follow its planned step, two at most
    else:
        assert hist[[4, 8, 16]].sum() > 0  # steps at a whole tier


def test_choose_replan():
    assert [bud.choose_replan(p, 1.0) for p in (0.0, 0.004, 0.01, 0.025, 0.16, 1.0)] == [1, 1, 1, 3, 16, 16]
    assert bud.choose_replan(0.05e-3, 16.25e-3) == 1  # full-scale K2.6 at C=1: plan every step
    assert bud.choose_replan(0.18e-3, 0.6e-3) == 16  # a launch-bound small model
    for bad in ((float("nan"), 1.0), (0.1, 0.0), (0.1, float("inf"))):
        with pytest.raises(ValueError, match="finite"):
            bud.choose_replan(*bad)
    with pytest.raises(ValueError, match="replan must be"):
        CostModel.from_points((4,), 1, [[(1, 1.0)]], replan=0)
    policy = BudgetPolicy.choosing(_cost((4, 8), 1, 0.0, replan=5))
    assert policy.replan == 5 and policy.forced(0, 4).replan == 1 and policy.alternating(8).replan == 1


def test_choose_values_no_node_past_a_rows_room():
    """A row that may commit only `room` more tokens gains nothing from nodes deeper than room - 1 (E[min(A + 1,
    room)]): with a flat cost every useful node is taken and no deeper one; room large enough changes nothing; the
    numbers are those of the brute-force gain in numpy."""
    b, n = 3, 16
    logits, tree = _random_tree(b, n, 6, 3, 2)  # a small vocabulary: deep, probable paths
    scores = node_scores(logits, tree.tokens, tree.depths, tree.visibility)
    live, ctx = jnp.array([True, True, True]), jnp.zeros(3)
    depths = np.asarray(tree.depths)[:, 1:]
    cost = CostModel.from_points((n,), b, [[(1, 1.0), (1e5, 1.0)]])  # flat: every gain is worth its node
    choose = jax.jit(BudgetPolicy.choosing(cost).choose)
    _, free = choose(scores, tree.visibility, live, ctx, depths=tree.depths, room=jnp.full((b,), 100))
    _, none_given = choose(scores, tree.visibility, live, ctx)
    np.testing.assert_array_equal(np.asarray(free), np.asarray(none_given))
    assert np.asarray(free)[:, 1:].all() and depths.max() >= 3  # every node, some deeper than the rooms below
    room = jnp.array([1, 2, 3])
    _, capped = choose(scores, tree.visibility, live, ctx, depths=tree.depths, room=room)
    capped = np.asarray(capped)[:, 1:]
    np.testing.assert_array_equal(capped, depths < np.asarray(room)[:, None])  # exactly the useful nodes
    assert not capped[0].any() and capped[2].any()  # room 1: the bonus alone


def test_choice_between_plans_weighs_the_fixed_programs():
    """Planned steps of both tiers cost the same, so planning every step takes the larger tier (it gains more); the
    larger tier's fixed program costs 3x the smaller's, so with a plan every 4th step (3 fixed steps after each) the
    smaller tier wins."""
    b, n = 2, 8
    logits, tree = _random_tree(b, n, 3, 7, 5)
    scores = node_scores(logits, tree.tokens, tree.depths, tree.visibility)
    live, ctx = jnp.array([True, True]), jnp.zeros(2)
    pts = [[(1, 1.0), (100, 1.0)]] * 2
    for replan, want in ((1, 1), (4, 0)):
        cost = CostModel.from_points((4, 8), b, pts, replan=replan, fixed=(1.0, 3.0))
        tier, active = BudgetPolicy.choosing(cost).choose(scores, tree.visibility, live, ctx)
        assert int(tier) == want, replan
        if want == 1:
            assert np.asarray(active)[:, 1:].sum() == 2 * n  # equal costs: every node is worth verifying
    np.testing.assert_allclose(np.asarray(_cost((4, 8), b, 1e-3).fixed), [1.009, 1.117], rtol=1e-5)  # every node
    for bad in ((1.0,), (1.0, 0.0), (1.0, float("nan"))):
        with pytest.raises(ValueError, match="fixed must hold 2"):
            CostModel.from_points((4, 8), b, pts, fixed=bad)
    record = bud.cost_record(CostModel.from_points((4, 8), b, pts, replan=4, fixed=(1.0, 3.0)), {})
    back = bud.from_record(json.loads(json.dumps(record)), b)
    assert back.replan == 4 and np.asarray(back.fixed).tolist() == [1.0, 3.0]
    old = {k: v for k, v in record.items() if k not in ("fixed", "replan", "switch")}  # a file of an older version
    assert bud.from_record(old, b).replan == 1 and np.asarray(bud.from_record(old, b).fixed).tolist() == [1.0, 1.0]


def test_auto_with_partial_acceptance_is_lossless(model):
    """A noisy oracle drafter (1..8 tokens accepted) and a cost making the choice vary per step and row."""
    cfg, params, _, ar = model
    out = kj.generate(params, cfg, PROMPTS, max_new_tokens=24, method="ddtree", drafter=OracleDrafter(8, 4.0, 4.0),
                      budget="auto", max_budget=32, cost_model=_cost(bud.default_tiers(32), len(PROMPTS), 0.004))
    assert out.tokens == ar
    assert sum(h > 0 for h in out.stats["nodes_histogram"]) >= 3 and out.stats["tau_histogram"][1] > 0


def test_a_tier_of_no_nodes_runs_autoregressive_steps(model):
    """tiers (0, 4, 16), a plan every third step, tier 0's steps (the bonus alone, nothing drafted) half the price
    of a planned step and half of tier 4's: with the random drafter (its path probabilities near 1/V) no tree pays
    and every step verifies no node (tau 1); with a sharp oracle drafter (paths of probability ~1) the trees pay and
    no step is autoregressive. Both give exactly the AR tokens."""
    cfg, params, drafter, ar = model
    tiers, b = (0, 4, 16), len(PROMPTS)
    cost = CostModel.from_points(tiers, b, [[(b, 1.0)]] + [[(1, 1.0 + 0.1 * i), (1e5, 1.0 + 0.1 * i + 0.02 * 1e5)]
                                                          for i in (1, 2)], replan=3, fixed=[0.5, 1.0, 1.2])
    run = lambda d: kj.generate(params, cfg, PROMPTS, max_new_tokens=24, method="ddtree", drafter=d, budget="auto",
                                max_budget=16, tiers=tiers, cost_model=cost)
    plain = run(drafter)
    assert plain.tokens == ar
    assert plain.stats["nodes_histogram"] == [sum(plain.stats["tau_histogram"])] and plain.stats["tau"] == 1.0
    sharp = run(OracleDrafter(8, 8.0, 0.0))
    assert sharp.tokens == ar
    assert sharp.stats["nodes_histogram"][0] == 0 and sharp.stats["tau"] > 2


def test_calibration_times_a_tier_of_no_nodes(model, monkeypatch):
    """Calibration with tiers (0, 8): tier 0 has one point (the roots alone); its fixed program (`no_draft`) is
    timed; the plan's own cost is measured against the smallest tier that drafts (8)."""
    cfg, params, drafter, _ = model
    monkeypatch.setattr(bud, "choose_replan", lambda plan_s, step_s: 3)  # the fixed programs are timed too
    small = dataclasses.replace(cfg, max_position_embeddings=256)
    logs = []
    cost, meta = bud.calibrate(params, small, drafter, batch=2, max_budget=8, tiers=(0, 8), steps=1, repeats=1,
                               log=logs.append)
    assert cost.tiers == (0, 8) and cost.replan == 3
    assert {m for m, _ in cost.points()[0]} == {2.0}  # tier 0: the two rows' roots
    fixed = np.asarray(cost.fixed)
    assert fixed.shape == (2,) and np.all(fixed > 0) and fixed[1] == pytest.approx(meta["fixed_seconds"], rel=1e-6)
    assert sum("fixed budget 0 (no draft)" in line for line in logs) == 1


def test_switch_loop_makes_the_same_steps_as_the_phase_loops(model, monkeypatch):
    """KDTREE_JAX_AUTO_LOOP=switch (one while loop, a lax.switch per window) runs the same steps as the default
    loops (one per tier): the AR tokens and the same nodes per step, planning every third step (windows of a planned
    step and the tier's fixed steps) and with a policy forced to change tiers at every step; an unknown value is a
    clear error."""
    cfg, params, drafter, ar = model
    tiers = (4, 8, 16)
    cost = _cost(tiers, len(PROMPTS), 0.02, 0.1, 3, [0.01] * len(tiers))
    traced, real = [], kj.decoding.auto_loop
    monkeypatch.setattr(kj.decoding, "auto_loop", lambda: traced.append(real()) or traced[-1])

    def run(loop, new=24):
        monkeypatch.setenv("KDTREE_JAX_AUTO_LOOP", loop)
        kj.decoding.clear_compiled()
        jax.clear_caches()  # the loop is read when the program is traced, and jax keeps traced programs too
        return kj.generate(params, cfg, PROMPTS, max_new_tokens=new, method="ddtree", drafter=drafter,
                           budget="auto", max_budget=16, tiers=tiers, cost_model=cost)

    runs = {}
    for loop in ("phases", "switch"):
        out = run(loop)
        assert out.tokens == ar and traced[-1] == loop, (loop, traced)
        runs[loop] = out.stats["nodes_histogram"], out.stats["steps"]
    assert runs["switch"] == runs["phases"] and sum(h > 0 for h in runs["phases"][0]) >= 2  # several sizes ran
    # a tier change at every step (forced to alternate between the first and the last tier; replan 1)
    m = speculative(cfg, "ddtree", drafter, 16, BudgetPolicy.choosing(cost).alternating(16))
    req = kj.decoding.prepare(cfg, PROMPTS, 24, extra_slots=m.extra_slots)
    for loop in ("phases", "switch"):
        monkeypatch.setenv("KDTREE_JAX_AUTO_LOOP", loop)
        jax.clear_caches()
        st = start(m, params, cfg, jnp.asarray(req.tokens), jnp.asarray(req.lengths), jax.random.key(0),
                   jnp.int32(-1), sampler=Sampler(), cache_len=req.cache_len, max_new=req.max_new)
        st = advance(m, params, cfg, st, jnp.int32(100), sampler=Sampler())
        assert traced[-1] == loop
        assert [np.asarray(st.out)[i, :int(st.num_out[i])].tolist() for i in range(len(PROMPTS))] == ar
        hist = np.asarray(st.nodes).sum(axis=0)
        assert hist[4] > 0 and hist[16] > 0 and hist[4] + hist[16] == hist.sum()
        runs[loop] = hist.tolist()
    assert runs["switch"] == runs["phases"]
    with pytest.raises(ValueError, match="KDTREE_JAX_AUTO_LOOP must be one of"):
        run("unrolled", 4)
    monkeypatch.delenv("KDTREE_JAX_AUTO_LOOP")
    kj.decoding.clear_compiled()
    jax.clear_caches()


def test_auto_changing_tier_every_step_is_lossless(model):
    """The loop leaves one tier's program for another's at every step (forced to alternate), or when the switch
    term makes it worth it: still exactly the AR tokens, and the loop ends."""
    cfg, params, drafter, ar = model
    tiers = bud.default_tiers(16)
    pts = lambda i: [(1, 1.0 + 0.1 * i), (1e5, 1.0 + 0.1 * i + 0.004 * 1e5)]
    for policy in (BudgetPolicy.choosing(_cost(tiers, len(PROMPTS), 0.0)).alternating(16),
                   BudgetPolicy.choosing(CostModel.from_points(tiers, len(PROMPTS), [pts(i) for i in range(len(tiers))],
                                                               switch=0.5))):
        m = speculative(cfg, "ddtree", drafter, 16, policy)
        req = kj.decoding.prepare(cfg, PROMPTS, 24, extra_slots=m.extra_slots)
        st = start(m, params, cfg, jnp.asarray(req.tokens), jnp.asarray(req.lengths), jax.random.key(0),
                   jnp.int32(-1), sampler=Sampler(), cache_len=req.cache_len, max_new=req.max_new)
        st = advance(m, params, cfg, st, jnp.int32(100), sampler=Sampler())
        out = [np.asarray(st.out)[i, :int(st.num_out[i])].tolist() for i in range(len(PROMPTS))]
        assert out == ar and bool(np.all(np.asarray(st.done)))
        hist = np.asarray(st.nodes).sum(axis=0)
        if int(policy.force_tier) == -2:  # every step all nodes of the first or the last tier, in turn
            assert hist[4] > 0 and hist[16] > 0 and hist[4] + hist[16] == hist.sum()
            assert abs(int(hist[4]) - int(hist[16])) <= len(PROMPTS)


def test_auto_sampling_matches_target_distribution(model):
    """At temperature > 0 with filters, auto's second token follows the target's marginal (as for fixed budgets,
    tests/test_ddtree.py), while the cost model has part of every tree masked (3 tokens: the first decoding step
    has room for 2, so its depth-1 nodes count)."""
    cfg, params, _, _ = model
    prompt, n = [9, 8, 7, 6], 2000
    sampling = dict(temperature=0.8, top_k=40, top_p=0.9)
    out = kj.generate(params, cfg, [prompt] * n, max_new_tokens=3, method="ddtree", drafter=OracleDrafter(8),
                      budget="auto", max_budget=16, tiers=(4, 16), cost_model=_cost((4, 16), n, 2e-5), seed=7,
                      **sampling)
    toks = np.array(out.tokens)
    v = cfg.vocab_size
    p1 = filtered_probs(kj.forward(params, cfg, jnp.array([prompt]))[0, -1], **sampling)
    p2 = p1 @ filtered_probs(kj.forward(params, cfg, jnp.array([prompt + [t] for t in range(v)]))[:, -1], **sampling)
    assert _chi2_pvalue(np.bincount(toks[:, 0], minlength=v), n * p1) > 1e-3
    assert _chi2_pvalue(np.bincount(toks[:, 1], minlength=v), n * p2) > 1e-3
    assert 1 <= out.stats["nodes"] < 16  # part of the tree verified, the rest masked
    assert out.stats["tau_histogram"][2] > n // 10


def test_masked_nodes_are_isolated(model):
    """step with some nodes inactive: the nodes that do not see them get the logits and latents of the unmasked
    step, the inactive ones really change, and a masked token gets no routed expert."""
    cfg, params, _, _ = model
    b, t = 2, 6
    cache = init_cache(cfg, b, 64)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, 16)), jnp.int32)
    cache = prefill(params, cfg, toks, jnp.array([9, 16], jnp.int32), cache).cache
    parents = np.array([-1, 0, 0, 1, 2, 3])
    vis = np.eye(t, dtype=bool)
    for i in range(1, t):
        vis[i] |= vis[parents[i]]
    depths = jnp.asarray(np.broadcast_to(vis.sum(axis=1) - 1, (b, t)), jnp.int32)
    mask = jnp.asarray(np.broadcast_to(vis, (b, t, t)))
    new = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    full = step(params, cfg, new, cache, depths=depths, tree_mask=mask)
    active = jnp.asarray(np.broadcast_to([True, True, False, True, False, True], (b, t)))  # 2 and its child 4 off
    masked = step(params, cfg, new, cache, depths=depths, tree_mask=mask, active=active)
    on = np.asarray(active[0])
    assert rel_err(masked.logits[:, on], full.logits[:, on]) <= 1e-5
    assert rel_err(masked.logits[:, ~on], full.logits[:, ~on]) > 1e-3  # the masked ones really changed
    rows = np.asarray(cache.lengths)[:, None] + np.flatnonzero(on)[None, :]  # the active nodes' cache slots
    for a, w in zip(masked.cache.latent + masked.cache.k_pe, full.cache.latent + full.cache.k_pe):
        assert rel_err(np.take_along_axis(np.asarray(a), rows[:, :, None], 1),
                       np.take_along_axis(np.asarray(w), rows[:, :, None], 1)) <= 1e-5
    lp = params.moe_layers[0].mlp
    x = jax.random.normal(jax.random.key(3), (1, 3, cfg.hidden_size))
    y, want = moe(lp, x, cfg, jnp.array([[True, False, True]])), moe(lp, x, cfg)
    assert rel_err(y[0, ::2], want[0, ::2]) <= 1e-6
    assert rel_err(y[0, 1], swiglu(lp.shared, x[0, 1])) <= 1e-6  # the shared expert alone
    assert rel_err(want[0, 1], swiglu(lp.shared, x[0, 1])) > 1e-3


def test_auto_loop_never_copies_the_cache(model):
    """The tiers' step programs are while loops of their own inside the loop (no conditional, whose index the
    host would wait for every step); the cache is only read in verify and written after, in place: a cache-sized
    copy would cost a full cache read and write per step at long context."""
    cfg, params, drafter, _ = model
    b, s = 2, 2048
    m = speculative(cfg, "ddtree", drafter, 16, BudgetPolicy.choosing(_cost((4, 16), b, 0.01)))
    st = start(m, params, cfg, jnp.ones((b, 16), jnp.int32), jnp.array([5, 9], jnp.int32), jax.random.key(0),
               jnp.int32(-1), sampler=Sampler(), cache_len=s, max_new=32, chunk=None)
    hlo = advance.lower(m, params, cfg, st, jnp.int32(4), sampler=Sampler()).compile().as_text()
    assert "conditional(" not in hlo
    assert len(re.findall(r" while\(", hlo)) >= 3  # the loop over the tiers and one loop per tier
    shapes = {f"[{b},{s},{cfg.kv_lora_rank}]", f"[{b},{s},{cfg.qk_rope_head_dim}]"}
    for line in hlo.splitlines():
        mm = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = \w+(\[[\d,]*\])\S* ([\w\-]+)\(", line)
        if mm and mm.group(1) in shapes:
            assert mm.group(2) not in ("copy", "concatenate", "slice", "dynamic-slice"), line


def test_calibration_is_measured_once_and_reused(model, tmp_path, monkeypatch):
    cfg, params, drafter, ar = model
    monkeypatch.setenv("KDTREE_JAX_COSTS", str(tmp_path))
    monkeypatch.setattr(bud, "choose_replan", lambda plan_s, step_s: 3)  # whatever the CPU measures: the fixed
    small = dataclasses.replace(cfg, max_position_embeddings=256)  # programs between plans are timed too
    logs = []
    cost = bud.resolve(params, small, drafter, batch=2, max_budget=8, log=logs.append)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and any("calibrating" in line for line in logs)
    data = json.loads(files[0].read_text())
    assert data["tiers"] == [4, 8] and data["batch"] == 2 and len(data["points"]) == 2
    assert data["replan"] == cost.replan >= 1 and "plan_seconds" in data["meta"] and data["meta"]["fixed_seconds"] > 0
    assert data["replan"] == 3 and len(data["fixed"]) == 2 and all(f > 0 for f in data["fixed"])
    assert data["fixed"][0] == pytest.approx(data["meta"]["fixed_seconds"], rel=1e-6)  # the plan's reference
    assert sum("calibrating" in line and "fixed budget" in line for line in logs) == 2  # both tiers' programs
    for pts in cost.points():  # non-decreasing in tokens and seconds, positive
        assert all(a[0] <= b[0] and 0 < a[1] <= b[1] for a, b in zip(pts, pts[1:]))
    monkeypatch.setattr(bud, "calibrate", lambda *a, **k: pytest.fail("measured again"))
    again = bud.resolve(params, small, drafter, batch=2, max_budget=8)
    np.testing.assert_array_equal(np.asarray(again.seconds), np.asarray(cost.seconds))
    out = kj.generate(params, small, PROMPTS[:2], max_new_tokens=24, method="ddtree", drafter=drafter,
                      budget="auto", max_budget=8)  # finds the saved file
    assert out.tokens == ar[:2]
    files[0].write_text("{not json")
    with pytest.raises(ValueError, match="unreadable.*calibrate"):
        bud.resolve(params, small, drafter, batch=2, max_budget=8)
    files[0].write_text("[]")  # JSON, but not a cost model
    with pytest.raises(ValueError, match="unreadable.*calibrate"):
        bud.resolve(params, small, drafter, batch=2, max_budget=8, cost_model=str(files[0]))
    with pytest.raises(ValueError, match="does not exist"):
        bud.resolve(params, small, drafter, batch=2, max_budget=8, cost_model=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="measured for batch 2"):
        bud.resolve(params, small, drafter, batch=3, max_budget=8, cost_model=cost)


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="chain", budget="auto"), "ddtree's tree size"),
    (dict(method="ddtree", budget="auto", max_budget=0), "max_budget must be"),
    (dict(method="ddtree", budget="big"), "budget must be an integer"),
    (dict(method="ddtree", budget="auto", max_budget=8, tiers=(2, 4)), "largest tier must be"),
    # eighth probe round: merged without a word (the CLI refuses them), then refused as 'got tiers (4,)'
    (dict(method="ddtree", budget="auto", max_budget=8, tiers=(4, 4)), r"each tier once: 4 given more than once in "
                                                                       r"\(4, 4\)"),
    (dict(method="ddtree", budget="auto", max_budget=8, tiers=[4, 2]), r"got tiers \(4, 2\)"),  # as given
    (dict(method="ddtree", budget="auto", max_budget=8, cost_model=3), "cost_model must be"),
])
def test_bad_auto_arguments_are_clear_errors(model, kwargs, match):
    cfg, params, drafter, _ = model
    with pytest.raises((ValueError, TypeError), match=match):
        kj.generate(params, cfg, PROMPTS[:1], max_new_tokens=4, drafter=drafter, **kwargs)


def test_bad_cost_points_are_clear_errors():
    with pytest.raises(ValueError, match="non-finite, negative or zero"):
        CostModel.from_points((4,), 1, [[(1, 0.0)]])
    with pytest.raises(ValueError, match="need as many"):
        CostModel.from_points((4, 8), 1, [[(1, 1.0)]])
    dips = CostModel.from_points((4,), 1, [[(1, 2.0), (5, 1.0), (9, 3.0)]])  # noise: never cheaper with more
    # a hand-edited file: values that became inf in float32, a replan past what calibration gives (the server's
    # chunks are whole windows of it: 10**9 steps a chunk; 2**31 overflowed int32), a batch that is not a count
    with pytest.raises(ValueError, match=r"non-finite, negative or zero point \(finite: in float32"):
        CostModel.from_points((4,), 1, [[(1, 1e300)]])
    with pytest.raises(ValueError, match="finite"):
        CostModel.from_points((4,), 1, [[(1, 1.0)]], switch=1e300)
    with pytest.raises(ValueError, match="fixed must hold 1"):
        CostModel.from_points((4,), 1, [[(1, 1.0)]], fixed=[1e300])
    for replan in (17, 10**9, 2**31):
        with pytest.raises(ValueError, match=r"replan must be an integer in \[1, 16\]"):
            CostModel.from_points((4,), 1, [[(1, 1.0)]], replan=replan)
    for batch in ("1", 1.5, True, 0):
        with pytest.raises(ValueError, match="batch must be an integer >= 1"):
            CostModel.from_points((4,), batch, [[(1, 1.0)]])
    np.testing.assert_allclose(np.asarray(dips.seconds)[0], [1.5, 1.5, 3.0])  # the closest non-decreasing curve


def test_reliability_counts_and_bins_equal_numpy():
    rng = np.random.default_rng(11)
    b, n = 3, 20
    scores = np.concatenate([np.zeros((b, 1)), -rng.exponential(3.0, (b, n))], axis=1).astype(np.float32)
    scores[0, 1:4] = [0.0, np.log(0.5), np.log(0.25)]  # bin edges: p = 1, 1/2, 1/4 -> bins 0, 1, 2
    verified, accepted = rng.random((b, n + 1)) < 0.7, rng.random((b, n + 1)) < 0.3
    got = np.asarray(reliability_counts(jnp.asarray(scores), jnp.asarray(verified), jnp.asarray(accepted)))
    p = np.exp(scores[:, 1:].astype(np.float64))
    k = np.clip(np.floor(-np.log2(p)), 0, RELIABILITY_BINS - 1).astype(int)
    assert k[0, :3].tolist() == [0, 1, 2] and np.asarray(reliability_bin(jnp.asarray(p[0, :3]))).tolist() == [0, 1, 2]
    want = np.zeros((b, 2, RELIABILITY_BINS))
    for r in range(b):
        for i in range(n):
            if verified[r, i + 1]:
                want[r, 0, k[r, i]] += p[r, i]
                want[r, 1, k[r, i]] += accepted[r, i + 1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_auto_reports_the_drafters_reliability(model):
    cfg, params, drafter, ar = model
    out = kj.generate(params, cfg, PROMPTS, max_new_tokens=24, method="ddtree", drafter=OracleDrafter(8, 4.0, 4.0),
                      budget="auto", max_budget=16, cost_model=_cost(bud.default_tiers(16), len(PROMPTS), 0.001))
    assert out.tokens == ar
    rel = out.stats["draft_reliability"]
    assert len(rel["predicted"]) == len(rel["accepted"]) == RELIABILITY_BINS and sum(rel["predicted"]) > 0
    accepted_nodes = sum(n * c for n, c in enumerate(out.stats["tau_histogram"])) - sum(out.stats["tau_histogram"])
    assert 0 < sum(rel["accepted"]) <= accepted_nodes  # planned steps only (every step here: replan 1)
    fixed = kj.generate(params, cfg, PROMPTS, max_new_tokens=24, method="ddtree", drafter=drafter, budget=8)
    assert sum(fixed.stats["draft_reliability"]["predicted"]) == 0  # a fixed budget keeps none
