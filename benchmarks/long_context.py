"""Long context on K2.6: decode against the cache bytes, three ways to hold the latent cache on 8 GPUs, and the
prefill of long prompts against the bf16 compute floor.

Parts (each writes `long_context_<part>.json` under --out; `report` joins them into long_context.{md,json,png}):

  sweep      1 GPU. The per-device program of an ep=8 mesh (`full_scale.per_device_model`: 1/8 of heads, experts,
             vocabulary), --layers layers, decode (one token per row) at contexts 4k / 32k / 128k for batch 1 and
             8, the cache donated and fed back. Per layer, the time added from 4k to a longer context is set
             against the cache bytes added, read at the copy bandwidth measured in the same run.
  attention  1 GPU. One K2 layer's attention kernels as one GPU of eight runs them, per design, at 32k / 128k,
             batch 1 and 8: "heads" (today's default: 8 of 64 heads, every row's whole cache on every GPU),
             "sequence" (the cache split by slots: all 64 heads over 1/8 of the slots with `mla_prefix`, the new
             tokens' part and the log-sum-exp combine; the collectives are in `mesh`), "dp" (rows split over
             GPUs: 64 heads over the whole cache of ceil(B/8) rows, plus the 7/8 of the attention weights this
             design replicates, a bytes floor term at the measured bandwidth).
  prefill    1 GPU. The per-device program, --layers layers, one prompt of 32k and 128k tokens into an empty
             cache with chunked prefill (`prefill_last`): time to first token, peak memory, and the bf16 compute
             floor (every weight matmul of each token, 1 of 8 local experts' share of the top-8, and causal
             attention in the naive form, 2 x (192 + 128) FLOPs per head, query and visible key), at the matmul
             rate measured in the same run.
  mesh       2 GPUs. K2-width layers on an ep=2 mesh: decode with the cache replicated vs sequence-sharded at
             4k / 32k / 128k, batch 1 and 8; the sequence design's collectives at their 8-GPU message sizes; and
             greedy tokens of a small bf16 model (ar and ddtree) sequence-sharded on 2 GPUs vs one device.

    python benchmarks/long_context.py sweep --out DIR         # each part on its machine, then:
    python benchmarks/long_context.py report --out DIR --commit HASH
    python benchmarks/long_context.py all --small --out /tmp/x  # CPU smoke run of every part
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
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
from common import ceilings, random_trees, timed  # noqa: E402
from full_scale import nbytes, per_device_model, time_step  # noqa: E402
from kdtree_jax.kernels.mla_verify import combine_lse, mla_prefix, mla_verify, tree_attention_lse  # noqa: E402
from kdtree_jax.model import init_cache, prefill_last, step  # noqa: E402
from kdtree_jax.sharding import trace_context  # noqa: E402
from profile_tools import profile_calls, top_kernels  # noqa: E402

N = 8  # the mesh whose one device each 1-GPU part runs
ROW_BYTES = (512 + 64) * 2  # one token's latent + rope key per layer, bf16


def _meta(args, ceil) -> dict:
    return dict(date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind),
                devices=jax.device_count(), commit=args.commit, copy_Bps=ceil.get("copy_Bps"),
                matmul_flops=ceil.get("matmul_flops"))


def _ceil(small: bool) -> dict:
    return ceilings() if jax.default_backend() == "gpu" and not small else {"copy_Bps": 50e9, "matmul_flops": 1e11}


def _save(args, name: str, res: dict) -> None:
    """Write a part's results so far (a part cut short by a time limit keeps what it measured)."""
    with open(os.path.join(args.out, f"long_context_{name}.json"), "w") as f:
        json.dump(res, f, indent=1)


def _model(args):
    return per_device_model(N, args.layers, args.small, "ffi")


