"""benchmarks/ddtree_full_scale.py: the replayed-acceptance wrapper commits exactly the drawn lengths through the real
decoding loop, and the CPU smoke runs (--small; histogram and trace replay) write a consistent report (loop and stage
times, replayed tau inside the histogram's range, the projection's arithmetic from the JSON's own terms, --replot);
an auto row's report from made-up numbers. The trace replay itself: tests/test_trace_replay.py."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import ddtree_full_scale as dfs  # noqa: E402
from full_scale import COMM_PER_LAYER_S, FAST_ALLREDUCE_S, TAU_QUOTED  # noqa: E402

import kdtree_jax as kj  # noqa: E402
from kdtree_jax.ddtree import speculative  # noqa: E402
from kdtree_jax.decoding import advance  # noqa: E402


@pytest.mark.parametrize("length", [1, 3, 8])
def test_replayed_commits_the_drawn_length(length):
    cfg = kj.configs.tiny(num_hidden_layers=2, kernels="xla")
    params = kj.init_params(cfg, jax.random.key(0))
    drafter = dfs.make_drafter(cfg, True, 8)
    hist = [0] * 9
    hist[length] = 5  # every step commits `length` tokens
    m = dfs.replayed(speculative(cfg, "ddtree", drafter, 8), hist)
    batch, context, steps = 2, 40, 3
    s = dfs.loop_state(m, cfg, batch, context, 128, 64, np.random.default_rng(0))
    s = advance(m, params, cfg, s, jnp.int32(steps), sampler=dfs.GREEDY)
    assert int(s.steps) == steps
    np.testing.assert_array_equal(np.asarray(s.num_out), 1 + steps * length)
    np.testing.assert_array_equal(np.asarray(s.cache.lengths), context + steps * length)
    accepted = np.asarray(s.accepted)
    assert accepted[:, length].tolist() == [steps] * batch and accepted.sum() == steps * batch
    out = np.asarray(s.out)
    assert np.all(out[:, :1 + steps * length] >= 0) and np.all(out[:, 1 + steps * length:] == -1)


def test_replayed_path_is_valid():
    """The replayed path's nodes are nodes of the tree, root first, -1 past the drawn length; where the tree has a
    child it is the walk's (each node the child of the one before)."""
    cfg = kj.configs.tiny(num_hidden_layers=2, kernels="xla")
    params = kj.init_params(cfg, jax.random.key(0))
    drafter = dfs.make_drafter(cfg, True, 8)
    m = dfs.replayed(speculative(cfg, "ddtree", drafter, 16), [0, 1, 1, 1, 1, 1, 1, 1, 1])
    s = dfs.loop_state(m, cfg, 4, 40, 128, 64, np.random.default_rng(1))
    tree = m.inner.build(cfg, m.inner.propose(params, cfg, s, dfs.GREEDY), s.last)
    target = jnp.zeros(tree.tokens.shape, jnp.int32)
    path = kj.ddtree.accept(cfg, tree, target, 8)
    for k in range(5):
        p = m.replay(tree, target, path, jax.random.key(k))
        nodes, length, parents = np.asarray(p.nodes), np.asarray(p.length), np.asarray(tree.parents)
        for b in range(nodes.shape[0]):
            assert 1 <= length[b] <= 8 and nodes[b, 0] == 0 and np.all(nodes[b, length[b]:] == -1)
            assert np.all((nodes[b, :length[b]] >= 0) & (nodes[b, :length[b]] < tree.tokens.shape[1]))
            for j in range(1, length[b]):
                if np.any(parents[b] == nodes[b, j - 1]):
                    assert parents[b, nodes[b, j]] == nodes[b, j - 1]
    with pytest.raises(ValueError, match="index 0 empty"):
        dfs.replayed(m.inner, [1, 2, 3])


