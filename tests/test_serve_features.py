"""`kdtree-jax serve`'s OpenAI features on the embedded model, through the official `openai` client: logprobs (the
target's log-softmax at the committed tokens, streamed too), echo, n > 1, prefix reuse and the latency histograms.

One ddtree server (4 slots, a prefix cache, n up to 4) serves the module; one ar server with room for one cached
prompt checks reuse and eviction without a drafter. Every greedy answer must be exactly `generate`'s tokens for its
prompt alone, whether its prompt was prefilled or read from the prefix cache; every log-probability must equal
`kj.forward`'s log-softmax at its position (to 1e-4).
"""

import concurrent.futures
import functools
import os
import re

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import jax  # noqa: E402

import kdtree_jax as kj  # noqa: E402
from kdtree_jax.serving.engine import PREFIX_MIN_TOKENS, Engine  # noqa: E402
from kdtree_jax.serving.serve import BackgroundServer, create_app  # noqa: E402

BUDGET, SLOTS, CONTEXT, MAX_TOKENS, MAX_N = 8, 4, 256, 16, 4
PROMPT = "def fib(n):\n    "  # 16 bytes
CHAT = [{"role": "user", "content": "def parse("}]
CHAT_PROMPT = "user: def parse(\nassistant:"  # the embedded chat template applied
SHARED = 'import os\nimport sys\n\n\ndef read_config(path):\n    """Read the settings file at path."""\n'  # 85 bytes
TAILS = ["    with open(path) as f:\n", "    if not os.path.exists(path):\n"]
OTHER = "class Parser:\n    def __init__(self, text):\n        self.text = text\n        self.pos = 0\n"
TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return kj.load("builtin")


def start(model, method: str, prefix_bytes: int):
    engine = Engine(model.params, model.cfg, method=method, drafter=model.drafter, budget=BUDGET, max_batch=SLOTS,
                    max_context=CONTEXT, eos_id=model.tokenizer.eos_id, prefix_cache_bytes=prefix_bytes)
    server = BackgroundServer(create_app(engine, model.tokenizer, "builtin", max_n=MAX_N))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return engine, server, client


@pytest.fixture(scope="module")
def served(model):
    engine, server, client = start(model, "ddtree", 10**8)
    yield dict(engine=engine, url=server.url, client=client)
    client.close()
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def solo(model):
    """solo(prompt, method="ddtree"): generate's greedy text for this prompt alone, and its tokens without EOS."""

    @functools.cache
    def answer(prompt: str, method: str = "ddtree") -> tuple[str, list[int]]:
        out = kj.generate(model, [model.tokenizer.encode(prompt)], max_new_tokens=MAX_TOKENS, method=method,
                          budget=BUDGET, eos_id=model.tokenizer.eos_id)
        tokens = [t for t in out.tokens[0] if t != model.tokenizer.eos_id]
        return model.tokenizer.decode(tokens), tokens

    return answer


@pytest.fixture(scope="module")
def log_softmax(model):
    """log_softmax(ids): kj.forward's log-softmax [len(ids), V] (float64), one compilation: the ids padded to the
    context (the model is causal: what follows does not change a position's logits)."""

    def value(ids: list[int]) -> np.ndarray:
        padded = np.zeros((1, CONTEXT), np.int32)
        padded[0, :len(ids)] = ids
        logits = kj.forward(model.params, model.cfg, padded)[0, :len(ids)]
        return np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)

    return value


def token_id(text: str) -> int:
    """The byte tokenizer's id of a token as the log-probabilities show it (a character or "bytes:\\xNN")."""
    raw = bytes.fromhex(text[6:].replace("\\x", "")) if text.startswith("bytes:") else text.encode()
    assert len(raw) == 1, text
    return raw[0]


def token_text(i: int) -> str:
    return chr(i) if i < 128 else f"bytes:\\x{i:02x}"


