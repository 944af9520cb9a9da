// The tree expansion of the CUDA kernel (stage 3), written once against a small execution context so that the same
// code runs as one CUDA block (DevCtx in tree_build.cu) and as a sequential host emulation (HostCtx below, used by
// the CPU target "kdtree_tree_build_levels" that the CPU test suite checks against the best-first heap).
//
// Instead of popping a heap `budget` times (a long chain of dependent steps), it enumerates the tree level by level.
// With t a lower bound on the score of the budget-th node, level d is every child (p, j) of a level d-1 node p whose
// score passes t; a parent's passing children are a prefix of its depth's sorted tokens, found by binary search,
// and children are written in (parent, rank) order, so each level is stored in the lexicographic order of rank
// paths. The first t is the budget-th best score among the "spine siblings" (the best path to depth d-1 followed by
// any token at depth d), which always contain `budget` nodes. When the node store (2 budget + 2 slots) would
// overflow, it is trimmed to its best `budget` nodes and t rises to the budget-th score (deeper nodes then need a
// strictly higher score); if one level alone is still too large, a parent of within-level rank i keeps only its
// first budget / (i + 1) children (at least (i + 1)(j + 1) - 1 nodes of the level precede child j of it) and only
// the level's best `budget` candidates are written. At the end the best `budget` stored nodes, sorted by
// (score desc, slot asc) -- slot order is (depth, lexicographic rank path) -- are the tree, in pop order.
#pragma once

#include "common.h"

#ifdef __CUDACC__
#define KD_DEV __device__ __forceinline__
#define KD_CLZLL(x) __clzll(static_cast<long long>(x))
#else
#define KD_DEV inline
#define KD_CLZLL(x) __builtin_clzll(x)
#endif

