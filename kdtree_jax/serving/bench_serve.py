"""`kdtree-jax bench-serve`: throughput and latency of a running server at several concurrencies.

For each concurrency c, c clients send streamed /v1/completions requests back to back (`rounds` each: c x rounds
requests), greedy, `ignore_eos` so that every request generates exactly max_tokens tokens, from prompts taken from
the held-out files of the embedded model's corpus (standard-library files it was not trained on). Before the timed
levels, every prompt is sent once (at the highest concurrency, 2 tokens each) so that compilation is not timed.
Per level: aggregate tok/s (all tokens / wall time), per-request tok/s (mean of each request's tokens / its latency),
time to first token p50 / p99, tokens and wall seconds. Results as JSON, a Markdown table and a PNG plot.

`prefix_ttft` measures prefix reuse instead: the time to first token of prompts that begin with a long held-out
prefix, cold (a prefix the server has not seen) against warm (the prefix of the request just before, another
question after it), with the server's prefix-cache counters.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np

from ..corpus import corpus_split


@functools.cache
def heldout_texts() -> tuple[str, ...]:
    """The held-out standard-library files' text (read once)."""
    _, held = corpus_split()
    return tuple(p.read_text(errors="replace") for p in held)


def longest_prompt_chars() -> int:
    """The most characters `heldout_prompts` can cut: a window comes from a file more than twice its length."""
    return (max(map(len, heldout_texts()), default=0) - 1) // 2


def heldout_prompts(count: int, chars: int, seed: int) -> list[str]:
    """`count` windows of `chars` characters from the held-out standard-library files, each starting at a line."""
    texts = [t for t in heldout_texts() if len(t) > 2 * chars]
    if not texts:
        raise ValueError(f"prompts of {chars} characters are cut from held-out files more than twice as long, and "
                         f"none is longer than {2 * chars} characters (at most {longest_prompt_chars()})")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        text = texts[rng.integers(len(texts))]
        start = text.rfind("\n", 0, int(rng.integers(len(text) - chars))) + 1
        out.append(text[start:start + chars])
    return out


def _check_room(server: dict, max_tokens: int) -> None:
    """A ValueError naming --max-tokens when the server's context (its /health's max_context, where it says one)
    leaves no room for a prompt besides them: every timed request would be refused, after the warm-up."""
    context = server.get("max_context") if isinstance(server, dict) else None
    if isinstance(context, int) and max_tokens >= context:
        raise ValueError(f"--max-tokens {max_tokens}: the server's context is {context} tokens (its /health), "
                         "prompt and answer together")


