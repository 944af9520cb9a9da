"""`kdtree-jax serve`: the continuous-batching engine and the OpenAI-compatible server, on the embedded model.

One server (ddtree, 4 slots) is started once for the module on 127.0.0.1 and driven with the official `openai` client
and raw HTTP: every greedy answer (and one at top_k=1) must be exactly `generate`'s tokens for that prompt alone,
whatever else is in flight, and a seeded sampled answer (top_k and top_p too) the same as alone; a burst of requests
is prefilled in one call per padded prompt length (ar engine); a disconnect frees its slot; bad requests get 400s, a
full queue 429; the last test shuts everything down and checks that no thread or task is left behind.
"""

import concurrent.futures
import functools
import json
import os
import pathlib
import queue
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import kdtree_jax as kj  # noqa: E402
from kdtree_jax.serving.engine import Engine, Event  # noqa: E402
from kdtree_jax.serving.serve import BackgroundServer, StopPrefix, TextStream, create_app  # noqa: E402

ROOT = pathlib.Path(__file__).parent.parent
BUDGET, SLOTS, CONTEXT, QUEUE = 8, 4, 256, 10  # the queue holds the concurrent test's 13 requests less the slots
# prompts of two padded lengths (16 and 32 bytes), so that few shapes compile
PROMPTS = ["def fib(n):\n    ", "import os\nimport", "class Foo:\n    ", "for i in range(", "    return self.",
           "# Copyright 2001 Python Software", "def main():\n    parser = argparse.",
           "if __name__ == '__main__':\n    ", "try:\n    import json\nexcept Imp", "with open(path) as f:\n    data"]
MAX_TOKENS = [12, 30]


@pytest.fixture(scope="module")
def model():
    return kj.load("builtin")


@pytest.fixture(scope="module")
def served(model):
    threads_before = set(threading.enumerate())
    engine = Engine(model.params, model.cfg, method="ddtree", drafter=model.drafter, budget=BUDGET, max_batch=SLOTS,
                    max_context=CONTEXT, max_queue=QUEUE, eos_id=model.tokenizer.eos_id)
    server = BackgroundServer(create_app(engine, model.tokenizer, "builtin"))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    running = {"up": True}

    def shutdown():
        if running.pop("up", False):
            client.close()
            server.stop()
            engine.close()

    yield dict(engine=engine, server=server, client=client, url=server.url, threads_before=threads_before,
               shutdown=shutdown)
    shutdown()


@pytest.fixture(scope="module")
def solo(model):
    """solo(prompt, max_tokens, method="ddtree"): generate's greedy tokens for this prompt alone (EOS included)."""

    @functools.cache
    def tokens(prompt: str, max_tokens: int, method: str = "ddtree") -> list[int]:
        out = kj.generate(model, [model.tokenizer.encode(prompt)], max_new_tokens=max_tokens, method=method,
                          budget=BUDGET, eos_id=model.tokenizer.eos_id)
        return out.tokens[0]

    return tokens


@pytest.fixture(scope="module")
def solo_text(model, solo):
    """solo_text(prompt, max_tokens): (text, finish reason, tokens) that the server must answer a greedy request."""

    def answer(prompt: str, max_tokens: int) -> tuple[str, str, int]:
        tokens = solo(prompt, max_tokens)
        finish = "stop" if tokens[-1] == model.tokenizer.eos_id else "length"
        return model.tokenizer.decode(tokens), finish, len(tokens)

    return answer


