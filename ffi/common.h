// Shared by the C++ (CPU) and CUDA handlers: the exact arithmetic that makes both return the same tree.
//
// Scores. Every logit is sanitized (NaN -> -2^20, clamped to +-2^20, -0 -> +0). Per depth, the log-sum-exp is
// computed in tiles of kTile logits: m_t = max of the tile, s_t = sum of Exp32AsDouble(x - m_t) in double, an exp
// written with IEEE mul/add/fma only (so the CPU and the GPU compute the same value for every logit);
// then m = max m_t, s = sum s_t * exp(m_t - m) in double, lse = m + log(s). A token's log-prob in 64-bit fixed point
// (2^-32 nats) is q = llrint(x * 2^32) - llrint(lse * 2^32) <= 0, and a node's score is the integer sum of the q of
// its path. Integer scores make ties exact and associative (cousins with the same multiset of logits tie exactly)
// and a child never scores above its parent. The only difference between the platforms is the order of the double
// sums (last-bit rounding), which changes llrint(lse * 2^32) with probability ~1e-6 per depth; such a one-unit
// (2^-32 nats) difference would then also have to decide a comparison between two scores to change the tree.
//
// Order ("the tie rule"). Nodes are ranked by score (higher first), then depth (shallower first), then by their path
// of per-depth token ranks read lexicographically (smaller first). A depth's tokens are ranked by logit (higher
// first), then token id (smaller first). The tree is the first `budget` nodes of that order, in that order; it is
// prefix-closed and every parent precedes its children.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define KD_HD __host__ __device__ __forceinline__
#else
#define KD_HD inline __attribute__((always_inline))
#endif

namespace kdtree {

constexpr int kTile = 1024;                     // logits per log-sum-exp tile (one warp's tile on the GPU)
constexpr float kLogitClamp = 1048576.0f;       // 2^20
constexpr double kScoreScale = 4294967296.0;    // 2^32: score units per nat
constexpr int kMaxDepth = 16;                   // L <= 16
constexpr int64_t kMaxCudaBudget = 4096;        // the CUDA kernel keeps up to this many nodes

KD_HD uint32_t FloatBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

KD_HD float BitsFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

KD_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// NaN -> -2^20 (fmax returns the non-NaN operand), clamp to +-2^20, -0 -> +0.
KD_HD float Sanitize(float x) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(fminf(fmaxf(x, -kLogitClamp), kLogitClamp), 0.0f);
#else
  float y = __builtin_fmaxf(x, -kLogitClamp);
  y = __builtin_fminf(y, kLogitClamp);
  return y + 0.0f;
#endif
}

KD_HD double DoubleFromWords(uint32_t hi, uint32_t lo) {
#ifdef __CUDA_ARCH__
  return __hiloint2double(static_cast<int>(hi), static_cast<int>(lo));
#else
  const uint64_t u = (static_cast<uint64_t>(hi) << 32) | lo;
  double d;
  std::memcpy(&d, &u, 8);
  return d;
#endif
}

// exp(t) for t <= 0 (0 below -80), as a double holding an exactly float-representable value: Cephes expf's range
// reduction and polynomial from correctly rounded mul/add/fma only (Ops), so every platform computes the same bits
// (max relative error 8.4e-8). The integer k comes from the bits of t * log2(e) + 1.5 * 2^23 and the double is
// assembled from the bits of the polynomial's value y in [0.70, 1.42] with k added to its exponent: no float->int
// or float->double conversions, which are slow on the GPU. t = -inf gives 0.
template <class Ops>
KD_HD double Exp32AsDouble(float t) {
  const float kfm = Ops::Add(Ops::Mul(t, 1.44269504088896341f), 12582912.0f);
  const float kf = Ops::Add(kfm, -12582912.0f);
  const int k = static_cast<int>(FloatBits(kfm)) - 0x4B400000;
  float x = Ops::Fma(kf, -0.693359375f, t);
  x = Ops::Fma(kf, 2.12194440e-4f, x);
  const float z = Ops::Mul(x, x);
  float p = 1.9875691500e-4f;
  p = Ops::Fma(p, x, 1.3981999507e-3f);
  p = Ops::Fma(p, x, 8.3334519073e-3f);
  p = Ops::Fma(p, x, 4.1665795894e-2f);
  p = Ops::Fma(p, x, 1.6666665459e-1f);
  p = Ops::Fma(p, x, 5.0000001201e-1f);
  const uint32_t yb = FloatBits(Ops::Add(Ops::Fma(p, z, x), 1.0f));
  const double e = DoubleFromWords((yb >> 3) + (static_cast<uint32_t>(896 + k) << 20), yb << 29);
  return t < -80.0f ? 0.0 : e;
}

