"""The decoding engine: request checks and layout, the `Sampler`, committing tokens, the loop state, the methods'
protocol and the one `lax.while_loop` driver that runs every method, compile-and-run with timing, and the result.

A method implements `Method`: `start` fills the cache with the prompts (and makes the method's own state), `step`
runs one target forward and returns what it commits (`Committed`). `AR` (one token per step) lives here; the
speculative methods "chain" and "ddtree" are `kdtree_jax.ddtree.Speculative`. The driver keeps the books the same
way for every method (commit, EOS, the histogram, non-finite logits), in one carry, `DecodeState`:

    state = start(method, params, cfg, tokens, lengths, key, eos_id, sampler=..., cache_len=..., max_new=...)
    state = advance(method, params, cfg, state, until, sampler=...)   # state donated; run until `until` steps
    state = run(method, params, cfg, tokens, lengths, key, eos_id, ...)  # both, compiled as one function

`generate` calls `run` once; `stream` calls `advance` a few steps at a time and shows the tokens in between.
"""

from __future__ import annotations

import dataclasses
import os
import time
from functools import partial
from typing import Any, Callable, Iterator, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import validate
from .budget_policy import RELIABILITY_BINS
from .config import ModelConfig
from .distributed import to_host
from .model import KVCache, Params, init_cache, prefill_last, step
from .sharding import trace_context


@dataclasses.dataclass
class GenerateOutput:
    """tokens: per prompt, the generated ids (ending with EOS when one was produced).
    stats: steps (target forwards after prefill), tau (tokens committed per step, bonus included),
    tau_histogram, compile_s, wall_s, tokens_per_s, method, budget."""

    tokens: list[list[int]]
    stats: dict[str, Any]


def nonfinite_rows(logits: jax.Array, where: jax.Array | None = None) -> jax.Array:
    """bool [B]: rows of logits [B, ..., V] holding a NaN or an inf (one cheap reduction next to the vocab matmul);
    with `where` bool [B, ...], only the positions it marks count."""
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1)
    if where is not None:
        bad &= where
    return jnp.any(bad.reshape(bad.shape[0], -1), axis=-1)


