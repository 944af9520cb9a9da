"""budget="auto": DDTree's node budget chosen every step, on the device, from a measured cost curve.

A bigger draft tree is not free in a 384-expert MoE: its nodes route to more experts, and verify reads their weights.
Acceptance meanwhile grows slowly with the budget. So every step, from the tree the drafter just proposed, the loop
picks how many of its nodes the target verifies:

* **Expected tokens.** The tree is built best-first at the largest budget; node i's path probability p_i (the product
  of the drafter's probabilities along its path) is the chance it is accepted if the target agrees with the drafter,
  and the expected tokens a step commits with a set S of nodes is 1 + sum of p_i over S per live row (DDTree's own
  objective). Over the whole batch the best S of m nodes is the m most probable nodes of all rows together; it is
  prefix-closed because a child is never more probable than its parent.
* **Cost.** `CostModel`: the measured seconds of one step of the compiled loop as a function of the tokens verified
  (live rows + chosen nodes), per *tier* (a node count compiled into the loop), plus a term per cached token of the
  live rows, plus a term for a step whose tier differs from the step before. Nodes not chosen are masked: routed to
  no expert (`model.step(active=...)`), so the MoE reads no weights for them, and never accepted. The tiers (by
  default up to 5: max/16, max/8, max/4, max/2, max, those >= 4) are separate step programs, each in a while loop of
  its own inside the decoding loop (`decoding.run_steps`), so a step that wants few nodes does not pay for the
  attention and dense layers of the largest, nor for a conditional. A tier of 0 nodes (opt-in: `tiers=(0, ...)`)
  verifies the bonus alone, and its steps between plans draft nothing: autoregressive steps that keep the
  drafter's context, for where no tree pays (a launch-bound model at concurrency, a drafter gone off its text).
* **Choice.** The tier and node count maximizing expected tokens per second, computed in the loop
  (`budget_policy`: `node_scores`, `BudgetPolicy.choose`; this module measures and keeps the cost models).
* **How often.** The plan (the tree at the largest budget, its scores, the choice) has a cost of its own, measured
  at calibration against the fixed program of the smallest tier. Where it exceeds 1% of a step (a small model's
  launch-bound steps), the loop plans every `replan`-th step and runs the planned tier's fixed program between
  (`choose_replan`).

Lossless as every fixed budget is: the nodes verified are a prefix-closed subtree chosen from the draft alone, and
every committed token is the target's own choice (docs/ddtree.md). How it compares with the fixed budgets, as
measured: docs/budget.md and benchmarks/results/auto_budget/.

The cost model is measured once per model shape, mesh, device, batch size and budget (`calibrate`: the same
compiled step with the node count forced, timed at every tier and several node counts, and at two contexts), saved
as JSON in the user cache directory (`cost_path`) and reused; `kdtree-jax bench --calibrate` does it ahead of time.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .budget_policy import BudgetPolicy, CostModel, check_tiers, choose_replan, default_tiers
from .config import ModelConfig, user_cache_dir
from .ddtree import no_draft, speculative
from .decoding import Sampler, _prefill_chunk, advance, start
from .sharding import current_mesh, trace_context

COST_VERSION = 2  # 2: the switch term


# --------------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------------


def cost_dir() -> str:
    """Where measured cost models are kept: $KDTREE_JAX_COSTS, else kdtree-jax/costs in the user cache directory
    ($XDG_CACHE_HOME, else ~/.cache)."""
    if os.environ.get("KDTREE_JAX_COSTS"):
        return os.environ["KDTREE_JAX_COSTS"]
    return user_cache_dir("costs")


def setup_key(cfg: ModelConfig, drafter, batch: int, tiers: tuple[int, ...]) -> dict:
    """What a cost model depends on: the model's and drafter's shapes and kernels, the mesh, the devices, the batch
    and the tiers (not the weights' values)."""
    mesh = current_mesh()
    dev = jax.devices()[0]
    return dict(model=dataclasses.asdict(cfg), drafter=repr(getattr(drafter, "cfg", type(drafter).__name__)),
                mesh=None if mesh is None else dict(mesh.shape), platform=dev.platform,
                device=getattr(dev, "device_kind", dev.platform), devices=jax.device_count(), batch=int(batch),
                tiers=list(tiers), jax=jax.__version__, version=COST_VERSION)


def cost_path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    name = f"{key['device']}-b{key['batch']}-n{key['tiers'][-1]}-{digest}".replace(" ", "_").replace("/", "_")
    return os.path.join(cost_dir(), name + ".json")


def cost_record(cost: CostModel, meta: dict) -> dict:
    """The cost model as plain JSON data (tiers, points, per_context, context, switch, replan, fixed) with its
    meta."""
    return dict(tiers=list(cost.tiers), points=cost.points(), per_context=float(cost.per_context),
                context=float(cost.context), switch=float(cost.switch), replan=cost.replan,
                fixed=[float(f) for f in np.asarray(cost.fixed)], meta=meta)


def from_record(data: dict, batch: int, per_context: float | None = None) -> CostModel:
    """The cost model of a `cost_record` (per_context: instead of the record's). Records written before a term
    existed get its neutral value: switch 0, replan 1 (every step planned), fixed the curves at every node."""
    return CostModel.from_points(data["tiers"], batch, [[tuple(p) for p in pts] for pts in data["points"]],
                                 data["per_context"] if per_context is None else per_context, data["context"],
                                 data.get("switch", 0.0), data.get("replan", 1), data.get("fixed"))


def save(cost: CostModel, path: str, meta: dict | None = None) -> None:
    """Write the cost model as JSON, atomically (a temporary file renamed into place: never half-written)."""
    data = dict(version=COST_VERSION, batch=cost.batch, **cost_record(cost, meta or {}))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str) -> tuple[CostModel, dict]:
    """(cost model, meta) from a file `save` wrote; ValueError naming the file and the problem otherwise."""
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != COST_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {COST_VERSION}")
        return from_record(data, data["batch"]), data.get("meta", {})
    except OSError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ValueError(f"cost model file {path} is unreadable ({type(e).__name__}: {e}); measure one with "
                         "`kdtree-jax bench --calibrate` (or, if it is the one kept for this setup, delete it: the "
                         "next auto run measures it again)") from None


