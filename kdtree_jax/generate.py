"""`generate`: prefill, then a `lax.while_loop` of decode steps, compiled as one function.

Input checks run on the host before anything compiles; the loop itself never returns to the host.
`method="ar"` is plain autoregressive decoding; "ddtree" and "chain" are the speculative methods of
`kdtree_jax.ddtree` (lossless: at temperature 0 they return exactly the "ar" tokens).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .ddtree import generate_speculative
from .decoding import GenerateOutput, check_finite, choose, commit, finish, nonfinite_rows, prepare, run_compiled
from .distributed import to_host
from .model import KVCache, Params, init_cache, prefill_last, pytree_dataclass, step
from .sharding import trace_context

METHODS = ("ar", "chain", "ddtree")


@pytree_dataclass
class DecodeState:
    """The loop carry of autoregressive decoding."""

    cache: KVCache  # lengths[b] = tokens of row b in the cache (prompt + generated, minus `last`)
    out: jax.Array  # int32 [B, N]  generated tokens; -1 beyond num_out
    num_out: jax.Array  # int32 [B]     tokens generated so far
    done: jax.Array  # bool [B]      row finished (EOS or N tokens)
    last: jax.Array  # int32 [B]     newest token, not yet in the cache
    key: jax.Array  # PRNG key
    steps: jax.Array  # int32 []      decode steps run
    accepted: jax.Array  # int32 [B, N + 1] histogram of tokens committed per step and row
    nonfinite: jax.Array  # bool [B]      the model gave this row a NaN or inf logit (an error, not token 0)


def _ar_start(params, cfg: ModelConfig, tokens, lengths, key, cache_len: int, max_new: int, temperature, eos_id,
              greedy: bool, chunk: int | None = None) -> DecodeState:
    b = tokens.shape[0]
    last_logits, cache, _ = prefill_last(params, cfg, tokens, lengths, init_cache(cfg, b, cache_len), chunk)  # [B, V]
    key, sub = jax.random.split(key)
    first = choose(last_logits, sub, temperature, greedy)
    out = jnp.full((b, max_new), -1, jnp.int32)
    out, num_out, done, _ = commit(out, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), first[:, None],
                                    jnp.ones((b,), jnp.int32), eos_id, max_new)
    return DecodeState(cache=cache, out=out, num_out=num_out, done=done, last=first, key=key,
                       steps=jnp.zeros((), jnp.int32), accepted=jnp.zeros((b, max_new + 1), jnp.int32),
                       nonfinite=nonfinite_rows(last_logits))


def _ar_advance(params, cfg: ModelConfig, state: DecodeState, until, temperature, eos_id, greedy: bool):
    max_new = state.out.shape[1]

    def cond(s: DecodeState):
        return (s.steps < until) & ~jnp.all(s.done)

    def body(s: DecodeState):
        res = step(params, cfg, s.last[:, None], s.cache)
        key, sub = jax.random.split(s.key)
        nxt = choose(res.logits[:, 0], sub, temperature, greedy)
        active = ~s.done
        cache = dataclasses.replace(res.cache, lengths=res.cache.lengths + active.astype(jnp.int32))
        out, num_out, done, committed = commit(s.out, s.num_out, s.done, nxt[:, None],
                                                jnp.ones_like(s.num_out), eos_id, max_new)
        accepted = s.accepted.at[jnp.arange(nxt.shape[0]), committed].add(active.astype(jnp.int32))
        return DecodeState(cache=cache, out=out, num_out=num_out, done=done, last=jnp.where(active, nxt, s.last),
                           key=key, steps=s.steps + 1, accepted=accepted,
                           nonfinite=s.nonfinite | (active & nonfinite_rows(res.logits)))

    return jax.lax.while_loop(cond, body, state)


@partial(jax.jit, static_argnames=("cfg", "cache_len", "max_new", "greedy", "chunk"))
def _ar_generate(params, cfg, tokens, lengths, key, temperature, eos_id, *, cache_len, max_new, greedy, chunk):
    state = _ar_start(params, cfg, tokens, lengths, key, cache_len, max_new, temperature, eos_id, greedy, chunk)
    return _ar_advance(params, cfg, state, jnp.int32(max_new), temperature, eos_id, greedy)


_ar_start_jit = jax.jit(_ar_start, static_argnames=("cfg", "cache_len", "max_new", "greedy", "chunk"))
_ar_advance_jit = jax.jit(_ar_advance, static_argnames=("cfg", "greedy"), donate_argnames=("state",))


def _unpack(params, cfg, prompts, drafter):
    """Accept generate(model, prompts) as well as generate(params, cfg, prompts)."""
    if hasattr(params, "params") and hasattr(params, "cfg"):
        model = params
        if prompts is None and cfg is not None and not isinstance(cfg, ModelConfig):
            prompts, cfg = cfg, None
        if cfg is not None and cfg != model.cfg:
            raise ValueError("a loaded model carries its own cfg; do not pass a different one")
        return model.params, model.cfg, prompts, drafter if drafter is not None else getattr(model, "drafter", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"generate(params, cfg, prompts, ...) needs a ModelConfig as cfg, got {type(cfg).__name__}")
    return params, cfg, prompts, drafter


def generate(params: Params | Any, cfg: ModelConfig | None = None, prompts=None, *, max_new_tokens: int = 64,
             method: str = "ar", drafter=None, budget: int = 64, temperature: float = 0.0, seed: int = 0,
             eos_id: int | None = None, prefill_chunk: int | None = None) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens for each prompt (a list of token-id lists of any lengths).

    `generate(params, cfg, prompts, ...)` or `generate(model, prompts, ...)` with a loaded model. Greedy at
    temperature 0, else sampling at that temperature with `seed`. A row stops after `eos_id` (kept in its
    output). `method`: "ar", or "chain" / "ddtree" with a `drafter` and, for ddtree, a node `budget`.
    `prefill_chunk`: prompts go into the cache in chunks of this many tokens (bounded memory for long prompts);
    None chooses (chunks of 1,024 past 2,048 tokens), 0 forces one pass.
    """
    params, cfg, prompts, drafter = _unpack(params, cfg, prompts, drafter)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "ar":
        return generate_speculative(params, cfg, prompts, max_new_tokens=max_new_tokens, method=method,
                                    drafter=drafter, budget=budget, temperature=temperature, seed=seed,
                                    eos_id=eos_id, prefill_chunk=prefill_chunk)
    req = prepare(cfg, prompts, max_new_tokens, temperature, eos_id, prefill_chunk=prefill_chunk)
    args = (params, cfg, jnp.asarray(req.tokens), jnp.asarray(req.lengths), jax.random.key(seed),
            jnp.float32(req.temperature or 1.0), jnp.int32(req.eos_id))
    static = dict(cache_len=req.cache_len, max_new=req.max_new, greedy=req.temperature == 0, chunk=req.chunk)
    state, timing = run_compiled(_ar_generate, args, static)
    return finish(state, timing, method="ar", budget=None)


