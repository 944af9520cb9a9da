// Small numeric helpers shared by the C++ (CPU) handlers: bf16 <-> float and an fp32 dot product.
#pragma once

#include <cstdint>
#include <cstring>

namespace kdtree {

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) {  // bf16 bits -> float (exact)
  const uint32_t u = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t Bf16Bits(float x) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// float -> the handler's element type (fp32 as is, bf16 rounded to nearest even)
inline void FromFloat(float x, float* out) { *out = x; }
inline void FromFloat(float x, uint16_t* out) { *out = Bf16Bits(x); }

// fp32 dot product with eight running sums (vectorizes without reassociation flags).
inline float Dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) part[0] += a[i] * b[i];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

}  // namespace kdtree
