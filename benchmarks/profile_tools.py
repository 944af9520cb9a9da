"""GPU kernel profiles of a jitted call: a jax.profiler trace (perfetto JSON) parsed into per-kernel rows."""

from __future__ import annotations

import collections
import glob
import gzip
import heapq
import json
import os
import re
import tempfile


def _kernel_family(name: str) -> str:
    """A kernel's name without return type, namespaces, template arguments, parameters and fusion numbers (so that
    repeats group together): "void (anonymous namespace)::Foo<64>(int)" -> "Foo", "loop_add_fusion_3" ->
    "loop_add_fusion"."""
    name = name.replace("(anonymous namespace)::", "").strip()
    name = re.sub(r"^void\s+", "", name)
    name = re.split(r"[<(]", name, maxsplit=1)[0].split("::")[-1]
    return re.sub(r"[._]\d+$", "", name.strip()) or "?"


def chain_spans(events: list[tuple[str, float, float]], first: str, last: str) -> list[float]:
    """µs from the start of each `first` kernel to the end of the next `last` kernel to start at or after it (events:
    (family, start µs, duration µs) of every stream); a chain of kernels timed as one span, so that kernels launched
    early that wait for the one before them (programmatic dependent launch) count once."""
    events = sorted(events, key=lambda e: e[1])
    spans = []
    for i, (family, ts, _) in enumerate(events):
        if family != first:
            continue
        end = next((t + d for f, t, d in events[i:] if f == last), None)
        if end is not None:
            spans.append(end - ts)
    return spans


def path_shares(events: list[tuple[str, float, float]], calls: int = 1) -> dict[str, float]:
    """µs of the span from the first start to the last end, each instant given to the running kernel that ends first
    (events: (family, start µs, duration µs) of every stream), and to "(idle)" when none runs. A kernel launched early
    that waits for the one before it (programmatic dependent launch) is charged only after that one ends, and a kernel
    that ran beside a longer one on another stream only while it was the next to end: what each kernel added to the
    step, where the busy time adds up every kernel's whole duration. With `calls` calls in the trace, the calls - 1
    longest idle stretches are the gaps between calls: "(between calls)", not "(idle)". The values sum to the span."""
    bounds = sorted({t for _, ts, d in events for t in (ts, ts + d)})
    order = sorted(events, key=lambda e: e[1])
    shares = collections.defaultdict(float)
    running: list[tuple[float, int, str]] = []
    idle, stretch, nxt = [], 0.0, 0
    for a, b in zip(bounds, bounds[1:]):
        while nxt < len(order) and order[nxt][1] <= a:
            fam, ts, d = order[nxt]
            heapq.heappush(running, (ts + d, nxt, fam))
            nxt += 1
        while running and running[0][0] <= a:
            heapq.heappop(running)
        if running:
            shares[running[0][2]] += b - a
            if stretch:
                idle.append(stretch)
            stretch = 0.0
        else:
            stretch += b - a
    if stretch:
        idle.append(stretch)
    idle.sort(reverse=True)
    gaps = idle[:max(calls - 1, 0)]
    if gaps:
        shares["(between calls)"] = sum(gaps)
    if len(idle) > len(gaps):
        shares["(idle)"] = sum(idle[len(gaps):])
    return dict(shares)


HOST_EVENT_MIN_US = 5.0  # the host events kept with keep_events: what can explain an idle GPU


