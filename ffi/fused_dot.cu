// fused_dot on CUDA (sm_90a): the dense matmuls of a decode or verify step (M <= 32 rows) with what surrounds them
// in a layer, in one launch; the function of fused_dot.cc (kdtree_jax/kernels/fused_dot.py has the math).
//
//   y_s = epilogue_s(r * (x * nw) . w_s)        for the one or two weights w_s [K, N_s] that share the input x
//
// r = 1 / sqrt(mean(x^2) + eps) per row when an RMSNorm weight nw is given (the norm factored out of the dot, so no
// kernel writes the normalized rows first), else r = 1 and nw = 1. Epilogues: plain (bf16 or f32, then up to two
// residual adds, each rounded to bf16 as the model's `h + a` is), or gated (w_s = [gate | up], y = silu(gate) * up).
// The normalized rows themselves (bf16(nw * bf16(x * r)), exactly the reference's RMSNorm) are an optional output,
// for the routed experts.
//
// Why: a layer at one device's share of K2.6 ran ~14 XLA kernels around its dense weights at M = 1 (two per norm,
// split-K and its reduction per dot, the gate multiply), each taking 1-8 µs whatever it moved. Four launches of this
// kernel do that work.
//
// Work split. A block of 8 warps owns 16 columns of w (two n-tiles of 8: 32 contiguous bytes of every row; for a
// gated weight, 8 gate columns and the same 8 up columns) and one K slice; the `split` blocks of a thread-block
// cluster share the K of one 16-column group and exchange their fp32 partials (and the rows' sums of squares)
// through distributed shared memory, in rank order, so the result does not depend on timing. Within a block, warp w
// takes the 64-row chunks w, w + 8, ... of the slice (the 8 warps read neighbouring rows at once).
//
// Streaming. Each warp streams its chunks through its own ring of kRing stages (cp.async, L2 only; no block-wide
// barrier in the loop): a stage holds the chunk's 64 rows x 32 bytes of w, the 64 norm weights and the 64 inputs of
// each token row. The first stages of w (a parameter no kernel writes) are copied before griddepcontrol.wait.
//
// The product: mma.m16n8k16 with the token rows as A (16 a tile) and w as B (16 inputs x 8 columns). The inputs of
// a 32-row block are summed in an order chosen so that both operands load 16 bytes a lane: lane (g, t) takes inputs
// 8t .. 8t + 7 of token rows g and g + 8 (the A registers of both k-steps of the block), and B's rows are stored in
// shared memory in the matching order (k-step s, logical row l <-> physical row 8 (l % 8 / 2) + 4 s + 2 (l / 8) +
// l % 2), each 8 x 8 matrix that ldmatrix.trans reads as 128 contiguous bytes (no bank conflicts).
// No workspace, no host sync (kCmdBufferCompatible).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "cuda_common.cuh"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace cg = cooperative_groups;

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kCols = 16;                  // columns of w a block owns
constexpr int kChunk = 64;                 // rows of w (inputs) a stage
constexpr int kWBytes = kChunk * kCols * 2;  // 2 KB
constexpr int kRing = 4;                   // stages a warp
constexpr int kMaxRows = 32;
constexpr int kMaxSplit = 8;
constexpr int64_t kFlagPlain = 1;
constexpr int64_t kFlagEarlyW = 2;
constexpr int64_t kFlagL2Lines = 4;  // the weight copies ask L2 for whole 256-byte lines

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

__host__ __device__ constexpr int StageBytes(int m) { return kWBytes + 128 + m * 128; }
__host__ __device__ constexpr int RingBytes(int m) { return kWarps * kRing * StageBytes(m); }
// after the rings: the block's partials [M][16] f32, the warps' sums of squares [8][M], the block's [M]
__host__ constexpr int SmemBytes(int m) { return RingBytes(m) + m * kCols * 4 + kWarps * m * 4 + m * 4; }

