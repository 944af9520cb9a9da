"""Continuous batching: requests join and leave the fixed slots of one decoding batch (rows of the KV cache) while the
other rows keep decoding.

A background thread owns the device state: the decoding driver's loop carry (`decoding.DecodeState`, the drafter's
state included) over `max_batch` rows of `max_context` cache slots, for one `decoding.Method` (`AR` or
`ddtree.speculative`'s chain or ddtree). Each iteration it
  1. frees the slots of cancelled requests (finished ones are freed as soon as their last tokens are read),
  2. prefills the waiting requests into free slots, those of one padded prompt length together (`_admit`: the
     driver's `initial_state` for their rows, every field written into the batch at the slots, traced indices; the
     count of rows padded to a power of two, at most max_batch, with rows that are dropped: one compilation per
     padded prompt length and power of two), so that a burst of requests costs about one prefill,
  3. runs `chunk_steps` decoding steps of every live row inside one jitted call (`_advance`: the driver's
     `run_steps`; the rows of free slots are marked done and stay frozen), and
  4. hands each request the tokens it committed (its `on_event` callback, called on the engine thread).
Calls are dispatched asynchronously: the first token of a new request is read while the chunk after its prefill runs.

Prefix reuse (`prefix_cache_bytes` > 0): after a prompt is prefilled, its rows of the latent cache (and of the
drafter's context cache) are copied into a `PrefixCache`; a later prompt that begins with the same tokens as a kept
one (at least PREFIX_MIN_TOKENS of them) gets those rows copied into its slot and only the rest of its prompt run
through the target (`_resume`: cached forwards after the copied rows, the drafter taking its context from them),
instead of the whole prompt. A token's latent depends on the tokens before it alone, so the rows are the ones its
own prefill would write: greedy answers are the same. Entries are dropped least recently used first past the budget.

Log-probabilities: the batch's method state carries `LogprobRows` beside the method's own (`_Logprobs`): while a
live request asks for them, each step writes the target's log-softmax at the tokens it commits and its top
MAX_TOP_LOGPROBS tokens, at their positions (from `Committed.logits`: with ddtree, the verify logits at the accepted
path, not the drafter's); the first token's are written by the prefill. The calls of a batch where no request asks
compile without them.

A row's arithmetic never mixes with the other rows', so at temperature 0 a request gets exactly the tokens of
`generate` on its prompt alone. Per-row limits need no per-row shapes: row b writes its tokens to
out[b, M - max_new[b]:], so `commit`'s cut at M = out.shape[1] stops it after exactly max_new[b] tokens. Each row has
its own end-of-sequence id (-1: none; the batch's `eos_id` is int32 [B, 1], which `commit` compares with the row's
new tokens) and its own sampling options, temperature (0: greedy), top_k and top_p, through `RowSampler` (the
options as traced data: no compilation per request), or the static greedy `Sampler` while every live row is greedy.
Each row also has its own random key, from its request's `seed`: split once per call that runs the row, folded with
the step's key (every call starts from the same loop key), so a seeded request draws the same tokens whatever else
is in flight, and in whichever slot (with a fixed budget; budget="auto" chooses the nodes verified for the batch
together, so there a sampled row's tokens depend on the other rows).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..ddtree import Speculative
from .. import validate
from ..decoding import DecodeState, Method, Sampler, commit, no_reliability, nonfinite_rows, prepare, run_steps
from ..generate import auto_method, check_auto, check_dtype, check_params, make_method
from ..model import forward, init_cache, step
from ..sharding import mesh_of, trace_context

log = logging.getLogger("kdtree_jax.serving.engine")

DEFAULT_MAX_CONTEXT = 8192  # cache slots per row when the model allows that many and none are asked for
MAX_TOP_LOGPROBS = 20  # the most likely tokens kept per position, the most a request may ask for (OpenAI's chat limit)
PREFIX_MIN_TOKENS = 32  # a cached prefix is reused when it shares at least this many tokens with the prompt; a prompt
# is kept when it holds at least this many tokens that no kept prompt begins with
# the buckets of the latency histograms (seconds), as vLLM's
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ContextOverflow(ValueError):
    """A prompt plus max_tokens (plus the speculative tree) does not fit a row of the cache."""


class QueueFull(RuntimeError):
    """The waiting queue is at its limit (the server answers 429)."""


class EngineClosed(RuntimeError):
    """The engine is shut down (or its thread died) and takes no more requests."""


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request receives: newly committed token ids, and with the last event why it finished."""

    tokens: list[int]
    finish: str | None = None  # None: more to come; "stop" (EOS), "length" (max_tokens), "cancelled", "error"
    error: str | None = None  # with finish == "error": what went wrong
    # when the request asked for them, one per token: (its log-probability, [(token id, log-probability)] of the
    # most likely tokens at its position, as many as asked, most likely first), of the target's distribution
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class Histogram:
    """A latency histogram as Prometheus keeps one: counts by upper bound (the last: +Inf), the sum and the count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, observations <= it)], the last bound inf."""
        return list(zip((*self.bounds, float("inf")), itertools.accumulate(self.counts)))

    def copy(self) -> Histogram:
        h = Histogram(self.bounds)
        h.counts, h.sum, h.count = list(self.counts), self.sum, self.count
        return h


@dataclasses.dataclass(eq=False)
class _Request:
    """A request's inputs and, once admitted, where it stands (engine thread only)."""

    id: int
    tokens: np.ndarray  # int32 [1, T_pad] the right-padded prompt
    lengths: np.ndarray  # int32 [1]
    chunk: int | None  # prefill chunk (None: one pass)
    max_new: np.int32
    # the sampling options and the rest of the request's row, in the dtypes of the engine's columns (converted, and
    # so range-checked, when the request is submitted)
    temperature: np.float32  # 0: greedy
    top_k: np.int32  # 0: none
    top_p: np.float32  # 1: none
    seed: np.ndarray  # uint32 [2]   the high and low words of the seed
    eos: np.int32  # -1: none
    on_event: Callable[[Event], None]
    logprobs: int | None = None  # the most likely tokens to report with each token's log-probability (None: none)
    submitted: float = 0.0  # time.monotonic() when it was queued
    slot: int = -1
    shown: int = 0  # tokens handed to on_event so far
    last: int = -1  # the newest of them
    last_time: float | None = None  # when tokens were last handed out

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[0, :self.lengths[0]]


@dataclasses.dataclass(eq=False)
class _Prefix:
    """A kept prompt: its tokens, and its rows of the caches, each `size` (a power of two) slots long: every layer's
    latent [size, R] and rope key [size, dr], and the drafter's state's (slots on axis 0 of each leaf; None: none)."""

    tokens: np.ndarray  # int32 [T]
    rows: tuple  # (latent tuple, k_pe tuple, drafter state)
    nbytes: int


