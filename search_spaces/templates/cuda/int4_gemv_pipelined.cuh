// int4_gemv's pipelined CUDA-core kernel (``row_groups`` > 1; search_spaces/templates/int4_gemv.py explains it): a
// warp takes C::G groups of C::R weight rows one after another, and loads the next group's chunks and scales into
// registers before it multiplies the current group's. The one-group kernel loads all of its rows and then computes,
// in step with every other warp of the wave; here each warp keeps loads in flight while it computes. The chunk
// arithmetic is int4_gemv.cuh's (and int4_gemv_zeros.cuh's), on chunks already in registers.
#ifndef AUTOSCHED_INT4_GEMV_PIPELINED_CUH
#define AUTOSCHED_INT4_GEMV_PIPELINED_CUH

#include "int4_gemv_zeros.cuh"

// One group of rows in registers: each row's chunks of this lane (C::STEPS of them, lanes 32 chunks apart),
// with each chunk's scale and zero point.
template <class C>
struct autosched_q4_group {
  uint4 q[C::R][C::STEPS];
  float scale[C::R][C::STEPS];
  float zero[C::R][C::STEPS];  // with zero points only (else never read, and dropped)
};

template <class C, typename T>
__device__ __forceinline__ void autosched_q4_load_group(autosched_q4_group<C>& g, const uint8_t* __restrict__ wq,
                                                        const T* __restrict__ scales,
                                                        const uint8_t* __restrict__ zeros, int row0, int lane) {
  #pragma unroll
  for (int r = 0; r < C::R; ++r) {
    const int row = row0 + r;
    if (row >= C::N) break;  // the last block's rows past n
    #pragma unroll
    for (int j = 0; j < C::STEPS; ++j) {
      const int chunk = j * 32 + lane;
      if (C::CHUNKS % 32 == 0 || chunk < C::CHUNKS) {  // a last step of fewer than 32 chunks
        g.q[r][j] = autosched_ld_stream_v4(wq + (size_t)row * (C::K / 2) + chunk * 16);
        const int index = row * C::GROUPS + chunk * 32 / C::GROUP;  // a chunk lies in one group
        g.scale[r][j] = static_cast<float>(scales[index]);
        if (C::ZEROS) g.zero[r][j] = static_cast<float>(zeros[index]);
      }
    }
  }
}

// The group's rows times the activations (C::M rows of x), each row's sums over the warp, stored by lane 0.
template <class C, typename T, void (*STORE1)(T*, float)>
__device__ __forceinline__ void autosched_q4_compute_group(const autosched_q4_group<C>& g, const T* __restrict__ x,
                                                           const T* __restrict__ bias, T* __restrict__ c, int row0,
                                                           int lane) {
  #pragma unroll
  for (int r = 0; r < C::R; ++r) {
    const int row = row0 + r;
    float acc[C::M];
    #pragma unroll
    for (int i = 0; i < C::M; ++i) acc[i] = 0.f;
    #pragma unroll
    for (int j = 0; j < C::STEPS; ++j) {
      const int chunk = j * 32 + lane;
      // Checked at run time even where the bounds always hold: the branch keeps nvcc from hoisting every chunk's
      // activation loads above the products (which spilled at 4 rows).
      if (row < C::N && chunk < C::CHUNKS) {
        const void* xp = x + chunk * 32;
        if constexpr (C::HALF) {
          __half2 w[4][4];
          if constexpr (C::ZEROS) {
            autosched_q4_unpack_half_zeros_bits(g.q[r][j], w, g.zero[r][j]);
            #pragma unroll
            for (int i = 0; i < C::M; ++i) autosched_q4_row_half_zeros(acc[i], w, xp, i, C::K * 2, g.scale[r][j]);
          } else {
            autosched_q4_unpack_half_bits(g.q[r][j], w);
            #pragma unroll
            for (int i = 0; i < C::M; ++i) autosched_q4_row_half(acc[i], w, xp, i, C::K * 2, g.scale[r][j]);
          }
        } else {
          float w[32];
          if constexpr (C::ZEROS) autosched_q4_unpack_zeros_bits(g.q[r][j], w, g.zero[r][j]);
          else autosched_q4_unpack_bits(g.q[r][j], w);
          #pragma unroll
          for (int i = 0; i < C::M; ++i) autosched_q4_row<T>(acc[i], w, xp, i, C::K * 2, g.scale[r][j]);
        }
      }
    }
    #pragma unroll
    for (int i = 0; i < C::M; ++i) autosched_warp_sum(acc[i]);
    if (lane == 0 && row < C::N) {
      #pragma unroll
      for (int i = 0; i < C::M; ++i) STORE1(c + i * C::N + row, acc[i] + (C::BIAS ? static_cast<float>(bias[row]) : 0.f));
    }
  }
}

