// KdCrc32: the CRC-32 of zlib (reflected polynomial 0xEDB88320, pre- and post-inverted), for the checksums that
// checked loads compare (kdtree_jax/checkpoint.py). Not a custom call: a plain C function called through ctypes,
// which releases the GIL, so the loader's worker threads run it side by side.
//
// Why: zlib 1.2's byte-table CRC runs at ~2 GB/s a core, which on a few cores makes a checked load a third slower
// than an unchecked one. Folding with carry-less multiplies (PCLMULQDQ) runs several times faster.
//
// The method (GF(2) polynomials; bytes in the reflected order, so the first bit of the message is its highest
// coefficient). The raw CRC with a zero start, crc0(S) = S(x) x^32 mod P, depends only on S mod P, and ignores
// leading zero bytes. A 16-byte block A followed by n more bytes contributes A(x) x^(8 n). Splitting A into its two
// 64-bit halves, A = H x^64 + L, and moving it d bits further on gives A x^d = H x^(64 + d) + L x^d, congruent to
// H k_hi + L k_lo with k_hi = x^(64 + d) mod P and k_lo = x^d mod P (degree < 32): two carry-less multiplies of
// 64 x 32 bits whose sum (degree < 96) is XORed into the block d bits further on. Read as reflected values, the
// product of a carry-less multiply is the polynomial product times x, so each constant is stored as
// x^(e - 1) mod P, which makes the product congruent to the one wanted. Four registers fold the data 64 bytes at a
// time (d = 512), then fold into one (d = 128), then one 16-byte block at a time; what is left, the 16 bytes of
// the register and the last n < 16 bytes, has the same crc0 as the whole message and is finished a byte at a time.
// The start value enters as zlib's does: its inverse XORed into the first 4 bytes. The constants are computed
// here, not copied; tests/test_robustness.py compares the result with zlib's for every length 0..600, start value and
// alignment, and for large arrays.

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KD_CRC_X86 1
#endif

namespace {

struct Tables {
  uint32_t bytes[256];  // zlib's byte table
  uint64_t fold512[2];  // {x^(511) mod P, x^(575) mod P} as reflected 64-bit constants (low, high qword)
  uint64_t fold128[2];  // {x^(127) mod P, x^(191) mod P}
};

uint32_t Reflect32(uint32_t v) {
  uint32_t r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}

// x^e mod P in the normal order (bit d: the coefficient of x^d), P = x^32 + 0x04C11DB7.
uint32_t XPowModP(int e) {
  uint32_t r = 1;
  for (int i = 0; i < e; ++i) r = (r << 1) ^ ((r & 0x80000000u) ? 0x04C11DB7u : 0u);
  return r;
}

// A remainder of degree < 32 as the 64-bit reflected operand of a carry-less multiply: the coefficient of x^d at
// bit 63 - d.
uint64_t FoldConstant(int e) { return static_cast<uint64_t>(Reflect32(XPowModP(e))) << 32; }

const Tables& GetTables() {
  static const Tables t = [] {
    Tables s{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      s.bytes[n] = c;
    }
    // The low qword of a register holds its higher-degree half H, folded with x^(64 + d); the high qword L with
    // x^d. Each constant is x^(e - 1): see the header.
    s.fold512[0] = FoldConstant(64 + 512 - 1);
    s.fold512[1] = FoldConstant(512 - 1);
    s.fold128[0] = FoldConstant(64 + 128 - 1);
    s.fold128[1] = FoldConstant(128 - 1);
    return s;
  }();
  return t;
}

// The raw reflected CRC update (no inversion), a byte at a time.
uint32_t Bytewise(uint32_t c, const uint8_t* p, size_t n) {
  const uint32_t* table = GetTables().bytes;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return c;
}

#ifdef KD_CRC_X86
__attribute__((target("pclmul,sse4.1"))) inline __m128i Fold(__m128i a, __m128i k, __m128i next) {
  // k's low qword multiplies a's low qword (H), k's high qword a's high qword (L)
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00), _mm_clmulepi64_si128(a, k, 0x11)), next);
}

// The raw CRC update of n >= 64 bytes from state c, by folding.
__attribute__((target("pclmul,sse4.1"))) uint32_t Folded(uint32_t c, const uint8_t* p, size_t n) {
  const Tables& t = GetTables();
  const __m128i k512 = _mm_set_epi64x(static_cast<long long>(t.fold512[1]), static_cast<long long>(t.fold512[0]));
  const __m128i k128 = _mm_set_epi64x(static_cast<long long>(t.fold128[1]), static_cast<long long>(t.fold128[0]));
  auto load = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  __m128i r0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));  // the state into bytes 0..3
  __m128i r1 = load(p + 16), r2 = load(p + 32), r3 = load(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    r0 = Fold(r0, k512, load(p));
    r1 = Fold(r1, k512, load(p + 16));
    r2 = Fold(r2, k512, load(p + 32));
    r3 = Fold(r3, k512, load(p + 48));
  }
  __m128i r = Fold(Fold(Fold(r0, k128, r1), k128, r2), k128, r3);
  for (; n >= 16; p += 16, n -= 16) r = Fold(r, k128, load(p));
  alignas(16) uint8_t rest[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(rest), r);
  return Bytewise(Bytewise(0, rest, 16), p, n);
}

bool HasClmul() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  }();
  return ok;
}
#endif

}  // namespace

extern "C" {

// zlib.crc32(data, crc): the CRC-32 of n bytes at data, continuing from crc (0 to start).
__attribute__((visibility("default"))) uint32_t KdCrc32(uint32_t crc, const void* data, uint64_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#ifdef KD_CRC_X86
  if (n >= 64 && HasClmul()) return ~Folded(c, p, n);
#endif
  return ~Bytewise(c, p, n);
}

// 1 when KdCrc32 folds with carry-less multiplies on this CPU, 0 when it runs a byte at a time.
__attribute__((visibility("default"))) int KdCrc32Folds() {
#ifdef KD_CRC_X86
  return HasClmul() ? 1 : 0;
#else
  return 0;
#endif
}

}  // extern "C"