__device__ __forceinline__ float Bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// 8 bf16 (one uint4) times 8 bf16 -> 8 bf16, each product rounded once; adds the squares of x to ss.
__device__ __forceinline__ uint4 NormTimes(uint4 xv, uint4 nv, float& ss) {
  uint32_t in[4] = {xv.x, xv.y, xv.z, xv.w}, nn[4] = {nv.x, nv.y, nv.z, nv.w}, out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&in[i]);
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&nn[i]);
    const float2 af = __bfloat1622float2(a), bf = __bfloat1622float2(b);
    ss = fmaf(af.x, af.x, ss);
    ss = fmaf(af.y, af.y, ss);
    const __nv_bfloat162 p = __floats2bfloat162_rn(af.x * bf.x, af.y * bf.y);
    out[i] = *reinterpret_cast<const uint32_t*>(&p);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// grid (split, groups of both segments), cluster (split, 1, 1): blockIdx.y picks the 16 columns, the rank the K
// slice. MT: token tiles of 16 (M <= 16 MT).
template <int MT>
__global__ void __launch_bounds__(kThreads) FusedDotKernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int rank = blockIdx.x, split = p.split, m = p.m;
  const int s_idx = blockIdx.y < p.seg[0].groups ? 0 : 1;
  const Segment seg = s_idx ? p.seg[1] : p.seg[0];  // (not p.seg[s_idx]: a copy to local memory)
  const int group = blockIdx.y - (s_idx ? p.seg[0].groups : 0);
  // the global columns of the block's two n-tiles
  const int col_h0 = seg.gated ? 8 * group : kCols * group;
  const int col_h1 = seg.gated ? seg.n / 2 + 8 * group : kCols * group + 8;
  const int kslice = p.k / split, k0 = rank * kslice;
  const int chunks = kslice / kChunk;
  const int mine = warp < chunks ? (chunks - warp + kWarps - 1) / kWarps : 0;  // this warp's chunks
  const int stage = StageBytes(m);
  const uint32_t ring = SmemAddress(smem) + warp * kRing * stage;
  const bool norm = p.nw != nullptr;

  // lane-constant parts of the copies: piece i of a stage (row q / 2, half q % 2 of the 32 bytes, q = lane + 32 i)
  // lands at matrix (32-row block, k-step, row half) of the ldmatrix order, row 2 (row % 32 / 8) + row % 2
  uint32_t w_slot[4];
  int w_src[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int q = lane + 32 * i, row = q / 2, h = q % 2, b = row / 32, pl = row % 32;
    w_slot[i] = ((((b * 4 + 2 * (pl % 8 / 4) + pl % 4 / 2) * 2 + h) * 8 + 2 * (pl / 8) + pl % 2) * 16);
    w_src[i] = row * seg.n + (h ? col_h1 : col_h0);
  }
  auto chunk_row = [&](int c) { return k0 + (warp + kWarps * c) * kChunk; };
  auto copy_w = [&](int c) {  // 64 rows x 2 pieces of 16 bytes: 4 copies a lane
    const uint32_t dst = ring + (c % kRing) * stage;
    const __nv_bfloat16* src = seg.w + static_cast<int64_t>(chunk_row(c)) * seg.n;
#pragma unroll
    for (int i = 0; i < 4; ++i) CopyAsync16Cg(dst + w_slot[i], src + w_src[i], p.l2_256);
    if (norm && lane < 8) CopyAsync16Cg(dst + kWBytes + lane * 16, p.nw + chunk_row(c) + lane * 8);
  };
  const int x_row0 = lane / 8, x_piece = lane % 8;  // lane's first token row and its 16-byte piece of the chunk
  auto copy_x = [&](int c) {  // the chunk's 64 inputs of every token row: 8 pieces a row, swizzled by row parity
    const uint32_t dst = ring + (c % kRing) * stage + kWBytes + 128;
    const __nv_bfloat16* src = p.x + chunk_row(c) + x_piece * 8;
#pragma unroll 1
    for (int row = x_row0; row < m; row += 4) {
      CopyAsync16Cg(dst + row * 128 + ((x_piece ^ ((row & 1) << 2)) << 4), src + row * p.k);
    }
  };

  auto first_w = [&]() {
#pragma unroll
    for (int c = 0; c < kRing - 1; ++c) {
      if (c < mine) copy_w(c);
      CopyCommit();
    }
  };
  if (p.early_w) first_w();
  GridDependencyWait();
  if (!p.early_w) first_w();
  for (int c = 0; c < kRing - 1 && c < mine; ++c) copy_x(c);
  CopyCommit();
  LaunchDependents();

  float acc[MT][2][4];
  float ss[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    ss[mt][0] = ss[mt][1] = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) acc[mt][h][0] = acc[mt][h][1] = acc[mt][h][2] = acc[mt][h][3] = 0.0f;
  }

  for (int c = 0; c < mine; ++c) {
    if (c == 0) {
      CopyWait<0>();
    } else {
      CopyWait<kRing - 2>();
    }
    __syncwarp();  // chunk c visible to the whole warp; the slot of chunk c - 1 read by every lane
    if (c + kRing - 1 < mine) {
      copy_w(c + kRing - 1);
      copy_x(c + kRing - 1);
    }
    CopyCommit();
    const uint32_t ws = ring + (c % kRing) * stage;
    const unsigned char* stage_ptr = smem + warp * kRing * stage + (c % kRing) * stage;
#pragma unroll
    for (int b = 0; b < 2; ++b) {  // 32-row blocks of the chunk
      uint32_t bw[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) LdsmT4(bw[h], ws + (((b * 4 + lane / 8) * 2 + h) * 8 + lane % 8) * 16);
      uint4 nv = make_uint4(0, 0, 0, 0);
      if (norm) nv = *reinterpret_cast<const uint4*>(stage_ptr + kWBytes + (4 * b + t) * 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint4 xr[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = 16 * mt + g + 8 * half;
          xr[half] = make_uint4(0, 0, 0, 0);
          if (row < m) {
            const int piece = (4 * b + t) ^ ((row & 1) << 2);
            xr[half] = *reinterpret_cast<const uint4*>(stage_ptr + kWBytes + 128 + row * 128 + piece * 16);
            if (norm) {
              xr[half] = NormTimes(xr[half], nv, ss[mt][half]);
            }
          }
        }
        const uint32_t a0[4] = {xr[0].x, xr[1].x, xr[0].y, xr[1].y};  // k-step 0: inputs 8t + 0..3
        const uint32_t a1[4] = {xr[0].z, xr[1].z, xr[0].w, xr[1].w};  // k-step 1: inputs 8t + 4..7
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          MmaAt(acc[mt][h], a0, bw[h][0], bw[h][1]);
          MmaAt(acc[mt][h], a1, bw[h][2], bw[h][3]);
        }
      }
    }
  }
  CopyWait<0>();
  if (!norm) {  // the sums of squares only matter with a norm; keep them zero otherwise
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ss[mt][0] = ss[mt][1] = 0.0f;
  }
  __syncthreads();  // every ring read: the rings become the warps' partials

  // warp partials red[warp][token][16 columns]; lane (g, t) holds tokens 16 mt + g (+ 8), columns 8 h + 2 t (+ 1)
  float* red = reinterpret_cast<float*>(smem);
  float* part = reinterpret_cast<float*>(smem + RingBytes(m));
  float* ssw = part + m * kCols;
  float* bss = ssw + kWarps * m;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = 16 * mt + g + 8 * half;
      float s = ss[mt][half];
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (row < m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          red[(warp * m + row) * kCols + 8 * h + 2 * t] = acc[mt][h][2 * half];
          red[(warp * m + row) * kCols + 8 * h + 2 * t + 1] = acc[mt][h][2 * half + 1];
        }
        if (t == 0) ssw[warp * m + row] = s;
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < m * kCols; e += kThreads) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += red[w * m * kCols + e];
    part[e] = s;
  }
  for (int e = tid; e < m; e += kThreads) {
    float s = 0.0f;
    for (int w = 0; w < kWarps; ++w) s += ssw[w * m + e];
    bss[e] = s;
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (split > 1) {
    cluster.sync();
  } else {
    __syncthreads();
  }
  auto peer = [&](float* ptr, int r) { return split > 1 ? cluster.map_shared_rank(ptr, r) : ptr; };
  float* rs = ssw;  // the rows' scales (the warps' sums of squares are no longer needed)
  if (tid < m) {
    float s = 0.0f;
    for (int r = 0; r < split; ++r) s += peer(bss, r)[tid];
    rs[tid] = norm ? rsqrtf(s / static_cast<float>(p.k) + p.eps) : 1.0f;
  }
  __syncthreads();
  const int outs = seg.gated ? 8 : kCols;  // outputs a row
  const int total = m * outs, per = (total + split - 1) / split;
  const int lo = rank * per, hi = min(total, lo + per);
  for (int e = lo + tid; e < hi; e += kThreads) {
    const int row = e / outs, c = e % outs;
    const int src = row * kCols + c;
    float v0 = 0.0f, v1 = 0.0f;
    for (int r = 0; r < split; ++r) {
      const float* pr = peer(part, r);
      v0 += pr[src];
      if (seg.gated) v1 += pr[src + 8];
    }
    const float sc = rs[row];
    if (seg.gated) {
      const float gate = Bf(v0 * sc), up = Bf(v1 * sc);
      const float h = Bf(Bf(gate * Bf(1.0f / (1.0f + __expf(-gate)))) * up);
      reinterpret_cast<__nv_bfloat16*>(seg.y)[row * (seg.n / 2) + 8 * group + c] = __float2bfloat16_rn(h);
    } else {
      const float v = v0 * sc;
      const int at = row * seg.n + kCols * group + c;
      if (seg.f32) {
        reinterpret_cast<float*>(seg.y)[at] = v;
      } else {
        float o = Bf(v);
        if (s_idx == 0 && p.add0) o = Bf(__bfloat162float(p.add0[at]) + o);
        if (s_idx == 0 && p.add1) o = Bf(__bfloat162float(p.add1[at]) + o);
        reinterpret_cast<__nv_bfloat16*>(seg.y)[at] = __float2bfloat16_rn(o);
      }
    }
  }
  if (p.xn && blockIdx.y == 0) {  // the normalized rows of this block's K slice
    for (int row = 0; row < m; ++row) {
      const float sc = rs[row];
      for (int kk = k0 + tid; kk < k0 + kslice; kk += kThreads) {
        const float xr = Bf(__bfloat162float(p.x[row * p.k + kk]) * sc);
        p.xn[row * p.k + kk] = __float2bfloat16_rn((norm ? __bfloat162float(p.nw[kk]) : 1.0f) * xr);
      }
    }
  }
  if (split > 1) cluster.sync();  // no block leaves while another still reads its partials
}

