"""The whole DDTree speculative loop at full scale: K2.6's per-device program of an ep=8 mesh on one GPU, the
jitted decoding loop against the sum of its stages, and a projection to 8 GPUs.

The target is `full_scale.per_device_model` (61 layers; 1/8 of the heads, vocabulary and dense widths, 48 of 384
experts, random weights). The drafter is a DFlash drafter as one device of 8 runs it (6 layers, block 8, 64/8
query heads, 8/8 key/value heads of 112, MLP 18,432/8; random weights). Its logits go through the target's lm_head,
which here is this device's vocabulary shard: the tree is built from that shard's 1/8 of the vocabulary (on a real
mesh the full distribution needs a gather of the shards' top candidates, a collective left out here like the
target's and the drafter's all-reduces). The drafter's context fusion (`fc`, 6 x 7,168 rows) is whole on this
device (a mesh splits its rows 8 ways): the keep stage reads ~0.5 GB more than a device of the mesh would.

ACCEPTANCE IS REPLAYED, NOT PRODUCED BY THESE WEIGHTS. Random weights accept next to nothing, so every stage runs
for real each step (draft, tree build, verify, the accept kernel, keep) while what is accepted comes from the
embedded model. By default (`--replay trace`, `trace_replay.py`) the tree is built from the embedded drafter's
recorded distributions at each row's text position and accept walks the embedded target's greedy choices there, so
the accepted length is the accept kernel's own and budget="auto" runs too (`--budgets ...,auto`: its cost model is
first measured on this model at the cell's C, `budget.calibrate`). With `--replay histogram` the method runs wrapped
(`Replayed`): each row commits a length drawn from the embedded model's measured histogram for that budget
(results/acceptance/acceptance.json, ddtree at budget b: index i = steps that committed i tokens); the committed
path is the accept kernel's path, continued down the tree's first children (any valid node where the tree ends).
Either way keep and the drafter's add_context run on the real shapes, and the cache grows by the committed length.
The loop starts from a state whose two caches hold `context` tokens of zeros (no prefill; `full_scale.time_step`
times its steps on such a cache too).

Measured for each cell (C rows, budget b, context 4,096):
  * the loop: `decoding.advance` compiled once (state donated), after a warm-up of a few steps, runs of S and 2S
    steps from the same context: "marginal" = (time of 2S - time of S) / S, what a long run pays a step;
    "whole" = time of S / S, with a call's entry spread over S steps;
  * its stages, each jitted and timed alone on the same shapes (median of repeats of 5 queued calls, as
    `full_scale.time_step`): draft (`Speculative.propose`), tree build (`ddtree_tree`), verify (`model.step` with the
    tree, the target's choice at every node, the non-finite check; its hidden states returned, as keep reads them),
    accept (`ddtree.accept`), keep (`Speculative.keep`), and the replay's own work (the histogram's draw, or the
    trace's choices put in place of the target's; not part of the real method); budget="auto" has no stages;
  * loop / sum of stages: the issue's goal is <= 1.1 at C=1 and C=10; the excess is loop overhead.
The drafter alone (the sharded one and the replicated one, 64 heads, 8 KV heads, MLP 18,432) at batch 1 and 10
against its bytes floor (its layers, final norm and the lm_head shard read once, the context keys and values up to
the context, at the copy bandwidth measured in the same run; `fc` is not read by a draft and not counted; the floor
of `full_scale.time_drafter`, which counts it, is given beside).

Projection to 8 GPUs per cell: tokens/s = C x tau / (loop step + 61 x the all-reduces of one layer), tau the mean
of the replayed lengths in the timed steps, the all-reduces `full_scale.COMM_PER_LAYER_S` (2 H200s, sharding.md) of
the cell's nodes or, failing that, of the 65-node cell (a bound); beside it a what-if at 2 x
`full_scale.FAST_ALLREDUCE_S` a layer and the quoted K2.5-DFlash acceptance (`full_scale.TAU_QUOTED`).

    python benchmarks/ddtree_full_scale.py                             # one H200: C = 1 and 10, budgets 8-64
    python benchmarks/ddtree_full_scale.py --cells 1 --budgets 8,16,auto --drafters 0   # with budget="auto"
    python benchmarks/ddtree_full_scale.py --cells 1                   # the same in two calls of ~5 min (each
    python benchmarks/ddtree_full_scale.py --cells 10 --drafters 0 --append   # cell compiles the loop and stages)
    python benchmarks/ddtree_full_scale.py --small --layers 2 --out /tmp/x   # CPU smoke run
    python benchmarks/ddtree_full_scale.py --replot results/ddtree_full_scale/ddtree_full_scale.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import kdtree_jax as kj  # noqa: E402
from common import ceilings  # noqa: E402
from full_scale import (COMM_PER_LAYER_S, FAST_ALLREDUCE_S, TAU_QUOTED, cut_model_note, nbytes,  # noqa: E402
                        per_device_model)
from trace_replay import Trace, Traced, record, traced  # noqa: E402
from kdtree_jax.budget import calibrate  # noqa: E402
from kdtree_jax.budget_policy import BudgetPolicy  # noqa: E402
from kdtree_jax.builtin import load_builtin  # noqa: E402
from kdtree_jax.ddtree import DraftTree, Path, Speculative, accept, speculative, verify  # noqa: E402
from kdtree_jax.decoding import Committed, DecodeState, Sampler, advance, no_reliability, nonfinite_rows  # noqa: E402
from kdtree_jax.drafter import draft, init_draft_cache  # noqa: E402
from kdtree_jax.model import StepOutput, init_cache  # noqa: E402
from kdtree_jax.sharding import trace_context  # noqa: E402
from kdtree_jax.train import corpus_split, load_tokens, windows  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ACCEPTANCE = os.path.join(HERE, "results", "acceptance", "acceptance.json")
BATCHES, BUDGETS = (1, 10), (8, 16, 32, 64)
SMALL_BATCHES, SMALL_BUDGETS = (1, 2), (8, 16)
STAGES = ("draft", "tree_build", "verify", "accept", "replay", "keep")
AUTO = "auto"  # a budget cell of budget="auto" (largest tree AUTO_MAX, default tiers), calibrated at its C here
AUTO_MAX = 64
GREEDY = Sampler()
# the drafter's shape: K2.5-DFlash (6 layers, 64 heads, 8 KV heads of 112, K2's dense MLP width); --small: a toy
DRAFTER = dict(num_layers=6, num_heads=64, num_kv_heads=8, head_dim=112, intermediate_size=18432)
SMALL_DRAFTER = dict(num_layers=1, num_heads=16, num_kv_heads=8, head_dim=8, intermediate_size=128)


# --------------------------------------------------------------------------------------------------------------
# Replayed acceptance
# --------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Replayed:
    """A fixed-budget `Speculative` whose every stage runs for real each step, but whose rows commit a length drawn
    from a histogram (`log_hist[i]`: log of the steps that committed i tokens) instead of the accept kernel's
    length. The path is the kernel's, continued down the tree (`replay`), so keep and the driver see the real
    shapes and the drawn counts. A pytree: the histogram is a leaf (another histogram reuses the compiled loop)."""

    inner: Speculative
    log_hist: jax.Array  # f32 [K + 1]

    name = property(lambda self: self.inner.name)
    budget = property(lambda self: self.inner.budget)
    tokens_per_step = property(lambda self: self.inner.tokens_per_step)
    extra_slots = property(lambda self: self.inner.extra_slots)
    max_nodes = property(lambda self: self.inner.max_nodes)
    phases = property(lambda self: 1)

    def start(self, params, cfg, tokens, lengths, cache, chunk):
        return self.inner.start(params, cfg, tokens, lengths, cache, chunk)

    def replay(self, tree: DraftTree, target: jax.Array, path: Path, key: jax.Array) -> Path:
        """The path of the drawn length: the accept kernel's nodes while they last, then each node's first child in
        the tree (node min(j, N - 1) where the tree has none: keep's cost does not depend on which nodes); its
        tokens as `accept` makes them (the path's tokens after the root, then the target's token at its last
        node). -1 past the length, as the kernel pads."""
        b, width = path.nodes.shape
        n = tree.tokens.shape[1]
        logits = jnp.broadcast_to(self.log_hist[:width + 1], (b, min(width + 1, self.log_hist.shape[0])))
        length = jnp.clip(jax.random.categorical(jax.random.fold_in(key, 1), logits, axis=-1), 1, width)
        length = length.astype(jnp.int32)
        cols, cur = [path.nodes[:, 0]], path.nodes[:, 0]
        for j in range(1, width):
            child = tree.parents == cur[:, None]  # [B, N]
            walked = jnp.where(jnp.any(child, axis=1), jnp.argmax(child, axis=1), min(j, n - 1)).astype(jnp.int32)
            cur = jnp.where(j < path.length, path.nodes[:, j], walked)
            cols.append(cur)
        col = jnp.arange(width)[None, :]
        nodes = jnp.where(col < length[:, None], jnp.stack(cols, axis=1), -1)
        path_tokens = jnp.take_along_axis(tree.tokens, jnp.clip(nodes, 0, n - 1), axis=1)
        last = jnp.take_along_axis(nodes, (length - 1)[:, None], axis=1)
        bonus = jnp.take_along_axis(target, last, axis=1)[:, 0]
        tokens = jnp.where(col == length[:, None] - 1, bonus[:, None],
                           jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1))
        return Path(nodes=nodes, length=length, tokens=tokens)

    def step(self, params, cfg, s: DecodeState, key, sampler) -> Committed:
        """draft -> build -> verify -> accept (the kernel) -> replay -> keep: `Speculative.step` of a fixed budget
        with the drawn path in place of the kernel's."""
        m = self.inner
        with jax.named_scope("draft"):
            draft_logits = m.propose(params, cfg, s, sampler)
        with jax.named_scope("tree_build"):
            tree = m.build(cfg, draft_logits, s.last)
        with jax.named_scope("verify"):
            target, res = verify(params, cfg, tree, s.cache, key, sampler)
        with jax.named_scope("accept"):
            path = accept(cfg, tree, target, min(tree.tokens.shape[1], m.tokens_per_step))
        with jax.named_scope("replay"):
            path = self.replay(tree, target, path, key)
        with jax.named_scope("compact"):
            cache, dstate = m.keep(cfg, res, s.draft, s.cache.lengths, path)
        return Committed(tokens=path.tokens, count=path.length, cache=cache, draft=dstate,
                         nonfinite=nonfinite_rows(res.logits))


def replayed(method: Speculative, histogram) -> Replayed:
    """`method` (ddtree or chain at a fixed budget) committing lengths drawn from `histogram` (counts by tokens
    committed; index 0, no token, must be empty: every step commits the bonus)."""
    hist = np.asarray(histogram, np.float64)
    if method.policy is not None:
        raise ValueError("replayed acceptance needs a fixed budget (budget='auto' chooses its nodes every step)")
    if hist.ndim != 1 or len(hist) < 2 or hist[0] != 0 or np.any(hist < 0) or hist.sum() <= 0:
        raise ValueError(f"histogram must count steps by tokens committed (index 0 empty), got {hist.tolist()}")
    with np.errstate(divide="ignore"):
        return Replayed(method, jnp.asarray(np.log(hist), jnp.float32))


def histograms(path: str) -> dict[int, list[int]]:
    """{budget: histogram} of ddtree in an acceptance.json (`benchmarks/acceptance.py`)."""
    with open(path) as f:
        return {int(r["budget"]): list(r["histogram"]) for r in json.load(f)["tau"] if r["method"] == "ddtree"}


def hist_mean(hist) -> float:
    h = np.asarray(hist, np.float64)
    return float((h * np.arange(len(h))).sum() / h.sum())


# --------------------------------------------------------------------------------------------------------------
# Models, state, timing
# --------------------------------------------------------------------------------------------------------------


def make_drafter(cfg, small: bool, n: int, key=None):
    """The DFlash drafter of one device of n (n=1: replicated): heads, KV heads and MLP width split n ways."""
    shape = SMALL_DRAFTER if small else DRAFTER
    return kj.init_drafter(cfg, jax.random.key(1) if key is None else key, num_layers=shape["num_layers"],
                           block_size=8, num_heads=shape["num_heads"] // n,
                           num_kv_heads=max(1, shape["num_kv_heads"] // n), head_dim=shape["head_dim"],
                           intermediate_size=shape["intermediate_size"] // n)


def loop_state(method, cfg, batch: int, context: int, cache_len: int, max_new: int, rng) -> DecodeState:
    """The loop state of `batch` rows as if a prompt of `context` tokens had been prefilled and its first token
    committed: both caches `cache_len` slots (zeros, as `full_scale.time_step`'s; their lengths `context`), a random
    bonus token per row, room for max_new tokens."""
    cache = dataclasses.replace(init_cache(cfg, batch, cache_len), lengths=jnp.full((batch,), context, jnp.int32))
    if isinstance(method, Traced):  # the bonus at each row's first position
        t = method.trace
        last = t.bonus[jnp.arange(batch) % t.streams, t.offset]
    else:
        last = jnp.asarray(rng.integers(0, cfg.vocab_size - 1, batch), jnp.int32)
    return DecodeState(cache=cache, draft=inner(method).drafter.start(batch, cache_len),
                       out=jnp.full((batch, max_new), -1, jnp.int32).at[:, 0].set(last),
                       num_out=jnp.ones((batch,), jnp.int32), done=jnp.zeros((batch,), bool), last=last,
                       key=jax.random.key(0), eos_id=jnp.int32(-1), steps=jnp.zeros((), jnp.int32),
                       accepted=jnp.zeros((batch, method.tokens_per_step + 1), jnp.int32),
                       nonfinite=jnp.zeros((batch,), bool), nodes=jnp.zeros((batch, method.max_nodes + 1), jnp.int32),
                       reliability=no_reliability(batch))


def inner(method) -> Speculative:
    """The speculative method inside a replay: `Replayed`'s inner one, or a `Traced` (itself one)."""
    return method.inner if isinstance(method, Replayed) else method


def rewind(s: DecodeState, context: int) -> DecodeState:
    """The state back at `context` cached tokens and no step run (the caches' contents and the histogram kept), so
    that every timed run starts from the same context and has room."""
    b = s.last.shape[0]
    return s.replace(cache=dataclasses.replace(s.cache, lengths=jnp.full((b,), context, jnp.int32)),
                     num_out=jnp.ones((b,), jnp.int32), done=jnp.zeros((b,), bool), steps=jnp.zeros((), jnp.int32))


def time_calls(call, repeats: int, inner: int = 5) -> tuple[float, float]:
    """(median seconds per call over `repeats` samples of `inner` calls queued back to back, seconds of the first
    call: compile and run), the protocol of `full_scale.time_step`."""
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    first = time.perf_counter() - t0
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = call()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
    return float(np.median(samples)), first


def time_loop(method: Replayed | Traced, params, cfg, s: DecodeState, context: int, steps: int, warmup: int,
              repeats: int) -> tuple[dict, DecodeState]:
    """The compiled loop from `s` (donated): compile, `warmup` steps, then `repeats` pairs of runs of `steps` and
    2 x `steps` steps, each from `context` (`rewind`). Returns the timings (marginal: the difference of the pair over
    `steps`, at least a tenth of the longer run's mean step; the mean over the pairs), the replayed tau (the mean
    tokens committed per row and step) with its histogram, and the last state.

    A `Traced` method starts the pairs at places spread evenly over its streams (`Trace.at`: pair i at i / repeats of
    a stream's positions), so that they replay different text, and both runs of a pair at the same place: the longer
    run's first steps replay the shorter run's exactly (checked: the same tokens), so their difference is the time,
    the tokens and the nodes of its last `steps` steps, and tau is of those steps, the ones the marginal times. Under
    budget="auto" a step's cost and its tokens depend on its text, so both must come from the same steps (until
    810bd4c each run started further along: at C = 1 an H100 gave auto 5.9 ms marginal against 14.9 whole, 2026-12-07).
    A `Replayed` method draws its lengths at random: its tau is of every timed step.
    """
    until = lambda k: jnp.int32(k)
    traced_ = isinstance(method, Traced)
    at = lambda pair: (dataclasses.replace(method, trace=method.trace.at(pair * method.trace.positions // repeats))
                       if traced_ else method)
    counts = lambda s: (np.asarray(s.accepted).sum(axis=0), np.asarray(s.nodes).sum(axis=0))
    with trace_context(params, cfg):
        t0 = time.perf_counter()
        compiled = advance.lower(method, params, cfg, s, until(warmup), sampler=GREEDY).compile()
        compile_s = time.perf_counter() - t0
        s = compiled(at(0), params, s, until(warmup))
        jax.block_until_ready(s.out)
        whole, marginal = [], []
        hist, nodes = 0, 0
        for pair in range(repeats):
            walls, seen = [], []
            for k in (steps, 2 * steps):
                s = rewind(s, context)
                jax.block_until_ready(s.cache.lengths)
                before = counts(s)
                t0 = time.perf_counter()
                s = compiled(at(pair), params, s, until(k))
                jax.block_until_ready(s.out)
                walls.append(time.perf_counter() - t0)
                if int(s.steps) != k:
                    raise RuntimeError(f"the loop ran {int(s.steps)} steps of {k} (rows done early: no room?)")
                seen.append(tuple(a - b for a, b in zip(counts(s), before)))
                if traced_:  # the longer run's first steps must be the shorter run's: the same tokens committed
                    out, num = np.asarray(s.out), np.asarray(s.num_out)
                    if k == steps:
                        short = (out, num)
                    elif any(not np.array_equal(out[r, :n], short[0][r, :n]) for r, n in enumerate(short[1])):
                        raise RuntimeError("a pair's runs replayed different steps: the trace's replay is not "
                                           "deterministic, and their difference would not be the last steps'")
            whole.append(walls[0] / steps)  # never <= 0 from noise (as `budget.time_loop`)
            marginal.append(max((walls[1] - walls[0]) / steps, 0.1 * walls[1] / (2 * steps)))
            if traced_:  # the longer run's last steps
                hist, nodes = hist + seen[1][0] - seen[0][0], nodes + seen[1][1] - seen[0][1]
            else:
                hist, nodes = hist + seen[0][0] + seen[1][0], nodes + seen[0][1] + seen[1][1]
    return dict(loop_s=float(np.mean(marginal)), loop_whole_s=float(np.mean(whole)), loop_compile_s=compile_s,
                timed_steps=int((1 if traced_ else 3) * steps * repeats), tau_replayed=hist_mean(hist),
                replayed_histogram=hist.tolist(), nodes_histogram=nodes.tolist()), s


def time_stages(method: Replayed | Traced, params, cfg, s: DecodeState, repeats: int) -> tuple[dict, float]:
    """Each stage of a step jitted alone and timed (`time_calls`) on the inputs the one before made from `s`
    (consumed: verify and keep donate the caches, as the loop updates them in place). ({stage: seconds}, seconds of
    the first calls: compiles). "replay": `Replayed`'s draw of the path (after accept), or a `Traced`'s choices in
    place of the target's (before accept; its draft stage includes the select of the trace's distributions)."""
    m, key = inner(method), jax.random.key(7)
    trace = isinstance(method, Traced)
    width = min(m.max_nodes + 1, m.tokens_per_step)
    f_draft = jax.jit(lambda m, p, s: m.propose(p, cfg, s, GREEDY))
    f_tree = jax.jit(lambda dl, bonus: m.build(cfg, dl, bonus))  # m closed over: build reads none of its arrays

    def _verify(p, tree, cache, key):
        target, res = verify(p, cfg, tree, cache, key, GREEDY)
        return target, nonfinite_rows(res.logits), res.hidden, res.cache

    f_verify = jax.jit(_verify, donate_argnums=2)
    f_accept = jax.jit(lambda tree, target: accept(cfg, tree, target, width))
    if trace:
        f_choices = jax.jit(lambda method, tree, target, s: method.choices(target, tree, s))
    else:
        f_replay = jax.jit(lambda tree, target, path, key: method.replay(tree, target, path, key))  # (its histogram)
    f_keep = jax.jit(lambda m, cache, hidden, d, starts, path: m.keep(
        cfg, StepOutput(logits=jnp.zeros(hidden.shape[1:3] + (1,)), hidden=hidden, cache=cache), d, starts, path),
        donate_argnums=(1, 3))
    out, first = {}, 0.0
    starts, bonus = jnp.copy(s.cache.lengths), s.last
    # the draft's call gets only what it reads (the target's embedding and lm_head, the caches' lengths): a thousand
    # unread weight arrays would make its timing the host's dispatch, not the drafter's
    p_draft, s_draft = target_io(params), s.replace(cache=dataclasses.replace(s.cache, latent=(), k_pe=()))
    with trace_context(params, cfg):
        out["draft"], f = time_calls(lambda: f_draft(m, p_draft, s_draft), repeats)
        first += f
        dl = f_draft(m, p_draft, s_draft)
        out["tree_build"], f = time_calls(lambda: f_tree(dl, bonus), repeats)
        first += f
        tree = f_tree(dl, bonus)
        held = {"cache": s.cache}

        def call_verify():
            target, bad, hidden, held["cache"] = f_verify(params, tree, held["cache"], key)
            return target, bad, hidden

        out["verify"], f = time_calls(call_verify, repeats)
        first += f
        target, _, hidden = call_verify()
        if trace:
            out["replay"], f = time_calls(lambda: f_choices(method, tree, target, s_draft), repeats)
            first += f
            target = f_choices(method, tree, target, s_draft)
        out["accept"], f = time_calls(lambda: f_accept(tree, target), repeats)
        first += f
        path = f_accept(tree, target)
        if not trace:
            out["replay"], f = time_calls(lambda: f_replay(tree, target, path, key), repeats)
            first += f
            path = f_replay(tree, target, path, key)
        held["draft"] = s.draft

        def call_keep():
            held["cache"], held["draft"] = f_keep(m, held["cache"], hidden, held["draft"], starts, path)
            return held["draft"]

        out["keep"], f = time_calls(call_keep, repeats)
        first += f
    return out, first


def target_io(params):
    """The target's params without its layers: what a draft reads of the target (the embedding, the lm_head)."""
    return dataclasses.replace(params, layers=())


def draft_bytes(drafter, params, dcache, context: int) -> float:
    """Bytes one draft must read: the drafter's layers and final norm, the target's lm_head (this device's shard),
    the context keys and values up to `context` (`fc` is read when context is added, in keep, not here)."""
    p = drafter.params
    ctx = 2 * nbytes(dcache.k) * context / dcache.k[0].shape[1]
    return nbytes(p.layers) + nbytes(p.norm) + nbytes(params.lm_head) + ctx


def time_draft(drafter, params, cfg, batch: int, context: int, repeats: int, copy_Bps: float, kind: str,
               attention: str) -> dict:
    """The drafter's step alone (`drafter.draft`: the block's logits, its attention on `attention`, its dense weights
    as fused_dot calls where the config's ffi_ops name fused_dot, as the loop's drafter does) after `context` tokens,
    and its bytes floor; on a GPU also "profile": its kernels' busy time and span a step and the 16 kernel families
    that take the most ([family, launches, µs] a step)."""
    dcache = init_draft_cache(drafter.cfg, batch, context + 16)
    lengths, bonus = jnp.full((batch,), context, jnp.int32), jnp.zeros((batch,), jnp.int32)
    dense = "ffi" if cfg.impl("fused_dot") == "ffi" else "xla"
    fn, io = jax.jit(partial(draft, attention=attention, dense=dense)), target_io(params)
    with trace_context(params, cfg):
        step_s, _ = time_calls(lambda: fn(drafter, io, dcache, lengths, bonus), repeats)
        prof = {}
        if jax.default_backend() == "gpu":  # where the step's time goes: its kernels under the profiler, 5 calls
            from profile_tools import profile_calls, top_kernels
            p = profile_calls(lambda: fn(drafter, io, dcache, lengths, bonus), (), 5)
            prof = dict(busy_us=p["busy_us"], span_us=p["span_us"],
                        kernels=[[k, round(n, 2), round(us, 2)] for k, n, us in top_kernels(p, 16)])
            print(f"drafter {kind} batch {batch}: GPU busy {p['busy_us']:.0f} µs, span {p['span_us']:.0f} µs; "
                  + ", ".join(f"{k} {n:g}x {us:.0f} µs" for k, n, us in prof["kernels"]), flush=True)
    byts = draft_bytes(drafter, params, dcache, context)
    fc = nbytes(drafter.params.fc) + nbytes(drafter.params.hidden_norm)
    d = drafter.cfg
    return dict(kind=kind, batch=batch, context=context, attention=attention, dense=dense, step_s=step_s, bytes=byts,
                copy_Bps=copy_Bps,
                floor_s=byts / copy_Bps,
                floor_fc_s=(byts + fc) / copy_Bps,
                layers=d.num_layers, heads=d.num_heads, kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                intermediate=d.intermediate_size, profile=prof)


def cell_method(params, cfg, drafter, batch: int, budget, replay) -> tuple[Replayed | Traced, dict]:
    """The method of a cell and what was measured to make it: ddtree at `budget` (or budget="auto", its cost model
    calibrated here on this model at this batch: `budget.calibrate`) replaying `replay` (a `Trace`, or a histogram
    of committed lengths: fixed budgets only)."""
    if budget != AUTO:
        m = speculative(cfg, "ddtree", drafter, budget)
        return (traced(m, replay) if isinstance(replay, Trace) else replayed(m, replay)), {}
    if not isinstance(replay, Trace):
        raise ValueError("budget='auto' replays a trace (--replay trace): it chooses its nodes every step")
    t0 = time.perf_counter()
    with trace_context(params, cfg):
        cost, meta = calibrate(params, cfg, drafter, batch=batch, max_budget=AUTO_MAX, steps=2, repeats=1)
    policy = BudgetPolicy.choosing(cost)
    info = dict(calibrate_s=time.perf_counter() - t0, tiers=list(cost.tiers), replan=cost.replan,
                cost_points=cost.points(), cost_meta=meta)
    return traced(speculative(cfg, "ddtree", drafter, AUTO_MAX, policy=policy), replay), info


def run_cell(params, cfg, drafter, batch: int, budget, replay, context: int, args, rng) -> dict:
    """One cell: the loop, then its stages (a fixed budget's), from a state at `context` tokens."""
    method, info = cell_method(params, cfg, drafter, batch, budget, replay)
    room = 2 * args.steps * method.tokens_per_step + 1
    cache_len = -(-(context + max(args.warmup, 2 * args.steps) * method.tokens_per_step + method.extra_slots + 8)
                  // 64) * 64
    s = loop_state(method, cfg, batch, context, cache_len, room + args.warmup * method.tokens_per_step, rng)
    loop, s = time_loop(method, params, cfg, s, context, args.steps, args.warmup, args.loop_repeats)
    if budget == AUTO:  # its steps are of several programs: no stages to add up
        return dict(C=batch, budget=budget, context=context, nodes=AUTO_MAX + 1, **loop, stages=None, **info,
                    mean_nodes=hist_mean(loop["nodes_histogram"]))
    stages, first = time_stages(method, params, cfg, rewind(s, context), args.repeats)
    del s
    total = sum(stages.values())
    row = dict(C=batch, budget=budget, context=context, nodes=budget + 1, **loop, stages=stages, stage_sum_s=total,
               ratio=loop["loop_s"] / total, ratio_whole=loop["loop_whole_s"] / total, stages_first_s=first)
    if not isinstance(replay, Trace):
        row.update(histogram=list(replay), tau_hist=hist_mean(replay))
    return row


# --------------------------------------------------------------------------------------------------------------
# Projection and report
# --------------------------------------------------------------------------------------------------------------


def cell_order(r: dict) -> tuple[int, int]:
    """Rows by C, then budget (auto after the fixed ones)."""
    return r["C"], r["budget"] if isinstance(r["budget"], int) else 1 << 30


def projection(rows: list[dict], layers: int) -> list[dict]:
    """Tokens/s on 8 GPUs per measured cell: C x tau / (loop step + layers x one layer's all-reduces), tau the
    replayed mean, the all-reduces measured at the cell's nodes per row or else at 65 (a bound, `comm_bound`), as
    `full_scale.projection` picks them; beside it the what-if all-reduce time and the quoted taus."""
    out = []
    for r in sorted(rows, key=cell_order):
        c, t = r["C"], r["nodes"]
        key = (c, t) if (c, t) in COMM_PER_LAYER_S else (c, 65) if (c, 65) in COMM_PER_LAYER_S else None
        if key is None:
            continue
        comm_s, loop_s, tau = layers * COMM_PER_LAYER_S[key], r["loop_s"], r["tau_replayed"]
        out.append(dict(method=f"ddtree@{r['budget']}", C=c, budget=r["budget"], loop_s=loop_s, comm_s=comm_s,
                        comm_bound=key != (c, t), tau=tau, tok_s=c * tau / (loop_s + comm_s),
                        tok_s_fast=c * tau / (loop_s + layers * 2 * FAST_ALLREDUCE_S),
                        tok_s_quoted={k: c * v / (loop_s + comm_s) for k, v in TAU_QUOTED.items()}))
    return out


def best(proj: list[dict]) -> dict[int, dict]:
    """{C: the projection row of the most tokens/s at that C}."""
    out = {}
    for p in proj:
        if p["C"] not in out or p["tok_s"] > out[p["C"]]["tok_s"]:
            out[p["C"]] = p
    return out


def ms(x: float) -> str:
    return f"{1e3 * x:.2f}"


def replay_note(meta: dict) -> str:
    """The report's first paragraph: where the acceptance comes from."""
    if meta.get("replay", "histogram") == "histogram":
        return ("**Acceptance is replayed, not produced by this drafter**: every stage runs for real each step, but "
                "each row commits a length drawn from the embedded model's measured histogram for the budget "
                f"({meta['acceptance']}); random weights would accept next to nothing.")
    return ("**Acceptance is replayed from the embedded model, not produced by these weights**: every stage runs for "
            "real each step (draft, tree build, verify, accept, keep), but the tree is built from the embedded "
            "drafter's distributions and accept walks the embedded target's greedy choices, both recorded at each "
            f"row's text position (`benchmarks/trace_replay.py`: {meta.get('trace_texts')} held-out texts of "
            f"{meta.get('trace_positions')} positions, joined into C streams, the timed pairs of runs spread evenly "
            "over them, both runs of a pair from the same place); so "
            "each step's tree, auto's choice of nodes and the accepted length are the embedded pair's (byte tokens), "
            "and the tau column is the accept kernel's own, over the steps the marginal times (each pair's longer "
            "run's last S steps). Random weights would accept next to nothing.")


def nodes_scope(meta: dict) -> str:
    """Which steps a row's mean nodes count: the timed ones since the pairs replay the same text (`loop_stat` mean)."""
    return ("the steps the marginal times" if meta.get("loop_stat") == "mean"
            else "every step run, the warm-up's too")


def write_report(out_dir: str, meta: dict, rows: list[dict], drafters: list[dict]) -> dict:
    """ddtree_full_scale.{json,md,png} in out_dir from the measured rows (the projection recomputed from them)."""
    os.makedirs(out_dir, exist_ok=True)
    rows = sorted(rows, key=cell_order)
    proj = projection(rows, meta["layers"])
    data = dict(meta=meta, rows=rows, drafters=drafters, projection=proj)
    with open(os.path.join(out_dir, "ddtree_full_scale.json"), "w") as f:
        json.dump(data, f, indent=1)
    runs = meta.get("earlier", []) + [meta]
    lines = [f"# The DDTree loop at full scale: K2.6's per-device program of an ep={meta['n']} mesh on one GPU "
             f"({meta['date']}, {meta['device']}, commit {meta['commit']}, kernels={meta['kernels']})"
             + (" - the tiny config, a smoke run" if meta.get("small") else ""), "",
             replay_note(meta), "",
             f"{meta['layers']} layers, {meta['params_gb']:.1f} GB of weights on the device, context "
             f"{meta['context']}; the drafter: {meta['drafter']}, its tree built from this device's vocabulary "
             f"shard ({meta['vocab']} tokens). Loop: `decoding.advance` compiled once, runs of {meta['steps']} and "
             f"{2 * meta['steps']} steps from the same context after {meta['warmup']} warm-up steps, "
             f"{'median' if meta.get('loop_stat', 'median') == 'median' else 'the mean'} of "
             f"{meta['loop_repeats']} pairs; marginal = (2S-step run - S-step run) / S, whole = S-step run / S (a "
             f"call's entry included). Stages: each jitted alone on the same shapes (the draft given only the target's "
             f"embedding and lm_head, not its layers' arrays), median of {meta['repeats']} x 5 queued calls. The "
             "state: both caches at the context, zeros (no prefill). No collectives anywhere (those of the mesh are "
             "in the projection).", "",
             "Command" + ("s" if len(runs) > 1 else "") + ": " + "; ".join(
                 f"`{r['command']}`" + (f" with XLA_FLAGS=`{r['xla_flags']}`" if r.get("xla_flags") else "")
                 + (f" ({r['commit']}, {r['date']})" if len(runs) > 1 else "") for r in runs) + ".", "",
             "## The loop against its stages (ms per step)", "",
             "| C | budget | loop (marginal) | loop (whole) | draft | tree build | verify | accept | replay | keep | "
             "sum of stages | loop / sum | whole / sum | tau replayed (the embedded model's) | loop compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    embedded = meta.get("embedded_tau", {})
    for r in rows:
        st = r["stages"]
        ref = r.get("tau_hist", embedded.get(str(r["budget"])))
        cols = (" | ".join(ms(st[k]) for k in STAGES) + f" | {ms(r['stage_sum_s'])} | {r['ratio']:.2f} | "
                f"{r['ratio_whole']:.2f}") if st else " | ".join(["-"] * (len(STAGES) + 3))
        lines.append(f"| {r['C']} | {r['budget']} | {ms(r['loop_s'])} | {ms(r['loop_whole_s'])} | {cols} | "
                     f"{r['tau_replayed']:.2f} ({'-' if ref is None else f'{ref:.2f}'}) | "
                     f"{r['loop_compile_s']:.0f} |")
    staged = [r for r in rows if r["stages"]]
    for r in rows:
        if not r["stages"]:
            lines += ["", f"budget=\"auto\" at C = {r['C']}: tiers {r['tiers']} (largest {r['nodes'] - 1} nodes), its "
                          f"cost model calibrated on this model in {r['calibrate_s']:.0f} s (`budget.calibrate`, "
                          f"plan every {r['replan']} step{'s' * (r['replan'] > 1)}); nodes verified per row and "
                          f"step: {r['mean_nodes']:.1f} on average ({nodes_scope(meta)}). Its steps "
                          "run several programs, so no stages are summed."]
    if staged:
        worst = max(staged, key=lambda r: r["ratio"])
        lines += ["", f"Goal loop <= 1.1 x the sum of stages: {sum(r['ratio'] <= 1.1 for r in staged)} of "
                      f"{len(staged)} cells meet it (marginal); the worst is C = {worst['C']}, budget "
                      f"{worst['budget']}: "
                      f"{worst['ratio']:.2f}x, {ms(worst['loop_s'] - worst['stage_sum_s'])} ms a step of overhead. "
                      "The replay is not part of the real method (it is in the sum, so it does not count as "
                      "overhead)."]
    if drafters:
        lines += ["", "## The drafter alone (one block's logits, context "
                      f"{drafters[0]['context']}; floor = bytes / {drafters[0]['copy_Bps'] / 1e12:.2f} TB/s, "
                      + ("the copy bandwidth measured in this run)" if meta.get("copy_measured") else
                         "an assumed bandwidth: no GPU, not measured)"), "",
                  "| drafter | layers x heads / KV heads x dim, MLP | attention | dense | batch | step ms | floor ms | "
                  "% of floor | % of the floor with `fc` (full_scale's) |", "|---|---|---|---|---|---|---|---|---|"]
        for d in drafters:
            lines.append(f"| {d['kind']} | {d['layers']} x {d['heads']} / {d['kv_heads']} x {d['head_dim']}, "
                         f"{d['intermediate']} | {d.get('attention', 'xla')} | {d.get('dense', 'xla')} | "
                         f"{d['batch']} | {ms(d['step_s'])} | "
                         f"{ms(d['floor_s'])} | "
                         f"{d['floor_s'] / d['step_s']:.0%} | {d['floor_fc_s'] / d['step_s']:.0%} |")
        lines += ["", "Goal for the sharded drafter: <= 0.45 ms a step per device, >= 60% of its floor (the floor "
                      "without `fc`). Its all-reduces (after attention and MLP, 6 layers) and the gather of the "
                      "shards' top candidates are not included."]
        for d in drafters:
            if d["kind"].startswith("sharded"):
                met = d["step_s"] <= 0.45e-3 and d["floor_s"] / d["step_s"] >= 0.6
                lines.append(f"- batch {d['batch']}: {ms(d['step_s'])} ms, {d['floor_s'] / d['step_s']:.0%} of the "
                             f"floor: goal {'met' if met else 'not met'}.")
    if proj:
        quoted = " / ".join(f"{k} {v}" for k, v in TAU_QUOTED.items())
        lines += ["", f"## Projection to {meta['n']} GPUs (every term measured, except the columns marked what-if and "
                      "quoted)", "", *cut_model_note(meta["layers"]),
                  f"| method | C | loop step ms | all-reduces ms ({meta['layers']} layers) | tau (replayed) | tok/s | "
                  f"tok/s, what-if 2 x {1e6 * FAST_ALLREDUCE_S:.0f} µs all-reduces | tok/s at quoted tau ({quoted}) |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in proj:
            q = " / ".join(f"{v:.0f}" for v in p["tok_s_quoted"].values())
            lines.append(f"| {p['method']} | {p['C']} | {ms(p['loop_s'])} | {'<= ' if p['comm_bound'] else ''}"
                         f"{ms(p['comm_s'])} | {p['tau']:.2f} | {p['tok_s']:.0f} | {p['tok_s_fast']:.0f} | {q} |")
        for c, p in sorted(best(proj).items()):
            lines.append(f"\nBest measured budget at C = {c}: {p['method']} ({p['tok_s']:.0f} tok/s with the replayed "
                         "tau).")
        lines += ["", "tokens/s = C x tau / (loop step + all-reduces): the loop step is the marginal one measured here "
                      "(draft, tree build, verify, accept, keep, the loop's books); all-reduces: those of one MoE "
                      "layer on an ep=2 mesh, results/sharding/sharding.md (2 H200s), times the layers (`<=`: the "
                      "65-node cell's messages, larger than this cell's); tau: the mean of the lengths committed in "
                      "the timed steps, " + ("drawn from the embedded model's histogram" if meta.get("replay",
                      "histogram") == "histogram" else "the embedded pair's, replayed from its trace") + " (byte "
                      "tokens); quoted tau: K2.5-DFlash "
                      "as a chain at block 8 from its model card (not measured here). Not included: the drafter's "
                      "all-reduces, the gather of the vocabulary shards' candidates for the tree."]
    if not any(r["budget"] == AUTO for r in rows):
        lines += ["", "budget=\"auto\" is not in this run" + (" (a histogram replay cannot drive it: it chooses its "
                      "nodes from the drafter's probabilities, which random weights make ~1/vocabulary; --replay trace "
                      "can)." if meta.get("replay", "histogram") == "histogram" else "; `--budgets ...,auto` runs it.")]
    with open(os.path.join(out_dir, "ddtree_full_scale.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(out_dir, meta, rows)
    return data


def plot(out_dir: str, meta: dict, rows: list[dict]) -> None:
    """Per cell: the stages stacked, beside the loop's marginal step (and its whole-run step as a tick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["stages"]]  # (auto's loop has no stages to stack)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 4.5))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for name, color in zip(STAGES, ("tab:orange", "tab:olive", "tab:blue", "tab:purple", "tab:gray", "tab:green")):
        h = np.array([1e3 * r["stages"][name] for r in rows])
        ax.bar(x - 0.2, h, 0.4, bottom=bottom, label=name, color=color)
        bottom += h
    ax.bar(x + 0.2, [1e3 * r["loop_s"] for r in rows], 0.4, label="loop step (marginal)", color="tab:red")
    ax.scatter(x + 0.2, [1e3 * r["loop_whole_s"] for r in rows], marker="_", s=300, color="black",
               label="loop step (whole runs)", zorder=3)
    ax.set_xticks(x, [f"C={r['C']}\nb={r['budget']}" for r in rows], fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title(f"DDTree loop vs its stages, {'tiny config' if meta.get('small') else 'K2.6'} per device "
                 f"(ep={meta['n']}), {meta['device']}, {meta['commit']}",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ddtree_full_scale.png"), dpi=120)
    plt.close(fig)


def replot(path: str) -> None:
    """The report of a saved run written again next to its JSON, the projection recomputed from its numbers."""
    with open(path) as f:
        saved = json.load(f)
    write_report(os.path.dirname(os.path.abspath(path)), saved["meta"], saved["rows"], saved["drafters"])


# --------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------


def budget_value(text: str) -> int | str:
    """A budget: a positive integer, or "auto"."""
    text = text.strip()
    if text == AUTO:
        return AUTO
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def parse_cells(text: str) -> list[tuple[int, int | str | None]]:
    """"1,10x64,1xauto" -> [(1, None), (10, 64), (1, "auto")]: a batch size (every budget) or BATCHxBUDGET."""
    cells = []
    for part in text.split(","):
        c, _, b = part.strip().partition("x")
        try:
            cells.append((int(c), budget_value(b) if b else None))
        except ValueError:
            raise argparse.ArgumentTypeError(f"cell {part!r} is not C or CxBUDGET (e.g. 10, 10x64 or 1xauto)") from None
    return cells


def ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def budget_list(text: str) -> list[int | str]:
    try:
        return [budget_value(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of budgets (integers >= 1 or "
                                         "auto)") from None


def embedded_trace(texts: int, positions: int) -> Trace:
    """The embedded model's trace (`trace_replay.record`) of the first `texts` of the held-out prompts
    `benchmarks/acceptance.py` measures (64 of 128 tokens), `positions` positions each (a cell of C rows joins them
    into C streams, `Trace.chain`)."""
    _, held = corpus_split()
    prompts = windows(load_tokens(held), np.random.default_rng(0), max(64, texts), 128).tolist()[:texts]
    return record(load_builtin(), prompts, positions)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=HERE).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ddtree_full_scale"))
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT"), help="default: $KDTREE_COMMIT, else git's")
    ap.add_argument("--n", type=int, default=8, help="GPUs of the mesh whose per-device program runs (default 8)")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--kernels", choices=("ffi", "xla"), help="default: ffi (xla with --small)")
    ap.add_argument("--ffi-ops", default=None, metavar="OPS",
                    help="with ffi kernels, these custom calls (comma-separated; default: the config's, which leave "
                         "out fused_dot), e.g. " + ",".join(kj.config.FFI_OPS))
    ap.add_argument("--small", action="store_true", help="a tiny config (CPU smoke run)")
    ap.add_argument("--cells", type=parse_cells, help="C or CxBUDGET, comma-separated (default: C = 1, 10 with every "
                    "budget of --budgets; --small: 1, 2); run budget by budget, each at every C given alone")
    ap.add_argument("--budgets", type=budget_list, help="the tree budgets, integers or auto (default 8,16,32,64; "
                    "--small: 8,16); auto's cost model is measured at each C first (`budget.calibrate`)")
    ap.add_argument("--drafters", type=ints, help="batch sizes of the drafter-alone timing (default: 1,10; "
                    "--small: 1,2; 0: none)")
    ap.add_argument("--draft-attention", choices=("xla", "cudnn", "ffi"), default=None,
                    help="the drafter-alone rows' attention (`drafter.block_attention`; default: what the loop's "
                         "drafter runs, ffi (the custom call) where the config's ffi_ops name draft_attention, as "
                         "they do by default, else xla)")
    ap.add_argument("--context", type=int, help="cached tokens (default 4096; --small: 256)")
    ap.add_argument("--steps", type=int, default=16, help="S: timed runs of S and 2S loop steps (default 16)")
    ap.add_argument("--warmup", type=int, default=2, help="loop steps of the first (compiling) call")
    ap.add_argument("--loop-repeats", type=int, default=4, help="pairs of timed loop runs (mean)")
    ap.add_argument("--repeats", type=int, default=5, help="samples of each stage's timing (median)")
    ap.add_argument("--replay", choices=("trace", "histogram"), default="trace",
                    help="acceptance from the embedded model's trace (trees and accepted paths: trace_replay.py; "
                    "default) or lengths drawn from its histograms (--acceptance)")
    ap.add_argument("--trace-texts", type=int, default=20, help="held-out prompts traced (rounded up to a multiple "
                    "of every C: a cell joins them into C streams; default 20)")
    ap.add_argument("--trace-positions", type=int, default=128, help="positions traced after each prompt (a row "
                    "past its stream's last starts it again; default 128)")
    ap.add_argument("--acceptance", default=ACCEPTANCE, help="--replay histogram: the acceptance.json whose histograms "
                    "are replayed (its ddtree taus are also reported beside a trace's)")
    ap.add_argument("--time-limit", type=float, default=1e9, help="start no new cell after this many seconds")
    ap.add_argument("--append", action="store_true", help="keep the cells and drafter rows of the JSON already in "
                    "--out that this run does not measure again (one measurement in several calls)")
    ap.add_argument("--replot", metavar="JSON", help="rewrite the report next to a saved ddtree_full_scale.json")
    args = ap.parse_args(argv)
    if args.replot:
        replot(args.replot)
        return 0
    t_start = time.perf_counter()
    kernels = args.kernels or ("xla" if args.small else "ffi")
    budgets = args.budgets or list(SMALL_BUDGETS if args.small else BUDGETS)
    given = args.cells or [(c, None) for c in (SMALL_BATCHES if args.small else BATCHES)]
    # budget by budget, every C at each (a run cut short by a time limit has the small budgets at every C)
    cells = [(c, b) for b in budgets for c, x in given if x is None] + [(c, b) for c, b in given if b is not None]
    context = args.context or (256 if args.small else 4096)
    hists = histograms(args.acceptance)
    missing = sorted({b for _, b in cells if b != AUTO} - set(hists))
    if args.replay == "histogram" and any(b == AUTO for _, b in cells):
        raise SystemExit("budget auto chooses its nodes every step: it replays a trace (--replay trace)")
    if args.replay == "histogram" and missing:
        raise SystemExit(f"{args.acceptance} has no ddtree histogram for budget(s) {missing} (it has {sorted(hists)})")
    rows, drafters, earlier = [], [], []
    path = os.path.join(args.out, "ddtree_full_scale.json")
    if args.append and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        rows, drafters = saved["rows"], saved["drafters"]
        earlier = saved["meta"].get("earlier", []) + [{k: saved["meta"].get(k) for k in
                                                        ("command", "commit", "date", "device", "xla_flags")}]

    t0 = time.perf_counter()
    cfg, params = per_device_model(args.n, args.layers, args.small, kernels)
    if args.ffi_ops:
        cfg = dataclasses.replace(cfg, ffi_ops=tuple(o.strip() for o in args.ffi_ops.split(",") if o.strip()))
    init_s = time.perf_counter() - t0
    sharded = make_drafter(cfg, args.small, args.n)
    copy_Bps = ceilings()["copy_Bps"] if jax.default_backend() == "gpu" else 50e9
    d = sharded.cfg
    meta = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                commit=args.commit or git_commit(), command=shlex.join(["python", "benchmarks/ddtree_full_scale.py",
                                                                        *(sys.argv[1:] if argv is None else argv)]),
                kernels=kernels, ffi_ops=list(cfg.ffi_ops), n=args.n, layers=args.layers, small=args.small,
                params_gb=nbytes(params) / 1e9,
                init_s=init_s, copy_Bps=copy_Bps, copy_measured=jax.default_backend() == "gpu",
                xla_flags=os.environ.get("XLA_FLAGS", ""), context=context,
                steps=args.steps, warmup=args.warmup, loop_repeats=args.loop_repeats, loop_stat="mean",
                repeats=args.repeats,
                vocab=cfg.vocab_size, acceptance=os.path.relpath(os.path.abspath(args.acceptance), HERE),
                replay=args.replay, embedded_tau={str(b): hist_mean(h) for b, h in hists.items()},
                drafter=f"{d.num_layers} layer{'s' * (d.num_layers != 1)}, {d.num_heads} heads, {d.num_kv_heads} "
                        f"KV heads of {d.head_dim}, MLP {d.intermediate_size}, block {d.block_size}", earlier=earlier)
    print(f"params {meta['params_gb']:.1f} GB made in {init_s:.1f} s; copy {copy_Bps / 1e12:.2f} TB/s", flush=True)
    write_report(args.out, meta, rows, drafters)

    batches = [b for b in (args.drafters if args.drafters is not None else (SMALL_BATCHES if args.small else BATCHES))
               if b > 0]
    if batches:
        attention = args.draft_attention or ("ffi" if cfg.impl("draft_attention") == "ffi" else "xla")
        replicated = make_drafter(cfg, args.small, 1)
        for kind, dr in ((f"sharded (1/{args.n})", sharded), ("replicated", replicated)):
            for b in batches:
                try:
                    r = time_draft(dr, params, cfg, b, context, args.repeats, copy_Bps, kind, attention)
                except Exception as e:  # noqa: BLE001 (out of memory is a result to record)
                    print(f"drafter {kind} batch {b}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                    continue
                drafters = [x for x in drafters if (x["kind"], x["batch"]) != (kind, b)] + [r]
                print(f"drafter {kind:14s} batch {b:2d}: {ms(r['step_s'])} ms, floor {ms(r['floor_s'])} ms "
                      f"({r['floor_s'] / r['step_s']:.0%})", flush=True)
                write_report(args.out, meta, rows, drafters)
        del replicated

    trace = None
    if args.replay == "trace" and cells:
        t0 = time.perf_counter()
        lcm = math.lcm(*{c for c, _ in cells})
        trace = embedded_trace(lcm * -(-args.trace_texts // lcm), args.trace_positions)
        meta.update(trace_texts=trace.streams, trace_positions=trace.positions, trace_s=time.perf_counter() - t0)
        print(f"trace of the embedded model: {trace.streams} texts x {trace.positions} positions in "
              f"{meta['trace_s']:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    for c, b in cells:
        if time.perf_counter() - t_start > args.time_limit:
            print("time limit reached", flush=True)
            break
        t0 = time.perf_counter()
        try:
            row = run_cell(params, cfg, sharded, c, b, trace.chain(c) if trace else hists[b], context, args, rng)
        except Exception as e:  # noqa: BLE001 (out of memory at the largest cells is a result to record)
            print(f"C={c} budget {b}: failed: {str(e).splitlines()[0][:300]}", flush=True)
            continue
        row["cell_s"] = time.perf_counter() - t0
        rows = [r for r in rows if (r["C"], r["budget"]) != (c, b)] + [row]
        st = row["stages"]
        parts = ("stages " + " + ".join(f"{k} {ms(st[k])}" for k in STAGES) + f" = {ms(row['stage_sum_s'])} ms "
                 f"({row['ratio']:.2f}x)") if st else f"{row['mean_nodes']:.1f} nodes a row on average"
        print(f"C={c:2d} budget {b!s:>4}: loop {ms(row['loop_s'])} ms (whole {ms(row['loop_whole_s'])}), {parts}; "
              f"tau {row['tau_replayed']:.2f}; compile {row['loop_compile_s']:.0f} s, cell {row['cell_s']:.0f} s",
              flush=True)
        write_report(args.out, meta, rows, drafters)
    write_report(args.out, meta, rows, drafters)
    print(open(os.path.join(args.out, "ddtree_full_scale.md")).read(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
