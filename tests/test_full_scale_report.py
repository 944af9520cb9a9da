"""benchmarks/full_scale.py's report arithmetic on made-up numbers (no model): the projection to N GPUs, the
cells given on the command line, the A/B table against an earlier run, and --replot from the saved JSON."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import full_scale  # noqa: E402


def _row(context, batch, tokens, step_ms, floor_ms):
    nbytes = dict(weights=1e9, experts=2e9, cache=3e8, total=3.3e9)
    return dict(context=context, batch=batch, tokens=tokens, step_s=step_ms / 1e3, compile_s=10.0, bytes=nbytes,
                floor_s=floor_ms / 1e3)


ROWS = [_row(4096, 1, 1, 7.5, 1.5), _row(4096, 1, 17, 14.0, 6.4), _row(4096, 1, 65, 22.0, 14.0),
        _row(4096, 10, 17, 30.5, 18.6), _row(131072, 1, 17, 99.0, 9.0)]
COMM = {(1, 1): (0.115e-3, [14336]), (1, 65): (0.127e-3, [28672]), (10, 65): (0.498e-3, [286720])}
META = dict(date="2026-12-04", device="test", commit="abc1234", kernels="ffi", n=8, layers=61, params_gb=76.0,
            init_s=7.0, copy_Bps=4.1e12, xla_flags="")


def test_projection_is_the_measured_terms_arithmetic():
    extra = {"drafter": dict(step_s=2.6e-3)}
    proj = {(p["method"], p["C"]): p for p in full_scale.projection(ROWS, extra, 61, COMM)}
    # 4k cells only; 10 x 17 charged the 10 x 65 cell's all-reduces; no 10 x 1 cell, so no ar at C = 10
    assert set(proj) == {("ar", 1), ("ddtree@16", 1), ("ddtree@64", 1), ("ddtree@16", 10)}
    assert proj[("ddtree@16", 10)]["tok_s"] == pytest.approx(10 * 3.843 / (30.5e-3 + 2.6e-3 + 61 * 0.498e-3))
    ar = proj[("ar", 1)]
    assert ar["tok_s"] == pytest.approx(1.0 / (7.5e-3 + 61 * 0.115e-3))
    d16 = proj[("ddtree@16", 1)]
    assert d16["comm_bound"] and d16["comm_s"] == pytest.approx(61 * 0.127e-3)  # the 65-node messages, a bound
    assert d16["tok_s"] == pytest.approx(3.843 / (14.0e-3 + 2.6e-3 + 61 * 0.127e-3))
    assert d16["tok_s_fast"] == pytest.approx(3.843 / (14.0e-3 + 2.6e-3 + 61 * 2 * 8e-6))
    assert d16["tok_s_quoted"]["Math500"] == pytest.approx(5.5 / (14.0e-3 + 2.6e-3 + 61 * 0.127e-3))
    assert not proj[("ddtree@64", 1)]["comm_bound"]


def test_cells_argument():
    assert full_scale.parse_cells("4096:1x17, 131072:10x65") == [(4096, 1, 17), (131072, 10, 65)]
    with pytest.raises(Exception, match="CONTEXT:BATCHxNODES"):
        full_scale.parse_cells("4096-1x17")


def test_ab_report_and_replot(tmp_path):
    base_dir, new_dir = tmp_path / "base", tmp_path / "new"
    base_rows = [dict(r, step_s=r["step_s"] * 1.25) for r in ROWS]
    comm_json = {f"{b}x{t}": dict(seconds=s, bytes=n) for (b, t), (s, n) in COMM.items()}
    base_extra = dict(profiles={"context 4096, 1 x 1": dict(busy_us=8000.0, launches=61 * 40, top=[])},
                      comm=comm_json, comm_source="made up")
    full_scale.write_report(str(base_dir), dict(META, commit="base000"), base_rows, base_extra)
    with open(base_dir / "full_scale.json") as f:
        base = json.load(f)
    extra = dict(profiles={"context 4096, 1 x 1": dict(busy_us=7000.0, launches=61 * 34, top=[])}, comm=comm_json,
                 comm_source="made up", drafter=dict(step_s=2.6e-3, bytes=7e9, layers=6, batch=1, context=4096),
                 base=base)
    extra["projection"] = full_scale.projection(ROWS, extra, 61, COMM)
    full_scale.write_report(str(new_dir), META, ROWS, extra)
    text = (new_dir / "full_scale.md").read_text()
    assert "against base000, the same cells in the same call" in text
    assert "| 4096 | 1 x 1 | 9.38 | 7.50 | 1.25x |" in text and "| 40.0 | 34.0 |" in text
    assert "Best measured budget at C = 1: ddtree@16" in text
    assert (new_dir / "full_scale.png").stat().st_size > 0
    before = text
    (new_dir / "full_scale.md").unlink()
    full_scale.main(["--replot", str(new_dir / "full_scale.json")])
    assert (new_dir / "full_scale.md").read_text() == before


def test_report_states_the_loop_rows(tmp_path):
    """Cells timed with --loop get the in-a-loop table, its ratio to the floor from the loop's step."""
    rows = [dict(ROWS[0], loop_step_s=6.0e-3), ROWS[1]]
    prof = dict(busy_us=5000.0, launches=1220.0, top=[("MlaVerifyKernel", 61.0, 700.0)], path_us={})
    full_scale.write_report(str(tmp_path), META, rows, {"profiles": {"context 4096, 1 x 1": prof}})
    text = (tmp_path / "full_scale.md").read_text()
    assert "| 4096 | 1 x 1 | 7.50 | 6.00 | 4.00 |" in text  # 6.0 ms / 1.5 ms floor
    assert text.count("| 4096 | 1 x 17 |") == 1 and text.count("| 4096 | 1 x 1 |") == 2  # no loop row for 1 x 17
    assert "## Kernel profile, context 4096, 1 x 1" in text


