"""What every decoding method shares: request checks and layout, sampling, committing tokens, compile-and-run
with timing, and the host-side result. The methods (`generate`'s AR loop, `ddtree`'s speculative loop) build on it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .distributed import to_host
from .sharding import trace_context


@dataclasses.dataclass
class GenerateOutput:
    """tokens: per prompt, the generated ids (ending with EOS when one was produced).
    stats: steps (target forwards after prefill), tau (tokens committed per step, bonus included),
    tau_histogram, compile_s, wall_s, tokens_per_s, method, budget."""

    tokens: list[list[int]]
    stats: dict[str, Any]


def nonfinite_rows(logits: jax.Array) -> jax.Array:
    """bool [B]: rows of logits [B, ...] holding a NaN or an inf (one cheap reduction next to the vocab matmul)."""
    return ~jnp.all(jnp.isfinite(logits.reshape(logits.shape[0], -1)), axis=-1)


def choose(logits: jax.Array, key: jax.Array, temperature: jax.Array, greedy: bool) -> jax.Array:
    """The target's token for logits [B, ..., V]: argmax when greedy, else a sample at `temperature`: one scalar, or
    one per row f32 [B] where a row at 0 takes the argmax (requests with their own temperatures in one batch)."""
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return top
    if jnp.ndim(temperature) == 0:
        return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)
    t = temperature.reshape(-1, *(1,) * (logits.ndim - 1))  # [B, 1, ..., 1]
    sample = jax.random.categorical(key, logits / jnp.where(t > 0, t, 1.0), axis=-1).astype(jnp.int32)
    return jnp.where(t[..., 0] > 0, sample, top)


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
    temperature: float
    eos_id: int  # -1: none
    chunk: int | None = None  # prefill in chunks of this many tokens (None: one pass)


def prepare(cfg: ModelConfig, prompts, max_new_tokens: int, temperature: float = 0.0, eos_id: int | None = None,
            extra_slots: int = 0, prefill_chunk: int | None = None) -> Request:
    """Check the inputs and lay them out; every error is a ValueError/TypeError naming the problem.

    `extra_slots` is the room the method needs past the last token (the speculative tree's nodes).
    """
    if isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts as an array must be [B, T], got shape {arr.shape}")
        prompts = [list(r) for r in arr]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists (or a [B, T] array)")
    if all(isinstance(p, (int, np.integer)) for p in prompts):
        raise ValueError("prompts must be a list of prompts (a list of token-id lists); wrap a single prompt in []")
    rows = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.size == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D sequence of token ids, got shape {a.shape}")
        if not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"prompt {i} must hold integer token ids, got dtype {a.dtype}")
        if a.min() < 0 or a.max() >= cfg.vocab_size:
            bad = int(a[(a < 0) | (a >= cfg.vocab_size)][0])
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {cfg.vocab_size})")
        rows.append(a.astype(np.int32))
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    tiny, huge = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    if 0 < temperature < tiny or temperature > huge:  # sampling divides float32 logits by it
        raise ValueError(f"temperature {temperature!r} is outside float32's normal range [{tiny:.4g}, {huge:.4g}] "
                         "(it would round to 0 or inf); use 0 for greedy decoding")
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary [0, {cfg.vocab_size})")
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
                   cache_len=_round_up(max(t_pad, need), 64), temperature=float(temperature),
                   eos_id=-1 if eos_id is None else int(eos_id), chunk=_prefill_chunk(prefill_chunk, t_pad))


def _histogram_stats(accepted: np.ndarray, steps: int) -> dict:
    hist = accepted.sum(axis=0)  # [N + 1]: count of (row, step) pairs that committed i tokens
    total_steps = int(hist.sum())
    tau = float((hist * np.arange(len(hist))).sum() / total_steps) if total_steps else 0.0
    last = int(np.nonzero(hist)[0].max()) + 1 if hist.any() else 1
    return {"steps": steps, "tau": tau, "tau_histogram": hist[:last].tolist()}


_COMPILED: dict = {}  # compiled executables by function, argument shapes and static arguments


def run_compiled(fn, args: tuple, static: dict):
    """Compile fn for these argument shapes (cached), then run it; returns (result, {compile_s, wall_s})."""
    flat, tree = jax.tree.flatten((args, static), is_leaf=lambda x: isinstance(x, ModelConfig))
    sig = (fn, tree, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) if hasattr(x, "shape") else x
                           for x in flat))
    t0 = time.perf_counter()
    compiled = _COMPILED.get(sig)
    if compiled is None:
        cfg = next(a for a in args if isinstance(a, ModelConfig))
        with trace_context(args, cfg):
            compiled = fn.lower(*args, **static).compile()
        _COMPILED[sig] = compiled
    t1 = time.perf_counter()
    dyn = tuple(a for a in args if not isinstance(a, ModelConfig))
    result = jax.block_until_ready(compiled(*dyn))
    t2 = time.perf_counter()
    return result, {"compile_s": t1 - t0, "wall_s": t2 - t1}


def check_finite(state) -> None:
    """Raise FloatingPointError naming the rows for which the model produced NaN or inf logits."""
    bad = np.flatnonzero(to_host(state.nonfinite))
    if bad.size:
        raise FloatingPointError(f"the model produced NaN or inf logits for prompt(s) {bad.tolist()} (non-finite "
                                 "weights or an overflow in the activations); no tokens are returned")


def finish(state, timing: dict, method: str, budget: int | None) -> GenerateOutput:
    """Host-side result: per-row token lists and the stats (FloatingPointError if logits were not finite).

    The stats have the same keys for every method: steps, tau, tau_histogram, compile_s (tracing and compilation),
    wall_s (the compiled run alone), method, budget, new_tokens (all rows) and tokens_per_s = new_tokens / wall_s.
    """
    check_finite(state)
    out, num = to_host(state.out), to_host(state.num_out)  # replicated: readable on every process
    tokens = [out[i, :num[i]].tolist() for i in range(out.shape[0])]
    stats = _histogram_stats(to_host(state.accepted), int(to_host(state.steps)))
    total = int(num.sum())
    stats.update(timing, method=method, budget=budget, new_tokens=total,
                 tokens_per_s=total / timing["wall_s"] if timing["wall_s"] > 0 else float("nan"))
    return GenerateOutput(tokens=tokens, stats=stats)
