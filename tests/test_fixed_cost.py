"""benchmarks/fixed_cost.py runs on a CPU (tiny shapes, wall times) and writes its table and JSON: the GPU run of
the next session must not fail on a typo."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import fixed_cost  # noqa: E402


def test_smoke_run_writes_every_case(tmp_path):
    fixed_cost.main(["--small", "--calls", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "fixed_cost.json").read_text())
    names = [r["case"] for r in saved["rows"]]
    assert len(names) == 10 and names[0].startswith("moe_route") and names[-1].startswith("control")
    assert [n for n in names if n.startswith("mla_pre")] == [  # the custom call beside XLA's operations, M = 1, 17
        "mla_pre 1x1 (custom call)", "mla_pre 1x1 (XLA reference)", "mla_pre 1x17 (custom call)",
        "mla_pre 1x17 (XLA reference)"]
    assert all(r["hot_wall_us"] > 0 and r["cold_wall_us"] > 0 for r in saved["rows"])
    table = (tmp_path / "fixed_cost.md").read_text()
    assert all(f"| {n} |" in table for n in names)


def test_chain_spans_count_an_overlapped_chain_once():
    """A chain whose later kernels start early (PDL) and wait: its span is first start to last end, once per chain;
    a first kernel with no last one after it gives no span."""
    from profile_tools import chain_spans

    events = [("A", 0.0, 3.0), ("G", 1.0, 10.0), ("G", 2.0, 15.0), ("C", 4.0, 14.0), ("X", 20.0, 1.0),
              ("A", 30.0, 3.0), ("G", 31.0, 5.0), ("C", 33.0, 6.0), ("A", 50.0, 2.0)]
    assert chain_spans(events[::-1], "A", "C") == [18.0, 9.0]


def test_path_shares_charge_each_instant_to_the_kernel_that_ends_first():
    """A kernel launched early that waits (B, started at 1, ends at 9 after A ends at 4) is charged from A's end; one
    beside a longer one on another stream (C inside D) only while it is the next to end; gaps go to "(idle)", the
    longest calls - 1 of them to "(between calls)"; the shares sum to the span."""
    from profile_tools import path_shares

    events = [("A", 0.0, 4.0), ("B", 1.0, 8.0), ("D", 10.0, 10.0), ("C", 12.0, 3.0), ("A", 22.0, 1.0)]
    shares = path_shares(events[::-1])
    assert shares == {"A": 5.0, "B": 5.0, "(idle)": 3.0, "D": 7.0, "C": 3.0}
    assert sum(shares.values()) == 23.0
    # two calls: the longest idle stretch (20 -> 22) is the gap between them
    assert path_shares(events, calls=2) == {"A": 5.0, "B": 5.0, "(idle)": 1.0, "(between calls)": 2.0, "D": 7.0,
                                            "C": 3.0}


def test_timeline_layer_rows_cut_one_layer_window(tmp_path, capsys):
    """benchmarks/timeline.py: the window from one marker kernel to the next holds the kernels starting in it, each
    with its share of the window (a kernel running past the window's end counts up to it), and the script prints
    them."""
    import gzip
    import json

    from timeline import layer_rows, main

    events = [["M", 1, 0.0, 5.0], ["X", 2, 1.0, 10.0], ["Y", 1, 6.0, 2.0], ["M", 1, 20.0, 5.0], ["Z", 1, 26.0, 1.0],
              ["M", 1, 30.0, 1.0]]
    rows, window = layer_rows(events, "M", 0)
    assert window == 20.0
    assert [(r["family"], r["start"], r["end"], r["path"]) for r in rows] == [
        ("M", 0.0, 5.0, 5.0), ("X", 1.0, 11.0, 1.0 + 3.0), ("Y", 6.0, 8.0, 2.0)]
    path = tmp_path / "timeline.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(events, f)
    assert main([str(path), "--marker", "M", "--layer", "1"]) == 0
    capsys.readouterr()
    steps = [["M", 1, 0.0, 1.0], ["Z", 1, 3.0, 2.0], ["M", 1, 10.0, 1.0], ["M", 1, 100.0, 1.0], ["M", 1, 110.0, 1.0],
             ["M", 1, 200.0, 1.0], ["M", 1, 210.0, 1.0]]  # three steps of two layers: one window in the first
    with gzip.open(path, "wt") as f:
        json.dump(steps, f)
    assert main([str(path), "--marker", "M", "--windows", "--show", "Z"]) == 0
    assert capsys.readouterr().out.splitlines()[2:] == ["| 10.0 | 0 | 2.0 |"]
    with pytest.raises(ValueError, match="3 M kernels"):
        layer_rows(events, "M", 2)
    # idle stretches: 11 -> 20 (X ended last, M next), 27 -> 30; none inside the overlapping kernels
    from timeline import idle_gaps
    assert idle_gaps(events, 3.0) == [dict(start=11.0, us=9.0, before="X", after="M"),
                                      dict(start=27.0, us=3.0, before="Z", after="M")]


def test_timeline_host_events_in_a_gap():
    """timeline.host_in_gap: the host events overlapping an idle stretch, the longest overlap first, with it."""
    from timeline import host_in_gap
    host = [["launch", 1, 0.0, 12.0], ["record", 1, 14.0, 40.0], ["sync", 2, 30.0, 5.0], ["late", 1, 60.0, 9.0]]
    rows = host_in_gap(host, dict(start=10.0, us=40.0, before="A", after="B"))
    assert [(r[0], r[4]) for r in rows] == [("record", 36.0), ("sync", 5.0), ("launch", 2.0)]
