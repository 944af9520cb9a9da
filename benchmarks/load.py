"""What checked loads cost: `kj.load` of a converted checkpoint with its CRC-32s checked as the arrays are read
(the default) and without (verify=False), alternating, each read from disk (the checkpoint's files evicted from the
page cache before every load).

The checkpoint is benchmarks/convert.py's synthetic Kimi K2-shaped INT4 source (`--moe-layers`, `--experts`,
`--vocab` set its size), converted with kdtree-convert into a temporary directory. The embedded model is not such a
checkpoint: `kj.load("builtin")` reads the package's npz files, which carry no checksums.

    python benchmarks/load.py                                  # 1 dense + 1 MoE layer x 32 experts: ~3 GB
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


def timed_load(out: str, verify: bool) -> float:
    import jax

    import kdtree_jax as kj

    for d, _, files in os.walk(out):
        for f in files:
            evict(os.path.join(d, f))
    t0 = time.perf_counter()
    jax.block_until_ready(kj.load(out, verify=verify).params)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe-layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3, help="loads of each kind, alternating")
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
        times = {True: [], False: []}
        timed_load(ckpt, True)  # compiles and warms what does not depend on the data
        for _ in range(args.repeats):
            for verify in (True, False):
                times[verify].append(timed_load(ckpt, verify))
                print(f"verify={verify}: {times[verify][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    checked, plain = statistics.median(times[True]), statistics.median(times[False])
    meta = dict(date=datetime.date.today().isoformat(), commit=commit(), machine=machine(), bytes=nbytes,
                moe_layers=args.moe_layers, experts=args.experts, vocab=args.vocab, repeats=args.repeats)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "load.json"), "w") as f:
        json.dump(dict(meta=meta, checked_s=times[True], unchecked_s=times[False]), f, indent=1)
    text = "\n".join([
        f"# Checked loads ({meta['date']}, commit {meta['commit']})", "",
        f"{meta['machine']}. A {nbytes / 1e9:.2f} GB checkpoint (benchmarks/convert.py's synthetic K2 shapes: 1 dense "
        f"+ {args.moe_layers} MoE layer(s) x {args.experts} experts, vocab {args.vocab}), read from disk each time; "
        f"median of {args.repeats} loads of each kind, alternating. `python benchmarks/load.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`.", "",
        "| load | seconds | GB/s |", "|---|---|---|",
        f"| checked (default) | {checked:.2f} | {nbytes / 1e9 / checked:.2f} |",
        f"| verify=False | {plain:.2f} | {nbytes / 1e9 / plain:.2f} |", "",
        f"Checked loads take {checked / plain - 1:+.0%} the time of unchecked ones (goal: at most +10%).", ""])
    with open(os.path.join(args.out, "load.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
