"""A Triton W4A16 fused MoE of the vLLM family: the anchor that `benchmarks/marlin_moe.py --variants ...,triton`
times side by side with marlin_moe.

What it computes is marlin_moe's function (`kdtree_jax.kernels.marlin_moe.marlin_moe_ref`), from the same checkpoint
layout: packed int32 [E, out, in / 8] (nibble q + 8, least significant first), bf16 scales [E, out, in / 32].
How, in the usual Triton way (written here, not taken from elsewhere):
  1. align (torch, no host sync, so that it can be captured in a CUDA graph): the M k slots sorted by expert and
     padded per expert to BLOCK_M, the expert of every BLOCK_M-slot block (-1: unused), sized for the worst routing
     as marlin_moe sizes it;
  2. gemm1: per (slot block, BLOCK_N output columns), h = silu(x . gate) * (x . up), the weights dequantized in the k
     loop to bf16(q * s) (the reference's rounding) and fed to tl.dot with the gathered token rows;
  3. gemm2: ys = h . down, the same kernel without the gate;
  4. combine (torch): out[m] = sum_j weights[m, j] ys[m k + j] in fp32, dropped slots skipped.
Each k step loads a tile's packed words and scales once, along the weight rows (coalesced), and spreads them to the
inputs in registers. The block shapes are tuned per M over CONFIGS.

Runs on CUDA; on CPU with TRITON_INTERPRET=1 (tests/test_triton_moe.py, tiny shapes), where tl.dot gets the same
bf16 values as fp32 and the fp32 -> bf16 rounding is done on the bits (triton 3.9.0's interpreter returned garbage
from a bf16 dot and truncates that cast).
"""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

GROUP = 32  # inputs per scale

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K a multiple of GROUP
CONFIGS = [(bm, bn, bk, w, st) for bm in (16, 32, 64) for bn in (32, 64, 128) for bk in (64, 128)
           for w, st in ((4, 3),)] + [(128, 128, 64, 8, 3), (64, 128, 64, 8, 4), (128, 64, 128, 8, 3)]


def max_blocks(slots: int, experts: int, block_m: int) -> int:
    """Token blocks enough for any routing of `slots` slots over `experts` experts (each expert's run padded)."""
    return (slots + min(experts, slots) * (block_m - 1)) // block_m


