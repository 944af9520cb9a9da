"""Shared test setup: CPU JAX with 8 simulated devices, fp32 matmuls at full precision."""

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
