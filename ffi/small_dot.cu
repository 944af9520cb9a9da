// small_dot on CUDA (sm_90a): y[M, N] = x[M, K] . w[K, N] for the few rows of a decode or verify step (M <= 64),
// bf16 inputs, fp32 accumulation, one rounding to y's dtype (bf16 or f32); the function of small_dot.cc.
//
// Why: at one device's share of K2.6 a dense weight is 1.5-30 MB, and XLA's dot takes 4-8 us whatever it reads
// (docs/full_scale.md). This kernel streams w once, with as many blocks as the GPU has SMs, and starts loading w
// before the kernel ahead of it on the stream has finished.
//
// Work split. A block of 4 warps owns 64 columns of w (16 a warp) and one slice of K. The `split` blocks of a
// thread-block cluster (1, 2, 4 or 8; chosen so that the grid covers the GPU) share the K of one 64-column tile and
// sum their fp32 partials through distributed shared memory, each block finishing 1/split of the tile's outputs
// and adding the ranks' partials in rank order, so the result does not depend on timing.
//
// Streaming. A block streams its K slice through a ring of kStages stages in shared memory (cp.async, L2 only). A
// stage is 64 rows of w (64 x 128 bytes: the block's 64 columns) and the same 64 inputs of every token row (8 NT
// rows of 128 bytes, rows past M zero-filled). 16-byte chunk c of a stage row r sits at chunk c ^ (r % 8), so the 8
// rows one ldmatrix reads lie in different banks.
//
// The product. For mma.m16n8k16 the block computes y^T = w^T x^T: w^T's 16 x 16 tile (16 columns of w by 16
// inputs) is the A operand, read from the stage's w rows by ldmatrix .trans (matrix j: inputs 8 (j / 2) .. + 7,
// columns 8 (j % 2) .. + 7 of the warp's 16); 8 token rows are the B operand (ldmatrix of token rows: matrix j =
// inputs 8 j .. + 7, two k-steps per x4). The warp's accumulators hold y^T[16 columns, 8 NT tokens].
//
// Launch. As a programmatic dependent (PDL) of the kernel before it: a block waits (griddepcontrol.wait) before it
// reads anything an earlier kernel may write, and lets the next kernel start launching once its stream is set up.
// Flag bit 1 says that w is a parameter no kernel of the program writes (the model's weights): then the block issues
// its first kStages - 1 stages of w before the wait, so they load while the kernel ahead finishes. Without it (a w
// computed in the same program, e.g. a cast or a transpose) w is read only after the wait. Flag bit 0: a plain
// launch (for comparison).
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

using Bf16Mat = ffi::Buffer<ffi::BF16, 2>;
namespace cg = cooperative_groups;

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBN = 16 * kWarps;  // columns of w per block
constexpr int kBK = 64;           // inputs per stage
constexpr int kRow = 128;         // bytes of one stage row (64 bf16)
constexpr int kStages = 8;
constexpr int kMaxSplit = 8;      // the portable cluster size
constexpr int64_t kFlagPlain = 1;
constexpr int64_t kFlagEarlyW = 2;

template <int NT>
struct Layout {
  static constexpr int kWBytes = kBK * kRow;          // w rows of a stage
  static constexpr int kStage = kWBytes + 8 * NT * kRow;
  static constexpr int kRing = kStages * kStage;
  static constexpr int kSmem = kRing + kBN * 8 * NT * 4;  // + the block's fp32 partials [8 NT tokens][64 columns]
};

