// hopper_dequant_gemm's dequantisation for weights with zero points (dequant_gemm's zeros=1, w = s·(q − z)):
// hopper_dequant.cuh's 8-weight helper with the row's zero point z in place of 8 (a k step lies in one group,
// so z is one value per row and step, loaded with the scale). Kept beside hopper_dequant.cuh rather than in it,
// so that the kernels of zero point 8 carry the same source as before.
#ifndef AUTOSCHED_HOPPER_DEQUANT_ZEROS_CUH
#define AUTOSCHED_HOPPER_DEQUANT_ZEROS_CUH

#include "hopper_dequant.cuh"

// value + q minus value + z (value: 1024 in fp16, 128 in bf16) is q - z exactly for zero points up to 128
// (bf16's integers are exact to 256); the multiplication by the scale rounds once, as the workload's does.
template <typename T>
__device__ __forceinline__ void autosched_dequant8_zeros(void* tile, const void* packed, int r, int j, float scale,
                                                         float zero) {
  using pair = typename autosched_dtype<T>::pair;
  // byte b of the word holds k = 8j + 2b (low nibble) and 8j + 2b + 1
  const uint32_t q = reinterpret_cast<const uint32_t*>(packed)[r * 8 + j];
  const pair s2 = autosched_dtype<T>::splat(scale);
  const pair m2 = autosched_dtype<T>::splat(autosched_q4_magic<T>::MINUS - 8.f + zero);
  pair w[4];  // w[i]: k = 8j + i and 8j + i + 4
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t v = ((q >> (4 * i)) & 0x000F000Fu) | autosched_q4_magic<T>::BITS;
    w[i] = __hmul2(__hsub2(*reinterpret_cast<pair*>(&v), m2), s2);
  }
  const uint32_t* u = reinterpret_cast<const uint32_t*>(w);
  const uint4 out = make_uint4(__byte_perm(u[0], u[1], 0x5410u), __byte_perm(u[2], u[3], 0x5410u),
                               __byte_perm(u[0], u[1], 0x7632u), __byte_perm(u[2], u[3], 0x7632u));
  // 128-byte swizzle, as TMA writes it: 16-byte chunk j of row r at chunk j ^ (r % 8)
  *reinterpret_cast<uint4*>(static_cast<char*>(tile) + r * 128 + ((j ^ (r & 7)) << 4)) = out;
}
#define AUTOSCHED_DEQUANT8_ZEROS(NAME, T)                                                                   \
  __device__ __forceinline__ void NAME(void* tile, const void* packed, int r, int j, float scale,           \
                                       float zero) {                                                        \
    autosched_dequant8_zeros<T>(tile, packed, r, j, scale, zero);                                           \
  }

#endif  // AUTOSCHED_HOPPER_DEQUANT_ZEROS_CUH
