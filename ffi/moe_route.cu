// moe_route on CUDA: the function of moe_route.cc (which has the math), one warp per token. The warp holds the
// token's choices (sigmoid(logit) + bias) in shared memory; every selection (a group's two best, the kept groups,
// the k experts) is a warp-wide arg-max with ties to the lower index, so the result is the CPU handler's.
// No workspace, no host sync (kCmdBufferCompatible).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using F32Mat = ffi::Buffer<ffi::F32, 2>;
using F32Vec = ffi::Buffer<ffi::F32, 1>;
using I32Mat = ffi::Buffer<ffi::S32, 2>;

namespace kdtree {
namespace {

constexpr int kWarps = 4;         // tokens per block
constexpr int kMaxExperts = 2048;  // E
constexpr int kMaxGroups = 64;     // n_group
constexpr int kMaxK = 32;          // experts per token (one lane each)
constexpr unsigned kAll = 0xffffffffu;

struct Best {
  float v;
  int i;  // -1: none
};

__device__ __forceinline__ Best Better(Best a, Best b) {
  if (a.i < 0) return b;
  if (b.i < 0) return a;
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

// The largest v[i] over i in [first, first + n) with !taken[i], ties to the lower index, known to every lane.
__device__ __forceinline__ Best WarpArgMax(const float* v, const unsigned char* taken, int first, int n, int lane) {
  Best b{0.0f, -1};
  for (int i = first + lane; i < first + n; i += 32) {
    if (!taken[i]) b = Better(b, Best{v[i], i});
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) b = Better(b, Best{__shfl_xor_sync(kAll, b.v, o), __shfl_xor_sync(kAll, b.i, o)});
  return b;
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void __launch_bounds__(kWarps * 32) RouteKernel(const float* __restrict__ logits,
                                                           const float* __restrict__ bias, int m, int e, int k,
                                                           int n_group, int topk_group, bool renormalize,
                                                           float scale, int32_t* ids, float* weights) {
  __shared__ float choice_s[kWarps][kMaxExperts];
  __shared__ unsigned char taken_s[kWarps][kMaxExperts];
  __shared__ float group_s[kWarps][kMaxGroups];
  __shared__ unsigned char gtaken_s[kWarps][kMaxGroups];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarps + warp;
  if (row >= m) return;  // whole warps leave together
  float* choice = choice_s[warp];
  unsigned char* taken = taken_s[warp];
  const float* x = logits + static_cast<int64_t>(row) * e;
  for (int i = lane; i < e; i += 32) {
    choice[i] = Sigmoid(x[i]) + bias[i];
    taken[i] = 0;
  }
  __syncwarp();
  if (n_group > 1) {
    const int per = e / n_group;
    for (int g = 0; g < n_group; ++g) {  // the sum of the group's two best choices
      const Best a = WarpArgMax(choice, taken, g * per, per, lane);
      if (lane == 0) taken[a.i] = 1;
      __syncwarp();
      const Best b = WarpArgMax(choice, taken, g * per, per, lane);
      if (lane == 0) {
        taken[a.i] = 0;
        group_s[warp][g] = a.v + b.v;
      }
      __syncwarp();
    }
    for (int g = lane; g < n_group; g += 32) gtaken_s[warp][g] = 0;
    __syncwarp();
    for (int j = 0; j < topk_group; ++j) {
      const Best g = WarpArgMax(group_s[warp], gtaken_s[warp], 0, n_group, lane);
      if (lane == 0) gtaken_s[warp][g.i] = 1;
      __syncwarp();
    }
    for (int i = lane; i < e; i += 32) {
      if (!gtaken_s[warp][i / per]) choice[i] = -INFINITY;
    }
    __syncwarp();
  }
  int mine = 0;
  for (int j = 0; j < k; ++j) {
    const Best b = WarpArgMax(choice, taken, 0, e, lane);
    if (lane == j) mine = b.i;
    if (lane == 0) taken[b.i] = 1;
    __syncwarp();
  }
  const float w = lane < k ? Sigmoid(x[mine]) : 0.0f;
  float total = 0.0f;  // summed in order j = 0 .. k-1, as the CPU handler does
  for (int j = 0; j < k; ++j) total += __shfl_sync(kAll, w, j);
  if (lane < k) {
    const int64_t at = static_cast<int64_t>(row) * k + lane;
    ids[at] = mine;
    weights[at] = (renormalize ? w / (total + 1e-20f) : w) * scale;
  }
}

ffi::Error MoeRouteCuda(cudaStream_t stream, F32Mat logits, F32Vec bias, int64_t n_group, int64_t topk_group,
                        bool renormalize, float scale, ffi::Result<I32Mat> ids, ffi::Result<F32Mat> weights) {
  RouteShape d;
  if (ffi::Error err = CheckRouteShape(logits.dimensions(), bias.dimensions(), ids->dimensions(),
                                       weights->dimensions(), n_group, topk_group, &d);
      err.failure()) {
    return err;
  }
  if (d.e > kMaxExperts || n_group > kMaxGroups || d.k > kMaxK || d.m > INT32_MAX - kWarps) {
    return ffi::Error::InvalidArgument("moe_route: the CUDA kernel takes E <= 2048, n_group <= 64, k <= 32 (got E = " +
                                       std::to_string(d.e) + ", n_group = " + std::to_string(n_group) + ", k = " +
                                       std::to_string(d.k) + ")");
  }
  if (d.m == 0) return ffi::Error::Success();
  const unsigned blocks = static_cast<unsigned>((d.m + kWarps - 1) / kWarps);
  RouteKernel<<<blocks, kWarps * 32, 0, stream>>>(logits.typed_data(), bias.typed_data(), static_cast<int>(d.m),
                                                 static_cast<int>(d.e), static_cast<int>(d.k),
                                                 static_cast<int>(n_group), static_cast<int>(topk_group),
                                                 renormalize, scale, ids->typed_data(), weights->typed_data());
  return CudaStatus(cudaGetLastError(), "moe_route", "kernel launch");
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMoeRouteCuda, kdtree::MoeRouteCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<F32Mat>()               // logits [M, E]
                                  .Arg<F32Vec>()               // bias [E] (selection only)
                                  .Attr<int64_t>("n_group")    // expert groups
                                  .Attr<int64_t>("topk_group") // groups kept per token
                                  .Attr<bool>("renormalize")   // weights divided by their sum
                                  .Attr<float>("scale")        // routed_scaling_factor
                                  .Ret<I32Mat>()               // ids [M, k]
                                  .Ret<F32Mat>(),              // weights [M, k]
                              {xla::ffi::Traits::kCmdBufferCompatible});