class PrefixCache:
    """Prompts' cache rows kept for the requests that begin with the same tokens, within `capacity` bytes (the arrays'
    sizes across the mesh), the least recently used dropped first. Engine thread only."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: collections.OrderedDict[int, _Prefix] = collections.OrderedDict()  # by id(), oldest first
        self.bytes = 0
        self.evictions = 0

    def match(self, prompt: np.ndarray) -> tuple[_Prefix | None, int]:
        """The entry whose tokens begin like the prompt's for longest, and for how many tokens (None, 0: none)."""
        best, shared = None, 0
        for e in self.entries.values():
            n = min(len(e.tokens), len(prompt))
            differ = np.flatnonzero(e.tokens[:n] != prompt[:n])
            k = int(differ[0]) if differ.size else n
            if k > shared:
                best, shared = e, k
        return best, shared

    def touch(self, entry: _Prefix) -> None:
        self.entries.move_to_end(id(entry))

    def add(self, tokens: np.ndarray, rows: tuple) -> bool:
        """Keep a prompt's rows (dropping the entries its tokens begin with, and the least recently used past the
        capacity); False when they alone exceed it."""
        nbytes = sum(x.nbytes for x in jax.tree.leaves(rows))
        if nbytes > self.capacity:
            return False
        for key, e in list(self.entries.items()):
            if len(e.tokens) <= len(tokens) and np.array_equal(e.tokens, tokens[:len(e.tokens)]):
                self._drop(key)
        while self.bytes + nbytes > self.capacity:
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        entry = _Prefix(np.array(tokens, np.int32), rows, nbytes)
        self.entries[id(entry)] = entry
        self.bytes += nbytes
        return True

    def _drop(self, key: int) -> None:
        self.bytes -= self.entries.pop(key).nbytes


def _put(batch: jax.Array, rows: jax.Array, slots: jax.Array, axis: int = 0) -> jax.Array:
    """batch with rows (n along `axis`) written at the indices slots int32 [n] along that axis, a slot out of range
    (a padding row) dropped; in place when batch is donated."""
    return batch.at[(slice(None),) * axis + (slots,)].set(rows.astype(batch.dtype), mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampler:
    """The Sampler members the methods use (`greedy`, `logits`, `choose`), with every option per row and a random key
    per row. The options are applied as `decoding.Sampler.logits` applies them: temperature f32 [B] (0: a greedy row,
    whose logits are left as they are and whose token is the argmax, exactly the static greedy `Sampler`'s), then
    top_k int32 [B] (0: none; ties with the k-th token kept), then the nucleus top_p f32 [B] (1: none; ties kept), by
    one sort of the logits and thresholds read from it (`lax.top_k` needs a static k). A pytree with the options and
    keys as data: one compilation serves every mix of them; `filtered` (static) is False when no row has a top_k or
    top_p, which skips the sort.

    A row's draws depend on its own key alone: `choose(logits, key)` folds the call's `key` (the same for every row)
    into each row's key and draws each row with its own. The engine keeps each row's key, splits it once per call,
    and starts every call from the same loop key, so a seeded request gets the same tokens whatever else runs
    (with a fixed budget: see `Engine`)."""

    temperature: jax.Array  # f32 [B]    0: greedy
    top_k: jax.Array  # int32 [B]        0: all tokens
    top_p: jax.Array  # f32 [B]          1: all tokens
    key: jax.Array  # key [B]            the row's key for this call
    filtered: bool = dataclasses.field(default=True, metadata=dict(static=True))

    greedy = False  # per row, not for the whole batch

    @staticmethod
    def _rows(v: jax.Array, x: jax.Array) -> jax.Array:
        """v [B] shaped to broadcast against x [B, ..., V]."""
        return v.reshape(v.shape + (1,) * (x.ndim - 1))

    def logits(self, logits: jax.Array) -> jax.Array:
        """The log-probabilities (unnormalized, f32) that row b samples from, for logits [B, ..., V]: divided by the
        row's temperature, then -inf outside its top_k tokens, then -inf past its nucleus (a greedy row's as they
        are): `Sampler(temperature[b], top_k[b], top_p[b]).logits`, row by row."""
        x = logits.astype(jnp.float32)
        t = self._rows(self.temperature, x)
        sampled = t > 0
        # a sampled row's largest logit made 0 first, as `Sampler.logits` does (a tiny temperature overflows no logit)
        x = jnp.where(sampled, (x - jnp.max(x, axis=-1, keepdims=True)) / jnp.where(sampled, t, 1.0), x)
        if not self.filtered:
            return x
        desc = jnp.flip(jnp.sort(x, axis=-1), axis=-1)  # [B, ..., V]
        k = self._rows(self.top_k, x)
        kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, x.shape[-1] - 1), axis=-1)  # [B, ..., 1]
        kth = jnp.where(sampled & (k > 0), kth, -jnp.inf)
        x, desc = jnp.where(x >= kth, x, -jnp.inf), jnp.where(desc >= kth, desc, -jnp.inf)
        p = jax.nn.softmax(desc, axis=-1)
        before = jnp.concatenate([jnp.zeros_like(p[..., :1]), jnp.cumsum(p, axis=-1)[..., :-1]], axis=-1)
        top_p = self._rows(self.top_p, x)
        keep = jnp.sum(before < top_p, axis=-1, keepdims=True)  # the nucleus' size (>= 1)
        cut = jnp.where(sampled & (top_p < 1), jnp.take_along_axis(desc, keep - 1, axis=-1), -jnp.inf)
        return jnp.where(x >= cut, x, -jnp.inf)

    def choose(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """int32 [B, ...]: for a sampled row, a draw from its filtered distribution with its key (`key` folded in);
        for a greedy row, the argmax."""
        salt = jax.random.bits(key, dtype=jnp.uint32)
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(self.key, salt)
        drawn = jax.vmap(partial(jax.random.categorical, axis=-1))(keys, self.logits(logits))
        sampled = self._rows(self.temperature > 0, drawn)
        return jnp.where(sampled, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's key split in two: (the keys to keep for the next call, the keys for this one), key [B] each."""
    pairs = jax.vmap(jax.random.split)(keys)  # [B, 2]
    return pairs[:, 0], pairs[:, 1]


def seed_keys(seeds: jax.Array) -> jax.Array:
    """key [n] from seeds uint32 [n, 2] (the high and low words of seeds below 2**63): key(low) with the high word
    folded in, so that every seed has its own key (jax.random.key would drop the high word without x64)."""
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s[1]), s[0]))(seeds)