# --------------------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Sampler:
    """How a token is chosen from logits: greedy (argmax) when temperature is 0, else a draw from the filtered
    distribution `logits` defines. Static (hashable, compiled into the loop: another setting compiles again).

    The speculative methods use the same Sampler on both sides: the target's token at every tree node is
    `choose`, and the drafter's logits go through `logits` before the tree is built, so the tree is made for the
    distribution the target samples from. A new option is a field here and a line in `logits`.
    """

    temperature: float = 0.0  # 0: greedy; > 0: sample from softmax(logits / temperature)
    top_k: int | None = None  # keep the top_k most likely tokens (and any tied with the k-th); None: all
    top_p: float | None = None  # then keep the most likely tokens until they hold top_p of the mass; None or 1: all

    def __post_init__(self):  # the rules of kdtree_jax.validate, shared with the server and the command line
        object.__setattr__(self, "temperature", validate.temperature(self.temperature))
        object.__setattr__(self, "top_k", validate.top_k(self.top_k))
        object.__setattr__(self, "top_p", validate.top_p(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def logits(self, logits: jax.Array) -> jax.Array:
        """The log-probabilities (unnormalized, f32) of the distribution sampled from logits [..., V]: divided by the
        temperature, then -inf outside the top_k tokens, then -inf past the nucleus (the smallest set of most likely
        tokens whose probability reaches top_p; every token tied with its least likely one kept). Greedy: as is."""
        if self.greedy:
            return logits
        x = logits.astype(jnp.float32)
        # the largest logit made 0 first: divided by a temperature near float32's smallest normal number, logits of a
        # few units would overflow to inf, and the draw would take the first of them, not the most likely token
        x = (x - jnp.max(x, axis=-1, keepdims=True)) / self.temperature
        if self.top_k is not None and self.top_k < x.shape[-1]:
            kth = jax.lax.top_k(x, self.top_k)[0][..., -1:]
            x = jnp.where(x >= kth, x, -jnp.inf)
        if self.top_p is not None:
            desc = jnp.flip(jnp.sort(x, axis=-1), axis=-1)
            p = jax.nn.softmax(desc, axis=-1)
            before = jnp.concatenate([jnp.zeros_like(p[..., :1]), jnp.cumsum(p, axis=-1)[..., :-1]], axis=-1)
            keep = jnp.sum(before < self.top_p, axis=-1, keepdims=True)  # the nucleus' size (>= 1)
            x = jnp.where(x >= jnp.take_along_axis(desc, keep - 1, axis=-1), x, -jnp.inf)
        return x

    def choose(self, logits: jax.Array, key: jax.Array | None) -> jax.Array:
        """The token for logits [..., V]: int32 [...], the argmax when greedy, else a draw with `key`."""
        if self.greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, self.logits(logits), axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------------


def commit(out, num_out, done, new, n_new, eos_id, max_new):
    """Append new [B, K] (n_new[b] valid) to out [B, N] for rows not done; stop rows at EOS or N tokens.

    Returns (out, num_out, done, committed [B]) where committed counts tokens kept (cut at EOS and at N).
    """
    b, k = new.shape
    idx = jnp.arange(k)[None, :]
    valid = (idx < n_new[:, None]) & ~done[:, None]
    is_eos = valid & (new == eos_id)
    first_eos = jnp.min(jnp.where(is_eos, idx, k), axis=1)  # [B]
    valid &= idx <= first_eos[:, None]
    valid &= (num_out[:, None] + idx) < max_new
    slots = jnp.where(valid, num_out[:, None] + idx, out.shape[1])  # out of range -> dropped
    out = out.at[jnp.arange(b)[:, None], slots].set(new, mode="drop")
    committed = jnp.sum(valid, axis=1).astype(jnp.int32)
    num_out = num_out + committed
    done = done | (first_eos < k) | (num_out >= max_new)
    return out, num_out, done, committed


def _next_pow2(n: int, floor: int = 8) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


PREFILL_CHUNK = 1024  # prompts padded past 2 x this go into the cache in chunks of this many tokens


def _prefill_chunk(prefill_chunk, t_pad: int) -> int | None:
    """The chunk size for a padded prompt length (None: one pass). prefill_chunk: None (automatic), 0 (always one
    pass) or a power of two >= 16."""
    if prefill_chunk is None:
        return PREFILL_CHUNK if t_pad > 2 * PREFILL_CHUNK else None
    if (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 0
            or prefill_chunk and (prefill_chunk < 16 or prefill_chunk & (prefill_chunk - 1))):
        raise ValueError(f"prefill_chunk must be None, 0 or a power of two >= 16, got {prefill_chunk!r}")
    return int(prefill_chunk) if 0 < prefill_chunk < t_pad else None


@dataclasses.dataclass(frozen=True)
class Request:
    """Validated, padded inputs of one generate call."""

    tokens: np.ndarray  # int32 [B, T_pad] right-padded prompts
    lengths: np.ndarray  # int32 [B]
    max_new: int
    cache_len: int
    sampler: Sampler
    eos_id: int  # -1: none
    chunk: int | None = None  # prefill in chunks of this many tokens (None: one pass)


def prepare(cfg: ModelConfig, prompts, max_new_tokens: int, sampler: Sampler = Sampler(), eos_id: int | None = None,
            extra_slots: int = 0, prefill_chunk: int | None = None) -> Request:
    """Check the inputs and lay them out; every error is a ValueError/TypeError naming the problem.

    `extra_slots` is the room the method needs past the last token (the speculative tree's nodes).
    """
    rows = validate.token_rows(prompts, cfg.vocab_size)
    max_new_tokens = validate.integer("max_new_tokens", max_new_tokens, 1, validate.INT32_LIMIT)
    if not isinstance(sampler, Sampler):
        raise TypeError(f"sampler must be a kdtree_jax.decoding.Sampler, got {type(sampler).__name__}")
    eos_id = validate.token_id("eos_id", eos_id, cfg.vocab_size, optional=True)
    longest = max(len(r) for r in rows)
    need = longest + int(max_new_tokens) + extra_slots
    if need > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens}"
            + (f" + {extra_slots} speculative slots" if extra_slots else "")
            + f" = {need} exceeds the context of {cfg.max_position_embeddings} positions")
    t_pad = _next_pow2(longest)
    tokens = np.zeros((len(rows), t_pad), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    return Request(tokens=tokens, lengths=np.array([len(r) for r in rows], np.int32), max_new=int(max_new_tokens),
                   cache_len=_round_up(max(t_pad, need), 64), sampler=sampler,
                   eos_id=-1 if eos_id is None else int(eos_id), chunk=_prefill_chunk(prefill_chunk, t_pad))


# --------------------------------------------------------------------------------------------------------------
# The loop state, the methods' protocol, AR
# --------------------------------------------------------------------------------------------------------------


@struct.dataclass
class DecodeState:
    """The carry of the decoding loop, the same for every method (one row per prompt or slot)."""

    cache: KVCache  # the target's latent cache; lengths[b] = committed tokens of row b (the bonus not yet in it)
    draft: Any  # the method's own state: the drafter's context cache (None for ar and the oracle drafter)
    out: jax.Array  # int32 [B, N]      generated tokens; -1 beyond num_out
    num_out: jax.Array  # int32 [B]     tokens generated so far
    done: jax.Array  # bool [B]         row finished (EOS or N tokens)
    last: jax.Array  # int32 [B]        the bonus: the newest token, emitted, not yet in the cache
    key: jax.Array  # PRNG key
    eos_id: jax.Array  # int32 []       a row stops after this token (-1: none); [B, 1]: one per row (the serve engine)
    steps: jax.Array  # int32 []        steps run (target forwards after the prefill)
    accepted: jax.Array  # int32 [B, K + 1]  histogram: steps of row b that committed i tokens (K: most per step)
    nonfinite: jax.Array  # bool [B]    the target gave this row a NaN or inf logit (an error, not token 0)
    nodes: jax.Array  # int32 [B, N + 1]   histogram: steps of row b that verified i draft nodes (N: the method's most)
    reliability: jax.Array  # f32 [B, 2, K]  budget="auto": per bin of path probability, the drafter's predicted and
    # the target's accepted nodes of row b so far (`budget_policy.reliability_counts`); zeros for other methods


class Committed(NamedTuple):
    """What one step of a method commits for every row (the driver freezes the rows already done)."""

    tokens: jax.Array  # int32 [B, K]  the committed tokens in order; the last valid one is the next bonus
    count: jax.Array  # int32 [B]      valid tokens in `tokens` (>= 1); the cache grows by as many
    cache: KVCache  # the target's cache holding the committed tokens' latents after the prefix (lengths unchanged)
    draft: Any  # the method's new state
    nonfinite: jax.Array  # bool [B]   the target's logits of the row held a NaN or an inf
    nodes: jax.Array | None = None  # int32 [B]  draft nodes the target verified for the row (None: all of them)
    reliability: jax.Array | None = None  # f32 [B, 2, K]  this step's `reliability_counts` (None: none)
    logits: jax.Array | None = None  # f32 [B, K, V]  the target's logits that tokens[:, j] was chosen from (the
    # serving engine's log-probabilities; unused by the driver, so compiled away where nothing reads them)


class Method(Protocol):
    """A decoding method, run by the driver (`start`, `advance`, `run`). An implementation is a pytree (the drafter's
    weights as leaves, the rest static)."""

    name: str  # "ar", "chain", "ddtree": the stats' method
    budget: int | None  # the stats' budget (ddtree's node budget; None for ar and chain)
    tokens_per_step: int  # the most tokens one step commits
    extra_slots: int  # cache slots needed beyond the prompt and max_new tokens (the speculative tree's nodes)
    max_nodes: int  # the most draft nodes one step verifies per row (0 for ar)
    phases: int  # step programs (1; budget="auto": one per tier, `plan` picks the next step's, see `run_steps`)

    def start(self, params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
              chunk: int | None) -> tuple[jax.Array, KVCache, Any]:
        """Prefill the right-padded prompts tokens [B, T] into the empty cache: (the next-token logits [B, V], the
        cache, the method's state)."""

    def step(self, params: Params, cfg: ModelConfig, state: DecodeState, key: jax.Array,
             sampler: Sampler) -> Committed:
        """One step for every row: one target forward from the committed prefix and the bonus `state.last`. A
        method of several phases takes a sixth argument, the step's plan (phase as a Python int, data)."""

    # A method of several phases also has plan(params, cfg, state, sampler, phase) -> (phase int32 [], data): the
    # next step's phase and data from the state and the phase of the step before (None at a call's entry).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AR:
    """Autoregressive decoding: one target forward and one token per step."""

    name = "ar"
    budget = None
    tokens_per_step = 1
    extra_slots = 0
    max_nodes = 0
    phases = 1

    def start(self, params, cfg, tokens, lengths, cache, chunk):
        return prefill_last(params, cfg, tokens, lengths, cache, chunk)

    def step(self, params, cfg, state: DecodeState, key, sampler: Sampler) -> Committed:
        res = step(params, cfg, state.last[:, None], state.cache)
        nxt = sampler.choose(res.logits[:, 0], key)
        return Committed(tokens=nxt[:, None], count=jnp.ones_like(nxt), cache=res.cache, draft=state.draft,
                         nonfinite=nonfinite_rows(res.logits), logits=res.logits)


# --------------------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------------------


def initial_state(method: Method, params, cfg: ModelConfig, tokens, lengths, key, eos_id, *, sampler: Sampler,
                  cache_len: int, max_new: int, chunk: int | None = None) -> DecodeState:
    """The loop state after the prefill: the prompts tokens [B, T] (right-padded; lengths [B]) in a cache of
    `cache_len` slots (prefilled in pieces of `chunk` tokens, or in one pass), the first token chosen and committed,
    room for `max_new` tokens per row, eos_id (int32 []; -1: none) kept in the state. Traceable; `start` is its
    compiled form."""
    b = tokens.shape[0]
    last_logits, cache, draft = method.start(params, cfg, tokens, lengths, init_cache(cfg, b, cache_len), chunk)
    key, sub = jax.random.split(key)
    first = sampler.choose(last_logits, sub)
    out = jnp.full((b, max_new), -1, jnp.int32)
    out, num_out, done, _ = commit(out, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), first[:, None],
                                    jnp.ones((b,), jnp.int32), eos_id, max_new)
    return DecodeState(cache=cache, draft=draft, out=out, num_out=num_out, done=done, last=first, key=key,
                       eos_id=jnp.asarray(eos_id, jnp.int32), steps=jnp.zeros((), jnp.int32),
                       accepted=jnp.zeros((b, method.tokens_per_step + 1), jnp.int32),
                       nonfinite=nonfinite_rows(last_logits), nodes=jnp.zeros((b, method.max_nodes + 1), jnp.int32),
                       reliability=no_reliability(b))


