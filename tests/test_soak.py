"""benchmarks/soak.py on the embedded model for a few seconds (ar, 2 slots, short prompts and answers): every
request it sent is accounted for (by the clients and by the server's counters), no 5xx, every good answer equal to its
solo answer, every bad request refused, no slot left busy, a clean SIGTERM, and its report files written. The soak of
issue 46 (20 minutes, 16 clients) is the same script with its defaults."""

import json
import os
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("matplotlib")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import soak  # noqa: E402


def test_short_soak_accounts_for_every_request(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("KDTREE_JAX_COMPILATION_CACHE", str(tmp_path / "jax-cache"))
    out = tmp_path / "out"
    rc = soak.main(["--minutes", "0.1", "--concurrency", "2", "--prompts", "3", "--prompt-chars", "8,40",
                    "--max-tokens", "8,16", "--bad", "0.2", "--disconnect", "0.2", "--sample-s", "1",
                    "--out", str(out), "--name", "soak_test", "--",
                    "--method", "ar", "--max-batch", "2", "--max-context", "128"])
    res = json.loads((out / "soak_test.json").read_text())
    assert rc == 0, res["goals"]
    assert all((out / f"soak_test.{ext}").stat().st_size > 0 for ext in ("md", "json", "png"))
    c = res["clients"]
    by_kind = {k: sum(v.values()) for k, v in c["outcomes"].items()}
    # every request once in the outcomes, the statuses and the per-minute counts
    assert by_kind == {k: sum(v.values()) for k, v in c["statuses"].items()}
    assert by_kind == {k: sum(m[k] for m in c["per_minute"].values()) for k in by_kind}
    assert by_kind["good"] > 0 and by_kind["disconnect"] > 0
    assert by_kind["bad"] >= res["setup"]["bad_kinds"] == len(c["bad_requests_sent"])  # each kind at least once
    # all answered as they should be: no 5xx, no mismatch, no transport error
    assert c["outcomes"]["good"] == {"equal to solo": by_kind["good"]}
    assert c["outcomes"]["bad"] == {"refused (4xx, JSON error)": by_kind["bad"]}
    assert all(int(s) < 500 for k in c["statuses"] for s in c["statuses"][k])
    assert not c["failures"] and not res["log"]["errors"]
    # the server's counters agree: responses by status, engine requests finished, slots free
    answered = sum(by_kind.values()) + res["extra_requests"]
    assert sum(res["end"]["http_responses"].values()) == answered
    assert res["end"]["http_responses"]["400"] + res["end"]["http_responses"].get("422", 0) <= by_kind["bad"]
    assert sum(res["engine_outcomes"].values()) == res["engine_submitted"]
    assert res["engine_outcomes"]["error"] == 0
    assert res["end"]["active_slots"] == 0 and res["end"]["queue_depth"] == 0
    assert res["stop"]["status"] == 0
    for goal in ("no 5xx", "answers", "no slot leaked", "accounted for", "clean stop"):
        assert res["goals"][goal]["passed"] is True, (goal, res["goals"][goal])
    assert res["goals"]["host memory"]["passed"] is None  # 6 s: too short to judge
    assert res["memory"]["samples"] and all(s["rss"] > 0 for s in res["memory"]["samples"])
    table = (out / "soak_test.md").read_text()
    assert "| no 5xx |" in table
    (out / "soak_test.md").unlink()
    assert soak.main(["--replot", str(out / "soak_test.json")]) == 0 and (out / "soak_test.md").read_text() == table
