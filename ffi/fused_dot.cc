// fused_dot on the CPU: the function of kdtree_jax/kernels/fused_dot.py, computed as the CUDA kernel computes it
// (fused_dot.cu).
//
//   x'[m, k] = bf16(nw[k] * bf16(x[m, k] * r[m])), r[m] = 1 / sqrt(sum_k x[m, k]^2 / K + eps)   (no norm: x' = x)
//   a[m, n]  = sum_k x'[m, k] * w[k, n]                      (fp32, k ascending)
//   plain:   y = a (f32), or bf16(a), then y = bf16(add + y) for each addend in order
//   gated:   w = [gate | up]; g = bf16(a_gate), u = bf16(a_up), y = bf16(bf16(g * bf16(sigmoid(g))) * u)
//   xn = x'
// The GPU sums k in another order (equal within fp32 rounding) and takes an approximate reciprocal square root.
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_math.h"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace kdtree {
namespace {

float Rb(float v) { return ToFloat(Bf16Bits(v)); }

void Segment(const std::vector<float>& xs, const uint16_t* w, int64_t m, int64_t k,
             int64_t n, bool gated, ffi::AnyBuffer& y, const uint16_t* add0, const uint16_t* add1) {
  std::vector<float> a(n);
  const int64_t outs = gated ? n / 2 : n;
  const bool f32 = y.element_type() == ffi::DataType::F32;
  for (int64_t row = 0; row < m; ++row) {
    std::fill(a.begin(), a.end(), 0.0f);
    for (int64_t kk = 0; kk < k; ++kk) {
      const float xv = xs[row * k + kk];
      const uint16_t* wr = w + kk * n;
      for (int64_t c = 0; c < n; ++c) a[c] += xv * ToFloat(wr[c]);
    }
    for (int64_t c = 0; c < outs; ++c) {
      const int64_t at = row * outs + c;
      if (gated) {
        const float g = Rb(a[c]), u = Rb(a[outs + c]);
        const float h = Rb(Rb(g * Rb(1.0f / (1.0f + std::exp(-g)))) * u);
        reinterpret_cast<uint16_t*>(y.untyped_data())[at] = Bf16Bits(h);
      } else if (f32) {
        reinterpret_cast<float*>(y.untyped_data())[at] = a[c];
      } else {
        float o = Rb(a[c]);
        if (add0) o = Rb(ToFloat(add0[at]) + o);
        if (add1) o = Rb(ToFloat(add1[at]) + o);
        reinterpret_cast<uint16_t*>(y.untyped_data())[at] = Bf16Bits(o);
      }
    }
  }
}

ffi::Error FusedDot(ffi::AnyBuffer x, ffi::AnyBuffer w0, ffi::AnyBuffer w1, ffi::AnyBuffer nw, ffi::AnyBuffer add0,
                    ffi::AnyBuffer add1, float eps, int64_t gated0, int64_t gated1, int64_t layer, int64_t split,
                    int64_t flags, ffi::Result<ffi::AnyBuffer> y0, ffi::Result<ffi::AnyBuffer> y1,
                    ffi::Result<ffi::AnyBuffer> xn) {
  (void)flags;  // launch options of the CUDA kernel
  FusedDotShape d;
  if (ffi::Error e = CheckFusedDot(x, w0, w1, nw, add0, add1, gated0, gated1, layer, *y0, *y1, *xn, &d);
      e.failure()) {
    return e;
  }
  if (split < 0) return ffi::Error::InvalidArgument("fused_dot: split must be >= 0");
  const auto* xs = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const auto* ns = reinterpret_cast<const uint16_t*>(nw.untyped_data()) + d.offn;
  std::vector<float> xw(d.m * d.k);
  for (int64_t row = 0; row < d.m; ++row) {
    float ss = 0.0f;
    for (int64_t kk = 0; kk < d.k; ++kk) {
      const float v = ToFloat(xs[row * d.k + kk]);
      ss += v * v;
    }
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(d.k) + eps);
    for (int64_t kk = 0; kk < d.k; ++kk) {
      const float v = ToFloat(xs[row * d.k + kk]);
      xw[row * d.k + kk] = d.has_norm ? Rb(ToFloat(ns[kk]) * Rb(v * r)) : v;
    }
  }
  const auto* a0 = d.adds > 0 ? reinterpret_cast<const uint16_t*>(add0.untyped_data()) : nullptr;
  const auto* a1 = d.adds > 1 ? reinterpret_cast<const uint16_t*>(add1.untyped_data()) : nullptr;
  const auto* ws0 = reinterpret_cast<const uint16_t*>(w0.untyped_data()) + d.off0;  // (a stack's layer: offset)
  const auto* ws1 = reinterpret_cast<const uint16_t*>(w1.untyped_data()) + d.off1;
  Segment(xw, ws0, d.m, d.k, d.n0, gated0, *y0, a0, a1);
  if (d.n1) Segment(xw, ws1, d.m, d.k, d.n1, gated1, *y1, nullptr, nullptr);
  if (d.want_xn) {
    auto* out = reinterpret_cast<uint16_t*>(xn->untyped_data());
    for (int64_t e = 0; e < d.m * d.k; ++e) out[e] = Bf16Bits(xw[e]);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdFusedDotCpu, kdtree::FusedDot,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16
                                  .Arg<ffi::AnyBuffer>()  // w0 [K, N0] or [L, K, N0]
                                  .Arg<ffi::AnyBuffer>()  // w1 [K, N1] or [L, K, N1] (N1 = 0: none)
                                  .Arg<ffi::AnyBuffer>()  // nw [K], [L, K] or [0]
                                  .Arg<ffi::AnyBuffer>()  // add0 [M, N0] or [0]
                                  .Arg<ffi::AnyBuffer>()  // add1 [M, N0] or [0]
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("gated0")
                                  .Attr<int64_t>("gated1")
                                  .Attr<int64_t>("layer")  // the slice of stacked weights used
                                  .Attr<int64_t>("split")  // the CUDA kernel's blocks per K
                                  .Attr<int64_t>("flags")  // the CUDA kernel's launch options
                                  .Ret<ffi::AnyBuffer>()   // y0
                                  .Ret<ffi::AnyBuffer>()   // y1
                                  .Ret<ffi::AnyBuffer>()); // xn
