"""The routed experts of a MoE layer with INT4 weights (W4A16, group 32), as a custom call (`impl="ffi"`:
ffi/marlin_moe.cc on CPU, ffi/marlin_moe.cu on CUDA) or in pure JAX (`impl="xla"`, `marlin_moe_ref`).

For token m and its k routing slots j (expert e = ids[m, j]; an id outside [0, E) means "not one of these experts"
and adds nothing, which is how expert parallelism passes each shard the slots of other shards):

    h        = silu(x[m] @ gate_e.T) * (x[m] @ up_e.T)        [F]
    out[m]  += weights[m, j] * (h @ down_e.T)                  [D]

This is `moe_experts_ref` below; `moe_experts_dense` (`impl="dense"`) computes the same function with plain dense
matmuls over every expert (for training small models). The experts stay in the model's (and the checkpoint's)
layout: the compressed-tensors `Int4Array` of `kdtree_jax.quant` (packed int32 [E, out, in/8], nibble q + 8 least
significant first, bf16 scales [E, out, in/group]); the CUDA kernel streams those words directly with 16-byte loads
along `in`, so there is no repack and no inverse to keep in step with the converter.

CUDA fast paths (bf16 activations, D and F multiples of 128, group 32, as Kimi K2 has): the M k slots are sorted by
expert on the device into blocks of `block_m` slots of one expert (the `moe_align` of this module, as a kernel),
then gate+up with the SiLU-and-multiply fused, then down, each streaming every touched expert's INT4 weights once
(bf16 tensor cores, fp32 accumulation), then a fixed-order sum over the top-k with the routing weights. `block_m`
(and the FLAG_TILE bit) picks the path, by M and the slots per expert at trace time (`choose_path`):

- GEMV decode path (the default at K2's shapes for at most 64 slots, `gemv_eligible`; KDTREE_JAX_MOE_GEMV=0 turns it
  off): no sort, a block owning 16 weight rows (the gate and up rows of 8 outputs, then 16 down rows) with their
  inputs split over its warps, the token the mma's 8-column operand, two launches, the combine inside the second
  (ffi/marlin_moe.cu);
- stream path (block_m 8, 16, 32; fewer than 8 slots per expert, or no tile path): mma.sync with the weights as the
  16-row operand and 8 slots as the other; a block owns 16 rows of gate and up (or 32 of down) and one block of
  slots; every mma step lies in one quantization group, so the INT4 values go to the tensor cores exactly (one lop3
  per pair, offset by 136 and corrected with an mma of the tokens) and the group's scale multiplies the fp32 sums:
  the weights are not rounded to bf16 as the reference rounds them (the difference is below bf16 rounding). Its
  kernels are launched as programmatic dependents, so each starts while the one before it ends;
- tile path (block_m 64, 128; M >= TILE_MIN_M; D a multiple of 256, F of 128, group 32): a block owns up to
  block_m slots of one expert and 128 rows of gate and up (256 of down), so every dequantized weight tile serves
  all of the expert's slots (up to block_m) at once; wgmma with the weights from registers and the slots from
  shared memory. With FLAG_TILE, block_m 16 or 32 runs it too, in narrow tiles (at most 32 slots, two blocks per
  SM): block_m 32 is the default at 8-24 slots per expert (`NARROW_SLOTS`), 16 a variant for benchmarks and tests.

The sorted slots, the block experts and the bf16 intermediates h [M k, F] and ys [M k, D] are extra outputs of the
call (scratch; nothing in them needs clearing; the GEMV decode path writes only h, its second kernel summing each
token's slots itself). Float32 activations and other shapes run a generic CUDA-core
kernel: correct, not fast.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from ..quant import Int4Array
from . import _registry

STREAM_BLOCKS = (8, 16, 32)  # slots per block of the stream path (8 per mma column tile)
TILE_BLOCKS = (64, 128)  # slots per tile of the tile path
BLOCK_SIZES = STREAM_BLOCKS + TILE_BLOCKS
TILE_MIN_M = 512  # tokens from which the tile path runs (where it is eligible); H200: the stream path is faster at 256
TILE_128_MIN_M = 2048  # tokens from which its tiles hold 128 slots rather than 64
NARROW_SLOTS = (8.0, 24.0)  # slots per expert (M k / E) where the tile path's narrow 32-slot tiles run by default
TARGET = "kdtree_marlin_moe"
IMPLS = ("ffi", "xla", "dense")

# Bits of the custom call's `flags` attribute (benchmarks and tests; the default is 0).
FLAG_SYNC = 1  # tile path: mma.sync + ldmatrix instead of wgmma
FLAG_L2_256 = 2  # weight copies ask L2 for whole 256-byte lines
FLAG_DEEP = 8  # tile path (wgmma): 4 k-steps in flight instead of 2
FLAG_SERIAL = 16  # stream path: plain launches instead of programmatic dependent ones
FLAG_TILE = 32  # block_m 16 or 32: the tile path's narrow tiles (two blocks per SM) instead of the stream path
FLAG_FINE = 64  # tile path: a tile of 17-24 slots runs as 24 token columns (wgmma N = 24), not 32
FLAG_PERSIST = 128  # stream path: as many blocks as fit at once, each looping over the used units
FLAG_X_L1 = 256  # stream path, gate/up: the token values prefetched into L1 as many chunks ahead as the weights
FLAG_FUSED = 512  # the fused decode path: the whole MoE in one launch (target FUSED_TARGET; see `fused_eligible`)
FLAG_FUSED_ONE = 1024  # the fused path on one block an SM (not two): room for the other compute stream's kernels
FLAG_GEMV = 2048  # the GEMV decode path: a block 16 weight rows, the token the mma's N, no align (`gemv_eligible`)
GEMV_MAX_SLOTS = 64  # M k the GEMV path takes
FUSED_TARGET = "kdtree_marlin_moe_fused"
FUSED_MAX_SLOTS = 256  # M k the fused path takes (its kernel sorts the slots with one thread each)
FUSED_SPAN = 512  # inputs of one warp's item in the fused kernel: D and F must be multiples of it
FUSED_MAX_IN = 8192  # D and F at most (16 items a row: the kernel's unrolled sums of the partials)
NARROW_TILE_BLOCKS = (16, 32)  # the block sizes FLAG_TILE applies to
TILE_FLAGS = FLAG_L2_256  # the tile path's default flags (H200: the 256-byte L2 lines gain ~5% at M = 1,024)
STREAM_FLAGS = 0  # the stream path's (the L2 hint changes nothing there)
PERSIST_USED = 0.2  # FLAG_PERSIST by default while the expected used token blocks are at most this part of max_blocks
PERSIST_SLOTS = 0.25  # ... and an average expert (of all e) has at most this many slots


def block_size(m: int, k: int, e: int) -> int:
    """Slots per token block of the stream path: the smallest of 8 / 16 / 32 that an average expert's M k / E slots
    fill to less than 90% (as vLLM picks its moe block size); one block holds the slots of one expert, padded."""
    for bm in STREAM_BLOCKS:
        if m * k / max(e, 1) / bm < 0.9:
            return bm
    return STREAM_BLOCKS[-1]


def tile_eligible(d: int, f: int, gate_group: int, down_group: int, dtype) -> bool:
    """Shapes the tile path takes: bf16, D a multiple of 256, F of 128, group 32 for gate/up and down."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and d % 256 == 0 and f % 128 == 0 and gate_group == 32
            and down_group == 32)