def token_logprobs(logits: jax.Array, tokens: jax.Array, top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The log-softmax of logits [..., V] at tokens [...], and its `top` largest values and their token ids:
    (f32 [...], int32 [..., top], f32 [..., top]), most likely first."""
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(lsm, top)
    return jnp.take_along_axis(lsm, tokens[..., None], axis=-1)[..., 0], ids.astype(jnp.int32), values


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogprobRows:
    """The target's log-probabilities by row and sequence position (of the token at position p, from the logits at
    p - 1): chosen f32 [B, S] the committed token's, ids int32 [B, S, M] and top f32 [B, S, M] the M most likely
    tokens', most likely first. Written where tokens are committed; read only where a request asked for them."""

    chosen: jax.Array
    ids: jax.Array
    top: jax.Array

    @staticmethod
    def empty(batch: int, length: int, top: int) -> LogprobRows:
        return LogprobRows(jnp.zeros((batch, length), jnp.float32), jnp.zeros((batch, length, top), jnp.int32),
                           jnp.zeros((batch, length, top), jnp.float32))

    def write(self, rows: jax.Array, positions: jax.Array, values: tuple) -> LogprobRows:
        """values (`token_logprobs` of [n, K] tokens) written at rows int32 [n] and positions int32 [n, K]; a row or
        position out of range is dropped."""
        at = (rows[:, None], positions)
        return LogprobRows(*(old.at[at].set(new, mode="drop") for old, new in zip((self.chosen, self.ids, self.top),
                                                                                  values)))

    def window(self, start: jax.Array, width: int) -> LogprobRows:
        """Positions start[b] .. start[b] + width - 1 of each row."""
        take = lambda x: jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, width))(x, start)
        return LogprobRows(take(self.chosen), take(self.ids), take(self.top))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Logprobs:
    """The engine's `Method`: `inner` (AR or a speculative method) over the method state (inner's state,
    `LogprobRows`). With `capture`, each step also writes the target's log-probabilities of the tokens it commits
    (`Committed.logits`) at their positions, the bonus' position + 1 + j for the j-th."""

    inner: Method
    capture: bool = dataclasses.field(metadata=dict(static=True))

    name = property(lambda self: self.inner.name)
    tokens_per_step = property(lambda self: self.inner.tokens_per_step)
    max_nodes = property(lambda self: self.inner.max_nodes)
    phases = property(lambda self: getattr(self.inner, "phases", 1))
    replan = property(lambda self: getattr(self.inner, "replan", 1))

    @staticmethod
    def _own(s: DecodeState) -> DecodeState:
        return dataclasses.replace(s, draft=s.draft[0])

    def plan(self, params, cfg, s: DecodeState, sampler, phase):
        return self.inner.plan(params, cfg, self._own(s), sampler, phase)

    def fixed_plan(self, params, cfg, s: DecodeState, sampler, tier: int):
        return self.inner.fixed_plan(params, cfg, self._own(s), sampler, tier)

    def step(self, params, cfg, s: DecodeState, key, sampler, plan=None):
        args = (params, cfg, self._own(s), key, sampler) + (() if plan is None else (plan,))
        c = self.inner.step(*args)
        rows = s.draft[1]
        if self.capture:
            j = jnp.arange(c.tokens.shape[1])[None, :]
            valid = (j < c.count[:, None]) & ~s.done[:, None]
            positions = jnp.where(valid, s.cache.lengths[:, None] + 1 + j, rows.chosen.shape[1])
            rows = rows.write(jnp.arange(s.done.shape[0]), positions,
                              token_logprobs(c.logits, c.tokens, rows.ids.shape[-1]))
        return c._replace(draft=(c.draft, rows), logits=None)


def _top(cfg: ModelConfig) -> int:
    """The most likely tokens kept per position."""
    return min(MAX_TOP_LOGPROBS, cfg.vocab_size)


def _empty_state(method: Method, cfg: ModelConfig, key, *, batch: int, cache_len: int) -> DecodeState:
    """The batch's loop carry with every slot free (done): `batch` rows of `cache_len` cache slots, out as wide,
    eos_id per row [batch, 1]; `key` is the loop key that every call starts from (the rows' keys are kept apart).
    The method state is (the method's own, `LogprobRows`)."""
    draft = method.drafter.start(batch, cache_len) if isinstance(method, Speculative) else None
    return DecodeState(cache=init_cache(cfg, batch, cache_len),
                       draft=(draft, LogprobRows.empty(batch, cache_len, _top(cfg))),
                       out=jnp.full((batch, cache_len), -1, jnp.int32), num_out=jnp.zeros((batch,), jnp.int32),
                       done=jnp.ones((batch,), bool), last=jnp.zeros((batch,), jnp.int32), key=key,
                       eos_id=jnp.full((batch, 1), -1, jnp.int32), steps=jnp.zeros((), jnp.int32),
                       accepted=jnp.zeros((batch, method.tokens_per_step + 1), jnp.int32),
                       nonfinite=jnp.zeros((batch,), bool), nodes=jnp.zeros((batch, method.max_nodes + 1), jnp.int32),
                       reliability=no_reliability(batch))


_empty_state_jit = jax.jit(_empty_state, static_argnames=("cfg", "batch", "cache_len"))


