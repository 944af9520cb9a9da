import jax, jax.numpy as jnp
from kdtree_jax.kernels.fused_dot import fused_dot
from kdtree_jax.kernels.marlin_moe import FLAG_GEMV, marlin_moe
from kdtree_jax.quant import Int4Array
key = iter(jax.random.split(jax.random.key(0), 16))
local, d, f, bf = 48, 7168, 2048, jnp.bfloat16
def int4(rows, cols):
    packed = jax.lax.bitcast_convert_type(jax.random.bits(next(key), (local, rows, cols // 8), jnp.uint32), jnp.int32)
    return Int4Array(packed, (0.01 * jnp.ones((local, rows, cols // 32))).astype(bf))
x = jax.random.normal(next(key), (1, d), bf)
ids, wts = jnp.asarray([[3] + [local] * 7], jnp.int32), jnp.asarray([[0.3] + [0.0] * 7], jnp.float32)
ex = (int4(f, d), int4(f, d), int4(d, f))
moe = jax.jit(lambda x: marlin_moe(x, ids, wts, *ex, experts_total=384, flags=FLAG_GEMV))
w, nw = 0.02 * jax.random.normal(next(key), (d, 2112), bf), jnp.ones((d,), bf)
wo, xo = 0.02 * jax.random.normal(next(key), (1024, d), bf), jax.random.normal(next(key), (1, 1024), bf)
qkv = jax.jit(lambda a: fused_dot(a, w, norm=nw, flags=2)[0])
o = jax.jit(lambda a: fused_dot(a, wo, adds=(x,), flags=2)[0])
for _ in range(2):  # 4 matching launches an iteration (GemvUp, GemvDown, FusedDot x 2): ncu skips the first's
    jax.block_until_ready([moe(x), qkv(x), o(xo)])
