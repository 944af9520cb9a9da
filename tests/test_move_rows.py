"""move_rows: the accepted rows of many caches moved in one custom call (C++ on CPU, CUDA on GPU, marked gpu) equal
the pure-JAX gather-and-update, bit for bit, on fresh random caches; the model's move_accepted and greedy ddtree with
it on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_gpu

import kdtree_jax as kj
from kdtree_jax.kernels.move_rows import move_rows, move_rows_ref


def _case(rng, b: int, s: int, widths, dtype, p: int, n_nodes: int, device=None):
    """Caches of random values; starts and paths the loop makes: root first, then increasing node indices (so a
    source is often another row's destination), padded with -1; one start at the cache's end (clamped write)."""
    caches = [jnp.asarray(rng.standard_normal((b, s, w)), dtype) for w in widths]
    starts = rng.integers(0, s - n_nodes + 1, size=b).astype(np.int32)
    starts[-1] = s - n_nodes  # sources up to the last slot, the write clamped to s - p when n_nodes > p
    path = np.full((b, p), -1, np.int32)
    for r in range(b):
        length = int(rng.integers(1, p + 1))
        nodes = np.sort(rng.choice(np.arange(1, n_nodes), size=length - 1, replace=False)) if length > 1 else []
        path[r, :length] = np.concatenate([[0], nodes]).astype(np.int32)
    put = (lambda x: jax.device_put(x, device)) if device is not None else jnp.asarray
    return [put(c) for c in caches], put(jnp.asarray(starts)), put(jnp.asarray(path))


def _check_equal(caches, starts, path, n_nodes, platform_note=""):
    before = [np.asarray(c).copy() for c in caches]
    want = jax.jit(lambda c, s, p: move_rows(c, s, p, n_nodes, impl="xla"))(caches, starts, path)
    got = jax.jit(lambda c, s, p: move_rows(c, s, p, n_nodes))(caches, starts, path)
    assert len(got) == len(caches)
    for g, w, old in zip(got, want, before):
        assert g.dtype == old.dtype and g.shape == old.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=platform_note)
    if path.shape[1] > 1:  # a path of one node moves nothing; any longer one here moves something
        assert any(not np.array_equal(np.asarray(g), old) for g, old in zip(got, before))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("b, widths, p, n_nodes", [(1, (32, 16), 5, 9), (3, (32, 16, 32, 16), 4, 17),
                                                    (4, (8, 3, 24), 6, 6), (2, (64,), 1, 3)])
def test_cpu_kernel_equals_reference(dtype, b, widths, p, n_nodes):
    """Bit-equal to the gather-and-update on random caches: one and several rows, widths not a multiple of 16
    bytes, paths of one node, and a start at the cache's end."""
    rng = np.random.default_rng(b * 100 + p)
    _check_equal(*_case(rng, b, 48, widths, dtype, p, n_nodes), n_nodes)


def test_rows_outside_the_window_are_untouched_and_sources_read_before_written():
    """Hand-made: path [0, 1, 3, 4] moves slot 3 to 2 and slot 4 to 3, so slot 3 is read before it is written;
    every slot outside starts .. starts + P - 1 keeps its value."""
    c = jnp.arange(2 * 12 * 2, dtype=jnp.float32).reshape(2, 12, 2)
    starts = jnp.asarray([2, 0], jnp.int32)
    path = jnp.asarray([[0, 1, 3, 4], [0, 2, -1, -1]], jnp.int32)
    (got,) = jax.jit(lambda c, s, p: move_rows([c], s, p, 6))(c, starts, path)
    want = np.asarray(c).copy()
    want[0, 2:6] = np.asarray(c)[0, [2, 3, 5, 6]]
    want[1, 0:4] = np.asarray(c)[1, [0, 2, 0, 0]]  # -1 is clipped to node 0
    np.testing.assert_array_equal(np.asarray(got), want)


def test_in_a_while_loop_in_place():
    """Inside a while loop whose carry holds the caches (as the decoding loop's does): each iteration's move acts
    on the last one's result, equal to the reference's."""
    rng = np.random.default_rng(7)
    caches, starts, path = _case(rng, 2, 40, (16, 8), jnp.float32, 4, 9)
    starts = jnp.maximum(starts - 2, 0)  # room for the two later iterations' starts + 1, + 2

    def run(impl):
        body = lambda i, c: move_rows(c, starts + i, path, 9, impl=impl)
        return jax.jit(lambda c: jax.lax.fori_loop(0, 3, body, tuple(c)))(caches)

    for g, w in zip(run("ffi"), run("xla")):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_bad_inputs_are_named():
    c = jnp.zeros((2, 8, 4), jnp.float32)
    s, p = jnp.zeros((2,), jnp.int32), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="no caches"):
        move_rows([], s, p, 4)
    with pytest.raises(ValueError, match="one B, S and dtype"):
        move_rows([c, jnp.zeros((2, 9, 4), jnp.float32)], s, p, 4)
    with pytest.raises(ValueError, match="one B, S and dtype"):
        move_rows([c, jnp.zeros((2, 8, 4), jnp.bfloat16)], s, p, 4)
    with pytest.raises(TypeError, match="int32"):
        move_rows([c], s.astype(jnp.float32), p, 4)
    with pytest.raises(ValueError, match=r"path must be \[B, P\]|starts must be"):
        move_rows([c], s, p[0], 4)
    with pytest.raises(ValueError, match="n_nodes"):
        move_rows([c], s, p, 0)
    with pytest.raises(ValueError, match="path of 9 nodes"):
        move_rows([c], s, jnp.zeros((2, 9), jnp.int32), 9)
    with pytest.raises(ValueError, match="impl"):
        move_rows([c], s, p, 4, impl="gpu")


