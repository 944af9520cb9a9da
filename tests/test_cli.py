"""The kdtree-jax command line: generation with the embedded model, stats line, clear errors."""

import json
import os
import re

import pytest

from kdtree_jax import cli
from kdtree_jax.cli import DEFAULT_PROMPT, main, parse_mesh, stats_line

# generate's stats, the same for every method and for the CLI's streamed ar (docs/usage.md, "Stats")
_STATS_KEYS = {"method", "budget", "new_tokens", "steps", "tau", "tau_histogram", "nodes", "nodes_histogram",
               "draft_reliability", "compile_s", "wall_s", "tokens_per_s"}


@pytest.mark.parametrize("method, prompt, sampling", [("ar", None, []), ("ddtree", "import os\n", []),
                                                      ("chain", None, ["--temperature", "0.7", "--top-k", "20",
                                                                       "--top-p", "0.9"])])
def test_generate_prints_text_and_stats(method, prompt, sampling, capsys, monkeypatch):
    """The text, streamed by every method, then one stats line of the same keys for every method; compilation is
    reported apart, first; the sampling options reach the decoding loop."""
    import importlib

    api = importlib.import_module("kdtree_jax.generate")  # the module (kdtree_jax.generate is the function)
    seen, streamed = [], []
    monkeypatch.setattr(cli, "stats_line", lambda stats: seen.append(stats) or stats_line(stats))
    real_stream = api.stream
    monkeypatch.setattr(api, "stream", lambda *a, **kw: streamed.append(kw) or real_stream(*a, **kw))
    budget = ["--budget", "16"] if method == "ddtree" else []  # (refused with the other methods: it would be ignored)
    argv = ["generate", "--max-new-tokens", "24", "--method", method] + budget + sampling
    assert main(argv + (["--prompt", prompt] if prompt else [])) == 0
    assert streamed and all(kw["method"] == method for kw in streamed)
    if sampling:
        assert (streamed[-1]["temperature"], streamed[-1]["top_k"], streamed[-1]["top_p"]) == (0.7, 20, 0.9)
    out = capsys.readouterr()
    prompt = prompt or DEFAULT_PROMPT
    assert out.out.startswith(prompt) and len(out.out) > len(prompt)
    stats = out.out.strip().splitlines()[-1]
    assert stats.startswith("[stats]") and f"method={method}" in stats and "tau=" in stats
    values = dict(item.split("=", 1) for item in stats.split()[1:])
    assert {"new_tokens", "steps", "compile_s", "wall_s", "tokens_per_s"} <= values.keys()
    new, wall = int(values["new_tokens"]), float(values["wall_s"])
    assert new == 24 and wall > 0 and float(values["compile_s"]) > 0
    assert float(values["tokens_per_s"]) == pytest.approx(new / wall, rel=0.05, abs=0.1)  # wall_s is rounded
    assert set(seen[0]) == _STATS_KEYS
    assert "embedded model" in out.err
    compiling = out.err.index(f"compiling {method}")
    assert "compiled in" in out.err[compiling:]


def test_stats_line_has_generate_keys():
    """The CLI's ar streaming stats have exactly the keys of generate's stats (one schema for every method)."""
    import jax

    import kdtree_jax as kj

    cfg = kj.configs.tiny()
    out = kj.generate(kj.init_params(cfg, jax.random.key(0)), cfg, [[1, 2, 3]], max_new_tokens=4)
    assert set(out.stats) == _STATS_KEYS
    assert out.stats["tokens_per_s"] == pytest.approx(out.stats["new_tokens"] / out.stats["wall_s"])
    assert stats_line(out.stats).startswith("[stats] method=ar new_tokens=4 steps=3 tau=1.00 compile_s=")