def check_completion_logprobs(lp, context: list[int], tokens: list[int], ref: np.ndarray, top: int, offset: int = 0):
    """lp (a completion's logprobs) against the reference log-softmax for `tokens` generated after `context`."""
    assert [token_id(t) for t in lp.tokens] == tokens
    assert lp.text_offset == list(range(offset, offset + len(tokens)))  # one byte (one ASCII character) a token
    for j, (t, value, alts) in enumerate(zip(tokens, lp.token_logprobs, lp.top_logprobs)):
        row = ref[len(context) - 1 + j]
        assert abs(value - row[t]) < TOL
        best = np.argsort(-row, kind="stable")[:top]
        want = {}
        for i in [*best, t]:
            want.setdefault(token_text(int(i)) if i < 256 else "", row[i])
        assert alts.keys() == want.keys() and all(abs(alts[k] - want[k]) < TOL for k in want)


def test_completion_logprobs_are_the_targets_log_softmax(served, model, solo, log_softmax):
    """Greedy ddtree: each token's logprob and its top 3 are the target's (the verify logits), streamed or not."""
    client, ids = served["client"], model.tokenizer.encode(PROMPT)
    text, tokens = solo(PROMPT)
    r = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3)
    assert r.choices[0].text == text
    check_completion_logprobs(r.choices[0].logprobs, ids, tokens, log_softmax(ids + tokens), top=3)
    merged = dict(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    pieces = []
    for chunk in client.completions.create(model="builtin", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=3, stream=True):
        pieces.append(chunk.choices[0].text)
        if chunk.choices[0].logprobs is not None:
            for k, v in merged.items():
                v += getattr(chunk.choices[0].logprobs, k)
    assert "".join(pieces) == text and merged == r.choices[0].logprobs.model_dump()


def test_sampled_and_chat_logprobs(served, model, solo, log_softmax):
    """A sampled request's logprobs are of the target's distribution itself (before temperature and top_k); chat's
    logprobs and top_logprobs, streamed, match the answer's tokens."""
    client, tok = served["client"], model.tokenizer
    ids = tok.encode(PROMPT)
    r = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.5,
                                  seed=5, logprobs=0, extra_body={"top_k": 20})
    lp = r.choices[0].logprobs
    tokens = [token_id(t) for t in lp.tokens]
    assert tok.decode(tokens) == r.choices[0].text and len(tokens) > 0
    check_completion_logprobs(lp, ids, tokens, log_softmax(ids + tokens), top=0)

    text, tokens = solo(CHAT_PROMPT)
    ids = tok.encode(CHAT_PROMPT)
    ref = log_softmax(ids + tokens)
    content, entries = [], []
    for chunk in client.chat.completions.create(model="builtin", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True):
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        entries += choice.logprobs.content if choice.logprobs else []
    assert "".join(content) == text and [token_id(e.token) for e in entries] == tokens
    for j, (t, e) in enumerate(zip(tokens, entries)):
        row = ref[len(ids) - 1 + j]
        assert e.bytes == [t] and abs(e.logprob - row[t]) < TOL
        best = np.argsort(-row, kind="stable")[:2]
        assert [a.token for a in e.top_logprobs] == [token_text(int(i)) if i < 256 else "" for i in best]
        assert all(abs(a.logprob - row[i]) < TOL for a, i in zip(e.top_logprobs, best))


def test_echo_with_and_without_logprobs(served, model, solo, log_softmax):
    """echo puts the prompt before the text; with logprobs, the prompt's tokens' too (the first: None); max_tokens 0
    answers the prompt alone."""
    client, ids = served["client"], model.tokenizer.encode(PROMPT)
    text, tokens = solo(PROMPT)
    r = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + text and r.usage.completion_tokens >= len(tokens)
    r = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    lp, ref = r.choices[0].logprobs, log_softmax(ids)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (PROMPT, 0, "length")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    check_completion_logprobs(type(lp)(**{k: v[1:] for k, v in lp.model_dump().items()}), ids[:1], ids[1:], ref,
                              top=2, offset=1)
    pieces = [c.choices[0].text for c in client.completions.create(
        model="builtin", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, echo=True, stream=True)]
    assert pieces[0] == PROMPT and "".join(pieces) == PROMPT + text


