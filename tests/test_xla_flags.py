"""The XLA flags the `kdtree-jax` commands add: a value the user gave wins, the opt-out leaves XLA_FLAGS alone, and
the installed jaxlib knows every flag (XLA aborts the process on an unknown one)."""

import os
import subprocess
import sys

from kdtree_jax.xla_flags import GPU_FLAGS, OPT_OUT, apply_gpu_flags, cuda_possible, with_gpu_flags


def test_missing_flags_are_added_and_given_values_kept():
    assert with_gpu_flags("").split() == list(GPU_FLAGS)
    mine = "--xla_gpu_enable_pdl=false --xla_dump_to=/tmp/d"
    out = with_gpu_flags(mine).split()
    assert out[:2] == mine.split() and "--xla_gpu_enable_pdl=true" not in out
    assert set(GPU_FLAGS[1:]) <= set(out) and len(out) == 2 + len(GPU_FLAGS) - 1


def test_opt_out_idempotence_and_gpu_only():
    env = {OPT_OUT: "0", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    apply_gpu_flags(env, gpu=True)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    env = {}
    apply_gpu_flags(env, gpu=True)
    once = env["XLA_FLAGS"]
    apply_gpu_flags(env, gpu=True)
    assert env["XLA_FLAGS"] == once and once.split() == list(GPU_FLAGS)
    env = {}
    apply_gpu_flags(env, gpu=False)
    assert "XLA_FLAGS" not in env
    assert not cuda_possible({"JAX_PLATFORMS": "cpu"})


def test_the_installed_jaxlib_accepts_the_flags():
    env = {**os.environ, "XLA_FLAGS": " ".join(GPU_FLAGS), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "3.0"
