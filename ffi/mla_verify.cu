// mla_verify, CUDA handler (sm_90a): MLA-absorbed attention over the latent cache with a tree mask.
//
// The function is the CPU handler's (ffi/mla_verify.cc has the math): each query row (token n, head h) of batch
// row b sees the committed prefix (slots < cache_lens[b]) and, through tree_mask[b, n, :], the N tree tokens
// written at cache_lens[b] ..; scores, softmax and sums are fp32.
//
// Fast path (bf16, R = 512, dr = 64): flash decoding over the latent cache, the heads sharing every cache tile.
//   * The M = N * H query rows of a batch row form [64 x 576] tiles; block (row tile, split, b) streams its split of
//     the keys in [64 x 576] tiles (latent || rope key), which serve as K (576 wide) and V (first 512).
//   * Warpgroup 0 loads (cp.async into 128B-swizzled panels, completion on an mbarrier per stage, two stages).
//     Warpgroup 1 computes S = Q K^T (wgmma m64n64k16, both operands in shared memory), the masked online softmax
//     in fp32, and O[:, 0:256] += P V with P from registers (wgmma m64n256k16); it hands P (bf16) and the row
//     rescale factors to warpgroup 2 through shared memory, which computes O[:, 256:512] += P V.
//   * With several splits, each block writes its normalized partial output, its row max and its row sum (fp32),
//     and a second kernel combines them in a fixed order (deterministic; no atomics, nothing to clear).
//     The split count is the extent of the partials output's second axis (the Python wrapper plans it).
//   * Launches: both kernels are programmatic dependents (PDL) of the kernel before them. The attention kernel sets
//     up its barriers, then waits (griddepcontrol.wait) for the previous kernel's writes before it reads anything,
//     and lets the combine launch at once; the combine waits for the attention kernel's partials the same way and
//     lets the next kernel launch. So each launch overlaps the tail of the kernel before it. Flag bit 0: plain
//     launches.
// Generic path (any other dtype or head size, R <= 1024, dr <= 256): one warp per query row, online softmax on
// CUDA cores. Correct but slow: it exists so that every shape the CPU handler takes also runs on the GPU.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "cuda_common.cuh"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kInf = INFINITY;
constexpr int64_t kFlagPlain = 1;  // plain launches instead of programmatic dependent ones

// ------------------------------------------------------------------------------------------------------------------
// Fast path
// ------------------------------------------------------------------------------------------------------------------

constexpr int kRank = 512;                     // latent width R (= V width)
constexpr int kRope = 64;                      // rope key width dr
constexpr int kChunks = (kRank + kRope) / 8;   // 16-byte chunks per key or query row: 72
constexpr int kRows = 64;                      // query rows per block (the wgmma M)
constexpr int kKeys = 64;                      // keys per pipeline stage
constexpr int kStages = 2;
constexpr int kPanel = 64 * 128;               // one [64 rows x 64 columns] bf16 panel, 128B-swizzled: 8 KB
constexpr int kTileBytes = 9 * kPanel;         // [64 x 576]: 8 latent panels, then the rope panel
constexpr int kThreads = 384;                  // warpgroup 0 loads, warpgroups 1 and 2 compute

// Shared memory map, in bytes from a 1024-aligned base (the swizzle pattern repeats every 1024 bytes).
constexpr int kSmemQ = 0;
constexpr int kSmemKV = kSmemQ + kTileBytes;            // kStages tiles
constexpr int kSmemP = kSmemKV + kStages * kTileBytes;  // P, bf16 [64 rows x 64 keys]
constexpr int kSmemAlpha = kSmemP + kPanel;             // float [64]: this tile's row rescale factors
constexpr int kSmemSum = kSmemAlpha + kRows * 4;        // float [64]: final row sums
constexpr int kSmemBars = kSmemSum + kRows * 4;         // mbarriers: full[2], empty[2], p_full, p_empty
constexpr int kSmemBytes = kSmemBars + 6 * 8 + 1024;    // + room to align the base

constexpr int kBarFull = 0, kBarEmpty = 2, kBarPFull = 4, kBarPEmpty = 5;

struct FastParams {
  const __nv_bfloat16* q_lat;   // [B, M, 512]   M = N * H query rows, row n * H + h
  const __nv_bfloat16* q_pe;    // [B, M, 64]
  const __nv_bfloat16* latent;  // [B, S, 512]
  const __nv_bfloat16* pe;      // [B, S, 64]
  const int32_t* lens;          // [B]
  const bool* mask;             // [B, N, N]
  __nv_bfloat16* out;           // [B, M, 512]
  float* part;                  // [B, splits, M, 512]  normalized partial outputs (splits > 1)
  float2* stats;                // [B, splits, M]       (row max in log2 units, row sum) of each partial
  int n, h, s, m, splits;
  float scale_log2;             // softmax scale * log2(e)
};

