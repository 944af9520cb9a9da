// marlin_moe, CUDA handler (sm_90a): the W4A16 fused MoE of kdtree_jax/kernels/marlin_moe.py.
//
// The function is the CPU handler's (ffi/marlin_moe.cc has the math). Weights stay in the checkpoint layout
// (compressed-tensors pack-quantized: int32 [E, out, in/8], nibble q + 8 least significant first; bf16 scales
// [E, out, in/group]); nothing is repacked. Launches on the stream, nothing allocated, no host sync:
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
// Two fast paths (bf16), chosen by the block size BM of the align stage (the Python wrapper picks it from M):
//
// Stream path (BM = 8, 16, 32; small M; D and F multiples of 128, group 32): gemm1 and gemm2 are one kernel
// (template: gated or not, NT token tiles of 8). A block of 4 warps owns one token block of BM = 8 NT slots (one
// expert) and 16 output rows of gate and up (gemm1) or 32 rows of down (gemm2); its 4 warps split K in 128-wide
// chunks (warp w takes chunks w, w + 4, ...) and sum their fp32 partials in shared memory in warp order. The
// weights are the A operand of mma.m16n8k16 (16 output rows), the tokens the B operand (8 columns), so one token
// per expert wastes 7/8 of the small side and none of the weight stream.
//
// K order. A dot product does not care in which order k is summed, as long as A and B agree. A chunk holds 4
// quantization groups G of 32 inputs (16 bytes, 4 packed words, per row). mma step (G, h) gives lane (g, t) of a
// warp (g = lane / 4, t = lane % 4) word t of group G of rows g and g + 8 of a 16-row tile, its nibble pairs
// (p, p + 4) with p = 2 h (logical k 2t, 2t+1) and p = 2 h + 1 (logical k 2t+8, 2t+9), and the token values at the
// same inputs (32 G + 8 t .. + 7 of the chunk, paired with one byte permute). So each mma step lies in one group,
// with one scale per row, and the scale is applied after the mma, in fp32: dequantization is one lop3 per pair,
// (word >> 4 p) & 0x000F000F | 0x43004300 = the exact bf16 pair (128 + n_p, 128 + n_{p+4}) = q + 136, and the
// step's mmas accumulate onto -136 (sum of the step's token values), an mma of the constant -136 with the same
// tokens that both tiles share. That leaves sum q x (fp32), times the row's scale. The weights are never rounded
// to bf16 (the reference rounds q * s to bf16): the two differ by less than bf16 rounding.
//
// Streaming. Each warp streams its own chunks through its own slots of a shared-memory ring of kStreamStages
// chunks (cp.async, L1 bypassed for the weights): each lane copies one 16-byte group of each of its 4 weight rows
// and the 4 scales of one of the warp's rows. Group G of row g sits in 16-byte slot G ^ (g / 2 % 4) of the row's
// 64 bytes, so the lanes' 4-byte reads of word t of group G hit 32 different banks. cp.async.wait_group and a warp
// barrier order the copies before the reads, a second warp barrier the reads before the slot is refilled. A block
// copies its first weight stages before it reads its slots (the weights need only the expert). Token rows go
// straight to registers, loaded a chunk ahead (through L1 for x; from L2 for h, which gemm1 writes); token tiles
// without a slot (the real slots come first in a block) are skipped.
//
// Launches. gemm1, gemm2 and the combine are launched as programmatic dependents (PDL) of the kernel before them:
// gemm1 waits for the align stage at its start, gemm2 copies its first weight stages while gemm1's last blocks run
// and waits for gemm1 before it reads h, the combine waits for gemm2. Every block waits before it ends, so each
// kernel also ends after the one before it. Flag bit 4 launches them plainly.
//
// Tile path (BM = 64 or 128; large M; D a multiple of 256, F of 128, group 32): a block of two warpgroups owns one
// tile of up to BM slots of one expert and 128 rows of gate and of up (gemm1) or 256 rows of down (gemm2), so each
// dequantized weight is used for every token of the tile. The weights are the A operand of wgmma.m64nNk16 from
// registers (warp w of a warpgroup holds rows 16 w .. 16 w + 15 of its 64-row tile, the mma.m16n8k16 fragment
// layout); the tokens are the B operand, read by the tensor cores from 128B-swizzled shared memory; N = the tile's
// slot count rounded up to 16 (a template instance per N; flag bit 6: 17-24 slots as N = 24). Per 128-input
// stage, lane (g, t) copies the 16 bytes (inputs 32 t .. 32 t + 31) of each of its 4 weight rows and dequantizes
// them into the A fragments of the stage's 8 k-steps (k-step j takes word j / 2, nibble pairs s = 2 (j % 2) and
// s + 1, as above). The stage loop is issue-bound, so it is kept lean (H200, 2026-12-02: 424 SASS instructions for
// 16 wgmma, was 556): the lop3 written out (in C it compiles to two), ring slots counted rather than s % stages,
// the wgmma descriptor's low word added to. The tensor cores read B
// in logical k order, so the tokens must hold, at logical position l of every 128-block, input TilePhys(l): a
// small kernel writes x in that order (into the ys scratch, which gemm2 overwrites later), and gemm1 writes h in
// that order, so gemm2's B is ready as well. A ring of 4 (BM = 128) or 6 (BM = 64) stages of cp.async, refilled
// two stages behind the compute so that no wgmma still reads a slot being overwritten, a stage's copies issued in
// 4 parts after its first 4 k-steps in tiles of more than 32 slots (all at once after the barrier in narrower ones,
// where that measured 2-5% faster at M = 512 on the H200); the epilogue goes through
// shared memory and stores 16-byte row pieces. Two k-steps of wgmma in flight (4 with flag bit 3). The same kernel
// with mma.sync (ldmatrix for B) is kept for comparison (flag bit 0).
//
// Generic path (float32, or shapes off the fast paths): one warp per (slot, output row), CUDA cores, fp32.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "cuda_common.cuh"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kWarps = 4;                 // warps per stream-path gemm block (the K split)
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 128;               // inputs per warp step
constexpr int kMaxAlignSmem = 200 * 1024;

// Bits of the "flags" attribute (benchmarks and tests; 0 is the default).
constexpr int64_t kFlagSync = 1;        // tile path: mma.sync + ldmatrix instead of wgmma
constexpr int64_t kFlagL2Prefetch = 2;  // weight copies ask L2 for 256-byte lines
constexpr int64_t kFlagDeep = 8;        // tile path (wgmma): 4 k-steps in flight instead of 2
constexpr int64_t kFlagSerial = 16;     // stream path: plain launches instead of programmatic dependent ones
constexpr int64_t kFlagTile = 32;       // BM = 16 or 32: the tile path's narrow tiles instead of the stream path
constexpr int64_t kFlagFine = 64;       // tile path: 17-24 slots run as N = 24 (not 32)
constexpr int64_t kFlagPersist = 128;   // stream path: resident blocks loop over the used units (GemmKernel)
constexpr int64_t kFlagXL1 = 256;       // stream path, gate/up: x prefetched into L1 as far ahead as the weights
constexpr int64_t kFlagFusedOne = 1024;  // fused path: one block per SM (not the occupancy's two)
constexpr int64_t kFlagGemv = 2048;      // the GEMV decode path (CUDA cores, a warp a row; few slots)

// ------------------------------------------------------------------------------------------------------------------
// Small helpers (the ones fused_dot.cu uses too are in cuda_common.cuh)
// ------------------------------------------------------------------------------------------------------------------

