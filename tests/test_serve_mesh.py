"""`kdtree-jax serve` on a mesh: 8 simulated CPU devices (tests/conftest.py) split ep=4 x tp=2, a tiny model with 8
heads, driven with the official `openai` client; every greedy answer must be exactly `generate`'s tokens for its
prompt alone on the same mesh.

- The command line, `kdtree-jax serve --model DIR --mesh ep=4,tp=2` of a converted checkpoint (ar), in its own
  process: concurrent requests get their solo answers; SIGTERM then stops it gracefully (exit status 0, the open
  stream ended with [DONE]), as docs/reliability.md defines the stop.
- The engine with the sequence-sharded cache (`cache_sharding="sequence"`), ddtree and a prefix cache: concurrent
  requests, and a prompt whose first 40 tokens are read from the prefix cache, get their solo answers.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import kdtree_jax as kj  # noqa: E402
from kdtree_jax.drafter import shard_drafter  # noqa: E402
from kdtree_jax.serving.engine import Engine  # noqa: E402
from kdtree_jax.serving.serve import BackgroundServer, create_app  # noqa: E402
from kdtree_jax.tokenizer import ByteTokenizer  # noqa: E402

MESH = dict(ep=4, tp=2)
MAX_TOKENS = 8
# four prompts of 40-56 token ids (one padded length, 64: one compilation), the last two sharing their first 40 ids
RNG = np.random.default_rng(0)
SHARED = RNG.integers(0, 256, 40).tolist()
PROMPTS = [RNG.integers(0, 256, 48).tolist(), RNG.integers(0, 256, 56).tolist(),
           SHARED + RNG.integers(0, 256, 4).tolist(), SHARED + RNG.integers(0, 256, 9).tolist()]

pytestmark = pytest.mark.skipif(jax.device_count() != 8, reason="needs 8 devices (XLA_FLAGS="
                                "--xla_force_host_platform_device_count=8 before jax starts)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(client, model: str, prompts: list[list[int]]) -> list[str]:
    """The greedy completions of the prompts (token ids), sent at once."""
    def one(p):
        return client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def solo(params, cfg, prompts: list[list[int]], **method) -> list[str]:
    """generate's greedy answer for each prompt alone, as the server's text."""
    return [ByteTokenizer().decode(kj.generate(params, cfg, [p], max_new_tokens=MAX_TOKENS, **method).tokens[0])
            for p in prompts]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny random Hugging Face model with 8 heads, converted (kdtree-convert) to a checkpoint directory."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from hf_models import build_hf_model, save_hf_model
    from kdtree_converters.convert import convert

    root = tmp_path_factory.mktemp("mesh")
    src = save_hf_model(build_hf_model("yarn", num_attention_heads=8, num_key_value_heads=8), str(root / "hf"))
    convert(src, str(root / "ckpt"), dtype="float32", progress=False, log=lambda msg: None)
    return str(root / "ckpt")


def test_cli_serves_a_checkpoint_on_a_mesh_and_stops_on_sigterm(checkpoint):
    port = free_port()
    argv = [sys.executable, "-m", "kdtree_jax.cli", "serve", "--model", checkpoint, "--mesh", "ep=4,tp=2", "--method",
            "ar", "--max-batch", "4", "--max-context", "128", "--port", str(port), "--shutdown-timeout", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    try:
        model = kj.load(checkpoint, kj.make_mesh(**MESH))  # while the server starts
        want = solo(model.params, model.cfg, PROMPTS)
        deadline = time.monotonic() + 300
        while not any("serving 'ckpt'" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=30).json()["mesh"] == {"dp": 1, "ep": 4, "tp": 2}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert answers(client, "ckpt", PROMPTS) == want
        client.close()
        # SIGTERM with a stream open: the process drains it (or ends it at the 1 s timeout) and exits with 0
        events, opened = [], threading.Event()

        def stream():
            body = dict(model="ckpt", prompt=PROMPTS[0], max_tokens=64, temperature=0, ignore_eos=True, stream=True)
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    opened.set()
                    if line:
                        events.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        assert opened.wait(60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        reader.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    data = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert events[-1] == "data: [DONE]" and data, events
    assert "error" in data[-1] or data[-1]["choices"][0]["finish_reason"] == "length"
    err = "".join(lines)
    assert "stopping: new requests get 503" in err and "Traceback" not in err


def test_sequence_sharded_cache_with_ddtree_and_prefix_reuse_on_a_mesh():
    cfg = kj.configs.tiny(num_attention_heads=8, n_routed_experts=16, moe_intermediate_size=256,
                          cache_sharding="sequence")
    mesh = kj.make_mesh(**MESH)
    params = kj.init_params(cfg, jax.random.key(0), mesh=mesh)
    drafter = shard_drafter(kj.init_drafter(cfg, jax.random.key(1), num_layers=1, block_size=4), mesh)
    want = solo(params, cfg, PROMPTS, method="ddtree", drafter=drafter, budget=4)
    engine = Engine(params, cfg, method="ddtree", drafter=drafter, budget=4, max_batch=4, max_context=128,
                    prefix_cache_bytes=10**7)
    server = BackgroundServer(create_app(engine, ByteTokenizer(), "tiny"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        assert answers(client, "tiny", PROMPTS[:3]) == want[:3]
        assert answers(client, "tiny", PROMPTS[3:]) == want[3:]  # its first 40 tokens read from the prefix cache
        snapshot = engine.snapshot()
        assert (snapshot["prefix_hits"], snapshot["prefix_tokens_saved"]) == (1, len(SHARED))
        lat = engine._state.cache.latent[0]
        assert {s.data.shape[1] for s in lat.addressable_shards} == {128 // 8}  # each device: 1/8 of the slots
    finally:
        client.close()
        server.stop()
        engine.close()