def _resume(method: Method, params, cfg: ModelConfig, tokens, lengths, cache, rows: tuple, reused, chunk: int | None):
    """`method.start` for prompts whose first reused[b] tokens are cached: their rows (`_Prefix.rows`, stacked: [n,
    size, ...], the drafter's state's leaves too) copied into the empty cache, then the rest of each prompt,
    tokens [n, T] (right-padded; lengths [n]), run after them by cached forwards (`model.step`, causal), in pieces of
    `chunk` tokens (None: one), the drafter taking its context from each. Returns (the next-token logits [n, V] at
    each prompt's last token, the cache with lengths reused + lengths, the drafter's state)."""
    latent, k_pe, draft_rows = rows
    n, size = tokens.shape[0], latent[0].shape[1]
    put = lambda c, r: c.at[:, :size].set(r.astype(c.dtype))
    cache = dataclasses.replace(cache, latent=tuple(map(put, cache.latent, latent)),
                                k_pe=tuple(map(put, cache.k_pe, k_pe)))
    draft = None
    if isinstance(method, Speculative):
        draft = jax.tree.map(put, method.drafter.start(n, cache.max_len), draft_rows)
    piece = tokens.shape[1] if chunk is None else chunk

    def body(carry, k):
        cache, draft, last = carry
        at = reused + k * piece
        res = step(params, cfg, jax.lax.dynamic_slice_in_dim(tokens, k * piece, piece, axis=1),
                   dataclasses.replace(cache, lengths=at))
        if isinstance(method, Speculative):
            draft = method.drafter.add_context(draft, res.hidden, at)
        idx = lengths - 1 - k * piece  # the prompt's last token, if it lies in this piece
        here = jnp.take_along_axis(res.logits, jnp.clip(idx, 0, piece - 1)[:, None, None], axis=1)[:, 0]
        return (res.cache, draft, jnp.where(((idx >= 0) & (idx < piece))[:, None], here, last)), None

    last = jnp.zeros((n, cfg.vocab_size), jnp.float32)
    (cache, draft, last), _ = jax.lax.scan(body, (cache, draft, last), jnp.arange(tokens.shape[1] // piece))
    return last, dataclasses.replace(cache, lengths=(reused + lengths).astype(jnp.int32)), draft


@partial(jax.jit, static_argnames=("cfg", "chunk"), donate_argnames=("state", "keys"))
def _admit(method: Method, params, cfg: ModelConfig, state: DecodeState, keys, slots, tokens, lengths, options,
           seeds, max_new, eos, *, chunk: int | None, prefix=None):
    """Prefill the prompts tokens [n, T] (right-padded; lengths [n]) into the rows slots int32 [n] of the batch in
    one call (traced slots: one compilation per n and T; a slot of B is a padding row, dropped).

    Each row is what the driver's `initial_state` makes (the same prefill, drafter state and first token as
    `generate`), its cache as long as the batch's; its first token is committed at out[b, M - max_new[b]] (M =
    out.shape[1]) and the target's log-probabilities of it written at its position. Every field but the loop key and
    step count replaces the slot's row (nothing of the previous request remains), the drafter's state's too (rows on
    axis 0 of every leaf: `DrafterProtocol.start`).
    prefix: None, or (entries, reused int32 [n]): tokens are then the rest of prompts whose first reused[b] tokens'
    rows are entries[b] (`_Prefix.rows`, all of one size; `_resume`).
    options: the rows' (temperature f32 [n], top_k int32 [n], top_p f32 [n]) for a `RowSampler` (always filtered:
    one sort of [n, V]); seeds uint32 [n, 2] (`seed_keys`): half of each row's key draws its first token, the other
    half goes to the row's slot of keys [B]; max_new and eos int32 [n] (eos -1: none).
    Returns (state, keys, first tokens [n], done [n], nonfinite [n], their `token_logprobs`).
    """
    width, n, length = state.out.shape[1], tokens.shape[0], state.cache.max_len
    keep, now = split_rows(seed_keys(seeds))
    cache = init_cache(cfg, n, length)
    if prefix is None:
        logits, cache, draft = method.start(params, cfg, tokens, lengths, cache, chunk)
    else:
        entries, reused = prefix
        stack = lambda part: tuple(map(jnp.stack, zip(*(e[part] for e in entries))))  # per layer [n, size, .]
        rows = (stack(0), stack(1), jax.tree.map(lambda *x: jnp.stack(x), *(e[2] for e in entries)))
        logits, cache, draft = _resume(method, params, cfg, tokens, lengths, cache, rows, reused, chunk)
    first = RowSampler(*options, key=now).choose(logits, jax.random.split(state.key)[1])  # as initial_state draws
    out, num_out, done, _ = commit(jnp.full((n, width), -1, jnp.int32), width - max_new, jnp.zeros((n,), bool),
                                   first[:, None], jnp.ones((n,), jnp.int32), eos[:, None], width)
    row = dataclasses.replace(_empty_state(method, cfg, state.key, batch=n, cache_len=length), cache=cache,
                              draft=draft, out=out, num_out=num_out, done=done, last=first, eos_id=eos[:, None],
                              nonfinite=nonfinite_rows(logits))
    logprobs = token_logprobs(logits, first, _top(cfg))

    def put(name: str):
        if name == "draft":
            own = jax.tree.map(lambda b, r: _put(b, r, slots), state.draft[0], row.draft)
            return own, state.draft[1].write(slots, cache.lengths[:, None], tuple(v[:, None] for v in logprobs))
        return jax.tree.map(lambda b, r: _put(b, r, slots), getattr(state, name), getattr(row, name))

    new = {f.name: put(f.name) for f in dataclasses.fields(DecodeState) if f.name not in ("key", "steps")}
    return dataclasses.replace(state, **new), _put(keys, keep, slots), first, done, row.nonfinite, logprobs


@partial(jax.jit, static_argnames=("size",))
def _prefix_rows(state: DecodeState, slot, *, size: int) -> tuple:
    """The first `size` slots of row `slot` of the caches: `_Prefix.rows`."""
    def take(x, axis: int):
        return jax.lax.slice_in_dim(jax.lax.dynamic_index_in_dim(x, slot, axis, keepdims=False), 0, size, axis=axis)

    return (tuple(take(x, 0) for x in state.cache.latent), tuple(take(x, 0) for x in state.cache.k_pe),
            jax.tree.map(lambda x: take(x, 0), state.draft[0]))


@partial(jax.jit, static_argnames=("cfg", "top"))
def _prompt_logprobs(params, cfg: ModelConfig, tokens, *, top: int):
    """`token_logprobs` of each token of tokens [1, T] after the ones before it (teacher-forced, `model.forward`):
    [T - 1] values for tokens 1 .. T - 1."""
    return token_logprobs(forward(params, cfg, tokens)[0, :-1], tokens[0, 1:], top)


@partial(jax.jit, static_argnames=("cfg", "steps", "width", "filtered"), donate_argnames=("state", "keys"))
def _advance(method: Method, params, cfg: ModelConfig, state: DecodeState, keys, stop, since, options, lp_since, *,
             steps: int, width: int, filtered: bool):
    """Up to `steps` decoding steps of every live row (fewer when every row is done); rows in `stop` bool [B] (free
    slots) are marked done first. options: None when every live row is greedy (the static greedy `Sampler`: no
    draws), else the rows' (temperature, top_k, top_p) for a `RowSampler` (`filtered` static) that draws with half of
    each row's key of keys [B], the other half kept for the next call. Every call starts from the same loop key
    (state.key, put back after the steps), so a row's draws depend on its own key and progress alone. lp_since: None
    (no log-probabilities), else int32 [B]: the steps write them (`_Logprobs`) and the call returns them from
    position lp_since[b] on.

    Returns (state, keys, window int32 [B, width]: out[b, start[b]:start[b] + width], start [B] (= since[b], the
    first token not yet read, moved back where it would overrun out), steps run, row-steps run, tokens those
    row-steps accepted, bonus included: the tau of the chunk is their ratio; draft nodes those row-steps verified;
    None or (`LogprobRows.window` of `width` positions from lp_start [B], lp_start: lp_since moved back likewise)).
    """
    if options is None:
        sampler = Sampler()
    else:
        keys, now = split_rows(keys)
        sampler = RowSampler(*options, key=now, filtered=filtered)
    loop_key = state.key
    state = dataclasses.replace(state, done=state.done | stop, steps=jnp.zeros((), jnp.int32))
    accepted_before, nodes_before = state.accepted, state.nodes
    state = run_steps(_Logprobs(method, lp_since is not None), params, cfg, state, jnp.int32(steps), sampler)
    state = dataclasses.replace(state, key=loop_key)
    hist = state.accepted - accepted_before  # [B, K + 1] (row, step) pairs that committed k tokens
    nodes = state.nodes - nodes_before  # [B, N + 1] (row, step) pairs that verified n draft nodes
    start = jnp.minimum(since, state.out.shape[1] - width)
    window = jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, width))(state.out, start)
    logprobs = None
    if lp_since is not None:
        lp_start = jnp.minimum(lp_since, state.cache.max_len - width)
        logprobs = (state.draft[1].window(lp_start, width), lp_start)
    return (state, keys, window, start, state.steps, jnp.sum(hist), jnp.sum(hist * jnp.arange(hist.shape[1])),
            jnp.sum(nodes * jnp.arange(nodes.shape[1])), logprobs)