// 16 bytes global -> shared through L1; zero-filled (src not read) when !valid.
__device__ __forceinline__ void CopyAsync16Ca(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// 8 / 4 bytes global -> shared through L1.
__device__ __forceinline__ void CopyAsync8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CopyAsync4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

// cp.async.wait_group with a run-time count (0..6; uniform over the block).
__device__ __forceinline__ void CopyWaitDyn(int n) {
  switch (n) {
    case 0: CopyWait<0>(); break;
    case 1: CopyWait<1>(); break;
    case 2: CopyWait<2>(); break;
    case 3: CopyWait<3>(); break;
    case 4: CopyWait<4>(); break;
    case 5: CopyWait<5>(); break;
    default: CopyWait<6>(); break;
  }
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

__device__ __forceinline__ uint32_t LoadShared2(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void StoreShared2(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

__device__ __forceinline__ void StoreShared16(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Two 8x8 b16 matrices (Ldsm4's first two), the other two registers 0.
__device__ __forceinline__ void Ldsm2(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr)
               : "memory");
  r[2] = r[3] = 0u;
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t Bf2Bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 BitsBf2(uint32_t u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }

// (word & 0x000F000F) | 0x43004300 in one lop3: the bf16 pair (128 + low nibble of each half-word).
__device__ __forceinline__ uint32_t BiasedPair(uint32_t word) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(word), "n"(0x000F000F), "n"(0x43004300));
  return d;
}

// Nibbles s and s + 4 of a packed word as the bf16 pair (q_s, q_{s+4}) * scale (q = nibble - 8), rounded once.
__device__ __forceinline__ uint32_t Dequant(uint32_t word, int s, __nv_bfloat162 scale) {
  const uint32_t biased = BiasedPair(word >> (4 * s));  // (128 + n_s, 128 + n_{s+4})
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

// D = A B (zero accumulators), the same tile shape.
__device__ __forceinline__ void MmaZero(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

__device__ __forceinline__ uint2 LoadShared8(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

// 16 bytes global -> registers: through L1 (data no kernel writes while this one runs), or from L2 only.
__device__ __forceinline__ uint4 LoadGlobal16Nc(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 LoadGlobal16Cg(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr) : "memory");
  return v;
}

// Ask L1 for the line holding ptr (no value; the load that needs it comes later).
__device__ __forceinline__ void PrefetchL1(const void* ptr) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr));
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
// wgmma (the tile path)
// ------------------------------------------------------------------------------------------------------------------

// Generic-proxy shared-memory writes (cp.async) -> reads by wgmma (async proxy).
__device__ __forceinline__ void ProxyFence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keep the compiler from moving reads of wgmma registers above a wait (and their writers below the issue).
template <int N>
__device__ __forceinline__ void Pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void Pin(uint32_t (&d)[2][4]) {  // one k-step's A fragments (2 tiles)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
  }
}

// Shared-memory matrix descriptor of a K-major operand in 128B-swizzled panels: rows of 64 bf16 (128 B), 8-row
// groups 1024 B apart (SBO); LBO unused. The panel starts 1024-aligned; k-step kk of it starts at +32 kk bytes.
__device__ __forceinline__ uint64_t KMajorDesc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3ffff) >> 4) | (static_cast<uint64_t>(16 >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (uint64_t{1} << 62);
}

// d[64 x N] += A[64 x 16] (registers, this warp's 16 rows) B[16 x N] (K-major in shared memory).
template <int N>
struct Wgmma;

template <>
struct Wgmma<8> {
  static __device__ __forceinline__ void Run(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3"
        "}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

template <>
struct Wgmma<16> {
  static __device__ __forceinline__ void Run(float (&d)[8], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

template <>
struct Wgmma<24> {
  static __device__ __forceinline__ void Run(float (&d)[12], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11"
        "}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

template <>
struct Wgmma<32> {
  static __device__ __forceinline__ void Run(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

template <>
struct Wgmma<48> {
  static __device__ __forceinline__ void Run(float (&d)[24], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23"
        "}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

template <>
struct Wgmma<64> {
  static __device__ __forceinline__ void Run(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

template <>
struct Wgmma<80> {
  static __device__ __forceinline__ void Run(float (&d)[40], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %45, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39"
        "}, {%40, %41, %42, %43}, %44, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

template <>
struct Wgmma<96> {
  static __device__ __forceinline__ void Run(float (&d)[48], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
        "}, {%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

template <>
struct Wgmma<112> {
  static __device__ __forceinline__ void Run(float (&d)[56], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %61, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55"
        "}, {%56, %57, %58, %59}, %60, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

template <>
struct Wgmma<128> {
  static __device__ __forceinline__ void Run(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
};

// ------------------------------------------------------------------------------------------------------------------
// 1. align: slots sorted by expert, padded per expert to BM, with the expert of each block
// ------------------------------------------------------------------------------------------------------------------

// One block of 32 W threads (W from the slot count: one warp for a handful of slots). Warp w owns slots
// [w P, (w + 1) P) (P = ceil(S / W)); within a warp, 32 slots at a time, __match_any_sync groups lanes of one
// expert, so a slot's place is (expert start) + (slots of that expert in earlier warps) + (in earlier rounds of
// this warp) + (in lower lanes): a stable sort without atomics.
// Shared memory (ints): hist [W, E] (counts, then running starts), count [E], start [E], warp sums [32], total.
__global__ void AlignKernel(const int32_t* __restrict__ ids, int slots, int experts, int bm, int max_blocks,
                            int32_t* __restrict__ sorted, int32_t* __restrict__ block_expert) {
  extern __shared__ int align_smem[];
  LaunchDependents();  // the stream path's gemm1 may start launching (it waits for this kernel to end)
  const int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  int* hist = align_smem;
  int* count = hist + nw * experts;
  int* start = count + experts;
  int* wsum = start + experts;
  int* total = wsum + 32;
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

  // Exclusive scan of the padded counts: thread tid takes experts [e0, e1); warp shuffles, then the warp sums.
  const int span = (experts + blockDim.x - 1) / blockDim.x;
  const int e0 = min(experts, tid * span), e1 = min(experts, e0 + span);
  int sum = 0;
  for (int e = e0; e < e1; ++e) sum += (count[e] + bm - 1) / bm * bm;
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int v = lane < nw ? wsum[lane] : 0;
    int w_incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, w_incl, o);
      if (lane >= o) w_incl += u;
    }
    __syncwarp();
    if (lane < nw) wsum[lane] = w_incl - v;
    if (lane == 31) *total = w_incl;
  }
  __syncthreads();
  const int cap = max_blocks * bm;
  int run = wsum[warp] + incl - sum;
  for (int e = e0; e < e1; ++e) {
    const int padded = (count[e] + bm - 1) / bm * bm;
    start[e] = run;
    for (int b = run / bm; b < (run + padded) / bm && b < max_blocks; ++b) block_expert[b] = e;
    for (int p = run + count[e]; p < run + padded && p < cap; ++p) sorted[p] = slots;
    run += padded;
  }
  __syncthreads();
  for (int b = *total / bm + tid; b < max_blocks; b += blockDim.x) block_expert[b] = -1;
  if (tid == 0) block_expert[max_blocks] = min(*total / bm, max_blocks);  // the used blocks (all first)

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

int64_t AlignSmem(int64_t experts, int warps) { return ((warps + 2) * experts + 33) * 4; }

// Warps of the align block: one per 256 slots, at most 16 and as many as the shared memory holds.
int AlignWarps(int64_t experts, int64_t slots) {
  int w = static_cast<int>((slots + 255) / 256);
  w = w < 1 ? 1 : (w > 16 ? 16 : w);
  for (; w >= 1; --w) {
    if (AlignSmem(experts, w) <= kMaxAlignSmem) return w;
  }
  return 0;
}

// ------------------------------------------------------------------------------------------------------------------
// 2./3. the stream-path gemm
// ------------------------------------------------------------------------------------------------------------------

struct GemmParams {
  const uint32_t* w0;          // packed [E, rows, K/8]: gate (gated) or down
  const uint32_t* w1;          // packed [E, rows, K/8]: up (gated only)
  const __nv_bfloat16* s0;     // scales [E, rows, K/32] of w0
  const __nv_bfloat16* s1;     // scales of w1
  const __nv_bfloat16* src;    // B operand rows [*, K]: x [M, K] (gated, row = slot / k) or h [M k, K] (row = slot)
  __nv_bfloat16* dst;          // [M k, rows]: h (gated) or ys
  const int32_t* sorted;       // [max_blocks * BM] slots (M k = padding)
  const int32_t* block_expert; // [max_blocks + 1]: each block's expert (-1: unused), then the used blocks
  int rows;                    // output rows per expert (F or D)
  int k;                       // inputs (D or F), a multiple of 128
  int groups;                  // scales per row (K / 32)
  int src_div;                 // slot -> B row divisor (top-k for gemm1, 1 for gemm2)
  int slots;                   // M k
  int max_blocks;              // token blocks (entries of block_expert)
  int x_ahead;                 // chunks ahead x is prefetched into L1 (gate/up; 0: none, x read one chunk ahead)
};

// The ring of the stream path, per stage: weights (4 rows x 16 B per thread), then scales (8 B per thread); 4 blocks
// of 4 warps per SM.
constexpr int kStreamStages = 6;
constexpr int kStreamW = 16 * 4 * kThreads;
constexpr int kStreamStageBytes = kStreamW + 8 * kThreads;
constexpr int kStreamSmem = kStreamStages * kStreamStageBytes;
constexpr uint32_t kMinus136 = 0xC308C308u;  // the bf16 pair (-136, -136)

// One unit of work: row set `set` (16 gate and 16 up rows, or 32 down rows) of expert e for the slots of token block
// `block`, all 4 warps of the block, each over a quarter of k. Called by every thread of the block.
template <int NT, bool kGated, bool kL2>
__device__ __forceinline__ void GemmUnit(const GemmParams& p, int block, int set, int e) {
  constexpr int kBm = 8 * NT;
  extern __shared__ __align__(16) unsigned char gemm_smem[];
  __shared__ int s_src[kBm];  // B row of each token column (-1: padding)
  __shared__ int s_dst[kBm];  // output row (slot) of each token column (-1: padding)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // Row set s = 2 tile + rh: rows g + 8 rh of tile `tile` (gate / up, or the two 16-row halves of down). This thread
  // copies group t of its row of every set, and the scales of its row of set t. Running pointers at this warp's
  // next chunk to copy.
  const int row0 = set * (kGated ? 16 : 32);
  const int64_t words = p.k / 8;
  const int chunks = p.k / kChunk;
  const int mine = (chunks - warp + kWarps - 1) / kWarps;  // chunks warp, warp + 4, ...
  const uint32_t* a_ptr[4];
  const __nv_bfloat16* sc_ptr = nullptr;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int tile = s >> 1, rh = s & 1;
    const int64_t row = static_cast<int64_t>(e) * p.rows + row0 + (kGated ? 0 : 16 * tile) + g + 8 * rh;
    a_ptr[s] = ((kGated && tile) ? p.w1 : p.w0) + row * words + 4 * t + warp * 16;
    if (s == t) sc_ptr = ((kGated && tile) ? p.s1 : p.s0) + row * p.groups + warp * 4;
  }

  // Shared-memory offsets in a stage: this warp's 2 KB of weights (set s at + 512 s; row g at + 64 g, group G in
  // slot G ^ sw), then its 256 bytes of scales (lane order).
  const int sw = (g >> 1) & 3;
  const uint32_t ring = SmemAddress(gemm_smem);
  const uint32_t w_copy = warp * 2048 + 64 * g + 16 * (t ^ sw);
  const uint32_t w_read = warp * 2048 + 64 * g + 4 * t;
  const uint32_t s_copy = kStreamW + (warp * 32 + lane) * 8;
  const uint32_t s_read = kStreamW + (warp * 32 + 4 * g) * 8;
  uint32_t copy_stage = ring, read_stage = ring;  // the stages the next copy fills and the next chunk reads
  auto next_stage = [](uint32_t& stage, uint32_t ring) {
    stage = stage + kStreamStageBytes == ring + kStreamSmem ? ring : stage + kStreamStageBytes;
  };
  auto issue = [&]() {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      CopyAsync16Cg(copy_stage + w_copy + 512 * s, a_ptr[s], kL2);
      a_ptr[s] += kWarps * 16;
    }
    CopyAsync8(copy_stage + s_copy, sc_ptr);
    sc_ptr += kWarps * 4;
    next_stage(copy_stage, ring);
  };
#pragma unroll
  for (int s = 0; s < kStreamStages - 1; ++s) {  // the weights need only the expert: copy before the slots arrive
    if (s < mine) issue();
    CopyCommit();
  }

  int real = 0;
  if (tid < kBm) {
    const int slot = __ldcg(p.sorted + static_cast<int64_t>(block) * kBm + tid);
    real = slot >= 0 && slot < p.slots;
    s_dst[tid] = real ? slot : -1;
    s_src[tid] = real ? slot / p.src_div : -1;
  }
  const int tiles = (__syncthreads_count(real) + 7) / 8;  // token tiles with a slot (the real slots come first)
  const __nv_bfloat16* x_ptr[NT];  // inputs 8 t .. 8 t + 7 of each group of token column 8 j + g, next chunk
  bool x_ok[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int src = s_src[8 * j + g];
    x_ok[j] = src >= 0 && mine > 0;
    x_ptr[j] = p.src + static_cast<int64_t>(x_ok[j] ? src : 0) * p.k + warp * kChunk + 8 * t;
  }
  auto load_x = [&](int j, int grp) {
    return kGated ? LoadGlobal16Nc(x_ptr[j] + 32 * grp) : LoadGlobal16Cg(x_ptr[j] + 32 * grp);
  };
  // FLAG_X_L1: the two 128-byte lines of each token row of chunk `ahead` chunks past x_ptr's asked into L1 (lane t
  // at element 8 t + 32 t: lines 0, 0, 1, 1), so that the one-chunk-ahead loads below find them there.
  auto prefetch_x = [&](int ahead) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (x_ok[j]) PrefetchL1(x_ptr[j] + static_cast<int64_t>(ahead) * kWarps * kChunk + 32 * t);
    }
  };
  if (kGated && p.x_ahead > 0) {
    for (int c = 1; c <= p.x_ahead && c < mine; ++c) prefetch_x(c);
  }
  if (!kGated) GridDependencyWait();  // h is gemm1's output
  uint4 xv[NT][4];  // this chunk's token values: [token tile][group]
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int grp = 0; grp < 4; ++grp) xv[j][grp] = x_ok[j] ? load_x(j, grp) : make_uint4(0, 0, 0, 0);
    x_ptr[j] += kWarps * kChunk;
  }
  float acc[2][NT][4];
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[tile][j][c] = 0.0f;
    }
  }

  uint32_t k136[4];  // the A operand of the base-sum mma, kept in registers
#pragma unroll
  for (int r = 0; r < 4; ++r) asm volatile("mov.b32 %0, %1;" : "=r"(k136[r]) : "n"(kMinus136));
  for (int i = 0; i < mine; ++i) {
    if (i + kStreamStages - 1 < mine) issue();
    CopyCommit();
    if (kGated && p.x_ahead > 0 && i + p.x_ahead < mine) prefetch_x(p.x_ahead - 1);  // chunk i + ahead (x_ptr: i + 1)
    CopyWait<kStreamStages - 1>();  // this thread's copies of chunk i have landed
    __syncwarp();                   // and the other lanes'

    const bool more = i + 1 < mine;
    uint2 sc2[4];  // the scales of the chunk's 4 groups, for this thread's row of each set
#pragma unroll
    for (int s = 0; s < 4; ++s) sc2[s] = LoadShared8(read_stage + s_read + 8 * s);
#pragma unroll
    for (int grp = 0; grp < 4; ++grp) {
      uint32_t v[4][4];  // [set][nibble pair p]: q + 136 of inputs (p, p + 4) of word t of group grp
      float sc[4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t word = LoadShared4(read_stage + w_read + 16 * (grp ^ sw) + 512 * s);
#pragma unroll
        for (int q = 0; q < 4; ++q) v[s][q] = BiasedPair(word >> (4 * q));
        const uint32_t pair = (grp >> 1) ? sc2[s].y : sc2[s].x;
        sc[s] = __uint_as_float((grp & 1) ? (pair & 0xffff0000u) : (pair << 16));
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (NT > 1 && j >= tiles) break;  // uniform over the block
        const uint4 xg = xv[j][grp];
        const uint32_t b[4] = {__byte_perm(xg.x, xg.z, 0x5410), __byte_perm(xg.x, xg.z, 0x7632),
                               __byte_perm(xg.y, xg.w, 0x5410), __byte_perm(xg.y, xg.w, 0x7632)};
        if (more && x_ok[j]) xv[j][grp] = load_x(j, grp);  // the next chunk's
        float base_sum[4];  // -136 x (sum of the group's token values), in every row
        MmaZero(base_sum, k136[0], k136[1], k136[2], k136[3], b[0], b[1]);
        Mma(base_sum, k136[0], k136[1], k136[2], k136[3], b[2], b[3]);
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
          float d[4] = {base_sum[0], base_sum[1], base_sum[2], base_sum[3]};
          Mma(d, v[2 * tile][0], v[2 * tile + 1][0], v[2 * tile][1], v[2 * tile + 1][1], b[0], b[1]);
          Mma(d, v[2 * tile][2], v[2 * tile + 1][2], v[2 * tile][3], v[2 * tile + 1][3], b[2], b[3]);
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[tile][j][c] = fmaf(sc[2 * tile + (c >> 1)], d[c], acc[tile][j][c]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) x_ptr[j] += kWarps * kChunk;
    next_stage(read_stage, ring);
    __syncwarp();  // every lane is done with the slot before it is copied into again
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

// The stream-path gemm. kPersist: a grid of as many blocks as fit on the GPU at once, block i taking units i, i + grid,
// ... of the used token blocks x row sets (token blocks fastest; no block is launched for nothing: max_blocks bounds
// every routing, and most are unused when a few experts are touched); else one block per unit, the grid [max_blocks,
// row sets], the blocks of unused token blocks exiting at once.
template <int NT, bool kGated, bool kL2, bool kPersist>
__global__ void __launch_bounds__(kThreads, NT == 4 ? 3 : 4) GemmKernel(const GemmParams p) {
  if (kGated) GridDependencyWait();  // the align stage's arrays (gemm2: gemm1 started after the align stage ended)
  if (!kPersist) {
    const int e = __ldcg(p.block_expert + blockIdx.x);
    if (e >= 0) {  // uniform over the block
      LaunchDependents();
      GemmUnit<NT, kGated, kL2>(p, blockIdx.x, blockIdx.y, e);
      return;
    }
  } else {
    LaunchDependents();
    const int used = min(__ldcg(p.block_expert + p.max_blocks), p.max_blocks);
    const int64_t units = static_cast<int64_t>(used) * (p.rows / (kGated ? 16 : 32));
    for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {  // the grid's order: token blocks fastest
      const int block = static_cast<int>(u % used);
      const int e = __ldcg(p.block_expert + block);
      if (e < 0) continue;  // (not reached: the used blocks come first)
      GemmUnit<NT, kGated, kL2>(p, block, static_cast<int>(u / used), e);
      __syncthreads();  // the ring and the slot lists are free for the next unit
    }
  }
  if (!kGated) GridDependencyWait();  // no block ends before gemm1 has: the chain completes in order
}

// ------------------------------------------------------------------------------------------------------------------
// 2./3. the tile-path gemm
// ------------------------------------------------------------------------------------------------------------------

constexpr int kTileThreads = 256;            // two warpgroups
constexpr int kMaxTile = 128;                // slots per tile (BM)
constexpr int kTileW = 16 * 4 * kTileThreads;  // stage bytes of weights: 4 rows x 16 B per thread
constexpr int kTileS = 8 * kTileThreads;       // stage bytes of scales: 4 groups of one row per thread
constexpr int kTileX = kTileW + kTileS;        // tokens: two 128B-swizzled panels [BM rows x 64 inputs]

__host__ __device__ constexpr int TileStages(int bt) { return bt <= 32 ? 4 : bt <= 64 ? 6 : 4; }
__host__ __device__ constexpr int TileStageBytes(int bt) { return kTileX + 256 * bt; }
constexpr int TileSmem(int bt) { return TileStages(bt) * TileStageBytes(bt) + 1024; }  // + room to align the base

// The input held at logical position l (0..127) of a 128-input block in the tile path's k order: k-step j = l / 16
// of the block takes, from lane t's word j / 2 (inputs 32 t + 8 (j / 2) ..), the nibble pairs s = 2 (j % 2)
// (logical 2t, 2t+1 of the step) and s + 1 (logical 2t+8, 2t+9); pair s holds inputs s and s + 4 of the word.
__host__ __device__ constexpr int TilePhys(int l) {
  return 32 * ((l & 7) >> 1) + 8 * (l >> 5) + 2 * ((l >> 4) & 1) + ((l >> 3) & 1) + 4 * (l & 1);
}

// Its inverse: the logical position of input f (0..127).
__host__ __device__ constexpr int TileLogical(int f) {
  return 16 * (2 * ((f & 31) >> 3) + ((f >> 1) & 1)) + 8 * (f & 1) + 2 * (f >> 5) + ((f >> 2) & 1);
}

// xp[m, 128 b + l] = x[m, 128 b + TilePhys(l)], one thread per 128-input block (bf16).
__global__ void PermuteKernel(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ xp, int64_t blocks) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < blocks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4* src = reinterpret_cast<const uint4*>(x + i * 128);
    uint32_t w[64];
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const uint4 v = src[c];
      w[4 * c] = v.x;
      w[4 * c + 1] = v.y;
      w[4 * c + 2] = v.z;
      w[4 * c + 3] = v.w;
    }
    uint4* dst = reinterpret_cast<uint4*>(xp + i * 128);
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      uint32_t o[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int l = 8 * c + 2 * q;  // logical pair (l, l + 1) = inputs (p, p + 4), same half of words p/2, p/2 + 2
        const int ph = TilePhys(l);
        o[q] = __byte_perm(w[ph >> 1], w[(ph >> 1) + 2], (ph & 1) ? 0x7632 : 0x5410);
      }
      dst[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

struct TileParams {
  const uint32_t* w0;          // packed [E, rows, K/8]: gate (gated) or down
  const uint32_t* w1;          // packed [E, rows, K/8]: up (gated only)
  const __nv_bfloat16* s0;     // scales [E, rows, K/32] of w0
  const __nv_bfloat16* s1;     // scales of w1
  const __nv_bfloat16* src;    // B rows [*, K] in tile k order: xp [M, D] (gated, row = slot / k) or h [M k, F]
  __nv_bfloat16* dst;          // [M k, rows]: h in tile k order (gated) or ys
  const int32_t* sorted;       // [max_blocks * BM] slots (M k = padding)
  const int32_t* block_expert; // [max_blocks + 1]: each block's expert (-1: unused), then the used blocks
  int rows;                    // output rows per expert (F or D)
  int k;                       // inputs (D or F), a multiple of 128
  int groups;                  // scales per row (K / 32)
  int src_div;                 // slot -> B row divisor (top-k for gemm1, 1 for gemm2)
  int slots;                   // M k
  int row_tiles;               // rows / 128 (gated) or rows / 256
  int bt;                      // BM: 64 or 128
  int flags;                   // kFlag*
};

// One block: tile `tile` (<= BM slots of expert e, ntok of them real, N = ntok rounded up) x row tile rt. kDepth:
// k-steps whose wgmma may be in flight (2 or 4; it divides the 8 k-steps of a stage), each with its own fragments.
template <int N, bool kGated, bool kSync, int kDepth>
__device__ __forceinline__ void TileBlock(const TileParams& p, int e, int rt, int ntok, uint32_t base,
                                          const int* s_src, const int* s_dst) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  const int64_t words = p.k / 8;
  const int stages = TileStages(p.bt), stage_bytes = TileStageBytes(p.bt), panel = 128 * p.bt;
  const bool l2_256 = (p.flags & kFlagL2Prefetch) != 0;

  // This thread's 4 weight rows i = 2 tau + rh: tile tau (gate / up, or the two 64-row halves of a warpgroup's
  // down rows), rows 16 wq + g + 8 rh of the 64-row tile.
  const uint32_t* w_ptr[4];
  const __nv_bfloat16* sc_ptr = nullptr;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tau = i >> 1, rh = i & 1;
    const int local = kGated ? 64 * wg + 16 * wq + g + 8 * rh : 128 * wg + 64 * tau + 16 * wq + g + 8 * rh;
    const int64_t row = static_cast<int64_t>(e) * p.rows + (kGated ? 128 : 256) * rt + local;
    w_ptr[i] = ((kGated && tau) ? p.w1 : p.w0) + row * words + 4 * t;
    if (i == t) sc_ptr = ((kGated && tau) ? p.s1 : p.s0) + row * p.groups;  // lane t copies row t's scales
  }
  // Token rows this thread copies: row n = tid / 16 + 16 r, 16-byte piece c = tid % 16 of the 256-byte stage.
  constexpr int kRowsPer = (N + 15) / 16;
  const int c16 = tid & 15;
  const __nv_bfloat16* x_ptr[kRowsPer];
  uint32_t x_off[kRowsPer];  // its place in a stage
  bool x_ok[kRowsPer];
#pragma unroll
  for (int r = 0; r < kRowsPer; ++r) {
    const int n = (tid >> 4) + 16 * r;
    x_ok[r] = n < ntok;
    x_ptr[r] = p.src + static_cast<int64_t>(x_ok[r] ? s_src[n] : 0) * p.k + 8 * c16;
    x_off[r] = kTileX + (c16 >> 3) * panel + n * 128 + (((c16 & 7) ^ (n & 7)) << 4);
  }

  // Part q (0..3) of the copies of stage s into the ring slot at sb: weight row q, the scales (q = 0) and token rows
  // q, q + 4. In the loop, part q is issued after k-step q's wgmma, so that a thread's 7-13 copies of a stage do not
  // all reach the load/store unit at once: issued together after the barrier, they stalled the next instruction that
  // reused one of their address registers until the unit had taken them all (H200, ncu source counters, 2026-12-02:
  // ~16% of the warps' samples at M = 1,024 and 4,096). (The sources are addressed from s: advancing the pointers by
  // one stage per call instead, the same addresses, computed the tile path's wgmma kernels wrong on the H200 at
  // 32 and 128 slots, not understood; see benchmarks/results/marlin_moe.predictions.md, 2026-12-02.)
  auto issue_part = [&](uint32_t sb, int s, int q) {
    CopyAsync16Cg(sb + (q * kTileThreads + tid) * 16, w_ptr[q] + 16 * s, l2_256);
    if (q == 0) CopyAsync8(sb + kTileW + tid * 8, sc_ptr + 4 * s);
#pragma unroll
    for (int r = q; r < kRowsPer; r += 4) {
      const int n = (tid >> 4) + 16 * r;
      if (N % 16 == 0 || n < N) CopyAsync16CgZ(sb + x_off[r], x_ptr[r] + 128 * s, x_ok[r]);
    }
  };
  auto issue = [&](uint32_t sb, int s) {
#pragma unroll
    for (int q = 0; q < 4; ++q) issue_part(sb, s, q);
  };
  // Tiles of at most 32 slots issue a stage's copies in one burst after the barrier: spread over the k-steps they
  // were 2-5% slower at M = 512 on the H200 (three runs, 2026-12-02 and 12-03); the 128-slot tiles gained 5-6% from it.
  constexpr bool kSpread = N > 32;

  float acc[2][N / 2];
#pragma unroll
  for (int tau = 0; tau < 2; ++tau) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[tau][i] = 0.0f;
  }
  uint32_t a[kDepth][2][4];  // [k-step % kDepth][tau][fragment register]
#pragma unroll
  for (int b = 0; b < kDepth; ++b) {
#pragma unroll
    for (int tau = 0; tau < 2; ++tau) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[b][tau][r] = 0u;
    }
  }

  const int ks = p.k / 128;
  const uint32_t ring_end = base + stages * stage_bytes;
  for (int s = 0; s < stages - 2; ++s) {
    if (s < ks) issue(base + s * stage_bytes, s);
    CopyCommit();
  }
  uint32_t sb = base, ahead_sb = base + (stages - 2) * stage_bytes;  // ring slots of stage s and of s + stages - 2
  for (int s = 0; s < ks; ++s) {
    CopyWaitDyn(stages - 3);  // this thread's copies of stage s have landed
    if (!kSync) ProxyFence();
    __syncthreads();          // everyone's; and every wgmma of stage s - 2 is done (wait_group kDepth - 1 < 8)
    const bool refill = s + stages - 2 < ks;  // stage s + stages - 2 into ring slot fill_sb (4 parts below if kSpread)
    const uint32_t fill_sb = ahead_sb;
    if (!kSpread && refill) issue(fill_sb, s + stages - 2);
    ahead_sb += stage_bytes;
    if (ahead_sb == ring_end) ahead_sb = base;
    uint4 wv[4];
    __nv_bfloat162 sc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      wv[i] = LoadShared16(sb + (i * kTileThreads + tid) * 16);
      const uint32_t bits = LoadShared2(sb + kTileW + (warp * 32 + 4 * g + i) * 8 + 2 * t);
      sc[i] = BitsBf2(bits | (bits << 16));
    }
    const uint32_t desc0 = static_cast<uint32_t>(KMajorDesc(sb + kTileX));  // its low word; k-step j adds (j / 4)
                                                                                // panels + 32 (j % 4) bytes, >> 4
    const uint32_t xb = sb + kTileX;
    sb += stage_bytes;
    if (sb == ring_end) sb = base;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t(&aj)[2][4] = a[j % kDepth];
      const int hs = 2 * (j & 1);
#pragma unroll
      for (int tau = 0; tau < 2; ++tau) {
        const uint32_t w0 = Word(wv[2 * tau], j >> 1), w1 = Word(wv[2 * tau + 1], j >> 1);
        aj[tau][0] = Dequant(w0, hs, sc[2 * tau]);
        aj[tau][1] = Dequant(w1, hs, sc[2 * tau + 1]);
        aj[tau][2] = Dequant(w0, hs + 1, sc[2 * tau]);
        aj[tau][3] = Dequant(w1, hs + 1, sc[2 * tau + 1]);
      }
      if (kSync) {
        const uint32_t pb = xb + (j >> 2) * panel;
        const int c0 = 2 * (j & 3);
#pragma unroll
        for (int jj = 0; jj < N / 8; jj += 2) {
          uint32_t b[4];
          if (jj + 1 < N / 8) {
            const int q = lane >> 3, r = lane & 7, n = 8 * (jj + (q >> 1)) + r, c = c0 + (q & 1);
            Ldsm4(b, pb + n * 128 + ((c ^ r) << 4));
          } else {
            const int q = (lane >> 3) & 1, r = lane & 7, n = 8 * jj + r, c = c0 + q;
            Ldsm2(b, pb + n * 128 + ((c ^ r) << 4));
          }
#pragma unroll
          for (int tau = 0; tau < 2; ++tau) {
            MmaAt(&acc[tau][4 * jj], aj[tau], b[0], b[1]);
            if (jj + 1 < N / 8) MmaAt(&acc[tau][4 * (jj + 1)], aj[tau], b[2], b[3]);
          }
        }
        if (kSpread && j < 4 && refill) issue_part(fill_sb, s + stages - 2, j);
      } else {
        const uint64_t desc =
            (KMajorDesc(0) & ~uint64_t{0xffffffffu}) | (desc0 + (((j >> 2) * panel + (j & 3) * 32) >> 4));
        WgmmaFence();
        Wgmma<N>::Run(acc[0], aj[0], desc);
        Wgmma<N>::Run(acc[1], aj[1], desc);
        WgmmaCommit();
        if (kSpread && j < 4 && refill) issue_part(fill_sb, s + stages - 2, j);
        WgmmaWait<kDepth - 1>();  // k-step j + 1 - kDepth is done: its fragments may be rewritten next
        Pin(a[(j + 1) % kDepth]);
      }
    }
    CopyCommit();  // one group per stage, empty past the last
  }
  if (!kSync) WgmmaWait<0>();
  Pin(acc[0]);
  Pin(acc[1]);
  CopyWait<0>();
  __syncthreads();  // the ring is free: stage the output tile there

  // Accumulator 4 jj + c of tile tau: row 16 wq + g + 8 (c >> 1) of the tile, token 8 jj + 2 t + (c & 1).
  constexpr int kCols = kGated ? 128 : 256;
  constexpr int kPitch = 2 * kCols + 16;
#pragma unroll
  for (int jj = 0; jj < N / 8; ++jj) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int n = 8 * jj + 2 * t + (c & 1), r = 16 * wq + g + 8 * (c >> 1);
      const uint32_t row = base + n * kPitch;
      if (kGated) {
        const float v = Silu(acc[0][4 * jj + c]) * acc[1][4 * jj + c];
        StoreShared2(row + 2 * TileLogical(64 * wg + r), __bfloat16_as_ushort(__float2bfloat16_rn(v)));
      } else {
#pragma unroll
        for (int tau = 0; tau < 2; ++tau) {
          StoreShared2(row + 2 * (128 * wg + 64 * tau + r),
                       __bfloat16_as_ushort(__float2bfloat16_rn(acc[tau][4 * jj + c])));
        }
      }
    }
  }
  __syncthreads();
  constexpr int kPieces = kCols / 8;  // 16-byte pieces per row
  const int64_t col0 = static_cast<int64_t>(kCols) * rt;
  for (int idx = tid; idx < ntok * kPieces; idx += kTileThreads) {
    const int n = idx / kPieces, c = idx % kPieces;
    const uint4 v = LoadShared16(base + n * kPitch + 16 * c);
    *reinterpret_cast<uint4*>(p.dst + static_cast<int64_t>(s_dst[n]) * p.rows + col0 + 8 * c) = v;
  }
}

// kMaxN: the largest token tile the instance holds (128; 32 for the narrow tiles of BM = 16 or 32, whose instances
// fit in 128 registers, so that two blocks share an SM).
template <bool kGated, bool kSync, int kDepth, int kMaxN>
__global__ void __launch_bounds__(kTileThreads, kMaxN <= 32 ? 2 : 1) TileKernel(const TileParams p) {
  extern __shared__ __align__(16) unsigned char tile_smem[];
  __shared__ int s_src[kMaxN];  // B row of each token (slot / k or slot)
  __shared__ int s_dst[kMaxN];  // output row (slot) of each token (-1: padding)
  const int tid = threadIdx.x;
  const int tile = blockIdx.x / p.row_tiles, rt = blockIdx.x - tile * p.row_tiles;
  const int e = p.block_expert[tile];
  if (e < 0) return;  // uniform over the block
  int ok = 0;
  if (tid < p.bt) {
    const int slot = p.sorted[static_cast<int64_t>(tile) * p.bt + tid];
    ok = slot >= 0 && slot < p.slots;
    s_dst[tid] = ok ? slot : -1;
    s_src[tid] = ok ? slot / p.src_div : 0;
  }
  const int ntok = __syncthreads_count(ok);  // the real slots come first in a tile
  const uint32_t base = (SmemAddress(tile_smem) + 1023u) & ~1023u;
  if (ntok <= 8) {
    TileBlock<8, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
  } else if (ntok <= 16) {
    TileBlock<16, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
  } else if (ntok <= 24 && (p.flags & kFlagFine)) {
    TileBlock<24, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
  } else if (kMaxN <= 32 || ntok <= 32) {
    TileBlock<32, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
  } else if constexpr (kMaxN > 32) {
    if (ntok <= 48) {
      TileBlock<48, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
    } else if (ntok <= 64) {
      TileBlock<64, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
    } else if (ntok <= 80) {
      TileBlock<80, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
    } else if (ntok <= 96) {
      TileBlock<96, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
    } else if (ntok <= 112) {
      TileBlock<112, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
    } else {
      TileBlock<128, kGated, kSync, kDepth>(p, e, rt, ntok, base, s_src, s_dst);
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

// The same for bf16 with D a multiple of 8: one thread per 8 consecutive outputs (16-byte loads and stores); the
// same fixed order and fp32 arithmetic, so the same bits.
__global__ void CombineKernel8(const __nv_bfloat16* __restrict__ ys, const int32_t* __restrict__ ids,
                               const float* __restrict__ weights, int64_t m, int topk, int experts, int d,
                               __nv_bfloat16* __restrict__ out) {
  GridDependencyWait();  // ys (a programmatic dependent of the stream path's gemm2)
  const int pieces = d / 8;
  const int64_t n = m * pieces;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / pieces, col = 8 * (i % pieces);
    float sum[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) sum[q] = 0.0f;
    for (int j0 = 0; j0 < topk; j0 += 4) {  // 4 slots' loads in flight at a time, summed in slot order
      bool ok[4];
      float w[4];
      uint4 v[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int e = j0 + r < topk ? ids[row * topk + j0 + r] : -1;
        ok[r] = e >= 0 && e < experts;
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t slot = row * topk + j0 + r;
        w[r] = ok[r] ? weights[slot] : 0.0f;
        v[r] = ok[r] ? LoadGlobal16Cg(ys + slot * d + col) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (!ok[r]) continue;
        const uint32_t u[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 f = __bfloat1622float2(BitsBf2(u[q]));
          sum[2 * q] += w[r] * f.x;
          sum[2 * q + 1] += w[r] * f.y;
        }
      }
    }
    uint32_t o[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) o[q] = Bf2Bits(__floats2bfloat162_rn(sum[2 * q], sum[2 * q + 1]));
    *reinterpret_cast<uint4*>(out + row * d + col) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Fused decode path (target kdtree_marlin_moe_fused): the whole MoE of a few tokens in one kernel
// ------------------------------------------------------------------------------------------------------------------
//
// For one device's share at decode and small tree verifies (M k <= 256 slots, a few local experts), the stream
// path's four launches (align, gate/up, down, combine) each take 3-20 us while the bytes they move take ~5 us in
// all. This kernel does the same function in one launch of resident blocks (every block on the GPU at once):
//   1. every block sorts the slots by expert itself (stable, in shared memory) into units of at most 8 slots of
//      one expert (the mma's 8 token columns);
//   2. gate/up: a warp's item is 16 rows of gate and the same 16 of up, for one unit, over 512 inputs (lane (g, t)
//      reads groups 4 t .. 4 t + 3 of the item, 64 contiguous bytes, of rows g and g + 8); its fp32 partial sums
//      go to p1, and the warp that completes a (unit, 16 rows) tile (a counter per tile) sums the D / 512 partials
//      in order (all loads in flight at once) and writes h = silu(gate) * up in bf16;
//   3. a grid barrier (the blocks are resident: their count comes from the occupancy), with each warp's first down
//      weights already loading;
//   4. down: a warp's item is 16 rows of down for one unit over 512 of the F inputs, partials to p2; the warp that
//      completes a 16-row tile over every unit sums, for each token, its slots j in ascending order:
//      out[m, d] = sum_j w[m, j] bf16(sum of the F / 512 partials of slot j).
// Weights are dequantized to bf16 before the mma ((q - 8) s rounded once, as the reference and the tile path do),
// so an mma step may span groups. h and the per-slot outputs are rounded to bf16 like the other paths' scratch.
// Every sum has a fixed order: the result is bitwise reproducible. The counters (one for the barrier, one per
// gate/up tile, one per down tile) are cleared by a memset before the launch.
constexpr int kFusedWarps = 8;
constexpr int kFusedThreads = 32 * kFusedWarps;
constexpr int kFusedMaxSlots = kFusedThreads;  // one thread per slot while sorting
constexpr int kFusedPieces = 4;                // 16-byte pieces (groups of 32 inputs) per row per lane of an item
constexpr int kFusedSpan = 4 * 32 * kFusedPieces;  // inputs per item: 512
constexpr int kFusedMaxSplit = 16;             // D / 512 and F / 512 at most (D, F <= 8192): unrolled sums

struct FusedParams {
  const __nv_bfloat16* x;  // [M, D]
  const int32_t* ids;      // [M, k]
  const float* weights;    // [M, k]
  const uint32_t* gq;      // [E, F, D/8]
  const uint32_t* uq;
  const __nv_bfloat16* gs;  // [E, F, D/32]
  const __nv_bfloat16* us;
  const uint32_t* dq;       // [E, D, F/8]
  const __nv_bfloat16* ds;  // [E, D, F/32]
  __nv_bfloat16* out;       // [M, D]
  float* p1;                // [S, D/512, 2, F]
  __nv_bfloat16* h;         // [S, F]
  float* p2;                // [S, F/512, D]
  unsigned* counters;       // [1 + S F/16 + D/16], zero at launch
  int m, k, e, d, f, slots;
};

__device__ __forceinline__ uint4 LoadWeight16(const void* ptr) { return LoadStream16(ptr, true); }

__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Scale i (0 .. 3) of four bf16 scales as the pair (s, s).
__device__ __forceinline__ __nv_bfloat162 ScalePair(const uint2& four, int i) {
  const uint32_t two = i < 2 ? four.x : four.y;
  return BitsBf2(Prmt(two, two, i % 2 == 0 ? 0x1010u : 0x3232u));
}

// Rows r and r + 8 of a packed [rows, cols/8] matrix at this lane's 4 groups (the first grp), with their scales.
struct Rows {
  uint4 w[2][kFusedPieces];
  uint2 sc[2];
};
__device__ __forceinline__ void LoadRows(Rows& r, const uint32_t* q, const __nv_bfloat16* s, int64_t row, int cols,
                                         int grp) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t at = row + 8 * half;
    const uint32_t* src = q + at * (cols / 8) + 4 * grp;
#pragma unroll
    for (int c = 0; c < kFusedPieces; ++c) r.w[half][c] = LoadWeight16(src + 4 * c);
    r.sc[half] = __ldg(reinterpret_cast<const uint2*>(s + at * (cols / 32) + grp));
  }
}

// The 32 inputs of group `piece` of this lane's token (or h) row; zeros for a column without a slot.
__device__ __forceinline__ void LoadPiece(uint4 (&tok)[4], const __nv_bfloat16* row, int piece, bool valid, bool cg) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat16* p = row + 32 * piece + 8 * i;
    tok[i] = !valid ? make_uint4(0, 0, 0, 0) : cg ? LoadGlobal16Cg(p) : LoadGlobal16Nc(p);
  }
}

// acc += W x over one piece: step (word, h) gives lane (g, t) nibbles (2h, 2h + 4) and (2h + 1, 2h + 5) of word
// `word` of rows g and g + 8 (the k order is free as long as the tokens' values sit at the same inputs).
__device__ __forceinline__ void PieceMma(float (&acc)[4], const Rows& r, int c, const uint4 (&tok)[4]) {
  const __nv_bfloat162 s0 = ScalePair(r.sc[0], c), s1 = ScalePair(r.sc[1], c);
#pragma unroll
  for (int wd = 0; wd < 4; ++wd) {
    const uint32_t lo = Word(r.w[0][c], wd), hi = Word(r.w[1][c], wd);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t xa = Word(tok[wd], hh), xb = Word(tok[wd], hh + 2);
      Mma(acc, Dequant(lo, 2 * hh, s0), Dequant(hi, 2 * hh, s1), Dequant(lo, 2 * hh + 1, s0),
          Dequant(hi, 2 * hh + 1, s1), Prmt(xa, xb, 0x5410u), Prmt(xa, xb, 0x7632u));
    }
  }
}

// One count on *counter for this warp, after its writes (the warp's barrier orders its lanes' writes before lane
// 0's count, a GPU-scope acquire-release atomic, as CUTLASS's split-K semaphores do with a block barrier); true in
// the warp that counted last of `of`, which then sees every counted warp's writes (through L2: ld.cg).
__device__ __forceinline__ bool CountLast(unsigned* counter, unsigned of, int lane) {
  __syncwarp();
  unsigned old = 0;
  if (lane == 0) asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  const bool last = __shfl_sync(0xffffffffu, old, 0) == of - 1;
  __syncwarp();
  return last;
}

// sum_{q < n} src[q * stride] in order q = 0, 1, ..., every load issued before the first add (n <= kFusedMaxSplit).
__device__ __forceinline__ float SumSplits(const float* src, int n, int64_t stride) {
  float v[kFusedMaxSplit];
#pragma unroll
  for (int q = 0; q < kFusedMaxSplit; ++q) v[q] = q < n ? __ldcg(src + q * stride) : 0.0f;
  float sum = 0.0f;
#pragma unroll
  for (int q = 0; q < kFusedMaxSplit; ++q) sum += q < n ? v[q] : 0.0f;
  return sum;
}

__global__ void __launch_bounds__(kFusedThreads, 2) FusedMoeKernel(const FusedParams p) {
  __shared__ int id_s[kFusedMaxSlots];      // slot -> its expert, or -1
  __shared__ int pos_s[kFusedMaxSlots];     // slot -> its place in expert order, or -1
  __shared__ int slot_s[kFusedMaxSlots];    // place -> slot
  __shared__ int first_s[kFusedMaxSlots + 1];  // unit -> its first place (and one past the last unit)
  __shared__ int expert_s[kFusedMaxSlots];  // unit -> expert
  __shared__ int within_s[kFusedMaxSlots], expert_at_s[kFusedMaxSlots];  // place -> rank in its expert, expert
  __shared__ int warp_units_s[kFusedWarps];
  __shared__ int units_s;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int S = p.slots, D = p.d, F = p.f, E = p.e;

  // 1. Slots in expert order (ties: the lower slot), units of at most 8 places of one expert.
  {
    int e = -1;
    if (tid < S) {
      e = p.ids[tid];
      e = e >= 0 && e < E ? e : -1;
      id_s[tid] = e;
    }
    __syncthreads();
    int place = 0, within = 0;
    if (e >= 0) {
      for (int s = 0; s < S; ++s) {
        const int o = id_s[s];
        place += o >= 0 && (o < e || (o == e && s < tid));
        within += o == e && s < tid;
      }
    }
    if (tid < S) pos_s[tid] = e >= 0 ? place : -1;
    if (e >= 0) {
      slot_s[place] = tid;
      within_s[place] = within;
      expert_at_s[place] = e;
    }
    const int valid = __syncthreads_count(e >= 0);
    const bool starts = tid < valid && within_s[tid] % 8 == 0;  // a unit starts at every 8th place of a run
    const unsigned ballot = __ballot_sync(0xffffffffu, starts);
    if (lane == 0) warp_units_s[warp] = __popc(ballot);
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) before += warp_units_s[w];
    if (starts) {
      const int u = before + __popc(ballot & ((1u << lane) - 1u));
      first_s[u] = tid;
      expert_s[u] = expert_at_s[tid];
    }
    if (tid == kFusedThreads - 1) {
      const int units = before + warp_units_s[warp];
      first_s[units] = valid;
      units_s = units;
    }
    __syncthreads();
  }
  const int U = units_s;
  if (U == 0) {  // no slot has a local expert: the output is zeros (every block returns here, before the barrier)
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kFusedThreads + tid; i < static_cast<int64_t>(p.m) * D;
         i += static_cast<int64_t>(gridDim.x) * kFusedThreads) {
      p.out[i] = __float2bfloat16_rn(0.0f);
    }
    return;
  }
  const int T1 = F / 16, S1 = D / kFusedSpan, T2 = D / 16, S2 = F / kFusedSpan;
  const int gw = blockIdx.x * kFusedWarps + warp, nw = gridDim.x * kFusedWarps;
  unsigned* const barrier = p.counters;
  unsigned* const tiles1 = p.counters + 1;
  unsigned* const tiles2 = p.counters + 1 + S * T1;

  // 2. gate / up.
  const int n1 = U * T1 * S1;
  for (int it = gw; it < n1; it += nw) {
    const int sl = it % S1, tile = (it / S1) % T1, u = it / S1 / T1;
    const int e = expert_s[u], first = first_s[u], count = min(first_s[u + 1] - first, 8);
    const int grp = sl * (kFusedSpan / 32) + kFusedPieces * t;
    const int64_t row = static_cast<int64_t>(e) * F + tile * 16 + g;
    Rows wg, wu;
    LoadRows(wg, p.gq, p.gs, row, D, grp);
    LoadRows(wu, p.uq, p.us, row, D, grp);
    const bool has = g < count;
    const __nv_bfloat16* xrow = p.x + static_cast<int64_t>(has ? slot_s[first + g] / p.k : 0) * D + 32 * grp;
    float ag[4] = {0.0f, 0.0f, 0.0f, 0.0f}, au[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int c = 0; c < kFusedPieces; ++c) {  // the tokens from L1 (every warp reads them), a piece at a time
      uint4 tok[4];
      LoadPiece(tok, xrow, c, has, false);
      PieceMma(ag, wg, c, tok);
      PieceMma(au, wu, c, tok);
    }
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {  // accumulator cc: column 2 t + cc, rows g (cc) and g + 8 (2 + cc)
      const int col = 2 * t + cc;
      if (col < count) {
        float* dst = p.p1 + (static_cast<int64_t>(first + col) * S1 + sl) * 2 * F + tile * 16 + g;
        dst[0] = ag[cc];
        dst[8] = ag[2 + cc];
        dst[F] = au[cc];
        dst[F + 8] = au[2 + cc];
      }
    }
    if (CountLast(tiles1 + u * T1 + tile, S1, lane)) {  // lanes: 16 rows x 2 columns at a time
      const int r = tile * 16 + lane % 16;
      for (int col = lane / 16; col < count; col += 2) {
        const float* src = p.p1 + static_cast<int64_t>(first + col) * S1 * 2 * F + r;
        const float gsum = SumSplits(src, S1, 2 * F), usum = SumSplits(src + F, S1, 2 * F);
        p.h[static_cast<int64_t>(first + col) * F + r] = __float2bfloat16_rn(Silu(gsum) * usum);
      }
    }
  }

  // 3. The first down item's weights start loading, then every block waits for every h.
  const int n2 = U * T2 * S2;
  Rows wd;
  if (gw < n2) {
    const int sl = gw % S2, u = (gw / S2) % U, tile = gw / S2 / U;
    LoadRows(wd, p.dq, p.ds, static_cast<int64_t>(expert_s[u]) * D + tile * 16 + g, F,
             sl * (kFusedSpan / 32) + kFusedPieces * t);
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    atomicAdd(barrier, 1u);
    // every block is resident (the grid is the occupancy's), so the wait ends; a wait of seconds means it is not,
    // and trapping (an error the caller sees) beats hanging the stream
    for (long long spins = 0; *reinterpret_cast<volatile unsigned*>(barrier) < gridDim.x; ++spins) {
      if (spins > (1ll << 31)) __trap();
    }
    __threadfence();
  }
  __syncthreads();

  // 4. down, and the combine by the warp that completes each 16-row tile.
  for (int it = gw; it < n2; it += nw) {
    const int sl = it % S2, u = (it / S2) % U, tile = it / S2 / U;
    const int first = first_s[u], count = min(first_s[u + 1] - first, 8);
    const int grp = sl * (kFusedSpan / 32) + kFusedPieces * t;
    if (it != gw) LoadRows(wd, p.dq, p.ds, static_cast<int64_t>(expert_s[u]) * D + tile * 16 + g, F, grp);
    const bool has = g < count;
    const __nv_bfloat16* hrow = p.h + static_cast<int64_t>(first + (has ? g : 0)) * F + 32 * grp;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint4 tok[2][4];  // h from L2 (written in this launch), a piece ahead of its use
    LoadPiece(tok[0], hrow, 0, has, true);
#pragma unroll
    for (int c = 0; c < kFusedPieces; ++c) {
      if (c + 1 < kFusedPieces) LoadPiece(tok[(c + 1) % 2], hrow, c + 1, has, true);
      PieceMma(acc, wd, c, tok[c % 2]);
    }
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int col = 2 * t + cc;
      if (col < count) {
        float* dst = p.p2 + (static_cast<int64_t>(first + col) * S2 + sl) * D + tile * 16 + g;
        dst[0] = acc[cc];
        dst[8] = acc[2 + cc];
      }
    }
    if (CountLast(tiles2 + tile, static_cast<unsigned>(U * S2), lane)) {
      for (int i = lane; i < 16 * p.m; i += 32) {
        const int r = tile * 16 + i % 16, m = i / 16;
        float sum = 0.0f;
        for (int j = 0; j < p.k; ++j) {
          const int slot = m * p.k + j, place = pos_s[slot];
          if (place < 0) continue;
          const float y = SumSplits(p.p2 + static_cast<int64_t>(place) * S2 * D + r, S2, D);
          sum += p.weights[slot] * __bfloat162float(__float2bfloat16_rn(y));
        }
        p.out[static_cast<int64_t>(m) * D + r] = __float2bfloat16_rn(sum);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Handler
// ------------------------------------------------------------------------------------------------------------------

// GEMV decode path (flag bit 11; bf16, group 32, D and F multiples of 1024, at most kGemvSlots slots): no align, two
// launches, the dots on the tensor cores with the token as the mma's 8-column operand. A block owns 16 weight rows
// (gemv1: the gate and the up rows of 8 consecutive f; gemv2: 16 rows d of down) and splits their inputs over its
// warps; each warp copies its [16 rows x its inputs] of packed nibbles and their scales into shared memory with
// cp.async (no registers held while the bytes are in flight), then, a group of 32 inputs at a time:
//   * ldmatrix gives lane (g, c) word c of the group (nibbles 8c .. 8c + 7) of rows g and g + 8, two groups a load;
//   * each word becomes four bf16 pairs 128 + q by a shift and one lop3 (BiasedPair: nibbles s and s + 4 of the
//     word), the A fragments of two m16n8k16 mmas; the token's 8 inputs of chunk c, staged in shared memory as bf16 in
//     the same order (x0 x4 x1 x5 x2 x6 x3 x7), are the B fragments (every column the same token);
//   * the two mmas add sum_j x_j (128 + q_j) over the group, in fp32, onto -136 sum_j x_j (the group sums of x
//     precomputed), which leaves sum_j x_j (q_j - 8), and the lane adds s_g times that for its two rows: the
//     arithmetic of the CUDA-core version this replaced (and of the stream path), with the tensor core doing the 32
//     multiply-adds.
// The warps' sums are added in a fixed order through shared memory; h and ys are rounded to bf16 as the reference
// rounds them, and gemv2 sums a token's slots in slot order, as CombineKernel8 does. ~1 instruction a weight where
// the CUDA-core version this replaced needed ~2.5, yet the same time (H100, 2026-12-06: both are bound by the chain
// of latencies from the router's ids to the block's sums, not by instructions); a token's local slots run one after
// another in a block.
constexpr int kGemvSlots = 64;
constexpr int kUpWarps = 8;    // gemv1: the D inputs over 8 warps
constexpr int kDownWarps = 4;  // gemv2: the F inputs over 4 warps
constexpr int kTcRows = 16;    // weight rows a block (the mma's M)

// A warp's row of `groups` 16-byte groups in shared memory, padded to an odd count of 16-byte chunks so that
// ldmatrix's eight row reads fall in eight different 16-byte bank groups.
__host__ __device__ constexpr int RowChunks(int groups) { return groups | 1; }

// Shared-memory bytes of a GEMV block: the staged row (bf16) and its group offsets (fp32), then per warp its
// [16 x groups] nibbles (padded rows) and [16 x groups] bf16 scales, then the warps' sums [warps x 16] (fp32).
__host__ __device__ constexpr int GemvSmem(int inputs, int warps) {
  return 2 * inputs + 4 * (inputs / 32) +
         warps * (kTcRows * RowChunks(inputs / 32 / warps) * 16 + kTcRows * (inputs / 32 / warps) * 2) +
         4 * warps * kTcRows;
}

struct GemvParams {
  const uint32_t* gate_q;       // [E, F, D/8]
  const uint32_t* up_q;
  const uint32_t* down_q;       // [E, D, F/8]
  const __nv_bfloat16* gate_s;  // [E, F, D/32]
  const __nv_bfloat16* up_s;
  const __nv_bfloat16* down_s;  // [E, D, F/32]
  const __nv_bfloat16* x;       // [M, D]
  const int32_t* ids;           // [M, k]
  const float* weights;         // [M, k]
  __nv_bfloat16* h;             // [S, F]
  __nv_bfloat16* out;           // [M, D]
  int e, d, f, topk, slots;
};

__device__ __forceinline__ bool LocalExpert(int e, int experts) { return e >= 0 && e < experts; }

// The block's shared memory carved as GemvSmem lays it out, for `inputs` inputs over `warps` warps.
struct GemvSmemMap {
  uint32_t v;       // staged row: inputs bf16, each 8-input chunk as x0 x4 x1 x5 x2 x6 x3 x7
  float* off;       // [inputs / 32]: -136 x the group's sum of the staged row
  uint32_t w;       // this warp's nibbles [16][RowChunks(groups)] x 16 bytes
  uint32_t s;       // this warp's scales [16][groups] bf16
  float* red;       // [warps][16]
};

__device__ __forceinline__ GemvSmemMap CarveGemv(uint8_t* base, int inputs, int warps, int warp) {
  const int groups = inputs / 32 / warps;
  const int wbytes = kTcRows * RowChunks(groups) * 16, sbytes = kTcRows * groups * 2;
  uint8_t* wbase = base + 2 * inputs + 4 * (inputs / 32);
  GemvSmemMap m;
  m.v = SmemAddress(base);
  m.off = reinterpret_cast<float*>(base + 2 * inputs);
  m.w = SmemAddress(wbase + warp * (wbytes + sbytes));
  m.s = m.w + wbytes;
  m.red = reinterpret_cast<float*>(wbase + warps * (wbytes + sbytes));
  return m;
}

// Where a warp's 16 weight rows start: rows 0-7 at lo + r * q_stride words (scales lo_s + r * s_stride), rows 8-15
// at hi / hi_s the same way; every pointer already at the warp's first input.
struct TcRowSource {
  const uint32_t *lo, *hi;
  const __nv_bfloat16 *lo_s, *hi_s;
  int64_t q_stride, s_stride;
};

// This warp's cp.async copies of its kGroups groups of the 16 rows (and their scales) into its shared memory,
// committed as one group.
template <int kGroups>
__device__ __forceinline__ void CopyRows(const GemvSmemMap& m, const TcRowSource& src, int lane) {
#pragma unroll
  for (int i = lane; i < kTcRows * kGroups; i += 32) {
    const int r = i / kGroups, g = i % kGroups;
    CopyAsync16Cg(m.w + (r * RowChunks(kGroups) + g) * 16, (r < 8 ? src.lo : src.hi) + (r % 8) * src.q_stride + 4 * g);
  }
#pragma unroll
  for (int i = lane; i < kTcRows * kGroups / 4; i += 32) {  // 8 bytes: four groups' scales
    const int r = i / (kGroups / 4), q = i % (kGroups / 4);
    CopyAsync8(m.s + (r * kGroups + 4 * q) * 2, (r < 8 ? src.lo_s : src.hi_s) + (r % 8) * src.s_stride + 4 * q);
  }
  CopyCommit();
}

// The warp's 16 rows . v over its kGroups groups (group0 = its first group of the staged row): tot[0] for row g,
// tot[1] for row g + 8 (lane = 4 g + c); every lane of a quad ends with the same two sums.
template <int kGroups>
__device__ __forceinline__ void TcRowDots(const GemvSmemMap& m, int group0, int lane, float (&tot)[2]) {
  const int g = lane >> 2, c = lane & 3, q = lane >> 3;
  const uint32_t rows = m.w + (((q & 1) * 8 + (lane & 7)) * RowChunks(kGroups) + (q >> 1)) * 16;
  tot[0] = tot[1] = 0.0f;
#pragma unroll 2
  for (int j = 0; j < kGroups; j += 2) {
    uint32_t r[4];
    Ldsm4(r, rows + 16 * j);  // rows g, g + 8 of group j, then of group j + 1
    const uint32_t s0 = LoadShared4(m.s + (g * kGroups + j) * 2), s1 = LoadShared4(m.s + ((g + 8) * kGroups + j) * 2);
    const float2 o = *reinterpret_cast<const float2*>(m.off + group0 + j);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 b = LoadShared16(m.v + ((group0 + j + h) * 4 + c) * 16);
      const uint32_t lo = r[2 * h], hi = r[2 * h + 1];
      const float off = h == 0 ? o.x : o.y;
      float d[4] = {off, off, off, off};  // -136 sum_j x_j
      Mma(d, BiasedPair(lo), BiasedPair(hi), BiasedPair(lo >> 4), BiasedPair(hi >> 4), b.x, b.y);
      Mma(d, BiasedPair(lo >> 8), BiasedPair(hi >> 8), BiasedPair(lo >> 12), BiasedPair(hi >> 12), b.z, b.w);
      const float sg = __uint_as_float(h == 0 ? s0 << 16 : s0 & 0xFFFF0000u);
      const float sg8 = __uint_as_float(h == 0 ? s1 << 16 : s1 & 0xFFFF0000u);
      tot[0] = fmaf(sg, d[0], tot[0]);
      tot[1] = fmaf(sg8, d[2], tot[1]);
    }
  }
}

// Once this warp's copies have landed: its 16 rows' sums over its inputs into m.red[warp] (rows g and g + 8 from the
// first lane of each quad), then a block barrier, after which m.red holds every warp's sums.
template <int kGroups>
__device__ __forceinline__ void WarpSumsToShared(const GemvSmemMap& m, int warp, int lane) {
  CopyWait<0>();
  __syncwarp();
  float tot[2];
  TcRowDots<kGroups>(m, warp * kGroups, lane, tot);
  if ((lane & 3) == 0) {
    m.red[warp * kTcRows + lane / 4] = tot[0];
    m.red[warp * kTcRows + lane / 4 + 8] = tot[1];
  }
  __syncthreads();
}

// Stage `n` bf16 values (n a multiple of 32, at most 4 x 8 x the block's threads) into m.v, each 8-value chunk as
// x0 x4 x1 x5 x2 x6 x3 x7 (the B fragments' order), and -136 x each group's fp32 sum into m.off; block-wide. A group's
// four chunks are four neighbouring threads', summed by two shuffles.
__device__ __forceinline__ void StageBf16(const __nv_bfloat16* src, int n, const GemvSmemMap& m) {
  __syncthreads();  // the previous slot's reads are done
  uint4 got[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int at = threadIdx.x + i * blockDim.x;
    got[i] = 8 * at < n ? LoadGlobal16Cg(src + 8 * at) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int at = threadIdx.x + i * blockDim.x;
    const uint32_t words[4] = {got[i].x, got[i].y, got[i].z, got[i].w};
    float f[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 two = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[j]));
      f[2 * j] = two.x;
      f[2 * j + 1] = two.y;
    }
    float sum = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (8 * at < n) {
      const uint4 perm = make_uint4(__byte_perm(got[i].x, got[i].z, 0x5410), __byte_perm(got[i].x, got[i].z, 0x7632),
                                    __byte_perm(got[i].y, got[i].w, 0x5410), __byte_perm(got[i].y, got[i].w, 0x7632));
      StoreShared16(m.v + 16 * at, perm);
      if (at % 4 == 0) m.off[at / 4] = -136.0f * sum;
    }
  }
  __syncthreads();
}

// grid F / 8 blocks of 8 warps: block b owns f = 8 b .. 8 b + 7 (rows 0-7 of its tile the gate rows, 8-15 the up
// rows), warp w inputs [w D / 8, (w + 1) D / 8); for every slot of a local expert it writes h[slot, f].
template <int kGroups>  // D / 256: groups a warp
__global__ void __launch_bounds__(32 * kUpWarps, 2) GemvUpKernel(const GemvParams p) {
  extern __shared__ __align__(16) uint8_t gsm[];
  __shared__ int ids_s[kGemvSlots];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, f0 = blockIdx.x * 8;
  const GemvSmemMap m = CarveGemv(gsm, p.d, kUpWarps, warp);
  GridDependencyWait();
  LaunchDependents();
  if (threadIdx.x < p.slots) ids_s[threadIdx.x] = p.ids[threadIdx.x];  // every slot's expert, one load each
  __syncthreads();
  int staged = -1;
  for (int slot = 0; slot < p.slots; ++slot) {
    const int e = ids_s[slot];
    if (!LocalExpert(e, p.e)) continue;
    const int64_t row = static_cast<int64_t>(e) * p.f + f0;  // the gate and up rows f0 .. f0 + 7
    const int64_t q0 = row * (p.d / 8) + warp * kGroups * 4, s0 = row * (p.d / 32) + warp * kGroups;
    const TcRowSource src{p.gate_q + q0, p.up_q + q0, p.gate_s + s0, p.up_s + s0, p.d / 8, p.d / 32};
    CopyRows<kGroups>(m, src, lane);  // (this warp read its previous slot's rows before the sums below)
    const int tok = slot / p.topk;
    if (tok != staged) {  // the slot's token row (all of a token's slots share it)
      StageBf16(p.x + static_cast<int64_t>(tok) * p.d, p.d, m);
      staged = tok;
    }
    WarpSumsToShared<kGroups>(m, warp, lane);
    if (threadIdx.x < 8) {
      float gs = 0.0f, us = 0.0f;
#pragma unroll
      for (int w = 0; w < kUpWarps; ++w) {
        gs += m.red[w * kTcRows + threadIdx.x];
        us += m.red[w * kTcRows + threadIdx.x + 8];
      }
      const float g = __bfloat162float(__float2bfloat16_rn(gs)), u = __bfloat162float(__float2bfloat16_rn(us));
      const float silu = __bfloat162float(__float2bfloat16_rn(g / (1.0f + __expf(-g))));
      p.h[static_cast<int64_t>(slot) * p.f + f0 + threadIdx.x] = __float2bfloat16_rn(silu * u);
    }
    __syncthreads();  // the sums are read before the next slot's (of the same token: no restaging) are written
  }
}

// The 16 down rows d0 .. of expert e, this warp's inputs, copied (cp.async, committed).
template <int kGroups>
__device__ __forceinline__ void CopyDownRows(const GemvParams& p, const GemvSmemMap& m, int e, int d0, int warp,
                                             int lane) {
  const int64_t row = static_cast<int64_t>(e) * p.d + d0;
  const int64_t q0 = row * (p.f / 8) + warp * kGroups * 4, s0 = row * (p.f / 32) + warp * kGroups;
  const TcRowSource src{p.down_q + q0, p.down_q + q0 + 8 * (p.f / 8), p.down_s + s0, p.down_s + s0 + 8 * (p.f / 32),
                        p.f / 8, p.f / 32};
  CopyRows<kGroups>(m, src, lane);
}

// grid D / 16 blocks of 4 warps: block b computes out[t, d] for d = 16 b .. + 15 and every token t, the combine
// included: the sum over t's slots of a local expert, in slot order and fp32, of weight x ys (ys = h . down rounded
// to bf16), as CombineKernel8 sums it (zeros for a token without one). The router's ids and weights are read, and the
// first local slot's down rows requested, before the wait for gemv1: the router ended before gemv1 passed its own
// wait, and so before this grid could start.
template <int kGroups>  // F / 128: groups a warp
__global__ void __launch_bounds__(32 * kDownWarps, 4) GemvDownKernel(const GemvParams p) {
  extern __shared__ __align__(16) uint8_t gsm[];
  __shared__ int ids_s[kGemvSlots];
  __shared__ float wts_s[kGemvSlots];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, d0 = blockIdx.x * kTcRows;
  const GemvSmemMap m = CarveGemv(gsm, p.f, kDownWarps, warp);
  if (threadIdx.x < p.slots) {
    ids_s[threadIdx.x] = p.ids[threadIdx.x];
    wts_s[threadIdx.x] = p.weights[threadIdx.x];
  }
  __syncthreads();
  int first = 0;
  while (first < p.slots && !LocalExpert(ids_s[first], p.e)) ++first;
  if (first < p.slots) CopyDownRows<kGroups>(p, m, ids_s[first], d0, warp, lane);
  GridDependencyWait();  // h (gemv1)
  LaunchDependents();
  const int tokens = p.slots / p.topk;
  for (int tok = 0; tok < tokens; ++tok) {
    float acc = 0.0f;  // thread t < 16: row d0 + t
    for (int j = 0; j < p.topk; ++j) {
      const int slot = tok * p.topk + j, e = ids_s[slot];
      if (!LocalExpert(e, p.e)) continue;
      if (slot != first) CopyDownRows<kGroups>(p, m, e, d0, warp, lane);
      StageBf16(p.h + static_cast<int64_t>(slot) * p.f, p.f, m);
      WarpSumsToShared<kGroups>(m, warp, lane);
      if (threadIdx.x < kTcRows) {
        float ys = 0.0f;
#pragma unroll
        for (int w = 0; w < kDownWarps; ++w) ys += m.red[w * kTcRows + threadIdx.x];
        acc += wts_s[slot] * __bfloat162float(__float2bfloat16_rn(ys));
      }
    }
    if (threadIdx.x < kTcRows) p.out[static_cast<int64_t>(tok) * p.d + d0 + threadIdx.x] = __float2bfloat16_rn(acc);
  }
}

ffi::Error LastError(const char* what) { return kdtree::CudaStatus(cudaGetLastError(), "marlin_moe", what); }

// The shapes of the nine inputs (x, ids, weights, then gate, up and down as packed + scales), checked.
template <typename... Buffers>
ffi::Error MoeShapeOf(kdtree::MoeShape* shape, const Buffers&... inputs) {
  return kdtree::CheckMoeShape(inputs.dimensions()..., shape);
}

// The output set to zeros (no slot has an expert here).
ffi::Error ClearOutput(cudaStream_t stream, ffi::Result<ffi::AnyBuffer>& out) {
  return cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream) == cudaSuccess
             ? ffi::Error::Success()
             : LastError("clearing the output");
}

unsigned GridFor(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

template <typename... Params, typename... Args>
ffi::Error Launch(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t stream, bool pdl,
                  const char* what, Args... args) {
  return kdtree::LaunchKernel(kernel, grid, threads, smem, stream, pdl, "marlin_moe", what, args...);
}

// Blocks of a kernel that fit on the current device at once (occupancy x SMs), queried once per kernel and device
// into known[device] (0: not yet; the calls that take FLAG_PERSIST are the small ones, where host time counts).
constexpr int kDevices = 64;
template <typename Kernel>
ffi::Error ResidentBlocks(Kernel kernel, int threads, int smem, std::atomic<int64_t>* known, int64_t* blocks,
                          int max_per_sm = 0) {  // max_per_sm > 0: at most that many blocks an SM
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return LastError("querying the current device");
  if (device >= 0 && device < kDevices && (*blocks = known[device].load(std::memory_order_relaxed)) > 0) {
    return ffi::Error::Success();
  }
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) {
    return LastError("querying the device's occupancy");
  }
  if (max_per_sm > 0 && per_sm > max_per_sm) per_sm = max_per_sm;
  *blocks = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
  if (device >= 0 && device < kDevices) known[device].store(*blocks, std::memory_order_relaxed);
  return ffi::Error::Success();
}

template <int NT, bool kGated, bool kL2, bool kPersist>
ffi::Error LaunchGemm(cudaStream_t stream, const GemmParams& p, bool pdl, const char* what) {
  auto kernel = GemmKernel<NT, kGated, kL2, kPersist>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStreamSmem) != cudaSuccess) {
    return LastError("raising the shared-memory limit");
  }
  const int64_t sets = p.rows / (kGated ? 16 : 32);
  dim3 grid(static_cast<unsigned>(p.max_blocks), static_cast<unsigned>(sets));
  if (kPersist) {
    static std::atomic<int64_t> known[kDevices] = {};  // this kernel's, per device
    int64_t resident = 0;
    if (ffi::Error e = ResidentBlocks(kernel, kThreads, kStreamSmem, known, &resident); e.failure()) return e;
    const int64_t units = p.max_blocks * sets;
    grid = dim3(static_cast<unsigned>(units < resident ? units : resident));
  }
  return Launch(kernel, grid, kThreads, kStreamSmem, stream, pdl, what, p);
}

