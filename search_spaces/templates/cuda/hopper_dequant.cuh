// hopper_dequant_gemm's dequantisation: 8 int4 weights of row r, 16-byte chunk j of a packed 64-column
// tile, written as T times the group's scale into the B tile where TMA would have put them (128-byte swizzle).
#ifndef AUTOSCHED_HOPPER_DEQUANT_CUH
#define AUTOSCHED_HOPPER_DEQUANT_CUH

#include "common.cuh"

// A nibble q under the exponent of 1024 (fp16) or 128 (bf16) is that value + q; MINUS is that value + 8.
template <typename T> struct autosched_q4_magic;
template <> struct autosched_q4_magic<half> { static constexpr uint32_t BITS = 0x64006400u; static constexpr float MINUS = 1032.f; };
template <> struct autosched_q4_magic<nv_bfloat16> { static constexpr uint32_t BITS = 0x43004300u; static constexpr float MINUS = 136.f; };

template <typename T>
__device__ __forceinline__ void autosched_dequant8(void* tile, const void* packed, int r, int j, float scale) {
  using pair = typename autosched_dtype<T>::pair;
  // byte b of the word holds k = 8j + 2b (low nibble) and 8j + 2b + 1
  const uint32_t q = reinterpret_cast<const uint32_t*>(packed)[r * 8 + j];
  const pair s2 = autosched_dtype<T>::splat(scale), m2 = autosched_dtype<T>::splat(autosched_q4_magic<T>::MINUS);
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
#define AUTOSCHED_DEQUANT8(NAME, T)                                                                          \
  __device__ __forceinline__ void NAME(void* tile, const void* packed, int r, int j, float scale) {         \
    autosched_dequant8<T>(tile, packed, r, j, scale);                                                       \
  }

#endif  // AUTOSCHED_HOPPER_DEQUANT_CUH
