"""The kernels XLA compiles the per-device step into, counted without a GPU (issue 41's "kernels per layer").

XLA's GPU compiler can run without a device ("deviceless" compilation: a topology described by a GPU target config,
here an H200's); the optimized HLO it returns is what the GPU would run, launch for launch, except where autotuning
would have picked another GEMM configuration (autotuning needs the device, so its defaults are taken). At 1 x 1 the
counts agree with the profile measured on the H200 (2026-12-04, 8760c2d: 12 `input_reduce_fusion`, 6
`loop_multiply_fusion` and 1 `gemm_fusion_dot` a layer; docs/full_scale.md). This script compiles the step of the
per-device program of an ep=8 K2.6 mesh (`full_scale.per_device_cfg`, abstract weights: nothing is allocated) with L
and L + 1 layers, so that their difference is one MoE layer, and lists that layer's kernels with the bytes each one
reads and writes (from the HLO's shapes), flagging the large arrays written by one kernel only for another to read
back (an intermediate the floor does not need).

Needs jax's CUDA plugin for the jax installed here (a CPU machine is enough):

    pip install "jax-cuda13-plugin[with-cuda]==$(python -c 'import jaxlib; print(jaxlib.__version__)')"
    python benchmarks/xla_kernels.py --out benchmarks/results/xla_kernels        # cells 1x1, 1x17, 10x1, 10x17

Custom calls are counted as the kernels they launch (as profiled: `KERNELS_PER_CALL`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository's kdtree_jax, as the other benchmarks import it
sys.path.insert(0, HERE)

# An H200 as XLA's GPU compiler describes a device (stream_executor's GpuTargetConfigProto, text format): the numbers
# its cost models and fusion heuristics read. 141 GB HBM3e at 4.8 TB/s, 132 SMs, 50 MB of L2.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150110011392
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 12 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H200"
"""

# GPU kernels each custom call launches at small M, as the H200 profiles show them (docs/full_scale.md): marlin_moe's
# stream path align + gate/up + down + combine; mla_verify's kernel + its split combine.
KERNELS_PER_CALL = {"kdtree_marlin_moe": 4, "kdtree_marlin_moe_fused": 2, "kdtree_mla_verify": 2, "kdtree_mla_pre": 1,
                    "kdtree_fused_dot": 1, "kdtree_draft_attention": 2,
                    "kdtree_moe_route": 1, "kdtree_tree_build": 1, "kdtree_tree_accept": 1}
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple", "after-all", "partition-id",
               "replica-id", "opt-barrier"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1}
IN_PLACE = ("dynamic_update_slice", "scatter")  # fusions that update their largest operand in place (the cache)
INTERMEDIATE_BYTES = 1 << 20  # an array at least this large, written by one kernel and read by another, is flagged

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z\-]*)\((.*)$")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape in `text` (a shape or a tuple of shapes), e.g. "(bf16[2,3]{1,0}, f32[])" -> 16."""
    total = 0.0
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dtype]
    return int(total)


def _operands(args: str) -> list[str]:
    """The %names an instruction's operand list refers to (its text up to the closing parenthesis)."""
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", args[:end])


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
SLICES = ("slice", "dynamic-slice")  # what a fusion may do to an operand and be counted as reading only that part
VIEWS = ("bitcast", "reshape")  # passed through on the way to those slices


def _computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's instruction lines in HLO text, by its name (without the %)."""
    comps, body = {}, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            body = comps.setdefault(m.group(1), [])
        elif line.startswith("}"):
            body = None
        elif body is not None:
            body.append(line)
    return comps