template <int NT, bool kL2, bool kPersist>
ffi::Error LaunchGemms(cudaStream_t stream, const GemmParams& g1, const GemmParams& g2, bool pdl) {
  if (ffi::Error e = LaunchGemm<NT, true, kL2, kPersist>(stream, g1, pdl, "gate/up kernel launch"); e.failure()) {
    return e;
  }
  return LaunchGemm<NT, false, kL2, kPersist>(stream, g2, pdl, "down kernel launch");
}

template <bool kL2, bool kPersist>
ffi::Error LaunchStream(cudaStream_t stream, const GemmParams& g1, const GemmParams& g2, int bm, bool pdl) {
  return bm == 8    ? LaunchGemms<1, kL2, kPersist>(stream, g1, g2, pdl)
         : bm == 16 ? LaunchGemms<2, kL2, kPersist>(stream, g1, g2, pdl)
                    : LaunchGemms<4, kL2, kPersist>(stream, g1, g2, pdl);
}

template <bool kGated, bool kSync, int kDepth, int kMaxN>
ffi::Error LaunchTile(cudaStream_t stream, const TileParams& p, int64_t tiles, const char* what) {
  const int bytes = TileSmem(p.bt);
  auto kernel = TileKernel<kGated, kSync, kDepth, kMaxN>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
    return LastError("raising the tile kernel's shared-memory limit");
  }
  kernel<<<static_cast<unsigned>(tiles * p.row_tiles), kTileThreads, bytes, stream>>>(p);
  return LastError(what);
}

