"""Device wrappers around the inline PTX of tensor-core and async-copy work (sm_80+).

Generated kernels use only these functions for mma / ldmatrix / cp.async, so the test emulator
(which defines TPP_CUDA_EMULATION and supplies host versions with exactly these signatures) can
run the same source on the CPU.

  tpp_mma_bf16_16816 / tpp_mma_f16_16816   d += a*b, one m16n8k16 tile, f32 accumulators
                                           (mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16})
  tpp_ldmatrix_x{1,2,4}[_trans]            ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16;
                                           lane l passes the address of row l%8 of matrix l/8
  tpp_cp_async_16                          cp.async.cg.shared.global, 16 bytes, of which the last
                                           16 - src_bytes are zero-filled (src_bytes 0..16)
  tpp_cp_async_commit / tpp_cp_async_wait<N>   commit_group / wait_group N
"""
from __future__ import annotations

PREAMBLE = r"""#ifndef TPP_CUDA_EMULATION
#ifndef TPP_CUDA_PTX_PREAMBLE
#define TPP_CUDA_PTX_PREAMBLE
__device__ __forceinline__ unsigned tpp_smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void tpp_mma_bf16_16816(float d[4], const unsigned a[4],
                                                   const unsigned b[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void tpp_mma_f16_16816(float d[4], const unsigned a[4],
                                                  const unsigned b[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void tpp_ldmatrix_x1(unsigned r[1], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0]) : "r"(tpp_smem_addr(smem_row)));
}
__device__ __forceinline__ void tpp_ldmatrix_x2(unsigned r[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(tpp_smem_addr(smem_row)));
}
__device__ __forceinline__ void tpp_ldmatrix_x4(unsigned r[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(tpp_smem_addr(smem_row)));
}
__device__ __forceinline__ void tpp_ldmatrix_x2_trans(unsigned r[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(tpp_smem_addr(smem_row)));
}
__device__ __forceinline__ void tpp_ldmatrix_x4_trans(unsigned r[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(tpp_smem_addr(smem_row)));
}
__device__ __forceinline__ void tpp_cp_async_16(void* smem_dst, const void* gmem_src,
                                                int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(tpp_smem_addr(smem_dst)), "l"(gmem_src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void tpp_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void tpp_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
#endif
#endif
"""
