// DDTree tree build (Algorithm 1) on CUDA. Same definition and bit-identical output as tree_build.cc (common.h).
//
// Four kernels, all shapes from the buffers, scratch in the `workspace` output (every byte read is first written
// in the same call, so nothing needs clearing), no allocation or host sync (kCmdBufferCompatible):
//   1. StreamTopK  grid (chunks, B*L), 8 warps: one pass over the logits. Per 1024-logit tile (one warp, 32 logits
//      a lane in registers, the warp's next tile already loading) the tile max and the sum of Exp32AsDouble; each
//      logit that beats the block's running K-th best (logit desc, id asc) is appended to a shared-memory buffer,
//      which a radix select compacts back to K entries when it fills. Out: the chunk's K best tokens and the
//      per-tile (max, sum).
//   2. MergeTopK   one block per (b, d): the same filter over the chunks' candidates, then a bitonic sort of the
//      K best; and the row's lse from its tiles. Out: sorted TokenKeys [B, L, K] and llrint(lse 2^32) [B, L].
//   3. LevelsKernel one block per batch row: the level-by-level expansion of tree_levels.h, arena in shared memory
//      (global workspace for large budgets). Out: tokens, parents, depths and an ancestor table.
//   4. VisKernel   all SMs: the [B, N+1, N+1] ancestor mask from depths and the ancestor table, 16 bytes a thread.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "common.h"
#include "handler_checks.h"
#include "tree_levels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using I32Mat = ffi::Buffer<ffi::S32, 2>;
using BoolCube = ffi::Buffer<ffi::PRED, 3>;
using U8Vec = ffi::Buffer<ffi::U8, 1>;

namespace kdtree {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = kStreamThreads / 32;

struct GpuOps {
  static __device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ float Fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
};

// The thread-block execution context of tree_levels.h (see HostCtx there). Every member is called by all threads.
struct DevCtx {
  int tid, nt;
  int64_t* r64;  // shared [32]
  int* r32;      // shared [32]

  __device__ void sync() { __syncthreads(); }
  __device__ int lane() const { return tid & 31; }
  __device__ int warp() const { return tid >> 5; }
  __device__ int nwarps() const { return nt >> 5; }

