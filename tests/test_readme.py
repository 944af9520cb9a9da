"""The README's examples run as written, and those of docs/usage.md, where the rest of the README's usage went: their
Python blocks on one CPU device and on 8 simulated ones, their cheap commands, every call their prose names (resolved
by the name it is written with, then called), and CI runs the README's test command verbatim."""

import ast
import dataclasses
import inspect
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
USAGE = (ROOT / "docs" / "usage.md").read_text()


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def _prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


PYTHON_BLOCKS, USAGE_PYTHON_BLOCKS = _blocks(README, "python"), _blocks(USAGE, "python")
BASH_BLOCKS, USAGE_BASH_BLOCKS = _blocks(README, "bash"), _blocks(USAGE, "bash")
# every call written in the prose's inline code: `name(...)` or `x = name(...)`
PROSE_CALLS = re.findall(r"`(?:\w+ = )?([A-Za-z_][\w.]*)\(([^`]*)\)`", _prose(README) + _prose(USAGE))
EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"


def _run(argv: list[str], devices: int, timeout: int = 300) -> subprocess.CompletedProcess:
    """argv in a fresh process on the CPU platform with `devices` simulated devices (jax reads XLA_FLAGS at start)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=EIGHT_DEVICES if devices == 8 else "")
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _cli(command: str) -> list[str]:
    """A README `kdtree-jax ...` line as argv: the installed script beside this Python, else the module."""
    script = pathlib.Path(sys.executable).parent / "kdtree-jax"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "kdtree_jax.cli"]
    return head + shlex.split(command)[1:]


def test_readme_has_its_examples():
    """The README: one device, then the `openai` client (run against a server in tests/test_serve.py); usage.md: a
    mesh."""
    assert len(PYTHON_BLOCKS) == 2 and "from openai import OpenAI" in PYTHON_BLOCKS[1] and len(BASH_BLOCKS) >= 3
    assert len(USAGE_PYTHON_BLOCKS) == 1


def test_single_device_block_runs():
    """The first block as written on one device: it generates text with the embedded model."""
    assert _run([sys.executable, "-c", PYTHON_BLOCKS[0]], devices=1).stdout.strip()  # the decoded continuation


@pytest.mark.parametrize("devices", [1, 8])
def test_sharded_block_runs(devices):
    """usage.md's sharded block does nothing on one device and generates on 8 simulated ones."""
    proc = _run([sys.executable, "-c", USAGE_PYTHON_BLOCKS[0]], devices=devices)
    if devices == 8:
        tokens = ast.literal_eval(proc.stdout.strip().splitlines()[-1])  # the printed [[...], [...]]
        assert [len(t) for t in tokens] == [8, 8]
    else:
        assert proc.stdout == ""


def _setup_commands() -> tuple[str, str]:
    """The two commands of "Two commands": (main job, tests)."""
    main, tests = (b.strip() for b in BASH_BLOCKS[:2])
    assert "\n" not in main and "\n" not in tests
    return main, tests


def test_setup_commands_use_distinct_environments_and_ci_runs_the_test_command():
    main, tests = _setup_commands()
    envs = [re.match(r"python3 -m venv (\S+) && \. (\S+)/bin/activate && ", c) for c in (main, tests)]
    assert all(m and m[1] == m[2] for m in envs) and envs[0][1] != envs[1][1]
    after_venv = tests[envs[1].end():]
    assert after_venv in (ROOT / ".ci" / "run").read_text().splitlines()


def test_cheap_commands_run():
    """`--help`, usage.md's `plan` (no weights, no devices) and the main job's command (the embedded model, ~128
    tokens)."""
    main, _ = _setup_commands()
    generate = main[main.index("kdtree-jax generate"):]
    plan = USAGE_BASH_BLOCKS[0].strip()
    assert plan.startswith("kdtree-jax plan ") and "`kdtree-jax generate --help`" in USAGE
    assert "usage: kdtree-jax generate" in _run(_cli("kdtree-jax generate --help"), devices=1).stdout
    assert "fits" in _run(_cli(plan), devices=1).stdout
    proc = _run(_cli(generate), devices=1)
    assert proc.stdout.startswith('def fibonacci(n):\n    """Return') and "[stats] method=ddtree" in proc.stdout
    assert "compiled in" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# The calls the prose names
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """(cfg, params, drafter) of a random tiny model: what the prose's `cfg`, `params` and `drafter` stand for."""
    import jax

    import kdtree_jax as kj

    cfg = kj.configs.tiny()
    return cfg, kj.init_params(cfg, jax.random.key(0)), kj.init_drafter(cfg, jax.random.key(1), num_layers=1,
                                                                          block_size=8)