def fused_eligible(m: int, k: int, d: int, f: int, gate_group: int, down_group: int, dtype) -> bool:
    """Shapes the fused decode path takes: bf16, D and F multiples of 512 up to 8192, group 32, 1 <= M k <= 256."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and d % FUSED_SPAN == 0 and f % FUSED_SPAN == 0 and d <= FUSED_MAX_IN
            and f <= FUSED_MAX_IN and gate_group == 32 and down_group == 32 and 0 < m * k <= FUSED_MAX_SLOTS)


def gemv_eligible(m: int, k: int, d: int, f: int, gate_group: int, down_group: int, dtype) -> bool:
    """Shapes the GEMV decode path takes: bf16, group 32, D of 2048, 4096, 7168 or 8192, F of 1024 or 2048,
    1 <= M k <= GEMV_MAX_SLOTS."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and d in (2048, 4096, 7168, 8192) and f in (1024, 2048)
            and gate_group == 32 and down_group == 32 and 0 < m * k <= GEMV_MAX_SLOTS)


def gemv_default() -> int:
    """FLAG_GEMV where the GEMV decode path is eligible unless KDTREE_JAX_MOE_GEMV (read at trace time) is "0" (the
    stream path); "1" or unset: the GEMV path, the default since it made the 1 x 1 step 1.08x faster on an H100
    (2026-12-06, 40 layers); any other value is refused."""
    value = os.environ.get("KDTREE_JAX_MOE_GEMV", "1").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"KDTREE_JAX_MOE_GEMV must be 0 (the stream path) or 1 (the GEMV decode path), got {value!r}")
    return 0 if value == "0" else FLAG_GEMV


