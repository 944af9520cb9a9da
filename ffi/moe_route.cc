// moe_route on the CPU: the sigmoid noaux_tc router's choice of experts from its logits, the function of
// kdtree_jax/kernels/moe_route.py's `moe_route_ref`. Per token: score = sigmoid(logit), choice = score + bias; with
// n_group > 1 only the topk_group groups with the largest sum of their two best choices compete (the others are
// -inf); the k largest choices in order (ties: the lower index first), weighted by their unbiased scores,
// renormalized to sum 1 when asked, times `scale`. moe_route.cu computes the same, one warp per token.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using F32Mat = ffi::Buffer<ffi::F32, 2>;
using F32Vec = ffi::Buffer<ffi::F32, 1>;
using I32Mat = ffi::Buffer<ffi::S32, 2>;

namespace kdtree {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The index of the largest of v[0..n) not yet taken (ties: the lowest index); -inf counts as a value.
int64_t ArgMax(const std::vector<float>& v, const std::vector<char>& taken, int64_t first, int64_t n) {
  int64_t best = -1;
  for (int64_t i = first; i < first + n; ++i) {
    if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
  }
  return best;
}

ffi::Error MoeRoute(F32Mat logits, F32Vec bias, int64_t n_group, int64_t topk_group, bool renormalize, float scale,
                    ffi::Result<I32Mat> ids, ffi::Result<F32Mat> weights) {
  RouteShape d;
  if (ffi::Error e = CheckRouteShape(logits.dimensions(), bias.dimensions(), ids->dimensions(),
                                     weights->dimensions(), n_group, topk_group, &d);
      e.failure()) {
    return e;
  }
  const int64_t per = d.e / n_group;
  std::vector<float> choice(d.e), group(n_group);
  std::vector<char> taken(d.e), gtaken(n_group);
  for (int64_t m = 0; m < d.m; ++m) {
    const float* x = logits.typed_data() + m * d.e;
    for (int64_t e = 0; e < d.e; ++e) choice[e] = Sigmoid(x[e]) + bias.typed_data()[e];
    if (n_group > 1) {
      for (int64_t g = 0; g < n_group; ++g) {  // the sum of the group's two best choices
        std::fill(taken.begin(), taken.end(), 0);
        const int64_t a = ArgMax(choice, taken, g * per, per);
        taken[a] = 1;
        group[g] = choice[a] + choice[ArgMax(choice, taken, g * per, per)];
      }
      std::fill(gtaken.begin(), gtaken.end(), 0);
      for (int64_t j = 0; j < topk_group; ++j) gtaken[ArgMax(group, gtaken, 0, n_group)] = 1;
      for (int64_t e = 0; e < d.e; ++e) {
        if (!gtaken[e / per]) choice[e] = kNegInf;
      }
    }
    std::fill(taken.begin(), taken.end(), 0);
    int32_t* out_ids = ids->typed_data() + m * d.k;
    float* out_w = weights->typed_data() + m * d.k;
    float total = 0.0f;
    for (int64_t j = 0; j < d.k; ++j) {
      const int64_t e = ArgMax(choice, taken, 0, d.e);
      taken[e] = 1;
      out_ids[j] = static_cast<int32_t>(e);
      out_w[j] = Sigmoid(x[e]);
      total += out_w[j];
    }
    for (int64_t j = 0; j < d.k; ++j) out_w[j] = (renormalize ? out_w[j] / (total + 1e-20f) : out_w[j]) * scale;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMoeRouteCpu, kdtree::MoeRoute,
                              ffi::Ffi::Bind()
                                  .Arg<F32Mat>()               // logits [M, E]
                                  .Arg<F32Vec>()               // bias [E] (selection only)
                                  .Attr<int64_t>("n_group")    // expert groups
                                  .Attr<int64_t>("topk_group") // groups kept per token
                                  .Attr<bool>("renormalize")   // weights divided by their sum
                                  .Attr<float>("scale")        // routed_scaling_factor
                                  .Ret<I32Mat>()               // ids [M, k]
                                  .Ret<F32Mat>());             // weights [M, k]