def test_model_move_accepted_and_greedy_ddtree_with_it():
    """The model's move_accepted with the custom call on equals it off, and greedy ddtree with it on = ar."""
    from kdtree_jax.model import init_cache, move_accepted
    base = kj.configs.tiny(kernels="ffi")
    on = kj.configs.tiny(kernels="ffi", ffi_ops=base.ffi_ops + ("move_rows",))
    rng = np.random.default_rng(3)
    cache = init_cache(base, 2, 32)
    cache = type(cache)(**{**cache.__dict__, "latent": tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype)
                                                               for x in cache.latent),
                           "k_pe": tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in cache.k_pe)})
    starts, path = jnp.asarray([3, 11], jnp.int32), jnp.asarray([[0, 2, 5], [0, 1, -1]], jnp.int32)
    got = jax.jit(lambda c: move_accepted(c, on, starts, path, 8))(cache)
    want = jax.jit(lambda c: move_accepted(c, base, starts, path, 8))(cache)
    for g, w in zip(got.latent + got.k_pe, want.latent + want.k_pe):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    params = kj.init_params(on, jax.random.key(0))
    drafter = kj.init_drafter(on, jax.random.key(1), num_layers=1, block_size=4)
    prompts = [[5, 6, 7, 8], [9, 10]]
    ar = kj.generate(params, on, prompts, max_new_tokens=10).tokens
    assert kj.generate(params, on, prompts, max_new_tokens=10, method="ddtree", drafter=drafter, budget=6).tokens == ar


def test_move_rows_ref_is_the_models_former_move():
    """The reference is the gather-and-update the model ran before the custom call (checked against numpy)."""
    rng = np.random.default_rng(11)
    caches, starts, path = _case(rng, 3, 30, (6,), jnp.float32, 4, 7)
    (got,) = move_rows_ref(caches, starts, path, 7)
    c, want = np.asarray(caches[0]), np.asarray(caches[0]).copy()
    for r in range(3):
        src = int(starts[r]) + np.clip(np.asarray(path[r]), 0, 6)
        dst = min(int(starts[r]), 30 - 4)
        want[r, dst:dst + 4] = c[r, src]
    np.testing.assert_array_equal(np.asarray(got), want)


# CUDA (run on the device machine: pytest -m gpu)

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("b, caches, p, n_nodes", [(1, 122, 8, 17), (10, 122, 8, 65), (3, 130, 17, 17)])
def test_gpu_kernel_equals_reference(dtype, b, caches, p, n_nodes):
    """K2's caches of one device (61 layers x latent 512 and rope key 64 at 4k context; 130 caches: two launches),
    one and ten rows, on the GPU, bit-equal to the reference."""
    rng = np.random.default_rng(caches + b)
    widths = [512 if i % 2 == 0 else 64 for i in range(caches)]
    args = _case(rng, b, 4160, widths, dtype, p, n_nodes, device=jax.devices("gpu")[0])
    _check_equal(*args, n_nodes, platform_note="gpu")


@pytest.mark.gpu
@needs_gpu
def test_gpu_narrow_rows_and_loop():
    """Rows not a multiple of 16 bytes (the byte-wise kernel) and the move inside a while loop, on the GPU."""
    rng = np.random.default_rng(5)
    gpu = jax.devices("gpu")[0]
    _check_equal(*_case(rng, 3, 64, (3, 5, 24), jnp.float32, 5, 9, device=gpu), 9, platform_note="gpu narrow")
    caches, starts, path = _case(rng, 2, 40, (512, 64), jnp.bfloat16, 4, 9, device=gpu)
    starts = jnp.maximum(starts - 2, 0)

    def run(impl):
        body = lambda i, c: move_rows(c, starts + i, path, 9, impl=impl)
        return jax.jit(lambda c: jax.lax.fori_loop(0, 3, body, tuple(c)))(caches)

    for g, w in zip(run("ffi"), run("xla")):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_benchmark_smoke(tmp_path):
    """benchmarks/move_rows.py --small runs on the CPU and writes its table, numbers and plot."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import move_rows as bench
    assert bench.main(["--small", "--out", str(tmp_path), "--batches", "2", "--nodes", "9"]) == 0
    saved = json.load(open(tmp_path / "move_rows.json"))
    assert [(r["batch"], r["nodes"]) for r in saved["rows"]] == [(2, 9)]
    assert saved["rows"][0]["bytes"] == 2 * 2 * 8 * 3 * (512 + 64) * 4  # read + write, rows, path, layers, f32
    assert (tmp_path / "move_rows.png").stat().st_size > 0 and "| 2 | 9 |" in (tmp_path / "move_rows.md").read_text()
