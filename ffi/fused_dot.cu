// fused_dot on CUDA (sm_90a): a layer's dense weights at the few rows of a decode or verify step (M <= 32) with what
// surrounds them, in one launch; the function of fused_dot.cc (kdtree_jax/kernels/fused_dot.py has the math).
//
//   x'  = rms_norm(x) = bf16(nw * bf16(x * r)), r = 1 / sqrt(mean(x^2) + eps)     (no norm weight: x' = x)
//   y_s = epilogue_s(x' . w_s)      for the one or two weights w_s [K, N_s] that share x
//
// Epilogues: plain (bf16 or f32, then up to two residual adds, each rounded to bf16 as the model's `h + a` is) or
// gated (w_s = [gate | up], y = silu(gate) * up); x' itself is an optional output (the routed experts' input).
//
// Why: a layer at one device's share of K2.6 ran ~14 XLA kernels around its dense weights at M = 1 (two per norm,
// split-K and its reduction per dot, the gate multiply), each taking 1-8 µs whatever it moved.
//
// Work split. A block of 256 threads owns 64 columns of w (128 contiguous bytes of each row; gated: 32 gate and the
// same 32 up columns) and a K slice; the `split` blocks of a thread-block cluster share the K of one 64-column tile
// and add their fp32 partials through distributed shared memory in rank order (the result does not depend on
// timing). The split is the largest whose clusters all fit on the GPU at once (cudaOccupancyMaxActiveClusters), so
// the grid is one wave. x needs the whole row's sum of squares before the dot, so that x' is rounded as the
// reference rounds it (equal but where r, summed in another order and from an approximate reciprocal square root,
// puts x r on the other side of a rounding: rare, one ulp): each block reads its K slice of x into shared memory and
// sums each row's squares over it, the cluster's blocks add those sums in rank order through distributed shared
// memory, and each normalizes its slice there. Two kernels take the products:
// - M <= 4, the CUDA cores (FusedDotKernel): thread t takes 8 columns (16 bytes, t % 8) of rows t / 8, t / 8 + 32,
//   ... of the slice; it loads U rows at once (ld.global.nc, L1 not allocated) and multiplies the U before them
//   while they arrive; the 4 row groups of a warp that share columns are summed by two shuffles, the 8 warps in
//   shared memory;
// - 5-32 rows (or any with flag bit 3), the tensor cores (FusedDotMmaKernel, its comment has the layout).
// The first stages of w (a parameter no kernel writes, flag bit 1) are loaded before griddepcontrol.wait, while the
// kernel ahead finishes. No workspace, no host sync (kCmdBufferCompatible).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda_common.cuh"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace cg = cooperative_groups;

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 64;                  // columns of w a block owns
constexpr int kRowGroups = kThreads / 8;   // 32: the rows a block's threads load at once
constexpr int kChunk = 64;                 // K and each K slice: multiples of it
constexpr int kMaxCoreRows = 4;  // the CUDA-core kernel's rows at most
constexpr int kMaxRows = 32;     // the tensor-core kernel's
constexpr int kMaxK = 8192;               // K at most (each thread loads its x pieces at once)
constexpr int kMaxSplit = 16;              // clusters of 16 are non-portable (sm_90: allowed by a kernel attribute)
constexpr int64_t kFlagPlain = 1;
constexpr int64_t kFlagEarlyW = 2;
constexpr int64_t kFlagL2Lines = 4;  // the weight loads ask L2 for whole 256-byte lines
constexpr int64_t kFlagMma = 8;      // the tensor-core kernel at M <= 4 too

struct Segment {
  const __nv_bfloat16* w;  // [K, n]
  void* y;                 // [M, n] (plain) or [M, n / 2] (gated)
  int n;                   // columns of w
  int groups;              // 16-column groups: n / 16
  int gated;
  int f32;                 // y in float32 (plain only)
};

