// draft_attention, CPU handler: the DFlash drafter's block attention (grouped-query heads).
//
// For batch row b, block token t and query head h (kv head g = h / (H / G); shapes in
// kdtree_jax/kernels/draft_attention.py):
//   keys    = the context, slots 0 .. P-1 of ck/cv with P = clamp(lengths[b], 0, S), then the T block tokens of
//             kb/vb, all visible (the block attends to itself both ways);
//   s_k     = scale * q[b, t, h] . key_k
//   out     = sum_k softmax(s)_k value_k
// Scores, softmax and sums are fp32 for fp32 and bf16 inputs alike; the output has the inputs' dtype.
// This is the function of kdtree_jax.drafter.block_attention (which rounds the probabilities to the inputs' dtype
// before the products: the kernel does not).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpu_math.h"
#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kdtree::Dot;
using kdtree::FromFloat;
using kdtree::ToFloat;

using Dims = kdtree::DraftShape;

template <typename T>
void Attend(const T* q, const T* ck, const T* cv, const T* kb, const T* vb, const int32_t* lens, float scale,
            const Dims& n, T* out) {
  const int64_t rep = n.h / n.g;
  std::vector<float> keys, values, qrow(n.d), scores, acc(n.d);
  for (int64_t b = 0; b < n.b; ++b) {
    const int64_t prefix = std::clamp<int64_t>(lens[b], 0, n.s);
    const int64_t nkeys = prefix + n.t;
    for (int64_t g = 0; g < n.g; ++g) {
      keys.resize(nkeys * n.d);
      values.resize(nkeys * n.d);
      for (int64_t k = 0; k < nkeys; ++k) {
        const int64_t at = k < prefix ? ((b * n.s + k) * n.g + g) * n.d : ((b * n.t + k - prefix) * n.g + g) * n.d;
        const T* kr = (k < prefix ? ck : kb) + at;
        const T* vr = (k < prefix ? cv : vb) + at;
        for (int64_t i = 0; i < n.d; ++i) {
          keys[k * n.d + i] = ToFloat(kr[i]);
          values[k * n.d + i] = ToFloat(vr[i]);
        }
      }
      scores.resize(nkeys);
      for (int64_t t = 0; t < n.t; ++t) {
        for (int64_t r = 0; r < rep; ++r) {
          const int64_t row = (b * n.t + t) * n.h + g * rep + r;
          for (int64_t i = 0; i < n.d; ++i) qrow[i] = ToFloat(q[row * n.d + i]);
          float peak = -std::numeric_limits<float>::infinity();
          for (int64_t k = 0; k < nkeys; ++k) {
            scores[k] = Dot(qrow.data(), keys.data() + k * n.d, n.d) * scale;
            peak = std::max(peak, scores[k]);
          }
          float total = 0.0f;
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t k = 0; k < nkeys; ++k) {
            const float p = std::exp(scores[k] - peak);
            total += p;
            const float* v = values.data() + k * n.d;
            for (int64_t i = 0; i < n.d; ++i) acc[i] += p * v[i];
          }
          const float inv = total > 0.0f ? 1.0f / total : 0.0f;
          for (int64_t i = 0; i < n.d; ++i) FromFloat(acc[i] * inv, out + row * n.d + i);
        }
      }
    }
  }
}

ffi::Error DraftAttentionCpuImpl(ffi::AnyBuffer q,                  // [B, T, H, D]
                                 ffi::AnyBuffer ck,                 // [B, S, G, D]
                                 ffi::AnyBuffer cv,                 // [B, S, G, D]
                                 ffi::AnyBuffer kb,                 // [B, T, G, D]
                                 ffi::AnyBuffer vb,                 // [B, T, G, D]
                                 ffi::Buffer<ffi::S32> lengths,     // [B]
                                 float scale,
                                 ffi::Result<ffi::AnyBuffer> out) {  // [B, T, H, D]
  Dims n;
  if (ffi::Error e = kdtree::CheckDraftShape(q, ck, cv, kb, vb, lengths.element_count(), *out, &n); e.failure()) {
    return e;
  }
  const ffi::DataType t = q.element_type();
  const int32_t* lens = lengths.typed_data();
  if (t == ffi::DataType::F32) {
    Attend(static_cast<const float*>(q.untyped_data()), static_cast<const float*>(ck.untyped_data()),
           static_cast<const float*>(cv.untyped_data()), static_cast<const float*>(kb.untyped_data()),
           static_cast<const float*>(vb.untyped_data()), lens, scale, n, static_cast<float*>(out->untyped_data()));
  } else if (t == ffi::DataType::BF16) {
    Attend(static_cast<const uint16_t*>(q.untyped_data()), static_cast<const uint16_t*>(ck.untyped_data()),
           static_cast<const uint16_t*>(cv.untyped_data()), static_cast<const uint16_t*>(kb.untyped_data()),
           static_cast<const uint16_t*>(vb.untyped_data()), lens, scale, n,
           static_cast<uint16_t*>(out->untyped_data()));
  } else {
    return ffi::Error::InvalidArgument("draft_attention: dtype must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdDraftAttentionCpu, DraftAttentionCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // q [B, T, H, D]
                                  .Arg<ffi::AnyBuffer>()           // ck [B, S, G, D]
                                  .Arg<ffi::AnyBuffer>()           // cv [B, S, G, D]
                                  .Arg<ffi::AnyBuffer>()           // kb [B, T, G, D]
                                  .Arg<ffi::AnyBuffer>()           // vb [B, T, G, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // lengths [B]
                                  .Attr<float>("scale")            // softmax scale
                                  .Ret<ffi::AnyBuffer>());         // out [B, T, H, D]