def align(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted slots [max_blocks BLOCK_M] (M k: padding), block experts [max_blocks] (-1: unused)) of ids [M, k]."""
    flat = ids.reshape(-1).to(torch.int64)
    slots = flat.numel()
    valid = (flat >= 0) & (flat < experts)
    key = torch.where(valid, flat, torch.full_like(flat, experts))
    order = torch.argsort(key, stable=True)
    # (torch.bincount would read its input's max back to the host on CUDA: a sync per call)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key))[:experts]
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(padded, 0) - padded  # each expert's first padded position
    first = torch.cumsum(counts, 0) - counts  # its first place in `order`
    ek = key[order]
    rank = torch.arange(slots, device=ids.device) - torch.where(ek < experts, first[ek.clamp(max=experts - 1)], 0)
    pos = torch.where(ek < experts, start[ek.clamp(max=experts - 1)] + rank, -1)
    nb = max_blocks(slots, experts, block_m)
    sorted_slots = torch.full((nb * block_m + 1,), slots, dtype=torch.int32, device=ids.device)
    sorted_slots[torch.where(pos >= 0, pos, nb * block_m)] = order.to(torch.int32)  # dropped slots: the spare entry
    blocks = torch.arange(nb, device=ids.device)
    ends = torch.cumsum(padded, 0) // block_m  # the block after each expert's last
    owner = torch.searchsorted(ends, blocks, right=True)
    block_expert = torch.where(owner < experts, owner, -1).to(torch.int32)
    return sorted_slots[:-1].contiguous(), block_expert


@triton.jit
def _bf16(v, INTERPRET: tl.constexpr):
    """fp32 -> bf16, rounded to nearest even. The interpreter truncates instead (triton 3.9.0), so there the rounding
    is done on the bits first (the result is then exact in bf16, and its truncation changes nothing)."""
    if INTERPRET:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _dequant(w_ptrs, s_ptrs, col_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """bf16(q * s) [BLOCK_N, BLOCK_K] of the words at w_ptrs [BLOCK_N, BLOCK_K / 8] (nibble j of word w: input 8 w + j,
    q = nibble - 8) and the scales at s_ptrs [BLOCK_N, BLOCK_K / 32] (fp32 on the interpreter, see `_moe_gemm`)."""
    words = tl.load(w_ptrs, mask=col_ok[:, None], other=0)
    q = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    q = tl.reshape(q, (BLOCK_N, BLOCK_K)) - 8
    sc = tl.load(s_ptrs, mask=col_ok[:, None], other=0.0).to(tl.float32)
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
    b = _bf16(q.to(tl.float32) * sc, INTERPRET)
    if INTERPRET:
        b = b.to(tl.float32)
    return b


@triton.jit
def _moe_gemm(src, w0, s0, w1, s1, dst, sorted_slots, block_expert, n_out, k_in, src_div, slots,
              GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(n_out, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    e = tl.load(block_expert + pid_m)
    if e >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_slots + offs_m)
        real = slot < slots
        row = tl.where(real, slot // src_div, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < n_out
        offs_k = tl.arange(0, BLOCK_K)
        words = k_in // 8
        groups = k_in // 32
        wrow = e.to(tl.int64) * n_out + offs_n  # weight rows of this tile
        x_ptrs = src + row[:, None] * k_in + offs_k[None, :]
        # [BLOCK_N, BLOCK_K / 8] words and [BLOCK_N, BLOCK_K / 32] scales: each loaded once, along the rows' contiguous
        # inputs, then spread to [BLOCK_N, BLOCK_K] in registers
        w_off = wrow[:, None] * words + tl.arange(0, BLOCK_K // 8)[None, :]
        s_off = wrow[:, None] * groups + tl.arange(0, BLOCK_K // 32)[None, :]
        acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_in, BLOCK_K):
            a = tl.load(x_ptrs + kk, mask=real[:, None], other=0.0)
            b = _dequant(w0 + w_off + kk // 8, s0 + s_off + kk // 32, col_ok, BLOCK_N, BLOCK_K, INTERPRET)
            if INTERPRET:  # the interpreter's bf16 dot is wrong; fp32 of the same bf16 values gives the same products
                a = a.to(tl.float32)
            acc0 = tl.dot(a, tl.trans(b), acc0)
            if GATED:
                b1 = _dequant(w1 + w_off + kk // 8, s1 + s_off + kk // 32, col_ok, BLOCK_N, BLOCK_K, INTERPRET)
                acc1 = tl.dot(a, tl.trans(b1), acc1)
        if GATED:
            res = acc0 / (1.0 + tl.exp(-acc0)) * acc1
        else:
            res = acc0
        out_ptrs = dst + tl.where(real, slot, 0).to(tl.int64)[:, None] * n_out + offs_n[None, :]
        tl.store(out_ptrs, _bf16(res, INTERPRET), mask=real[:, None] & col_ok[None, :])


def _gemm(src, wq0, ws0, wq1, ws1, dst, sorted_slots, block_expert, src_div, cfg, gated):
    bm, bn, bk, warps, stages = cfg
    e, n_out, words = wq0.shape
    k_in = words * 8
    if k_in % bk or bk % GROUP:
        raise ValueError(f"triton_moe: BLOCK_K {bk} must divide the {k_in} inputs and be a multiple of {GROUP}")
    if tuple(ws0.shape) != (e, n_out, k_in // GROUP):
        raise ValueError(f"triton_moe: scales {tuple(ws0.shape)} do not match packed weights {tuple(wq0.shape)} with "
                         f"group {GROUP}")
    grid = (block_expert.numel() * triton.cdiv(n_out, bn),)
    cpu = src.device.type == "cpu"  # Triton's interpreter (TRITON_INTERPRET=1)
    extra = {} if cpu else {"num_warps": warps, "num_stages": stages}
    _moe_gemm[grid](src, wq0, ws0, wq1 if gated else wq0, ws1 if gated else ws0, dst, sorted_slots, block_expert,
                    n_out, k_in, src_div, dst.shape[0], GATED=gated, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                    INTERPRET=cpu, **extra)


def moe(x, ids, weights, gate_q, gate_s, up_q, up_s, down_q, down_s, cfg1, cfg2=None):
    """The fused MoE: x [M, D] bf16, ids [M, k] int, weights [M, k] -> [M, D] bf16. cfg1 / cfg2: CONFIGS entries of
    the two gemms (cfg2 default cfg1). Both gemms use cfg1's BLOCK_M (one align)."""
    cfg2 = cfg2 or cfg1
    if cfg2[0] != cfg1[0]:
        raise ValueError("triton_moe: both gemms take the align stage's BLOCK_M")
    m, k = ids.shape
    e, f, _ = gate_q.shape
    d = x.shape[1]
    sorted_slots, block_expert = align(ids, e, cfg1[0])
    h = torch.empty((m * k, f), dtype=torch.bfloat16, device=x.device)
    ys = torch.empty((m * k, d), dtype=torch.bfloat16, device=x.device)
    _gemm(x, gate_q, gate_s, up_q, up_s, h, sorted_slots, block_expert, k, cfg1, True)
    _gemm(h, down_q, down_s, None, None, ys, sorted_slots, block_expert, 1, cfg2, False)
    valid = (ids >= 0) & (ids < e)
    wv = torch.where(valid, weights.float(), 0.0)
    ysv = torch.where(valid.reshape(m, k, 1), ys.view(m, k, d).float(), 0.0)
    return (ysv * wv[..., None]).sum(1).to(x.dtype)


