"""benchmarks/fixed_cost.py runs on a CPU (tiny shapes, wall times) and writes its table and JSON: the GPU run of
the next session must not fail on a typo."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import fixed_cost  # noqa: E402


def test_smoke_run_writes_every_case(tmp_path):
    fixed_cost.main(["--small", "--calls", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "fixed_cost.json").read_text())
    names = [r["case"] for r in saved["rows"]]
    assert len(names) == 5 and names[0].startswith("moe_route") and names[-1].startswith("control")
    assert all(r["hot_wall_us"] > 0 and r["cold_wall_us"] > 0 for r in saved["rows"])
    table = (tmp_path / "fixed_cost.md").read_text()
    assert all(f"| {n} |" in table for n in names)