template <bool kSync, int kDepth, int kMaxN>
ffi::Error LaunchTilesOf(cudaStream_t stream, const TileParams& g1, const TileParams& g2, int64_t tiles) {
  if (ffi::Error e = LaunchTile<true, kSync, kDepth, kMaxN>(stream, g1, tiles, "tile gate/up launch"); e.failure()) {
    return e;
  }
  return LaunchTile<false, kSync, kDepth, kMaxN>(stream, g2, tiles, "tile down launch");
}

// BM = 16 or 32: the narrow instances (two blocks per SM); 64 or 128: the wide ones.
template <bool kSync, int kDepth>
ffi::Error LaunchTiles(cudaStream_t stream, const TileParams& g1, const TileParams& g2, int64_t tiles) {
  return g1.bt <= 32 ? LaunchTilesOf<kSync, kDepth, 32>(stream, g1, g2, tiles)
                     : LaunchTilesOf<kSync, kDepth, kMaxTile>(stream, g1, g2, tiles);
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
                             ffi::Result<ffi::Buffer<ffi::S32>> block_expert,  // [max_blocks + 1]
                             ffi::Result<ffi::AnyBuffer> h,            // [M k, F]
                             ffi::Result<ffi::AnyBuffer> ys,           // [M k, D]
                             int64_t flags) {
  kdtree::MoeShape shape;
  if (ffi::Error e = MoeShapeOf(&shape, x, ids, weights, gate_q, gate_s, up_q, up_s, down_q, down_s); e.failure()) {
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
  const int64_t max_blocks = static_cast<int64_t>(block_expert->element_count()) - 1;
  const int64_t bm = max_blocks > 0 ? static_cast<int64_t>(sorted->element_count()) / max_blocks : 0;
  if (max_blocks < 0 || max_blocks * bm != static_cast<int64_t>(sorted->element_count()) ||
      (max_blocks > 0 && bm != 8 && bm != 16 && bm != 32 && bm != 64 && bm != 128)) {
    return ffi::Error::InvalidArgument(
        "marlin_moe: scratch sorted must be [max_blocks * block_m] and block_expert [max_blocks + 1] with block_m 8, "
        "16, 32, 64 or 128; got " + std::to_string(sorted->element_count()) + " and " +
        std::to_string(block_expert->element_count()));
  }
  if (M == 0 || D == 0) return ffi::Error::Success();
  if (S == 0 || E == 0 || F == 0) {
    return ClearOutput(stream, out);
  }
  if (S > INT32_MAX / 2 || E > INT32_MAX / 2) {
    return ffi::Error::InvalidArgument("marlin_moe: sizes beyond the kernel's 32-bit indexing");
  }

  const int align_warps = AlignWarps(E, S);
  const bool bf16 = t == ffi::DataType::BF16;
  const bool blocks_ok = align_warps > 0 && max_blocks * bm == static_cast<int64_t>(sorted->element_count()) &&
                         max_blocks <= INT32_MAX / 256;
  const bool narrow = (flags & kFlagTile) && (bm == 16 || bm == 32);  // the tile path at BM = 16 / 32
  const bool tile_bm = bm == 64 || bm == 128 || narrow;
  const bool stream_ok = bf16 && D % kChunk == 0 && F % kChunk == 0 && gg == 32 && dg == 32 && blocks_ok &&
                         (bm == 8 || bm == 16 || bm == 32) && !narrow;
  const bool tile_ok = bf16 && D % 256 == 0 && F % 128 == 0 && gg == 32 && dg == 32 && blocks_ok && tile_bm &&
                       static_cast<int64_t>(S) * D < (int64_t{1} << 40);
  if (tile_bm && !tile_ok) {
    return ffi::Error::InvalidArgument("marlin_moe: the tile path (blocks of 64 or 128 slots, or 16 or 32 with the "
                                       "tile flag) needs bf16, D a multiple of 256, F of 128 and group size 32");
  }
  const auto* xq = reinterpret_cast<const uint32_t*>(gate_q.typed_data());
  const auto* uqp = reinterpret_cast<const uint32_t*>(up_q.typed_data());
  const auto* dqp = reinterpret_cast<const uint32_t*>(down_q.typed_data());
  const auto* gsp = reinterpret_cast<const __nv_bfloat16*>(gate_s.typed_data());
  const auto* usp = reinterpret_cast<const __nv_bfloat16*>(up_s.typed_data());
  const auto* dsp = reinterpret_cast<const __nv_bfloat16*>(down_s.typed_data());

  if (flags & kFlagGemv) {
    if (!bf16 || D % 1024 || F % 1024 || D > 8192 || F > 8192 || gg != 32 || dg != 32 || S > kGemvSlots) {
      return ffi::Error::InvalidArgument("marlin_moe: the GEMV path (flag bit 11) needs bf16, group size 32, D and F "
                                         "multiples of 1024 (D up to 8192, F up to 2048) and at most 64 slots");
    }
    const GemvParams gp{xq, uqp, dqp, gsp, usp, dsp, static_cast<const __nv_bfloat16*>(x.untyped_data()),
                        ids.typed_data(), weights.typed_data(), static_cast<__nv_bfloat16*>(h->untyped_data()),
                        static_cast<__nv_bfloat16*>(out->untyped_data()), static_cast<int>(E), static_cast<int>(D),
                        static_cast<int>(F), static_cast<int>(topk), static_cast<int>(S)};
    const bool pdl = !(flags & kFlagSerial);
    const int up_smem = GemvSmem(static_cast<int>(D), kUpWarps), down_smem = GemvSmem(static_cast<int>(F), kDownWarps);
    if (D != 2048 && D != 4096 && D != 7168 && D != 8192) {
      return ffi::Error::InvalidArgument("marlin_moe: the GEMV path takes D of 2048, 4096, 7168 or 8192");
    }
    if (F != 1024 && F != 2048) {
      return ffi::Error::InvalidArgument("marlin_moe: the GEMV path takes F of 1024 or 2048");
    }
    auto up = D == 2048 ? GemvUpKernel<8> : D == 4096 ? GemvUpKernel<16> : D == 7168 ? GemvUpKernel<28>
                                                                                       : GemvUpKernel<32>;
    auto down = F == 1024 ? GemvDownKernel<8> : GemvDownKernel<16>;
    if (cudaFuncSetAttribute(up, cudaFuncAttributeMaxDynamicSharedMemorySize, up_smem) != cudaSuccess ||
        cudaFuncSetAttribute(down, cudaFuncAttributeMaxDynamicSharedMemorySize, down_smem) != cudaSuccess) {
      return LastError("raising the GEMV path's shared-memory limit");
    }
    if (ffi::Error e = Launch(up, dim3(static_cast<unsigned>(F / 8)), 32 * kUpWarps, up_smem, stream, pdl,
                              "gemv1 launch", gp);
        e.failure()) {
      return e;
    }
    // gemv2 sums each token's slots itself (no combine launch; ys is not written on this path)
    return Launch(down, dim3(static_cast<unsigned>(D / kTcRows)), 32 * kDownWarps, down_smem, stream, pdl,
                  "gemv2 launch", gp);
  }
  if (stream_ok || tile_ok) {
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
    const bool pdl = stream_ok && !(flags & kFlagSerial);  // gemm1, gemm2 and the combine (stream path)
    const auto* xp = static_cast<const __nv_bfloat16*>(x.untyped_data());
    auto* hp = static_cast<__nv_bfloat16*>(h->untyped_data());
    auto* yp = static_cast<__nv_bfloat16*>(ys->untyped_data());
    if (tile_ok) {
      // x in tile k order, into the ys scratch (gemm2 overwrites it after gemm1 has read it).
      const int64_t pblocks = M * D / 128;
      PermuteKernel<<<GridFor(pblocks, 128), 128, 0, stream>>>(xp, yp, pblocks);
      if (ffi::Error e = LastError("permute launch"); e.failure()) return e;
      TileParams g1{xq, uqp, gsp, usp, yp, hp, sorted->typed_data(), block_expert->typed_data(),
                    static_cast<int>(F), static_cast<int>(D), static_cast<int>(gate_scales), static_cast<int>(topk),
                    static_cast<int>(S), static_cast<int>(F / 128), static_cast<int>(bm), static_cast<int>(flags)};
      TileParams g2{dqp, nullptr, dsp, nullptr, hp, yp, sorted->typed_data(), block_expert->typed_data(),
                    static_cast<int>(D), static_cast<int>(F), static_cast<int>(down_scales), 1,
                    static_cast<int>(S), static_cast<int>(D / 256), static_cast<int>(bm), static_cast<int>(flags)};
      ffi::Error err = (flags & kFlagSync)   ? LaunchTiles<true, 2>(stream, g1, g2, max_blocks)
                       : (flags & kFlagDeep) ? LaunchTiles<false, 4>(stream, g1, g2, max_blocks)
                                             : LaunchTiles<false, 2>(stream, g1, g2, max_blocks);
      if (err.failure()) return err;
    } else {
      const int nb = static_cast<int>(max_blocks), bmi = static_cast<int>(bm);
      GemmParams g1{xq, uqp, gsp, usp, xp, hp, sorted->typed_data(), block_expert->typed_data(),
                    static_cast<int>(F), static_cast<int>(D), static_cast<int>(gate_scales), static_cast<int>(topk),
                    static_cast<int>(S), nb, (flags & kFlagXL1) ? kStreamStages - 1 : 0};
      GemmParams g2{dqp, nullptr, dsp, nullptr, hp, yp, sorted->typed_data(), block_expert->typed_data(),
                    static_cast<int>(D), static_cast<int>(F), static_cast<int>(down_scales), 1, static_cast<int>(S),
                    nb, 0};
      const bool l2 = (flags & kFlagL2Prefetch) != 0, persist = (flags & kFlagPersist) != 0;
      ffi::Error err = l2 ? (persist ? LaunchStream<true, true>(stream, g1, g2, bmi, pdl)
                                     : LaunchStream<true, false>(stream, g1, g2, bmi, pdl))
                          : (persist ? LaunchStream<false, true>(stream, g1, g2, bmi, pdl)
                                     : LaunchStream<false, false>(stream, g1, g2, bmi, pdl));
      if (err.failure()) return err;
    }
    return Launch(CombineKernel8, dim3(GridFor(M * D / 8, 256)), 256, 0, stream, pdl, "combine launch",
                  static_cast<const __nv_bfloat16*>(yp), ids.typed_data(), weights.typed_data(), M,
                  static_cast<int>(topk), static_cast<int>(E), static_cast<int>(D),
                  static_cast<__nv_bfloat16*>(out->untyped_data()));
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


ffi::Error MarlinMoeFusedCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ids,
                                  ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> gate_q,
                                  ffi::Buffer<ffi::BF16> gate_s, ffi::Buffer<ffi::S32> up_q,
                                  ffi::Buffer<ffi::BF16> up_s, ffi::Buffer<ffi::S32> down_q,
                                  ffi::Buffer<ffi::BF16> down_s, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::Buffer<ffi::F32>> p1, ffi::Result<ffi::AnyBuffer> h,
                                  ffi::Result<ffi::Buffer<ffi::F32>> p2, ffi::Result<ffi::Buffer<ffi::U32>> counters,
                                  int64_t flags) {
  kdtree::MoeShape shape;
  if (ffi::Error e = MoeShapeOf(&shape, x, ids, weights, gate_q, gate_s, up_q, up_s, down_q, down_s); e.failure()) {
    return e;
  }
  const int64_t M = shape.m, D = shape.d, K = shape.k, E = shape.e, F = shape.f, S = M * K;
  const ffi::DataType t = x.element_type();
  if (t != ffi::DataType::BF16 || out->element_type() != t || h->element_type() != t || D % kFusedSpan != 0 ||
      F % kFusedSpan != 0 || D > kFusedSpan * kFusedMaxSplit || F > kFusedSpan * kFusedMaxSplit ||
      shape.gate_scales * 32 != D || shape.down_scales * 32 != F || S > kFusedMaxSlots ||
      E > INT32_MAX / 2) {
    return ffi::Error::InvalidArgument("marlin_moe (fused): needs bfloat16, D and F multiples of 512 up to 8192, "
                                       "group size 32 and at most 256 slots (M k); got D = " + std::to_string(D) + ", F = " +
                                       std::to_string(F) + ", M k = " + std::to_string(S));
  }
  if (out->element_count() != static_cast<size_t>(M * D) ||
      p1->element_count() != static_cast<size_t>(S * (D / kFusedSpan) * 2 * F) ||
      h->element_count() != static_cast<size_t>(S * F) ||
      p2->element_count() != static_cast<size_t>(S * (F / kFusedSpan) * D) ||
      counters->element_count() != static_cast<size_t>(1 + S * (F / 16) + D / 16)) {
    return ffi::Error::InvalidArgument("marlin_moe (fused): scratch sizes must be p1 [M k D/512 2 F], h [M k F], "
                                       "p2 [M k F/512 D] and counters [1 + M k F/16 + D/16]");
  }
  if (M == 0 || D == 0) return ffi::Error::Success();
  if (S == 0 || E == 0 || F == 0) {
    return ClearOutput(stream, out);
  }
  if (cudaMemsetAsync(counters->typed_data(), 0, counters->size_bytes(), stream) != cudaSuccess) {
    return LastError("clearing the fused path's counters");
  }
  // the grid per device: the occupancy's, or one block an SM (kFlagFusedOne: room for the other stream's kernels)
  static std::atomic<int64_t> known[kDevices] = {}, known_one[kDevices] = {};
  const bool one = (flags & kFlagFusedOne) != 0;
  int64_t resident = 0;
  if (ffi::Error e = ResidentBlocks(FusedMoeKernel, kFusedThreads, 0, one ? known_one : known, &resident, one ? 1 : 0);
      e.failure()) {
    return e;
  }
  FusedParams p{static_cast<const __nv_bfloat16*>(x.untyped_data()), ids.typed_data(), weights.typed_data(),
                reinterpret_cast<const uint32_t*>(gate_q.typed_data()),
                reinterpret_cast<const uint32_t*>(up_q.typed_data()),
                reinterpret_cast<const __nv_bfloat16*>(gate_s.typed_data()),
                reinterpret_cast<const __nv_bfloat16*>(up_s.typed_data()),
                reinterpret_cast<const uint32_t*>(down_q.typed_data()),
                reinterpret_cast<const __nv_bfloat16*>(down_s.typed_data()),
                static_cast<__nv_bfloat16*>(out->untyped_data()), p1->typed_data(),
                static_cast<__nv_bfloat16*>(h->untyped_data()), p2->typed_data(), counters->typed_data(),
                static_cast<int>(M), static_cast<int>(K), static_cast<int>(E), static_cast<int>(D),
                static_cast<int>(F), static_cast<int>(S)};
  FusedMoeKernel<<<static_cast<unsigned>(resident), kFusedThreads, 0, stream>>>(p);
  return LastError("fused kernel launch");
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
                                  .Ret<ffi::Buffer<ffi::S32>>()        // block experts, used blocks [max_blocks + 1]
                                  .Ret<ffi::AnyBuffer>()               // h [M k, F]
                                  .Ret<ffi::AnyBuffer>()               // ys [M k, D]
                                  .Attr<int64_t>("flags"),             // kFlag* bits (0: the defaults)
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMarlinMoeFusedCuda, MarlinMoeFusedCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // x [M, D] bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()        // ids [M, k] (outside [0, E): no expert)
                                  .Arg<ffi::Buffer<ffi::F32>>()        // routing weights [M, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // gate packed [E, F, D/8]
                                  .Arg<ffi::Buffer<ffi::BF16>>()       // gate scales [E, F, D/32]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // up packed [E, F, D/8]
                                  .Arg<ffi::Buffer<ffi::BF16>>()       // up scales [E, F, D/32]
                                  .Arg<ffi::Buffer<ffi::S32>>()        // down packed [E, D, F/8]
                                  .Arg<ffi::Buffer<ffi::BF16>>()       // down scales [E, D, F/32]
                                  .Ret<ffi::AnyBuffer>()               // out [M, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()        // gate/up partials [M k, D/512, 2, F]
                                  .Ret<ffi::AnyBuffer>()               // h [M k, F]
                                  .Ret<ffi::Buffer<ffi::F32>>()        // down partials [M k, F/512, D]
                                  .Ret<ffi::Buffer<ffi::U32>>()        // counters [1 + M k F/16 + D/16]
                                  .Attr<int64_t>("flags"),             // kFlagFusedOne (0: the default)
                              {xla::ffi::Traits::kCmdBufferCompatible});
