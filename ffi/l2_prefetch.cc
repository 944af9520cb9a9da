// l2_prefetch, CPU: out = x. The other operands are the weights the CUDA handler asks into the GPU's L2 cache
// (l2_prefetch.cu); on the CPU there is nothing to ask, so they are only checked to be buffers. x is aliased to the
// result; where XLA gave the result its own buffer, x is copied into it.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace kdtree {
namespace {

ffi::Error L2PrefetchCpu(ffi::AnyBuffer x, ffi::RemainingArgs weights, ffi::Result<ffi::AnyBuffer> out,
                         int64_t bulk_bytes) {
  if (out->size_bytes() != x.size_bytes() || out->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("l2_prefetch: the result must be x's shape and dtype");
  }
  if (bulk_bytes < 0 || bulk_bytes % 16 != 0) {
    return ffi::Error::InvalidArgument("l2_prefetch: bulk_bytes must be 0 or a positive multiple of 16");
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!weights.get<ffi::AnyBuffer>(i).has_value()) {
      return ffi::Error::InvalidArgument("l2_prefetch: an operand after x is not a buffer");
    }
  }
  if (out->untyped_data() != x.untyped_data() && x.size_bytes() > 0) {
    std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdL2PrefetchCpu, kdtree::L2PrefetchCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // x, aliased to the result
                                  .RemainingArgs()                  // the arrays to ask into L2 (read by no one here)
                                  .Ret<ffi::AnyBuffer>()            // x
                                  .Attr<int64_t>("bulk_bytes"));    // 0: a prefetch a 128-byte line; else bulk chunks
