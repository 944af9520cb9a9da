// Device helpers shared by the CUDA handlers that stream weights (marlin_moe.cu, fused_dot.cu):
// shared-memory addresses, cp.async copies, streaming loads into registers, ldmatrix, one m16n8k16 mma, programmatic
// dependent launch. Inline PTX, sm_80+ (griddepcontrol: sm_90).
#pragma once

#include <cstdint>

namespace {

__device__ __forceinline__ uint32_t SmemAddress(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16 bytes global -> shared, cached in L2 only (streamed weights); l2_256: ask L2 to fetch the whole 256-byte line.
__device__ __forceinline__ void CopyAsync16Cg(uint32_t dst, const void* src, bool l2_256 = false) {
  if (l2_256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  }
}

// 16 bytes global -> shared, L2 only; zero-filled (src not read) when !valid.
__device__ __forceinline__ void CopyAsync16CgZ(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

__device__ __forceinline__ void CopyCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void CopyWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices from shared memory: lane i gives the address of row i % 8 of matrix i / 8; lane (g, t)
// (g = lane / 4, t = lane % 4) receives, in r[j], elements 2t and 2t + 1 of row g of matrix j.
__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// The same, transposed: lane (g, t) receives elements g of rows 2t and 2t + 1 of matrix j.
__device__ __forceinline__ void LdsmT4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// d[0..3] += A B for one m16n8k16 tile (bf16 inputs, fp32 accumulators): A's fragment a, B's b0, b1.
__device__ __forceinline__ void MmaAt(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> registers, for data read once (streamed weights): not cached in L1; l2_256: ask L2 to fetch the
// whole 256-byte line (the neighbouring lanes or blocks read the rest).
__device__ __forceinline__ uint4 LoadStream16(const void* ptr, bool l2_256) {
  uint4 v;
  if (l2_256) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  }
  return v;
}

// Programmatic dependent launch (sm_90): wait until the kernel before this one on the stream has ended and its
// writes are visible; let the kernel after this one start launching. Both do nothing without a PDL launch.
__device__ __forceinline__ void GridDependencyWait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void LaunchDependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

}  // namespace
