"""budget="auto" against fixed budgets (issue 19), in three parts run side by side on one machine:

  embedded    The embedded model: tokens/s, tau and nodes verified per step of ddtree with budgets 8, 16, 32, 64, 128
              and "auto" (max 128, its cost model measured first in the same run by `kdtree_jax.budget.calibrate`),
              at concurrency 1 and 10 (held-out prompts of 128 tokens, 128 new tokens, greedy; median of 3 timed
              runs after a warm-up). Every row's tokens are checked equal to ar's.
  fullscale   Full-scale K2.6 as one GPU of an ep=8 mesh runs it (61 layers, `full_scale.per_device_model`, the
              K2.5-DFlash-shaped drafter, random weights), context 4,096: the step time of the same decoding loop
              for fixed budgets 8, 16, 32, 64, 128 (`budget.time_loop`), and auto's cost model (`calibrate`), at C=1 and
              C=10. Collectives are not in these per-device times (the same caveat for every budget).
  project     A projection, every term measured: the embedded model's acceptance, step by step, with the step
              costs of `fullscale`. Fixed budget b: the embedded model's steps at b x the full-scale step of b.
              Auto: the embedded model decoding with the full-scale cost model (its choices are the ones auto
              makes for that cost), each step costed by that model at the nodes it verified (plus its switch term
              where the tier changed).

    python benchmarks/auto_budget.py embedded --out DIR      # then fullscale (one H200, ~80 GB); on the GPU machine,
                                                             # one call per part: scripts/gpu_auto_budget.sh; then:
    python benchmarks/auto_budget.py report --out DIR --commit HASH   # runs `project`, writes auto_budget.{md,json,png}
    python benchmarks/auto_budget.py fullscale --small --out /tmp/x  # CPU smoke run of the full-scale part
    python benchmarks/auto_budget.py diagnose --profile --out DIR    # where a step's time goes: fixed 16 and 128,
                                                             # one-tier and two-tier auto forced, kernel profiles
    python benchmarks/auto_budget.py overhead --costs DIR/auto_budget_embedded.json --concurrency 1 --budgets 16,auto
                                                             # per call vs per step of generate (embedded model)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import kdtree_jax as kj  # noqa: E402
from kdtree_jax import budget as bud  # noqa: E402
from kdtree_jax.ddtree import speculative  # noqa: E402

FIXED = (8, 16, 32, 64, 128)
FULL_FIXED = (16, 32, 8, 64, 128)  # most telling first (the part stops starting cells when its time is spent)
MAX = 128
CONCURRENCY = (1, 10)


def _meta(args) -> dict:
    dev = jax.devices()[0]
    return dict(date=datetime.date.today().isoformat(), device=getattr(dev, "device_kind", dev.platform),
                commit=args.commit, jax=jax.__version__,
                python=sys.version.split()[0])  # the prompts come from this Python's standard library


def _save(out: str, name: str, data: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"auto_budget_{name}.json"), "w") as f:
        json.dump(data, f, indent=1)


def _prompts(tok, batch: int, length: int) -> list[list[int]]:
    from kdtree_jax.cli import _bench_prompts

    return _bench_prompts(tok, batch, length, 0)


def _embedded(args):
    """The embedded model, with the custom calls of --ffi-ops (the rest in pure JAX)."""
    model = kj.load("builtin")
    cfg = model.cfg
    if args.ffi_ops:
        cfg = dataclasses.replace(cfg, kernels="ffi", ffi_ops=tuple(o.strip() for o in args.ffi_ops.split(",")))
    return model, model.params, cfg, model.drafter


def part_embedded(args) -> dict:
    model, params, cfg, drafter = _embedded(args)
    out = dict(meta=dict(_meta(args), ffi_ops=args.ffi_ops), rows=[], costs={})
    kept = None
    if args.costs:  # an auto_budget_embedded.json, or a report's auto_budget.json (its "embedded" part)
        data = json.load(open(args.costs))
        kept = data["costs"] if "costs" in data else data["embedded"]["costs"]
    for c in args.concurrency:
        prompts = _prompts(model.tokenizer, c, 128)
        if kept:  # the cost models an earlier embedded run measured (same model, batch and tiers)
            e = kept[str(c)]
            cost = bud.from_record(e, c)
            out["costs"][str(c)] = dict(e, kept_from=args.costs)
        else:
            cost, meta = bud.calibrate(params, cfg, drafter, batch=c, max_budget=MAX, tiers=args.tiers, steps=8,
                                       log=print)
            out["costs"][str(c)] = bud.cost_record(cost, meta)
        runs = [("ar", None)] + [("ddtree", b) for b in args.budgets]
        ar = None
        for method, b in runs:
            go = lambda: kj.generate(params, cfg, prompts, max_new_tokens=args.new_tokens, method=method,
                                     drafter=drafter, budget=b or 64, max_budget=MAX, tiers=cost.tiers,
                                     cost_model=cost)
            first = go()
            outs = [go() for _ in range(args.repeats)]
            wall = statistics.median(o.stats["wall_s"] for o in outs)
            ar = outs[0].tokens if method == "ar" else ar
            st = outs[0].stats
            row = dict(concurrency=c, method=method, budget=b, tokens=sum(map(len, outs[0].tokens)), wall_s=wall,
                       tokens_per_s=sum(map(len, outs[0].tokens)) / wall, tau=st["tau"], steps=st["steps"],
                       nodes=st["nodes"], nodes_histogram=st["nodes_histogram"], equal_ar=outs[0].tokens == ar,
                       compile_s=first.stats["compile_s"])
            out["rows"].append(row)
            print(f"C={c} {method} {b}: {row['tokens_per_s']:.1f} tok/s, tau {row['tau']:.2f}, nodes "
                  f"{row['nodes']:.1f}, = ar {row['equal_ar']}", flush=True)
            _save(args.out, "embedded", out)
    return out


def _full_scale_model(small: bool):
    from full_scale import per_device_model

    cfg, params = per_device_model(8, 3 if small else 61, small, "xla" if small else "ffi")
    if not small:
        drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=6, block_size=8, num_heads=64, num_kv_heads=8,
                                  intermediate_size=kj.configs.k2_6().intermediate_size)
        drafter = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, drafter)
    else:
        drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=1, block_size=8)
    return cfg, params, drafter


def part_fullscale(args) -> dict:
    small = args.small
    cfg, params, drafter = _full_scale_model(small)
    context = 256 if small else 4096
    out = dict(meta=_meta(args), layers=cfg.num_hidden_layers, context=context, fixed=[], costs={})
    t_end = time.perf_counter() + args.budget_s
    steps, repeats = (2, 1) if small else (args.steps, args.step_repeats)
    for c in args.concurrency:
        if time.perf_counter() > t_end:
            print(f"fullscale: time budget spent before C={c}", flush=True)
            break
        # marginal timing (runs of 2k minus runs of k steps): a call's entry costs ~30 ms at full scale (measured
        # with benchmarks/host_bound.py), so whole runs of 3 steps overstated a 18.5 ms step by half
        cost, meta = bud.calibrate(params, cfg, drafter, batch=c, max_budget=MAX, context=context, steps=steps,
                                   repeats=repeats, log=print, marginal=True)
        out["costs"][str(c)] = bud.cost_record(cost, meta)
        _save(args.out, "fullscale", out)
        # the fixed budgets start from the state calibrate started from (the same compiled prefill, the same cache)
        auto = speculative(cfg, "ddtree", drafter, MAX, bud.BudgetPolicy.choosing(bud.CostModel.from_points(
            cost.tiers, c, [[(1.0, 1.0)]] * len(cost.tiers))))
        s0 = bud.prefilled(auto, params, cfg, c, context, **bud.calibration_geometry(cfg, auto, context, steps)[2])
        for b in FULL_FIXED:
            if time.perf_counter() > t_end:
                print(f"fullscale: time budget spent before C={c} budget {b}", flush=True)
                break
            m = speculative(cfg, "ddtree", drafter, b)
            sec = bud.time_loop(m, params, cfg, s0, steps, repeats, marginal=True)
            out["fixed"].append(dict(concurrency=c, budget=b, step_s=sec))
            print(f"fullscale C={c} fixed budget {b}: {1e3 * sec:.2f} ms per step", flush=True)
            _save(args.out, "fullscale", out)
        if args.profile and c == 1 and time.perf_counter() < t_end:
            # where auto's extra time goes: its tier-16 program verifying 16 nodes against fixed 16, kernel by
            # kernel, and the GPU's idle time per step (span - busy: host round trips such as the switch's index)
            pol = auto.policy
            for name, m in (("auto tier 16, 16 nodes", auto.with_policy(pol.forced(0, cost.tiers[0]))),
                            ("fixed 16", speculative(cfg, "ddtree", drafter, cost.tiers[0]))):
                out.setdefault("profiles", {})[name] = _profile(m, params, cfg, s0, steps)
                p = out["profiles"][name]
                print(f"profile {name}: busy {p['busy_us']:.0f} us, span {p['span_us']:.0f} us per step", flush=True)
                _save(args.out, "fullscale", out)
        del s0
    return out


def part_diagnose(args) -> dict:
    """Where auto's extra step time goes, at full scale, C=1: the same prefilled state run by fixed 16 and 128, by auto
    with one tier (16: no switch, the tree built at 16) and by auto with tiers (16, 128) (the switch, the tree built
    at 128) forced to several (tier, nodes); step time and kernel profile of each."""
    cfg, params, drafter = _full_scale_model(args.small)
    context = 256 if args.small else 4096
    steps, repeats = (2, 1) if args.small else (args.steps, args.step_repeats)
    out = dict(meta=_meta(args), layers=cfg.num_hidden_layers, context=context, rows=[])
    dummy = lambda tiers: bud.BudgetPolicy.choosing(bud.CostModel.from_points(tiers, 1, [[(1.0, 1.0)]] * len(tiers)))
    two = speculative(cfg, "ddtree", drafter, 128, dummy((16, 128)))
    one = speculative(cfg, "ddtree", drafter, 16, dummy((16,)))
    s0 = bud.prefilled(two, params, cfg, 1, context, **bud.calibration_geometry(cfg, two, context, steps)[2])
    variants = [("fixed 16", speculative(cfg, "ddtree", drafter, 16)),
                ("auto (16,): 16 nodes", one.with_policy(one.policy.forced(0, 16))),
                ("auto (16,): 0 nodes", one.with_policy(one.policy.forced(0, 0))),
                ("auto (16,128): tier 16, 16 nodes", two.with_policy(two.policy.forced(0, 16))),
                ("auto (16,128): tier 16, 0 nodes", two.with_policy(two.policy.forced(0, 0))),
                ("auto (16,128): tier 128, 0 nodes", two.with_policy(two.policy.forced(1, 0))),
                ("auto (16,128): tier 128, 128 nodes", two.with_policy(two.policy.forced(1, 128))),
                ("fixed 128", speculative(cfg, "ddtree", drafter, 128))]
    for name, m in variants:
        t = time.perf_counter()
        sec = bud.time_loop(m, params, cfg, s0, steps, repeats, marginal=False)
        row = dict(name=name, step_s=sec, wall_s=time.perf_counter() - t)
        if args.profile:
            row["profile"] = _profile(m, params, cfg, s0, steps)
        out["rows"].append(row)
        p = row.get("profile", {})
        print(f"diagnose {name}: {1e3 * sec:.2f} ms per step; busy {p.get('busy_us', 0) / 1e3:.2f} ms, span "
              f"{p.get('span_us', 0) / 1e3:.2f} ms ({row['wall_s']:.0f} s)", flush=True)
        _save(args.out, "diagnose", out)
    base = {k: (n, us) for k, n, us in out["rows"][0].get("profile", {}).get("top_all", [])}
    for row in out["rows"][1:]:
        if "profile" not in row:
            continue
        cur = {k: (n, us) for k, n, us in row["profile"]["top_all"]}
        diff = sorted(((k, cur.get(k, (0, 0))[0] - base.get(k, (0, 0))[0], cur.get(k, (0, 0))[1] - base.get(k, (0, 0))[1])
                       for k in set(cur) | set(base)), key=lambda r: -abs(r[2]))[:12]
        print(f"--- {row['name']} minus fixed 16, per step (kernel, launches, us):", flush=True)
        for k, dn, dus in diff:
            print(f"    {k[:70]:70s} {dn:+8.1f} {dus:+9.1f}", flush=True)
    return out


def part_overhead(args) -> dict:
    """What one `generate` call pays besides its steps, auto vs the fixed budgets, on the embedded model: the wall of
    calls of several lengths (--lengths, median of --repeats) fitted as a + b x steps (a: per call, b: per step), and
    a profile of one call of --new-tokens tokens per method (GPU busy, span, launches; the host events that differ
    most). Auto takes its cost model from --costs (an auto_budget_embedded.json)."""
    from profile_tools import profile_calls

    model, params, cfg, drafter = _embedded(args)
    out = dict(meta=dict(_meta(args), ffi_ops=args.ffi_ops, xla_flags=os.environ.get("XLA_FLAGS", "")), rows=[],
               fits=[], profiles=[])
    data = json.load(open(args.costs))
    kept = data["costs"] if "costs" in data else data["embedded"]["costs"]
    missing = [c for c in args.concurrency if str(c) not in kept]
    if missing:
        raise SystemExit(f"overhead: {args.costs} has cost models for C = {sorted(kept)}, not for C = {missing}")
    for c in args.concurrency:
        cost = bud.from_record(kept[str(c)], c)
        prompts = _prompts(model.tokenizer, c, 128)
        ar = {}
        for b in args.budgets:
            go = lambda n, b=b: kj.generate(params, cfg, prompts, max_new_tokens=n, drafter=drafter,
                                            method="ar" if b == "ar" else "ddtree", budget=64 if b == "ar" else b,
                                            max_budget=MAX, cost_model=cost)
            pts = []
            for n in args.lengths:
                go(n)
                outs = [go(n) for _ in range(args.repeats)]
                wall = statistics.median(o.stats["wall_s"] for o in outs)
                pts.append((outs[0].stats["steps"], wall))
                ar = {**ar, n: outs[0].tokens} if b == "ar" else ar
                out["rows"].append(dict(concurrency=c, budget=b, new_tokens=n, steps=pts[-1][0], wall_s=wall,
                                        tau=outs[0].stats["tau"],
                                        equal_ar=outs[0].tokens == ar[n] if n in ar and b != "ar" else None))
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            mx, my = statistics.mean(xs), statistics.mean(ys)
            spread = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in pts) / spread if spread > 0 else my / max(mx, 1)
            call = my - slope * mx if spread > 0 else None  # one length (or equal steps): no per-call term
            fit = dict(concurrency=c, budget=b, per_call_s=call, per_step_s=slope, points=pts)
            out["fits"].append(fit)
            same = [r["equal_ar"] for r in out["rows"][-len(pts):]]
            head = "(one step count: wall / steps) " if call is None else f"{1e3 * call:.2f} ms per call + "
            print(f"C={c} budget {b}: {head}{1e3 * slope:.3f} ms per step "
                  f"({', '.join(f'{n} steps {1e3 * w:.1f} ms' for n, w in pts)}); = ar {same}", flush=True)
            prof = profile_calls(lambda _: go(args.new_tokens).tokens, (None,), 2)
            launches = sum(n for n, _ in prof["kernels"].values())
            host = sorted(prof["host"].items(), key=lambda kv: -kv[1][1])[:60]
            out["profiles"].append(dict(concurrency=c, budget=b, busy_us=prof["busy_us"], span_us=prof["span_us"],
                                        launches=launches, host=host))
            print(f"    profile, {args.new_tokens} tokens: GPU busy {prof['busy_us'] / 1e3:.2f} ms, span "
                  f"{prof['span_us'] / 1e3:.2f} ms, {launches:.0f} launches", flush=True)
            for k, (n, us) in host[:30]:
                print(f"      host {k[:80]:80s} {n:8.1f} {us / 1e3:8.2f} ms", flush=True)
            _save(args.out, "overhead", out)
    return out


def _profile(method, params, cfg, s0, steps: int) -> dict:
    """Kernels per step of the compiled loop run `steps` steps from a copy of s0 (jax.profiler trace)."""
    from profile_tools import profile_calls, top_kernels

    from kdtree_jax.decoding import Sampler, advance
    from kdtree_jax.sharding import trace_context

    def call(_):
        with trace_context(params, cfg):
            return advance(method, params, cfg, jax.tree.map(jnp.copy, s0), jnp.int32(steps), sampler=Sampler()).out

    prof = profile_calls(call, (None,), 2)
    return dict(busy_us=prof["busy_us"] / steps, span_us=prof["span_us"] / steps,
                top=[(k, n / steps, us / steps) for k, n, us in top_kernels(prof, 20)],
                top_all=[(k, n / steps, us / steps) for k, n, us in top_kernels(prof, 10 ** 6)])


def _cost_of(entry: dict, batch: int, fixed: dict | None = None) -> bud.CostModel:
    """A measured cost model, the per-context term dropped (the projection holds the context at the calibration's);
    `fixed` {budget: seconds}: the fixed budgets' measured steps as its tiers' fixed programs, where the record has
    none and every tier was measured."""
    if fixed and "fixed" not in entry and all(t in fixed for t in entry["tiers"]):
        entry = dict(entry, fixed=[fixed[t] for t in entry["tiers"]])
    return bud.from_record(entry, batch, per_context=0.0)


def equal_step_costs(entry: dict, fixed: dict) -> dict:
    """A cost-model entry with each tier's curve lowered (every point by the same amount) until its whole tier costs
    the fixed budget of its size, `fixed` {budget: seconds}: what auto would cost if its tier steps cost exactly the
    fixed steps (a prediction, `report --predict-equal-steps`, for a cost model measured before that was so)."""
    points = []
    for t, pts in zip(entry["tiers"], entry["points"]):
        top = max(pts, key=lambda q: q[0])[1]
        points.append([[tok, sec - (top - fixed[t])] for tok, sec in pts] if t in fixed else pts)
    return dict(entry, points=points)


def _project_one(params, cfg, drafter, prompts, new_tokens: int, budget, cost, fixed_s):
    """(tokens, seconds, steps, node histogram) of one batch of prompts decoded greedily to the end; auto runs a
    window (a planned step and the replan - 1 fixed steps after it) per call, as the loop runs them."""
    from kdtree_jax.decoding import advance, start
    from kdtree_jax.generate import _request, _start_args

    m, req = _request(params, cfg, prompts, drafter, max_new_tokens=new_tokens, method="ddtree",
                      budget=budget, temperature=0.0, top_k=None, top_p=None, eos_id=None, prefill_chunk=None,
                      max_budget=MAX, cost_model=cost)
    a, static = _start_args(m, params, cfg, req, 0)
    state = start(*a, **static)
    seconds, hist, last_tier = 0.0, np.zeros_like(np.asarray(state.nodes)), None
    window = cost.replan if budget == "auto" else 1  # a call runs one planned step and the fixed steps after it
    while not bool(np.all(np.asarray(state.done))):
        live, before = ~np.asarray(state.done), int(state.steps)
        state = advance(m, params, cfg, state, state.steps + window, sampler=req.sampler)
        now = np.asarray(state.nodes)
        diff, hist = now - hist, now  # [B, N + 1]: the window's steps of each row by the nodes they verified
        k = int(state.steps) - before
        if budget != "auto":
            seconds += k * fixed_s
            continue
        counts = np.arange(diff.shape[1])
        top = int(max(counts[diff[r] > 0].max() for r in np.flatnonzero(live)))
        # the fixed steps after a plan verify their tier's whole tree, so a window of several steps names its tier;
        # a single (planned) step is costed at the smallest tier that holds its nodes
        tier = next(i for i, t in enumerate(cost.tiers) if t >= top)
        row_steps, row_nodes = diff.sum(axis=1), (diff * counts).sum(axis=1)
        planned = np.where(live, row_nodes - np.maximum(row_steps - 1, 0) * cost.tiers[tier], 0)  # the planned step
        m_tok = float(np.sum(live) + np.sum(np.maximum(planned, 0)))
        seconds += float(np.interp(m_tok, np.asarray(cost.tokens[tier]), np.asarray(cost.seconds[tier])))
        seconds += (k - 1) * float(cost.fixed[tier])  # the fixed programs run every row, live or not
        seconds += float(cost.switch) if last_tier not in (None, tier) else 0.0
        last_tier = tier
    return int(np.asarray(state.num_out).sum()), seconds, int(state.steps), hist.sum(axis=0)


def part_project(args, emb: dict, full: dict) -> dict:
    """The embedded model's decoding, step by step, costed with the full-scale step times: `args.batches` batches of C
    held-out prompts, one after another, per cell."""
    model, params, cfg, drafter = _embedded(args)
    out = dict(meta=dict(_meta(args), ffi_ops=args.ffi_ops, batches=args.batches,
                         predict_equal_steps=args.predict_equal_steps), rows=[])
    for c in CONCURRENCY:
        if str(c) not in full["costs"] or c not in args.concurrency:
            continue
        prompts = _prompts(model.tokenizer, c * args.batches, 128)
        entry = full["costs"][str(c)]
        fixed = {f["budget"]: f["step_s"] for f in full["fixed"] if f["concurrency"] == c}
        if not fixed and "fixed" in entry:  # no fixed cells run: the fixed programs its calibration timed
            fixed = dict(zip(entry["tiers"], entry["fixed"]))
        cost = _cost_of(equal_step_costs(entry, fixed) if args.predict_equal_steps else entry, c, fixed)
        for b in [b for b in FIXED if b in fixed and b in args.budgets] + ["auto"] * ("auto" in args.budgets):
            total, seconds, steps, hist = 0, 0.0, 0, 0
            for i in range(args.batches):
                t, sec, st, h = _project_one(params, cfg, drafter, prompts[i * c:(i + 1) * c], args.new_tokens, b, cost,
                                             fixed.get(b))
                total, seconds, steps, hist = total + t, seconds + sec, steps + st, hist + h
            out["rows"].append(dict(concurrency=c, budget=b, steps=steps, tokens=total, seconds=seconds,
                                    tokens_per_s=total / seconds, tau=total / max(steps, 1) / c,
                                    nodes=float((hist * np.arange(hist.shape[0])).sum() / max(hist.sum(), 1))))
            print(f"projection C={c} budget {b}: {total / seconds:.1f} tok/s ({steps} steps)", flush=True)
    return out


def report(args) -> None:
    def load(name):
        path = os.path.join(args.out, f"auto_budget_{name}.json")
        return json.load(open(path)) if os.path.exists(path) else None

    emb, full = load("embedded"), load("fullscale")
    proj = part_project(args, emb, full) if full else None
    data = dict(commit=args.commit, embedded=emb, fullscale=full, projection=proj)
    lines = ["# budget=\"auto\" vs fixed DDTree budgets", "",
             "`python benchmarks/auto_budget.py embedded|fullscale --out DIR`, then `report`. Every ratio below is "
             "between numbers of one run.", ""]
    if emb:
        m = emb["meta"]
        lines += [f"## The embedded model ({m['date']}, {m['device']}, commit {m['commit']})", "",
                  "Greedy, held-out prompts of 128 tokens, 128 new tokens each; auto: max 128 nodes, tiers "
                  f"{' / '.join('/'.join(map(str, e['tiers'])) for e in emb.get('costs', {}).values())}, "
                  f"its cost model measured first in the same run. Custom calls: {m.get('ffi_ops') or 'none'}.", "",
                  "| C | budget | tokens/s | vs best fixed | tau | nodes / step | = ar |", "|---|---|---|---|---|---|---|"]
        for c in CONCURRENCY:
            rows = [r for r in emb["rows"] if r["concurrency"] == c and r["method"] == "ddtree"]
            if not rows:
                continue
            best = max(r["tokens_per_s"] for r in rows if r["budget"] != "auto")
            for r in [x for x in emb["rows"] if x["concurrency"] == c]:
                b = r["budget"] if r["method"] == "ddtree" else "ar"
                lines.append(f"| {c} | {b} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / best:.2f}x | "
                             f"{r['tau']:.2f} | {r['nodes']:.1f} | {r['equal_ar']} |")
        lines.append("")
    if full:
        m = full["meta"]
        lines += [f"## Full-scale K2.6, one GPU of an ep=8 mesh ({m['date']}, {m['device']}, commit {m['commit']}, "
                  f"{full['layers']} layers, context {full['context']})", "",
                  "Step = draft + tree build + verify + accept + keep, the loop compiled as `generate` runs it; "
                  "collectives not included.", "", "| C | fixed budget | step ms |", "|---|---|---|"]
        lines += [f"| {f['concurrency']} | {f['budget']} | {1e3 * f['step_s']:.2f} |" for f in full["fixed"]]
        missing = [c for c in CONCURRENCY if str(c) not in full["costs"]]
        if missing:
            lines += ["", f"Not measured: C = {', '.join(map(str, missing))} (see full.log of the run: the part stopped "
                          "before or failed in those cells)."]
        for c, e in full["costs"].items():
            lines += ["", f"Auto's cost model at C={c} (step ms by verified tokens, per tier):", ""]
            lines += [f"- tier {t}: " + ", ".join(f"{m:.0f} tok {1e3 * s:.2f}" for m, s in pts)
                      for t, pts in zip(e["tiers"], e["points"])]
        for name, p in full.get("profiles", {}).items():
            lines += ["", f"Kernels per step, C=1, {name} (GPU busy {p['busy_us'] / 1e3:.2f} ms, span "
                          f"{p['span_us'] / 1e3:.2f} ms):", "", "| kernel | launches | µs |", "|---|---|---|"]
            lines += [f"| `{k[:80]}` | {n:.0f} | {us:.0f} |" for k, n, us in p["top"]]
        lines.append("")
    if proj:
        pm = proj["meta"]
        lines += [f"## Projection: the embedded model's acceptance at the full-scale step times (acceptance run on "
                  f"{pm['device']}, {pm['date']}, commit {pm['commit']})", "",
                  "Fixed b: the embedded model's steps at budget b x the full-scale step of b. Auto: the embedded "
                  "model decoding with the full-scale cost model, each planned step costed at the nodes it verified "
                  "(and the switch term where its tier changed), each step between plans (replan > 1) at its tier's "
                  "fixed program. A "
                  "projection: collectives excluded, the context held at 4,096. "
                  f"Each cell decodes {pm.get('batches', 1)} batch(es) of C held-out prompts, one after another."]
        if pm.get("predict_equal_steps"):
            lines += ["", "**A prediction, not a projection** (`--predict-equal-steps`): auto's cost curves are lowered "
                          "so that each whole tier costs the fixed budget of its size, i.e. as if auto's tier step "
                          "cost exactly the fixed step; auto's rows use those costs for its choices and its time."]
        lines += ["",
                  "| C | budget | steps | tau | nodes / step | projected tok/s | vs best fixed |", "|---|---|---|---|---|---|---|"]
        for c in CONCURRENCY:
            rows = [r for r in proj["rows"] if r["concurrency"] == c]
            if not rows:
                continue
            fixed_best = max((r["tokens_per_s"] for r in rows if r["budget"] != "auto"), default=float("nan"))
            b64 = next((r["tokens_per_s"] for r in rows if r["budget"] == 64), float("nan"))
            for r in rows:
                lines.append(f"| {c} | {r['budget']} | {r['steps']} | {r['tau']:.2f} | {r['nodes']:.1f} | "
                             f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / fixed_best:.2f}x |")
            auto = next(r for r in rows if r["budget"] == "auto")
            lines.append(f"| {c} | auto vs 64 | | | | | {auto['tokens_per_s'] / b64:.2f}x |")
        lines.append("")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "auto_budget.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "auto_budget.json"), "w") as f:
        json.dump(data, f, indent=1)
    _plot(args.out, emb, proj)
    print("\n".join(lines))


def _plot(out: str, emb, proj) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(n, d) for n, d in (("embedded model, measured", emb), ("full scale, projected", proj)) if d]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (name, d) in zip(axes[0], panels):
        for c in CONCURRENCY:
            rows = [r for r in d["rows"] if r["concurrency"] == c and r.get("method", "ddtree") == "ddtree"]
            fixed = [r for r in rows if r["budget"] != "auto"]
            auto = [r for r in rows if r["budget"] == "auto"]
            if fixed:
                line, = ax.plot([r["budget"] for r in fixed], [r["tokens_per_s"] for r in fixed], "o-",
                                label=f"fixed, C={c}")
                for r in auto:
                    ax.axhline(r["tokens_per_s"], color=line.get_color(), ls="--", label=f"auto, C={c}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (nodes)")
        ax.set_ylabel("tokens/s")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "auto_budget.png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("embedded", "fullscale", "diagnose", "overhead", "report"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "auto_budget"))
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"))
    ap.add_argument("--small", action="store_true", help="fullscale: a tiny config (CPU smoke run)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", default="32,128,512", help="overhead: the new tokens of the fitted calls")
    ap.add_argument("--budget-s", type=float, default=1e9, help="fullscale: start no new cell after this many s")
    ap.add_argument("--steps", type=int, default=4,
                    help="fullscale, diagnose: k of the timed runs (fullscale: runs of 2k minus runs of k steps)")
    ap.add_argument("--concurrency", default="1,10",
                    help="embedded, fullscale, overhead: the batch sizes (comma-separated)")
    ap.add_argument("--budgets", default=",".join(map(str, FIXED)) + ",auto",
                    help="embedded: the ddtree budgets to run after ar; report: the projection's budgets; overhead: "
                         "the budgets fitted, 'ar' for ar (first, to check the others' tokens) (comma-separated; "
                         "'auto' included)")
    ap.add_argument("--costs", help="embedded: take auto's cost models from an earlier run's auto_budget_embedded.json "
                                    "(or a report's auto_budget.json) instead of calibrating")
    ap.add_argument("--tiers", default=None,
                    help="embedded: auto's tiers, comma-separated, the largest 128 (default: 8,16,32,64,128); 0 adds "
                         "autoregressive steps between plans (nothing drafted)")
    ap.add_argument("--step-repeats", type=int, default=2, help="fullscale, diagnose: timed runs per cell (median)")
    ap.add_argument("--profile", action="store_true",
                    help="fullscale: kernel profiles of auto's tier-16 step and of fixed 16 at C=1 (GPU)")
    ap.add_argument("--batches", type=int, default=12,
                    help="report: the projection decodes this many batches of C prompts per cell (default 12)")
    ap.add_argument("--predict-equal-steps", action="store_true",
                    help="report: a prediction, not a projection: auto's cost curves lowered so each whole tier costs "
                         "the fixed budget of its size (`equal_step_costs`)")
    ap.add_argument("--ffi-ops", default="tree_build,tree_accept",
                    help="embedded and report: the custom calls used (default: the tree kernels; '' for pure JAX)")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.budgets = [b if b in ("auto", "ar") else int(b) for b in args.budgets.split(",")]
    if "ar" in args.budgets and args.part != "overhead":
        ap.error("--budgets: 'ar' is for the overhead part (the other parts run ar first anyway)")
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.tiers = tuple(int(t) for t in args.tiers.split(",")) if args.tiers else None
    if args.batches < 1:
        ap.error("--batches must be >= 1")
    if args.part == "embedded":
        part_embedded(args)
    elif args.part == "fullscale":
        part_fullscale(args)
    elif args.part == "diagnose":
        part_diagnose(args)
    elif args.part == "overhead":
        if not args.costs:
            ap.error("overhead needs --costs (an auto_budget_embedded.json)")
        part_overhead(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
