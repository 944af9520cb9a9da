// mla_pre on the CPU: the projections between qkv_a and the attention of one MLA layer (kdtree_jax/kernels/mla_pre.py
// has the math). Row m of a [M, Rq + R + dr] is token t = m % T of batch row b = m / T (T = M / B):
//   cq = round(w_q * round(a[:Rq] / rms)),  q[h, j] = round(cq . q_b[h, j, :]),
//   q_lat[m, h, i] = round(q[h, :dn] . k_b[i, h, :]),  q_pe[m, h] = rope(q[h, dn:]),
//   latent[b, d + t] = round(w_kv * round(a[Rq:Rq+R] / rms)),  pe[b, d + t] = rope(a[Rq+R:]),
// d = clamp(starts[b], 0, S - T); every sum and product in fp32, round() to the activations' dtype where the model
// rounds, rope(x)_(2i, 2i+1) = round(x1 cos_i - x2 sin_i), round(x2 cos_i + x1 sin_i). The caches are aliased to the
// results (in place). mla_pre.cu is the same on CUDA (sums in another order).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using F32Mat = ffi::Buffer<ffi::F32, 2>;
using I32Vec = ffi::Buffer<ffi::S32, 1>;

namespace kdtree {
namespace {

inline float Round(float x, float*) { return x; }
inline float Round(float x, uint16_t*) { return ToFloat(Bf16Bits(x)); }
inline void Store(float x, float* dst) { *dst = x; }
inline void Store(float x, uint16_t* dst) { *dst = Bf16Bits(x); }

// w * round(x / rms(x)), rounded, into out (n floats).
template <typename T>
void NormRow(const T* x, const T* w, int64_t n, float eps, float* out) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += ToFloat(x[i]) * ToFloat(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = Round(ToFloat(w[i]) * Round(ToFloat(x[i]) * inv, static_cast<T*>(nullptr)), static_cast<T*>(nullptr));
  }
}

// The interleaved pairs of x (dr floats) rotated by (cos, sin) [dr / 2], stored as T.
template <typename T>
void RopeRow(const float* x, const float* cos, const float* sin, int64_t dr, T* out) {
  for (int64_t i = 0; i < dr / 2; ++i) {
    const float x1 = x[2 * i], x2 = x[2 * i + 1];
    Store(x1 * cos[i] - x2 * sin[i], out + 2 * i);
    Store(x2 * cos[i] + x1 * sin[i], out + 2 * i + 1);
  }
}

template <typename T>
ffi::Error Run(ffi::AnyBuffer a_buf, ffi::AnyBuffer qn_buf, ffi::AnyBuffer kvn_buf, ffi::AnyBuffer qb_buf,
               ffi::AnyBuffer kb_buf, F32Mat cos, F32Mat sin,
               I32Vec starts, ffi::AnyBuffer lat_in, ffi::AnyBuffer pe_in, float eps,
               ffi::Result<ffi::AnyBuffer> q_lat_buf, ffi::Result<ffi::AnyBuffer> q_pe_buf,
               ffi::Result<ffi::AnyBuffer> lat_buf, ffi::Result<ffi::AnyBuffer> pe_buf) {
  const auto ad = a_buf.dimensions(), qd = qb_buf.dimensions(), kd = kb_buf.dimensions(), ld = lat_in.dimensions();
  if (ad.size() != 2 || qd.size() != 3 || kd.size() != 3 || ld.size() != 3 || pe_in.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument("mla_pre: a [M, C], q_b [H, dn + dr, Rq], k_b [R, H, dn], caches [B, S, *]");
  }
  const int64_t m_rows = ad[0], c = ad[1], h = qd[0], dq = qd[1], rq = qd[2], r = kd[0], dn = kd[2];
  const int64_t dr = dq - dn, b = ld[0], s = ld[1];
  if (kd[1] != h || ld[2] != r || c != rq + r + dr || dr < 2 || dr % 2 || b < 1 || m_rows % b ||
      starts.element_count() != static_cast<size_t>(b) || qn_buf.element_count() != static_cast<size_t>(rq) ||
      kvn_buf.element_count() != static_cast<size_t>(r) || pe_in.dimensions()[1] != s ||
      pe_in.dimensions()[2] != dr || cos.element_count() != static_cast<size_t>(m_rows * dr / 2) ||
      sin.element_count() != cos.element_count() || m_rows / b > s) {
    return ffi::Error::InvalidArgument("mla_pre: shapes do not agree (a [M, Rq + R + dr], norms [Rq] and [R], caches "
                                       "[B, S, R] and [B, S, dr] with M a multiple of B and M / B <= S, cos and "
                                       "sin [M, dr / 2])");
  }
  const int64_t t_rows = m_rows / b;
  const T* a = static_cast<const T*>(a_buf.untyped_data());
  const T* wq = static_cast<const T*>(qn_buf.untyped_data());
  const T* wkv = static_cast<const T*>(kvn_buf.untyped_data());
  const T* qb = static_cast<const T*>(qb_buf.untyped_data());
  const T* kb = static_cast<const T*>(kb_buf.untyped_data());
  T* q_lat = static_cast<T*>(q_lat_buf->untyped_data());
  T* q_pe = static_cast<T*>(q_pe_buf->untyped_data());
  T* lat = static_cast<T*>(lat_buf->untyped_data());
  T* pe = static_cast<T*>(pe_buf->untyped_data());
  if (lat != lat_in.untyped_data()) std::memcpy(lat, lat_in.untyped_data(), lat_in.size_bytes());
  if (pe != pe_in.untyped_data()) std::memcpy(pe, pe_in.untyped_data(), pe_in.size_bytes());

  std::vector<float> cq(rq), q(dq), row(std::max(dn, std::max(r, dr))), w(std::max(rq, dn));
  for (int64_t m = 0; m < m_rows; ++m) {
    const T* x = a + m * c;
    const float* cs = cos.typed_data() + m * dr / 2;
    const float* sn = sin.typed_data() + m * dr / 2;
    NormRow(x, wq, rq, eps, cq.data());
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t j = 0; j < dq; ++j) {
        const T* wr = qb + (hh * dq + j) * rq;
        for (int64_t k = 0; k < rq; ++k) w[k] = ToFloat(wr[k]);
        q[j] = Round(Dot(cq.data(), w.data(), rq), static_cast<T*>(nullptr));
      }
      RopeRow(q.data() + dn, cs, sn, dr, q_pe + (m * h + hh) * dr);
      for (int64_t i = 0; i < r; ++i) {
        const T* kr = kb + (i * h + hh) * dn;
        for (int64_t n = 0; n < dn; ++n) w[n] = ToFloat(kr[n]);
        Store(Dot(q.data(), w.data(), dn), q_lat + (m * h + hh) * r + i);
      }
    }
    const int64_t bb = m / t_rows, slot = std::clamp<int64_t>(starts.typed_data()[bb], 0, s - t_rows) + m % t_rows;
    NormRow(x + rq, wkv, r, eps, row.data());
    for (int64_t i = 0; i < r; ++i) Store(row[i], lat + (bb * s + slot) * r + i);
    for (int64_t i = 0; i < dr; ++i) row[i] = ToFloat(x[rq + r + i]);
    RopeRow(row.data(), cs, sn, dr, pe + (bb * s + slot) * dr);
  }
  return ffi::Error::Success();
}

