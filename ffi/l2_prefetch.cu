// l2_prefetch, CUDA: out = x (aliased: nothing to do; XLA gave the result its own buffer: copied), and every byte of
// the other operands asked into L2 by one short grid that issues the requests and ends. Nothing waits for them: the
// kernels after this one (the next projections, whose weights these are) find in L2 what has arrived by then.
// Placed before a kernel that moves few bytes (mla_verify at a decode step), the DRAM fetches overlap it.
// bulk_bytes = 0: one `prefetch.global.L2::evict_last` a 128-byte line; else one `cp.async.bulk.prefetch.L2` (the
// copy engine, sm_90) a chunk of that many bytes, a warp a block. Up to kMaxSpans arrays a launch; more take more
// launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace kdtree {
namespace {

constexpr int kMaxSpans = 16;
constexpr int kPrefetchThreads = 256;
constexpr int kMaxPrefetchBlocks = 1024;

struct Spans {
  const char* ptr[kMaxSpans];
  int64_t bytes[kMaxSpans];
  int64_t end[kMaxSpans];  // chunks of spans 0 .. k, cumulative
  int n;
};

__global__ void __launch_bounds__(kPrefetchThreads) PrefetchKernel(Spans s, int64_t chunks, int64_t chunk_bytes,
                                                                   bool bulk) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int k = 0;
    while (k + 1 < s.n && i >= s.end[k]) ++k;
    const int64_t offset = (i - (k ? s.end[k - 1] : 0)) * chunk_bytes;
    const char* at = s.ptr[k] + offset;
    if (bulk) {
      const int64_t left = s.bytes[k] - offset;
      const uint32_t size = static_cast<uint32_t>((left < chunk_bytes ? left : chunk_bytes) & ~int64_t{15});
      if (size > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"(size) : "memory");
    } else {
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(at));
    }
  }
}

ffi::Error L2PrefetchCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs weights,
                          ffi::Result<ffi::AnyBuffer> out, int64_t bulk_bytes) {
  if (out->size_bytes() != x.size_bytes() || out->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("l2_prefetch: the result must be x's shape and dtype");
  }
  if (bulk_bytes < 0 || bulk_bytes % 16 != 0) {
    return ffi::Error::InvalidArgument("l2_prefetch: bulk_bytes must be 0 or a positive multiple of 16");
  }
  cudaError_t e = cudaSuccess;
  if (out->untyped_data() != x.untyped_data() && x.size_bytes() > 0) {
    e = cudaMemcpyAsync(out->untyped_data(), x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  }
  const int64_t chunk = bulk_bytes > 0 ? bulk_bytes : 128;
  Spans s{};
  int64_t chunks = 0;
  for (size_t i = 0; i < weights.size() && e == cudaSuccess; ++i) {
    auto w = weights.get<ffi::AnyBuffer>(i);
    if (!w.has_value()) return ffi::Error::InvalidArgument("l2_prefetch: an operand after x is not a buffer");
    if (w->size_bytes() > 0) {
      s.ptr[s.n] = static_cast<const char*>(w->untyped_data());
      s.bytes[s.n] = static_cast<int64_t>(w->size_bytes());
      chunks += (s.bytes[s.n] + chunk - 1) / chunk;
      s.end[s.n++] = chunks;
    }
    if (s.n > 0 && (s.n == kMaxSpans || i + 1 == weights.size())) {  // launch this group
      // bulk chunks: a warp a block, so that the requests spread over the SMs' copy engines
      const int threads = bulk_bytes > 0 ? 32 : kPrefetchThreads;
      const int64_t blocks = std::min<int64_t>((chunks + threads - 1) / threads, kMaxPrefetchBlocks);
      PrefetchKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(s, chunks, chunk, bulk_bytes > 0);
      e = cudaGetLastError();
      s = Spans{};
      chunks = 0;
    }
  }
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("l2_prefetch (CUDA): ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdL2PrefetchCuda, kdtree::L2PrefetchCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // x, aliased to the result
                                  .RemainingArgs()                  // the arrays to ask into L2
                                  .Ret<ffi::AnyBuffer>()            // x
                                  .Attr<int64_t>("bulk_bytes"),     // 0: a prefetch a 128-byte line; else bulk chunks
                              {xla::ffi::Traits::kCmdBufferCompatible});
