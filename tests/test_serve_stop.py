"""`kdtree-jax serve` stops within a bound (docs/reliability.md), on real processes serving the embedded model.

SIGTERM: new requests get 503 at once, a request in flight that finishes within --shutdown-timeout gets its whole
answer, one that does not ends with an error event and [DONE], and the process exits with status 0. Ctrl-C twice:
the process exits at once with status 130 and one line, the open stream told (an error event, [DONE]). No traceback
either way.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

LONG = 1900  # tokens: minutes of decoding on a CPU, far past the shutdown timeouts below


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`kdtree-jax serve --model builtin --method ar` in its own process, its stderr read as it comes."""

    def __init__(self, shutdown_timeout: float, cache: str):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "kdtree_jax.cli", "serve", "--model", "builtin", "--method", "ar", "--max-batch",
                "2", "--port", str(port), "--shutdown-timeout", str(shutdown_timeout)]
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", KDTREE_JAX_COMPILATION_CACHE=cache)
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        self.wait_for("serving 'builtin'", 300)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, f"no {text!r} in:\n" + "".join(self.lines)
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Stream:
    """A streamed greedy completion on a thread: its events, whether it ended with [DONE]; `started` is set with the
    first text."""

    def __init__(self, url: str, max_tokens: int):
        self.events, self.done = [], False
        self.started = threading.Event()
        body = dict(model="builtin", prompt="def f(x):", max_tokens=max_tokens, temperature=0, ignore_eos=True,
                    stream=True)
        self.thread = threading.Thread(target=self._run, args=(url, body))
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                    self.started.set()
        self.started.set()

    def join(self) -> None:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if "error" in e]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One compilation cache for both servers: the second starts without compiling."""
    return str(tmp_path_factory.mktemp("jax-cache"))


def test_sigterm_drains_within_the_timeout_then_exits_0(cache):
    server = Served(shutdown_timeout=8, cache=cache)
    try:
        long, short = Stream(server.url, LONG), Stream(server.url, 40)
        assert long.started.wait(120) and short.started.wait(120)
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        server.wait_for("stopping: new requests get 503", 30)
        r = httpx.post(server.url + "/v1/completions", json=dict(model="builtin", prompt="x", max_tokens=2), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(server.url + "/health", timeout=30).status_code == 503
        assert server.proc.wait(timeout=60) == 0
        elapsed = time.monotonic() - t0
        long.join(), short.join()
    finally:
        server.close()
    assert 8 <= elapsed < 30, elapsed
    assert short.done and not short.errors and short.events[-1]["choices"][0]["finish_reason"] == "length"
    assert long.done and len(long.errors) == 1 and "8 s shutdown timeout" in long.errors[0]["message"]
    assert "Traceback" not in "".join(server.lines)


def test_second_ctrl_c_exits_at_once_with_130_and_one_line(cache):
    server = Served(shutdown_timeout=120, cache=cache)
    try:
        long = Stream(server.url, LONG)
        assert long.started.wait(120)
        server.proc.send_signal(signal.SIGINT)
        server.wait_for("stopping: new requests get 503", 30)
        server.proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert server.proc.wait(timeout=30) == 130
        elapsed = time.monotonic() - t0
        long.join()
    finally:
        server.close()
    assert elapsed < 5, elapsed
    err = "".join(server.lines)
    assert "Traceback" not in err and err.splitlines()[-1].startswith("kdtree-jax: interrupted twice: stopped at once")
    assert long.done and len(long.errors) == 1 and "interrupted twice" in long.errors[0]["message"]
