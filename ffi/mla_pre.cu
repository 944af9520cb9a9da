// mla_pre, CUDA handler (sm_90a): the function of mla_pre.cc (which has the math) in one launch.
//
// Fast path (bf16, dn = 128, dr = 64, R = 512, Rq in {512, 1024, 1536, 2048}, M <= 32 rows): a thread-block cluster
// of kCluster = 8 blocks per head, 8 warps a block. Both products run on the tensor cores (mma.sync m16n8k16, bf16 in,
// fp32 sums), the weights as the A operand held in registers, the tokens as B (8 a tile) read from shared memory.
//   0. Each block loads its weights into registers: the 24 rows of q_b[h] it owns (rows 24 c .. 24 c + 23 for cluster
//      rank c; two 16-row tiles, the second half empty), warp w taking the query-latent columns w Rq / 8 ..
//      (w + 1) Rq / 8 - 1; and 16 of the 64 latent columns it absorbs into (64 c .. 64 c + 63) over half of dn. With
//      flag bit 0 (the weights are the program's inputs, which no kernel writes) before waiting for the kernel before
//      it (PDL), so that their latency hides behind that kernel's tail.
//   1. Every block copies all M rows of the query latent into shared memory (cp.async, all in flight at once) and
//      normalizes them there (cq, bf16, as the model rounds).
//      Row m's key-value part (norm -> latent cache, rope -> rope-key cache) is written by block m mod (8 H).
//   2. q = cq . q_b for its 24 rows: each warp's partial sums over its columns, one 8-token tile at a time, into
//      shared memory, then summed over the 8 warps and rounded to bf16 (as the model rounds q). A q_nope value is
//      stored into every block of the cluster (distributed shared memory: stores, nothing waits on them), a rope
//      value kept for step 3.
//   3. The rows that are rope dimensions are rotated and stored as q_pe. A cluster barrier (every block now holds
//      the head's 128 q_nope rows), then each block computes its 64 absorbed columns: q_lat[m, h, i] =
//      q_nope[m] . k_b[i, h], the two halves of dn summed through shared memory.
//   The cluster's blocks first meet at a barrier split in two (arrive at the start, wait before the first store into
//   another block), so that no block writes into one that has not started.
// Lane (g, t) (g = lane / 4, t = lane % 4) loads 16 bytes, elements 8 t .. 8 t + 7 of a 32-wide chunk, of each A row
// and B token it holds; mma step s (two per chunk) takes elements 8 t + 4 s .. + 3 as the fragment's k = 2 t, 2 t + 1,
// 2 t + 8, 2 t + 9. A and B use the same reordering of k, so the sum is unchanged and every load is 16 bytes.
// The code is small on purpose (no loop over tokens unrolled): an earlier version, unrolled to 8,248 instructions,
// spent 70% of its warps' time waiting for instructions (ncu, H100: 37 µs at M = 1).
// Sums run in another order than the CPU handler's, so results agree to rounding, not bit for bit.
// Any other shape or dtype: the Python wrapper runs the reference instead (no CUDA kernel here).

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda_common.cuh"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using F32Mat = ffi::Buffer<ffi::F32, 2>;
using I32Vec = ffi::Buffer<ffi::S32, 1>;
namespace cg = cooperative_groups;