namespace kdtree {

// Sequential stand-in for a thread block: one "thread" runs every loop iteration of each phase. The GPU context
// (DevCtx in tree_build.cu) has the same members: tid, nt, sync, SumI32, MinU64, MaxU64, ThreadExclusive (exclusive
// prefix of one value per thread), Count (atomic increment) and ExclusiveScan.
struct HostCtx {
  int tid = 0;
  int nt = 1;
  void sync() {}
  int SumI32(int v) { return v; }
  uint64_t MinU64(uint64_t v) { return v; }
  uint64_t MaxU64(uint64_t v) { return v; }
  int ThreadExclusive(int v, int* total) {
    *total = v;
    return 0;
  }
  void Count(int* p) { *p += 1; }
  // out[0..n] = exclusive prefix sums of in[0..n), out[n] = total; in may alias out.
  void ExclusiveScan(const int* in, int* out, int n) {
    int s = 0;
    for (int i = 0; i < n; ++i) {
      const int v = in[i];
      out[i] = s;
      s += v;
    }
    out[n] = s;
  }
};

// Scalars shared by the block (shared memory on the GPU).
struct LevelShared {
  int64_t t;                        // score threshold
  int strict;                       // 1: pass if score > t, 0: if score >= t
  int m;                            // used slots of the node store (slot 0 = root)
  int lvl[kMaxDepth + 2];           // level d occupies slots [lvl[d], lvl[d + 1])
  int levcount[kMaxDepth + 1];
  int64_t sp[kMaxDepth + 1];        // score of the best path to depth d
  int64_t lseq[kMaxDepth];
  int sel[3];
};

struct LevelsIO {
  int n, l, k;
  const uint64_t* topk;   // [l, k] this batch row's per-depth tokens, sorted by TokenKey
  const int64_t* lseq;    // [l]
  int32_t* tokens;        // [n]
  int32_t* parents;       // [n]
  int32_t* depths;        // [n]
  int32_t* anc;           // [(n + 1), (l + 1)] ancestor of each node at each depth, or nullptr
};

KD_DEV int LowerUpperBound(const int* a, int n, int x) {  // first index i in [0, n) with a[i] > x, else n
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] <= x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// k-th smallest (1-based) of key(i), i in [0, n): MSB-first radix select with 11-bit digits, starting at the highest
// bit where the keys differ, and stopping early once the selected digit's bin is needed whole (the k-th is then the
// largest key in it).
template <class Ctx, class Key>
KD_DEV uint64_t SelectKth(Ctx& c, int n, int k, Key key, int* hist, int* hscan, int* sel) {
  uint64_t lo = ~uint64_t{0}, hi = 0;
  for (int i = c.tid; i < n; i += c.nt) {
    const uint64_t u = key(i);
    lo = u < lo ? u : lo;
    hi = u > hi ? u : hi;
  }
  lo = c.MinU64(lo);
  hi = c.MaxU64(hi);
  if (lo == hi) return lo;
  int top = 63 - KD_CLZLL(lo ^ hi);                   // bits above `top` are shared by every key
  uint64_t mask = ~((uint64_t{2} << top) - 1);         // (2 << 63 wraps to 0: mask 0)
  uint64_t prefix = lo & mask;
  int krem = k;
  for (;;) {
    const int shift = top - kRadixBits + 1 > 0 ? top - kRadixBits + 1 : 0;
    const int bins = 1 << (top - shift + 1);
    for (int i = c.tid; i < bins; i += c.nt) hist[i] = 0;
    c.sync();
    for (int i = c.tid; i < n; i += c.nt) {
      const uint64_t u = key(i);
      if ((u & mask) == prefix) c.Count(&hist[(u >> shift) & static_cast<uint64_t>(bins - 1)]);
    }
    c.sync();
    c.ExclusiveScan(hist, hscan, bins);
    for (int i = c.tid; i < bins; i += c.nt) {
      if (hscan[i] < krem && krem <= hscan[i + 1]) {
        sel[0] = i;
        sel[1] = hscan[i];
        sel[2] = hscan[i + 1] - hscan[i];
      }
    }
    c.sync();
    const int bin = sel[0];
    krem -= sel[1];
    const bool whole = sel[2] == krem;
    c.sync();
    prefix |= static_cast<uint64_t>(bin) << shift;
    mask |= static_cast<uint64_t>(bins - 1) << shift;
    if (shift == 0) return prefix;
    if (whole) {
      uint64_t m = 0;
      for (int i = c.tid; i < n; i += c.nt) {
        const uint64_t u = key(i);
        if ((u & mask) == prefix && u > m) m = u;
      }
      return c.MaxU64(m);
    }
    top = shift - 1;
  }
}

// Calls emit(i, pos) for the `want` smallest key(i) (ties at kth broken by smaller i), pos = 0.. in order of i.
template <class Ctx, class Key, class Emit>
KD_DEV void OrderedKeep(Ctx& c, int n, int want, uint64_t kth, Key key, Emit emit) {
  int less = 0;
  for (int i = c.tid; i < n; i += c.nt) less += key(i) < kth ? 1 : 0;
  less = c.SumI32(less);
  const int ties_allowed = want - less;
  const int per = (n + c.nt - 1) / c.nt;
  const int lo = c.tid * per < n ? c.tid * per : n;
  const int hi = lo + per < n ? lo + per : n;
  int my_less = 0, my_ties = 0;
  for (int i = lo; i < hi; ++i) {
    const uint64_t u = key(i);
    my_less += u < kth ? 1 : 0;
    my_ties += u == kth ? 1 : 0;
  }
  int total;
  const int ties_before = c.ThreadExclusive(my_ties, &total);
  int my_kept_ties = ties_allowed - ties_before;
  my_kept_ties = my_kept_ties < 0 ? 0 : (my_kept_ties > my_ties ? my_ties : my_kept_ties);
  int pos = c.ThreadExclusive(my_less + my_kept_ties, &total);
  int tie = ties_before;
  for (int i = lo; i < hi; ++i) {
    const uint64_t u = key(i);
    bool keep = u < kth;
    if (u == kth) keep = tie++ < ties_allowed;
    if (keep) emit(i, pos++);
  }
  c.sync();
}

// Sorts k[0..n) ascending; n is a power of two.
template <class Ctx>
KD_DEV void BitonicSortKeys(Ctx& c, uint64_t* k, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = c.tid; i < (n >> 1); i += c.nt) {
        const int a = 2 * i - (i & (stride - 1));
        const int b = a + stride;
        if ((k[a] > k[b]) == ((a & size) == 0)) {
          const uint64_t t = k[a];
          k[a] = k[b];
          k[b] = t;
        }
      }
      c.sync();
    }
  }
}

// Sorts (k[i], v[i]) pairs ascending; n is a power of two.
template <class Ctx>
KD_DEV void BitonicSort(Ctx& c, uint64_t* k, int* v, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = c.tid; i < (n >> 1); i += c.nt) {
        const int a = 2 * i - (i & (stride - 1));
        const int b = a + stride;
        const bool up = (a & size) == 0;
        const bool greater = k[a] > k[b] || (k[a] == k[b] && v[a] > v[b]);
        if (greater == up) {
          const uint64_t tk = k[a];
          k[a] = k[b];
          k[b] = tk;
          const int tv = v[a];
          v[a] = v[b];
          v[b] = tv;
        }
      }
      c.sync();
    }
  }
}

