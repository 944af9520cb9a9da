// marlin_moe, CUDA handler (sm_90a): the W4A16 fused MoE of kdtree_jax/kernels/marlin_moe.py.
//
// The function is the CPU handler's (ffi/marlin_moe.cc has the math). Weights stay in the checkpoint layout
// (compressed-tensors pack-quantized: int32 [E, out, in/8], nibble q + 8 least significant first; bf16 scales
// [E, out, in/group]); nothing is repacked. Four launches on the stream, nothing allocated, no host sync:
//
//   1. align   one block: ids [M, k] -> the M k slots sorted by expert (stable), each expert's run padded to a
//              multiple of BM with the sentinel M k, and the expert of every BM-slot block (-1: unused block).
//              Static sizes: max_blocks >= floor((M k + min(E, M k) (BM - 1)) / BM) (vLLM's moe_align_block_size).
//   2. gemm1   h[slot, f] = silu(x[m] . gate_e[f]) * (x[m] . up_e[f]), slot = m k + j routed to expert e.
//   3. gemm2   ys[slot, d] = h[slot] . down_e[d].
//   4. combine out[m, d] = sum_j weights[m, j] * ys[m k + j, d], j ascending, slots of dropped ids skipped.
// h [M k, F] and ys [M k, D] are extra outputs in the activations' dtype (the reference rounds both too); every
// element that is read was written earlier in the same call, so no scratch needs clearing. The reductions have a
// fixed order, so the result is bitwise reproducible.
//
// Fast path (bf16, D and F multiples of 128, groups multiples of 32, an even number of groups per row): gemm1 and
// gemm2 are one kernel (template: gated or not, NT token tiles of 8). A block of 4 warps owns one token block of
// BM = 8 NT slots (one expert) and 16 output rows of gate and up (gemm1) or 32 rows of down (gemm2); its 4 warps
// split K in 128-wide chunks (warp w takes chunks w, w + 4, ...) and sum their fp32 partials in shared memory in
// warp order. The weights are the A operand of mma.m16n8k16 (16 output rows), the tokens the B operand (8
// columns), so one token per expert wastes 7/8 of the small side and none of the weight stream.
//
// K permutation. A dot product does not care in which order k is summed, as long as A and B agree. In one chunk,
// lane (g, t) of a warp (g = lane / 4, t = lane % 4) owns the 32 inputs 32 t .. 32 t + 31: one 16-byte load of 4
// packed words per weight row (rows g and g + 8 of each 16-row tile; one quantization group) and 64 contiguous
// bytes of each of its token rows. mma step (w, h) (word w = 0..3, half h = 0..1) feeds it the pairs of nibbles
// (s, s + 4) with s = 2 h (logical k 2t, 2t+1) and s = 2 h + 1 (logical k 2t+8, 2t+9) of word w; the token
// values at the same positions are paired with one byte permute. Dequantization of a pair: (word >> 4 s) &
// 0x000F000F | 0x43004300 is the bf16 pair (128 + n_s, 128 + n_{s+4}); minus 136 gives q exactly, times the
// scale rounds once, the same bf16 value as the reference's fp32 q * s cast to bf16.
//
// Streaming. Each thread copies exactly the bytes it will read (its 4 weight vectors, 4 scale words, 4 NT token
// vectors per chunk) with cp.async into its own slots of a shared-memory ring of kStages chunks, so the ring needs
// no block barrier: cp.async.wait_group orders a thread's own copies. Weights bypass L1 (.cg); scales and token
// rows go through it (.ca), where the other blocks of the same SM find them.
//
// Generic path (float32, or shapes off the fast path): one warp per (slot, output row), CUDA cores, fp32.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kWarps = 4;                 // warps per gemm block (the K split)
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 128;               // inputs per warp step
constexpr int kMaxAlignSmem = 200 * 1024;

