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
from ..decoding import DecodeState, Method, Sampler, commit, initial_state, no_reliability, prepare, run_steps
from ..generate import auto_method, check_auto, check_params, make_method
from ..model import init_cache
from ..sharding import trace_context

log = logging.getLogger("kdtree_jax.serving.engine")

DEFAULT_MAX_CONTEXT = 8192  # cache slots per row when the model allows that many and none are asked for


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
    slot: int = -1
    shown: int = 0  # tokens handed to on_event so far
    last: int = -1  # the newest of them


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
        x = x / jnp.where(sampled, t, 1.0)
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


def _empty_state(method: Method, cfg: ModelConfig, key, *, batch: int, cache_len: int) -> DecodeState:
    """The batch's loop carry with every slot free (done): `batch` rows of `cache_len` cache slots, out as wide,
    eos_id per row [batch, 1]; `key` is the loop key that every call starts from (the rows' keys are kept apart)."""
    draft = method.drafter.start(batch, cache_len) if isinstance(method, Speculative) else None
    return DecodeState(cache=init_cache(cfg, batch, cache_len), draft=draft,
                       out=jnp.full((batch, cache_len), -1, jnp.int32), num_out=jnp.zeros((batch,), jnp.int32),
                       done=jnp.ones((batch,), bool), last=jnp.zeros((batch,), jnp.int32), key=key,
                       eos_id=jnp.full((batch, 1), -1, jnp.int32), steps=jnp.zeros((), jnp.int32),
                       accepted=jnp.zeros((batch, method.tokens_per_step + 1), jnp.int32),
                       nonfinite=jnp.zeros((batch,), bool), nodes=jnp.zeros((batch, method.max_nodes + 1), jnp.int32),
                       reliability=no_reliability(batch))


_empty_state_jit = jax.jit(_empty_state, static_argnames=("cfg", "batch", "cache_len"))


@partial(jax.jit, static_argnames=("cfg", "chunk"), donate_argnames=("state", "keys"))
def _admit(method: Method, params, cfg: ModelConfig, state: DecodeState, keys, slots, tokens, lengths, options,
           seeds, max_new, eos, *, chunk: int | None):
    """Prefill the prompts tokens [n, T] (right-padded; lengths [n]) into the rows slots int32 [n] of the batch in
    one call (traced slots: one compilation per n and T; a slot of B is a padding row, dropped).

    Each row is the driver's `initial_state` (the same prefill, drafter state and first token as `generate`), its
    cache as long as the batch's; its first token is committed again at out[b, M - max_new[b]] (M = out.shape[1]).
    Every field but the loop key and step count replaces the slot's row (nothing of the previous request remains);
    the drafter's state (a DraftCache, [Ld, B, S, ...]) has its rows on axis 1.
    options: the rows' (temperature f32 [n], top_k int32 [n], top_p f32 [n]) for a `RowSampler` (always filtered:
    one sort of [n, V]); seeds uint32 [n, 2] (`seed_keys`): half of each row's key draws its first token, the other
    half goes to the row's slot of keys [B]; max_new and eos int32 [n] (eos -1: none).
    Returns (state, keys, first tokens [n], done [n], nonfinite [n]).
    """
    width, n = state.out.shape[1], tokens.shape[0]
    keep, now = split_rows(seed_keys(seeds))
    row = initial_state(method, params, cfg, tokens, lengths, state.key, eos[:, None],
                        sampler=RowSampler(*options, key=now), cache_len=state.cache.max_len, max_new=1, chunk=chunk)
    out, num_out, done, _ = commit(jnp.full((n, width), -1, jnp.int32), width - max_new, jnp.zeros((n,), bool),
                                   row.last[:, None], jnp.ones((n,), jnp.int32), eos[:, None], width)
    row = dataclasses.replace(row, out=out, num_out=num_out, done=done, eos_id=eos[:, None])

    def put(name: str):
        axis = 1 if name == "draft" else 0
        return jax.tree.map(lambda b, r: _put(b, r, slots, axis), getattr(state, name), getattr(row, name))

    new = {f.name: put(f.name) for f in dataclasses.fields(DecodeState) if f.name not in ("key", "steps")}
    return dataclasses.replace(state, **new), _put(keys, keep, slots), row.last, done, row.nonfinite


