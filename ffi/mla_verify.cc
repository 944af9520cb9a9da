// mla_verify, CPU handler: MLA-absorbed attention over the latent cache with a tree mask.
//
// For batch row b, query token n and head h (shapes in kdtree_jax/kernels/mla_verify.py):
//   keys    = the committed prefix, slots 0 .. P-1 with P = clamp(cache_lens[b], 0, S), all visible;
//             then the N tree tokens, slots T0 + u with T0 = clamp(cache_lens[b], 0, S - N), visible when
//             tree_mask[b, n, u]  (T0 = P unless the tree would run past the end of the cache);
//   s_k     = scale * (q_lat[b, n, h] . latent[b, slot_k] + q_pe[b, n, h] . pe[b, slot_k])
//   out     = sum_k softmax(s)_k latent[b, slot_k]       (zeros when no key is visible)
// Scores, softmax and sums are fp32 for fp32 and bf16 inputs alike; the output has the inputs' dtype.
// This is the function of model.mla_absorbed_attention, including its clamping when lengths + N > S.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

using Dims = kdtree::MlaShape;

template <typename T>
void Attend(const T* q_lat, const T* q_pe, const T* latent, const T* pe, const int32_t* lens, const bool* mask,
            float scale, const Dims& d, T* out) {
  const int64_t kdim = d.r + d.dr;
  std::vector<float> keys;     // [P + N, R + dr]  this row's keys in fp32, prefix then tree
  std::vector<int64_t> seen;   // visible key indices of one query token
  std::vector<float> scores;   // [H, visible]
  std::vector<float> acc(d.h * d.r);
  std::vector<float> q(d.h * kdim);
  std::vector<float> total(d.h);
  for (int64_t b = 0; b < d.b; ++b) {
    const int64_t len = lens[b];
    const int64_t prefix = std::clamp<int64_t>(len, 0, d.s);
    const int64_t tree0 = std::clamp<int64_t>(len, 0, d.s - d.n);
    const int64_t nkeys = prefix + d.n;
    keys.resize(nkeys * kdim);
    for (int64_t k = 0; k < nkeys; ++k) {
      const int64_t slot = k < prefix ? k : tree0 + (k - prefix);
      const T* lat = latent + (b * d.s + slot) * d.r;
      const T* rope = pe + (b * d.s + slot) * d.dr;
      float* row = keys.data() + k * kdim;
      for (int64_t i = 0; i < d.r; ++i) row[i] = ToFloat(lat[i]);
      for (int64_t i = 0; i < d.dr; ++i) row[d.r + i] = ToFloat(rope[i]);
    }
    for (int64_t n = 0; n < d.n; ++n) {
      seen.clear();
      for (int64_t k = 0; k < prefix; ++k) seen.push_back(k);
      for (int64_t u = 0; u < d.n; ++u) {
        if (mask[(b * d.n + n) * d.n + u]) seen.push_back(prefix + u);
      }
      const int64_t nv = static_cast<int64_t>(seen.size());
      const int64_t qrow = (b * d.n + n) * d.h;
      for (int64_t h = 0; h < d.h; ++h) {
        for (int64_t i = 0; i < d.r; ++i) q[h * kdim + i] = ToFloat(q_lat[(qrow + h) * d.r + i]);
        for (int64_t i = 0; i < d.dr; ++i) q[h * kdim + d.r + i] = ToFloat(q_pe[(qrow + h) * d.dr + i]);
      }
      scores.resize(d.h * nv);
      for (int64_t j = 0; j < nv; ++j) {
        const float* key = keys.data() + seen[j] * kdim;
        for (int64_t h = 0; h < d.h; ++h) {
          const float* qh = q.data() + h * kdim;
          scores[h * nv + j] = (Dot(qh, key, d.r) + Dot(qh + d.r, key + d.r, d.dr)) * scale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(total.begin(), total.end(), 0.0f);
      for (int64_t h = 0; h < d.h; ++h) {
        float* sh = scores.data() + h * nv;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < nv; ++j) peak = std::max(peak, sh[j]);
        for (int64_t j = 0; j < nv; ++j) {
          sh[j] = std::exp(sh[j] - peak);
          total[h] += sh[j];
        }
      }
      for (int64_t j = 0; j < nv; ++j) {
        const float* value = keys.data() + seen[j] * kdim;
        for (int64_t h = 0; h < d.h; ++h) {
          const float p = scores[h * nv + j];
          float* ah = acc.data() + h * d.r;
          for (int64_t i = 0; i < d.r; ++i) ah[i] += p * value[i];
        }
      }
      for (int64_t h = 0; h < d.h; ++h) {
        const float inv = total[h] > 0.0f ? 1.0f / total[h] : 0.0f;
        T* o = out + (qrow + h) * d.r;
        for (int64_t i = 0; i < d.r; ++i) FromFloat(acc[h * d.r + i] * inv, o + i);
      }
    }
  }
}

ffi::Error MlaVerifyCpuImpl(ffi::AnyBuffer q_lat,                // [B, N, H, R]
                            ffi::AnyBuffer q_pe,                 // [B, N, H, dr]
                            ffi::AnyBuffer latent,               // [B, S, R]
                            ffi::AnyBuffer pe,                   // [B, S, dr]
                            ffi::Buffer<ffi::S32> cache_lens,    // [B]
                            ffi::Buffer<ffi::PRED> tree_mask,    // [B, N, N]
                            float scale,                         // softmax scale
                            ffi::Result<ffi::AnyBuffer> out) {   // [B, N, H, R]
  Dims d;
  if (ffi::Error e = kdtree::CheckMlaShape(q_lat.dimensions(), q_pe.dimensions(), latent.dimensions(),
                                           pe.dimensions(), cache_lens.element_count(), tree_mask.element_count(),
                                           &d);
      e.failure()) {
    return e;
  }
  const ffi::DataType t = q_lat.element_type();
  if (q_pe.element_type() != t || latent.element_type() != t || pe.element_type() != t ||
      out->element_type() != t) {
    return ffi::Error::InvalidArgument("mla_verify: q, q_pe, latent, pe and out must share one dtype");
  }
  const int32_t* lens = cache_lens.typed_data();
  const bool* mask = tree_mask.typed_data();
  if (t == ffi::DataType::F32) {
    Attend(static_cast<const float*>(q_lat.untyped_data()), static_cast<const float*>(q_pe.untyped_data()),
           static_cast<const float*>(latent.untyped_data()), static_cast<const float*>(pe.untyped_data()), lens,
           mask, scale, d, static_cast<float*>(out->untyped_data()));
  } else if (t == ffi::DataType::BF16) {
    Attend(static_cast<const uint16_t*>(q_lat.untyped_data()), static_cast<const uint16_t*>(q_pe.untyped_data()),
           static_cast<const uint16_t*>(latent.untyped_data()), static_cast<const uint16_t*>(pe.untyped_data()),
           lens, mask, scale, d, static_cast<uint16_t*>(out->untyped_data()));
  } else {
    return ffi::Error::InvalidArgument("mla_verify: dtype must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMlaVerifyCpu, MlaVerifyCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // q_nope_absorbed [B, N, H, R]
                                  .Arg<ffi::AnyBuffer>()           // q_pe [B, N, H, dr]
                                  .Arg<ffi::AnyBuffer>()           // latent_cache [B, S, R]
                                  .Arg<ffi::AnyBuffer>()           // pe_cache [B, S, dr]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // cache_lens [B]
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // tree_mask [B, N, N]
                                  .Attr<float>("scale")            // softmax scale
                                  .Ret<ffi::AnyBuffer>());         // out [B, N, H, R]
