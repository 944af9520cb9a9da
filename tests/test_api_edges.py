"""The API's edges (docs/reliability.md): `forward` checks its ids as `generate` does; every argument of `generate`,
`stream` and `forward` is type- and range-checked by the rules of `kdtree_jax.validate`, the same the server and the
command line apply; params that do not match a cfg are refused, naming the array, its shape and the config field."""

import dataclasses
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax as kj
from kdtree_jax import validate
from kdtree_jax.generate import check_params, seed_key, stream


@pytest.fixture(scope="module")
def tiny():
    cfg = kj.configs.tiny()
    return cfg, kj.init_params(cfg, jax.random.key(0)), kj.init_drafter(cfg, jax.random.key(1), num_layers=1,
                                                                          block_size=4)


@pytest.mark.parametrize("tokens, error, match", [
    ([[1, 2, 999]], ValueError, "token id 999 outside the vocabulary"),
    ([[1, -1]], ValueError, "token id -1 outside the vocabulary"),
    ([[]], ValueError, "row 0 must be a non-empty"),
    ([], ValueError, "non-empty list"),
    (np.zeros((1, 0), np.int32), ValueError, "non-empty"),
    ([[1.5, 2.0]], TypeError, "integer token ids"),
    ([[1, 2], [3]], ValueError, "rows of one length"),
    ([[1, 2**70]], ValueError, "token id 1180591620717411303424 outside the vocabulary"),  # was "got dtype object"
    ([[1, 2**64 - 1]], ValueError, "token id 18446744073709551615 outside the vocabulary"),  # "got dtype float64"
    ([1, 2, 3], ValueError, "wrap a single row in"),
    (np.zeros((2, 3, 4), np.int32), ValueError, r"\[B, T\]"),
    ([[1, True, 3]], TypeError, "row 0 holds booleans"),  # numpy made the bool an id 1
    ([bytearray(b"abc")], ValueError, "row 0 is bytes, not token ids"),  # bytearray and memoryview were taken as ids
    ([memoryview(b"abc")], ValueError, "row 0 is bytes, not token ids"),
    ([[1] * 2049], ValueError, "2049 positions exceed the model's context of 2048"),  # logits past the context
])
def test_forward_checks_its_ids_as_generate_does(tiny, tokens, error, match):
    cfg, params, _ = tiny
    with pytest.raises(error, match=match):
        kj.forward(params, cfg, tokens)


def test_forward_accepts_what_it_did(tiny):
    """Lists, numpy and jax arrays of any integer dtype give the same logits; inside jit the ids are traced."""
    cfg, params, _ = tiny
    ref = kj.forward(params, cfg, [[1, 2, 3]])
    assert ref.shape == (1, 3, cfg.vocab_size)
    for tokens in (np.array([[1, 2, 3]], np.int64), jax.numpy.array([[1, 2, 3]], jax.numpy.int32)):
        np.testing.assert_array_equal(kj.forward(params, cfg, tokens), ref)
    np.testing.assert_allclose(jax.jit(lambda t: kj.forward(params, cfg, t))(np.array([[1, 2, 3]])), ref, rtol=1e-6)
    logits, hidden = kj.forward(params, cfg, [[1, 2, 3]], return_hidden=True)
    assert hidden.shape[:3] == (cfg.num_hidden_layers, 1, 3)
    with pytest.raises(ValueError, match="return_hidden must be true or false"):
        kj.forward(params, cfg, [[1, 2, 3]], return_hidden="yes")