def test_openai_client_completions_streamed_and_not(served, solo_text):
    client = served["client"]
    assert [m.id for m in client.models.list().data] == ["builtin"]
    want, finish, n = solo_text(PROMPTS[0], MAX_TOKENS[1])
    r = client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=MAX_TOKENS[1], temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (want, finish, n)
    assert r.usage.prompt_tokens == len(PROMPTS[0])
    chunks = list(client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=MAX_TOKENS[1],
                                            temperature=0, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices[0].text]
    assert "".join(texts) == want and len(texts) > 1  # streamed in pieces as the chunks of steps finish
    assert chunks[-1].choices[0].finish_reason == finish

    stop = want[len(want) // 2:len(want) // 2 + 2]  # a stop string that the answer contains
    r = client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=MAX_TOKENS[1], temperature=0,
                                  stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want[:want.index(stop)], "stop")
    streamed = client.completions.create(model="builtin", prompt=PROMPTS[0], max_tokens=MAX_TOKENS[1],
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want[:want.index(stop)]


def test_openai_client_chat_streamed_and_not(served, solo_text):
    client = served["client"]
    messages = [{"role": "user", "content": "def fib"}]
    want, finish, _ = solo_text("user: def fib\nassistant:", MAX_TOKENS[0])  # the embedded template
    r = client.chat.completions.create(model="builtin", messages=messages, max_tokens=MAX_TOKENS[0], temperature=0)
    assert (r.choices[0].message.role, r.choices[0].message.content, r.choices[0].finish_reason) == (
        "assistant", want, finish)
    chunks = list(client.chat.completions.create(model="builtin", messages=messages, max_tokens=MAX_TOKENS[0],
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_concurrent_clients_each_get_their_solo_output(served, solo_text):
    """10 greedy clients (more than the slots: requests wait and join mid-flight) next to sampling ones: a greedy
    request, and one sampled at top_k=1, gets its solo `generate` tokens; a seeded sampled request (with top_k and
    top_p or without) gets the same tokens among the others as alone."""
    client = served["client"]
    greedy = [dict(prompt=p, max_tokens=MAX_TOKENS[i % 2], temperature=0) for i, p in enumerate(PROMPTS)]
    greedy.append(dict(prompt=PROMPTS[2], max_tokens=MAX_TOKENS[0], temperature=1.0, extra_body={"top_k": 1}))
    sampled = [dict(prompt=PROMPTS[1], max_tokens=20, temperature=0.8, seed=7, extra_body={"ignore_eos": True}),
               dict(prompt=PROMPTS[6], max_tokens=20, temperature=1.5, top_p=0.9, seed=7,
                    extra_body={"ignore_eos": True, "top_k": 40})]

    def ask(job):
        r = client.completions.create(model="builtin", **job)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(len(greedy) + len(sampled)) as pool:
        answers = list(pool.map(ask, greedy + sampled))
    for job, answer in zip(greedy, answers):
        assert answer == solo_text(job["prompt"], job["max_tokens"]), job
    alone = [ask(job) for job in sampled]
    assert answers[len(greedy):] == alone and all(a[1:] == ("length", 20) for a in alone)


def test_disconnect_mid_stream_frees_the_slot(served):
    engine = served["engine"]
    before = engine.snapshot()
    body = dict(model="builtin", prompt=PROMPTS[2], max_tokens=200, temperature=0, stream=True, ignore_eos=True)
    with httpx.Client(base_url=served["url"], timeout=300) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # the request is decoding in its slot: hang up
    assert engine.wait_idle(timeout=120)
    after = engine.snapshot()
    assert after["finished_cancelled"] == before["finished_cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 200
    assert (after["active_slots"], after["queue_depth"]) == (0, 0)


BAD = [
    (dict(model="gpt-4", prompt="x"), "model"),
    (dict(model="builtin", prompt="x", max_tokens=CONTEXT), "max_tokens"),  # context overflow
    (dict(model="builtin", prompt="x", top_k=-2), "top_k"),
    (dict(model="builtin", prompt="x", top_k=2.5), "top_k"),
    (dict(model="builtin", prompt="x", top_p=0), "top_p"),
    (dict(model="builtin", prompt="x", top_p=1.5), "top_p"),
    (dict(model="builtin", prompt="x", temperature=-1), "temperature"),
    (dict(model="builtin", prompt="x", max_tokens=0), "max_tokens"),
    (dict(model="builtin", prompt="x", max_tokens="8"), "max_tokens"),
    (dict(model="builtin", prompt="x", n=0), "n"),
    (dict(model="builtin", prompt="x", n=9), "n"),  # past the server's max_n (8)
    (dict(model="builtin", prompt="x", stop=[""]), "stop"),
    (dict(model="builtin", prompt="x", seed=-1), "seed"),
    (dict(model="builtin", prompt="x", seed=1.5), "seed"),
    (dict(model="builtin", prompt="x", stream="yes"), "stream"),
    (dict(model="builtin"), "prompt"),
    (dict(model="builtin", prompt=["a", "b"]), "prompt"),
    (dict(model="builtin", prompt=[1, 2, 100000]), "prompt"),  # a token id outside the vocabulary
    (dict(model="builtin", prompt="x", top_k=2**31), "top_k"),  # past the engine's int32 column
    (dict(model="builtin", prompt="x", max_tokens=2.0), "max_tokens"),
    (dict(model="builtin", prompt="x\ud800y"), "prompt"),  # a lone surrogate (a JSON \ud800 escape): was a 500
    (dict(model="builtin", prompt="x", stop="\udc80"), "stop"),
    (dict(model="builtin", prompt="x", stop=0), "stop"),  # 0, false and {} were taken as no stop string
    (dict(model="builtin", prompt="x", stop=False), "stop"),
    (dict(model="builtin", prompt="x", stop={}), "stop"),
    (dict(model="builtin", prompt="x", presence_penalty=0.5), "presence_penalty"),  # these were ignored
    (dict(model="builtin", prompt="x", frequency_penalty=-1), "frequency_penalty"),
    (dict(model="builtin", prompt="x", best_of=3), "best_of"),
    (dict(model="builtin", prompt="x", response_format={"type": "json_object"}), "response_format"),
    (dict(model="builtin", prompt="x", stream_options={"include_usage": True}), "stream_options"),
    (dict(model="builtin", prompt="x" * CONTEXT), "prompt"),  # no room and no max_tokens given: was max_tokens
    # echo's prompt log-probabilities past the server's context: was a 200 (a forward the server was not sized for)
    (dict(model="builtin", prompt="x" * (CONTEXT + 1), echo=True, logprobs=0, max_tokens=0), "prompt"),
    # echo with max_tokens 0 and no logprobs: the prompt was not checked at all (a 200 with any ids, any length)
    (dict(model="builtin", prompt=[1, 2, 100000], echo=True, max_tokens=0), "prompt"),
    (dict(model="builtin", prompt="x" * (CONTEXT + 1), echo=True, max_tokens=0), "prompt"),
    (dict(model="builtin", prompt="x" * (CONTEXT + 8), max_tokens=4), "prompt"),  # the prompt alone: was max_tokens
    (dict(model="builtin", prompt="x", stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage"),  # was "include_usage", a field the body does not have
]


def test_bad_requests_get_400(served):
    with httpx.Client(base_url=served["url"], timeout=60) as http:
        for body, param in BAD:  # (json.dumps escapes the lone surrogates that httpx's json= cannot encode)
            r = http.post("/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param, body
        assert http.post("/v1/completions", content=b"{not json").status_code == 400
        for body in (b'{"model": "builtin", "prompt": "a\xffb"}', b"\x1f\x8b\x08\x00"):  # a stray byte, gzip
            r = http.post("/v1/completions", content=body)  # were "the body holds a number too long to read"
            assert r.status_code == 400 and "the body is not JSON text in UTF-8" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json=dict(model="builtin", messages=[{"role": "user"}]))
        assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")
        assert "exceeds the server's context" in http.post("/v1/completions", json=BAD[1][0]).json()["error"]["message"]
        assert http.get("/health").json()["status"] == "ok"
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        served["client"].completions.create(model="gpt-4", prompt="x", max_tokens=4)


def test_a_prompt_past_the_context_is_refused_before_its_ids_are_read(served, model, monkeypatch):
    """Issue 46, fourth probe round: a 15 MB prompt held the event loop (every client, every stream) for 2.3 s,
    tokenized on it and then checked id by id before its length. Now text is tokenized on a worker thread and a
    prompt longer than the context refused by its length alone."""
    from kdtree_jax import validate

    threads, rows = [], []
    encode, token_row = type(model.tokenizer).encode, validate.token_row
    monkeypatch.setattr(type(model.tokenizer), "encode",
                        lambda self, text: threads.append(threading.current_thread().name) or encode(self, text))
    monkeypatch.setattr(validate, "token_row", lambda ids, *a, **k: rows.append(len(ids)) or token_row(ids, *a, **k))
    with httpx.Client(base_url=served["url"], timeout=60) as http:
        for prompt in ("x" * 100_000, [120] * 100_000):
            for extra in ({}, dict(max_tokens=4), dict(echo=True, max_tokens=0)):
                r = http.post("/v1/completions", json=dict(model="builtin", prompt=prompt, **extra))
                error = r.json()["error"]
                assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
                assert error["param"] == "prompt" and "100000 tokens exceeds the server's context" in error["message"]
        r = http.post("/v1/chat/completions", json=dict(model="builtin", messages=[{"role": "user",
                                                                                    "content": "x" * 100_000}]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert rows == [] and threads and "kdtree-jax-http" not in threads, (rows, threads)


def test_chat_conflicts_unknown_routes_and_fields_that_ask_for_nothing(served):
    """Chat's lone surrogates, two different token limits and a prompt with no room are 400s naming the field; an
    unknown path or method gets OpenAI's error format naming the routes; the unsupported fields pass where they ask
    for nothing (null, 0, {}, "none", text)."""
    chat = dict(model="builtin", messages=[{"role": "user", "content": "hi"}])
    with httpx.Client(base_url=served["url"], timeout=300) as http:
        for body, param in [(dict(chat, messages=[{"role": "user", "content": "a\ud800"}]), "messages"),
                            (dict(chat, max_tokens=4, max_completion_tokens=8), "max_tokens"),
                            (dict(chat, max_tokens=4.0, max_completion_tokens=4), "max_tokens"),  # was a 200
                            (dict(chat, messages=[{"role": "user", "content": "x" * CONTEXT}]), "messages")]:
            r = http.post("/v1/chat/completions", content=json.dumps(body),
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        neutral = dict(presence_penalty=0, frequency_penalty=0.0, logit_bias={}, best_of=1, tool_choice="none",
                       response_format={"type": "text"}, suffix="", stream_options=None)
        r = http.post("/v1/completions", json=dict(model="builtin", prompt="x", max_tokens=2, temperature=0, **neutral))
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json=dict(chat, max_tokens=2, max_completion_tokens=2, temperature=0,
                                                        modalities=["text"], audio=None))
        assert r.status_code == 200, r.text
        # an answer in audio, or searched on the web, was answered in text without a word
        for field, value in (("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
                             ("web_search_options", {})):
            r = http.post("/v1/chat/completions", json=dict(chat, max_tokens=2, **{field: value}))
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        # eighth probe round: vLLM's extensions that change the tokens or the prompt, OpenAI's reasoning_effort and
        # completions' top_logprobs (chat's field) were ignored without a word
        for path, field, value in (("chat", "chat_template_kwargs", {"thinking": False}),
                                   ("chat", "add_generation_prompt", False), ("chat", "reasoning_effort", "high"),
                                   ("chat", "continue_final_message", True), ("", "min_p", 0.5),
                                   ("", "stop_token_ids", [10]), ("", "guided_choice", ["a"]),
                                   ("", "skip_special_tokens", False), ("", "top_logprobs", 2)):
            body = dict(chat, max_tokens=2) if path else dict(model="builtin", prompt="x", max_tokens=2)
            r = http.post(f"/v1/{path + '/' if path else ''}completions", json=dict(body, **{field: value}))
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}  # was dropped
        for extra in (dict(tool_calls=[call]), dict(function_call={"name": "f", "arguments": "{}"})):
            turns = [{"role": "user", "content": "hi"}, dict(role="assistant", content="", **extra)]
            r = http.post("/v1/chat/completions", json=dict(chat, messages=turns, max_tokens=2))
            error = r.json()["error"]
            assert (r.status_code, error["param"]) == (400, "messages") and next(iter(extra)) in error["message"]
        r = http.post("/v1/chat/completions", json=dict(chat, max_tokens=2, temperature=0, min_p=0, stop_token_ids=[],
                                                        add_generation_prompt=True, chat_template_kwargs={},
                                                        skip_special_tokens=True, top_logprobs=None))
        assert r.status_code == 200, r.text
        r = http.get("/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["message"].startswith(
            "Method Not Allowed: GET /v1/completions (the routes: POST /v1/completions,")
        r = http.post("/v1/complete", json=chat)
        assert r.status_code == 404 and r.json()["error"]["message"].startswith("Not Found: POST /v1/complete (")


def test_a_client_gone_before_its_body_is_not_a_server_error(served):
    """A client that closes the connection before the body its Content-Length promised was counted (and logged, with
    a traceback) as a 500: it is nginx's 499 now, and no 5xx."""
    import socket
    import time

    def counts():
        return _status_counts(served["url"])

    before = counts()
    host, port = served["url"].split("//")[1].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.2)
    for _ in range(100):
        after = counts()
        if after.get(499, 0) > before.get(499, 0):
            break
        time.sleep(0.05)
    assert after.get(499, 0) == before.get(499, 0) + 1 and after.get(500, 0) == before.get(500, 0), after


def test_a_body_past_the_limit_gets_413(model, served):
    """serve --max-request-mb: a body larger than the limit is refused with a 413 in OpenAI's format, whether it
    declares its length (refused before it is read) or comes chunked (counted as it comes); one under the limit is
    served; the server goes on."""
    limit = 2000
    server = BackgroundServer(create_app(served["engine"], model.tokenizer, "builtin", max_body_bytes=limit))
    body = {"model": "builtin", "prompt": "def f(", "max_tokens": 2, "temperature": 0}
    big = dict(body, prompt="x" * limit)

    def chunked(data: bytes):
        for i in range(0, len(data), 500):
            yield data[i:i + 500]

    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/completions", json=big)
            assert r.status_code == 413, r.text
            assert "larger than the server's limit of 2000 bytes" in r.json()["error"]["message"]
            r = http.post("/v1/completions", content=chunked(json.dumps(big).encode()),
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and "limit of 2000 bytes" in r.json()["error"]["message"], r.text
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    finally:
        server.stop()
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(served["engine"], model.tokenizer, "builtin", max_body_bytes=0)


def test_full_queue_gets_429(model, served):
    """Every slot busy with a long request and the queue full: the next request is refused, not queued."""
    engine = served["engine"]
    events = [queue.Queue() for _ in range(SLOTS)]
    long = [engine.submit(model.tokenizer.encode(PROMPTS[3]), max_tokens=200, ignore_eos=True, on_event=q.put)
            for q in events]
    for q in events:
        assert q.get(timeout=120).finish is None  # every long request holds a slot
    waiting = [engine.submit([65], max_tokens=1, on_event=lambda ev: None) for _ in range(QUEUE)]
    r = httpx.post(served["url"] + "/v1/completions", json=dict(model="builtin", prompt="x", max_tokens=2), timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    for request_id in long + waiting:
        engine.cancel(request_id)
    assert engine.wait_idle(timeout=120)
    assert engine.snapshot()["active_slots"] == 0


def test_more_choices_than_slots_and_queue_is_a_400_not_a_429(model, served):
    """Issue 46, eighth probe round: n past the slots plus the queue got a 429 ("retry later") on an idle server,
    every time: the queue can never take them all. It is a 400 naming n and the two limits."""
    engine = served["engine"]
    server = BackgroundServer(create_app(engine, model.tokenizer, "builtin", max_n=SLOTS + QUEUE + 1))
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json=dict(model="builtin", prompt="x", max_tokens=1, n=SLOTS + QUEUE + 1))
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (400, "n"), r.text
        assert f"{SLOTS} slots + {QUEUE} places in the queue" in error["message"]
    finally:
        server.stop()
    assert engine.snapshot()["queue_depth"] == 0


def test_a_failing_request_does_not_stop_the_engine(model, served, solo):
    engine = served["engine"]

    def broken(event: Event):
        raise RuntimeError("a consumer that fails")

    before = engine.snapshot()["finished_cancelled"]
    engine.submit(model.tokenizer.encode(PROMPTS[4]), max_tokens=30, on_event=broken)
    assert engine.wait_idle(timeout=120) and engine.snapshot()["finished_cancelled"] == before + 1
    tokens, _ = engine.complete(model.tokenizer.encode(PROMPTS[4]), max_tokens=MAX_TOKENS[0], timeout=120)
    assert tokens == solo(PROMPTS[4], MAX_TOKENS[0])
    broken_template = BackgroundServer(create_app(engine, model.tokenizer, "builtin", chat_template="{{ 1 / 0 }}"))
    try:
        with httpx.Client(base_url=broken_template.url, timeout=120) as http:
            r = http.post("/v1/chat/completions", json={"model": "builtin", "messages": [{"role": "user",
                                                                                         "content": "x"}]})
            assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]
            r = http.post("/v1/completions", json={"model": "builtin", "prompt": PROMPTS[4], "temperature": 0,
                                                   "max_tokens": MAX_TOKENS[0]})
            assert r.json()["choices"][0]["text"] == model.tokenizer.decode(solo(PROMPTS[4], MAX_TOKENS[0]))
    finally:
        broken_template.stop()


def test_metrics(served):
    text = httpx.get(served["url"] + "/metrics").text
    value = lambda name: float(re.search(rf"^kdtree_{name} (\S+)$", text, re.M).group(1))
    assert value("tau") > 1.5  # the embedded drafter's trees are accepted several tokens deep
    assert value("generated_tokens_total") > 0 and value("step_seconds") > 0
    assert (value("queue_depth"), value("active_slots"), value("max_batch")) == (0, 0, SLOTS)
    assert re.search(r'^kdtree_http_responses_total\{status="400"\} \d+$', text, re.M)
    assert re.search(r'^kdtree_requests_total\{outcome="cancelled"\} [1-9]', text, re.M)


def test_bench_serve_reads_tau_and_nodes_from_the_counters(served):
    """`kdtree-jax bench-serve` against the server: each concurrency's row carries the tau and the draft nodes per
    request-step from the server's counters (budget 8: every step verifies 8 nodes)."""
    from kdtree_jax.serving import bench_serve

    out = bench_serve.run(served["url"], [1, 2], rounds=1, max_tokens=6, prompt_chars=24, log=lambda line: None)
    for row in out["rows"]:
        assert row["tokens"] == 6 * row["concurrency"] and row["nodes_per_step"] == BUDGET
        assert 1.0 <= row["tau"] <= served["engine"]._method.tokens_per_step
    assert out["setup"]["server"]["budget"] == BUDGET
    full = dict(row_steps_total=4.0, step_tokens_total=10.0, verified_nodes_total=32.0)
    assert bench_serve._steps({}, full) == {} and bench_serve._steps(full, {}) == {}  # a reading failed: no columns
    assert bench_serve._steps(full, full) == {}  # no step between the readings
    assert bench_serve._steps(full, dict(row_steps_total=8.0, step_tokens_total=22.0, verified_nodes_total=64.0)) == \
        dict(tau=3.0, nodes_per_step=8.0)
    assert bench_serve._counters(served["url"] + "/v1", 30) == {}  # no /metrics there: nothing counted


def test_bench_serve_says_why_the_server_refused(served):
    """A request the server refuses (here: past its context, with the prompt; max_tokens alone past it is refused
    before any request) ends the run with the server's message, not its JSON."""
    from kdtree_jax.serving import bench_serve

    with pytest.raises(RuntimeError, match="the server answered 400: ") as refused:
        bench_serve.run(served["url"], [1], rounds=1, max_tokens=CONTEXT - 6, prompt_chars=24, log=lambda line: None)
    assert "{" not in str(refused.value) and "context" in str(refused.value)
    assert bench_serve._refusal(422, b'{"detail": "no such field"}') == "the server answered 422: no such field"
    assert bench_serve._refusal(502, b"<html>bad gateway</html>") == "the server answered 502: <html>bad gateway</html>"


def test_bench_serve_writes_the_runs_so_far_whole(served, tmp_path):
    """The benchmark writes its tables after each engine (a later failure keeps them): without the plot, json and md
    only, each replaced whole (no temporary left), the json readable back as the runs."""
    from kdtree_jax.serving import bench_serve

    run = bench_serve.run(served["url"], [1], rounds=1, max_tokens=4, prompt_chars=24, log=lambda line: None)
    (tmp_path / "partial.png").write_bytes(b"an earlier run's plot")  # must not stay beside the new tables
    paths = bench_serve.write([run], str(tmp_path), "partial", "title", "note", with_plot=False)
    assert sorted(os.path.basename(p) for p in paths) == ["partial.json", "partial.md"]
    assert sorted(os.listdir(tmp_path)) == ["partial.json", "partial.md"]
    with open(tmp_path / "partial.json") as f:
        assert json.load(f)[0]["rows"][0]["tokens"] == 4
    bench_serve.write([run, run], str(tmp_path), "partial", "title", with_plot=False)  # the next engine's runs
    with open(tmp_path / "partial.json") as f:
        assert len(json.load(f)) == 2
    assert (tmp_path / "partial.md").read_text().count(f"## {run['setup']['server']['method']}") == 2
    (tmp_path / "broken.json").mkdir()  # a write that fails: its temporary file is removed, nothing half-written
    with pytest.raises(OSError):
        bench_serve.write([run], str(tmp_path), "broken", "title", with_plot=False)
    assert sorted(os.listdir(tmp_path)) == ["broken.json", "partial.json", "partial.md"]


def test_text_stream_holds_back_stop_prefixes_and_partial_characters(model):
    ts = TextStream(model.tokenizer, ["STOP", "Q"], eos_id=model.tokenizer.eos_id)
    assert ts.feed(list(b"abcST")) == "abc"  # "ST" could begin "STOP"
    assert ts.feed(list("é".encode())[:1]) == ""  # half of a UTF-8 character waits
    assert ts.feed(list("é".encode())[1:] + [model.tokenizer.eos_id] + list(b"xSTO")) == "STéx" and not ts.stopped
    assert ts.feed(list(b"PyQ")) == "" and ts.stopped


def test_a_stop_string_is_not_matched_in_a_half_decoded_character(model):
    """A character whose bytes arrive in two events decodes as U+FFFD until its last byte: a stop string holding
    U+FFFD (a valid character) matched it there, ending the answer before an "é" the text never held; a real U+FFFD
    (a stray byte) still stops it."""
    e_acute = list("é".encode())
    ts = TextStream(model.tokenizer, ["\ufffd"], eos_id=model.tokenizer.eos_id)
    assert ts.feed(list(b"ab") + e_acute[:1]) == "ab" and not ts.stopped
    assert ts.feed(e_acute[1:]) + ts.feed([], final=True) == "é" and not ts.stopped and ts.count == 4
    ts = TextStream(model.tokenizer, ["x\ufffd"], eos_id=model.tokenizer.eos_id)
    assert ts.feed(list(b"ax") + e_acute[:1]) == "a" and not ts.stopped  # "x" is held back: it may begin the stop
    assert ts.feed([0xff]) == "" and ts.stopped  # the stray byte: "x" then a real U+FFFD, then a stop
    assert ts.count == 3  # up to the byte that became the real U+FFFD; the stray byte after it is dropped


def test_ar_engine_batched_prefill_and_seeded_sampling(model, solo):
    """The autoregressive engine (its own loop state and step): requests that arrive together are prefilled in one
    call per padded prompt length and each gets its solo `generate` tokens; a seeded sampled request gets the same
    tokens among them as alone."""
    encode = model.tokenizer.encode
    sampled = dict(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    burst = [PROMPTS[2], PROMPTS[3], PROMPTS[5]]  # prompts of 16, 16 and 32 bytes (padded: 16, 16, 32)
    events = {p: queue.Queue() for p in [PROMPTS[1], *burst]}
    with Engine(model.params, model.cfg, method="ar", max_batch=4, max_context=128,
                eos_id=model.tokenizer.eos_id) as engine:
        alone, _ = engine.complete(encode(PROMPTS[1]), timeout=300, **sampled)

        def arrive(event: Event):  # when the first request ends, four arrive at once (on the engine's thread)
            if event.finish is not None:
                engine.submit(encode(PROMPTS[1]), on_event=events[PROMPTS[1]].put, **sampled)
                for p in burst:
                    engine.submit(encode(p), max_tokens=MAX_TOKENS[0], on_event=events[p].put)

        calls = engine.snapshot()["prefill_calls"]
        engine.submit(encode(PROMPTS[0]), max_tokens=4, on_event=arrive)
        assert engine.wait_idle(timeout=300)
        assert engine.snapshot()["prefill_calls"] - calls == 3  # the first; the three of 16 bytes; the one of 32

    def tokens(q: queue.Queue) -> list[int]:
        out = []
        while True:
            event = q.get_nowait()
            out += event.tokens
            if event.finish is not None:
                return out

    assert tokens(events[PROMPTS[1]]) == alone
    assert [tokens(events[p]) for p in burst] == [solo(p, MAX_TOKENS[0], "ar") for p in burst]


def test_auto_budget_engine_gives_each_greedy_request_its_solo_tokens(model, solo):
    """budget="auto" in the engine (a cost model that makes the planned steps verify part of the tree, a plan every
    third step, tiers 4 and 8): 10 greedy requests through 4 slots, joining mid-flight, each get exactly their solo
    tokens; the chunk is rounded up to whole windows of 3 steps; the verified nodes are counted and lie between none
    and the whole tree; a sampled request (top_k: the per-row filtered sampler in the plan) runs to its length; bad
    auto arguments are clear errors."""
    from kdtree_jax.budget import CostModel

    encode = model.tokenizer.encode
    tiers = (4, 8)
    cost = CostModel.from_points(tiers, SLOTS, [[(1, 1.0 + 0.1 * i), (1e4, 1.0 + 0.1 * i + 0.02 * 1e4)]
                                                for i in range(2)], replan=3, fixed=[1.05, 1.3])
    with Engine(model.params, model.cfg, method="ddtree", drafter=model.drafter, budget="auto", max_budget=BUDGET,
                cost_model=cost, max_batch=SLOTS, max_context=CONTEXT, chunk_steps=4,
                eos_id=model.tokenizer.eos_id) as engine:
        setup = engine.describe()
        assert (setup["budget"], setup["tiers"], setup["replan"], setup["chunk_steps"]) == ("auto", [4, 8], 3, 6)
        events = {i: queue.Queue() for i in range(len(PROMPTS))}
        for i, p in enumerate(PROMPTS):
            engine.submit(encode(p), max_tokens=MAX_TOKENS[i % 2], on_event=events[i].put)
        sampled, finish = engine.complete(encode(PROMPTS[1]), max_tokens=20, temperature=0.8, top_k=40, seed=7,
                                          ignore_eos=True, timeout=300)
        assert engine.wait_idle(timeout=300)
        counts = engine.snapshot()
    for i, p in enumerate(PROMPTS):
        got = []
        while True:
            event = events[i].get_nowait()
            assert event.error is None, event.error
            got += event.tokens
            if event.finish is not None:
                break
        assert got == solo(p, MAX_TOKENS[i % 2]), p
    assert finish == "length" and len(sampled) == 20 and all(0 <= t < model.cfg.vocab_size for t in sampled)
    nodes = counts["step_nodes"] / counts["row_steps"]
    assert 0 < nodes < BUDGET, nodes
    with pytest.raises(ValueError, match="method='ar' has no budget"):
        Engine(model.params, model.cfg, method="ar", budget="auto", max_batch=SLOTS, max_context=CONTEXT)
    with pytest.raises(ValueError, match="measured for batch 4"):
        Engine(model.params, model.cfg, method="ddtree", drafter=model.drafter, budget="auto", max_budget=BUDGET,
               cost_model=cost, max_batch=2, max_context=CONTEXT)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_context=0), "power of two >= 64"),
    (dict(max_context=96), "power of two >= 64"),
    (dict(max_context=64, budget=64), "no room for a request beside the 65 slots.*max_context >= 128"),
    (dict(max_context=64, budget="auto", max_budget=64), "no room.*budget 64"),  # before any calibration
])
def test_engine_contexts_that_hold_no_request_are_refused(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(model.params, model.cfg, method="ddtree", drafter=model.drafter, max_batch=2,
               **{"budget": 8, **kwargs})


def test_engine_refuses_params_in_another_dtype_than_cfg(model):
    """Issue 46, fifth probe round: generate and stream named params of another dtype than cfg.dtype, the Engine
    took them (and failed inside JAX at its first request). Now it refuses them at construction, in the same words."""
    import dataclasses

    other = dataclasses.replace(model.cfg, dtype="bfloat16" if model.cfg.dtype == "float32" else "float32")
    with pytest.raises(ValueError, match=f"params.embed has dtype {model.cfg.dtype} but cfg.dtype is "
                                         f"'{other.dtype}': decoding runs in cfg.dtype"):
        Engine(model.params, other, method="ar", max_batch=1, max_context=64).close()


def test_engine_and_app_sizes_are_checked_at_construction(model):
    """Issue 46, sixth probe round: Engine(chunk_steps=2**31) was built and then failed every request (an
    OverflowError from its int32 loop); create_app took max_n 0 (every request giving n refused), -1, 1.5 and an
    empty model name. Each is now refused when made, naming the argument."""
    for name in ("max_batch", "max_queue", "chunk_steps"):
        with pytest.raises(ValueError, match=rf"{name} must be an integer in \[1, 2\*\*31\), got 2147483648"):
            Engine(model.params, model.cfg, method="ar", max_context=64, **{name: 2**31})
    engine = Engine(model.params, model.cfg, method="ar", max_batch=1, max_context=64)
    try:
        for max_n in (0, -1, 1.5, True, 2**31):
            with pytest.raises(ValueError, match="max_n must be an integer in"):
                create_app(engine, model.tokenizer, "builtin", max_n=max_n)
        with pytest.raises(ValueError, match="model_name must be a non-empty string"):
            create_app(engine, model.tokenizer, " ")
    finally:
        engine.close()


def test_readme_openai_example_runs(served, capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    example = next(b for b in blocks if "from openai import OpenAI" in b)
    exec(example.replace("http://127.0.0.1:8000", served["url"]), {})
    printed = capsys.readouterr().out
    assert "completion_tokens=64" in printed and len(printed) > 100  # the completion, its usage, the streamed chat


def test_cli_keeps_compiled_programs_across_runs(tmp_path):
    """`kdtree-jax generate` (serve too) keeps its compiled programs in JAX's persistent compilation cache."""
    env = dict(os.environ, KDTREE_JAX_COMPILATION_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu", XLA_FLAGS="")
    argv = [sys.executable, "-m", "kdtree_jax.cli", "generate", "--max-new-tokens", "4", "--prompt", "x"]
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=300)
    assert any((tmp_path / "cache").iterdir())


def test_stop_prefix_is_the_longest_held_end_and_grows_lazily():
    """StopPrefix.held(text) = the largest k < len(s) with text ending in s[:k] (against the definition, on random
    strings over two letters, where borders abound); a 10**6-character stop string costs nothing up front and its
    failure table grows only as far as a text matched it."""
    rng = np.random.default_rng(0)
    for _ in range(400):
        s = "".join(rng.choice(list("ab"), int(rng.integers(1, 9))))
        text = "".join(rng.choice(list("ab"), int(rng.integers(0, 12))))
        want = max((k for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        assert StopPrefix(s).held(text) == want, (s, text)
    long = StopPrefix("Z" * 10**6)
    assert long.held("abc" * 1000) == 0 and len(long.fail) == 1
    assert long.held("xZZZ") == 3 and len(long.fail) <= 4


def test_a_long_stop_string_does_not_stall_the_server_and_usage_counts_to_the_stop(served, solo, model):
    """A 1 MB stop string took ~12 s of the event loop per streamed chunk (the held prefix was found in quadratic
    time); completion_tokens counted the tokens generated after a stop string."""
    prompt = PROMPTS[0]
    body = dict(model="builtin", prompt=prompt, max_tokens=8, temperature=0, stop=["Z" * 10**6])
    with httpx.Client(base_url=served["url"], timeout=120) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.elapsed.total_seconds() < 30, r.elapsed
        tokens = solo(prompt, 30)
        text = model.tokenizer.decode(tokens)
        stop = text[3:5]  # a stop string a few tokens in
        first = next(k for k in range(1, len(tokens) + 1) if stop in model.tokenizer.decode(tokens[:k]))
        r = http.post("/v1/completions", json=dict(body, max_tokens=30, stop=[stop])).json()
        assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == text[:text.find(stop)]
        assert r["usage"]["completion_tokens"] == first < 30


def _status_counts(url: str) -> dict[int, float]:
    text = httpx.get(url + "/metrics").text
    return {int(k): float(v) for k, v in re.findall(r'^kdtree_http_responses_total\{status="(\d+)"\} (\S+)$', text,
                                                     re.M)}


def test_a_whole_answer_whose_client_left_frees_its_slot(served):
    """A non-streamed request went on decoding to max_tokens after its client hung up (only streams were
    cancelled); and its answer, which nobody reads, was counted as a 200: it is nginx's 499 now."""
    engine = served["engine"]
    assert engine.wait_idle(timeout=120)
    before, statuses = engine.snapshot(), _status_counts(served["url"])
    body = json.dumps(dict(model="builtin", prompt=PROMPTS[3], max_tokens=200, temperature=0, ignore_eos=True))
    host, port = served["url"].removeprefix("http://").split(":")
    import socket
    import time
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 60
        while engine.snapshot()["generated_tokens"] == before["generated_tokens"] and time.monotonic() < deadline:
            time.sleep(0.02)  # decoding: hang up
    assert engine.wait_idle(timeout=120)
    after = engine.snapshot()
    assert after["finished_cancelled"] == before["finished_cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 200
    assert (after["active_slots"], after["queue_depth"]) == (0, 0)
    for _ in range(100):  # the response is counted once the handler returns
        now = _status_counts(served["url"])
        if now.get(499, 0) > statuses.get(499, 0):
            break
        time.sleep(0.05)
    assert now.get(499, 0) == statuses.get(499, 0) + 1 and now.get(200, 0) == statuses.get(200, 0), now


def test_only_the_documented_routes_and_short_errors(served):
    """FastAPI's /docs, /redoc and /openapi.json are not served, a trailing slash is an unknown path (was a bare 307),
    HEAD /health answers, and a 400 does not send back a huge field whole."""
    with httpx.Client(base_url=served["url"], timeout=60) as http:
        for path in ("/docs", "/redoc", "/openapi.json"):
            r = http.get(path)
            assert r.status_code == 404 and "the routes:" in r.json()["error"]["message"], path
        r = http.post("/v1/completions/", json=dict(model="builtin", prompt="x", max_tokens=2))
        assert r.status_code == 404 and "the routes:" in r.json()["error"]["message"]
        assert http.head("/health").status_code == 200 and http.head("/v1/models").status_code == 200
        assert http.head("/metrics").status_code == 200  # was a 405 where the other GET routes answer HEAD
        r = http.post("/v1/completions", json=dict(model="A" * 100_000, prompt="x"))
        assert r.status_code == 400 and len(r.content) < 1000 and "100002 characters" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json=dict(model="builtin", prompt="x", max_tokens="9" * 100_000))
        assert r.status_code == 400 and len(r.content) < 1000
        r = http.get("/health" + "a" * 60_000)  # the 404 sent the whole path back (60 kB; httpx sends up to 64 kB)
        assert r.status_code == 404 and len(r.content) < 1000 and "60007 characters" in r.json()["error"]["message"]
        # valid JSON with an integer past Python's 4,300-digit limit was called "not valid JSON"
        r = http.post("/v1/completions", content=b'{"model": "builtin", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
                      headers={"content-type": "application/json"})
        assert r.status_code == 400 and "a number too long to read" in r.json()["error"]["message"], r.text


def test_a_body_that_does_not_arrive_gets_408(model, served):
    """A client that declares a body and sends part of it held its connection and a task forever (slowloris)."""
    import socket
    server = BackgroundServer(create_app(served["engine"], model.tokenizer, "builtin", body_timeout=0.5))
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")
            reply = b""
            while b"within" not in reply and (part := sock.recv(4096)):  # the headers and the body may come apart
                reply += part
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in reply, reply
    finally:
        server.stop()
    with pytest.raises(ValueError, match="body_timeout"):
        create_app(served["engine"], model.tokenizer, "builtin", body_timeout=float("nan"))


def _read_to_close(sock) -> bytes:
    reply = b""
    while part := sock.recv(4096):
        reply += part
    return reply


def test_a_head_that_does_not_arrive_closes_the_connection(model, served):
    """uvicorn times a connection out only after a response: one that sent nothing, or part of its request line and
    headers (slowloris: a byte at a time), held a socket forever. The head has a deadline from the connection's start
    (or the last response's end) that trickled bytes do not move."""
    import socket
    server = BackgroundServer(create_app(served["engine"], model.tokenizer, "builtin"), head_timeout=1.0)
    try:
        address = server.url.removeprefix("http://").split(":")
        address = (address[0], int(address[1]))
        with socket.create_connection(address, timeout=30) as sock:  # nothing sent: closed, nothing said
            t0 = time.monotonic()
            assert _read_to_close(sock) == b"" and time.monotonic() - t0 < 20
        with socket.create_connection(address, timeout=30) as sock:  # a head a byte every 0.1 s: 408 at ~1 s
            head, reply, t0 = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100, b"", time.monotonic()
            sock.settimeout(0.1)
            for byte in head:
                try:
                    sock.sendall(bytes([byte]))
                    if part := sock.recv(4096):
                        reply += part
                    else:
                        break
                except TimeoutError:
                    continue
                except OSError:  # reset by the close
                    break
            assert reply.startswith(b"HTTP/1.1 408"), reply
            assert time.monotonic() - t0 < 8  # the 100-byte trickle alone takes >= 10 s
        with socket.create_connection(address, timeout=30) as sock:  # one request answered, the next cut short
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")
            reply = _read_to_close(sock)
            assert reply.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in reply, reply
    finally:
        server.stop()
    with pytest.raises(ValueError, match="head_timeout"):
        BackgroundServer(create_app(served["engine"], model.tokenizer, "builtin"), head_timeout=0)


@pytest.mark.parametrize("request_bytes, reason", [
    (b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n", "Missing mandatory Host: header"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
     "conflicting Content-Length headers"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
     "illegal chunk header"),
])
def test_a_request_that_is_not_http_gets_a_json_400_with_the_reason(served, request_bytes, reason):
    """uvicorn answered a request h11 cannot parse with the plain text 'Invalid HTTP request received.', naming
    nothing; it is the server's JSON error now, with h11's reason, and the connection is closed."""
    import socket

    host, port = served["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request_bytes)
        head, _, body = _read_to_close(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["message"].startswith("the request is not valid HTTP/1.1: ") and reason in error["message"], error


def test_background_server_connections_send_without_delay():
    """The benchmarks' and tests' server gives its connections TCP_NODELAY, as uvicorn's own sockets (the CLI's)
    have it: with a listening socket of proto 0 (`socket.create_server`) asyncio left it off, and every response after
    the first on a kept-alive connection waited ~40 ms for a delayed acknowledgement, which inflated every TTFT the
    serving benchmarks measured. A bare ASGI app, so that no engine is involved."""
    import socket

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    server = BackgroundServer(app)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert [client.get("/").text for _ in range(3)] == ["ok"] * 3  # one kept-alive connection
            sockets = server.connection_sockets()
            assert len(sockets) == 1
            assert sockets[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.stop()


def test_load_then_shutdown_leaves_nothing_behind(served):
    """A bounded load (streamed, whole, cut short by a stop string or a hang-up), then: every slot free, and after
    shutdown no thread or task of the server or the engine remains."""
    url, engine = served["url"], served["engine"]

    def one(i):
        body = dict(model="builtin", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS[i % 2], temperature=0)
        with httpx.Client(base_url=url, timeout=300) as http:
            if i % 3 == 0:
                return http.post("/v1/completions", json=dict(body, stop=["e"])).status_code
            with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
                for line in r.iter_lines():
                    if i % 3 == 1 and line.startswith("data: "):
                        break  # hang up early
                return r.status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert set(pool.map(one, range(18))) == {200}
    assert engine.wait_idle(timeout=120)
    assert (engine.snapshot()["active_slots"], engine.snapshot()["queue_depth"]) == (0, 0)
    assert served["server"].other_tasks() == []
    served["shutdown"]()
    assert not engine.alive
    assert set(threading.enumerate()) == served["threads_before"]