// ------------------------------------------------------------------------------------------------------------------
// Small helpers
// ------------------------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t SmemAddress(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16 bytes global -> shared, cached in L2 only (streamed weights).
__device__ __forceinline__ void CopyAsync16Cg(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// 16 bytes global -> shared through L1; zero-filled (src not read) when !valid.
__device__ __forceinline__ void CopyAsync16Ca(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// 4 bytes global -> shared through L1.
__device__ __forceinline__ void CopyAsync4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void CopyCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void CopyWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint4 LoadShared16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

__device__ __forceinline__ uint32_t LoadShared4(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t Bf2Bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 BitsBf2(uint32_t u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }

// Nibbles s and s + 4 of a packed word as the bf16 pair (q_s, q_{s+4}) * scale (q = nibble - 8), rounded once.
__device__ __forceinline__ uint32_t Dequant(uint32_t word, int s, __nv_bfloat162 scale) {
  const uint32_t biased = ((word >> (4 * s)) & 0x000F000Fu) | 0x43004300u;  // (128 + n_s, 128 + n_{s+4})
  const __nv_bfloat162 q = __hsub2(BitsBf2(biased), BitsBf2(0x43084308u));   // - 136: exact
  return Bf2Bits(__hmul2(q, scale));
}

// D += A B for one m16n8k16 tile, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void Mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float Silu(float v) { return v / (1.0f + __expf(-v)); }

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void Store(float v, float* p) { *p = v; }
__device__ __forceinline__ void Store(float v, __nv_bfloat16* p) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ float Round(float v, const float*) { return v; }
__device__ __forceinline__ float Round(float v, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// ------------------------------------------------------------------------------------------------------------------
// 1. align: slots sorted by expert, padded per expert to BM, with the expert of each block
// ------------------------------------------------------------------------------------------------------------------

// One block of 32 W threads. Warp w owns slots [w P, (w + 1) P) (P = ceil(S / W)); within a warp, 32 slots at a
// time, __match_any_sync groups lanes of one expert, so a slot's place is (expert start) + (slots of that expert
// in earlier warps) + (in earlier rounds of this warp) + (in lower lanes): a stable sort without atomics.
// Shared memory (ints): hist [W, E] (counts, then running starts), count [E], start [E], part [32 W], total.
__global__ void AlignKernel(const int32_t* __restrict__ ids, int slots, int experts, int bm, int max_blocks,
                            int32_t* __restrict__ sorted, int32_t* __restrict__ block_expert) {
  extern __shared__ int align_smem[];
  const int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  int* hist = align_smem;
  int* count = hist + nw * experts;
  int* start = count + experts;
  int* part = start + experts;
  int* total = part + blockDim.x;
  for (int i = tid; i < nw * experts; i += blockDim.x) hist[i] = 0;
  __syncthreads();

  const int per = (slots + nw - 1) / nw;
  const int lo = min(slots, warp * per), hi = min(slots, lo + per);
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    int e = i < hi ? ids[i] : -1;
    if (e < 0 || e >= experts) e = -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == 31 - __clz(peers)) hist[warp * experts + e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();

  for (int e = tid; e < experts; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < nw; ++w) {
      const int c = hist[w * experts + e];
      hist[w * experts + e] = run;
      run += c;
    }
    count[e] = run;
  }
  __syncthreads();

  // Exclusive scan of the padded counts: thread tid takes experts [e0, e1).
  const int span = (experts + blockDim.x - 1) / blockDim.x;
  const int e0 = min(experts, tid * span), e1 = min(experts, e0 + span);
  int sum = 0;
  for (int e = e0; e < e1; ++e) sum += (count[e] + bm - 1) / bm * bm;
  part[tid] = sum;
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int j = 0; j < static_cast<int>(blockDim.x); ++j) {
      const int c = part[j];
      part[j] = run;
      run += c;
    }
    *total = run;
  }
  __syncthreads();
  const int cap = max_blocks * bm;
  int run = part[tid];
  for (int e = e0; e < e1; ++e) {
    const int padded = (count[e] + bm - 1) / bm * bm;
    start[e] = run;
    for (int b = run / bm; b < (run + padded) / bm && b < max_blocks; ++b) block_expert[b] = e;
    for (int p = run + count[e]; p < run + padded && p < cap; ++p) sorted[p] = slots;
    run += padded;
  }
  __syncthreads();
  for (int b = *total / bm + tid; b < max_blocks; b += blockDim.x) block_expert[b] = -1;

  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    int e = i < hi ? ids[i] : -1;
    if (e < 0 || e >= experts) e = -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0) {
      const int pos = start[e] + hist[warp * experts + e] + __popc(peers & ((1u << lane) - 1u));
      if (pos < cap) sorted[pos] = i;
    }
    __syncwarp();
    if (e >= 0 && lane == 31 - __clz(peers)) hist[warp * experts + e] += __popc(peers);
    __syncwarp();
  }
}