def test_bad_arguments_are_clear_errors(capsys):
    assert main(["generate", "--prompt", "x", "--max-new-tokens", "0"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--method", "ddtree", "--budget", "0"]) == 2
    assert "budget" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--temperature", "1", "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dp=N, ep=N, tp=N"):
        parse_mesh("tp=2,xx=3")
    assert parse_mesh("ep=4,tp=2") == {"ep": 4, "tp": 2}
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--budget" in capsys.readouterr().out


def test_bench_rows_are_lossless_and_written(tmp_path, capsys):
    """bench runs ar, chain and ddtree on the same held-out prompts; greedy speculative tokens equal ar's."""
    import json

    path = tmp_path / "bench.json"
    assert main(["bench", "--budgets", "4,16", "--batch", "2", "--prompt-len", "32", "--max-new-tokens", "12",
                 "--repeats", "1", "--ffi-ops", "tree_build,tree_accept", "--json", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["method", "budget", "tokens/s"] and len(table) == 5
    saved = json.loads(path.read_text())
    assert saved["setup"]["kernels"] == "ffi"  # the tree custom calls (C++ handlers here), the rest pure JAX
    rows = saved["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("chain", None), ("ddtree", 4), ("ddtree", 16)]
    assert all(r["equal_ar"] for r in rows)
    assert all(r["tokens_per_s"] > 0 and r["steps"] >= 1 for r in rows)
    assert rows[0]["tau"] == 1.0 and all(r["tau"] >= 1.0 for r in rows[1:])


def test_bench_calibrates_and_runs_auto(tmp_path, capsys, monkeypatch):
    """bench --calibrate measures budget='auto''s cost model once and saves it (tiers 0 and 8: autoregressive steps
    among the choices); the auto row finds it, is lossless, and generate --budget auto reuses it without measuring
    again."""
    import json

    from kdtree_jax import budget

    monkeypatch.setenv("KDTREE_JAX_COSTS", str(tmp_path / "costs"))
    path = tmp_path / "bench.json"
    assert main(["bench", "--methods", "ddtree", "--budgets", "8,auto", "--max-budget", "8", "--tiers", "0,8",
                 "--batch", "1",
                 "--prompt-len", "32", "--max-new-tokens", "12", "--repeats", "1", "--calibrate", "--json",
                 str(path)]) == 0
    out = capsys.readouterr()
    assert "cost model saved to" in out.err and "tier    0:" in out.out and "tier    8:" in out.out
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    rows = json.loads(path.read_text())["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("ddtree", 8), ("ddtree", "auto")]
    assert all(r["equal_ar"] for r in rows) and 0 <= rows[2]["nodes"] <= 8
    monkeypatch.setattr(budget, "calibrate", lambda *a, **k: pytest.fail("measured again"))
    assert main(["generate", "--method", "ddtree", "--budget", "auto", "--max-budget", "8", "--tiers", "0,8",
                 "--max-new-tokens", "8"]) == 0
    assert "budget=auto nodes=" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ar,beam"], "unknown method"),
    (["--budgets", "8,big"], "integers or 'auto'"),
    (["--budgets", "8,0"], "at least 1"),
    (["--budgets", "eight"], "comma-separated integers"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--prompt-len", "100000000"], "--prompt-len 100000000 and --max-new-tokens 4 (ar): 100000000 prompt tokens + 4 "
                                    "= 100000004 exceed the model's context of 2048 positions"),  # (before the text)
    (["--ffi-ops", "tree_build,beam_search"], "unknown custom calls"),
    (["--ffi-ops", "tree_build", "--kernels", "xla"], "cannot go with --kernels xla"),
])
def test_bench_bad_arguments(argv, message, capsys):
    assert main(["bench", "--repeats", "1", "--max-new-tokens", "4", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8_is_a_usage_error(capsys):
    """Bytes that are not UTF-8 reach Python as lone surrogates: named as such before anything loads."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", b"abc\xff".decode("utf-8", "surrogateescape")])
    assert exit_.value.code == 2 and "not UTF-8 text: byte ff at character 3" in capsys.readouterr().err


def test_an_empty_prompt_is_a_usage_error(capsys):
    """Named as --prompt and refused before the model is loaded (it failed after, as the API's 'prompt must be a
    non-empty 1-D sequence of token ids, got shape (0,)')."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", ""])
    assert exit_.value.code == 2 and "argument --prompt: expected the text to continue, got ''" in \
        capsys.readouterr().err


@pytest.mark.parametrize("tiers, message", [("0,-8", "tiers must be >= 0"), ("0,x", "comma-separated integers"),
                                            ("0,8,8,16", "8 given more than once")])
def test_bad_tiers_are_usage_errors(tiers, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--tiers", tiers])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def _no_load(monkeypatch):
    """These refusals must come before the model is loaded (minutes for a large one): loading fails the test."""
    def load(*a, **k):
        raise AssertionError("the model was loaded before the bad argument was refused")
    monkeypatch.setattr(cli, "_load", load)


@pytest.mark.parametrize("port", ["70000", "0", "-1", "http"])
def test_serve_refuses_ports_out_of_range(port, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", port])
    assert exit_.value.code == 2 and "--port" in capsys.readouterr().err


def test_serve_refuses_a_taken_port_a_bad_host_and_a_tiny_context_before_loading(monkeypatch, capsys):
    import socket

    _no_load(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", "--host", "no-such-host.invalid"]) == 2
    assert "--host 'no-such-host.invalid'" in capsys.readouterr().err
    assert main(["serve", "--max-context", "0"]) == 2
    assert "--max-context must be a power of two >= 64, got 0" in capsys.readouterr().err


def test_serve_refuses_bad_n_prefix_cache_cache_sharding_and_warmup_before_loading(monkeypatch, capsys):
    _no_load(monkeypatch)
    assert main(["serve", "--max-n", "0"]) == 2
    assert "--max-n must be in 1..2147483647, got 0" in capsys.readouterr().err
    assert main(["serve", "--cache-sharding", "sequence"]) == 2
    assert "--cache-sharding lays the cache out over --mesh" in capsys.readouterr().err
    for gb in ("-1", "nan", "x"):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--prefix-cache-gb", gb])
        assert exit_.value.code == 2 and "--prefix-cache-gb" in capsys.readouterr().err
    for lengths in ("0", "x", "8,,16", "every"):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--warmup", lengths])
        assert exit_.value.code == 2 and "--warmup" in capsys.readouterr().err
    assert main(["serve", "--max-request-mb", "0"]) == 2
    assert "--max-request-mb must allow at least one byte, got 0" in capsys.readouterr().err
    assert main(["serve", "--warmup", "8,128", "--max-context", "128"]) == 2
    assert "--warmup 128: a prompt must be shorter than --max-context 128" in capsys.readouterr().err
    assert main(["bench-serve", "--url", "http://127.0.0.1:1", "--shared-prefix", "-5"]) == 2
    assert "--shared-prefix must be at least 1, got -5" in capsys.readouterr().err


def test_an_empty_model_path_is_a_usage_error(capsys):
    """Not the working directory's name in 'is not a kdtree-jax checkpoint'."""
    for command in ("generate", "bench", "serve"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--model", ""])
        assert exit_.value.code == 2
        assert "--model: expected a checkpoint directory or 'builtin', got ''" in capsys.readouterr().err


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdtree-jax: error: "), err
    return err[0]


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "-1"], r"max_new_tokens must be an integer in [1, 2**31), got -1"),
    (["--max-new-tokens", str(2**40)], r"max_new_tokens must be an integer in [1, 2**31)"),
    (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["--temperature", "-0.5"], "temperature must be a finite number >= 0, got -0.5"),
    (["--temperature", "1", "--top-p", "0"], "top_p must be None or a number in (0, 1], got 0.0"),
    (["--temperature", "1", "--top-k", "0"], "top_k must be None or an integer in [1, 2**31), got 0"),
    (["--method", "ddtree", "--budget", "-1"], "--budget must be at least 1 (or 'auto'), got -1"),
    (["--method", "ddtree", "--budget", "auto", "--max-budget", "0"], "--max-budget must be at least 1, got 0"),
    (["--method", "ddtree", "--budget", "auto", "--tiers", "0,32"],
     "--tiers 0,32: the largest tier must equal --max-budget (64)"),
    (["--method", "ddtree", "--budget", "auto", "--cost-model", "/no/such/cost.json"],
     "--cost-model /no/such/cost.json: no such file"),
    # flags that would be ignored
    (["--budget", "16"], "--budget: for --method ddtree only (--method ar drafts no tree"),
    (["--method", "chain", "--budget", "auto"], "--budget: for --method ddtree only (--method chain"),
    (["--top-k", "40"], "--top-k: for --temperature > 0 only"),
    (["--temperature", "0", "--top-k", "40", "--top-p", "0.9"], "--top-k, --top-p: for --temperature > 0 only"),
])
def test_generate_refuses_bad_decoding_flags_in_one_line_before_loading(argv, message, monkeypatch, capsys):
    """Refused before the model is loaded (minutes for a large one) and before 'compiling' is announced: the error
    is the one line on stderr."""
    _no_load(monkeypatch)
    assert main(["generate", "--prompt", "x", *argv]) == 2
    assert message in _one_line_error(capsys)


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-batch", "0"], "--max-batch must be in 1..2147483647, got 0"),
    (["serve", "--max-queue", "-1"], "--max-queue must be in 1..2147483647, got -1"),
    (["serve", "--chunk-steps", "0"], "--chunk-steps must be in 1..2147483647, got 0"),
    (["serve", "--chunk-steps", "99999999999"], "--chunk-steps must be in 1..2147483647, got 99999999999"),
    (["serve", "--max-batch", "99999999999"], "--max-batch must be in 1..2147483647, got 99999999999"),
    (["serve", "--host", ""], "--host must not be empty (the default 127.0.0.1 serves this machine only"),
    (["bench", "--methods", "ddtree", "--budgets", ""], "--budgets '': expected comma-separated integers or 'auto'"),
    (["bench-serve", "--url", "http://127.0.0.1:9", "--seed", "-1"], "--seed must be in 0..2**63 - 1, got -1"),
    (["serve", "--max-context", "100"], "--max-context must be a power of two >= 64, got 100"),
    (["serve", "--budget", "0"], "--budget must be at least 1 (or 'auto'), got 0"),
    (["serve", "--method", "ar", "--budget", "16"], "--budget: for --method ddtree only (--method ar drafts no tree"),
    (["serve", "--served-model-name", ""], "--served-model-name must not be empty"),
    (["bench", "--methods", "ar", "--budgets", "abc"], "--budgets: for ddtree only (--methods ar drafts no tree"),
    (["plan", "--model", "tiny", "--context", "8", "--hosts", "0"], "--hosts must be a positive integer, got 0"),
    # sixth probe round: bench checked budget auto's flags once the model was loaded (and, for --tiers and
    # --cost-model, after ar and chain had been timed)
    (["bench", "--budgets", "auto", "--max-budget", "0"], "--max-budget must be at least 1, got 0"),
    (["bench", "--budgets", "auto", "--max-budget", "16", "--tiers", "4,8"],
     "--tiers 4,8: the largest tier must equal --max-budget (16)"),
    (["bench", "--budgets", "auto", "--cost-model", "/no/such/cost.json"],
     "--cost-model /no/such/cost.json: no such file"),
    (["bench", "--calibrate", "--max-budget", "-4"], "--max-budget must be at least 1, got -4"),
    (["bench", "--max-new-tokens", str(2**40)], r"max_new_tokens must be an integer in [1, 2**31)"),
    (["serve", "--prefix-cache-gb", "1e300"], "--prefix-cache-gb must be below 9.22e+09 (2**63 bytes), got 1e+300"),
    (["serve", "--max-request-mb", "1e308"], "--max-request-mb must be below 9.22e+12 (2**63 bytes), got 1e+308"),
])
def test_serve_bench_and_plan_refuse_bad_flags_in_one_line_before_loading(argv, message, monkeypatch, capsys):
    _no_load(monkeypatch)
    monkeypatch.setattr(cli, "_read_model", lambda *a: pytest.fail("the model was read"))
    assert main(argv) == 2
    assert message in _one_line_error(capsys)


def test_a_cost_model_that_is_not_a_file_says_what_it_is(tmp_path, monkeypatch, capsys):
    """Issue 46, fifth probe round: --cost-model naming a directory, a FIFO or a symlink loop said "no such file"."""
    import os

    _no_load(monkeypatch)
    os.mkfifo(tmp_path / "fifo")
    os.symlink("loop", tmp_path / "loop")
    for path, what in ((tmp_path, "is a directory"), (tmp_path / "fifo", "is not a regular file"),
                       (tmp_path / "loop", "does not open: Too many levels of symbolic links")):
        assert main(["generate", "--prompt", "x", "--method", "ddtree", "--budget", "auto", "--cost-model",
                     str(path)]) == 2
        assert f"--cost-model {path}: {what} (a cost model saved by" in _one_line_error(capsys)


def test_a_cost_model_that_does_not_fit_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    """Sixth probe round: a --cost-model file that is not a cost model, or is one for another batch or other tiers,
    was refused only once the model was loaded (bench: after ar and chain had been timed)."""
    import json

    from kdtree_jax import budget
    from kdtree_jax.budget_policy import CostModel

    _no_load(monkeypatch)
    (tmp_path / "list.json").write_text("[]")
    budget.save(CostModel.from_points((4, 8, 16), 2, [[(1, 1.0)]] * 3), str(tmp_path / "b2.json"))
    auto = ["--budget", "auto", "--max-budget", "16", "--cost-model"]
    for argv in (["generate", "--prompt", "x", "--method", "ddtree"], ["serve", "--max-batch", "4"],
                 ["bench", "--batch", "3", "--budgets", "auto", "--max-budget", "16", "--cost-model"]):
        argv = argv + auto if argv[0] != "bench" else argv
        assert main(argv + [str(tmp_path / "list.json")]) == 2
        assert f"cost model file {tmp_path / 'list.json'} is unreadable" in _one_line_error(capsys)
        assert main(argv + [str(tmp_path / "b2.json")]) == 2
        batch = {"generate": 1, "serve": 4, "bench": 3}[argv[0]]
        assert f"measured for batch 2 and tiers (4, 8, 16); this run has batch {batch}" in _one_line_error(capsys)
    assert json.loads((tmp_path / "b2.json").read_text())["batch"] == 2


def test_bench_refuses_what_it_cannot_run_before_timing(monkeypatch, capsys):
    """Sixth probe round: `bench --batch 99999999999` was a MemoryError (745 GiB of prompt windows), and a ddtree
    budget past the drafter's (depth, token) choices was refused after ar and chain had been timed."""
    from kdtree_jax.tokenizer import ByteTokenizer

    import kdtree_jax as kj

    with pytest.raises(ValueError, match=r"--batch 99999999999 x --prompt-len 128: 12799999999872 prompt tokens, "
                                         r"more than the \d+ of the held-out text"):
        cli._bench_prompts(ByteTokenizer(), 99999999999, 128, 0)
    monkeypatch.setattr(kj, "generate", lambda *a, **k: pytest.fail("a method was timed"))
    assert main(["bench", "--budgets", "16,99999999999", "--max-new-tokens", "4"]) == 2
    out = capsys.readouterr()
    assert "tokens/s" not in out.out and out.err.strip().splitlines()[-1] == (
        "kdtree-jax: error: budget 99999999999 exceeds the 7 x 264 distinct (depth, token) choices")


def test_serve_refuses_a_warmup_past_the_context_before_loading(monkeypatch, capsys):
    """Issue 46, fifth probe round: `serve --warmup 99999999` was refused by the engine, after the model had loaded
    and 'compiling the prefills ... for prompts of 99999999 tokens' was printed. Without --max-context the context is
    at most 8192 tokens: longer is refused before loading."""
    _no_load(monkeypatch)
    assert main(["serve", "--warmup", "8,99999999"]) == 2
    assert ("--warmup 99999999: a prompt must be shorter than the context, at most 8192 tokens without --max-context"
            in _one_line_error(capsys))


def test_serve_refuses_a_warmup_past_the_models_context_before_compiling(monkeypatch, capsys):
    """Below 8192 tokens but past the model's context (the embedded model's 2048 positions): refused once the model is
    loaded, before any 'compiling' line and before the engine is built."""
    from kdtree_jax.serving import engine

    monkeypatch.setattr(engine, "Engine", lambda *a, **k: pytest.fail("the engine was built"))
    assert main(["serve", "--model", "builtin", "--warmup", "8,4096"]) == 2
    err = capsys.readouterr().err
    assert "compiling" not in err and err.strip().splitlines()[-1] == (
        "kdtree-jax: error: --warmup 4096: a prompt must be shorter than the context, 2048 tokens (the model's 2048 "
        "positions, at most 8192 without --max-context)")


def test_outputs_that_cannot_be_written_are_refused_before_the_work(tmp_path, monkeypatch, capsys):
    _no_load(monkeypatch)
    missing = tmp_path / "no-such-folder" / "rows.json"
    assert main(["bench", "--json", str(missing)]) == 2
    assert f"the folder {missing.parent} does not exist" in capsys.readouterr().err
    assert main(["bench", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert main(["bench", "--calibrate", "--cost-model", str(a_file / "c.json")]) == 2  # (a missing folder is made)
    assert "--cost-model's folder" in capsys.readouterr().err
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--out", str(a_file)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--out", str(a_file / "x")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    for name in ("sub/run", "", ".."):  # a folder in --name failed when the results were written, after the run
        assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), "--name", name]) == 2
        assert f"--name {name!r}: expected a file name without a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no probe file left behind


def test_bench_serve_names_a_server_it_cannot_reach(tmp_path, capsys):
    pytest.importorskip("httpx")
    with __import__("socket").socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert main(["bench-serve", "--url", url, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--url {url}: ConnectError" in err and "--debug" not in err
    assert main(["bench-serve", "--url", "http://[::1", "--out", str(tmp_path)]) == 2
    assert "--url http://[::1: InvalidURL" in capsys.readouterr().err


def test_debug_after_the_subcommand_shows_the_traceback(capsys):
    assert main(["generate", "--max-new-tokens", "0"]) == 2  # one line by default
    assert "max_new_tokens" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_new_tokens"):
        main(["generate", "--max-new-tokens", "0", "--debug"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        main(["--debug", "generate", "--max-new-tokens", "0"])


@pytest.mark.parametrize("argv, given", [
    (["generate", "--tiers", "0,64"], "--tiers"),
    (["generate", "--method", "ddtree", "--budget", "16", "--max-budget", "32", "--cost-model", "c.json"],
     "--max-budget, --cost-model"),
    (["serve", "--max-budget", "32"], "--max-budget"),
    (["bench", "--budgets", "16", "--tiers", "0,64"], "--tiers"),
])
def test_auto_flags_without_budget_auto_are_refused(argv, given, monkeypatch, capsys):
    _no_load(monkeypatch)
    assert main(argv) == 2
    assert f"{given}: for --budget auto only" in capsys.readouterr().err


def test_a_closed_output_pipe_ends_quietly():
    """`kdtree-jax generate | head -c3`: the reader goes away; the command stops with 141 (SIGPIPE's status) and no
    error message."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "kdtree_jax.cli", "generate", "--max-new-tokens", "300"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(3)
    p.stdout.close()  # the reader leaves while the text still streams
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert "error" not in err and "Traceback" not in err, err


def test_serve_max_context_past_the_model_names_the_flag(capsys):
    """Checked once the model's config is known (after the load), named as the flag, before the engine starts."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert main(["serve", "--max-context", "4096", "--port", str(port), "--method", "ar"]) == 2
    assert "--max-context 4096 exceeds the model's context of 2048 positions" in capsys.readouterr().err


@pytest.mark.parametrize("damage, message", [
    ("directory", "chat_template.jinja is not a regular file"),
    ("fifo", "chat_template.jinja is not a regular file"),
    ("dangling", "chat_template.jinja is missing"),
    ("syntax", r"chat_template.jinja: not a Jinja chat template \(line 1: "),
    ("latin1", "chat_template.jinja: not UTF-8 text"),
    ("config_syntax", r"tokenizer_config.json \(chat_template\): not a Jinja chat template"),
])
def test_serve_refuses_a_broken_chat_template_before_loading(damage, message, tmp_path, monkeypatch, capsys):
    """A chat_template.jinja that is a FIFO blocked serve forever once the model had loaded and compiled; a directory
    was an IsADirectoryError then; one that is a symlink to nothing was taken as no template (the embedded one served
    without a word); a template with a syntax error failed only after the load. Each is one line now, before the
    model is loaded."""
    _no_load(monkeypatch)
    path = tmp_path / "chat_template.jinja"
    if damage == "directory":
        path.mkdir()
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "dangling":
        path.symlink_to(tmp_path / "nowhere")
    elif damage == "syntax":
        path.write_text("{% for m in messages %}{{ m['content'] }}")
    elif damage == "latin1":
        path.write_bytes("{{ 'é' }}".encode("latin-1"))
    else:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    import socket

    with socket.socket() as free:  # a port that is free, so that the listen check passes
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert main(["serve", "--model", str(tmp_path), "--port", str(port)]) == 2
    assert re.search(message, _one_line_error(capsys))


@pytest.mark.parametrize("argv, message", [
    (["--shared-prefix", "0"], "--shared-prefix must be at least 1, got 0"),  # ran the concurrency levels instead
    (["--question-chars", "5"], "--question-chars: with --shared-prefix only"),  # was ignored
    (["--shared-prefix", "100", "--concurrency", "1,2"], "--concurrency: for the concurrency levels, not with"),
    (["--shared-prefix", "100", "--prompt-chars", "64"], "--prompt-chars: for the concurrency levels, not with"),
    (["--prompt-chars", "10000000"], r"--prompt-chars 10000000: prompts are cut from held-out files more than twice "
                                     r"as long; the longest allows \d+ characters"),  # said 20000000, not given
    (["--shared-prefix", "10000000"], "--shared-prefix 10000000: prompts are cut"),
])
def test_bench_serve_refuses_flags_of_the_other_mode_and_prompts_longer_than_the_files(argv, message, tmp_path,
                                                                                        capsys):
    """Before any request (the URL is never reached): each flag that the chosen mode would ignore is refused, and a
    prompt length the held-out files cannot give is named by its flag."""
    assert main(["bench-serve", "--url", "http://127.0.0.1:1", "--out", str(tmp_path), *argv]) == 2
    assert re.search(message, _one_line_error(capsys))


def test_generate_takes_every_seed_the_api_takes_and_refuses_a_length_past_the_context_before_compiling(capsys):
    """--seed 2**63 - 1 was refused ('outside [0, 2**63 - 1)') though generate and the server take it (one rule for
    every seed: validate.seed); --max-new-tokens past the model's context was refused after a 'compiling ar ...'
    line, by the call that was to compile."""
    assert main(["generate", "--seed", str(2**63 - 1), "--max-new-tokens", "2", "--temperature", "1"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["generate", "--seed", str(2**63)])
    assert "outside [0, 2**63)" in capsys.readouterr().err
    assert main(["generate", "--max-new-tokens", "10000"]) == 2
    err = capsys.readouterr().err
    assert "compiling" not in err and re.search(r"--max-new-tokens 10000: the prompt's \d+ tokens \+ 10000 = \d+ "
                                                r"exceed the model's context of 2048 positions", err), err


def test_speculative_slots_past_the_context_are_refused_before_compiling_or_timing(monkeypatch, capsys):
    """Issue 46, eighth probe round: `generate --method ddtree --max-new-tokens 2010` fits the context without the
    draft tree's slots, so it was refused after the 'compiling ddtree ...' line; `bench --prompt-len 1900
    --max-new-tokens 100` timed ar, then refused ddtree (and a prompt past the context came after the table's head).
    Both count the method's speculative slots before anything compiles or is timed."""
    import kdtree_jax as kj

    assert main(["generate", "--method", "ddtree", "--max-new-tokens", "2010"]) == 2
    err = capsys.readouterr().err
    assert "compiling" not in err and re.search(r"--max-new-tokens 2010: the prompt's \d+ tokens \+ 2010 \+ 65 "
                                                r"speculative slots = \d+ exceed the model's context of 2048", err), err
    monkeypatch.setattr(kj, "generate", lambda *a, **k: pytest.fail("a method was timed"))
    assert main(["bench", "--prompt-len", "1900", "--max-new-tokens", "100", "--methods", "ar,ddtree",
                 "--budgets", "64"]) == 2
    out = capsys.readouterr()
    assert "tokens/s" not in out.out and out.err.strip().splitlines()[-1] == (
        "kdtree-jax: error: --prompt-len 1900 and --max-new-tokens 100 (ddtree, budget 64): 1900 prompt tokens + 100 "
        "+ 65 speculative slots = 2065 exceed the model's context of 2048 positions")


def test_empty_output_paths_are_refused(monkeypatch, capsys):
    """Issue 46, eighth probe round: `bench --json ''` ran and wrote no file, and `bench --calibrate --cost-model ''`
    saved the cost model where auto runs look, each without a word; bench-serve's `--out ''` wrote into the working
    directory."""
    _no_load(monkeypatch)
    for argv, message in ((["bench", "--json", ""], "--json '': expected a file name"),
                          (["bench", "--calibrate", "--cost-model", " "], "--cost-model ' ': expected a file name"),
                          (["bench-serve", "--url", "http://127.0.0.1:9", "--out", ""], "--out '': expected a dir")):
        assert main(argv) == 2
        assert message in _one_line_error(capsys)


def test_bench_serve_refuses_max_tokens_past_the_servers_context_before_any_request(monkeypatch):
    """Issue 46, eighth probe round: `bench-serve --max-tokens 5000` against a server of 2048 tokens warmed it up,
    then failed on the first timed request ('RuntimeError: the server answered 400 ...'). The server's /health says
    its context: --max-tokens is refused from it, before any completion is sent."""
    httpx = pytest.importorskip("httpx")
    from kdtree_jax.serving import bench_serve

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "builtin"}]})
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "max_context": 2048})
        raise AssertionError(f"a request was sent: {request.method} {request.url.path}")

    client = httpx.Client
    monkeypatch.setattr(bench_serve.httpx, "Client", lambda **k: client(transport=httpx.MockTransport(handler), **k))
    for run in (lambda: bench_serve.run("http://server", [1], max_tokens=2048),
                lambda: bench_serve.prefix_ttft("http://server", max_tokens=5000)):
        with pytest.raises(ValueError, match=r"--max-tokens \d+: the server's context is 2048 tokens"):
            run()
