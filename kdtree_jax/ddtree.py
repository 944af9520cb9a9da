"""DDTree speculative decoding (Ringel & Romano, arXiv:2604.12989) with the DFlash drafter, in one jitted loop.

One step, a pure function of the loop state:
  1. the drafter reads the block [bonus, MASK, ...] and gives per-depth distributions q_1 .. q_L;
  2. `tree_build` keeps the `budget` prefixes with the largest summed log-probability (DDTree Algorithm 1);
     "chain" takes the drafter's argmax at each depth instead (DFlash's linear draft);
  3. the target verifies all budget + 1 nodes in one forward: node i at position prefix + depth(i), seeing the
     prefix and its ancestors; its latent KV is written into the cache right after the prefix;
  4. the target's token at each node (argmax, or a sample at temperature > 0) and `tree_accept` give the
     longest root path the target agrees with, and the next bonus token;
  5. the accepted nodes' latents are moved to contiguous slots, and their hidden states become drafter context.
Every committed token is the target's own choice given the committed prefix, so greedy decoding returns exactly
the autoregressive tokens, and sampling draws from the target's distribution (docs/ddtree.md §4).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .drafter import DrafterProtocol
from .decoding import choose, commit, finish, nonfinite_rows, prepare, run_compiled
from .kernels import tree_accept, tree_build
from .model import KVCache, Params, init_cache, prefill_last, pytree_dataclass, step
from .sharding import replicated_call


@pytree_dataclass
class SpecState:
    """The loop carry of speculative decoding."""

    cache: KVCache  # target latent cache; lengths[b] = committed tokens (the bonus is not in it yet)
    dcache: Any  # the drafter's state: the DFlash context keys/values of the committed slots (None: oracle)
    out: jax.Array  # int32 [B, N]   generated tokens; -1 beyond num_out
    num_out: jax.Array  # int32 [B]
    done: jax.Array  # bool [B]
    last: jax.Array  # int32 [B]      the bonus token: emitted, not yet verified into the cache
    key: jax.Array
    steps: jax.Array  # int32 []       verify steps run
    accepted: jax.Array  # int32 [B, L + 2] histogram: tokens accepted per step (bonus included)
    nonfinite: jax.Array  # bool [B]       the target gave this row a NaN or inf logit


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


def _take_rows(x: jax.Array, starts: jax.Array, n: int) -> jax.Array:
    """x [B, S, ...] -> [B, n, ...]: slots starts[b] .. starts[b] + n - 1 of each row."""
    return jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, n, axis=0))(x, starts)


def _put_rows(x: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    return jax.vmap(lambda r, u, s: jax.lax.dynamic_update_slice_in_dim(r, u, s, axis=0))(x, new, starts)


def compact(cache: KVCache, starts: jax.Array, path: jax.Array, n_nodes: int) -> KVCache:
    """Move the accepted nodes' latents (tree slots starts + path[b, j]) to slots starts + j, every layer.

    path [B, P] lists node indices in root-to-leaf order (padding -1: whatever lands past the accepted length
    is never read). Positions stay right: node path[j] has depth j and was roped at position starts + j.
    """
    idx = jnp.clip(path, 0, n_nodes - 1)  # [B, P]

    def move(c):  # c [B, S, C]
        tree = _take_rows(c, starts, n_nodes)  # [B, N, C]
        return _put_rows(c, jnp.take_along_axis(tree, idx[:, :, None], axis=1), starts)

    return dataclasses.replace(cache, latent=tuple(map(move, cache.latent)), k_pe=tuple(map(move, cache.k_pe)))


def spec_step(params: Params, cfg: ModelConfig, drafter: DrafterProtocol, s: SpecState, method: str, budget: int,
              temperature, eos_id, greedy: bool) -> SpecState:
    """One draft -> build -> verify -> accept -> compact step for every row (rows already done stay frozen)."""
    build_impl, accept_impl = cfg.impl("tree_build"), cfg.impl("tree_accept")
    lengths = s.cache.lengths
    bs = drafter.block_size
    with jax.named_scope("draft"):
        dlogits = drafter.propose(params, cfg, s.dcache, s.cache, s.last, s.key)  # [B, L, V]
    with jax.named_scope("tree_build"):
        if method == "chain":
            tree = chain_tree(dlogits, s.last)
        else:
            tree = ddtree_tree(dlogits, s.last, budget, build_impl)
    n = tree.tokens.shape[1]
    with jax.named_scope("verify"):
        res = step(params, cfg, tree.tokens, s.cache, depths=tree.depths, tree_mask=tree.visibility)
        key, sub = jax.random.split(s.key)
        target = choose(res.logits, sub, temperature, greedy)  # [B, N]
    with jax.named_scope("accept"):
        acc = replicated_call(lambda *a: tree_accept(*a, impl=accept_impl), tree.tokens, tree.parents, target)
        width = min(n, bs)  # a path holds at most L + 1 = block_size nodes, and at most N
        path = acc.path[:, :width]  # [B, P]
        path_tokens = jnp.take_along_axis(tree.tokens, jnp.clip(path, 0, n - 1), axis=1)  # [B, P]
        col = jnp.arange(width)[None, :]
        emitted = jnp.where(col == acc.length[:, None] - 1, acc.bonus[:, None],
                            jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1))
        active = ~s.done
        out, num_out, done, _ = commit(s.out, s.num_out, s.done, emitted, acc.length, eos_id, s.out.shape[1])
    with jax.named_scope("compact"):
        cache = compact(res.cache, lengths, path, n)
        hidden = jnp.take_along_axis(res.hidden, jnp.clip(path, 0, n - 1)[None, :, :, None], axis=2)  # [L, B, P, D]
        dcache = drafter.add_context(s.dcache, hidden, lengths)
        grow = jnp.where(active, acc.length, 0)
        cache = dataclasses.replace(cache, lengths=lengths + grow)
    accepted = s.accepted.at[jnp.arange(lengths.shape[0]), acc.length].add(active.astype(jnp.int32))
    return SpecState(cache=cache, dcache=dcache, out=out, num_out=num_out, done=done,
                     last=jnp.where(active, acc.bonus, s.last), key=key, steps=s.steps + 1, accepted=accepted,
                     nonfinite=s.nonfinite | (active & nonfinite_rows(res.logits)))


def _spec_start(params, cfg, drafter: DrafterProtocol, tokens, lengths, key, temperature, eos_id, *, cache_len: int,
                max_new: int, greedy: bool, chunk: int | None = None) -> SpecState:
    b = tokens.shape[0]
    block = drafter.block_size
    last_logits, cache, dcache = prefill_last(params, cfg, tokens, lengths, init_cache(cfg, b, cache_len), chunk,
                                              drafter.add_context, drafter.start(b, cache_len))  # context per piece
    key, sub = jax.random.split(key)
    first = choose(last_logits, sub, temperature, greedy)
    out = jnp.full((b, max_new), -1, jnp.int32)
    out, num_out, done, _ = commit(out, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), first[:, None],
                                    jnp.ones((b,), jnp.int32), eos_id, max_new)
    return SpecState(cache=cache, dcache=dcache, out=out, num_out=num_out, done=done, last=first, key=key,
                     steps=jnp.zeros((), jnp.int32), accepted=jnp.zeros((b, block + 1), jnp.int32),
                     nonfinite=nonfinite_rows(last_logits))


@partial(jax.jit, static_argnames=("cfg", "cache_len", "max_new", "greedy", "method", "budget", "chunk"))
def _spec_generate(params, cfg, drafter, tokens, lengths, key, temperature, eos_id, *, cache_len, max_new, greedy,
                   method, budget, chunk=None):
    state = _spec_start(params, cfg, drafter, tokens, lengths, key, temperature, eos_id, cache_len=cache_len,
                        max_new=max_new, greedy=greedy, chunk=chunk)

    def cond(s):
        return ~jnp.all(s.done)

    def body(s):
        return spec_step(params, cfg, drafter, s, method, budget, temperature, eos_id, greedy)

    return jax.lax.while_loop(cond, body, state)


def check_spec_args(cfg: ModelConfig, drafter, method: str, budget) -> int:
    """Validate the speculative arguments; returns the number of tree nodes per step (root included)."""
    if not isinstance(drafter, DrafterProtocol):
        raise ValueError(f"method={method!r} needs a drafter (kj.init_drafter, a loaded model's, or an OracleDrafter), "
                         f"got {type(drafter).__name__}")
    drafter.check(cfg)
    depth = drafter.depth
    if method == "chain":
        return depth + 1
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
    if budget > depth * cfg.vocab_size:
        raise ValueError(f"budget {budget} exceeds the {depth} x {cfg.vocab_size} distinct (depth, token) choices")
    return budget + 1


def generate_speculative(params, cfg: ModelConfig, prompts, *, max_new_tokens: int, method: str, drafter,
                         budget: int, temperature: float, seed: int, eos_id, prefill_chunk=None):
    """`generate(method="ddtree" | "chain")`: see kdtree_jax.generate.generate."""
    n_nodes = check_spec_args(cfg, drafter, method, budget)
    req = prepare(cfg, prompts, max_new_tokens, temperature, eos_id, extra_slots=n_nodes, prefill_chunk=prefill_chunk)
    args = (params, cfg, drafter, jnp.asarray(req.tokens), jnp.asarray(req.lengths), jax.random.key(seed),
            jnp.float32(req.temperature or 1.0), jnp.int32(req.eos_id))
    static = dict(cache_len=req.cache_len, max_new=req.max_new, greedy=req.temperature == 0, method=method,
                  budget=n_nodes - 1, chunk=req.chunk)
    state, timing = run_compiled(_spec_generate, args, static)
    return finish(state, timing, method=method, budget=n_nodes - 1)