  __device__ int SumI32(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    if (lane() == 0) r32[warp()] = v;
    __syncthreads();
    int t = 0;
    for (int w = 0; w < nwarps(); ++w) t += r32[w];
    __syncthreads();
    return t;
  }
  template <bool kMax>
  __device__ uint64_t ReduceU64(uint64_t v) {
    for (int o = 16; o > 0; o >>= 1) {
      const uint64_t u = __shfl_xor_sync(kFull, v, o);
      v = kMax ? (u > v ? u : v) : (u < v ? u : v);
    }
    if (lane() == 0) r64[warp()] = static_cast<int64_t>(v);
    __syncthreads();
    uint64_t t = static_cast<uint64_t>(r64[0]);
    for (int w = 1; w < nwarps(); ++w) {
      const uint64_t u = static_cast<uint64_t>(r64[w]);
      t = kMax ? (u > t ? u : t) : (u < t ? u : t);
    }
    __syncthreads();
    return t;
  }
  __device__ uint64_t MinU64(uint64_t v) { return ReduceU64<false>(v); }
  __device__ uint64_t MaxU64(uint64_t v) { return ReduceU64<true>(v); }
  __device__ float MaxF32(float v) {  // max of non-NaN floats, through the monotone OrdKey map
    return FromOrdKey(static_cast<uint32_t>(MaxU64(OrdKey(v + 0.0f))));
  }
  __device__ double SumF64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    if (lane() == 0) r64[warp()] = __double_as_longlong(v);
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < nwarps(); ++w) t += __longlong_as_double(r64[w]);
    __syncthreads();
    return t;
  }
  __device__ int ThreadExclusive(int v, int* total) {
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, x, o);
      if (lane() >= o) x += y;
    }
    if (lane() == 31) r32[warp()] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < nwarps(); ++w) {
      const int s = r32[w];
      before += w < warp() ? s : 0;
      all += s;
    }
    __syncthreads();
    *total = all;
    return before + x - v;
  }
  // Atomic +1, one atomic per distinct address among the converged lanes.
  __device__ void Count(int* p) {
    const unsigned active = __activemask();
    const unsigned peers = __match_any_sync(active, reinterpret_cast<unsigned long long>(p));
    if (lane() == __ffs(peers) - 1) atomicAdd(p, __popc(peers));
  }
  // One contiguous segment a thread: a single block-wide step (in may alias out).
  __device__ void ExclusiveScan(const int* in, int* out, int n) {
    const int per = (n + nt - 1) / nt;
    const int lo = min(n, tid * per), hi = min(n, lo + per);
    int sum = 0;
    for (int i = lo; i < hi; ++i) sum += in[i];
    int total;
    int run = ThreadExclusive(sum, &total);
    for (int i = lo; i < hi; ++i) {
      const int x = in[i];
      out[i] = run;
      run += x;
    }
    if (tid == 0) out[n] = total;
    __syncthreads();
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Stages 1 and 2: running top-K filter with a shared-memory buffer.

struct StreamShared {
  int n;           // entries in the buffer
  int m;           // compaction cursor
  uint64_t theta;  // the K-th best key kept so far (keys below it qualify); ~0 until the first compaction
  float thx;       // its logit and id, for the cheap float test
  uint32_t thid;
  int sel[3];
  int64_t r64[32];
  int r32[32];
};

// Keeps the `keep` smallest of buf[0..n) (keys are unique) and sets theta to the largest kept.
__device__ void Compact(DevCtx& c, uint64_t* buf, uint64_t* tmp, int keep, StreamShared& ss, int* hist,
                        int* hscan) {
  const int n = ss.n;
  const uint64_t kth = SelectKth(c, n, keep, [&](int i) { return buf[i]; }, hist, hscan, ss.sel);
  if (c.tid == 0) ss.m = 0;
  __syncthreads();
  for (int base = 0; base < n; base += c.nt) {  // uniform trip count: whole warps take part in the ballot
    const int i = base + c.tid;
    const uint64_t u = i < n ? buf[i] : ~uint64_t{0};
    const bool q = i < n && u <= kth;
    const unsigned ballot = __ballot_sync(kFull, q);
    int at = 0;
    if (c.lane() == 0 && ballot != 0) at = atomicAdd(&ss.m, __popc(ballot));
    at = __shfl_sync(kFull, at, 0);
    if (q) tmp[at + __popc(ballot & ((1u << c.lane()) - 1))] = u;
  }
  __syncthreads();
  for (int i = c.tid; i < keep; i += c.nt) buf[i] = tmp[i];
  if (c.tid == 0) {
    ss.n = keep;
    ss.theta = kth;
    ss.thx = TokenKeyLogit(kth);
    ss.thid = static_cast<uint32_t>(kth);
  }
  __syncthreads();
}

// Appends the lanes' flagged keys (warp-aggregated); every lane of the warp calls it.
__device__ __forceinline__ int WarpReserve(int count, StreamShared& ss, int lane) {
  int incl = count;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += y;
  }
  const int total = __shfl_sync(kFull, incl, 31);
  int base = 0;
  if (lane == 31) base = atomicAdd(&ss.n, total);
  base = __shfl_sync(kFull, base, 31);
  return base + incl - count;
}

// A warp's 1024-logit tile: element k (0..31) of lane `lane` is logit Offset(k, lane) of the tile. Raw holds the
// loaded bits of a full tile (the next tile is loaded while the current one is processed); Unpack makes floats.
template <typename T, bool kVec>
struct Tile;

template <>
struct Tile<float, true> {  // 8 float4 a lane
  struct Raw {
    float4 v[8];
  };
  static __device__ __forceinline__ int Offset(int k, int lane) { return (k >> 2) * 128 + lane * 4 + (k & 3); }
  static __device__ __forceinline__ void Load(const float* p, int lane, Raw& r) {
    const float4* q = reinterpret_cast<const float4*>(p) + lane;
#pragma unroll
    for (int g = 0; g < 8; ++g) r.v[g] = __ldcs(q + g * 32);
  }
  static __device__ __forceinline__ void Unpack(const Raw& r, float (&x)[32]) {
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      x[4 * g] = r.v[g].x;
      x[4 * g + 1] = r.v[g].y;
      x[4 * g + 2] = r.v[g].z;
      x[4 * g + 3] = r.v[g].w;
    }
  }
};