def no_reliability(batch: int) -> jax.Array:
    """DecodeState.reliability before any step: nothing predicted, nothing accepted."""
    return jnp.zeros((batch, 2, RELIABILITY_BINS), jnp.float32)


def loop_step(method: Method, params, cfg: ModelConfig, s: DecodeState, sampler: Sampler, plan=None) -> DecodeState:
    """One iteration of the loop: the method's step, and the books kept alike for every method: commit (EOS, N
    tokens), the cache's lengths, the bonus, the histogram, non-finite logits. plan: (phase, data) for a method of
    several phases (`run_steps`), None otherwise."""
    key, sub = jax.random.split(s.key)
    c = method.step(params, cfg, s, sub, sampler) if plan is None else method.step(params, cfg, s, sub, sampler, plan)
    active = ~s.done
    out, num_out, done, _ = commit(s.out, s.num_out, s.done, c.tokens, c.count, s.eos_id, s.out.shape[1])
    bonus = jnp.take_along_axis(c.tokens, (c.count - 1)[:, None], axis=1)[:, 0]
    rows = jnp.arange(s.last.shape[0])
    nodes = jnp.full_like(c.count, method.max_nodes) if c.nodes is None else c.nodes
    return DecodeState(cache=dataclasses.replace(c.cache, lengths=s.cache.lengths + jnp.where(active, c.count, 0)),
                       draft=c.draft, out=out, num_out=num_out, done=done, last=jnp.where(active, bonus, s.last),
                       key=key, eos_id=s.eos_id, steps=s.steps + 1,
                       accepted=s.accepted.at[rows, c.count].add(active.astype(jnp.int32)),
                       nonfinite=s.nonfinite | (active & c.nonfinite),
                       nodes=s.nodes.at[rows, nodes].add(active.astype(jnp.int32)),
                       reliability=s.reliability if c.reliability is None else
                       s.reliability + jnp.where(active[:, None, None], c.reliability, 0.0))