def test_smoke_run_report(tmp_path):
    out = tmp_path / "r"
    args = ["--small", "--layers", "2", "--steps", "4", "--warmup", "1", "--loop-repeats", "1", "--repeats", "2",
            "--out", str(out), "--replay", "histogram"]
    assert dfs.main(args + ["--cells", "1x8", "--drafters", "1"]) == 0
    assert dfs.main(args + ["--cells", "2x8", "--drafters", "0", "--append"]) == 0  # one measurement, two calls
    for ext in ("md", "json", "png"):
        assert (out / f"ddtree_full_scale.{ext}").stat().st_size > 0
    data = json.loads((out / "ddtree_full_scale.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert {(r["C"], r["budget"]) for r in rows} == {(1, 8), (2, 8)}
    for r in rows:
        assert r["loop_s"] > 0 and r["loop_whole_s"] > 0
        assert set(r["stages"]) == set(dfs.STAGES) and all(v > 0 for v in r["stages"].values())
        assert r["stage_sum_s"] == pytest.approx(sum(r["stages"].values()))
        assert r["ratio"] == pytest.approx(r["loop_s"] / r["stage_sum_s"])
        hist = np.asarray(r["histogram"])
        seen = np.flatnonzero(hist)
        assert seen.min() <= r["tau_replayed"] <= seen.max()
        assert sum(r["replayed_histogram"]) == r["timed_steps"] * r["C"]
        assert r["tau_hist"] == pytest.approx(dfs.hist_mean(hist))
    assert {(d["kind"], d["batch"]) for d in data["drafters"]} == {("sharded (1/8)", 1), ("replicated", 1)}
    assert all(d["step_s"] > 0 and d["floor_s"] > 0 for d in data["drafters"])
    proj = data["projection"]
    assert [p["C"] for p in proj] == [1]  # no all-reduces measured at C = 2
    p, r = proj[0], rows[0]
    comm = meta["layers"] * COMM_PER_LAYER_S[(1, 65)]
    assert p["comm_bound"] and p["comm_s"] == pytest.approx(comm)
    assert p["tok_s"] == pytest.approx(r["tau_replayed"] / (r["loop_s"] + comm))
    assert p["tok_s_fast"] == pytest.approx(r["tau_replayed"] / (r["loop_s"] + meta["layers"] * 2 * FAST_ALLREDUCE_S))
    assert p["tok_s_quoted"] == pytest.approx({k: v / (r["loop_s"] + comm) for k, v in TAU_QUOTED.items()})
    text = (out / "ddtree_full_scale.md").read_text()
    assert "Acceptance is replayed, not produced by this drafter" in text and meta["commit"] in text
    assert "Best measured budget at C = 1: ddtree@8" in text and "--cells 1x8 --drafters 1" in text
    assert "--cells 2x8 --drafters 0 --append" in text
    assert "A cut model**: 2 of K2.6's 61 layers" in text  # the projection of 2 layers is not K2.6's
    before = text
    (out / "ddtree_full_scale.md").unlink()
    (out / "ddtree_full_scale.png").unlink()
    assert dfs.main(["--replot", str(out / "ddtree_full_scale.json")]) == 0
    assert (out / "ddtree_full_scale.md").read_text() == before and (out / "ddtree_full_scale.png").exists()


def test_smoke_run_trace(tmp_path):
    """--replay trace (the default): the embedded model's trace, the tau the accept kernel's own along it."""
    out = tmp_path / "t"
    assert dfs.main(["--small", "--layers", "2", "--steps", "3", "--warmup", "1", "--loop-repeats", "1",
                     "--repeats", "1", "--out", str(out), "--cells", "2x8", "--drafters", "0", "--trace-texts", "2",
                     "--trace-positions", "24"]) == 0
    data = json.loads((out / "ddtree_full_scale.json").read_text())
    meta, (r,) = data["meta"], data["rows"]
    assert meta["replay"] == "trace" and meta["trace_texts"] == 2 and meta["trace_positions"] == 24
    assert 1 <= r["tau_replayed"] <= 8 and sum(r["replayed_histogram"]) == r["timed_steps"] * 2
    assert set(r["stages"]) == set(dfs.STAGES) and "tau_hist" not in r
    text = (out / "ddtree_full_scale.md").read_text()
    assert "replayed from the embedded model" in text and "--cells 2x8" in text


def test_report_with_an_auto_row(tmp_path):
    """An auto cell has a loop and no stages: its row, its paragraph and its projection (made-up numbers)."""
    meta = dict(n=8, layers=61, date="d", device="dev", commit="c", kernels="ffi", params_gb=1.0, context=4096,
                drafter="x", vocab=20480, steps=16, warmup=2, loop_repeats=2, repeats=5, command="cmd",
                acceptance="a.json", replay="trace", trace_texts=20, trace_positions=128, embedded_tau={"8": 3.5})
    fixed = dict(C=1, budget=8, nodes=9, loop_s=0.01, loop_whole_s=0.011, stages={k: 0.002 for k in dfs.STAGES},
                 stage_sum_s=0.012, ratio=0.01 / 0.012, ratio_whole=0.011 / 0.012, tau_replayed=3.4,
                 loop_compile_s=20.0)
    auto = dict(C=1, budget="auto", nodes=65, loop_s=0.012, loop_whole_s=0.013, stages=None, tau_replayed=3.9,
                loop_compile_s=60.0, tiers=[4, 8, 16, 32, 64], replan=1, calibrate_s=100.0, mean_nodes=11.5)
    data = dfs.write_report(str(tmp_path), meta, [auto, fixed], [])
    assert [r["budget"] for r in data["rows"]] == [8, "auto"]
    assert [p["method"] for p in data["projection"]] == ["ddtree@8", "ddtree@auto"]
    p = data["projection"][1]
    assert p["tok_s"] == pytest.approx(3.9 / (0.012 + 61 * COMM_PER_LAYER_S[(1, 65)]))
    text = (tmp_path / "ddtree_full_scale.md").read_text()
    assert "| 1 | auto | 12.00 | 13.00 | - |" in text and "3.90 (-)" in text and "3.40 (3.50)" in text
    assert 'budget="auto" at C = 1: tiers [4, 8, 16, 32, 64]' in text and "11.5" in text
    assert "1 of 1 cells meet it" in text


def test_cells_argument():
    assert dfs.parse_cells("1, 10x64, 2xauto") == [(1, None), (10, 64), (2, "auto")]
    assert dfs.budget_list("8,auto") == [8, "auto"]
    with pytest.raises(Exception, match="C or CxBUDGET"):
        dfs.parse_cells("1:64")
    with pytest.raises(Exception, match="budgets"):
        dfs.budget_list("8,0")