// The keys of batch row b, in order: the prefix (slots 0 .. prefix-1), then the N tree slots tree0 ..;
// a block covers `count` tiles of 64 keys from tile `first`.
struct KeyRange {
  int prefix, tree0, keys, first, count;
};

__device__ __forceinline__ KeyRange BlockKeys(const FastParams& p, int b, int split) {
  KeyRange r;
  const int len = p.lens[b];
  r.prefix = min(max(len, 0), p.s);
  r.tree0 = min(max(len, 0), p.s - p.n);
  r.keys = r.prefix + p.n;
  const int tiles = (r.keys + kKeys - 1) / kKeys;
  const int per = (tiles + p.splits - 1) / p.splits;
  r.first = split * per;
  r.count = max(0, min(tiles, r.first + per) - r.first);
  return r;
}

__device__ __forceinline__ void BarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void BarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void BarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// 16 bytes global -> shared; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// Arrive on `bar` once all of this thread's earlier cp.async have landed.
__device__ __forceinline__ void CopyArrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Generic-proxy shared-memory writes (cp.async, st.shared) -> reads by wgmma (async proxy).
__device__ __forceinline__ void ProxyFence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaWaitAll() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Keep the compiler from moving reads of wgmma registers above the wait (and their writers below the issue).
template <int N>
__device__ __forceinline__ void Pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void Pin(uint32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle. K-major operands: rows of 64 elements (128 B), 8-row groups
// 1024 B apart (SBO); LBO unused. MN-major operands: 64-element runs along MN, 8-deep K groups 1024 B apart (SBO),
// the next 64 MN elements one panel further (LBO).
__device__ __forceinline__ uint64_t Descriptor(uint32_t addr, uint32_t lbo) {
  return static_cast<uint64_t>((addr & 0x3ffff) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (uint64_t{1} << 62);
}
__device__ __forceinline__ uint64_t KMajor(uint32_t addr) { return Descriptor(addr, 16); }
__device__ __forceinline__ uint64_t MnMajor(uint32_t addr) { return Descriptor(addr, kPanel); }

#define KD_ACC8(i)                                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define KD_ACC32(i) KD_ACC8(i), KD_ACC8(i + 8), KD_ACC8(i + 16), KD_ACC8(i + 24)
#define KD_ACC128 KD_ACC32(0), KD_ACC32(32), KD_ACC32(64), KD_ACC32(96)

#define KD_REGS32                                                                  \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define KD_REGS128                                                                                              \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                      \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                             \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                             \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                             \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                 \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d[64 x 64] (+)= A[64 x 16] B[16 x 64]; A and B K-major in shared memory.
__device__ __forceinline__ void MmaScores(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" KD_REGS32 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : KD_ACC32(0)
      : "l"(a), "l"(b), "r"(accumulate));
}

// d[64 x 256] += A[64 x 16] B[16 x 256]; A in registers, B MN-major in shared memory.
__device__ __forceinline__ void MmaValuesRegs(float (&d)[128], const uint32_t* a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" KD_REGS128
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : KD_ACC128
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
}

// d[64 x 256] += A[64 x 16] B[16 x 256]; A K-major and B MN-major in shared memory.
__device__ __forceinline__ void MmaValuesSmem(float (&d)[128], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" KD_REGS128 "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : KD_ACC128
      : "l"(a), "l"(b), "n"(1));
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Copies rows 0..63 of latent (512 wide) || rope (64 wide), both pointing at the tile's first row, into nine swizzled
// panels. Thread t of the loading warpgroup copies latent chunk t % 64 of rows t / 64 + 2k and rope chunk t % 8 of
// rows t / 8 + 16k: consecutive threads read consecutive 16 bytes, every source is a constant offset from two
// pointers.
__device__ __forceinline__ void CopyRows(uint32_t tile, const __nv_bfloat16* latent, const __nv_bfloat16* rope) {
  const int t = threadIdx.x;
  const int c = t & 63, r0 = t >> 6;
  const uint32_t dst = tile + (c >> 3) * kPanel + r0 * 128;
  const int cx = (c & 7) ^ r0;  // row r0 + 2k has (row & 7) = r0 ^ (2k & 7)
  const __nv_bfloat16* src = latent + r0 * kRank + c * 8;
#pragma unroll
  for (int k = 0; k < 32; ++k) CopyAsync16(dst + 256 * k + ((cx ^ ((2 * k) & 7)) << 4), src + 2 * k * kRank, true);
  const int c2 = t & 7, r2 = t >> 3;  // row r2 + 16k has (row & 7) = r2 & 7
  const uint32_t dst2 = tile + 8 * kPanel + r2 * 128 + ((c2 ^ (r2 & 7)) << 4);
  const __nv_bfloat16* src2 = rope + r2 * kRope + c2 * 8;
#pragma unroll
  for (int k = 0; k < 4; ++k) CopyAsync16(dst2 + 16 * 128 * k, src2 + 16 * k * kRope, true);
}

// The same for a tile that is not one run of valid rows: row `row` is latent[src] || rope[src] with
// `valid = row_of(row, src)`, zero-filled where !valid.
template <typename RowOf>
__device__ __forceinline__ void CopyTile(uint32_t tile, const __nv_bfloat16* latent, const __nv_bfloat16* rope,
                                         RowOf row_of) {
  const int t = threadIdx.x;
  const int c = t & 63, r0 = t >> 6;
  const uint32_t dst = tile + (c >> 3) * kPanel + r0 * 128;
  const int cx = (c & 7) ^ r0;  // row r0 + 2k has (row & 7) = r0 ^ (2k & 7)
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    int64_t src;
    const bool ok = row_of(r0 + 2 * k, src);
    CopyAsync16(dst + 256 * k + ((cx ^ ((2 * k) & 7)) << 4), latent + src * kRank + c * 8, ok);
  }
  const int c2 = t & 7, r2 = t >> 3;  // row r2 + 16k has (row & 7) = r2 & 7
  const uint32_t dst2 = tile + 8 * kPanel + r2 * 128 + ((c2 ^ (r2 & 7)) << 4);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    int64_t src;
    const bool ok = row_of(r2 + 16 * k, src);
    CopyAsync16(dst2 + 16 * 128 * k, rope + src * kRope + c2 * 8, ok);
  }
}

