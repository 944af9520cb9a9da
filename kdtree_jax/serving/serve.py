"""`kdtree-jax serve`: an OpenAI-compatible HTTP API (FastAPI on uvicorn) over the continuous-batching `Engine`.

Endpoints: POST /v1/completions and /v1/chat/completions (a JSON answer, or with "stream": true server-sent events
ending with `data: [DONE]`), GET /v1/models, /health and /metrics (Prometheus text format).

Request fields: model (the served name), prompt or messages, max_tokens (chat: max_completion_tokens too),
temperature (default 1, as OpenAI's API; 0 is greedy), top_p (in (0, 1]), top_k (vLLM's extension: an integer >= 1;
absent, 0 or -1: none), each request its own, stop (a string or a list of up to 4), seed (fixes every token drawn,
whatever else is in flight, with a fixed budget; absent: the server picks one), stream, stream_options.include_usage,
n (choices, up to the server's max_n: one engine request each, choice i with seed + i), ignore_eos (vLLM's extension:
run to max_tokens), logprobs (completions: 0 .. 5 alternatives; chat: true, with top_logprobs 0 .. 20), echo
(completions: the prompt before the text, with its tokens' log-probabilities when logprobs is given; max_tokens 0
then answers the prompt alone). The log-probabilities are the target's (before temperature, top_k and top_p) at the
committed tokens, streamed with their text; the end-of-sequence token, which adds no text, has none. The fields
of OpenAI's API that are not implemented (`UNSUPPORTED`: suffix, logit_bias, tools, penalties, best_of,
response_format, modalities, audio, reasoning_effort, ...), and vLLM's sampling, output and chat template extensions
(min_p, stop_token_ids, guided_json, chat_template_kwargs, ...), are refused with a 400 unless they ask for nothing
(null, 0, {}); other fields are ignored.
Every field is checked by the rules of `kdtree_jax.validate` (those of `generate`), against the dtype and range of the
engine column it is stored in, before the request reaches a slot.
Errors are OpenAI-style JSON {"error": {"message", "type", "param", "code"}}: 400 for a bad request (context overflow,
unknown model, bad parameter, a body that is not a JSON object), 429 when the waiting queue is full, 500 when the model
fails on a request, 503 when the engine is down or the server is stopping. A request that fails while it is prepared,
decoded or streamed fails alone: its client gets the error (a stream: an error event, then [DONE]) and the other
requests go on. A client that disconnects, or a stop string, cancels its request and frees its slot.

`run` stops gracefully on SIGTERM or Ctrl-C: new requests get 503, those in flight get up to a shutdown timeout, then
each still open ends with an error (an error event and [DONE] for a stream); a second Ctrl-C stops the process at once.

Chat prompts use the checkpoint's chat template (`chat_template.jinja`, or "chat_template" in
tokenizer_config.json), else EMBEDDED_CHAT_TEMPLATE: one line "role: content" per message, then "assistant:".

This module needs the `serve` extra (fastapi, uvicorn, jinja2); the rest of the package does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import AsyncIterator, Callable

import h11
import jinja2.sandbox
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import validate
from ..checkpoint import CheckpointError, open_regular, read_json
from .engine import ContextOverflow, Engine, EngineClosed, Event, Histogram, QueueFull
from .heap import HeapTrimmer
from ..tokenizer import TOKENIZER_CONFIG_FILE

log = logging.getLogger("kdtree_jax.serving.serve")

EMBEDDED_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MAX_STOP_STRINGS = 4
DEFAULT_MAX_TOKENS = 256  # when a request gives none (and the context has room)
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds the requests in flight get to finish when the server is stopped
DEFAULT_MAX_N = 8  # choices per request (n), when the server is not told
BODY_TIMEOUT_S = 60.0  # a request body must arrive within this (nginx's client_body_timeout)
HEAD_TIMEOUT_S = 60.0  # a request line and headers must arrive within this (nginx's client_header_timeout)
DISCONNECT_POLL_S = 0.25  # how often a whole (not streamed) answer looks whether its client has gone
DEFAULT_MAX_BODY_BYTES = 16_000_000  # a request body past this gets a 413 (a prompt of 8k tokens: well under 1 MB)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limits: `logprobs` of /v1/completions, `top_logprobs` of chat
MAX_CHAT_TOP_LOGPROBS = 20
ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"
ABORT_GRACE_S = 2.0  # seconds the streams ended by a stop get to send their error event and [DONE]


def load_chat_template(model_dir: str | None) -> str:
    """The chat template of a checkpoint directory (its chat_template.jinja, else tokenizer_config.json's
    "chat_template", a string or a list of named templates of which "default" is used), else EMBEDDED_CHAT_TEMPLATE.
    A CheckpointError names a template file that is there but is not a regular file (a directory, a FIFO, which
    would block, a symlink loop or to nothing: taken as no file, the embedded template was used without a word), is
    not UTF-8, or is not a Jinja template (a syntax error: the server failed only once the model had loaded)."""
    if model_dir:
        path = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
        if os.path.lexists(path):
            with open_regular(path, "rb") as f:
                raw = f.read()
            try:
                return _parsed(raw.decode("utf-8"), path)
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        path = os.path.join(model_dir, TOKENIZER_CONFIG_FILE)
        if os.path.lexists(path):
            template = read_json(path).get("chat_template")  # a malformed file: an error naming it
            if isinstance(template, list):
                template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
            if isinstance(template, str):
                return _parsed(template, f"{path} (chat_template)")
    return EMBEDDED_CHAT_TEMPLATE


def _parsed(template: str, where: str) -> str:
    """template, once Jinja has parsed it (a CheckpointError naming `where` and the line if it does not)."""
    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"{where}: not a Jinja chat template (line {e.lineno}: {e.message})") from None
    return template


class BadRequest(Exception):
    """A request the server refuses with a 400 (or `status`), in OpenAI's error format."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind


def _error_response(e: BadRequest) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}},
                        status_code=e.status)