ffi::Error MlaPre(ffi::AnyBuffer a, ffi::AnyBuffer qn, ffi::AnyBuffer kvn, ffi::AnyBuffer qb, ffi::AnyBuffer kb,
                  F32Mat cos, F32Mat sin, I32Vec starts,
                  ffi::AnyBuffer lat, ffi::AnyBuffer pe, float eps, int64_t /*flags: CUDA launch only*/,
                  ffi::Result<ffi::AnyBuffer> q_lat,
                  ffi::Result<ffi::AnyBuffer> q_pe, ffi::Result<ffi::AnyBuffer> lat_out,
                  ffi::Result<ffi::AnyBuffer> pe_out) {
  const ffi::DataType t = a.element_type();
  for (ffi::DataType u : {qn.element_type(), kvn.element_type(), qb.element_type(), kb.element_type(),
                          lat.element_type(), pe.element_type(), q_lat->element_type(), q_pe->element_type()}) {
    if (u != t) return ffi::Error::InvalidArgument("mla_pre: a, the weights, the caches and the results share a dtype");
  }
  if (t == ffi::DataType::F32) {
    return Run<float>(a, qn, kvn, qb, kb, cos, sin, starts, lat, pe, eps, q_lat, q_pe, lat_out, pe_out);
  }
  if (t == ffi::DataType::BF16) {
    return Run<uint16_t>(a, qn, kvn, qb, kb, cos, sin, starts, lat, pe, eps, q_lat, q_pe, lat_out, pe_out);
  }
  return ffi::Error::InvalidArgument("mla_pre: dtype must be float32 or bfloat16");
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMlaPreCpu, kdtree::MlaPre,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()               // a [M, Rq + R + dr] (qkv_a's output)
                                  .Arg<ffi::AnyBuffer>()               // q_a_norm [Rq]
                                  .Arg<ffi::AnyBuffer>()               // kv_a_norm [R]
                                  .Arg<ffi::AnyBuffer>()               // q_b [H, dn + dr, Rq]
                                  .Arg<ffi::AnyBuffer>()               // k_b [R, H, dn]
                                  .Arg<F32Mat>()     // cos [M, dr / 2]
                                  .Arg<F32Mat>()     // sin [M, dr / 2]
                                  .Arg<I32Vec>()     // starts [B]
                                  .Arg<ffi::AnyBuffer>()               // latent cache [B, S, R] (aliased)
                                  .Arg<ffi::AnyBuffer>()               // rope-key cache [B, S, dr] (aliased)
                                  .Attr<float>("eps")                  // the norms' epsilon
                                  .Attr<int64_t>("flags")              // bit 0: the weights are program inputs
                                  .Ret<ffi::AnyBuffer>()               // q_lat [M, H, R]
                                  .Ret<ffi::AnyBuffer>()               // q_pe [M, H, dr]
                                  .Ret<ffi::AnyBuffer>()               // latent cache, rows written
                                  .Ret<ffi::AnyBuffer>());             // rope-key cache, rows written
