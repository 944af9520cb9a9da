// fused_dot on CUDA (sm_90a): a layer's dense weights at the few rows of a decode step (M <= 4) with what surrounds
// them, in one launch; the function of fused_dot.cc (kdtree_jax/kernels/fused_dot.py has the math).
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
// the grid is one wave. Thread t takes 8 columns (16 bytes, t % 8) of rows t / 8, t / 8 + 32, ... of the slice; it
// loads U rows at once (ld.global.nc, L1 not allocated) and multiplies the U before them while they arrive. x needs
// the whole row's sum of squares before the dot, so that x' is rounded as the reference rounds it (equal but where r,
// summed in another order and from an approximate reciprocal square root, puts x r on the other side of a rounding:
// rare, one ulp): each block reads the whole rows of x (M <= 4 rows of K values, from L2), keeps its slice in shared
// memory and normalizes it there. The first U rows of w (a
// parameter no kernel writes, flag bit 1) are loaded before griddepcontrol.wait, while the kernel ahead finishes.
// The 4 row groups of a warp that share columns are summed by two shuffles, the 8 warps in shared memory.
// No workspace, no host sync (kCmdBufferCompatible).
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
constexpr int kMaxRows = 4;
constexpr int kMaxK = 8192;               // K at most (each thread loads its x pieces at once)
constexpr int kMaxSplit = 16;              // clusters of 16 are non-portable (sm_90: allowed by a kernel attribute)
constexpr int64_t kFlagPlain = 1;
constexpr int64_t kFlagEarlyW = 2;
constexpr int64_t kFlagL2Lines = 4;  // the weight loads ask L2 for whole 256-byte lines

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

// shared memory: x' of the slice [MM][kslice] f32; the warps' partials [8][MM][64]; the block's [MM][64]; the warps'
// sums of squares [8][MM]; the rows' scales [MM]; the slice's norm weights [kslice]
__host__ __device__ constexpr int SmemBytes(int mm, int kslice) {
  return 4 * (mm * kslice + kWarps * mm * kTile + mm * kTile + kWarps * mm + mm + kslice);
}

// grid (split, tiles of both weights), cluster (split, 1, 1): blockIdx.y picks the 64 columns, the rank the K slice.
template <int MM, int U>
__global__ void __launch_bounds__(kThreads, 2) FusedDotKernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, m = p.m, split = p.split, rank = blockIdx.x;
  const int s_idx = blockIdx.y < p.seg[0].groups ? 0 : 1;
  const Segment seg = s_idx ? p.seg[1] : p.seg[0];  // (not p.seg[s_idx]: a copy to local memory)
  const int group = blockIdx.y - (s_idx ? p.seg[0].groups : 0);
  const int kslice = p.k / split, k0 = rank * kslice;
  const bool norm = p.nw != nullptr;
  const int piece = tid % 8, rg = tid / 8;
  const int col = seg.gated ? (piece < 4 ? 32 * group + 8 * piece : seg.n / 2 + 32 * group + 8 * (piece - 4))
                            : kTile * group + 8 * piece;
  const __nv_bfloat16* wp = seg.w + static_cast<int64_t>(k0 + rg) * seg.n + col;
  const int64_t stride = static_cast<int64_t>(kRowGroups) * seg.n;
  const int rows = kslice / kRowGroups;
  float* xs = reinterpret_cast<float*>(smem);  // [MM][kslice]
  float* red = xs + MM * kslice;               // [8 warps][MM][64]
  float* part = red + kWarps * MM * kTile;     // [MM][64]
  float* ssw = part + MM * kTile;              // [8 warps][MM]
  float* rs = ssw + kWarps * MM;               // [MM]
  float* nws = rs + MM;                        // [kslice]: the norm weights of the slice

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
  // x: the whole rows' sums of squares (a norm needs them), the block's slice into shared memory
