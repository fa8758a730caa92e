// SPDX-License-Identifier: Apache-2.0
// Device helpers of the decode kernels (cuda_attention.cu; topk.cu takes the conversions): 16-bit
// element conversions, a one-instruction exp2, cp.async copies into shared memory, ldmatrix, and
// mma.sync m16n8k16 with an A operand whose rows 8..15 are zero (8 query heads) plus the hi + lo
// split that carries an fp32 query through a 16-bit A operand; mma.sync m16n8k8 on tf32 with the
// 3xTF32 split (retro_kmeans.cu); and env_flag, the host's benchmark switches.
// Include from .cu files.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace kvs::cuda::kutil {

// A benchmark knob: on unless the environment variable `name` is set to 0 (read once into flag,
// -1 until then; a setter may store 0 or 1 first). Host code.
inline bool env_flag(std::atomic<int>& flag, const char* name) {
  int v = flag.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv(name);
    v = (e && *e) ? (std::atoi(e) != 0) : 1;
    flag.store(v, std::memory_order_relaxed);
  }
  return v != 0;
}

template <typename T>
struct Cvt;
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ void f32x8(const uint4& u, float (&f)[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ void f32x8(const uint4& u, float (&f)[8]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 p = __half22float2(h);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  static __device__ __forceinline__ __half from(float x) { return __float2half_rn(x); }
};

// 2^x with one MUFU op; x <= 0 here (scores minus a running max), -inf gives 0, and results
// below 2^-126 flush to 0 (they are below fp32 resolution of the sums anyway).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- cp.async --------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = pred ? 16 : 0;  // 0: no global read, the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#pragma nv_diag_suppress 550  // d2/d3 below: padding rows of the product, set and dropped
template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float x0, float x1) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);  // x0 in the low half (lower column)
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
  }
  static __device__ __forceinline__ float round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
  // c[0..1] += A * B for an A whose rows 8..15 are zero (a1 = a3 = 0).
  static __device__ __forceinline__ void mma(float (&c)[2], uint32_t a0, uint32_t a2, uint32_t b0,
                                             uint32_t b1) {
    float d2, d3;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(0.f),
          "f"(0.f));
  }
};
template <>
struct Mma<__half> {
  static __device__ __forceinline__ uint32_t pack(float x0, float x1) {
    __half2 v = __floats2half2_rn(x0, x1);
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
  }
  static __device__ __forceinline__ float round(float x) { return __half2float(__float2half_rn(x)); }
  static __device__ __forceinline__ void mma(float (&c)[2], uint32_t a0, uint32_t a2, uint32_t b0,
                                             uint32_t b1) {
    float d2, d3;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(0.f),
          "f"(0.f));
  }
};

#pragma nv_diag_default 550

__device__ __forceinline__ void ldsm_x4(const void* p, uint32_t& x0, uint32_t& x1, uint32_t& x2,
                                        uint32_t& x3) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
               : "r"(s)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(const void* p, uint32_t& x0, uint32_t& x1,
                                              uint32_t& x2, uint32_t& x3) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
               : "r"(s)
               : "memory");
}

// Split x into hi + lo, both representable in T (|x - hi - lo| ~ 2^-16 |x| for bf16).
template <typename T>
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const float h0 = Mma<T>::round(x0), h1 = Mma<T>::round(x1);
  hi = Mma<T>::pack(h0, h1);
  lo = Mma<T>::pack(x0 - h0, x1 - h1);
}

// mma.sync m16n8k8 with tf32 operands, fp32 accumulate: c += A (16 x 8, row) * B (8 x 8, col).
// Fragments (g = lane / 4, t = lane % 4): a[0] (g, t), a[1] (g + 8, t), a[2] (g, t + 4), a[3]
// (g + 8, t + 4); b[0] (k t, n g), b[1] (k t + 4, n g); c[0..1] (g, 2t..2t+1), c[2..3] (g + 8, ...).
__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t u;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(u) : "f"(x));
  return u;
}
// x as big + small tf32 parts (3xTF32: big*big + big*small + small*big keeps about fp32's accuracy).
__device__ __forceinline__ void tf32_split(float x, uint32_t& big, uint32_t& small) {
  big = tf32(x);
  small = tf32(x - __uint_as_float(big));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace kvs::cuda::kutil