// Monotone map float -> uint32 (larger float, larger key); inputs are sanitized (no NaN, no -0).
KD_HD uint32_t OrdKey(float f) {
  const uint32_t u = FloatBits(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

KD_HD float FromOrdKey(uint32_t k) { return BitsFloat((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// A depth's tokens sort ascending by this key: logit descending, then token id ascending.
KD_HD uint64_t TokenKey(float x, uint32_t id) {
  return (static_cast<uint64_t>(~OrdKey(x)) << 32) | id;
}
KD_HD float TokenKeyLogit(uint64_t c) { return FromOrdKey(~static_cast<uint32_t>(c >> 32)); }
KD_HD int32_t TokenKeyId(uint64_t c) { return static_cast<int32_t>(static_cast<uint32_t>(c)); }

// Fixed-point logit (exact: |x| <= 2^20, so x * 2^32 is an integer-valued double below 2^53 or rounds once).
KD_HD int64_t LogitQ(float x) {
#ifdef __CUDA_ARCH__
  return __double2ll_rn(static_cast<double>(x) * kScoreScale);
#else
  return __builtin_llrint(static_cast<double>(x) * kScoreScale);
#endif
}

KD_HD int64_t LseQ(double lse) {
#ifdef __CUDA_ARCH__
  return __double2ll_rn(lse * kScoreScale);
#else
  return __builtin_llrint(lse * kScoreScale);
#endif
}

// Scores sort ascending by this key: higher score first.
KD_HD uint64_t ScoreKey(int64_t score) { return ~(static_cast<uint64_t>(score) ^ (uint64_t{1} << 63)); }
KD_HD int64_t KeyScore(uint64_t u) { return static_cast<int64_t>(~u ^ (uint64_t{1} << 63)); }

KD_HD int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
KD_HD int64_t AlignUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }
KD_HD int64_t NextPow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// ---------------------------------------------------------------------------------------------------------------
// The CUDA kernel's plan and workspace layout. It lives here so that the CPU library can report the workspace size
// to Python (the workspace is an extra output of the CUDA custom call), with one source of truth.
// ---------------------------------------------------------------------------------------------------------------

constexpr int kRadixBits = 11;                 // radix-select digit (tree_levels.h SelectKth)
constexpr int kRadixBins = 1 << kRadixBits;     // its histogram: kRadixBins counters, scan kRadixBins + 1
constexpr int kStreamThreads = 256;             // stage 1: 8 warps, one 1024-logit tile each per round
constexpr int kStreamRound = (kStreamThreads / 32) * kTile;
constexpr int kStreamSlots = 264;               // ~2 resident stage-1 blocks per SM on an H200 (132 SMs)
constexpr int kLevelThreads = 512;              // stage 3: one block per batch row
constexpr int64_t kMaxLevelSmem = 200 * 1024;   // stage 3 keeps its arena in shared memory up to this size

struct LevelLayout {  // byte offsets inside one batch row's stage-3 arena
  int64_t cap, p2;
  int64_t qtab;  // 1: the per-depth logits are stored as int64 LogitQ values, 0: as floats
  int64_t xs, key, par, dj, cnt, tkey, tpar, tdj, crank, sortk, sortv, bytes;
};

KD_HD LevelLayout LevelLayoutFor(int64_t n, int64_t l, int64_t k, int64_t cap, int64_t qtab) {
  LevelLayout a{};
  a.cap = cap;
  a.p2 = NextPow2(n + 1);
  a.qtab = qtab;
  int64_t o = 0;
  auto take = [&o](int64_t bytes) {
    const int64_t at = o;
    o = AlignUp(o + bytes, 16);
    return at;
  };
  a.xs = take((qtab ? 8 : 4) * l * k);
  a.key = take(8 * a.cap);
  a.par = take(4 * a.cap);
  a.dj = take(4 * a.cap);
  a.cnt = take(4 * (a.cap + 1));
  a.tkey = take(8 * (n + 1));
  a.tpar = take(4 * (n + 1));
  a.tdj = take(4 * (n + 1));
  a.crank = take(4 * (n + 1));
  a.sortk = take(8 * a.p2);
  a.sortv = take(4 * a.p2);
  a.bytes = o;
  return a;
}

// The node store holds 4 budget + 2 slots (fewer trims) and the logits as int64 (no conversions in the searches)
// when that fits in shared memory; otherwise the first of the smaller variants that fits; otherwise the largest,
// in global memory. Any cap >= 2 budget + 2 is correct (tree_levels.h).
KD_HD LevelLayout PlanLevels(int64_t n, int64_t l, int64_t k) {
  const int64_t caps[4] = {4 * n + 2, 4 * n + 2, 2 * n + 2, 2 * n + 2};
  const int64_t qtabs[4] = {1, 0, 1, 0};
  for (int i = 0; i < 4; ++i) {
    const LevelLayout a = LevelLayoutFor(n, l, k, caps[i], qtabs[i]);
    if (a.bytes <= kMaxLevelSmem) return a;
  }
  return LevelLayoutFor(n, l, k, caps[0], qtabs[0]);
}

struct Plan {
  int64_t b, l, v, n, k;
  int64_t tiles, tiles_per_chunk, nchunk, kc;
  int64_t stream_smem;
  LevelLayout lv;
  bool levels_in_smem;
  int64_t tile_m, tile_s, cand, cand_n, topk, lseq, anc, arena, total;  // byte offsets into the workspace
};

KD_HD int64_t StreamSmemBytes(int64_t kc) {
  // candidate buffer (2 kc + one round) + compaction target (kc), uint64 each, + radix histogram and its scan
  return 8 * (3 * kc + kStreamRound) + 4 * (2 * kRadixBins + 1) + 64;
}

KD_HD Plan MakePlan(int64_t b, int64_t l, int64_t v, int64_t n) {
  Plan p{};
  p.b = b;
  p.l = l;
  p.v = v;
  p.n = n;
  p.k = n < v ? n : v;
  p.tiles = CeilDiv(v, kTile);
  const int64_t rows = b * l;
  int64_t want = kStreamSlots / rows;
  if (want < 1) want = 1;
  int64_t most = p.tiles / 4;  // at least 4 tiles a chunk
  if (most < 1) most = 1;
  int64_t merge_cap = (16 * 1024) / p.k;  // stage 2 reads nchunk * K candidates a row: about 16K at most
  if (merge_cap < 1) merge_cap = 1;
  most = most < merge_cap ? most : merge_cap;
  const int64_t nchunk = want < most ? want : most;
  p.tiles_per_chunk = CeilDiv(p.tiles, nchunk);
  p.nchunk = CeilDiv(p.tiles, p.tiles_per_chunk);
  p.kc = p.k < p.tiles_per_chunk * kTile ? p.k : p.tiles_per_chunk * kTile;
  p.stream_smem = StreamSmemBytes(p.kc);
  p.lv = PlanLevels(n, l, p.k);
  p.levels_in_smem = p.lv.bytes <= kMaxLevelSmem;
  int64_t o = 0;
  auto take = [&o](int64_t bytes) {
    const int64_t at = o;
    o = AlignUp(o + bytes, 256);
    return at;
  };
  p.tile_m = take(4 * rows * p.tiles);
  p.tile_s = take(8 * rows * p.tiles);
  p.cand = take(8 * rows * p.nchunk * p.kc);
  p.cand_n = take(4 * rows * p.nchunk);
  p.topk = take(8 * rows * p.k);
  p.lseq = take(8 * rows);
  p.anc = take(4 * b * (n + 1) * (l + 1));
  p.arena = take(p.levels_in_smem ? 0 : p.lv.bytes * b);
  p.total = o;
  return p;
}

}  // namespace kdtree
