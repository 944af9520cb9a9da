// marlin_moe, CPU handler: the routed experts of a MoE layer with INT4 (W4A16) weights.
//
// For token m and its k routing slots j (slot = m k + j, expert e = ids[m, j]; e outside [0, E) means "no expert
// here" and the slot adds nothing):
//   W[o, i]  = q[o, i] * scale[o, i / group]      (q = nibble - 8; the compressed-tensors layout of kdtree_jax.quant:
//                                                  int32 [E, out, in/8], nibble i % 8 of word i / 8, LSB first)
//   h[slot]  = silu(x[m] . gate_e) * (x[m] . up_e)          [F]
//   ys[slot] = h[slot] . down_e                             [D]
//   out[m]   = sum_j weights[m, j] * ys[m k + j]            j ascending, fp32
// Dot products are fp32. With bf16 activations, W, h and ys are rounded to bf16 like the CUDA tile path rounds them
// (its mma inputs and its scratch are bf16; the CUDA stream path keeps W exact, scaling fp32 sums); with float32
// everything stays float32.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_math.h"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kdtree::Bf16Bits;
using kdtree::Dot;
using kdtree::ToFloat;

// x rounded to the storage type T (identity for float).
inline float RoundTo(float x, const float*) { return x; }
inline float RoundTo(float x, const uint16_t*) { return ToFloat(Bf16Bits(x)); }

inline void Store(float x, float* out) { *out = x; }
inline void Store(float x, uint16_t* out) { *out = Bf16Bits(x); }

inline float Silu(float v) { return v / (1.0f + std::exp(-v)); }

// Expert e's weight [rows, cols] as floats (rounded to T), from packed [E, rows, cols/8] and scales [E, rows, G].
template <typename T>
void Dequantize(const uint32_t* packed, const uint16_t* scale, int64_t e, int64_t rows, int64_t cols, int64_t groups,
                std::vector<float>* w) {
  const int64_t group = cols / groups;
  w->resize(rows * cols);
  const T* tag = nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* q = packed + (e * rows + r) * (cols / 8);
    const uint16_t* s = scale + (e * rows + r) * groups;
    float* dst = w->data() + r * cols;
    for (int64_t i = 0; i < cols; ++i) {
      const int nib = static_cast<int>((q[i / 8] >> (4 * (i % 8))) & 15u) - 8;
      dst[i] = RoundTo(static_cast<float>(nib) * ToFloat(s[i / group]), tag);
    }
  }
}

using Dims = kdtree::MoeShape;

struct Experts {
  const uint32_t *gate_q, *up_q, *down_q;
  const uint16_t *gate_s, *up_s, *down_s;
};

template <typename T>
void Run(const T* x, const int32_t* ids, const float* weights, const Experts& w, const Dims& d, T* out) {
  const int64_t slots = d.m * d.k;
  std::vector<std::vector<int64_t>> by_expert(d.e);  // slots of each expert, ascending
  for (int64_t s = 0; s < slots; ++s) {
    if (ids[s] >= 0 && ids[s] < d.e) by_expert[ids[s]].push_back(s);
  }
  const T* tag = nullptr;
  std::vector<float> gate, up, down, xv(d.d), h(d.f);
  std::vector<float> ys(slots * d.d, 0.0f);  // [M k, D]
  for (int64_t e = 0; e < d.e; ++e) {
    if (by_expert[e].empty()) continue;
    Dequantize<T>(w.gate_q, w.gate_s, e, d.f, d.d, d.gate_scales, &gate);
    Dequantize<T>(w.up_q, w.up_s, e, d.f, d.d, d.gate_scales, &up);
    Dequantize<T>(w.down_q, w.down_s, e, d.d, d.f, d.down_scales, &down);
    for (const int64_t s : by_expert[e]) {
      const T* row = x + (s / d.k) * d.d;
      for (int64_t i = 0; i < d.d; ++i) xv[i] = ToFloat(row[i]);
      for (int64_t o = 0; o < d.f; ++o) {
        h[o] = RoundTo(Silu(Dot(gate.data() + o * d.d, xv.data(), d.d)) *
                           Dot(up.data() + o * d.d, xv.data(), d.d),
                       tag);
      }
      float* y = ys.data() + s * d.d;
      for (int64_t o = 0; o < d.d; ++o) y[o] = RoundTo(Dot(down.data() + o * d.f, h.data(), d.f), tag);
    }
  }
  for (int64_t m = 0; m < d.m; ++m) {
    for (int64_t o = 0; o < d.d; ++o) {
      float sum = 0.0f;
      for (int64_t j = 0; j < d.k; ++j) {
        const int64_t s = m * d.k + j;
        if (ids[s] >= 0 && ids[s] < d.e) sum += weights[s] * ys[s * d.d + o];
      }
      Store(sum, out + m * d.d + o);
    }
  }
}

