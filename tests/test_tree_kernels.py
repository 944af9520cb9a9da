"""tree_build and tree_accept: the CPU kernels, the CUDA kernels (marked gpu) and the pure-JAX references against an
independent Python `heapq` implementation of DDTree Algorithm 1 and hand-built trees.

The heapq reference computes log-sum-exps in float64 with numpy (the kernels use their own tiled float32 exp) and
scores in the kernels' fixed point, so the CPU kernel must match it array for array; a difference is accepted only
when it is explained by a near-tie (two scores within 1e-7 nats, where the two log-sum-exps may round apart).
The float32 reference is held to the same checks with a wider near-tie margin.
"""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.kernels import Accepted, tree_accept, tree_build, tree_build_ref
from kdtree_jax.kernels.tree_build import _tree_build_levels_cpu

SCALE = 2.0**32
CLAMP = np.float32(2.0**20)
HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


# --------------------------------------------------------------------------------------------------------------------
# inputs


def draft_logits(seed: int, b: int, l: int, v: int, dtype=jnp.float32, ties: bool = False) -> jax.Array:
    """Fresh random logits with varied shapes per (row, depth): temperature from flat to peaked, sometimes a
    confident token (deep trees). ties=True draws from a few levels only (many exactly equal logits)."""
    rng = np.random.default_rng(seed)
    if ties:
        x = rng.integers(-6, 7, size=(b, l, v)).astype(np.float32) * 0.5
    else:
        x = rng.standard_normal((b, l, v), dtype=np.float32)
        x *= np.exp(rng.uniform(np.log(0.5), np.log(8.0), size=(b, l, 1))).astype(np.float32)
        sure = rng.random((b, l)) < 0.5
        hot = rng.integers(0, v, size=(b, l))
        bb, ll = np.nonzero(sure)
        x[bb, ll, hot[bb, ll]] += rng.uniform(5, 20, size=bb.size).astype(np.float32)
    return jnp.asarray(x, dtype=dtype)


# --------------------------------------------------------------------------------------------------------------------
# the independent reference


def _sanitize(x: np.ndarray) -> np.ndarray:
    x = np.where(np.isnan(x), -CLAMP, x).astype(np.float32)
    return np.clip(x, -CLAMP, CLAMP) + np.float32(0.0)


def heapq_tree(logits_row: np.ndarray, budget: int) -> dict:
    """Algorithm 1 for one row [L, V] with Python's heapq. Scores: sum of llrint(x 2^32) - llrint(lse 2^32) with a
    float64 log-sum-exp; heap entries (-score, depth, rank path) implement the tie rule of tree_build."""
    x = _sanitize(np.asarray(logits_row, np.float32))
    l, v = x.shape
    k = min(budget, v)
    x64 = x.astype(np.float64)
    m = x64.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x64 - m).sum(axis=1, keepdims=True)))[:, 0]  # [L]
    order = np.lexsort((np.broadcast_to(np.arange(v), (l, v)), -x64), axis=1)[:, :k]  # logit desc, id asc
    top_x = np.take_along_axis(x64, order, axis=1)
    q = [[int(np.rint(top_x[d, j] * SCALE)) - int(np.rint(lse[d] * SCALE)) for j in range(k)] for d in range(l)]
    lp = top_x - lse[:, None]  # float64 log-probs
    heap = [(-q[0][0], 1, (0,), 0)]
    score, score64, ranks = [0], [0.0], [()]
    tokens, parents, depths = [], [], []
    while len(tokens) < budget:
        neg, d, path, par = heapq.heappop(heap)
        i = len(tokens) + 1
        j = path[-1]
        tokens.append(int(order[d - 1, j]))
        parents.append(par)
        depths.append(d)
        score.append(-neg)
        score64.append(score64[par] + lp[d - 1, j])
        ranks.append(path)
        if j + 1 < k:
            heapq.heappush(heap, (-(score[par] + q[d - 1][j + 1]), d, path[:-1] + (j + 1,), par))
        if d < l:
            heapq.heappush(heap, (-(score[i] + q[d][0]), d + 1, path + (0,), i))
    nxt = heapq.heappop(heap) if heap else None
    next64 = None
    if nxt is not None:
        nd, npath = nxt[1], nxt[2]
        next64 = score64[nxt[3]] + lp[nd - 1, npath[-1]]
    lp_full = x64 - lse[:, None]
    return {"tokens": np.array(tokens, np.int32), "parents": np.array(parents, np.int32),
            "depths": np.array(depths, np.int32), "score64": np.array(score64[1:]), "next64": next64, "lp": lp_full}


