"""`kdtree-jax plan`: per-GPU memory from shapes alone, checked against arithmetic written out by hand."""

import json
import shutil
import time

import pytest

import kdtree_jax as kj
from kdtree_jax.cli import main

GB = 1e9


def _plan_json(capsys, *argv):
    status = main(["plan", *argv, "--json"])
    out = capsys.readouterr()
    return status, json.loads(out.out)


def test_k2_6_weights_on_ep8_match_a_hand_count(capsys):
    c = kj.configs.k2_6()
    d, v, n_layers, h, ep = c.hidden_size, c.vocab_size, c.num_hidden_layers, c.num_attention_heads, 8
    bf16, f32 = 2, 4
    n_moe, n_dense = n_layers - c.first_k_dense_replace, c.first_k_dense_replace
    top = 2 * v * d * bf16 // ep + d * bf16  # embed and lm_head split over the vocabulary; final norm
    attn = (d * c.q_lora_rank + c.q_lora_rank + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank) * bf16
    attn += (c.q_lora_rank * h * (c.qk_nope_head_dim + c.qk_rope_head_dim) + c.kv_lora_rank * h * c.qk_nope_head_dim
             + c.kv_lora_rank * h * c.v_head_dim + h * c.v_head_dim * d) * bf16 // ep  # per-head weights
    norms = 2 * d * bf16
    dense_mlp = 3 * d * c.intermediate_size * bf16 // ep
    # one INT4 [out, in] matrix: in/8 int32 words and in/32 bf16 scales per output row
    int4 = lambda n_out, n_in: n_out * (n_in // 8 * 4 + n_in // 32 * 2)
    f = c.moe_intermediate_size
    expert = 2 * int4(f, d) + int4(d, f)
    assert 24.7e6 < expert < 24.9e6  # ~24.8 MB per expert
    moe = (c.n_routed_experts // ep) * expert + d * c.n_routed_experts * bf16 + c.n_routed_experts * f32
    moe += 3 * d * f * c.n_shared_experts * bf16 // ep
    expected = top + n_layers * (attn + norms) + n_dense * dense_mlp + n_moe * moe
    assert 75e9 < expected < 78e9

    from kdtree_jax import plan

    p = plan.plan(c, None, {"ep": 8}, 1024, 1, 64, 141 * GB)
    assert p.weights == expected
    status, r = _plan_json(capsys, "--model", "k2_6", "--mesh", "ep=8", "--context", "1024")
    assert status == 0 and r["per_gpu_gb"]["weights"] == round(expected / GB, 2)


def test_builtin_fits_trivially(capsys):
    status, r = _plan_json(capsys, "--model", "builtin", "--context", "1024", "--concurrency", "4", "--budget", "16")
    assert status == 0 and r["fits"] and r["drafter"]
    assert r["per_gpu_gb"]["weights"] < 0.1 and r["per_gpu_gb"]["free"] > 120


def test_k2_6_long_context_does_not_fit_and_the_suggestion_does(capsys):
    args = ["--model", "k2_6", "--mesh", "ep=8", "--budget", "64"]  # a context inside the positions (262,079)
    status, r = _plan_json(capsys, *args, "--context", "262000", "--concurrency", "10")
    assert status == 1 and not r["fits"]
    cache = r["per_gpu_gb"]["latent_cache"]
    assert cache == round(61 * 10 * r["cache_slots_per_row"] * 1152 / GB, 2) and 183 < cache < 186
    conc, ctx = r["largest_concurrency"], r["largest_context"]
    assert 1 <= conc < 10 and 1 <= ctx < 262000
    assert _plan_json(capsys, *args, "--context", "262000", "--concurrency", str(conc))[1]["fits"]
    assert not _plan_json(capsys, *args, "--context", "262000", "--concurrency", str(conc + 1))[1]["fits"]
    assert _plan_json(capsys, *args, "--context", str(ctx), "--concurrency", "10")[1]["fits"]
    assert not _plan_json(capsys, *args, "--context", str(ctx + 64), "--concurrency", "10")[1]["fits"]
    assert r["sequence_sharded"]["cache_gb"] == pytest.approx(cache / 8, abs=0.01)

    assert main(["plan", *args, "--context", "262000", "--concurrency", "10"]) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "REPLICATED" in text and 'cache_sharding="sequence"' in text
    assert f"largest concurrency that fits at context 262,000: {conc}" in text


def test_dp_splits_the_cache_rows(capsys):
    base = ["--model", "tiny", "--context", "1000", "--concurrency", "4"]
    one = _plan_json(capsys, *base)[1]
    two = _plan_json(capsys, *base, "--mesh", "dp=2")[1]
    assert one["cache_rows_per_gpu"] == 4 and two["cache_rows_per_gpu"] == 2


def test_a_dp_wider_than_the_search_still_finds_its_concurrency(capsys):
    """With dp past the search's limit of 2**20 rows, the largest concurrency is still searched (one row per dp
    group at least): a tiny model at dp = 2**21 fits 2**21 rows and more, and says so."""
    status, r = _plan_json(capsys, "--model", "tiny", "--context", "64", "--mesh", f"dp={2**21}",
                           "--concurrency", str(2**21))
    assert status == 0 and r["fits"] and r["largest_concurrency"] >= 2**21 and r["largest_concurrency"] % 2**21 == 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "k3_0", "--context", "8"], "not a preset"),
    (["--model", "/no/such/dir", "--context", "8"], "no config.json"),
    (["--model", "tiny", "--mesh", "ep=2,zz=3", "--context", "8"], "dp=N, ep=N, tp=N"),
    (["--model", "tiny", "--mesh", "ep=0", "--context", "8"], "ep must be an integer >= 1"),
    (["--model", "tiny", "--mesh", "ep=3", "--context", "8"], "num_attention_heads (4) is not divisible"),
    (["--model", "k2_6", "--mesh", "ep=5", "--context", "8"], "not divisible by"),
    (["--model", "tiny", "--context", "0"], "--context must be a positive integer"),
    (["--model", "tiny", "--context", "8", "--concurrency", "-1"], "--concurrency must be a positive integer"),
    (["--model", "tiny", "--context", "8", "--budget", "0"], "--budget must be in 1..4096"),
    (["--model", "tiny", "--context", "8", "--budget", "5000"], "--budget must be in 1..4096"),
    (["--model", "tiny", "--context", "8", "--gpu-memory-gb", "-1"], "--gpu-memory-gb must be a positive number"),
])
def test_bad_inputs_are_one_line_errors(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kdtree-jax: error: ") and message in err


def test_checkpoint_directory_config(tmp_path, capsys):
    cfg = kj.configs.tiny()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    status, r = _plan_json(capsys, "--model", str(tmp_path), "--context", "100")
    assert status == 0 and not r["drafter"]
    tiny = _plan_json(capsys, "--model", "tiny", "--context", "100")[1]
    assert r["per_gpu_gb"] == tiny["per_gpu_gb"]


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for option in ("--model", "--mesh", "--context", "--concurrency", "--budget", "--gpu-memory-gb", "--json"):
        assert option in out


def test_hosts(capsys):
    from kdtree_jax.cli import main

    base = ["plan", "--model", "k2_6", "--context", "65536", "--concurrency", "4"]
    assert main([*base, "--mesh", "ep=16", "--hosts", "2"]) == 0
    assert "mesh axes crossing hosts: ep" in capsys.readouterr().out
    assert main([*base, "--mesh", "ep=16", "--hosts", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hosts"] == {"hosts": 2, "gpus_per_host": 8, "crossing": ["ep"]}
    for mesh, hosts, message in (("ep=2,tp=8", "4", "keep tp inside a host"), ("ep=8", "3", "do not split evenly")):
        assert main([*base, "--mesh", mesh, "--hosts", hosts]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_a_context_past_the_models_positions_does_not_fit(capsys):
    """Memory would hold it, but generate refuses a context past the model's positions: the verdict says so."""
    status, r = _plan_json(capsys, "--model", "k2_6", "--mesh", "ep=8", "--context", "300000", "--concurrency", "1",
                           "--budget", "64")
    assert status == 1 and not r["fits"] and r["per_gpu_gb"]["free"] > 0  # memory is not what fails
    assert r["context_limit"] < 300000
    assert main(["plan", "--model", "k2_6", "--mesh", "ep=8", "--context", "300000", "--concurrency", "1",
                 "--budget", "64"]) == 1
    assert "DOES NOT FIT: context 300,000 exceeds the model's limit" in capsys.readouterr().out
    status, r = _plan_json(capsys, "--model", "k2_6", "--mesh", "ep=8", "--context", str(r["context_limit"]),
                           "--concurrency", "1", "--budget", "64")
    assert status == 0 and r["fits"]


@pytest.mark.parametrize("make, mesh", [
    (kj.configs.k2_6, {"ep": 8}),
    (lambda: kj.configs.k2_6(first_k_dense_replace=3), {"dp": 2, "ep": 4, "tp": 2}),
    (kj.configs.tiny, {"ep": 1}),
    (lambda: kj.configs.tiny(first_k_dense_replace=0), {"ep": 4}),  # MoE layers only
    (lambda: kj.configs.tiny(first_k_dense_replace=3), {"ep": 2}),  # dense layers only
    (lambda: kj.configs.tiny(q_lora_rank=None, expert_format="bf16"), {"ep": 4}),
])
def test_closed_form_equals_the_sum_over_every_layer(make, mesh):
    from kdtree_jax import plan
    from kdtree_jax.model import param_info

    cfg = make()
    sizes = plan.check_mesh(cfg, mesh)
    assert plan.model_weight_bytes(cfg, sizes) == plan.weight_bytes(param_info(cfg), sizes, cfg.group_size)


def test_a_million_layers_in_well_under_a_second(tmp_path, capsys):
    """`plan` counts one layer of each kind (dense, MoE), not every layer: 10^6 layers cost what 61 do."""
    (tmp_path / "config.json").write_text(json.dumps({**kj.configs.k2_6().to_dict(), "num_hidden_layers": 10**6}))
    t0 = time.perf_counter()
    status, r = _plan_json(capsys, "--model", str(tmp_path), "--mesh", "ep=8", "--context", "4096")
    assert time.perf_counter() - t0 < 1.0
    k2 = _plan_json(capsys, "--model", "k2_6", "--mesh", "ep=8", "--context", "4096")[1]
    assert status == 1 and r["largest_concurrency"] == r["largest_context"] == 0
    assert r["per_gpu_gb"]["weights"] > 10**6 / 61 * 0.99 * k2["per_gpu_gb"]["weights"]


@pytest.mark.parametrize("name, text", [("config.json", '{"vocab_size": 264,\n'), ("config.json", "[" * 100_000),
                                        ("config.json", "\xff"), ("drafter_config.json", "{oops"),
                                        ("drafter_config.json", "[]")])
def test_malformed_json_names_the_file(tmp_path, capsys, name, text):
    from kdtree_jax.builtin import PACKAGE_DIR

    for f in ("config.json", "drafter_config.json"):
        shutil.copy(PACKAGE_DIR / f, tmp_path / f)
    (tmp_path / name).write_text(text, encoding="latin-1")
    assert main(["plan", "--model", str(tmp_path), "--context", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kdtree-jax: error: {tmp_path / name}: "), err
    assert ("not valid JSON" if text != "[]" else "expected a JSON object") in err[0]


def test_drafter_weights_and_cache_are_split_as_placed():
    """A K2.5-DFlash-shaped drafter on ep=8: its weights split like the target's (all but its norms), so one GPU holds
    just over 1/8 of them; its 8 key/value heads split too, so its context cache per row is 1/8; a drafter of 1
    key/value head keeps that cache whole."""
    import dataclasses

    import jax

    from kdtree_jax import plan
    from kdtree_jax.drafter import init_drafter

    cfg = kj.configs.tiny()
    d8 = dataclasses.replace(jax.eval_shape(lambda: init_drafter(cfg, jax.random.key(0))).cfg, hidden_size=7168,
                             num_heads=64, num_kv_heads=8, head_dim=112, intermediate_size=18432, num_layers=6,
                             target_layer_ids=(1, 2, 3, 4, 5, 6), vocab_size=163840, target_num_layers=61,
                             dtype="bfloat16")
    whole = plan.weight_bytes(plan.drafter_info(d8), {"dp": 1, "ep": 1, "tp": 1}, 32)
    split = plan.weight_bytes(plan.drafter_info(d8), {"dp": 1, "ep": 8, "tp": 1}, 32, fitting=True)
    assert whole / 8 <= split < whole / 7.9
    k2 = kj.configs.k2_6()
    cache = lambda kv, ep: plan.plan(k2, dataclasses.replace(d8, num_kv_heads=kv), {"ep": ep}, 4096, 1, 16,
                                     141 * GB).drafter_cache
    assert cache(8, 1) == 8 * cache(8, 8) and cache(1, 1) == cache(1, 8)


def test_hosts_in_closed_form_match_the_device_array_and_take_no_memory():
    """check_hosts reads the crossing axes from the mesh's sizes: the same as laying the devices out in an array
    (tp innermost, as kj.make_mesh does) for every small mesh, and at once for a mesh of 10**12 GPUs (the array took
    8 bytes a GPU: --mesh dp=1000000000 wanted gigabytes, even with --hosts 1)."""
    import itertools

    import numpy as np

    from kdtree_jax.plan import check_hosts
    from kdtree_jax.sharding import ShardingError

    for dp, ep, tp in itertools.product(range(1, 7), repeat=3):
        devices = dp * ep * tp
        mesh = dict(dp=dp, ep=ep, tp=tp)
        for hosts in (h for h in range(1, devices + 1) if devices % h == 0):
            host = np.arange(devices).reshape(dp, ep, tp) // (devices // hosts)
            crossing = [a for i, a in enumerate(("dp", "ep", "tp")) if np.any(host != np.take(host, [0], axis=i))]
            if "tp" in crossing:
                with pytest.raises(ShardingError, match="keep tp inside a host"):
                    check_hosts(mesh, hosts)
            else:
                assert check_hosts(mesh, hosts)["crossing"] == crossing, (mesh, hosts)
    t0 = time.perf_counter()
    assert check_hosts(dict(dp=10**12, ep=8, tp=1), 2 * 10**12)["crossing"] == ["dp", "ep"]  # 4 GPUs a host
    assert check_hosts(dict(dp=10**12, ep=8, tp=1), 10**11)["crossing"] == ["dp"]  # 80 GPUs a host
    assert check_hosts(dict(dp=10**12, ep=1, tp=1), 1)["crossing"] == []
    assert time.perf_counter() - t0 < 0.1
