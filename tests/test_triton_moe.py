"""benchmarks/triton_moe.py (the Triton anchor of the marlin_moe benchmark) on CPU through Triton's interpreter:
its align stage against moe_align, and the whole MoE against the float64 definition, on tiny shapes."""

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

# Triton reads TRITON_INTERPRET when it is imported, when a kernel is defined and when it runs: set from here to the
# import of the module under test and during each test here (the fixture below), restored otherwise
_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import triton_moe  # noqa: E402
finally:
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
from conftest import TOL, rel_err  # noqa: E402
from test_marlin_moe import experts64, make_experts, make_routing  # noqa: E402

from kdtree_jax.kernels.marlin_moe import marlin_moe_ref, max_blocks, moe_align  # noqa: E402


def _torch(a, dtype=None):
    """A jax / numpy array as a CPU torch tensor (bf16 through float32: numpy has no bf16)."""
    arr = np.asarray(jnp.asarray(a, jnp.float32)) if getattr(a, "dtype", None) == jnp.bfloat16 else np.asarray(a)
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.to(dtype) if dtype is not None else t


@pytest.mark.parametrize("m, k, e, bm, kind", [
    (5, 3, 8, 16, "sentinel"), (33, 6, 7, 16, "repeat"), (40, 2, 12, 32, "few"), (1, 8, 384, 16, "uniform"),
])
def test_align_equals_moe_align(m, k, e, bm, kind):
    rng = np.random.default_rng(m * 1000 + e)
    ids, _ = make_routing(rng, m, k, e, kind)
    if kind == "sentinel":
        ids = ids.at[0, 0].set(-3)
    want_slots, want_blocks = (np.asarray(a) for a in moe_align(ids, e, bm))
    got_slots, got_blocks = triton_moe.align(_torch(ids), e, bm)
    assert got_slots.shape == (max_blocks(m * k, e, bm) * bm,)
    np.testing.assert_array_equal(got_slots.numpy(), want_slots)
    np.testing.assert_array_equal(got_blocks.numpy(), want_blocks)


@pytest.mark.parametrize("m, k, e, kind, cfg1, cfg2", [
    (6, 2, 4, "uniform", (16, 32, 32, 4, 3), None),
    (9, 3, 5, "sentinel", (16, 16, 64, 4, 3), (16, 32, 32, 4, 3)),
    (20, 4, 3, "repeat", (32, 32, 32, 4, 3), None),
])
def test_moe_matches_float64_and_reference(m, k, e, kind, cfg1, cfg2):
    d, f = 64, 96
    rng = np.random.default_rng(m + 7 * e)
    gate, up, down = make_experts(rng, e, d, f)
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    ids, weights = make_routing(rng, m, k, e, kind)
    ws = [_torch(a) for w in (gate, up, down) for a in (w.packed, w.scale)]
    ws = [w.to(torch.bfloat16) if w.dtype == torch.float32 else w for w in ws]  # the scales
    got = triton_moe.moe(_torch(x, torch.bfloat16), _torch(ids), _torch(weights), *ws, cfg1, cfg2)
    assert got.dtype == torch.bfloat16 and got.shape == (m, d)
    got = got.float().numpy()
    want = experts64(x, ids, weights, gate, up, down)
    assert rel_err(got, want) < TOL[jnp.bfloat16]
    # the reference rounds the gate and up products to bf16 too (this kernel feeds fp32 sums to the SiLU): two bf16
    # approximations of one value, each within TOL of float64
    ref = np.asarray(marlin_moe_ref(x, ids, weights, gate, up, down), np.float32)
    assert rel_err(got, ref) < 2 * TOL[jnp.bfloat16]


def test_bad_block_shapes_and_scales_are_refused():
    rng = np.random.default_rng(0)
    gate, up, down = make_experts(rng, 2, 64, 96)
    x = torch.zeros((1, 64), dtype=torch.bfloat16)
    ids = torch.zeros((1, 1), dtype=torch.int32)
    ws = [_torch(a) for w in (gate, up, down) for a in (w.packed, w.scale)]
    with pytest.raises(ValueError, match="BLOCK_K"):
        triton_moe.moe(x, ids, torch.ones((1, 1)), *ws, (16, 32, 48, 4, 3))
    with pytest.raises(ValueError, match="BLOCK_M"):
        triton_moe.moe(x, ids, torch.ones((1, 1)), *ws, (16, 32, 32, 4, 3), (32, 32, 32, 4, 3))
    ws[1] = ws[1][..., :1]  # gate's scales of a group of 64, not 32
    with pytest.raises(ValueError, match="scales"):
        triton_moe.moe(x, ids, torch.ones((1, 1)), *ws, (16, 32, 32, 4, 3))


def test_candidates_follow_the_slots_per_expert():
    small = triton_moe.candidates(1, 8, 384)  # 1 slot per touched expert
    assert small and all(c[0] == 16 for c in small)
    large = triton_moe.candidates(4096, 8, 384)  # ~85 per expert
    assert {c[0] for c in large} == {16, 32, 64, 128}


def test_measure_jax_takes_the_benchmarks_jax_inputs():
    """The path benchmarks/marlin_moe.py's `triton` variant takes: JAX arrays shared with torch (DLPack), one config
    timed, the first set's output returned."""
    m, k, e, d, f = 4, 2, 3, 64, 96
    rng = np.random.default_rng(5)
    experts = make_experts(rng, e, d, f)
    sets = []
    for _ in range(2):
        ids, weights = make_routing(rng, m, k, e, "uniform")
        sets.append((jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16), ids, weights))
    got = triton_moe.measure_jax(sets, experts, m, k, e, configs=[(16, 32, 32, 4, 3)])
    assert got["config"] == (16, 32, 32, 4, 3) and got["time_s"] > 0 and len(got["tried"]) == 1
    assert got["timing"] == "eager"  # (CUDA graphs on the GPU only)
    assert rel_err(got["out"], experts64(*sets[0], *experts)) < TOL[jnp.bfloat16]
