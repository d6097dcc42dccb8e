// int4_gemv's CUDA-core kernel helpers (search_spaces/templates/int4_gemv.py explains the kernel): the warp
// sum, and the chunk helpers that add one lane's 32-weight chunk (16 packed bytes) times each of M activation
// rows to that row's accumulator. int4_gemv.py names each helper per point, with one accumulator parameter per row.
#ifndef AUTOSCHED_INT4_GEMV_CUH
#define AUTOSCHED_INT4_GEMV_CUH

#include "common.cuh"

__device__ __forceinline__ void autosched_warp_sum(float& x) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
}

// Products in fp32: the nibbles become half2 1024 + q by one mask-and-or (1024's exponent leaves the
// mantissa's last four bits to the nibble), then q - 8 by one subtraction, exactly.
// A chunk helper streams its 16 bytes in, unpacks them once (autosched_q4_unpack), then adds each row's
// product (autosched_q4_row) to that row's accumulator.
__device__ __forceinline__ void autosched_q4_unpack_bits(uint4 q4, float (&w)[32]) {  // a chunk already loaded
  const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w};
  // w: q - 8 in k order: byte b of word j holds k = 8j + 2b (low nibble), 8j + 2b + 1
  const __half2 bias = __float2half2_rn(1032.f);
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
__device__ __forceinline__ void autosched_q4_unpack(const void* wp, float (&w)[32]) {
  autosched_q4_unpack_bits(autosched_ld_stream_v4(wp), w);
}
template <typename T>
__device__ __forceinline__ void autosched_q4_row(float& acc, const float (&w)[32], const void* xp, int i,
                                                 int row_bytes, float scale) {
  {
    const uint4* x = reinterpret_cast<const uint4*>(static_cast<const char*>(xp) + i * row_bytes);
    float s = 0.f;
    #pragma unroll
    for (int v = 0; v < 4; ++v) {
      uint4 a = x[v];
      const uint32_t aw[4] = {a.x, a.y, a.z, a.w};
      #pragma unroll
      for (int t = 0; t < 4; ++t) {
        float2 f = autosched_dtype<T>::to_float2(*reinterpret_cast<const typename autosched_dtype<T>::pair*>(&aw[t]));
        s += f.x * w[v * 8 + 2 * t] + f.y * w[v * 8 + 2 * t + 1];
      }
    }
    acc += s * scale;
  }
}

// fp16 with products in half2: about half the instructions per weight. Weights become (q - 8) / 16, exactly,
// by one half2 FMA per two nibbles (a low nibble is 1024 + q under 0x6400's exponent, a high one 1024 + 16q);
// the 1/16 keeps a half's sum of 8 products below 4 |x|, so activations up to 16384 in magnitude cannot
// overflow. Activation pairs are regrouped to the nibbles' order, (k, k + 4), by byte permutes; every two
// words' half2 sums go to fp32, and the chunk's sum is scaled by 16 x its group's scale.
__device__ __forceinline__ void autosched_q4_unpack_half_bits(uint4 q4, __half2 (&w)[4][4]) {
  const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w};
  // w[j][t]: (q - 8) / 16 of k = 8j + t and 8j + t + 4 (byte b of word j holds k = 8j + 2b, 8j + 2b + 1)
  const __half2 lo_mul = __float2half2_rn(0.0625f), lo_add = __float2half2_rn(-64.5f);
  const __half2 hi_mul = __float2half2_rn(0.00390625f), hi_add = __float2half2_rn(-4.5f);
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
__device__ __forceinline__ void autosched_q4_unpack_half(const void* wp, __half2 (&w)[4][4]) {
  autosched_q4_unpack_half_bits(autosched_ld_stream_v4(wp), w);
}
__device__ __forceinline__ void autosched_q4_row_half(float& acc, const __half2 (&w)[4][4], const void* xp, int i,
                                                      int row_bytes, float scale) {
  const float scale16 = 16.f * scale;
  {
    const uint4* x = reinterpret_cast<const uint4*>(static_cast<const char*>(xp) + i * row_bytes);
    float s = 0.f;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      __half2 h = __float2half2_rn(0.f);
      #pragma unroll
      for (int v = 2 * half; v < 2 * half + 2; ++v) {
        const uint4 a = x[v];  // k = 8v .. 8v + 7
        uint32_t pairs[4] = {(a.x & 0xFFFFu) | (a.z << 16), (a.x >> 16) | (a.z & 0xFFFF0000u),
                             (a.y & 0xFFFFu) | (a.w << 16), (a.y >> 16) | (a.w & 0xFFFF0000u)};
        #pragma unroll
        for (int t = 0; t < 4; ++t) h = __hfma2(*reinterpret_cast<__half2*>(&pairs[t]), w[v][t], h);
      }
      const float2 f = __half22float2(h);
      s += f.x + f.y;
    }
    acc += s * scale16;
  }
}

#endif  // AUTOSCHED_INT4_GEMV_CUH