# --------------------------------------------------------------------------------------------------------------------
# checks


def check_structure(tree_row, n: int, l: int, v: int) -> None:
    tokens, parents, depths, vis = (np.asarray(a) for a in tree_row)
    assert tokens.shape == parents.shape == depths.shape == (n,)
    assert vis.shape == (n + 1, n + 1) and vis.dtype == bool
    idx = np.arange(1, n + 1)
    assert np.all((parents >= 0) & (parents < idx)), "a parent must come before its child"
    pdepth = np.concatenate([[0], depths])[parents]
    assert np.all(depths == pdepth + 1) and np.all((depths >= 1) & (depths <= l))
    assert np.all((tokens >= 0) & (tokens < v))
    pairs = set(zip(parents.tolist(), tokens.tolist()))
    assert len(pairs) == n, "two children of one parent share a token"
    want = np.zeros((n + 1, n + 1), bool)
    want[0, 0] = True
    for i in range(1, n + 1):
        want[i] = want[parents[i - 1]]
        want[i, i] = True
    np.testing.assert_array_equal(vis, want)


def path_scores(tokens, parents, depths, lp) -> np.ndarray:
    s = np.zeros(len(tokens) + 1)
    for i in range(len(tokens)):
        s[i + 1] = s[parents[i]] + lp[depths[i] - 1, tokens[i]]
    return s[1:]


def paths(tokens, parents) -> list[tuple]:
    out = [()]
    for t, p in zip(tokens.tolist(), parents.tolist()):
        out.append(out[p] + (t,))
    return out[1:]


def assert_same_tree(got, want: dict, tol: float) -> None:
    """Exact equality with the heapq tree, or a difference explained by near-ties (scores within `tol`)."""
    tokens, parents, depths, _ = (np.asarray(a) for a in got)
    if (np.array_equal(tokens, want["tokens"]) and np.array_equal(parents, want["parents"])
            and np.array_equal(depths, want["depths"])):
        return
    s_got = path_scores(tokens, parents, depths, want["lp"])
    s_want = want["score64"]
    assert np.all(np.diff(s_got) <= tol), "pop order must not increase in score"
    np.testing.assert_allclose(np.sort(s_got), np.sort(s_want), rtol=0, atol=tol)
    got_paths, want_paths = paths(tokens, parents), paths(want["tokens"], want["parents"])
    boundary = s_want[-1]
    extra = [s for p, s in zip(got_paths, s_got) if p not in set(want_paths)]
    assert all(abs(s - boundary) <= tol for s in extra), "different node sets away from the boundary"
    gaps = np.abs(np.diff(np.sort(np.concatenate([s_want, [] if want["next64"] is None else [want["next64"]]]))))
    assert np.any((gaps > 0) & (gaps <= tol)) or np.any(gaps == 0), "arrays differ although no scores nearly tie"


# --------------------------------------------------------------------------------------------------------------------
# tree_build on CPU vs heapq

CASES = [  # (seed, B, L, V, budget, dtype)
    (1, 1, 7, 256, 1, jnp.float32),
    (2, 16, 7, 256, 16, jnp.bfloat16),
    (3, 1, 15, 256, 1024, jnp.float32),
    (4, 16, 15, 256, 64, jnp.float32),
    (5, 1, 7, 32000, 256, jnp.bfloat16),
    (6, 16, 7, 32000, 64, jnp.float32),
    (7, 1, 15, 32000, 1024, jnp.bfloat16),
    (8, 16, 15, 32000, 16, jnp.bfloat16),
    (9, 1, 7, 163840, 1024, jnp.float32),
    (10, 16, 15, 163840, 256, jnp.bfloat16),
    (11, 1, 15, 163840, 64, jnp.bfloat16),
    (12, 16, 7, 163840, 1, jnp.float32),
]