BAD_ARGUMENTS = [
    (dict(eos_id=4.7), "eos_id must be None or an integer token id, got 4.7"),
    (dict(eos_id=True), "eos_id must be None or an integer"),
    (dict(eos_id=10**6), "eos_id 1000000 is outside the vocabulary"),
    (dict(max_new_tokens=4.0), r"max_new_tokens must be an integer in \[1, 2\*\*31\), got 4.0"),
    (dict(max_new_tokens=2**40), r"max_new_tokens must be an integer in \[1, 2\*\*31\)"),
    (dict(seed=2**70), r"seed must be an integer in \[0, 2\*\*63\), got 1180591620717411303424"),
    (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*63\)"),
    (dict(seed=1.0), r"seed must be an integer in \[0, 2\*\*63\)"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="0.7"), "temperature must be a finite number"),
    (dict(temperature=1.0, top_k=2**31), r"top_k must be None or an integer in \[1, 2\*\*31\)"),
    (dict(temperature=1.0, top_k=40.0), "top_k must be None or an integer"),
    (dict(temperature=1.0, top_p=1e-40), "below float32's normal range"),
    (dict(temperature=1.0, top_p=True), r"top_p must be None or a number in \(0, 1\]"),
    (dict(prefill_chunk=16.0), "prefill_chunk must be"),
    (dict(method="ddtree", budget=4.5), "budget must be an integer"),
    (dict(method="ddtree", budget="auto", max_budget=8.0), "max_budget must be an integer"),
    # (sixth probe round: the tree that does not fit is max_budget's, and the message said "budget")
    (dict(method="ddtree", budget="auto", max_budget=10**6), r"max_budget \(budget='auto'\): budget 1000000 exceeds"),
    # arguments the method does not use are still checked, not silently ignored
    (dict(method="ar", budget="x"), "budget must be an integer >= 1, got 'x'"),
    (dict(method="ar", budget=-5), "budget must be an integer >= 1, got -5"),
    (dict(method="ar", max_budget=-1), "max_budget must be an integer >= 1, got -1"),
    (dict(method="ar", tiers="garbage"), "tiers: for budget='auto' alone"),
    (dict(method="ddtree", budget=8, tiers=(4, 8)), r"tiers: for budget='auto' alone \(budget=8 would ignore"),
    (dict(method="chain", cost_model=12), "cost_model: for budget='auto' alone"),
]


@pytest.mark.parametrize("kwargs, match", BAD_ARGUMENTS)
def test_generate_and_stream_check_every_argument(tiny, kwargs, match):
    cfg, params, drafter = tiny
    args = {"max_new_tokens": 4, "drafter": drafter, **kwargs}
    with pytest.raises(ValueError, match=match):
        kj.generate(params, cfg, [[1, 2, 3]], **args)
    with pytest.raises(ValueError, match=match):
        next(stream(params, cfg, [1, 2, 3], **args))


def test_zero_d_arrays_and_numpy_scalars_are_the_numbers_they_hold(tiny):
    """A jax or numpy 0-d array passes as its value (it was refused with 'got Array(0.5, dtype=float32)'), and a
    float16 is compared without a cast warning."""
    cfg, params, _ = tiny
    want = kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=3, temperature=0.5, top_k=4, seed=7).tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (jnp.float32(0.5), np.float16(0.5), np.asarray(0.5)):
            got = kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=jnp.int32(3), temperature=t,
                              top_k=jnp.asarray(4), seed=np.asarray(7)).tokens
            assert got == want, (t, got, want)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got True"):
        kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=3, temperature=jnp.bool_(True))
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=jnp.float32(3.0))


def test_stream_checks_every(tiny):
    """`every` is a step count, int32 on the device: past it (2**40) was JAX's OverflowError naming no argument; at
    its largest the bound of steps to run to stays in int32 (steps + every used to wrap to a negative bound, and the
    stream would have asked for no step again and again)."""
    cfg, params, _ = tiny
    for every in (0, 2.0, True, 2**31, 2**40):
        with pytest.raises(ValueError, match=r"every must be an integer in \[1, 2\*\*31\)"):
            next(stream(params, cfg, [1, 2, 3], max_new_tokens=4, every=every))
    want = kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=4).tokens[0]
    assert sum(stream(params, cfg, [1, 2, 3], max_new_tokens=4, every=2**31 - 1), []) == want


def test_every_seed_below_2_63_has_its_own_key(tiny):
    """jax.random.key keeps 32 bits without x64: seeds 2**32 apart used to draw the same tokens. Seeds below 2**32
    keep the keys (and tokens) they had."""
    cfg, params, _ = tiny
    drawn = {str(kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=8, temperature=1.0, seed=s).tokens)
             for s in (0, 2**32, 2**40, 2**63 - 1)}
    assert len(drawn) == 4
    assert jax.random.key_data(seed_key(7)).tolist() == jax.random.key_data(jax.random.key(7)).tolist()


