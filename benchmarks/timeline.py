"""One layer of a profiled step, kernel by kernel: what ran on which stream, when, and what each kernel added to the
step (`profile_tools.path_shares` over the layer's window).

    python benchmarks/timeline.py results/full_scale/timeline_4096_1x1.json.gz [--marker MlaVerifyKernel] [--layer 20]
    python benchmarks/timeline.py TIMELINE --windows [--show GemvUpKernel,GemvDownKernel]   # every window, sorted
    python benchmarks/timeline.py TIMELINE --gaps [--min-gap 3]   # every stretch with no kernel running
    python benchmarks/timeline.py TIMELINE --gaps --host HOST   # and what the host did in the longest ones

The timeline files are written by `benchmarks/full_scale.py` for its profiled cells (every GPU kernel of three
steps: [family, stream, start µs, duration µs]). A layer's window runs from the start of its marker kernel (one a
layer, default the attention kernel) to the start of the next one; kernels launched early that wait (programmatic
dependent launch) show a long duration and a small share."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_tools import path_shares  # noqa: E402


def layer_rows(events: list, marker: str, layer: int) -> tuple[list[dict], float]:
    """The kernels starting in the window [start of the layer-th marker, start of the next one): rows of family,
    stream, start and end (µs from the window's start), duration and µs on the path (each instant of the window
    charged to the running kernel that ends first), in start order; and the window's length."""
    starts = [e[2] for e in events if e[0] == marker]
    if layer + 1 >= len(starts):
        raise ValueError(f"{len(starts)} {marker} kernels in the timeline: no window after number {layer}")
    a, b = starts[layer], starts[layer + 1]
    inside = [e for e in events if a <= e[2] < b]
    clipped = [(f"{i}", ts, min(ts + d, b) - ts) for i, (_, _, ts, d) in enumerate(inside)]
    shares = path_shares(clipped)
    rows = [dict(family=f, stream=s, start=ts - a, end=ts + d - a, dur=d, path=shares.get(f"{i}", 0.0))
            for i, (f, s, ts, d) in enumerate(inside)]
    return rows, b - a


def idle_gaps(events: list, min_gap: float) -> list[dict]:
    """Every stretch of at least min_gap µs in which no kernel runs on any stream, in time order, with the kernels that
    ended before it and started after it."""
    out, end, last = [], None, None
    for f, _, ts, d in sorted(events, key=lambda e: e[2]):
        if end is not None and ts - end >= min_gap:
            out.append(dict(start=end, us=ts - end, before=last, after=f))
        if end is None or ts + d > end:
            end, last = ts + d, f
    return out


def host_in_gap(host: list, gap: dict) -> list[tuple]:
    """The host events [name, thread, start, duration] that overlap a gap, longest overlap first, with the overlap."""
    a, b = gap["start"], gap["start"] + gap["us"]
    rows = [(n, tid, ts, d, min(ts + d, b) - max(ts, a)) for n, tid, ts, d in host if ts < b and ts + d > a]
    return sorted(rows, key=lambda r: -r[4])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline", help="a timeline_*.json.gz written by benchmarks/full_scale.py")
    ap.add_argument("--marker", default="MlaVerifyKernel", help="the kernel family that starts each layer's window")
    ap.add_argument("--layer", type=int, default=None, help="which window (default: the middle one of the first step)")
    ap.add_argument("--windows", action="store_true",
                    help="every window of the first step: its length and the µs on the path of --show's kernels")
    ap.add_argument("--show", default="GemvUpKernel,GemvDownKernel", help="kernel families for --windows")
    ap.add_argument("--gaps", action="store_true", help="every stretch with no kernel running (of --min-gap µs)")
    ap.add_argument("--min-gap", type=float, default=3.0)
    ap.add_argument("--host", metavar="HOST", help="with --gaps: the host events file written beside the timeline "
                    "(host_*.json.gz): for the --top-gaps longest gaps, the host events that overlap each")
    ap.add_argument("--top-gaps", type=int, default=3)
    ap.add_argument("--top-host", type=int, default=15)
    args = ap.parse_args(argv)
    with gzip.open(args.timeline, "rt") as f:
        events = json.load(f)
    if args.gaps:
        gaps = idle_gaps(events, args.min_gap)
        print(f"{len(gaps)} stretches of >= {args.min_gap} µs with no kernel running, {sum(g['us'] for g in gaps):.0f} "
              "µs in all\n\n| from µs | µs | after | before |\n|---|---|---|---|")
        for g in gaps:
            print(f"| {g['start']:.1f} | {g['us']:.1f} | `{g['before']}` | `{g['after']}` |")
        if args.host:
            with gzip.open(args.host, "rt") as f:
                host = json.load(f)
            for g in sorted(gaps, key=lambda g: -g["us"])[:args.top_gaps]:
                print(f"\nThe host during the gap at {g['start']:.1f} µs ({g['us']:.1f} µs), its longest events:\n\n"
                      "| event | thread | start µs | µs | µs inside the gap |\n|---|---|---|---|---|")
                for name, tid, ts, d, inside in host_in_gap(host, g)[:args.top_host]:
                    print(f"| `{name[:90]}` | {tid} | {ts:.1f} | {d:.1f} | {inside:.1f} |")
        return 0
    count = sum(e[0] == args.marker for e in events)
    if args.windows:
        show = [f.strip() for f in args.show.split(",") if f.strip()]
        lines = []
        for layer in range(max(count // 3 - 1, 0)):  # the first of the three profiled steps
            rows, window = layer_rows(events, args.marker, layer)
            lines.append((window, layer, [sum(r["path"] for r in rows if r["family"] == f) for f in show]))
        print(f"| window µs | window | {' | '.join(f'{f} µs on the path' for f in show)} |\n"
              f"|---|---|{'---|' * len(show)}")
        for window, layer, paths in sorted(lines):
            print(f"| {window:.1f} | {layer} | {' | '.join(f'{p:.1f}' for p in paths)} |")
        return 0
    layer = args.layer if args.layer is not None else max(count // 6, 0)  # three steps: the middle of the first
    rows, window = layer_rows(events, args.marker, layer)
    print(f"window {layer} of {count} ({args.marker} to the next): {window:.1f} µs, {len(rows)} kernels, "
          f"{sum(r['path'] for r in rows):.1f} µs of them on the path\n")
    print("| kernel | stream | start µs | end µs | µs | µs on the path |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['family'][:60]}` | {r['stream']} | {r['start']:.1f} | {r['end']:.1f} | {r['dur']:.1f} | "
              f"{r['path']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
