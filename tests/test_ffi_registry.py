"""A custom-call library file that exists but does not load: a clear error naming it and how to rebuild, from the
API (FfiLibraryError) and from the command line (one line, no traceback)."""

import os
import subprocess
import sys

import pytest

from kdtree_jax.kernels._registry import CPU_LIBRARY


@pytest.fixture
def broken_ffi_env(tmp_path):
    (tmp_path / CPU_LIBRARY).write_bytes(b"\x7fELF this is not a shared library" * 8)
    return {**os.environ, "KDTREE_JAX_FFI_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}, tmp_path / CPU_LIBRARY


def test_api_raises_ffi_library_error(broken_ffi_env):
    env, path = broken_ffi_env
    code = ("import jax.numpy as jnp\n"
            "from kdtree_jax.kernels import _registry, tree_build\n"
            "try:\n"
            "    tree_build(jnp.zeros((1, 2, 8), jnp.float32), 4, impl='ffi')\n"
            "except _registry.FfiLibraryError as e:\n"
            "    print('caught:', e)\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("caught: ") and str(path) in run.stdout
    assert "pip install -e ." in run.stdout and "KDTREE_JAX_FFI_DIR" in run.stdout


def test_cli_reports_one_line(broken_ffi_env):
    env, path = broken_ffi_env
    run = subprocess.run([sys.executable, "-m", "kdtree_jax.cli", "generate", "--prompt", "x", "--method", "ddtree",
                          "--budget", "4", "--max-new-tokens", "2", "--ffi-ops", "tree_build"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.startswith("kdtree-jax: error:")]
    assert len(errors) == 1 and str(path) in errors[0] and "pip install -e ." in errors[0]
    assert "Traceback" not in run.stderr