#pragma unroll 1
  for (int row = 0; row < m; ++row) {
    float ss = 0.0f;
    uint4 got[kMaxK / 8 / kThreads];  // every 16-byte load of the row issued before the first is used
#pragma unroll
    for (int j = 0; j < kMaxK / 8 / kThreads; ++j) {
      const int c = tid + j * kThreads;
      got[j] = c < p.k / 8 ? *reinterpret_cast<const uint4*>(p.x + row * p.k + 8 * c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kMaxK / 8 / kThreads; ++j) {
      const int c = tid + j * kThreads;
      const uint32_t xw[4] = {got[j].x, got[j].y, got[j].z, got[j].w};
      const bool mine = 8 * c >= k0 && 8 * c < k0 + kslice;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xw[i]));
        ss = fmaf(a.x, a.x, ss);
        ss = fmaf(a.y, a.y, ss);
        if (mine) {
          xs[row * kslice + 8 * c - k0 + 2 * i] = a.x;
          xs[row * kslice + 8 * c - k0 + 2 * i + 1] = a.y;
        }
      }
    }
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, d);
    if (lane == 0) ssw[warp * MM + row] = ss;
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
          nws[8 * c + 2 * i] = b.x;
          nws[8 * c + 2 * i + 1] = b.y;
        }
      }
    }
  }
  LaunchDependents();
  __syncthreads();
  if (tid < m) {
    float ss = 0.0f;
    for (int w = 0; w < kWarps; ++w) ss += ssw[w * MM + tid];
    rs[tid] = rsqrtf(ss / static_cast<float>(p.k) + p.eps);
  }
  __syncthreads();
  if (norm) {  // x' = bf16(nw * bf16(x * r)), in place
    for (int e = tid; e < m * kslice; e += kThreads) {
      const int row = e / kslice, kk = e - row * kslice;
      xs[e] = Bf(nws[kk] * Bf(xs[e] * rs[row]));
    }
    __syncthreads();
  }

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
          const float xv = mm < m ? xs[mm * kslice + kk] : 0.0f;
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[mm][j] = fmaf(xv, wf[j], acc[mm][j]);
        }
      }
    }
  }
  // the 4 row groups of a warp hold the same columns (lanes l, l ^ 8, l ^ 16, l ^ 24); then the 8 warps in order
#pragma unroll
  for (int mm = 0; mm < MM; ++mm) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v = acc[mm][j];
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 8 && mm < m) red[(warp * MM + mm) * kTile + 8 * lane + j] = v;
    }
  }
  __syncthreads();
  for (int e = tid; e < m * kTile; e += kThreads) {
    float v = 0.0f;
    for (int w = 0; w < kWarps; ++w) v += red[w * MM * kTile + e];
    part[e] = v;
  }
  if (p.xn && blockIdx.y == 0) {  // x' of this block's K slice
    for (int e = tid; e < m * kslice; e += kThreads) {
      const int row = e / kslice;
      p.xn[row * p.k + k0 + e - row * kslice] = __float2bfloat16_rn(xs[e]);
    }
  }

  // the K split's sum, in rank order, and the epilogue; block `rank` of the cluster finishes 1 / split of the tile
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
      const float* pr = split > 1 ? cluster.map_shared_rank(part, r) : part;
      v0 += pr[src];
      if (seg.gated) v1 += pr[src + kHalf];
    }
    if (seg.gated) {
      const float gate = Bf(v0), up = Bf(v1);
      const float h = Bf(Bf(gate * Bf(1.0f / (1.0f + __expf(-gate)))) * up);
      reinterpret_cast<__nv_bfloat16*>(seg.y)[row * (seg.n / 2) + kHalf * group + c] = __float2bfloat16_rn(h);
    } else {
      const int at = row * seg.n + kTile * group + c;
      if (seg.f32) {
        reinterpret_cast<float*>(seg.y)[at] = v0;
      } else {
        float o = Bf(v0);
        if (s_idx == 0 && p.add0) o = Bf(__bfloat162float(p.add0[at]) + o);
        if (s_idx == 0 && p.add1) o = Bf(__bfloat162float(p.add1[at]) + o);
        reinterpret_cast<__nv_bfloat16*>(seg.y)[at] = __float2bfloat16_rn(o);
      }
    }
  }
  if (split > 1) cluster.sync();  // no block leaves while another still reads its partials
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

