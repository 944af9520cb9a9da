"""Full-scale K2.6 as one GPU of an N-GPU mesh runs it: the per-device step, its bytes floor, a kernel profile,
and a projection to N GPUs built from measured terms only.

The per-device program of an ep=N mesh (`per_device_model`: heads, vocabulary, dense and shared-expert widths
split N ways, 384/N local experts; every token routed top-8 over all 384 experts, as every device of the mesh
routes it, its slots on the other devices' experts going to no expert: 8/N local slots per token on average), for
all 61 layers, random weights made by `kj.init_params` (one compiled call, INT4 experts made one at a time), run on one
GPU without collectives. For each cell (batch x tree nodes per row, context) it measures the cached `step` with
the cache donated and fed back (as generate runs it), and computes the bytes floor of the same cell from the same
config: every weight read once, the local experts the tokens touch (expected number for uniform routing), the
latent cache read up to the context, the new rows written, at the copy bandwidth measured in the same run. A
jax.profiler trace of the decode and verify steps is parsed into per-kernel rows. The drafter (K2.5-DFlash shape:
6 layers, 64 heads, 8 KV heads, MLP 18,432, block 8; replicated) is timed against its own floor.

The projection to N GPUs (`projection`): tokens/s = C x tau / (per-device verify step + drafter step + 61 x the
all-reduces of one layer) for ar and every ddtree budget whose cell was measured, each term measured: the step and
drafter here, the all-reduces from the 2-GPU measurement committed in results/sharding/sharding.md, tau of the
embedded model by budget (results/acceptance/acceptance.md); beside it two columns that are not measurements,
labelled so: all-reduces at a what-if latency, and the published acceptance of the K2.5 DFlash drafter (quoted).
Tree build and accept are left out (0.1-0.4 ms per step). With --base, the report puts an earlier build's run of the
same cells beside this one.

    python benchmarks/full_scale.py                                     # on one H200 (~80 GB of weights)
    python benchmarks/full_scale.py --layers 3 --small --out /tmp/x     # CPU smoke run
    python benchmarks/full_scale.py --replot results/full_scale/full_scale.json  # the report again, from its numbers
    python benchmarks/full_scale.py --cells 4096:1x1 --loop 16   # also 16 steps in one executable (the decode loop's
                                                                 # step, without a call's own host work)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import kdtree_jax as kj  # noqa: E402
from common import ceilings, random_trees  # noqa: E402
from kdtree_jax import plan  # noqa: E402
from kdtree_jax.sharding import trace_context  # noqa: E402
from kdtree_jax.model import MLP, MoE, init_cache, step  # noqa: E402
from profile_tools import profile_calls, top_kernels  # noqa: E402

CELLS = [(4096, 1, 1), (4096, 1, 17), (4096, 1, 65), (4096, 10, 1), (4096, 10, 65), (131072, 1, 1),
         (65536, 10, 1), (4096, 10, 17), (4096, 1, 9), (4096, 1, 33), (4096, 10, 9), (4096, 10, 33),
         (32768, 1, 65), (131072, 1, 65), (32768, 10, 1)]  # most telling first
SMALL_CELLS = [(256, 1, 1), (256, 1, 17), (256, 2, 1)]
PROFILED = [(4096, 1, 1), (4096, 1, 17)]
# measured terms taken from committed results when this machine has one GPU (see the module docstring)
COMM_PER_LAYER_S = {(1, 1): 0.115e-3, (1, 65): 0.127e-3, (10, 1): 0.123e-3, (10, 65): 0.498e-3}  # sharding.md
COMM_CELLS = [(1, 1), (1, 65), (10, 1), (10, 65)]
# the embedded model's ddtree tau by budget: results/acceptance/acceptance.md (H200, 0e0a3ae, 64 held-out prompts;
# byte tokens)
TAU = {8: 3.562, 16: 3.843, 32: 4.140, 64: 4.414}
# quoted, not measured here: K2.5-DFlash as a chain at block 8 (its model card); a DDTree of the same block accepts at
# least as many tokens per step
TAU_QUOTED = {"MT-Bench": 3.7, "Math500": 5.5}
K2_LAYERS = kj.configs.k2_6().num_hidden_layers  # 61
FAST_ALLREDUCE_S = 8e-6  # what-if: the small-message latency custom all-reduces reach on 8 NVLink GPUs (SGLang)
BUDGETS = (8, 16, 32, 64)


def parse_cells(text: str) -> list[tuple[int, int, int]]:
    """"4096:1x1,131072:1x17" -> [(4096, 1, 1), (131072, 1, 17)]: (context, batch, tree nodes per row)."""
    cells = []
    for part in text.split(","):
        context, _, bt = part.strip().partition(":")
        batch, _, t = bt.partition("x")
        try:
            cells.append((int(context), int(batch), int(t)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"cell {part!r} is not CONTEXT:BATCHxNODES (e.g. 4096:1x17)") from None
    return cells


def per_device_cfg(n: int, layers: int, small: bool, kernels: str) -> kj.ModelConfig:
    """The config of one device's share of an ep=n mesh: 1/n of heads, vocabulary and dense width; the routing of
    the whole model (every device scores all E experts and picks the top k). Its params hold only E/n experts
    (`per_device_model`), so the ids of other devices' experts mean no expert, as in shard 0's call of
    `moe_expert_parallel`."""
    if small:
        return kj.configs.tiny(num_hidden_layers=layers, kernels=kernels, max_position_embeddings=4096)
    base = kj.configs.k2_6()
    return kj.configs.k2_6(num_hidden_layers=layers, kernels=kernels, num_attention_heads=base.num_attention_heads // n,
                           vocab_size=base.vocab_size // n, intermediate_size=base.intermediate_size // n)


def per_device_model(n: int, layers: int, small: bool, kernels: str, key=None):
    """(cfg, params) of the program one device of an ep=n mesh runs: `per_device_cfg`, with E/n experts per MoE
    layer (random INT4), the router of all E (the other devices' experts are ids >= E/n: no expert), and the shared
    expert's 1/n width."""
    cfg = per_device_cfg(n, layers, small, kernels)
    check_fits(local_experts_cfg(cfg, n))
    key = jax.random.key(0) if key is None else key
    params = kj.init_params(local_experts_cfg(cfg, n), key)

    def router(lp, i):  # the init's "small" declaration (0.02 x normal), drawn in numpy
        if not isinstance(lp.mlp, MoE):
            return lp
        rng = np.random.default_rng(1000 + i)
        e, d = cfg.n_routed_experts, cfg.hidden_size
        mlp = dataclasses.replace(lp.mlp, router=jnp.asarray(0.02 * rng.standard_normal((d, e)), lp.mlp.router.dtype),
                                  router_bias=jnp.asarray(0.02 * rng.standard_normal(e, np.float32)))
        return dataclasses.replace(lp, mlp=mlp)

    params = dataclasses.replace(params, layers=tuple(router(lp, i) for i, lp in enumerate(params.layers)))
    if not small:
        params = narrow_shared(params, cfg.moe_intermediate_size * cfg.n_shared_experts // n)
    return cfg, jax.block_until_ready(params)


def check_fits(cfg: kj.ModelConfig, device=None, share: float = 0.95) -> None:
    """Exit with one line when the weights of `cfg` (on one device, `plan.model_weight_bytes`) exceed `share` of a
    GPU's memory: XLA's allocator would otherwise retry for minutes before it fails (the 61-layer program on an
    H100, 2026-12-07: a whole 540 s device call). Says how many layers would fit. A CPU is not checked, nor is a
    package older than `plan.model_weight_bytes` (an A/B's base runs this script on an older commit's package)."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() if device.platform == "gpu" else None
    if not stats or not stats.get("bytes_limit") or not hasattr(plan, "model_weight_bytes"):
        return
    need, limit = plan.model_weight_bytes(cfg, plan.check_mesh(cfg, {})), stats["bytes_limit"]
    if need > share * limit:
        fit = int(0.8 * limit / (need / cfg.num_hidden_layers))
        raise SystemExit(f"{cfg.num_hidden_layers} layers: {need / 1e9:.1f} GB of weights do not fit this "
                         f"{device.device_kind}'s {limit / 1e9:.1f} GB; run fewer (--layers {fit}) or on a larger GPU")


def local_experts_cfg(cfg: kj.ModelConfig, n: int) -> kj.ModelConfig:
    """The config whose init gives one device's E/n experts (its router is replaced by the router of all E)."""
    return dataclasses.replace(cfg, n_routed_experts=cfg.n_routed_experts // n, n_group=1, topk_group=1,
                               num_experts_per_tok=min(cfg.num_experts_per_tok, cfg.n_routed_experts // n))


def cut_shared(shared: MLP, width: int) -> MLP:
    """A shared expert cut to `width` (its 1/N column/row share). Every projection of the MLP has the width last
    except `down` ([F, D]), whichever weights the layout holds."""
    return MLP(**{f.name: getattr(shared, f.name)[:width] if f.name == "down" else getattr(shared, f.name)[..., :width]
                  for f in dataclasses.fields(shared)})


def narrow_shared(params, width: int):
    """The shared expert of every MoE layer cut to `width` (`cut_shared`), donating the rest."""
    def cut(lp):
        if not isinstance(lp.mlp, MoE):
            return lp
        return dataclasses.replace(lp, mlp=dataclasses.replace(lp.mlp, shared=cut_shared(lp.mlp.shared, width)))

    return jax.jit(lambda p: dataclasses.replace(p, layers=tuple(cut(lp) for lp in p.layers)), donate_argnums=0)(
        params)


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def floor_bytes(params, cfg, batch: int, t: int, context: int) -> dict:
    """Bytes a step must move: weights read once (routed experts: those the M = batch x t tokens touch, expected
    value for uniform routing of k per token over E), cache read (context + t slots) and written (t slots),
    per row, every layer."""
    experts, other = 0, 0
    for lp in params.layers:
        if isinstance(lp.mlp, MoE):
            m = lp.mlp
            e, held = m.router.shape[1], m.we_gate.shape[0]  # experts routed over; held here (E/n per device)
            per_expert = sum(nbytes(w) for w in (m.we_gate, m.we_up, m.we_down)) / held
            touched = held * (1 - (1 - cfg.num_experts_per_tok / e) ** (batch * t))
            experts += per_expert * touched
            other += nbytes(dataclasses.replace(m, we_gate=None, we_up=None, we_down=None))
            other += nbytes(dataclasses.replace(lp, mlp=None))
        else:
            other += nbytes(lp)
    other += nbytes(params.lm_head) + nbytes(params.final_norm) + batch * t * params.embed.shape[1] * 2
    row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * jnp.dtype(cfg.jnp_dtype).itemsize
    cache = cfg.num_hidden_layers * batch * row * (context + 2 * t)
    return dict(weights=other, experts=experts, cache=cache, total=other + experts + cache)


def step_state(params, cfg, batch: int, t: int, context: int, rng, fn):
    """The arguments of a jitted step `fn(params, cache, tokens, depths, tree_mask)` (random tokens and trees of T
    nodes a row, the cache at `context` tokens) as a list, and call(state) -> fn's first output, the donated cache fed
    back into the state."""
    depths, vis = random_trees(batch, t, rng)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, t)), jnp.int32)
    cache = init_cache(cfg, batch, context + t + 8)
    cache = dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))
    state = [params, cache, tokens, jnp.asarray(depths), jnp.asarray(vis)]

    def call(st):
        out, st[1] = fn(*st)
        return out

    return state, call