int AlignWarps(int64_t experts) {
  for (int w = 16; w >= 1; --w) {
    if (((w + 2) * experts + 32 * w + 1) * 4 <= kMaxAlignSmem) return w;
  }
  return 0;
}

int64_t AlignSmem(int64_t experts, int warps) { return ((warps + 2) * experts + 32 * warps + 1) * 4; }

// ------------------------------------------------------------------------------------------------------------------
// 2./3. the fast gemm
// ------------------------------------------------------------------------------------------------------------------

struct GemmParams {
  const uint32_t* w0;          // packed [E, rows, K/8]: gate (gated) or down
  const uint32_t* w1;          // packed [E, rows, K/8]: up (gated only)
  const __nv_bfloat16* s0;     // scales [E, rows, K/group] of w0
  const __nv_bfloat16* s1;     // scales of w1
  const __nv_bfloat16* src;    // B operand rows [*, K]: x [M, K] (gated, row = slot / k) or h [M k, K] (row = slot)
  __nv_bfloat16* dst;          // [M k, rows]: h (gated) or ys
  const int32_t* sorted;       // [max_blocks * BM] slots (M k = padding)
  const int32_t* block_expert; // [max_blocks] (-1: unused)
  int rows;                    // output rows per expert (F or D)
  int k;                       // inputs (D or F), a multiple of 128
  int groups;                  // scales per row (K / group), even
  int group;                   // group size, a multiple of 32
  int src_div;                 // slot -> B row divisor (top-k for gemm1, 1 for gemm2)
  int slots;                   // M k
};

template <int NT>
struct Ring {
  static constexpr int kA = 4;                                   // uint4 per thread: (tile, row half)
  static constexpr int kS = 4;                                   // scale words per thread
  static constexpr int kX = 4 * NT;                              // uint4 per thread: (token tile, word)
  static constexpr int kOffS = 16 * kA * kThreads;
  static constexpr int kOffX = kOffS + 4 * kS * kThreads;
  static constexpr int kStageBytes = kOffX + 16 * kX * kThreads;
  static constexpr int kStages = NT == 1 ? 3 : (NT == 2 ? 4 : 2);  // 4, 2, 2 blocks per SM (shared memory)
  static constexpr int kBytes = kStages * kStageBytes;
};

