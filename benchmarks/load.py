"""What checked loads cost: `kj.load` of a converted checkpoint with its CRC-32s checked as the arrays are read
(the default) and without (verify=False), alternating, each read from disk (the checkpoint's files evicted from the
page cache before every load), or with `--page-cache` from the page cache (the files read once and kept there: the
checksums' worst case, as the reads then cost the least).

The checkpoint is benchmarks/convert.py's synthetic Kimi K2-shaped INT4 source (`--moe-layers`, `--experts`,
`--vocab` set its size), converted with kdtree-convert into a temporary directory. The embedded model is not such a
checkpoint: `kj.load("builtin")` reads the package's npz files, which carry no checksums.

    python benchmarks/load.py                                  # 1 dense + 1 MoE layer x 32 experts: ~3 GB
    python benchmarks/load.py --page-cache --out benchmarks/results/load/page_cache
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from convert import commit, evict, machine, make_checkpoint  # noqa: E402


def timed_load(out: str, verify: bool, page_cache: bool = False, zlib_crc: bool = False) -> float:
    """Seconds of one kj.load; zlib_crc: the checksums by zlib's CRC-32 instead of the C++ library's (the A/B)."""
    import jax

    import kdtree_jax as kj
    import kdtree_jax.checkpoint as ckpt

    for d, _, files in os.walk(out):
        for f in files:
            if not page_cache:
                evict(os.path.join(d, f))
    native = ckpt._native_crc32
    if zlib_crc:
        ckpt._native_crc32 = lambda: None
    try:
        t0 = time.perf_counter()
        jax.block_until_ready(kj.load(out, verify=verify).params)
        return time.perf_counter() - t0
    finally:
        ckpt._native_crc32 = native


KINDS = {"checked (default)": (True, False), "checked, zlib's CRC-32": (True, True), "verify=False": (False, False)}


def native_crc32() -> str:
    """Which CRC-32 the checked load ran: the C++ library's (folding or a byte at a time) or zlib's."""
    import kdtree_jax.checkpoint as ckpt
    from kdtree_jax.kernels._registry import cpu_library

    if ckpt._native_crc32() is None:
        return "zlib"
    return "the C++ library, " + ("folded with carry-less multiplies" if cpu_library().KdCrc32Folds() else
                                  "a byte at a time")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3, help="loads of each kind, alternating")
    ap.add_argument("--page-cache", action="store_true",
                    help="read from the page cache (files not evicted): the checksums' largest share of a load")
    ap.add_argument("--dir", default=None, help="where to put the temporary checkpoints (default: the system temp)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "load"))
    args = ap.parse_args(argv)
    from kdtree_converters.convert import convert

    root = tempfile.mkdtemp(prefix="kdtree-load-bench-", dir=args.dir)
    try:
        src, ckpt = os.path.join(root, "hf"), os.path.join(root, "out")
        make_checkpoint(src, args.moe_layers, args.experts, args.vocab)
        convert(src, ckpt, progress=False, log=lambda s: None)
        shutil.rmtree(src)
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
        times = {kind: [] for kind in KINDS}
        load_before = os.getloadavg()[0]
        timed_load(ckpt, True)  # compiles and warms what does not depend on the data
        kinds = list(KINDS)
        for rep in range(args.repeats):  # each kind first, second and third in turn: none always runs first, or
            for kind in kinds[rep % 3:] + kinds[:rep % 3]:  # always after the same other
                verify, zlib_crc = KINDS[kind]
                times[kind].append(timed_load(ckpt, verify, args.page_cache, zlib_crc))
                print(f"{kind}: {times[kind][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0]
    checked, plain = statistics.median(times["checked (default)"]), statistics.median(times["verify=False"])
    zlib_checked = statistics.median(times["checked, zlib's CRC-32"])
    meta = dict(date=datetime.date.today().isoformat(), commit=commit(), machine=machine(), bytes=nbytes,
                moe_layers=args.moe_layers, experts=args.experts, vocab=args.vocab, repeats=args.repeats,
                page_cache=args.page_cache, native_crc32=native_crc32(), loadavg=[load_before, load_after])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "load.json"), "w") as f:
        json.dump(dict(meta=meta, checked_s=times["checked (default)"], unchecked_s=times["verify=False"],
                       checked_zlib_s=times["checked, zlib's CRC-32"]), f, indent=1)
    text = "\n".join([
        f"# Checked loads ({meta['date']}, commit {meta['commit']})", "",
        f"{meta['machine']}. A {nbytes / 1e9:.2f} GB checkpoint (benchmarks/convert.py's synthetic K2 shapes: 1 dense "
        f"+ {args.moe_layers} MoE layer(s) x {args.experts} experts, vocab {args.vocab}), read "
        f"{'from the page cache' if args.page_cache else 'from disk'} each time; {args.repeats} loads of each kind, "
        f"alternating, each kind first in turn; CRC-32 by {meta['native_crc32']}; 1-minute load average "
        f"{load_before:.1f} before, "
        f"{load_after:.1f} after (on {os.cpu_count()} cores). `python benchmarks/load.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`.", "",
        "| load | median s | min s | max s | GB/s (median) |", "|---|---|---|---|---|",
        *(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} | {max(ts):.2f} | "
          f"{nbytes / 1e9 / statistics.median(ts):.2f} |"
          for name, ts in times.items()), "",
        f"Checked loads take {checked / plain - 1:+.0%} the time of unchecked ones (goal: at most +10%); with zlib's "
        f"CRC-32 they took {zlib_checked / plain - 1:+.0%} in the same run (medians).", ""])
    with open(os.path.join(args.out, "load.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