# --------------------------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------------------------


def calibration_nodes(size: int) -> list[int]:
    """Node counts per row timed at a tier of `size` nodes: 0, the powers of two below it, and itself."""
    return sorted({0, size} | {1 << k for k in range(size.bit_length()) if 1 << k < size})


def prefilled(method, params, cfg: ModelConfig, batch: int, context: int, *, t_pad: int, cache_len: int, room: int):
    """The loop state of `method` after prefilling `batch` random prompts of `context` tokens (padded to t_pad; a
    cache of cache_len slots; room for `room` new tokens), greedy: the state every timed run starts from."""
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, t_pad)), jnp.int32)
    with trace_context(params, cfg):  # long prompts in chunks, as generate prefills them (bounded memory)
        return start(method, params, cfg, toks, jnp.full((batch,), context, jnp.int32), jax.random.key(0),
                     jnp.int32(-1), sampler=Sampler(), cache_len=cache_len, max_new=room,
                     chunk=_prefill_chunk(None, t_pad))


def time_loop(method, params, cfg: ModelConfig, state0, steps: int, repeats: int, marginal: bool = True) -> float:
    """Seconds per step of the compiled loop (`decoding.advance`) from a copy of state0, as a long run pays it: the
    difference between runs of 2 x `steps` and `steps` steps, over the steps between (what a call pays once, its
    entry and first launches, drops out), the median of `repeats` pairs after one warm-up (which compiles). state0
    needs room for 2 x `steps` steps (`calibration_geometry`). marginal=False: a run of `steps` steps over its
    steps (a third of the time; for steps long enough that the entry does not count)."""

    def once(n: int) -> tuple[float, int]:
        s = jax.block_until_ready(jax.tree.map(jnp.copy, state0))
        t = time.perf_counter()
        with trace_context(params, cfg):
            s = advance(method, params, cfg, s, jnp.int32(n), sampler=Sampler())
        jax.block_until_ready(s.out)
        return time.perf_counter() - t, int(s.steps) - int(state0.steps)

    per = []
    for _ in range(repeats + 1):
        if not marginal:
            t1, n1 = once(steps)
            per.append(t1 / max(n1, 1))
            continue
        (t1, n1), (t2, n2) = once(steps), once(2 * steps)
        whole = t2 / max(n2, 1)
        per.append(max((t2 - t1) / (n2 - n1), 0.1 * whole) if n2 > n1 else whole)  # never <= 0 from noise
    return statistics.median(per[1:])


