"""Where the warps of a kernel wait, per SASS instruction, from ncu's sampled warp stalls.

Reads the CSV that `ncu --import REPORT --page source --csv --print-source sass` prints (gzipped or not; one or more
kernels; `scripts/gpu_marlin_moe.sh` writes it with PROFILE_SOURCE=1) and prints, per kernel: the samples by stall
reason, by opcode, and the instructions holding the most samples with their three largest reasons.

usage: python benchmarks/ncu_source_top.py src_k2_4096_after.csv.gz [--top 40]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(text: str) -> list[tuple[str, list[dict]]]:
    """[(kernel name, [row dict per SASS instruction, in address order])] of a source-page CSV."""
    out, header = [], None
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            out.append((row[1] if len(row) > 1 else "?", []))
            header = None
        elif row[0] == "Address":
            header = row
        elif header and out and len(row) == len(header):
            out[-1][1].append(dict(zip(header, row)))
    return out


def _int(value: str) -> int:
    try:
        return int(float(value))
    except ValueError:
        return 0


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers ('@!P0 LDGSTS.E.128 ...' -> 'LDGSTS')."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summary(name: str, rows: list[dict], top: int) -> list[str]:
    reasons = [k for k in (rows[0] if rows else {}) if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_int(r[SAMPLES]) for r in rows)
    lines = [f"== {name}: {len(rows)} instructions, {total} samples"]
    if total == 0:
        return lines + ["  (no samples)"]
    by_reason = {k[6:]: sum(_int(r[k]) for r in rows) for k in reasons}
    lines.append("  by reason: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in
                                             sorted(by_reason.items(), key=lambda kv: -kv[1]) if v >= 0.01 * total))
    by_op: dict[str, int] = {}
    for r in rows:
        by_op[opcode(r["Source"])] = by_op.get(opcode(r["Source"]), 0) + _int(r[SAMPLES])
    lines.append("  by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in
                                             sorted(by_op.items(), key=lambda kv: -kv[1])[:16]))
    lines.append("  the instructions with the most samples (index in the kernel, share, SASS, largest reasons):")
    ranked = sorted(range(len(rows)), key=lambda i: -_int(rows[i][SAMPLES]))[:top]
    for i in ranked:
        r = rows[i]
        largest = sorted(((_int(r[k]), k[6:]) for k in reasons), reverse=True)[:3]
        why = " ".join(f"{k}:{v}" for v, k in largest if v)
        lines.append(f"  {i:6d} {100 * _int(r[SAMPLES]) / total:6.2f}%  {r['Source'].strip()[:64]:64s} {why}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="the source page as CSV (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=30, help="instructions to list per kernel (default 30)")
    args = ap.parse_args(argv)
    opener = gzip.open if args.csv.endswith(".gz") else open
    try:
        with opener(args.csv, "rt") as f:
            text = f.read()
    except (OSError, EOFError) as e:
        print(f"ncu_source_top: cannot read {args.csv}: {e}", file=sys.stderr)
        return 1
    found = kernels(text)
    if not found:
        print(f"ncu_source_top: no kernel in {args.csv} (expected ncu's --page source --csv output)", file=sys.stderr)
        return 1
    for name, rows in found:
        print("\n".join(summary(name, rows, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
