"""Is the drafter's path probability a calibrated chance of acceptance? (budget="auto" relies on it, issue 19)

budget="auto" takes node i's path probability p_i under the draft distributions (`budget_policy.node_scores`) as
the chance that the target accepts it, and so sum p_i over the verified nodes as the tokens a step gains. This
script decodes held-out prompts with the embedded model (greedy, ddtree with every node of a `--budget` tree
verified), and for every node of every step records p_i and whether the node was on the accepted path. It prints
the acceptance rate per bin of p_i next to the bins' mean p_i, and the totals per step and row: sum p_i against
the nodes accepted. A calibrated drafter has the two columns equal.

    python benchmarks/draft_calibration.py --out DIR          # writes DIR/draft_calibration.json

The prompts are windows of the running Python's held-out standard-library files (as `kdtree-jax bench`), so the
numbers depend on the Python version; the results record it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kdtree_jax as kj  # noqa: E402
from kdtree_jax import budget as bud  # noqa: E402
from kdtree_jax.budget_policy import node_scores  # noqa: E402
from kdtree_jax.cli import _bench_prompts  # noqa: E402
from kdtree_jax.ddtree import speculative  # noqa: E402
from kdtree_jax.decoding import Sampler, advance, start  # noqa: E402

BINS = (0.0, 0.001, 0.01, 0.03, 0.1, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0 + 1e-9)


def accepted_nodes(tokens: np.ndarray, parents: np.ndarray, committed: np.ndarray) -> set[int]:
    """The tree nodes on the accepted path of one row: from the root, the child whose token is the next committed
    token, while there is one (the last committed token is the bonus, the target's own, on no node)."""
    nodes, cur = {0}, 0
    for tok in committed[:-1]:
        kids = np.flatnonzero((parents == cur) & (tokens == tok))
        if kids.size == 0:
            break
        cur = int(kids[0])
        nodes.add(cur)
    return nodes


def measure(batch: int, new_tokens: int, budget: int, prompt_len: int) -> dict:
    model = kj.load("builtin")
    cfg, params, drafter = model.cfg, model.params, model.drafter
    prompts = jnp.asarray(np.array(_bench_prompts(model.tokenizer, batch, prompt_len, 0)), jnp.int32)
    tiers = (budget,)
    policy = bud.BudgetPolicy.choosing(bud.CostModel.from_points(tiers, batch, [[(1.0, 1.0)]])).forced(0, budget)
    m = speculative(cfg, "ddtree", drafter, budget, policy)  # one tier, every node verified, its plan readable
    s = start(m, params, cfg, prompts, jnp.full((batch,), prompt_len, jnp.int32), jax.random.key(0), jnp.int32(-1),
              sampler=Sampler(), cache_len=prompt_len + new_tokens + budget + 16, max_new=new_tokens, chunk=None)

    @jax.jit
    def plan(s):
        draft_logits = m.propose(params, cfg, s, Sampler())
        tree = m.build(cfg, draft_logits, s.last)
        return tree, node_scores(draft_logits, tree.tokens, tree.depths, tree.visibility)

    p, acc, rows = [], [], 0
    edges = []  # (depth, edge probability q, accepted) of every node whose parent was accepted (the node was tested)
    while not bool(np.all(np.asarray(s.done))):
        tree, scores = plan(s)  # the tree the next step builds (the same state, the same key)
        before, live = np.asarray(s.num_out), ~np.asarray(s.done)
        s = advance(m, params, cfg, s, s.steps + 1, sampler=Sampler())
        out, after = np.asarray(s.out), np.asarray(s.num_out)
        tok, par, sc = np.asarray(tree.tokens), np.asarray(tree.parents), np.asarray(scores)
        for b in np.flatnonzero(live):
            on = accepted_nodes(tok[b], par[b], out[b, before[b]:after[b]])
            p += np.exp(sc[b, 1:]).tolist()
            acc += [i in on for i in range(1, tok.shape[1])]
            dep = np.asarray(tree.depths)[b]
            for i in range(1, tok.shape[1]):
                if par[b, i] in on:
                    edges.append((int(dep[i]), float(np.exp(sc[b, i] - sc[b, par[b, i]])), i in on))
            rows += 1
    p, acc = np.asarray(p), np.asarray(acc)
    bins = []
    for lo, hi in zip(BINS, BINS[1:]):
        sel = (p >= lo) & (p < hi)
        if sel.any():
            bins.append(dict(lo=lo, hi=min(hi, 1.0), nodes=int(sel.sum()), mean_p=float(p[sel].mean()),
                             accepted=float(acc[sel].mean())))
    e = np.asarray(edges, np.float64).reshape(-1, 3)
    by_edge = []
    for depths in ((1, 1), (2, 2), (3, 1 << 30)):
        for lo, hi in zip(BINS, BINS[1:]):
            sel = (e[:, 0] >= depths[0]) & (e[:, 0] <= depths[1]) & (e[:, 1] >= lo) & (e[:, 1] < hi)
            if sel.any():
                by_edge.append(dict(depth=f"{depths[0]}" if depths[0] == depths[1] else f"{depths[0]}+", lo=lo,
                                    hi=min(hi, 1.0), edges=int(sel.sum()), mean_q=float(e[sel, 1].mean()),
                                    accepted=float(e[sel, 2].mean())))
    return dict(meta=dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                          python=sys.version.split()[0], jax=jax.__version__, commit=os.environ.get("KDTREE_COMMIT",
                                                                                                    "unknown")),
                batch=batch, new_tokens=new_tokens, budget=budget, step_rows=rows,
                sum_p_per_step=float(p.sum() / max(rows, 1)), accepted_per_step=float(acc.sum() / max(rows, 1)),
                bins=bins, edges=by_edge)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "draft_calibration"),
                    help="directory for draft_calibration.json (default: results/draft_calibration/)")
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded together (default 8)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--budget", type=int, default=128, help="tree nodes, every one verified (default 128)")
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args(argv)
    if min(args.batch, args.new_tokens, args.budget, args.prompt_len) < 1:
        ap.error("--batch, --new-tokens, --budget and --prompt-len must be >= 1")
    res = measure(args.batch, args.new_tokens, args.budget, args.prompt_len)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "draft_calibration.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{res['step_rows']} step-rows: sum of p per step {res['sum_p_per_step']:.2f}, nodes accepted per step "
          f"{res['accepted_per_step']:.2f} (Python {res['meta']['python']})")
    print("| p_i | nodes | mean p_i | accepted |\n|---|---|---|---|")
    for b in res["bins"]:
        print(f"| [{b['lo']:.3f}, {b['hi']:.2f}) | {b['nodes']} | {b['mean_p']:.3f} | {b['accepted']:.3f} |")
    print("\nPer edge, given its parent accepted: q = the drafter's probability of the node's token at its depth.")
    print("| depth | q | edges | mean q | accepted |\n|---|---|---|---|---|")
    for b in res["edges"]:
        print(f"| {b['depth']} | [{b['lo']:.3f}, {b['hi']:.2f}) | {b['edges']} | {b['mean_q']:.3f} | "
              f"{b['accepted']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