__device__ __forceinline__ uint32_t Swizzled(uint32_t row_base, int row, int chunk) {
  return row_base + row * kRow + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void StoreOut(float v, float* p) { *p = v; }
__device__ __forceinline__ void StoreOut(float v, __nv_bfloat16* p) { *p = __float2bfloat16_rn(v); }

// grid (split, N / 64), cluster (split, 1, 1): blockIdx.y picks the 64 columns, the cluster rank the K slice.
template <int NT, typename Out>
__global__ void __launch_bounds__(kThreads) SmallDotKernel(const __nv_bfloat16* __restrict__ x,
                                                           const __nv_bfloat16* __restrict__ w, Out* __restrict__ y,
                                                           int m, int k, int n, int split, bool early_w) {
  using L = Layout<NT>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rank = blockIdx.x, col0 = blockIdx.y * kBN;
  const int stages = k / kBK / split;  // stages of this block's K slice
  const int k0 = rank * stages * kBK;
  const uint32_t base = SmemAddress(smem);

  auto copy_w = [&](int s) {  // 64 rows x 8 chunks: 4 copies a thread
    const uint32_t dst = base + (s % kStages) * L::kStage;
    const __nv_bfloat16* src = w + static_cast<int64_t>(k0 + s * kBK) * n + col0;
#pragma unroll
    for (int i = 0; i < kBK * 8 / kThreads; ++i) {
      const int r = tid / 8 + i * (kThreads / 8), c = tid % 8;
      CopyAsync16Cg(Swizzled(dst, r, c), src + static_cast<int64_t>(r) * n + c * 8);
    }
  };
  auto copy_x = [&](int s) {  // 8 NT token rows x 8 chunks
    const uint32_t dst = base + (s % kStages) * L::kStage + L::kWBytes;
    for (int e = tid; e < 64 * NT; e += kThreads) {
      const int r = e / 8, c = e % 8;
      const bool valid = r < m;
      CopyAsync16CgZ(Swizzled(dst, r, c), x + static_cast<int64_t>(valid ? r : 0) * k + k0 + s * kBK + c * 8, valid);
    }
  };

  // Prologue: the weights of the first stages (before the wait for the kernel ahead when w is a parameter), then the
  // token rows. The commit groups are the same either way.
  auto copy_first_w = [&]() {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < stages) copy_w(s);
      CopyCommit();
    }
  };
  if (early_w) copy_first_w();
  GridDependencyWait();
  if (!early_w) copy_first_w();
  for (int s = 0; s < kStages - 1 && s < stages; ++s) copy_x(s);
  CopyCommit();
  LaunchDependents();

  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;

  const int mat = lane / 8, mrow = lane % 8;
  for (int i = 0; i < stages; ++i) {
    // Stage i has landed once at most kStages - 2 later groups are pending (every iteration commits one group);
    // the prologue's groups all complete at i = 0.
    if (i == 0) {
      CopyWait<0>();
    } else {
      CopyWait<kStages - 2>();
    }
    __syncthreads();  // stage i visible to every warp; stage i - 1's slot free (its reads are done)
    if (i + kStages - 1 < stages) {
      copy_w(i + kStages - 1);
      copy_x(i + kStages - 1);
    }
    CopyCommit();
    const uint32_t ws = base + (i % kStages) * L::kStage, xs = ws + L::kWBytes;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 32) {  // two k-steps: inputs kk .. kk + 15 and kk + 16 .. kk + 31
      uint32_t a0[4], a1[4];
      const int wr = kk + mrow + 8 * (mat / 2), wc = 2 * warp + mat % 2;
      LdsmT4(a0, Swizzled(ws, wr, wc));
      LdsmT4(a1, Swizzled(ws, wr + 16, wc));
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        uint32_t b[4];
        Ldsm4(b, Swizzled(xs, 8 * t + mrow, kk / 8 + mat));
        MmaAt(acc[t], a0, b[0], b[1]);
        MmaAt(acc[t], a1, b[2], b[3]);
      }
    }
  }
  CopyWait<0>();

  // The block's partials y^T[column, token] -> red[token][column]: lane (g, q) holds columns 16 warp + g (+ 8) and
  // tokens 8 t + 2 q (+ 1).
  float* red = reinterpret_cast<float*>(smem + L::kRing);
  const int g = lane / 4, q = lane % 4;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = 16 * warp + g + 8 * h;
      red[(8 * t + 2 * q) * kBN + col] = acc[t][2 * h];
      red[(8 * t + 2 * q + 1) * kBN + col] = acc[t][2 * h + 1];
    }
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (split > 1) {
    cluster.sync();
  } else {
    __syncthreads();
  }
  const int total = m * kBN, lo = rank * (total / split), hi = lo + total / split;  // kBN % split == 0
  for (int e = lo + tid; e < hi; e += kThreads) {
    float sum = 0.0f;
    for (int r = 0; r < split; ++r) sum += (split > 1 ? cluster.map_shared_rank(red, r) : red)[e];
    StoreOut(sum, y + static_cast<int64_t>(e / kBN) * n + col0 + e % kBN);
  }
  if (split > 1) cluster.sync();  // no block leaves while another still reads its partials
}

constexpr int kDevices = 64;
std::atomic<int> g_sms[kDevices];

ffi::Error Sms(int* sms) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return kdtree::CudaStatus(cudaGetLastError(), "small_dot", "device");
  if (device >= 0 && device < kDevices && (*sms = g_sms[device].load(std::memory_order_relaxed)) > 0) {
    return ffi::Error::Success();
  }
  if (cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return kdtree::CudaStatus(cudaGetLastError(), "small_dot", "querying the SM count");
  }
  if (device >= 0 && device < kDevices) g_sms[device].store(*sms, std::memory_order_relaxed);
  return ffi::Error::Success();
}

