import jax, jax.numpy as jnp
from kdtree_jax.kernels.mla_verify import mla_verify, plan_splits
k = jax.random.split(jax.random.key(0), 4)
b, n, h, s = 1, 1, 8, 4096
q = jax.random.normal(k[0], (b, n, h, 512), jnp.bfloat16)
qp = jax.random.normal(k[1], (b, n, h, 64), jnp.bfloat16)
lat = jax.random.normal(k[2], (b, s, 512), jnp.bfloat16)
pe = jax.random.normal(k[3], (b, s, 64), jnp.bfloat16)
lens = jnp.full((b,), s - n, jnp.int32)
mask = jnp.ones((b, n, n), bool)
print("splits", plan_splits(b, n, h, s))
fns = [jax.jit(lambda *a, ns=ns: mla_verify(*a, 0.1309, num_splits=ns)) for ns in (64, 1)]
for _ in range(3):  # 3 launches an iteration (64 splits: kernel + combine; 1 split: kernel): ncu skips the first 3
    jax.block_until_ready([f(q, qp, lat, pe, lens, mask) for f in fns])
