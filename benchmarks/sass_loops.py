"""The instructions of each GEMM kernel's main loop, counted from its SASS (the count METHOD asks for before a change);
with --sizes, every kernel's whole length instead.

A kernel whose loop is issue-bound gets faster only with fewer instructions per loop trip, and the compiler decides
how many there are: `(w >> 4) & 0x000F000F | 0x43004300` written in C compiled to two LOP3 where one does, `s % n`
to an integer division. This prints, for every loop (a backward branch) that holds a tensor-core instruction (HGMMA
or HMMA), its length and its opcode histogram, so a change can be judged by the SASS before it runs.

cuobjdump reads the SASS from the built library (or a .cubin). It comes with the CUDA toolkit; where the toolkit has
no cuobjdump (this project's CPU machines have nvcc and ptxas only), the `nvidia-cuda-cuobjdump` wheel carries one:
`pip download --no-deps nvidia-cuda-cuobjdump` and unzip it. A cubin of one file:
`nvcc -cubin -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I <jaxlib>/include -I ffi ffi/marlin_moe.cu`.

--sizes: a table of every matching kernel's SASS instructions (16 bytes each), longest first. A kernel run once per
layer by a few warps fetches its code from L2 (or DRAM) every time: mla_pre's first kernel, 8,248 instructions, had
its warps waiting for instructions 70% of the time on an H100 (docs/full_scale.md, 2026-12-06); its rebuild has 1,984.

usage: python benchmarks/sass_loops.py LIB_OR_CUBIN [--kernels REGEX] [--cuobjdump PATH] [--sizes [--commit C]]
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys

_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_GUARD = re.compile(r"^@!?U?P\w+\s+")


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """{mangled name: [(address, instruction text)]} of every function in cuobjdump -sass output."""
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        if "Function :" in line:
            current = line.split("Function :", 1)[1].strip()
            out[current] = []
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            out[current].append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(text: str) -> str:
    """The opcode without guard predicate and modifiers: '@!P3 LDGSTS.E.BYPASS.128 [R9], ...' -> 'LDGSTS'."""
    return _GUARD.sub("", text).split()[0].split(".")[0]


def loops(body: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) indices of each loop: from a backward branch's target to the branch, if it holds an MMA that no
    loop nested in it holds (an outer work loop around the main loop is not counted again)."""
    index = {addr: i for i, (addr, _) in enumerate(body)}
    found = []
    for i, (addr, text) in enumerate(body):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", _GUARD.sub("", text))
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr and target in index:
            first = index[target]
            found.append((first, i))
    mma = [opcode(t) in ("HGMMA", "HMMA") for _, t in body]
    kept = []
    for first, last in found:
        inner = [(f, l) for f, l in found if first <= f and l <= last and (f, l) != (first, last)]
        if any(mma[k] and not any(f <= k <= l for f, l in inner) for k in range(first, last + 1)):
            kept.append((first, last))
    return kept


def demangled(names: list[str]) -> dict[str, str]:
    """{mangled: readable} through c++filt where there is one (else the names as they are)."""
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def report(sass: str, kernels: str) -> list[str]:
    """One line per MMA loop of each matching function: its instruction count, MMA count and opcode histogram."""
    lines = []
    funcs = {n: b for n, b in functions(sass).items() if re.search(kernels, n)}
    names = demangled(list(funcs))
    for name, body in funcs.items():
        for first, last in loops(body):
            ops = collections.Counter(opcode(t) for _, t in body[first:last + 1])
            mma = ops["HGMMA"] + ops["HMMA"]
            span = f"loop {body[first][0]:#x}-{body[last][0]:#x}"
            histogram = ", ".join(f"{k} {v}" for k, v in ops.most_common())
            lines.append(f"{names[name]}: {span}: {last - first + 1} instructions, {mma} MMA; {histogram}")
    return lines


def source_file(mangled: str) -> str:
    """The .cu file an anonymous-namespace kernel comes from: '..._13_marlin_moe_cu_2adc7650...' -> 'marlin_moe.cu'."""
    m = re.search(r"_\d+_(\w+?)_cu_[0-9a-f]{8}", mangled)
    return f"{m.group(1)}.cu" if m else "-"


def short_name(readable: str) -> str:
    """'void kdtree::(anonymous namespace)::RouteKernel<12>(float const*, ...)' -> 'RouteKernel<12>'."""
    name = readable.replace("(anonymous namespace)::", "").replace("kdtree::", "")
    name = name[5:] if name.startswith("void ") else name
    return name.split("(", 1)[0] if "(" in name else name


def sizes(sass: str, kernels: str) -> list[tuple[str, str, int]]:
    """(short readable name, source file, instructions) of each matching function, longest first."""
    funcs = {n: b for n, b in functions(sass).items() if re.search(kernels, n)}
    names = demangled(list(funcs))
    rows = [(short_name(names[n]), source_file(n), len(b)) for n, b in funcs.items()]
    return sorted(rows, key=lambda r: (-r[2], r[0]))


def size_table(rows: list[tuple[str, str, int]]) -> list[str]:
    lines = ["| kernel | file | SASS instructions | code KB |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {src} | {n:,} | {16 * n / 1024:.1f} |" for name, src, n in rows]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("binary", help="libkdtree_jax_cuda.so or a .cubin")
    ap.add_argument("--kernels", default="TileKernel|GemmKernel", help="regex over mangled function names")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump", help="the cuobjdump to run")
    ap.add_argument("--sizes", action="store_true", help="every matching kernel's length (default --kernels: all)")
    ap.add_argument("--commit", default=None, help="with --sizes: a heading naming this commit and today's date")
    args = ap.parse_args(argv)
    if args.sizes and args.kernels == ap.get_default("kernels"):
        args.kernels = "."
    try:
        sass = subprocess.run([args.cuobjdump, "-sass", args.binary], check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        print(f"sass_loops: no cuobjdump at {args.cuobjdump!r} (see --help for where to get one)", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"sass_loops: cuobjdump failed on {args.binary}: {e.stderr.strip()[:500]}", file=sys.stderr)
        return 1
    if args.sizes:
        import datetime
        rows = sizes(sass, args.kernels)
        if args.commit:
            today = datetime.date.today().isoformat()
            print(f"# SASS length of each kernel ({today}, commit {args.commit}, sm_90a)\n\n"
                  f"`python benchmarks/sass_loops.py <the build's libkdtree_jax_cuda.so> --sizes --commit "
                  f"{args.commit}`: instructions per kernel, 16 bytes each, longest first.\n")
        print("\n".join(size_table(rows)) if rows else f"no function matches {args.kernels!r}")
        return 0
    lines = report(sass, args.kernels)
    print("\n".join(lines) if lines else f"no MMA loop in functions matching {args.kernels!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