def parse_trace(path: str, chain: tuple[str, str] | None = None, calls: int = 1, keep_events: bool = False) -> dict:
    """{"kernels": {family: [launches, total_us]}, "busy_us": sum of stream events, "span_us": first to last,
    "path_us": `path_shares` of `calls` calls} of every event on the GPU streams of a perfetto trace (threads named
    "Stream ..." of a GPU process), and "host":
    {name with digits as #: [events, total_us]} of the events of the other processes (XLA's thunks, launches).
    chain (first, last kernel family): "chain_us", the `chain_spans` of the trace. keep_events: "events", every GPU
    stream event as [family, stream (thread id), start µs from the first, duration µs], in start order, and
    "host_events", the host threads' events of at least HOST_EVENT_MIN_US as [name, thread, start µs from the first
    GPU event, duration µs]."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = str(e.get("args", {}).get("name", ""))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = str(e.get("args", {}).get("name", ""))
    gpu = {pid for pid, n in procs.items() if "GPU" in n or "/device:" in n}
    kernels = collections.defaultdict(lambda: [0, 0.0])
    host = collections.defaultdict(lambda: [0, 0.0])
    busy, t0, t1, stream_events, tids, host_events = 0.0, None, None, [], [], []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in gpu:  # host threads: what the runtime did (thunks, launches)
            h = host[re.sub(r"\d+", "#", str(e.get("name", "?")))[:80]]
            h[0] += 1
            h[1] += float(e.get("dur", 0.0))
            if keep_events and float(e.get("dur", 0.0)) >= HOST_EVENT_MIN_US:
                host_events.append((str(e.get("name", "?"))[:120], e.get("tid"), float(e["ts"]), float(e["dur"])))
            continue
        if e.get("ph") != "X" or e.get("pid") not in gpu:
            continue
        if not threads.get((e["pid"], e.get("tid")), "").startswith("Stream"):
            continue
        dur = float(e.get("dur", 0.0))
        family = _kernel_family(e["name"])
        stream_events.append((family, float(e["ts"]), dur))
        tids.append(e.get("tid"))
        k = kernels[family]
        k[0] += 1
        k[1] += dur
        busy += dur
        ts = float(e["ts"])
        t0 = ts if t0 is None else min(t0, ts)
        t1 = ts + dur if t1 is None else max(t1, ts + dur)
    out = {"kernels": dict(kernels), "host": dict(host), "busy_us": busy,
           "span_us": (t1 - t0) if t0 is not None else 0.0, "path_us": path_shares(stream_events, calls)}
    if chain is not None:
        out["chain_us"] = chain_spans(stream_events, *chain)
    if keep_events:
        out["events"] = sorted(([f, tid, round(ts - (t0 or 0.0), 3), round(d, 3)]
                                for (f, ts, d), tid in zip(stream_events, tids)), key=lambda e: e[2])
        out["host_events"] = sorted(([n, tid, round(ts - (t0 or 0.0), 3), round(d, 3)]
                                     for n, tid, ts, d in host_events), key=lambda e: e[2])
    return out


def profile_calls(fn, args, calls: int, logdir: str | None = None, chain: tuple[str, str] | None = None,
                  keep_events: bool = False) -> dict:
    """Run fn(*args) `calls` times under the profiler (after one warm call) and parse the GPU streams' kernels.
    Kernel totals are divided by `calls` (per call); chain: as `parse_trace`'s (every span, not divided)."""
    import jax

    jax.block_until_ready(fn(*args))
    logdir = logdir or tempfile.mkdtemp(prefix="kdtree_prof_")
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    paths = sorted(glob.glob(os.path.join(logdir, "**", "perfetto_trace.json*"), recursive=True))
    if not paths:
        raise RuntimeError(f"no perfetto trace under {logdir}")
    res = parse_trace(paths[-1], chain, calls, keep_events)
    res["kernels"] = {k: [n / calls, us / calls] for k, (n, us) in res["kernels"].items()}
    res["host"] = {k: [n / calls, us / calls] for k, (n, us) in res["host"].items()}
    res["busy_us"] /= calls
    res["span_us"] /= calls
    res["path_us"] = {k: us / calls for k, us in res["path_us"].items()}
    return res


def top_kernels(prof: dict, n: int = 25) -> list[tuple[str, float, float]]:
    """[(family, launches per call, µs per call)] sorted by time, the n largest."""
    rows = sorted(((k, c, us) for k, (c, us) in prof["kernels"].items()), key=lambda r: -r[2])
    return rows[:n]