def time_step(params, cfg, batch: int, t: int, context: int, rng, repeats: int, profile: bool, hlo: str | None = None):
    """(seconds per step, compile s, profile or None) for T tree nodes per row after `context` cached tokens; with
    `hlo` (a path), the compiled step's optimized HLO is written there (gzip)."""
    fn = jax.jit(lambda p, c, tok, d, m: (lambda o: (o.logits[:, 0, :8], o.cache))(
        step(p, cfg, tok, c, depths=d, tree_mask=m)), donate_argnums=1)
    state, call = step_state(params, cfg, batch, t, context, rng, fn)

    with trace_context(params, cfg):
        t0 = time.perf_counter()
        compiled = fn.lower(*state).compile()
        compile_s = time.perf_counter() - t0
        if hlo:
            with gzip.open(hlo, "wt") as f:
                f.write(compiled.as_text())
        del compiled
        jax.block_until_ready(call(state))
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(5):
                out = call(state)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - t0) / 5)
        prof = profile_calls(call, (state,), 3, keep_events=True) if profile else None
    del state
    return float(np.median(samples)), compile_s, prof


def steps_in_one_call(cfg, steps: int):
    """jit(params, cache, tokens, depths, tree_mask) -> (the sum of the steps' first 8 logits of node 0, fp32 [B, 8];
    the cache): `steps` cached steps in one fori_loop, the cache carried (donated), each step's tokens the given ones
    plus 0 or 1 from the logits so far (always 0 for finite logits), so that no step can be hoisted out of the loop."""
    def steps_fn(p, c, tok, d, m):
        def body(_, carry):
            acc, c = carry
            o = step(p, cfg, tok + (acc[:, :1] > 1e30).astype(jnp.int32), c, depths=d, tree_mask=m)
            return acc + o.logits[:, 0, :8].astype(jnp.float32), o.cache
        return jax.lax.fori_loop(0, steps, body, (jnp.zeros((tok.shape[0], 8), jnp.float32), c))

    return jax.jit(steps_fn, donate_argnums=1)


