"""The API: `generate` (prefill, then a `lax.while_loop` of steps, compiled as one function), `stream` (the same loop
resumed a few steps at a time, for showing text as it comes) and `forward` (teacher-forced logits).

Input checks run on the host before anything compiles (the rules of `kdtree_jax.validate`, and `check_params`: the
params must have the layout of the cfg they come with); the loop itself never returns to the host. `method="ar"` is
plain autoregressive decoding; "ddtree" and "chain" are the speculative methods of `kdtree_jax.ddtree` (lossless:
at temperature 0 they return exactly the "ar" tokens). All three are run by the driver of `kdtree_jax.decoding`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Generator

import jax
import jax.numpy as jnp
import numpy as np

from .budget import BudgetPolicy, resolve
from .config import ModelConfig
from .ddtree import speculative
from .decoding import (AR, DecodeState, GenerateOutput, Method, Request, Sampler, advance, finish, prepare, run,
                       run_compiled, start, stream_tokens)
from . import validate
from .model import MoE, Params, abstract_params
from .model import forward as model_forward
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


_CALLS = {"generate": "generate(params, cfg, prompts, ...)", "stream": "stream(params, cfg, prompt, ...)",
          "forward": "forward(params, cfg, tokens)"}


def _unpack(params, cfg, prompts, drafter, fn: str = "generate"):
    """Accept generate(model, prompts) as well as generate(params, cfg, prompts); the params checked against cfg.
    `fn` names the call in messages ("generate", "stream" or "forward")."""
    if hasattr(params, "params") and hasattr(params, "cfg"):
        model = params
        if not isinstance(model.cfg, ModelConfig):  # a drafter: it was an AttributeError deep in the checks
            raise TypeError(f"{fn}'s first argument is a {type(model).__name__} whose cfg is a "
                            f"{type(model.cfg).__name__}, not a model: the target comes first ({fn}(model, ...) "
                            f"with kj.load's model, or {_CALLS[fn]}), a drafter goes in drafter=")
        if prompts is None and cfg is not None and not isinstance(cfg, ModelConfig):
            prompts, cfg = cfg, None
        if cfg is not None and cfg != model.cfg:
            raise ValueError("a loaded model carries its own cfg; do not pass a different one")
        return model.params, model.cfg, prompts, drafter if drafter is not None else getattr(model, "drafter", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"{_CALLS[fn]} needs a ModelConfig as cfg, got {type(cfg).__name__}")
    check_params(params, cfg)
    check_dtype(params, cfg)
    return params, cfg, prompts, drafter


def check_dtype(params, cfg: ModelConfig) -> None:
    """Raise a ValueError when the params (params.embed) are not in cfg.dtype: decoding keeps its cache and
    activations in cfg.dtype, and params of another dtype failed deep in JAX, naming no argument. Checked by
    `generate`, `stream` and the serving Engine."""
    dtype = getattr(params.embed, "dtype", None)
    if dtype is not None and jnp.dtype(dtype) != cfg.jnp_dtype:
        raise ValueError(f"params.embed has dtype {jnp.dtype(dtype)} but cfg.dtype is {cfg.dtype!r}: decoding runs "
                         f"in cfg.dtype; cast the params to it, or give a cfg of their dtype "
                         f"(dataclasses.replace(cfg, dtype=...))")


def _leaves(tree) -> dict[str, Any]:
    """{path as jax writes it (".layers[0].attn.q_b"): leaf} of a pytree."""
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@functools.lru_cache(maxsize=16)
def _expected(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    return _leaves(abstract_params(cfg))


# what decides that an array exists at all (structure, not shape), by a piece of its path: routed experts are
# INT4 (packed, scale) or dense; the query's LoRA norm exists with q_lora_rank
_STRUCTURE_FIELDS = {".mlp.we_": "expert_format", ".q_a_norm": "q_lora_rank"}


def _shape_fields(cfg: ModelConfig, path: str, dim: int) -> list[str]:
    """The integer config fields that dimension `dim` of the array at `path` follows: those whose change changes it
    (each doubled in turn; values the config refuses are skipped)."""
    want = _expected(cfg)[path].shape[dim]
    fields = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "num_hidden_layers" or isinstance(value, bool) or not isinstance(value, int):
            continue
        try:
            other = _expected(dataclasses.replace(cfg, **{f.name: 2 * value})).get(path)
        except (ValueError, TypeError, ZeroDivisionError):
            continue
        if other is not None and other.shape[dim] != want:
            fields.append(f.name)
    return fields


def check_params(params, cfg: ModelConfig) -> None:
    """Raise a ValueError when `params` do not have the layout `init_params(cfg)` makes (arrays, their shapes),
    naming the first array that differs, its shape and the config field(s) that shape follows; a TypeError when they
    are not model parameters at all. Dtypes are not compared (a model may run in another precision)."""
    layers = getattr(params, "layers", None)
    if not isinstance(layers, tuple) or not all(hasattr(params, k) for k in ("embed", "final_norm", "lm_head")):
        raise TypeError(f"params must be a kdtree_jax.Params (init_params, kj.load), got {type(params).__name__}")
    if len(layers) != cfg.num_hidden_layers:
        raise ValueError(f"params have {len(layers)} decoder layers but cfg.num_hidden_layers is "
                         f"{cfg.num_hidden_layers}: they were made for another config")
    for i, layer in enumerate(layers):
        moe, want_moe = isinstance(getattr(layer, "mlp", None), MoE), i >= cfg.num_dense_layers
        if moe != want_moe:
            raise ValueError(f"params.layers[{i}].mlp is a {'MoE' if moe else 'dense MLP'} but cfg makes it a "
                             f"{'MoE' if want_moe else 'dense MLP'} (it follows cfg.first_k_dense_replace = "
                             f"{cfg.first_k_dense_replace}): the params were made for another config")
    got, want = _leaves(params), _expected(cfg)
    missing, extra = [p for p in want if p not in got], [p for p in got if p not in want]
    if missing or extra:
        path, problem = (missing[0], "lack") if missing else (extra[0], "have")
        field = next((f for piece, f in _STRUCTURE_FIELDS.items() if piece in path), None)
        raise ValueError(f"params {problem} the array params{path}, which cfg "
                         + ("declares" if missing else "does not declare")
                         + (f" (it follows cfg.{field} = {getattr(cfg, field)!r})" if field else "")
                         + ": they were made for another config")
    for path, w in want.items():
        shape = tuple(getattr(got[path], "shape", ()))
        if shape != tuple(w.shape):
            dims = [i for i, (a, b) in enumerate(zip(shape, w.shape)) if a != b] if len(shape) == len(w.shape) else []
            fields = _shape_fields(cfg, path, dims[0]) if dims else []
            follows = (f" (dimension {dims[0]} follows " + ", ".join(f"cfg.{f} = {getattr(cfg, f)}" for f in fields)
                       + ")") if fields else ""
            raise ValueError(f"params{path} has shape {shape} but cfg gives {tuple(w.shape)}{follows}: the params "
                             "were made for another config")


def seed_key(seed: int) -> jax.Array:
    """The PRNG key of a seed in [0, 2**63): key(seed) below 2**32, else key(the low word) with the high word folded
    in (jax.random.key keeps only 32 bits without x64, so every seed gets its own key either way)."""
    seed = validate.seed(seed)
    key = jax.random.key(seed & 0xFFFFFFFF)
    return jax.random.fold_in(key, seed >> 32) if seed >> 32 else key


def forward(params: Params | Any, cfg: ModelConfig | None = None, tokens=None, return_hidden: bool = False):
    """Teacher-forced logits: tokens [B, T] (token ids in [0, vocab_size), at least one row of at least one token,
    T within the model's context) -> logits [B, T, V] float32 (`kdtree_jax.model.forward`), after the checks
    `generate` makes: cfg a ModelConfig, params of its layout, the ids in the vocabulary. `forward(params, cfg,
    tokens)` or `forward(model, tokens)` with a loaded model. With `return_hidden`, returns (logits, hidden [L, B, T,
    D]) with every decoder layer's output. Traced tokens (inside jit) are checked for shape only."""
    if hasattr(params, "params") and hasattr(params, "cfg"):
        params, cfg, tokens, _ = _unpack(params, cfg, tokens, None, "forward")
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"forward(params, cfg, tokens) needs a ModelConfig as cfg, got {type(cfg).__name__}")
    if tokens is None:
        raise TypeError("forward needs tokens: forward(params, cfg, tokens) or forward(model, tokens)")
    check_params(params, cfg)
    validate.flag("return_hidden", return_hidden)
    if isinstance(tokens, jax.core.Tracer) or (isinstance(tokens, jax.Array) and not tokens.is_fully_addressable):
        if tokens.ndim != 2 or 0 in tokens.shape or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be integer ids [B, T] with B, T >= 1, got {tokens.dtype} {tokens.shape}")
    else:
        rows = validate.token_rows(tokens, cfg.vocab_size, name="tokens", row="row")
        if len({len(r) for r in rows}) > 1:
            raise ValueError(f"tokens must be [B, T]: rows of one length, got lengths {[len(r) for r in rows]}")
        tokens = jnp.asarray(np.stack(rows)) if not isinstance(tokens, jax.Array) else tokens
    if tokens.shape[1] > cfg.max_position_embeddings:
        raise ValueError(f"tokens: {tokens.shape[1]} positions exceed the model's context of "
                         f"{cfg.max_position_embeddings} (max_position_embeddings)")
    return model_forward(params, cfg, tokens, return_hidden=return_hidden)