def _refusal(status: int, body: bytes) -> str:
    """A non-200 answer in words: the message of an OpenAI-style error ({"error": {"message": ...}}) or a FastAPI one
    ({"detail": ...}), else the start of the body."""
    text = body.decode(errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return f"the server answered {status}: {text[:500]}"
    message = None
    if isinstance(data, dict):
        error = data.get("error")
        message = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
        if message is None and "detail" in data:
            message = data["detail"] if isinstance(data["detail"], str) else json.dumps(data["detail"])
    return f"the server answered {status}: {(text if message is None else str(message))[:500]}"


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed request: its latency, time to first token and generated tokens."""
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, ignore_eos=True,
                stream_options={"include_usage": True})
    t0 = time.perf_counter()
    first, tokens, prompt_tokens = None, None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(_refusal(r.status_code, await r.aread()))
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"the server failed a request: {data['error']['message']}")
            if first is None and data["choices"] and data["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if data.get("usage"):
                tokens, prompt_tokens = data["usage"]["completion_tokens"], data["usage"]["prompt_tokens"]
    latency = time.perf_counter() - t0
    return dict(latency_s=latency, ttft_s=first if first is not None else latency, tokens=tokens or 0,
                prompt_tokens=prompt_tokens)


async def _level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                 timeout: float) -> tuple[list[dict], float]:
    """The prompts sent by `concurrency` clients, each sending its next request when the last one ends."""
    todo = list(prompts)
    results = []

    async def client_loop(client):
        while todo:
            results.append(await _one(client, model, todo.pop(), max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def summarize(concurrency: int, results: list[dict], wall: float) -> dict:
    """One row of the table."""
    ttft = np.array([r["ttft_s"] for r in results])
    tokens = sum(r["tokens"] for r in results)
    return dict(concurrency=concurrency, requests=len(results), tokens=tokens, wall_s=wall,
                aggregate_tok_s=tokens / wall,
                per_request_tok_s=float(np.mean([r["tokens"] / r["latency_s"] for r in results])),
                ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)))


COUNTERS = ("row_steps_total", "step_tokens_total", "verified_nodes_total")  # a kdtree-jax server's, in /metrics


def _read_metrics(url: str, timeout: float, names: tuple[str, ...]) -> dict[str, float]:
    """These kdtree_ metrics from the server's /metrics (a kdtree-jax server; empty for other servers)."""
    with httpx.Client(base_url=url, timeout=timeout) as c:
        r = c.get("/metrics")
    if r.status_code != 200:
        return {}
    found = {m.group(1): float(m.group(2)) for m in re.finditer(r"^kdtree_(\w+) (\S+)$", r.text, re.M)}
    return {n: found[n] for n in names if n in found}


def _counters(url: str, timeout: float) -> dict[str, float]:
    """The server's request-step counters from /metrics."""
    return _read_metrics(url, timeout, COUNTERS)


def _steps(before: dict, after: dict) -> dict:
    """tau (tokens per request-step) and draft nodes verified per request-step between two readings of the
    counters; nothing where the server does not count them."""
    if not all(n in before and n in after for n in COUNTERS):
        return {}
    steps = after["row_steps_total"] - before["row_steps_total"]
    if steps <= 0:
        return {}
    return dict(tau=(after["step_tokens_total"] - before["step_tokens_total"]) / steps,
                nodes_per_step=(after["verified_nodes_total"] - before["verified_nodes_total"]) / steps)


def _commit() -> str | None:
    """The commit of the source tree this package runs from: $KDTREE_COMMIT when set (a copy whose git metadata
    is stale), else git's answer when it is a checkout."""
    if os.environ.get("KDTREE_COMMIT"):
        return os.environ["KDTREE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run(url: str, concurrencies: list[int], *, rounds: int = 2, max_tokens: int = 128, prompt_chars: int = 256,
        seed: int = 0, model: str | None = None, timeout: float = 600.0, log=print) -> dict:
    """Warm the server up, then time each concurrency; returns {"setup": ..., "rows": [...]}."""
    url = url.rstrip("/")
    with httpx.Client(base_url=url, timeout=timeout) as c:
        model = model or c.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        server = c.get("/health").raise_for_status().json()
    _check_room(server, max_tokens)
    prompts = heldout_prompts(max(concurrencies) * rounds, prompt_chars, seed)
    log(f"warming up: {len(prompts)} prompts at concurrency {max(concurrencies)}")
    asyncio.run(_level(url, model, prompts, max(concurrencies), 2, timeout))
    log("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    rows = []
    for c in concurrencies:
        before = _counters(url, timeout)
        results, wall = asyncio.run(_level(url, model, prompts[:c * rounds], c, max_tokens, timeout))
        rows.append(dict(summarize(c, results, wall), **_steps(before, _counters(url, timeout))))
        log(format_row(rows[-1]))
    setup = dict(url=url, model=model, server=server, rounds=rounds, max_tokens=max_tokens, prompt_chars=prompt_chars,
                 seed=seed, date=datetime.date.today().isoformat(), commit=_commit())
    return dict(setup=setup, rows=rows)


PREFIX_COUNTERS = ("prefix_cache_hits_total", "prefix_cache_tokens_saved_total")


def prefix_ttft(url: str, *, prefix_chars: int = 1500, question_chars: int = 50, rounds: int = 3,
                max_tokens: int = 8, seed: int = 0, model: str | None = None, timeout: float = 600.0,
                log=print) -> dict:
    """Time to first token of prompts beginning with `prefix_chars` characters of a held-out file, one request at a
    time: per round, a new prefix and a question of `question_chars` characters (cold: the server has not seen the
    prefix), then the same prefix and another question (warm: the server may reuse the prefix's cache rows). A first
    round, not timed, compiles the programs those shapes need. Returns {"setup", "rows": one per round, "summary":
    the medians, warm / cold, and the server's prefix-cache hits and tokens saved over the timed rounds}."""
    url = url.rstrip("/")
    with httpx.Client(base_url=url, timeout=timeout) as c:
        model = model or c.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        server = c.get("/health").raise_for_status().json()
    _check_room(server, max_tokens)
    prefixes = heldout_prompts(rounds + 1, prefix_chars, seed)
    questions = heldout_prompts(2 * (rounds + 1), question_chars, seed + 1)

    async def pair(prefix: str, a: str, b: str) -> tuple[dict, dict]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            cold = await _one(client, model, prefix + a, max_tokens)
            return cold, await _one(client, model, prefix + b, max_tokens)

    log(f"warming up: a prefix of {prefix_chars} characters, then two questions of {question_chars}")
    start = _read_metrics(url, timeout, PREFIX_COUNTERS)
    asyncio.run(pair(prefixes[0], questions[0], questions[1]))
    before = _read_metrics(url, timeout, PREFIX_COUNTERS)
    warmup = {f"warmup_{n}": before[n] - start[n] for n in PREFIX_COUNTERS if n in before and n in start}
    log("warm-up: " + (", ".join(f"{k} {v:g}" for k, v in warmup.items()) or "no prefix counters"))
    rows = []
    for i in range(1, rounds + 1):
        cold, warm = asyncio.run(pair(prefixes[i], questions[2 * i], questions[2 * i + 1]))
        rows.append(dict(round=i, cold_prompt_tokens=cold["prompt_tokens"], warm_prompt_tokens=warm["prompt_tokens"],
                         cold_ttft_s=cold["ttft_s"], warm_ttft_s=warm["ttft_s"]))
        log(f"round {i}: cold {1e3 * cold['ttft_s']:.0f} ms ({cold['prompt_tokens']} prompt tokens), warm "
            f"{1e3 * warm['ttft_s']:.0f} ms ({warm['prompt_tokens']})")
    after = _read_metrics(url, timeout, PREFIX_COUNTERS)
    cold_s = float(np.median([r["cold_ttft_s"] for r in rows]))
    warm_s = float(np.median([r["warm_ttft_s"] for r in rows]))
    summary = dict(cold_ttft_p50_s=cold_s, warm_ttft_p50_s=warm_s, warm_over_cold=warm_s / cold_s,
                   **{n: after[n] - before[n] for n in PREFIX_COUNTERS if n in before and n in after}, **warmup)
    setup = dict(url=url, model=model, server=server, rounds=rounds, prefix_chars=prefix_chars,
                 question_chars=question_chars, max_tokens=max_tokens, seed=seed,
                 date=datetime.date.today().isoformat(), commit=_commit())
    return dict(setup=setup, rows=rows, summary=summary)


def prefix_markdown(runs: list[dict], title: str, note: str = "") -> str:
    """A table per `prefix_ttft` run: each round's cold and warm TTFT, then the medians."""
    lines = [f"# {title}", ""] + ([note, ""] if note else [])
    for run_ in runs:
        s, srv, m = run_["setup"], run_["setup"]["server"], run_["summary"]
        gb = srv.get("prefix_cache_bytes", 0) / 1e9
        lines += [f"## {srv.get('method')}" + (f" (budget {srv['budget']})" if srv.get("budget") else "")
                  + f", prefix cache {gb:g} GB", "",
                  f"{s['date']}, {srv.get('device')}, commit {s['commit']}. Model {s['model']}; a held-out prefix of "
                  f"{s['prefix_chars']} characters and a question of {s['question_chars']}, one request at a time, "
                  f"{s['max_tokens']} tokens each (greedy); TTFT = time to the first streamed text. Over the timed "
                  f"rounds the server counted {m.get('prefix_cache_hits_total', 0):g} prefix hits and "
                  f"{m.get('prefix_cache_tokens_saved_total', 0):g} prompt tokens read from its prefix cache"
                  + (f" (in the untimed warm-up round: {m['warmup_prefix_cache_hits_total']:g} hits)"
                     if "warmup_prefix_cache_hits_total" in m else "") + ".", "",
                  "| round | prompt tokens cold / warm | cold TTFT ms | warm TTFT ms | warm / cold |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['round']} | {r['cold_prompt_tokens']} / {r['warm_prompt_tokens']} | "
                  f"{1e3 * r['cold_ttft_s']:.0f} | {1e3 * r['warm_ttft_s']:.0f} | "
                  f"{r['warm_ttft_s'] / r['cold_ttft_s']:.2f} |" for r in run_["rows"]]
        lines += [f"| median | | {1e3 * m['cold_ttft_p50_s']:.0f} | {1e3 * m['warm_ttft_p50_s']:.0f} | "
                  f"{m['warm_over_cold']:.2f} |", ""]
    return "\n".join(lines)


COLUMNS = ("concurrency", "aggregate tok/s", "per-request tok/s", "TTFT p50 ms", "TTFT p99 ms", "tokens", "wall s",
           "tau", "nodes / step")


def format_row(r: dict) -> str:
    per_step = (f"{r['tau']:.2f} | {r['nodes_per_step']:.1f}" if "tau" in r else "- | -")
    return (f"| {r['concurrency']} | {r['aggregate_tok_s']:.1f} | {r['per_request_tok_s']:.1f} | "
            f"{1e3 * r['ttft_p50_s']:.0f} | {1e3 * r['ttft_p99_s']:.0f} | {r['tokens']} | {r['wall_s']:.2f} | "
            f"{per_step} |")


def markdown(runs: list[dict], title: str, note: str = "") -> str:
    """A table per run, under a heading that says what each run measured (and the note under the title)."""
    lines = [f"# {title}", ""] + ([note, ""] if note else [])
    for run_ in runs:
        s, srv = run_["setup"], run_["setup"]["server"]
        auto = (f", max {srv.get('max_budget')}, tiers {srv.get('tiers')}, a plan every {srv.get('replan')} steps"
                if srv.get("budget") == "auto" else "")
        lines += [f"## {srv.get('method')}" + (f" (budget {srv['budget']}{auto})" if srv.get("budget") else ""), "",
                  f"{s['date']}, {srv.get('device')}, commit {s['commit']}. Model {s['model']}, max_batch "
                  f"{srv.get('max_batch')}, chunk_steps {srv.get('chunk_steps')}; {s['rounds']} requests per client, "
                  f"{s['max_tokens']} tokens each (greedy, ignore_eos), held-out prompts of {s['prompt_chars']} "
                  "characters; TTFT = time to the first streamed text; tau and nodes / step: tokens committed and "
                  "draft nodes verified per request per decoding step (the server's counters).", "",
                  "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += [format_row(r) for r in run_["rows"]]
        lines.append("")
    return "\n".join(lines)


def plot(runs: list[dict], path: str, title: str) -> None:
    """Aggregate and per-request tok/s (left) and TTFT p50 (right) against concurrency, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for run_ in runs:
        srv = run_["setup"]["server"]
        label = srv.get("method", "?") + (f" {srv['budget']}" if srv.get("budget") else "")
        c = [r["concurrency"] for r in run_["rows"]]
        line, = ax.plot(c, [r["aggregate_tok_s"] for r in run_["rows"]], "o-", label=f"{label} aggregate")
        ax.plot(c, [r["per_request_tok_s"] for r in run_["rows"]], "s--", color=line.get_color(),
                label=f"{label} per request")
        ax2.plot(c, [1e3 * r["ttft_p50_s"] for r in run_["rows"]], "o-", color=line.get_color(), label=label)
    ax.set(xlabel="concurrent requests", ylabel="tokens / s", title="throughput")
    ax2.set(xlabel="concurrent requests", ylabel="ms", title="time to first token (p50)")
    for a in (ax, ax2):
        a.set_xticks(sorted({r["concurrency"] for run_ in runs for r in run_["rows"]}))
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(runs: list[dict], out_dir: str, name: str, title: str, note: str = "", *,
          with_plot: bool = True) -> list[str]:
    """name.json, name.md and (with_plot) name.png in out_dir, each written whole (a temporary file renamed into
    place), so a benchmark can write the runs it has after each one and a later failure loses only what follows.
    Runs of `prefix_ttft` get their own table and no plot. Returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    prefix = bool(runs) and "summary" in runs[0]
    with_plot = with_plot and not prefix
    table = prefix_markdown(runs, title, note) if prefix else markdown(runs, title, note)
    for ext, text in ((".json", json.dumps(runs, indent=1)), (".md", table)):
        tmp = base + ext + ".tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, base + ext)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    if not with_plot:
        if os.path.exists(base + ".png"):  # an earlier run's plot must not sit beside these tables
            os.unlink(base + ".png")
        return [base + ".json", base + ".md"]
    plot(runs, base + ".png", title)
    return [base + ext for ext in (".json", ".md", ".png")]