struct Params {
  const __nv_bfloat16* x;     // [M, K]
  const __nv_bfloat16* nw;    // [K] or null
  const __nv_bfloat16* add0;  // [M, n0] or null (segment 0, plain bf16)
  const __nv_bfloat16* add1;
  __nv_bfloat16* xn;          // [M, K] or null
  Segment seg[2];
  int m, k, split;
  float eps;
  bool early_w;
  bool l2_256;  // kFlagL2Lines
};

__device__ __forceinline__ float Bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// shared memory: x' of the slice [MM][xstride] f32 (the tensor-core kernel pads each row by 8 floats so that a
// warp's 8-byte fragment reads fall in distinct banks); the warps' partials [8][MM][64]; the block's [MM][64]; the
// warps' sums of squares [8][MM]; the rows' scales [MM]; the slice's norm weights [kslice]
__host__ __device__ constexpr int XStride(int kslice, bool mma) { return mma ? kslice + 8 : kslice; }
__host__ __device__ constexpr int SmemBytes(int mm, int kslice, bool mma) {
  return 4 * (mm * XStride(kslice, mma) + kWarps * mm * kTile + mm * kTile + kWarps * mm + mm + kslice);
}

struct Smem {
  float* xs;    // [MM][xstride]
  float* red;   // [8 warps][MM][64]
  float* part;  // [MM][64]
  float* ssw;   // [8 warps][MM]
  float* rs;    // [MM]
  float* nws;   // [kslice]
};

template <int MM>
__device__ __forceinline__ Smem Carve(unsigned char* smem, int xstride) {
  Smem s;
  s.xs = reinterpret_cast<float*>(smem);
  s.red = s.xs + MM * xstride;
  s.part = s.red + kWarps * MM * kTile;
  s.ssw = s.part + MM * kTile;
  s.rs = s.ssw + kWarps * MM;
  s.nws = s.rs + MM;
  return s;
}

// The block's tile: which weight (segment), which 64 columns, and the first column of a thread's 8 (piece 0-7: a
// plain tile's 8-column groups in order; a gated one's 4 of gate, then the same 4 of up).
struct Tile {
  Segment seg;
  int s_idx, group;
};

__device__ __forceinline__ Tile TileOf(const Params& p) {
  const int s_idx = blockIdx.y < p.seg[0].groups ? 0 : 1;
  return {s_idx ? p.seg[1] : p.seg[0], s_idx, static_cast<int>(blockIdx.y) - (s_idx ? p.seg[0].groups : 0)};
}

__device__ __forceinline__ int PieceColumn(const Tile& t, int piece) {
  return t.seg.gated ? (piece < 4 ? 32 * t.group + 8 * piece : t.seg.n / 2 + 32 * t.group + 8 * (piece - 4))
                     : kTile * t.group + 8 * piece;
}