// Warpgroup 0: stream Q (once) and the block's key tiles into shared memory.
__device__ void LoadTiles(const FastParams& p, const KeyRange& r, uint32_t base, int b, int m0) {
  const int64_t q0 = static_cast<int64_t>(b) * p.m, kv0 = static_cast<int64_t>(b) * p.s;
  const int shift = r.tree0 - r.prefix;  // tree key v >= prefix lives in slot v + shift (0 unless clamped)
  if (r.count > 0) {  // lands with the first key tile (the same threads' arrive on full[0] waits for it)
    if (m0 + kRows <= p.m) {
      CopyRows(base + kSmemQ, p.q_lat + (q0 + m0) * kRank, p.q_pe + (q0 + m0) * kRope);
    } else {
      CopyTile(base + kSmemQ, p.q_lat, p.q_pe, [&](int row, int64_t& src) {
        const bool ok = m0 + row < p.m;
        src = ok ? q0 + m0 + row : 0;
        return ok;
      });
    }
  }
  for (int i = 0; i < r.count; ++i) {
    const int st = i & 1;
    BarWait(base + kSmemBars + 8 * (kBarEmpty + st), ((i >> 1) & 1) ^ 1);
    const int k0 = (r.first + i) * kKeys;
    const uint32_t tile = base + kSmemKV + st * kTileBytes;
    if (k0 + kKeys <= r.keys && (shift == 0 || k0 + kKeys <= r.prefix || k0 >= r.prefix)) {
      const int64_t first = kv0 + (k0 < r.prefix ? k0 : k0 + shift);
      CopyRows(tile, p.latent + first * kRank, p.pe + first * kRope);
    } else {
      CopyTile(tile, p.latent, p.pe, [&](int row, int64_t& src) {
        const int v = k0 + row;
        const bool ok = v < r.keys;
        src = ok ? kv0 + (v < r.prefix ? v : v + shift) : 0;
        return ok;
      });
    }
    CopyArrive(base + kSmemBars + 8 * (kBarFull + st));
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// Both compute warpgroups: write O[:, col0 : col0 + 256] / l, as the output or as this split's partial.
__device__ __forceinline__ void StoreRows(const FastParams& p, const float (&o)[128], const float (&l)[2],
                                          const float (&mrow)[2], int b, int split, int m0, int row0, int col0,
                                          bool write_stats) {
  const int quad = threadIdx.x & 3;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int qm = m0 + row0 + 8 * hh;
    if (qm >= p.m) continue;
    const float inv = l[hh] > 0.0f ? 1.0f / l[hh] : 0.0f;
    if (p.splits == 1) {
      __nv_bfloat16* dst = p.out + (static_cast<size_t>(b) * p.m + qm) * kRank + col0 + 2 * quad;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<uint32_t*>(dst + 8 * j) = PackBf16(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
      }
    } else {
      const size_t row = (static_cast<size_t>(b) * p.splits + split) * p.m + qm;
      float* dst = p.part + row * kRank + col0 + 2 * quad;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
      }
      if (write_stats && quad == 0) p.stats[row] = make_float2(mrow[hh], l[hh]);
    }
  }
}