@pytest.mark.parametrize("change, match", [
    (dict(vocab_size=300), r"params\.embed has shape \(264, 64\) but cfg gives \(300, 64\) \(dimension 0 follows "
                           r"cfg\.vocab_size = 300\)"),
    (dict(hidden_size=96), r"params\.embed has shape \(264, 64\) but cfg gives \(264, 96\) \(dimension 1 follows "
                           r"cfg\.hidden_size = 96\)"),
    (dict(moe_intermediate_size=64), r"params\.layers\[1\]\.mlp\.we_gate.* \(dimension 1 follows "
                                     r"cfg\.moe_intermediate_size = 64\)"),
    (dict(num_attention_heads=8), r"params\.layers\[0\]\.attn\.q_b .* follows cfg\.num_attention_heads = 8\)"),
    (dict(num_hidden_layers=2), "params have 3 decoder layers but cfg.num_hidden_layers is 2"),
    (dict(first_k_dense_replace=2), r"params\.layers\[1\]\.mlp is a MoE but cfg makes it a dense MLP \(it follows "
                                    r"cfg\.first_k_dense_replace = 2\)"),
    (dict(expert_format="bf16"), r"params lack the array params\.layers\[1\]\.mlp\.we_gate, which cfg declares "
                                 r"\(it follows cfg\.expert_format = 'bf16'"),
])
def test_params_of_another_config_are_refused_naming_the_field(tiny, change, match):
    cfg, params, _ = tiny
    other = dataclasses.replace(cfg, **change)
    for call in (lambda: kj.generate(params, other, [[1, 2, 3]], max_new_tokens=2),
                 lambda: kj.forward(params, other, [[1, 2, 3]]),
                 lambda: check_params(params, other)):
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(TypeError, match="params must be a kdtree_jax.Params"):
        kj.forward({"embed": params.embed}, cfg, [[1, 2, 3]])


