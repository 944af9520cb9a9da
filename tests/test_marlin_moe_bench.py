"""The marlin_moe benchmark's CPU-side parts: --variants-at parsing and the report (table, JSON, plot) it writes."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import marlin_moe as bench  # noqa: E402


def test_variants_at_by_m():
    spec = "1,16=stream,tile64;4096=tile128;16=stream,base"
    assert bench.variants_at(spec, 1) == ["stream", "tile64"]
    assert bench.variants_at(spec, 16) == ["stream", "tile64", "base"]  # each once, in the order given
    assert bench.variants_at(spec, 4096) == ["tile128"]
    assert bench.variants_at(spec, 64) == []
    assert bench.variants_at(spec, 160) == []  # M = 160 is not 16
    assert bench.variants_at(spec) == ["stream", "tile64", "tile128", "base"]  # any M: what --variants-at asks for
    assert bench.variants_at("", 1) == [] and bench.variants_at("stream", 1) == []  # no '=': nothing


def _row(shape, m, variant, time_us, floor_us, rel_err=None):
    return dict(shape=shape, m=m, variant=variant, time_s=time_us * 1e-6, block_m=16, path="p", sets=32,
                touched=8.0, routed=8.0 * m, floor_s=floor_us * 1e-6, flops_floor_s=1e-6, finite=True, rel_err=rel_err)


def test_report_lists_the_anchor_and_the_baseline(tmp_path):
    meta = dict(date="2026-12-03", device="test device", commit="abc1234", jax="0", copy_Bps=4e12,
                matmul_flops=7e14, before="base build", notes=["a note"])
    rows = [_row("k2", 1, "after", 80.0, 48.0), _row("k2", 1, "base", 82.0, 48.0, 0.0),
            _row("k2", 1, "triton", 360.0, 48.0, 4.4e-3), _row("device", 16, "after", 120.0, 80.0),
            _row("device", 16, "triton", 600.0, 80.0, 4.0e-3)]
    bench.write_report(str(tmp_path), meta, rows)
    md = (tmp_path / "marlin_moe.md").read_text()
    # K2: the other variants' table holds base and triton with time (% of floor; rel err)
    assert "| M | base | triton |" in md
    assert "| 1 | 82.0 (59%; 0.0e+00) | 360.0 (13%; 4.4e-03) |" in md
    # per-device: only triton besides after; after's own row has its % of the floor (80 / 120)
    assert "| M | triton |" in md and "| 16 | 600.0 (13%; 4.0e-03) |" in md
    assert "| 120.0 | 67% |" in md
    assert "- a note" in md and "commit abc1234" in md
    saved = json.loads((tmp_path / "marlin_moe.json").read_text())
    assert saved["meta"]["commit"] == "abc1234"
    assert [(r["variant"], r["time_s"]) for r in saved["rows"]] == [(r["variant"], r["time_s"]) for r in rows]
    pytest.importorskip("matplotlib")
    png = tmp_path / "marlin_moe.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