def calibration_geometry(cfg: ModelConfig, method, context: int | None, steps: int) -> tuple[int, int, dict]:
    """(near context, far context, prefilled's t_pad / cache_len / room) of a calibration: `context` (default 128,
    or less for short models) and 4x it, in one cache shape (so that one compiled loop serves both)."""
    room = 2 * (steps + steps % 2) * method.tokens_per_step + 1  # time_loop runs 2 x steps (even, for the switch)
    limit = cfg.max_position_embeddings - room - method.extra_slots
    c0 = min(128, limit // 4) if context is None else int(context)
    c1 = min(4 * c0, limit)
    if c0 < 1 or c1 <= c0:
        raise ValueError(f"calibration: context {c0} leaves no room in {cfg.max_position_embeddings} positions")
    t_pad = 1 << (c1 - 1).bit_length()
    cache_len = -(-max(t_pad, c1 + room + method.extra_slots) // 64) * 64
    return c0, c1, dict(t_pad=t_pad, cache_len=cache_len, room=room)


def calibrate(params, cfg: ModelConfig, drafter, *, batch: int, max_budget: int, tiers=None, context: int | None = None,
              steps: int = 4, repeats: int = 3, log: Callable[[str], None] | None = None,
              marginal: bool = True) -> tuple[CostModel, dict]:
    """Measure the cost model of the auto method for `batch` rows: the compiled loop, with the nodes per row forced,
    timed per step (`time_loop`: `steps` more steps, median of `repeats`; `marginal`) from the same prefilled state
    at every tier and node count in
    `calibration_nodes`, at `context` cached tokens (default: 128, or less for short models), and at the largest
    tier again at 4x that context for the per-token term. Random prompts; greedy. Returns (cost model, meta)."""
    tiers = check_tiers(default_tiers(max_budget) if tiers is None else tiers, max_budget)
    policy = BudgetPolicy.choosing(CostModel.from_points(tiers, batch, [[(1.0, 1.0)]] * len(tiers)))
    method = speculative(cfg, "ddtree", drafter, max_budget).with_policy(policy)
    c0, c1, geometry = calibration_geometry(cfg, method, context, steps)
    state = partial(prefilled, method, params, cfg, batch, **geometry)
    timed = lambda s0, pol: time_loop(method.with_policy(pol), params, cfg, s0, steps, repeats, marginal)
    log = log or (lambda s: None)
    t0 = time.perf_counter()
    s0 = state(c0)
    points = []
    total = sum(len(calibration_nodes(t)) for t in tiers) + 2 + (len(tiers) > 1)
    done = 0
    for i, size in enumerate(tiers):
        pts = []
        for r in calibration_nodes(size):
            sec = timed(s0, policy.forced(i, r))
            pts.append((batch * (1 + r), sec))
            done += 1
            log(f"calibrating budget=auto [{done}/{total}]: tier {size}, {r} nodes per row x {batch} rows: "
                f"{1e3 * sec:.2f} ms per step")
        points.append(pts)
    switch = 0.0
    if len(tiers) > 1:  # the first and the last tier in turn, every node: what a change of tier adds to a step
        # (time_loop's difference of k and 2k steps: k even, so it holds as many steps of each tier)
        turns = time_loop(method.with_policy(policy.alternating(tiers[-1])), params, cfg, s0, steps + steps % 2,
                          repeats, marginal)
        switch = max(0.0, turns - (points[0][-1][1] + points[-1][-1][1]) / 2)
        done += 1
        log(f"calibrating budget=auto [{done}/{total}]: tiers {tiers[0]} and {tiers[-1]} in turn: {1e3 * turns:.2f} ms "
            f"per step ({1e3 * switch:.2f} ms per change of tier)")
    # the plan's own cost: the smallest tier with every node (the plan runs, as it does every planned step) against
    # the fixed program of that size (no plan), from the same state; it sets how often the loop plans (`replan`)
    # (a tier of 0 nodes drafts nothing between plans, so the smallest tier that drafts is the one compared)
    fixed_time = lambda size: time_loop(speculative(cfg, "ddtree", drafter, size) if size else no_draft(cfg, drafter),
                                        params, cfg, s0, steps, repeats, marginal)
    first = next(i for i, t in enumerate(tiers) if t > 0)
    fixed = fixed_time(tiers[first])
    plan_s = points[first][-1][1] - fixed
    replan = choose_replan(max(plan_s, 0.0), fixed)
    done += 1
    log(f"calibrating budget=auto [{done}/{total}]: fixed budget {tiers[first]}: {1e3 * fixed:.2f} ms per step (the "
        f"plan costs {1e3 * plan_s:.2f} ms: plan every {replan} step{'s' if replan > 1 else ''})")
    fixed_all = None
    if replan > 1:  # most steps run a tier's fixed program: what each costs (the choice weighs them, `choose`)
        fixed_all = []
        total += len(tiers) - 1
        for i, size in enumerate(tiers):
            fixed_all.append(fixed if i == first else fixed_time(size))
            if i != first:
                done += 1
                log(f"calibrating budget=auto [{done}/{total}]: fixed budget {size}{' (no draft)' * (size == 0)}: "
                    f"{1e3 * fixed_all[-1]:.2f} ms per step")
    del s0  # one prefilled cache at a time (K2 at C=10 x 16k: 12 GB each, and time_loop copies it)
    far = timed(state(c1), policy.forced(len(tiers) - 1, tiers[-1]))
    near = points[-1][-1][1]
    per_context = max(0.0, (far - near) / (batch * (c1 - c0)))
    log(f"calibrating budget=auto [{total}/{total}]: context {c1}: {1e3 * far:.2f} ms per step "
        f"({1e9 * per_context:.2f} ns per row and cached token); {time.perf_counter() - t0:.1f} s in all")
    cost = CostModel.from_points(tiers, batch, points, per_context, c0, switch, replan, fixed_all)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), context=c0, far_context=c1,
                far_seconds=far, fixed_seconds=fixed, plan_seconds=plan_s, steps=steps, repeats=repeats,
                marginal=marginal, device=str(jax.devices()[0]))
    return cost, meta