// After GridDependencyWait: the block's K slice of x into xs (16-byte loads, 8 a thread in flight) and the slice's
// norm weights; each row's sum of squares over the slice (warp w: rows w, w + 8, ...), the cluster's slices added in
// rank order through distributed shared memory (deterministic); then, after letting the next kernel launch,
// x' = bf16(nw * bf16(x * r)) in place. Rows m..MM-1 of xs are not written.
template <int MM>
__device__ __forceinline__ void StageX(const Params& p, const Smem& sm, int xstride, int k0, int kslice) {
  constexpr int kBatch = 8;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, m = p.m, split = p.split;
  const bool norm = p.nw != nullptr;
  const int per_row = kslice / 8, total = m * per_row;
#pragma unroll 1
  for (int e0 = tid; e0 < total; e0 += kThreads * kBatch) {
    uint4 got[kBatch];  // every load of the batch issued before the first is used
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads, row = e / per_row, c = e - row * per_row;
      got[u] = e < total ? *reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(row) * p.k + k0 + 8 * c)
                         : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads, row = e / per_row, c = e - row * per_row;
      if (e < total) {
        const uint32_t xw[4] = {got[u].x, got[u].y, got[u].z, got[u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xw[i]));
          sm.xs[row * xstride + 8 * c + 2 * i] = a.x;
          sm.xs[row * xstride + 8 * c + 2 * i + 1] = a.y;
        }
      }
    }
  }
  if (norm) {  // the slice's norm weights, every 16-byte load issued before the first is used
    uint4 got[kMaxK / 8 / kThreads];
#pragma unroll
    for (int j = 0; j < kMaxK / 8 / kThreads; ++j) {
      const int c = tid + j * kThreads;
      got[j] = c < kslice / 8 ? *reinterpret_cast<const uint4*>(p.nw + k0 + 8 * c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kMaxK / 8 / kThreads; ++j) {
      const int c = tid + j * kThreads;
      const uint32_t nw[4] = {got[j].x, got[j].y, got[j].z, got[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&nw[i]));
        if (c < kslice / 8) {
          sm.nws[8 * c + 2 * i] = b.x;
          sm.nws[8 * c + 2 * i + 1] = b.y;
        }
      }
    }
  }
  __syncthreads();
  for (int row = warp; row < m; row += kWarps) {  // the slice's sum of squares of each row: ssw[row]
    float ss = 0.0f;
    for (int kk = lane; kk < kslice; kk += 32) ss = fmaf(sm.xs[row * xstride + kk], sm.xs[row * xstride + kk], ss);
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, d);
    if (lane == 0) sm.ssw[row] = ss;
  }
  LaunchDependents();
  cg::cluster_group cluster = cg::this_cluster();
  if (split > 1) {
    cluster.sync();
  } else {
    __syncthreads();
  }
  if (tid < m) {  // the whole row's: the cluster's slices in rank order
    float ss = 0.0f;
    for (int r = 0; r < split; ++r) ss += (split > 1 ? cluster.map_shared_rank(sm.ssw, r) : sm.ssw)[tid];
    sm.rs[tid] = rsqrtf(ss / static_cast<float>(p.k) + p.eps);
  }
  __syncthreads();
  if (norm) {  // x' = bf16(nw * bf16(x * r)), in place
    for (int e = tid; e < m * kslice; e += kThreads) {
      const int row = e / kslice, kk = e - row * kslice;
      float& v = sm.xs[row * xstride + kk];
      v = Bf(sm.nws[kk] * Bf(v * sm.rs[row]));
    }
  }
  __syncthreads();
}