def test_one_rule_for_the_api_the_engine_the_server_and_the_cli(tiny):
    """The same top_k past int32 is refused by Sampler, the serving engine and the command line with one message."""
    cfg, params, _ = tiny
    message = r"top_k must be None or an integer in \[1, 2\*\*31\), got 2147483648"
    with pytest.raises(validate.ArgumentError, match=message):
        kj.Sampler(1.0, top_k=2**31)
    from kdtree_jax.serving.engine import Engine

    with Engine(params, cfg, max_batch=1, max_context=64) as engine:
        with pytest.raises(validate.ArgumentError, match=message):
            engine.submit([1, 2], max_tokens=2, temperature=1.0, top_k=2**31, on_event=lambda ev: None)
        with pytest.raises(validate.ArgumentError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
            engine.submit([1, 2], max_tokens=2, seed=2**63, on_event=lambda ev: None)
    argv = [sys.executable, "-m", "kdtree_jax.cli", "generate", "--prompt", "x", "--temperature", "1", "--top-k",
            str(2**31)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("kdtree-jax: error: top_k must be None or an integer in")


@pytest.mark.parametrize("call, error, match", [
    (lambda p, c: kj.generate(p, c, "def f", max_new_tokens=2), ValueError,
     r"^prompts is text, not lists of token ids: encode text with the model's tokenizer first \(model\.tokenizer"),
    (lambda p, c: kj.generate(p, c, ["def f"], max_new_tokens=2), ValueError, r"^prompts: prompt 0 is text, not token"),
    (lambda p, c: kj.generate(p, c, [["d", "e"]], max_new_tokens=2), TypeError, r"^prompts: prompt 0 holds text"),
    (lambda p, c: next(stream(p, c, "def f", max_new_tokens=2)), ValueError, r"^prompt is text, not token ids"),
    (lambda p, c: next(stream(p, c, [[1, 2]], max_new_tokens=2)), ValueError,
     r"^prompt must be a non-empty 1-D sequence of token ids, got shape \(1, 2\)"),
    (lambda p, c: next(stream(p, c, [1, 999], max_new_tokens=2)), ValueError,
     r"^prompt has token id 999 outside the vocabulary \[0, 264\)"),
])
def test_text_prompts_point_to_the_tokenizer_and_stream_names_its_prompt(tiny, call, error, match):
    """Text where token ids belong is the likeliest mistake: named as text, with the way to ids; `stream` takes one
    `prompt` and its errors say so (not "prompts: prompt 0")."""
    cfg, params, _ = tiny
    with pytest.raises(error, match=match):
        call(params, cfg)


def test_load_refuses_bad_arguments_naming_them(tmp_path):
    """Before anything is read: a path that is not one (not the working directory for ""), a file, a verify that
    is not a bool ("no" would have been true), a mesh that is not one."""
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"x")
    for kwargs, error, match in [
        (dict(path=None), TypeError, r"path must be a checkpoint directory \(a str or os\.PathLike\) or 'builtin', "
                                     "got NoneType"),
        (dict(path=7), TypeError, "path must be a checkpoint directory .* got int"),
        (dict(path=""), ValueError, "path is empty: give a checkpoint directory or 'builtin'"),
        (dict(path=str(tmp_path / "missing")), ValueError, "missing is not a kdtree-jax checkpoint: no such file or "
                                                           "directory"),
        (dict(path=a_file), ValueError, "model.safetensors is not a kdtree-jax checkpoint: it is a file; give the "
                                        "checkpoint's directory"),
        (dict(path="builtin", verify="no"), TypeError, "verify must be None, True or False, got 'no'"),
        (dict(path="builtin", mesh="tp=2"), TypeError, r"mesh must be None or a jax\.sharding\.Mesh \(kj\.make_mesh\), "
                                                       "got str"),
    ]:
        with pytest.raises(error, match=match):
            kj.load(**kwargs)


def test_numpy_integers_are_integers_for_budget_max_budget_and_the_engine(tiny):
    """Every integer argument takes a numpy integer (validate.is_integer); budget, max_budget and the engine's sizes
    refused them ('budget must be an integer >= 1, got np.int64(4)')."""
    cfg, params, drafter = tiny
    args = dict(max_new_tokens=4, method="ddtree", drafter=drafter)
    assert (kj.generate(params, cfg, [[1, 2, 3]], budget=np.int64(4), **args).tokens
            == kj.generate(params, cfg, [[1, 2, 3]], budget=4, **args).tokens)
    from kdtree_jax.generate import check_auto

    assert check_auto("ddtree", "auto", np.int32(8))
    with pytest.raises(ValueError, match=r"max_budget must be an integer >= 1, got 0"):
        check_auto("ddtree", "auto", np.int64(0))
    from kdtree_jax.serving.engine import Engine

    with Engine(params, cfg, max_batch=np.int64(1), max_context=np.int64(64), chunk_steps=np.int32(2)) as engine:
        assert (engine.max_batch, engine.max_context, engine.chunk_steps) == (1, 64, 2)
        assert type(engine.max_context) is int


def test_forward_takes_a_loaded_model_and_generate_refuses_booleans_in_a_row():
    model = kj.load("builtin")
    ids = model.tokenizer.encode("def f(")
    np.testing.assert_array_equal(kj.forward(model, [ids]), kj.forward(model.params, model.cfg, [ids]))
    with pytest.raises(TypeError, match="forward needs tokens"):
        kj.forward(model.params, model.cfg)
    with pytest.raises(TypeError, match="prompt 0 holds booleans"):
        kj.generate(model, [[ids[0], True] + ids[2:]], max_new_tokens=2)


def test_a_drafter_given_as_the_model_is_named_and_each_call_names_itself(tiny):
    """Issue 46, eighth probe round: generate(model.drafter, prompts) and stream were an AttributeError ('DrafterConfig'
    object has no attribute 'max_position_embeddings'), and stream's and forward's refusals of a cfg named
    generate(params, cfg, prompts, ...)."""
    cfg, params, drafter = tiny

    def called(call, first, ids):  # stream checks its arguments when it is first advanced
        out = call(first, ids) if call is kj.forward else call(first, ids, max_new_tokens=1)
        return next(out) if call is stream else out

    for call, ids in ((kj.generate, [[1, 2]]), (stream, [1, 2]), (kj.forward, [[1, 2]])):
        name = call.__name__
        with pytest.raises(TypeError, match=f"^{name}'s first argument is a Drafter whose cfg is a DrafterConfig, "
                                            "not a model: .* a drafter goes in drafter="):
            called(call, drafter, ids)
        with pytest.raises(TypeError, match=rf"^{name}\(params, cfg, .*needs a ModelConfig as cfg, got list"):
            called(call, params, ids)


@pytest.mark.parametrize("field, value", [("rope_theta", float("nan")), ("rope_theta", -1.0), ("rope_factor", 0.0),
                                          ("rms_norm_eps", -1.0), ("routed_scaling_factor", float("nan")),
                                          ("rope_beta_fast", float("inf")), ("rope_mscale", -0.5)])
def test_config_numbers_the_model_divides_by_or_takes_logs_of_are_checked(field, value):
    """They passed every check and failed later, inside JAX (NaN to integer, a math domain error) or as NaN logits."""
    with pytest.raises(kj.config.ConfigError, match=f"{field} must be a finite number"):
        kj.configs.tiny(**{field: value})


def test_argparse_errors_are_one_line_and_an_empty_method_list_is_refused():
    for argv, match in [(["generate", "--max-new-tokens", "abc"], "kdtree-jax generate: error: argument "
                         "--max-new-tokens: invalid int value: 'abc' (see kdtree-jax generate --help)"),
                        (["bench", "--methods", ""], "kdtree-jax: error: --methods: give at least one of")]:
        r = subprocess.run([sys.executable, "-m", "kdtree_jax.cli", *argv], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [match] if "abc" in argv else \
            r.returncode != 0 and r.stderr.strip().startswith(match), r.stderr


@pytest.mark.parametrize("raw, match", [({"vocab_size": "264"}, "config field 'vocab_size' must be int, got '264'"),
                                        ({"rope_parameters": [1]}, "config field 'rope_parameters' must be an object"),
                                        ({"text_config": 3}, "config field 'text_config' must be an object")])
def test_from_hf_names_a_value_of_the_wrong_type(raw, match):
    """ModelConfig.from_hf (and so `kdtree-jax plan --model HF_DIR`) failed inside the mapping with Python's text
    ("'<' not supported between instances of 'str' and 'int'")."""
    base = dict(vocab_size=264, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=16)
    assert kj.ModelConfig.from_hf(base).vocab_size == 264
    with pytest.raises(kj.config.ConfigError, match=match):
        kj.ModelConfig.from_hf({**base, **raw})


def test_params_in_another_dtype_than_cfg_are_named(tiny):
    """Issue 46, fourth probe round: params cast to bfloat16 with a float32 cfg failed inside JAX
    ("lax.dynamic_update_slice requires arguments to have the same dtypes"), naming no argument."""
    cfg, params, _ = tiny
    other = "float32" if cfg.dtype == "bfloat16" else "bfloat16"
    with pytest.raises(ValueError, match=f"params.embed has dtype {cfg.dtype} but cfg.dtype is '{other}'"):
        kj.generate(params, dataclasses.replace(cfg, dtype=other), [[1, 2]], max_new_tokens=2)
    with pytest.raises(ValueError, match="params.embed has dtype"):
        next(stream(params, dataclasses.replace(cfg, dtype=other), [1, 2], max_new_tokens=2))


def test_generate_and_stream_inside_jit_or_vmap_name_the_traced_argument(tiny):
    """generate and stream run their own compiled loop on the host; inside jax.jit or vmap their arguments are
    tracers. That was JAX's TracerArrayConversionError or a ConcretizationTypeError, naming neither the argument nor
    the call; now a TypeError names the argument and says to call them outside the transformation."""
    cfg, params, _ = tiny
    ids = jnp.array([1, 2, 3])
    calls = {
        "prompts": lambda t: kj.generate(params, cfg, t[None], max_new_tokens=2).tokens,
        "prompts: prompt 0": lambda t: kj.generate(params, cfg, [t], max_new_tokens=2).tokens,
        "prompt": lambda t: list(stream(params, cfg, t, max_new_tokens=2)),
        "max_new_tokens": lambda t: kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=t[0]).tokens,
        "temperature": lambda t: kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=2, temperature=t[0] / 2).tokens,
        "params": lambda t: kj.generate(jax.tree.map(lambda a: a + 0 * t[0].astype(a.dtype), params), cfg,
                                        [[1, 2, 3]], max_new_tokens=2).tokens,
    }
    for name, call in calls.items():
        for transform in (jax.jit, jax.vmap):
            arg = ids[None] if transform is jax.vmap else ids
            with pytest.raises(TypeError, match=rf"^{name} (is a traced value|hold traced values).*outside jax.jit"):
                transform(call)(arg)


