// DDTree tree build (Algorithm 1) on the CPU: per depth the log-sum-exp and the top-K tokens, then a best-first
// heap over rank paths. Scores and the tie rule are in common.h; the CUDA handler (tree_build.cu) gives the same
// arrays bit for bit.
//
// Targets:
//   KdTreeBuildCpu        the handler used by kdtree_jax.kernels.tree_build on CPU (binary heap, Algorithm 1)
//   KdTreeBuildLevelsCpu  the CUDA kernel's level-by-level expansion (tree_levels.h) run sequentially on the host;
//                         only tests use it, to check the GPU algorithm on machines without a GPU
//   KdCudaUnavailable     registered for CUDA when the CUDA library is missing: fails with a readable message
// and the plain C function KdTreeBuildWorkspaceBytes, the size of the CUDA handler's workspace output.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <queue>
#include <string>
#include <vector>

#include "common.h"
#include "tree_levels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Typed buffers (aliases keep template commas out of the binding macro).
using I32Mat = ffi::Buffer<ffi::S32, 2>;
using I32Vec = ffi::Buffer<ffi::S32, 1>;
using BoolCube = ffi::Buffer<ffi::PRED, 3>;

namespace kdtree {
namespace {

struct CpuOps {
  static inline __attribute__((always_inline)) float Mul(float a, float b) { return a * b; }
  static inline __attribute__((always_inline)) float Add(float a, float b) { return a + b; }
  static inline __attribute__((always_inline)) float Fma(float a, float b, float c) {
    return __builtin_fmaf(a, b, c);
  }
};

// lse of one row of sanitized logits, tile by tile as the GPU does it (see common.h).
inline __attribute__((always_inline)) double RowLse(const float* xs, int64_t v) {
  const int64_t tiles = CeilDiv(v, kTile);
  std::vector<float> tm(tiles);
  std::vector<double> ts(tiles);
  float m = -INFINITY;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t lo = t * kTile, hi = std::min<int64_t>(v, lo + kTile);
    float mt = -INFINITY;
    for (int64_t i = lo; i < hi; ++i) mt = std::max(mt, xs[i]);
    double st = 0.0;
    for (int64_t i = lo; i < hi; ++i) st += Exp32AsDouble<CpuOps>(xs[i] - mt);
    tm[t] = mt;
    ts[t] = st;
    m = std::max(m, mt);
  }
  double s = 0.0;
  for (int64_t t = 0; t < tiles; ++t) s += ts[t] * std::exp(static_cast<double>(tm[t]) - static_cast<double>(m));
  return static_cast<double>(m) + std::log(s);
}

#if defined(__x86_64__)
__attribute__((target("fma"))) double RowLseFma(const float* xs, int64_t v) { return RowLse(xs, v); }
double RowLseNoFma(const float* xs, int64_t v) { return RowLse(xs, v); }  // fmaf in software: same result, slower
double RowLseDispatch(const float* xs, int64_t v) {
  static const bool has_fma = __builtin_cpu_supports("fma");
  return has_fma ? RowLseFma(xs, v) : RowLseNoFma(xs, v);
}
#else
double RowLseDispatch(const float* xs, int64_t v) { return RowLse(xs, v); }
#endif

// Per row (b, d): the K best tokens as sorted TokenKeys, and llrint(lse * 2^32).
void PrepareRows(const ffi::AnyBuffer& logits, int64_t rows, int64_t v, int64_t k, std::vector<uint64_t>& topk,
                 std::vector<int64_t>& lseq) {
  topk.resize(rows * k);
  lseq.resize(rows);
  std::vector<float> xs(v);
  std::vector<uint64_t> keys(v);
  const bool bf16 = logits.element_type() == ffi::DataType::BF16;
  for (int64_t r = 0; r < rows; ++r) {
    if (bf16) {
      const uint16_t* x = static_cast<const uint16_t*>(logits.untyped_data()) + r * v;
      for (int64_t i = 0; i < v; ++i) xs[i] = Sanitize(Bf16ToFloat(x[i]));
    } else {
      const float* x = static_cast<const float*>(logits.untyped_data()) + r * v;
      for (int64_t i = 0; i < v; ++i) xs[i] = Sanitize(x[i]);
    }
    lseq[r] = LseQ(RowLseDispatch(xs.data(), v));
    for (int64_t i = 0; i < v; ++i) keys[i] = TokenKey(xs[i], static_cast<uint32_t>(i));
    if (k < v) std::nth_element(keys.begin(), keys.begin() + k, keys.end());
    std::sort(keys.begin(), keys.begin() + k);
    std::copy(keys.begin(), keys.begin() + k, topk.begin() + r * k);
  }
}

// Algorithm 1 with a binary heap. Candidates: (score, depth, parent pop index, rank j).
class HeapTree {
 public:
  HeapTree(int64_t n, int64_t l, int64_t k, const uint64_t* topk, const int64_t* lseq)
      : n_(n), l_(l), k_(k), topk_(topk), lseq_(lseq) {}