def run_steps(method: Method, params, cfg: ModelConfig, state: DecodeState, until, sampler) -> DecodeState:
    """The loop from `state` until `until` steps (int32, counted from the start) have run or every row is done
    (traceable; `advance` is its compiled form, with the state donated). `sampler`: a `Sampler`, or any object with
    its `logits` and `choose` (the server's per-row sampler).

    A method of several phases (budget="auto": one verify program per tier) gives each step's phase and data from
    the state before it and the phase of the step before (`method.plan(params, cfg, state, sampler, phase)` ->
    (phase int32 [], data); phase None at the loop's entry). Its loop is one while loop per phase, each running
    while its phase is planned, inside a loop over the phases in turn. The phase is read where every while loop
    reads its condition anyway, so a step costs what its phase's own loop costs; a `lax.switch` per step (the host
    waits for the index, then launches the branch) cost a host round trip per step on full-scale K2.6 (measured:
    docs/budget.md). A change of phase costs up to `phases` + 1 empty loop conditions. A method with `replan` > 1
    plans only every replan-th step: after a planned step, its phase's loop runs up to replan - 1 steps with
    `method.fixed_plan(params, cfg, state, sampler, phase)` as their data (an inner while loop), then plans.
    With $KDTREE_JAX_AUTO_LOOP=switch (`auto_loop`) the phases are one while loop and a `lax.switch` per window.
    Each call plans one step more than it runs (the plan after its last step, at the end of that step), and its first step is planned
    without a phase before it: a run cut into calls (`stream`, the server's chunks) drafts a little more, and with
    a switch term in the cost model may choose other tiers at the cuts than one call would.
    """
    go = lambda s: (s.steps < until) & ~jnp.all(s.done)
    phases, replan = getattr(method, "phases", 1), getattr(method, "replan", 1)
    if phases == 1 and replan == 1:
        return jax.lax.while_loop(go, lambda s: loop_step(method, params, cfg, s, sampler), state)

    def between(t: int, s: DecodeState) -> DecodeState:
        """Up to replan - 1 steps of phase t's fixed program (`method.fixed_plan`: no plan) after a planned step."""
        def body(q):
            s, i = q
            fixed = method.fixed_plan(params, cfg, s, sampler, t)
            return loop_step(method, params, cfg, s, sampler, plan=(t, fixed)), i + 1

        return jax.lax.while_loop(lambda q: go(q[0]) & (q[1] < replan - 1), body, (s, jnp.int32(0)))[0]

    def window(t: int, s: DecodeState, data):
        """Phase t's planned step, the steps between plans, then the next plan: (state, phase, data)."""
        s = loop_step(method, params, cfg, s, sampler, plan=(t, data))
        s = between(t, s) if replan > 1 else s
        return (s, *method.plan(params, cfg, s, sampler, t))

    def phase_loop(t: int, c):
        return jax.lax.while_loop(lambda c: go(c[0]) & (c[1] == t), lambda c: window(t, c[0], c[2]), c)

    def sweep(c):
        for t in range(phases):
            c = phase_loop(t, c)
        return c

    first = (state, *method.plan(params, cfg, state, sampler, None))
    if auto_loop() == "switch":  # one while loop, each window's tier a lax.switch (see `auto_loop`)
        branches = [partial(window, t) for t in range(phases)]
        return jax.lax.while_loop(lambda c: go(c[0]), lambda c: jax.lax.switch(c[1], branches, c[0], c[2]),
                                  first)[0]
    return jax.lax.while_loop(lambda c: go(c[0]), sweep, first)[0]