ffi::Error MarlinMoeCpuImpl(ffi::AnyBuffer x,                  // [M, D]
                            ffi::Buffer<ffi::S32> ids,         // [M, k]
                            ffi::Buffer<ffi::F32> weights,     // [M, k]
                            ffi::Buffer<ffi::S32> gate_q,      // [E, F, D/8]
                            ffi::Buffer<ffi::BF16> gate_s,     // [E, F, D/G]
                            ffi::Buffer<ffi::S32> up_q,        // [E, F, D/8]
                            ffi::Buffer<ffi::BF16> up_s,       // [E, F, D/G]
                            ffi::Buffer<ffi::S32> down_q,      // [E, D, F/8]
                            ffi::Buffer<ffi::BF16> down_s,     // [E, D, F/G']
                            ffi::Result<ffi::AnyBuffer> out) { // [M, D]
  Dims d;
  if (ffi::Error e = kdtree::CheckMoeShape(x.dimensions(), ids.dimensions(), weights.dimensions(),
                                           gate_q.dimensions(), gate_s.dimensions(), up_q.dimensions(),
                                           up_s.dimensions(), down_q.dimensions(), down_s.dimensions(), &d);
      e.failure()) {
    return e;
  }
  const ffi::DataType t = x.element_type();
  if (out->element_type() != t) return ffi::Error::InvalidArgument("marlin_moe: out must have x's dtype");
  const Experts w{reinterpret_cast<const uint32_t*>(gate_q.typed_data()),
                  reinterpret_cast<const uint32_t*>(up_q.typed_data()),
                  reinterpret_cast<const uint32_t*>(down_q.typed_data()),
                  reinterpret_cast<const uint16_t*>(gate_s.typed_data()),
                  reinterpret_cast<const uint16_t*>(up_s.typed_data()),
                  reinterpret_cast<const uint16_t*>(down_s.typed_data())};
  if (t == ffi::DataType::F32) {
    Run(static_cast<const float*>(x.untyped_data()), ids.typed_data(), weights.typed_data(), w, d,
        static_cast<float*>(out->untyped_data()));
  } else if (t == ffi::DataType::BF16) {
    Run(static_cast<const uint16_t*>(x.untyped_data()), ids.typed_data(), weights.typed_data(), w, d,
        static_cast<uint16_t*>(out->untyped_data()));
  } else {
    return ffi::Error::InvalidArgument("marlin_moe: x must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMarlinMoeCpu, MarlinMoeCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // x [M, D] f32 | bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()     // ids [M, k] (outside [0, E): no expert)
                                  .Arg<ffi::Buffer<ffi::F32>>()     // routing weights [M, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()     // gate packed [E, F, D/8]
                                  .Arg<ffi::Buffer<ffi::BF16>>()    // gate scales [E, F, D/group]
                                  .Arg<ffi::Buffer<ffi::S32>>()     // up packed [E, F, D/8]
                                  .Arg<ffi::Buffer<ffi::BF16>>()    // up scales [E, F, D/group]
                                  .Arg<ffi::Buffer<ffi::S32>>()     // down packed [E, D, F/8]
                                  .Arg<ffi::Buffer<ffi::BF16>>()    // down scales [E, D, F/group]
                                  .Ret<ffi::AnyBuffer>());          // out [M, D]