// Warpgroup 1: S = Q K^T, masked online softmax, O[:, 0:256]; hands P and the rescale factors to warpgroup 2.
__device__ void ScoresAndLowHalf(const FastParams& p, const KeyRange& r, uint8_t* smem, uint32_t base, int b,
                                 int split, int m0) {
  const int t = threadIdx.x - 128;
  const int lane = t & 31, quad = lane & 3;
  const int row0 = (t >> 5) * 16 + (lane >> 2);  // this thread's rows: row0 and row0 + 8
  float* alpha_smem = reinterpret_cast<float*>(smem + kSmemAlpha);
  uint8_t* p_smem = smem + kSmemP;
  const uint32_t bars = base + kSmemBars;

  int n_of[2];
  bool real[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int qm = m0 + row0 + 8 * hh;
    real[hh] = qm < p.m;
    n_of[hh] = real[hh] ? qm / p.h : 0;
  }
  float o[128], s[32];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.0f;
  float mrun[2] = {-kInf, -kInf}, lrun[2] = {0.0f, 0.0f};

  for (int i = 0; i < r.count; ++i) {
    const int st = i & 1;
    BarWait(bars + 8 * (kBarFull + st), (i >> 1) & 1);
    ProxyFence();
    const uint32_t tile = base + kSmemKV + st * kTileBytes;
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kChunks / 2; ++kk) {
      const uint32_t off = (kk >> 2) * kPanel + (kk & 3) * 32;
      MmaScores(s, KMajor(base + kSmemQ + off), KMajor(tile + off), kk > 0);
    }
    WgmmaCommit();
    WgmmaWaitAll();
    Pin(s);

    // s[4j + 2hh + e] is row row0 + 8hh, key k0 + 8j + 2quad + e.
    const int k0 = (r.first + i) * kKeys;
    float mx[2] = {-kInf, -kInf};
    if (k0 + kKeys <= r.prefix) {  // every key of the tile is in the prefix
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        s[j] *= p.scale_log2;
        mx[(j >> 1) & 1] = fmaxf(mx[(j >> 1) & 1], s[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int v = k0 + 8 * j + 2 * quad + e;
            const bool seen =
                v < r.prefix || (v < r.keys && real[hh] &&
                                 p.mask[(static_cast<size_t>(b) * p.n + n_of[hh]) * p.n + (v - r.prefix)]);
            const float x = seen ? s[4 * j + 2 * hh + e] * p.scale_log2 : -kInf;
            s[4 * j + 2 * hh + e] = x;
            mx[hh] = fmaxf(mx[hh], x);
          }
        }
      }
    }
    float alpha[2], base_m[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
      mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
      const float mnew = fmaxf(mrun[hh], mx[hh]);
      base_m[hh] = mnew == -kInf ? 0.0f : mnew;  // a row with nothing visible yet keeps p = 0, not NaN
      alpha[hh] = exp2f(mrun[hh] - base_m[hh]);
      mrun[hh] = mnew;
    }
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      s[j] = exp2f(s[j] - base_m[(j >> 1) & 1]);
      sum[(j >> 1) & 1] += s[j];
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) lrun[hh] = lrun[hh] * alpha[hh] + sum[hh];
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {  // skipped once the row maxima settle
#pragma unroll
      for (int j = 0; j < 128; ++j) o[j] *= alpha[(j >> 1) & 1];
    }
    // P as wgmma A fragments: k-step kk holds keys 16kk .. 16kk + 15.
    uint32_t pa[16];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int q = 0; q < 4; ++q) pa[4 * kk + q] = PackBf16(s[8 * kk + 2 * q], s[8 * kk + 2 * q + 1]);
    }

    // Hand P and alpha to warpgroup 2 once it is done with the previous tile's.
    BarWait(bars + 8 * kBarPEmpty, (i & 1) ^ 1);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = row0 + 8 * hh;
        *reinterpret_cast<uint32_t*>(p_smem + row * 128 + ((j ^ (row & 7)) << 4) + quad * 4) =
            PackBf16(s[4 * j + 2 * hh], s[4 * j + 2 * hh + 1]);
      }
    }
    if (quad == 0) {
      alpha_smem[row0] = alpha[0];
      alpha_smem[row0 + 8] = alpha[1];
    }
    ProxyFence();
    BarArrive(bars + 8 * kBarPFull);

    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) MmaValuesRegs(o, pa + 4 * kk, MnMajor(tile + kk * 16 * 128));
    WgmmaCommit();
    WgmmaWaitAll();
    Pin(o);
    Pin(pa);
    if (lane == 0) BarArrive(bars + 8 * (kBarEmpty + st));
  }

  float* sum_smem = reinterpret_cast<float*>(smem + kSmemSum);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    lrun[hh] += __shfl_xor_sync(0xffffffffu, lrun[hh], 1);
    lrun[hh] += __shfl_xor_sync(0xffffffffu, lrun[hh], 2);
  }
  if (quad == 0) {
    sum_smem[row0] = lrun[0];
    sum_smem[row0 + 8] = lrun[1];
  }
  asm volatile("bar.sync 1, 256;" ::: "memory");
  StoreRows(p, o, lrun, mrun, b, split, m0, row0, 0, true);
}

