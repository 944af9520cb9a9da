"""The single-GPU stand-in for one device of an ep mesh (`benchmarks/full_scale.py per_device_model`), which the
full-scale benchmarks time: its MoE layers route over every expert of the model and hold only the device's share,
so each layer computes what shard 0 of `moe_expert_parallel` contributes."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.model import MoE, moe
from kdtree_jax.quant import Int4Array

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from full_scale import per_device_model  # noqa: E402

from conftest import rel_err  # noqa: E402


def _pad_experts(w: Int4Array, total: int) -> Int4Array:
    """w [e, out, in/8] with experts e .. total - 1 appended as exact zeros (every nibble q + 8 = 8, scale 1)."""
    e = w.packed.shape[0]
    zeros = jnp.full((total - e, *w.packed.shape[1:]), np.int32(-0x77777778), jnp.int32)  # 0x88888888
    return Int4Array(jnp.concatenate([w.packed, zeros]),
                     jnp.concatenate([w.scale, jnp.ones((total - e, *w.scale.shape[1:]), w.scale.dtype)]))


def test_per_device_moe_is_shard_zeros_share():
    n = 8
    cfg, params = per_device_model(n, 3, True, "xla")
    layer = next(lp for lp in params.layers if isinstance(lp.mlp, MoE))
    p = layer.mlp
    e = cfg.n_routed_experts
    assert p.router.shape == (cfg.hidden_size, e) and p.we_gate.packed.shape[0] == e // n  # all routed, 1/n held
    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.hidden_size), jnp.float32)
    here = moe(p, x, cfg)
    # the whole model's layer with the other devices' experts present but zero: their slots add nothing, as on
    # shard 0 of a mesh, where they belong to other devices
    full = dataclasses.replace(p, we_gate=_pad_experts(p.we_gate, e), we_up=_pad_experts(p.we_up, e),
                               we_down=_pad_experts(p.we_down, e))
    assert float(jnp.max(jnp.abs(full.we_gate.dequantize()[e // n:]))) == 0.0
    assert rel_err(here, moe(full, x, cfg)) <= 1e-6
    shared_only = dataclasses.replace(p, router_bias=p.router_bias.at[: e // n].set(-1e9))  # no local expert chosen
    assert rel_err(here, moe(shared_only, x, cfg)) > 1e-3  # the local experts do contribute
