// Rows of several caches moved within each batch row, on CUDA; the same result as move_rows.cc (see there). One
// launch for every cache: block (c, b) stages row b's P source rows of cache c in shared memory, then writes them
// at their destination slots, so a source that is also a destination is read before it is overwritten. Up to
// kMaxCaches caches a launch (their pointers travel in the kernel's parameters); more take more launches. No
// workspace, no host sync (kCmdBufferCompatible).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using I32Mat = ffi::Buffer<ffi::S32, 2>;
using I32Vec = ffi::Buffer<ffi::S32, 1>;

namespace kdtree {
namespace {

constexpr int kMoveThreads = 256;
constexpr int kMaxCaches = 128;              // 128 x (8 + 4) bytes of pointers and widths: within 4 KB of parameters
constexpr int64_t kMaxMoveSmem = 200 * 1024;

struct MoveTargets {
  char* data[kMaxCaches];
  int32_t row_bytes[kMaxCaches];  // a multiple of sizeof(Word)
};

// Word: the unit copied (uint4 where every row is a multiple of 16 bytes, else one byte).
template <typename Word>
__global__ void __launch_bounds__(kMoveThreads) MoveRowsKernel(MoveTargets t, const int32_t* __restrict__ starts,
                                                               const int32_t* __restrict__ path, int p, int n_nodes,
                                                               int64_t s) {
  extern __shared__ uint4 smem[];
  Word* stage = reinterpret_cast<Word*>(smem);
  const int c = blockIdx.x, b = blockIdx.y;
  const int words = t.row_bytes[c] / static_cast<int>(sizeof(Word));
  Word* base = reinterpret_cast<Word*>(t.data[c] + static_cast<int64_t>(b) * s * t.row_bytes[c]);
  const int64_t st = starts[b];
  for (int i = threadIdx.x; i < p * words; i += blockDim.x) {
    const int j = i / words;
    const int64_t node = min(max(path[static_cast<int64_t>(b) * p + j], 0), n_nodes - 1);
    const int64_t src = min(max(st + node, int64_t{0}), s - 1);
    stage[i] = base[src * words + i % words];
  }
  __syncthreads();
  const int64_t dst = min(max(st, int64_t{0}), s - p);
  for (int i = threadIdx.x; i < p * words; i += blockDim.x) base[dst * words + i] = stage[i];
}

template <typename Word>
cudaError_t Launch(cudaStream_t stream, const MoveTargets& t, int caches, int64_t b, const int32_t* starts,
                   const int32_t* path, int64_t p, int64_t n_nodes, int64_t s, int64_t smem) {
  cudaError_t e = cudaFuncSetAttribute(MoveRowsKernel<Word>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  MoveRowsKernel<Word><<<dim3(static_cast<unsigned>(caches), static_cast<unsigned>(b)), kMoveThreads, smem, stream>>>(
      t, starts, path, static_cast<int>(p), static_cast<int>(n_nodes), s);
  return cudaGetLastError();
}

ffi::Error MoveRowsCuda(cudaStream_t stream, I32Vec starts, I32Mat path, ffi::RemainingArgs caches,
                        ffi::RemainingRets outs, int64_t n_nodes) {
  const int64_t b = path.dimensions()[0], p = path.dimensions()[1];
  if (starts.dimensions()[0] != b || n_nodes < 1 || n_nodes > 2147483647 || caches.size() != outs.size()) {
    return ffi::Error::InvalidArgument("move_rows: starts [B], path [B, P], n_nodes >= 1, one result per cache");
  }
  if (b == 0 || p == 0 || caches.size() == 0) return ffi::Error::Success();
  if (b > 65535) return ffi::Error::InvalidArgument("move_rows: the CUDA kernel takes B <= 65535");
  MoveTargets t{};
  int64_t s = -1, widest = 0;
  bool wide = true;  // every row a multiple of 16 bytes: copy in uint4 words
  size_t n = 0;
  cudaError_t e = cudaSuccess;
  for (size_t c = 0; c < caches.size(); ++c) {
    auto in = caches.get<ffi::AnyBuffer>(c);
    auto out = outs.get<ffi::AnyBuffer>(c);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("move_rows: a cache is not a buffer");
    const auto dims = in->dimensions();
    if (dims.size() != 3 || dims[0] != b || dims[1] < p || (s >= 0 && dims[1] != s) ||
        (*out)->dimensions().size() != 3 || (*out)->size_bytes() != in->size_bytes() ||
        (*out)->element_type() != in->element_type()) {
      return ffi::Error::InvalidArgument("move_rows: cache " + std::to_string(c) +
                                         " must be [B, S, C] with S >= P (one S for all), its result the same");
    }
    s = dims[1];
    const int64_t row = static_cast<int64_t>(in->size_bytes()) / (b * s);
    char* data = static_cast<char*>((*out)->untyped_data());
    if (data != in->untyped_data() && in->size_bytes() > 0) {  // not aliased: move within a copy
      e = cudaMemcpyAsync(data, in->untyped_data(), in->size_bytes(), cudaMemcpyDeviceToDevice, stream);
      if (e != cudaSuccess) break;
    }
    t.data[n] = data;
    t.row_bytes[n] = static_cast<int32_t>(row);
    widest = std::max(widest, row);
    wide = wide && row % 16 == 0 && reinterpret_cast<uintptr_t>(data) % 16 == 0;
    ++n;
    if (n == kMaxCaches || c + 1 == caches.size()) {  // launch this group
      const int64_t smem = p * widest;
      if (smem > kMaxMoveSmem) {
        return ffi::Error::InvalidArgument("move_rows: P x the widest row must be <= 200 KB (got " +
                                           std::to_string(smem) + " bytes)");
      }
      e = wide ? Launch<uint4>(stream, t, static_cast<int>(n), b, starts.typed_data(), path.typed_data(), p,
                               n_nodes, s, smem)
               : Launch<uint8_t>(stream, t, static_cast<int>(n), b, starts.typed_data(), path.typed_data(), p,
                                 n_nodes, s, smem);
      if (e != cudaSuccess) break;
      n = 0;
      widest = 0;
      wide = true;
    }
  }
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("move_rows (CUDA): ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdMoveRowsCuda, kdtree::MoveRowsCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<I32Vec>()            // starts [B]
                                  .Arg<I32Mat>()            // path [B, P], node indices (clamped to 0 .. n_nodes - 1)
                                  .RemainingArgs()          // caches [B, S, C_i], aliased to the results
                                  .RemainingRets()          // the same caches, rows moved
                                  .Attr<int64_t>("n_nodes"),  // the tree's nodes (root included)
                              {xla::ffi::Traits::kCmdBufferCompatible});