// After the warps' partials are in red: their sum (warps in order), x' of the slice out where asked, the K split's
// sum over the cluster in rank order and the epilogue; block `rank` of the cluster finishes 1 / split of the tile.
template <int MM>
__device__ __forceinline__ void FinishTile(const Params& p, const Tile& t, const Smem& sm, int xstride, int k0,
                                           int kslice) {
  const int tid = threadIdx.x, m = p.m, split = p.split, rank = blockIdx.x;
  const Segment& seg = t.seg;
  __syncthreads();
  for (int e = tid; e < m * kTile; e += kThreads) {
    float v = 0.0f;
    for (int w = 0; w < kWarps; ++w) v += sm.red[w * MM * kTile + e];
    sm.part[e] = v;
  }
  if (p.xn && blockIdx.y == 0) {  // x' of this block's K slice
    for (int e = tid; e < m * kslice; e += kThreads) {
      const int row = e / kslice, kk = e - row * kslice;
      p.xn[row * p.k + k0 + kk] = __float2bfloat16_rn(sm.xs[row * xstride + kk]);
    }
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (split > 1) {
    cluster.sync();
  } else {
    __syncthreads();
  }
  constexpr int kHalf = kTile / 2;
  const int outs = seg.gated ? kHalf : kTile;  // outputs a row
  const int total = m * outs, per = (total + split - 1) / split;
  const int lo = rank * per, hi = min(total, lo + per);
  for (int e = lo + tid; e < hi; e += kThreads) {
    const int row = e / outs, c = e % outs;
    const int src = row * kTile + c;
    float v0 = 0.0f, v1 = 0.0f;
    for (int r = 0; r < split; ++r) {
      const float* pr = split > 1 ? cluster.map_shared_rank(sm.part, r) : sm.part;
      v0 += pr[src];
      if (seg.gated) v1 += pr[src + kHalf];
    }
    if (seg.gated) {
      const float gate = Bf(v0), up = Bf(v1);
      const float h = Bf(Bf(gate * Bf(1.0f / (1.0f + __expf(-gate)))) * up);
      reinterpret_cast<__nv_bfloat16*>(seg.y)[row * (seg.n / 2) + kHalf * t.group + c] = __float2bfloat16_rn(h);
    } else {
      const int at = row * seg.n + kTile * t.group + c;
      if (seg.f32) {
        reinterpret_cast<float*>(seg.y)[at] = v0;
      } else {
        float o = Bf(v0);
        if (t.s_idx == 0 && p.add0) o = Bf(__bfloat162float(p.add0[at]) + o);
        if (t.s_idx == 0 && p.add1) o = Bf(__bfloat162float(p.add1[at]) + o);
        reinterpret_cast<__nv_bfloat16*>(seg.y)[at] = __float2bfloat16_rn(o);
      }
    }
  }
  if (split > 1) cluster.sync();  // no block leaves while another still reads its partials
}

// The CUDA cores (M <= 4). grid (split, tiles of both weights), cluster (split, 1, 1): blockIdx.y picks the 64
// columns, the rank the K slice. Thread t takes 8 columns (piece t % 8) of rows t / 8, t / 8 + 32, ... of the slice.
template <int MM, int U>
__global__ void __launch_bounds__(kThreads, 2) FusedDotKernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, m = p.m;
  const Tile t = TileOf(p);
  const int kslice = p.k / p.split, k0 = blockIdx.x * kslice;
  const int piece = tid % 8, rg = tid / 8;
  const __nv_bfloat16* wp = t.seg.w + static_cast<int64_t>(k0 + rg) * t.seg.n + PieceColumn(t, piece);
  const int64_t stride = static_cast<int64_t>(kRowGroups) * t.seg.n;
  const int rows = kslice / kRowGroups;
  const Smem sm = Carve<MM>(smem, kslice);

  uint4 nxt[U];
  auto load = [&](int i0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      nxt[u] = i0 + u < rows ? LoadStream16(wp + (i0 + u) * stride, p.l2_256) : make_uint4(0, 0, 0, 0);
    }
  };
  if (p.early_w) load(0);
  GridDependencyWait();
  if (!p.early_w) load(0);
  StageX<MM>(p, sm, kslice, k0, kslice);

  float acc[MM][8];
#pragma unroll
  for (int mm = 0; mm < MM; ++mm) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[mm][j] = 0.0f;
  }
#pragma unroll 1
  for (int i0 = 0; i0 < rows; i0 += U) {
    uint4 cur[U];
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = nxt[u];
    if (i0 + U < rows) load(i0 + U);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u < rows) {
        const int kk = rg + kRowGroups * (i0 + u);
        const uint32_t wv[4] = {cur[u].x, cur[u].y, cur[u].z, cur[u].w};
        float wf[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          wf[2 * i] = __uint_as_float(wv[i] << 16);
          wf[2 * i + 1] = __uint_as_float(wv[i] & 0xffff0000u);
        }
#pragma unroll
        for (int mm = 0; mm < MM; ++mm) {
          const float xv = mm < m ? sm.xs[mm * kslice + kk] : 0.0f;
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[mm][j] = fmaf(xv, wf[j], acc[mm][j]);
        }
      }
    }
  }
  // the 4 row groups of a warp hold the same columns (lanes l, l ^ 8, l ^ 16, l ^ 24); FinishTile sums the 8 warps
#pragma unroll
  for (int mm = 0; mm < MM; ++mm) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v = acc[mm][j];
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 8 && mm < m) sm.red[(warp * MM + mm) * kTile + 8 * lane + j] = v;
    }
  }
  FinishTile<MM>(p, t, sm, kslice, k0, kslice);
}

