// DDTree acceptance walk on the CPU. From the root, step to the lowest-index child whose token equals the target's
// token at the current node, while there is one. Out: the accepted node indices (root first, padded with -1), their
// count and the target's token at the last accepted node (the next bonus token). tree_accept.cu is the same walk.
#include <climits>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Typed buffers (aliases keep template commas out of the binding macro).
using I32Mat = ffi::Buffer<ffi::S32, 2>;
using I32Vec = ffi::Buffer<ffi::S32, 1>;

namespace kdtree {
namespace {

ffi::Error TreeAccept(I32Mat tokens, I32Mat parents,
                      I32Mat target, ffi::Result<I32Mat> path,
                      ffi::Result<I32Vec> length, ffi::Result<I32Vec> bonus) {
  const int64_t b = tokens.dimensions()[0], n = tokens.dimensions()[1];
  if (n < 1 || parents.dimensions()[0] != b || parents.dimensions()[1] != n || target.dimensions()[0] != b ||
      target.dimensions()[1] != n || path->dimensions()[0] != b || path->dimensions()[1] != n ||
      length->dimensions()[0] != b || bonus->dimensions()[0] != b) {
    return ffi::Error::InvalidArgument("tree_accept: shapes must be [B, N] (N >= 1) in, [B, N], [B], [B] out");
  }
  std::vector<int32_t> child(n);
  for (int64_t r = 0; r < b; ++r) {
    const int32_t* tok = tokens.typed_data() + r * n;
    const int32_t* par = parents.typed_data() + r * n;
    const int32_t* tgt = target.typed_data() + r * n;
    int32_t* out = path->typed_data() + r * n;
    std::fill(child.begin(), child.end(), INT_MAX);
    for (int64_t c = n - 1; c >= 1; --c) {
      const int32_t p = par[c];
      if (p >= 0 && p < n && tok[c] == tgt[p]) child[p] = static_cast<int32_t>(c);
    }
    int32_t cur = 0, len = 1;
    out[0] = 0;
    while (len < n && child[cur] != INT_MAX) {
      cur = child[cur];
      out[len++] = cur;
    }
    for (int64_t i = len; i < n; ++i) out[i] = -1;
    length->typed_data()[r] = len;
    bonus->typed_data()[r] = tgt[cur];
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdTreeAcceptCpu, kdtree::TreeAccept,
                              ffi::Ffi::Bind()
                                  .Arg<I32Mat>()      // node_tokens [B, N]
                                  .Arg<I32Mat>()      // parents [B, N], parents[:, 0] = -1
                                  .Arg<I32Mat>()      // target_tokens [B, N]
                                  .Ret<I32Mat>()      // path [B, N], padded with -1
                                  .Ret<I32Vec>()      // length [B]
                                  .Ret<I32Vec>());    // bonus [B]
