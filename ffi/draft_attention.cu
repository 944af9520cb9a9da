// draft_attention, CUDA handler: the DFlash drafter's block attention (grouped-query heads), the function of the
// CPU handler (ffi/draft_attention.cc has the math): every query row of a kv head sees the context (slots below
// lengths[b]) and the whole block; scores, softmax and sums are fp32.
//
// Flash decoding on the CUDA cores (a first version: no tensor cores, no pipelining).
//   * The M = T * (H / G) query rows of one kv head of one batch row form tiles of 64 rows; block (split, head and
//     row tile, b) takes its share of the P + T keys (context then block) in tiles of 32 keys, one key a lane:
//     each warp scores its 8 rows against the tile (q broadcast from shared memory, the key from the lane's own
//     shared-memory row), updates the rows' running max and sum (online softmax) and adds p * V, each lane holding
//     4 of the head's dims for every row. Two blocks an SM (128 registers, a few bytes spilled); a split with no
//     keys (the splits are planned for the cache's length) only marks its rows empty.
//   * With one split the block writes the normalized rows; with several each block writes its unnormalized partial
//     rows and their (max, sum), and a second kernel combines them in a fixed order (deterministic, no atomics).
//     The split count is the extent of the partials output's third axis (the Python wrapper plans it).
// Any head dim up to 128, float32 or bfloat16.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "handler_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 8;
constexpr int kRows = kWarps * kRowsPerWarp;  // query rows a block
constexpr int kKeys = 32;                      // keys a tile: one a lane
constexpr int kMaxDim = 128;                   // 4 dims a lane
constexpr int kThreads = kWarps * 32;
constexpr int kCombineThreads = 128;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float Load(const float* p) { return *p; }
__device__ __forceinline__ float Load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void Store(float* p, float x) { *p = x; }
__device__ __forceinline__ void Store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

struct Params {
  const void* q;    // [B, T, H, D]
  const void* ck;   // [B, S, G, D]
  const void* cv;   // [B, S, G, D]
  const void* kb;   // [B, T, G, D]
  const void* vb;   // [B, T, G, D]
  const int32_t* lens;  // [B]
  void* out;        // [B, T, H, D]
  float* part;      // [B, G * M, splits, D]  unnormalized partial rows (splits > 1)
  float2* stats;    // [B, G * M, splits]     their (row max, row sum)
  int t, h, g, s, d, m, splits;
  float scale;
};