def time_loop(params, cfg, batch: int, t: int, context: int, rng, repeats: int, steps: int, profile: bool):
    """(seconds per step, profile or None) of `steps` steps inside one executable (a fori_loop carrying the cache,
    as the jitted decode loop runs them): what a step costs where no call's host-side work comes between steps. Each
    step's tokens depend on the last step's logits, so that no part of a step is hoisted out of the loop."""
    state, call = step_state(params, cfg, batch, t, context, rng, steps_in_one_call(cfg, steps))

    with trace_context(params, cfg):
        jax.block_until_ready(call(state))
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(call(state))
            samples.append((time.perf_counter() - t0) / steps)
        prof = profile_calls(call, (state,), 1, keep_events=True) if profile else None
    del state
    return float(np.median(samples)), prof


def save_timeline(out_dir: str, stem: str, prof: dict) -> None:
    """Move a profile's events into out_dir: timeline_<stem>.json.gz, every GPU kernel of the profiled steps as
    [family, stream, start µs, µs] (benchmarks/timeline.py reads it), and host_<stem>.json.gz, the host's events of
    at least profile_tools.HOST_EVENT_MIN_US as [name, thread, start µs, µs]."""
    os.makedirs(out_dir, exist_ok=True)
    for name, key in (("timeline", "events"), ("host", "host_events")):
        with gzip.open(os.path.join(out_dir, f"{name}_{stem}.json.gz"), "wt") as f:
            json.dump(prof.pop(key), f)


