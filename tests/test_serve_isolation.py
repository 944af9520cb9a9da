"""One request never hurts another in `kdtree-jax serve` (docs/reliability.md), on the embedded model (ar, 2 slots).

A property test (hypothesis) sends random request bodies, each field in or out of its range, and malformed bodies,
while greedy streams run: every bad body gets a 4xx, every good one a 200, every stream equals its solo `generate`
answer, and /metrics counts no 5xx. Then failures are injected: a prefill that raises for one request, a text
stream that raises for one request: that request alone fails (its client is told), the others go on.
"""

import json
import queue
import re
import string
import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kdtree_jax as kj  # noqa: E402
from kdtree_jax.serving import engine as engine_module  # noqa: E402
from kdtree_jax.serving import serve  # noqa: E402
from kdtree_jax.serving.engine import Engine  # noqa: E402
from kdtree_jax.serving.serve import BackgroundServer, create_app  # noqa: E402

SLOTS, CONTEXT = 2, 128
STREAM_PROMPT, STREAM_TOKENS = "def f(x):\n", 48  # 10 bytes: padded to 16, like the random prompts


@pytest.fixture(scope="module")
def model():
    return kj.load("builtin")


@pytest.fixture(scope="module")
def served(model):
    engine = Engine(model.params, model.cfg, method="ar", max_batch=SLOTS, max_context=CONTEXT,
                    eos_id=model.tokenizer.eos_id, warmup=(8, 16))  # every prompt below is padded to 8 or 16
    server = BackgroundServer(create_app(engine, model.tokenizer, "builtin"))
    yield dict(engine=engine, url=server.url)
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def solo_text(model):
    """The text a greedy request for the stream's prompt must get: `generate` on that prompt alone."""
    tok = model.tokenizer
    tokens = kj.generate(model, [tok.encode(STREAM_PROMPT)], max_new_tokens=STREAM_TOKENS, eos_id=tok.eos_id).tokens[0]
    return tok.decode([t for t in tokens if t != tok.eos_id])


def stream_text(http: httpx.Client, body: dict) -> tuple[str, list[dict]]:
    """(the streamed text, the error events) of a streamed completion; it must end with [DONE]."""
    text, errors, lines = [], [], []
    with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        event = json.loads(line[6:])
        if "error" in event:
            errors.append(event["error"])
        else:
            text.append(event["choices"][0]["text"])
    return "".join(text), errors


class GreedyStreams:
    """Greedy streams of STREAM_PROMPT, one after the other on a thread, until stopped: their texts."""

    def __init__(self, url: str):
        self.texts, self.errors = [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,))
        self._thread.start()

    def _run(self, url: str) -> None:
        body = dict(model="builtin", prompt=STREAM_PROMPT, max_tokens=STREAM_TOKENS, temperature=0)
        with httpx.Client(base_url=url, timeout=300) as http:
            while not self._stop.is_set():
                text, errors = stream_text(http, body)
                self.texts.append(text)
                self.errors += errors

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def metrics(url: str) -> dict[int, float]:
    """HTTP status -> responses counted by /metrics."""
    text = httpx.get(url + "/metrics").text
    return {int(k): float(v) for k, v in re.findall(r'^kdtree_http_responses_total\{status="(\d+)"\} (\S+)$', text,
                                                     re.M)}


# ---------------------------------------------------------------------------------------------------------------
# Random bodies: each field drawn in range (good) or out of it (bad)
# ---------------------------------------------------------------------------------------------------------------