template <int NT, bool kGated>
__global__ void __launch_bounds__(kThreads) GemmKernel(const GemmParams p) {
  using R = Ring<NT>;
  constexpr int kBm = 8 * NT;
  extern __shared__ __align__(16) unsigned char gemm_smem[];
  __shared__ int s_src[kBm];  // B row of each token column (-1: padding)
  __shared__ int s_dst[kBm];  // output row (slot) of each token column (-1: padding)

  const int block = blockIdx.x;
  const int e = p.block_expert[block];
  if (e < 0) return;  // uniform over the block
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  if (tid < kBm) {
    const int slot = p.sorted[static_cast<int64_t>(block) * kBm + tid];
    const bool ok = slot >= 0 && slot < p.slots;
    s_dst[tid] = ok ? slot : -1;
    s_src[tid] = ok ? slot / p.src_div : -1;
  }
  __syncthreads();

  const int row0 = blockIdx.y * (kGated ? 16 : 32);
  const int64_t words = p.k / 8;
  const uint32_t* a_ptr[2][2];
  const __nv_bfloat16* s_ptr[2][2];
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int64_t row = static_cast<int64_t>(e) * p.rows + row0 + (kGated ? 0 : 16 * tile) + g + 8 * rh;
      a_ptr[tile][rh] = ((kGated && tile) ? p.w1 : p.w0) + row * words + 4 * t;
      s_ptr[tile][rh] = ((kGated && tile) ? p.s1 : p.s0) + row * p.groups;
    }
  }
  const __nv_bfloat16* x_ptr[NT];
  bool x_ok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int src = s_src[8 * j + g];
    x_ok[j] = src >= 0;
    x_ptr[j] = p.src + static_cast<int64_t>(x_ok[j] ? src : 0) * p.k + 32 * t;
  }

  const uint32_t ring = SmemAddress(gemm_smem);
  auto issue = [&](int stage, int chunk) {
    const uint32_t base = ring + stage * R::kStageBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tile = i >> 1, rh = i & 1;
      CopyAsync16Cg(base + (i * kThreads + tid) * 16, a_ptr[tile][rh] + chunk * 16);
      const int gi = (chunk * kChunk + 32 * t) / p.group;
      CopyAsync4(base + R::kOffS + (i * kThreads + tid) * 4, s_ptr[tile][rh] + (gi & ~1));
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        CopyAsync16Ca(base + R::kOffX + ((j * 4 + w) * kThreads + tid) * 16, x_ptr[j] + chunk * kChunk + 8 * w,
                      x_ok[j]);
      }
    }
  };

  float acc[2][NT][4];
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[tile][j][c] = 0.0f;
    }
  }

  const int chunks = p.k / kChunk;
  const int mine = (chunks - warp + kWarps - 1) / kWarps;  // chunks warp, warp + 4, ...