// The tensor cores (M up to 32), mma.m16n8k16 with the weight as B. A warp takes 16-row steps of the slice (warp w:
// steps w, w + 8, ...). Lane (g, q) = (lane / 4, lane % 4) loads 16 bytes, columns 8g..8g+7 of the tile (PieceColumn
// g), from each of the step's rows 2q, 2q+1, 2q+8 and 2q+9: the warp reads the step's 16 rows x 128 bytes, 8 lanes a
// 128-byte row. Two byte permutes a word pair turn (row 2q: columns c, c+1) and (row 2q+1: c, c+1) into (2q, 2q+1 of
// column c) and (of column c+1): the B fragment of mma j (j = 0..7) holds column 8g + j for lane group g, so mma j
// computes the tile's columns j, 8 + j, ..., 56 + j, and its accumulator (g, 2q) is x' row g (+ 16h, + 8) times
// column 16q + j (and 16q + 8 + j). A comes from x' in shared memory (exact in bf16: x' was rounded to it), rows
// past m zero. U steps of loads are in flight before the first is used.
template <int MM, int U>
__global__ void __launch_bounds__(kThreads, 1) FusedDotMmaKernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kHalves = MM / 16 > 0 ? MM / 16 : 1;  // 16-row A tiles
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, m = p.m;
  const int g = lane / 4, q = lane % 4;
  const Tile t = TileOf(p);
  const int kslice = p.k / p.split, k0 = blockIdx.x * kslice, xstride = XStride(kslice, true);
  const int steps = kslice / 16, mine = steps > warp ? (steps - warp + kWarps - 1) / kWarps : 0;
  const __nv_bfloat16* wp = t.seg.w + static_cast<int64_t>(k0 + 16 * warp + 2 * q) * t.seg.n + PieceColumn(t, g);
  const int64_t n = t.seg.n, step_stride = static_cast<int64_t>(16 * kWarps) * n;
  const Smem sm = Carve<MM>(smem, xstride);

  uint4 nxt[U][4];  // rows 2q, 2q + 1, 2q + 8, 2q + 9 of U steps
  auto load = [&](int i0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const __nv_bfloat16* r = wp + (i0 + u) * step_stride;
      const bool ok = i0 + u < mine;
      nxt[u][0] = ok ? LoadStream16(r, p.l2_256) : make_uint4(0, 0, 0, 0);
      nxt[u][1] = ok ? LoadStream16(r + n, p.l2_256) : make_uint4(0, 0, 0, 0);
      nxt[u][2] = ok ? LoadStream16(r + 8 * n, p.l2_256) : make_uint4(0, 0, 0, 0);
      nxt[u][3] = ok ? LoadStream16(r + 9 * n, p.l2_256) : make_uint4(0, 0, 0, 0);
    }
  };
  if (p.early_w) load(0);
  GridDependencyWait();
  if (!p.early_w) load(0);
  StageX<MM>(p, sm, xstride, k0, kslice);

  float acc[kHalves][8][4];
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[h][j][i] = 0.0f;
    }
  }
  auto x_word = [&](int row, int kk) -> uint32_t {  // x' (row, kk..kk+1) as a bf16 pair; 0 past m
    if (row >= m || row >= MM) return 0u;
    const float2 v = *reinterpret_cast<const float2*>(sm.xs + row * xstride + kk);
    const __nv_bfloat162 b = __floats2bfloat162_rn(v.x, v.y);
    return *reinterpret_cast<const uint32_t*>(&b);
  };