template <>
struct Tile<uint16_t, true> {  // 4 uint4 (8 bf16 each) a lane
  struct Raw {
    uint4 v[4];
  };
  static __device__ __forceinline__ int Offset(int k, int lane) { return (k >> 3) * 256 + lane * 8 + (k & 7); }
  static __device__ __forceinline__ void Load(const uint16_t* p, int lane, Raw& r) {
    const uint4* q = reinterpret_cast<const uint4*>(p) + lane;
#pragma unroll
    for (int g = 0; g < 4; ++g) r.v[g] = __ldcs(q + g * 32);
  }
  static __device__ __forceinline__ void Unpack(const Raw& r, float (&x)[32]) {
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const uint32_t w[4] = {r.v[g].x, r.v[g].y, r.v[g].z, r.v[g].w};
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        x[8 * g + 2 * h] = BitsFloat(w[h] << 16);
        x[8 * g + 2 * h + 1] = BitsFloat(w[h] & 0xffff0000u);
      }
    }
  }
};

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(uint16_t x) { return Bf16ToFloat(x); }

template <typename T>
struct Tile<T, false> {  // scalar loads, lane-strided
  struct Raw {
    T v[32];
  };
  static __device__ __forceinline__ int Offset(int k, int lane) { return k * 32 + lane; }
  static __device__ __forceinline__ void Load(const T* p, int lane, Raw& r) {
#pragma unroll
    for (int k = 0; k < 32; ++k) r.v[k] = p[k * 32 + lane];
  }
  static __device__ __forceinline__ void Unpack(const Raw& r, float (&x)[32]) {
#pragma unroll
    for (int k = 0; k < 32; ++k) x[k] = ToFloat(r.v[k]);
  }
};