namespace {

constexpr int kCluster = 8;          // blocks per head
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kDn = 128, kDr = 64, kRank = 512, kDq = kDn + kDr;
constexpr int kRowsPerBlock = kDq / kCluster;   // 24 rows of q_b
constexpr int kColsPerBlock = kRank / kCluster;  // 64 absorbed columns
constexpr int kMaxM = 32;
constexpr int kRedPitch = kMaxM + 8;   // floats a row of partial sums (float2 stores of 16 lanes: no bank conflicts)
constexpr int kNopePitch = kDn + 32;   // bf16 a q_nope row (rows 64 bytes apart mod 128: 16-byte B loads conflict-free)
__host__ __device__ constexpr int CqPitch(int rq) { return rq + 32; }  // bf16 a cq row, for the same reason

struct Params {
  const __nv_bfloat16* a;    // [M, Rq + R + dr]
  const __nv_bfloat16* wq;   // [Rq]
  const __nv_bfloat16* wkv;  // [R]
  const __nv_bfloat16* qb;   // [H, dq, Rq]
  const __nv_bfloat16* kb;   // [R, H, dn]
  const float* cos;          // [M, dr / 2]
  const float* sin;          // [M, dr / 2]
  const int32_t* starts;     // [B]
  __nv_bfloat16* q_lat;      // [M, H, R]
  __nv_bfloat16* q_pe;       // [M, H, dr]
  __nv_bfloat16* lat;        // [B, S, R]
  __nv_bfloat16* pe;         // [B, S, dr]
  int m, t, h, s;
  float eps;
  bool early;                // the weights are program inputs no kernel writes: load them before the PDL wait
};

// The cluster barrier in two halves: arrive (relaxed: orders nothing), then wait.
__device__ __forceinline__ void ClusterArrive() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void ClusterWait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

__device__ __forceinline__ float Round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ void Unpack(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(p[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ uint4 Pack(const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

__device__ __forceinline__ float WarpSum(float x, int width = 32) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    if (o < width) x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

// The A fragment of mma step s from 16-byte rows lo (fragment rows g) and hi (rows g + 8): see the header.
__device__ __forceinline__ void FragA(uint32_t (&a)[4], const uint4& lo, const uint4& hi, int s) {
  a[0] = s ? lo.z : lo.x;
  a[1] = s ? hi.z : hi.x;
  a[2] = s ? lo.w : lo.y;
  a[3] = s ? hi.w : hi.y;
}

// Norm of one row of n = 256 kChunksPerLane elements (x, weight w) by one warp: round(w * round(x / rms)) into dst
// (which may be x: each lane writes the chunks it read).
template <int kChunksPerLane>
__device__ __forceinline__ void NormRow(const __nv_bfloat16* x, const uint4 (&w)[kChunksPerLane], float eps,
                                        __nv_bfloat16* dst) {
  const int lane = threadIdx.x & 31;
  constexpr int n = 256 * kChunksPerLane;
  float v[kChunksPerLane][8];
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunksPerLane; ++c) {
    Unpack(reinterpret_cast<const uint4*>(x)[lane + 32 * c], v[c]);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += v[c][e] * v[c][e];
  }
  const float inv = rsqrtf(WarpSum(ss) / static_cast<float>(n) + eps);
#pragma unroll
  for (int c = 0; c < kChunksPerLane; ++c) {
    float wf[8], o[8];
    Unpack(w[c], wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = wf[e] * Round(v[c][e] * inv);
    reinterpret_cast<uint4*>(dst)[lane + 32 * c] = Pack(o);
  }
}

template <int kChunks>  // Rq / 256: 32-wide chunks of the query latent a warp multiplies (Rq / 8 columns)
__global__ void __launch_bounds__(kThreads, 1) MlaPreKernel(const Params p) {
  constexpr int kRq = 256 * kChunks, kCq = CqPitch(kRq), kWarpCols = kRq / kWarps;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  __nv_bfloat16* cq = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [M rounded up to 8, kCq]
  __shared__ __align__(16) float red[kWarps * kRowsPerBlock * kRedPitch];  // partial sums (q, then q_lat)
  __shared__ float q_rope[kRowsPerBlock][kMaxM];  // this block's rope rows of q (rounded)
  __shared__ __align__(16) __nv_bfloat16 q_nope[kMaxM][kNopePitch];  // the head's q_nope, stored by the cluster
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int head = blockIdx.x / kCluster;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  ClusterArrive();  // this block has started (waited for before the first store into another block)

  // 0. weights into registers (independent of the kernel before this one when they are the program's inputs)
  if (!p.early) GridDependencyWait();
  uint4 wa0[kChunks], wa1[kChunks], wa2[kChunks];  // q_b rows g, g + 8 (tile 0) and 16 + g (tile 1)
  {
    const __nv_bfloat16* src = p.qb + (static_cast<int64_t>(head) * kDq + rank * kRowsPerBlock + g) * kRq +
                               warp * kWarpCols + 8 * t4;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      wa0[c] = *reinterpret_cast<const uint4*>(src + 32 * c);
      wa1[c] = *reinterpret_cast<const uint4*>(src + 8 * kRq + 32 * c);
      wa2[c] = *reinterpret_cast<const uint4*>(src + 16 * kRq + 32 * c);
    }
  }
  const int half = warp >> 2, tile = warp & 3;  // the absorption: dn half, 16-column tile of the block's 64
  uint4 wkb[2][2];                              // [chunk][rows g, g + 8]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int col = rank * kColsPerBlock + 16 * tile + g + 8 * r;
    const __nv_bfloat16* src = p.kb + (static_cast<int64_t>(col) * p.h + head) * kDn + 64 * half + 8 * t4;
#pragma unroll
    for (int c = 0; c < 2; ++c) wkb[c][r] = *reinterpret_cast<const uint4*>(src + 32 * c);
  }
  uint4 wq[kChunks], wkv[2];
#pragma unroll
  for (int k = 0; k < kChunks; ++k) wq[k] = reinterpret_cast<const uint4*>(p.wq)[lane + 32 * k];
#pragma unroll
  for (int k = 0; k < 2; ++k) wkv[k] = reinterpret_cast<const uint4*>(p.wkv)[lane + 32 * k];

  GridDependencyWait();  // a, the rope tables, the starts and the caches come from the kernels before this one
  LaunchDependents();

  // 1. the query latent of every row copied into shared memory (every copy in flight at once), normalized there in
  // place after this block's rows of the key-value part went to the caches
  const int64_t width = kRq + kRank + kDr;
  for (int i = threadIdx.x; i < p.m * (kRq / 8); i += kThreads) {
    const int m = i / (kRq / 8), k = i % (kRq / 8);
    CopyAsync16Cg(SmemAddress(cq + m * kCq + 8 * k), p.a + m * width + 8 * k);
  }
  CopyCommit();
  const int block = head * kCluster + rank, blocks = p.h * kCluster;
  for (int m = block + warp * blocks; m < p.m; m += kWarps * blocks) {
    const int b = m / p.t;
    const int slot = min(max(p.starts[b], 0), p.s - p.t) + m % p.t;
    const int64_t dst = static_cast<int64_t>(b) * p.s + slot;
    NormRow<2>(p.a + m * width + kRq, wkv, p.eps, p.lat + dst * kRank);
    const __nv_bfloat162 x = reinterpret_cast<const __nv_bfloat162*>(p.a + m * width + kRq + kRank)[lane];
    const float2 xf = __bfloat1622float2(x);
    const float cs = p.cos[m * (kDr / 2) + lane], sn = p.sin[m * (kDr / 2) + lane];
    reinterpret_cast<__nv_bfloat162*>(p.pe + dst * kDr)[lane] =
        __floats2bfloat162_rn(xf.x * cs - xf.y * sn, xf.y * cs + xf.x * sn);
  }
  CopyWait<0>();
  __syncthreads();
  for (int m = warp; m < p.m; m += kWarps) NormRow<kChunks>(cq + m * kCq, wq, p.eps, cq + m * kCq);
  __syncthreads();

  // 2. q: this warp's partial sums of the block's 24 rows over its columns, 8 tokens a tile (tokens >= M read
  // whatever the padded rows of cq hold; their columns are never used)
#pragma unroll 1
  for (int n0 = 0; n0 < p.m; n0 += 8) {
    float d0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const __nv_bfloat16* x = cq + (n0 + g) * kCq + warp * kWarpCols + 8 * t4;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint4 b = *reinterpret_cast<const uint4*>(x + 32 * c);
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        uint32_t a[4];
        FragA(a, wa0[c], wa1[c], s);
        MmaAt(d0, a, s ? b.z : b.x, s ? b.w : b.y);
        FragA(a, wa2[c], zero, s);
        MmaAt(d1, a, s ? b.z : b.x, s ? b.w : b.y);
      }
    }
    float* r = red + warp * kRowsPerBlock * kRedPitch + n0 + 2 * t4;
    *reinterpret_cast<float2*>(r + g * kRedPitch) = make_float2(d0[0], d0[1]);
    *reinterpret_cast<float2*>(r + (g + 8) * kRedPitch) = make_float2(d0[2], d0[3]);
    *reinterpret_cast<float2*>(r + (g + 16) * kRedPitch) = make_float2(d1[0], d1[1]);
  }
  __syncthreads();
  ClusterWait();  // every block of the cluster has started
  for (int i = threadIdx.x; i < kRowsPerBlock * p.m; i += kThreads) {
    const int row = i / p.m, m = i % p.m, n = rank * kRowsPerBlock + row;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[(w * kRowsPerBlock + row) * kRedPitch + m];
    if (n < kDn) {  // q_nope: into every block's copy
      const __nv_bfloat16 v = __float2bfloat16_rn(sum);
#pragma unroll
      for (int b = 0; b < kCluster; ++b) cluster.map_shared_rank(&q_nope[0][0], b)[m * kNopePitch + n] = v;
    } else {
      q_rope[row][m] = Round(sum);
    }
  }
  __syncthreads();

  // 3. the rope rows rotated into q_pe; then the cluster's q_nope stores complete
  for (int i = threadIdx.x; i < (kRowsPerBlock / 2) * p.m; i += kThreads) {
    const int pair = i % (kRowsPerBlock / 2), m = i / (kRowsPerBlock / 2);
    const int row = rank * kRowsPerBlock + 2 * pair;
    if (row < kDn) continue;
    const int j = (row - kDn) / 2;
    const float x1 = q_rope[2 * pair][m], x2 = q_rope[2 * pair + 1][m];
    const float cs = p.cos[m * (kDr / 2) + j], sn = p.sin[m * (kDr / 2) + j];
    reinterpret_cast<__nv_bfloat162*>(p.q_pe + (static_cast<int64_t>(m) * p.h + head) * kDr)[j] =
        __floats2bfloat162_rn(x1 * cs - x2 * sn, x2 * cs + x1 * sn);
  }
  cluster.sync();  // (release, acquire) every block's q_nope stores are visible here

  // the absorption: warp (half, tile) sums its 16 columns over dn half `half`; red holds [2][64][kRedPitch]
#pragma unroll 1
  for (int n0 = 0; n0 < p.m; n0 += 8) {
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const __nv_bfloat16* x = &q_nope[n0 + g][64 * half + 8 * t4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint4 b = *reinterpret_cast<const uint4*>(x + 32 * c);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        uint32_t a[4];
        FragA(a, wkb[c][0], wkb[c][1], s);
        MmaAt(d, a, s ? b.z : b.x, s ? b.w : b.y);
      }
    }
    float* r = red + (half * kColsPerBlock + 16 * tile) * kRedPitch + n0 + 2 * t4;
    *reinterpret_cast<float2*>(r + g * kRedPitch) = make_float2(d[0], d[1]);
    *reinterpret_cast<float2*>(r + (g + 8) * kRedPitch) = make_float2(d[2], d[3]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kColsPerBlock * p.m; i += kThreads) {
    const int col = i % kColsPerBlock, m = i / kColsPerBlock;
    const float v = red[col * kRedPitch + m] + red[(kColsPerBlock + col) * kRedPitch + m];
    p.q_lat[(static_cast<int64_t>(m) * p.h + head) * kRank + rank * kColsPerBlock + col] = __float2bfloat16_rn(v);
  }
}

template <int kChunks>
ffi::Error Launch(cudaStream_t stream, const Params& p) {
  auto kernel = MlaPreKernel<kChunks>;
  constexpr int kRow = CqPitch(256 * kChunks) * 2;  // bytes a row of cq
  const int smem = ((p.m + 7) / 8 * 8) * kRow;  // cq [M rounded up to a tile, Rq + 32] bf16; the limit is set for the
  // largest M (one value, so that calls from several host threads never lower it under one another's launch)
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxM * kRow) !=
      cudaSuccess) {
    return kdtree::CudaStatus(cudaGetLastError(), "mla_pre", "raising the shared-memory limit");
  }
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  attrs[1].id = cudaLaunchAttributeClusterDimension;
  attrs[1].val.clusterDim.x = kCluster;
  attrs[1].val.clusterDim.y = 1;
  attrs[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(p.h * kCluster));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = 2;
  return kdtree::CudaStatus(cudaLaunchKernelEx(&config, kernel, p), "mla_pre", "kernel launch");
}