def sliced_operand_bytes(body: list[str]) -> dict[int, int]:
    """Of a fused computation's instruction lines: for each parameter that the computation only slices (every user a
    `slice` or `dynamic-slice` of it, directly or through `bitcast` / `reshape`, whose users must then be slices in
    turn), the bytes of those slices' outputs, by parameter number. Parameters used any other way (a dot, a
    multiply, a dynamic-slice's index, the ROOT itself, ...) are left out: their kernel reads all of them."""
    params, ops, users = {}, {}, {}
    for line in body:
        m = _INSTR.match(line)
        if not m:
            continue
        root, name, shape, op, rest = m.groups()
        ops[name] = (op, shape_bytes(shape))
        if root:
            users.setdefault(name, []).append((None, 0))  # the fusion's output: read whole by whoever uses it
        if op == "parameter":
            number = re.match(r"\s*(\d+)", rest)
            if number:
                params[int(number.group(1))] = name
        for position, operand in enumerate(_operands(rest)):
            users.setdefault(operand, []).append((name, position))

    def sliced(name: str, depth: int = 0) -> int | None:  # the bytes of the slices that `name` reaches; None: not all
        if not users.get(name) or depth > 8:
            return None
        total = 0
        for user, position in users[name]:
            op, out = ops.get(user, (None, 0))
            if op in SLICES and position == 0:
                total += out
            elif op in VIEWS:
                part = sliced(user, depth + 1)
                if part is None:
                    return None
                total += part
            else:
                return None
        return total

    return {i: b for i, name in params.items() if (b := sliced(name)) is not None}


def entry_kernels(hlo: str) -> list[dict]:
    """The kernel-launching instructions of the ENTRY computation of optimized HLO text, in program order: name,
    kind (a fusion's name without its number, as the GPU profile names the kernel; a custom call's target; else the
    opcode), kernels (launches: a custom call's from KERNELS_PER_CALL), bytes_out (its output's shape), inputs
    (operand names, a bitcast or tuple element named by the instruction it views), input_bytes_full (each operand's
    whole shape), input_bytes (what the kernel reads of each operand: its whole shape, except an operand that a
    fusion's computation only slices (`slice` / `dynamic-slice`, directly or through a bitcast or reshape), e.g. one
    layer of weights stacked [L, ...]: the bytes of those slices) and bytes_in (their sum). Only a fusion's own
    computation is read for slices, not the computations it calls in turn. Instructions that launch nothing
    (parameters, tuples, bitcasts, ...) are left out."""
    start = hlo.find("\nENTRY ")
    if start < 0:
        raise ValueError("no ENTRY computation in this HLO text")
    comps = None  # parsed on the first fusion
    shapes, alias, out = {}, {}, []
    for line in hlo[start:].splitlines()[1:]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        _, name, shape, op, rest = m.groups()
        shapes[name] = shape_bytes(shape)
        if op in ("bitcast", "get-tuple-element"):  # a view of its operand: readers of it read the operand's kernel
            src = _operands(rest)
            alias[name] = alias.get(src[0], src[0]) if src else name
        if op in NOT_KERNELS:
            continue
        raw = _operands(rest)
        inputs = [alias.get(i, i) for i in raw]
        full = [shapes.get(i, 0) for i in raw]
        read = list(full)
        if op == "fusion":
            kind = re.sub(r"\.\d+$", "", name)
            called = re.search(r"\bcalls=%([\w.\-]+)", rest)
            if called:
                if comps is None:
                    comps = _computations(hlo)
                for i, b in sliced_operand_bytes(comps.get(called.group(1), [])).items():
                    if i < len(read):
                        read[i] = min(read[i], b)
        elif op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            kind = target.group(1) if target else "custom-call"
        else:
            kind = op
        written = shapes[name]
        aliasing = re.search(r"output_to_operand_aliasing=\{((?:\{[\d,\s]*\}:\s*\(\d+,\s*\{[\d,\s]*\}\),?\s*)+)\}",
                             rest)
        if aliasing:  # results that are operands updated in place (a custom call's caches) are not new arrays
            written -= sum(full[int(i)] for i in re.findall(r"\((\d+),", aliasing.group(1)) if int(i) < len(full))
        out.append(dict(name=name, kind=kind, kernels=KERNELS_PER_CALL.get(kind, 1), bytes_out=written,
                        bytes_in=sum(read), inputs=inputs, custom=op == "custom-call", input_bytes=read,
                        input_bytes_full=full))
    return out


