// draft_attention, CUDA handler: the DFlash drafter's block attention (grouped-query heads), the function of the
// CPU handler (ffi/draft_attention.cc has the math): every query row of a kv head sees the context (slots below
// lengths[b]) and the whole block; scores, softmax and sums are fp32.
//
// Flash decoding on the CUDA cores (no tensor cores).
//   * The M = T * (H / G) query rows of one kv head of one batch row form tiles of 64 rows; block (split, head and
//     row tile, b) takes its share of the P + T keys (context then block) in tiles of 32 keys, one key a lane:
//     each warp scores its 8 rows against the tile (q broadcast from shared memory, the key from the lane's own
//     shared-memory row), updates the rows' running max and sum (online softmax) and adds p * V, each lane holding
//     4 of the head's dims for every row. Two blocks an SM; a split with no keys (the splits are planned for the
//     cache's length) only marks its rows empty.
//   * Loads: where a row is a multiple of 16 bytes (D a multiple of 8 in bf16, of 4 in f32) every thread issues all
//     its 16-byte loads of the queries, then of a key/value tile, before it stores any (the first version loaded
//     one element at a time, each load waiting for the last: on an H100 it was 1.4x slower than XLA's operations in
//     the drafter), and the next tile's loads are issued before the current tile is computed. Other head dims: one
//     element at a time.
//   * With one split the block writes the normalized rows; with several each block writes its unnormalized partial
//     rows and their (max, sum), and a second kernel combines them: one block a row, 8 groups of splits summed
//     side by side, then the groups in order (deterministic, no atomics).
//     The split count is the extent of the partials output's third axis (the Python wrapper plans it).
// Any head dim up to 128, float32 or bfloat16.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda_common.cuh"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 8;
constexpr int kRows = kWarps * kRowsPerWarp;  // query rows a block
constexpr int kKeys = 32;                      // keys a tile: one a lane
constexpr int kMaxDim = 128;                   // 4 dims a lane
constexpr int kThreads = kWarps * 32;
constexpr int kCombineX = kMaxDim;  // a combine block: a thread a dim ...
constexpr int kCombineY = 8;        // ... in each of 8 groups of splits
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float Load(const float* p) { return *p; }
__device__ __forceinline__ float Load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void Store(float* p, float x) { *p = x; }
__device__ __forceinline__ void Store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// 16 bytes of T: their elements as floats.
__device__ __forceinline__ void Unpack(const float*, const uint4& u, float* f) {
  f[0] = __uint_as_float(u.x);
  f[1] = __uint_as_float(u.y);
  f[2] = __uint_as_float(u.z);
  f[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void Unpack(const __nv_bfloat16*, const uint4& u, float* f) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 Load16(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

struct Params {
  const void* q;    // [B, T, H, D]
  const void* ck;   // [B, S, G, D]
  const void* cv;   // [B, S, G, D]
  const void* kb;   // [B, T, G, D]
  const void* vb;   // [B, T, G, D]
  const int32_t* lens;  // [B]
  void* out;        // [B, T, H, D]
  float* part;      // [B, G * M, splits, D]  unnormalized partial rows (splits > 1)
  float2* stats;    // [B, G * M, splits]     their (row max, row sum)
  int t, h, g, s, d, m, splits;
  float scale;
};

__device__ __forceinline__ float WarpMax(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// The output row of query row m of kv head g, batch row b.
__device__ __forceinline__ int64_t OutRow(const Params& p, int b, int g, int m) {
  const int rep = p.h / p.g;
  return (static_cast<int64_t>(b) * p.t + m / rep) * p.h + g * rep + m % rep;
}

// Block `split`'s keys of batch row b: [k0, k1) of the row's prefix (context slots below the clamped length) then
// its T block keys, in whole tiles; k0 >= k1 when the split has none (the splits are planned for the cache's S).
struct KeyShare {
  int prefix, k0, k1;
};
__device__ __forceinline__ KeyShare ShareOf(const Params& p, int b, int split) {
  const int prefix = min(max(p.lens[b], 0), p.s);
  const int nkeys = prefix + p.t;
  const int chunk = ((nkeys + p.splits - 1) / p.splits + kKeys - 1) / kKeys * kKeys;
  const int k0 = split * chunk;
  return {prefix, k0, min(nkeys, k0 + chunk)};
}

// Key k's dims c.. of kv head g: its element offset in the context ([B, S, G, D], k < prefix) or the block.
__device__ __forceinline__ int64_t KeyOffset(const Params& p, int b, int g, int prefix, int k, int c) {
  const int64_t slot = k < prefix ? static_cast<int64_t>(b) * p.s + k : static_cast<int64_t>(b) * p.t + k - prefix;
  return (slot * p.g + g) * p.d + c;
}

// A split with no keys: its rows' stats say (-inf, 0), which the combine skips.
__device__ __forceinline__ void MarkEmpty(const Params& p, int b, int g, int row0, int split, int threads) {
  for (int i = threadIdx.x; i < kRows; i += threads) {
    const int m = row0 + i;
    const int64_t row = (static_cast<int64_t>(b) * p.g + g) * p.m + m;
    if (m < p.m) p.stats[row * p.splits + split] = make_float2(-INFINITY, 0.0f);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) AttendKernel(Params p) {
  extern __shared__ float smem[];
  const int d = p.d, stride = d | 1;  // the key tile's row stride: odd, so the lanes' rows fall in distinct banks
  float* qs = smem;                   // [kRows][d]
  float* ks = qs + kRows * d;         // [kKeys][d | 1]
  float* vs = ks + kKeys * stride;    // [kKeys][d]
  const int tiles = (p.m + kRows - 1) / kRows;
  const int split = blockIdx.x, g = blockIdx.y / tiles, row0 = (blockIdx.y % tiles) * kRows, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q = static_cast<const T*>(p.q);
  const T* ck = static_cast<const T*>(p.ck);
  const T* cv = static_cast<const T*>(p.cv);
  const T* kb = static_cast<const T*>(p.kb);
  const T* vb = static_cast<const T*>(p.vb);
  const KeyShare share = ShareOf(p, b, split);
  const int prefix = share.prefix, k0 = share.k0, k1 = share.k1;
  if (k0 >= k1) {
    MarkEmpty(p, b, g, row0, split, kThreads);
    return;  // the whole block: k0 and k1 are the block's
  }

  constexpr int kE = 16 / sizeof(T);                   // elements in 16 bytes
  const bool vec = d % kE == 0;                          // rows of whole 16-byte chunks (and so aligned)
  const int dc = d / kE;                                 // with vec: a row's chunks
  if (vec) {  // every load issued before any store
    constexpr int kN = (kRows * kMaxDim / kE + kThreads - 1) / kThreads;
    uint4 r[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int e = threadIdx.x + i * kThreads, row = e / dc, m = row0 + row;
      if (e < kRows * dc && m < p.m) r[i] = Load16(q + OutRow(p, b, g, m) * d + (e % dc) * kE);
    }
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int e = threadIdx.x + i * kThreads, row = e / dc, m = row0 + row;
      if (e >= kRows * dc) continue;
      float f[kE];
      if (m < p.m) {
        Unpack(q, r[i], f);
      } else {
#pragma unroll
        for (int u = 0; u < kE; ++u) f[u] = 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kE; ++u) qs[row * d + (e % dc) * kE + u] = f[u];
    }
  } else {
    for (int e = threadIdx.x; e < kRows * d; e += kThreads) {
      const int i = e / d, c = e % d, m = row0 + i;
      qs[e] = m < p.m ? Load(q + OutRow(p, b, g, m) * d + c) : 0.0f;
    }
  }
  // With vec, a thread's chunks of a key/value tile (chunk e: key e / dc, dims (e % dc) * kE ...), held in
  // registers from their loads (issued a tile ahead) to their stores.
  constexpr int kTileN = (kKeys * kMaxDim / kE + kThreads - 1) / kThreads;
  uint4 kr4[kTileN], vr4[kTileN];
  const auto load_tile = [&](int kt) {
#pragma unroll
    for (int i = 0; i < kTileN; ++i) {
      const int e = threadIdx.x + i * kThreads, k = kt + e / dc;
      if (e < kKeys * dc && k < k1) {
        const int64_t o = KeyOffset(p, b, g, prefix, k, (e % dc) * kE);
        kr4[i] = Load16((k < prefix ? ck : kb) + o);
        vr4[i] = Load16((k < prefix ? cv : vb) + o);
      }
    }
  };
  if (vec) load_tile(k0);
  float o[kRowsPerWarp][4], peak[kRowsPerWarp], total[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    peak[i] = -INFINITY;
    total[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) o[i][c] = 0.0f;
  }
  const float* qw = qs + warp * kRowsPerWarp * d;
  for (int kt = k0; kt < k1; kt += kKeys) {
    __syncthreads();  // the last tile's reads are done (and the queries are in place)
    if (vec) {
#pragma unroll
      for (int i = 0; i < kTileN; ++i) {
        const int e = threadIdx.x + i * kThreads, j = e / dc, c = (e % dc) * kE;
        if (e >= kKeys * dc) continue;
        float kf[kE], vf[kE];
        if (kt + j < k1) {
          Unpack(ck, kr4[i], kf);
          Unpack(cv, vr4[i], vf);
        } else {
#pragma unroll
          for (int u = 0; u < kE; ++u) kf[u] = vf[u] = 0.0f;
        }
#pragma unroll
        for (int u = 0; u < kE; ++u) {
          ks[j * stride + c + u] = kf[u];
          vs[j * d + c + u] = vf[u];
        }
      }
    } else {
      for (int e = threadIdx.x; e < kKeys * d; e += kThreads) {
        const int j = e / d, c = e % d, k = kt + j;
        float kv = 0.0f, vv = 0.0f;
        if (k < k1) {
          const int64_t o = KeyOffset(p, b, g, prefix, k, c);
          kv = Load((k < prefix ? ck : kb) + o);
          vv = Load((k < prefix ? cv : vb) + o);
        }
        ks[j * stride + c] = kv;
        vs[j * d + c] = vv;
      }
    }
    __syncthreads();
    if (vec && kt + kKeys < k1) load_tile(kt + kKeys);  // the next tile's loads in flight during this one's math
    const bool valid = kt + lane < k1;  // lane 0's key always is
    float sc[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) sc[i] = 0.0f;
    const float* kr = ks + lane * stride;
    if (d % 4 == 0) {  // the queries four dims at a time (rows of 16-byte multiples)
      for (int c = 0; c < d; c += 4) {
        const float k0c = kr[c], k1c = kr[c + 1], k2c = kr[c + 2], k3c = kr[c + 3];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const float4 qv = *reinterpret_cast<const float4*>(qw + i * d + c);
          sc[i] = fmaf(qv.w, k3c, fmaf(qv.z, k2c, fmaf(qv.y, k1c, fmaf(qv.x, k0c, sc[i]))));
        }
      }
    } else {
      for (int c = 0; c < d; ++c) {
        const float kc = kr[c];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) sc[i] = fmaf(qw[i * d + c], kc, sc[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const float s = valid ? sc[i] * p.scale : -INFINITY;
      const float top = fmaxf(peak[i], WarpMax(s));  // finite: lane 0's key is valid
      const float alpha = expf(peak[i] - top);       // 0 on the first tile (peak -inf)
      const float pr = valid ? expf(s - top) : 0.0f;
      total[i] = total[i] * alpha + WarpSum(pr);
      peak[i] = top;
#pragma unroll
      for (int c = 0; c < 4; ++c) o[i][c] *= alpha;
      sc[i] = pr;
    }
    const int last = min(kKeys, k1 - kt);
    for (int j = 0; j < last; ++j) {
      float vj[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) vj[c] = lane + 32 * c < d ? vs[j * d + lane + 32 * c] : 0.0f;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float pj = __shfl_sync(kFull, sc[i], j);
#pragma unroll
        for (int c = 0; c < 4; ++c) o[i][c] = fmaf(pj, vj[c], o[i][c]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int m = row0 + warp * kRowsPerWarp + i;
    if (m >= p.m) continue;
    if (p.splits == 1) {
      const float inv = total[i] == 0.0f ? 0.0f : 1.0f / total[i];  // NaN stays NaN
      T* orow = static_cast<T*>(p.out) + OutRow(p, b, g, m) * d;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (lane + 32 * c < d) Store(orow + lane + 32 * c, o[i][c] * inv);
      }
    } else {
      const int64_t row = (static_cast<int64_t>(b) * p.g + g) * p.m + m;
      float* prow = p.part + (row * p.splits + split) * d;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (lane + 32 * c < d) prow[lane + 32 * c] = o[i][c];
      }
      if (lane == 0) p.stats[row * p.splits + split] = make_float2(peak[i], total[i]);
    }
  }
}

// The tensor-core variant (bf16, D a multiple of 16, up to 128): the same blocks, splits and outputs, with 4 warps
// of 16 query rows each; scores and p · V as mma.m16n8k16 (bf16 in, fp32 sums). A warp's queries stay in registers
// as A fragments; a key tile (32 keys) is staged in shared memory as K [key][D + 8] and V transposed [D][32 + 8] (the
// pads put a fragment's 32-bit reads in distinct banks); the unnormalized probabilities exp(s - running max) are
// rounded to bf16 for p · V (the reference rounds the normalized ones: the same relative error a term) and used
// straight from the score fragments' registers; the rows are divided by their fp32 sums at the end.
constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaKPad = 8;   // K's row: D + 8 bf16
constexpr int kMmaVRow = kKeys + 8;  // V^T's row: 40 bf16

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t Word(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

__global__ void __launch_bounds__(kMmaThreads) AttendMmaKernel(Params p) {
  extern __shared__ uint4 smem_mma[];
  const int d = p.d, krow = d + kMmaKPad;
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(smem_mma);  // [kKeys][d + 8]
  __nv_bfloat16* vt = ks + kKeys * krow;                             // [d][kKeys + 8]
  const int tiles = (p.m + kRows - 1) / kRows;
  const int split = blockIdx.x, g = blockIdx.y / tiles, row0 = (blockIdx.y % tiles) * kRows, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
  const auto* q = static_cast<const __nv_bfloat16*>(p.q);
  const auto* ck = static_cast<const __nv_bfloat16*>(p.ck);
  const auto* cv = static_cast<const __nv_bfloat16*>(p.cv);
  const auto* kb = static_cast<const __nv_bfloat16*>(p.kb);
  const auto* vb = static_cast<const __nv_bfloat16*>(p.vb);
  const KeyShare share = ShareOf(p, b, split);
  const int prefix = share.prefix, k0 = share.k0, k1 = share.k1;
  if (k0 >= k1) {
    MarkEmpty(p, b, g, row0, split, kMmaThreads);
    return;
  }
  const int steps = d / 16;  // k-steps of the scores, 16 dims each
  const int m_lo = row0 + warp * 16 + gid, m_hi = m_lo + 8;  // this thread's two rows
  // The queries as A fragments: step s, registers {row lo, dims 16s + 2tig (+1)}, {row hi, same}, {lo, + 8}, {hi, + 8}
  uint32_t qa[8][4];
#pragma unroll
  for (int st = 0; st < 8; ++st) {  // (a bound known at compile time: the fragments stay in registers)
    const int c = 16 * st + 2 * tig;
    const __nv_bfloat16* lo = q + OutRow(p, b, g, min(m_lo, p.m - 1)) * d;
    const __nv_bfloat16* hi = q + OutRow(p, b, g, min(m_hi, p.m - 1)) * d;
    const bool in = st < steps;
    qa[st][0] = in && m_lo < p.m ? Word(lo + c) : 0u;
    qa[st][1] = in && m_hi < p.m ? Word(hi + c) : 0u;
    qa[st][2] = in && m_lo < p.m ? Word(lo + c + 8) : 0u;
    qa[st][3] = in && m_hi < p.m ? Word(hi + c + 8) : 0u;
  }
  const int dc = d / 8;  // 16-byte chunks a row
  constexpr int kTileN = kKeys * kMaxDim / 8 / kMmaThreads;  // a thread's chunks of K (and of V) a tile: 4
  uint4 kr4[kTileN], vr4[kTileN];
  const auto load_tile = [&](int kt) {
#pragma unroll
    for (int i = 0; i < kTileN; ++i) {
      const int e = threadIdx.x + i * kMmaThreads, k = kt + e % kKeys;  // a lane a key: see the stores below
      if (e < kKeys * dc && k < k1) {
        const int c = (e / kKeys) * 8;
        const int64_t o = KeyOffset(p, b, g, prefix, k, c);
        kr4[i] = Load16((k < prefix ? ck : kb) + o);
        vr4[i] = Load16((k < prefix ? cv : vb) + o);
      }
    }
  };
  load_tile(k0);
  float o[16][4], peak[2] = {-INFINITY, -INFINITY}, total[2] = {0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < 16; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) o[n][c] = 0.0f;
  }
  for (int kt = k0; kt < k1; kt += kKeys) {
    __syncthreads();  // the last tile's reads are done
#pragma unroll
    for (int i = 0; i < kTileN; ++i) {
      // chunk e: key e % 32, dims 8 (e / 32) ..: a warp's lanes hold 32 keys of the same dims, so their 16-bit
      // stores into V^T's rows fall in 16 banks, two lanes a word (key-major chunks put them in one or two)
      const int e = threadIdx.x + i * kMmaThreads, j = e % kKeys, c = (e / kKeys) * 8;
      if (e >= kKeys * dc) continue;
      const bool in = kt + j < k1;
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(ks + j * krow + c) = in ? kr4[i] : zero;
      const uint4 v = in ? vr4[i] : zero;
      const __nv_bfloat16* vh = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
      for (int u = 0; u < 8; ++u) vt[(c + u) * kMmaVRow + j] = vh[u];
    }
    __syncthreads();
    if (kt + kKeys < k1) load_tile(kt + kKeys);  // the next tile's loads in flight during this one's math
    // scores: 4 n-tiles of 8 keys; element (row lo|hi, key 8n + 2tig (+1))
    float sc[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) sc[n][c] = 0.0f;
      const __nv_bfloat16* kr = ks + (8 * n + gid) * krow + 2 * tig;
#pragma unroll
      for (int st = 0; st < 8; ++st) {
        if (st < steps) MmaAt(sc[n], qa[st], Word(kr + 16 * st), Word(kr + 16 * st + 8));
      }
    }
    float top[2] = {peak[0], peak[1]};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bool valid = kt + 8 * n + 2 * tig + (c & 1) < k1;
        sc[n][c] = valid ? sc[n][c] * p.scale : -INFINITY;
        top[c / 2] = fmaxf(top[c / 2], sc[n][c]);
      }
    }
    float alpha[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // a row's four lanes share its max (the tile's first key is valid: finite)
      top[r] = fmaxf(top[r], __shfl_xor_sync(kFull, top[r], 1));
      top[r] = fmaxf(top[r], __shfl_xor_sync(kFull, top[r], 2));
      alpha[r] = expf(peak[r] - top[r]);  // 0 on the first tile (peak -inf)
      peak[r] = top[r];
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        sc[n][c] = expf(sc[n][c] - top[c / 2]);  // masked keys: exp(-inf) = 0
        sum[c / 2] += sc[n][c];
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] += __shfl_xor_sync(kFull, sum[r], 1);
      sum[r] += __shfl_xor_sync(kFull, sum[r], 2);
      total[r] = total[r] * alpha[r] + sum[r];
    }
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    // p · V: the scores' fragments of keys 16kk.. are the A fragment of k-step kk
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t pa[4] = {PackBf16(sc[2 * kk][0], sc[2 * kk][1]), PackBf16(sc[2 * kk][2], sc[2 * kk][3]),
                              PackBf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                              PackBf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        if (n < 2 * steps) {
          const __nv_bfloat16* vr = vt + (8 * n + gid) * kMmaVRow + 16 * kk + 2 * tig;
          MmaAt(o[n], pa, Word(vr), Word(vr + 8));
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = r == 0 ? m_lo : m_hi;
    if (m >= p.m) continue;
    if (p.splits == 1) {
      const float inv = total[r] == 0.0f ? 0.0f : 1.0f / total[r];  // NaN stays NaN
      __nv_bfloat16* orow = static_cast<__nv_bfloat16*>(p.out) + OutRow(p, b, g, m) * d;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        if (n < 2 * steps) {
          *reinterpret_cast<uint32_t*>(orow + 8 * n + 2 * tig) = PackBf16(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        }
      }
    } else {
      const int64_t row = (static_cast<int64_t>(b) * p.g + g) * p.m + m;
      float* prow = p.part + (row * p.splits + split) * d;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        if (n < 2 * steps) {
          *reinterpret_cast<float2*>(prow + 8 * n + 2 * tig) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
        }
      }
      if (tig == 0) p.stats[row * p.splits + split] = make_float2(peak[r], total[r]);
    }
  }
}

// One block a query row: the splits' partial rows weighted by exp(their max - the largest). Group y of the block
// sums splits y * per .. (y + 1) * per - 1 in order (a thread a dim, several splits' loads in flight), then the
// groups are added in order: the same sums on every run.
template <typename T>
__global__ void __launch_bounds__(kCombineX * kCombineY) CombineKernel(Params p) {
  __shared__ float part_rows[kCombineY][kCombineX];
  __shared__ float part_totals[kCombineY];
  __shared__ float warp_top[kCombineX * kCombineY / 32];
  const int64_t row = blockIdx.x;  // (b * G + g) * M + m
  const int m = static_cast<int>(row % p.m), g = static_cast<int>((row / p.m) % p.g);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.m) * p.g));
  const int x = threadIdx.x, y = threadIdx.y, tid = y * kCombineX + x;
  const float2* st = p.stats + row * p.splits;
  // a split is empty when it says (-inf, 0); any other, NaN included, counts (so a NaN score reaches the output)
  const auto empty = [](float2 s) { return s.x == -INFINITY && s.y == 0.0f; };
  float top = -INFINITY;  // the largest max: the same in any order
  for (int j = tid; j < p.splits; j += kCombineX * kCombineY) top = fmaxf(top, st[j].x);
  top = WarpMax(top);
  if (tid % 32 == 0) warp_top[tid / 32] = top;
  __syncthreads();
  top = -INFINITY;