#pragma unroll 1
  for (int i0 = 0; i0 < mine; i0 += U) {
    uint4 cur[U][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < 4; ++r) cur[u][r] = nxt[u][r];
    }
    if (i0 + U < mine) load(i0 + U);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u < mine) {
        const int kb = 16 * (warp + kWarps * (i0 + u));  // the step's first row in the slice
        uint32_t a[kHalves][4];
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          a[h][0] = x_word(16 * h + g, kb + 2 * q);
          a[h][1] = x_word(16 * h + g + 8, kb + 2 * q);
          a[h][2] = x_word(16 * h + g, kb + 2 * q + 8);
          a[h][3] = x_word(16 * h + g + 8, kb + 2 * q + 8);
        }
        const uint32_t r0[4] = {cur[u][0].x, cur[u][0].y, cur[u][0].z, cur[u][0].w};
        const uint32_t r1[4] = {cur[u][1].x, cur[u][1].y, cur[u][1].z, cur[u][1].w};
        const uint32_t r8[4] = {cur[u][2].x, cur[u][2].y, cur[u][2].z, cur[u][2].w};
        const uint32_t r9[4] = {cur[u][3].x, cur[u][3].y, cur[u][3].z, cur[u][3].w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const unsigned sel = j % 2 ? 0x7632u : 0x5410u;  // the high halves (column 2i + 1) or the low (2i)
          const uint32_t b0 = __byte_perm(r0[j / 2], r1[j / 2], sel), b1 = __byte_perm(r8[j / 2], r9[j / 2], sel);
#pragma unroll
          for (int h = 0; h < kHalves; ++h) MmaAt(acc[h][j], a[h], b0, b1);
        }
      }
    }
  }
  // accumulator (h, j, i): row 16h + g (+ 8 for i >= 2), column 16q + j (+ 8 for odd i)
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 16 * h + g + (i >= 2 ? 8 : 0), col = 16 * q + j + (i % 2 ? 8 : 0);
        if (row < m && row < MM) sm.red[(warp * MM + row) * kTile + col] = acc[h][j][i];
      }
    }
  }
  FinishTile<MM>(p, t, sm, xstride, k0, kslice);
}

template <typename Kernel>
ffi::Error Launch(Kernel kernel, int smem, cudaStream_t stream, const Params& params, int groups, bool pdl) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    return kdtree::CudaStatus(cudaGetLastError(), "fused_dot", "raising the shared-memory limit");
  }
  if (params.split > 8 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    return kdtree::CudaStatus(cudaGetLastError(), "fused_dot", "allowing clusters of 16");
  }
  cudaLaunchAttribute attrs[2];
  int count = 0;
  if (pdl) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (params.split > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = static_cast<unsigned>(params.split);
    attrs[count].val.clusterDim.y = 1;
    attrs[count++].val.clusterDim.z = 1;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(params.split), static_cast<unsigned>(groups));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  return kdtree::CudaStatus(cudaLaunchKernelEx(&config, kernel, params), "fused_dot", "kernel launch");
}

int MaxSmem() {  // the device's opt-in shared memory a block
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();
    return 48 * 1024;
  }
  return bytes;
}