@pytest.mark.parametrize("seed,b,l,v,budget,dtype", CASES)
def test_tree_build_cpu_vs_heapq(seed, b, l, v, budget, dtype):
    x = draft_logits(seed, b, l, v, dtype)
    got = jax.jit(tree_build, static_argnums=1)(x, budget)
    xs = np.asarray(x.astype(jnp.float32))
    for r in range(b):
        row = [a[r] for a in got]
        check_structure(row, budget, l, v)
        assert_same_tree(row, heapq_tree(xs[r], budget), tol=1e-7)


@pytest.mark.parametrize("seed,b,l,v,budget,dtype", [
    (20, 4, 16, 64, 1024, jnp.bfloat16),  # many ties, K = V < budget = L * V
    (21, 4, 7, 512, 256, jnp.float32),
    (22, 2, 15, 3000, 512, jnp.bfloat16),
])
def test_tree_build_cpu_ties(seed, b, l, v, budget, dtype):
    x = draft_logits(seed, b, l, v, dtype, ties=True)
    got = tree_build(x, budget)
    xs = np.asarray(x.astype(jnp.float32))
    for r in range(b):
        row = [a[r] for a in got]
        check_structure(row, budget, l, v)
        assert_same_tree(row, heapq_tree(xs[r], budget), tol=1e-7)


# The CUDA kernel's level-by-level algorithm, run sequentially on the host, equals the heap kernel exactly.
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("budget", [1, 16, 64, 256, 1024])
def test_levels_algorithm_equals_heap(budget, ties):
    with jax.default_device(jax.devices("cpu")[0]):  # the levels algorithm is a CPU target (for tests)
        _levels_equal_heap(budget, ties)


def _levels_equal_heap(budget, ties):
    for seed in range(3):
        v = [97, 1000, 32000][seed]
        x = draft_logits(100 * budget + seed + 50 * ties, 4, [7, 15, 16][seed], v, jnp.bfloat16 if ties else
                         jnp.float32, ties=ties)
        budget_ = min(budget, x.shape[1] * v)
        want = tree_build(x, budget_)
        got = _tree_build_levels_cpu(x, budget_)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_levels_algorithm_flat_and_peaked():
    """Inputs that overflow the level store: flat depths (trim path), exact-tie plateaus (level cap path)."""
    with jax.default_device(jax.devices("cpu")[0]):  # the levels algorithm is a CPU target (for tests)
        _levels_flat_and_peaked()


def _levels_flat_and_peaked():
    rng = np.random.default_rng(7)
    flat = np.full((2, 15, 2048), -30.0, np.float32)
    flat[:, :, :600] = rng.integers(0, 3, size=(2, 15, 600)) * 0.01  # 600 near-equal tokens per depth
    flat[1, ::2, 0] += 30.0  # every other depth has one confident token
    for x in (jnp.asarray(flat), jnp.asarray(flat, jnp.bfloat16)):
        for budget in (256, 1024):
            want = tree_build(x, budget)
            got = _tree_build_levels_cpu(x, budget)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------------------------------------------------
# the pure-JAX reference


@pytest.mark.parametrize("seed,b,l,v,budget,dtype", [
    (30, 2, 7, 256, 16, jnp.float32),
    (31, 2, 15, 1000, 256, jnp.bfloat16),
    (32, 1, 7, 32000, 1024, jnp.float32),
    (33, 2, 15, 256, 64, jnp.bfloat16),
])
def test_tree_build_ref_vs_heapq(seed, b, l, v, budget, dtype):
    x = draft_logits(seed, b, l, v, dtype)
    got = jax.jit(tree_build_ref, static_argnums=1)(x, budget)
    ffi = tree_build(x, budget, impl="xla")
    xs = np.asarray(x.astype(jnp.float32))
    for r in range(b):
        row = [a[r] for a in got]
        check_structure(row, budget, l, v)
        assert_same_tree(row, heapq_tree(xs[r], budget), tol=1e-4)
        for a, c in zip(row, ffi):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c[r]))