// Warpgroup 2: O[:, 256:512] += P V with P from shared memory.
__device__ void HighHalf(const FastParams& p, const KeyRange& r, uint8_t* smem, uint32_t base, int b, int split,
                         int m0) {
  const int t = threadIdx.x - 256;
  const int lane = t & 31;
  const int row0 = (t >> 5) * 16 + (lane >> 2);
  const float* alpha_smem = reinterpret_cast<const float*>(smem + kSmemAlpha);
  const uint32_t bars = base + kSmemBars;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;

  for (int i = 0; i < r.count; ++i) {
    const int st = i & 1;
    BarWait(bars + 8 * (kBarFull + st), (i >> 1) & 1);
    BarWait(bars + 8 * kBarPFull, i & 1);
    ProxyFence();
    const float alpha[2] = {alpha_smem[row0], alpha_smem[row0 + 8]};
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < 128; ++j) o[j] *= alpha[(j >> 1) & 1];
    }
    const uint32_t tile = base + kSmemKV + st * kTileBytes;
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      MmaValuesSmem(o, KMajor(base + kSmemP + kk * 32), MnMajor(tile + 4 * kPanel + kk * 16 * 128));
    }
    WgmmaCommit();
    WgmmaWaitAll();
    Pin(o);
    if (lane == 0) {
      BarArrive(bars + 8 * kBarPEmpty);
      BarArrive(bars + 8 * (kBarEmpty + st));
    }
  }
  asm volatile("bar.sync 1, 256;" ::: "memory");
  const float* sum_smem = reinterpret_cast<const float*>(smem + kSmemSum);
  const float l[2] = {sum_smem[row0], sum_smem[row0 + 8]};
  const float unused[2] = {0.0f, 0.0f};
  StoreRows(p, o, l, unused, b, split, m0, row0, 256, false);
}

__global__ void __launch_bounds__(kThreads, 1) MlaVerifyKernel(const FastParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (SmemAddress(smem_raw) & 1023)) & 1023);
  const uint32_t base = SmemAddress(smem);
  const int m0 = blockIdx.x * kRows, split = blockIdx.y, b = blockIdx.z;
  if (threadIdx.x == 0) {
    const uint32_t bars = base + kSmemBars;
    BarInit(bars + 8 * (kBarFull + 0), 128);
    BarInit(bars + 8 * (kBarFull + 1), 128);
    BarInit(bars + 8 * (kBarEmpty + 0), 8);
    BarInit(bars + 8 * (kBarEmpty + 1), 8);
    BarInit(bars + 8 * kBarPFull, 128);
    BarInit(bars + 8 * kBarPEmpty, 4);
  }
  __syncthreads();
  GridDependencyWait();  // the queries, caches, lengths and mask were written by the kernels before this one
  LaunchDependents();    // the combine may launch; it waits for this grid to end before it reads the partials
  const KeyRange r = BlockKeys(p, b, split);  // reads the lengths: after the wait
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 64;");
    LoadTiles(p, r, base, b, m0);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
    if (wg == 1) {
      ScoresAndLowHalf(p, r, smem, base, b, split, m0);
    } else {
      HighHalf(p, r, smem, base, b, split, m0);
    }
  }
}

// out[b, m, :] = sum_i w_i part_i / sum_i w_i with w_i = l_i 2^(m_i - max m), over the splits that saw a key.
// Block (m, b, c) writes columns 128 c .. 128 c + 127 of row m (four blocks a row, so that at one query token's
// eight rows 32 SMs read the partials, not 8): the weights go through shared memory, each warp sums every 8th split
// (a 16-byte load a lane a split, four splits' loads in flight), then the eight warps' sums are added in a fixed
// order. Each column is summed in the same order whatever the block count.
constexpr int kMaxSplits = 1024;
constexpr int kCombineWarps = 8;
constexpr int kCombineCols = 128;  // columns a block
constexpr int kCombineParts = kRank / kCombineCols;

