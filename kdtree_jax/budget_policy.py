"""The in-loop part of budget="auto" (`kdtree_jax.budget` has the whole story, calibration and files): the
`CostModel` of a step, the `BudgetPolicy` that picks the tier and the nodes to verify every step from the nodes'
path probabilities (`node_scores`), and the default tiers. Pure JAX, traced into the decoding loop."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def default_tiers(max_budget: int) -> tuple[int, ...]:
    """The node counts compiled into the loop for `max_budget`: max/16, max/8, max/4, max/2 and max (those >= 4),
    each a separate step program (`decoding.run_steps`)."""
    tiers = sorted({max_budget // d for d in (16, 8, 4, 2) if max_budget // d >= 4} | {max_budget})
    return tuple(tiers)


FLOAT32_MAX = float(np.finfo(np.float32).max)  # the cost model's arrays are float32
REPLAN_MOST = 16  # the longest run of steps between plans
REPLAN_SHARE = 0.01  # the plan's cost, spread over the steps between plans, kept within this share of a step


def choose_replan(plan_seconds: float, step_seconds: float) -> int:
    """Steps from one plan to the next (1: plan every step): the fewest that spread a plan's own cost
    (`plan_seconds`: the auto step at a tier's every node minus the fixed step of that size, both measured) within
    REPLAN_SHARE of a step, at most REPLAN_MOST. Where the plan is cheap beside the step (a large model's step)
    every step is planned; where the step is a few launches (a small model), the steps between plans run the chosen
    tier's fixed program."""
    if not (math.isfinite(plan_seconds) and math.isfinite(step_seconds)) or step_seconds <= 0:
        raise ValueError(f"plan seconds {plan_seconds} and step seconds {step_seconds} must be finite, the step > 0")
    return int(min(REPLAN_MOST, max(1, math.ceil(plan_seconds / (REPLAN_SHARE * step_seconds) - 1e-9))))


RELIABILITY_BINS = 16  # bins of a node's path probability p: bin k holds 2^-(k+1) < p <= 2^-k (the last, the rest)


def reliability_bin(p: jax.Array) -> jax.Array:
    """int32, p's shape: the reliability bin of path probabilities p (0: above 1/2, k: in (2^-(k+1), 2^-k])."""
    k = jnp.floor(-jnp.log2(jnp.maximum(p, 2.0**-40)))
    return jnp.clip(k, 0, RELIABILITY_BINS - 1).astype(jnp.int32)


def reliability_counts(scores: jax.Array, verified: jax.Array, accepted: jax.Array) -> jax.Array:
    """f32 [B, 2, K]: per row and bin of path probability, the probability the drafter predicted (sum of p over the
    verified nodes) and the nodes the target accepted, from scores f32 [B, N+1] (log path probabilities, root
    first), verified and accepted bool [B, N+1] (the root is left out)."""
    p = jnp.exp(scores[:, 1:])
    onehot = jax.nn.one_hot(reliability_bin(p), RELIABILITY_BINS, dtype=jnp.float32) * verified[:, 1:, None]
    predicted = jnp.sum(onehot * p[:, :, None], axis=1)
    hits = jnp.sum(onehot * accepted[:, 1:, None].astype(jnp.float32), axis=1)
    return jnp.stack([predicted, hits], axis=1)


def check_tiers(tiers, max_budget: int) -> tuple[int, ...]:
    """The tiers sorted, checked: integers >= 0 (a tier of 0 nodes: autoregressive steps between plans, nothing
    drafted), each once (the command line's --tiers rule), the largest max_budget."""
    if (not isinstance(tiers, (tuple, list)) or not tiers
            or any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0 for t in tiers)):
        raise ValueError(f"tiers must be a non-empty list of integers >= 0, got {tiers!r}")
    given = tuple(int(t) for t in tiers)
    twice = sorted({t for t in given if given.count(t) > 1})
    if twice:  # (they were merged without a word, and a refusal then showed tiers that were never given)
        raise ValueError(f"tiers: each tier once: {', '.join(map(str, twice))} given more than once in {given}")
    tiers = tuple(sorted(given))
    if tiers[-1] != max_budget:
        raise ValueError(f"the largest tier must be max_budget {max_budget}, got tiers {given}")
    return tiers


def _non_decreasing(y: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to y in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return np.concatenate([np.full(int(c), m) for m, c in blocks])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds of one speculative step at one batch size, as measured by `calibrate`.

    Step seconds at tier t for `m` verified tokens (live rows + chosen nodes) and `ctx` cached tokens over the live
    rows: interp(m, tokens[t], seconds[t]) + per_context * (ctx - live rows x context), never below 1% of the curve;
    plus `switch` when the step's tier differs from the one before (the loop leaves one tier's program for
    another's: a few loop conditions read by the host, `decoding.run_steps`). The first step of each compiled call
    (`decoding.advance`) has no step before it and pays no switch.
    `replan` (static, `choose_replan`): the loop plans every `replan`-th step; the steps between run the planned
    tier's fixed program (its whole tree, no plan), where planning every step would cost more than 1% of a step;
    `fixed` is what one of those costs per tier (measured where replan > 1; else each curve at every node).
    The arrays are leaves (traced): a cost model of the same shape reuses the compiled loop.
    """

    tokens: jax.Array  # f32 [T, K]  verified tokens at the calibration points of each tier (increasing)
    seconds: jax.Array  # f32 [T, K] step seconds there (made non-decreasing)
    per_context: jax.Array  # f32 []  seconds per live row and cached token, beyond `context`
    context: jax.Array  # f32 []      the context of the calibration
    switch: jax.Array  # f32 []       seconds a change of tier adds to a step
    fixed: jax.Array  # f32 [T]       seconds of each tier's fixed program (its whole tree, no plan) at `context`
    tiers: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    batch: int = dataclasses.field(metadata=dict(static=True))
    replan: int = dataclasses.field(default=1, metadata=dict(static=True))

    def step_seconds(self, tier: int, m: jax.Array, live: jax.Array, ctx: jax.Array) -> jax.Array:
        return self.all_step_seconds(jnp.broadcast_to(m, (len(self.tiers), *jnp.shape(m))), live, ctx)[tier]

    def all_step_seconds(self, m: jax.Array, live: jax.Array, ctx: jax.Array) -> jax.Array:
        """Step seconds of every tier at once: m [T, ...] verified tokens per tier -> [T, ...]. The curve is the
        sum of its segments' rises, each segment's share clipped to [0, 1] (one elementwise pass and a sum over the
        points, instead of a search per tier): interp(m, tokens[t], seconds[t]), flat beyond the end points."""
        x, y = self.tokens, self.seconds  # [T, K]
        extra = (1,) * (m.ndim - 1)
        x0, x1 = x[:, :-1].reshape(x.shape[0], *extra, -1), x[:, 1:].reshape(x.shape[0], *extra, -1)
        rise = (y[:, 1:] - y[:, :-1]).reshape(x.shape[0], *extra, -1)
        dx = x1 - x0
        share = jnp.clip((m.astype(jnp.float32)[..., None] - x0) / jnp.where(dx > 0, dx, 1.0), 0.0, 1.0)
        share = jnp.where(dx > 0, share, (m.astype(jnp.float32)[..., None] >= x1).astype(jnp.float32))
        base = y[:, :1].reshape(x.shape[0], *extra) + jnp.sum(share * rise, axis=-1)
        return jnp.maximum(base + self.per_context * (ctx - live * self.context), 0.01 * base)

    def fixed_step_seconds(self, live: jax.Array, ctx: jax.Array) -> jax.Array:
        """f32 [T]: a step of each tier's fixed program (every node of every row), `ctx` cached tokens over the
        live rows."""
        return jnp.maximum(self.fixed + self.per_context * (ctx - live * self.context), 0.01 * self.fixed)

    @staticmethod
    def from_points(tiers, batch: int, points: list[list[tuple[int, float]]], per_context: float = 0.0,
                    context: float = 0.0, switch: float = 0.0, replan: int = 1, fixed=None) -> "CostModel":
        """From measured (tokens, seconds) points per tier (any number each: padded to one width by repeating the
        last point). Each curve is replaced by the closest non-decreasing one (least squares: measurement noise
        averaged out where it dips), as a step never gets cheaper with more tokens. fixed: seconds of each tier's
        fixed program (None: each curve at the tier's every node of `batch` rows)."""
        tiers = tuple(int(t) for t in tiers)
        if len(points) != len(tiers) or any(not p for p in points):
            raise ValueError(f"cost model: {len(tiers)} tiers need as many non-empty point lists, got {len(points)}")
        k = max(len(p) for p in points)
        tok, sec = np.zeros((len(tiers), k), np.float32), np.zeros((len(tiers), k), np.float32)
        for i, pts in enumerate(points):
            pts = sorted((float(m), float(s)) for m, s in pts)
            arr = np.array(pts + [pts[-1]] * (k - len(pts)), np.float64)
            # finite in float32, where the loop keeps them (1e300 would be inf there)
            if (not np.all(np.isfinite(arr)) or np.any(np.abs(arr) > FLOAT32_MAX) or np.any(arr[:, 1] <= 0)
                    or np.any(arr[:, 0] < 0)):
                raise ValueError(f"cost model: tier {tiers[i]} has a non-finite, negative or zero point (finite: in "
                                 f"float32, up to {FLOAT32_MAX:.3g}): {pts}")
            tok[i], sec[i] = arr[:, 0], _non_decreasing(arr[:, 1])
        if not all(np.isfinite(x) and 0 <= x <= FLOAT32_MAX for x in (per_context, context, switch)):
            raise ValueError(f"cost model: per_context {per_context}, context {context} and switch {switch} must be "
                             "finite (in float32) and >= 0")
        # at most what `choose_replan` gives: the serving engine's chunks are whole windows of replan steps (a file
        # saying 10**9 made every chunk a request's whole answer, and 2**31 overflowed the loop's int32 counter)
        if isinstance(replan, bool) or not isinstance(replan, (int, np.integer)) or not 1 <= replan <= REPLAN_MOST:
            raise ValueError(f"cost model: replan must be an integer in [1, {REPLAN_MOST}], got {replan!r}")
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"cost model: batch must be an integer >= 1, got {batch!r}")
        if fixed is None:  # each tier with every node of every row, on its curve
            fixed = np.array([np.interp(batch * (1.0 + t), tok[i], sec[i]) for i, t in enumerate(tiers)])
        fixed = np.asarray(fixed, np.float64)
        if (fixed.shape != (len(tiers),) or not np.all(np.isfinite(fixed)) or np.any(fixed > FLOAT32_MAX)
                or np.any(fixed <= 0)):
            raise ValueError(f"cost model: fixed must hold {len(tiers)} finite seconds > 0 (one per tier), got "
                             f"{fixed.tolist()}")
        return CostModel(tokens=jnp.asarray(tok), seconds=jnp.asarray(sec), per_context=jnp.float32(per_context),
                         context=jnp.float32(context), switch=jnp.float32(switch),
                         fixed=jnp.asarray(fixed, jnp.float32), tiers=tiers, batch=int(batch), replan=int(replan))

    def points(self) -> list[list[tuple[float, float]]]:
        tok, sec = np.asarray(self.tokens), np.asarray(self.seconds)
        return [[(float(m), float(s)) for m, s in zip(tok[i], sec[i])] for i in range(len(self.tiers))]


def _nodes(nodes) -> int:
    if isinstance(nodes, bool) or not isinstance(nodes, (int, np.integer)) or nodes < 0:
        raise ValueError(f"nodes per row must be an integer >= 0, got {nodes!r}")
    return int(nodes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BudgetPolicy:
    """How the auto method picks the nodes: from `cost` (choose), or forced to `force_nodes` nodes per row at tier
    index `force_tier` when that is >= 0, or at the first and the last tier in turn when it is -2 (calibration
    times the same compiled loop this way). Make one with `choosing`, then `forced` or `alternating`."""

    cost: CostModel
    force_tier: jax.Array  # int32 []  -1: choose; 0 .. T-1: that tier; -2: the first and the last in turn
    force_nodes: jax.Array  # int32 []

    @property
    def tiers(self) -> tuple[int, ...]:
        return self.cost.tiers

    @staticmethod
    def choosing(cost: CostModel) -> "BudgetPolicy":
        return BudgetPolicy(cost, jnp.int32(-1), jnp.int32(0))

    def forced(self, tier_index: int, nodes: int) -> "BudgetPolicy":
        """Forced to `nodes` nodes per row (at most the tier's) at tier index `tier_index` every step."""
        if not 0 <= tier_index < len(self.tiers):  # a tier no loop runs would never end the decoding loop
            raise ValueError(f"tier_index must be in [0, {len(self.tiers)}) for tiers {self.tiers}, got {tier_index}")
        return BudgetPolicy(self.planning_every_step(), jnp.int32(tier_index), jnp.int32(_nodes(nodes)))

    def alternating(self, nodes: int) -> "BudgetPolicy":
        """Forced to `nodes` nodes per row, the tier changing every step (first, last, first, ...)."""
        return BudgetPolicy(self.planning_every_step(), jnp.int32(-2), jnp.int32(_nodes(nodes)))

    def planning_every_step(self) -> CostModel:
        """The cost model with replan 1: a forced policy holds every step to its nodes, none runs a tier's fixed
        program between plans."""
        return dataclasses.replace(self.cost, replan=1)

    @property
    def replan(self) -> int:
        return self.cost.replan

    def choose(self, scores: jax.Array, visibility: jax.Array, live: jax.Array, context: jax.Array,
               current: int | None = None, depths: jax.Array | None = None,
               room: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(tier index int32 [], active bool [B, N+1]) for a tree of N nodes below the root: scores f32 [B, N+1] the
        nodes' log path probabilities (root first, non-increasing along every path), visibility bool [B, N+1, N+1]
        (ancestors), live bool [B] (rows still decoding: the others verify nothing), context int32 [B] (cached
        tokens), current: the tier index of the step before (static; None: none, no tier pays the switch). The
        active nodes of a row are prefix-closed and lie in the first tiers[tier] nodes. The choice maximizes
        expected tokens per second: with replan r > 1, over this step and the r - 1 steps of the tier's fixed
        program after it (each expected to gain what the tier's whole tree would now, at `CostModel.fixed`).
        depths int32 [B, N+1] (root 0) and room int32 [B] (tokens each row may still commit): a row commits at most
        room tokens, so its nodes deeper than room - 1 gain nothing (the expected tokens are E[min(A + 1, room)] for
        A accepted nodes) and are never chosen for their gain."""
        b, n1 = scores.shape
        n = n1 - 1
        tiers = self.tiers
        idx = jnp.arange(n)
        useful = live[:, None]
        if depths is not None and room is not None:
            useful = useful & (depths[:, 1:] < room[:, None])
        p = jnp.where(useful, jnp.exp(scores[:, 1:]), 0.0).reshape(-1)  # [B N]
        n_live = jnp.sum(live).astype(jnp.float32)
        ctx = jnp.sum(jnp.where(live, context, 0)).astype(jnp.float32)
        # one sort for every tier: a tier's m best nodes are its first m among all nodes by probability (ties:
        # row-major, so a parent before its child)
        order = jnp.argsort(-p, stable=True)
        col = jnp.broadcast_to(idx, (b, n)).reshape(-1)[order]  # each sorted node's index in its tree
        sizes = jnp.asarray(tiers, jnp.int32)
        inside = col[None, :] < sizes[:, None]  # [T, B N]
        zero = jnp.zeros((len(tiers), 1))
        count = jnp.concatenate([zero, jnp.cumsum(inside, axis=1)], axis=1)  # [T, B N + 1]: nodes of the first j
        gain = jnp.concatenate([zero, jnp.cumsum(jnp.where(inside, p[order], 0.0), axis=1)], axis=1)  # expected
        switch = np.array([0.0 if current in (None, t) else 1.0 for t in range(len(tiers))], np.float32)
        cost = self.cost.all_step_seconds(n_live + count, n_live, ctx) + switch[:, None] * self.cost.switch
        tokens = n_live + gain
        r = self.replan
        if r > 1:  # this step and the r - 1 steps of the tier's fixed program after it (every node): their rate
            cost = cost + (r - 1) * self.cost.fixed_step_seconds(n_live, ctx)[:, None]
            tokens = tokens + (r - 1) * (n_live + gain[:, -1:])
        ratio = jnp.where(count <= n_live * sizes[:, None], tokens / cost, -jnp.inf)
        best = jnp.argmax(ratio, axis=1)  # [T] the first j of each tier's best ratio
        tier = jnp.argmax(jnp.max(ratio, axis=1)).astype(jnp.int32)
        picked = (jnp.arange(b * n) < best[tier]) & inside[tier]  # in sorted order
        chosen = jnp.zeros((b * n,), bool).at[order].set(picked).reshape(b, n) & live[:, None]
        turn = len(tiers) - 1 if current == 0 else 0  # alternating: the tier the step before did not use
        f_tier = jnp.where(self.force_tier == -2, turn, jnp.maximum(self.force_tier, 0))
        forced = (idx[None, :] < self.force_nodes) & (idx[None, :] < sizes[f_tier]) & live[:, None]
        use_forced = self.force_tier != -1
        chosen = jnp.where(use_forced, forced, chosen)
        tier = jnp.where(use_forced, f_tier, tier).astype(jnp.int32)
        active = jnp.concatenate([live[:, None], chosen], axis=1)  # the root: every live row
        # prefix closure: a node is verified only with all its ancestors (float sums can break exact monotonicity)
        active &= ~jnp.any(visibility & ~active[:, None, :], axis=2)
        return tier, active


def node_scores(draft_logits: jax.Array, tokens: jax.Array, depths: jax.Array, visibility: jax.Array) -> jax.Array:
    """f32 [B, N+1]: each node's log path probability under the draft distributions draft_logits [B, L, V] (root 0),
    for the tree's tokens, depths [B, N+1] (root first) and ancestor mask visibility [B, N+1, N+1]."""
    x = jnp.nan_to_num(draft_logits.astype(jnp.float32), nan=-2.0**20, posinf=2.0**20, neginf=-2.0**20)
    logp = jax.nn.log_softmax(x, axis=-1)  # [B, L, V]
    d = jnp.clip(depths - 1, 0, x.shape[1] - 1)
    lp = jnp.take_along_axis(jnp.take_along_axis(logp, d[:, :, None], axis=1), tokens[:, :, None], axis=2)[..., 0]
    lp = jnp.where(depths > 0, lp, 0.0)  # [B, N+1]
    return jnp.einsum("bij,bj->bi", visibility.astype(jnp.float32), lp)