def test_tree_build_ref_ties():
    x = draft_logits(34, 2, 7, 64, jnp.bfloat16, ties=True)
    got = tree_build_ref(x, 200)
    xs = np.asarray(x.astype(jnp.float32))
    for r in range(2):
        assert_same_tree([a[r] for a in got], heapq_tree(xs[r], 200), tol=1e-4)


def test_tree_build_in_loop_and_special_values():
    """Inside lax.fori_loop under jit; NaN and +-inf logits are sanitized the same way by kernel and reference."""
    x = draft_logits(40, 2, 7, 300, jnp.float32)
    x = x.at[0, 0, 5].set(jnp.nan).at[0, 0, 7].set(jnp.inf).at[1, 2, :50].set(-jnp.inf)

    @jax.jit
    def run(x):
        def body(i, acc):
            return acc + tree_build(jnp.roll(x, i, axis=2), 32).tokens
        return jax.lax.fori_loop(0, 3, body, jnp.zeros((2, 32), jnp.int32))

    got = tree_build(x, 32)
    want = sum(np.asarray(tree_build(jnp.roll(x, i, axis=2), 32).tokens) for i in range(3))
    np.testing.assert_array_equal(run(x), want)
    xs = np.asarray(x)
    for r in range(2):
        assert_same_tree([a[r] for a in got], heapq_tree(xs[r], 32), tol=1e-7)
    assert int(got.tokens[0, 0]) == 7  # the +inf logit, clamped to 2^20, is the first node


def test_tree_build_bad_inputs():
    x = jnp.zeros((2, 7, 100), jnp.float32) + 1.0
    with pytest.raises(ValueError, match="budget"):
        tree_build(x, 0)
    with pytest.raises(ValueError, match="budget"):
        tree_build(x, 701)
    with pytest.raises(TypeError, match="budget"):
        tree_build(x, 16.0)
    with pytest.raises(ValueError, match=r"\[B, L, V\]"):
        tree_build(x[0], 16)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        tree_build(x.astype(jnp.float16), 16)
    with pytest.raises(ValueError, match="1..16"):
        tree_build(jnp.ones((1, 17, 10)), 4)
    with pytest.raises(ValueError, match="impl"):
        tree_build(x, 4, impl="cuda")
    with pytest.raises(ValueError, match="budget"):
        tree_build_ref(x, 0)
    assert tree_build(x, 700).tokens.shape == (2, 700)  # budget = L * V is allowed


# --------------------------------------------------------------------------------------------------------------------
# tree_accept


def accept_py(tokens, parents, target) -> tuple[list[int], int]:
    cur, path = 0, [0]
    while True:
        kids = [c for c in range(1, len(tokens)) if parents[c] == cur and tokens[c] == target[cur]]
        if not kids:
            return path, target[cur]
        cur = min(kids)
        path.append(cur)


def random_trees(seed: int, b: int, n: int, vocab: int):
    rng = np.random.default_rng(seed)
    parents = np.full((b, n), -1, np.int32)
    for i in range(1, n):
        parents[:, i] = rng.integers(0, i, size=b)
    tokens = rng.integers(0, vocab, size=(b, n)).astype(np.int32)
    target = rng.integers(0, vocab, size=(b, n)).astype(np.int32)
    follow = rng.random((b, n)) < 0.7  # make long accepted paths likely: copy a child's token into the target
    for r in range(b):
        for p in range(n):
            kids = np.nonzero(parents[r] == p)[0]
            if kids.size and follow[r, p]:
                target[r, p] = tokens[r, rng.choice(kids)]
    return tokens, parents, target