// A block of C::W warps; warp w of block bx owns rows (bx * C::W + w) * C::R * C::G onwards, C::G groups of C::R.
// Two groups in registers: the loads of one are in flight while the other is multiplied.
template <class C, typename T, void (*STORE1)(T*, float)>
__device__ __forceinline__ void autosched_q4_gemv_pipelined(const T* __restrict__ x, const uint8_t* __restrict__ wq,
                                                            const T* __restrict__ scales,
                                                            const uint8_t* __restrict__ zeros,
                                                            const T* __restrict__ bias, T* __restrict__ c, int bx,
                                                            int tx) {
  const int lane = tx % 32;
  const int row0 = (bx * C::W + tx / 32) * C::R * C::G;
  autosched_q4_group<C> even, odd;
  autosched_q4_load_group<C, T>(even, wq, scales, zeros, row0, lane);
  #pragma unroll 1
  for (int group = 0; group < C::G; group += 2) {
    if (group + 1 < C::G) autosched_q4_load_group<C, T>(odd, wq, scales, zeros, row0 + (group + 1) * C::R, lane);
    autosched_q4_compute_group<C, T, STORE1>(even, x, bias, c, row0 + group * C::R, lane);
    if (group + 2 < C::G) autosched_q4_load_group<C, T>(even, wq, scales, zeros, row0 + (group + 2) * C::R, lane);
    if (group + 1 < C::G) autosched_q4_compute_group<C, T, STORE1>(odd, x, bias, c, row0 + (group + 1) * C::R, lane);
  }
}

// The device function NAME of config C over scalar T: the workload's inputs in its order (zero points and bias
// where it has them), the output, the block and the thread.
#define AUTOSCHED_Q4_GEMV_PIPELINED(NAME, T, C, STORE1)                                                           \
  __device__ __forceinline__ void NAME(const T* __restrict__ x, const uint8_t* __restrict__ wq,                 \
      const T* __restrict__ scales, T* __restrict__ c, int bx, int tx) {                                       \
    autosched_q4_gemv_pipelined<C, T, STORE1>(x, wq, scales, nullptr, nullptr, c, bx, tx);                     \
  }
#define AUTOSCHED_Q4_GEMV_PIPELINED_BIAS(NAME, T, C, STORE1)                                                      \
  __device__ __forceinline__ void NAME(const T* __restrict__ x, const uint8_t* __restrict__ wq,                 \
      const T* __restrict__ scales, const T* __restrict__ bias, T* __restrict__ c, int bx, int tx) {           \
    autosched_q4_gemv_pipelined<C, T, STORE1>(x, wq, scales, nullptr, bias, c, bx, tx);                        \
  }
#define AUTOSCHED_Q4_GEMV_PIPELINED_ZEROS(NAME, T, C, STORE1)                                                     \
  __device__ __forceinline__ void NAME(const T* __restrict__ x, const uint8_t* __restrict__ wq,                 \
      const T* __restrict__ scales, const uint8_t* __restrict__ zeros, T* __restrict__ c, int bx, int tx) {    \
    autosched_q4_gemv_pipelined<C, T, STORE1>(x, wq, scales, zeros, nullptr, c, bx, tx);                       \
  }
#define AUTOSCHED_Q4_GEMV_PIPELINED_ZEROS_BIAS(NAME, T, C, STORE1)                                                \
  __device__ __forceinline__ void NAME(const T* __restrict__ x, const uint8_t* __restrict__ wq,                 \
      const T* __restrict__ scales, const uint8_t* __restrict__ zeros, const T* __restrict__ bias,            \
      T* __restrict__ c, int bx, int tx) {                                                                     \
    autosched_q4_gemv_pipelined<C, T, STORE1>(x, wq, scales, zeros, bias, c, bx, tx);                          \
  }

#endif  // AUTOSCHED_INT4_GEMV_PIPELINED_CUH