__device__ __forceinline__ uint64_t* StreamBuffers(unsigned char* smem, int kc, uint64_t** tmp, int** hist,
                                                   int** hscan) {
  uint64_t* buf = reinterpret_cast<uint64_t*>(smem);
  *tmp = buf + 2 * kc + kStreamRound;
  *hist = reinterpret_cast<int*>(*tmp + kc);
  *hscan = *hist + kRadixBins;
  return buf;
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kStreamThreads, 2) StreamTopK(const T* __restrict__ logits, int64_t v, int tiles,
                                                                int tpc, int nchunk, int kc, float* tile_m,
                                                                double* tile_s, uint64_t* cand, int* cand_n) {
  using Io = Tile<T, kVec>;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ StreamShared ss;
  uint64_t* tmp;
  int *hist, *hscan;
  uint64_t* buf = StreamBuffers(smem, kc, &tmp, &hist, &hscan);
  DevCtx c{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), ss.r64, ss.r32};
  const int lane = c.lane(), warp = c.warp();
  const int chunk = blockIdx.x;
  const int64_t row = blockIdx.y;
  const T* x_row = logits + row * v;
  const int t0 = chunk * tpc, t1 = min(tiles, t0 + tpc);
  auto full = [&](int t) { return t < t1 && static_cast<int64_t>(t + 1) * kTile <= v; };
  if (c.tid == 0) {
    ss.n = 0;
    ss.theta = ~uint64_t{0};
    ss.thx = -INFINITY;
    ss.thid = 0xffffffffu;
  }
  typename Io::Raw cur, nxt;
  if (full(t0 + warp)) Io::Load(x_row + static_cast<int64_t>(t0 + warp) * kTile, lane, cur);
  __syncthreads();
  for (int base = t0; base < t1; base += kWarps) {
    const int t = base + warp;
    if (full(t + kWarps)) Io::Load(x_row + static_cast<int64_t>(t + kWarps) * kTile, lane, nxt);  // prefetch
    if (t < t1) {
      const int64_t start = static_cast<int64_t>(t) * kTile;
      float x[32];
      if (full(t)) {
        Io::Unpack(cur, x);
#pragma unroll
        for (int k = 0; k < 32; ++k) x[k] = Sanitize(x[k]);
      } else {  // the row's last, partial tile; positions past V are -inf
#pragma unroll
        for (int k = 0; k < 32; ++k) {
          const int64_t e = start + Io::Offset(k, lane);
          x[k] = e < v ? Sanitize(ToFloat(x_row[e])) : -INFINITY;
        }
      }
      float lane_max = -INFINITY;
#pragma unroll
      for (int k = 0; k < 32; ++k) lane_max = fmaxf(lane_max, x[k]);
      float m = lane_max;
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
      double s4[4] = {0.0, 0.0, 0.0, 0.0};  // four chains for ILP; the order only moves the last bit
#pragma unroll
      for (int k = 0; k < 32; ++k) s4[k & 3] += Exp32AsDouble<GpuOps>(__fsub_rn(x[k], m));  // -inf -> 0
      double s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
      if (lane == 0) {
        tile_m[row * tiles + t] = m;
        tile_s[row * tiles + t] = s;
      }
      // candidates: logits that beat the running K-th best (none in a lane whose max is below it)
      const float thx = ss.thx;
      const uint32_t thid = ss.thid;
      uint32_t mask = 0;
      if (lane_max >= thx) {
#pragma unroll
        for (int k = 0; k < 32; ++k) {
          const uint32_t id = static_cast<uint32_t>(start + Io::Offset(k, lane));
          const bool q = x[k] != -INFINITY && (x[k] > thx || (x[k] == thx && id < thid));
          mask |= static_cast<uint32_t>(q) << k;
        }
      }
      if (__any_sync(kFull, mask != 0)) {
        int pos = WarpReserve(__popc(mask), ss, lane);
#pragma unroll
        for (int k = 0; k < 32; ++k) {
          if ((mask >> k) & 1u) buf[pos++] = TokenKey(x[k], static_cast<uint32_t>(start + Io::Offset(k, lane)));
        }
      }
    }
    cur = nxt;
    __syncthreads();
    const int n_now = ss.n;
    __syncthreads();
    if (n_now > 2 * kc) Compact(c, buf, tmp, kc, ss, hist, hscan);
  }
  if (ss.n > kc) Compact(c, buf, tmp, kc, ss, hist, hscan);
  const int n = ss.n;
  uint64_t* out = cand + (row * nchunk + chunk) * static_cast<int64_t>(kc);
  for (int i = c.tid; i < n; i += c.nt) out[i] = buf[i];
  if (c.tid == 0) cand_n[row * nchunk + chunk] = n;
}