def fused_default() -> int:
    """The flags `marlin_moe` takes by default where the fused path is eligible, from KDTREE_JAX_MOE_FUSED (read at
    trace time): "1" FLAG_FUSED, "one" FLAG_FUSED | FLAG_FUSED_ONE, "0" or unset 0 (the default: the stream and tile
    paths, until the fused one is measured faster in the full step); any other value is refused."""
    value = os.environ.get("KDTREE_JAX_MOE_FUSED", "0").strip()
    choices = {"0": 0, "": 0, "1": FLAG_FUSED, "one": FLAG_FUSED | FLAG_FUSED_ONE}
    if value not in choices:
        raise ValueError(f"KDTREE_JAX_MOE_FUSED must be 0 (off), 1 (the fused MoE path) or one (it on one block an "
                         f"SM), got {value!r}")
    return choices[value]


def choose_path(m: int, k: int, e: int, tile_ok: bool, local: int | None = None) -> tuple[int, int]:
    """(block_m, flags) of the CUDA path for M tokens routed to k of e experts (e: all of the model's, also for one
    expert-parallel shard's call, whose slots of other shards' experts go nowhere: M k / e is the slots per expert
    on every shard, M k / e_local would overstate it ep-fold), where the shapes allow the tile path: its narrow
    32-slot tiles while an average expert has NARROW_SLOTS slots (K2: M = 384 .. 1,152; H200, 2026-12-01: 1.17-1.27x
    the 64-slot tiles at M = 384 .. 1,152, 1.17x the stream path at 384 and 1.26-2.0x above; the stream path wins at
    M = 256, 5.3 slots), else its 64 from TILE_MIN_M tokens and 128 from TILE_128_MIN_M; the stream path's
    `block_size` otherwise, with FLAG_PERSIST where an average expert has at most PERSIST_SLOTS slots and uniform
    routing would use at most PERSIST_USED of the token blocks `max_blocks` must allow for the shard's `local`
    experts (default e): one shard of an 8-way mesh at M <= 8 (H200, 2026-12-02: per-device M = 1 / 4 0.89x / 0.86x
    the time of the grid; 1.02-1.09x at M = 16 .. 256 and on the whole model's experts, which use every token block
    at small M; the slots bound keeps it off at large M, where max_blocks outgrows the local experts)."""
    spe = m * k / max(e, 1)
    if tile_ok and NARROW_SLOTS[0] <= spe <= NARROW_SLOTS[1] and m < TILE_128_MIN_M:
        return 32, TILE_FLAGS | FLAG_TILE
    if tile_ok and m >= TILE_MIN_M:
        return (TILE_BLOCKS[1] if m >= TILE_128_MIN_M else TILE_BLOCKS[0]), TILE_FLAGS
    bm = block_size(m, k, e)
    loc = e if local is None else local
    used = loc * (1.0 - (1.0 - min(k, e) / max(e, 1)) ** m)  # distinct local experts, about one token block each
    sparse = spe <= PERSIST_SLOTS and used <= PERSIST_USED * max_blocks(m * k, loc, bm)
    return bm, STREAM_FLAGS | (FLAG_PERSIST if sparse else 0)


def choose_block_m(m: int, k: int, e: int, tile_ok: bool, local: int | None = None) -> int:
    """The block_m of `choose_path` (32 may be the stream path's or the narrow tiles': its flags tell)."""
    return choose_path(m, k, e, tile_ok, local)[0]