__global__ void __launch_bounds__(kCombineWarps * 32) CombineKernel(const float* part, const float2* stats,
                                                                    __nv_bfloat16* out, int m, int splits) {
  __shared__ float weight[kMaxSplits];
  __shared__ float top[kCombineWarps], total[kCombineWarps];
  __shared__ float4 sums[kCombineWarps][kCombineCols / 4];
  const int qm = blockIdx.x, b = blockIdx.y, col0 = kCombineCols * blockIdx.z;
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const size_t first = static_cast<size_t>(b) * splits * m + qm;  // stats row of split i: first + i * m
  GridDependencyWait();  // the attention kernel's partials
  LaunchDependents();

  float mx = -kInf;
  for (int i = t; i < splits; i += kCombineWarps * 32) {
    const float2 st = stats[first + static_cast<size_t>(i) * m];
    weight[i] = st.y > 0.0f ? st.x : -kInf;
    mx = fmaxf(mx, weight[i]);
  }
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
  if (lane == 0) top[warp] = mx;
  __syncthreads();
  mx = top[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) mx = fmaxf(mx, top[w]);
  float sum = 0.0f;
  for (int i = t; i < splits; i += kCombineWarps * 32) {
    const float st_l = stats[first + static_cast<size_t>(i) * m].y;
    weight[i] = weight[i] == -kInf ? 0.0f : st_l * exp2f(weight[i] - mx);
    sum += weight[i];
  }
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, w);
  if (lane == 0) total[warp] = sum;
  __syncthreads();

  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4* src = reinterpret_cast<const float4*>(part + first * kRank + col0) + lane;
  const size_t stride = static_cast<size_t>(m) * kRank / 4;  // float4s from one split's row to the next's
#pragma unroll 4
  for (int i = warp; i < splits; i += kCombineWarps) {
    const float w = weight[i];
    if (w == 0.0f) continue;
    const float4 v = src[i * stride];
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  }
  sums[warp][lane] = acc;
  __syncthreads();
  if (t < kCombineCols / 4) {
    float all = 0.0f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) all += total[w];
    const float inv = all > 0.0f ? 1.0f / all : 0.0f;
    float4 v = sums[0][t];
#pragma unroll
    for (int w = 1; w < kCombineWarps; ++w) {
      v.x += sums[w][t].x;
      v.y += sums[w][t].y;
      v.z += sums[w][t].z;
      v.w += sums[w][t].w;
    }
    __nv_bfloat16* dst = out + (static_cast<size_t>(b) * m + qm) * kRank + col0 + 4 * t;
    *reinterpret_cast<uint32_t*>(dst) = PackBf16(v.x * inv, v.y * inv);
    *reinterpret_cast<uint32_t*>(dst + 2) = PackBf16(v.z * inv, v.w * inv);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Generic path
// ------------------------------------------------------------------------------------------------------------------

constexpr int kMaxRankPerLane = 32;  // R <= 1024
constexpr int kMaxRopePerLane = 8;   // dr <= 256

template <typename T>
struct GenericParams {
  const T* q_lat;        // [B, M, R]
  const T* q_pe;         // [B, M, dr]
  const T* latent;       // [B, S, R]
  const T* pe;           // [B, S, dr]
  const int32_t* lens;   // [B]
  const bool* mask;      // [B, N, N]
  T* out;                // [B, M, R]
  int b, n, h, r, dr, s;
  float scale_log2;
};

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void FromFloat(float x, float* out) { *out = x; }
__device__ __forceinline__ void FromFloat(float x, __nv_bfloat16* out) { *out = __float2bfloat16_rn(x); }

template <typename T>
__global__ void __launch_bounds__(128) GenericKernel(const GenericParams<T> p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;  // (b * N + n) * H + h
  if (row >= static_cast<int64_t>(p.b) * p.n * p.h) return;
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.n) * p.h));
  const int n = static_cast<int>(row / p.h % p.n);
  const int len = p.lens[b];
  const int prefix = min(max(len, 0), p.s), tree0 = min(max(len, 0), p.s - p.n);
  float q[kMaxRankPerLane], qr[kMaxRopePerLane], acc[kMaxRankPerLane];
#pragma unroll
  for (int i = 0; i < kMaxRankPerLane; ++i) {
    const int d = lane + 32 * i;
    q[i] = d < p.r ? ToFloat(p.q_lat[row * p.r + d]) : 0.0f;
    acc[i] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < kMaxRopePerLane; ++i) {
    const int d = lane + 32 * i;
    qr[i] = d < p.dr ? ToFloat(p.q_pe[row * p.dr + d]) : 0.0f;
  }
  float mrun = -kInf, lrun = 0.0f;
  for (int v = 0; v < prefix + p.n; ++v) {
    if (v >= prefix && !p.mask[(static_cast<int64_t>(b) * p.n + n) * p.n + (v - prefix)]) continue;
    const int64_t slot = static_cast<int64_t>(b) * p.s + (v < prefix ? v : tree0 + (v - prefix));
    float val[kMaxRankPerLane];
    float dot_lat = 0.0f, dot_pe = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxRankPerLane; ++i) {
      const int d = lane + 32 * i;
      val[i] = d < p.r ? ToFloat(p.latent[slot * p.r + d]) : 0.0f;
      dot_lat += q[i] * val[i];
    }
