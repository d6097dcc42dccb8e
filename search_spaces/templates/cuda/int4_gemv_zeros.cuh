// int4_gemv's CUDA-core chunk helpers for weights with zero points (dequant_gemm's zeros=1, w = s·(q − z)):
// the unpacking of int4_gemv.cuh with the chunk's zero point z in place of 8. A chunk lies in one group, so
// z is one value per chunk, loaded with the scale. Kept beside int4_gemv.cuh rather than in it, so that the
// kernels of zero point 8 carry the same source as before. Exact for zero points 0 to 63 (AWQ's 0-15,
// GPTQ v1's 1-16).
#ifndef AUTOSCHED_INT4_GEMV_ZEROS_CUH
#define AUTOSCHED_INT4_GEMV_ZEROS_CUH

#include "int4_gemv.cuh"

// Products in fp32: half2 1024 + q minus 1024 + z gives q - z exactly (integers to 2048 are exact in fp16).
__device__ __forceinline__ void autosched_q4_unpack_zeros_bits(uint4 q4, float (&w)[32], float zero) {
  const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w};
  // w: q - z in k order: byte b of word j holds k = 8j + 2b (low nibble), 8j + 2b + 1
  const __half2 bias = __float2half2_rn(1024.f + zero);
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    #pragma unroll
    for (int s = 0; s < 2; ++s) {  // low nibbles, then high
      uint32_t even = ((q[j] >> (4 * s)) & 0x000F000Fu) | 0x64006400u;     // bytes 0, 2
      uint32_t odd = ((q[j] >> (4 * s + 8)) & 0x000F000Fu) | 0x64006400u;  // bytes 1, 3
      float2 e = __half22float2(__hsub2(*reinterpret_cast<__half2*>(&even), bias));
      float2 o = __half22float2(__hsub2(*reinterpret_cast<__half2*>(&odd), bias));
      w[8 * j + s] = e.x; w[8 * j + 4 + s] = e.y; w[8 * j + 2 + s] = o.x; w[8 * j + 6 + s] = o.y;
    }
  }
}
__device__ __forceinline__ void autosched_q4_unpack_zeros(const void* wp, float (&w)[32], float zero) {
  autosched_q4_unpack_zeros_bits(autosched_ld_stream_v4(wp), w, zero);
}

// Products in half2: weights (q - z) / 32, exactly, by one half2 FMA per two nibbles (a low nibble is 1024 + q
// under 0x6400's exponent, a high one 1024 + 16q; the added constants 32 + z/32 and 2 + z/32 are exact for z
// under 64). q - z spans twice q - 8's range, so 1/32 rather than int4_gemv.cuh's 1/16 keeps a half's sum of
// 8 products within 4 |x| for z up to 16 (the same overflow bound). Same layout as autosched_q4_unpack_half.
__device__ __forceinline__ void autosched_q4_unpack_half_zeros_bits(uint4 q4, __half2 (&w)[4][4], float zero) {
  const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w};
  const __half2 lo_mul = __float2half2_rn(0.03125f), lo_add = __float2half2_rn(-32.f - zero * 0.03125f);
  const __half2 hi_mul = __float2half2_rn(0.001953125f), hi_add = __float2half2_rn(-2.f - zero * 0.03125f);
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    #pragma unroll
    for (int s = 0; s < 2; ++s) {  // bytes 0 and 2, then 1 and 3
      const uint32_t v = q[j] >> (8 * s);
      uint32_t lo = (v & 0x000F000Fu) | 0x64006400u, hi = (v & 0x00F000F0u) | 0x64006400u;
      w[j][2 * s] = __hfma2(*reinterpret_cast<__half2*>(&lo), lo_mul, lo_add);
      w[j][2 * s + 1] = __hfma2(*reinterpret_cast<__half2*>(&hi), hi_mul, hi_add);
    }
  }
}
__device__ __forceinline__ void autosched_q4_unpack_half_zeros(const void* wp, __half2 (&w)[4][4], float zero) {
  autosched_q4_unpack_half_zeros_bits(autosched_ld_stream_v4(wp), w, zero);
}
// autosched_q4_row_half scales by 16 x scale for (q - 8) / 16: (q - z) / 32 needs twice that (a power of two,
// exact).
__device__ __forceinline__ void autosched_q4_row_half_zeros(float& acc, const __half2 (&w)[4][4], const void* xp,
                                                            int i, int row_bytes, float scale) {
  autosched_q4_row_half(acc, w, xp, i, row_bytes, 2.f * scale);
}

#endif  // AUTOSCHED_INT4_GEMV_ZEROS_CUH