def part_sweep(args) -> dict:
    ceil = _ceil(args.small)
    cfg, params = _model(args)
    rng = np.random.default_rng(0)
    contexts = (256, 1024, 2048) if args.small else (4096, 32768, 131072)
    rows = []
    for batch in (1, 8):
        for context in contexts:
            try:
                step_s, compile_s, _ = time_step(params, cfg, batch, 1, context, rng, args.repeats, False)
            except Exception as e:  # noqa: BLE001 (out of memory is a result to record)
                print(f"sweep {batch} x {context}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            rows.append(dict(batch=batch, context=context, step_s=step_s, compile_s=compile_s))
            _save(args, "sweep", dict(meta=_meta(args, ceil), layers=cfg.num_hidden_layers, rows=rows))
            print(f"sweep batch {batch} context {context}: {1e3 * step_s:.2f} ms", flush=True)
    for r in rows:
        base = next((b for b in rows if b["batch"] == r["batch"] and b["context"] == contexts[0]), None)
        if base is not None and r["context"] > contexts[0]:
            added = r["batch"] * (r["context"] - contexts[0]) * ROW_BYTES  # per layer
            r["added_per_layer_s"] = (r["step_s"] - base["step_s"]) / cfg.num_hidden_layers
            r["added_floor_per_layer_s"] = added / ceil["copy_Bps"]
    return dict(meta=_meta(args, ceil), layers=cfg.num_hidden_layers, rows=rows)


def _attention_weight_bytes(cfg) -> int:
    """Bytes of one layer's attention weights at full width (all heads)."""
    h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    n = (cfg.hidden_size * cfg.q_lora_rank + cfg.q_lora_rank * h * (dn + dr)
         + cfg.hidden_size * (cfg.kv_lora_rank + dr) + cfg.kv_lora_rank * h * (dn + dv) + h * dv * cfg.hidden_size)
    return 2 * n


def part_attention(args) -> dict:
    ceil = _ceil(args.small)
    full = kj.configs.k2_6()
    heads, r, dr = (8, 32, 16) if args.small else (full.num_attention_heads, 512, 64)
    dtype = jnp.float32 if args.small else jnp.bfloat16
    scale = 0.07
    rng = np.random.default_rng(1)
    rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    contexts = (512, 2048) if args.small else (32768, 131072)
    rows = []
    for context in contexts:
        for batch in (1, 8):
            lens = jnp.full((batch,), context - 1, jnp.int32)
            one = jnp.ones((batch, 1, 1), bool)
            # heads: 1/8 of the heads over every row's whole cache
            q, qp, lat, pe = rand(batch, 1, heads // N, r), rand(batch, 1, heads // N, dr), rand(batch, context, r), \
                rand(batch, context, dr)
            t_heads, _ = timed(jax.jit(lambda *a: mla_verify(*a, scale)), (q, qp, lat, pe, lens, one), 1)
            # sequence: every head over 1/8 of the slots, the new token's part, the combine (collectives: `mesh`)
            s_loc = context // N
            qa, qpa, lat_l, pe_l = rand(batch, 1, heads, r), rand(batch, 1, heads, dr), rand(batch, s_loc, r), \
                rand(batch, s_loc, dr)
            new_l, new_p = rand(batch, 1, r), rand(batch, 1, dr)

            def seq_local(qa, qpa, lat_l, pe_l, vis, new_l, new_p, m):
                out, lse = mla_prefix(qa, qpa, lat_l, pe_l, vis, scale)
                mine = heads // N
                pre = (out[:, :, :mine], lse[:, :, :mine])
                return combine_lse(pre, tree_attention_lse(qa[:, :, :mine], qpa[:, :, :mine], new_l, new_p, m,
                                                           scale))[0]

            vis = jnp.full((batch,), s_loc, jnp.int32)
            t_seq, _ = timed(jax.jit(seq_local), (qa, qpa, lat_l, pe_l, vis, new_l, new_p, one), 1)
            # dp: every head over the whole cache of ceil(B / 8) rows, plus the replicated attention weights
            rows_dp = -(-batch // N)
            qd, qpd = rand(rows_dp, 1, heads, r), rand(rows_dp, 1, heads, dr)
            t_dp, _ = timed(jax.jit(lambda *a: mla_verify(*a, scale)),
                            (qd, qpd, lat[:rows_dp], pe[:rows_dp], lens[:rows_dp], one[:rows_dp]), 1)
            extra = _attention_weight_bytes(full) * (N - 1) / N / ceil["copy_Bps"]
            rows.append(dict(context=context, batch=batch, heads_s=t_heads, sequence_s=t_seq, dp_kernel_s=t_dp,
                             dp_weights_s=extra, dp_s=t_dp + extra,
                             cache_floor_heads_s=batch * context * ROW_BYTES / ceil["copy_Bps"],
                             cache_floor_sequence_s=batch * s_loc * ROW_BYTES / ceil["copy_Bps"]))
            print(f"attention context {context} batch {batch}: heads {1e6 * t_heads:.0f} us, sequence "
                  f"{1e6 * t_seq:.0f} us, dp {1e6 * t_dp:.0f} + {1e6 * extra:.0f} us", flush=True)
            del q, qp, lat, pe, qa, qpa, lat_l, pe_l
    return dict(meta=_meta(args, ceil), rows=rows)


def prefill_flops(cfg, t: int) -> float:
    """bf16 FLOPs of one t-token prompt through the per-device program: weight matmuls per token (the local
    experts' share of the top-k), causal attention in the naive form."""
    per_token = 0
    for i in range(cfg.num_hidden_layers):
        h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        per_token += (cfg.hidden_size * cfg.q_lora_rank + cfg.q_lora_rank * h * (dn + dr)
                      + cfg.hidden_size * (cfg.kv_lora_rank + dr) + cfg.kv_lora_rank * h * (dn + dv)
                      + h * dv * cfg.hidden_size)
        if i < cfg.first_k_dense_replace:
            per_token += 3 * cfg.hidden_size * cfg.intermediate_size
        else:
            per_token += 3 * cfg.hidden_size * cfg.moe_intermediate_size * (
                cfg.num_experts_per_tok + cfg.n_shared_experts / N)
    attention = cfg.num_hidden_layers * cfg.num_attention_heads * t * (t + 1) / 2 * 2 * (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return 2 * per_token * t + attention


def part_prefill(args) -> dict:
    ceil = _ceil(args.small)
    cfg, params = _model(args)
    rng = np.random.default_rng(2)
    rows = []
    for t in ((1024, 4096) if args.small else (32768, 131072)):
        for chunk in args.chunks:
            tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32)
            lens = jnp.full((1,), t, jnp.int32)
            cache = init_cache(cfg, 1, -(-t // chunk) * chunk + 64)
            fn = jax.jit(lambda p, tok, ln, c: prefill_last(p, cfg, tok, ln, c, chunk)[:2], donate_argnums=3)
            try:
                with trace_context(params, cfg):
                    t0 = time.perf_counter()
                    compiled = fn.lower(params, tokens, lens, cache).compile()
                    compile_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    last, cache = jax.block_until_ready(compiled(params, tokens, lens, cache))
                    ttft = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 (out of memory is a result to record)
                print(f"prefill {t} chunk {chunk}: failed: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            assert bool(jnp.all(jnp.isfinite(last)))
            stats = jax.devices()[0].memory_stats() or {}
            flops = prefill_flops(cfg, t)
            rows.append(dict(tokens=t, chunk=chunk, ttft_s=ttft, compile_s=compile_s, flops=flops,
                             floor_s=flops / ceil["matmul_flops"], peak_bytes=stats.get("peak_bytes_in_use"),
                             params_bytes=nbytes(params), cache_bytes=nbytes(cache.latent) + nbytes(cache.k_pe)))
            print(f"prefill {t} tokens, chunk {chunk}: {ttft:.2f} s, floor {flops / ceil['matmul_flops']:.2f} s "
                  f"({flops / ceil['matmul_flops'] / ttft:.0%}), compile {compile_s:.0f} s", flush=True)
            del cache
            _save(args, "prefill", dict(meta=_meta(args, ceil), layers=cfg.num_hidden_layers, rows=rows))
    res = dict(meta=_meta(args, ceil), layers=cfg.num_hidden_layers, rows=rows)
    if jax.default_backend() == "gpu" and not args.small:  # where the time of a 32k prompt goes, by kernel
        t, chunk = 32768, args.chunks[-1]
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32)
        fn = jax.jit(lambda p, tok: prefill_last(p, cfg, tok, jnp.full((1,), t, jnp.int32),
                                                 init_cache(cfg, 1, t + 64), chunk)[0])
        with trace_context(params, cfg):
            prof = profile_calls(fn, (params, tokens), 1)
        res["profile"] = dict(tokens=t, chunk=chunk, busy_us=prof["busy_us"], top=top_kernels(prof, 15))
        for k, c, us in res["profile"]["top"]:
            print(f"  {us / prof['busy_us']:5.1%} {us / 1e3:9.1f} ms {c:6.0f}x {k[:90]}", flush=True)
    return res


def _mesh_step(cfg, params, mesh, batch: int, context: int, rng, sequence: bool, profile: bool = False):
    cfg = dataclasses.replace(cfg, cache_sharding="sequence" if sequence else "replicated")
    with jax.set_mesh(mesh):
        cache = init_cache(cfg, batch, context + 8 * N)
        cache = dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))
    tokens = jnp.asarray(rng.integers(0, 1000, (batch, 1)), jnp.int32)
    depths, vis = random_trees(batch, 1, rng)
    fn = jax.jit(lambda p, c, tok, d, m: (lambda o: (o.logits[:, 0, :8], o.cache))(
        step(p, cfg, tok, c, depths=d, tree_mask=m)), donate_argnums=1)
    state = [params, cache, tokens, jnp.asarray(depths), jnp.asarray(vis)]

    def call():
        out, state[1] = fn(*state)
        return out

    with trace_context(params, cfg):
        jax.block_until_ready(call())
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(5):
                out = call()
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - t0) / 5)
        prof = profile_calls(lambda: call(), (), 3) if profile else None
    return (float(np.median(samples)), prof) if profile else float(np.median(samples))


def _collectives(mesh, batch: int, heads: int, r: int, repeats: int = 20) -> float:
    """Seconds of the sequence design's collectives of one layer at its 8-GPU message sizes (one decode token per
    row), as `sharding.mla_sequence_parallel` issues them: the queries (1/8 of the heads per device) gathered,
    then one all-to-all of every head's (partial output, log-sum-exp); `repeats` of them in one program on this
    mesh, each depending on the last."""
    axes = ("ep", "tp")
    spec = jax.sharding.PartitionSpec(None, None, axes, None)
    n = mesh.shape["ep"] * mesh.shape["tp"]
    q = jax.device_put(jnp.ones((batch, 1, heads // N * n, r + 64), jnp.bfloat16),
                       jax.sharding.NamedSharding(mesh, spec))
    part = jax.device_put(jnp.ones((batch, 1, heads * n, r + 1), jnp.float32), jax.sharding.NamedSharding(mesh, spec))

    def body(_, carry):
        q, part = carry
        g = jax.lax.all_gather(q, axes, axis=2, tiled=True)  # [B, 1, 8 heads x n, R + 64]
        moved = jax.lax.all_to_all(part[None] + g[:1, :1, :1, :1].astype(jnp.float32), axes, 3, 0, tiled=True)
        return q, jnp.tile(moved.sum(0), (1, 1, n, 1)) / n

    local = lambda q, part: jax.lax.fori_loop(0, repeats, body, (q, part))
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False))
    return timed(fn, (q, part), repeats, min_batch=0.0, samples=5)[0]


def part_mesh(args) -> dict:
    ceil = _ceil(args.small)
    out = dict(meta=_meta(args, ceil), rows=[], collectives=[], tokens={})
    if jax.device_count() < 2:
        print("mesh: needs 2 devices", flush=True)
        return out
    mesh = kj.make_mesh(ep=2, devices=jax.devices()[:2])
    rng = np.random.default_rng(3)
    layers = 2 if args.small else args.mesh_layers
    base = dict(num_hidden_layers=layers, first_k_dense_replace=0, kernels="ffi")
    if args.small:
        cfg = kj.configs.tiny(**base, num_attention_heads=8, n_routed_experts=16, moe_intermediate_size=256,
                              max_position_embeddings=8192)
    else:
        cfg = kj.configs.k2_6(**base)
    params = kj.shard_params(kj.init_params(cfg, jax.random.key(0)), cfg, mesh)
    for context in ((256, 2048) if args.small else (4096, 32768, 131072)):
        for batch in (1, 8):
            row = dict(context=context, batch=batch, layers=layers)
            for name, seq in (("replicated_s", False), ("sequence_s", True)):
                try:
                    row[name] = _mesh_step(cfg, params, mesh, batch, context, rng, seq)
                except Exception as e:  # noqa: BLE001 (out of memory is a result to record)
                    print(f"mesh {name} {batch} x {context}: failed: {str(e).splitlines()[0][:200]}", flush=True)
            out["rows"].append(row)
            print(f"mesh context {context} batch {batch}: " + ", ".join(
                f"{k} {1e3 * v:.2f} ms" for k, v in row.items() if k.endswith("_s")), flush=True)
    if jax.default_backend() == "gpu":  # the kernels of a replicated-cache decode step at batch 1 and 8
        out["profiles"] = {}
        for batch in (1, 8):
            _, prof = _mesh_step(cfg, params, mesh, batch, 4096, rng, False, profile=True)
            out["profiles"][str(batch)] = dict(busy_us=prof["busy_us"], top=top_kernels(prof, 12))
            print(f"profile, batch {batch}, 4k, replicated (GPU busy {prof['busy_us'] / 1e3:.2f} ms per step):",
                  flush=True)
            for k, c, us in out["profiles"][str(batch)]["top"]:
                print(f"  {us:8.0f} us {c:5.0f}x {k[:90]}", flush=True)
    heads, r = (cfg.num_attention_heads, cfg.kv_lora_rank)
    for batch in (1, 8):
        sec = _collectives(mesh, batch, heads, r)
        out["collectives"].append(dict(batch=batch, seconds=sec))
        print(f"sequence collectives, batch {batch}: {1e6 * sec:.0f} us per layer", flush=True)
    del params
    model = kj.load("builtin")  # trained (sharp logits), cast to bf16
    small = dataclasses.replace(model.cfg, dtype="bfloat16", kernels="ffi")
    sp = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, model.params)
    texts = ["def fibonacci(n):\n", "import numpy as np\n\n", "class Stack:\n    def push(self, x):",
             "for i in range(10):\n"]
    prompts = [model.tokenizer.encode(t) for t in texts]
    sharded = kj.shard_params(sp, small, mesh)
    for method in ("ar", "ddtree"):
        kw = dict(max_new_tokens=64, method=method, drafter=model.drafter if method == "ddtree" else None)
        one = kj.generate(sp, small, prompts, **kw).tokens
        for layout in ("sequence", "replicated"):
            two = kj.generate(sharded, dataclasses.replace(small, cache_sharding=layout), prompts, **kw).tokens
            same = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                       for x, y in zip(one, two))
            out["tokens"][f"{method}, {layout} cache"] = dict(equal=one == two, rows=len(prompts),
                                                              tokens=sum(map(len, one)), equal_prefix_tokens=same)
            print(f"greedy tokens, {method}, bf16 embedded model, {layout} cache on 2 devices = one device: "
                  f"{one == two} ({same} of {sum(map(len, one))} tokens before the first difference)", flush=True)
    return out


