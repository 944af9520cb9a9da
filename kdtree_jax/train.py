"""Training the embedded default model: a small K2-architecture target and its DFlash drafter.

Corpus: the Python standard library's own source files, bytes as tokens (`kdtree_jax.corpus`).

1. `train_target`: next-byte cross-entropy with AdamW (optax: global-norm clipping, linear warmup, cosine decay to a
   tenth of the peak rate, weight decay on matrices only); the MoE router's `e_score_correction_bias` is trained the
   DeepSeek-V3 way (no auxiliary loss: after each step, bias += rate * sign(mean load - expert load)).
2. `export_int4`: routed experts quantized to symmetric INT4 with group-32 bf16 scales (the K2.6 format).
3. `distill_drafter`: the target's own greedy continuations of held-in prompts are the labels; random anchor
   positions in the continuation, one masked block per anchor, cross-entropy per depth k weighted by
   exp(-(k - 1) / gamma), as in the published DFlash recipe (docs/ddtree.md §5).

Run `python -m kdtree_jax.train --out DIR` (on a GPU: a few minutes); `--help` lists the knobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .builtin import from_shipping, load_npz, save_npz, shipping_struct, to_shipping
from .config import ModelConfig
from .configs import TINY_BOS, TINY_EOS, TINY_MASK
from .corpus import corpus_split, load_tokens, windows
from .drafter import Drafter, append_context, draft, init_draft_cache, init_drafter
from .generate import generate
from .kernels.marlin_moe import moe_experts_dense
from .model import (
    MoE,
    Params,
    _forward_jit,
    _logits,
    embed,
    init_params,
    mla,
    rms_norm,
    rope_tables,
    route,
    swiglu,
)
from .quant import quantize_int4

# --------------------------------------------------------------------------------------------------------------
# The embedded model's shape
# --------------------------------------------------------------------------------------------------------------


def builtin_config(**overrides) -> ModelConfig:
    """The embedded target: every K2 feature at a few MB (MLA with LoRA queries, YaRN, 1 dense + 3 MoE layers of
    16 routed experts top-4 plus a shared expert, INT4 experts). Byte vocabulary (264 = 256 bytes + specials)."""
    cfg = dict(vocab_size=264, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
               num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
               qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
               n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
               rope_theta=10000.0, rope_type="yarn", rope_factor=4.0, rope_beta_fast=32.0, rope_beta_slow=1.0,
               rope_mscale=1.0, rope_mscale_all_dim=1.0, rope_original_max_position_embeddings=512,
               max_position_embeddings=2048, bos_token_id=TINY_BOS, eos_token_id=TINY_EOS, dtype="float32",
               expert_format="bf16", kernels="dense")
    return ModelConfig(**{**cfg, **overrides})


# --------------------------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------------------------


def optimizer(peak_lr: float, warmup: int, total: int) -> optax.GradientTransformation:
    """AdamW (b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1 on matrices, none on norms and biases) on gradients
    clipped to global norm 1, at a learning rate that rises linearly over the first `warmup` steps (step k:
    peak_lr * (k + 1) / warmup) and then decays along a cosine to a tenth of `peak_lr` at step `total`."""
    lr = optax.join_schedules([optax.linear_schedule(peak_lr / max(warmup, 1), peak_lr, warmup - 1),
                               optax.cosine_decay_schedule(peak_lr, total - warmup, alpha=0.1)], [warmup])
    decayed = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decayed))


def apply_updates(params, grads, opt, peak_lr: float, warmup: int, total: int):
    """One `optimizer` step: (params, optimizer state, the gradients' global norm before clipping)."""
    updates, opt = optimizer(peak_lr, warmup, total).update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, optax.tree.norm(grads)


# --------------------------------------------------------------------------------------------------------------
# Target training
# --------------------------------------------------------------------------------------------------------------


def train_forward(params: Params, cfg: ModelConfig, tokens: jax.Array):
    """Teacher-forced logits [B, T, V] (the model's function, see test) and each MoE layer's expert load [L_moe, E].

    The same blocks as `model.forward`, written out so the router's choices can be counted for bias balancing.
    """
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = rope_tables(cfg, positions)
    h = embed(params, tokens)
    loads = []
    for lp in params.layers:
        a, _ = mla(lp.attn, rms_norm(h, lp.attn_norm, cfg.rms_norm_eps), cos, sin, cfg, "prefill")
        h = h + a
        x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps)
        if not isinstance(lp.mlp, MoE):
            h = h + swiglu(lp.mlp, x)
            continue
        flat = x.reshape(-1, x.shape[-1])
        ids, w = route(lp.mlp, flat, cfg)
        y = moe_experts_dense(flat, ids, w, lp.mlp.we_gate, lp.mlp.we_up, lp.mlp.we_down)
        y = y + swiglu(lp.mlp.shared, flat)
        loads.append(jnp.bincount(ids.reshape(-1), length=cfg.n_routed_experts) / ids.size)
        h = h + y.reshape(x.shape)
    return _logits(params, cfg, h), (jnp.stack(loads) if loads else None)