__device__ __forceinline__ float WarpMax(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// The output row of query row m of kv head g, batch row b.
__device__ __forceinline__ int64_t OutRow(const Params& p, int b, int g, int m) {
  const int rep = p.h / p.g;
  return (static_cast<int64_t>(b) * p.t + m / rep) * p.h + g * rep + m % rep;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) AttendKernel(Params p) {
  extern __shared__ float smem[];
  const int d = p.d, stride = d | 1;  // the key tile's row stride: odd, so the lanes' rows fall in distinct banks
  float* qs = smem;                   // [kRows][d]
  float* ks = qs + kRows * d;         // [kKeys][d | 1]
  float* vs = ks + kKeys * stride;    // [kKeys][d]
  const int tiles = (p.m + kRows - 1) / kRows;
  const int split = blockIdx.x, g = blockIdx.y / tiles, row0 = (blockIdx.y % tiles) * kRows, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q = static_cast<const T*>(p.q);
  const T* ck = static_cast<const T*>(p.ck);
  const T* cv = static_cast<const T*>(p.cv);
  const T* kb = static_cast<const T*>(p.kb);
  const T* vb = static_cast<const T*>(p.vb);
  const int prefix = min(max(p.lens[b], 0), p.s);
  const int nkeys = prefix + p.t;
  const int chunk = ((nkeys + p.splits - 1) / p.splits + kKeys - 1) / kKeys * kKeys;  // whole tiles
  const int k0 = split * chunk, k1 = min(nkeys, k0 + chunk);
  if (k0 >= k1) {  // no keys here (the splits are planned for the cache's S, the row may be shorter): marked empty
    for (int i = threadIdx.x; i < kRows; i += kThreads) {
      const int m = row0 + i;
      const int64_t row = (static_cast<int64_t>(b) * p.g + g) * p.m + m;
      if (m < p.m) p.stats[row * p.splits + split] = make_float2(-INFINITY, 0.0f);
    }
    return;  // the whole block: k0 and k1 are the block's
  }

  for (int e = threadIdx.x; e < kRows * d; e += kThreads) {
    const int i = e / d, c = e % d, m = row0 + i;
    qs[e] = m < p.m ? Load(q + OutRow(p, b, g, m) * d + c) : 0.0f;
  }
  float o[kRowsPerWarp][4], peak[kRowsPerWarp], total[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    peak[i] = -INFINITY;
    total[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) o[i][c] = 0.0f;
  }
  const float* qw = qs + warp * kRowsPerWarp * d;
  for (int kt = k0; kt < k1; kt += kKeys) {
    __syncthreads();  // the last tile's reads are done (and the queries are in place)
    for (int e = threadIdx.x; e < kKeys * d; e += kThreads) {
      const int j = e / d, c = e % d, k = kt + j;
      float kv = 0.0f, vv = 0.0f;
      if (k < k1) {
        const bool ctx = k < prefix;
        const int64_t at = (ctx ? (static_cast<int64_t>(b) * p.s + k) : (static_cast<int64_t>(b) * p.t + k - prefix)) *
                               p.g * d + static_cast<int64_t>(g) * d + c;
        kv = Load((ctx ? ck : kb) + at);
        vv = Load((ctx ? cv : vb) + at);
      }
      ks[j * stride + c] = kv;
      vs[j * d + c] = vv;
    }
    __syncthreads();
    const bool valid = kt + lane < k1;  // lane 0's key always is
    float sc[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) sc[i] = 0.0f;
    const float* kr = ks + lane * stride;
    if (d % 4 == 0) {  // the queries four dims at a time (rows of 16-byte multiples)
      for (int c = 0; c < d; c += 4) {
        const float k0c = kr[c], k1c = kr[c + 1], k2c = kr[c + 2], k3c = kr[c + 3];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const float4 qv = *reinterpret_cast<const float4*>(qw + i * d + c);
          sc[i] = fmaf(qv.w, k3c, fmaf(qv.z, k2c, fmaf(qv.y, k1c, fmaf(qv.x, k0c, sc[i]))));
        }
      }
    } else {
      for (int c = 0; c < d; ++c) {
        const float kc = kr[c];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) sc[i] = fmaf(qw[i * d + c], kc, sc[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const float s = valid ? sc[i] * p.scale : -INFINITY;
      const float top = fmaxf(peak[i], WarpMax(s));  // finite: lane 0's key is valid
      const float alpha = expf(peak[i] - top);       // 0 on the first tile (peak -inf)
      const float pr = valid ? expf(s - top) : 0.0f;
      total[i] = total[i] * alpha + WarpSum(pr);
      peak[i] = top;
#pragma unroll
      for (int c = 0; c < 4; ++c) o[i][c] *= alpha;
      sc[i] = pr;
    }
    const int last = min(kKeys, k1 - kt);
    for (int j = 0; j < last; ++j) {
      float vj[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) vj[c] = lane + 32 * c < d ? vs[j * d + lane + 32 * c] : 0.0f;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const float pj = __shfl_sync(kFull, sc[i], j);
#pragma unroll
        for (int c = 0; c < 4; ++c) o[i][c] = fmaf(pj, vj[c], o[i][c]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int m = row0 + warp * kRowsPerWarp + i;
    if (m >= p.m) continue;
    if (p.splits == 1) {
      const float inv = total[i] == 0.0f ? 0.0f : 1.0f / total[i];  // NaN stays NaN
      T* orow = static_cast<T*>(p.out) + OutRow(p, b, g, m) * d;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (lane + 32 * c < d) Store(orow + lane + 32 * c, o[i][c] * inv);
      }
    } else {
      const int64_t row = (static_cast<int64_t>(b) * p.g + g) * p.m + m;
      float* prow = p.part + (row * p.splits + split) * d;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (lane + 32 * c < d) prow[lane + 32 * c] = o[i][c];
      }
      if (lane == 0) p.stats[row * p.splits + split] = make_float2(peak[i], total[i]);
    }
  }
}

// One block a query row: the splits' partial rows weighted by exp(their max - the largest), in split order.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) CombineKernel(Params p) {
  const int64_t row = blockIdx.x;  // (b * G + g) * M + m
  const int m = static_cast<int>(row % p.m), g = static_cast<int>((row / p.m) % p.g);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.m) * p.g));
  const float2* st = p.stats + row * p.splits;
  // a split is empty when it says (-inf, 0); any other, NaN included, counts (so a NaN score reaches the output)
  const auto empty = [](float2 x) { return x.x == -INFINITY && x.y == 0.0f; };
  float top = -INFINITY;
  for (int j = 0; j < p.splits; ++j) top = fmaxf(top, st[j].x);
  float total = 0.0f;
  for (int j = 0; j < p.splits; ++j) total += empty(st[j]) ? 0.0f : st[j].y * expf(st[j].x - top);
  const float inv = total == 0.0f ? 0.0f : 1.0f / total;  // NaN stays NaN
  T* orow = static_cast<T*>(p.out) + OutRow(p, b, g, m) * p.d;
  for (int c = threadIdx.x; c < p.d; c += kCombineThreads) {
    float acc = 0.0f;
    for (int j = 0; j < p.splits; ++j) {
      if (!empty(st[j])) acc = fmaf(p.part[(row * p.splits + j) * p.d + c], expf(st[j].x - top), acc);
    }
    Store(orow + c, acc * inv);
  }
}