#pragma unroll
  for (int s = 0; s < R::kStages - 1; ++s) {
    if (s < mine) issue(s, warp + kWarps * s);
    CopyCommit();
  }
  for (int i = 0; i < mine; ++i) {
    const int ahead = i + R::kStages - 1;
    if (ahead < mine) issue(ahead % R::kStages, warp + kWarps * ahead);
    CopyCommit();
    CopyWait<R::kStages - 1>();  // this thread's copies of chunk i have landed

    const int chunk = warp + kWarps * i;
    const uint32_t base = ring + (i % R::kStages) * R::kStageBytes;
    uint4 a[2][2];
    __nv_bfloat162 scale[2][2];
    const int parity = ((chunk * kChunk + 32 * t) / p.group) & 1;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int tile = q >> 1, rh = q & 1;
      a[tile][rh] = LoadShared16(base + (q * kThreads + tid) * 16);
      const uint32_t sw = LoadShared4(base + R::kOffS + (q * kThreads + tid) * 4);
      const uint32_t bits = parity ? (sw >> 16) : (sw & 0xffffu);
      scale[tile][rh] = BitsBf2(bits | (bits << 16));
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t deq[2][2][4];  // [tile][row half][nibble pair s]
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const uint32_t word = Word(a[tile][rh], w);
#pragma unroll
          for (int s = 0; s < 4; ++s) deq[tile][rh][s] = Dequant(word, s, scale[tile][rh]);
        }
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4 xv = LoadShared16(base + R::kOffX + ((j * 4 + w) * kThreads + tid) * 16);
        const uint32_t pair[4] = {__byte_perm(xv.x, xv.z, 0x5410), __byte_perm(xv.x, xv.z, 0x7632),
                                  __byte_perm(xv.y, xv.w, 0x5410), __byte_perm(xv.y, xv.w, 0x7632)};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int tile = 0; tile < 2; ++tile) {
            Mma(acc[tile][j], deq[tile][0][2 * h], deq[tile][1][2 * h], deq[tile][0][2 * h + 1],
                deq[tile][1][2 * h + 1], pair[2 * h], pair[2 * h + 1]);
          }
        }
      }
    }
  }
  CopyWait<0>();
  __syncthreads();  // every warp is done with the ring: reuse it for the partial sums

  constexpr int kVals = 2 * NT * 4;
  float* red = reinterpret_cast<float*>(gemm_smem);  // [warp - 1][kVals][32]
  if (warp > 0) {
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) red[((warp - 1) * kVals + (tile * NT + j) * 4 + c) * 32 + lane] = acc[tile][j][c];
      }
    }
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[tile][j][c] += red[((w - 1) * kVals + (tile * NT + j) * 4 + c) * 32 + lane];
      }
    }
  }
  // Accumulator c of token tile j: row g + 8 (c >> 1) of the tile, token column 8 j + 2 t + (c & 1).
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int slot = s_dst[8 * j + 2 * t + (c & 1)];
      if (slot < 0) continue;
      __nv_bfloat16* out = p.dst + static_cast<int64_t>(slot) * p.rows + row0 + g + 8 * (c >> 1);
      if (kGated) {
        out[0] = __float2bfloat16_rn(Silu(acc[0][j][c]) * acc[1][j][c]);
      } else {
        out[0] = __float2bfloat16_rn(acc[0][j][c]);
        out[16] = __float2bfloat16_rn(acc[1][j][c]);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Generic path and the combine
// ------------------------------------------------------------------------------------------------------------------

struct GenericParams {
  const uint32_t* w0;        // packed [E, rows, K/8]
  const uint32_t* w1;        // up (gated) or null
  const __nv_bfloat16* s0;   // scales [E, rows, K/group]
  const __nv_bfloat16* s1;
  const int32_t* ids;        // [M k]
  int experts, rows, k, groups, group, src_div, slots;
};

// Warp per (slot, row): the dot products of the slot's B row with row `row` of its expert (and of up, gated).
template <typename T, bool kGated>
__global__ void GenericGemmKernel(const GenericParams p, const T* __restrict__ src, T* __restrict__ dst) {
  const int lane = threadIdx.x & 31;
  const int64_t tasks = static_cast<int64_t>(p.slots) * p.rows;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; task < tasks;
       task += stride) {
    const int slot = static_cast<int>(task / p.rows), row = static_cast<int>(task % p.rows);
    const int e = p.ids[slot];
    if (e < 0 || e >= p.experts) continue;  // uniform over the warp
    const T* b = src + static_cast<int64_t>(slot / p.src_div) * p.k;
    const int64_t r = static_cast<int64_t>(e) * p.rows + row;
    const uint32_t* q0 = p.w0 + r * (p.k / 8);
    const uint32_t* q1 = kGated ? p.w1 + r * (p.k / 8) : nullptr;
    const __nv_bfloat16* sc0 = p.s0 + r * p.groups;
    const __nv_bfloat16* sc1 = kGated ? p.s1 + r * p.groups : nullptr;
    float d0 = 0.0f, d1 = 0.0f;
    for (int wi = lane; wi < p.k / 8; wi += 32) {
      const uint32_t u0 = q0[wi];
      const uint32_t u1 = kGated ? q1[wi] : 0u;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int kk = 8 * wi + n;
        const float v = ToFloat(b[kk]);
        const float w0 = Round(static_cast<float>(static_cast<int>((u0 >> (4 * n)) & 15u) - 8) *
                                   __bfloat162float(sc0[kk / p.group]), dst);
        d0 += w0 * v;
        if (kGated) {
          const float w1 = Round(static_cast<float>(static_cast<int>((u1 >> (4 * n)) & 15u) - 8) *
                                     __bfloat162float(sc1[kk / p.group]), dst);
          d1 += w1 * v;
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      d0 += __shfl_xor_sync(0xffffffffu, d0, o);
      if (kGated) d1 += __shfl_xor_sync(0xffffffffu, d1, o);
    }
    if (lane == 0) Store(kGated ? Silu(d0) * d1 : d0, dst + static_cast<int64_t>(slot) * p.rows + row);
  }
}

// out[m, d] = sum_j weights[m, j] ys[m k + j, d] over the slots with a local expert, j ascending, in fp32.
template <typename T>
__global__ void CombineKernel(const T* __restrict__ ys, const int32_t* __restrict__ ids,
                              const float* __restrict__ weights, int64_t m, int topk, int experts, int d,
                              T* __restrict__ out) {
  const int64_t n = m * d;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / d, col = i % d;
    float sum = 0.0f;
    for (int j = 0; j < topk; ++j) {
      const int64_t slot = row * topk + j;
      const int e = ids[slot];
      if (e >= 0 && e < experts) sum += weights[slot] * ToFloat(ys[slot * d + col]);
    }
    Store(sum, out + i);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Handler
// ------------------------------------------------------------------------------------------------------------------

ffi::Error LastError(const char* what) { return kdtree::CudaStatus(cudaGetLastError(), "marlin_moe", what); }

unsigned GridFor(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

template <int NT, bool kGated>
ffi::Error LaunchGemm(cudaStream_t stream, const GemmParams& p, int max_blocks, const char* what) {
  constexpr int kBytes = Ring<NT>::kBytes;
  auto kernel = GemmKernel<NT, kGated>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes) != cudaSuccess) {
    return LastError("raising the shared-memory limit");
  }
  const dim3 grid(static_cast<unsigned>(max_blocks), static_cast<unsigned>(p.rows / (kGated ? 16 : 32)));
  kernel<<<grid, kThreads, kBytes, stream>>>(p);
  return LastError(what);
}

template <int NT>
ffi::Error LaunchGemms(cudaStream_t stream, GemmParams g1, GemmParams g2, int max_blocks) {
  if (ffi::Error e = LaunchGemm<NT, true>(stream, g1, max_blocks, "gate/up kernel launch"); e.failure()) return e;
  return LaunchGemm<NT, false>(stream, g2, max_blocks, "down kernel launch");
}

template <typename T>
ffi::Error LaunchGeneric(cudaStream_t stream, GenericParams p1, GenericParams p2, const T* x, T* h, T* ys,
                         const float* weights, int64_t m, int topk, int64_t d, T* out) {
  const int64_t slots = m * topk;
  GenericGemmKernel<T, true><<<GridFor(slots * p1.rows * 32, 256), 256, 0, stream>>>(p1, x, h);
  if (ffi::Error e = LastError("generic gate/up launch"); e.failure()) return e;
  GenericGemmKernel<T, false><<<GridFor(slots * p2.rows * 32, 256), 256, 0, stream>>>(p2, h, ys);
  if (ffi::Error e = LastError("generic down launch"); e.failure()) return e;
  CombineKernel<T><<<GridFor(m * d, 256), 256, 0, stream>>>(ys, p1.ids, weights, m, topk, p1.experts,
                                                             static_cast<int>(d), out);
  return LastError("combine launch");
}

ffi::Error MarlinMoeCudaImpl(cudaStream_t stream,
                             ffi::AnyBuffer x,                         // [M, D]
                             ffi::Buffer<ffi::S32> ids,                // [M, k]
                             ffi::Buffer<ffi::F32> weights,            // [M, k]
                             ffi::Buffer<ffi::S32> gate_q,             // [E, F, D/8]
                             ffi::Buffer<ffi::BF16> gate_s,            // [E, F, D/G]
                             ffi::Buffer<ffi::S32> up_q,               // [E, F, D/8]
                             ffi::Buffer<ffi::BF16> up_s,              // [E, F, D/G]
                             ffi::Buffer<ffi::S32> down_q,             // [E, D, F/8]
                             ffi::Buffer<ffi::BF16> down_s,            // [E, D, F/G']
                             ffi::Result<ffi::AnyBuffer> out,          // [M, D]
                             ffi::Result<ffi::Buffer<ffi::S32>> sorted,        // [max_blocks * BM]
                             ffi::Result<ffi::Buffer<ffi::S32>> block_expert,  // [max_blocks]
                             ffi::Result<ffi::AnyBuffer> h,            // [M k, F]
                             ffi::Result<ffi::AnyBuffer> ys) {         // [M k, D]
  kdtree::MoeShape shape;
  if (ffi::Error e = kdtree::CheckMoeShape(x.dimensions(), ids.dimensions(), weights.dimensions(),
                                           gate_q.dimensions(), gate_s.dimensions(), up_q.dimensions(),
                                           up_s.dimensions(), down_q.dimensions(), down_s.dimensions(), &shape);
      e.failure()) {
    return e;
  }
  const int64_t M = shape.m, D = shape.d, topk = shape.k, E = shape.e, F = shape.f;
  const int64_t gate_scales = shape.gate_scales, down_scales = shape.down_scales;
  const int64_t gg = gate_scales > 0 ? D / gate_scales : 0, dg = down_scales > 0 ? F / down_scales : 0;
  const ffi::DataType t = x.element_type();
  if ((t != ffi::DataType::F32 && t != ffi::DataType::BF16) || out->element_type() != t ||
      h->element_type() != t || ys->element_type() != t) {
    return ffi::Error::InvalidArgument("marlin_moe: x, out and the h / ys scratch must share one dtype, float32 "
                                       "or bfloat16");
  }
  const int64_t S = M * topk;
  if (h->element_count() != static_cast<size_t>(S * F) || ys->element_count() != static_cast<size_t>(S * D) ||
      out->element_count() != static_cast<size_t>(M * D)) {
    return ffi::Error::InvalidArgument("marlin_moe: scratch h must be [M k, F] and ys [M k, D]");
  }
  if (M == 0 || D == 0) return ffi::Error::Success();
  if (S == 0 || E == 0 || F == 0) {
    if (cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream) != cudaSuccess) {
      return LastError("clearing the output");
    }
    return ffi::Error::Success();
  }
  if (S > INT32_MAX / 2 || E > INT32_MAX / 2) {
    return ffi::Error::InvalidArgument("marlin_moe: sizes beyond the kernel's 32-bit indexing");
  }

  const int64_t max_blocks = static_cast<int64_t>(block_expert->element_count());
  const int64_t bm = max_blocks > 0 ? static_cast<int64_t>(sorted->element_count()) / max_blocks : 0;
  const int align_warps = AlignWarps(E);
  const bool fast = t == ffi::DataType::BF16 && D % kChunk == 0 && F % kChunk == 0 && gg % 32 == 0 &&
                    dg % 32 == 0 && gate_scales % 2 == 0 && down_scales % 2 == 0 && align_warps > 0 &&
                    (bm == 8 || bm == 16 || bm == 32) && max_blocks * bm == static_cast<int64_t>(
                        sorted->element_count()) && max_blocks <= INT32_MAX / 64;
  const auto* xq = reinterpret_cast<const uint32_t*>(gate_q.typed_data());
  const auto* uqp = reinterpret_cast<const uint32_t*>(up_q.typed_data());
  const auto* dqp = reinterpret_cast<const uint32_t*>(down_q.typed_data());
  const auto* gsp = reinterpret_cast<const __nv_bfloat16*>(gate_s.typed_data());
  const auto* usp = reinterpret_cast<const __nv_bfloat16*>(up_s.typed_data());
  const auto* dsp = reinterpret_cast<const __nv_bfloat16*>(down_s.typed_data());

  if (fast) {
    const int64_t need = (S + (E < S ? E : S) * (bm - 1)) / bm;
    if (max_blocks < need) {
      return ffi::Error::InvalidArgument("marlin_moe: " + std::to_string(max_blocks) + " blocks of " +
                                         std::to_string(bm) + " slots cannot hold every routing (need " +
                                         std::to_string(need) + ")");
    }
    const int64_t smem = AlignSmem(E, align_warps);
    if (smem > 48 * 1024 && cudaFuncSetAttribute(AlignKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)) != cudaSuccess) {
      return LastError("raising the align kernel's shared-memory limit");
    }
    AlignKernel<<<1, 32 * align_warps, smem, stream>>>(ids.typed_data(), static_cast<int>(S), static_cast<int>(E),
                                                       static_cast<int>(bm), static_cast<int>(max_blocks),
                                                       sorted->typed_data(), block_expert->typed_data());
    if (ffi::Error e = LastError("align launch"); e.failure()) return e;
    auto* hp = static_cast<__nv_bfloat16*>(h->untyped_data());
    auto* yp = static_cast<__nv_bfloat16*>(ys->untyped_data());
    GemmParams g1{xq, uqp, gsp, usp, static_cast<const __nv_bfloat16*>(x.untyped_data()), hp,
                  sorted->typed_data(), block_expert->typed_data(), static_cast<int>(F), static_cast<int>(D),
                  static_cast<int>(gate_scales), static_cast<int>(gg), static_cast<int>(topk), static_cast<int>(S)};
    GemmParams g2{dqp, nullptr, dsp, nullptr, hp, yp, sorted->typed_data(), block_expert->typed_data(),
                  static_cast<int>(D), static_cast<int>(F), static_cast<int>(down_scales), static_cast<int>(dg), 1,
                  static_cast<int>(S)};
    ffi::Error err = bm == 8    ? LaunchGemms<1>(stream, g1, g2, static_cast<int>(max_blocks))
                     : bm == 16 ? LaunchGemms<2>(stream, g1, g2, static_cast<int>(max_blocks))
                                : LaunchGemms<4>(stream, g1, g2, static_cast<int>(max_blocks));
    if (err.failure()) return err;
    CombineKernel<__nv_bfloat16><<<GridFor(M * D, 256), 256, 0, stream>>>(
        yp, ids.typed_data(), weights.typed_data(), M, static_cast<int>(topk), static_cast<int>(E),
        static_cast<int>(D), static_cast<__nv_bfloat16*>(out->untyped_data()));
    return LastError("combine launch");
  }

  if (D % 8 != 0 || F % 8 != 0) return ffi::Error::InvalidArgument("marlin_moe: D and F must be multiples of 8");
  GenericParams p1{xq, uqp, gsp, usp, ids.typed_data(), static_cast<int>(E), static_cast<int>(F),
                   static_cast<int>(D), static_cast<int>(gate_scales), static_cast<int>(gg), static_cast<int>(topk),
                   static_cast<int>(S)};
  GenericParams p2{dqp, nullptr, dsp, nullptr, ids.typed_data(), static_cast<int>(E), static_cast<int>(D),
                   static_cast<int>(F), static_cast<int>(down_scales), static_cast<int>(dg), 1, static_cast<int>(S)};
  if (t == ffi::DataType::F32) {
    return LaunchGeneric<float>(stream, p1, p2, static_cast<const float*>(x.untyped_data()),
                                static_cast<float*>(h->untyped_data()), static_cast<float*>(ys->untyped_data()),
                                weights.typed_data(), M, static_cast<int>(topk), D,
                                static_cast<float*>(out->untyped_data()));
  }
  return LaunchGeneric<__nv_bfloat16>(stream, p1, p2, static_cast<const __nv_bfloat16*>(x.untyped_data()),
                                      static_cast<__nv_bfloat16*>(h->untyped_data()),
                                      static_cast<__nv_bfloat16*>(ys->untyped_data()), weights.typed_data(), M,
                                      static_cast<int>(topk), D, static_cast<__nv_bfloat16*>(out->untyped_data()));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMarlinMoeCuda, MarlinMoeCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // x [M, D] f32 | bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()        // ids [M, k] (outside [0, E): no expert)
                                  .Arg<ffi::Buffer<ffi::F32>>()        // routing weights [M, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // gate packed [E, F, D/8]
                                  .Arg<ffi::Buffer<ffi::BF16>>()       // gate scales [E, F, D/group]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // up packed [E, F, D/8]
                                  .Arg<ffi::Buffer<ffi::BF16>>()       // up scales [E, F, D/group]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // down packed [E, D, F/8]
                                  .Arg<ffi::Buffer<ffi::BF16>>()       // down scales [E, D, F/group]
                                  .Ret<ffi::AnyBuffer>()               // out [M, D]
                                  .Ret<ffi::Buffer<ffi::S32>>()        // sorted slots [max_blocks * BM]
                                  .Ret<ffi::Buffer<ffi::S32>>()        // expert of each block [max_blocks]
                                  .Ret<ffi::AnyBuffer>()               // h [M k, F]
                                  .Ret<ffi::AnyBuffer>(),              // ys [M k, D]
                              {xla::ffi::Traits::kCmdBufferCompatible});
