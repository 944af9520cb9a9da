// small_dot on the CPU: y[M, N] = x[M, K] . w[K, N], bf16 inputs, fp32 accumulation over k in ascending order, one
// rounding to y's dtype (bf16 or f32); the function of kdtree_jax/kernels/small_dot.py's `small_dot_ref`.
// small_dot.cu computes the same on the GPU (its sums run in another order: equal within fp32 rounding).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_math.h"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using Bf16Mat = ffi::Buffer<ffi::BF16, 2>;

namespace kdtree {
namespace {

ffi::Error SmallDot(Bf16Mat x, Bf16Mat w, int64_t split, int64_t flags,
                    ffi::Result<ffi::AnyBuffer> y) {
  (void)flags;  // launch options of the CUDA kernel
  SmallDotShape d;
  if (ffi::Error e = CheckSmallDotShape(x.dimensions(), w.dimensions(), y->dimensions(), y->element_type(), &d);
      e.failure()) {
    return e;
  }
  if (split < 0) return ffi::Error::InvalidArgument("small_dot: split must be >= 0");
  const auto* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* ws = reinterpret_cast<const uint16_t*>(w.typed_data());
  const bool f32 = y->element_type() == ffi::DataType::F32;
  std::vector<float> acc(d.n);
  for (int64_t m = 0; m < d.m; ++m) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < d.k; ++k) {
      const float xv = ToFloat(xs[m * d.k + k]);
      const uint16_t* row = ws + k * d.n;
      for (int64_t n = 0; n < d.n; ++n) acc[n] += xv * ToFloat(row[n]);
    }
    if (f32) {
      float* out = reinterpret_cast<float*>(y->untyped_data()) + m * d.n;
      for (int64_t n = 0; n < d.n; ++n) out[n] = acc[n];
    } else {
      uint16_t* out = reinterpret_cast<uint16_t*>(y->untyped_data()) + m * d.n;
      for (int64_t n = 0; n < d.n; ++n) out[n] = Bf16Bits(acc[n]);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdSmallDotCpu, kdtree::SmallDot,
                              ffi::Ffi::Bind()
                                  .Arg<Bf16Mat>()  // x [M, K]
                                  .Arg<Bf16Mat>()  // w [K, N]
                                  .Attr<int64_t>("split")            // the CUDA kernel's blocks per K (0: chosen)
                                  .Attr<int64_t>("flags")            // the CUDA kernel's launch options
                                  .Ret<ffi::AnyBuffer>());           // y [M, N], bf16 or f32
