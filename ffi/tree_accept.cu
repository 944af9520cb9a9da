// DDTree acceptance walk on CUDA, one block per batch row; same result as tree_accept.cc. The block marks, for every
// node, its lowest-index child whose token equals the target's token at the node (atomicMin in shared memory);
// then one thread follows those marks from the root. No workspace, no host sync (kCmdBufferCompatible).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using I32Mat = ffi::Buffer<ffi::S32, 2>;
using I32Vec = ffi::Buffer<ffi::S32, 1>;

namespace kdtree {
namespace {

constexpr int kAcceptThreads = 256;
constexpr int64_t kMaxAcceptSmem = 200 * 1024;

__global__ void __launch_bounds__(kAcceptThreads) AcceptKernel(int n, const int32_t* __restrict__ tokens,
                                                               const int32_t* __restrict__ parents,
                                                               const int32_t* __restrict__ target, int32_t* path,
                                                               int32_t* length, int32_t* bonus) {
  extern __shared__ int child[];  // [n] lowest matching child of each node, INT_MAX if none
  __shared__ int s_len;
  const int64_t off = static_cast<int64_t>(blockIdx.x) * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) child[i] = INT_MAX;
  __syncthreads();
  for (int c = 1 + threadIdx.x; c < n; c += blockDim.x) {
    const int p = parents[off + c];
    if (p >= 0 && p < n && tokens[off + c] == target[off + p]) atomicMin(&child[p], c);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int cur = 0, len = 1;
    path[off] = 0;
    while (len < n && child[cur] != INT_MAX) {
      cur = child[cur];
      path[off + len++] = cur;
    }
    length[blockIdx.x] = len;
    bonus[blockIdx.x] = target[off + cur];
    s_len = len;
  }
  __syncthreads();
  for (int i = s_len + threadIdx.x; i < n; i += blockDim.x) path[off + i] = -1;
}

ffi::Error TreeAcceptCuda(cudaStream_t stream, I32Mat tokens, I32Mat parents, I32Mat target,
                          ffi::Result<I32Mat> path, ffi::Result<I32Vec> length, ffi::Result<I32Vec> bonus) {
  const int64_t b = tokens.dimensions()[0], n = tokens.dimensions()[1];
  if (n < 1 || parents.dimensions()[0] != b || parents.dimensions()[1] != n || target.dimensions()[0] != b ||
      target.dimensions()[1] != n || path->dimensions()[0] != b || path->dimensions()[1] != n ||
      length->dimensions()[0] != b || bonus->dimensions()[0] != b) {
    return ffi::Error::InvalidArgument("tree_accept: shapes must be [B, N] (N >= 1) in, [B, N], [B], [B] out");
  }
  const int64_t smem = 4 * n;
  if (smem > kMaxAcceptSmem || b > 2147483647) {
    return ffi::Error::InvalidArgument("tree_accept: the CUDA kernel supports N <= 51200 (got " +
                                       std::to_string(n) + ")");
  }
  if (b == 0) return ffi::Error::Success();
  cudaError_t e = cudaFuncSetAttribute(AcceptKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e == cudaSuccess) {
    AcceptKernel<<<static_cast<unsigned>(b), kAcceptThreads, smem, stream>>>(
        static_cast<int>(n), tokens.typed_data(), parents.typed_data(), target.typed_data(), path->typed_data(),
        length->typed_data(), bonus->typed_data());
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("tree_accept (CUDA): ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdTreeAcceptCuda, kdtree::TreeAcceptCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<I32Mat>()      // node_tokens [B, N]
                                  .Arg<I32Mat>()      // parents [B, N], parents[:, 0] = -1
                                  .Arg<I32Mat>()      // target_tokens [B, N]
                                  .Ret<I32Mat>()      // path [B, N], padded with -1
                                  .Ret<I32Vec>()      // length [B]
                                  .Ret<I32Vec>(),     // bonus [B]
                              {xla::ffi::Traits::kCmdBufferCompatible});
