// moe_grouped_gemm: a mixture-of-experts layer's products over a prefill's routed rows, as one grouped GEMM on
// tensor cores (search_spaces/templates/moe_grouped_gemm.py generates the config struct and the TIRx launch).
//
// X [M, K] holds the routed rows sorted by expert: expert e's rows are indptr[e] .. indptr[e + 1] - 1
// (indptr [E + 1], indptr[E] = M; an expert may have none). W [E, N, K] holds each expert's nn.Linear weight,
// Y [M, N] the products, row for row: Y[i] = X[i] · W[e(i)]^T, fp32 accumulation.
//
// One CTA per (column tile of C::BN, row tile of C::BM of one expert). The row tiles of each expert are counted
// on the device from indptr (a tile never straddles two experts: an expert's last tile is masked at its end),
// so the launch holds M / BM + E tile slots per column tile, more than the rows can need; the spare CTAs return
// at once. Slots run fastest, so the CTAs that read one expert's weight tile run side by side and the weight is
// read from DRAM about once. C::WARPS warps (4: 2 x 2, or 8: 4 x 2) each own a (BM / (WARPS / 2)) x (BN / 2) part
// of the tile: X's rows are
// mma.sync m16n8k16's A (row-major), W's rows its B columns (K contiguous: "col"), both by ldmatrix from
// XOR-swizzled shared memory, fp32 accumulators in registers. K runs in steps of 64 through a ring of C::STAGES
// cp.async stages; rows past the expert's end, columns past N and K past its end are zeros in shared memory.
#ifndef AUTOSCHED_MOE_GROUPED_GEMM_CUH
#define AUTOSCHED_MOE_GROUPED_GEMM_CUH

#include "common.cuh"

// Four 8x8 matrices by ldmatrix (not transposed), each lane naming one row by a generic pointer into shared memory.
__device__ __forceinline__ void autosched_gg_ldmatrix_x4(uint32_t* r, const void* row) {
  autosched_ldmatrix_x4(r, static_cast<unsigned>(__cvta_generic_to_shared(row)), false);
}

// Element offset of 16-byte chunk `chunk` of row `row` in a tile of 64-element rows: chunks XOR-swizzled by the
// row, so that the 8 rows an ldmatrix reads at one column fall in 8 different bank groups.
__device__ __forceinline__ int autosched_gg_at(int row, int chunk) { return row * 64 + ((chunk ^ (row & 7)) << 3); }