#pragma unroll
  for (int w = 0; w < kCombineX * kCombineY / 32; ++w) top = fmaxf(top, warp_top[w]);
  const int per = (p.splits + kCombineY - 1) / kCombineY;
  const int j0 = min(p.splits, y * per), j1 = min(p.splits, j0 + per);
  const bool dim = x < p.d;
  const float* col = p.part + row * p.splits * p.d + x;
  float acc = 0.0f, total = 0.0f;
#pragma unroll 4
  for (int j = j0; j < j1; ++j) {
    const float2 s = st[j];
    if (empty(s)) continue;
    const float w = expf(s.x - top);
    total = fmaf(s.y, w, total);
    if (dim) acc = fmaf(col[static_cast<int64_t>(j) * p.d], w, acc);
  }
  part_rows[y][x] = acc;
  if (x == 0) part_totals[y] = total;
  __syncthreads();
  if (y != 0 || !dim) return;
  acc = 0.0f;
  total = 0.0f;
#pragma unroll
  for (int i = 0; i < kCombineY; ++i) {
    acc += part_rows[i][x];
    total += part_totals[i];
  }
  const float inv = total == 0.0f ? 0.0f : 1.0f / total;  // NaN stays NaN
  Store(static_cast<T*>(p.out) + OutRow(p, b, g, m) * p.d + x, acc * inv);
}