// The K split: the largest power of two up to 16 dividing K / 64 whose clusters (one per 64-column tile) can all be
// resident at once (cudaOccupancyMaxActiveClusters, cached per device and shape), so that the grid is one wave; if
// none, the smallest whose block's shared memory fits (more than one wave).
template <typename Kernel>
ffi::Error ChooseSplit(Kernel kernel, int kernel_id, int mm, bool mma, int64_t k, int64_t tiles, int* split) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int>, int> fits;  // (device, kernel, split, K) -> resident clusters
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return kdtree::CudaStatus(cudaGetLastError(), "fused_dot", "device");
  const int max_smem = MaxSmem();
  *split = 0;
  for (int s = kMaxSplit; s >= 1; s /= 2) {
    if ((k / kChunk) % s) continue;
    const int smem = SmemBytes(mm, static_cast<int>(k / s), mma);
    if (smem > max_smem) break;  // fewer splits only need more
    *split = s;                  // the smallest that fits so far
    if (s == 1) break;
    const auto key = std::make_tuple(device, kernel_id, s, static_cast<int>(k));
    int clusters = -1;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = fits.find(key);
      if (it != fits.end()) clusters = it->second;
    }
    if (clusters < 0) {
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
          (s > 8 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
                                cudaSuccess)) {
        return kdtree::CudaStatus(cudaGetLastError(), "fused_dot", "setting the kernel's attributes");
      }
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = static_cast<unsigned>(s);
      attr.val.clusterDim.y = 1;
      attr.val.clusterDim.z = 1;
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(static_cast<unsigned>(s), static_cast<unsigned>(tiles));
      config.blockDim = dim3(kThreads);
      config.dynamicSmemBytes = smem;
      config.attrs = &attr;
      config.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
        cudaGetLastError();  // a size the device cannot run: not a candidate
        clusters = 0;
      }
      std::lock_guard<std::mutex> lock(mu);
      fits[key] = clusters;
    }
    if (tiles <= clusters) return ffi::Error::Success();
  }
  if (*split == 0) {
    return ffi::Error::InvalidArgument("fused_dot: no K split of " + std::to_string(k) + " fits a block's shared "
                                       "memory at " + std::to_string(mm) + " rows");
  }
  return ffi::Error::Success();
}

template <int MM, int U, bool kMma>
ffi::Error Run(cudaStream_t stream, Params& p, int64_t tiles, bool pdl) {
  void (*kernel)(const Params);
  if constexpr (kMma) {
    kernel = FusedDotMmaKernel<MM, U>;
  } else {
    kernel = FusedDotKernel<MM, U>;
  }
  if (p.split == 0) {
    if (ffi::Error err = ChooseSplit(kernel, kMma ? 100 + MM : MM, MM, kMma, p.k, tiles, &p.split); err.failure()) {
      return err;
    }
  }
  const int smem = SmemBytes(MM, p.k / p.split, kMma);
  if (smem > MaxSmem()) {
    return ffi::Error::InvalidArgument("fused_dot: split " + std::to_string(p.split) + " leaves a K slice of " +
                                       std::to_string(p.k / p.split) + " too long for a block's shared memory at " +
                                       std::to_string(MM) + " rows; use a larger split or 0");
  }
  return Launch(kernel, smem, stream, p, static_cast<int>(tiles), pdl);
}