__global__ void __launch_bounds__(kStreamThreads) MergeTopK(int nchunk, int kc, int k, int tiles,
                                                            const uint64_t* __restrict__ cand,
                                                            const int* __restrict__ cand_n,
                                                            const float* __restrict__ tile_m,
                                                            const double* __restrict__ tile_s, uint64_t* topk,
                                                            int64_t* lseq) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ StreamShared ss;
  uint64_t* tmp;
  int *hist, *hscan;
  uint64_t* buf = StreamBuffers(smem, k, &tmp, &hist, &hscan);
  DevCtx c{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), ss.r64, ss.r32};
  const int64_t row = blockIdx.x;

  float m = -INFINITY;
  for (int t = c.tid; t < tiles; t += c.nt) m = fmaxf(m, tile_m[row * tiles + t]);
  m = c.MaxF32(m);
  double s = 0.0;
  for (int t = c.tid; t < tiles; t += c.nt) {
    s += tile_s[row * tiles + t] * exp(static_cast<double>(tile_m[row * tiles + t]) - static_cast<double>(m));
  }
  s = c.SumF64(s);
  if (c.tid == 0) {
    lseq[row] = LseQ(static_cast<double>(m) + log(s));
    ss.n = 0;
    ss.theta = ~uint64_t{0};
  }
  __syncthreads();

  const uint64_t* rc = cand + row * nchunk * static_cast<int64_t>(kc);
  const int* rn = cand_n + row * nchunk;
  const int slots = nchunk * kc;
  for (int base = 0; base < slots; base += kStreamRound) {
    const uint64_t theta = ss.theta;
    for (int j = 0; j < kStreamRound / kStreamThreads; ++j) {
      const int i = base + j * kStreamThreads + c.tid;
      const bool valid = i < slots && (i % kc) < rn[i / kc];
      const uint64_t u = valid ? rc[i] : ~uint64_t{0};
      const bool q = valid && u < theta;
      const unsigned ballot = __ballot_sync(kFull, q);
      if (ballot != 0) {
        int at = 0;
        if (c.lane() == 0) at = atomicAdd(&ss.n, __popc(ballot));
        at = __shfl_sync(kFull, at, 0);
        if (q) buf[at + __popc(ballot & ((1u << c.lane()) - 1))] = u;
      }
    }
    __syncthreads();
    const int n_now = ss.n;
    __syncthreads();
    if (n_now > 2 * k) Compact(c, buf, tmp, k, ss, hist, hscan);
  }
  if (ss.n > k) Compact(c, buf, tmp, k, ss, hist, hscan);
  const int p2 = static_cast<int>(NextPow2(k));
  for (int i = k + c.tid; i < p2; i += c.nt) buf[i] = ~uint64_t{0};
  __syncthreads();
  BitonicSortKeys(c, buf, p2);
  for (int i = c.tid; i < k; i += c.nt) topk[row * k + i] = buf[i];
}

// ---------------------------------------------------------------------------------------------------------------
// Stages 3 and 4.

__global__ void __launch_bounds__(kLevelThreads) LevelsKernel(int n, int l, int k, const uint64_t* topk,
                                                              const int64_t* lseq, int32_t* tokens,
                                                              int32_t* parents, int32_t* depths, int32_t* anc,
                                                              char* global_arena, LevelLayout lay, bool in_smem) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ LevelShared sh;
  __shared__ int hist[kRadixBins];
  __shared__ int hscan[kRadixBins + 1];
  __shared__ int64_t r64[32];
  __shared__ int r32[32];
  const int64_t b = blockIdx.x;
  char* arena = in_smem ? reinterpret_cast<char*>(smem) : global_arena + b * lay.bytes;
  DevCtx c{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), r64, r32};
  const LevelsIO io{n, l, k, topk + b * l * k, lseq + b * l, tokens + b * n, parents + b * n, depths + b * n,
                    anc + b * (n + 1) * (l + 1)};
  BuildLevels(c, io, arena, lay, sh, hist, hscan);
}

// vis[b, r, c] = (c is an ancestor of r or r itself), 16 bytes a thread over the flat [B, N+1, N+1] array.
__global__ void VisKernel(int64_t bsz, int n, int l, const int32_t* __restrict__ depths,
                          const int32_t* __restrict__ anc, bool* vis) {
  const int64_t w = n + 1, per = w * w, total = bsz * per;
  const bool aligned = (reinterpret_cast<uintptr_t>(vis) & 15) == 0;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q * 16 < total;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e0 = q * 16;
    int64_t bb = e0 / per;
    const int64_t rem = e0 - bb * per;
    int r = static_cast<int>(rem / w);
    int col = static_cast<int>(rem - static_cast<int64_t>(r) * w);
    uint32_t word[4] = {0, 0, 0, 0};
    const int cnt = total - e0 < 16 ? static_cast<int>(total - e0) : 16;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i >= cnt) break;
      const int dr = r == 0 ? 0 : depths[bb * n + r - 1];
      const int dc = col == 0 ? 0 : depths[bb * n + col - 1];
      const bool val = col == 0 || (dc <= dr && anc[(bb * w + r) * (l + 1) + dc] == col);
      word[i >> 2] |= static_cast<uint32_t>(val) << (8 * (i & 3));
      if (++col == w) {
        col = 0;
        if (++r == w) {
          r = 0;
          ++bb;
        }
      }
    }
    if (cnt == 16 && aligned) {
      *reinterpret_cast<uint4*>(vis + e0) = make_uint4(word[0], word[1], word[2], word[3]);
    } else {
      unsigned char* out = reinterpret_cast<unsigned char*>(vis + e0);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        if (i < cnt) out[i] = static_cast<unsigned char>((word[i >> 2] >> (8 * (i & 3))) & 1u);
      }
    }
  }
}