ffi::Error MlaPreCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer qn, ffi::AnyBuffer kvn, ffi::AnyBuffer qb,
                      ffi::AnyBuffer kb, F32Mat cos, F32Mat sin,
                      I32Vec starts, ffi::AnyBuffer lat_in, ffi::AnyBuffer pe_in, float eps,
                      int64_t flags, ffi::Result<ffi::AnyBuffer> q_lat, ffi::Result<ffi::AnyBuffer> q_pe,
                      ffi::Result<ffi::AnyBuffer> lat, ffi::Result<ffi::AnyBuffer> pe) {
  const auto ad = a.dimensions(), qd = qb.dimensions(), kd = kb.dimensions(), ld = lat_in.dimensions();
  for (ffi::DataType u : {a.element_type(), qn.element_type(), kvn.element_type(), qb.element_type(),
                          kb.element_type(), lat_in.element_type(), pe_in.element_type(), q_lat->element_type(),
                          q_pe->element_type()}) {
    if (u != ffi::DataType::BF16) return ffi::Error::InvalidArgument("mla_pre: the CUDA handler takes bfloat16");
  }
  if (ad.size() != 2 || qd.size() != 3 || kd.size() != 3 || ld.size() != 3 || pe_in.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument("mla_pre: a [M, C], q_b [H, dn + dr, Rq], k_b [R, H, dn], caches [B, S, *]");
  }
  const int64_t m = ad[0], h = qd[0], rq = qd[2], b = ld[0], s = ld[1];
  if (qd[1] != kDq || kd[0] != kRank || kd[1] != h || kd[2] != kDn || ld[2] != kRank || ad[1] != rq + kRank + kDr ||
      pe_in.dimensions()[0] != b || pe_in.dimensions()[1] != s || pe_in.dimensions()[2] != kDr || b < 1 ||
      m % b || m < 1 || m > kMaxM || m / b > s || starts.element_count() != static_cast<size_t>(b) ||
      cos.element_count() != static_cast<size_t>(m * kDr / 2) || sin.element_count() != cos.element_count() ||
      qn.element_count() != static_cast<size_t>(rq) || kvn.element_count() != static_cast<size_t>(kRank) ||
      h < 1 || h > 65535 / kCluster || s > INT32_MAX / 2) {
    return ffi::Error::InvalidArgument("mla_pre: the CUDA handler takes dn = 128, dr = 64, R = 512, 1 <= B T <= 32 "
                                       "(got a " + kdtree::ShapeString(ad) + ", q_b " + kdtree::ShapeString(qd) +
                                       ", k_b " + kdtree::ShapeString(kd) + ", latent " + kdtree::ShapeString(ld) +
                                       ")");
  }
  if (lat->untyped_data() != lat_in.untyped_data() &&
      cudaMemcpyAsync(lat->untyped_data(), lat_in.untyped_data(), lat_in.size_bytes(), cudaMemcpyDeviceToDevice,
                      stream) != cudaSuccess) {
    return kdtree::CudaStatus(cudaGetLastError(), "mla_pre", "copying the latent cache");
  }
  if (pe->untyped_data() != pe_in.untyped_data() &&
      cudaMemcpyAsync(pe->untyped_data(), pe_in.untyped_data(), pe_in.size_bytes(), cudaMemcpyDeviceToDevice,
                      stream) != cudaSuccess) {
    return kdtree::CudaStatus(cudaGetLastError(), "mla_pre", "copying the rope-key cache");
  }
  Params p;
  p.a = static_cast<const __nv_bfloat16*>(a.untyped_data());
  p.wq = static_cast<const __nv_bfloat16*>(qn.untyped_data());
  p.wkv = static_cast<const __nv_bfloat16*>(kvn.untyped_data());
  p.qb = static_cast<const __nv_bfloat16*>(qb.untyped_data());
  p.kb = static_cast<const __nv_bfloat16*>(kb.untyped_data());
  p.cos = cos.typed_data();
  p.sin = sin.typed_data();
  p.starts = starts.typed_data();
  p.q_lat = static_cast<__nv_bfloat16*>(q_lat->untyped_data());
  p.q_pe = static_cast<__nv_bfloat16*>(q_pe->untyped_data());
  p.lat = static_cast<__nv_bfloat16*>(lat->untyped_data());
  p.pe = static_cast<__nv_bfloat16*>(pe->untyped_data());
  p.m = static_cast<int>(m);
  p.t = static_cast<int>(m / b);
  p.h = static_cast<int>(h);
  p.s = static_cast<int>(s);
  p.eps = eps;
  p.early = flags & 1;
  switch (rq) {
    case 512: return Launch<2>(stream, p);
    case 1024: return Launch<4>(stream, p);
    case 1536: return Launch<6>(stream, p);
    case 2048: return Launch<8>(stream, p);
    default:
      return ffi::Error::InvalidArgument("mla_pre: the CUDA handler takes Rq in {512, 1024, 1536, 2048}, got " +
                                         std::to_string(rq));
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMlaPreCuda, MlaPreCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // a [M, Rq + R + dr] (qkv_a's output)
                                  .Arg<ffi::AnyBuffer>()               // q_a_norm [Rq]
                                  .Arg<ffi::AnyBuffer>()               // kv_a_norm [R]
                                  .Arg<ffi::AnyBuffer>()               // q_b [H, dn + dr, Rq]
                                  .Arg<ffi::AnyBuffer>()               // k_b [R, H, dn]
                                  .Arg<F32Mat>()     // cos [M, dr / 2]
                                  .Arg<F32Mat>()     // sin [M, dr / 2]
                                  .Arg<I32Vec>()     // starts [B]
                                  .Arg<ffi::AnyBuffer>()               // latent cache [B, S, R] (aliased)
                                  .Arg<ffi::AnyBuffer>()               // rope-key cache [B, S, dr] (aliased)
                                  .Attr<float>("eps")                  // the norms' epsilon
                                  .Attr<int64_t>("flags")              // bit 0: the weights are program inputs
                                  .Ret<ffi::AnyBuffer>()               // q_lat [M, H, R]
                                  .Ret<ffi::AnyBuffer>()               // q_pe [M, H, dr]
                                  .Ret<ffi::AnyBuffer>()               // latent cache, rows written
                                  .Ret<ffi::AnyBuffer>(),              // rope-key cache, rows written
                              {xla::ffi::Traits::kCmdBufferCompatible});
