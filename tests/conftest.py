"""Shared test setup: CPU JAX with 8 simulated devices, fp32 matmuls at full precision."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("KDTREE_JAX_COMPILATION_CACHE", "off")  # the CLI's cache: tests compile afresh, write no ~/.cache

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64; NaN anywhere gives inf (NaN never passes)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}  # relative error bounds by dtype


def has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


needs_gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU (run with JAX_PLATFORMS=cuda,cpu)")


def filtered_probs(logits, temperature: float, top_k=None, top_p=None) -> np.ndarray:
    """Numpy reference of the sampled distribution (float64, [..., V]): logits / temperature; then only the tokens
    whose logit is at least the top_k-th largest; then, by descending probability, every token until the ones
    before it hold top_p of the mass (and every token tied with the last one kept)."""
    x = np.asarray(logits, np.float64) / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = np.sort(x, axis=-1)[..., -top_k, None]
        x = np.where(x >= kth, x, -np.inf)
    if top_p is not None and top_p < 1:
        flat = x.reshape(-1, x.shape[-1])
        for row in flat:
            desc = np.sort(row)[::-1]
            p = np.exp(desc - desc[0])
            p /= p.sum()
            before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
            cut = desc[np.sum(before < top_p) - 1]
            row[row < cut] = -np.inf
        x = flat.reshape(x.shape)
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees every test file's compiled programs when the file ends. Each XLA CPU executable keeps several memory
    mappings, and a pytest-xdist worker runs many files in one process: without this a worker reached 65,220 mappings
    by the end of the suite, 310 below Linux's default vm.max_map_count (65,530), where mmap starts failing and
    the process dies with a segmentation fault inside XLA."""
    yield
    from kdtree_jax.decoding import clear_compiled
    from kdtree_jax.model import _leaf_initializer

    clear_compiled()
    _leaf_initializer.cache_clear()
    jax.clear_caches()
    gc.collect()


def tiny_bf16_model():
    """The tiny preset in bf16 and its weights from key 3 (the custom calls' model-level tests)."""
    import kdtree_jax as kj
    cfg = kj.configs.tiny(dtype="bfloat16")
    return cfg, kj.init_params(cfg, jax.random.key(3))


def with_ffi_op(cfg, op: str, on: bool):
    """cfg with the default custom calls, plus `op` when on (without it when not)."""
    import dataclasses

    import kdtree_jax as kj
    ops = tuple(o for o in kj.config.DEFAULT_FFI_OPS if o != op) + ((op,) if on else ())
    return dataclasses.replace(cfg, kernels="ffi", ffi_ops=ops)


def step_calls(params, cfg, target: str, rows: int = 2, t: int = 1) -> int:
    """The calls of custom call `target` in the lowered step of [rows, t] tokens over a cache of t + 16 slots."""
    from kdtree_jax.model import init_cache, step
    from kdtree_jax.sharding import trace_context
    cache = init_cache(cfg, rows, t + 16)
    tokens = jnp.ones((rows, t), jnp.int32)
    with trace_context(params, cfg):
        text = jax.jit(lambda p, c, tk: step(p, cfg, tk, c).logits).lower(params, cache, tokens).as_text()
    return text.count(f'"{target}"') + text.count(f"@{target}")
