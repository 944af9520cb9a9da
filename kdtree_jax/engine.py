"""Continuous batching: requests join and leave the fixed slots of one decoding batch (rows of the KV cache) while the
other rows keep decoding.

A background thread owns the device state: the decoding driver's loop carry (`decoding.DecodeState`, the drafter's
state included) over `max_batch` rows of `max_context` cache slots, for one `decoding.Method` (`AR` or
`ddtree.speculative`'s chain or ddtree). Each iteration it
  1. frees the slots of cancelled requests (finished ones are freed as soon as their last tokens are read),
  2. prefills each waiting request into a free slot (`_admit`: the driver's `initial_state` for one row, every
     field written into the batch at the slot, a traced index: one compilation per padded prompt length),
  3. runs `chunk_steps` decoding steps of every live row inside one jitted call (`_advance`: the driver's
     `run_steps`; the rows of free slots are marked done and stay frozen), and
  4. hands each request the tokens it committed (its `on_event` callback, called on the engine thread).
Calls are dispatched asynchronously: the first token of a new request is read while the chunk after its prefill runs.

A row's arithmetic never mixes with the other rows', so at temperature 0 a request gets exactly the tokens of
`generate` on its prompt alone. Per-row limits need no per-row shapes: row b writes its tokens to
out[b, M - max_new[b]:], so `commit`'s cut at M = out.shape[1] stops it after exactly max_new[b] tokens. Each row has
its own end-of-sequence id (-1: none; the batch's `eos_id` is int32 [B, 1], which `commit` compares with the row's
new tokens) and its own temperature (0: greedy), through `RowSampler`, or the static greedy `Sampler` while every
live row is greedy. The rows share one random stream, so a request's `seed` fixes only its first token.
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

from .config import ModelConfig
from .ddtree import Speculative
from .decoding import DecodeState, Method, Sampler, commit, initial_state, prepare, run_steps
from .generate import make_method
from .model import init_cache
from .sharding import trace_context

log = logging.getLogger("kdtree_jax.engine")

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
    max_new: int
    temperature: float
    seed: int
    eos: int  # -1: none
    on_event: Callable[[Event], None]
    slot: int = -1
    shown: int = 0  # tokens handed to on_event so far
    last: int = -1  # the newest of them


def _put(batch: jax.Array, row: jax.Array, slot: jax.Array, axis: int = 0) -> jax.Array:
    """batch with its row `slot` (along `axis`) replaced by row (size 1 along that axis); in place when donated."""
    return jax.lax.dynamic_update_slice_in_dim(batch, row.astype(batch.dtype), slot, axis)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampler:
    """The Sampler members the methods use (`greedy`, `logits`, `choose`), with a temperature per row: f32 [B], 0 for a
    greedy row, whose token is the argmax, exactly the static greedy `Sampler`'s. A pytree with the temperatures as
    data: one compilation serves every mix of temperatures (no top-k or top-p)."""

    temperature: jax.Array  # f32 [B]

    greedy = False  # per row, not for the whole batch

    def _rows(self, x: jax.Array) -> jax.Array:
        """The temperatures shaped to broadcast against x [B, ..., V]; 1 for the greedy rows."""
        t = self.temperature.reshape(self.temperature.shape + (1,) * (x.ndim - 1))
        return jnp.where(t > 0, t, 1.0)

    def logits(self, logits: jax.Array) -> jax.Array:
        """logits [B, ..., V] (f32) divided by the row's temperature (a greedy row's as they are)."""
        return logits.astype(jnp.float32) / self._rows(logits)

    def choose(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """int32 [B, ...]: a draw from softmax(logits / temperature) for sampled rows, the argmax for greedy ones."""
        drawn = jax.random.categorical(key, self.logits(logits), axis=-1)
        sampled = (self.temperature > 0).reshape(self.temperature.shape + (1,) * (logits.ndim - 2))
        return jnp.where(sampled, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def _empty_state(method: Method, cfg: ModelConfig, key, *, batch: int, cache_len: int) -> DecodeState:
    """The batch's loop carry with every slot free (done): `batch` rows of `cache_len` cache slots, out as wide,
    eos_id per row [batch, 1]; `key` starts the random stream that the rows share."""
    draft = method.drafter.start(batch, cache_len) if isinstance(method, Speculative) else None
    return DecodeState(cache=init_cache(cfg, batch, cache_len), draft=draft,
                       out=jnp.full((batch, cache_len), -1, jnp.int32), num_out=jnp.zeros((batch,), jnp.int32),
                       done=jnp.ones((batch,), bool), last=jnp.zeros((batch,), jnp.int32), key=key,
                       eos_id=jnp.full((batch, 1), -1, jnp.int32), steps=jnp.zeros((), jnp.int32),
                       accepted=jnp.zeros((batch, method.tokens_per_step + 1), jnp.int32),
                       nonfinite=jnp.zeros((batch,), bool), nodes=jnp.zeros((batch, method.max_nodes + 1), jnp.int32))


_empty_state_jit = jax.jit(_empty_state, static_argnames=("cfg", "batch", "cache_len"))


@partial(jax.jit, static_argnames=("cfg", "chunk"), donate_argnames=("state",))
def _admit(method: Method, params, cfg: ModelConfig, state: DecodeState, slot, tokens, lengths, key,
           sampler: RowSampler, max_new, eos, *, chunk: int | None):
    """Prefill one prompt tokens [1, T] into row `slot` of the batch (slot traced: one compilation per T).

    The row is the driver's `initial_state` (the same prefill, drafter state and first token as `generate`), its
    cache as long as the batch's; its first token is committed again at out[0, M - max_new] (M = out.shape[1]).
    Every field but the shared key and step count replaces the slot's row (nothing of the previous request
    remains); the drafter's state (a DraftCache, [Ld, B, S, ...]) has its rows on axis 1. sampler: the row's temperature [1]; max_new and eos
    int32 [] (eos -1: none). Returns (state, first token [1], done [1], nonfinite [1]).
    """
    width = state.out.shape[1]
    row = initial_state(method, params, cfg, tokens, lengths, key, eos, sampler=sampler,
                        cache_len=state.cache.max_len, max_new=1, chunk=chunk)
    out, num_out, done, _ = commit(jnp.full((1, width), -1, jnp.int32), (width - max_new)[None], jnp.zeros((1,), bool),
                                   row.last[:, None], jnp.ones((1,), jnp.int32), eos, width)
    row = dataclasses.replace(row, out=out, num_out=num_out, done=done, eos_id=jnp.reshape(eos, (1, 1)))

    def put(name: str):
        axis = 1 if name == "draft" else 0
        return jax.tree.map(lambda b, r: _put(b, r, slot, axis), getattr(state, name), getattr(row, name))

    new = {f.name: put(f.name) for f in dataclasses.fields(DecodeState) if f.name not in ("key", "steps")}
    return dataclasses.replace(state, **new), row.last, done, row.nonfinite


@partial(jax.jit, static_argnames=("cfg", "steps", "width"), donate_argnames=("state",))
def _advance(method: Method, params, cfg: ModelConfig, state: DecodeState, stop, since, sampler, *, steps: int,
             width: int):
    """Up to `steps` decoding steps of every live row (fewer when every row is done); rows in `stop` bool [B] (free
    slots) are marked done first. sampler: a `RowSampler` (traced) or the greedy `Sampler` (static).

    Returns (state, window int32 [B, width]: out[b, start[b]:start[b] + width], start [B] (= since[b], the first
    token not yet read, moved back where it would overrun out), steps run, row-steps run, tokens those row-steps
    accepted, bonus included: the tau of the chunk is their ratio).
    """
    state = dataclasses.replace(state, done=state.done | stop, steps=jnp.zeros((), jnp.int32))
    accepted_before = state.accepted
    state = run_steps(method, params, cfg, state, jnp.int32(steps), sampler)
    hist = state.accepted - accepted_before  # [B, K + 1] (row, step) pairs that committed k tokens
    start = jnp.minimum(since, state.out.shape[1] - width)
    window = jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, width))(state.out, start)
    return state, window, start, state.steps, jnp.sum(hist), jnp.sum(hist * jnp.arange(hist.shape[1]))


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
    chunk_steps: decoding steps per jitted call (new tokens reach the requests after each).
    """

    def __init__(self, params, cfg: ModelConfig, *, method: str = "ar", drafter=None, budget: int = 64,
                 max_batch: int = 8, max_context: int | None = None, max_queue: int = 64, chunk_steps: int = 4,
                 eos_id: int | None = None, seed: int = 0):
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("chunk_steps", chunk_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        context = max_context or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        if isinstance(context, bool) or not isinstance(context, int) or context < 64 or context & (context - 1):
            raise ValueError(f"max_context must be a power of two >= 64 (prompts are padded to powers of two), "
                             f"got {context!r}")
        if context > cfg.max_position_embeddings:
            raise ValueError(f"max_context {context} exceeds the model's context of {cfg.max_position_embeddings}")
        if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
            raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {cfg.vocab_size})")
        self._method = make_method(cfg, method, drafter, budget)
        self.method, self.budget, self.extra_slots = self._method.name, self._method.budget, self._method.extra_slots
        self.params, self.cfg = params, cfg
        self.max_batch, self.max_context, self.max_queue, self.chunk_steps = max_batch, context, max_queue, chunk_steps
        self.eos_id = -1 if eos_id is None else int(eos_id)
        # tokens a row can commit in a chunk, plus one
        self._width = min(1 + chunk_steps * self._method.tokens_per_step, context)
        self._key = jax.random.key(seed)
        self._state = self._empty()
        self._active: dict[int, _Request] = {}  # by slot (engine thread only)
        self._temps = np.zeros((max_batch,), np.float32)
        self._pending: list[_Request] = []
        self._cancelled: set[int] = set()
        self._closing = False
        self._cond = threading.Condition()
        self._idle = threading.Event()
        self._ids = itertools.count(1)
        outcomes = {f"finished_{k}": 0 for k in ("stop", "length", "cancelled", "error")}
        self.counters = dict(prompt_tokens=0, generated_tokens=0, steps=0, row_steps=0, step_tokens=0,
                             chunk_seconds=0.0, last_step_seconds=0.0, prefills=0, **outcomes)
        self._thread = threading.Thread(target=self._run, name="kdtree-jax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------------------------
    # The callers' side (any thread)
    # ------------------------------------------------------------------------------------------------------------

    def submit(self, prompt: list[int], *, max_tokens: int, on_event: Callable[[Event], None],
               temperature: float = 0.0, seed: int = 0, ignore_eos: bool = False) -> int:
        """Queue one request; returns its id. on_event(Event) is called on the engine thread with each batch of new
        tokens, the last time with `finish` set. ValueError/TypeError for bad inputs (with the reason: token ids,
        max_tokens, temperature, seed; ContextOverflow when they do not fit a row), QueueFull, EngineClosed."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        need = len(prompt) + int(max_tokens) + self.extra_slots
        if need > self.max_context:
            raise ContextOverflow(f"prompt of {len(prompt)} tokens + max_tokens {max_tokens}"
                                  + (f" + {self.extra_slots} speculative slots" if self.extra_slots else "")
                                  + f" = {need} exceeds the server's context of {self.max_context} tokens")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        eos = None if ignore_eos or self.eos_id < 0 else self.eos_id
        req = prepare(self.cfg, [prompt], int(max_tokens), Sampler(temperature), eos, extra_slots=self.extra_slots)
        with self._cond:
            if self._closing or not self._thread.is_alive():
                raise EngineClosed("the engine is shut down")
            waiting = len(self._pending) - (self.max_batch - len(self._active))  # beyond the free slots
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are already waiting for a slot (the limit)")
            r = _Request(id=next(self._ids), tokens=req.tokens, lengths=req.lengths, chunk=req.chunk,
                         max_new=req.max_new, temperature=req.sampler.temperature, seed=int(seed), eos=req.eos_id,
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

    def complete(self, prompt: list[int], *, max_tokens: int, temperature: float = 0.0, seed: int = 0,
                 ignore_eos: bool = False, timeout: float | None = None) -> tuple[list[int], str]:
        """Blocking: (the generated token ids, finish reason). RuntimeError when the request fails."""
        events: queue.Queue[Event] = queue.Queue()
        self.submit(prompt, max_tokens=max_tokens, on_event=events.put, temperature=temperature, seed=seed,
                    ignore_eos=ignore_eos)
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
        """The engine's setup: method, budget, slots, context, chunk and device (for /health and benchmarks)."""
        return dict(method=self.method, budget=self.budget, max_batch=self.max_batch, max_context=self.max_context,
                    max_queue=self.max_queue, chunk_steps=self.chunk_steps, device=_device_name())

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

    def _empty(self):
        with trace_context(self.params, self.cfg):
            return _empty_state_jit(self._method, self.cfg, self._key, batch=self.max_batch, cache_len=self.max_context)

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
            except Exception as e:  # a device or compiler failure: the running requests fail, the engine goes on
                log.exception("engine iteration failed")
                for r in [*self._active.values(), *(r for r, _ in zip(admit, free) if r.slot < 0)]:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")
                self._state = self._empty()
        with self._cond:
            leftover, self._pending = [*self._pending, *self._active.values()], []
            self._active.clear()
        for r in leftover:
            self._deliver(r, Event([], "error", "the server is shutting down"))
        self._idle.set()

    def _iterate(self, admit: list[tuple[_Request, int]]) -> None:
        """Prefill `admit` into their slots, run one chunk for every live row, hand out the new tokens."""
        firsts = []
        with trace_context(self.params, self.cfg):
            for r, slot in admit:
                sampler = RowSampler(jnp.full((1,), r.temperature, jnp.float32))
                self._state, *first = _admit(
                    self._method, self.params, self.cfg, self._state, jnp.int32(slot), jnp.asarray(r.tokens),
                    jnp.asarray(r.lengths), jax.random.key(r.seed), sampler, jnp.int32(r.max_new), jnp.int32(r.eos),
                    chunk=r.chunk)
                r.slot, r.shown = slot, 1  # the first token is read below, while the chunk runs
                self._active[slot] = r
                self._temps[slot] = r.temperature
                firsts.append((r, first))
            with self._cond:
                self.counters["prefills"] += len(admit)
                self.counters["prompt_tokens"] += sum(int(r.lengths[0]) for r, _ in admit)
            chunk = None
            if self._active:
                t0 = time.perf_counter()
                live = np.zeros((self.max_batch,), bool)
                live[list(self._active)] = True
                since = np.array([self._row_start(self._active[s]) + self._active[s].shown if live[s] else 0
                                  for s in range(self.max_batch)], np.int32)
                # every live row greedy: the static greedy Sampler (no draws to throw away), else one per row
                sampler = RowSampler(jnp.asarray(self._temps)) if self._temps[live].any() else Sampler()
                self._state, *chunk = _advance(
                    self._method, self.params, self.cfg, self._state, jnp.asarray(~live), jnp.asarray(since),
                    sampler, steps=self.chunk_steps, width=self._width)
        for r, first in firsts:
            token, done, nonfinite = (int(np.asarray(x)[0]) for x in first)
            self._hand_out(r, [token], bool(done), bool(nonfinite))
        if chunk is not None:
            window, start, steps, row_steps, step_tokens = jax.device_get(chunk)
            num_out, done, nonfinite = jax.device_get((self._state.num_out, self._state.done, self._state.nonfinite))
            seconds = time.perf_counter() - t0
            with self._cond:
                self.counters["steps"] += int(steps)
                self.counters["row_steps"] += int(row_steps)
                self.counters["step_tokens"] += int(step_tokens)
                self.counters["chunk_seconds"] += seconds
                self.counters["last_step_seconds"] = seconds / max(int(steps), 1)
            for slot, r in list(self._active.items()):
                lo = self._row_start(r) + r.shown - int(start[slot])
                new = window[slot, lo:int(num_out[slot]) - int(start[slot])].tolist()
                r.shown += len(new)
                self._hand_out(r, new, bool(done[slot]), bool(nonfinite[slot]))

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