def xla_bytes(k: dict) -> int:
    """Bytes an XLA kernel moves, from its shapes: what it reads of its operands (`input_bytes`: each operand whole,
    except one its fusion only slices, e.g. one layer of a stacked weight: that slice) plus its output. Two cases
    differ: a dynamic-slice fusion moves its output twice (read, then written); an in-place update (a
    dynamic-update-slice or scatter fusion) moves only the update: its operands whose whole size is below the
    output's, twice (the operand of the output's size is the buffer updated in place, not read). 0 for a custom call
    (what it reads depends on its arguments' values: the routed experts, the cached length)."""
    if k["custom"]:
        return 0
    if any(w in k["kind"] for w in IN_PLACE):
        return 2 * sum(b for b in k["input_bytes_full"] if b < k["bytes_out"])
    if "dynamic_slice" in k["kind"]:
        return 2 * k["bytes_out"]
    return k["bytes_in"] + k["bytes_out"]


def intermediates(kernels: list[dict], limit: int = INTERMEDIATE_BYTES) -> list[dict]:
    """Kernels whose output (>= limit bytes) only other kernels read: arrays written and read back within the step.
    An output that is updated in place (a dynamic-update-slice or scatter fusion of the cache) is not one."""
    readers = {}
    for k in kernels:
        for i in k["inputs"]:
            readers.setdefault(i, []).append(k["name"])
    return [dict(name=k["name"], kind=k["kind"], bytes=k["bytes_out"], read_by=readers[k["name"]])
            for k in kernels if k["bytes_out"] >= limit and k["name"] in readers
            and not any(w in k["kind"] for w in IN_PLACE)]


def layer_diff(small: list[dict], large: list[dict]) -> dict:
    """One layer's kernels, as the difference between the step with L + 1 layers and with L: counts by kind,
    launches, and the flagged intermediates (those of the larger program beyond the smaller's, by kind)."""
    def by_kind(ks):
        c = {}
        for k in ks:
            c[k["kind"]] = c.get(k["kind"], 0) + k["kernels"]
        return c
    a, b = by_kind(small), by_kind(large)
    kinds = {k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b))}
    inter_a, inter_b = intermediates(small), intermediates(large)
    return dict(launches=sum(k["kernels"] for k in large) - sum(k["kernels"] for k in small),
                kinds={k: v for k, v in kinds.items() if v},
                xla_bytes=sum(map(xla_bytes, large)) - sum(map(xla_bytes, small)),
                intermediates=len(inter_b) - len(inter_a),
                intermediate_bytes=sum(i["bytes"] for i in inter_b) - sum(i["bytes"] for i in inter_a),
                intermediate_kinds=sorted({i["kind"] for i in inter_b}))


# ---------------------------------------------------------------------------------------------------- compiling


