"""Two real processes on this machine, 4 CPU devices each (gloo), one 2 x 4 mesh: forward, generate (ar, ddtree)
and load give exactly the single-process results; processes that disagree fail with a message, in bounded time."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import rel_err

import kdtree_jax as kj

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(tmp_path, extra=((), ())):
    port, out = _free_port(), str(tmp_path / "result.json")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, WORKER, str(port), str(i), out, *extra[i]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=400)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a worker did not finish within 400 s:\n" + "\n".join(logs))
    return [p.returncode for p in procs], logs, out


def test_two_processes_equal_one(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import build_hf_model, save_hf_model

    from kdtree_converters.convert import convert

    src = save_hf_model(build_hf_model("yarn"), str(tmp_path / "hf"))
    ckpt = str(tmp_path / "ckpt")
    convert(src, ckpt, dtype="float32", progress=False, log=lambda msg: None)
    codes, logs, out = _run_pair(tmp_path, extra=(("--ckpt", ckpt), ("--ckpt", ckpt)))
    assert codes == [0, 0], "\n".join(logs[i][-3000:] for i in range(2))
    with open(out) as f:
        res = json.load(f)
    cfg = kj.configs.tiny(num_attention_heads=8, n_routed_experts=16, moe_intermediate_size=256)
    params = kj.init_params(cfg, jax.random.key(0))
    drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=1, block_size=4)
    tokens = np.random.default_rng(0).integers(0, 256, size=(4, 16))
    assert rel_err(np.array(res["logits"]), kj.forward(params, cfg, tokens)) <= 1e-5
    ar = kj.generate(params, cfg, PROMPTS, max_new_tokens=8).tokens
    assert res["ar"] == ar
    assert res["ddtree"] == kj.generate(params, cfg, PROMPTS, max_new_tokens=8, method="ddtree", drafter=drafter,
                                        budget=8).tokens == ar
    converted = kj.load(ckpt)
    assert res["ckpt"] == kj.generate(converted, PROMPTS, max_new_tokens=8).tokens
    e, f, d = converted.params.moe_layers[0].mlp.we_gate.shape  # each device restored its 1/4 of the experts
    assert res["ckpt_local_shards"] == [[e // 4, f, d]]
    model = kj.load("builtin")
    assert res["builtin"] == kj.generate(model, [model.tokenizer.encode("def add(a, b):")], max_new_tokens=12).tokens


def test_processes_that_disagree_fail_with_a_message(tmp_path):
    codes, logs, _ = _run_pair(tmp_path, extra=((), ("--other-config",)))
    assert codes[0] != 0 and codes[1] != 0
    for log in logs:
        assert "the model config differs between processes: process(es) [1] disagree with process 0" in log


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"],
     "--coordinator 'nohost': expected HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in 0..1 (--num-processes 2), got 2"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "0", "--process-id", "0"],
     "--num-processes must be at least 1, got 0"),
    (["--num-processes", "2"], "--coordinator, --process-id missing: a multi-host run takes"),
    (["--process-id", "1"], "--coordinator, --num-processes missing"),  # alone it used to be ignored
])
def test_bad_multihost_flags_are_one_line_errors(capsys, flags, message):
    from kdtree_jax.cli import main

    assert main(["generate", "--max-new-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_coordinator_that_never_comes_is_an_error_not_an_abort(monkeypatch):
    """Process 1 waits for process 0's coordinator port, then says it never came (jax.distributed.initialize itself
    would end the process in a fatal abort after its timeout); it never reaches initialize."""
    from kdtree_jax import distributed

    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("initialize must not be reached"))
    port = _free_port()  # nothing listens there
    with pytest.raises(distributed.DistributedError, match=f"no coordinator at 127.0.0.1:{port} after 1.5 s"):
        distributed.init_distributed(f"127.0.0.1:{port}", 2, 1, timeout_s=1.5)
    assert not distributed._STATE["initialized"]
    with socket.socket() as listener:  # a port that accepts: the wait ends at once
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        distributed._wait_for_coordinator(f"127.0.0.1:{listener.getsockname()[1]}", 5)