def _device_name() -> str:
    """'1 x NVIDIA H200', or for the CPU its model and core count."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"{jax.device_count()} x {device.device_kind}"
    model = "CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return f"{model}, {os.cpu_count()} cores"


def all_prompt_lengths(max_context: int) -> tuple[int, ...]:
    """One prompt length for each length prompts are padded to (powers of two from 8) below max_context + 1: the
    warm-up that compiles every prefill a request can need."""
    return tuple(min(1 << k, max_context - 1) for k in range(3, max_context.bit_length()))


class Engine:
    """Continuous batching over `max_batch` slots for one model and one method, on a background thread.

    engine = Engine(params, cfg, method="ddtree", drafter=drafter, budget=16, max_batch=8, eos_id=tok.eos_id)
    tokens, finish = engine.complete(prompt_ids, max_tokens=64)      # blocking, from any thread
    request_id = engine.submit(prompt_ids, max_tokens=64, on_event=callback)   # streaming
    engine.close()

    max_context: cache slots per row, a power of two (prompt + max_tokens + the speculative tree must fit); default
    min(the model's context, 8192). max_queue: requests waiting for a slot before `submit` raises QueueFull.
    chunk_steps: decoding steps per jitted call (new tokens reach the requests after each). seed: the seeds of the
    requests that give none are drawn from a generator seeded with it. warmup: prompt lengths (in tokens) for which
    the prefill of every admission size is compiled before the engine starts (benchmarks: no request waits for a
    compilation), or "all": every length a prompt is padded to, up to max_context (`all_prompt_lengths`).

    budget="auto" (ddtree): trees of up to max_budget nodes, each step verifying the part its cost model makes pay
    for the live rows together (`kdtree_jax.budget`; tiers and cost_model as for `generate`). The cost model is the
    one for max_batch rows: given, saved for this setup, or measured when the engine starts. A call of the engine
    plans its first step anew and plans once after its last, so where the model plans every `replan`-th step the
    chunk is rounded up to whole windows of replan steps (`chunk_steps` then says what runs). Greedy requests get
    exactly their solo tokens, as with a fixed budget; a sampled request's tokens follow the right distribution, but
    which nodes are verified depends on the other rows, so its seed no longer fixes its tokens whatever else runs.

    prefix_cache_bytes: room for prompts' cache rows kept for later prompts that begin with the same tokens (0: none;
    see the module's docstring). On a mesh, params and drafter sharded (`kj.shard_params`, `shard_drafter`), every
    call runs on it, the cache laid out as cfg.cache_sharding says.
    """

    def __init__(self, params, cfg: ModelConfig, *, method: str = "ar", drafter=None, budget: int | str = 64,
                 max_budget: int = 64, tiers=None, cost_model=None, max_batch: int = 8, max_context: int | None = None,
                 max_queue: int = 64, chunk_steps: int = 4, eos_id: int | None = None, seed: int = 0,
                 warmup: tuple[int, ...] | str = (), prefix_cache_bytes: int = 0):
        # int32 on the device, as `serve` checks them (chunk_steps 2**31 passed here and failed every request)
        max_batch, max_queue, chunk_steps = (validate.integer(name, value, 1, validate.INT32_LIMIT) for name, value in (
            ("max_batch", max_batch), ("max_queue", max_queue), ("chunk_steps", chunk_steps)))
        prefix_cache_bytes = validate.integer("prefix_cache_bytes", prefix_cache_bytes, 0)
        context = min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT) if max_context is None else max_context
        if not validate.is_integer(context) or context < 64 or context & (context - 1):
            raise ValueError(f"max_context must be a power of two >= 64 (prompts are padded to powers of two), "
                             f"got {context!r}")
        context = int(context)
        if context > cfg.max_position_embeddings:
            raise ValueError(f"max_context {context} exceeds the model's context of {cfg.max_position_embeddings}")
        if isinstance(warmup, str):
            if warmup != "all":
                raise ValueError(f"warmup must be prompt lengths or 'all', got {warmup!r}")
            warmup = all_prompt_lengths(context)
        check_params(params, cfg)
        check_dtype(params, cfg)
        eos_id = validate.token_id("eos_id", eos_id, cfg.vocab_size, optional=True)
        seed = validate.seed(seed)
        auto = check_auto(method, budget, max_budget, tiers, cost_model)
        extra = make_method(cfg, method, drafter, max_budget if auto else budget).extra_slots
        if context < extra + 2:  # a prompt of one token and one new token must fit beside the tree
            need = 1 << (extra + 1).bit_length()
            raise ValueError(f"max_context {context} leaves no room for a request beside the {extra} slots of the "
                             f"draft tree (budget {max_budget if auto else budget}): use max_context >= {need}, or a "
                             "smaller budget")
        if auto:
            with trace_context(params, cfg):
                self._method = auto_method(params, cfg, drafter, batch=max_batch, max_budget=max_budget, tiers=tiers,
                                           cost_model=cost_model)
            replan = self._method.replan
            chunk_steps = -(-chunk_steps // replan) * replan  # whole windows: no plan thrown away mid-window
        else:
            self._method = make_method(cfg, method, drafter, budget)
        self.method, self.budget, self.extra_slots = self._method.name, self._method.budget, self._method.extra_slots
        self.params, self.cfg = params, cfg
        self.max_batch, self.max_context, self.max_queue, self.chunk_steps = max_batch, context, max_queue, chunk_steps
        self.eos_id = -1 if eos_id is None else int(eos_id)
        # tokens a row can commit in a chunk, plus one
        self._width = min(1 + chunk_steps * self._method.tokens_per_step, context)
        self._state, self._keys = self._empty()
        self._active: dict[int, _Request] = {}  # by slot (engine thread only)
        # the sampling options of each slot's request (engine thread only)
        self._temps = np.zeros((max_batch,), np.float32)
        self._top_k = np.zeros((max_batch,), np.int32)
        self._top_p = np.ones((max_batch,), np.float32)
        self._seeds = np.random.default_rng(seed)
        self._pending: list[_Request] = []
        self._cancelled: set[int] = set()
        self._closing = False
        self._cond = threading.Condition()
        self._idle = threading.Event()
        self._ids = itertools.count(1)
        self._prefixes = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        outcomes = {f"finished_{k}": 0 for k in ("stop", "length", "cancelled", "error")}
        self.counters = dict(prompt_tokens=0, generated_tokens=0, steps=0, row_steps=0, step_tokens=0, step_nodes=0,
                             chunk_seconds=0.0, last_step_seconds=0.0, prefills=0, prefill_calls=0, prefix_hits=0,
                             prefix_tokens_saved=0, **outcomes)
        self.histograms = dict(time_to_first_token=Histogram(TTFT_BUCKETS), inter_token=Histogram(ITL_BUCKETS),
                               queue=Histogram(QUEUE_BUCKETS))
        if warmup:
            self._warm_up(warmup)
        self._thread = threading.Thread(target=self._run, name="kdtree-jax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------------------------
    # The callers' side (any thread)
    # ------------------------------------------------------------------------------------------------------------

    def submit(self, prompt: list[int], *, max_tokens: int, on_event: Callable[[Event], None],
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, ignore_eos: bool = False, logprobs: int | None = None) -> int:
        """Queue one request; returns its id. on_event(Event) is called on the engine thread with each batch of new
        tokens, the last time with `finish` set. Sampling as `decoding.Sampler(temperature, top_k, top_p)` (greedy at
        temperature 0); `seed` fixes every token drawn, whatever else runs (not with budget="auto": see the class;
        None: one from the engine's generator). logprobs: None, or 0 .. MAX_TOP_LOGPROBS: each event then carries the
        target's log-probability of each token (before temperature, top_k and top_p) and that many most likely tokens
        at its position with theirs (`Event.logprobs`).
        ValueError/TypeError for bad inputs (with the reason: token ids, max_tokens, temperature, top_k, top_p, seed,
        by the rules of `kdtree_jax.validate`; ContextOverflow when they do not fit a row), QueueFull, EngineClosed.
        Every value is converted to the dtype of the engine's column here, so nothing about one request can fail
        later in a call that other requests share."""
        max_tokens = validate.integer("max_tokens", max_tokens, 1, validate.INT32_LIMIT)
        seed = None if seed is None else validate.seed(seed)
        ignore_eos = validate.flag("ignore_eos", ignore_eos)
        logprobs = validate.integer("logprobs", logprobs, 0, _top(self.cfg) + 1, optional=True)
        if not callable(on_event):
            raise TypeError(f"on_event must be callable, got {type(on_event).__name__}")
        rows = [validate.token_row(prompt, self.cfg.vocab_size)]
        need = len(rows[0]) + max_tokens + self.extra_slots
        if need > self.max_context:
            raise ContextOverflow(f"prompt of {len(rows[0])} tokens + max_tokens {max_tokens}"
                                  + (f" + {self.extra_slots} speculative slots" if self.extra_slots else "")
                                  + f" = {need} exceeds the server's context of {self.max_context} tokens")
        eos = None if ignore_eos or self.eos_id < 0 else self.eos_id
        req = prepare(self.cfg, rows, max_tokens, Sampler(temperature, top_k, top_p), eos,
                      extra_slots=self.extra_slots)
        s = req.sampler
        with self._cond:
            if self._closing or not self._thread.is_alive():
                raise EngineClosed("the engine is shut down")
            waiting = len(self._pending) - (self.max_batch - len(self._active))  # beyond the free slots
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are already waiting for a slot (the limit)")
            if seed is None:
                seed = int(self._seeds.integers(2**63))
            r = _Request(id=next(self._ids), tokens=req.tokens, lengths=req.lengths, chunk=req.chunk,
                         max_new=np.int32(req.max_new), temperature=np.float32(s.temperature),
                         top_k=np.int32(s.top_k or 0), top_p=np.float32(1.0 if s.top_p is None else s.top_p),
                         seed=np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32), eos=np.int32(req.eos_id),
                         on_event=on_event, logprobs=logprobs, submitted=time.monotonic())
            self._pending.append(r)
            self._idle.clear()
            self._cond.notify()
        return r.id

    def cancel(self, request_id: int) -> None:
        """Stop a request: a waiting one leaves the queue, a running one frees its slot before the next chunk. Its
        last event has finish == "cancelled" (nothing happens for a finished or unknown id)."""
        with self._cond:
            for r in self._pending:
                if r.id == request_id:
                    self._pending.remove(r)
                    self._deliver(r, Event([], "cancelled"))
                    self.counters["finished_cancelled"] += 1
                    self._cond.notify()  # the engine thread says when it is idle
                    return
            self._cancelled.add(request_id)
            self._cond.notify()

    def complete(self, prompt: list[int], *, max_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, ignore_eos: bool = False,
                 timeout: float | None = None) -> tuple[list[int], str]:
        """Blocking: (the generated token ids, finish reason); the arguments are `submit`'s. RuntimeError when the
        request fails."""
        events: queue.Queue[Event] = queue.Queue()
        self.submit(prompt, max_tokens=max_tokens, on_event=events.put, temperature=temperature, top_k=top_k,
                    top_p=top_p, seed=seed, ignore_eos=ignore_eos)
        tokens = []
        while True:
            ev = events.get(timeout=timeout)
            tokens += ev.tokens
            if ev.finish == "error":
                raise RuntimeError(ev.error)
            if ev.finish is not None:
                return tokens, ev.finish

    def prompt_logprobs(self, prompt: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Per prompt token, as `Event.logprobs` gives them, the target's log-probabilities of it after the tokens
        before it and of the `top` most likely tokens there (None for the first token), by one teacher-forced forward
        on the calling thread (the prompt padded to a power of two)."""
        top = validate.integer("logprobs", top, 0, _top(self.cfg) + 1)
        req = prepare(self.cfg, [validate.token_row(prompt, self.cfg.vocab_size)], 1)
        with trace_context(self.params, self.cfg):
            values = _prompt_logprobs(self.params, self.cfg, req.tokens, top=_top(self.cfg))
        chosen, ids, logp = jax.device_get(values)
        return [None] + [_token_entry(chosen[i], ids[i], logp[i], top) for i in range(len(prompt) - 1)]

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is waiting or running (every slot free); False on timeout."""
        return self._idle.wait(timeout)

    def describe(self) -> dict:
        """The engine's setup: method, budget, slots, context, chunk and device (for /health and benchmarks); with
        budget="auto" also the largest tree, the tiers and the plan's period (replan)."""
        auto = {}
        if self.budget == "auto":
            auto = dict(max_budget=self._method.max_nodes, tiers=list(self._method.policy.tiers),
                        replan=self._method.replan)
        mesh = mesh_of(self.params)
        return dict(method=self.method, budget=self.budget, **auto, max_batch=self.max_batch,
                    max_context=self.max_context, max_queue=self.max_queue, chunk_steps=self.chunk_steps,
                    prefix_cache_bytes=self._prefixes.capacity if self._prefixes else 0,
                    mesh=None if mesh is None else dict(mesh.shape),
                    cache_sharding=self.cfg.cache_sharding, device=_device_name())

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def snapshot(self) -> dict:
        """The counters plus the gauges: queue depth, busy slots, max_batch, the prefix cache's entries, bytes and
        evictions; and `histograms`, copies of the latency histograms (a copy, for /metrics)."""
        with self._cond:
            p = self._prefixes
            return dict(self.counters, queue_depth=len(self._pending), active_slots=len(self._active),
                        max_batch=self.max_batch, prefix_entries=len(p.entries) if p else 0,
                        prefix_bytes=p.bytes if p else 0, prefix_evictions=p.evictions if p else 0,
                        histograms={k: h.copy() for k, h in self.histograms.items()})

    def close(self) -> None:
        """Stop the engine thread (every waiting and running request gets an error event) and wait for it."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------------------------------------
    # The engine thread
    # ------------------------------------------------------------------------------------------------------------

    def _empty(self) -> tuple[DecodeState, jax.Array]:
        """The batch with every slot free, and the rows' keys key [B] (placeholders until requests take the slots)."""
        with trace_context(self.params, self.cfg):
            state = _empty_state_jit(self._method, self.cfg, jax.random.key(0), batch=self.max_batch,
                                     cache_len=self.max_context)
            return state, jax.random.split(jax.random.key(1), self.max_batch)

    def _warm_up(self, prompt_lens: tuple[int, ...]) -> None:
        """Compile the prefills of every admission size (1, 2, 4, ... rows, at most max_batch) for prompts of these
        lengths (padded as requests are), and the decoding chunk in its three sampler forms, each with and without
        log-probabilities, by running them on nothing: padding rows, which are dropped, and no live row. The calls'
        arguments are laid out as the serving path lays them out (a keyword given or left out, a NumPy or a device
        array: each difference is another program). A prompt that reuses a cached prefix is another program, not
        compiled here."""
        for n in prompt_lens:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 < n < self.max_context:
                raise ValueError(f"warmup prompt lengths must be integers in [1, {self.max_context}), got {n!r}")
        shapes = {(r.tokens.shape[1], r.chunk) for r in (prepare(self.cfg, [[0] * n], 1) for n in prompt_lens)}
        sizes = sorted({min(1 << i, self.max_batch) for i in range(self.max_batch.bit_length() + 1)})
        with trace_context(self.params, self.cfg):
            for (t_pad, chunk), rows in itertools.product(sorted(shapes), sizes):
                options = (np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32))
                ones = np.ones(rows, np.int32)
                self._state, self._keys, *_ = _admit(
                    self._method, self.params, self.cfg, self._state, self._keys, self.max_batch * ones,
                    np.zeros((rows, t_pad), np.int32), ones, options, np.zeros((rows, 2), np.uint32), ones, -ones,
                    chunk=chunk, prefix=None)  # as `_prefill` passes it: a keyword left out is another program
            sampled = (self._temps.copy(), self._top_k.copy(), self._top_p.copy())
            since = np.zeros((self.max_batch,), np.int32)
            for (options, filtered), lp_since in itertools.product(
                    ((None, False), (sampled, False), (sampled, True)), (None, since)):
                self._state, self._keys, *_ = _advance(
                    self._method, self.params, self.cfg, self._state, self._keys, jnp.ones((self.max_batch,), bool),
                    jnp.asarray(since), options, lp_since, steps=self.chunk_steps, width=self._width,
                    filtered=filtered)
        jax.block_until_ready(self._state)

    def _deliver(self, r: _Request, event: Event) -> bool:
        """on_event(event); False (and the request is to be dropped) when the callback raised."""
        try:
            r.on_event(event)
            return True
        except Exception:
            log.exception("request %d: its event callback raised; the request is cancelled", r.id)
            return False

    def _finish(self, r: _Request, reason: str, tokens: list[int] = (), error: str | None = None,
                logprobs: list | None = None) -> None:
        """Free r's slot and send its last event."""
        if self._active.get(r.slot) is r:
            del self._active[r.slot]
        self._deliver(r, Event(list(tokens), reason, error, logprobs))
        with self._cond:
            self.counters[f"finished_{reason}"] += 1

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closing or self._pending or self._active or self._cancelled):
                    self._idle.set()
                    self._cond.wait()
                if self._closing:
                    break
                cancelled, self._cancelled = self._cancelled, set()
            for r in [r for r in self._active.values() if r.id in cancelled]:
                self._finish(r, "cancelled")
            with self._cond:
                free = [s for s in range(self.max_batch) if s not in self._active]
                admit, self._pending = self._pending[:len(free)], self._pending[len(free):]
            try:
                self._iterate(list(zip(admit, free)))
            except Exception as e:  # outside the steps `_iterate` guards (a bug): this iteration's requests fail
                self._fail([*self._active.values(), *(r for r in admit if r.slot < 0)], e, "engine iteration")
        with self._cond:
            leftover, self._pending = [*self._pending, *self._active.values()], []
            self._active.clear()
        for r in leftover:
            self._deliver(r, Event([], "error", "the server is shutting down"))
        self._idle.set()

    def _fail(self, requests: list[_Request], e: Exception, what: str) -> None:
        """`what` raised e for these requests: they finish with an error and the others go on, unless the batch's
        state did not survive the failure (a call that failed after its donated state was consumed): then every
        running request fails with them and the state starts over empty."""
        log.error("%s failed for request(s) %s: %s: %s", what, [r.id for r in requests], type(e).__name__, e,
                  exc_info=e)
        message = f"{type(e).__name__}: {e}"
        for r in requests:
            self._finish(r, "error", error=message)
        if not self._usable():
            log.error("the batch's state was lost with it: the running requests fail too")
            for r in list(self._active.values()):
                self._finish(r, "error", error=f"{message} (in another request; the batch's state was lost)")
            self._state, self._keys = self._empty()

    def _usable(self) -> bool:
        """Whether the batch's state survived a failed call: no buffer donated away, none holding a failed result."""
        try:
            leaves = jax.tree.leaves((self._state, self._keys))
            if any(x.is_deleted() for x in leaves):
                return False
            jax.block_until_ready(leaves)
            return True
        except Exception:  # the failed computation's error, raised where its result is read
            return False

    def _admission(self, r: _Request, slot: int) -> _Admission:
        """How r is prefilled: the rest of its prompt after the longest kept prefix it begins with (at least
        PREFIX_MIN_TOKENS of it, one token left to prefill, and the rest padded fitting the row), else all of it."""
        cold = _Admission(r, slot, r.tokens, r.lengths, r.chunk)
        if self._prefixes is None:
            return cold
        prompt = r.prompt
        entry, shared = self._prefixes.match(prompt)
        cold.shared = shared
        reused = min(shared, len(prompt) - 1)
        if entry is None or reused < PREFIX_MIN_TOKENS:
            return cold
        rest = prepare(self.cfg, [prompt[reused:]], 1)
        if reused + rest.tokens.shape[1] > self.max_context:
            return cold
        return _Admission(r, slot, rest.tokens, rest.lengths, rest.chunk, entry, reused, shared)

    def _keep_prefix(self, a: _Admission) -> None:
        """Keep a's prompt's rows (prefilled, or copied and prefilled) when it holds at least PREFIX_MIN_TOKENS tokens
        that no kept prompt begins with; a failure here costs the cache an entry, not the request."""
        prompt = a.request.prompt
        if self._prefixes is None or len(prompt) - a.shared < PREFIX_MIN_TOKENS:
            return
        try:
            size = min(1 << (len(prompt) - 1).bit_length(), self.max_context)
            self._prefixes.add(prompt, _prefix_rows(self._state, np.int32(a.slot), size=size))
        except Exception:
            log.exception("request %d: its prompt could not be kept in the prefix cache", a.request.id)

    def _iterate(self, admit: list[tuple[_Request, int]]) -> None:
        """Prefill `admit` into their slots (one call per padded prompt length, or per padded rest and prefix size
        for prompts that begin with a kept prefix), run one chunk for every live row, hand out the new tokens. A
        failure fails the requests it concerns (`_fail`): a prefill its group's, the chunk every live row's, the
        reading or handing out of one request's tokens that request's."""
        groups: dict[tuple, list[_Admission]] = {}
        for r, slot in admit:
            a = self._admission(r, slot)
            size = 0 if a.entry is None else a.entry.rows[0][0].shape[0]
            groups.setdefault((a.tokens.shape[1], size), []).append(a)
        firsts = []
        with trace_context(self.params, self.cfg):
            for group in groups.values():
                try:
                    firsts.append((group, self._prefill(group)))
                except Exception as e:
                    self._fail([a.request for a in group], e, "prefill")
                    continue
                for a in group:
                    self._keep_prefix(a)
            chunk = None
            if self._active:
                t0 = time.perf_counter()
                live = np.zeros((self.max_batch,), bool)
                live[list(self._active)] = True
                since = np.array([self._row_start(self._active[s]) + self._active[s].shown if live[s] else 0
                                  for s in range(self.max_batch)], np.int32)
                # every live row greedy: the static greedy Sampler (no draws to throw away), else one per row
                sampled = live & (self._temps > 0)
                options = (self._temps.copy(), self._top_k.copy(), self._top_p.copy()) if sampled.any() else None
                filtered = bool((sampled & ((self._top_k > 0) | (self._top_p < 1))).any())
                # log-probabilities only while a live request asks for them (another compilation of the chunk)
                lp_since = None
                if any(r.logprobs is not None for r in self._active.values()):
                    lp_since = np.zeros((self.max_batch,), np.int32)
                    for s, r in self._active.items():
                        lp_since[s] = r.lengths[0] + r.shown
                try:
                    self._state, self._keys, *chunk = _advance(
                        self._method, self.params, self.cfg, self._state, self._keys, jnp.asarray(~live),
                        jnp.asarray(since), options, lp_since, steps=self.chunk_steps, width=self._width,
                        filtered=filtered)
                except Exception as e:
                    self._fail(list(self._active.values()), e, "decoding chunk")
        for group, first in firsts:
            try:
                tokens, done, nonfinite, logprobs = jax.device_get(first)
            except Exception as e:
                self._fail([a.request for a in group], e, "prefill")
                continue
            for i, a in enumerate(group):
                r = a.request
                lp = None if r.logprobs is None else [_token_entry(*(v[i] for v in logprobs), r.logprobs)]
                self._guarded(r, lambda r=r, i=i, lp=lp: self._hand_out(r, [int(tokens[i])], bool(done[i]),
                                                                        bool(nonfinite[i]), lp))
        if chunk is None:
            return
        try:
            window, start, steps, row_steps, step_tokens, step_nodes, logprobs = jax.device_get(chunk)
            num_out, done, nonfinite = jax.device_get((self._state.num_out, self._state.done, self._state.nonfinite))
        except Exception as e:
            self._fail(list(self._active.values()), e, "decoding chunk")
            return
        seconds = time.perf_counter() - t0
        with self._cond:
            self.counters["steps"] += int(steps)
            self.counters["row_steps"] += int(row_steps)
            self.counters["step_tokens"] += int(step_tokens)
            self.counters["step_nodes"] += int(step_nodes)
            self.counters["chunk_seconds"] += seconds
            self.counters["last_step_seconds"] = seconds / max(int(steps), 1)
        for slot, r in list(self._active.items()):
            def hand_out(slot=slot, r=r):
                lo = self._row_start(r) + r.shown - int(start[slot])
                new = window[slot, lo:int(num_out[slot]) - int(start[slot])].tolist()
                lp = None
                if r.logprobs is not None:
                    rows, lp_start = logprobs
                    at = int(r.lengths[0]) + r.shown - int(lp_start[slot])
                    lp = [_token_entry(rows.chosen[slot, j], rows.ids[slot, j], rows.top[slot, j], r.logprobs)
                          for j in range(at, at + len(new))]
                r.shown += len(new)
                self._hand_out(r, new, bool(done[slot]), bool(nonfinite[slot]), lp)

            self._guarded(r, hand_out)

    def _guarded(self, r: _Request, work: Callable[[], None]) -> None:
        """work() (reading and handing out r's tokens); if it raises, r alone fails."""
        try:
            work()
        except Exception as e:
            self._fail([r], e, "handing out tokens")

    def _prefill(self, group: list[_Admission]) -> tuple:
        """One prefill call for requests of one padded prompt length (or rest and prefix size) into their slots, the
        rows padded to a power of two (at most max_batch: few shapes compile) with rows that are dropped; returns the
        first tokens, done, nonfinite and log-probabilities of the rows (on the device: read after the chunk is
        dispatched)."""
        reqs, n = [a.request for a in group], len(group)
        rows = min(1 << (n - 1).bit_length(), self.max_batch)

        def column(values, pad, dtype) -> np.ndarray:
            return np.array(list(values) + [pad] * (rows - n), dtype)

        tokens = np.zeros((rows, group[0].tokens.shape[1]), np.int32)
        tokens[:n] = np.concatenate([a.tokens for a in group])
        options = (column((r.temperature for r in reqs), 0, np.float32), column((r.top_k for r in reqs), 0, np.int32),
                   column((r.top_p for r in reqs), 1, np.float32))
        seeds = column((r.seed for r in reqs), (0, 0), np.uint32)
        prefix = None
        if group[0].entry is not None:
            entries = [a.entry.rows for a in group]
            prefix = (tuple(entries + entries[:1] * (rows - n)), column((a.reused for a in group), 1, np.int32))
        now = time.monotonic()
        self._state, self._keys, *first = _admit(
            self._method, self.params, self.cfg, self._state, self._keys,
            column((a.slot for a in group), self.max_batch, np.int32), tokens,
            column((a.lengths[0] for a in group), 1, np.int32), options, seeds,
            column((r.max_new for r in reqs), 1, np.int32), column((r.eos for r in reqs), -1, np.int32),
            chunk=group[0].chunk, prefix=prefix)
        for a in group:
            r, slot = a.request, a.slot
            r.slot, r.shown = slot, 1  # the first token is read after the chunk is dispatched
            self._active[slot] = r
            self._temps[slot], self._top_k[slot], self._top_p[slot] = r.temperature, r.top_k, r.top_p
            if a.entry is not None:
                self._prefixes.touch(a.entry)
        with self._cond:
            self.counters["prefills"] += n
            self.counters["prefill_calls"] += 1
            self.counters["prompt_tokens"] += sum(int(r.lengths[0]) for r in reqs)
            self.counters["prefix_hits"] += sum(a.entry is not None for a in group)
            self.counters["prefix_tokens_saved"] += sum(a.reused for a in group)
            for r in reqs:
                self.histograms["queue"].observe(now - r.submitted)
        return first

    def _row_start(self, r: _Request) -> int:
        """Where r's tokens begin in its row of out."""
        return self.max_context - r.max_new

    def _hand_out(self, r: _Request, new: list[int], done: bool, nonfinite: bool, logprobs: list | None = None) -> None:
        """Give r its new tokens (and their log-probabilities when it asked); finish it when its row is done or broken
        (a callback that raises cancels it). Times the first token and the tokens after it."""
        if self._active.get(r.slot) is not r:  # finished earlier in this iteration
            return
        r.last = new[-1] if new else r.last
        now = time.monotonic()
        with self._cond:
            self.counters["generated_tokens"] += len(new)
            if new and not nonfinite:
                if r.last_time is None:
                    self.histograms["time_to_first_token"].observe(now - r.submitted)
                else:
                    self.histograms["inter_token"].observe((now - r.last_time) / len(new), len(new))
        if new:
            r.last_time = now
        if nonfinite:
            self._finish(r, "error", error="the model produced NaN or inf logits for this request")
        elif done:
            self._finish(r, "stop" if r.eos >= 0 and r.last == r.eos else "length", new, logprobs=logprobs)
        elif new and not self._deliver(r, Event(new, logprobs=logprobs)):
            self._finish(r, "cancelled")


def _token_entry(chosen, ids, top, count: int) -> tuple[float, list[tuple[int, float]]]:
    """One token's `Event.logprobs` entry from its `token_logprobs` values, `count` of the most likely kept."""
    return float(chosen), [(int(i), float(v)) for i, v in zip(ids[:count], top[:count])]


@dataclasses.dataclass(eq=False)
class _Admission:
    """How a request is prefilled into its slot: tokens int32 [1, T] (lengths [1]) after the first `reused` tokens of
    its prompt, whose rows come from `entry` (None: the whole prompt); `shared`: the tokens its prompt has in common
    with the kept prompt that begins most like it."""

    request: _Request
    slot: int
    tokens: np.ndarray
    lengths: np.ndarray
    chunk: int | None
    entry: _Prefix | None = None
    reused: int = 0
    shared: int = 0