def _topology_mesh(flags: bool = True):
    """The sharding of one H200 of a deviceless topology; `flags`: with the XLA flags the kdtree-jax commands set
    (`kdtree_jax.xla_flags.GPU_FLAGS`), as XLA_FLAGS is read when the backend starts."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check the CUDA libraries against
    if flags:
        from kdtree_jax.xla_flags import with_gpu_flags
        os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ.get("XLA_FLAGS", ""))
    import jax
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology="1x1x1")
    except Exception as e:  # the plugin missing, or too old for deviceless topologies
        import jaxlib
        raise SystemExit(f"xla_kernels: no deviceless CUDA compiler here ({str(e).splitlines()[0]}); install jax's "
                         f"CUDA plugin: pip install \"jax-cuda13-plugin[with-cuda]=={jaxlib.__version__}\"") from None
    return jax.sharding.NamedSharding(topologies.make_mesh(topo, (1,), ("d",)), jax.sharding.PartitionSpec())


def compile_step(layers: int, batch: int, t: int, context: int, n: int, ffi_ops, sharding) -> str:
    """The optimized HLO of one verify step (`model.step`, T tree nodes per row after `context` cached tokens) of
    the per-device program of an ep=n mesh with `layers` layers, compiled for the target config."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kdtree_jax as kj
    from common import random_trees
    from full_scale import cut_shared, local_experts_cfg, per_device_cfg
    from kdtree_jax.model import MoE, init_cache, step
    from kdtree_jax.sharding import trace_context

    cfg = per_device_cfg(n, layers, False, "ffi")
    if ffi_ops is not None:
        cfg = dataclasses.replace(cfg, ffi_ops=tuple(ffi_ops))
    width = cfg.moe_intermediate_size * cfg.n_shared_experts // n

    def weights(key):  # full_scale.per_device_model's shapes: E/n experts, the router of all E, 1/n shared width
        p = kj.init_params(local_experts_cfg(cfg, n), key)

        def share(lp):
            if not isinstance(lp.mlp, MoE):
                return lp
            e = cfg.n_routed_experts
            mlp = dataclasses.replace(lp.mlp, shared=cut_shared(lp.mlp.shared, width),
                                      router=jnp.zeros((cfg.hidden_size, e), lp.mlp.router.dtype),
                                      router_bias=jnp.zeros((e,), jnp.float32))
            return dataclasses.replace(lp, mlp=mlp)
        return dataclasses.replace(p, layers=tuple(share(lp) for lp in p.layers))

    put = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
    params = put(jax.eval_shape(weights, jax.random.key(0)))
    cache = put(jax.eval_shape(lambda: init_cache(cfg, batch, context + t + 8)))
    depths, vis = random_trees(batch, t, np.random.default_rng(0))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    fn = jax.jit(lambda p, c, tok, d, m: (lambda o: (o.logits[:, 0, :8], o.cache))(
        step(p, cfg, tok, c, depths=d, tree_mask=m)), donate_argnums=1)
    with trace_context(params, cfg):
        lowered = fn.lower(params, cache, spec((batch, t), jnp.int32), spec(depths.shape, jnp.int32),
                           spec(vis.shape, jnp.bool_))
    return lowered.compile().as_text()


def compile_draft(layers: int, batch: int, context: int, n: int, sharding, attention: str = "xla",
                  dense: str = "xla") -> str:
    """The optimized HLO of one draft (`drafter.draft`: the block's logits over this device's vocabulary shard) of the
    K2.5-DFlash-shaped drafter split n ways (`ddtree_full_scale.make_drafter`) with `layers` layers, `batch` rows
    after `context` cached tokens, its attention on `attention` (`drafter.block_attention`), its dense weights on
    `dense` (`drafter.draft`: "ffi", fused_dot calls where the block has at most 32 rows)."""
    import jax
    import jax.numpy as jnp

    from ddtree_full_scale import DRAFTER, make_drafter
    from full_scale import per_device_cfg
    from kdtree_jax.drafter import draft, init_draft_cache
    from kdtree_jax.model import init_params
    from kdtree_jax.sharding import trace_context

    cfg = per_device_cfg(n, 1, False, "ffi")
    shape = dict(DRAFTER, num_layers=layers)
    put = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

    def build(key):
        import ddtree_full_scale
        saved = ddtree_full_scale.DRAFTER
        ddtree_full_scale.DRAFTER = shape
        try:
            drafter = make_drafter(cfg, False, n, key)
        finally:
            ddtree_full_scale.DRAFTER = saved
        p = init_params(cfg, key)
        return drafter, dataclasses.replace(p, layers=())  # what a draft reads of the target: embed, lm_head
    drafter, io = jax.eval_shape(build, jax.random.key(0))
    drafter, io = put(drafter), put(io)
    dcache = put(jax.eval_shape(lambda: init_draft_cache(drafter.cfg, batch, context + 16)))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    with trace_context(io, cfg):
        lowered = jax.jit(functools.partial(draft, attention=attention, dense=dense)).lower(
            drafter, io, dcache, spec((batch,), jnp.int32), spec((batch,), jnp.int32))
    assert DRAFTER["num_layers"] >= 1
    return lowered.compile().as_text()


def parse_cells(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in c.lower().split("x")) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected cells BxT, comma-separated (e.g. 1x1,10x17)") from None