#pragma unroll
    for (int i = 0; i < kMaxRopePerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < p.dr) dot_pe += qr[i] * ToFloat(p.pe[slot * p.dr + d]);
    }
    float dot = dot_lat + dot_pe;
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, w);
    const float x = dot * p.scale_log2;
    const float mnew = fmaxf(mrun, x);
    const float alpha = exp2f(mrun - mnew), pv = exp2f(x - mnew);
    lrun = lrun * alpha + pv;
#pragma unroll
    for (int i = 0; i < kMaxRankPerLane; ++i) acc[i] = acc[i] * alpha + pv * val[i];
    mrun = mnew;
  }
  const float inv = lrun > 0.0f ? 1.0f / lrun : 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxRankPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < p.r) FromFloat(acc[i] * inv, p.out + row * p.r + d);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// Handler
// ------------------------------------------------------------------------------------------------------------------

ffi::Error LastError(const char* what) { return kdtree::CudaStatus(cudaGetLastError(), "mla_verify", what); }

template <typename... Params, typename... Args>
ffi::Error Launch(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t stream, bool pdl,
                  const char* what, Args... args) {
  return kdtree::LaunchKernel(kernel, grid, threads, smem, stream, pdl, "mla_verify", what, args...);
}

template <typename T>
ffi::Error LaunchGeneric(cudaStream_t stream, const GenericParams<T>& p) {
  const int64_t rows = static_cast<int64_t>(p.b) * p.n * p.h;
  GenericKernel<T><<<static_cast<unsigned>((rows + 3) / 4), 128, 0, stream>>>(p);
  return LastError("generic kernel launch");
}

