// gemv8's chunk helpers (search_spaces/templates/gemv8.py explains the kernel): 8-bit weights, int8 codes or the
// bits of float8 E4M3FN numbers, one lane's 16-weight chunk (16 bytes) at a time. Each helper streams the chunk in,
// converts it to fp32 once (autosched_q8_unpack, autosched_e4m3_unpack), then adds its product with each of M
// activation rows to that row's accumulator (autosched_q8_row). The channel's scale is applied by the kernel once,
// after the warp's sum. gemv8.py names each helper per point, with one accumulator parameter per row.
#ifndef AUTOSCHED_GEMV8_CUH
#define AUTOSCHED_GEMV8_CUH

#include "common.cuh"

// int8: w = q, exactly. q ^ 0x80 is q + 128 (0 to 255) as an unsigned byte; in the low mantissa bits of 2^23 it
// makes the float 2^23 + q + 128, and subtracting 2^23 + 128 leaves q (integers below 2^24 are exact in fp32).
// Two full-rate instructions per weight (a byte permute, an add), where a cvt from int8 issues at a quarter of
// the rate the weights arrive at.
__device__ __forceinline__ void autosched_q8_unpack(const void* wp, float (&w)[16]) {
  uint4 q4 = autosched_ld_stream_v4(wp);
  const uint32_t q[4] = {q4.x ^ 0x80808080u, q4.y ^ 0x80808080u, q4.z ^ 0x80808080u, q4.w ^ 0x80808080u};
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    #pragma unroll
    for (int b = 0; b < 4; ++b) w[4 * j + b] = __uint_as_float(0x4B000000u | ((q[j] >> (8 * b)) & 0xFFu)) - 8388736.f;
  }
}

// float8 E4M3FN (OCP: sign, 4 exponent bits biased by 7, 3 mantissa bits, no infinities): w / 256, exactly, as
// a half. The code's sign goes to the half's sign bit, its exponent and mantissa to the half's low 4 exponent
// bits and top 3 mantissa bits: ((b & 0x80) << 8) | ((b & 0x7F) << 7). The half's exponent bias is 15, so a
// normal code (e > 0) reads 2^(e - 15)·(1 + m/8) = 2^-8 · 2^(e - 7)·(1 + m/8), and a subnormal one (e = 0)
// m/8 · 2^-14 = 2^-8 · m/8 · 2^-6: every code is its value over 256 (halves keep their subnormals; the
// conversion to fp32 is exact). The NaN codes 0x7F and 0xFF (exponent and mantissa all ones) would read 1.875:
// (b & 0x7F) + 1 carries into bit 7 for them alone, and that bit goes to the half's top exponent bit, making
// exponent 31 with a nonzero mantissa, a NaN. The 2^8 goes into the channel's scale (a power of two: the sums
// are those of the exact weights, scaled).
__device__ __forceinline__ void autosched_e4m3_unpack(const void* wp, float (&w)[16]) {
  uint4 q4 = autosched_ld_stream_v4(wp);
  const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w};
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t magnitude = q[j] & 0x7F7F7F7Fu;
    const uint32_t u = magnitude | ((magnitude + 0x01010101u) & 0x80808080u);  // bit 7: a NaN code
    uint32_t even = ((q[j] << 8) & 0x80008000u) | ((u << 7) & 0x7F807F80u);  // bytes 0, 2
    uint32_t odd = (q[j] & 0x80008000u) | ((u >> 1) & 0x7F807F80u);         // bytes 1, 3
    const float2 e = __half22float2(*reinterpret_cast<__half2*>(&even));
    const float2 o = __half22float2(*reinterpret_cast<__half2*>(&odd));
    w[4 * j] = e.x; w[4 * j + 1] = o.x; w[4 * j + 2] = e.y; w[4 * j + 3] = o.y;
  }
}

// One activation row's product with a chunk's 16 weights (k order), in fp32, added to the row's accumulator.
template <typename T>
__device__ __forceinline__ void autosched_q8_row(float& acc, const float (&w)[16], const void* xp, int i,
                                                 int row_bytes) {
  const uint4* x = reinterpret_cast<const uint4*>(static_cast<const char*>(xp) + i * row_bytes);
  float s = 0.f;
  #pragma unroll
  for (int v = 0; v < 2; ++v) {
    uint4 a = x[v];
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w};
    #pragma unroll
    for (int t = 0; t < 4; ++t) {
      float2 f = autosched_dtype<T>::to_float2(*reinterpret_cast<const typename autosched_dtype<T>::pair*>(&aw[t]));
      s += f.x * w[v * 8 + 2 * t];  // one FMA per weight
      s += f.y * w[v * 8 + 2 * t + 1];
    }
  }
  acc += s;
}

#endif  // AUTOSCHED_GEMV8_CUH