constexpr int kDevices = 64;
std::atomic<int> g_sms[kDevices];

ffi::Error Sms(int* sms) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return kdtree::CudaStatus(cudaGetLastError(), "fused_dot", "device");
  if (device >= 0 && device < kDevices && (*sms = g_sms[device].load(std::memory_order_relaxed)) > 0) {
    return ffi::Error::Success();
  }
  if (cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return kdtree::CudaStatus(cudaGetLastError(), "fused_dot", "querying the SM count");
  }
  if (device >= 0 && device < kDevices) g_sms[device].store(*sms, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// The blocks of a K slice: the fewest (a power of two up to 8 dividing K's 64-row chunks) whose grid covers every
// SM, else the most that divide.
int ChooseSplit(int64_t k, int64_t groups, int sms) {
  const int64_t chunks = k / kChunk;
  int best = 1;
  for (int s = 1; s <= kMaxSplit; s *= 2) {
    if (chunks % s) break;
    best = s;
    if (groups * s >= sms) break;
  }
  return best;
}

template <int MT>
ffi::Error Launch(cudaStream_t stream, const Params& params, int groups, bool pdl) {
  auto kernel = FusedDotKernel<MT>;
  const int smem = SmemBytes(params.m);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    return kdtree::CudaStatus(cudaGetLastError(), "fused_dot", "raising the shared-memory limit");
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

ffi::Error FusedDotCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w0, ffi::AnyBuffer w1,
                        ffi::AnyBuffer nw, ffi::AnyBuffer add0, ffi::AnyBuffer add1, float eps, int64_t gated0,
                        int64_t gated1, int64_t split, int64_t flags, ffi::Result<ffi::AnyBuffer> y0,
                        ffi::Result<ffi::AnyBuffer> y1, ffi::Result<ffi::AnyBuffer> xn) {
  kdtree::FusedDotShape d;
  if (ffi::Error err = kdtree::CheckFusedDot(x, w0, w1, nw, add0, add1, gated0, gated1, *y0, *y1, *xn, &d);
      err.failure()) {
    return err;
  }
  const bool aligned = d.k % kChunk == 0 && d.n0 % kCols == 0 && d.n1 % kCols == 0;
  if (d.m > kMaxRows || !aligned || d.x_type != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("fused_dot: the CUDA kernel takes bf16, M <= 32, K a multiple of 64 and N "
                                       "multiples of 16 (got x " + kdtree::ShapeString(x.dimensions()) + ", w0 " +
                                       kdtree::ShapeString(w0.dimensions()) + ", w1 " +
                                       kdtree::ShapeString(w1.dimensions()) + ")");
  }
  if (split < 0 || split > kMaxSplit || (split & (split - 1)) || (split > 0 && (d.k / kChunk) % split)) {
    return ffi::Error::InvalidArgument("fused_dot: split must be 0 (chosen) or a power of two up to 8 dividing K / "
                                       "64, got " + std::to_string(split));
  }
  const int64_t groups = d.n0 / kCols + d.n1 / kCols;
  if (groups > 65535) return ffi::Error::InvalidArgument("fused_dot: too many columns for the CUDA grid");
  for (const void* ptr : {x.untyped_data(), w0.untyped_data(), w1.untyped_data(), nw.untyped_data()}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16) {
      return ffi::Error::InvalidArgument("fused_dot: x, the weights and the norm weight must be 16-byte aligned");
    }
  }
  if (d.m == 0 || groups == 0) return ffi::Error::Success();
  int s = static_cast<int>(split);
  if (s == 0) {
    int sms = 0;
    if (ffi::Error err = Sms(&sms); err.failure()) return err;
    s = ChooseSplit(d.k, groups, sms);
  }
  Params p = {};
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.untyped_data());
  p.nw = d.has_norm ? reinterpret_cast<const __nv_bfloat16*>(nw.untyped_data()) : nullptr;
  p.add0 = d.adds > 0 ? reinterpret_cast<const __nv_bfloat16*>(add0.untyped_data()) : nullptr;
  p.add1 = d.adds > 1 ? reinterpret_cast<const __nv_bfloat16*>(add1.untyped_data()) : nullptr;
  p.xn = d.want_xn ? reinterpret_cast<__nv_bfloat16*>(xn->untyped_data()) : nullptr;
  p.seg[0] = {reinterpret_cast<const __nv_bfloat16*>(w0.untyped_data()), y0->untyped_data(), static_cast<int>(d.n0),
              static_cast<int>(d.n0 / kCols), gated0 != 0, y0->element_type() == ffi::DataType::F32};
  p.seg[1] = {reinterpret_cast<const __nv_bfloat16*>(w1.untyped_data()), y1->untyped_data(), static_cast<int>(d.n1),
              static_cast<int>(d.n1 / kCols), gated1 != 0, y1->element_type() == ffi::DataType::F32};
  p.m = static_cast<int>(d.m);
  p.k = static_cast<int>(d.k);
  p.split = s;
  p.eps = eps;
  const bool pdl = !(flags & kFlagPlain);
  p.early_w = pdl && (flags & kFlagEarlyW);
  p.l2_256 = (flags & kFlagL2Lines) != 0;
  return d.m <= 16 ? Launch<1>(stream, p, static_cast<int>(groups), pdl)
                   : Launch<2>(stream, p, static_cast<int>(groups), pdl);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdFusedDotCuda, FusedDotCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16
                                  .Arg<ffi::AnyBuffer>()  // w0 [K, N0]
                                  .Arg<ffi::AnyBuffer>()  // w1 [K, N1] (N1 = 0: none)
                                  .Arg<ffi::AnyBuffer>()  // nw [K] or [0]
                                  .Arg<ffi::AnyBuffer>()  // add0 [M, N0] or [0]
                                  .Arg<ffi::AnyBuffer>()  // add1 [M, N0] or [0]
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("gated0")
                                  .Attr<int64_t>("gated1")
                                  .Attr<int64_t>("split")     // blocks per K (0: chosen)
                                  .Attr<int64_t>("flags")     // bit 0: plain launch; 1: weights are parameters
                                  .Ret<ffi::AnyBuffer>()      // y0 [M, N0 or N0 / 2]
                                  .Ret<ffi::AnyBuffer>()      // y1 [M, N1 or N1 / 2]
                                  .Ret<ffi::AnyBuffer>(),     // xn [M, K] or [0, K]
                              {xla::ffi::Traits::kCmdBufferCompatible});