JUNK = st.one_of(st.text(max_size=3), st.lists(st.integers(0, 9), max_size=2),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
NOT_FINITE = st.sampled_from([float("nan"), float("inf"), -float("inf")])


def field(good, bad):
    """A strategy of (value, whether it is in range): out of range one time in ten, so that about half the bodies
    are good throughout."""
    return st.integers(0, 9).flatmap(lambda i: bad.map(lambda v: (v, False)) if i == 0 else
                                     good.map(lambda v: (v, True)))


def ints_out_of(low: int, high: int):
    return st.one_of(st.integers(max_value=low - 1), st.integers(min_value=high, max_value=2**80))


FIELDS = {
    "model": field(st.just("builtin"), st.one_of(st.text(max_size=5), st.integers())),
    "prompt": field(st.one_of(st.text(string.ascii_letters + string.digits + " ():\n", min_size=1, max_size=16),
                              st.lists(st.integers(0, 255), min_size=1, max_size=16)),
                    st.one_of(st.just(""), st.just([]), st.integers(), st.lists(st.integers(264, 2**70), min_size=1),
                              st.lists(st.integers(max_value=-1), min_size=1), st.lists(st.booleans(), min_size=1),
                              st.lists(st.text(max_size=2), min_size=2, max_size=3))),
    # good: up to 4 tokens (quick); bad: past the context (including int32's range), floats, junk
    "max_tokens": field(st.integers(1, 4), st.one_of(ints_out_of(1, CONTEXT), st.floats(), st.booleans(), JUNK)),
    "temperature": field(st.one_of(st.just(0), st.floats(0.05, 2.0)),
                         st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=2.001), st.just(1e-40), NOT_FINITE,
                                   st.booleans(), JUNK)),
    "top_p": field(st.floats(0.05, 1.0), st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.001),
                                                   st.just(1e-40), NOT_FINITE, st.booleans(), JUNK)),
    "top_k": field(st.integers(-1, 2**31 - 1), st.one_of(ints_out_of(-1, 2**31), st.floats(), st.booleans(), JUNK)),
    "seed": field(st.integers(0, 2**63 - 1), st.one_of(ints_out_of(0, 2**63), st.floats(), st.booleans(), JUNK)),
    "stop": field(st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
                  st.one_of(st.just(""), st.lists(st.text(min_size=1), min_size=5, max_size=6),
                            st.lists(st.integers(), min_size=1, max_size=2))),
    "n": field(st.just(1), st.one_of(ints_out_of(1, 9), st.floats(), st.booleans())),  # past the max_n of 8
    "ignore_eos": field(st.booleans(), st.one_of(st.integers(0, 1), st.text(max_size=2))),
    "stream": field(st.booleans(), st.one_of(st.integers(0, 1), st.text(max_size=2))),
}
MALFORMED = [b"[" * 100_000, b'{"model": ' * 50_000, b"{", b"[]", b"null", b'"builtin"', b"\xff\xfe", b"",
             b'{"model": "builtin", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"]


@st.composite
def bodies(draw):
    """(body bytes, whether every field is in range): a JSON object with "model", "prompt" and some of the other
    fields, or a malformed body."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(MALFORMED)), False
    body, good = {}, True
    for name, strategy in FIELDS.items():
        required = name in ("model", "prompt")  # left out one time in twenty: a bad body
        if draw(st.integers(0, 19)) > 0 if required else draw(st.booleans()):
            value, ok = draw(strategy)
            body[name], good = value, good and ok
    return json.dumps(body).encode(), good and "model" in body and "prompt" in body


def test_random_bodies_never_hurt_a_stream(served, solo_text):
    url = served["url"]
    before = metrics(url)
    streams = GreedyStreams(url)
    seen = {True: 0, False: 0}
    try:
        with httpx.Client(base_url=url, timeout=300) as http:

            @settings(max_examples=60, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
            @given(bodies())
            def one(case):
                body, good = case
                seen[good] += 1
                if good and json.loads(body).get("stream"):
                    _, errors = stream_text(http, json.loads(body))
                    assert not errors, (body, errors)
                    return
                r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                if good:
                    assert r.status_code == 200, (body, r.text)
                    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
                else:
                    assert 400 <= r.status_code < 500, (body[:200], r.status_code, r.text[:300])
                    assert r.json()["error"]["message"]

            one()
    finally:
        streams.stop()
    assert min(seen.values()) >= 10, seen  # both kinds were sent
    assert streams.texts and set(streams.texts) == {solo_text} and not streams.errors
    after = metrics(url)
    assert not {s: n for s, n in after.items() if s >= 500 and n > before.get(s, 0)}, after
    assert after.get(400, 0) > before.get(400, 0) and after.get(200, 0) > before.get(200, 0)
    assert served["engine"].wait_idle(timeout=60) and served["engine"].snapshot()["active_slots"] == 0


# ---------------------------------------------------------------------------------------------------------------
# Failures injected into one request
# ---------------------------------------------------------------------------------------------------------------


def test_a_failing_prefill_fails_its_request_alone(served, model, solo_text, monkeypatch):
    """The prefill of one request raises (prompts padded to 32 tokens, here): that request gets the error, the
    request decoding beside it goes on to its solo answer and the engine is not reset under it."""
    engine, tok = served["engine"], model.tokenizer
    admit = engine_module._admit

    def failing(method, params, cfg, state, keys, slots, tokens, *args, **kwargs):
        if tokens.shape[1] == 32:
            raise RuntimeError("an injected prefill failure")
        return admit(method, params, cfg, state, keys, slots, tokens, *args, **kwargs)

    monkeypatch.setattr(engine_module, "_admit", failing)
    before = engine.snapshot()
    running, failed = queue.Queue(), queue.Queue()
    engine.submit(tok.encode(STREAM_PROMPT), max_tokens=STREAM_TOKENS, on_event=running.put)
    event = running.get(timeout=120)
    assert event.finish is None  # decoding in its slot
    engine.submit(tok.encode("x" * 20), max_tokens=4, on_event=failed.put)
    tokens = event.tokens
    event = failed.get(timeout=120)
    assert (event.finish, event.error) == ("error", "RuntimeError: an injected prefill failure")
    while True:
        event = running.get(timeout=120)
        tokens += event.tokens
        if event.finish is not None:
            break
    assert event.finish in ("stop", "length") and tok.decode([t for t in tokens if t != tok.eos_id]) == solo_text
    after = engine.snapshot()
    assert after["finished_error"] == before["finished_error"] + 1 and engine.wait_idle(timeout=60)


def test_a_failing_stream_fails_alone(served, solo_text, monkeypatch):
    """Decoding one request's text raises: its stream ends with an error event and [DONE], a greedy stream beside
    it gets its solo answer, and the next requests are served."""
    feed = serve.TextStream.feed

    def failing(self, ids, final=False):
        if "BOOM" in self.stop:
            raise UnicodeError("an injected decoding failure")
        return feed(self, ids, final)

    monkeypatch.setattr(serve.TextStream, "feed", failing)
    streams = GreedyStreams(served["url"])
    try:
        with httpx.Client(base_url=served["url"], timeout=300) as http:
            text, errors = stream_text(http, dict(model="builtin", prompt="abc", max_tokens=8, stop=["BOOM"]))
            assert text == "" and len(errors) == 1 and "an injected decoding failure" in errors[0]["message"]
            r = http.post("/v1/completions", json=dict(model="builtin", prompt="abc", max_tokens=8, stop="BOOM"))
            assert r.status_code == 500 and "an injected decoding failure" in r.json()["error"]["message"]
            assert http.post("/v1/completions", json=dict(model="builtin", prompt="abc", max_tokens=2)).status_code \
                == 200
    finally:
        streams.stop()
    assert set(streams.texts) == {solo_text} and not streams.errors
    assert served["engine"].wait_idle(timeout=60) and served["engine"].snapshot()["active_slots"] == 0


def test_warmup_all_compiles_every_prefill(model):
    """Engine(warmup="all") (serve --warmup all) compiles, before it starts, the prefill of every padded prompt length
    and admission size and the decoding chunk in every form a request can ask for (greedy, sampled, filtered, each
    with and without log-probabilities): afterwards requests of every length, alone and two together, of every
    kind, compile nothing. Without the warm-up a request of a length not seen before compiles a prefill (the
    control: the count can move)."""
    tok = model.tokenizer
    context = 64
    admit, advance = engine_module._admit, engine_module._advance

    def prompt(n):
        return [tok.encode("x")[0]] * n

    def run(engine, n, **kw):
        done = queue.Queue()
        engine.submit(prompt(n), max_tokens=3, on_event=lambda e: e.finish and done.put(e), **kw)
        return done

    with Engine(model.params, model.cfg, method="ar", max_batch=2, max_context=context, eos_id=tok.eos_id) as cold:
        before = admit._cache_size()
        cold.complete(prompt(40), max_tokens=2)  # padded to 64 rows
        assert admit._cache_size() > before
    with Engine(model.params, model.cfg, method="ar", max_batch=2, max_context=context, eos_id=tok.eos_id,
                warmup="all") as warm:
        compiled = admit._cache_size(), advance._cache_size()
        kinds = [dict(), dict(temperature=1.0, seed=1), dict(temperature=1.0, top_k=5, seed=2), dict(logprobs=2),
                 dict(temperature=0.7, top_p=0.9, logprobs=0, seed=3)]
        for n, kind in zip((1, 7, 9, 16, 17, 33, 50, context - 4), kinds * 2):
            assert run(warm, n, **kind).get(timeout=120).error is None
        together = [run(warm, n, **kind) for n, kind in ((3, kinds[1]), (30, kinds[3]))]  # admitted in one call
        assert all(done.get(timeout=120).error is None for done in together)
        assert (admit._cache_size(), advance._cache_size()) == compiled
    with pytest.raises(ValueError, match="warmup must be prompt lengths or 'all'"):
        Engine(model.params, model.cfg, method="ar", max_batch=2, max_context=context, warmup="every")