def report(meta: dict, rows: list[dict], base: dict | None = None) -> str:
    draft = meta.get("program") == "draft"
    what = (f"the K2.5-DFlash-shaped drafter's block (`drafter.draft`, its attention on "
            f"{meta.get('attention', 'xla')}, its dense weights on {meta.get('dense', 'xla')}) of one GPU of an ep=8 "
            "mesh" if draft else
            "the step of one GPU of an ep=8 K2.6 mesh")
    lines = [f"# Kernels a layer, as XLA compiles the per-device {'draft' if draft else 'step'} ({meta['date']}, "
             f"commit {meta['commit']}, compiled for an {meta['target']} without a device)", "",
             f"Counted, not timed: `python benchmarks/xla_kernels.py{' --program draft' if draft else ''}` compiles "
             f"{what} (context {meta['context']}, custom calls {', '.join(meta['ffi_ops'])}) with {meta['layers']} "
             f"and {meta['layers'] + 1} {'drafter ' if draft else ''}layers on a CPU (XLA's deviceless compilation, "
             f"jax {meta['jax']}, XLA_FLAGS `{meta.get('xla_flags') or 'none'}`; GEMM configurations are XLA's "
             f"defaults, where the GPU would autotune) and reports one {'drafter' if draft else 'MoE'} layer: the "
             "difference. Custom calls count as the kernels they launch; XLA's bytes: what XLA's own kernels read and "
             "write, from their shapes (each operand whole, except one that a fusion only slices, e.g. one layer of a "
             "stacked weight, counted as the slice; an in-place update as the update; the custom calls left "
             "out); an intermediate is an array of at least 1 MB that one kernel writes and another reads back.", "",
             "| cell | kernels a layer | XLA's bytes a layer (MB) | intermediates (MB) | kernels by kind |",
             "|---|---|---|---|---|"]
    old = {(r["batch"], r["t"]): r["layer"] for r in base["rows"]} if base else {}
    if base:
        lines[-2] = lines[-2].replace("| kernels a layer |", f"| kernels a layer ({base['meta']['commit']} -> now) |")
        lines.insert(-2, f"Beside each count (and intermediates), the same compiled from commit "
                         f"{base['meta']['commit']} ({base['meta']['date']}, its JSON in runs/).\n")
    for r in rows:
        d = r["layer"]
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(d["kinds"].items(), key=lambda kv: -kv[1]))
        inter = (f"{d['intermediates']} ({d['intermediate_bytes'] / 1e6:.1f}: {', '.join(d['intermediate_kinds'])})"
                 if d["intermediates"] else "0")
        was = old.get((r["batch"], r["t"]))
        count = f"{was['launches']} -> {d['launches']}" if was else f"{d['launches']}"
        if was:
            inter = f"{was['intermediates']} ({was['intermediate_bytes'] / 1e6:.1f}) -> {inter}"
        lines.append(f"| {r['batch']} x {r['t']} | {count} | {d['xla_bytes'] / 1e6:.1f} | {inter} | {kinds} |")
    return "\n".join(lines) + "\n"