def time_drafter(cfg, params, small: bool, context: int, batch: int, repeats: int) -> dict:
    """The K2.5-DFlash-shaped drafter's step (draft logits for one block) and its bytes floor."""
    from kdtree_jax.drafter import draft, init_draft_cache

    if small:
        drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=1, block_size=8)
    else:
        drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=6, block_size=8, num_heads=64, num_kv_heads=8,
                                  intermediate_size=kj.configs.k2_6().intermediate_size)
    dcache = init_draft_cache(drafter.cfg, batch, context + 16)
    lengths = jnp.full((batch,), context, jnp.int32)
    bonus = jnp.zeros((batch,), jnp.int32)
    fn = jax.jit(draft)
    args = (drafter, params, dcache, lengths, bonus)
    with trace_context(params, cfg):
        jax.block_until_ready(fn(*args))
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(5):
                out = fn(*args)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - t0) / 5)
    byts = nbytes(drafter.params) + nbytes(params.lm_head) + nbytes(dcache.k) * context / dcache.k[0].shape[1] * 2
    return dict(step_s=float(np.median(samples)), bytes=byts, layers=drafter.cfg.num_layers, batch=batch,
                context=context)


def measure_comm(rng, small: bool, kernels: str) -> dict:
    """On >= 2 devices: the all-reduces of one K2-width MoE layer on an ep=2 mesh (sizes read from the compiled
    step), each timed alone with its real message size. {(batch, tokens): (seconds per layer, [bytes])}."""
    from sharding import allreduce_bytes, allreduce_time, layer_cfg, step_time

    mesh = kj.make_mesh(ep=2, devices=jax.devices()[:2])
    out = {}
    for batch, t in COMM_CELLS:
        _, hlo = step_time(layer_cfg(2, small, kernels), mesh, batch, t, 256 if small else 1024, rng)
        sizes = allreduce_bytes(hlo, layer=1)
        out[(batch, t)] = (sum(allreduce_time(mesh, b) for b in sizes), sizes)
        print(f"collectives of one layer, {batch}x{t}: {len(sizes)} all-reduces {sizes} bytes, "
              f"{1e6 * out[(batch, t)][0]:.0f} us", flush=True)
    return out


def cell_key(r: dict) -> tuple[int, int, int]:
    return r["context"], r["batch"], r["tokens"]


def per_layer(extra: dict, r: dict, layers: int) -> str:
    """Kernels a layer launches in the profiled cell of row r ("-" when it was not profiled)."""
    prof = extra.get("profiles", {}).get(f"context {r['context']}, {r['batch']} x {r['tokens']}")
    return f"{prof['launches'] / layers:.1f}" if prof else "-"