template <typename T, class C>
__device__ __forceinline__ void autosched_moe_grouped_gemm(const T* __restrict__ X, const int* __restrict__ indptr,
    const T* __restrict__ W, T* __restrict__ Y, T* smem, int cta) {
  constexpr int M = C::M, E = C::E, N = C::N, K = C::K, BM = C::BM, BN = C::BN, STAGES = C::STAGES;
  constexpr int BK = 64, CHUNKS = BK / 8, WARPS_N = 2, WARPS_M = C::WARPS / WARPS_N, THREADS = 32 * C::WARPS;
  constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MI = WM / 16, NI = WN / 8;
  constexpr int SLOTS = (M + BM - 1) / BM + E, KT = (K + BK - 1) / BK;
  static_assert(WM % 16 == 0 && BN % 32 == 0 && BM * CHUNKS % THREADS == 0 && BN * CHUNKS % THREADS == 0,
                "warp tiles of 16 rows, tiles of 32 columns");
  static_assert(K % 8 == 0 && N % 2 == 0 && STAGES >= 2, "rows of 16-byte chunks, columns in pairs");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;

  // The CTA's column tile and row tile: slots count the experts' row tiles in order.
  const int col0 = cta / SLOTS * BN;
  int slot = cta % SLOTS, expert = 0, start = 0, end = 0;
  for (; expert < E; ++expert) {
    start = indptr[expert];
    end = indptr[expert + 1];
    const int tiles = (end - start + BM - 1) / BM;
    if (slot < tiles) break;
    slot -= tiles;
  }
  if (expert >= E) return;  // a spare CTA
  const int row0 = start + slot * BM;
  const T* w = W + (size_t)expert * N * K;
  T* sa = smem;                     // [STAGES][BM][BK]
  T* sb = smem + STAGES * BM * BK;  // [STAGES][BN][BK]

  auto load = [&](int kt, int stage) {  // one K step of the X and W tiles, zeros where out of range
    const int k0 = kt * BK;
    #pragma unroll
    for (int it = 0; it < BM * CHUNKS / THREADS; ++it) {
      const int i = it * THREADS + tid, r = i / CHUNKS, c = i % CHUNKS;
      const bool ok = row0 + r < end && k0 + c * 8 < K;
      autosched_cp_async(sa + stage * BM * BK + autosched_gg_at(r, c), ok ? X + (size_t)(row0 + r) * K + k0 + c * 8 : X,
                         ok);
    }
    #pragma unroll
    for (int it = 0; it < BN * CHUNKS / THREADS; ++it) {
      const int i = it * THREADS + tid, r = i / CHUNKS, c = i % CHUNKS;
      const bool ok = col0 + r < N && k0 + c * 8 < K;
      autosched_cp_async(sb + stage * BN * BK + autosched_gg_at(r, c), ok ? w + (size_t)(col0 + r) * K + k0 + c * 8 : W,
                         ok);
    }
  };

  float acc[MI][NI][4];
  #pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    #pragma unroll
    for (int ni = 0; ni < NI; ++ni) acc[mi][ni][0] = acc[mi][ni][1] = acc[mi][ni][2] = acc[mi][ni][3] = 0.f;
  }
  #pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) load(s, s);
    autosched_cp_async_commit();  // one group per stage, empty or not, so that the wait below counts right
  }
  for (int kt = 0; kt < KT; ++kt) {
    autosched_cp_async_wait<STAGES - 2>();  // step kt's group has landed
    __syncthreads();  // ... for every thread, and every warp is done with step kt - 1's stage, refilled next
    if (kt + STAGES - 1 < KT) load(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
    autosched_cp_async_commit();
    const T* a = sa + kt % STAGES * BM * BK;
    const T* b = sb + kt % STAGES * BN * BK;
    #pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      // A: matrices (rows 0-7, 8-15) x (k 0-7, 8-15); B: (columns 0-7 | 8-15) x (k 0-7, 8-15), two n8 tiles.
      uint32_t af[MI][4], bf[NI / 2][4];
      #pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        autosched_gg_ldmatrix_x4(af[mi], a + autosched_gg_at(wm * WM + mi * 16 + lane % 8 + 8 * (lane / 8 % 2),
                                                             2 * kk + lane / 16));
      #pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj)
        autosched_gg_ldmatrix_x4(bf[nj], b + autosched_gg_at(wn * WN + nj * 16 + lane % 8 + 8 * (lane / 16),
                                                             2 * kk + lane / 8 % 2));
      #pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        #pragma unroll
        for (int ni = 0; ni < NI; ++ni)
          autosched_mma_m16n8k16<T>(acc[mi][ni], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf[ni / 2][2 * (ni % 2)],
                                    bf[ni / 2][2 * (ni % 2) + 1]);
      }
    }
  }

  // The lane's accumulators: rows lane / 4 and 8 below it, columns 2 (lane % 4) + {0, 1} of each m16 x n8 tile.
  #pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + wm * WM + mi * 16 + lane / 4 + 8 * r;
      if (row >= end) continue;
      #pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int col = col0 + wn * WN + ni * 8 + 2 * (lane % 4);
        if (col < N)
          *reinterpret_cast<uint32_t*>(Y + (size_t)row * N + col) =
              autosched_pack<T>(acc[mi][ni][2 * r], acc[mi][ni][2 * r + 1]);
      }
    }
  }
}

// The entry point NAME(X, indptr, W, Y, smem, cta) that the TIRx launch calls, for element type T and config C.
#define AUTOSCHED_MOE_GROUPED_GEMM(NAME, T, C)                                                                \
  __device__ __forceinline__ void NAME(const T* __restrict__ X, const int* __restrict__ indptr,                \
      const T* __restrict__ W, T* __restrict__ Y, T* smem, int cta) {                                          \
    autosched_moe_grouped_gemm<T, C>(X, indptr, W, Y, smem, cta);                                              \
  }

#endif  // AUTOSCHED_MOE_GROUPED_GEMM_CUH
