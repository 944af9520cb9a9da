"""Soak of `kdtree-jax serve` (issue 46): a real server process under a mix of good, bad and abandoned requests for
`--minutes`, judged against these goals:

    no 5xx          no response with a 5xx status (as the clients saw them, and in the server's own
                    kdtree_http_responses_total), no error event inside a 200 stream
    answers         every good greedy answer (text, finish reason, token count) equal to its solo answer; every bad
                    request refused with a 4xx and an OpenAI-style JSON error; no transport error
    host memory     the server process's resident set (VmRSS) at the end within 2% of the one at the end of the
                    soak's first minute
    device memory   the same for the GPU memory of the server's process (nvidia-smi), where there is a GPU; the
                    server's /metrics report no device memory, and on a CPU device memory is host memory
    no slot leaked  once the clients stop and the server drains: /metrics' active_slots and queue_depth 0, every
                    request that entered the engine finished (kdtree_requests_total), and one more good request
                    answered as before
    accounted for   the server counted as many completion responses as the clients got
    clean stop      SIGTERM: the process exits with status 0 within its shutdown timeout

How: `kdtree-jax serve --model builtin` is started as a subprocess on a free port (its own flags after `--`; default
`--method ddtree --budget 16 --max-batch 16 --warmup all`: every program a request without a cached prefix can need
compiled before the server answers; the allocator's preallocation turned off,
XLA_PYTHON_CLIENT_PREALLOCATE=false, so that nvidia-smi sees what the server holds, unless `--preallocate`). A pool
of `--prompts` requests (held-out standard-library text of 16..400 characters, max_tokens 16..128, a quarter of them
chat, half with ignore_eos) is sent once each, alone and not streamed, at temperature 0: their solo answers. A
warm-up then sends the pool `--warmup-rounds` times at full concurrency, 2 tokens each (so that the prefills of
several requests together compile), and each kind of bad request once. Then `--concurrency` client threads loop for
`--minutes`, each request drawn at random: 80% a good request from the pool (streamed or not, 50/50; a streamed one
with include_usage half the time) whose answer must equal its solo one; 10% a bad request (41 kinds: malformed or
non-object JSON, an empty body, invalid UTF-8, 100,000 nested brackets, wrong types, values out of range such as
max_tokens -1 or 10**12, temperature "hot" or NaN, n 0, top_p 5, token ids outside the vocabulary, an unknown model,
a context overflow, ...) that must get a 4xx with a JSON error; 10% a good streamed request whose client closes the
connection after 1..5 events. Every `--sample-s` seconds the server's VmRSS (and GPU memory) is recorded. Results in
results/<name>/<name>.{md,json,png}: the goals, the counts by kind, outcome and status, the first differences, the
memory samples and the server log's error lines. Exit status 0 when no goal failed (a soak shorter than 2 minutes
does not judge memory).

    python benchmarks/soak.py --minutes 20 --concurrency 16                       # on a CPU or a GPU
    # the H200 run, after scripts/ffi_env.sh (the custom calls' libraries, as scripts/gpu_serve.sh loads them):
    KDTREE_COMMIT=$(git rev-parse --short HEAD) python3 benchmarks/soak.py --name soak_h200 \
        -- --method ddtree --budget 16 --max-batch 16 --warmup all --ffi-ops tree_build,tree_accept
    python benchmarks/soak.py --replot benchmarks/results/soak/soak.json          # rewrite the table and plot
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from convert import commit  # noqa: E402

DEFAULT_SERVE = ["--method", "ddtree", "--budget", "16", "--max-batch", "16", "--warmup", "all"]
KINDS = ("good", "bad", "disconnect")
FIRST = 10  # failures kept in full, per kind of failure
MIN_JUDGED_S = 120.0  # memory is judged only on soaks at least this long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------------------------
# the server and what it reports


class Served:
    """`kdtree-jax serve` in its own process, its output in a log file; `url` once /health answers 200."""

    def __init__(self, serve_args: list[str], shutdown_timeout: float, preallocate: bool, log_path: str):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [sys.executable, "-m", "kdtree_jax.cli", "serve", "--model", "builtin", "--port", str(port),
                     "--shutdown-timeout", f"{shutdown_timeout:g}", *serve_args]
        env = dict(os.environ)
        if not preallocate:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        env["JAX_LOG_COMPILES"] = "1"  # each compilation (or load from the compilation cache) logged: see Compiles
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}:\n{self.log_tail(40)}")
            try:
                r = httpx.get(self.url + "/health", timeout=10)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no /health 200 within {timeout:g} s:\n{self.log_tail(40)}")
            time.sleep(0.5)

    def log_lines(self) -> list[str]:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read().splitlines()

    def log_tail(self, n: int) -> str:
        return "\n".join(self.log_lines()[-n:])

    def stop(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM, then wait up to `timeout` s: (exit status, None if it had not exited; seconds)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class Compiles(threading.Thread):
    """The server's compilations as they happen, from its log (JAX_LOG_COMPILES: a "Compiling <name> with global
    shapes and types ..." line, maybe a compilation-cache hit, then "Finished XLA compilation of <name> in <s> sec"):
    events {t_s (by `clock`, within 0.5 s), name, seconds, cache_hit, shapes (of the last 8 arguments: those of the
    requests, after the weights and the state; a prefill's rows and padded prompt length among them)}."""

    def __init__(self, path: str, clock):
        super().__init__(name="compiles", daemon=True)
        self.path, self.clock, self.events, self.stop = path, clock, [], threading.Event()
        self._pending: dict = {}
        self._offset, self._rest = 0, ""

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.poll()

    def poll(self) -> None:
        """Parse what the log has gained since the last call."""
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except OSError:
            return
        *lines, self._rest = (self._rest + text).split("\n")
        for line in lines:
            self.parse(line)

    def parse(self, line: str) -> None:
        if (m := re.search(r"Compiling (.+?) with global shapes and types (.*)", line)):
            self._pending = dict(name=m.group(1), shapes=" ".join(re.findall(r"\w+\[[^\]]*\]", m.group(2))[-8:]),
                                 cache_hit=False)
        elif "Persistent compilation cache hit" in line:
            self._pending["cache_hit"] = True
        elif (m := re.search(r"Finished XLA compilation of (.+) in ([0-9.]+) sec", line)):
            event = dict(t_s=self.clock(), name=m.group(1), seconds=float(m.group(2)), cache_hit=False,
                         shapes=None)
            if self._pending.get("name") == event["name"]:
                event.update(cache_hit=self._pending["cache_hit"], shapes=self._pending["shapes"])
            self._pending = {}
            self.events.append(event)


def metrics(url: str) -> dict[str, float]:
    """The kdtree_ samples of /metrics, by name with labels (`http_responses_total{status="200"}`)."""
    r = httpx.get(url + "/metrics", timeout=30)
    r.raise_for_status()
    out = {}
    for line in r.text.splitlines():
        if line.startswith("kdtree_"):
            name, value = line.rsplit(" ", 1)
            out[name[len("kdtree_"):]] = float(value)
    return out


def by_label(m: dict[str, float], name: str) -> dict[str, float]:
    """{label value: sample} of a metric with one label."""
    return {k.split('"')[1]: v for k, v in m.items() if k.startswith(name + "{")}


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:
        return None


def gpu_bytes(pid: int) -> int | None:
    """The GPU memory nvidia-smi reports for the process (summed over GPUs); None without nvidia-smi or a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = [int(mib) for p, mib in (line.split(",") for line in out.splitlines() if line.count(",") == 1)
            if p.strip() == str(pid) and mib.strip().isdigit()]
    return sum(used) << 20 if used else None


def sample(pid: int, t: float) -> dict:
    """The server's resident set and GPU memory (bytes), open file descriptors and threads at time t (s)."""
    fds = threads = None
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status") as f:
            threads = next((int(line.split()[1]) for line in f if line.startswith("Threads:")), None)
    except OSError:
        pass
    return dict(t_s=round(t, 1), rss=rss_bytes(pid), gpu=gpu_bytes(pid), fds=fds, threads=threads)


# ------------------------------------------------------------------------------------------------------------------
# requests


def pool(count: int, chars: tuple[int, int], tokens: tuple[int, int], seed: int) -> list[dict]:
    """`count` good greedy requests: {name, path, body}; prompt lengths and max_tokens spread over their ranges."""
    from kdtree_jax.serving.bench_serve import heldout_prompts

    rng = random.Random(seed)
    out = []
    for i in range(count):
        f = i / max(count - 1, 1)
        n_chars = round(chars[0] * (chars[1] / chars[0]) ** f)  # geometric: short and long prompts alike
        text = heldout_prompts(1, n_chars, seed + i)[0]
        max_tokens = rng.randint(*tokens)
        chat = i % 4 == 3
        body = dict(max_tokens=max_tokens, temperature=0, ignore_eos=i % 2 == 0)
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        out.append(dict(name=f"p{i}", path="/v1/chat/completions" if chat else "/v1/completions", body=body,
                        prompt_chars=len(text)))
    return out


def bad_requests(model: str, max_context: int) -> list[tuple[str, str, bytes]]:
    """(name, path, raw body) of requests that must be refused with a 4xx."""
    base = dict(model=model, prompt="def f(x):", max_tokens=8, temperature=0)
    nested = b"[" * 100_000 + b"]" * 100_000

    def body(**kw) -> bytes:
        return json.dumps(dict(base, **kw)).encode()

    def without(key: str) -> bytes:
        return json.dumps({k: v for k, v in base.items() if k != key}).encode()

    chat = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    completions = [
        ("empty body", b""), ("malformed JSON", b'{"model": "' + model.encode() + b'", "prompt": '),
        ("a JSON list", b"[1, 2, 3]"), ("a JSON string", b'"hello"'), ("JSON null", b"null"), ("{}", b"{}"),
        ("invalid UTF-8", b'{"model": "\xff\xfe", "prompt": "x"}'), ("100,000 nested brackets", nested),
        ("a prompt of 100,000 nested brackets", b'{"model": "' + model.encode() + b'", "prompt": ' + nested + b"}"),
        ("max_tokens -1", body(max_tokens=-1)), ("max_tokens 0", body(max_tokens=0)),
        ("max_tokens 10**12", body(max_tokens=10**12)), ("max_tokens 'ten'", body(max_tokens="ten")),
        ("max_tokens 1.5", body(max_tokens=1.5)), ("max_tokens true", body(max_tokens=True)),
        ("max_tokens past the context", body(max_tokens=max_context)),
        ("temperature 'hot'", body(temperature="hot")), ("temperature -1", body(temperature=-1)),
        ("temperature 3", body(temperature=3)),
        ("temperature NaN", json.dumps(dict(base, temperature=float("nan"))).encode()),
        ("temperature 1e400", body(max_tokens=8)[:-1] + b', "temperature": 1e400}'),
        ("n 0", body(n=0)), ("n 1000", body(n=1000)), ("top_p 5", body(top_p=5)), ("top_p 0", body(top_p=0)),
        ("top_k 2**40", body(top_k=2**40)), ("seed -1", body(seed=-1)), ("stop 5", body(stop=5)),
        ("5 stop strings", body(stop=list("abcde"))), ("logprobs 99", body(logprobs=99)),
        ("stream 'yes'", body(stream="yes")), ("prompt 42", body(prompt=42)), ("prompt ''", body(prompt="")),
        ("no prompt", without("prompt")), ("token ids outside the vocabulary", body(prompt=[10**9, 5])),
        ("a negative token id", body(prompt=[-1])), ("an unknown model", body(model="no-such-model")),
        ("suffix (unsupported)", body(suffix="x")),
    ]
    chats = [("chat: messages []", dict(chat, messages=[])), ("chat: messages 'hi'", dict(chat, messages="hi")),
             ("chat: top_logprobs without logprobs", dict(chat, top_logprobs=3))]
    return ([(n, "/v1/completions", b) for n, b in completions]
            + [(n, "/v1/chat/completions", json.dumps(b).encode()) for n, b in chats])


def answer_of(path: str, data: dict) -> tuple[str, str | None, int | None]:
    """(text, finish reason, completion tokens) of a non-streamed answer."""
    choice = data["choices"][0]
    text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    return text, choice["finish_reason"], data.get("usage", {}).get("completion_tokens")


class Stats:
    """What the clients saw, under a lock: counts by kind and outcome, statuses, failures, per-minute counts."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes = {k: {} for k in KINDS}
        self.statuses = {k: {} for k in KINDS}
        self.failures: dict[str, list] = {}
        self.failure_counts: dict[str, int] = {}
        self.per_minute: dict[int, dict[str, int]] = {}
        self.latency: list[float] = []
        self.bad_names: dict[str, int] = {}

    def add(self, kind: str, outcome: str, status: int | None, t: float, failure: dict | None = None,
            latency: float | None = None, bad_name: str | None = None) -> None:
        with self.lock:
            self.outcomes[kind][outcome] = self.outcomes[kind].get(outcome, 0) + 1
            key = str(status) if status is not None else "none"
            self.statuses[kind][key] = self.statuses[kind].get(key, 0) + 1
            minute = self.per_minute.setdefault(int(t // 60), {k: 0 for k in KINDS})
            minute[kind] += 1
            if failure is not None:
                self.failure_counts[outcome] = self.failure_counts.get(outcome, 0) + 1
                kept = self.failures.setdefault(outcome, [])
                if len(kept) < FIRST:
                    kept.append(dict(failure, kind=kind, t_s=round(t, 1)))
            if latency is not None:
                self.latency.append(latency)
            if bad_name is not None:
                self.bad_names[bad_name] = self.bad_names.get(bad_name, 0) + 1


def read_stream(r: httpx.Response, path: str, stop_after: int | None = None):
    """(text, finish reason, usage tokens, error events, whether [DONE] came, events read) of a streamed answer;
    with stop_after, stop reading after that many events."""
    chat = path.endswith("chat/completions")
    text, finish, usage, errors, done, n = [], None, None, [], False, 0
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        event = json.loads(line[6:])
        n += 1
        if "error" in event:
            errors.append(event["error"])
        for c in event.get("choices", []):
            text.append((c.get("delta", {}).get("content") if chat else c.get("text")) or "")
            finish = c.get("finish_reason") or finish
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
        if stop_after is not None and n >= stop_after:
            break
    return "".join(text), finish, usage, errors, done, n


class Client(threading.Thread):
    """One client: requests drawn at random until `end` (monotonic), each judged and counted."""

    def __init__(self, i: int, url: str, model: str, goods: list[dict], bads: list, stats: Stats, t0: float,
                 end: float, p_bad: float, p_disconnect: float, timeout: float, seed: int):
        super().__init__(name=f"client {i}", daemon=True)
        self.url, self.model, self.goods, self.bads, self.stats = url, model, goods, bads, stats
        self.t0, self.end, self.p_bad, self.p_disconnect, self.timeout = t0, end, p_bad, p_disconnect, timeout
        self.rng = random.Random(seed * 1000 + i)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout) as http:
            while time.monotonic() < self.end:
                x = self.rng.random()
                kind = "bad" if x < self.p_bad else "disconnect" if x < self.p_bad + self.p_disconnect else "good"
                try:
                    getattr(self, kind)(http)
                except httpx.HTTPError as e:
                    self.stats.add(kind, "transport error", None, time.monotonic() - self.t0,
                                   dict(error=f"{type(e).__name__}: {e}"))
                except Exception as e:  # a bug of the client or an answer it cannot parse: counted, not fatal
                    self.stats.add(kind, "client error", None, time.monotonic() - self.t0,
                                   dict(error=f"{type(e).__name__}: {e}"))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def good(self, http: httpx.Client) -> None:
        g = self.rng.choice(self.goods)
        stream = self.rng.random() < 0.5
        usage = stream and self.rng.random() < 0.5
        body = dict(g["body"], model=self.model)
        if stream:
            body.update(stream=True, **({"stream_options": {"include_usage": True}} if usage else {}))
        t = time.monotonic()
        if stream:
            with http.stream("POST", g["path"], json=body) as r:
                if r.status_code != 200:
                    return self.status_failure("good", r.status_code, r.read(), g["name"])
                text, finish, tokens, errors, done, _ = read_stream(r, g["path"])
            if errors or not done:
                return self.stats.add("good", "error event in a stream" if errors else "stream cut", 200, self.now(),
                                      dict(request=g["name"], stream=True, errors=errors, done=done))
        else:
            r = http.post(g["path"], json=body)
            if r.status_code != 200:
                return self.status_failure("good", r.status_code, r.content, g["name"])
            text, finish, tokens = answer_of(g["path"], r.json())
        latency = time.monotonic() - t
        want = (g["solo_text"], g["solo_finish"], g["solo_tokens"] if (usage or not stream) else None)
        got = (text, finish, tokens if (usage or not stream) else None)
        if got != want:
            cut = next((i for i, (a, b) in enumerate(zip(text, g["solo_text"])) if a != b),
                       min(len(text), len(g["solo_text"])))
            return self.stats.add("good", "mismatch", 200, self.now(), dict(
                request=g["name"], stream=stream, first_difference_at=cut,
                solo=g["solo_text"][max(0, cut - 40):cut + 40], got=text[max(0, cut - 40):cut + 40],
                solo_finish=g["solo_finish"], finish=finish, solo_tokens=g["solo_tokens"], tokens=tokens))
        self.stats.add("good", "equal to solo", 200, self.now(), latency=latency)

    def status_failure(self, kind: str, status: int, content: bytes, name: str) -> None:
        outcome = "5xx" if status >= 500 else f"unexpected {status}"
        self.stats.add(kind, outcome, status, self.now(), dict(request=name, status=status,
                                                                 body=content[:500].decode(errors="replace")))

    def bad(self, http: httpx.Client, item: tuple[str, str, bytes] | None = None) -> None:
        name, path, raw = item or self.rng.choice(self.bads)
        r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        if r.status_code >= 500 or r.status_code < 400:
            outcome = "5xx" if r.status_code >= 500 else "accepted"
            return self.stats.add("bad", outcome, r.status_code, self.now(), dict(
                request=name, status=r.status_code, body=r.content[:500].decode(errors="replace")), bad_name=name)
        try:
            error = r.json()["error"]
            ok = isinstance(error, dict) and isinstance(error.get("message"), str)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            return self.stats.add("bad", "4xx without a JSON error", r.status_code, self.now(), dict(
                request=name, status=r.status_code, body=r.content[:500].decode(errors="replace")), bad_name=name)
        self.stats.add("bad", "refused (4xx, JSON error)", r.status_code, self.now(), bad_name=name)

    def disconnect(self, http: httpx.Client) -> None:
        g = self.rng.choice(self.goods)
        k = self.rng.randint(1, 5)
        body = dict(g["body"], model=self.model, stream=True)
        with http.stream("POST", g["path"], json=body) as r:
            if r.status_code != 200:
                return self.status_failure("disconnect", r.status_code, r.read(), g["name"])
            _, finish, _, errors, done, n = read_stream(r, g["path"], stop_after=k)
            # leaving the block unread closes the connection: the server sees the client go
        if errors:
            return self.stats.add("disconnect", "error event in a stream", 200, self.now(),
                                  dict(request=g["name"], errors=errors))
        outcome = ("finished before the close" if done else "closed after the last token" if finish
                   else "closed mid-stream")
        self.stats.add("disconnect", outcome, 200, self.now())


def warm_up(url: str, model: str, goods: list[dict], concurrency: int, rounds: int, timeout: float) -> dict:
    """The pool sent `rounds` times at `concurrency`, 2 tokens each, so that the prefills of several requests
    together (one program per padded prompt length and power of two of rows) compile before the soak, as far as
    arrivals group them: {status: count}."""
    todo = [dict(g["body"], model=model, max_tokens=2, path=g["path"]) for _ in range(rounds) for g in goods]
    statuses: dict[str, int] = {}
    lock = threading.Lock()

    def loop():
        with httpx.Client(base_url=url, timeout=timeout) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    body = todo.pop()
                path = body.pop("path")
                try:
                    status = str(http.post(path, json=body).status_code)
                except httpx.HTTPError:
                    status = "none"
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def solo(http: httpx.Client, model: str, g: dict) -> None:
    r = http.post(g["path"], json=dict(g["body"], model=model))
    if r.status_code != 200:
        raise RuntimeError(f"solo request {g['name']} answered {r.status_code}: {r.text[:500]}")
    g["solo_text"], g["solo_finish"], g["solo_tokens"] = answer_of(g["path"], r.json())


# ------------------------------------------------------------------------------------------------------------------
# the report


def growth(samples: list[dict], key: str, baseline_t: float, end_t: float) -> dict | None:
    """The memory verdict of one series, from the samples taken while every client ran (t <= end_t, the soak's
    planned end: as the last requests finish, memory drops): the first sample at or after baseline_t (the end of
    minute 1) and the last; growth = (last - that) / that. For context: the peak
    after baseline_t, the median of the last minute against that of the minute after baseline_t (less noisy than two
    samples), and a least-squares slope after baseline_t."""
    import numpy as np

    series = [s for s in samples if s.get(key) is not None and s["t_s"] <= end_t]
    base = next((s for s in series if s["t_s"] >= baseline_t), None)
    if base is None or series[-1]["t_s"] <= base["t_s"]:
        return None
    last = series[-1]
    after = [s for s in series if s["t_s"] >= base["t_s"]]
    first_min = [s[key] for s in after if s["t_s"] < base["t_s"] + 60]
    last_min = [s[key] for s in after if s["t_s"] > last["t_s"] - 60]
    t = np.array([s["t_s"] for s in after]) / 60
    v = np.array([s[key] for s in after], float)
    slope = float(np.polyfit(t, v, 1)[0]) if len(after) > 2 else 0.0
    # the growth after the server's last compilation (or load of a program) of the soak: the median of the minute
    # that follows the sample that saw it against that of the last minute
    since = None
    if all("compiles" in x for x in series):
        changed = [b for a, b in zip(series, series[1:]) if b["compiles"] > a["compiles"]]
        t_c = changed[-1]["t_s"] if changed else series[0]["t_s"]
        window = [x[key] for x in series if t_c <= x["t_s"] < t_c + 60]
        if last["t_s"] - t_c >= 120:
            since = dict(t_s=t_c, first=float(np.median(window)), last=float(np.median(last_min)))
    return dict(baseline_t_s=base["t_s"], baseline=base[key], last_t_s=last["t_s"], last=last[key],
                after_last_compilation=since,
                growth=(last[key] - base[key]) / base[key], peak_growth=(v.max() - base[key]) / base[key],
                median_growth=(float(np.median(last_min)) - float(np.median(first_min))) / float(np.median(first_min)),
                slope_per_min=slope, first=series[0][key])


def judge(res: dict, limit: float) -> dict:
    """{goal: {passed: True/False/None (not judged), measured: words}}."""
    c, s, end = res["clients"], res["server"], res["end"]
    client_5xx = sum(c["outcomes"][k].get(o, 0) for k in KINDS for o in ("5xx", "error event in a stream"))
    server_5xx = sum(v for st, v in end["http_responses"].items() if int(st) >= 500)
    goals = {}
    goals["no 5xx"] = dict(passed=client_5xx == 0 and server_5xx == 0,
                           measured=f"{client_5xx} seen by the clients (5xx statuses and error events in streams), "
                                    f"{server_5xx} counted by the server")
    good = sum(c["outcomes"]["good"].values())
    equal = c["outcomes"]["good"].get("equal to solo", 0)
    bad = sum(c["outcomes"]["bad"].values())
    refused = c["outcomes"]["bad"].get("refused (4xx, JSON error)", 0)
    transport = sum(c["outcomes"][k].get(o, 0) for k in KINDS for o in ("transport error", "client error"))
    mismatches = c["outcomes"]["good"].get("mismatch", 0)
    warm_ok = set(res["warmup"]) <= {"200"}
    goals["answers"] = dict(passed=equal == good and refused == bad and transport == 0 and good > 0 and warm_ok,
                            measured=f"{equal} of {good} good answers equal to solo ({mismatches} mismatches), "
                                     f"{refused} of {bad} bad requests refused with a 4xx JSON error, {transport} "
                                     "transport or client errors" + ("" if warm_ok else
                                                                     f"; warm-up statuses {res['warmup']}"))
    for goal, key in (("host memory", "rss"), ("device memory", "gpu")):
        g = res["memory"].get(key)
        if key == "gpu" and not any(x.get("gpu") is not None for x in res["memory"]["samples"]):
            goals[goal] = dict(passed=None, measured="not measured: the server's /metrics report no device memory "
                                                     "and nvidia-smi is absent or shows no GPU memory for the process "
                                                     "(on a CPU, device memory is host memory)")
        elif res["setup"]["soak_s"] < MIN_JUDGED_S or g is None:
            goals[goal] = dict(passed=None, measured=f"not judged: a soak shorter than {MIN_JUDGED_S:g} s")
        else:
            goals[goal] = dict(passed=g["growth"] < limit,
                               measured=f"{g['baseline'] / 2**20:,.0f} MiB at {g['baseline_t_s']:.0f} s -> "
                                        f"{g['last'] / 2**20:,.0f} MiB at {g['last_t_s']:.0f} s: "
                                        f"{100 * g['growth']:+.2f}% (peak {100 * g['peak_growth']:+.2f}%; "
                                        f"last minute's median against minute 2's: {100 * g['median_growth']:+.2f}%; "
                                        f"fitted slope {g['slope_per_min'] / 2**20:+.2f} MiB/min; "
                                        + (f"after the server's last compilation (the sample at {lc['t_s']:.0f} "
                                           f"s), the minute that follows to the last minute, medians: "
                                           f"{lc['first'] / 2**20:,.0f} -> {lc['last'] / 2**20:,.0f} MiB, "
                                           f"{100 * (lc['last'] / lc['first'] - 1):+.2f}%; "
                                           if (lc := g.get("after_last_compilation")) else "")
                                        + f"{g['first'] / 2**20:,.0f} MiB at the start)")
    finished = sum(end["engine_requests"].values()) - sum(s["engine_requests_before"].values())
    entered = res["engine_submitted"]
    leak_ok = (end["active_slots"] == 0 and end["queue_depth"] == 0 and finished == entered
               and res["after"]["equal"])
    goals["no slot leaked"] = dict(
        passed=leak_ok,
        measured=f"after a {end['drain_s']:.1f} s drain: active_slots {end['active_slots']:g}, queue_depth "
                 f"{end['queue_depth']:g}; {finished:g} engine requests finished of {entered} that entered "
                 f"({', '.join(f'{k} {v:g}' for k, v in res['engine_outcomes'].items())}); a good request after it: "
                 f"{'equal to solo' if res['after']['equal'] else 'NOT equal to solo: ' + res['after']['detail']}")
    answered = sum(v for k in KINDS for st, v in c["statuses"][k].items() if st != "none") + res["extra_requests"]
    counted = sum(end["http_responses"].values())
    goals["accounted for"] = dict(passed=answered == counted,
                                  measured=f"the server counted {counted:g} completion responses, the clients got "
                                           f"{answered} (solo, soak and after-drain requests)")
    stop = res["stop"]
    goals["clean stop"] = dict(passed=stop["status"] == 0 and stop["seconds"] <= stop["bound_s"],
                               measured=f"SIGTERM -> exit status {stop['status']} after {stop['seconds']:.1f} s "
                                        f"(bound: the {stop['shutdown_timeout_s']:g} s shutdown timeout + 30 s)")
    return goals


def verdicts(res: dict) -> None:
    """The memory growth of each series and the goals' verdicts, from the run's samples and counts (again on
    --replot)."""
    st = res["setup"]
    end_t = min(60.0 * st["minutes"], st["soak_s"])
    for key in ("rss", "gpu"):
        res["memory"][key] = growth(res["memory"]["samples"], key, min(60.0, st["soak_s"]), end_t)
    res["goals"] = judge(res, st["growth_limit"])
    res["passed"] = not any(v["passed"] is False for v in res["goals"].values())


def markdown(res: dict) -> str:
    st, c = res["setup"], res["clients"]
    mark = {True: "**pass**", False: "**FAIL**", None: "not judged"}
    lines = [f"# Soak of kdtree-jax serve ({st['date']}, {st['device']}, commit {st['commit']})", "",
             f"`{st['command']}`", ""] + ([st["note"], ""] if st.get("note") else []) + [
             f"Server: `{st['serve_command']}` (XLA_PYTHON_CLIENT_PREALLOCATE="
             f"{'unset' if st['preallocate'] else 'false'}); {st['health'].get('method')}"
             + (f" budget {st['health']['budget']}" if st['health'].get('budget') else "")
             + f", {st['health'].get('max_batch')} slots of {st['health'].get('max_context')} tokens. "
             f"{st['concurrency']} clients for {st['soak_s'] / 60:.1f} min: "
             f"{100 * (1 - st['p_bad'] - st['p_disconnect']):.0f}% "
             f"good greedy requests from a pool of {st['prompts']} (prompts of {st['prompt_chars'][0]}.."
             f"{st['prompt_chars'][1]} characters, max_tokens {st['max_tokens'][0]}..{st['max_tokens'][1]}; "
             f"streamed or not, 50/50), {100 * st['p_bad']:.0f}% bad requests ({st['bad_kinds']} kinds), "
             f"{100 * st['p_disconnect']:.0f}% streams closed by the client after 1..5 events. Memory sampled every "
             f"{st['sample_s']:g} s; growth = (last - the sample at the end of minute 1) / that sample, goal < "
             f"{100 * st['growth_limit']:g}%. Solo answers: each pool request sent alone before the soak; then "
             f"a warm-up, the pool sent {st['warmup_rounds']} times at concurrency {st['concurrency']} (2 tokens "
             f"each; statuses: {', '.join(f'{n} x {k}' for k, n in res['warmup'].items())}). Load: "
             f"1-minute load average {st['loadavg_before']:.1f} before, {res['loadavg_after']:.1f} after "
             f"(on {os.cpu_count()} cores).", "",
             f"**Verdict: {'every judged goal met' if res['passed'] else 'a goal FAILED'}.**", "",
             "| goal | measured | result |", "|---|---|---|"]
    lines += [f"| {g} | {v['measured']} | {mark[v['passed']]} |" for g, v in res["goals"].items()]
    total = sum(sum(v.values()) for v in c["outcomes"].values())
    lines += ["", f"Requests in the soak: {total:,} ({total / (st['soak_s'] / 60):.0f} a minute); good answers' "
              f"latency p50 {res['latency'].get('p50_s', 0):.2f} s, p99 {res['latency'].get('p99_s', 0):.2f} s.", "",
              "| kind | outcome | requests |", "|---|---|---|"]
    for k in KINDS:
        for o, n in sorted(c["outcomes"][k].items(), key=lambda x: -x[1]):
            lines.append(f"| {k} | {o} | {n:,} |")
    lines += ["", "| kind | HTTP statuses |", "|---|---|"]
    lines += [f"| {k} | {', '.join(f'{s}: {n:,}' for s, n in sorted(c['statuses'][k].items()))} |" for k in KINDS]
    lines += ["", "Server counters at the end: responses by status "
              + ", ".join(f"{s}: {n:,.0f}" for s, n in sorted(res["end"]["http_responses"].items()))
              + "; engine requests by outcome " + ", ".join(f"{s}: {n:,.0f}" for s, n in res["engine_outcomes"].items())
              + f" (since the soak's solo phase began). Server log: {res['log']['lines']:,} lines, "
              f"{len(res['log']['errors'])} with Traceback, ERROR or a 5xx access line."]
    events = res.get("compiles", [])
    if events:
        during = [e for e in events if 0 <= e["t_s"] <= st["soak_s"]]
        late = [e for e in during if e["t_s"] >= min(60.0, st["soak_s"])]
        lines += ["", f"Compilations in the server (JAX_LOG_COMPILES; a program compiled or loaded from the "
                  f"compilation cache): {len(events) - len(during)} before or after the soak, {len(during)} during it, "
                  f"{len(late)} after its first minute"
                  + (": " + "; ".join(f"{e['name']} at {e['t_s']:.0f} s ({e['seconds']:.2f} s"
                                      f"{', a cache hit' if e['cache_hit'] else ''}; arguments ... "
                                      f"`{e['shapes']}`)" for e in late[:12])
                     + (f"; ... ({len(late) - 12} more)" if len(late) > 12 else "") if late else "") + "."]
    samples = res["memory"]["samples"]
    base = next((x for x in samples if x["t_s"] >= min(60.0, st["soak_s"])), samples[-1])
    last = [x for x in samples if x["t_s"] <= min(60.0 * st["minutes"], st["soak_s"])][-1]
    if samples[0].get("fds") is not None:
        lines += ["", "The server's open file descriptors and threads (not goals; a leaked connection would show): "
                  + "; ".join(f"{what} {x['fds']} and {x['threads']}" for what, x in (
                      ("at the start", samples[0]), (f"at {base['t_s']:.0f} s", base),
                      (f"at {last['t_s']:.0f} s", last), ("after the drain", samples[-1]))) + "."]
    if c["failures"]:
        lines += ["", "## Failures (the first of each kind)", ""]
        for outcome, items in c["failures"].items():
            lines.append(f"- {outcome} ({c['failure_counts'][outcome]}): `{json.dumps(items[0])[:1500]}`")
    if res["log"]["errors"]:
        lines += ["", "## Server log lines with errors (the first 20)", "", "```"] + res["log"]["errors"][:20] + ["```"]
    lines += ["", f"![memory and requests]({st['name']}.png)", ""]
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    samples = res["memory"]["samples"]
    t = [s["t_s"] / 60 for s in samples if s.get("rss")]
    ax.plot(t, [s["rss"] / 2**20 for s in samples if s.get("rss")], "o-", ms=3, label="host RSS")
    if any(s.get("gpu") for s in samples):
        ax.plot([s["t_s"] / 60 for s in samples if s.get("gpu")], [s["gpu"] / 2**20 for s in samples if s.get("gpu")],
                "s-", ms=3, label="GPU memory (nvidia-smi)")
    g = res["memory"].get("rss")
    if g:
        lim = res["setup"]["growth_limit"]
        ax.axhspan(g["baseline"] / 2**20, g["baseline"] * (1 + lim) / 2**20, color="green", alpha=0.15,
                   label=f"minute-1 RSS + {100 * lim:g}%")
    ax.axvline(res["setup"]["soak_s"] / 60, color="gray", ls="--", label="clients stopped")
    late = [e["t_s"] / 60 for e in res.get("compiles", []) if 0 <= e["t_s"] <= res["setup"]["soak_s"]]
    if late:
        ax.plot(late, [ax.get_ylim()[0]] * len(late), "|", color="red", ms=14, mew=2, label="a compilation")
    ax.set(xlabel="minutes into the soak", ylabel="MiB", title="server memory")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    minutes = sorted(res["clients"]["per_minute"], key=int)
    bottom = [0] * len(minutes)
    for k in KINDS:
        v = [res["clients"]["per_minute"][m][k] for m in minutes]
        ax2.bar([int(m) for m in minutes], v, bottom=bottom, label=k)
        bottom = [a + b for a, b in zip(bottom, v)]
    ax2.set(xlabel="minute", ylabel="requests", title="requests finished per minute, by kind")
    ax2.legend(fontsize=8)
    fig.suptitle(f"kdtree-jax serve soak: {res['setup']['device']}, C = {res['setup']['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: dict, out: str, name: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, name)
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(res))
    plot(res, base + ".png")
    return [base + ext for ext in (".md", ".json", ".png")]


# ------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", "benchmarks/soak.py", *argv])
    serve_args = DEFAULT_SERVE
    if "--" in argv:
        at = argv.index("--")
        argv, serve_args = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s [options] [-- serve flags]")
    ap.add_argument("--minutes", type=float, default=20.0, help="length of the soak (default: 20)")
    ap.add_argument("--concurrency", type=int, default=16, help="client threads (default: 16)")
    ap.add_argument("--prompts", type=int, default=32, help="good requests in the pool (default: 32)")
    ap.add_argument("--prompt-chars", default="16,400", help="shortest,longest prompt in characters (default: 16,400)")
    ap.add_argument("--max-tokens", default="16,128", help="smallest,largest max_tokens of the pool (default: 16,128)")
    ap.add_argument("--bad", type=float, default=0.1, help="share of bad requests (default: 0.1)")
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of streams the client closes (default: 0.1)")
    ap.add_argument("--warmup-rounds", type=int, default=2,
                    help="times the pool is sent at --concurrency (2 tokens each) before the soak (default: 2)")
    ap.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples (default: 10)")
    ap.add_argument("--growth", type=float, default=0.02, help="memory growth allowed after minute 1 (default: 0.02)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="the server's --shutdown-timeout; SIGTERM must end it within this + 30 s (default: 30)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds for the server to answer /health")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    ap.add_argument("--drain-s", type=float, default=60.0, help="seconds the server gets to free its slots after the "
                                                                 "clients stop (default: 60)")
    ap.add_argument("--preallocate", action="store_true",
                    help="keep JAX's GPU memory preallocation (then nvidia-smi shows the preallocated pool)")
    ap.add_argument("--seed", type=int, default=0, help="prompts and the clients' choices (default: 0)")
    ap.add_argument("--device", default=None, help="the device named in the report (default: the server's /health)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "soak"),
                    help="output directory (default: benchmarks/results/soak/)")
    ap.add_argument("--name", default="soak", help="output file name without extension (default: soak)")
    ap.add_argument("--note", default=None, help="a line printed under the command in the report (with --replot: "
                                                 "added to the saved run)")
    ap.add_argument("--replot", metavar="JSON", help="rewrite the table and plot next to a saved JSON")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            res = json.load(f)
        if args.note is not None:
            res["setup"]["note"] = args.note
        verdicts(res)  # from the saved samples and counts, by this version's rules
        print("wrote", ", ".join(write(res, os.path.dirname(os.path.abspath(args.replot)), res["setup"]["name"])))
        return 0 if res["passed"] else 1
    chars = tuple(int(x) for x in args.prompt_chars.split(","))
    tokens = tuple(int(x) for x in args.max_tokens.split(","))
    if args.bad + args.disconnect > 1 or min(args.bad, args.disconnect) < 0:
        ap.error("--bad + --disconnect must be in [0, 1]")

    log_dir = tempfile.mkdtemp(prefix="kdtree-soak-")
    server = Served(serve_args, args.shutdown_timeout, args.preallocate, os.path.join(log_dir, "serve.log"))
    samples: list[dict] = []
    sampling = threading.Event()
    t0 = [time.monotonic()]  # the soak's start (reset when the soak begins)

    compiles = Compiles(server.log_path, time.monotonic)  # times made relative to the soak's start at the end
    compiles.start()

    def sampler():
        while not sampling.wait(args.sample_s):
            samples.append(dict(sample(server.proc.pid, time.monotonic() - t0[0]), compiles=len(compiles.events)))

    try:
        print(f"starting: {shlex.join(server.argv)}", flush=True)
        health = server.wait_healthy(args.start_timeout)
        url = server.url
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        before = metrics(url)
        goods = pool(args.prompts, chars, tokens, args.seed)
        print(f"solo answers of {len(goods)} requests, one at a time", flush=True)
        with httpx.Client(base_url=url, timeout=args.request_timeout) as http:
            for g in goods:
                solo(http, model, g)
        bads = bad_requests(model, health["max_context"])
        print(f"warm-up: the pool {args.warmup_rounds} times at concurrency {args.concurrency}, 2 tokens each",
              flush=True)
        warm = warm_up(url, model, goods, args.concurrency, args.warmup_rounds, args.request_timeout)
        stats = Stats()
        loadavg_before = os.getloadavg()[0]
        t0[0] = time.monotonic()
        samples.append(dict(sample(server.proc.pid, 0.0), compiles=len(compiles.events)))
        threading.Thread(target=sampler, daemon=True).start()
        end = t0[0] + 60 * args.minutes
        print(f"soak: {args.concurrency} clients for {args.minutes:g} min", flush=True)
        clients = [Client(i, url, model, goods, bads, stats, t0[0], end, args.bad, args.disconnect,
                          args.request_timeout, args.seed) for i in range(args.concurrency)]
        with httpx.Client(base_url=url, timeout=args.request_timeout) as http:  # each bad request once, first
            for item in bads:
                clients[0].bad(http, item)
        for c in clients:
            c.start()
        last_print = time.monotonic()
        while any(c.is_alive() for c in clients):
            time.sleep(1)
            if time.monotonic() - last_print >= 60:
                last_print = time.monotonic()
                with stats.lock:
                    print(f"{(last_print - t0[0]) / 60:.1f} min: {json.dumps(stats.outcomes)}", flush=True)
        soak_s = time.monotonic() - t0[0]
        t_drain = time.monotonic()
        while True:
            m = metrics(url)
            if (m["active_slots"] == 0 and m["queue_depth"] == 0) or time.monotonic() - t_drain > args.drain_s:
                break
            time.sleep(0.5)
        drain_s = time.monotonic() - t_drain
        sampling.set()
        samples.append(dict(sample(server.proc.pid, time.monotonic() - t0[0]), compiles=len(compiles.events)))
        end_metrics = metrics(url)
        g = goods[0]
        with httpx.Client(base_url=url, timeout=args.request_timeout) as http:
            r = http.post(g["path"], json=dict(g["body"], model=model))
        after_ok = r.status_code == 200 and answer_of(g["path"], r.json()) == (g["solo_text"], g["solo_finish"],
                                                                               g["solo_tokens"])
        after = dict(equal=after_ok, detail="" if after_ok else f"{r.status_code}: {r.text[:300]}")
        entered = len(goods) + 1 + warm.get("200", 0) + sum(stats.statuses[k].get("200", 0)
                                                            for k in ("good", "disconnect"))
        deadline = time.monotonic() + 10  # the engine counts a request just after its last event: a moment later
        while True:
            counted = metrics(url)  # the server's counters, that request included
            finished = sum(by_label(counted, "requests_total").values()) - sum(by_label(before, "requests_total")
                                                                                .values())
            if finished >= entered or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        print("stopping the server (SIGTERM)", flush=True)
        rc, stop_s = server.stop(args.shutdown_timeout + 60)
    finally:
        sampling.set()
        server.kill()
        compiles.stop.set()
        compiles.join()
        compiles.poll()
        for e in compiles.events:
            e["t_s"] = round(e["t_s"] - t0[0], 1)
    lines = server.log_lines()
    errors = [ln for ln in lines if "Traceback" in ln or "ERROR" in ln or '" 5' in ln and "HTTP/1.1" in ln]
    eng_before = by_label(before, "requests_total")
    eng_end = by_label(counted, "requests_total")
    with stats.lock:
        clients_res = dict(outcomes=stats.outcomes, statuses=stats.statuses, failures=stats.failures,
                           failure_counts=stats.failure_counts, bad_requests_sent=stats.bad_names,
                           per_minute={str(k): v for k, v in sorted(stats.per_minute.items())})
        lat = sorted(stats.latency)
    res = dict(
        setup=dict(date=datetime.date.today().isoformat(), commit=commit(), name=args.name,
                   device=args.device or health.get("device"), health=health,
                   command=command,
                   serve_command=shlex.join(["kdtree-jax", *server.argv[3:]]), preallocate=args.preallocate,
                   minutes=args.minutes, soak_s=soak_s, concurrency=args.concurrency, prompts=args.prompts,
                   prompt_chars=chars, max_tokens=tokens, p_bad=args.bad, p_disconnect=args.disconnect,
                   bad_kinds=len(bads), warmup_rounds=args.warmup_rounds, sample_s=args.sample_s,
                   growth_limit=args.growth, seed=args.seed, note=args.note,
                   loadavg_before=loadavg_before),
        pool=[dict(name=g["name"], path=g["path"], prompt_chars=g["prompt_chars"], max_tokens=g["body"]["max_tokens"],
                   ignore_eos=g["body"]["ignore_eos"], solo_finish=g["solo_finish"], solo_tokens=g["solo_tokens"])
              for g in goods],
        clients=clients_res,
        latency=dict(p50_s=lat[len(lat) // 2], p99_s=lat[min(len(lat) - 1, int(0.99 * len(lat)))]) if lat else {},
        server=dict(engine_requests_before=eng_before),
        end=dict(active_slots=end_metrics["active_slots"], queue_depth=end_metrics["queue_depth"], drain_s=drain_s,
                 http_responses=by_label(counted, "http_responses_total"), engine_requests=eng_end),
        engine_outcomes={k: eng_end.get(k, 0) - eng_before.get(k, 0) for k in eng_end},
        engine_submitted=entered, warmup=warm,
        extra_requests=len(goods) + 1 + sum(v for k, v in warm.items() if k != "none"), after=after,
        memory=dict(samples=samples),
        stop=dict(status=rc, seconds=stop_s, shutdown_timeout_s=args.shutdown_timeout,
                  bound_s=args.shutdown_timeout + 30),
        log=dict(lines=len(lines), errors=errors[:50], tail=[ln[:300] for ln in lines[-20:]]),
        compiles=compiles.events,
        loadavg_after=os.getloadavg()[0])
    verdicts(res)
    shutil.rmtree(log_dir, ignore_errors=True)
    for goal, v in res["goals"].items():
        verdict = {True: "pass: ", False: "FAIL: ", None: ""}[v["passed"]]
        print(f"{goal}: {verdict}{v['measured']}")
    print("wrote", ", ".join(write(res, args.out, args.name)))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
