// int4_gemv's tensor-core kernel (fp16): one device function that runs a whole block, the products on
// mma.sync m16n8k16 with 16 weight rows as M and the activation rows as N (at most 16: one or two n8 tiles,
// each A fragment taken by one mma.sync per tile), the weights bulk-copied into shared memory or streamed into
// registers (search_spaces/templates/int4_gemv.py, _mma_source, explains the loads and the nibble order). Its
// compile-time parameters come in a config struct that int4_gemv.py generates per point;
// AUTOSCHED_Q4_MMA_GEMV(_BIAS) below makes the entry point with the point's own name.
#ifndef AUTOSCHED_INT4_MMA_GEMV_CUH
#define AUTOSCHED_INT4_MMA_GEMV_CUH

#include "common.cuh"

#define AUTOSCHED_Q4_K_BLOCK 128  // weights of one row per k-block: 4 lanes x 32 nibbles

__device__ __forceinline__ uint32_t autosched_q4_nibbles(uint32_t w, uint32_t mask) {
  uint32_t r;  // (w & mask) | 0x64006400: the nibbles under half's exponent of 1024
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(mask), "r"(0x64006400u));
  return r;
}
// One lane's activations of a k-block (its 32 x at xp, row g of an n8 tile) in the nibbles' order: the B
// fragments of the k-block's eight products, the high-nibble slots' x divided by 16.
__device__ __forceinline__ void autosched_q4_mma_activations(uint32_t (&b)[8][2], const __half* xp_half,
                                                            __half2 sixteenth) {
  const uint4* xp = reinterpret_cast<const uint4*>(xp_half);
  #pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint4 v = xp[w];  // k = 8w .. 8w + 7 of the lane's 32
    b[2 * w][0] = __byte_perm(v.x, v.z, 0x5410);
    b[2 * w + 1][0] = __byte_perm(v.y, v.w, 0x5410);
    uint32_t hi0 = __byte_perm(v.x, v.z, 0x7632), hi1 = __byte_perm(v.y, v.w, 0x7632);
    __half2 h0 = __hmul2(*reinterpret_cast<__half2*>(&hi0), sixteenth);
    __half2 h1 = __hmul2(*reinterpret_cast<__half2*>(&hi1), sixteenth);
    b[2 * w][1] = *reinterpret_cast<uint32_t*>(&h0);
    b[2 * w + 1][1] = *reinterpret_cast<uint32_t*>(&h1);
  }
}
// The whole block's work: C holds the sizes (M, N, K, GROUPS, GROUP), the warps W, the 16-row tiles R, BIAS and
// ZEROS (zero points [N, GROUPS] in place of 8), and how the weights come in: with STREAM, straight from global
// memory into registers, the loads of U k-blocks issued before their products; else bulk-copied into a shared slab
// of rows ROW_BYTES apart. STORE1 applies the activation and stores one output.
template <class C, void (*STORE1)(__half*, float)>
__device__ __forceinline__ void autosched_q4_mma_gemv(const __half* __restrict__ x, const uint8_t* __restrict__ wq,
    const __half* __restrict__ scales, const uint8_t* __restrict__ zeros, const __half* __restrict__ bias,
    __half* __restrict__ c, uint8_t* smem, int bx, int tx) {
  constexpr int M = C::M, N = C::N, K = C::K, GROUPS = C::GROUPS, GROUP = C::GROUP, W = C::W, R = C::R;
  constexpr int K_BLOCK = AUTOSCHED_Q4_K_BLOCK;
  constexpr int BLOCKS = K / K_BLOCK, ROWS = 16 * R;
  constexpr int SLAB = C::STREAM ? 0 : ROWS * C::ROW_BYTES + 8 * W;  // the slab and its warps' mbarriers
  constexpr int NT = (M + 7) / 8;  // n8 tiles of activation rows: mma's N
  static_assert(NT >= 1 && NT <= 2, "one or two n8 tiles of activation rows");
  const int warp = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const int row0 = bx * ROWS, valid_rows = min(ROWS, N - row0);
  const int kb0 = warp * BLOCKS / W, kb1 = (warp + 1) * BLOCKS / W;  // this warp's share of the k-blocks
  const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(smem + ROWS * C::ROW_BYTES)) + 8 * warp;
  if (!C::STREAM) {
    if (lane == 0) autosched_bulk_expect(bar, valid_rows * (kb1 - kb0) * (K_BLOCK / 2));
    __syncwarp();
    for (int r = lane; r < valid_rows; r += 32)
      autosched_bulk_copy(smem + r * C::ROW_BYTES + kb0 * (K_BLOCK / 2),
                          wq + (size_t)(row0 + r) * (K / 2) + kb0 * (K_BLOCK / 2), (kb1 - kb0) * (K_BLOCK / 2), bar);
  }
  const __half2 sixteenth = __float2half2_rn(0.0625f);
  const uint32_t lo_offset = 0xE408E408u, hi_offset = 0xE480E480u;  // half2 (-1032, -1032), (-1152, -1152)
  const uint32_t ones = 0x3C003C00u, sixteens = 0x4C004C00u;  // half2 (1, 1), (16, 16)
  float acc[R][NT][4];
  const __half* row_scales[R][2];
  const uint8_t* row_zeros[R][2];
  const uint8_t* row_weights[R][2];  // STREAM: lane t's 16 bytes of the first k-block, rows g and g + 8
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][nt][e] = 0.f;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows past N read row N - 1's weights, scales (and, in the slab, stale bytes)
      const int row = min(row0 + 16 * r + g + 8 * h, N - 1);  // and are never stored
      row_scales[r][h] = scales + (size_t)row * GROUPS;
      if (C::ZEROS) row_zeros[r][h] = zeros + (size_t)row * GROUPS;
      row_weights[r][h] = wq + (size_t)row * (K / 2) + 16 * t;
    }
  }
  // One k-block's products: the tiles' packed weights q[r][h] (rows g and g + 8), scaled by their groups' scales.
  auto k_block = [&](int kb, const uint4 (&q)[R][2]) {
    // This k-block's activations in the nibbles' order, per n8 tile of activation rows; zeros past row M.
    uint32_t b[NT][8][2];
    if (g < M) {
      autosched_q4_mma_activations(b[0], x + g * K + kb * K_BLOCK + 32 * t, sixteenth);
    } else {
      #pragma unroll
      for (int j = 0; j < 8; ++j) b[0][j][0] = b[0][j][1] = 0u;
    }
    if (NT > 1) {  // the second tile: activation rows 8 + g
      if (8 + g < M) {
        autosched_q4_mma_activations(b[NT - 1], x + g * K + kb * K_BLOCK + 32 * t + 8 * K, sixteenth);
      } else {
        #pragma unroll
        for (int j = 0; j < 8; ++j) b[NT - 1][j][0] = b[NT - 1][j][1] = 0u;
      }
    }
    float offset[NT][4] = {};
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int j = 0; j < 8; ++j)
        autosched_mma_m16n8k16<half>(offset[nt], lo_offset, lo_offset, hi_offset, hi_offset, b[nt][j][0], b[nt][j][1]);
    // Zero points: sum (q - z) x = sum (q - 8) x + (8 - z) sum x, with the k-block's sum of x (one product with
    // constant A, 16 for the high slots' x / 16) shared by every row; z is one per row in a k-block.
    float x_sum[NT][4] = {};
    if (C::ZEROS) {
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int j = 0; j < 8; ++j)
          autosched_mma_m16n8k16<half>(x_sum[nt], ones, ones, sixteens, sixteens, b[nt][j][0], b[nt][j][1]);
    }
    const int group_index = kb * K_BLOCK / GROUP;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t wg[4] = {q[r][0].x, q[r][0].y, q[r][0].z, q[r][0].w};
      const uint32_t w8[4] = {q[r][1].x, q[r][1].y, q[r][1].z, q[r][1].w};
      float d[NT][4];
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        d[nt][0] = offset[nt][0]; d[nt][1] = offset[nt][1]; d[nt][2] = offset[nt][2]; d[nt][3] = offset[nt][3];
        if (C::ZEROS) {  // C fragment: d[0], d[1] of row g, d[2], d[3] of row g + 8
          const float shift0 = 8.f - row_zeros[r][0][group_index], shift1 = 8.f - row_zeros[r][1][group_index];
          d[nt][0] = fmaf(shift0, x_sum[nt][0], d[nt][0]); d[nt][1] = fmaf(shift0, x_sum[nt][1], d[nt][1]);
          d[nt][2] = fmaf(shift1, x_sum[nt][2], d[nt][2]); d[nt][3] = fmaf(shift1, x_sum[nt][3], d[nt][3]);
        }
      }
      #pragma unroll
      for (int w = 0; w < 4; ++w)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {  // bytes 0 and 2 of the word, then 1 and 3
          const uint32_t vg = wg[w] >> (8 * h), v8 = w8[w] >> (8 * h);
          const uint32_t a0 = autosched_q4_nibbles(vg, 0x000F000Fu), a1 = autosched_q4_nibbles(v8, 0x000F000Fu);
          const uint32_t a2 = autosched_q4_nibbles(vg, 0x00F000F0u), a3 = autosched_q4_nibbles(v8, 0x00F000F0u);
          #pragma unroll
          for (int nt = 0; nt < NT; ++nt)  // one A fragment, one product per n8 tile of activation rows
            autosched_mma_m16n8k16<half>(d[nt], a0, a1, a2, a3, b[nt][2 * w + h][0], b[nt][2 * w + h][1]);
        }
      const float s0 = __half2float(row_scales[r][0][group_index]), s1 = __half2float(row_scales[r][1][group_index]);
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        acc[r][nt][0] += d[nt][0] * s0; acc[r][nt][1] += d[nt][1] * s0;
        acc[r][nt][2] += d[nt][2] * s1; acc[r][nt][3] += d[nt][3] * s1;
      }
    }
  };
  if (C::STREAM) {  // the loads of U k-blocks in flight before their products; then the last k-blocks one at a time
    int kb = kb0;
    for (; kb + C::U <= kb1; kb += C::U) {
      uint4 q[C::U][R][2];
      #pragma unroll
      for (int u = 0; u < C::U; ++u)
        #pragma unroll
        for (int r = 0; r < R; ++r)
          #pragma unroll
          for (int h = 0; h < 2; ++h) q[u][r][h] = autosched_ld_stream_v4(row_weights[r][h] + (kb + u) * (K_BLOCK / 2));
      #pragma unroll
      for (int u = 0; u < C::U; ++u) k_block(kb + u, q[u]);
    }
    for (; kb < kb1; ++kb) {
      uint4 q[R][2];
      #pragma unroll
      for (int r = 0; r < R; ++r)
        #pragma unroll
        for (int h = 0; h < 2; ++h) q[r][h] = autosched_ld_stream_v4(row_weights[r][h] + kb * (K_BLOCK / 2));
      k_block(kb, q);
    }
  } else {
    autosched_mbarrier_wait(bar, 0);  // the barrier's first phase
    for (int kb = kb0; kb < kb1; ++kb) {
      uint4 q[R][2];
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint8_t* tile = smem + (16 * r + g) * C::ROW_BYTES + kb * (K_BLOCK / 2) + 16 * t;
        q[r][0] = *reinterpret_cast<const uint4*>(tile);
        q[r][1] = *reinterpret_cast<const uint4*>(tile + 8 * C::ROW_BYTES);
      }
      k_block(kb, q);
    }
  }
  if (W > 1) {  // the warps' partial sums meet in shared memory after the slab, laid out [warp][register][lane]
    auto partial = reinterpret_cast<float (*)[R * NT * 4][32]>(smem + SLAB);
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) partial[warp][4 * (NT * r + nt) + e][lane] = acc[r][nt][e];
    __syncthreads();
    if (warp != 0) return;
    #pragma unroll
    for (int r = 0; r < R; ++r)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          float sum = 0.f;
          #pragma unroll
          for (int v = 0; v < W; ++v) sum += partial[v][4 * (NT * r + nt) + e][lane];
          acc[r][nt][e] = sum;
        }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) {  // C fragment: rows g, g + 8 (weights) x columns 8 nt + 2t, + 1 (activations)
        const int row = row0 + 16 * r + g + 8 * (e >> 1), i = 8 * nt + 2 * t + (e & 1);
        if (i < M && row < N)
          STORE1(c + i * N + row, C::BIAS ? acc[r][nt][e] + __half2float(bias[row]) : acc[r][nt][e]);
      }
}