def candidates(m: int, k: int, experts: int) -> list[tuple]:
    """CONFIGS whose BLOCK_M suits the slots per expert (at most 4x the expected slots of a touched expert)."""
    per = m * k / max(1, min(experts, m * k))
    fit = [c for c in CONFIGS if c[0] <= max(16, 4 * per)]
    return fit or CONFIGS[:1]


def _run_sets(sets, ws, cfg):
    return [moe(*s, *ws, cfg) for s in sets]


def time_sets(sets, ws, cfg, samples: int = 5, min_batch: float = 0.05) -> tuple[float, str]:
    """(median seconds per op of `moe` over the input sets, "graph" or "eager"). On CUDA one CUDA graph holds a call
    per set (align, both gemms, combine: no host sync inside), and its replays are queued back to back, then waited
    for, so host dispatch is not timed (the JAX variants' batches are one jitted program too); where the capture
    fails, and off CUDA, the calls run eagerly (host dispatch included)."""
    _run_sets(sets, ws, cfg)  # compiles the kernels
    cuda = sets[0][0].device.type == "cuda"
    run, mode = (lambda: _run_sets(sets, ws, cfg)), "eager"  # noqa: E731
    if cuda:
        torch.cuda.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: JAX's own threads keep using the GPU while this thread captures (the default, global,
            # fails their calls and leaves JAX's stream in an error state)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                _run_sets(sets, ws, cfg)
            run, mode = graph.replay, "graph"
        except RuntimeError as e:
            print(f"triton_moe: CUDA graph capture failed, timing eagerly: {str(e).splitlines()[0][:160]}", flush=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run()
    sync()
    t0 = time.perf_counter()
    run()
    sync()
    calls = max(1, min(50, int(min_batch / max(time.perf_counter() - t0, 1e-6))))
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        sync()
        out.append((time.perf_counter() - t0) / (calls * len(sets)))
    return statistics.median(out), mode


def tune(sets, ws, m: int, k: int, experts: int, budget_s: float = 45.0,
         configs=None) -> tuple[tuple, tuple[float, str], list]:
    """(best config, (its time per op, timing mode), [(config, time or error)]) over `configs` (default
    `candidates`), each timed briefly, until budget_s (compilation included) has passed."""
    tried = []
    start = time.perf_counter()
    for cfg in configs or candidates(m, k, experts):
        if time.perf_counter() - start > budget_s and tried:
            break
        try:
            tried.append((cfg, time_sets(sets, ws, cfg, samples=1, min_batch=0.01)[0]))
        except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped, and reported
            tried.append((cfg, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
    timed_ok = [(c, t) for c, t in tried if isinstance(t, float)]
    if not timed_ok:
        raise RuntimeError(f"triton_moe: no config ran at M = {m}: {tried[:3]}")
    best = min(timed_ok, key=lambda ct: ct[1])[0]
    return best, time_sets(sets, ws, best), tried


def from_jax(a) -> torch.Tensor:
    """A JAX array as a torch tensor on the same device, sharing its memory (DLPack)."""
    return torch.utils.dlpack.from_dlpack(a)


def measure_jax(sets, experts, m: int, k: int, n_experts: int, budget_s: float = 45.0, configs=None) -> dict:
    """Tunes and times `moe` on marlin_moe's benchmark inputs: sets [(x, ids, weights)] and experts (gate, up, down)
    as `Int4Array`s, JAX arrays (on the GPU; on the CPU through the interpreter). -> {time_s, timing ("graph" /
    "eager"), config, tried, out (the first set's output, float32 numpy)}."""
    import jax

    jax.block_until_ready((sets, experts))
    ts = [tuple(from_jax(a) for a in s) for s in sets]
    ws = [from_jax(a) for w in experts for a in (w.packed, w.scale)]
    best, (seconds, mode), tried = tune(ts, ws, m, k, n_experts, budget_s, configs)
    out = moe(*ts[0], *ws, best).float().cpu().numpy()
    return dict(time_s=seconds, timing=mode, config=best, tried=tried, out=out)