PARTS = {"sweep": part_sweep, "attention": part_attention, "prefill": part_prefill, "mesh": part_mesh}


def report(out_dir: str, commit: str) -> str:
    data = {}
    for name in PARTS:
        path = os.path.join(out_dir, f"long_context_{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                data[name] = json.load(f)
    lines = ["# Long context: K2.6 decode and prefill against their floors", "",
             "`python benchmarks/long_context.py PART --out DIR`, then `report`; every ratio below is between "
             "numbers measured in the same run of its part.", ""]
    sw = data.get("sweep")
    if sw:
        m = sw["meta"]
        lines += [f"## Decode against the cache bytes ({m['date']}, {m['device']}, commit {m['commit']}, per-device program of ep=8, "
                  f"{sw['layers']} layers, copy {m['copy_Bps'] / 1e12:.2f} TB/s)", "",
                  "| batch | context | step ms | added per layer µs | added cache bytes at copy speed µs | ratio |",
                  "|---|---|---|---|---|---|"]
        for r in sw["rows"]:
            extra = (f"{1e6 * r['added_per_layer_s']:.1f} | {1e6 * r['added_floor_per_layer_s']:.1f} | "
                     f"{r['added_per_layer_s'] / r['added_floor_per_layer_s']:.2f}x" if "added_per_layer_s" in r
                     else "- | - | -")
            lines.append(f"| {r['batch']} | {r['context']} | {1e3 * r['step_s']:.2f} | {extra} |")
        lines.append("")
    at = data.get("attention")
    if at:
        m = at["meta"]
        lines += [f"## One layer's attention on one GPU of eight, three cache layouts ({m['date']}, {m['device']}, commit "
                  f"{m['commit']})",
                  "", "heads: 8 heads, whole cache of every row (today's default). sequence: 64 heads over 1/8 of "
                  "the slots + new tokens + combine (collectives below, under the 2-GPU part). dp: 64 heads over "
                  "the whole cache of ceil(B/8) rows + reading the 7/8 of the attention weights it replicates "
                  "(bytes at copy speed). Cache floor: that layout's cache bytes at copy speed.", "",
                  "| context | batch | heads µs | cache floor µs | sequence µs | cache floor µs | dp µs (kernel + "
                  "weights) |", "|---|---|---|---|---|---|---|"]
        for r in at["rows"]:
            lines.append(f"| {r['context']} | {r['batch']} | {1e6 * r['heads_s']:.0f} | "
                         f"{1e6 * r['cache_floor_heads_s']:.0f} | {1e6 * r['sequence_s']:.0f} | "
                         f"{1e6 * r['cache_floor_sequence_s']:.0f} | {1e6 * r['dp_s']:.0f} ({1e6 * r['dp_kernel_s']:.0f}"
                         f" + {1e6 * r['dp_weights_s']:.0f}) |")
        lines.append("")
    pf = data.get("prefill")
    if pf:
        m = pf["meta"]
        lines += [f"## Prefill of one long prompt ({m['date']}, {m['device']}, commit {m['commit']}, per-device program of ep=8, "
                  f"{pf['layers']} layers, bf16 matmul {m['matmul_flops'] / 1e12:.0f} TFLOP/s measured)", "",
                  "| prompt | chunk | time to first token s | compute floor s | % of floor | peak GB | weights GB | "
                  "cache GB | compile s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in pf["rows"]:
            peak = f"{r['peak_bytes'] / 1e9:.1f}" if r.get("peak_bytes") else "-"
            lines.append(f"| {r['tokens']} | {r['chunk']} | {r['ttft_s']:.2f} | {r['floor_s']:.2f} | "
                         f"{r['floor_s'] / r['ttft_s']:.0%} | {peak} | {r['params_bytes'] / 1e9:.1f} | "
                         f"{r['cache_bytes'] / 1e9:.1f} | {r['compile_s']:.0f} |")
        prof = pf.get("profile")
        if prof:
            lines += ["", f"Kernels of one {prof['tokens']}-token prompt in chunks of {prof['chunk']} (GPU busy "
                          f"{prof['busy_us'] / 1e6:.2f} s):", "", "| kernel | launches | ms | share |", "|---|---|---|---|"]
            lines += [f"| `{k[:80]}` | {c:.0f} | {us / 1e3:.1f} | {us / prof['busy_us']:.0%} |" for k, c, us in prof["top"]]
        lines.append("")
    me = data.get("mesh")
    if me and me["rows"]:
        m = me["meta"]
        lines += [f"## Replicated vs sequence-sharded cache on an ep=2 mesh ({m['date']}, {m['devices']} x "
                  f"{m['device']}, commit {m['commit']}, K2-width layers, decode)", "",
                  "| context | batch | layers | replicated ms | sequence ms |", "|---|---|---|---|---|"]
        for r in me["rows"]:
            cell = lambda k: f"{1e3 * r[k]:.2f}" if k in r else "failed"
            lines.append(f"| {r['context']} | {r['batch']} | {r['layers']} | {cell('replicated_s')} | "
                         f"{cell('sequence_s')} |")
        for batch, prof in me.get("profiles", {}).items():
            lines += ["", f"Kernels of a decode step, batch {batch}, 4k, replicated cache (both GPUs' streams summed, "
                          f"{prof['busy_us'] / 1e3:.2f} ms):", "", "| kernel | launches | µs |", "|---|---|---|"]
            lines += [f"| `{k[:80]}` | {c:.0f} | {us:.0f} |" for k, c, us in prof["top"]]
        lines += [""] + [f"- Collectives of the sequence design per layer at 8-GPU message sizes, batch {c['batch']}:"
                         f" {1e6 * c['seconds']:.0f} µs (timed on this mesh)." for c in me["collectives"]]
        lines += [f"- Greedy tokens, {k}, the embedded model in bf16 on 2 devices = on one device: "
                  f"{v['equal']} ({v['rows']} prompts, {v['equal_prefix_tokens']} of {v['tokens']} tokens before "
                  "the first difference)." for k, v in me["tokens"].items()]
        lines.append("")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "long_context.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "long_context.json"), "w") as f:
        json.dump(dict(commit=commit, **data), f, indent=1)
    _plot(out_dir, data, commit)
    return text


def _plot(out_dir: str, data: dict, commit: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sw = data.get("sweep")
    if sw:
        for batch in (1, 8):
            rs = [r for r in sw["rows"] if r["batch"] == batch]
            axes[0].plot([r["context"] / 1024 for r in rs], [1e3 * r["step_s"] for r in rs], "o-",
                         label=f"batch {batch}, {sw['layers']} layers")
        axes[0].set_xlabel("context (k tokens)")
        axes[0].set_ylabel("decode step ms (per-device program)")
        axes[0].legend()
    at = data.get("attention")
    if at:
        labels = [f"{r['context'] // 1024}k\nB={r['batch']}" for r in at["rows"]]
        x = np.arange(len(labels))
        for i, (key, name) in enumerate((("heads_s", "heads"), ("sequence_s", "sequence"), ("dp_s", "dp"))):
            axes[1].bar(x + (i - 1) * 0.27, [1e6 * r[key] for r in at["rows"]], 0.27, label=name)
        axes[1].set_xticks(x, labels)
        axes[1].set_ylabel("one layer's attention on 1 GPU of 8, µs")
        axes[1].legend()
    fig.suptitle(f"K2.6 long context ({', '.join(sorted({d['meta']['commit'] for d in data.values()}))})")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "long_context.png"), dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=[*PARTS, "report", "all"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "long_context"))
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"))
    ap.add_argument("--layers", type=int, default=30, help="layers of the per-device program (sweep, prefill)")
    ap.add_argument("--mesh-layers", type=int, default=4, help="K2-width MoE layers of the 2-GPU part")
    ap.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[1024, 4096],
                    help="prefill chunk sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    args = ap.parse_args(argv)
    if args.small and args.layers > 4:
        args.layers = 3
    os.makedirs(args.out, exist_ok=True)
    for name in (PARTS if args.part == "all" else [args.part] if args.part != "report" else []):
        _save(args, name, PARTS[name](args))
    print(report(args.out, args.commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