  void Build(int32_t* tokens, int32_t* parents, int32_t* depths) {
    par_.assign(1, -1);
    rank_.assign(1, 0);
    score_.assign(1, 0);
    auto later = [this](const Cand& a, const Cand& b) { return Before(b, a); };
    std::priority_queue<Cand, std::vector<Cand>, decltype(later)> heap(later);
    heap.push({Q(1, 0), 1, 0, 0});
    for (int64_t i = 1; i <= n_ && !heap.empty(); ++i) {
      const Cand c = heap.top();
      heap.pop();
      par_.push_back(c.parent);
      rank_.push_back(c.j);
      score_.push_back(c.score);
      tokens[i - 1] = TokenKeyId(topk_[(c.depth - 1) * k_ + c.j]);
      parents[i - 1] = c.parent;
      depths[i - 1] = c.depth;
      if (c.j + 1 < k_) heap.push({score_[c.parent] + Q(c.depth, c.j + 1), c.depth, c.parent, c.j + 1});
      if (c.depth < l_) heap.push({c.score + Q(c.depth + 1, 0), c.depth + 1, static_cast<int>(i), 0});
    }
  }

 private:
  struct Cand {
    int64_t score;
    int depth, parent, j;
  };
  int64_t Q(int d, int j) const { return LogitQ(TokenKeyLogit(topk_[(d - 1) * k_ + j])) - lseq_[d - 1]; }
  // True when a pops before b: higher score, then shallower, then the lexicographically smaller rank path.
  bool Before(const Cand& a, const Cand& b) const {
    if (a.score != b.score) return a.score > b.score;
    if (a.depth != b.depth) return a.depth < b.depth;
    int pa = a.parent, pb = b.parent, ja = a.j, jb = b.j;
    while (pa != pb) {
      ja = rank_[pa];
      jb = rank_[pb];
      pa = par_[pa];
      pb = par_[pb];
    }
    return ja < jb;
  }
  int64_t n_, l_, k_;
  const uint64_t* topk_;
  const int64_t* lseq_;
  std::vector<int> par_, rank_;
  std::vector<int64_t> score_;
};

// Row i of the ancestor mask = row of its parent plus itself; row 0 = the root.
void WriteVisibility(int64_t n, const int32_t* parents, bool* vis) {
  const int64_t w = n + 1;
  std::fill(vis, vis + w * w, false);
  vis[0] = true;
  for (int64_t i = 1; i <= n; ++i) {
    std::copy(vis + parents[i - 1] * w, vis + parents[i - 1] * w + i, vis + i * w);
    vis[i * w + i] = true;
  }
}

ffi::Error TreeBuild(ffi::AnyBuffer logits, ffi::Result<I32Mat> tokens,
                     ffi::Result<I32Mat> parents, ffi::Result<I32Mat> depths,
                     ffi::Result<BoolCube> vis, bool levels) {
  const auto dims = logits.dimensions();
  if (dims.size() != 3) return ffi::Error::InvalidArgument("tree_build: draft_logits must be [B, L, V]");
  if (logits.element_type() != ffi::DataType::F32 && logits.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("tree_build: draft_logits must be float32 or bfloat16");
  }
  const int64_t b = dims[0], l = dims[1], v = dims[2];
  const int64_t n = tokens->dimensions()[1];
  if (l < 1 || l > kMaxDepth || v < 1 || n < 1 || n > l * v) {
    return ffi::Error::InvalidArgument("tree_build: need 1 <= L <= 16, V >= 1 and 1 <= budget <= L * V");
  }
  if (tokens->dimensions()[0] != b || parents->dimensions()[0] != b || parents->dimensions()[1] != n ||
      depths->dimensions()[0] != b || depths->dimensions()[1] != n || vis->dimensions()[0] != b ||
      vis->dimensions()[1] != n + 1 || vis->dimensions()[2] != n + 1) {
    return ffi::Error::InvalidArgument("tree_build: output shapes do not match [B, budget] / [B, budget+1, budget+1]");
  }
  if (levels && n > kMaxCudaBudget) return ffi::Error::InvalidArgument("tree_build levels: budget > 4096");
  const int64_t k = std::min(n, v);
  std::vector<uint64_t> topk;
  std::vector<int64_t> lseq;
  PrepareRows(logits, b * l, v, k, topk, lseq);
  const LevelLayout lay = PlanLevels(n, l, k);
  std::vector<uint64_t> arena(levels ? CeilDiv(lay.bytes, 8) : 0);
  for (int64_t r = 0; r < b; ++r) {
    int32_t* tok = tokens->typed_data() + r * n;
    int32_t* par = parents->typed_data() + r * n;
    int32_t* dep = depths->typed_data() + r * n;
    if (levels) {
      HostCtx ctx;
      LevelShared sh{};
      int hist[kRadixBins], hscan[kRadixBins + 1];
      const LevelsIO io{static_cast<int>(n), static_cast<int>(l), static_cast<int>(k), topk.data() + r * l * k,
                        lseq.data() + r * l, tok, par, dep, nullptr};
      BuildLevels(ctx, io, reinterpret_cast<char*>(arena.data()), lay, sh, hist, hscan);
    } else {
      HeapTree(n, l, k, topk.data() + r * l * k, lseq.data() + r * l).Build(tok, par, dep);
    }
    WriteVisibility(n, par, vis->typed_data() + r * (n + 1) * (n + 1));
  }
  return ffi::Error::Success();
}

ffi::Error TreeBuildHeap(ffi::AnyBuffer logits, ffi::Result<I32Mat> tokens,
                         ffi::Result<I32Mat> parents, ffi::Result<I32Mat> depths,
                         ffi::Result<BoolCube> vis) {
  return TreeBuild(logits, tokens, parents, depths, vis, false);
}

ffi::Error TreeBuildLevels(ffi::AnyBuffer logits, ffi::Result<I32Mat> tokens,
                           ffi::Result<I32Mat> parents, ffi::Result<I32Mat> depths,
                           ffi::Result<BoolCube> vis) {
  return TreeBuild(logits, tokens, parents, depths, vis, true);
}

ffi::Error CudaUnavailable(ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error(ffi::ErrorCode::kUnavailable,
                    "kdtree-jax: the CUDA custom calls are not available (libkdtree_jax_cuda.so was not built or did "
                    "not load; see the warning printed at registration). Rebuild with nvcc on PATH, or pass "
                    "impl='xla'.");
}

}  // namespace
}  // namespace kdtree

// The operands of both CPU builders (the heap and the level-by-level one).
static auto TreeBuildCpuBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // draft_logits [B, L, V] f32 | bf16
      .Ret<I32Mat>()          // tokens [B, N]
      .Ret<I32Mat>()          // parents [B, N]
      .Ret<I32Mat>()          // depths [B, N]
      .Ret<BoolCube>();       // visibility [B, N + 1, N + 1]
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdTreeBuildCpu, kdtree::TreeBuildHeap, TreeBuildCpuBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KdTreeBuildLevelsCpu, kdtree::TreeBuildLevels, TreeBuildCpuBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KdCudaUnavailable, kdtree::CudaUnavailable,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());

extern "C" int64_t KdTreeBuildWorkspaceBytes(int64_t b, int64_t l, int64_t v, int64_t n) {
  return kdtree::MakePlan(b, l, v, n).total;
}