ffi::Error FusedDotCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w0, ffi::AnyBuffer w1,
                        ffi::AnyBuffer nw, ffi::AnyBuffer add0, ffi::AnyBuffer add1, float eps, int64_t gated0,
                        int64_t gated1, int64_t layer, int64_t split, int64_t flags,
                        ffi::Result<ffi::AnyBuffer> y0, ffi::Result<ffi::AnyBuffer> y1,
                        ffi::Result<ffi::AnyBuffer> xn) {
  kdtree::FusedDotShape d;
  if (ffi::Error err =
          kdtree::CheckFusedDot(x, w0, w1, nw, add0, add1, gated0, gated1, layer, *y0, *y1, *xn, &d);
      err.failure()) {
    return err;
  }
  if (d.m > kMaxRows || d.k % kChunk || d.k > kMaxK || d.n0 % kTile || d.n1 % kTile) {
    return ffi::Error::InvalidArgument("fused_dot: the CUDA kernels take M <= 32, K a multiple of 64 up to 8192 and N "
                                       "multiples of 64 (got x " + kdtree::ShapeString(x.dimensions()) + ", w0 " +
                                       kdtree::ShapeString(w0.dimensions()) + ", w1 " +
                                       kdtree::ShapeString(w1.dimensions()) + ")");
  }
  if (split < 0 || split > kMaxSplit || (split & (split - 1)) || (split > 0 && (d.k / kChunk) % split)) {
    return ffi::Error::InvalidArgument("fused_dot: split must be 0 (chosen) or a power of two up to 16 dividing K "
                                       "/ 64, got " + std::to_string(split));
  }
  const int64_t tiles = d.n0 / kTile + d.n1 / kTile;
  if (tiles > 65535) return ffi::Error::InvalidArgument("fused_dot: too many columns for the CUDA grid");
  for (const void* ptr : {x.untyped_data(), w0.untyped_data(), w1.untyped_data(), nw.untyped_data()}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16) {
      return ffi::Error::InvalidArgument("fused_dot: x, the weights and the norm weight must be 16-byte aligned");
    }
  }
  if (d.m == 0 || tiles == 0) return ffi::Error::Success();
  Params p = {};
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.untyped_data());
  p.nw = d.has_norm ? reinterpret_cast<const __nv_bfloat16*>(nw.untyped_data()) + d.offn : nullptr;
  p.add0 = d.adds > 0 ? reinterpret_cast<const __nv_bfloat16*>(add0.untyped_data()) : nullptr;
  p.add1 = d.adds > 1 ? reinterpret_cast<const __nv_bfloat16*>(add1.untyped_data()) : nullptr;
  p.xn = d.want_xn ? reinterpret_cast<__nv_bfloat16*>(xn->untyped_data()) : nullptr;
  const auto* ws0 = reinterpret_cast<const __nv_bfloat16*>(w0.untyped_data()) + d.off0;  // (a stack's layer)
  const auto* ws1 = reinterpret_cast<const __nv_bfloat16*>(w1.untyped_data()) + d.off1;
  p.seg[0] = {ws0, y0->untyped_data(), static_cast<int>(d.n0), static_cast<int>(d.n0 / kTile), gated0 != 0,
              y0->element_type() == ffi::DataType::F32};
  p.seg[1] = {ws1, y1->untyped_data(), static_cast<int>(d.n1), static_cast<int>(d.n1 / kTile), gated1 != 0,
              y1->element_type() == ffi::DataType::F32};
  p.m = static_cast<int>(d.m);
  p.k = static_cast<int>(d.k);
  p.split = static_cast<int>(split);
  p.eps = eps;
  const bool pdl = !(flags & kFlagPlain);
  p.early_w = pdl && (flags & kFlagEarlyW);
  p.l2_256 = (flags & kFlagL2Lines) != 0;
  if (d.m <= kMaxCoreRows && !(flags & kFlagMma)) {
    return d.m == 1   ? Run<1, 8, false>(stream, p, tiles, pdl)
           : d.m == 2 ? Run<2, 8, false>(stream, p, tiles, pdl)
                      : Run<4, 4, false>(stream, p, tiles, pdl);
  }
  return d.m <= 8 ? Run<8, 4, true>(stream, p, tiles, pdl)
         : d.m <= 16 ? Run<16, 4, true>(stream, p, tiles, pdl)
                     : Run<32, 2, true>(stream, p, tiles, pdl);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdFusedDotCuda, FusedDotCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16
                                  .Arg<ffi::AnyBuffer>()  // w0 [K, N0] or [L, K, N0]
                                  .Arg<ffi::AnyBuffer>()  // w1 [K, N1] or [L, K, N1] (N1 = 0: none)
                                  .Arg<ffi::AnyBuffer>()  // nw [K], [L, K] or [0]
                                  .Arg<ffi::AnyBuffer>()  // add0 [M, N0] or [0]
                                  .Arg<ffi::AnyBuffer>()  // add1 [M, N0] or [0]
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("gated0")
                                  .Attr<int64_t>("gated1")
                                  .Attr<int64_t>("layer")     // the slice of stacked weights used
                                  .Attr<int64_t>("split")     // blocks per K (0: chosen)
                                  .Attr<int64_t>("flags")     // bit 0: plain launch; 1: weights are parameters
                                  .Ret<ffi::AnyBuffer>()      // y0 [M, N0 or N0 / 2]
                                  .Ret<ffi::AnyBuffer>()      // y1 [M, N1 or N1 / 2]
                                  .Ret<ffi::AnyBuffer>(),     // xn [M, K] or [0, K]
                              {xla::ffi::Traits::kCmdBufferCompatible});