def resolve(params, cfg: ModelConfig, drafter, *, batch: int, max_budget: int, tiers=None, cost_model=None,
            log: Callable[[str], None] | None = None) -> CostModel:
    """The cost model for an auto run: `cost_model` itself (a CostModel or the path of a saved one), else the one
    saved for this setup (`cost_path`), else one measured now (`calibrate`) and saved there."""
    tiers = check_tiers(default_tiers(max_budget) if tiers is None else tiers, max_budget)
    if isinstance(cost_model, CostModel):
        cost = cost_model
    elif isinstance(cost_model, (str, os.PathLike)):
        if not os.path.isfile(cost_model):
            raise ValueError(f"cost model file {os.fspath(cost_model)} does not exist (or is not a file)")
        cost, _ = load(os.fspath(cost_model))
    elif cost_model is None:
        with trace_context(params, cfg):
            path = cost_path(setup_key(cfg, drafter, batch, tiers))
        if os.path.exists(path):
            cost, _ = load(path)
        else:
            say = log or (lambda s: print(f"[kdtree-jax] {s}", file=sys.stderr, flush=True))
            say(f"budget='auto': no cost model for this setup yet; measuring it once (saved to {path})")
            cost, meta = calibrate(params, cfg, drafter, batch=batch, max_budget=max_budget, tiers=tiers, log=say)
            save(cost, path, meta)
    else:
        raise TypeError(f"cost_model must be a CostModel, a path or None, got {type(cost_model).__name__}")
    check_matches(cost, batch, tiers, max_budget)
    return cost


def check_matches(cost: CostModel, batch: int, tiers: tuple[int, ...], max_budget: int) -> None:
    """A ValueError unless the cost model was measured for `batch` rows and these tiers."""
    if cost.tiers != tuple(tiers) or cost.batch != batch:
        raise ValueError(f"the cost model was measured for batch {cost.batch} and tiers {cost.tiers}; this run has "
                         f"batch {batch} and tiers {tuple(tiers)} (max_budget {max_budget}); use the same batch (the "
                         f"server: --max-batch) and max_budget, or measure one for this setup (`kdtree-jax bench "
                         f"--calibrate --batch {batch} --max-budget {max_budget}`)")