def plot(path: str, rows: list[dict], base: dict | None, program: str = "step") -> None:
    """Kernels a layer by cell (and the base commit's beside them)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [f"{r['batch']}x{r['t']}" for r in rows]
    now = [r["layer"]["launches"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(cells))
    if base:
        old = {(r["batch"], r["t"]): r["layer"]["launches"] for r in base["rows"]}
        ax.bar([i - 0.2 for i in x], [old.get((r["batch"], r["t"]), 0) for r in rows], 0.4,
               label=base["meta"]["commit"])
        ax.bar([i + 0.2 for i in x], now, 0.4, label="now")
        ax.legend()
    else:
        ax.bar(list(x), now, 0.6)
    if program == "step":
        ax.axhline(10, color="gray", ls="--", lw=1)
        ax.text(len(cells) - 0.5, 10.5, "goal <= 10", ha="right", fontsize=8, color="gray")
    ax.set_xticks(list(x), cells)
    ax.set_xlabel("batch x tree nodes" if program == "step" else "batch x block")
    ax.set_ylabel("kernels a MoE layer" if program == "step" else "kernels a drafter layer")
    ax.set_title(f"XLA's compiled per-device {'step' if program == 'step' else 'draft'} (H200 target, no device)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_commit() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write xla_kernels.{md,json} here (default: print the table only)")
    ap.add_argument("--cells", type=parse_cells, default=parse_cells("1x1,1x17,10x1,10x17"),
                    help="batch x tree nodes, comma-separated (default 1x1,1x17,10x1,10x17)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=3, help="L: the layer is the difference of L + 1 and L (default 3)")
    ap.add_argument("--n", type=int, default=8, help="GPUs of the mesh whose per-device program compiles")
    ap.add_argument("--ffi-ops", help="custom calls, comma-separated (default: the config's)")
    ap.add_argument("--program", choices=("step", "draft"), default="step",
                    help="step: the target's verify step (cells BxT); draft: the drafter's block (cells Bx8: batch "
                         "x the block; its layers are the difference of --layers + 1 and --layers drafter layers)")
    ap.add_argument("--attention", choices=("xla", "cudnn", "ffi"), default="xla", help="--program draft: the "
                    "drafter's attention (`drafter.block_attention`; default xla, XLA's operations; ffi: the custom "
                    "call, what the drafter runs with the default ffi_ops since 2026-12-07, counted as 2 launches)")
    ap.add_argument("--dense", choices=("xla", "ffi"), default="xla", help="--program draft: the drafter's dense "
                    "weights (`drafter.draft`'s dense; default xla, XLA's dots; ffi: four fused_dot calls a layer "
                    "where the block has at most 32 rows, counted as 1 launch each)")
    ap.add_argument("--no-flags", action="store_true", help="compile without the XLA flags the kdtree-jax commands "
                    "set (kdtree_jax.xla_flags.GPU_FLAGS); with them by default")
    ap.add_argument("--hlo", action="store_true", help="also write each cell's optimized HLO (L + 1 layers) to --out")
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT") or git_commit())
    ap.add_argument("--base", metavar="JSON", help="an earlier commit's xla_kernels.json: its counts beside these")
    ap.add_argument("--name", default=None, help="file name of the outputs (default: xla_kernels, with --program "
                    "draft xla_kernels_draft)")
    args = ap.parse_args(argv)
    if args.layers < 2:
        ap.error("--layers must be at least 2 (layer 0 is K2's dense layer; the difference is a MoE layer)")
    sharding = _topology_mesh(not args.no_flags)
    import jax
    ffi_ops = [o.strip() for o in args.ffi_ops.split(",") if o.strip()] if args.ffi_ops else None
    rows = []
    for batch, t in args.cells:
        t0 = time.perf_counter()
        if args.program == "draft":
            hlos = [compile_draft(layers, batch, args.context, args.n, sharding, args.attention, args.dense)
                    for layers in (args.layers, args.layers + 1)]
        else:
            hlos = [compile_step(layers, batch, t, args.context, args.n, ffi_ops, sharding)
                    for layers in (args.layers, args.layers + 1)]
        small, large = (entry_kernels(h) for h in hlos)
        rows.append(dict(batch=batch, t=t, layer=layer_diff(small, large),
                         step_kernels=sum(k["kernels"] for k in large), compile_s=time.perf_counter() - t0))
        print(f"{batch} x {t}: {rows[-1]['layer']['launches']} kernels a layer ({rows[-1]['compile_s']:.0f} s)",
              file=sys.stderr, flush=True)
        if args.hlo and args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"step_{batch}x{t}.hlo.txt"), "w") as f:
                f.write(hlos[1])
    import kdtree_jax as kj
    meta = dict(date=datetime.date.today().isoformat(), commit=args.commit, target="H200", jax=jax.__version__,
                xla_flags=os.environ.get("XLA_FLAGS", ""), program=args.program,
                **(dict(attention=args.attention, dense=args.dense) if args.program == "draft" else {}),
                context=args.context, layers=args.layers, n=args.n,
                ffi_ops=list(ffi_ops or kj.configs.k2_6(kernels="ffi").ffi_ops))
    base = None
    if args.base:
        with open(args.base) as f:
            base = json.load(f)
    text = report(meta, rows, base)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = args.name or ("xla_kernels_draft" if args.program == "draft" else "xla_kernels")
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows, base=base["meta"] if base else None), f, indent=1)
        plot(os.path.join(args.out, f"{name}.png"), rows, base, args.program)
    return 0


if __name__ == "__main__":
    sys.exit(main())