def test_a_random_key_where_a_number_belongs_is_refused_naming_the_argument(tiny):
    """A jax.random key as the seed was NotImplementedError('Cannot call abstract method item'), naming nothing; it is
    now the seed rule's refusal, on one line (the key's repr has two)."""
    cfg, params, _ = tiny
    key = jax.random.key(3)
    for name, kwargs in (("seed", dict(seed=key, temperature=1.0)), ("eos_id", dict(eos_id=key))):
        with pytest.raises(ValueError, match=rf"^{name} must be .*key<fry>") as e:
            kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=2, **kwargs)
        assert "\n" not in str(e.value)


def test_a_number_where_a_random_key_belongs_is_refused_naming_it(tiny):
    """init_params / init_drafter given an int (or another array) for the key: JAX's own error was 'invalid PRNG key
    data', naming no argument; both keys forms of one draw still work (typed and raw uint32)."""
    import numpy as np

    cfg = tiny[0]
    for bad, got in ((0, "int 0"), (np.zeros(3, np.uint32), r"uint32 \(3,\)"),
                     (jax.random.split(jax.random.key(0), 2), r"keys of shape \(2,\)")):
        for make in (lambda k: kj.init_params(cfg, k), lambda k: kj.init_drafter(cfg, k, num_layers=1, block_size=4)):
            with pytest.raises(ValueError, match=rf"^key must be a JAX random key of one draw, .* got .*{got}"):
                make(bad)
    raw = kj.init_drafter(cfg, jax.random.PRNGKey(1), num_layers=1, block_size=4)
    typed = kj.init_drafter(cfg, jax.random.key(1), num_layers=1, block_size=4)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(raw.params), jax.tree.leaves(typed.params)))
