// hopper_gemm's streaming tensor-core kernel for a decode step's 2 to 16 rows of fp16 or bf16 (mma_gemv.py explains
// it): one device function that runs a whole block. The weights go from global memory straight into mma.sync's A
// fragments, 16 weight rows as M, with no shared memory on the way; the activation rows are mma's N (one or two n8
// tiles). Its compile-time parameters come in a config struct that mma_gemv.py generates per point;
// AUTOSCHED_MMA_GEMV(_BIAS) below makes the entry point with the point's own name.
#ifndef AUTOSCHED_MMA_GEMV_CUH
#define AUTOSCHED_MMA_GEMV_CUH

#include "common.cuh"

#define AUTOSCHED_MMA_GEMV_STEP 64  // k per step: a 128-byte line of each weight row, 32 bytes a lane

// One step's products: lane (g, t) holds 16 consecutive k of weight rows g and g + 8 (w[h][0..7], two elements a
// word) and of its activation row (x[0..7]). mma.sync contracts over the k that its fragments name; any order of k
// serves as long as A and B agree, so product s takes the lane's words 2s and 2s + 1 (k 4s .. 4s + 3 of its 16)
// as the fragments' k = (2t, 2t + 1) and (2t + 8, 2t + 9).
template <typename T>
__device__ __forceinline__ void autosched_mma_gemv_step(float (&acc)[4], const uint4 (&w)[2][2], const uint4 (&x)[2]) {
  const uint32_t wg[8] = {w[0][0].x, w[0][0].y, w[0][0].z, w[0][0].w, w[0][1].x, w[0][1].y, w[0][1].z, w[0][1].w};
  const uint32_t w8[8] = {w[1][0].x, w[1][0].y, w[1][0].z, w[1][0].w, w[1][1].x, w[1][1].y, w[1][1].z, w[1][1].w};
  const uint32_t xb[8] = {x[0].x, x[0].y, x[0].z, x[0].w, x[1].x, x[1].y, x[1].z, x[1].w};
  #pragma unroll
  for (int s = 0; s < 4; ++s)
    autosched_mma_m16n8k16<T>(acc, wg[2 * s], w8[2 * s], wg[2 * s + 1], w8[2 * s + 1], xb[2 * s], xb[2 * s + 1]);
}

