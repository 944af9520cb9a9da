"""benchmarks/collectives.py on 8 simulated CPU devices: a sharded layer issues exactly its two all-reduces, of
the sizes the report predicts, and the default candidate is timed in its own process."""

import json
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import collectives  # noqa: E402


@pytest.mark.skipif(jax.device_count() < 2, reason="needs several devices (tests/conftest.py simulates 8)")
def test_two_all_reduces_a_layer_and_a_report(tmp_path):
    assert collectives.main(["--small", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "collectives.json").read_text())
    meta = saved["meta"]
    for c, t in meta["cells"]:
        assert saved["counts"][f"{c}x{t}"] == collectives.messages(c, t, meta["hidden"], meta["act_bytes"])
    assert saved["results"]["xla"]["status"] == "ok"
    assert all(v > 0 for v in saved["results"]["xla"]["seconds"].values())
    assert "not run on a CPU" in saved["results"]["one_shot"]["status"]