ffi::Error CudaCheck(cudaError_t e, const char* what) { return kdtree::CudaStatus(e, "tree_build (CUDA)", what); }

// Raises a kernel's dynamic shared memory limit when a launch needs more than was set before on this device (one
// cudaFuncSetAttribute per kernel and device in steady state).
template <auto Kernel>
ffi::Error AllowSmem(int64_t bytes, const char* what) {
  static std::atomic<int64_t> allowed[64] = {};
  int dev = 0;
  ffi::Error err = CudaCheck(cudaGetDevice(&dev), what);
  if (err.failure()) return err;
  if (dev < 64 && allowed[dev].load(std::memory_order_relaxed) >= bytes) return ffi::Error::Success();
  err = CudaCheck(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
                  what);
  if (err.failure()) return err;
  if (dev < 64) {
    int64_t cur = allowed[dev].load(std::memory_order_relaxed);
    while (cur < bytes && !allowed[dev].compare_exchange_weak(cur, bytes)) {
    }
  }
  return ffi::Error::Success();
}

template <typename T, bool kVec>
ffi::Error LaunchStream(const Plan& p, const void* logits, char* ws, cudaStream_t stream) {
  ffi::Error err = AllowSmem<StreamTopK<T, kVec>>(p.stream_smem, "stage 1 shared memory");
  if (err.failure()) return err;
  StreamTopK<T, kVec><<<dim3(static_cast<unsigned>(p.nchunk), static_cast<unsigned>(p.b * p.l)), kStreamThreads, p.stream_smem,
           stream>>>(static_cast<const T*>(logits), p.v, static_cast<int>(p.tiles),
                     static_cast<int>(p.tiles_per_chunk), static_cast<int>(p.nchunk), static_cast<int>(p.kc),
                     reinterpret_cast<float*>(ws + p.tile_m), reinterpret_cast<double*>(ws + p.tile_s),
                     reinterpret_cast<uint64_t*>(ws + p.cand), reinterpret_cast<int*>(ws + p.cand_n));
  return CudaCheck(cudaGetLastError(), "stage 1 launch");
}