ffi::Error MlaVerifyCudaImpl(cudaStream_t stream,
                             ffi::AnyBuffer q_lat,                 // [B, N, H, R]
                             ffi::AnyBuffer q_pe,                  // [B, N, H, dr]
                             ffi::AnyBuffer latent,                // [B, S, R]
                             ffi::AnyBuffer pe,                    // [B, S, dr]
                             ffi::Buffer<ffi::S32> cache_lens,     // [B]
                             ffi::Buffer<ffi::PRED> tree_mask,     // [B, N, N]
                             float scale,                          // softmax scale
                             int64_t flags,                        // bit 0: plain launches (fast path)
                             ffi::Result<ffi::AnyBuffer> out,      // [B, N, H, R]
                             ffi::Result<ffi::Buffer<ffi::F32>> part,    // [B, splits, M or 0, R]
                             ffi::Result<ffi::Buffer<ffi::F32>> stats) { // [B, splits, M or 0, 2]
  kdtree::MlaShape shape;
  if (ffi::Error e = kdtree::CheckMlaShape(q_lat.dimensions(), q_pe.dimensions(), latent.dimensions(),
                                           pe.dimensions(), cache_lens.element_count(), tree_mask.element_count(),
                                           &shape);
      e.failure()) {
    return e;
  }
  const int64_t B = shape.b, N = shape.n, H = shape.h, R = shape.r, DR = shape.dr, S = shape.s, M = N * H;
  if (S > INT32_MAX / 2) return ffi::Error::InvalidArgument("mla_verify: cache length beyond 32-bit indexing");
  const ffi::DataType t = q_lat.element_type();
  if (q_pe.element_type() != t || latent.element_type() != t || pe.element_type() != t ||
      out->element_type() != t) {
    return ffi::Error::InvalidArgument("mla_verify: q, q_pe, latent, pe and out must share one dtype");
  }
  if (B == 0 || M == 0 || R == 0) return ffi::Error::Success();
  const float scale_log2 = scale * 1.4426950408889634f;

  if (t == ffi::DataType::BF16 && R == kRank && DR == kRope) {
    const auto xd = part->dimensions(), sd = stats->dimensions();
    const int64_t splits = xd.size() == 4 ? xd[1] : 0;
    if (xd.size() != 4 || sd.size() != 4 || xd[0] != B || splits < 1 || splits > kMaxSplits || sd[1] != splits ||
        (splits > 1 && (xd[2] != M || xd[3] != R || sd[0] != B || sd[2] != M || sd[3] != 2))) {
      return ffi::Error::InvalidArgument("mla_verify: partials " + kdtree::ShapeString(xd) + " / stats " + kdtree::ShapeString(sd) +
                                         " do not match [B, splits, M, R] / [B, splits, M, 2]");
    }
    if (B > 65535) return ffi::Error::InvalidArgument("mla_verify: batch over 65535");
    FastParams p;
    p.q_lat = static_cast<const __nv_bfloat16*>(q_lat.untyped_data());
    p.q_pe = static_cast<const __nv_bfloat16*>(q_pe.untyped_data());
    p.latent = static_cast<const __nv_bfloat16*>(latent.untyped_data());
    p.pe = static_cast<const __nv_bfloat16*>(pe.untyped_data());
    p.lens = cache_lens.typed_data();
    p.mask = tree_mask.typed_data();
    p.out = static_cast<__nv_bfloat16*>(out->untyped_data());
    p.part = part->typed_data();
    p.stats = reinterpret_cast<float2*>(stats->typed_data());
    p.n = static_cast<int>(N);
    p.h = static_cast<int>(H);
    p.s = static_cast<int>(S);
    p.m = static_cast<int>(M);
    p.splits = static_cast<int>(splits);
    p.scale_log2 = scale_log2;
    if (cudaFuncSetAttribute(MlaVerifyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) !=
        cudaSuccess) {
      return LastError("raising the shared-memory limit");
    }
    const dim3 grid(static_cast<unsigned>((M + kRows - 1) / kRows), static_cast<unsigned>(splits),
                    static_cast<unsigned>(B));
    const bool pdl = !(flags & kFlagPlain);
    if (ffi::Error e = Launch(MlaVerifyKernel, grid, kThreads, kSmemBytes, stream, pdl, "kernel launch", p);
        e.failure()) {
      return e;
    }
    if (splits > 1) {
      const dim3 parts(static_cast<unsigned>(M), static_cast<unsigned>(B), kCombineParts);
      return Launch(CombineKernel, parts, kCombineWarps * 32, 0, stream, pdl, "combine launch",
                    static_cast<const float*>(p.part), static_cast<const float2*>(p.stats), p.out, p.m, p.splits);
    }
    return ffi::Error::Success();
  }

  if (R > 32 * kMaxRankPerLane || DR > 32 * kMaxRopePerLane) {
    return ffi::Error::InvalidArgument("mla_verify: the CUDA kernel takes R <= 1024 and dr <= 256 (got R = " +
                                       std::to_string(R) + ", dr = " + std::to_string(DR) + ")");
  }
  if (t == ffi::DataType::F32) {
    GenericParams<float> p{static_cast<const float*>(q_lat.untyped_data()),
                           static_cast<const float*>(q_pe.untyped_data()),
                           static_cast<const float*>(latent.untyped_data()),
                           static_cast<const float*>(pe.untyped_data()),
                           cache_lens.typed_data(),
                           tree_mask.typed_data(),
                           static_cast<float*>(out->untyped_data()),
                           static_cast<int>(B), static_cast<int>(N), static_cast<int>(H), static_cast<int>(R),
                           static_cast<int>(DR), static_cast<int>(S), scale_log2};
    return LaunchGeneric(stream, p);
  }
  if (t == ffi::DataType::BF16) {
    GenericParams<__nv_bfloat16> p{static_cast<const __nv_bfloat16*>(q_lat.untyped_data()),
                                   static_cast<const __nv_bfloat16*>(q_pe.untyped_data()),
                                   static_cast<const __nv_bfloat16*>(latent.untyped_data()),
                                   static_cast<const __nv_bfloat16*>(pe.untyped_data()),
                                   cache_lens.typed_data(),
                                   tree_mask.typed_data(),
                                   static_cast<__nv_bfloat16*>(out->untyped_data()),
                                   static_cast<int>(B), static_cast<int>(N), static_cast<int>(H),
                                   static_cast<int>(R), static_cast<int>(DR), static_cast<int>(S), scale_log2};
    return LaunchGeneric(stream, p);
  }
  return ffi::Error::InvalidArgument("mla_verify: dtype must be float32 or bfloat16");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMlaVerifyCuda, MlaVerifyCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // q_nope_absorbed [B, N, H, R]
                                  .Arg<ffi::AnyBuffer>()              // q_pe [B, N, H, dr]
                                  .Arg<ffi::AnyBuffer>()              // latent_cache [B, S, R]
                                  .Arg<ffi::AnyBuffer>()              // pe_cache [B, S, dr]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // cache_lens [B]
                                  .Arg<ffi::Buffer<ffi::PRED>>()      // tree_mask [B, N, N]
                                  .Attr<float>("scale")               // softmax scale
                                  .Attr<int64_t>("flags")             // bit 0: plain launches
                                  .Ret<ffi::AnyBuffer>()              // out [B, N, H, R]
                                  .Ret<ffi::Buffer<ffi::F32>>()       // partial outputs [B, splits, M, R]
                                  .Ret<ffi::Buffer<ffi::F32>>(),      // partial (max, sum) [B, splits, M, 2]
                              {xla::ffi::Traits::kCmdBufferCompatible});