def stream_ar(params, cfg: ModelConfig, prompt: list[int], *, max_new_tokens: int, temperature: float = 0.0,
              seed: int = 0, eos_id: int | None = None, chunk: int = 16) -> Iterator[list[int]]:
    """Yield the tokens of one prompt in chunks of up to `chunk` decode steps (for the CLI's streaming output).

    The same jitted prefill and decode loop as `generate`, resumed every `chunk` steps from the donated state.
    """
    req = prepare(cfg, [prompt], max_new_tokens, temperature, eos_id)
    greedy, temp, eos = req.temperature == 0, jnp.float32(req.temperature or 1.0), jnp.int32(req.eos_id)
    with trace_context(params, cfg):
        state = _ar_start_jit(params, cfg, jnp.asarray(req.tokens), jnp.asarray(req.lengths), jax.random.key(seed),
                              cache_len=req.cache_len, max_new=req.max_new, temperature=temp, eos_id=eos,
                              greedy=greedy, chunk=req.chunk)
    shown = 0
    while True:
        check_finite(state)
        n = int(to_host(state.num_out)[0])
        if n > shown:
            yield to_host(state.out)[0, shown:n].tolist()
            shown = n
        if bool(to_host(state.done)[0]):
            return
        with trace_context(params, cfg):
            state = _ar_advance_jit(params, cfg, state, state.steps + chunk, temp, eos, greedy)