template <typename T>
cudaError_t Launch(cudaStream_t stream, const Params& p, int b, bool mma) {
  const int tiles = (p.m + kRows - 1) / kRows;
  const dim3 grid(p.splits, p.g * tiles, b);
  cudaError_t e;
  if (mma) {  // the caller checked: bf16, D a multiple of 16
    const size_t smem = sizeof(__nv_bfloat16) * (kKeys * (p.d + kMmaKPad) + p.d * kMmaVRow);
    AttendMmaKernel<<<grid, kMmaThreads, smem, stream>>>(p);
  } else {
    const size_t smem = sizeof(float) * (kRows * p.d + kKeys * (p.d | 1) + kKeys * p.d);
    e = cudaFuncSetAttribute(AttendKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    AttendKernel<T><<<grid, kThreads, smem, stream>>>(p);
  }
  if (p.splits > 1) {
    const int64_t rows = static_cast<int64_t>(b) * p.g * p.m;
    CombineKernel<T><<<static_cast<unsigned>(rows), dim3(kCombineX, kCombineY), 0, stream>>>(p);
  }
  return cudaGetLastError();
}

ffi::Error DraftAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer ck, ffi::AnyBuffer cv,
                              ffi::AnyBuffer kb, ffi::AnyBuffer vb, ffi::Buffer<ffi::S32> lengths, float scale,
                              int32_t mma, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> part,
                              ffi::Result<ffi::Buffer<ffi::F32>> stats) {
  kdtree::DraftShape n;
  if (ffi::Error e = kdtree::CheckDraftShape(q, ck, cv, kb, vb, lengths.element_count(), *out, &n); e.failure()) {
    return e;
  }
  const int64_t b = n.b, t = n.t, h = n.h, d = n.d, s = n.s, g = n.g;
  const auto pd = part->dimensions();
  if (pd.size() != 4 || stats->dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("draft_attention: part and stats must be 4-D");
  }
  const int64_t m = t * (h / g), splits = pd[2];
  if (pd[0] != b || pd[1] != g * m || pd[3] != d || splits < 1 || stats->dimensions()[0] != b ||
      stats->dimensions()[1] != g * m || stats->dimensions()[2] != splits || stats->dimensions()[3] != 2) {
    return ffi::Error::InvalidArgument("draft_attention: part must be [B, G * M, splits, D] and stats "
                                       "[B, G * M, splits, 2], M = T * H / G");
  }
  const int64_t tiles = (m + kRows - 1) / kRows;
  if (b == 0 || t == 0 || h == 0 || d == 0) return ffi::Error::Success();  // nothing to write
  if (d > kMaxDim || b > 65535 || g * tiles > 65535 || splits > 65535 || s + t > 2147483647 ||
      b * g * m > 2147483647) {
    return ffi::Error::InvalidArgument("draft_attention: the CUDA kernel takes a head dim of 1..128, B and "
                                       "G x ceil(M / 64) <= 65535");
  }
  const ffi::DataType dt = q.element_type();
  Params p{q.untyped_data(), ck.untyped_data(), cv.untyped_data(), kb.untyped_data(), vb.untyped_data(),
           lengths.typed_data(), out->untyped_data(), part->typed_data(),
           reinterpret_cast<float2*>(stats->typed_data()), static_cast<int>(t), static_cast<int>(h),
           static_cast<int>(g), static_cast<int>(s), static_cast<int>(d), static_cast<int>(m),
           static_cast<int>(splits), scale};
  cudaError_t e;
  if (dt == ffi::DataType::F32) {
    e = Launch<float>(stream, p, static_cast<int>(b), false);
  } else if (dt == ffi::DataType::BF16) {
    e = Launch<__nv_bfloat16>(stream, p, static_cast<int>(b), mma != 0 && d % 16 == 0);
  } else {
    return ffi::Error::InvalidArgument("draft_attention: dtype must be float32 or bfloat16");
  }
  return kdtree::CudaStatus(e, "draft_attention (CUDA)", "launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdDraftAttentionCuda, DraftAttentionCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // q [B, T, H, D]
                                  .Arg<ffi::AnyBuffer>()              // ck [B, S, G, D]
                                  .Arg<ffi::AnyBuffer>()              // cv [B, S, G, D]
                                  .Arg<ffi::AnyBuffer>()              // kb [B, T, G, D]
                                  .Arg<ffi::AnyBuffer>()              // vb [B, T, G, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // lengths [B]
                                  .Attr<float>("scale")               // softmax scale
                                  .Attr<int32_t>("mma")               // 1: the tensor-core kernel where it applies
                                  .Ret<ffi::AnyBuffer>()              // out [B, T, H, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()       // part [B, G * M, splits, D]
                                  .Ret<ffi::Buffer<ffi::F32>>(),      // stats [B, G * M, splits, 2]
                              {xla::ffi::Traits::kCmdBufferCompatible});