def _map_moe(params: Params, fn) -> Params:
    """params with the MoE of the j-th MoE layer replaced by fn(moe, j)."""
    layers, j = [], 0
    for lp in params.layers:
        if isinstance(lp.mlp, MoE):
            lp = dataclasses.replace(lp, mlp=fn(lp.mlp, j))
            j += 1
        layers.append(lp)
    return dataclasses.replace(params, layers=tuple(layers))


def lm_loss(params: Params, cfg: ModelConfig, tokens: jax.Array):
    logits, loads = train_forward(params, cfg, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll), loads


@partial(jax.jit, static_argnames=("cfg", "warmup", "total", "peak_lr", "bias_rate"), donate_argnums=(0, 1))
def target_step(params, opt, tokens, cfg, warmup, total, peak_lr, bias_rate):
    (loss, loads), grads = jax.value_and_grad(lm_loss, has_aux=True)(params, cfg, tokens)
    params, opt, gnorm = apply_updates(params, grads, opt, peak_lr, warmup, total)
    if loads is not None:  # aux-loss-free balancing of the selection bias
        step_sign = bias_rate * jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads)  # [L_moe, E]
        params = _map_moe(params, lambda mlp, j: dataclasses.replace(mlp, router_bias=mlp.router_bias + step_sign[j]))
    return params, opt, loss, gnorm


@partial(jax.jit, static_argnames=("cfg",))
def eval_loss(params, cfg, tokens):
    return lm_loss(params, cfg, tokens)[0]


def heldout_loss(params, cfg, held: np.ndarray, batches: int = 8, batch: int = 32, length: int = 257,
                 seed: int = 1) -> float:
    """Mean next-byte cross-entropy (nats) on fixed random windows of the held-out files."""
    rng = np.random.default_rng(seed)
    return float(np.mean([eval_loss(params, cfg, jnp.asarray(windows(held, rng, batch, length)))
                          for _ in range(batches)]))


