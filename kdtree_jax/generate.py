"""The API's decoding: `generate` (prefill, then a `lax.while_loop` of steps, compiled as one function) and `stream`
(the same loop resumed a few steps at a time, for showing text as it comes).

Input checks run on the host before anything compiles; the loop itself never returns to the host. `method="ar"` is
plain autoregressive decoding; "ddtree" and "chain" are the speculative methods of `kdtree_jax.ddtree` (lossless:
at temperature 0 they return exactly the "ar" tokens). All three are run by the driver of `kdtree_jax.decoding`.
"""

from __future__ import annotations

from typing import Any, Generator

import jax
import jax.numpy as jnp

from .budget import BudgetPolicy, resolve
from .config import ModelConfig
from .ddtree import speculative
from .decoding import (AR, DecodeState, GenerateOutput, Method, Request, Sampler, advance, finish, prepare, run,
                       run_compiled, start, stream_tokens)
from .model import Params
from .sharding import trace_context

METHODS = ("ar", "chain", "ddtree")


def make_method(cfg: ModelConfig, method: str, drafter=None, budget: int = 64,
                policy: BudgetPolicy | None = None) -> Method:
    """The decoding method named `method` ("ar", "chain" or "ddtree"), its arguments checked; with a budget
    `policy` (ddtree only), the budget is the largest tree and each step verifies the part the policy picks."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if policy is not None and method != "ddtree":
        raise ValueError(f"budget='auto' chooses ddtree's tree size; method={method!r} has no budget")
    return AR() if method == "ar" else speculative(cfg, method, drafter, budget, policy)


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


def check_auto(method: str, budget, max_budget) -> bool:
    """Whether `budget` is "auto" (then method must be ddtree and max_budget an integer >= 1: checked here)."""
    auto = isinstance(budget, str) and budget == "auto"
    if auto and method != "ddtree":
        raise ValueError(f"budget='auto' chooses ddtree's tree size; method={method!r} has no budget")
    if auto and (isinstance(max_budget, bool) or not isinstance(max_budget, int) or max_budget < 1):
        raise ValueError(f"max_budget must be an integer >= 1, got {max_budget!r}")
    return auto


def auto_method(params, cfg: ModelConfig, drafter, *, batch: int, max_budget: int, tiers=None,
                cost_model=None) -> Method:
    """ddtree with budget="auto" for `batch` rows: trees of max_budget nodes, each step verifying the part that the
    cost model (`budget.resolve`: the given one, the saved one for this setup, or one measured now) makes pay."""
    m = make_method(cfg, "ddtree", drafter, max_budget)  # the drafter and max_budget checked before any calibration
    cost = resolve(params, cfg, drafter, batch=batch, max_budget=max_budget, tiers=tiers, cost_model=cost_model)
    return m.with_policy(BudgetPolicy.choosing(cost))


def _request(params, cfg, prompts, drafter, *, max_new_tokens, method, budget, temperature, top_k, top_p, eos_id,
             prefill_chunk, max_budget=64, tiers=None, cost_model=None) -> tuple[Method, Request]:
    auto = check_auto(method, budget, max_budget)
    m = make_method(cfg, method, drafter, max_budget if auto else budget)
    req = prepare(cfg, prompts, max_new_tokens, Sampler(temperature, top_k, top_p), eos_id,
                  extra_slots=m.extra_slots, prefill_chunk=prefill_chunk)
    if auto:
        m = auto_method(params, cfg, drafter, batch=req.tokens.shape[0], max_budget=max_budget, tiers=tiers,
                        cost_model=cost_model)
    return m, req


def _start_args(m: Method, params, cfg: ModelConfig, req: Request, seed: int) -> tuple[tuple, dict]:
    args = (m, params, cfg, jnp.asarray(req.tokens), jnp.asarray(req.lengths), jax.random.key(seed),
            jnp.int32(req.eos_id))
    return args, dict(sampler=req.sampler, cache_len=req.cache_len, max_new=req.max_new, chunk=req.chunk)


def generate(params: Params | Any, cfg: ModelConfig | None = None, prompts=None, *, max_new_tokens: int = 64,
             method: str = "ar", drafter=None, budget: int | str = 64, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, eos_id: int | None = None,
             prefill_chunk: int | None = None, max_budget: int = 64, tiers=None, cost_model=None) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens for each prompt (a list of token-id lists of any lengths).

    `generate(params, cfg, prompts, ...)` or `generate(model, prompts, ...)` with a loaded model. Greedy at
    temperature 0, else sampling at that temperature with `seed`, from the `top_k` most likely tokens and then the
    nucleus of mass `top_p` (`kdtree_jax.decoding.Sampler`). A row stops after `eos_id` (kept in its output).
    `method`: "ar", or "chain" / "ddtree" with a `drafter` and, for ddtree, a node `budget`: a number, or "auto":
    each step verifies the part of a `max_budget`-node tree that maximizes expected tokens per second under a cost
    model measured once for this setup (`kdtree_jax.budget`; `cost_model`: a CostModel or a saved file to use
    instead; `tiers`: the tree sizes compiled, default max/16, max/8, max/4, max/2, max, those >= 4).
    `prefill_chunk`: prompts go into the cache in chunks of this many tokens (bounded memory for long prompts);
    None chooses (chunks of 1,024 past 2,048 tokens), 0 forces one pass.
    """
    params, cfg, prompts, drafter = _unpack(params, cfg, prompts, drafter)
    m, req = _request(params, cfg, prompts, drafter, max_new_tokens=max_new_tokens, method=method, budget=budget,
                      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, prefill_chunk=prefill_chunk,
                      max_budget=max_budget, tiers=tiers, cost_model=cost_model)
    args, static = _start_args(m, params, cfg, req, seed)
    state, timing = run_compiled(run, args, static)
    return finish(state, timing, method=m.name, budget=m.budget)


def stream(params: Params | Any, cfg: ModelConfig | None = None, prompt=None, *, max_new_tokens: int = 64,
           method: str = "ar", drafter=None, budget: int | str = 64, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0, eos_id: int | None = None,
           prefill_chunk: int | None = None, every: int | None = None, max_budget: int = 64, tiers=None,
           cost_model=None) -> Generator[list[int], None, DecodeState]:
    """Yield the new tokens of one prompt (a token-id list) as `method` decodes them, lists of ids `every` steps
    (default: about 16 tokens' worth) at a time; the arguments are `generate`'s. The same compiled loop as
    `generate`, resumed from its donated state (`decoding.advance`); the same tokens. Returns the final loop state
    (the generator's return value; `decoding.step_stats` reads steps and tau from it)."""
    params, cfg, prompt, drafter = _unpack(params, cfg, prompt, drafter)
    m, req = _request(params, cfg, [prompt], drafter, max_new_tokens=max_new_tokens, method=method, budget=budget,
                      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, prefill_chunk=prefill_chunk,
                      max_budget=max_budget, tiers=tiers, cost_model=cost_model)
    if every is None:
        every = max(1, 16 // m.tokens_per_step)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an integer >= 1, got {every!r}")
    args, static = _start_args(m, params, cfg, req, seed)
    with trace_context(params, cfg):
        state = start(*args, **static)

    def resume(state: DecodeState, until) -> DecodeState:
        with trace_context(params, cfg):
            return advance(m, params, cfg, state, until, sampler=req.sampler)

    return (yield from stream_tokens(state, resume, every))