def check_accept(acc: Accepted, tokens, parents, target):
    path, length, bonus = (np.asarray(a) for a in acc)
    for r in range(tokens.shape[0]):
        want, want_bonus = accept_py(tokens[r].tolist(), parents[r].tolist(), target[r].tolist())
        assert length[r] == len(want) and bonus[r] == want_bonus
        np.testing.assert_array_equal(path[r], want + [-1] * (tokens.shape[1] - len(want)))


@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_tree_accept_hand_built(impl):
    #        0
    #      /   \
    #     1(5)  2(5)     two children with the same token: the lower index wins
    #     |      |
    #     3(7)   4(8)
    #     |
    #     5(9)           the deepest node
    tokens = np.array([[0, 5, 5, 7, 8, 9]] * 4, np.int32)
    parents = np.array([[-1, 0, 0, 1, 2, 3]] * 4, np.int32)
    target = np.array([
        [5, 7, 8, 9, 0, 4],  # root -> 1 -> 3 -> 5, bonus = target[5] = 4
        [6, 7, 8, 9, 0, 4],  # no child of the root matches: path [0], bonus 6
        [5, 3, 8, 9, 0, 4],  # root -> 1, then no match: bonus 3
        [5, 7, 8, 2, 0, 4],  # root -> 1 -> 3, bonus 2
    ], np.int32)
    acc = jax.jit(lambda *a: tree_accept(*a, impl=impl))(tokens, parents, target)
    np.testing.assert_array_equal(acc.length, [4, 1, 2, 3])
    np.testing.assert_array_equal(acc.bonus, [4, 6, 3, 2])
    np.testing.assert_array_equal(acc.path[:, :4], [[0, 1, 3, 5], [0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 3, -1]])
    check_accept(acc, tokens, parents, target)


@pytest.mark.parametrize("impl", ["ffi", "xla"])
@pytest.mark.parametrize("b,n", [(1, 1), (3, 17), (16, 257), (4, 1025)])
def test_tree_accept_random(impl, b, n):
    tokens, parents, target = random_trees(b * n, b, n, vocab=4)
    acc = tree_accept(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(target), impl=impl)
    check_accept(acc, tokens, parents, target)


def test_tree_accept_on_built_tree_in_while_loop():
    """Accept along a tree from tree_build, inside lax.while_loop; the target follows the tree to its deepest node."""
    b, n = 2, 64
    t = tree_build(draft_logits(50, b, 7, 500, jnp.float32), n)
    node_tokens = np.concatenate([np.full((b, 1), 3, np.int32), np.asarray(t.tokens)], axis=1)  # root = bonus 3
    parents = np.concatenate([np.full((b, 1), -1, np.int32), np.asarray(t.parents)], axis=1)
    depths = np.concatenate([np.zeros((b, 1), np.int32), np.asarray(t.depths)], axis=1)
    target = np.full((b, n + 1), 99, np.int32)
    deepest = depths.argmax(axis=1)
    for r in range(b):
        c = deepest[r]
        while c > 0:  # the target's token at each node on the path is its path child's token
            target[r, parents[r, c]] = node_tokens[r, c]
            c = parents[r, c]

    @jax.jit
    def run(nt, par, tgt):
        def body(st):
            i, total = st
            return i + 1, total + tree_accept(nt, par, tgt).length
        return jax.lax.while_loop(lambda st: st[0] < 2, body, (0, jnp.zeros((b,), jnp.int32)))[1]

    acc = tree_accept(node_tokens, parents, target)
    np.testing.assert_array_equal(acc.length, depths.max(axis=1) + 1)
    np.testing.assert_array_equal(acc.path[np.arange(b), acc.length - 1], deepest)
    np.testing.assert_array_equal(acc.bonus, [99, 99])
    np.testing.assert_array_equal(run(node_tokens, parents, target), 2 * np.asarray(acc.length))
    check_accept(acc, node_tokens, parents, target)