AUTO_LOOPS = ("phases", "switch")


def auto_loop() -> str:
    """How `run_steps` dispatches the steps of a method of several phases, read when the loop is traced from
    $KDTREE_JAX_AUTO_LOOP: "phases" (default) one while loop per phase inside a loop over the phases, the phase read
    where the loops read their conditions; "switch" (an experiment) one while loop whose body is a `lax.switch`
    over the phases, one window (planned step and the steps between plans) per iteration. On a GPU XLA runs a
    switch by reading its index on the host unless conditionals are captured in CUDA graphs (XLA_FLAGS
    --xla_gpu_enable_command_buffer with CONDITIONAL and WHILE), which is what this option is there to measure.
    Programs already traced keep their loop: a change in one process needs `clear_compiled()` and
    `jax.clear_caches()`."""
    chosen = os.environ.get("KDTREE_JAX_AUTO_LOOP", "phases")
    if chosen not in AUTO_LOOPS:
        raise ValueError(f"KDTREE_JAX_AUTO_LOOP must be one of {AUTO_LOOPS}, got {chosen!r}")
    return chosen


start = jax.jit(initial_state, static_argnames=("cfg", "sampler", "cache_len", "max_new", "chunk"))


@partial(jax.jit, static_argnames=("cfg", "sampler"), donate_argnames=("state",))
def advance(method: Method, params, cfg: ModelConfig, state: DecodeState, until, *, sampler: Sampler) -> DecodeState:
    """Run the loop from `state` (donated) until `until` steps (int32, counted from the start) have run or every
    row is done, and return the new state: resumable, a few steps at a time."""
    return run_steps(method, params, cfg, state, until, sampler)