def resolve(name: str, cfg):
    """The object a prose call's name denotes: `kj.` and `kdtree_jax.` the package, a bare name the package's (as
    `generate(...)` in the prose), `dataclasses.` the standard library's, `cfg.` a ModelConfig's."""
    import kdtree_jax

    head, *rest = name.split(".")
    obj = {"kj": kdtree_jax, "kdtree_jax": kdtree_jax, "dataclasses": dataclasses, "cfg": cfg}.get(head)
    obj = getattr(kdtree_jax, head) if obj is None else obj
    for part in rest:
        obj = getattr(obj, part)
    return obj


def _generate(fn, tiny, **kwargs):
    cfg, params, drafter = tiny
    out = fn(params, cfg, [[1, 2, 3]], max_new_tokens=4, **kwargs)
    assert [len(t) for t in out.tokens] == [4]


def _auto(fn, tiny, **kwargs):
    from kdtree_jax.budget import CostModel

    cfg, params, drafter = tiny  # one tier and a given cost model: nothing to measure, one program to compile
    cost = CostModel.from_points((64,), 1, [[(1, 1.0), (1e4, 201.0)]])
    _generate(fn, tiny, drafter=drafter, tiers=(64,), cost_model=cost, **kwargs)


def _stream(fn, tiny):
    import kdtree_jax as kj

    cfg, params, drafter = tiny
    streamed = [t for chunk in fn(params, cfg, [1, 2, 3], max_new_tokens=12, method="ddtree", drafter=drafter)
                for t in chunk]
    assert streamed == kj.generate(params, cfg, [[1, 2, 3]], max_new_tokens=12, method="ddtree",
                                   drafter=drafter).tokens[0]


def _one_device_mesh():
    import jax

    import kdtree_jax as kj

    return kj.make_mesh(devices=jax.devices()[:1])


def _load(fn, tiny):
    model = fn("builtin", _one_device_mesh())  # kj.load(path, mesh): the embedded model on a mesh
    assert dict(model.params.embed.sharding.mesh.shape) == {"dp": 1, "ep": 1, "tp": 1}


def _builtin(fn):
    model = fn("builtin")  # kj.load("builtin"): the embedded model with its drafter and tokenizer
    assert model.drafter is not None and model.tokenizer.decode(model.tokenizer.encode("def f(")) == "def f("


def _init_params(fn, tiny):
    import jax

    cfg = tiny[0]
    params = fn(cfg, jax.random.key(0), mesh=_one_device_mesh())
    assert params.embed.shape == (cfg.vocab_size, cfg.hidden_size)


def _replace(fn, tiny, **change):
    cfg = fn(tiny[0], **change)
    assert all(getattr(cfg, k) == v for k, v in change.items())
    if "kernels" in change:
        assert cfg.impl("tree_build") == "ffi"


def _impl(fn, tiny):
    assert fn("tree_build") in ("xla", "ffi")


def _init_distributed(fn, tiny):
    """Joining a job needs other processes: the call's arguments are bound to the function here, and
    tests/test_multihost.py calls it in two real processes."""
    inspect.signature(fn).bind("host0:12355", num_processes=2, process_id=0)
    assert "kj.init_distributed(" in (ROOT / "tests" / "multihost_worker.py").read_text()


# the prose's text of each call -> a test that calls what the name resolves to (the prose's "..." filled in)
CALLS = {
    'kj.load("builtin")': lambda fn, tiny: _builtin(fn),
    "kdtree_jax.decoding.clear_compiled()": lambda fn, tiny: fn(),
    "generate(..., temperature=0.8, top_k=40, top_p=0.95, seed=0)":
        lambda fn, tiny: _generate(fn, tiny, temperature=0.8, top_k=40, top_p=0.95, seed=0),
    'kdtree_jax.stream(params, cfg, ids, max_new_tokens=..., method="ddtree", drafter=...)': _stream,
    "generate(..., prefill_chunk=1024)": lambda fn, tiny: _generate(fn, tiny, prefill_chunk=1024),
    'dataclasses.replace(cfg, cache_sharding="sequence")':
        lambda fn, tiny: _replace(fn, tiny, cache_sharding="sequence"),
    'kj.init_distributed("host0:12355", num_processes=2, process_id=0)': _init_distributed,
    "kj.load(path, mesh)": _load,
    'generate(..., method="ddtree", budget="auto", max_budget=64)':
        lambda fn, tiny: _auto(fn, tiny, method="ddtree", budget="auto", max_budget=64),
    "init_params(mesh=)": _init_params,
    'dataclasses.replace(cfg, kernels="ffi")': lambda fn, tiny: _replace(fn, tiny, kernels="ffi"),
    "cfg.impl(op)": _impl,
}


def test_every_call_the_prose_names_has_a_test():
    written = {f"{name}({args})" for name, args in PROSE_CALLS}
    assert written == set(CALLS), (sorted(written - set(CALLS)), sorted(set(CALLS) - written))


@pytest.mark.parametrize("name, args", PROSE_CALLS, ids=[f"{n}({a[:24]})" for n, a in PROSE_CALLS])
def test_every_call_the_prose_names_runs(tiny, name, args):
    CALLS[f"{name}({args})"](resolve(name, tiny[0]), tiny)