def test_tree_accept_bad_inputs():
    a = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(TypeError, match="int32"):
        tree_accept(a.astype(jnp.float32), a, a)
    with pytest.raises(ValueError, match="one shape"):
        tree_accept(a, a[:, :4], a)
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        tree_accept(a[0], a[0], a[0])
    with pytest.raises(ValueError, match="impl"):
        tree_accept(a, a, a, impl="gpu")


# --------------------------------------------------------------------------------------------------------------------
# CUDA kernels (run on the device machine: pytest -m gpu)

GPU_CASES = [c + (False,) for c in CASES] + [  # (seed, B, L, V, budget, dtype, ties)
    (60, 16, 15, 163840, 1024, jnp.float32, False),
    (61, 16, 7, 163840, 256, jnp.float32, False),
    (62, 1, 7, 163840, 4096, jnp.bfloat16, False),  # largest budget: stage-3 arena in global memory
    (63, 2, 15, 32000, 2048, jnp.float32, False),  # global arena
    (64, 3, 11, 1001, 300, jnp.float32, False),  # V not a multiple of 4: scalar loads, partial tile
    (65, 2, 7, 1001, 64, jnp.bfloat16, False),
    (66, 4, 16, 64, 1024, jnp.bfloat16, True),  # budget = L * V
    (67, 4, 15, 3000, 512, jnp.bfloat16, True),
    (68, 16, 7, 32000, 256, jnp.float32, True),
    (69, 2, 15, 163840, 1024, jnp.bfloat16, True),
]


def _on(platform: str, x):
    return jax.device_put(x, jax.devices(platform)[0])


def _cuda_vs_cpu(x, budget):
    f = jax.jit(tree_build, static_argnums=1)
    jax.block_until_ready(f(_on("gpu", -x), budget))  # a different tree first: stale outputs would show
    got = f(_on("gpu", x), budget)
    want = f(_on("cpu", x), budget)
    for a, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    return got


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("seed,b,l,v,budget,dtype,ties", GPU_CASES)
def test_tree_build_cuda_equals_cpu(seed, b, l, v, budget, dtype, ties):
    x = draft_logits(seed, b, l, v, dtype, ties=ties)
    got = _cuda_vs_cpu(x, budget)
    xs = np.asarray(x.astype(jnp.float32))
    for r in range(min(b, 2)):
        check_structure([a[r] for a in got], budget, l, v)
        assert_same_tree([a[r] for a in got], heapq_tree(xs[r], budget), tol=1e-7)


@pytest.mark.gpu
@gpu
def test_tree_build_cuda_overflow_paths():
    """Flat and tie-plateau inputs that trim the stage-3 store and cap levels (see test_levels_algorithm_*)."""
    rng = np.random.default_rng(7)
    flat = np.full((2, 15, 2048), -30.0, np.float32)
    flat[:, :, :600] = rng.integers(0, 3, size=(2, 15, 600)) * 0.01
    flat[1, ::2, 0] += 30.0
    for x in (jnp.asarray(flat), jnp.asarray(flat, jnp.bfloat16)):
        for budget in (256, 1024, 4096):
            _cuda_vs_cpu(x, budget)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("b,n", [(1, 1), (16, 257), (64, 1025), (2, 4097)])
def test_tree_accept_cuda_equals_cpu(b, n):
    tokens, parents, target = random_trees(b + n, b, n, vocab=3)
    got = tree_accept(*(_on("gpu", a) for a in (tokens, parents, target)))
    want = tree_accept(*(_on("cpu", a) for a in (tokens, parents, target)))
    for a, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    check_accept(got, tokens, parents, target)


@pytest.mark.gpu
@gpu
def test_tree_build_cuda_ref_on_gpu():
    x = _on("gpu", draft_logits(70, 2, 7, 4096, jnp.float32))
    got = tree_build(x, 128)
    ref = tree_build_ref(x, 128)
    xs = np.asarray(x)
    for r in range(2):
        assert_same_tree([a[r] for a in got], heapq_tree(xs[r], 128), tol=1e-7)
        assert_same_tree([a[r] for a in ref], heapq_tree(xs[r], 128), tol=1e-4)