// The whole block's work: C holds the sizes (M activation rows, N outputs, K), the warps W, the 16-row tiles R per
// block, the steps U whose loads are issued together, BIAS, and GATED (swiglu_gemm: w holds the gate's N rows, then
// the up projection's; c = SiLU(gate) * up). STORE1 applies the activation and stores one output.
template <class C, typename T, void (*STORE1)(T*, float)>
__device__ __forceinline__ void autosched_mma_gemv(const T* __restrict__ x, const T* __restrict__ w,
                                                   const T* __restrict__ bias, T* __restrict__ c, float* smem, int bx,
                                                   int tx) {
  constexpr int M = C::M, N = C::N, K = C::K, W = C::W, R = C::R, U = C::U;
  constexpr int STEP = AUTOSCHED_MMA_GEMV_STEP, STEPS = K / STEP;
  constexpr int TILES = C::GATED ? 2 * R : R;  // A tiles: the gate's R, then the up projection's R
  constexpr int NT = (M + 7) / 8;              // n8 tiles of activation rows: mma's N
  static_assert(K % STEP == 0 && NT >= 1 && NT <= 2, "whole steps of k; one or two n8 tiles of activation rows");
  const int warp = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;
  const int row0 = bx * 16 * R;
  const int s0 = warp * STEPS / W, s1 = (warp + 1) * STEPS / W;  // this warp's share of the steps
  // Rows past N read row N - 1 and activation rows past M read row M - 1: their products land in outputs that are
  // never stored (mma's rows and columns do not mix), so every load is unconditional.
  const T* wp[TILES][2];
  #pragma unroll
  for (int r = 0; r < TILES; ++r)
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + 16 * (r % R) + g + 8 * h, N - 1) + (r >= R ? N : 0);
      wp[r][h] = w + (size_t)row * K + 16 * t;
    }
  const T* xp[NT];
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) xp[nt] = x + (size_t)min(8 * nt + g, M - 1) * K + 16 * t;
  float acc[TILES][NT][4];
  #pragma unroll
  for (int r = 0; r < TILES; ++r)
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][nt][e] = 0.f;
  // U steps' loads in flight before their products; then the last steps one at a time.
  int s = s0;
  for (; s + U <= s1; s += U) {
    uint4 wv[U][TILES][2][2], xv[U][NT][2];
    #pragma unroll
    for (int u = 0; u < U; ++u)
      #pragma unroll
      for (int r = 0; r < TILES; ++r)
        #pragma unroll
        for (int h = 0; h < 2; ++h)
          #pragma unroll
          for (int q = 0; q < 2; ++q) wv[u][r][h][q] = autosched_ld_stream_v4(wp[r][h] + (s + u) * STEP + 8 * q);
    #pragma unroll
    for (int u = 0; u < U; ++u)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int q = 0; q < 2; ++q) xv[u][nt][q] = *reinterpret_cast<const uint4*>(xp[nt] + (s + u) * STEP + 8 * q);
    #pragma unroll
    for (int u = 0; u < U; ++u)
      #pragma unroll
      for (int r = 0; r < TILES; ++r)
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) autosched_mma_gemv_step<T>(acc[r][nt], wv[u][r], xv[u][nt]);
  }
  for (; s < s1; ++s) {
    uint4 wv[TILES][2][2], xv[NT][2];
    #pragma unroll
    for (int r = 0; r < TILES; ++r)
      #pragma unroll
      for (int h = 0; h < 2; ++h)
        #pragma unroll
        for (int q = 0; q < 2; ++q) wv[r][h][q] = autosched_ld_stream_v4(wp[r][h] + s * STEP + 8 * q);
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      #pragma unroll
      for (int q = 0; q < 2; ++q) xv[nt][q] = *reinterpret_cast<const uint4*>(xp[nt] + s * STEP + 8 * q);
    #pragma unroll
    for (int r = 0; r < TILES; ++r)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) autosched_mma_gemv_step<T>(acc[r][nt], wv[r], xv[nt]);
  }
  // The warps' partial sums meet in shared memory, laid out [warp][register][lane]; each warp then adds up and
  // stores every W-th register of the tile (of the gate and of the up projection alike).
  constexpr int REGS = TILES * NT * 4, OUTS = R * NT * 4;
  auto partial = reinterpret_cast<float (*)[REGS][32]>(smem);
  if (W > 1) {
    #pragma unroll
    for (int r = 0; r < TILES; ++r)
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) partial[warp][4 * (NT * r + nt) + e][lane] = acc[r][nt][e];
    __syncthreads();
  }
  #pragma unroll
  for (int o = 0; o < OUTS; ++o) {
    if (W > 1 && o % W != warp) continue;
    const int r = o / (4 * NT), nt = o / 4 % NT, e = o % 4;
    float sum = acc[r][nt][e], up = 0.f;
    if constexpr (C::GATED) up = acc[(r + R) % TILES][nt][e];
    if (W > 1) {
      sum = up = 0.f;
      #pragma unroll
      for (int v = 0; v < W; ++v) {
        sum += partial[v][o][lane];
        if constexpr (C::GATED) up += partial[v][o + OUTS][lane];
      }
    }
    // C fragment: rows g, g + 8 (outputs) x columns 8 nt + 2t, + 1 (activation rows)
    const int row = row0 + 16 * r + g + 8 * (e >> 1), i = 8 * nt + 2 * t + (e & 1);
    if (i < M && row < N) {
      if constexpr (C::GATED) sum = sum / (1.f + __expf(-sum)) * up;
      if constexpr (C::BIAS) sum += static_cast<float>(bias[row]);
      STORE1(c + i * N + row, sum);
    }
  }
}

// The entry points take the workload's inputs in its order: x, w, [bias], c.
#define AUTOSCHED_MMA_GEMV(NAME, T, C, STORE1)                                                                  \
  __device__ __forceinline__ void NAME(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ c,       \
                                       float* smem, int bx, int tx) {                                            \
    autosched_mma_gemv<C, T, STORE1>(x, w, nullptr, c, smem, bx, tx);                                            \
  }
#define AUTOSCHED_MMA_GEMV_BIAS(NAME, T, C, STORE1)                                                             \
  __device__ __forceinline__ void NAME(const T* __restrict__ x, const T* __restrict__ w,                          \
                                       const T* __restrict__ bias, T* __restrict__ c, float* smem, int bx,        \
                                       int tx) {                                                                 \
    autosched_mma_gemv<C, T, STORE1>(x, w, bias, c, smem, bx, tx);                                               \
  }

#endif  // AUTOSCHED_MMA_GEMV_CUH