template <int NT, typename Out>
ffi::Error Launch(cudaStream_t stream, const __nv_bfloat16* x, const __nv_bfloat16* w, Out* y, int m, int k, int n,
                  int split, bool pdl, bool early_w) {
  auto kernel = SmallDotKernel<NT, Out>;
  const int smem = Layout<NT>::kSmem;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    return kdtree::CudaStatus(cudaGetLastError(), "small_dot", "raising the shared-memory limit");
  }
  cudaLaunchAttribute attrs[2];
  int count = 0;
  if (pdl) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (split > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = static_cast<unsigned>(split);
    attrs[count].val.clusterDim.y = 1;
    attrs[count++].val.clusterDim.z = 1;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(split), static_cast<unsigned>(n / kBN));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  return kdtree::CudaStatus(cudaLaunchKernelEx(&config, kernel, x, w, y, m, k, n, split, early_w), "small_dot",
                            "kernel launch");
}

// The blocks of a K slice: the fewest (a power of two up to 8 dividing K's stages) whose grid covers every SM,
// else the most that divide.
int ChooseSplit(int64_t k, int64_t n, int sms) {
  const int64_t stages = k / kBK, tiles = n / kBN;
  int best = 1;
  for (int s = 1; s <= kMaxSplit; s *= 2) {
    if (stages % s) break;
    best = s;
    if (tiles * s >= sms) break;
  }
  return best;
}

ffi::Error SmallDotCuda(cudaStream_t stream, Bf16Mat x, Bf16Mat w, int64_t split,
                        int64_t flags, ffi::Result<ffi::AnyBuffer> y) {
  kdtree::SmallDotShape d;
  if (ffi::Error err = kdtree::CheckSmallDotShape(x.dimensions(), w.dimensions(), y->dimensions(),
                                                  y->element_type(), &d);
      err.failure()) {
    return err;
  }
  if (d.m > 64 || d.k % kBK || d.n % kBN) {
    return ffi::Error::InvalidArgument("small_dot: the CUDA kernel takes M <= 64 and K, N multiples of 64 (got x " +
                                       kdtree::ShapeString(x.dimensions()) + ", w " +
                                       kdtree::ShapeString(w.dimensions()) + ")");
  }
  if (split < 0 || split > kMaxSplit || (split & (split - 1)) || (split > 0 && (d.k / kBK) % split)) {
    return ffi::Error::InvalidArgument("small_dot: split must be 0 (chosen) or a power of two up to 8 dividing K / "
                                       "64, got " + std::to_string(split));
  }
  if (d.n / kBN > 65535) {
    return ffi::Error::InvalidArgument("small_dot: the CUDA kernel takes N <= 65535 * 64, got " +
                                       std::to_string(d.n));
  }
  if (reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 || reinterpret_cast<uintptr_t>(w.untyped_data()) % 16) {
    return ffi::Error::InvalidArgument("small_dot: x and w must be 16-byte aligned");
  }
  if (d.m == 0 || d.n == 0) return ffi::Error::Success();
  int s = static_cast<int>(split);
  if (s == 0) {
    int sms = 0;
    if (ffi::Error err = Sms(&sms); err.failure()) return err;
    s = ChooseSplit(d.k, d.n, sms);
  }
  const bool pdl = !(flags & kFlagPlain), early_w = pdl && (flags & kFlagEarlyW);
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.typed_data());
  const auto* wp = reinterpret_cast<const __nv_bfloat16*>(w.typed_data());
  const int m = static_cast<int>(d.m), k = static_cast<int>(d.k), n = static_cast<int>(d.n);
  if (y->element_type() == ffi::DataType::F32) {
    float* yp = reinterpret_cast<float*>(y->untyped_data());
    return m <= 8    ? Launch<1>(stream, xp, wp, yp, m, k, n, s, pdl, early_w)
           : m <= 16 ? Launch<2>(stream, xp, wp, yp, m, k, n, s, pdl, early_w)
           : m <= 32 ? Launch<4>(stream, xp, wp, yp, m, k, n, s, pdl, early_w)
                     : Launch<8>(stream, xp, wp, yp, m, k, n, s, pdl, early_w);
  }
  auto* yp = reinterpret_cast<__nv_bfloat16*>(y->untyped_data());
  return m <= 8    ? Launch<1>(stream, xp, wp, yp, m, k, n, s, pdl, early_w)
         : m <= 16 ? Launch<2>(stream, xp, wp, yp, m, k, n, s, pdl, early_w)
         : m <= 32 ? Launch<4>(stream, xp, wp, yp, m, k, n, s, pdl, early_w)
                   : Launch<8>(stream, xp, wp, yp, m, k, n, s, pdl, early_w);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdSmallDotCuda, SmallDotCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<Bf16Mat>()  // x [M, K]
                                  .Arg<Bf16Mat>()  // w [K, N]
                                  .Attr<int64_t>("split")            // blocks per K (0: chosen)
                                  .Attr<int64_t>("flags")            // bit 0: plain launch; 1: w a parameter
                                  .Ret<ffi::AnyBuffer>(),            // y [M, N], bf16 or f32
                              {xla::ffi::Traits::kCmdBufferCompatible});