def train_target(cfg: ModelConfig, train: np.ndarray, held: np.ndarray, *, steps: int, batch: int, length: int,
                 peak_lr: float, seed: int, log=print) -> Params:
    params = init_params(cfg, jax.random.key(seed))
    warmup = min(200, steps // 10)
    opt = optimizer(peak_lr, warmup, steps).init(params)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for i in range(steps):
        toks = jnp.asarray(windows(train, rng, batch, length + 1))
        params, opt, loss, gnorm = target_step(params, opt, toks, cfg=cfg, warmup=warmup, total=steps,
                                               peak_lr=peak_lr, bias_rate=1e-3)
        if i % max(steps // 20, 1) == 0 or i == steps - 1:
            log(f"target step {i:5d}  loss {float(loss):.4f}  grad-norm {float(gnorm):.2f}  "
                f"{time.perf_counter() - t0:.0f}s")
    return params


def export_int4(params: Params, cfg: ModelConfig) -> tuple[Params, ModelConfig]:
    """Routed experts to INT4 group-32 (the checkpoint format), everything else in the config's dtype."""
    params = _map_moe(params, lambda mlp, _: dataclasses.replace(
        mlp, **{name: quantize_int4(getattr(mlp, name), cfg.group_size) for name in ("we_gate", "we_up", "we_down")}))
    return params, dataclasses.replace(cfg, expert_format="int4", kernels="xla")


# --------------------------------------------------------------------------------------------------------------
# Drafter distillation
# --------------------------------------------------------------------------------------------------------------


def greedy_continuations(params, cfg: ModelConfig, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """prompts [N, P] -> [N, P + new_tokens]: each prompt followed by the target's greedy continuation."""
    out = generate(params, cfg, prompts, max_new_tokens=new_tokens)  # no EOS: always new_tokens
    return np.concatenate([prompts, np.array(out.tokens, np.int32)], axis=1)


def drafter_loss(dparams, dcfg, target: Params, cfg: ModelConfig, seqs, anchors, gamma: float):
    """DFlash loss on seqs [B, T] with anchors [B, A]: block [x_a, MASK...] predicts x_{a+1} .. x_{a+bs-1}."""
    drafter = Drafter(params=dparams, cfg=dcfg)
    b, t = seqs.shape
    a = anchors.shape[1]
    hidden = jax.lax.stop_gradient(_forward_jit(target, cfg, seqs).hidden)  # [L, B, T, D]
    ctx = append_context(drafter, init_draft_cache(dcfg, b, t), hidden, jnp.zeros((b,), jnp.int32))
    rep = lambda x: jnp.repeat(x, a, axis=0)  # per layer [B, ...] -> [B*A, ...]
    ctx = jax.tree.map(rep, ctx)
    flat = anchors.reshape(-1)
    rows = jnp.repeat(jnp.arange(b), a)
    logits = draft(drafter, target, ctx, flat, seqs[rows, flat])  # [B*A, bs-1, V]
    depth = dcfg.block_size - 1
    labels = seqs[rows[:, None], flat[:, None] + 1 + jnp.arange(depth)[None, :]]  # [B*A, bs-1]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], axis=-1)[..., 0]
    w = jnp.exp(-jnp.arange(depth) / gamma)
    acc = jnp.mean(jnp.argmax(logits, -1) == labels, axis=0)  # [bs-1] top-1 accuracy per depth
    return jnp.sum(jnp.mean(nll, axis=0) * w) / jnp.sum(w), acc


@partial(jax.jit, static_argnames=("dcfg", "cfg", "warmup", "total", "peak_lr", "gamma"), donate_argnums=(0, 1))
def drafter_step(dparams, opt, target, seqs, anchors, dcfg, cfg, warmup, total, peak_lr, gamma):
    (loss, acc), grads = jax.value_and_grad(drafter_loss, has_aux=True)(dparams, dcfg, target, cfg, seqs, anchors,
                                                                        gamma)
    dparams, opt, _ = apply_updates(dparams, grads, opt, peak_lr, warmup, total)
    return dparams, opt, loss, acc


def distill_drafter(target: Params, cfg: ModelConfig, train: np.ndarray, *, num_layers: int, block_size: int,
                    prompts: int, prompt_len: int, new_tokens: int, steps: int, batch: int, anchors: int,
                    peak_lr: float, gamma: float, seed: int, log=print) -> Drafter:
    rng = np.random.default_rng(seed + 7)
    t0 = time.perf_counter()
    chunks = []
    for i in range(0, prompts, 512):
        chunks.append(greedy_continuations(target, cfg, windows(train, rng, min(512, prompts - i), prompt_len),
                                           new_tokens))
    seqs = np.concatenate(chunks)
    log(f"drafter data: {seqs.shape[0]} greedy continuations of {new_tokens} tokens, {time.perf_counter() - t0:.0f}s")
    drafter = init_drafter(cfg, jax.random.key(seed + 11), num_layers=num_layers, block_size=block_size,
                           mask_token_id=TINY_MASK, intermediate_size=2 * cfg.hidden_size)
    dparams, dcfg = drafter.params, drafter.cfg
    warmup = min(100, steps // 10)
    opt = optimizer(peak_lr, warmup, steps).init(dparams)
    lo, hi = prompt_len - 1, seqs.shape[1] - block_size  # anchors whose labels are all target continuations
    for i in range(steps):
        idx = rng.integers(0, len(seqs), size=batch)
        anc = rng.integers(lo, hi + 1, size=(batch, anchors)).astype(np.int32)
        dparams, opt, loss, acc = drafter_step(dparams, opt, target, jnp.asarray(seqs[idx]), jnp.asarray(anc),
                                               dcfg=dcfg, cfg=cfg, warmup=warmup, total=steps, peak_lr=peak_lr,
                                               gamma=gamma)
        if i % max(steps // 20, 1) == 0 or i == steps - 1:
            log(f"drafter step {i:5d}  loss {float(loss):.4f}  top-1 acc by depth "
                f"{np.round(np.asarray(acc), 2).tolist()}  {time.perf_counter() - t0:.0f}s")
    return Drafter(params=dparams, cfg=dcfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree_jax.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for target.npz, drafter.npz, configs and the log")
    ap.add_argument("--steps", type=int, default=3000, help="target training steps (default 3000)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=256, help="training window in tokens")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--drafter-steps", type=int, default=2000)
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4096, help="greedy continuations for distillation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="a tiny run for smoke tests (CPU)")
    ap.add_argument("--resume-target", default=None, help="a directory with a trained target (skip its training)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "train_log.txt"), "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    cfg = builtin_config()
    if args.small:
        cfg = builtin_config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32,
                             kv_lora_rank=32)
    train_files, held_files = corpus_split()
    train, held = load_tokens(train_files), load_tokens(held_files)
    log(f"python {sys.version.split()[0]} stdlib: {len(train_files)} train files ({len(train) / 1e6:.1f}M bytes), "
        f"{len(held_files)} held-out files ({len(held) / 1e6:.1f}M bytes); devices {jax.devices()}")
    t0 = time.perf_counter()
    if args.resume_target:
        qcfg = ModelConfig.from_dict(json.load(open(os.path.join(args.resume_target, "config.json"))))
        qparams = from_shipping(load_npz(os.path.join(args.resume_target, "target.npz"), shipping_struct(qcfg)),
                                jnp.float32)
        log(f"target loaded from {args.resume_target}")
    else:
        params = train_target(cfg, train, held, steps=args.steps, batch=args.batch, length=args.length,
                              peak_lr=args.lr, seed=args.seed, log=log)
        log(f"target trained in {time.perf_counter() - t0:.0f}s; held-out loss "
            f"{heldout_loss(params, cfg, held):.4f} nats/byte (float experts)")
        qparams, qcfg = export_int4(params, cfg)
        qparams = from_shipping(to_shipping(qparams), jnp.float32)  # exactly the weights the package ships
    log(f"held-out loss with INT4 experts and bf16 weights (as shipped): {heldout_loss(qparams, qcfg, held):.4f} "
        f"nats/byte")
    drafter = distill_drafter(qparams, dataclasses.replace(qcfg, kernels="dense"), train,
                              num_layers=args.drafter_layers, block_size=args.block_size,
                              prompts=args.prompts if not args.small else 64, prompt_len=128,
                              new_tokens=64, steps=args.drafter_steps, batch=32, anchors=16, peak_lr=2e-3,
                              gamma=7.0, seed=args.seed, log=log)
    save_npz(os.path.join(args.out, "target.npz"), to_shipping(qparams))
    save_npz(os.path.join(args.out, "drafter.npz"), to_shipping(drafter.params))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(qcfg.to_dict(), f, indent=1)
    with open(os.path.join(args.out, "drafter_config.json"), "w") as f:
        json.dump(dataclasses.asdict(drafter.cfg), f, indent=1)
    log(f"saved to {args.out} in {time.perf_counter() - t0:.0f}s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
