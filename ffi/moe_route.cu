// moe_route on CUDA: the function of moe_route.cc (which has the math), one warp per token. The warp holds the
// token's choices (sigmoid(logit) + bias) in registers, spread over its lanes; every selection (a group's two best,
// the kept groups, the k experts) is a warp-wide arg-max with ties to the lower index, so the result is the CPU
// handler's.
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

constexpr int kWarps = 4;          // tokens per block
constexpr int kMaxExperts = 2048;  // E (64 per lane)
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

__device__ __forceinline__ Best WarpBest(Best b) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) b = Better(b, Best{__shfl_xor_sync(kAll, b.v, o), __shfl_xor_sync(kAll, b.i, o)});
  return b;
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Expert i with choice v as a 64-bit key: the float's bits mapped to an unsigned order (high word), then ~i (low
// word), so a larger key is a larger choice or, at equal choices, the lower index. 0 is below every key.
__device__ __forceinline__ uint64_t Key(float v, int i) {
  const uint32_t u = __float_as_uint(v);
  const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(ordered) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}

__device__ __forceinline__ int KeyIndex(uint64_t key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

__device__ __forceinline__ uint64_t WarpMax(uint64_t key) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) key = max(key, __shfl_xor_sync(kAll, key, o));
  return key;
}

// One warp per token; PER = experts per lane (E <= 32 PER). Every value a lane needs is loaded before the first
// is used (one round trip to memory), then each of the k rounds is a warp arg-max after which only the lane that
// held the winner looks at its experts again.
template <int PER>
__global__ void __launch_bounds__(kWarps * 32) RouteKernel(const float* __restrict__ logits,
                                                           const float* __restrict__ bias, int m, int e, int k,
                                                           int n_group, int topk_group, bool renormalize,
                                                           float scale, int32_t* ids, float* weights) {
  __shared__ float group_s[kWarps][kMaxGroups];
  __shared__ unsigned char kept_s[kWarps][kMaxGroups];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarps + warp;
  if (row >= m) return;  // whole warps leave together
  const float* x = logits + static_cast<int64_t>(row) * e;
  float xs[PER], bs[PER], s[PER], c[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = lane + 32 * u;
    xs[u] = i < e ? x[i] : 0.0f;
    bs[u] = i < e ? bias[i] : 0.0f;
  }
  uint64_t out = 0;
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    s[u] = Sigmoid(xs[u]);
    c[u] = s[u] + bs[u];
    if (lane + 32 * u >= e) out |= uint64_t{1} << u;
  }
  if (n_group > 1) {
    const int per = e / n_group;
    for (int g = 0; g < n_group; ++g) {  // the sum of the group's two best choices
      Best a{0.0f, -1}, b{0.0f, -1};     // this lane's best two in group g
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const int i = lane + 32 * u;
        if (i < e && i / per == g) {
          const Best t{c[u], i};
          if (Better(a, t).i == t.i) {
            b = a;
            a = t;
          } else {
            b = Better(b, t);
          }
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {  // merge the two best of two lanes
        const Best oa{__shfl_xor_sync(kAll, a.v, o), __shfl_xor_sync(kAll, a.i, o)};
        const Best ob{__shfl_xor_sync(kAll, b.v, o), __shfl_xor_sync(kAll, b.i, o)};
        const Best top = Better(a, oa);
        const Best second = top.i == a.i ? Better(b, oa) : Better(a, ob);
        a = top;
        b = second;
      }
      if (lane == 0) group_s[warp][g] = a.v + b.v;
    }
    for (int g = lane; g < n_group; g += 32) kept_s[warp][g] = 0;
    __syncwarp();
    for (int j = 0; j < topk_group; ++j) {
      Best g{0.0f, -1};
      for (int t = lane; t < n_group; t += 32) {
        if (!kept_s[warp][t]) g = Better(g, Best{group_s[warp][t], t});
      }
      g = WarpBest(g);
      if (lane == 0) kept_s[warp][g.i] = 1;
      __syncwarp();
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = lane + 32 * u;
      if (i < e && !kept_s[warp][i / per]) c[u] = -INFINITY;
    }
  }
  // The top k: each expert as one 64-bit key (value order, then the lower index), so that every step of the k
  // warp arg-maxes is a branch-free unsigned max (the rounds are a serial chain: their latency is the kernel's).
  uint64_t key[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) key[u] = ((out >> u) & 1) ? 0 : Key(c[u], lane + 32 * u);
  uint64_t mine = 0;
#pragma unroll
  for (int u = 0; u < PER; ++u) mine = max(mine, key[u]);
  int id = 0;
  float w = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int best = KeyIndex(WarpMax(mine));
    const int owner = best & 31, slot = best >> 5;
    float score = 0.0f;  // the winner's unbiased score, from its lane's registers
#pragma unroll
    for (int u = 0; u < PER; ++u) score = u == slot ? s[u] : score;
    score = __shfl_sync(kAll, score, owner);
    if (lane == j) {
      id = best;
      w = score;
    }
    if (lane == owner) {
      mine = 0;
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        key[u] = u == slot ? 0 : key[u];
        mine = max(mine, key[u]);
      }
    }
  }
  float total = 0.0f;  // summed in order j = 0 .. k-1, as the CPU handler does
  for (int j = 0; j < k; ++j) total += __shfl_sync(kAll, w, j);
  if (lane < k) {
    const int64_t at = static_cast<int64_t>(row) * k + lane;
    ids[at] = id;
    weights[at] = (renormalize ? w / (total + 1e-20f) : w) * scale;
  }
}

template <int PER>
void Launch(cudaStream_t stream, unsigned blocks, const float* logits, const float* bias, int m, int e, int k,
            int n_group, int topk_group, bool renormalize, float scale, int32_t* ids, float* weights) {
  RouteKernel<PER><<<blocks, kWarps * 32, 0, stream>>>(logits, bias, m, e, k, n_group, topk_group, renormalize,
                                                       scale, ids, weights);
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
  const auto launch = d.e <= 32 * 4    ? Launch<4>
                      : d.e <= 32 * 8  ? Launch<8>
                      : d.e <= 32 * 12 ? Launch<12>  // 384 experts (Kimi K2, DeepSeek-V3 has 256)
                      : d.e <= 32 * 16 ? Launch<16>
                      : d.e <= 32 * 32 ? Launch<32>
                                       : Launch<64>;
  launch(stream, blocks, logits.typed_data(), bias.typed_data(), static_cast<int>(d.m), static_cast<int>(d.e),
         static_cast<int>(d.k), static_cast<int>(n_group), static_cast<int>(topk_group), renormalize, scale,
         ids->typed_data(), weights->typed_data());
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