def max_blocks(slots: int, e: int, bm: int) -> int:
    """Token blocks that hold any routing of `slots` slots over `e` experts: every touched expert pads its run up to
    a multiple of bm, at most min(e, slots) experts are touched, so sum ceil(c_e / bm) <= (slots + min(e, slots)
    (bm - 1)) / bm."""
    return (slots + min(e, slots) * (bm - 1)) // bm


def moe_align(ids: jax.Array, num_experts: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """Slots sorted by expert, each expert's run padded to a multiple of block_m (static shapes).

    ids int [M, k] -> (sorted_slots int32 [max_blocks * block_m], block_experts int32 [max_blocks]):
    sorted_slots holds the slots m k + j of expert 0 in ascending order, padded with the sentinel M k to a multiple
    of block_m, then expert 1's, ...; ids outside [0, num_experts) are left out. block_experts[b] is the expert of
    slots b block_m .. (b + 1) block_m - 1, or -1 past the last used block. The CUDA kernel computes exactly these
    arrays (its align stage); this is their definition.
    """
    flat = ids.reshape(-1).astype(jnp.int32)  # [S]
    s = flat.shape[0]
    nb = max_blocks(s, num_experts, block_m)
    key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # [S]; num_experts = dropped
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[key].add(1)  # [E + 1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded = padded.at[num_experts].set(0)
    ends = jnp.cumsum(padded)  # [E + 1]  end of each expert's padded run
    order = jnp.argsort(key, stable=True)  # [S]  slots by expert, ascending within an expert
    sorted_key = key[order]
    rank = jnp.arange(s, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[sorted_key]  # place within its expert
    dest = jnp.where(sorted_key < num_experts, (ends - padded)[sorted_key] + rank, nb * block_m)
    sorted_slots = jnp.full((nb * block_m,), s, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    first = jnp.arange(nb, dtype=jnp.int32) * block_m  # [nb]
    block_experts = jnp.searchsorted(ends[:num_experts], first, side="right").astype(jnp.int32)
    return sorted_slots, jnp.where(first < ends[num_experts], block_experts, -1)


def _check(x, ids, weights, we_gate, we_up, we_down) -> tuple[int, int, int, int, int]:
    arrays = {"x": x, "ids": ids, "weights": weights}
    for name, a in arrays.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"marlin_moe: {name} must be an array, got {type(a).__name__}")
    if len(x.shape) != 2:
        raise ValueError(f"marlin_moe: x must be [M, D], got shape {tuple(x.shape)}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"marlin_moe: x must be float32 or bfloat16, got {x.dtype}")
    m, d = (int(n) for n in x.shape)
    if len(ids.shape) != 2 or ids.shape[0] != m:
        raise ValueError(f"marlin_moe: ids must be [M, k] with M = {m} (x's rows), got shape {tuple(ids.shape)}")
    if tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"marlin_moe: weights has shape {tuple(weights.shape)}, expected ids' {tuple(ids.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"marlin_moe: ids must be integer, got {ids.dtype}")
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"marlin_moe: weights must be floating point, got {weights.dtype}")
    k = int(ids.shape[1])
    experts = {"we_gate": we_gate, "we_up": we_up, "we_down": we_down}
    for name, w in experts.items():
        if len(w.packed.shape) != 3 or len(w.scale.shape) != 3:
            raise ValueError(f"marlin_moe: {name} must hold packed [E, out, in/8] and scale [E, out, in/group], got "
                             f"{tuple(w.packed.shape)} and {tuple(w.scale.shape)}")
        if w.packed.dtype != jnp.int32:
            raise TypeError(f"marlin_moe: {name}.packed must be int32, got {w.packed.dtype}")
        if w.scale.dtype != jnp.bfloat16:
            raise TypeError(f"marlin_moe: {name}.scale must be bfloat16, got {w.scale.dtype}")
        e_, out, n_in = w.shape
        if w.scale.shape[:2] != (e_, out) or w.scale.shape[2] < 1 or n_in % w.scale.shape[2]:
            raise ValueError(f"marlin_moe: {name}.scale {tuple(w.scale.shape)} does not match its packed "
                             f"{tuple(w.packed.shape)} (one scale per group of inputs, the group dividing in = {n_in})")
    e, f, d_in = we_gate.shape
    if d_in != d:
        raise ValueError(f"marlin_moe: we_gate is [E, F, D] = {we_gate.shape} but x has D = {d}")
    if we_up.shape != we_gate.shape or we_up.scale.shape != we_gate.scale.shape:
        raise ValueError(f"marlin_moe: we_up {we_up.shape} (scale {tuple(we_up.scale.shape)}) must match we_gate "
                         f"{we_gate.shape} (scale {tuple(we_gate.scale.shape)})")
    if we_down.shape != (e, d, f):
        raise ValueError(f"marlin_moe: we_down must be [E, D, F] = {(e, d, f)}, got {we_down.shape}")
    if e < 1:
        raise ValueError("marlin_moe: no experts (E = 0)")
    return m, d, k, e, f


def _cuda_call(args, m: int, d: int, k: int, e: int, f: int, dtype, block_m: int,
               flags: int = 0, target: str = TARGET) -> list[jax.Array]:
    """The CUDA custom call: [out [M, D], sorted slots, block experts, h [M k, F], ys [M k, D]] (the GPU tests
    read the scratch outputs too; the GEMV path writes out and h only). In the tile path h holds each 128-column
    block in the kernel's k order. target:
    another registration of the same handler (benchmarks/marlin_stages.py's timing copies)."""
    nb = max_blocks(m * k, e, block_m)
    outs = [jax.ShapeDtypeStruct((m, d), dtype),
            jax.ShapeDtypeStruct((nb * block_m,), jnp.int32),  # slots sorted by expert, padded per expert
            jax.ShapeDtypeStruct((nb + 1,), jnp.int32),  # the expert of each block (-1: unused), the used blocks
            jax.ShapeDtypeStruct((m * k, f), dtype),  # h = silu(gate) * up per slot
            jax.ShapeDtypeStruct((m * k, d), dtype)]  # ys = h @ down.T per slot
    return jax.ffi.ffi_call(target, outs, vmap_method="sequential")(*args, flags=np.int64(flags))


def _fused_call(args, m: int, d: int, k: int, f: int, dtype, flags: int = 0) -> list[jax.Array]:
    """The fused path's custom call: [out [M, D], gate/up partials, h [M k, F], down partials, counters] (the
    scratch comes back for the GPU tests); flags: FLAG_FUSED_ONE or 0."""
    s = m * k
    outs = [jax.ShapeDtypeStruct((m, d), dtype),
            jax.ShapeDtypeStruct((s * (d // FUSED_SPAN) * 2 * f,), jnp.float32),
            jax.ShapeDtypeStruct((s, f), dtype),
            jax.ShapeDtypeStruct((s * (f // FUSED_SPAN) * d,), jnp.float32),
            jax.ShapeDtypeStruct((1 + s * (f // 16) + d // 16,), jnp.uint32)]
    call = jax.ffi.ffi_call(FUSED_TARGET, outs, vmap_method="sequential")
    return call(*args, flags=np.int64(flags & FLAG_FUSED_ONE))


def marlin_moe(x: jax.Array, ids: jax.Array, weights: jax.Array, we_gate, we_up, we_down, *, impl: str = "ffi",
               block_m: int | None = None, flags: int | None = None, experts_total: int | None = None) -> jax.Array:
    """Routed experts: sum_j weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = ids[m, j].

    x [M, D] float32 or bfloat16; ids int [M, k] (outside [0, E): no expert); weights float [M, k] (used in fp32);
    we_gate, we_up [E, F, D] and we_down [E, D, F] as `Int4Array` (int32 packed, bf16 scales, the model's layout)
    -> [M, D] in x's dtype. Float (not INT4) experts have no W4A16 kernel to run: they go to `marlin_moe_ref`.

    impl="ffi" runs the custom call (C++ on CPU, CUDA on GPU, the reference on other platforms); impl="xla" runs
    `marlin_moe_ref`, impl="dense" `moe_experts_dense` (`ModelConfig.impl` picks one). block_m overrides
    `choose_path` on CUDA (benchmarks, tests): 8, 16 or 32 run the stream path (16 or 32 with FLAG_TILE the tile
    path's narrow tiles), 64 or 128 the tile path (bf16, D % 256 == 0, F % 128 == 0, group 32 only). flags: FLAG_*
    bits for benchmarks and tests (None: the chosen path's; with block_m None, given flags replace the chosen path's
    other bits, and the path stays the chosen one). experts_total: the experts of the whole model when these E are
    one expert-parallel shard's (the ids of the other shards' experts mapped to E): the M k slots spread over
    experts_total experts, of which a shard gets about M k / experts_total per expert, so the block size is chosen
    from that density (default: E). No host sync: usable under jit, vmap, shard_map and inside loops.
    """
    if impl not in IMPLS:
        raise ValueError(f"marlin_moe: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "dense":
        return moe_experts_dense(x, ids, weights, we_gate, we_up, we_down)
    quantized = [isinstance(w, Int4Array) for w in (we_gate, we_up, we_down)]
    if not all(quantized):
        if any(quantized):
            raise TypeError("marlin_moe: we_gate, we_up and we_down must be all Int4Array or all float arrays")
        return marlin_moe_ref(x, ids, weights, we_gate, we_up, we_down)
    m, d, k, e, f = _check(x, ids, weights, we_gate, we_up, we_down)
    if experts_total is not None and (isinstance(experts_total, bool) or not isinstance(experts_total, int)
                                      or experts_total < e):
        raise ValueError(f"marlin_moe: experts_total must be an integer >= the {e} experts given, got "
                         f"{experts_total!r}")
    if impl == "xla":
        return marlin_moe_ref(x, ids, weights, we_gate, we_up, we_down)
    if block_m is not None and block_m not in BLOCK_SIZES:
        raise ValueError(f"marlin_moe: block_m must be one of {BLOCK_SIZES}, got {block_m!r}")
    tile_ok = tile_eligible(d, f, we_gate.group_size, we_down.group_size, x.dtype)
    narrow = block_m in NARROW_TILE_BLOCKS and flags is not None and bool(flags & FLAG_TILE)
    if (block_m in TILE_BLOCKS or narrow) and not tile_ok:
        raise ValueError(f"marlin_moe: block_m={block_m} (the tile path) needs bfloat16 x, D % 256 == 0, F % 128 == 0 "
                         f"and group size 32; got {x.dtype}, D = {d}, F = {f}, groups {we_gate.group_size} / "
                         f"{we_down.group_size}")
    if m == 0 or k == 0:
        return jnp.zeros((m, d), x.dtype)
    _registry.register()
    fused_ok = fused_eligible(m, k, d, f, we_gate.group_size, we_down.group_size, x.dtype)
    if flags is not None and flags & FLAG_FUSED and not fused_ok:
        raise ValueError(f"marlin_moe: FLAG_FUSED needs bfloat16 x, D and F multiples of {FUSED_SPAN} up to "
                         f"{FUSED_MAX_IN}, group size 32 and 1 <= M k <= {FUSED_MAX_SLOTS}; got {x.dtype}, D = {d}, "
                         f"F = {f}, M k = {m * k}")
    gemv_ok = gemv_eligible(m, k, d, f, we_gate.group_size, we_down.group_size, x.dtype)
    if flags is not None and flags & FLAG_GEMV and not gemv_ok:
        raise ValueError(f"marlin_moe: FLAG_GEMV needs bfloat16 x, group size 32, D in (2048, 4096, 7168, 8192), F in "
                         f"(1024, 2048) and 1 <= M k <= {GEMV_MAX_SLOTS}; got {x.dtype}, D = {d}, F = {f}, "
                         f"M k = {m * k}")
    gemv = bool(flags & FLAG_GEMV) if flags is not None else (block_m is None and gemv_ok and bool(gemv_default()))
    default = fused_default() if block_m is None and flags is None else 0
    if fused_ok and default and not gemv:
        flags = default
    if block_m is None:
        bm, chosen = choose_path(m, k, experts_total or e, tile_ok, local=e)
        # the chosen path (its FLAG_TILE bit), the given flags' other bits
        flags = chosen if flags is None else (flags & ~FLAG_TILE) | (chosen & FLAG_TILE)
    else:
        bm = block_m
        flags = (TILE_FLAGS if bm in TILE_BLOCKS else STREAM_FLAGS) if flags is None else flags
    if gemv:
        flags |= FLAG_GEMV

    def cpu(*args):
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, d), x.dtype), vmap_method="sequential")(*args)

    def cuda(*args):
        if flags & FLAG_FUSED and not flags & FLAG_GEMV:
            return _fused_call(args, m, d, k, f, x.dtype, flags)[0]
        return _cuda_call(args, m, d, k, e, f, x.dtype, bm, flags)[0]

    def other(x, ids, weights, gq, gs, uq, us, dq, ds):
        return marlin_moe_ref(x, ids, weights, Int4Array(gq, gs), Int4Array(uq, us), Int4Array(dq, ds))

    args = (x, ids.astype(jnp.int32), weights.astype(jnp.float32), we_gate.packed, we_gate.scale, we_up.packed,
            we_up.scale, we_down.packed, we_down.scale)
    return jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=other)


def marlin_moe_ref(x: jax.Array, ids: jax.Array, weights: jax.Array, we_gate, we_up, we_down) -> jax.Array:
    """Pure JAX: `moe_experts_ref` (dequantize, sort by expert, `jax.lax.ragged_dot`), with every id outside
    [0, E) (negative ones too) meaning no expert."""
    e = we_gate.shape[0]
    ids = jnp.where((ids >= 0) & (ids < e), ids, e)
    return moe_experts_ref(x, ids, weights, we_gate, we_up, we_down)


def moe_experts_ref(x, ids, weights, we_gate, we_up, we_down):
    """Routed experts in pure JAX: sum_k weights[m, k] * down_e(silu(gate_e(x)) * up_e(x)), e = ids[m, k].

    x [M, D], ids/weights [M, k], expert weights [E, F, D], [E, F, D], [E, D, F] (float, or Int4Array
    dequantized here). Tokens are sorted by expert and multiplied with `jax.lax.ragged_dot`. An id >= E means
    "not one of these experts" and contributes nothing (expert parallelism passes each shard's non-local slots
    that way). This is the function of the `marlin_moe` custom call.
    """
    dt = x.dtype
    m, k = ids.shape
    deq = lambda w: (w.dequantize(dt) if isinstance(w, Int4Array) else w)
    g, u, dn = deq(we_gate), deq(we_up), deq(we_down)
    n_exp = g.shape[0]
    flat = ids.reshape(-1)  # [M k]
    order = jnp.argsort(flat, stable=True)
    rows = order // k  # token of each sorted slot
    xs = x[rows]  # [M k, D]
    sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)  # [E]; ids >= E (not here) are dropped
    h = jax.nn.silu(jax.lax.ragged_dot(xs, jnp.swapaxes(g, 1, 2), sizes)) * jax.lax.ragged_dot(
        xs, jnp.swapaxes(u, 1, 2), sizes)  # [M k, F]
    y = jax.lax.ragged_dot(h.astype(dt), jnp.swapaxes(dn, 1, 2), sizes)  # [M k, D]
    kept = (flat[order] < n_exp)[:, None]  # slots sent to no local expert (expert parallelism) add nothing
    y = jnp.where(kept, y.astype(jnp.float32) * weights.reshape(-1)[order][:, None], 0.0)
    return jnp.zeros((m, x.shape[1]), jnp.float32).at[rows].add(y).astype(dt)


def moe_experts_dense(x, ids, weights, we_gate, we_up, we_down):
    """The same function as `moe_experts_ref`, computed by running every expert on every token and combining
    with a [M, E] weight matrix that is zero off the top-k: E / k times the work, but plain dense matmuls
    (used for training the embedded model, and as a second reference)."""
    dt = x.dtype
    deq = lambda w: (w.dequantize(dt) if isinstance(w, Int4Array) else w)
    g, u, dn = deq(we_gate), deq(we_up), deq(we_down)
    rows = jnp.arange(x.shape[0])[:, None]
    combine = jnp.zeros((x.shape[0], g.shape[0]), jnp.float32).at[rows, ids].add(weights, mode="drop")  # [M, E]
    h = jax.nn.silu(jnp.einsum("md,efd->mef", x, g)) * jnp.einsum("md,efd->mef", x, u)  # [M, E, F]
    y = jnp.einsum("mef,edf->med", h, dn)  # [M, E, D]
    return jnp.einsum("med,me->md", y.astype(jnp.float32), combine).astype(dt)
