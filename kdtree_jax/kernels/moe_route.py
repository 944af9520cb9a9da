"""The sigmoid noaux_tc router's choice of experts from its logits, as a custom call (`impl="ffi"`:
ffi/moe_route.cc on CPU, ffi/moe_route.cu on CUDA) or in pure JAX (`impl="xla"`, `moe_route_ref`).

Per token m, with score = sigmoid(logits[m]) [E] and choice = score + bias (the correction bias only chooses):
with n_group > 1, only the topk_group groups (contiguous runs of E / n_group experts) with the largest sum of their
two best choices compete, the others' choices becoming -inf; the k largest choices are the token's experts, in
descending order (ties: the lower index first, as `jax.lax.top_k`); their weights are the unbiased scores, divided
by their sum (plus 1e-20) when `renormalize`, times `scale`.

One kernel in place of XLA's sort (its top-k over E) and the elementwise steps around it: at a few tokens per step,
a layer's router is launch-bound. The CUDA handler runs one warp per token (E <= 2048, n_group <= 64, k <= 32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _registry

MAX_EXPERTS, MAX_GROUPS, MAX_K = 2048, 64, 32  # the CUDA handler's limits


def _check(logits, bias, k, n_group, topk_group) -> tuple[int, int]:
    for name, a in (("logits", logits), ("bias", bias)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"moe_route: {name} must be an array, got {type(a).__name__}")
    if len(logits.shape) != 2 or len(bias.shape) != 1 or bias.shape[0] != logits.shape[1]:
        raise ValueError(f"moe_route: expected logits [M, E] and bias [E], got {tuple(logits.shape)} and "
                         f"{tuple(bias.shape)}")
    m, e = (int(d) for d in logits.shape)
    for name, v in (("k", k), ("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"moe_route: {name} must be a positive int, got {v!r}")
    if e % n_group or topk_group > n_group or (n_group > 1 and e // n_group < 2) or k > e // n_group * topk_group:
        raise ValueError(f"moe_route: E = {e}, k = {k}, n_group = {n_group}, topk_group = {topk_group} do not "
                         "describe a routing (E divisible by n_group, >= 2 experts per group, k within the kept "
                         "groups)")
    for name, a in (("logits", logits), ("bias", bias)):
        if a.dtype != jnp.float32:
            raise TypeError(f"moe_route: {name} must be float32, got {a.dtype}")
    return m, e


def moe_route(logits: jax.Array, bias: jax.Array, *, k: int, n_group: int = 1, topk_group: int = 1,
              renormalize: bool = True, scale: float = 1.0, impl: str = "ffi") -> tuple[jax.Array, jax.Array]:
    """(expert ids int32 [M, k], weights float32 [M, k]) of router logits float32 [M, E] and the selection bias
    float32 [E]; see the module docstring. k, n_group, topk_group, renormalize and scale are static.

    impl="ffi" runs the custom call (C++ on CPU, CUDA on GPU, the reference on other platforms); impl="xla" runs
    `moe_route_ref`. No host sync.
    """
    m, e = _check(logits, bias, k, n_group, topk_group)
    if impl == "xla":
        return moe_route_ref(logits, bias, k=k, n_group=n_group, topk_group=topk_group, renormalize=renormalize,
                             scale=scale)
    if impl != "ffi":
        raise ValueError(f"moe_route: impl must be 'ffi' or 'xla', got {impl!r}")
    if e > MAX_EXPERTS or n_group > MAX_GROUPS or k > MAX_K:
        return moe_route_ref(logits, bias, k=k, n_group=n_group, topk_group=topk_group, renormalize=renormalize,
                             scale=scale)
    _registry.register()
    out = (jax.ShapeDtypeStruct((m, k), jnp.int32), jax.ShapeDtypeStruct((m, k), jnp.float32))
    attrs = dict(n_group=np.int64(n_group), topk_group=np.int64(topk_group), renormalize=bool(renormalize),
                 scale=np.float32(scale))

    def call(lg, b):
        return tuple(jax.ffi.ffi_call("kdtree_moe_route", out, vmap_method="sequential")(lg, b, **attrs))

    def other(lg, b):
        return moe_route_ref(lg, b, k=k, n_group=n_group, topk_group=topk_group, renormalize=renormalize,
                             scale=scale)

    return jax.lax.platform_dependent(logits, bias, cpu=call, cuda=call, default=other)


def moe_route_ref(logits: jax.Array, bias: jax.Array, *, k: int, n_group: int = 1, topk_group: int = 1,
                  renormalize: bool = True, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Pure JAX: sigmoid, biased choice, group-limited `jax.lax.top_k`, weights from the unbiased scores."""
    scores = jax.nn.sigmoid(logits)  # [M, E]
    choice = scores + bias
    if n_group > 1:
        m, e = choice.shape
        grouped = choice.reshape(m, n_group, e // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [M, G]
        _, keep = jax.lax.top_k(group_scores, topk_group)  # [M, topk_group]
        group_mask = jnp.zeros_like(group_scores, bool).at[jnp.arange(m)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, e // n_group, axis=-1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)  # [M, k]
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), w * scale