@partial(jax.jit, static_argnames=("cfg", "sampler", "cache_len", "max_new", "chunk"))
def run(method: Method, params, cfg: ModelConfig, tokens, lengths, key, eos_id, *, sampler: Sampler, cache_len: int,
        max_new: int, chunk: int | None = None) -> DecodeState:
    """`start`, then the loop until every row is done, compiled as one function (no host round trip)."""
    state = initial_state(method, params, cfg, tokens, lengths, key, eos_id, sampler=sampler, cache_len=cache_len,
                   max_new=max_new, chunk=chunk)
    return run_steps(method, params, cfg, state, jnp.int32(max_new), sampler)  # every step commits >= 1 token per row


def stream_tokens(state: DecodeState, resume: Callable[[DecodeState, jax.Array], DecodeState],
                every: int) -> Iterator[list[int]]:
    """Yield row 0's new tokens as the loop runs: resume(state, until) continues it (`advance`) `every` steps at a
    time. Returns the final state (the generator's return value)."""
    shown = 0
    while True:
        check_finite(state)
        n = int(to_host(state.num_out)[0])
        if n > shown:
            yield to_host(state.out)[0, shown:n].tolist()
            shown = n
        if bool(to_host(state.done)[0]):
            return state
        # the steps to run to, at most int32's largest (steps + every would wrap to a negative bound: no step run)
        state = resume(state, jnp.minimum(state.steps, validate.INT32_LIMIT - 1 - every) + every)


# --------------------------------------------------------------------------------------------------------------
# Compile, run, read the result
# --------------------------------------------------------------------------------------------------------------


_COMPILED: dict = {}  # compiled executables by function, argument shapes and static arguments; least recently used first
COMPILED_KEPT = 32  # executables `run_compiled` keeps: each holds memory and memory mappings (Linux allows a process
# 65,530 of those; a process that compiles program after program, a sweep in a notebook, would otherwise reach it)


