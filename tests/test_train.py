"""Training the embedded model (kdtree_jax.train): the optimizer's hyper-parameters, the training forward, and a few
target and drafter steps on a small config."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import rel_err

import kdtree_jax as kj
from kdtree_jax.configs import TINY_MASK
from kdtree_jax.train import builtin_config, drafter_step, optimizer, target_step, train_forward

SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32)


def test_optimizer_schedule_and_weight_decay():
    """With zero gradients AdamW moves only by its weight decay, lr * 0.1 * w, and on matrices only: the decay
    read back step by step is the learning rate, peak * (k + 1) / warmup at steps k < warmup, then along a cosine
    from the peak to a tenth of it at `total`."""
    peak, warmup, total = 1e-2, 4, 12
    tx = optimizer(peak, warmup, total)
    params = {"w": jnp.ones((2, 3)), "norm": jnp.ones((3,))}
    zeros = jax.tree.map(jnp.zeros_like, params)
    state, lrs = tx.init(params), []
    for _ in range(total + 2):
        updates, state = tx.update(zeros, state, params)
        lrs.append(float(-updates["w"][0, 0] / (0.1 * params["w"][0, 0])))
        assert not np.any(np.asarray(updates["norm"]))
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    cosine = lambda k: peak * (0.1 + 0.45 * (1 + np.cos(np.pi * (k - warmup) / (total - warmup))))
    want = [peak * (k + 1) / warmup for k in range(warmup)]
    want += [cosine(k) for k in range(warmup, total)] + [0.1 * peak] * 2
    np.testing.assert_allclose(lrs, want, rtol=1e-4)


def test_train_forward_is_the_model():
    cfg = builtin_config(**SMALL)
    params = kj.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
    logits, loads = train_forward(params, cfg, tokens)
    assert rel_err(logits, kj.forward(params, cfg, tokens)) <= 1e-5
    assert loads.shape == (cfg.num_moe_layers, cfg.n_routed_experts)
    np.testing.assert_allclose(np.asarray(loads).sum(-1), 1.0, rtol=1e-6)


def test_target_and_drafter_steps_learn():
    """A few optax steps on one batch lower the target's loss, and the routers' selection biases move by the
    balancing rule alone (their gradient is zero): each by at most the rate per step. The drafter's steps lower its
    DFlash loss."""
    cfg = builtin_config(**SMALL)
    params = kj.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (4, 33)), jnp.int32)
    steps, rate = 6, 1e-3
    bias0 = [np.asarray(lp.mlp.router_bias) for lp in params.moe_layers]
    opt = optimizer(3e-3, 1, steps).init(params)
    losses = []
    for _ in range(steps):
        params, opt, loss, gnorm = target_step(params, opt, tokens, cfg=cfg, warmup=1, total=steps, peak_lr=3e-3,
                                               bias_rate=rate)
        losses.append(float(loss))
        assert np.isfinite(float(gnorm))
    assert losses[-1] < losses[0] - 0.5, losses
    for lp, b0 in zip(params.moe_layers, bias0, strict=True):
        moved = np.abs(np.asarray(lp.mlp.router_bias) - b0).max()
        assert 0 < moved <= steps * rate * (1 + 1e-3)

    drafter = kj.init_drafter(cfg, jax.random.key(2), num_layers=1, block_size=4, mask_token_id=TINY_MASK)
    dparams, dcfg = drafter.params, drafter.cfg
    dopt = optimizer(3e-3, 1, steps).init(dparams)
    anchors = jnp.asarray([[3, 10, 20]] * 4, jnp.int32)
    dlosses = []
    for _ in range(steps):
        dparams, dopt, loss, acc = drafter_step(dparams, dopt, params, tokens, anchors, dcfg=dcfg, cfg=cfg, warmup=1,
                                                total=steps, peak_lr=3e-3, gamma=7.0)
        dlosses.append(float(loss))
    assert dlosses[-1] < dlosses[0], dlosses
    assert acc.shape == (dcfg.block_size - 1,)


def test_the_corpus_helpers_are_corpus_s():
    """The corpus helpers live in kdtree_jax.corpus; train uses those (benchmarks/acceptance.py imports them from
    train)."""
    from kdtree_jax import corpus, train

    assert all(getattr(train, n) is getattr(corpus, n) for n in ("corpus_split", "load_tokens", "windows"))