class StopPrefix:
    """For one stop string s: the longest end of a text that begins s, in time linear in the text looked at (the
    Knuth-Morris-Pratt automaton of s). Its failure table grows only as far as a text has matched s, so a long stop
    string costs nothing up front."""

    def __init__(self, s: str):
        self.s, self.fail = s, [0]  # fail[i]: the longest proper prefix of s[:i + 1] that also ends it

    def _table(self, n: int) -> None:
        s, fail = self.s, self.fail
        while len(fail) < n:
            i, k = len(fail), fail[-1]
            while k and s[i] != s[k]:
                k = fail[k - 1]
            fail.append(k + 1 if s[i] == s[k] else 0)

    def held(self, text: str) -> int:
        """The largest k < len(s) such that text ends with s[:k]."""
        s, q = self.s, 0
        for c in text:
            while q and (q == len(s) or s[q] != c):
                self._table(q)
                q = self.fail[q - 1]
            if s[q] == c:
                q += 1
        if q == len(s):
            self._table(q)
            q = self.fail[q - 1]
        return q


class TextStream:
    """Token ids -> text deltas for one request: holds back a trailing partial UTF-8 character (decoded as U+FFFD)
    and the longest end of the text that begins a stop string, and cuts the text before the first stop string (which
    never starts in text already sent: what was sent was never the beginning of a stop string)."""

    def __init__(self, tokenizer, stop: list[str], eos_id: int):
        self.tokenizer, self.stop, self.eos_id = tokenizer, stop, eos_id
        self.prefixes = [StopPrefix(s) for s in stop]
        self.ids: list[int] = []
        self.sent = 0  # characters handed out
        self.stopped = False  # a stop string was found
        self.count = 0  # tokens fed, up to the one whose text completes a stop string (OpenAI's completion_tokens)

    def feed(self, ids: list[int], final: bool = False) -> str:
        """The text that the new ids make safe to send (with `final`, all the rest)."""
        if self.stopped:
            return ""
        before = len(self.ids)
        self.ids += [i for i in ids if i != self.eos_id]
        text = self.tokenizer.decode(self.ids)
        # a trailing partial character decodes as one U+FFFD until its last byte comes: not text yet, so no stop
        # string is looked for in it (a stop string holding U+FFFD ended the answer before an "é" it had half decoded)
        ready = text[:-1] if not final and text.endswith("\ufffd") else text
        found = min(((i, len(s)) for s in self.stop if (i := ready.find(s, self.sent)) >= 0), default=None)
        if found is not None:
            self.stopped = True
            end = found[0]
            # the tokens up to the one whose text completes the earliest stop string (those after it are dropped)
            reach = found[0] + found[1]
            n = before
            while n < len(self.ids) and len(self.tokenizer.decode(self.ids[:n])) < reach:
                n += 1
            self.count += n - before
        elif final:
            end = len(text)
            self.count += len(ids)
        else:
            tail = ready[self.sent:]  # what was sent never began a stop string
            held = max((p.held(tail) for p in self.prefixes), default=0)
            end = max(self.sent, len(ready) - held)
            self.count += len(ids)
        delta, self.sent = text[self.sent:end], end
        return delta


class LogprobText:
    """The log-probabilities of a `TextStream`'s tokens, handed out with their text: a token goes once all its text has
    been sent; when the stream ends, every token whose text begins in what was sent (after a stop string, none).
    Items: (token id, text offset: characters before the token's text, plus `offset`, log-probability entry). The
    end-of-sequence token, which adds no text, has none."""

    def __init__(self, tokenizer, eos_id: int, offset: int = 0):
        self.tokenizer, self.eos_id, self.offset = tokenizer, eos_id, offset
        self.pending: list[tuple[int, tuple]] = []  # (token id, entry) not handed out yet
        self.index = 0  # the first pending token's index in the stream's ids
        self.start = 0  # where its text begins

    def feed(self, stream: TextStream, ids: list[int], entries: list[tuple] | None,
             final: bool = False) -> list[tuple[int, int, tuple]]:
        """The items that `stream`'s latest `feed` of ids (with their entries) makes ready."""
        self.pending += [(i, e) for i, e in zip(ids, entries or [None] * len(ids)) if i != self.eos_id]
        out = []
        while self.pending:
            end = len(self.tokenizer.decode(stream.ids[:self.index + 1]).rstrip("\ufffd"))
            if not (end <= stream.sent or final and not stream.stopped or stream.stopped and self.start < stream.sent):
                break
            token, entry = self.pending.pop(0)
            out.append((token, self.offset + self.start, entry))
            self.index, self.start = self.index + 1, max(self.start, end)
        if stream.stopped or final:
            self.pending = []
        return out


def text_offsets(tokenizer, ids: list[int]) -> list[int]:
    """The characters of text before each token's (a token ending inside a character counts from the next)."""
    return [len(tokenizer.decode(ids[:k]).rstrip("\ufffd")) for k in range(len(ids))]


def _field(rule: Callable, *args):
    """rule(*args) (a `kdtree_jax.validate` rule), its ArgumentError as a 400 naming the field."""
    try:
        return rule(*args)
    except validate.ArgumentError as e:
        raise BadRequest(str(e), param=e.name) from None


# OpenAI's (and vLLM's) request fields this server does not implement, with the values that ask for nothing (None:
# null): any other value is refused with a 400, not ignored
UNSUPPORTED = {"suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
               "tool_choice": (None, "none"), "function_call": (None, "none"), "presence_penalty": (None, 0),
               "frequency_penalty": (None, 0), "repetition_penalty": (None, 1), "best_of": (None, 1),
               "response_format": (None, {"type": "text"}), "min_tokens": (None, 0),
               "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
               "reasoning_effort": (None,),
               # vLLM's sampling and output extensions: each changes the tokens or the text (they were ignored)
               "min_p": (None, 0), "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False),
               "use_beam_search": (None, False), "length_penalty": (None, 1), "bad_words": (None, []),
               "allowed_token_ids": (None,), "logits_processors": (None, []), "prompt_logprobs": (None,),
               "truncate_prompt_tokens": (None,), "skip_special_tokens": (None, True),
               "spaces_between_special_tokens": (None, True), "return_tokens_as_token_ids": (None, False),
               "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
               "structured_outputs": (None,),
               # vLLM's chat template extensions: the server renders its own template with the assistant's turn open
               "chat_template": (None,), "chat_template_kwargs": (None, {}), "add_generation_prompt": (None, True),
               "continue_final_message": (None, False), "documents": (None, [])}