def clear_compiled() -> None:
    """Drops the executables `run_compiled` keeps (with `jax.clear_caches()`, everything compiled so far is freed)."""
    _COMPILED.clear()


def run_compiled(fn, args: tuple, static: dict):
    """Compile fn for these argument shapes (cached: the COMPILED_KEPT most recently used), then run it; returns
    (result, {compile_s, wall_s})."""
    flat, tree = jax.tree.flatten((args, static), is_leaf=lambda x: isinstance(x, ModelConfig))
    sig = (fn, tree, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) if hasattr(x, "shape") else x
                           for x in flat))
    t0 = time.perf_counter()
    compiled = _COMPILED.pop(sig, None)
    if compiled is None:
        cfg = next(a for a in args if isinstance(a, ModelConfig))
        with trace_context(args, cfg):
            compiled = fn.lower(*args, **static).compile()
    _COMPILED[sig] = compiled  # now the most recently used
    while len(_COMPILED) > COMPILED_KEPT:
        _COMPILED.pop(next(iter(_COMPILED)))
    t1 = time.perf_counter()
    dyn = tuple(a for a in args if not isinstance(a, ModelConfig))
    result = jax.block_until_ready(compiled(*dyn))
    t2 = time.perf_counter()
    return result, {"compile_s": t1 - t0, "wall_s": t2 - t1}


def check_finite(state: DecodeState) -> None:
    """Raise FloatingPointError naming the rows for which the model produced NaN or inf logits."""
    bad = np.flatnonzero(to_host(state.nonfinite))
    if bad.size:
        raise FloatingPointError(f"the model produced NaN or inf logits for prompt(s) {bad.tolist()} (non-finite "
                                 "weights or an overflow in the activations); no tokens are returned")


def _histogram(counts: np.ndarray) -> tuple[float, list[int]]:
    """(mean, the histogram cut after its last non-zero bin) of counts [B, K] summed over rows."""
    hist = counts.sum(axis=0)
    total = int(hist.sum())
    mean = float((hist * np.arange(len(hist))).sum() / total) if total else 0.0
    last = int(np.nonzero(hist)[0].max()) + 1 if hist.any() else 1
    return mean, hist[:last].tolist()


def step_stats(state: DecodeState) -> dict:
    """steps, tau (tokens committed per row and step, the bonus included) and tau_histogram of a loop state; nodes
    (draft nodes verified per row and step) and nodes_histogram (for budget="auto": how often each budget was
    chosen); draft_reliability (budget="auto", planned steps: per bin k of path probability, 2^-(k+1) < p <= 2^-k,
    the acceptances the drafter predicted and the nodes the target accepted; zeros for other methods)."""
    tau, tau_hist = _histogram(to_host(state.accepted))
    nodes, nodes_hist = _histogram(to_host(state.nodes))
    rel = to_host(state.reliability).sum(axis=0)
    return {"steps": int(to_host(state.steps)), "tau": tau, "tau_histogram": tau_hist, "nodes": nodes,
            "nodes_histogram": nodes_hist,
            "draft_reliability": {"predicted": [round(float(v), 4) for v in rel[0]],
                                  "accepted": [round(float(v), 4) for v in rel[1]]}}


def finish(state: DecodeState, timing: dict, method: str, budget: int | None) -> GenerateOutput:
    """Host-side result: per-row token lists and the stats (FloatingPointError if logits were not finite).

    The stats have the same keys for every method: steps, tau, tau_histogram, compile_s (tracing and compilation),
    wall_s (the compiled run alone), method, budget, new_tokens (all rows) and tokens_per_s = new_tokens / wall_s.
    """
    check_finite(state)
    out, num = to_host(state.out), to_host(state.num_out)  # replicated: readable on every process
    tokens = [out[i, :num[i]].tolist() for i in range(out.shape[0])]
    stats = step_stats(state)
    total = int(num.sum())
    stats.update(timing, method=method, budget=budget, new_tokens=total,
                 tokens_per_s=total / timing["wall_s"] if timing["wall_s"] > 0 else float("nan"))
    return GenerateOutput(tokens=tokens, stats=stats)
