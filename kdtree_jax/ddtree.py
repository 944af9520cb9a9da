"""DDTree speculative decoding (Ringel & Romano, arXiv:2604.12989) with the DFlash drafter: the methods "ddtree" and
"chain" as one `Speculative` method of the decoding driver (`kdtree_jax.decoding`), run in its jitted loop.

One step, a pure function of the loop state, in public stages (the benchmarks time each one):
  1. `propose`: the drafter reads the block [bonus, MASK, ...] and gives per-depth distributions q_1 .. q_L, put
     through the step's `Sampler` (the distribution the target samples from);
  2. `build`: `tree_build` keeps the `budget` prefixes with the largest summed log-probability (DDTree Algorithm 1);
     "chain" takes the drafter's argmax at each depth instead (DFlash's linear draft);
  3. `verify`: the target runs all budget + 1 nodes in one forward: node i at position prefix + depth(i), seeing the
     prefix and its ancestors; its latent KV is written into the cache right after the prefix; the Sampler chooses
     the target's token at each node;
  4. `accept`: `tree_accept` gives the longest root path the target agrees with, and the next bonus token;
  5. `keep`: the accepted nodes' latents are moved to contiguous slots, and their hidden states become drafter
     context.
Every committed token is the target's own choice given the committed prefix, so greedy decoding returns exactly
the autoregressive tokens, and sampling draws from the target's (filtered) distribution (docs/ddtree.md §4).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .budget_policy import BudgetPolicy, node_scores, reliability_counts
from .config import ModelConfig
from .decoding import Committed, DecodeState, Sampler, nonfinite_rows
from .drafter import DrafterProtocol
from . import validate
from .kernels import tree_accept, tree_build
from .model import KVCache, Params, StepOutput, move_accepted, prefill_last, step
from .sharding import replicated_call

TREES = ("chain", "ddtree")


class DraftTree(NamedTuple):
    tokens: jax.Array  # int32 [B, N]     node tokens, node 0 = the bonus (root)
    parents: jax.Array  # int32 [B, N]     parent index, -1 for the root; parents[i] < i
    depths: jax.Array  # int32 [B, N]     0 for the root
    visibility: jax.Array  # bool [B, N, N]  ancestors, self included


def chain_tree(draft_logits: jax.Array, bonus: jax.Array) -> DraftTree:
    """DFlash's linear draft: the argmax token at every depth, each node the child of the previous one."""
    b, depth, _ = draft_logits.shape
    toks = jnp.argmax(draft_logits, axis=-1).astype(jnp.int32)  # [B, L]
    n = depth + 1
    idx = jnp.arange(n, dtype=jnp.int32)
    return DraftTree(tokens=jnp.concatenate([bonus[:, None], toks], axis=1),
                     parents=jnp.broadcast_to(idx - 1, (b, n)), depths=jnp.broadcast_to(idx, (b, n)),
                     visibility=jnp.broadcast_to(idx[None, :] <= idx[:, None], (b, n, n)))


def ddtree_tree(draft_logits: jax.Array, bonus: jax.Array, budget: int, impl: str) -> DraftTree:
    """The DDTree draft tree of `budget` nodes below the bonus root (Algorithm 1, via `tree_build`)."""
    t = replicated_call(lambda dl: tree_build(dl, budget, impl=impl), draft_logits)
    b = bonus.shape[0]
    zero = jnp.zeros((b, 1), jnp.int32)
    return DraftTree(tokens=jnp.concatenate([bonus[:, None], t.tokens], axis=1),
                     parents=jnp.concatenate([zero - 1, t.parents], axis=1),
                     depths=jnp.concatenate([zero, t.depths], axis=1), visibility=t.visibility)


def verify(params: Params, cfg: ModelConfig, tree: DraftTree, cache: KVCache, key: jax.Array,
           sampler: Sampler) -> tuple[jax.Array, StepOutput]:
    """The target over every node of the tree in one forward after the committed prefix: (its token at every node
    int32 [B, N], chosen by the sampler; the forward's output, the nodes' latents written after the prefix)."""
    res = step(params, cfg, tree.tokens, cache, depths=tree.depths, tree_mask=tree.visibility)
    return sampler.choose(res.logits, key), res


def root_tree(bonus: jax.Array) -> DraftTree:
    """The tree of the bonus alone: a step that verifies it is an autoregressive step (nothing drafted)."""
    b = bonus.shape[0]
    return DraftTree(tokens=bonus[:, None].astype(jnp.int32), parents=jnp.full((b, 1), -1, jnp.int32),
                     depths=jnp.zeros((b, 1), jnp.int32), visibility=jnp.ones((b, 1, 1), bool))