ffi::Error TreeBuildCuda(cudaStream_t stream, ffi::AnyBuffer logits, ffi::Result<I32Mat> tokens,
                         ffi::Result<I32Mat> parents, ffi::Result<I32Mat> depths, ffi::Result<BoolCube> vis,
                         ffi::Result<U8Vec> workspace) {
  const auto dims = logits.dimensions();
  if (dims.size() != 3) return ffi::Error::InvalidArgument("tree_build: draft_logits must be [B, L, V]");
  const bool bf16 = logits.element_type() == ffi::DataType::BF16;
  if (!bf16 && logits.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("tree_build: draft_logits must be float32 or bfloat16");
  }
  const int64_t b = dims[0], l = dims[1], v = dims[2];
  const int64_t n = tokens->dimensions()[1];
  if (l < 1 || l > kMaxDepth || v < 1 || n < 1 || n > l * v) {
    return ffi::Error::InvalidArgument("tree_build: need 1 <= L <= 16, V >= 1 and 1 <= budget <= L * V");
  }
  if (n > kMaxCudaBudget) {
    return ffi::Error::InvalidArgument("tree_build: the CUDA kernel supports budget <= 4096 (got " +
                                       std::to_string(n) + "); use impl='xla' or run on CPU");
  }
  if (v >= (int64_t{1} << 31) || b * l >= 65536) {
    return ffi::Error::InvalidArgument("tree_build: the CUDA kernel needs V < 2^31 and B * L < 65536");
  }
  if (tokens->dimensions()[0] != b || parents->dimensions()[0] != b || parents->dimensions()[1] != n ||
      depths->dimensions()[0] != b || depths->dimensions()[1] != n || vis->dimensions()[0] != b ||
      vis->dimensions()[1] != n + 1 || vis->dimensions()[2] != n + 1) {
    return ffi::Error::InvalidArgument("tree_build: output shapes do not match [B, budget] / [B, budget+1, budget+1]");
  }
  const Plan p = MakePlan(b, l, v, n);
  if (workspace->dimensions()[0] < p.total) {
    return ffi::Error::InvalidArgument("tree_build: workspace of " + std::to_string(workspace->dimensions()[0]) +
                                       " bytes, need " + std::to_string(p.total));
  }
  char* ws = reinterpret_cast<char*>(workspace->untyped_data());
  const bool aligned16 = (reinterpret_cast<uintptr_t>(logits.untyped_data()) & 15) == 0;
  ffi::Error err = ffi::Error::Success();
  if (bf16) {
    err = (aligned16 && v % 8 == 0) ? LaunchStream<uint16_t, true>(p, logits.untyped_data(), ws, stream)
                                    : LaunchStream<uint16_t, false>(p, logits.untyped_data(), ws, stream);
  } else {
    err = (aligned16 && v % 4 == 0) ? LaunchStream<float, true>(p, logits.untyped_data(), ws, stream)
                                    : LaunchStream<float, false>(p, logits.untyped_data(), ws, stream);
  }
  if (err.failure()) return err;

  const int64_t merge_smem = StreamSmemBytes(p.k);
  err = AllowSmem<MergeTopK>(merge_smem, "stage 2 shared memory");
  if (err.failure()) return err;
  MergeTopK<<<static_cast<unsigned>(b * l), kStreamThreads, merge_smem, stream>>>(
      static_cast<int>(p.nchunk), static_cast<int>(p.kc), static_cast<int>(p.k), static_cast<int>(p.tiles),
      reinterpret_cast<const uint64_t*>(ws + p.cand), reinterpret_cast<const int*>(ws + p.cand_n),
      reinterpret_cast<const float*>(ws + p.tile_m), reinterpret_cast<const double*>(ws + p.tile_s),
      reinterpret_cast<uint64_t*>(ws + p.topk), reinterpret_cast<int64_t*>(ws + p.lseq));
  err = CudaCheck(cudaGetLastError(), "stage 2 launch");
  if (err.failure()) return err;

  const int64_t level_smem = p.levels_in_smem ? p.lv.bytes : 0;
  err = AllowSmem<LevelsKernel>(level_smem, "stage 3 shared memory");
  if (err.failure()) return err;
  int32_t* anc = reinterpret_cast<int32_t*>(ws + p.anc);
  LevelsKernel<<<static_cast<unsigned>(b), kLevelThreads, level_smem, stream>>>(
      static_cast<int>(n), static_cast<int>(l), static_cast<int>(p.k), reinterpret_cast<const uint64_t*>(ws + p.topk),
      reinterpret_cast<const int64_t*>(ws + p.lseq), tokens->typed_data(), parents->typed_data(),
      depths->typed_data(), anc, ws + p.arena, p.lv, p.levels_in_smem);
  err = CudaCheck(cudaGetLastError(), "stage 3 launch");
  if (err.failure()) return err;

  const int64_t chunks = CeilDiv(b * (n + 1) * (n + 1), 16);
  const int64_t blocks = CeilDiv(chunks, 256) < 4096 ? CeilDiv(chunks, 256) : 4096;
  VisKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(b, static_cast<int>(n), static_cast<int>(l),
                                                                 depths->typed_data(), anc, vis->typed_data());
  return CudaCheck(cudaGetLastError(), "stage 4 launch");
}

}  // namespace
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdTreeBuildCuda, kdtree::TreeBuildCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()      // draft_logits [B, L, V] f32 | bf16
                                  .Ret<I32Mat>()              // tokens [B, N]
                                  .Ret<I32Mat>()              // parents [B, N]
                                  .Ret<I32Mat>()              // depths [B, N]
                                  .Ret<BoolCube>()            // visibility [B, N + 1, N + 1]
                                  .Ret<U8Vec>(),              // workspace (KdTreeBuildWorkspaceBytes)
                              {xla::ffi::Traits::kCmdBufferCompatible});
