"""benchmarks/serve_ab.py: its summary of the alternated repeats (medians, ranges, B / A), and one short run on the
CPU with this tree on both sides (two server processes, each compiling the embedded model's ar engine), whose report
must hold every level of both."""

import json
import os
import statistics
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import serve_ab  # noqa: E402


def _row(c, agg, per, ttft):
    return dict(concurrency=c, aggregate_tok_s=agg, per_request_tok_s=per, ttft_p50_s=ttft)


def test_compare_takes_medians_and_ranges_of_each_side():
    runs = {"old": [[_row(1, 100.0, 90.0, 0.010)], [_row(1, 120.0, 80.0, 0.030)], [_row(1, 110.0, 85.0, 0.020)]],
            "new": [[_row(1, 99.0, 70.0, 0.015)], [_row(1, 121.0, 72.0, 0.025)], [_row(1, 105.0, 74.0, 0.005)]]}
    (got,) = serve_ab.compare(runs, ("old", "new"))
    assert got["concurrency"] == 1
    assert got["old_aggregate_tok_s"] == 110.0 and got["old_aggregate_tok_s_range"] == (100.0, 120.0)
    assert got["new_aggregate_tok_s"] == 105.0 and got["new_aggregate_tok_s_range"] == (99.0, 121.0)
    assert got["ratio_aggregate_tok_s"] == pytest.approx(105.0 / 110.0)
    assert got["ratio_per_request_tok_s"] == pytest.approx(72.0 / 85.0)
    assert got["new_ttft_p50_s"] == 0.015 and got["old_ttft_p50_s_range"] == (0.010, 0.030)


def test_compare_gives_each_process_pair_its_own_ratio():
    """Two pairs of two repeats: B / A over all four repeats, and within each pair from that pair's medians."""
    runs = {"A": [[_row(4, 100.0, 1, 1)], [_row(4, 110.0, 1, 1)], [_row(4, 200.0, 1, 1)], [_row(4, 210.0, 1, 1)]],
            "B": [[_row(4, 90.0, 1, 1)], [_row(4, 100.0, 1, 1)], [_row(4, 220.0, 1, 1)], [_row(4, 230.0, 1, 1)]]}
    (got,) = serve_ab.compare(runs, ("A", "B"), pairs=2)
    assert got["pair_ratios_aggregate_tok_s"] == pytest.approx([95.0 / 105.0, 225.0 / 205.0])
    assert got["ratio_aggregate_tok_s"] == pytest.approx(statistics.median([90, 100, 220, 230])
                                                          / statistics.median([100, 110, 200, 210]))


def test_a_short_run_of_this_tree_against_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    out = tmp_path / "out"
    rc = serve_ab.main(["--base", serve_ab.ROOT, "--base-label", "A", "--label", "B", "--concurrency", "1,2",
                        "--rounds", "1", "--max-tokens", "4", "--max-batch", "2", "--max-context", "128",
                        "--prompt-chars", "16", "--repeats", "1", "--pairs", "2", "--out", str(out), "--name", "ab"])
    assert rc == 0
    res = json.loads((out / "ab.json").read_text())
    rows = res["methods"]["ar"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        for side in ("A", "B"):
            assert r[f"{side}_aggregate_tok_s"] > 0 and r[f"{side}_ttft_p50_s"] > 0
        assert r["ratio_aggregate_tok_s"] > 0
    assert [len(res["raw"]["ar"][side]) for side in ("A", "B")] == [2, 2]
    assert all(len(r["pair_ratios_aggregate_tok_s"]) == 2 for r in rows)  # one B / A for each pair of servers
    text = (out / "ab.md").read_text()
    assert "| 1 |" in text and "| 2 |" in text and "B / A" in text and "within each process pair" in text