// The K split: the largest power of two up to 16 dividing K / 64 whose clusters (one per 64-column
// tile) can all be resident at once (cudaOccupancyMaxActiveClusters, cached per device and shape), so that the grid
// is one wave; 1 if none.
template <typename Kernel>
ffi::Error ChooseSplit(Kernel kernel, int kernel_id, int mm, int64_t k, int64_t tiles, int* split) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int>, int> fits;  // (device, kernel, split, K) -> resident clusters
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return kdtree::CudaStatus(cudaGetLastError(), "fused_dot", "device");
  *split = 1;
  for (int s = kMaxSplit; s >= 2; s /= 2) {
    if ((k / kChunk) % s) continue;
    const auto key = std::make_tuple(device, kernel_id, s, static_cast<int>(k));
    int clusters = -1;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = fits.find(key);
      if (it != fits.end()) clusters = it->second;
    }
    if (clusters < 0) {
      const int smem = SmemBytes(mm, static_cast<int>(k / s));
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
    if (tiles <= clusters) {
      *split = s;
      return ffi::Error::Success();
    }
  }
  return ffi::Error::Success();
}

template <int MM, int U>
ffi::Error Run(cudaStream_t stream, Params& p, int64_t tiles, bool pdl) {
  auto kernel = FusedDotKernel<MM, U>;
  if (p.split == 0) {
    if (ffi::Error err = ChooseSplit(kernel, MM, MM, p.k, tiles, &p.split); err.failure()) return err;
  }
  return Launch(kernel, SmemBytes(MM, p.k / p.split), stream, p, static_cast<int>(tiles), pdl);
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
  if (d.m > kMaxRows || d.k % kChunk || d.k > kMaxK || d.n0 % kTile || d.n1 % kTile) {
    return ffi::Error::InvalidArgument("fused_dot: the CUDA kernel takes M <= 4, K a multiple of 64 up to 8192 and N "
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
  p.nw = d.has_norm ? reinterpret_cast<const __nv_bfloat16*>(nw.untyped_data()) : nullptr;
  p.add0 = d.adds > 0 ? reinterpret_cast<const __nv_bfloat16*>(add0.untyped_data()) : nullptr;
  p.add1 = d.adds > 1 ? reinterpret_cast<const __nv_bfloat16*>(add1.untyped_data()) : nullptr;
  p.xn = d.want_xn ? reinterpret_cast<__nv_bfloat16*>(xn->untyped_data()) : nullptr;
  p.seg[0] = {reinterpret_cast<const __nv_bfloat16*>(w0.untyped_data()), y0->untyped_data(), static_cast<int>(d.n0),
              static_cast<int>(d.n0 / kTile), gated0 != 0, y0->element_type() == ffi::DataType::F32};
  p.seg[1] = {reinterpret_cast<const __nv_bfloat16*>(w1.untyped_data()), y1->untyped_data(), static_cast<int>(d.n1),
              static_cast<int>(d.n1 / kTile), gated1 != 0, y1->element_type() == ffi::DataType::F32};
  p.m = static_cast<int>(d.m);
  p.k = static_cast<int>(d.k);
  p.split = static_cast<int>(split);
  p.eps = eps;
  const bool pdl = !(flags & kFlagPlain);
  p.early_w = pdl && (flags & kFlagEarlyW);
  p.l2_256 = (flags & kFlagL2Lines) != 0;
  return d.m == 1   ? Run<1, 8>(stream, p, tiles, pdl)
         : d.m == 2 ? Run<2, 8>(stream, p, tiles, pdl)
                    : Run<4, 4>(stream, p, tiles, pdl);
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