def test_n_choices(served, model, solo):
    """n greedy choices are each the solo answer; n seeded sampled ones are the requests with seeds seed + i, streamed
    chat choices arrive by index; n past --max-n is refused."""
    client = served["client"]
    text, tokens = solo(PROMPT)
    r = client.completions.create(model="builtin", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and {c.text for c in r.choices} == {text}
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens >= 3 * len(tokens)
    sampled = dict(model="builtin", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9)
    r = client.completions.create(n=2, seed=11, **sampled)
    alone = [client.completions.create(n=1, seed=11 + i, **sampled).choices[0].text for i in range(2)]
    assert [c.text for c in r.choices] == alone
    chat_text, _ = solo(CHAT_PROMPT)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="builtin", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                                n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: chat_text, 1: chat_text}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="builtin", prompt=PROMPT, max_tokens=2, n=MAX_N + 1)
    assert e.value.body["param"] == "n"


def prefix_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=60).text
    return {m: float(v) for m, v in re.findall(r"^kdtree_(prefix_cache_\w+) (\S+)$", text, re.M)}


def test_prefix_reuse_is_lossless_with_ddtree(served, solo):
    """A prompt that begins like an earlier one (its first 85 bytes, or all but its last token) copies those cache
    rows instead of prefilling them and gets exactly the cold answer; /metrics counts the hits and tokens saved."""
    client, url = served["client"], served["url"]
    prompts = [SHARED + TAILS[0], SHARED + TAILS[1], SHARED + TAILS[0]]
    before = prefix_metrics(url)
    first = client.completions.create(model="builtin", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0)
    assert first.choices[0].text == solo(prompts[0])[0]
    assert prefix_metrics(url)["prefix_cache_hits_total"] == before["prefix_cache_hits_total"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: client.completions.create(model="builtin", prompt=p, max_tokens=MAX_TOKENS,
                                                                    temperature=0).choices[0].text, prompts[1:]))
    assert answers == [solo(p)[0] for p in prompts[1:]]
    after = prefix_metrics(url)
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] == 2
    saved = after["prefix_cache_tokens_saved_total"] - before["prefix_cache_tokens_saved_total"]
    assert saved == len(os.path.commonprefix(prompts[:2])) + len(prompts[2]) - 1  # (bytes are tokens here)
    assert after["prefix_cache_entries"] >= 1 and after["prefix_cache_bytes"] > 0


def test_prefix_reuse_with_ar_and_lru_eviction(model, solo):
    """An ar server with room for one cached prompt: a second prompt evicts the first, which then misses; a prompt
    that begins like the kept one hits; every answer is the solo one."""
    cfg = model.cfg  # a prompt of 65 to 128 tokens keeps 128 slots of each layer's latent and rope key (fp32)
    one = cfg.num_hidden_layers * 128 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    engine, server, client = start(model, "ar", int(1.5 * one))
    try:
        def ask(prompt: str) -> str:
            return client.completions.create(model="builtin", prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0).choices[0].text

        assert ask(SHARED + TAILS[0]) == solo(SHARED + TAILS[0], "ar")[0]  # kept
        assert ask(OTHER) == solo(OTHER, "ar")[0]  # kept, the first evicted
        m = prefix_metrics(server.url)
        assert (m["prefix_cache_hits_total"], m["prefix_cache_evictions_total"], m["prefix_cache_entries"]) == (0, 1, 1)
        assert ask(SHARED + TAILS[1]) == solo(SHARED + TAILS[1], "ar")[0]  # a miss: kept, OTHER evicted
        assert prefix_metrics(server.url)["prefix_cache_hits_total"] == 0
        assert ask(SHARED + TAILS[0]) == solo(SHARED + TAILS[0], "ar")[0]  # a hit on the shared part
        m = prefix_metrics(server.url)
        assert (m["prefix_cache_hits_total"], m["prefix_cache_evictions_total"]) == (1, 2)
        shared = len(os.path.commonprefix([SHARED + TAILS[0], SHARED + TAILS[1]]))
        assert m["prefix_cache_tokens_saved_total"] == shared >= PREFIX_MIN_TOKENS
    finally:
        client.close()
        server.stop()
        engine.close()