@partial(jax.jit, static_argnames=("cfg", "steps", "width", "filtered"), donate_argnames=("state", "keys"))
def _advance(method: Method, params, cfg: ModelConfig, state: DecodeState, keys, stop, since, options, *, steps: int,
             width: int, filtered: bool):
    """Up to `steps` decoding steps of every live row (fewer when every row is done); rows in `stop` bool [B] (free
    slots) are marked done first. options: None when every live row is greedy (the static greedy `Sampler`: no
    draws), else the rows' (temperature, top_k, top_p) for a `RowSampler` (`filtered` static) that draws with half of
    each row's key of keys [B], the other half kept for the next call. Every call starts from the same loop key
    (state.key, put back after the steps), so a row's draws depend on its own key and progress alone.

    Returns (state, keys, window int32 [B, width]: out[b, start[b]:start[b] + width], start [B] (= since[b], the
    first token not yet read, moved back where it would overrun out), steps run, row-steps run, tokens those
    row-steps accepted, bonus included: the tau of the chunk is their ratio; draft nodes those row-steps verified).
    """
    if options is None:
        sampler = Sampler()
    else:
        keys, now = split_rows(keys)
        sampler = RowSampler(*options, key=now, filtered=filtered)
    loop_key = state.key
    state = dataclasses.replace(state, done=state.done | stop, steps=jnp.zeros((), jnp.int32))
    accepted_before, nodes_before = state.accepted, state.nodes
    state = run_steps(method, params, cfg, state, jnp.int32(steps), sampler)
    state = dataclasses.replace(state, key=loop_key)
    hist = state.accepted - accepted_before  # [B, K + 1] (row, step) pairs that committed k tokens
    nodes = state.nodes - nodes_before  # [B, N + 1] (row, step) pairs that verified n draft nodes
    start = jnp.minimum(since, state.out.shape[1] - width)
    window = jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, width))(state.out, start)
    return (state, keys, window, start, state.steps, jnp.sum(hist), jnp.sum(hist * jnp.arange(hist.shape[1])),
            jnp.sum(nodes * jnp.arange(nodes.shape[1])))


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
    compilation).

    budget="auto" (ddtree): trees of up to max_budget nodes, each step verifying the part its cost model makes pay
    for the live rows together (`kdtree_jax.budget`; tiers and cost_model as for `generate`). The cost model is the
    one for max_batch rows: given, saved for this setup, or measured when the engine starts. A call of the engine
    plans its first step anew and plans once after its last, so where the model plans every `replan`-th step the
    chunk is rounded up to whole windows of replan steps (`chunk_steps` then says what runs). Greedy requests get
    exactly their solo tokens, as with a fixed budget; a sampled request's tokens follow the right distribution, but
    which nodes are verified depends on the other rows, so its seed no longer fixes its tokens whatever else runs.
    """

    def __init__(self, params, cfg: ModelConfig, *, method: str = "ar", drafter=None, budget: int | str = 64,
                 max_budget: int = 64, tiers=None, cost_model=None, max_batch: int = 8, max_context: int | None = None,
                 max_queue: int = 64, chunk_steps: int = 4, eos_id: int | None = None, seed: int = 0,
                 warmup: tuple[int, ...] = ()):
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("chunk_steps", chunk_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        context = min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT) if max_context is None else max_context
        if isinstance(context, bool) or not isinstance(context, int) or context < 64 or context & (context - 1):
            raise ValueError(f"max_context must be a power of two >= 64 (prompts are padded to powers of two), "
                             f"got {context!r}")
        if context > cfg.max_position_embeddings:
            raise ValueError(f"max_context {context} exceeds the model's context of {cfg.max_position_embeddings}")
        check_params(params, cfg)
        eos_id = validate.token_id("eos_id", eos_id, cfg.vocab_size, optional=True)
        seed = validate.seed(seed)
        auto = check_auto(method, budget, max_budget)
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
        outcomes = {f"finished_{k}": 0 for k in ("stop", "length", "cancelled", "error")}
        self.counters = dict(prompt_tokens=0, generated_tokens=0, steps=0, row_steps=0, step_tokens=0, step_nodes=0,
                             chunk_seconds=0.0, last_step_seconds=0.0, prefills=0, prefill_calls=0, **outcomes)
        if warmup:
            self._warm_up(warmup)
        self._thread = threading.Thread(target=self._run, name="kdtree-jax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------------------------
    # The callers' side (any thread)
    # ------------------------------------------------------------------------------------------------------------

    def submit(self, prompt: list[int], *, max_tokens: int, on_event: Callable[[Event], None],
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, ignore_eos: bool = False) -> int:
        """Queue one request; returns its id. on_event(Event) is called on the engine thread with each batch of new
        tokens, the last time with `finish` set. Sampling as `decoding.Sampler(temperature, top_k, top_p)` (greedy at
        temperature 0); `seed` fixes every token drawn, whatever else runs (not with budget="auto": see the class;
        None: one from the engine's generator).
        ValueError/TypeError for bad inputs (with the reason: token ids, max_tokens, temperature, top_k, top_p, seed,
        by the rules of `kdtree_jax.validate`; ContextOverflow when they do not fit a row), QueueFull, EngineClosed.
        Every value is converted to the dtype of the engine's column here, so nothing about one request can fail
        later in a call that other requests share."""
        max_tokens = validate.integer("max_tokens", max_tokens, 1, validate.INT32_LIMIT)
        seed = None if seed is None else validate.seed(seed)
        ignore_eos = validate.flag("ignore_eos", ignore_eos)
        if not callable(on_event):
            raise TypeError(f"on_event must be callable, got {type(on_event).__name__}")
        rows = validate.token_rows([prompt], self.cfg.vocab_size, name="prompt")
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
                         on_event=on_event)
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
        return dict(method=self.method, budget=self.budget, **auto, max_batch=self.max_batch,
                    max_context=self.max_context, max_queue=self.max_queue, chunk_steps=self.chunk_steps,
                    device=_device_name())

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def snapshot(self) -> dict:
        """The counters plus the gauges: queue depth, busy slots, max_batch (a copy, for /metrics)."""
        with self._cond:
            return dict(self.counters, queue_depth=len(self._pending), active_slots=len(self._active),
                        max_batch=self.max_batch)

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
        lengths (padded as requests are), and the decoding chunk in its three sampler forms, by running them on
        nothing: padding rows, which are dropped, and no live row."""
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
                    chunk=chunk)
            sampled = (self._temps.copy(), self._top_k.copy(), self._top_p.copy())
            for options, filtered in ((None, False), (sampled, False), (sampled, True)):
                self._state, self._keys, *_ = _advance(
                    self._method, self.params, self.cfg, self._state, self._keys, jnp.ones((self.max_batch,), bool),
                    jnp.zeros((self.max_batch,), jnp.int32), options, steps=self.chunk_steps, width=self._width,
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

    def _finish(self, r: _Request, reason: str, tokens: list[int] = (), error: str | None = None) -> None:
        """Free r's slot and send its last event."""
        if self._active.get(r.slot) is r:
            del self._active[r.slot]
        self._deliver(r, Event(list(tokens), reason, error))
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

    def _iterate(self, admit: list[tuple[_Request, int]]) -> None:
        """Prefill `admit` into their slots (one call per padded prompt length), run one chunk for every live row,
        hand out the new tokens. A failure fails the requests it concerns (`_fail`): a prefill its group's, the chunk
        every live row's, the reading or handing out of one request's tokens that request's."""
        by_length: dict[int, list[tuple[_Request, int]]] = {}
        for r, slot in admit:
            by_length.setdefault(r.tokens.shape[1], []).append((r, slot))
        firsts = []
        with trace_context(self.params, self.cfg):
            for group in by_length.values():
                try:
                    firsts.append((group, self._prefill(group)))
                except Exception as e:
                    self._fail([r for r, _ in group], e, "prefill")
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
                try:
                    self._state, self._keys, *chunk = _advance(
                        self._method, self.params, self.cfg, self._state, self._keys, jnp.asarray(~live),
                        jnp.asarray(since), options, steps=self.chunk_steps, width=self._width, filtered=filtered)
                except Exception as e:
                    self._fail(list(self._active.values()), e, "decoding chunk")
        for group, first in firsts:
            try:
                tokens, done, nonfinite = jax.device_get(first)
            except Exception as e:
                self._fail([r for r, _ in group], e, "prefill")
                continue
            for i, (r, _) in enumerate(group):
                self._guarded(r, lambda: self._hand_out(r, [int(tokens[i])], bool(done[i]), bool(nonfinite[i])))
        if chunk is None:
            return
        try:
            window, start, steps, row_steps, step_tokens, step_nodes = jax.device_get(chunk)
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
                r.shown += len(new)
                self._hand_out(r, new, bool(done[slot]), bool(nonfinite[slot]))

            self._guarded(r, hand_out)

    def _guarded(self, r: _Request, work: Callable[[], None]) -> None:
        """work() (reading and handing out r's tokens); if it raises, r alone fails."""
        try:
            work()
        except Exception as e:
            self._fail([r], e, "handing out tokens")

    def _prefill(self, group: list[tuple[_Request, int]]) -> tuple:
        """One prefill call for requests of one padded prompt length into their slots, the rows padded to a power of
        two (at most max_batch: few shapes compile) with rows that are dropped; returns the first tokens, done and
        nonfinite of the rows (on the device: read after the chunk is dispatched)."""
        reqs, n = [r for r, _ in group], len(group)
        rows = min(1 << (n - 1).bit_length(), self.max_batch)

        def column(values, pad, dtype) -> np.ndarray:
            return np.array(list(values) + [pad] * (rows - n), dtype)

        tokens = np.zeros((rows, reqs[0].tokens.shape[1]), np.int32)
        tokens[:n] = np.concatenate([r.tokens for r in reqs])
        options = (column((r.temperature for r in reqs), 0, np.float32), column((r.top_k for r in reqs), 0, np.int32),
                   column((r.top_p for r in reqs), 1, np.float32))
        seeds = column((r.seed for r in reqs), (0, 0), np.uint32)
        self._state, self._keys, *first = _admit(
            self._method, self.params, self.cfg, self._state, self._keys,
            column((slot for _, slot in group), self.max_batch, np.int32), tokens,
            column((r.lengths[0] for r in reqs), 1, np.int32), options, seeds,
            column((r.max_new for r in reqs), 1, np.int32), column((r.eos for r in reqs), -1, np.int32),
            chunk=reqs[0].chunk)
        for r, slot in group:
            r.slot, r.shown = slot, 1  # the first token is read after the chunk is dispatched
            self._active[slot] = r
            self._temps[slot], self._top_k[slot], self._top_p[slot] = r.temperature, r.top_k, r.top_p
        with self._cond:
            self.counters["prefills"] += n
            self.counters["prefill_calls"] += 1
            self.counters["prompt_tokens"] += sum(int(r.lengths[0]) for r in reqs)
        return first

    def _row_start(self, r: _Request) -> int:
        """Where r's tokens begin in its row of out."""
        return self.max_context - r.max_new

    def _hand_out(self, r: _Request, new: list[int], done: bool, nonfinite: bool) -> None:
        """Give r its new tokens; finish it when its row is done or broken (a callback that raises cancels it)."""
        if self._active.get(r.slot) is not r:  # finished earlier in this iteration
            return
        r.last = new[-1] if new else r.last
        with self._cond:
            self.counters["generated_tokens"] += len(new)
        if nonfinite:
            self._finish(r, "error", error="the model produced NaN or inf logits for this request")
        elif done:
            self._finish(r, "stop" if r.eos >= 0 and r.last == r.eos else "length", new)
        elif new and not self._deliver(r, Event(new)):
            self._finish(r, "cancelled")