// The entry points take the workload's inputs in its order: x, wq, scales, [zeros], [bias], c.
#define AUTOSCHED_Q4_MMA_GEMV(NAME, C, STORE1)                                                              \
  __device__ __forceinline__ void NAME(const __half* __restrict__ x, const uint8_t* __restrict__ wq,        \
      const __half* __restrict__ scales, __half* __restrict__ c, uint8_t* smem, int bx, int tx) {           \
    autosched_q4_mma_gemv<C, STORE1>(x, wq, scales, nullptr, nullptr, c, smem, bx, tx);                     \
  }
#define AUTOSCHED_Q4_MMA_GEMV_BIAS(NAME, C, STORE1)                                                         \
  __device__ __forceinline__ void NAME(const __half* __restrict__ x, const uint8_t* __restrict__ wq,        \
      const __half* __restrict__ scales, const __half* __restrict__ bias, __half* __restrict__ c,           \
      uint8_t* smem, int bx, int tx) {                                                                      \
    autosched_q4_mma_gemv<C, STORE1>(x, wq, scales, nullptr, bias, c, smem, bx, tx);                        \
  }
#define AUTOSCHED_Q4_MMA_GEMV_ZEROS(NAME, C, STORE1)                                                        \
  __device__ __forceinline__ void NAME(const __half* __restrict__ x, const uint8_t* __restrict__ wq,        \
      const __half* __restrict__ scales, const uint8_t* __restrict__ zeros, __half* __restrict__ c,         \
      uint8_t* smem, int bx, int tx) {                                                                      \
    autosched_q4_mma_gemv<C, STORE1>(x, wq, scales, zeros, nullptr, c, smem, bx, tx);                       \
  }
#define AUTOSCHED_Q4_MMA_GEMV_ZEROS_BIAS(NAME, C, STORE1)                                                   \
  __device__ __forceinline__ void NAME(const __half* __restrict__ x, const uint8_t* __restrict__ wq,        \
      const __half* __restrict__ scales, const uint8_t* __restrict__ zeros,                                 \
      const __half* __restrict__ bias, __half* __restrict__ c, uint8_t* smem, int bx, int tx) {             \
    autosched_q4_mma_gemv<C, STORE1>(x, wq, scales, zeros, bias, c, smem, bx, tx);                          \
  }

#endif  // AUTOSCHED_INT4_MMA_GEMV_CUH