def subtree(tree: DraftTree, n: int) -> DraftTree:
    """The first n nodes (root included) of a tree stored in build order: itself a tree (parents come first)."""
    return DraftTree(tree.tokens[:, :n], tree.parents[:, :n], tree.depths[:, :n], tree.visibility[:, :n, :n])


class Path(NamedTuple):
    nodes: jax.Array  # int32 [B, P]   accepted node indices, root first, padded with -1
    length: jax.Array  # int32 [B]     nodes on the path, root included (>= 1): the tokens committed
    tokens: jax.Array  # int32 [B, P]  the committed tokens: the path's tokens after the root, then the bonus


def accept(cfg: ModelConfig, tree: DraftTree, target: jax.Array, width: int) -> Path:
    """The longest root path whose every node's token is the target's choice at its parent (`tree_accept`), kept to
    `width` nodes (a path holds at most block_size nodes), and the tokens it commits."""
    acc = replicated_call(lambda *a: tree_accept(*a, impl=cfg.impl("tree_accept")), tree.tokens, tree.parents, target)
    n = tree.tokens.shape[1]
    nodes = acc.path[:, :width]  # [B, P]
    path_tokens = jnp.take_along_axis(tree.tokens, jnp.clip(nodes, 0, n - 1), axis=1)  # [B, P]
    col = jnp.arange(width)[None, :]
    tokens = jnp.where(col == acc.length[:, None] - 1, acc.bonus[:, None],
                       jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1))
    return Path(nodes=nodes, length=acc.length, tokens=tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Speculative:
    """The speculative methods as a `kdtree_jax.decoding.Method`: `name` "ddtree" (a tree of `budget` nodes below
    the bonus) or "chain" (the drafter's argmax path, `budget` = its depth), with any drafter of the
    `DrafterProtocol`. Make one with `speculative`, which checks the arguments."""

    drafter: DrafterProtocol
    name: str = dataclasses.field(metadata=dict(static=True))
    tree_nodes: int = dataclasses.field(metadata=dict(static=True))  # nodes below the root (auto: the most)
    policy: BudgetPolicy | None = None  # budget="auto": how many of the tree's nodes each step verifies

    @property
    def budget(self) -> int | str | None:
        if self.name != "ddtree":
            return None
        return "auto" if self.policy is not None else self.tree_nodes

    def with_policy(self, policy: BudgetPolicy | None) -> "Speculative":
        return dataclasses.replace(self, policy=policy)

    @property
    def tokens_per_step(self) -> int:
        return self.drafter.block_size

    @property
    def extra_slots(self) -> int:
        return self.tree_nodes + 1

    @property
    def max_nodes(self) -> int:
        return self.tree_nodes

    def start(self, params, cfg, tokens, lengths, cache, chunk):
        """The prefill, the drafter taking its context from every prefilled piece."""
        state = self.drafter.start(tokens.shape[0], cache.max_len)
        return prefill_last(params, cfg, tokens, lengths, cache, chunk, self.drafter.add_context, state)

    def propose(self, params: Params, cfg: ModelConfig, s: DecodeState, sampler: Sampler) -> jax.Array:
        """The drafter's per-depth logits [B, L, V] after the bonus, as the sampler filters them."""
        return sampler.logits(self.drafter.propose(params, cfg, s.draft, s.cache, s.last, s.key))

    def build(self, cfg: ModelConfig, draft_logits: jax.Array, bonus: jax.Array) -> DraftTree:
        if self.name == "chain":
            return chain_tree(draft_logits, bonus)
        return ddtree_tree(draft_logits, bonus, self.tree_nodes, cfg.impl("tree_build"))

    def keep(self, cfg: ModelConfig, res: StepOutput, draft: Any, starts: jax.Array,
             path: Path) -> tuple[KVCache, Any]:
        """The accepted nodes' latents moved next to the prefix (`model.move_accepted`), their hidden states to the
        drafter."""
        n = res.logits.shape[1]
        cache = move_accepted(res.cache, cfg, starts, path.nodes, n)
        hidden = jnp.take_along_axis(res.hidden, jnp.clip(path.nodes, 0, n - 1)[None, :, :, None], axis=2)  # [L,B,P,D]
        return cache, self.drafter.add_context(draft, hidden, starts)

    @property
    def phases(self) -> int:
        """Step programs in the loop: one per tier with a budget policy (auto), else 1."""
        return 1 if self.policy is None else len(self.policy.tiers)

    @property
    def replan(self) -> int:
        """Steps from one plan to the next (`CostModel.replan`; 1 without a policy): the steps between run the
        planned tier's fixed program (`fixed_plan`)."""
        return 1 if self.policy is None else self.policy.replan

    def choices(self, target: jax.Array, tree: DraftTree, s: DecodeState) -> jax.Array:
        """The target's token at every node [B, N] that accept walks: the sampler's choice `target` from the verify
        logits, as it is. A subclass may put other choices in its place (benchmarks/trace_replay.py replays
        recorded ones, so that random weights at full scale accept what a trained pair would)."""
        return target

    def fixed_plan(self, params, cfg: ModelConfig, s: DecodeState, sampler: Sampler, tier: int) -> DraftTree:
        """budget="auto", a step between plans: draft -> the tree at tier `tier`'s size, which the step verifies
        whole, unmasked: the fixed budget of that size (no scores, no choice, no mask). A tier of 0 nodes drafts
        nothing: its steps are autoregressive steps (the target's token after the bonus, the drafter's context kept)."""
        if self.policy.tiers[tier] == 0:
            return root_tree(s.last)
        with jax.named_scope("draft"):
            draft_logits = self.propose(params, cfg, s, sampler)
        with jax.named_scope("tree_build"):
            return ddtree_tree(draft_logits, s.last, self.policy.tiers[tier], cfg.impl("tree_build"))

    def plan(self, params, cfg: ModelConfig, s: DecodeState, sampler: Sampler,
             current: int | None = None) -> tuple[jax.Array, "_Plan"]:
        """budget="auto", before a step: draft -> build the largest tree -> choose the tier and the nodes to verify
        (`BudgetPolicy.choose`; `current`: the tier index of the step before, static, None at the loop's entry).
        Returns (tier index int32 [], the tree and its active nodes) for the decoding driver, which runs the step
        in that tier's program (`decoding.run_steps`)."""
        with jax.named_scope("draft"):
            draft_logits = self.propose(params, cfg, s, sampler)  # [B, L, V]
        with jax.named_scope("tree_build"):
            tree = self.build(cfg, draft_logits, s.last)
        with jax.named_scope("choose_budget"):
            scores = node_scores(draft_logits, tree.tokens, tree.depths, tree.visibility)
            room = s.out.shape[1] - s.num_out  # tokens each row may still commit (the engine offsets num_out)
            tier, active = self.policy.choose(scores, tree.visibility, ~s.done, s.cache.lengths, current,
                                              depths=tree.depths, room=room)
        return tier, _Plan(tree, active, scores)

    def step(self, params, cfg, s: DecodeState, key, sampler: Sampler, plan=None) -> Committed:
        """draft -> build -> verify -> accept -> keep, for every row. With a budget policy (auto), `plan` is
        (tier index, `_Plan`) from `plan` (the driver passes it; with one tier, the step makes it) and the step is
        verify -> accept -> keep of the plan's active nodes in that tier's program (`_step_auto`)."""
        if self.policy is not None:
            if plan is None and self.phases > 1:
                raise ValueError("budget='auto' steps of several tiers need their plan: run them in the decoding "
                                 "driver's loop (decoding.run_steps), which plans each step's tier")
            plan = (0, self.plan(params, cfg, s, sampler)[1]) if plan is None else plan
            if isinstance(plan[1], DraftTree):  # a step between plans (`fixed_plan`): the whole tree, unmasked
                return self._verify_tree(params, cfg, s, plan[1], key, sampler, padded=True)
            return self._step_auto(params, cfg, s, plan[0], plan[1], key, sampler)
        if self.tree_nodes == 0:  # the fixed program of an auto tier of 0 nodes (`no_draft`): nothing drafted
            return self._verify_tree(params, cfg, s, root_tree(s.last), key, sampler)
        with jax.named_scope("draft"):
            draft_logits = self.propose(params, cfg, s, sampler)  # [B, L, V]
        with jax.named_scope("tree_build"):
            tree = self.build(cfg, draft_logits, s.last)
        return self._verify_tree(params, cfg, s, tree, key, sampler)

    def _verify_tree(self, params, cfg: ModelConfig, s: DecodeState, tree: DraftTree, key, sampler: Sampler,
                     padded: bool = False) -> Committed:
        """verify -> accept -> keep of every node of `tree`; padded (auto's steps between plans): the accepted path
        padded to the drafter's block and the nodes counted, as `_step_auto` returns them."""
        with jax.named_scope("verify"):
            target, res = verify(params, cfg, tree, s.cache, key, sampler)  # [B, N]
            target = self.choices(target, tree, s)
        width = self.tokens_per_step
        with jax.named_scope("accept"):
            path = accept(cfg, tree, target, min(tree.tokens.shape[1], width))
        nodes = None
        if padded:
            path = _padded(path, width)
            nodes = jnp.full(path.length.shape, tree.tokens.shape[1] - 1, jnp.int32)
        with jax.named_scope("compact"):
            cache, draft = self.keep(cfg, res, s.draft, s.cache.lengths, path)
        return Committed(tokens=path.tokens, count=path.length, cache=cache, draft=draft,
                         nonfinite=nonfinite_rows(res.logits), nodes=nodes, logits=_path_logits(res.logits, path))

    def _step_auto(self, params, cfg: ModelConfig, s: DecodeState, tier: int, plan: "_Plan", key,
                   sampler: Sampler) -> Committed:
        """verify -> accept -> keep of the plan's active nodes among the first tiers[tier] of its tree: the step of a
        fixed budget of that size, with the inactive nodes routed to no expert (`model.step(active=)`) and never
        accepted (their tokens hidden from `tree_accept`); the accepted path is padded to the drafter's block, so
        every tier's step returns the same shapes."""
        n, width = self.policy.tiers[tier] + 1, self.tokens_per_step
        tree, active = subtree(plan.tree, n), plan.active[:, :n]
        with jax.named_scope("verify"):
            res = step(params, cfg, tree.tokens, s.cache, depths=tree.depths, tree_mask=tree.visibility, active=active)
            target = self.choices(sampler.choose(res.logits, key), tree, s)  # [B, N]
        root = jnp.arange(n)[None, :] == 0
        with jax.named_scope("accept"):
            path = accept(cfg, tree._replace(tokens=jnp.where(active | root, tree.tokens, -1)), target, min(n, width))
        accepted = jnp.any(path.nodes[:, :, None] == jnp.arange(n)[None, None, :], axis=1)  # [B, n]
        path = _padded(path, width)
        with jax.named_scope("compact"):
            cache, draft = self.keep(cfg, res, s.draft, s.cache.lengths, path)
        return Committed(tokens=path.tokens, count=path.length, cache=cache, draft=draft,
                         nonfinite=nonfinite_rows(res.logits, active),
                         nodes=jnp.sum(active[:, 1:], axis=1, dtype=jnp.int32),
                         reliability=reliability_counts(plan.scores[:, :n], active, accepted),
                         logits=_path_logits(res.logits, path))


def _path_logits(logits: jax.Array, path: Path) -> jax.Array:
    """The verify logits [B, N, V] at the accepted path's nodes [B, P, V]: committed token j is the target's choice
    at path node j (the tokens after the last accepted node, padding, read node 0's)."""
    n = logits.shape[1]
    return jnp.take_along_axis(logits, jnp.clip(path.nodes, 0, n - 1)[:, :, None], axis=1)


def _padded(path: Path, width: int) -> Path:
    """The path padded to `width` nodes (every auto step returns the same shapes, whatever its tier)."""
    pad = width - path.nodes.shape[1]
    return Path(nodes=jnp.pad(path.nodes, ((0, 0), (0, pad)), constant_values=-1), length=path.length,
                tokens=jnp.pad(path.tokens, ((0, 0), (0, pad))))


class _Plan(NamedTuple):
    """An auto step's plan (`Speculative.plan`): the tree at the largest budget and the nodes chosen to verify."""

    tree: DraftTree
    active: jax.Array  # bool [B, N+1]  prefix-closed per row, within the tier's first nodes; root: live rows
    scores: jax.Array  # f32 [B, N+1]   the nodes' log path probabilities under the draft (`node_scores`)


def speculative(cfg: ModelConfig, method: str, drafter, budget, policy: BudgetPolicy | None = None) -> Speculative:
    """The method "chain" or "ddtree" (with `budget` tree nodes) for target cfg, its arguments checked. With a
    `policy` (budget="auto", `kdtree_jax.budget`), `budget` is the largest tree and each step verifies a part."""
    if method not in TREES:
        raise ValueError(f"a speculative method is one of {TREES}, got {method!r}")
    if not isinstance(drafter, DrafterProtocol):
        raise ValueError(f"method={method!r} needs a drafter (kj.init_drafter, a loaded model's, or an OracleDrafter), "
                         f"got {type(drafter).__name__}")
    drafter.check(cfg)
    depth = drafter.depth
    if method == "chain":
        return Speculative(drafter, method, depth)
    if not validate.is_integer(budget) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1 (or 'auto' in generate and the serving engine), got "
                         f"{budget!r}")
    budget = int(budget)  # a numpy integer as a Python one (a static field of the method)
    if budget > depth * cfg.vocab_size:
        raise ValueError(f"budget {budget} exceeds the {depth} x {cfg.vocab_size} distinct (depth, token) choices")
    if policy is not None and policy.tiers[-1] != budget:
        raise ValueError(f"the budget policy's largest tier {policy.tiers[-1]} must be the budget {budget}")
    return Speculative(drafter, method, budget, policy)


def no_draft(cfg: ModelConfig, drafter) -> Speculative:
    """The fixed program of budget="auto"'s tier of 0 nodes: ddtree steps that draft nothing and verify the bonus
    alone (autoregressive steps that keep the drafter's context), for calibration to time."""
    drafter.check(cfg)
    return Speculative(drafter, "ddtree", 0)