def test_steps_in_one_call_are_the_steps_one_by_one():
    """--loop's executable (`steps_in_one_call`) runs the same steps as calling `step` in turn: its logits sum and the
    cache it carries equal those of three separate steps on the same tiny per-device model (CPU, XLA kernels), to
    fp32 rounding (one compiled loop against operations run one by one)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from common import random_trees
    from kdtree_jax.model import init_cache, step

    cfg, params = full_scale.per_device_model(8, 2, True, "xla")
    depths, vis = random_trees(1, 3, np.random.default_rng(1))
    tokens = jnp.asarray([[5, 17, 99]], jnp.int32)

    def fresh():
        cache = init_cache(cfg, 1, 40)
        return dataclasses.replace(cache, lengths=jnp.full((1,), 20, jnp.int32))

    acc, cache = jnp.zeros((1, 8), jnp.float32), fresh()
    for _ in range(3):
        out = step(params, cfg, tokens, cache, depths=jnp.asarray(depths), tree_mask=jnp.asarray(vis))
        acc, cache = acc + out.logits[:, 0, :8].astype(jnp.float32), out.cache
    got, got_cache = full_scale.steps_in_one_call(cfg, 3)(params, fresh(), tokens, jnp.asarray(depths),
                                                          jnp.asarray(vis))
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(acc), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(cache)):  # one jit against op by op: ulps apart
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)


def test_save_timeline_moves_both_event_lists(tmp_path):
    """save_timeline writes the kernels' and the host's events of a profile beside each other and takes them out of
    the profile (what stays is what the JSON report keeps)."""
    import gzip

    prof = dict(events=[["MlaVerifyKernel", 7, 0.0, 10.5]], host_events=[["launch", 3, -2.0, 6.0]], busy_us=10.5)
    full_scale.save_timeline(str(tmp_path / "out"), "loop_4096_1x1", prof)
    with gzip.open(tmp_path / "out" / "timeline_loop_4096_1x1.json.gz", "rt") as f:
        assert json.load(f) == [["MlaVerifyKernel", 7, 0.0, 10.5]]
    with gzip.open(tmp_path / "out" / "host_loop_4096_1x1.json.gz", "rt") as f:
        assert json.load(f) == [["launch", 3, -2.0, 6.0]]
    assert prof == dict(busy_us=10.5)


class _Device:
    """A stand-in for a jax device: its platform, kind and memory statistics."""

    def __init__(self, platform: str, limit: float | None, kind: str = "NVIDIA H100 80GB HBM3"):
        self.platform, self.device_kind, self._limit = platform, kind, limit

    def memory_stats(self):
        return None if self._limit is None else {"bytes_limit": int(self._limit)}


def test_check_fits_refuses_a_program_larger_than_the_gpu():
    """The 61-layer per-device program (~80 GB while it is made) on an H100's ~79 GB: one line naming the layers that
    fit, before any weight is allocated. On an H200 (139 GB), at 40 layers on the H100, and on a CPU: nothing."""
    cfg = full_scale.local_experts_cfg(full_scale.per_device_cfg(8, 61, False, "ffi"), 8)
    with pytest.raises(SystemExit, match=r"61 layers: 80\.\d GB of weights do not fit this NVIDIA H100 80GB HBM3's "
                                         r"79\.0 GB; run fewer \(--layers 4\d\)"):
        full_scale.check_fits(cfg, _Device("gpu", 79e9))
    full_scale.check_fits(cfg, _Device("gpu", 139e9, "NVIDIA H200"))
    full_scale.check_fits(cfg, _Device("cpu", 79e9))
    full_scale.check_fits(cfg, _Device("gpu", None))
    fewer = full_scale.local_experts_cfg(full_scale.per_device_cfg(8, 40, False, "ffi"), 8)
    full_scale.check_fits(fewer, _Device("gpu", 79e9))


def test_a_cut_model_is_named_in_the_projection(tmp_path):
    """A run of fewer layers than K2.6 has (an H100: 61 do not fit) says its projection is of that cut model."""
    comm_json = {f"{b}x{t}": dict(seconds=s, bytes=n) for (b, t), (s, n) in COMM.items()}
    for layers in (40, 61):
        extra = dict(comm=comm_json, comm_source="made up",
                     projection=full_scale.projection(ROWS, dict(drafter=dict(step_s=2.6e-3)), layers, COMM))
        out = tmp_path / str(layers)
        full_scale.write_report(str(out), dict(META, layers=layers), ROWS, extra)
        text = (out / "full_scale.md").read_text()
        assert ("A cut model**: 40 of K2.6's 61 layers (`--layers 40`)" in text) == (layers == 40), layers
        assert "## Projection to 8 GPUs" in text