def test_bench_serve_measures_prefix_ttft(served, tmp_path):
    """`bench-serve --shared-prefix`'s measurement: each warm request reads its prefix from the cache."""
    from kdtree_jax.serving import bench_serve

    result = bench_serve.prefix_ttft(served["url"], prefix_chars=150, question_chars=20, rounds=1, max_tokens=2,
                                     log=lambda line: None)
    (row,), summary = result["rows"], result["summary"]
    assert row["cold_prompt_tokens"] >= 170 and summary["warm_over_cold"] > 0
    assert summary["prefix_cache_hits_total"] >= 1 and summary["prefix_cache_tokens_saved_total"] >= 150
    assert summary["warmup_prefix_cache_hits_total"] >= 1  # the untimed round's warm request hit the cache too
    paths = bench_serve.write([result], str(tmp_path), "prefix", "prefix TTFT")
    assert [os.path.basename(p) for p in paths] == ["prefix.json", "prefix.md"]
    text = (tmp_path / "prefix.md").read_text()
    assert "| median |" in text and "in the untimed warm-up round: " in text


def test_bad_logprobs_n_and_echo_get_400(served):
    bad = [("/v1/completions", dict(prompt="x", logprobs=6), "logprobs"),
           ("/v1/completions", dict(prompt="x", logprobs=True), "logprobs"),
           ("/v1/completions", dict(prompt="x", n=0), "n"),
           ("/v1/completions", dict(prompt="x", echo="yes"), "echo"),
           ("/v1/completions", dict(prompt="x", max_tokens=0), "max_tokens"),
           ("/v1/chat/completions", dict(messages=CHAT, top_logprobs=2), "top_logprobs"),
           ("/v1/chat/completions", dict(messages=CHAT, logprobs=True, top_logprobs=21), "top_logprobs"),
           ("/v1/chat/completions", dict(messages=CHAT, echo=True), "echo")]
    with httpx.Client(base_url=served["url"], timeout=60) as http:
        for path, body, param in bad:
            r = http.post(path, json=dict(model="builtin", max_tokens=2, **body) if "max_tokens" not in body
                          else dict(model="builtin", **body))
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), (body, r.text)


def test_latency_histograms_in_prometheus_format(served):
    """/metrics holds the time to first token, inter-token latency and queue time as Prometheus histograms:
    cumulative buckets ending at +Inf = the count, a sum, HELP and TYPE lines."""
    text = httpx.get(served["url"] + "/metrics", timeout=60).text
    finished = sum(float(v) for v in re.findall(r'^kdtree_requests_total\{outcome="\w+"\} (\S+)$', text, re.M))
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds"):
        assert f"# TYPE kdtree_{name} histogram" in text and f"# HELP kdtree_{name} " in text
        buckets = re.findall(rf'^kdtree_{name}_bucket\{{le="([^"]+)"\}} (\S+)$', text, re.M)
        bounds = [float(b) for b, _ in buckets[:-1]]
        counts = [float(c) for _, c in buckets]
        count = float(re.search(rf"^kdtree_{name}_count (\S+)$", text, re.M).group(1))
        total = float(re.search(rf"^kdtree_{name}_sum (\S+)$", text, re.M).group(1))
        assert buckets[-1][0] == "+Inf" and bounds == sorted(bounds) and counts == sorted(counts)
        assert counts[-1] == count > 0 and total > 0
        if name != "inter_token_latency_seconds":
            assert count >= finished  # every request waited and got a first token