template <class Ctx>
KD_DEV void BuildLevels(Ctx& c, const LevelsIO& io, char* arena, const LevelLayout& lay, LevelShared& sh,
                        int* hist, int* hscan) {
  const int N = io.n, L = io.l, K = io.k, CAP = static_cast<int>(lay.cap);
  float* xs = reinterpret_cast<float*>(arena + lay.xs);     // lay.qtab == 0
  int64_t* xq = reinterpret_cast<int64_t*>(arena + lay.xs);  // lay.qtab == 1
  const bool qtab = lay.qtab != 0;
  int64_t* key = reinterpret_cast<int64_t*>(arena + lay.key);
  int* par = reinterpret_cast<int*>(arena + lay.par);
  uint32_t* dj = reinterpret_cast<uint32_t*>(arena + lay.dj);
  int* cnt = reinterpret_cast<int*>(arena + lay.cnt);
  int64_t* tkey = reinterpret_cast<int64_t*>(arena + lay.tkey);
  int* tpar = reinterpret_cast<int*>(arena + lay.tpar);
  uint32_t* tdj = reinterpret_cast<uint32_t*>(arena + lay.tdj);
  int* crank = reinterpret_cast<int*>(arena + lay.crank);
  uint64_t* sortk = reinterpret_cast<uint64_t*>(arena + lay.sortk);
  int* sortv = reinterpret_cast<int*>(arena + lay.sortv);

  for (int i = c.tid; i < L * K; i += c.nt) {
    const float x = TokenKeyLogit(io.topk[i]);
    if (qtab) xq[i] = LogitQ(x); else xs[i] = x;
  }
  if (c.tid == 0) {
    for (int d = 0; d < L; ++d) sh.lseq[d] = io.lseq[d];
  }
  c.sync();
  auto q = [&](int d, int j) -> int64_t {
    const int i = (d - 1) * K + j;
    return (qtab ? xq[i] : LogitQ(xs[i])) - sh.lseq[d - 1];
  };
  if (c.tid == 0) {
    sh.sp[0] = 0;
    for (int d = 1; d <= L; ++d) sh.sp[d] = sh.sp[d - 1] + q(d, 0);
  }
  c.sync();

  // t0: the N-th best spine sibling. (i / K by a float reciprocal, corrected: exact for i < 2^24.)
  const float inv_k = 1.0f / static_cast<float>(K);
  auto spine_key = [&](int i) {
    int d = static_cast<int>(static_cast<float>(i) * inv_k);
    d -= d * K > i ? 1 : 0;
    d += (d + 1) * K <= i ? 1 : 0;
    return ScoreKey(sh.sp[d] + q(d + 1, i - d * K));
  };
  const uint64_t u0 = SelectKth(c, L * K, N, spine_key, hist, hscan, sh.sel);
  if (c.tid == 0) {
    sh.t = KeyScore(u0);
    sh.strict = 0;
    key[0] = 0;
    par[0] = -1;
    dj[0] = 0;
    sh.m = 1;
    sh.lvl[0] = 0;
    for (int d = 1; d <= L + 1; ++d) sh.lvl[d] = 1;
  }
  c.sync();

  auto count = [&](int64_t kp, int d) -> int {  // passing children of a node with score kp, at depth d
    const int64_t t = sh.t;
    const bool strict = sh.strict != 0;
    int lo = 0, hi = K;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      const int64_t s = kp + q(d, mid);
      if (strict ? s > t : s >= t) lo = mid + 1; else hi = mid;
    }
    return lo;
  };
  auto slot_key = [&](int i) { return ScoreKey(key[1 + i]); };

  for (int d = 1; d <= L; ++d) {
    int mode = 0;  // 0: write every passing child, 1: write the level's best N candidates
    int ps = 0, P = 0, M = 0, T = 0;
    for (;;) {
      ps = sh.lvl[d - 1];
      P = sh.lvl[d] - ps;
      M = sh.m;
      if (P == 0) break;
      for (int p = c.tid; p < P; p += c.nt) cnt[p] = count(key[ps + p], d);
      c.sync();
      c.ExclusiveScan(cnt, cnt, P);
      T = cnt[P];
      c.sync();
      if (M + T <= CAP) break;
      if (M - 1 > N) {
        // Trim the store to its best N nodes (score desc, slot asc); deeper nodes must now beat the N-th.
        const uint64_t kth = SelectKth(c, M - 1, N, slot_key, hist, hscan, sh.sel);
        for (int s = c.tid; s < M; s += c.nt) cnt[s] = s == 0 ? 0 : -1;
        if (c.tid == 0) {
          for (int e = 0; e <= L; ++e) sh.levcount[e] = 0;
        }
        c.sync();
        OrderedKeep(c, M - 1, N, kth, slot_key, [&](int i, int pos) { cnt[1 + i] = 1 + pos; });
        for (int s = 1 + c.tid; s < M; s += c.nt) {
          const int ns = cnt[s];
          if (ns > 0) {
            tkey[ns] = key[s];
            tpar[ns] = cnt[par[s]];
            tdj[ns] = dj[s];
            c.Count(&sh.levcount[dj[s] >> 24]);
          }
        }
        c.sync();
        for (int s = 1 + c.tid; s <= N; s += c.nt) {
          key[s] = tkey[s];
          par[s] = tpar[s];
          dj[s] = tdj[s];
        }
        if (c.tid == 0) {
          sh.m = N + 1;
          sh.t = KeyScore(kth);
          sh.strict = 1;
          for (int e = 1; e < d; ++e) sh.lvl[e + 1] = sh.lvl[e] + sh.levcount[e];
        }
        c.sync();
        continue;
      }
      // One level too large even for a trimmed store (P <= N here): cap each parent by its within-level rank.
      const int p2 = static_cast<int>(NextPow2(P));
      for (int i = c.tid; i < p2; i += c.nt) {
        sortk[i] = i < P ? ScoreKey(key[ps + i]) : ~uint64_t{0};
        sortv[i] = i < P ? i : 0x7fffffff;
      }
      c.sync();
      BitonicSort(c, sortk, sortv, p2);
      for (int r = c.tid; r < P; r += c.nt) crank[sortv[r]] = r;
      c.sync();
      for (int p = c.tid; p < P; p += c.nt) {
        const int all = count(key[ps + p], d);
        const int cap = N / (crank[p] + 1);
        cnt[p] = all < cap ? all : cap;
      }
      c.sync();
      c.ExclusiveScan(cnt, cnt, P);
      T = cnt[P];
      c.sync();
      mode = M + T <= CAP ? 0 : 1;
      break;
    }
    if (P == 0) break;
    auto child = [&](int k, int* p, int* j) {
      *p = LowerUpperBound(cnt, P + 1, k) - 1;
      *j = k - cnt[*p];
    };
    auto put = [&](int k, int slot) {
      int p, j;
      child(k, &p, &j);
      key[slot] = key[ps + p] + q(d, j);
      par[slot] = ps + p;
      dj[slot] = (static_cast<uint32_t>(d) << 24) | static_cast<uint32_t>(j);
    };
    int added = T;
    if (mode == 0) {
      for (int k = c.tid; k < T; k += c.nt) put(k, M + k);
    } else {
      auto vkey = [&](int k) {
        int p, j;
        child(k, &p, &j);
        return ScoreKey(key[ps + p] + q(d, j));
      };
      const uint64_t kth = SelectKth(c, T, N, vkey, hist, hscan, sh.sel);
      OrderedKeep(c, T, N, kth, vkey, [&](int k, int pos) { put(k, M + pos); });
      added = N;
    }
    c.sync();
    if (c.tid == 0) {
      sh.lvl[d + 1] = M + added;
      sh.m = M + added;
    }
    c.sync();
  }

  // The best N stored nodes, sorted by (score desc, slot asc): the tree in pop order.
  const int M = sh.m;
  const int p2 = static_cast<int>(NextPow2(N));
  const uint64_t kth = SelectKth(c, M - 1, N, slot_key, hist, hscan, sh.sel);
  OrderedKeep(c, M - 1, N, kth, slot_key, [&](int i, int pos) {
    sortk[pos] = ScoreKey(key[1 + i]);
    sortv[pos] = 1 + i;
  });
  for (int i = N + c.tid; i < p2; i += c.nt) {
    sortk[i] = ~uint64_t{0};
    sortv[i] = 0x7fffffff;
  }
  c.sync();
  BitonicSort(c, sortk, sortv, p2);
  for (int i = c.tid; i < N; i += c.nt) cnt[sortv[i]] = i;
  c.sync();
  for (int i = c.tid; i < N; i += c.nt) {
    const int s = sortv[i];
    const int d = static_cast<int>(dj[s] >> 24);
    const int j = static_cast<int>(dj[s] & 0xffffffu);
    io.tokens[i] = TokenKeyId(io.topk[(d - 1) * K + j]);
    io.depths[i] = d;
    const int ps = par[s];
    io.parents[i] = ps == 0 ? 0 : cnt[ps] + 1;
    if (io.anc != nullptr) {
      int node = i + 1, slot = s;
      for (int e = d; e > 0; --e) {
        io.anc[(i + 1) * (L + 1) + e] = node;
        slot = par[slot];
        node = slot == 0 ? 0 : cnt[slot] + 1;
      }
      io.anc[(i + 1) * (L + 1)] = 0;
    }
  }
  if (io.anc != nullptr && c.tid == 0) io.anc[0] = 0;
  c.sync();
}

}  // namespace kdtree
