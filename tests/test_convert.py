"""kdtree-convert and kdtree_jax.load: every source format against transformers, resuming, sharded loading, errors.

Each source is a tiny random DeepseekV3 model saved by transformers and rewritten by ckpt_formats. Converted
checkpoints are loaded with kdtree_jax.load and their logits compared with transformers' (or, for quantized
sources, with transformers on the weights the quantized checkpoint decodes to).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import kdtree_jax as kj
from kdtree_jax.model import Model
from kdtree_jax.config import ConfigError
from kdtree_converters.convert import FAULT_ENV, convert, main
from kdtree_jax.checkpoint import CheckpointError
from kdtree_jax.quant import Int4Array, unpack_int4
from kdtree_jax.tokenizer import ByteTokenizer, TiktokenTokenizer

import ckpt_formats as cf
from conftest import rel_err
from hf_models import build_hf_model, hf_layer_outputs, save_hf_model

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TOKENS = np.random.default_rng(0).integers(0, 256, size=(2, 24))


def quiet_convert(src, out, **kw):
    return convert(src, out, progress=False, log=lambda msg: None, **kw)


def hf_logits(model_or_dir) -> np.ndarray:
    model = model_or_dir
    if isinstance(model_or_dir, str):
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    return hf_layer_outputs(model, TOKENS)[0]


def logits(m: Model) -> np.ndarray:
    return np.asarray(kj.forward(m.params, m.cfg, TOKENS))


def leaves(m: Model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(m.params)]


def assert_same_params(a: Model, b: Model):
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(leaves(a), leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """(transformers model, its save_pretrained directory, that directory converted with float32 defaults)."""
    root = tmp_path_factory.mktemp("fp32")
    model = build_hf_model("yarn")
    src = save_hf_model(model, str(root / "hf"))
    quiet_convert(src, str(root / "out"), dtype="float32")
    return model, src, str(root / "out")


@pytest.fixture(scope="module")
def int4(tmp_path_factory, fp32):
    """(INT4 compressed-tensors source, its dequantized reference, the source converted with INT4 experts)."""
    root = tmp_path_factory.mktemp("int4")
    src = cf.to_int4(fp32[1], str(root / "hf"), str(root / "ref"))
    quiet_convert(src, str(root / "out"), dtype="float32")
    return src, str(root / "ref"), str(root / "out")


# ---------------------------------------------------------------------------------------------------------------
# Source formats
# ---------------------------------------------------------------------------------------------------------------


def test_fp32_source_matches_transformers(fp32):
    model, src, out = fp32
    m = kj.load(out)
    assert m.cfg == kj.ModelConfig.from_hf(src, dtype="float32", expert_format="bf16")
    assert rel_err(logits(m), hf_logits(model)) <= 1e-5
    assert m.drafter is None and isinstance(m.tokenizer, ByteTokenizer)
    man = m.manifest
    n_tensors = len(load_file(os.path.join(src, "model.safetensors")))
    assert man["source"]["format"] == "float32" and man["source"]["tensors"] == n_tensors
    assert man["source"]["files"] == [{"name": "model.safetensors",
                                       "bytes": os.path.getsize(os.path.join(src, "model.safetensors"))}]
    assert man["skipped"] == {} and man["converted"]["experts"] == "bf16"
    assert sorted(os.listdir(os.path.join(out, "params"))) == ["layer_000", "layer_001", "layer_002", "top"]
    assert not [f for f in os.listdir(os.path.dirname(out)) if f.endswith(".partial")]


def test_bf16_source_is_copied_bit_exactly(fp32, tmp_path):
    model = build_hf_model("yarn").to(torch.bfloat16)
    src = save_hf_model(model, str(tmp_path / "hf"))
    quiet_convert(src, str(tmp_path / "out"))  # default: dtype bfloat16, experts as the source (bf16)
    m = kj.load(str(tmp_path / "out"))
    assert (m.cfg.dtype, m.cfg.expert_format) == ("bfloat16", "bf16")
    t = load_file(os.path.join(src, "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(m.params.embed), t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(m.params.lm_head), t["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.params.moe_layers[1].mlp.we_down[5]),
                                  t["model.layers.2.mlp.experts.5.down_proj.weight"])
    # bf16 activations against transformers in fp32 on the same bf16 weights
    assert rel_err(logits(m), hf_logits(model.to(torch.float32))) <= 3e-2


def test_convert_with_an_orbax_without_the_deep_copy_switch(monkeypatch, tmp_path):
    """orbax-checkpoint 0.12.4 (the GPU machine's, 2026-12-06) has no NumpyHandler(deepcopy_host_arrays=...): the
    converter then uses the plain handler (it failed with a TypeError before) and writes the same arrays."""
    from orbax.checkpoint import type_handlers

    from kdtree_jax import checkpoint

    class OldNumpyHandler(type_handlers.NumpyHandler):
        def __init__(self, metadata_key=None, ocdbt_process_id=None):  # 0.12.4's signature
            super().__init__(metadata_key=metadata_key, ocdbt_process_id=ocdbt_process_id)

    monkeypatch.setattr(checkpoint.type_handlers, "NumpyHandler", OldNumpyHandler)
    assert type(checkpoint._numpy_handler()) is OldNumpyHandler
    model = build_hf_model("yarn").to(torch.bfloat16)
    src = save_hf_model(model, str(tmp_path / "hf"))
    quiet_convert(src, str(tmp_path / "out"))
    m = kj.load(str(tmp_path / "out"))
    t = load_file(os.path.join(src, "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(m.params.embed), t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(m.params.moe_layers[1].mlp.we_down[5]),
                                  t["model.layers.2.mlp.experts.5.down_proj.weight"])


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])  # K2's blocks; small ones split both dimensions
def test_fp8_source_matches_dequantized_transformers(fp32, tmp_path, block):
    src = cf.to_fp8(fp32[1], str(tmp_path / "hf"), str(tmp_path / "ref"), block)
    assert any(v.dtype == torch.float8_e4m3fn for v in cf.read(src)[0].values())
    quiet_convert(src, str(tmp_path / "out"), dtype="float32")
    m = kj.load(str(tmp_path / "out"))
    assert m.manifest["source"]["format"] == "fp8 block-scaled" and m.manifest["skipped"] == {}
    ref = hf_logits(str(tmp_path / "ref"))
    assert rel_err(logits(m), ref) <= 1e-5
    assert rel_err(ref, hf_logits(fp32[0])) > 1e-3  # the reference really is the quantized model


def test_int4_source_repacked_bit_exactly(int4):
    src, ref, out = int4
    m = kj.load(out)
    assert m.cfg.expert_format == "int4" and m.manifest["source"]["format"] == "int4 compressed-tensors"
    t = load_file(os.path.join(src, "model.safetensors"))
    for j, layer in enumerate(range(1, 3)):
        for proj in ("gate", "up", "down"):
            w = getattr(m.params.moe_layers[j].mlp, f"we_{proj}")
            assert isinstance(w, Int4Array)
            for e in (0, 7, 15):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
                np.testing.assert_array_equal(np.asarray(w.packed[e]), t[f"{name}.weight_packed"])
                np.testing.assert_array_equal(np.asarray(w.scale[e]).view(np.uint16),
                                              t[f"{name}.weight_scale"].view(np.uint16))
    assert int(np.asarray(unpack_int4(m.params.moe_layers[0].mlp.we_up.packed[0]))[0, 0]) == -8
    assert rel_err(logits(m), hf_logits(ref)) <= 1e-5


def test_int4_source_dequantized_experts(int4, tmp_path):
    src, ref, out = int4
    quiet_convert(src, str(tmp_path / "out"), dtype="float32", experts="bf16")
    deq, packed = kj.load(str(tmp_path / "out")), kj.load(out)
    assert deq.cfg.expert_format == "bf16"
    r = load_file(os.path.join(ref, "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(deq.params.moe_layers[1].mlp.we_gate[3]),
                                  r["model.layers.2.mlp.experts.3.gate_proj.weight"])
    for a, b in zip(packed.params.moe_layers, deq.params.moe_layers):
        np.testing.assert_array_equal(np.asarray(a.mlp.we_gate.dequantize()), np.asarray(b.mlp.we_gate))
    assert rel_err(logits(packed), logits(deq)) <= 1e-6


def test_float_source_quantized_to_int4(fp32, tmp_path):
    quiet_convert(fp32[1], str(tmp_path / "out"), dtype="float32", experts="int4")
    m = kj.load(str(tmp_path / "out"))
    assert isinstance(m.params.moe_layers[0].mlp.we_down, Int4Array)
    err = rel_err(logits(m), hf_logits(fp32[0]))
    assert 1e-4 < err <= 0.2  # lossy, but close


def test_language_model_wrapper_and_tokenizer(int4, tmp_path):
    src = cf.wrap_language_model(int4[0], str(tmp_path / "hf"))
    tok = cf.write_tokenizer(src)
    quiet_convert(src, str(tmp_path / "out"), dtype="float32")
    m = kj.load(str(tmp_path / "out"))
    assert_same_params(m, kj.load(int4[2]))
    skipped = m.manifest["skipped"]
    assert {k: skipped.pop(k) for k in cf.VISION_TENSORS} == dict.fromkeys(cf.VISION_TENSORS,
                                                                           "not part of the language model")
    assert skipped == {"language_model.model.layers.0.self_attn.rotary_emb.inv_freq":
                       "stale rotary_emb.inv_freq buffer"}
    assert m.manifest["source"]["prefix"] == "language_model."
    assert m.manifest["tokenizer_files"] == ["tiktoken.model", "tokenizer_config.json"]
    assert os.path.exists(str(tmp_path / "out" / "tiktoken.model"))
    check_tokenizer(m.tokenizer, tok)


def check_tokenizer(t, tok):
    assert isinstance(t, TiktokenTokenizer)
    nb = tok["num_base"]
    assert (t.num_base, t.bos_id, t.eos_id, t.pad_id, t.vocab_size) == (nb, nb, nb + 1, nb + 257, nb + 258)
    assert t.special_tokens["<|im_end|>"] == nb + 2 and t.special_tokens[f"<|reserved_token_{nb + 5}|>"] == nb + 5
    for text in ("hello world", "Hello, 世界! naïve café 🙂\n\n  tabs\tand  spaces", ""):
        assert t.decode(t.encode(text)) == text
    # merges apply inside a pre-token; Kimi's pattern attaches the space to the next word, so "o " never merges
    merges = tok["merges"]
    assert t.encode("hello world") == [merges[b"hello"], merges[b" world"]]
    assert t.encode("ab世界") == [ord("a"), ord("b"), merges["世界".encode()]]
    assert t.encode("[BOS]hello<|im_end|>") == [nb, merges[b"hello"], nb + 2]
    assert t.encode("[BOS]", allow_special=False) == list(b"[BOS]")


def test_sharded_index(fp32, tmp_path):
    src = cf.shard(fp32[1], str(tmp_path / "hf"), 3)
    quiet_convert(src, str(tmp_path / "out"), dtype="float32")
    m = kj.load(str(tmp_path / "out"))
    assert [f["name"] for f in m.manifest["source"]["files"]] == [
        f"model-0000{k}-of-000003.safetensors" for k in (1, 2, 3)]
    assert_same_params(m, kj.load(fp32[2]))


# ---------------------------------------------------------------------------------------------------------------
# Resuming, sharded loading, the command line
# ---------------------------------------------------------------------------------------------------------------


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kdtree_converters.convert", *args], check=False, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)


def test_argparse_errors_are_one_line():
    """kdtree-convert's flag errors printed argparse's usage block before the error (5 lines); every other error of
    it, and kdtree-jax's, is one line."""
    for args, message in [(("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
                          ((), "the following arguments are required")]:
        r = run_cli(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("kdtree-convert: error: ") and message in r.stderr, r.stderr


def test_killed_conversion_resumes_identically(fp32, tmp_path):
    _, src, reference = fp32
    out = str(tmp_path / "out")
    partial = str(tmp_path / ".out.partial")
    killed = run_cli(src, out, "--dtype", "float32", env={FAULT_ENV: "written:2=KILL"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not os.path.exists(out)
    # items 1 and 2 were written, the second one not recorded: the rerun redoes it and the rest
    with open(os.path.join(partial, "progress.json")) as f:
        assert sorted(json.load(f)) == ["top"]
    assert sorted(os.listdir(os.path.join(partial, "params"))) == ["layer_000", "top"]
    resumed = run_cli(src, out, "--dtype", "float32")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr and not os.path.exists(partial)
    for name in ("config.json", "manifest.json"):
        assert read_text(os.path.join(out, name)) == read_text(os.path.join(reference, name))
    assert_same_params(kj.load(out), kj.load(reference))


def test_load_onto_mesh(int4):
    mesh = kj.make_mesh(tp=1, ep=4, dp=2)  # tp=2 cannot split the tiny experts' single scale group
    m, ref = kj.load(int4[2], mesh=mesh), kj.load(int4[2])
    from kdtree_jax.model import param_shardings

    want = param_shardings(m.cfg, mesh)
    for a, s in zip(jax.tree.leaves(m.params), jax.tree.leaves(want)):
        assert a.sharding.is_equivalent_to(s, a.ndim), (a.shape, a.sharding, s)
    expert = m.params.moe_layers[0].mlp.we_gate  # [E, F, D/8] and [E, F, D/32], E over ep
    assert {tuple(sh.data.shape) for sh in expert.packed.addressable_shards} == {(4, 32, 8)}
    assert {tuple(sh.data.shape) for sh in expert.scale.addressable_shards} == {(4, 32, 2)}
    assert_same_params(m, ref)
    sharded = kj.load(int4[2], mesh=mesh, verify=False)  # unchecked on a mesh: each device reads its own shard
    for a, s in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(want)):
        assert a.sharding.is_equivalent_to(s, a.ndim), (a.shape, a.sharding, s)
    assert_same_params(sharded, ref)


def test_unchecked_load_on_one_device_reads_through_the_host(int4):
    """verify=False on one device reads each part to the host (the checked load's reader, its checksums left out):
    the same arrays as the checked load, each on the default device."""
    checked, unchecked = kj.load(int4[2]), kj.load(int4[2], verify=False)
    assert_same_params(unchecked, checked)
    assert {d for a in jax.tree.leaves(unchecked.params) for d in a.devices()} == {jax.devices()[0]}


def test_load_checks_every_array(fp32, tmp_path):
    with pytest.raises(CheckpointError, match="not a kdtree-jax checkpoint"):
        kj.load(fp32[1])
    out = tmp_path / "out"
    shutil.copytree(fp32[2], out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "kv_lora_rank": 48}))
    # attn.qkv_a is [D, Rq + R + dr] = [64, 48 + 32 + 16]; the config now says R = 48
    with pytest.raises(CheckpointError, match=r"layer_000: array 'attn\.qkv_a' has shape \(64, 96\) float32, "
                                              r"expected \(64, 112\) float32"):
        kj.load(str(out))
    (out / "config.json").write_text(json.dumps(cfg))
    manifest = json.loads((out / "manifest.json").read_text())
    for version, what in ((1, "separate weights"), (2, "attn.q_b and attn.v_b with their input axis first")):
        (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": version}))
        pattern = f"older kdtree-convert \\(format {version}: [^)]*{re.escape(what)}\\); convert the Hugging Face"
        with pytest.raises(CheckpointError, match=pattern):
            kj.load(str(out))
    (out / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(out / "params" / "layer_002")
    with pytest.raises(CheckpointError, match="layer_002: item .* is missing"):
        kj.load(str(out))


def test_dry_run_writes_nothing(int4, tmp_path):
    out = str(tmp_path / "out")
    plan = quiet_convert(int4[0], out, dry_run=True)
    assert plan["converted"]["items"] == ["top", "layer_000", "layer_001", "layer_002"]
    assert plan["converted"]["experts"] == "int4" and plan["source"]["largest_item_bytes"] > 0
    assert os.listdir(tmp_path) == []
    assert main([int4[0], out, "--dry-run"]) == 0 and os.listdir(tmp_path) == []


def test_multi_token_prediction_layer_skipped(fp32, tmp_path):
    src = cf.add_mtp_layer(fp32[1], str(tmp_path / "hf"))
    plan = quiet_convert(src, str(tmp_path / "out"), dry_run=True)
    assert len(plan["skipped"]) == 4 + sum(k.startswith("model.layers.2.") for k in cf.read(fp32[1])[0])
    assert set(plan["skipped"].values()) == {"multi-token-prediction layer"}
    assert all(k.startswith("model.layers.3.") for k in plan["skipped"])


def test_cli_help_and_drafter(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("SRC_DIR", "OUT_DIR", "--drafter", "--experts", "--dtype", "--dry-run", "--overwrite"):
        assert flag in text
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--drafter", str(tmp_path / "c")]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_overwrite(fp32, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(fp32[2], out)
    with pytest.raises(CheckpointError, match="already exists.*--overwrite"):
        quiet_convert(fp32[1], out)
    assert main([fp32[1], out]) == 1
    quiet_convert(fp32[1], out, overwrite=True)  # float32 -> bfloat16 in place of the old one
    assert kj.load(out).cfg.dtype == "bfloat16" and sorted(os.listdir(tmp_path)) == ["out"]
    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        quiet_convert(fp32[1], str(other), overwrite=True)
    assert (other / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs: a clear error, and nothing in OUT_DIR (nor a partial directory) afterwards
# ---------------------------------------------------------------------------------------------------------------


def _edit_tensors(fn):
    def edit(src, dst):
        tensors, config = cf.read(src)
        fn(tensors)
        cf.write(dst, tensors, config)
    return edit


def _edit_config(fn):
    def edit(src, dst):
        tensors, config = cf.read(src)
        fn(config)
        cf.write(dst, tensors, config)
    return edit


def _corrupt_header(src, dst):
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "model.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"{garbage")


def _drop_all(suffix):
    def fn(tensors):
        for k in [k for k in tensors if k.endswith(suffix)]:
            del tensors[k]
    return fn


def _poison(tensors):
    w = tensors["model.layers.2.mlp.experts.3.up_proj.weight"].view(-1)
    w[5], w[9], w[11] = float("nan"), float("inf"), -float("inf")


BAD_INPUTS = {
    "missing_in_one_layer": (
        _edit_tensors(lambda t: t.pop("model.layers.2.self_attn.kv_a_layernorm.weight")), CheckpointError,
        r"missing tensor 'model\.layers\.2\.self_attn\.kv_a_layernorm\.weight'"),
    "missing_everywhere": (
        _edit_tensors(_drop_all("q_a_layernorm.weight")), CheckpointError,
        r"missing tensor 'model\.layers\.0\.self_attn\.q_a_layernorm\.weight'"),
    "shape_in_one_layer": (
        _edit_tensors(lambda t: t.update({"model.layers.1.input_layernorm.weight": torch.ones(65)})),
        CheckpointError, r"'model\.layers\.1\.input_layernorm\.weight' has shape \[65\], expected \[64\]"),
    "shape": (
        _edit_tensors(lambda t: t.update({"model.norm.weight": torch.ones(65)})), CheckpointError,
        r"'model\.norm\.weight' has shape \[65\], expected \[64\]"),
    "corrupt_header": (_corrupt_header, CheckpointError, "corrupt safetensors header"),
    "non_finite": (
        _edit_tensors(_poison), CheckpointError,
        r"'model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight' \(model\.safetensors\) has 3 non-finite value"),
    "no_router_bias": (
        _edit_tensors(_drop_all("e_score_correction_bias")), CheckpointError,
        r"missing tensor 'model\.layers\.1\.mlp\.gate\.e_score_correction_bias' \(config.json routes with "
        r"topk_method noaux_tc"),
    "unknown_quantization": (
        _edit_config(lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4})), CheckpointError,
        "unknown quantization method 'awq'"),
    "config_layers": (_edit_config(lambda c: c.update(num_hidden_layers=2)), ConfigError,
                      r"beyond config.json's num_hidden_layers=2"),
    "config_experts": (_edit_config(lambda c: c.update(n_routed_experts=8, num_experts_per_tok=2)), ConfigError,
                       r"n_routed_experts=8 .* layer 1 has routed experts 0\.\.15"),
    "config_shapes": (_edit_config(lambda c: c.update(q_lora_rank=40)), CheckpointError,
                      r"'model\.layers\.0\.self_attn\.q_a_proj\.weight' has shape \(48, 64\), expected \(40, 64\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input(case, fp32, tmp_path):
    make, error, pattern = BAD_INPUTS[case]
    make(fp32[1], str(tmp_path / "hf"))
    out = tmp_path / "out"
    with pytest.raises(error, match=pattern):
        quiet_convert(str(tmp_path / "hf"), str(out))
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_nonfinite_values_are_counted_across_chunks(monkeypatch):
    """Arrays larger than the chunk the NaN / inf check walks in: finite ones pass, and each bad value is counted
    once (a real K2 tensor spans hundreds of chunks)."""
    import kdtree_converters.convert as c

    monkeypatch.setattr(c, "NONFINITE_CHUNK", 1000)
    a = np.random.default_rng(0).standard_normal(10_500).astype(np.float32)
    assert c.count_nonfinite(a) == 0
    a[[3, 2500, 10_499]] = [np.nan, np.inf, -np.inf]
    assert c.count_nonfinite(a) == 3
    assert c.count_nonfinite(np.arange(5000, dtype=np.int32)) == 0


@pytest.mark.parametrize("flags, named", [(["--overwrite"], "--overwrite shapes"),
                                          (["--dtype", "bfloat16", "--dry-run"], "--dtype, --dry-run shape"),
                                          (["--drafter", "d", "--experts", "int4"], "--drafter, --experts shape")])
def test_verify_refuses_conversion_flags(flags, named, capsys, tmp_path):
    """--verify checks a checkpoint as it is: flags of a conversion would be ignored, so they are refused."""
    with pytest.raises(SystemExit) as e:
        main(["--verify", str(tmp_path), *flags])
    assert e.value.code == 2
    assert f"--verify CKPT checks a checkpoint as it is; {named} a conversion" in capsys.readouterr().err


@pytest.mark.parametrize("argv, name", [(["--verify", ""], "--verify"), (["", "out"], "SRC_DIR"),
                                        (["src", " "], "OUT_DIR"), (["src", "out", "--drafter", ""], "--drafter")])
def test_empty_paths_are_usage_errors(argv, name, capsys):
    """An empty path is not the working directory (whose name the error named: '/cwd is not a kdtree-jax
    checkpoint', 'no config.json in /cwd')."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and f"{name}: expected a directory, got " in capsys.readouterr().err


def _raw_safetensors(path, header_text: str, data: bytes) -> str:
    """A safetensors file of exactly this header text (padded to 8 bytes) and data section."""
    head = header_text.encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + data)
    return str(path)


@pytest.mark.parametrize("header, named", [
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.5, 8.5]}}', "corrupt safetensors header entry for 'a'"),
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}', "corrupt safetensors header entry for 'a'"),
    ('{"a": {"dtype": "F32", "shape": [2.9], "data_offsets": [0, 8]}}', "corrupt safetensors header entry for 'a'"),
    ('{"a": {"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}}', "corrupt safetensors header entry for 'a'"),
    ('{"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}', "corrupt safetensors header entry for 'a'"),
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
     '"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}', "tensors 'a' and 'b' overlap"),
    ('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
     '"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', "key 'a' appears twice"),
])
def test_safetensors_header_of_odd_values_is_refused(header, named, tmp_path):
    """Header values safetensors writes as integers are not truncated, no two tensors share bytes, and a name given
    twice is not resolved silently to its last entry (issue 46, eighth probe round)."""
    from kdtree_converters.convert import read_header
    path = _raw_safetensors(tmp_path / "x.safetensors", header, bytes(16))
    with pytest.raises(CheckpointError, match=re.escape(named)) as e:
        read_header(path)
    assert str(e.value).startswith(path)


def test_safetensors_header_of_adjacent_tensors_is_read(tmp_path):
    from kdtree_converters.convert import read_header
    path = _raw_safetensors(tmp_path / "x.safetensors", '{"__metadata__": {"format": "pt"}, '
                            '"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                            '"b": {"dtype": "I8", "shape": [0], "data_offsets": [8, 8]}, '
                            '"c": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', bytes(16))
    t = read_header(path)
    assert [(k, v.shape, v.nbytes) for k, v in t.items()] == [("a", (2,), 8), ("b", (0,), 0), ("c", (2,), 8)]


def _quantized_edit(quantize, fn):
    """An edit that quantizes the source (quantize(src, out, reference)), applies fn to its tensors and writes the
    result to dst."""
    def edit(src, dst):
        quantize(src, dst + ".q", dst + ".ref")
        tensors, config = cf.read(dst + ".q")
        fn(tensors)
        cf.write(dst, tensors, config)
        shutil.rmtree(dst + ".q")
        shutil.rmtree(dst + ".ref")
    return edit


def _fp8_edit(fn):
    return _quantized_edit(lambda src, out, ref: cf.to_fp8(src, out, ref, block=(16, 32)), fn)


def _int4_edit(fn):
    return _quantized_edit(cf.to_int4, fn)


_E, _Q = "model.layers.1.mlp.experts.3.up_proj", "model.layers.0.self_attn.q_a_proj.weight"
BAD_DTYPES = {  # name -> (edit, the start of the error); each caught from the headers, so by --dry-run too
    "int8_expert": (_edit_tensors(lambda t: t.update({f"{_E}.weight": t[f"{_E}.weight"].to(torch.int8)})),
                    f"tensor '{_E}.weight' (model.safetensors) is int8, expected a float dtype"),
    "bool_norm": (_edit_tensors(lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.bool)})),
                  "tensor 'model.norm.weight' (model.safetensors) is bool, expected a float dtype"),
    "fp8_without_scale": (_fp8_edit(lambda t: t.pop(f"{_Q}_scale_inv")),
                          f"FP8 tensor '{_Q}' (model.safetensors) has no '{_Q}_scale_inv'"),
    "e5m2_without_scale": (_edit_tensors(lambda t: t.update({_Q: t[_Q].to(torch.float8_e5m2)})),
                           f"FP8 tensor '{_Q}' (model.safetensors) has no '{_Q}_scale_inv'"),
    "integer_fp8_scale": (_fp8_edit(lambda t: t.update({f"{_Q}_scale_inv": t[f"{_Q}_scale_inv"].to(torch.int32)})),
                          f"tensor '{_Q}_scale_inv' (model.safetensors) is int32, expected a float scale"),
    "float_int4_packed": (_int4_edit(lambda t: t.update({f"{_E}.weight_packed": t[f"{_E}.weight_packed"].view(
        torch.float32)})), f"tensor '{_E}.weight_packed' (model.safetensors) is float32, expected I32"),
    "float_int4_shape": (_int4_edit(lambda t: t.update({f"{_E}.weight_shape": t[f"{_E}.weight_shape"].float()})),
                         f"tensor '{_E}.weight_shape' (model.safetensors) is float32, expected integer"),
}


@pytest.mark.parametrize("case", sorted(BAD_DTYPES))
def test_tensor_of_the_wrong_dtype_is_refused_by_dry_run_and_conversion(case, fp32, tmp_path):
    """An integer weight was cast to float as if it held values, an FP8 weight without its scale passed --dry-run
    (issue 46, eighth probe round)."""
    make, message = BAD_DTYPES[case]
    make(fp32[1], str(tmp_path / "hf"))
    for dry_run in (True, False):
        with pytest.raises(CheckpointError, match=re.escape(message)):
            quiet_convert(str(tmp_path / "hf"), str(tmp_path / "out"), dry_run=dry_run)
        assert sorted(os.listdir(tmp_path)) == ["hf"]


def _int4_scheme(group_size) -> dict:
    q = json.loads(json.dumps(cf.INT4_QUANTIZATION))
    q["config_groups"]["group_0"]["weights"]["group_size"] = group_size
    return q


@pytest.mark.parametrize("q, named", [
    (_int4_scheme("32"), "group_size '32' is not a positive integer"),
    (_int4_scheme(32.5), "group_size 32.5 is not a positive integer"),
    (_int4_scheme(-32), "group_size -32 is not a positive integer"),
    ({**cf.FP8_QUANTIZATION, "weight_block_size": [0, 128]}, "weight_block_size [0, 128]"),
    ({**cf.FP8_QUANTIZATION, "weight_block_size": [128.5, 128]}, "weight_block_size [128.5, 128]"),
    ({**cf.FP8_QUANTIZATION, "weight_block_size": 128}, "weight_block_size 128"),
])
def test_quantization_config_of_odd_sizes_is_refused(q, named):
    """A group size or FP8 block that is a string, a fraction or not positive was cast by int(), truncated, or left
    to fail later on a scale's shape (issue 46, eighth probe round)."""
    from kdtree_converters.convert import parse_quantization
    with pytest.raises(CheckpointError, match=re.escape(named)):
        parse_quantization(q)
    assert parse_quantization(_int4_scheme(32)).group_size == 32


def test_fp8_scale_that_overflows_float32_is_refused(fp32, tmp_path):
    """Finite FP8 values times a finite but huge weight_scale_inv are inf in float32: they were written as inf, with
    numpy's RuntimeWarning the only sign (issue 46, eighth probe round)."""
    def huge(t):
        t[f"{_Q}_scale_inv"].view(-1)[0] = 3e38
    _fp8_edit(huge)(fp32[1], str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=re.escape(f"FP8 tensor '{_Q}' dequantizes to ")):
        quiet_convert(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("field", ["bos_token_id", "eos_token_id"])
def test_special_token_outside_the_vocabulary_is_refused_before_converting(field, fp32, tmp_path):
    """config.json's bos or eos id past vocab_size (264) was converted into a checkpoint kj.load then refused (issue 46,
    eighth probe round)."""
    _edit_config(lambda c: c.update({field: 264}))(fp32[1], str(tmp_path / "hf"))
    for dry_run in (True, False):
        message = f"config.json: {field} 264 is outside the vocabulary [0, 264)"
        with pytest.raises(ConfigError, match=re.escape(message)):
            quiet_convert(str(tmp_path / "hf"), str(tmp_path / "out"), dry_run=dry_run)
        assert sorted(os.listdir(tmp_path)) == ["hf"]


HEADER_SHAPES = {  # caught from the headers (--dry-run called these consistent; the conversion failed later)
    "scalar_norm": (_edit_tensors(lambda t: t.update({"model.norm.weight": torch.tensor(1.0)})),
                    "tensor 'model.norm.weight' has shape [], expected [64]"),
    "no_lm_head": (_edit_tensors(lambda t: t.pop("lm_head.weight")), "missing tensor 'lm_head.weight'"),
    "fp8_scale_of_another_block": (
        _fp8_edit(lambda t: t.update({f"{_Q}_scale_inv": torch.ones(1, 1)})),
        f"tensor '{_Q}_scale_inv' has shape [1, 1], expected [3, 2] (blocks of 16x32 over [48, 64]"),
    "fp8_norm": (_fp8_edit(lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float8_e4m3fn),
                                               "model.norm.weight_scale_inv": torch.ones(1)})),
                 "FP8 tensor 'model.norm.weight' has shape [64]: only 2-D weights are block-scaled"),
    "int4_packed_attention": (
        _int4_edit(lambda t: t.update({_Q.replace(".weight", ".weight_packed"): torch.zeros(48, 8, dtype=torch.int32)})
                   or t.pop(_Q)),
        "tensor 'model.layers.0.self_attn.q_a_proj.weight_packed' is INT4-packed, but only routed experts may be"),
}


@pytest.mark.parametrize("case", sorted(HEADER_SHAPES))
def test_dry_run_checks_the_top_tensors_fp8_scales_and_int4_placement(case, fp32, tmp_path):
    """The final norm's and lm_head's shapes, each FP8 scale's block shape and which tensors may be INT4-packed are
    known from the headers: --dry-run called these sources consistent (issue 46, eighth probe round)."""
    make, message = HEADER_SHAPES[case]
    make(fp32[1], str(tmp_path / "hf"))
    for dry_run in (True, False):
        with pytest.raises(CheckpointError, match=re.escape(message)):
            quiet_convert(str(tmp_path / "hf"), str(tmp_path / "out"), dry_run=dry_run)
        assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_names_with_and_without_the_language_model_prefix_are_refused(fp32, tmp_path):
    """A source whose layer 2 alone carries `language_model.` was reported as missing the (present, unprefixed)
    embedding (issue 46, eighth probe round)."""
    def mix(t):
        for k in [k for k in t if k.startswith("model.layers.2.")]:
            t[f"language_model.{k}"] = t.pop(k)
    _edit_tensors(mix)(fp32[1], str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=re.escape("mix names with the 'language_model.' prefix and "
                                                        "language-model names without it (")):
        quiet_convert(str(tmp_path / "hf"), str(tmp_path / "out"), dry_run=True)