def check_auto(method: str, budget, max_budget, tiers=None, cost_model=None) -> bool:
    """Whether `budget` is "auto" (then method must be ddtree). Every budget argument is checked whatever the method
    (a method that does not use them still refuses nonsense: budget 'x' or -5 with method="ar"): budget "auto" or an
    integer >= 1, max_budget an integer >= 1; tiers and cost_model shape budget="auto" alone, so they are refused
    without it (they would be ignored)."""
    auto = isinstance(budget, str) and budget == "auto"
    if auto and method != "ddtree":
        raise ValueError(f"budget='auto' chooses ddtree's tree size; method={method!r} has no budget")
    if not auto:
        validate.integer("budget", budget, 1)
    validate.integer("max_budget", max_budget, 1)  # a numpy integer too, as every integer argument
    given = [name for name, value in (("tiers", tiers), ("cost_model", cost_model)) if value is not None]
    if given and not auto:
        raise ValueError(f"{' and '.join(given)}: for budget='auto' alone (budget={budget!r} would ignore them)")
    return auto


def auto_method(params, cfg: ModelConfig, drafter, *, batch: int, max_budget: int, tiers=None,
                cost_model=None) -> Method:
    """ddtree with budget="auto" for `batch` rows: trees of max_budget nodes, each step verifying the part that the
    cost model (`budget.resolve`: the given one, the saved one for this setup, or one measured now) makes pay."""
    max_budget = validate.integer("max_budget", max_budget, 1)
    m = make_method(cfg, "ddtree", drafter, max_budget)  # the drafter and max_budget checked before any calibration
    cost = resolve(params, cfg, drafter, batch=batch, max_budget=max_budget, tiers=tiers, cost_model=cost_model)
    return m.with_policy(BudgetPolicy.choosing(cost))


