// Shared by the C++ (CPU) and CUDA handlers of mla_verify, marlin_moe, moe_route, fused_dot and draft_attention:
// the operand-shape checks (one rule per op for both platforms, with the same error text) and, in CUDA builds,
// CUDA status -> ffi::Error.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

#ifdef __CUDACC__
#include <cuda_runtime.h>
#endif

namespace kdtree {

namespace xffi = xla::ffi;
using Dims = xffi::AnyBuffer::Dimensions;  // what every buffer's dimensions() returns

// "[2, 3, 4]"
inline std::string ShapeString(Dims dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

#ifdef __CUDACC__
// Success, or Internal("<op>: <what>: <CUDA's message>").
inline xffi::Error CudaStatus(cudaError_t err, const char* op, const char* what) {
  if (err == cudaSuccess) return xffi::Error::Success();
  return xffi::Error::Internal(std::string(op) + ": " + what + ": " + cudaGetErrorString(err));
}

// kernel<<<grid, threads, smem, stream>>>(args...), as a programmatic dependent (PDL) of the kernel before it on the
// stream if pdl (the kernel then waits with griddepcontrol.wait before it reads what that kernel wrote).
template <typename... Params, typename... Args>
xffi::Error LaunchKernel(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t stream, bool pdl,
                         const char* op, const char* what, Args... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = pdl ? 1 : 0;
  return CudaStatus(cudaLaunchKernelEx(&config, kernel, args...), op, what);
}
#endif

// mla_verify: q [B, N, H, R], q_pe [B, N, H, dr], latent [B, S, R], pe [B, S, dr], cache_lens [B],
// tree_mask [B, N, N], S >= N.
struct MlaShape {
  int64_t b, n, h, r, dr, s;
};

inline xffi::Error CheckMlaShape(Dims qd, Dims pd, Dims ld, Dims ed, size_t cache_lens, size_t tree_mask,
                                 MlaShape* shape) {
  if (qd.size() != 4 || pd.size() != 4 || ld.size() != 3 || ed.size() != 3) {
    return xffi::Error::InvalidArgument(
        "mla_verify: expected q [B,N,H,R], q_pe [B,N,H,dr], latent [B,S,R], pe [B,S,dr]");
  }
  const MlaShape d{qd[0], qd[1], qd[2], qd[3], pd[3], ld[1]};
  if (pd[0] != d.b || pd[1] != d.n || pd[2] != d.h || ld[0] != d.b || ld[2] != d.r || ed[0] != d.b ||
      ed[1] != d.s || ed[2] != d.dr || cache_lens != static_cast<size_t>(d.b) ||
      tree_mask != static_cast<size_t>(d.b * d.n * d.n) || d.s < d.n) {
    return xffi::Error::InvalidArgument("mla_verify: inconsistent shapes q " + ShapeString(qd) + " q_pe " +
                                        ShapeString(pd) + " latent " + ShapeString(ld) + " pe " + ShapeString(ed));
  }
  *shape = d;
  return xffi::Error::Success();
}

// marlin_moe: x [M, D], ids and weights [M, k], gate and up packed [E, F, D/8] with scales [E, F, gate_scales],
// down packed [E, D, F/8] with scales [E, D, down_scales]; each scale count divides its row (or the rows are empty).
struct MoeShape {
  int64_t m, d, k, e, f, gate_scales, down_scales;
};

// Arguments: the dimensions of x, ids, weights, gate packed / scales, up packed / scales, down packed / scales.
inline xffi::Error CheckMoeShape(Dims xd, Dims id, Dims wd, Dims gq, Dims gs, Dims uq, Dims us, Dims dq, Dims ds,
                                 MoeShape* shape) {
  if (xd.size() != 2 || id.size() != 2 || wd.size() != 2 || gq.size() != 3 || gs.size() != 3 || uq.size() != 3 ||
      us.size() != 3 || dq.size() != 3 || ds.size() != 3) {
    return xffi::Error::InvalidArgument("marlin_moe: expected x [M, D], ids and weights [M, k], packed experts "
                                        "[E, out, in/8] and scales [E, out, in/group]");
  }
  const MoeShape d{xd[0], xd[1], id[1], gq[0], gq[1], gs[2], ds[2]};
  const auto divides = [](int64_t scales, int64_t row, int64_t other) {
    return scales > 0 ? row % scales == 0 : row * other == 0;
  };
  if (id[0] != d.m || wd[0] != d.m || wd[1] != d.k || gq[2] * 8 != d.d || gs[0] != d.e || gs[1] != d.f ||
      uq[0] != d.e || uq[1] != d.f || uq[2] != gq[2] || us[0] != d.e || us[1] != d.f || us[2] != gs[2] ||
      dq[0] != d.e || dq[1] != d.d || dq[2] * 8 != d.f || ds[0] != d.e || ds[1] != d.d ||
      !divides(d.gate_scales, d.d, d.f) || !divides(d.down_scales, d.f, d.d)) {
    return xffi::Error::InvalidArgument("marlin_moe: inconsistent shapes x " + ShapeString(xd) + " ids " +
                                        ShapeString(id) + " gate " + ShapeString(gq) + "/" + ShapeString(gs) +
                                        " up " + ShapeString(uq) + "/" + ShapeString(us) + " down " +
                                        ShapeString(dq) + "/" + ShapeString(ds));
  }
  *shape = d;
  return xffi::Error::Success();
}

// moe_route: logits [M, E], bias [E] -> ids and weights [M, k]; E divisible by n_group, 1 <= topk_group <= n_group,
// k <= the experts of the kept groups, each group at least 2 experts when there are several.
struct RouteShape {
  int64_t m, e, k;
};

inline xffi::Error CheckRouteShape(Dims ld, Dims bd, Dims id, Dims wd, int64_t n_group, int64_t topk_group,
                                   RouteShape* shape) {
  if (ld.size() != 2 || bd.size() != 1 || id.size() != 2 || wd.size() != 2) {
    return xffi::Error::InvalidArgument("moe_route: expected logits [M, E], bias [E], ids and weights [M, k]");
  }
  const RouteShape d{ld[0], ld[1], id[1]};
  if (bd[0] != d.e || id[0] != d.m || wd[0] != d.m || wd[1] != d.k) {
    return xffi::Error::InvalidArgument("moe_route: inconsistent shapes logits " + ShapeString(ld) + " bias " +
                                        ShapeString(bd) + " ids " + ShapeString(id) + " weights " +
                                        ShapeString(wd));
  }
  if (n_group < 1 || d.e % n_group != 0 || topk_group < 1 || topk_group > n_group ||
      (n_group > 1 && d.e / n_group < 2) || d.k < 1 || d.k > d.e / n_group * topk_group) {
    return xffi::Error::InvalidArgument("moe_route: E = " + std::to_string(d.e) + ", k = " + std::to_string(d.k) +
                                        ", n_group = " + std::to_string(n_group) + ", topk_group = " +
                                        std::to_string(topk_group) + " do not describe a routing");
  }
  *shape = d;
  return xffi::Error::Success();
}

// fused_dot: x [M, K]; w0 [K, N0], w1 [K, N1] (N1 = 0: no second weight); nw [K] or empty; add0, add1 [M, N0] or
// empty (segment 0 plain bf16 only; add1 only with add0) -> y0 [M, N0] (gated: [M, N0 / 2]), y1 likewise, xn [M, K]
// or empty. Every operand bf16 except a plain y (bf16 or f32). A weight may also be a stack [L, K, N] and nw [L, K]
// (a drafter's layers in one array): `layer` then picks the one used, read in place at an element offset (off0,
// off1, offn), where a slice passed to a custom call would be a copy.
struct FusedDotShape {
  int64_t m, k, n0, n1;
  bool has_norm, want_xn;
  int adds;
  int64_t off0, off1, offn;
};

inline xffi::Error CheckFusedDot(const xffi::AnyBuffer& x, const xffi::AnyBuffer& w0, const xffi::AnyBuffer& w1,
                                 const xffi::AnyBuffer& nw, const xffi::AnyBuffer& add0, const xffi::AnyBuffer& add1,
                                 int64_t gated0, int64_t gated1, int64_t layer, const xffi::AnyBuffer& y0,
                                 const xffi::AnyBuffer& y1, const xffi::AnyBuffer& xn, FusedDotShape* shape) {
  const auto bad = [](const std::string& what) { return xffi::Error::InvalidArgument("fused_dot: " + what); };
  const Dims xd = x.dimensions(), w0d = w0.dimensions(), w1d = w1.dimensions(), nd = nw.dimensions();
  // a weight [K, N] or a stack [L, K, N] of which `layer` is used: its K and N, and the slice's element offset
  int64_t k0 = -1, n0 = 0, off0 = 0, k1 = -1, n1 = 0, off1 = 0;
  const auto pick = [layer](Dims wd, int64_t* kk, int64_t* nn, int64_t* off) {
    if (wd.size() == 2) {
      *kk = wd[0], *nn = wd[1], *off = 0;
    } else if (wd.size() == 3 && layer >= 0 && layer < wd[0]) {
      *kk = wd[1], *nn = wd[2], *off = layer * wd[1] * wd[2];
    }
  };
  pick(w0d, &k0, &n0, &off0);
  pick(w1d, &k1, &n1, &off1);
  if (xd.size() != 2 || k0 != xd[1] || k1 != xd[1]) {
    return bad("expected x [M, K], w0 [K, N0] and w1 [K, N1] (or stacks [L, K, N] with 0 <= layer < L), got x " +
               ShapeString(xd) + ", w0 " + ShapeString(w0d) + ", w1 " + ShapeString(w1d) + ", layer " +
               std::to_string(layer));
  }
  const xffi::DataType bf = xffi::DataType::BF16;
  for (const xffi::AnyBuffer* b : {&x, &w0, &w1, &nw, &add0, &add1, &xn}) {
    if (b->element_type() != bf) return bad("x, the weights, the norm weight, the addends and xn must be bfloat16");
  }
  const int64_t nws = static_cast<int64_t>(nw.element_count()), xns = static_cast<int64_t>(xn.element_count());
  FusedDotShape d{xd[0], xd[1], n0, n1, nws > 0, xns > 0, 0, off0, off1, 0};
  if (d.has_norm) {
    const bool one = nd.size() == 1 && nd[0] == d.k;
    const bool stacked = nd.size() == 2 && nd[1] == d.k && layer >= 0 && layer < nd[0];
    if (!one && !stacked) return bad("nw must be [K], a stack [L, K] with 0 <= layer < L, or empty, got " +
                                     ShapeString(nd));
    d.offn = stacked ? layer * d.k : 0;
  }
  const int64_t a0 = static_cast<int64_t>(add0.element_count()), a1 = static_cast<int64_t>(add1.element_count());
  const int64_t out0 = gated0 ? d.n0 / 2 : d.n0, out1 = gated1 ? d.n1 / 2 : d.n1;
  if ((a0 && a0 != d.m * out0) || (a1 && a1 != d.m * out0) || (a1 && !a0)) {
    return bad("the addends must be [M, N0] (add1 only with add0), got " + ShapeString(add0.dimensions()) + " and " +
               ShapeString(add1.dimensions()));
  }
  d.adds = (a0 ? 1 : 0) + (a1 ? 1 : 0);
  if ((gated0 && d.n0 % 2) || (gated1 && d.n1 % 2)) return bad("a gated weight needs an even number of columns");
  const Dims y0d = y0.dimensions(), y1d = y1.dimensions();
  if (y0d.size() != 2 || y1d.size() != 2 || y0d[0] != d.m || y0d[1] != out0 || y1d[0] != d.m || y1d[1] != out1) {
    return bad("expected y0 [M, " + std::to_string(out0) + "] and y1 [M, " + std::to_string(out1) + "], got " +
               ShapeString(y0d) + " and " + ShapeString(y1d));
  }
  for (int s = 0; s < 2; ++s) {
    const xffi::DataType t = (s ? y1 : y0).element_type();
    const bool gated = s ? gated1 : gated0;
    if (t != bf && (t != xffi::DataType::F32 || gated || (s == 0 && d.adds))) {
      return bad("a gated output or one with addends must be bfloat16; a plain one bfloat16 or float32");
    }
  }
  if (d.want_xn && xns != d.m * d.k) return bad("xn must be [M, K] or empty");
  *shape = d;
  return xffi::Error::Success();
}

// draft_attention: q [B, T, H, D], ck and cv [B, S, G, D], kb and vb [B, T, G, D] with G dividing H, lengths [B],
// out as q; one dtype for all five inputs and out (which one is the handler's to check).
struct DraftShape {
  int64_t b, t, h, g, s, d;
};

inline xffi::Error CheckDraftShape(const xffi::AnyBuffer& q, const xffi::AnyBuffer& ck, const xffi::AnyBuffer& cv,
                                   const xffi::AnyBuffer& kb, const xffi::AnyBuffer& vb, size_t lengths,
                                   const xffi::AnyBuffer& out, DraftShape* shape) {
  const Dims qd = q.dimensions(), cd = ck.dimensions(), bd = kb.dimensions();
  const bool four = qd.size() == 4 && cd.size() == 4 && bd.size() == 4 && cv.dimensions().size() == 4 &&
                    vb.dimensions().size() == 4 && out.dimensions().size() == 4;
  bool same = four;
  for (int i = 0; same && i < 4; ++i) {
    same = cv.dimensions()[i] == cd[i] && vb.dimensions()[i] == bd[i] && out.dimensions()[i] == qd[i];
  }
  if (!same || cd[0] != qd[0] || bd[0] != qd[0] || bd[1] != qd[1] || bd[2] != cd[2] || cd[3] != qd[3] ||
      bd[3] != qd[3] || cd[2] < 1 || qd[2] % cd[2] != 0 || lengths != static_cast<size_t>(qd[0])) {
    return xffi::Error::InvalidArgument(
        "draft_attention: expected q [B, T, H, D], ck/cv [B, S, G, D], kb/vb [B, T, G, D] with G dividing H, "
        "lengths [B], out as q; got q " + (four ? ShapeString(qd) + " ck " + ShapeString(cd) + " kb " +
        ShapeString(bd) : std::string("(not all 4-D)")));
  }
  const xffi::DataType t = q.element_type();
  if (ck.element_type() != t || cv.element_type() != t || kb.element_type() != t || vb.element_type() != t ||
      out.element_type() != t) {
    return xffi::Error::InvalidArgument("draft_attention: q, ck, cv, kb, vb and out must share one dtype");
  }
  *shape = DraftShape{qd[0], qd[1], qd[2], cd[2], cd[1], qd[3]};
  return xffi::Error::Success();
}

}  // namespace kdtree