template <typename T>
cudaError_t Launch(cudaStream_t stream, const Params& p, int b) {
  const int tiles = (p.m + kRows - 1) / kRows;
  const size_t smem = sizeof(float) * (kRows * p.d + kKeys * (p.d | 1) + kKeys * p.d);
  cudaError_t e = cudaFuncSetAttribute(AttendKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  AttendKernel<T><<<dim3(p.splits, p.g * tiles, b), kThreads, smem, stream>>>(p);
  if (p.splits > 1) {
    const int64_t rows = static_cast<int64_t>(b) * p.g * p.m;
    CombineKernel<T><<<static_cast<unsigned>(rows), kCombineThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

ffi::Error DraftAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer ck, ffi::AnyBuffer cv,
                              ffi::AnyBuffer kb, ffi::AnyBuffer vb, ffi::Buffer<ffi::S32> lengths, float scale,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> part,
                              ffi::Result<ffi::Buffer<ffi::F32>> stats) {
  kdtree::DraftShape n;
  if (ffi::Error e = kdtree::CheckDraftShape(q, ck, cv, kb, vb, lengths.element_count(), *out, &n); e.failure()) {
    return e;
  }
  const int64_t b = n.b, t = n.t, h = n.h, d = n.d, s = n.s, g = n.g;
  const auto pd = part->dimensions();
  if (pd.size() != 4 || stats->dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("draft_attention: part and stats must be 4-D");
  }
  const int64_t m = t * (h / g), splits = pd[2];
  if (pd[0] != b || pd[1] != g * m || pd[3] != d || splits < 1 || stats->dimensions()[0] != b ||
      stats->dimensions()[1] != g * m || stats->dimensions()[2] != splits || stats->dimensions()[3] != 2) {
    return ffi::Error::InvalidArgument("draft_attention: part must be [B, G * M, splits, D] and stats "
                                       "[B, G * M, splits, 2], M = T * H / G");
  }
  const int64_t tiles = (m + kRows - 1) / kRows;
  if (b == 0 || t == 0 || h == 0 || d == 0) return ffi::Error::Success();  // nothing to write
  if (d > kMaxDim || b > 65535 || g * tiles > 65535 || splits > 65535 || s + t > 2147483647 ||
      b * g * m > 2147483647) {
    return ffi::Error::InvalidArgument("draft_attention: the CUDA kernel takes a head dim of 1..128, B and "
                                       "G x ceil(M / 64) <= 65535");
  }
  const ffi::DataType dt = q.element_type();
  Params p{q.untyped_data(), ck.untyped_data(), cv.untyped_data(), kb.untyped_data(), vb.untyped_data(),
           lengths.typed_data(), out->untyped_data(), part->typed_data(),
           reinterpret_cast<float2*>(stats->typed_data()), static_cast<int>(t), static_cast<int>(h),
           static_cast<int>(g), static_cast<int>(s), static_cast<int>(d), static_cast<int>(m),
           static_cast<int>(splits), scale};
  cudaError_t e;
  if (dt == ffi::DataType::F32) {
    e = Launch<float>(stream, p, static_cast<int>(b));
  } else if (dt == ffi::DataType::BF16) {
    e = Launch<__nv_bfloat16>(stream, p, static_cast<int>(b));
  } else {
    return ffi::Error::InvalidArgument("draft_attention: dtype must be float32 or bfloat16");
  }
  return kdtree::CudaStatus(e, "draft_attention (CUDA)", "launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdDraftAttentionCuda, DraftAttentionCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()              // q [B, T, H, D]
                                  .Arg<ffi::AnyBuffer>()              // ck [B, S, G, D]
                                  .Arg<ffi::AnyBuffer>()              // cv [B, S, G, D]
                                  .Arg<ffi::AnyBuffer>()              // kb [B, T, G, D]
                                  .Arg<ffi::AnyBuffer>()              // vb [B, T, G, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()       // lengths [B]
                                  .Attr<float>("scale")               // softmax scale
                                  .Ret<ffi::AnyBuffer>()              // out [B, T, H, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()       // part [B, G * M, splits, D]
                                  .Ret<ffi::Buffer<ffi::F32>>(),      // stats [B, G * M, splits, 2]
                              {xla::ffi::Traits::kCmdBufferCompatible});