def _request(params, cfg, prompts, drafter, *, max_new_tokens, method, budget, temperature, top_k, top_p, eos_id,
             prefill_chunk, seed, max_budget=64, tiers=None, cost_model=None) -> tuple[Method, Request]:
    """The method and the checked, padded inputs (every argument checked before a cost model is measured)."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(params)):
        raise TypeError(f"params hold traced values: {validate.TRACED_HINT}")
    validate.seed(seed)
    auto = check_auto(method, budget, max_budget, tiers, cost_model)
    try:
        m = make_method(cfg, method, drafter, max_budget if auto else budget)
    except ValueError as e:  # budget="auto": the tree that does not fit is max_budget's
        raise (ValueError(f"max_budget (budget='auto'): {e}") if auto else e) from None
    req = prepare(cfg, prompts, max_new_tokens, Sampler(temperature, top_k, top_p), eos_id,
                  extra_slots=m.extra_slots, prefill_chunk=prefill_chunk)
    if auto:
        m = auto_method(params, cfg, drafter, batch=req.tokens.shape[0], max_budget=max_budget, tiers=tiers,
                        cost_model=cost_model)
    return m, req


def _start_args(m: Method, params, cfg: ModelConfig, req: Request, seed: int) -> tuple[tuple, dict]:
    args = (m, params, cfg, jnp.asarray(req.tokens), jnp.asarray(req.lengths), seed_key(seed), jnp.int32(req.eos_id))
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
                      seed=seed, max_budget=max_budget, tiers=tiers, cost_model=cost_model)
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
    params, cfg, prompt, drafter = _unpack(params, cfg, prompt, drafter, "stream")
    prompt = validate.token_row(prompt, cfg.vocab_size)  # one prompt: its errors name `prompt`, not `prompts`
    m, req = _request(params, cfg, [prompt], drafter, max_new_tokens=max_new_tokens, method=method, budget=budget,
                      temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, prefill_chunk=prefill_chunk,
                      seed=seed, max_budget=max_budget, tiers=tiers, cost_model=cost_model)
    every = (max(1, 16 // m.tokens_per_step) if every is None  # a step count: int32 on the device
             else validate.integer("every", every, 1, validate.INT32_LIMIT))
    args, static = _start_args(m, params, cfg, req, seed)
    with trace_context(params, cfg):
        state = start(*args, **static)

    def resume(state: DecodeState, until) -> DecodeState:
        with trace_context(params, cfg):
            return advance(m, params, cfg, state, until, sampler=req.sampler)

    return (yield from stream_tokens(state, resume, every))