def _same(a, b) -> bool:
    """JSON values equal as JSON compares them: a bool is not a number (json.loads gives True == 1 in Python)."""
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _check_unicode(text: str, param: str) -> None:
    """A 400 naming the field for text that is not Unicode a tokenizer takes: a lone surrogate (a JSON \\ud800 escape
    without its pair), which no UTF-8 encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{param} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character "
                         f"{e.start} (a \\u escape of a surrogate must be one of a pair)", param=param) from None


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    return False if value is None else _field(validate.flag, name, value)


class _Options:
    """The decoding parameters of one request, validated by the rules `generate` applies (`kdtree_jax.validate`): each
    integer and number in the range of the engine column that holds it."""

    def __init__(self, body: dict, chat: bool, max_n: int = 1):
        self.prompt_field = "messages" if chat else "prompt"
        self.echo = False if chat else _flag(body, "echo")
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        given = [n for n in names if body.get(n) is not None]
        low = 0 if self.echo else 1  # max_tokens 0 with echo: the prompt alone (with its log-probabilities)
        for name in given:  # each one checked, whichever is used
            _field(validate.integer, name, body[name], low, validate.INT32_LIMIT)
        self.max_tokens = int(body[given[0]]) if given else None
        temperature = body.get("temperature")
        self.temperature = 1.0 if temperature is None else _field(validate.temperature, temperature)
        if self.temperature > 2:
            raise BadRequest(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        self.top_p = _field(validate.top_p, body.get("top_p"))
        top_k = body.get("top_k")
        none = top_k is None or type(top_k) is int and top_k in (0, -1)  # vLLM's "no top_k"
        self.top_k = None if none else _field(validate.top_k, top_k)
        n = body.get("n")
        self.n = 1 if n is None else _field(validate.integer, "n", n, 1, max_n + 1)
        self.logprobs = self._logprobs(body, chat)
        for name, neutral in UNSUPPORTED.items():
            if name in body and not any(_same(body[name], v) for v in neutral):
                accepted = " or ".join(json.dumps(v) for v in neutral if v is not None)
                raise BadRequest(f"{name} is not supported: leave it out" + (f" (or give {accepted})" if accepted
                                                                              else ""), param=name)
        if chat and body.get("echo") not in (None, False):
            raise BadRequest("echo is not supported", param="echo")
        if len(given) == 2 and not _same(body[given[0]], body[given[1]]):
            raise BadRequest(f"max_completion_tokens {body[given[0]]} and max_tokens {body[given[1]]} differ: give one "
                             "of them", param="max_tokens")
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop  # (0, false, {}: refused below)
        if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and s for s in stop)):
            raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                             param="stop")
        for s in stop:
            _check_unicode(s, "stop")
        self.stop = stop
        self.seed = None if body.get("seed") is None else _field(validate.seed, body["seed"])
        self.stream = _flag(body, "stream")
        self.ignore_eos = _flag(body, "ignore_eos")
        stream_options = body.get("stream_options")
        if stream_options is not None and not isinstance(stream_options, dict):
            raise BadRequest("stream_options must be an object", param="stream_options")
        if stream_options is not None and not self.stream:
            raise BadRequest("stream_options is for streamed requests only: add \"stream\": true, or drop it",
                             param="stream_options")
        usage = (stream_options or {}).get("include_usage")
        self.stream_usage = False if usage is None else _field(validate.flag, "stream_options.include_usage", usage)

    @staticmethod
    def _logprobs(body: dict, chat: bool) -> int | None:
        """The alternatives asked for with each token's log-probability (None: no log-probabilities): completions'
        `logprobs` (0 .. 5), chat's `top_logprobs` (0 .. 20) when its `logprobs` is true."""
        if not chat:
            if body.get("top_logprobs") is not None:  # chat's field (it was ignored here, without a word)
                raise BadRequest("top_logprobs is chat's field: completions take \"logprobs\": k (0 to "
                                 f"{MAX_COMPLETION_LOGPROBS}), the alternatives shown per token", param="top_logprobs")
            value = body.get("logprobs")
            return None if value is None else _field(validate.integer, "logprobs", value, 0,
                                                     MAX_COMPLETION_LOGPROBS + 1)
        top = body.get("top_logprobs")
        top = None if top is None else _field(validate.integer, "top_logprobs", top, 0, MAX_CHAT_TOP_LOGPROBS + 1)
        if not _flag(body, "logprobs"):
            if top is not None:
                raise BadRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
            return None
        return top or 0


class _Submitted:
    """One request in the engine, seen from the event loop: its events through an asyncio queue. It is in `open`
    (the server's requests in flight) until its response has ended, whichever way (`close`)."""

    def __init__(self, engine: Engine, ids: list[int], opts: _Options, open_requests: set, seed: int | None):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.engine, self.open = engine, open_requests
        self.failure: BadRequest | None = None  # set by `abort`

        def post(ev: Event) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the event loop has closed: no one waits for the request
                loop.call_soon_threadsafe(self.queue.put_nowait, ev)

        self.id = engine.submit(ids, max_tokens=opts.max_tokens, temperature=opts.temperature, top_k=opts.top_k,
                                top_p=opts.top_p, seed=seed, ignore_eos=opts.ignore_eos, logprobs=opts.logprobs,
                                on_event=post)
        self.open.add(self)

    async def events(self) -> AsyncIterator[Event]:
        while True:
            ev = await self.queue.get()
            yield ev
            if ev.finish is not None:
                return

    def abort(self, failure: BadRequest) -> None:
        """End the request with `failure` (on the event loop): its reader gets it with the next event, at once."""
        if self.failure is None:
            self.failure = failure
            self.queue.put_nowait(Event([], "error", failure.message))
        self.cancel()

    def cancel(self) -> None:
        self.engine.cancel(self.id)  # nothing happens if it has finished

    def close(self) -> None:
        """The response has ended (done, client gone, error): cancel the request, it is no longer in flight."""
        self.cancel()
        self.open.discard(self)