def ab_lines(meta: dict, rows: list[dict], extra: dict, base: dict) -> list[str]:
    """The side-by-side table of this run's cells and the same cells of an earlier build, run on the same machine
    just before (`--base`): each step against its own bytes floor (the builds may move different bytes)."""
    old = {cell_key(r): r for r in base["rows"]}
    out = [f"## This build ({meta['commit']}) against {base['meta']['commit']}, the same cells in the same call", "",
           f"Both on {meta['device']}; {base['meta']['commit']} ran first (XLA_FLAGS "
           f"`{base['meta'].get('xla_flags') or 'unset'}`, then `{meta.get('xla_flags') or 'unset'}`). Each step is "
           "divided by its own build's bytes floor.", "",
           "| context | batch x nodes | step ms before | step ms now | speedup | floor ms before | floor ms now | "
           "x floor before | x floor now | kernels a layer before | now |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = old.get(cell_key(r))
        if b is None:
            continue
        out.append(f"| {r['context']} | {r['batch']} x {r['tokens']} | {1e3 * b['step_s']:.2f} | "
                   f"{1e3 * r['step_s']:.2f} | {b['step_s'] / r['step_s']:.2f}x | {1e3 * b['floor_s']:.2f} | "
                   f"{1e3 * r['floor_s']:.2f} | {b['step_s'] / b['floor_s']:.2f} | {r['step_s'] / r['floor_s']:.2f} | "
                   f"{per_layer(base, b, base['meta']['layers'])} | {per_layer(extra, r, meta['layers'])} |")
    return out + [""]


def projection(rows: list[dict], extra: dict, layers: int, comm: dict) -> list[dict]:
    """Tokens/s on the full mesh for ar and each ddtree budget whose cell (C x budget + 1 nodes, 4k context) was
    measured: C x tau / (per-device step + drafter + layers x one layer's all-reduces), with the all-reduces measured
    at that cell's message sizes or, failing that, at the 65-node cell's (an upper bound), beside the same with a
    what-if all-reduce time and with the quoted taus."""
    by = {(r["batch"], r["tokens"]): r for r in rows if r["context"] == 4096}
    out = []
    for c in (1, 10):
        for budget in (0, *BUDGETS):
            t = budget + 1
            key = (c, t) if (c, t) in comm else (c, 65) if budget and (c, 65) in comm else None
            if (c, t) not in by or key is None:
                continue
            drafter_s = extra.get("drafter", {}).get("step_s", 0.0) if budget else 0.0
            comm_s, base = layers * comm[key][0], by[(c, t)]["step_s"] + drafter_s
            tau = TAU[budget] if budget else 1.0
            out.append(dict(method=f"ddtree@{budget}" if budget else "ar", C=c, budget=budget,
                            step_s=by[(c, t)]["step_s"], drafter_s=drafter_s, comm_s=comm_s, comm_bound=key != (c, t),
                            tau=tau, tok_s=c * tau / (base + comm_s),
                            tok_s_fast=c * tau / (base + layers * 2 * FAST_ALLREDUCE_S),
                            tok_s_quoted={k: c * v / (base + comm_s) for k, v in TAU_QUOTED.items()} if budget else {}))
    return out


def cut_model_note(layers: int) -> list[str]:
    """The projection's warning where the run had fewer layers than K2.6 (`--layers`; on an H100 61 do not fit), else
    nothing."""
    if layers >= K2_LAYERS:
        return []
    return [f"**A cut model**: {layers} of K2.6's {K2_LAYERS} layers (`--layers {layers}`), so these are the rates of "
            f"a {layers}-layer model, not of K2.6; a {K2_LAYERS}-layer run (an H200 holds one) gives K2.6's.", ""]


def write_report(out_dir: str, meta: dict, rows: list[dict], extra: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "full_scale.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, **extra), f, indent=1)
    bw = meta["copy_Bps"]
    lines = [f"# Full-scale K2.6, the per-device program of an ep={meta['n']} mesh on one GPU "
             f"({meta['date']}, {meta['device']}, commit {meta['commit']}, kernels={meta['kernels']})", "",
             f"{meta['layers']} layers, {meta['params_gb']:.1f} GB of weights on the device; copy bandwidth "
             f"measured in this run {bw / 1e12:.2f} TB/s. Floor = bytes / that bandwidth (weights once, the "
             "local experts the tokens touch, the cache read and written). `python benchmarks/full_scale.py`"
             + (f" with XLA_FLAGS=`{meta['xla_flags']}`" if meta.get("xla_flags") else "") + ".", "",
             "| context | batch x nodes | step ms | floor ms | x floor | weights GB | experts GB | cache GB | "
             "compile s |", "|---|---|---|---|---|---|---|---|---|"]
    base = extra.get("base")
    if base:
        lines[-2:-2] = ab_lines(meta, rows, extra, base) + ["", "This build alone:", ""]
    for r in rows:
        lines.append(f"| {r['context']} | {r['batch']} x {r['tokens']} | {1e3 * r['step_s']:.2f} | "
                     f"{1e3 * r['floor_s']:.2f} | {r['step_s'] / r['floor_s']:.2f} | {r['bytes']['weights'] / 1e9:.2f}"
                     f" | {r['bytes']['experts'] / 1e9:.2f} | {r['bytes']['cache'] / 1e9:.2f} | "
                     f"{r['compile_s']:.0f} |")
    looped = [r for r in rows if r.get("loop_step_s")]
    if looped:
        lines += ["", "The same cells as steps inside one executable (`--loop`: a fori_loop carrying the cache, as the "
                      "jitted decode loop runs them; no per-call host work between steps):", "",
                  "| context | batch x nodes | step ms, one call a step | step ms, in a loop | x floor in a loop |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['context']} | {r['batch']} x {r['tokens']} | {1e3 * r['step_s']:.2f} | "
                  f"{1e3 * r['loop_step_s']:.2f} | {r['loop_step_s'] / r['floor_s']:.2f} |" for r in looped]
    d = extra.get("drafter")
    if d:
        lines += ["", f"Drafter (K2.5-DFlash shape, {d['layers']} layers, replicated, batch {d['batch']}, context "
                      f"{d['context']}): {1e3 * d['step_s']:.2f} ms vs a {1e3 * d['bytes'] / bw:.2f} ms floor "
                      f"({d['bytes'] / bw / d['step_s']:.0%} of the floor)."]
    for name, prof in extra.get("profiles", {}).items():
        lines += ["", f"## Kernel profile, {name} (per step; {prof['launches']:.0f} kernels, "
                      f"{prof['launches'] / meta['layers']:.1f} a layer; GPU busy {prof['busy_us'] / 1e3:.2f} ms)", "",
                  "| kernel | launches | µs | share | µs on the path |", "|---|---|---|---|---|"]
        path = prof.get("path_us", {})
        for k, c, us in prof["top"]:
            on_path = f"{path[k]:.0f}" if k in path else "-"
            lines.append(f"| `{k[:80]}` | {c:.0f} | {us:.0f} | {us / prof['busy_us']:.0%} | {on_path} |")
        if path:
            lines += ["", "µs on the path: each instant of a step charged to the running kernel that ends first "
                          f"(`profile_tools.path_shares`); no kernel running: {path.get('(idle)', 0.0):.0f} µs "
                          f"(and {path.get('(between calls)', 0.0):.0f} µs between the profiled calls)."]
    proj = extra.get("projection")
    if proj:
        quoted = " / ".join(f"{v}" for v in TAU_QUOTED.values())
        lines += ["", f"## Projection to {meta['n']} GPUs (a projection: every term measured, except the columns "
                      "marked what-if and quoted)", "",
                  *cut_model_note(meta["layers"]),
                  f"| method | C | per-device step ms | drafter ms | all-reduces ms ({meta['layers']} layers) | tau | "
                  f"tok/s | tok/s, what-if 2 x {1e6 * FAST_ALLREDUCE_S:.0f} µs all-reduces | tok/s at quoted tau "
                  f"{quoted} |", "|---|---|---|---|---|---|---|---|---|"]
        for p in proj:
            q = " / ".join(f"{v:.0f}" for v in p["tok_s_quoted"].values()) if p["tok_s_quoted"] else "-"
            lines.append(f"| {p['method']} | {p['C']} | {1e3 * p['step_s']:.2f} | {1e3 * p['drafter_s']:.2f} | "
                         f"{'<= ' if p['comm_bound'] else ''}{1e3 * p['comm_s']:.2f} | {p['tau']:.2f} | "
                         f"{p['tok_s']:.0f} | {p['tok_s_fast']:.0f} | {q} |")
        for c in sorted({p["C"] for p in proj}):
            trees = [p for p in proj if p["C"] == c and p["method"] != "ar"]
            if trees:
                best = max(trees, key=lambda p: p["tok_s"])
                lines.append(f"\nBest measured budget at C = {c}: {best['method']} ({best['tok_s']:.0f} tok/s with the "
                             "embedded tau).")
        lines += ["", f"All-reduces: those of one MoE layer on an ep=2 mesh, {extra.get('comm_source')}, times the "
                      "layers (`<=`: the 65-node cell's messages, larger than this cell's); tau: the embedded model's "
                      "(byte tokens, results/acceptance/acceptance.md); quoted tau: K2.5-DFlash as a chain at block 8 "
                      "on MT-Bench and Math500 from its model card (not measured here; a DDTree of the same block "
                      "accepts at least as many); the drafter replicated (its split over the mesh is timed in "
                      "results/ddtree_full_scale/, not here) and timed at batch 1, charged at every C (the C = 10 "
                      "rows are optimistic by its batch-10 step's excess, not measured); tree build and accept not "
                      "included (0.1-0.4 ms per step, results/tree_build/tree_build.md)."]
    with open(os.path.join(out_dir, "full_scale.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['context'] // 1024}k\n{r['batch']}x{r['tokens']}" for r in rows]
        x = np.arange(len(rows))
        old = {cell_key(r): r for r in base["rows"]} if base else {}
        if old:
            ax.bar(x - 0.3, [1e3 * old[cell_key(r)]["step_s"] if cell_key(r) in old else 0 for r in rows], 0.3,
                   label=f"step at {base['meta']['commit']}", color="tab:gray")
        ax.bar(x + (0.0 if old else -0.2), [1e3 * r["step_s"] for r in rows], 0.3 if old else 0.4,
               label=f"step at {meta['commit']}", color="tab:blue")
        ax.bar(x + (0.3 if old else 0.2), [1e3 * r["floor_s"] for r in rows], 0.3 if old else 0.4,
               label="bytes floor", color="tab:green")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("ms")
        ax.set_title(f"K2.6 per-device step (ep={meta['n']}), {meta['device']}, {meta['commit']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "full_scale.png"), dpi=120)
    except ImportError:
        pass


def replot(path: str) -> None:
    """The report of a saved run written again next to its JSON, the projection recomputed from its numbers."""
    with open(path) as f:
        saved = json.load(f)
    meta, rows = saved.pop("meta"), saved.pop("rows")
    comm = {tuple(int(v) for v in k.split("x")): (c["seconds"], c["bytes"]) for k, c in saved["comm"].items()}
    saved["projection"] = projection(rows, saved, meta["layers"], comm)
    write_report(os.path.dirname(os.path.abspath(path)), meta, rows, saved)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "full_scale"))
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"))
    ap.add_argument("--n", type=int, default=8, help="GPUs of the mesh whose per-device program runs (default 8)")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--kernels", default="ffi", choices=("ffi", "xla"))
    ap.add_argument("--ffi-ops", default=None, metavar="OPS",
                    help="with --kernels ffi, these custom calls (comma-separated; default: the config's, which "
                         "leave out fused_dot), e.g. all of them: " + ",".join(kj.config.FFI_OPS))
    ap.add_argument("--small", action="store_true", help="a tiny config (CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=1e9, help="stop starting new cells after this many seconds")
    ap.add_argument("--cells", type=parse_cells, help="CONTEXT:BxT,... the cells to time (default: all of CELLS)")
    ap.add_argument("--profile", type=parse_cells, help="CONTEXT:BxT,... the cells to profile (default: PROFILED)")
    ap.add_argument("--base", metavar="JSON", help="an earlier build's full_scale.json from the same machine: the "
                    "report puts its cells beside this run's")
    ap.add_argument("--replot", metavar="JSON", help="rewrite the report (table, projection, plot) next to a saved "
                    "full_scale.json, from its numbers")
    ap.add_argument("--loop", type=int, default=0, metavar="K", help="also time each cell as K steps inside one "
                    "executable (a fori_loop, as the jitted decode loop runs): the step without per-call host work")
    ap.add_argument("--skip-drafter", action="store_true", help="do not time the drafter (saves its compile)")
    ap.add_argument("--hlo", action="store_true", help="write the profiled cells' optimized HLO (.hlo.txt.gz) to --out")
    args = ap.parse_args(argv)
    if args.replot:
        replot(args.replot)
        return 0
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    rows, extra = [], {"profiles": {}}
    if args.base:
        with open(args.base) as f:
            extra["base"] = json.load(f)
    comm = {k: (v, None) for k, v in COMM_PER_LAYER_S.items()}
    comm_source = "results/sharding/sharding.md (2 H200s, 98aa1f1)"
    if jax.device_count() >= 2:
        comm = measure_comm(rng, args.small, args.kernels)
        comm_source = f"measured in this run on 2 devices (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')})"
    extra["comm"] = {f"{b}x{t}": dict(seconds=v[0], bytes=v[1]) for (b, t), v in comm.items()}
    extra["comm_source"] = comm_source
    t0 = time.perf_counter()
    cfg, params = per_device_model(args.n, args.layers, args.small, args.kernels)
    if args.ffi_ops:
        cfg = dataclasses.replace(cfg, ffi_ops=tuple(o.strip() for o in args.ffi_ops.split(",") if o.strip()))
    init_s = time.perf_counter() - t0
    ceil = ceilings() if jax.default_backend() == "gpu" else {"copy_Bps": 50e9}
    meta = dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind), commit=args.commit,
                kernels=args.kernels, ffi_ops=list(cfg.ffi_ops), n=args.n, layers=args.layers,
                params_gb=nbytes(params) / 1e9, init_s=init_s,
                copy_Bps=ceil["copy_Bps"], xla_flags=os.environ.get("XLA_FLAGS", ""))
    print(f"params {meta['params_gb']:.1f} GB made in {init_s:.1f} s; copy {ceil['copy_Bps'] / 1e12:.2f} TB/s",
          flush=True)
    try:
        if args.skip_drafter:
            raise RuntimeError("not timed (--skip-drafter)")
        extra["drafter"] = time_drafter(cfg, params, args.small, 4096 if not args.small else 256, 1, args.repeats)
        print(f"drafter {1e3 * extra['drafter']['step_s']:.2f} ms", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"drafter: {str(e).splitlines()[0][:200]}", flush=True)
    cells = args.cells or (SMALL_CELLS if args.small else CELLS)
    profiled = args.profile or ([SMALL_CELLS[0]] if args.small else PROFILED)
    for context, batch, t in cells:
        if time.perf_counter() - t_start > args.budget:
            print("time budget reached", flush=True)
            break
        prof_it = (context, batch, t) in profiled
        try:
            hlo = (os.path.join(args.out, f"step_{context}_{batch}x{t}.hlo.txt.gz") if args.hlo and prof_it
                   else None)
            if hlo:
                os.makedirs(args.out, exist_ok=True)
            step_s, compile_s, prof = time_step(params, cfg, batch, t, context, rng, args.repeats, prof_it, hlo)
        except Exception as e:  # noqa: BLE001 (out of memory at the largest cells is a result to record)
            print(f"context {context} {batch}x{t}: failed: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        fb = floor_bytes(params, cfg, batch, t, context)
        row = dict(context=context, batch=batch, tokens=t, step_s=step_s, compile_s=compile_s, bytes=fb,
                   floor_s=fb["total"] / ceil["copy_Bps"])
        if prof is not None and jax.default_backend() == "gpu":
            save_timeline(args.out, f"{context}_{batch}x{t}", prof)
            extra["profiles"][f"context {context}, {batch} x {t}"] = dict(
                busy_us=prof["busy_us"], launches=sum(c for c, _ in prof["kernels"].values()),
                top=top_kernels(prof, 25), path_us=prof["path_us"],
                host_top=sorted(prof["host"].items(), key=lambda kv: -kv[1][1])[:20])
        print(f"context {context:6d} {batch:2d}x{t:2d}: {1e3 * step_s:8.2f} ms  floor {1e3 * row['floor_s']:6.2f} ms "
              f"({step_s / row['floor_s']:.2f}x)  compile {compile_s:.0f}s", flush=True)
        if args.loop:
            try:
                row["loop_step_s"], lprof = time_loop(params, cfg, batch, t, context, rng, args.repeats, args.loop,
                                                      prof_it and jax.default_backend() == "gpu")
                print(f"context {context:6d} {batch:2d}x{t:2d}: {1e3 * row['loop_step_s']:8.2f} ms a step in a loop "
                      f"of {args.loop}", flush=True)
                if lprof is not None:
                    save_timeline(args.out, f"loop_{context}_{batch}x{t}", lprof)
            except Exception as e:  # noqa: BLE001
                print(f"context {context} {batch}x{t}: the loop failed: {str(e).splitlines()[0][:200]}", flush=True)
        rows.append(row)
        write_report(args.out, meta, rows, extra)
    extra["projection"] = projection(rows, extra, args.layers, comm)
    write_report(args.out, meta, rows, extra)
    print(open(os.path.join(args.out, "full_scale.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