class _EventStream(StreamingResponse):
    """Server-sent events whose requests (one per choice) are closed however the response ends (done, client gone,
    error)."""

    def __init__(self, body, submitted: list[_Submitted]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.submitted = submitted

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for sub in self.submitted:
                sub.close()


def _cut(text: str, limit: int = 60) -> str:
    """text for an error message, cut to `limit` characters (a 100 kB path was sent back whole in its 404)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Server:
    """The app's state: the engine, the tokenizer, the served name, the chat template, the most choices a request may
    ask for and the HTTP counters."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, chat_template: str = EMBEDDED_CHAT_TEMPLATE,
                 max_n: int = DEFAULT_MAX_N):
        self.engine, self.tokenizer, self.model_name, self.max_n = engine, tokenizer, model_name, max_n
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._template_error
        self.template = env.from_string(chat_template)
        self.created = int(time.time())
        self.responses: dict[int, int] = {}  # HTTP status -> count
        self.open: set[_Submitted] = set()  # the requests in flight
        self.stopping = False  # `shutdown` has begun: new requests get 503

    @staticmethod
    def _template_error(message: str):
        raise BadRequest(f"the chat template refused the messages: {message}", param="messages")

    def count(self, status: int) -> None:
        self.responses[status] = self.responses.get(status, 0) + 1

    # --------------------------------------------------------------------------------------------------------------

    def check_model(self, body: dict) -> None:
        if body.get("model") != self.model_name:
            raise BadRequest(f"unknown model {validate.shown(body.get('model'))}; this server serves "
                             f"{self.model_name!r}",
                             param="model", code="model_not_found")

    def prompt_ids(self, prompt) -> list[int]:
        """A completion prompt: a string, a list of token ids, or a one-element list of either."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            _check_unicode(prompt, "prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise BadRequest("prompt must be a non-empty string or list of token ids (one prompt per request)",
                         param="prompt")

    def chat_ids(self, messages) -> list[int]:
        """The chat template applied to the messages (text content only), with the assistant's turn opened."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise BadRequest(f"messages[{i}]: only text content parts are supported", param="messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise BadRequest(f"messages[{i}] must be an object with a string role and text content",
                                 param="messages")
            calls = [k for k in ("tool_calls", "function_call") if m.get(k) not in (None, [])]
            if calls:  # the template renders role and content alone: the calls were dropped from the prompt
                raise BadRequest(f"messages[{i}]: {calls[0]} is not supported (tools are not served): give the "
                                 "call as text content", param="messages")
            clean.append({"role": m["role"], "content": content})
        tok = self.tokenizer
        special = {name: tok.decode([i]) for name, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id))
                   if i is not None}
        text = self.template.render(messages=clean, add_generation_prompt=True, **special)
        _check_unicode(text, "messages")
        return tok.encode(text)

    def submit(self, ids: list[int], opts: _Options) -> list[_Submitted]:
        """Start the request's choices in the engine, choice i with seed + i (its errors as BadRequest with the right
        status; a choice refused cancels those already started). None for max_tokens 0 (echo: the prompt alone)."""
        if opts.max_tokens is None:
            room = self.engine.max_context - len(ids) - self.engine.extra_slots
            if room < 1:  # the prompt's fault, not that of a max_tokens the client did not give
                raise BadRequest(f"{opts.prompt_field}: a prompt of {len(ids)} tokens leaves no room for a new token "
                                 f"in the server's context of {self.engine.max_context} tokens"
                                 + (f" (less {self.engine.extra_slots} speculative slots)"
                                    if self.engine.extra_slots else ""), param=opts.prompt_field,
                                 code="context_length_exceeded")
            opts.max_tokens = min(DEFAULT_MAX_TOKENS, room)
        if opts.max_tokens == 0:  # nothing to generate, but the prompt is checked as the engine would
            try:
                validate.token_row(ids, self.engine.cfg.vocab_size, opts.prompt_field)
            except (ValueError, TypeError) as e:
                raise BadRequest(str(e), param=opts.prompt_field) from None
            if len(ids) > self.engine.max_context:
                raise BadRequest(f"{opts.prompt_field}: a prompt of {len(ids)} tokens exceeds the server's context of "
                                 f"{self.engine.max_context} tokens", param=opts.prompt_field,
                                 code="context_length_exceeded")
            return []
        subs: list[_Submitted] = []
        try:
            for i in range(opts.n):
                seed = None if opts.seed is None else (opts.seed + i) % validate.SEED_LIMIT
                subs.append(_Submitted(self.engine, ids, opts, self.open, seed))
        except ContextOverflow as e:  # the prompt's fault when it alone leaves no room for a token
            alone = len(ids) + self.engine.extra_slots + 1 > self.engine.max_context
            raise BadRequest(str(e), param=opts.prompt_field if alone else "max_tokens",
                             code="context_length_exceeded") from None
        except validate.ArgumentError as e:
            raise BadRequest(str(e), param=e.name) from None
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e)) from None
        except QueueFull as e:
            raise BadRequest(f"the server is busy: {e}; retry later", status=429, kind="rate_limit_error",
                             code="queue_full") from None
        except EngineClosed as e:
            raise BadRequest(str(e), status=503, kind="server_error") from None
        finally:
            if len(subs) < opts.n:  # refused: none of the request's choices runs
                for sub in subs:
                    sub.close()
        return subs

    async def run(self, sub: _Submitted, opts: _Options,
                  offset: int = 0) -> AsyncIterator[tuple[str, str | None, int, list | None]]:
        """(text delta, finish reason or None, tokens so far, log-probability items of the delta's tokens or None) as
        the request decodes (`LogprobText`, text offsets from `offset`); a stop string ends it (finish "stop") and
        cancels it. A request that fails raises BadRequest(status 500)."""
        text = TextStream(self.tokenizer, opts.stop, self.engine.eos_id)
        lp = None if opts.logprobs is None else LogprobText(self.tokenizer, self.engine.eos_id, offset)
        async for ev in sub.events():
            if sub.failure is not None:
                raise sub.failure
            if ev.finish == "error":
                raise BadRequest(f"generation failed: {ev.error}", status=500, kind="server_error")
            final = ev.finish is not None
            delta = text.feed(ev.tokens, final)
            items = None if lp is None else lp.feed(text, ev.tokens, ev.logprobs, final)
            if text.stopped:
                sub.cancel()
                yield delta, "stop", text.count, items
                return
            yield delta, ev.finish, text.count, items

    # --------------------------------------------------------------------------------------------------------------

    def token_text(self, token: int) -> tuple[str, bytes]:
        """A token as the log-probabilities show it: its text, or "bytes:\\xNN..." when its bytes are not whole
        UTF-8 characters, and its bytes."""
        tok = self.tokenizer
        raw = tok.token_bytes(token) if hasattr(tok, "token_bytes") else tok.decode([token]).encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def logprobs(self, items: list, chat: bool) -> dict:
        """OpenAI's logprobs object of a choice (or of a streamed chunk) from `LogprobText` items: completions'
        {tokens, token_logprobs, top_logprobs (a dict of the alternatives and the token), text_offset}, chat's
        {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal}."""
        if chat:
            def entry(token: int, value: float) -> dict:
                text, raw = self.token_text(token)
                return dict(token=text, logprob=value, bytes=list(raw))

            return dict(content=[dict(entry(t, e[0]), top_logprobs=[entry(i, v) for i, v in e[1]])
                                 for t, _, e in items], refusal=None)
        tokens, values, tops = [], [], []
        for t, _, e in items:
            tokens.append(self.token_text(t)[0])
            values.append(None if e is None else e[0])
            top = None
            if e is not None:
                top = {}
                for i, v in (*e[1], (t, e[0])):  # most likely first; tokens of one text keep the likeliest's
                    top.setdefault(self.token_text(i)[0], v)
            tops.append(top)
        return dict(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=[o for _, o, _ in items])

    async def echoed(self, ids: list[int], opts: _Options) -> tuple[str, list | None]:
        """With echo: the prompt's text and, with logprobs, its tokens' items (the first token's entry None)."""
        if not opts.echo:
            return "", None
        text = self.tokenizer.decode(ids)
        if opts.logprobs is None:
            return text, None
        try:  # (`completion` refused a prompt past the context: its forward would outgrow the server's memory)
            entries = await asyncio.to_thread(self.engine.prompt_logprobs, ids, opts.logprobs)
        except validate.ArgumentError as e:
            raise BadRequest(str(e), param=e.name) from None
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e)) from None
        return text, list(zip(ids, text_offsets(self.tokenizer, ids), entries))

    async def completion(self, body: dict, chat: bool, disconnected=None):
        """The answer to /v1/completions (chat False) or /v1/chat/completions (chat True). disconnected: an async
        callable that says whether the client has gone (a whole answer's requests are then cancelled, as a stream's
        are when its client hangs up)."""
        if self.stopping:
            raise BadRequest("the server is shutting down; retry on another", status=503, kind="server_error",
                             code="shutting_down")
        self.check_model(body)
        opts = _Options(body, chat, self.max_n)
        hold = self.engine.max_batch + self.engine.max_queue  # choices in slots and in the queue at once
        if opts.n > hold:  # the queue can never take them all: a 429 ("retry later") would come back every time
            raise BadRequest(f"n {opts.n} is more choices than this server holds at once: {self.engine.max_batch} "
                             f"slots + {self.engine.max_queue} places in the queue (serve --max-batch, --max-queue)",
                             param="n")
        # on a worker thread: a 16 MB prompt takes seconds to render and tokenize, which would stall every stream
        ids = await asyncio.to_thread(self.chat_ids if chat else self.prompt_ids, body.get(opts.prompt_field))
        if len(ids) > self.engine.max_context:  # before anything reads its ids one by one (seconds for millions)
            raise BadRequest(f"{opts.prompt_field}: a prompt of {len(ids)} tokens exceeds the server's context of "
                             f"{self.engine.max_context} tokens", param=opts.prompt_field,
                             code="context_length_exceeded")
        echo = await self.echoed(ids, opts)
        subs = self.submit(ids, opts)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = dict(id=rid, object="chat.completion" if chat else "text_completion", created=int(time.time()),
                    model=self.model_name)
        if opts.stream:
            return _EventStream(self._events(subs, opts, head, chat, len(ids), echo), subs)
        watch = asyncio.create_task(self._watch(disconnected, subs)) if disconnected and subs else None
        try:
            choices = await asyncio.gather(*(self._choice(sub, opts, echo) for sub in subs)) if subs else \
                [(echo[0], "length", 0, echo[1] or [])] * opts.n
        finally:
            if watch is not None:
                watch.cancel()
            for sub in subs:
                sub.close()
        if watch is not None and watch.done() and not watch.cancelled() and watch.result():
            # the client hung up and its requests were cancelled: nobody reads an answer (nginx's 499, not a 200)
            raise BadRequest("the client closed the connection before the answer", status=499)
        out = []
        for i, (text, finish, _, items) in enumerate(choices):
            logprobs = None if opts.logprobs is None else self.logprobs(items, chat)
            out.append(dict(index=i, message=dict(role="assistant", content=text), logprobs=logprobs,
                            finish_reason=finish) if chat
                       else dict(index=i, text=text, finish_reason=finish, logprobs=logprobs))
        n = sum(c[2] for c in choices)
        usage = dict(prompt_tokens=len(ids), completion_tokens=n, total_tokens=len(ids) + n)
        return JSONResponse(dict(head, choices=out, usage=usage))

    @staticmethod
    async def _watch(disconnected, subs: list[_Submitted]) -> bool:
        """Cancel `subs` once `disconnected()` says the client has gone (looked at every DISCONNECT_POLL_S); True
        then."""
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await disconnected():
                for sub in subs:
                    sub.cancel()
                return True

    async def _choice(self, sub: _Submitted, opts: _Options, echo: tuple[str, list | None]):
        """One choice whole: (text, finish reason, tokens, log-probability items)."""
        parts, finish, n, items = [echo[0]], None, 0, list(echo[1] or [])
        async for delta, finish, n, new in self.run(sub, opts, len(echo[0])):
            parts.append(delta)
            items += new or []
        return "".join(parts), finish, n, items

    async def _events(self, subs: list[_Submitted], opts: _Options, head: dict, chat: bool, prompt_tokens: int,
                      echo: tuple[str, list | None]):
        """The server-sent events of a streamed request: each choice's chunks as they come, its index on each."""
        head = dict(head, object="chat.completion.chunk" if chat else "text_completion")

        def chunk(i: int, delta: str | None, finish: str | None, items: list | None = None, role: bool = False) -> str:
            logprobs = None if opts.logprobs is None or not items else self.logprobs(items, chat)
            if chat:
                d = ({"role": "assistant", "content": ""} if role else {} if delta is None else {"content": delta})
                choice = dict(index=i, delta=d, finish_reason=finish)
                if logprobs is not None:
                    choice["logprobs"] = logprobs
                return _sse(dict(head, choices=[choice]))
            return _sse(dict(head, choices=[dict(index=i, text=delta or "", finish_reason=finish,
                                                 logprobs=logprobs)]))

        for i in range(opts.n):
            if chat:
                yield chunk(i, None, None, role=True)
            if echo[0]:
                yield chunk(i, echo[0], None, echo[1])
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, sub: _Submitted) -> None:
            try:
                async for item in self.run(sub, opts, len(echo[0])):
                    events.put_nowait((i, item, None))
            except Exception as e:  # handed to the stream below
                events.put_nowait((i, None, e))
            else:
                events.put_nowait((i, None, None))

        tasks = [asyncio.create_task(pump(i, sub), name=f"choice {i} of {head['id']}") for i, sub in enumerate(subs)]
        try:
            left, tokens = len(subs), [0] * opts.n
            if not subs:  # max_tokens 0: the prompt alone
                for i in range(opts.n):
                    yield chunk(i, None, "length")
            while left:
                i, item, error = await events.get()
                if error is not None:
                    raise error
                if item is None:
                    left -= 1
                    continue
                delta, finish, tokens[i], items = item
                if delta or items:
                    yield chunk(i, delta, None, items)
                if finish is not None:
                    yield chunk(i, None, finish)
            if opts.stream_usage:
                n = sum(tokens)
                usage = dict(prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=prompt_tokens + n)
                yield _sse(dict(head, choices=[], usage=usage))
        except BadRequest as e:
            yield _sse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})
        except Exception as e:  # a bug while this request streams: it fails alone, its client is told
            log.exception("request %s failed while streaming", [sub.id for sub in subs])
            for sub in subs:
                sub.cancel()
            yield _sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error", "param": None,
                                  "code": None}})
        finally:
            for task in tasks:
                task.cancel()
        yield "data: [DONE]\n\n"

    async def wait_closed(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every request in flight to end; whether they all did."""
        deadline = time.monotonic() + timeout
        while self.open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.open

    def abort_all(self, message: str) -> int:
        """End every request in flight with a 503 `message` (a stream: an error event, then [DONE]); how many."""
        open_requests = list(self.open)
        for sub in open_requests:
            sub.abort(BadRequest(message, status=503, kind="server_error", code="shutting_down"))
        return len(open_requests)

    async def shutdown(self, timeout: float) -> None:
        """Stop gracefully: new requests get 503 from now on; those in flight get up to `timeout` seconds to finish,
        then each still open ends with a 503 error, and gets ABORT_GRACE_S seconds to send it."""
        self.stopping = True
        if not await self.wait_closed(timeout):
            self.abort_all(f"the server is shutting down: the request did not finish within the {timeout:g} s "
                           "shutdown timeout")
            await self.wait_closed(ABORT_GRACE_S)

    def metrics(self) -> str:
        """Prometheus text: requests by outcome and by HTTP status, tokens, prefill calls, tau, verified nodes, queue
        depth, busy slots, step time, the prefix cache's hits, tokens saved, entries and bytes, and histograms of
        the time to first token, the time between tokens and the time in the queue."""
        s = self.engine.snapshot()
        lines = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]):
            lines.extend([f"# HELP kdtree_{name} {help_text}", f"# TYPE kdtree_{name} {kind}"])
            lines.extend(f"kdtree_{name}{labels} {value}" for labels, value in samples)

        def histogram(name: str, help_text: str, h: Histogram):
            samples = [(f'_bucket{{le="{"+Inf" if le == float("inf") else le}"}}', n) for le, n in h.cumulative()]
            metric(name, "histogram", help_text, samples + [("_sum", h.sum), ("_count", h.count)])

        metric("requests_total", "counter", "Requests finished in the engine, by outcome (cancelled: the client "
               "left, or a stop string ended it).",
               [(f'{{outcome="{k}"}}', s[f"finished_{k}"]) for k in ("stop", "length", "cancelled", "error")])
        metric("http_responses_total", "counter", "Responses to completion requests, by HTTP status.",
               [(f'{{status="{k}"}}', v) for k, v in sorted(self.responses.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", s["prompt_tokens"])])
        metric("prefill_calls_total", "counter", "Prefill calls (each prefills the waiting requests of one padded "
               "prompt length together).", [("", s["prefill_calls"])])
        metric("generated_tokens_total", "counter", "Tokens generated.", [("", s["generated_tokens"])])
        metric("decode_steps_total", "counter", "Decoding steps of the batch (target forwards after prefill).",
               [("", s["steps"])])
        metric("decode_step_seconds_total", "counter", "Wall time of the decoding chunks.", [("", s["chunk_seconds"])])
        metric("row_steps_total", "counter", "Decoding steps of requests (a step of the batch counts once per live "
               "request).", [("", s["row_steps"])])
        metric("step_tokens_total", "counter", "Tokens those request-steps committed.", [("", s["step_tokens"])])
        metric("verified_nodes_total", "counter", "Draft nodes those request-steps verified.", [("", s["step_nodes"])])
        tau = s["step_tokens"] / s["row_steps"] if s["row_steps"] else 0.0
        metric("tau", "gauge", "Tokens committed per request per decoding step, since the start.", [("", tau)])
        nodes = s["step_nodes"] / s["row_steps"] if s["row_steps"] else 0.0
        metric("verified_nodes_per_step", "gauge", "Draft nodes verified per request per decoding step, since the "
               "start (budget auto: what the cost model chose).", [("", nodes)])
        metric("step_seconds", "gauge", "Wall time of one decoding step of the batch, in the latest chunk.",
               [("", s["last_step_seconds"])])
        metric("queue_depth", "gauge", "Requests waiting for a slot.", [("", s["queue_depth"])])
        metric("active_slots", "gauge", "Slots decoding a request.", [("", s["active_slots"])])
        metric("max_batch", "gauge", "Slots (rows of the batch).", [("", s["max_batch"])])
        metric("prefix_cache_hits_total", "counter", "Requests whose prompt began with a cached prefix, its cache rows "
               "copied instead of prefilled.", [("", s["prefix_hits"])])
        metric("prefix_cache_tokens_saved_total", "counter", "Prompt tokens read from the prefix cache instead of "
               "prefilled.", [("", s["prefix_tokens_saved"])])
        metric("prefix_cache_evictions_total", "counter", "Cached prefixes dropped to make room (least recently used "
               "first).", [("", s["prefix_evictions"])])
        metric("prefix_cache_entries", "gauge", "Prompts kept in the prefix cache.", [("", s["prefix_entries"])])
        metric("prefix_cache_bytes", "gauge", "Bytes of cache rows the prefix cache holds (across the mesh).",
               [("", s["prefix_bytes"])])
        h = s["histograms"]
        histogram("time_to_first_token_seconds", "From a request's arrival in the engine to its first token.",
                  h["time_to_first_token"])
        histogram("inter_token_latency_seconds", "Between a request's tokens (tokens that arrive together share the "
                  "wait since the ones before).", h["inter_token"])
        histogram("request_queue_time_seconds", "From a request's arrival in the engine to its prefill.", h["queue"])
        return "\n".join(lines) + "\n"


def create_app(engine: Engine, tokenizer, model_name: str, chat_template: str = EMBEDDED_CHAT_TEMPLATE,
               max_n: int = DEFAULT_MAX_N, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout: float = BODY_TIMEOUT_S) -> FastAPI:
    """The FastAPI app over an engine (the engine's lifetime is the caller's); max_n: the most choices a request may
    ask for; max_body_bytes: the largest request body read (a larger one gets a 413 before it is read whole);
    body_timeout: the seconds a request's body may take to arrive (then a 408)."""
    max_body_bytes = validate.integer("max_body_bytes", max_body_bytes, 1)
    max_n = validate.integer("max_n", max_n, 1, validate.INT32_LIMIT)  # (0 refused every request that gave n)
    validate.seconds("body_timeout", body_timeout)
    if not isinstance(model_name, str) or not model_name.strip():
        raise ValueError(f"model_name must be a non-empty string (requests name the model they ask for), got "
                         f"{validate.shown(model_name)}")
    server = Server(engine, tokenizer, model_name, chat_template, max_n)
    # only the routes below (no /docs, /redoc, /openapi.json; "/v1/completions/" is an unknown path, not a redirect)
    app = FastAPI(title="kdtree-jax", description="OpenAI-compatible completions with continuous batching",
                  docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.server = server

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        """An unknown path or a method a route does not take: OpenAI's error format, naming the routes."""
        return JSONResponse({"error": {"message": f"{e.detail}: {_cut(request.method)} {_cut(request.url.path)} (the "
                                                  f"routes: {ROUTES})", "type": "invalid_request_error", "param": None,
                                       "code": None}}, status_code=e.status_code, headers=e.headers)

    async def body_of(request: Request) -> dict:
        too_large = (f"the body is larger than the server's limit of {max_body_bytes} bytes (serve "
                     "--max-request-mb)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:  # refused before it is read
            raise BadRequest(too_large, status=413)
        try:
            parts, size = [], 0
            async with asyncio.timeout(body_timeout):  # a client that sends its body slowly or never holds no task
                async for part in request.stream():  # counted as it comes: a chunked body declares no length
                    size += len(part)
                    if size > max_body_bytes:
                        raise BadRequest(too_large, status=413)
                    parts.append(part)
            body = json.loads(b"".join(parts))
        except TimeoutError:
            raise BadRequest(f"the body did not arrive within {body_timeout:g} s", status=408) from None
        except ClientDisconnect:  # gone before the whole body came: nginx's 499, not a failure of the server
            raise BadRequest("the client closed the connection before sending the whole body", status=499) from None
        except json.JSONDecodeError:
            raise BadRequest("the body is not valid JSON") from None
        except UnicodeDecodeError as e:  # bytes that are not text (a string with a stray byte, a compressed body)
            raise BadRequest(f"the body is not JSON text in UTF-8, -16 or -32 ({e.reason}: byte "
                             f"0x{e.object[e.start]:02x} at {e.start})") from None
        except ValueError as e:  # valid JSON with an integer past Python's digit limit for str -> int
            raise BadRequest(f"the body holds a number too long to read ({str(e).split(';')[0]})") from None
        except RecursionError:
            raise BadRequest("the body is nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    async def answer(request: Request, chat: bool):
        try:
            response = await server.completion(await body_of(request), chat, request.is_disconnected)
        except BadRequest as e:
            server.count(e.status)
            return _error_response(e)
        except Exception as e:  # a bug or a broken chat template: this request fails, the server goes on
            log.exception("request failed")
            server.count(500)
            return _error_response(BadRequest(f"{type(e).__name__}: {e}", status=500, kind="server_error"))
        server.count(200)
        return response

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "kdtree-jax"}]}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not engine.alive or server.stopping:
            return JSONResponse({"status": "shutting down" if engine.alive else "engine stopped"}, status_code=503)
        return {"status": "ok", "model": model_name, **engine.describe(), "max_n": server.max_n}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    return app


class _HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head. uvicorn times out an idle connection only
    after a response, and no byte of a new request resets that: a connection that never sends a request, or sends
    its request line and headers a byte at a time (slowloris), held a socket and its buffers forever. Here the head
    must be whole within `head_timeout` seconds of the connection's start, or of the previous response's end;
    else the connection is closed (with a 408 when part of a head came). The body has its own deadline
    (`create_app(body_timeout=)`)."""

    head_timeout = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def _arm_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_expired)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self.conn.trailing_data[0]:  # part of a head came
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._protocol_error: h11.RemoteProtocolError | None = None
        receive = self.conn.next_event

        def next_event():  # keeps h11's reason for a request it cannot parse, for `send_400_response`
            try:
                return receive()
            except h11.RemoteProtocolError as e:
                self._protocol_error = e
                raise

        self.conn.next_event = next_event
        self._arm_head()

    def send_400_response(self, msg: str) -> None:
        """The 400 for a request that is not HTTP/1.1 h11 can parse (a bad chunk size, a head past h11's limit, no
        Host, two Content-Lengths), in the server's JSON error format with h11's reason: uvicorn sent the plain text
        'Invalid HTTP request received.', naming nothing. The connection is then closed, as uvicorn does."""
        why = str(self._protocol_error or "") or msg
        body = json.dumps({"error": {"message": f"the request is not valid HTTP/1.1: {_cut(why, 200)}",
                                     "type": "invalid_request_error", "param": None, "code": None}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        with contextlib.suppress(h11.LocalProtocolError):  # a response had begun: only the close is left
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        (self._arm_head if self.conn.their_state is h11.IDLE else self._disarm_head)()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # waiting for the next request's head
            self._arm_head()

    def connection_lost(self, exc) -> None:
        self._disarm_head()
        super().connection_lost(exc)


def uvicorn_config(app, head_timeout: float = HEAD_TIMEOUT_S, **kwargs) -> uvicorn.Config:
    """uvicorn's Config for the app with h11 and a deadline for each request's head (`_HeadTimeoutProtocol`)."""
    protocol = type("HeadTimeoutProtocol", (_HeadTimeoutProtocol,),
                    {"head_timeout": validate.seconds("head_timeout", head_timeout)})
    return uvicorn.Config(app, http=protocol, lifespan="off", **kwargs)


def tcp_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket made with proto IPPROTO_TCP, so that asyncio gives every connection it accepts
    TCP_NODELAY, as it does for the sockets uvicorn opens itself: asyncio sets the option only on sockets whose
    proto is IPPROTO_TCP, and `socket.create_server` makes its socket with proto 0, which each accepted socket
    inherits. Without it, every response after the first on a kept-alive connection waited ~40 ms: its headers went
    out, its body waited for their acknowledgement, which the client delays (Nagle's algorithm against delayed ACKs;
    measured 2026-12-05: GET /health 43 ms instead of 1.3 on a reused connection)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if os.name == "posix":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


class BackgroundServer:
    """An app served by uvicorn on a thread, from a socket that listens before the thread starts (requests may be
    sent as soon as the constructor returns). port 0 picks a free port; `url` says which. For tests and benchmarks;
    `stop()` shuts the server down and joins its thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, head_timeout: float = HEAD_TIMEOUT_S):
        config = uvicorn_config(app, head_timeout, log_level="warning")
        self._sock = tcp_listener(host, port)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="kdtree-jax-http")
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._main = self._loop.create_task(self._server.serve(sockets=[self._sock]), name="uvicorn")
            self._loop.run_until_complete(self._main)
        finally:  # the worker threads of `asyncio.to_thread` (prompts are tokenized there) joined, not left exiting
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    def other_tasks(self, timeout: float = 10.0) -> list[str]:
        """The names of the tasks on the server's event loop, besides uvicorn's own, that are still running after
        `timeout` seconds (requests in flight, or tasks left behind)."""

        async def probe():
            others = [t for t in asyncio.all_tasks() if t not in (asyncio.current_task(), self._main)]
            if others:
                await asyncio.wait(others, timeout=timeout)
            return [t.get_name() for t in others if not t.done()]

        return asyncio.run_coroutine_threadsafe(probe(), self._loop).result()

    def connection_sockets(self) -> list[socket.socket]:
        """The sockets of the connections the server holds open now (for tests)."""
        return [p.transport.get_extra_info("socket") for p in list(self._server.server_state.connections)]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._sock.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `run` handles SIGINT and SIGTERM (uvicorn's handler waits for every
    connection without a deadline, then raises the signal again)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def run(app, host: str, port: int, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        log_line: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
    """Serve until SIGTERM or Ctrl-C, then stop gracefully (`Server.shutdown`): new requests get 503, those in flight
    get up to `shutdown_timeout` seconds, then each still open ends with an error (a stream: an error event and
    [DONE]); returns once the server has closed. A second SIGTERM or Ctrl-C ends the process at once with status 130
    and one line, after the open streams are told (at most ABORT_GRACE_S seconds). While it serves, the C heap's free
    memory is handed back to the system every few seconds (`heap.HeapTrimmer`), so that its resident set stays flat."""
    server = _Uvicorn(uvicorn_config(app, host=host, port=port, log_level="info",
                                     timeout_graceful_shutdown=ABORT_GRACE_S))
    state: Server = app.state.server

    async def graceful() -> None:
        log_line(f"stopping: new requests get 503; the {len(state.open)} in flight get up to {shutdown_timeout:g} s "
                 "(Ctrl-C again to stop at once)")
        await state.shutdown(shutdown_timeout)
        server.should_exit = True

    async def forced() -> None:
        told = state.abort_all("the server was stopped (interrupted twice)")
        await state.wait_closed(ABORT_GRACE_S)
        print(f"kdtree-jax: interrupted twice: stopped at once ({told} open request(s) ended with an error)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)  # at once: no shutdown of the engine or of the device

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task] = []

        def on_signal() -> None:
            tasks.append(loop.create_task(graceful() if not tasks else forced()))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        trimmer = HeapTrimmer()
        try:
            await server.serve()
        finally:
            trimmer.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    asyncio.run(main())
