// paged_decode: decode attention over a paged KV cache, one CTA per (sequence, K/V head), as a device
// function that runs one thread's share of the CTA (search_spaces/templates/paged_decode.py explains the
// loops). Its compile-time parameters come in a config struct C, which paged_decode.py generates per point,
// and the entry point with the point's own name is made by AUTOSCHED_PAGED_DECODE(_TMA) below.
#ifndef AUTOSCHED_PAGED_DECODE_CUH
#define AUTOSCHED_PAGED_DECODE_CUH

#include "common.cuh"

// The main loops (C::LOOP): CUDA cores, tensor cores fed from registers, tensor cores fed through each
// warp's cp.async ring in shared memory, and the transposed tensor-core loop fed by a producer warp's TMA.
#define AUTOSCHED_PD_CUDA_CORES 0
#define AUTOSCHED_PD_MMA 1
#define AUTOSCHED_PD_MMA_RING 2
#define AUTOSCHED_PD_TMA 3

// -inf spelled by its bits: INFINITY comes from math.h, which NVRTC (the GPU machine's compiler) may lack.
__device__ __forceinline__ float autosched_pd_neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float autosched_pd_weight(float m, float top) {
  return m == autosched_pd_neg_inf() ? 0.f : exp2f(m - top);
}

template <typename T, class C>
__device__ __forceinline__ void autosched_paged_decode(const T* __restrict__ Q, const T* __restrict__ K,
    const T* __restrict__ V, const int* __restrict__ table, const int* __restrict__ lens,
    T* __restrict__ O, float* smem, int pair, int rank, void* ring, unsigned long long k_map,
    unsigned long long v_map) {
  constexpr float SCALE_LOG2E = C::SCALE_LOG2E;  // log2(e) / sqrt(D): softmax in base 2
  constexpr int H = C::H, HKV = C::HKV, G = C::G, D = C::D, PAGE = C::PAGE, PPS = C::PPS;
  constexpr int WARPS = C::WARPS, UNROLL = C::UNROLL, SPLIT = C::SPLIT, THREADS = C::THREADS;
  constexpr int LOOP = C::LOOP, PREFETCH = C::PREFETCH, STAGES = C::STAGES;
  constexpr int TG = D / 8;             // lanes per token row (16 bytes each)
  constexpr int TPW = 32 / TG;          // tokens per warp per step
  constexpr int NG = WARPS * TPW;       // tokens per CTA per step
  // Shared memory (the caller's): the warps' and the CTA's partial results, then the CTA's slice of the
  // block table (so that no K/V load waits on a table load).
  auto part_o = reinterpret_cast<float (*)[G][D]>(smem);
  auto part_ml = reinterpret_cast<float (*)[G][2]>(smem + WARPS * G * D);
  auto fin_o = reinterpret_cast<float (*)[D]>(smem + WARPS * G * (D + 2));
  auto fin_ml = reinterpret_cast<float (*)[2]>(smem + (WARPS + 1) * G * D + WARPS * G * 2);
  int* page_of = reinterpret_cast<int*>(smem + (WARPS + 1) * G * (D + 2));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int sub = lane % TG, gid = warp * TPW + lane / TG;
  const int seq = pair / HKV, kvh = pair % HKV;
  const int len = lens[seq];
  const int pages = (len + PAGE - 1) / PAGE;
  const int first = rank * pages / SPLIT, last = (rank + 1) * pages / SPLIT;
  const int begin = first * PAGE, end = min(last * PAGE, len);
  for (int i = tid; i < last - first; i += THREADS) page_of[i] = table[seq * PPS + first + i];
  if constexpr (LOOP == AUTOSCHED_PD_TMA) {
    constexpr int KS = D / 16;  // k-steps of Sᵀ = K·Qᵀ, and m-tiles of Oᵀ = Vᵀ·Pᵀ
    constexpr int HALF_BYTES = PAGE * 128;  // one 64-column box of a page: PAGE rows of 128 bytes
    constexpr int TILE_BYTES = (D / 64) * HALF_BYTES;  // a page of K (or of V) for one K/V head
    const int g = lane / 4, t4 = lane % 4;
    const unsigned ring0 = static_cast<unsigned>(__cvta_generic_to_shared(ring));
    const unsigned bars = ring0 + STAGES * 2 * TILE_BYTES;  // full[STAGES], then empty[STAGES]
    if (tid == 0) {
      for (int st = 0; st < 2 * STAGES; ++st)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bars + 8 * st) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();  // the barriers and the page table: the producer starts at once, while Q loads
    const int n = last - first;  // the CTA's pages
    if (warp == WARPS) {  // the producer
      if (lane == 0) {
        for (int i = 0; i < n; ++i) {
          const int st = i % STAGES;
          if (i >= STAGES) autosched_mbarrier_wait(bars + 8 * (STAGES + st), (i / STAGES - 1) & 1);
          const unsigned full = bars + 8 * st, k_tile = ring0 + st * 2 * TILE_BYTES;
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                       :: "r"(full), "r"(2 * TILE_BYTES) : "memory");
          const int row = page_of[i] * PAGE;
          #pragma unroll
          for (int h = 0; h < D / 64; ++h) {
            autosched_tma_3d(k_tile + h * HALF_BYTES, k_map, 64 * h, kvh, row, full);
            autosched_tma_3d(k_tile + TILE_BYTES + h * HALF_BYTES, v_map, 64 * h, kvh, row, full);
          }
        }
      }
    } else {
      float o[KS][4], mh[2], lh[2];  // Oᵀ rows (head dims) 16 mt + g (0, 1) and + 8 (2, 3); heads 2 t4 + {0, 1}
      uint32_t qf[KS][2];  // Qᵀ's B fragments: head g, dims 16 s + 2 t4 + {0, 1} and + 8
      #pragma unroll
      for (int s = 0; s < KS; ++s) {
        const T* qrow = Q + ((size_t)seq * H + kvh * G + g) * D + 16 * s + 2 * t4;
        qf[s][0] = g < G ? *reinterpret_cast<const uint32_t*>(qrow) : 0u;
        qf[s][1] = g < G ? *reinterpret_cast<const uint32_t*>(qrow + 8) : 0u;
        o[s][0] = o[s][1] = o[s][2] = o[s][3] = 0.f;
      }
      mh[0] = mh[1] = autosched_pd_neg_inf(); lh[0] = lh[1] = 0.f;
      for (int i = warp; i < n; i += WARPS) {
        const int st = i % STAGES;
        autosched_mbarrier_wait(bars + 8 * st, (i / STAGES) & 1);
        const unsigned k_tile = ring0 + st * 2 * TILE_BYTES, v_tile = k_tile + TILE_BYTES;
        const int t0 = (first + i) * PAGE;  // the page's first token
        if (t0 + PAGE > end) {  // rows past the sequence may hold anything: zero V's (0 · NaN is NaN)
          for (int c = (end - t0) * 8 * (D / 64) + lane; c < PAGE * 8 * (D / 64); c += 32) {
            const int r = c / (8 * (D / 64)) , h = c / 8 % (D / 64);
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};"
                         :: "r"(v_tile + h * HALF_BYTES + r * 128 + c % 8 * 16), "r"(0u) : "memory");
          }
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // before TMA writes there again
          __syncwarp();
        }
        #pragma unroll
        for (int sub = 0; sub < PAGE / 16; ++sub) {
          float c[4] = {0.f, 0.f, 0.f, 0.f};  // Sᵀ: tokens g (0, 1) and g + 8 (2, 3); heads 2 t4 + {0, 1}
          #pragma unroll
          for (int s = 0; s < KS; ++s) {  // matrix lane / 8: tokens + 8 (lane / 8 % 2), columns + 8 (lane / 16)
            const int r = sub * 16 + lane % 16, chunk = 2 * s + lane / 16;
            uint32_t a[4];
            autosched_ldmatrix_x4(a, k_tile + chunk / 8 * HALF_BYTES + r * 128 + ((chunk % 8) ^ (r % 8)) * 16, false);
            autosched_mma_m16n8k16<T>(c, a[0], a[1], a[2], a[3], qf[s][0], qf[s][1]);
          }
          const int ta = t0 + sub * 16 + g;
          float top[2];
          #pragma unroll
          for (int j = 0; j < 4; ++j) c[j] = (ta + 8 * (j / 2) < end) ? c[j] * SCALE_LOG2E : autosched_pd_neg_inf();
          #pragma unroll
          for (int j = 0; j < 2; ++j) {  // head 2 t4 + j: its maximum down the column, then the rescale
            top[j] = fmaxf(mh[j], fmaxf(c[j], c[j + 2]));
            #pragma unroll
            for (int off = 4; off < 32; off <<= 1) top[j] = fmaxf(top[j], __shfl_xor_sync(0xffffffffu, top[j], off));
            const float keep = autosched_pd_weight(mh[j], top[j]);
            lh[j] *= keep;
            #pragma unroll
            for (int mt = 0; mt < KS; ++mt) { o[mt][j] *= keep; o[mt][j + 2] *= keep; }
            mh[j] = top[j];
          }
          float p[4];
          #pragma unroll
          for (int j = 0; j < 4; ++j) { p[j] = autosched_pd_weight(c[j], mh[j % 2]); lh[j % 2] += p[j]; }
          const uint32_t b0 = autosched_transpose_8x8(autosched_pack<T>(p[0], p[1]));  // Pᵀ: tokens 2 t4 + {0, 1}, head g
          const uint32_t b1 = autosched_transpose_8x8(autosched_pack<T>(p[2], p[3]));  // tokens 8 + 2 t4 + {0, 1}
          #pragma unroll
          for (int mt = 0; mt < KS; ++mt) {  // matrix lane / 8: head dims + 8 (lane / 8 % 2), tokens + 8 (lane / 16)
            const int r = sub * 16 + lane % 8 + 8 * (lane / 16), chunk = 2 * mt + lane / 8 % 2;
            uint32_t a[4];
            autosched_ldmatrix_x4(a, v_tile + chunk / 8 * HALF_BYTES + r * 128 + ((chunk % 8) ^ (r % 8)) * 16, true);
            autosched_mma_m16n8k16<T>(o[mt], a[0], a[1], a[2], a[3], b0, b1);
          }
        }
        __syncwarp();
        if (lane == 0)
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bars + 8 * (STAGES + st)) : "memory");
      }
      #pragma unroll
      for (int j = 0; j < 2; ++j) {  // a head's sum over its column's lanes
        #pragma unroll
        for (int off = 4; off < 32; off <<= 1) lh[j] += __shfl_xor_sync(0xffffffffu, lh[j], off);
      }
      #pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int h = 2 * t4 + j;
        if (h < G) {
          #pragma unroll
          for (int mt = 0; mt < KS; ++mt) {
            part_o[warp][h][16 * mt + g] = o[mt][j];
            part_o[warp][h][16 * mt + g + 8] = o[mt][j + 2];
          }
          if (g == 0) { part_ml[warp][h][0] = mh[j]; part_ml[warp][h][1] = lh[j]; }
        }
      }
    }
  } else if constexpr (LOOP == AUTOSCHED_PD_MMA_RING) {
    constexpr int KS = D / 16;  // k-steps of QKᵀ
    constexpr int KV4 = D / 32;  // 16-byte loads per lane per K row (a quarter row)
    constexpr int VV4 = D / 64;  // 16-byte loads per lane per V row (an eighth)
    constexpr int NT = D / 8;  // n-tiles of PV
    constexpr int ROWS = G > 8 ? 2 : 1;  // accumulator rows in use: g, and g + 8 for groups past 8
    const int g = lane / 4, t4 = lane % 4;
    uint32_t qa[KS][2], qb[KS][2];  // Q's A fragments: rows g (a0, a2) and g + 8 (a1, a3)
    #pragma unroll
    for (int s = 0; s < KS; ++s) {
      const size_t qrow = (size_t)seq * H + kvh * G;
      uint2 ra = make_uint2(0u, 0u), rb = make_uint2(0u, 0u);
      if (g < G) ra = *reinterpret_cast<const uint2*>(Q + (qrow + g) * D + t4 * (D / 4) + 4 * s);
      if (g + 8 < G) rb = *reinterpret_cast<const uint2*>(Q + (qrow + g + 8) * D + t4 * (D / 4) + 4 * s);
      qa[s][0] = ra.x; qa[s][1] = ra.y; qb[s][0] = rb.x; qb[s][1] = rb.y;
    }
    float o[NT][4], mrow[2], lrow[2];
    #pragma unroll
    for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    mrow[0] = mrow[1] = autosched_pd_neg_inf(); lrow[0] = lrow[1] = 0.f;
    __syncthreads();
    constexpr int TPS = 1;  // tiles per step
    constexpr int PIECES = 2 * KV4 + 4 * VV4;  // 16-byte pieces per lane per tile
    constexpr int RING_OFFSET = ((WARPS + 1) * G * (D + 2) + (PPS + SPLIT - 1) / SPLIT + 1 + 3) / 4 * 4;
    uint4* ring = reinterpret_cast<uint4*>(smem + RING_OFFSET) + (size_t)warp * UNROLL * PIECES * 32 + lane;
    const int tiles = end - begin > warp * 16 ? (end - begin - warp * 16 + WARPS * 16 - 1) / (WARPS * 16) : 0;
    auto issue = [&](int k) {  // the warp's tile k into slot k % UNROLL, as one commit group
      if (k < tiles) {
        const int base = begin + (warp + k * WARPS) * 16;
        uint4* slot = ring + (k % UNROLL) * PIECES * 32;
        #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int t = base + 8 * nt + g;
          const size_t row = t < end ? ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh : 0;
          #pragma unroll
          for (int i = 0; i < KV4; ++i)
            autosched_cp_async(slot + (nt * KV4 + i) * 32, K + row * D + t4 * (D / 4) + 8 * i, t < end);
        }
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int t = base + 2 * t4 + (r & 1) + 8 * (r >> 1);
          const size_t row = t < end ? ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh : 0;
          #pragma unroll
          for (int i = 0; i < VV4; ++i)
            autosched_cp_async(slot + (2 * KV4 + r * VV4 + i) * 32, V + row * D + g * (D / 8) + 8 * i, t < end);
        }
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    for (int k = 0; k < UNROLL - 1; ++k) issue(k);
    for (int k = 0; k < tiles; ++k) {
      issue(k + UNROLL - 1);
      asm volatile("cp.async.wait_group %0;\n" :: "n"(UNROLL - 1) : "memory");
      const int tile0 = begin + (warp + k * WARPS) * 16;
      const uint4* slot = ring + (k % UNROLL) * PIECES * 32;
      uint4 kr[1][2][KV4], vr[1][4][VV4];
      #pragma unroll
      for (int i = 0; i < 2 * KV4; ++i) kr[0][i / KV4][i % KV4] = slot[i * 32];
      #pragma unroll
      for (int i = 0; i < 4 * VV4; ++i) vr[0][i / VV4][i % VV4] = slot[(2 * KV4 + i) * 32];
      float sc[TPS][2][4];  // scores: rows g (0, 1) and g + 8 (2, 3), tokens 8 nt + 2 t4 + {0, 1}
      float top[2] = {mrow[0], mrow[1]};
      #pragma unroll
      for (int u = 0; u < TPS; ++u) {
        #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          float c[4] = {0.f, 0.f, 0.f, 0.f};
          #pragma unroll
          for (int s = 0; s < KS; ++s) {
            const uint4 w = kr[u][nt][s / 2];
            const uint32_t b0 = s % 2 ? w.z : w.x, b1 = s % 2 ? w.w : w.y;
            autosched_mma_m16n8k16<T>(c, qa[s][0], ROWS > 1 ? qb[s][0] : 0u, qa[s][1], ROWS > 1 ? qb[s][1] : 0u, b0, b1);
          }
          const int t = tile0 + u * 16 + 8 * nt + 2 * t4;
          #pragma unroll
          for (int i = 0; i < 2 * ROWS; ++i) {
            sc[u][nt][i] = t + (i & 1) < end ? c[i] * SCALE_LOG2E : autosched_pd_neg_inf();
            top[i / 2] = fmaxf(top[i / 2], sc[u][nt][i]);
          }
        }
      }
      float keep[2];
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {  // the row's maximum over its quad
        top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 1));
        top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 2));
        keep[r] = autosched_pd_weight(mrow[r], top[r]);
        lrow[r] *= keep[r];
        mrow[r] = top[r];
      }
      #pragma unroll
      for (int j = 0; j < NT; ++j) {
        o[j][0] *= keep[0]; o[j][1] *= keep[0];
        if (ROWS > 1) { o[j][2] *= keep[1]; o[j][3] *= keep[1]; }
      }
      #pragma unroll
      for (int u = 0; u < TPS; ++u) {
        float p[2][4];
        #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          #pragma unroll
          for (int i = 0; i < 2 * ROWS; ++i) {
            p[nt][i] = autosched_pd_weight(sc[u][nt][i], mrow[i / 2]);
            lrow[i / 2] += p[nt][i];
          }
        }
        const uint32_t pa0 = autosched_pack<T>(p[0][0], p[0][1]), pa1 = ROWS > 1 ? autosched_pack<T>(p[0][2], p[0][3]) : 0u;
        const uint32_t pa2 = autosched_pack<T>(p[1][0], p[1][1]), pa3 = ROWS > 1 ? autosched_pack<T>(p[1][2], p[1][3]) : 0u;
        #pragma unroll
        for (int j = 0; j < NT; ++j) {  // element g * D/8 + j of V rows 2 t4 + {0, 1} and + {8, 9}
          const unsigned sel = j % 2 ? 0x7632u : 0x5410u;
          const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&vr[u][0][j / 8]);
          const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&vr[u][1][j / 8]);
          const uint32_t* v2 = reinterpret_cast<const uint32_t*>(&vr[u][2][j / 8]);
          const uint32_t* v3 = reinterpret_cast<const uint32_t*>(&vr[u][3][j / 8]);
          const int wd = (j % 8) / 2;
          const uint32_t b0 = __byte_perm(v0[wd], v1[wd], sel), b1 = __byte_perm(v2[wd], v3[wd], sel);
          if (ROWS > 1) {
            autosched_mma_m16n8k16<T>(o[j], pa0, pa1, pa2, pa3, b0, b1);
          } else {  // rows g + 8 are zero: their accumulators live only for the instruction
            float c[4] = {o[j][0], o[j][1], 0.f, 0.f};
            autosched_mma_m16n8k16<T>(c, pa0, 0u, pa2, 0u, b0, b1);
            o[j][0] = c[0]; o[j][1] = c[1];
          }
        }
      }
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
      lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {  // output columns n = 2 t4 + {0, 1} of every n-tile j
      const int h = g + 8 * r;
      if (h < G) {
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
          part_o[warp][h][(2 * t4) * (D / 8) + j] = o[j][2 * r];
          part_o[warp][h][(2 * t4 + 1) * (D / 8) + j] = o[j][2 * r + 1];
        }
        if (t4 == 0) { part_ml[warp][h][0] = mrow[r]; part_ml[warp][h][1] = lrow[r]; }
      }
    }
  } else if constexpr (LOOP == AUTOSCHED_PD_MMA) {
    constexpr int KS = D / 16;  // k-steps of QKᵀ
    constexpr int KV4 = D / 32;  // 16-byte loads per lane per K row (a quarter row)
    constexpr int VV4 = D / 64;  // 16-byte loads per lane per V row (an eighth)
    constexpr int NT = D / 8;  // n-tiles of PV
    constexpr int ROWS = G > 8 ? 2 : 1;  // accumulator rows in use: g, and g + 8 for groups past 8
    const int g = lane / 4, t4 = lane % 4;
    uint32_t qa[KS][2], qb[KS][2];  // Q's A fragments: rows g (a0, a2) and g + 8 (a1, a3)
    #pragma unroll
    for (int s = 0; s < KS; ++s) {
      const size_t qrow = (size_t)seq * H + kvh * G;
      uint2 ra = make_uint2(0u, 0u), rb = make_uint2(0u, 0u);
      if (g < G) ra = *reinterpret_cast<const uint2*>(Q + (qrow + g) * D + t4 * (D / 4) + 4 * s);
      if (g + 8 < G) rb = *reinterpret_cast<const uint2*>(Q + (qrow + g + 8) * D + t4 * (D / 4) + 4 * s);
      qa[s][0] = ra.x; qa[s][1] = ra.y; qb[s][0] = rb.x; qb[s][1] = rb.y;
    }
    float o[NT][4], mrow[2], lrow[2];
    #pragma unroll
    for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    mrow[0] = mrow[1] = autosched_pd_neg_inf(); lrow[0] = lrow[1] = 0.f;
    __syncthreads();
    constexpr int TPS = UNROLL;  // tiles per step
    for (int tile0 = begin + warp * TPS * 16; tile0 < end; tile0 += WARPS * TPS * 16) {
      uint4 kr[TPS][2][KV4], vr[TPS][4][VV4];
      #pragma unroll
      for (int u = 0; u < TPS; ++u) {  // every load of the step first: bytes in flight
        const int base = tile0 + u * 16;
        #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {  // K rows base + 8 nt + g: a quarter each
          const int t = base + 8 * nt + g;
          const size_t row = t < end ? ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh : 0;
          #pragma unroll
          for (int i = 0; i < KV4; ++i)
            kr[u][nt][i] = t < end ? autosched_ld_stream_v4(K + row * D + t4 * (D / 4) + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
        }
        #pragma unroll
        for (int r = 0; r < 4; ++r) {  // V rows base + 2 t4 + {0, 1, 8, 9}: an eighth each
          const int t = base + 2 * t4 + (r & 1) + 8 * (r >> 1);
          const size_t row = t < end ? ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh : 0;
          #pragma unroll
          for (int i = 0; i < VV4; ++i)
            vr[u][r][i] = t < end ? autosched_ld_stream_v4(V + row * D + g * (D / 8) + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
        }
      }
      if constexpr (PREFETCH > 0) {  // the warp's tile PREFETCH steps ahead, into L2: a K row per lane 0-15, a V row per lane 16-31
        const int t = tile0 + PREFETCH * WARPS * TPS * 16 + lane % 16;
        if (t < end) {
          const size_t row = ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh;
          autosched_prefetch_l2((lane < 16 ? K : V) + row * D, D * 2);
        }
      }
      float sc[TPS][2][4];  // scores: rows g (0, 1) and g + 8 (2, 3), tokens 8 nt + 2 t4 + {0, 1}
      float top[2] = {mrow[0], mrow[1]};
      #pragma unroll
      for (int u = 0; u < TPS; ++u) {
        #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          float c[4] = {0.f, 0.f, 0.f, 0.f};
          #pragma unroll
          for (int s = 0; s < KS; ++s) {
            const uint4 w = kr[u][nt][s / 2];
            const uint32_t b0 = s % 2 ? w.z : w.x, b1 = s % 2 ? w.w : w.y;
            autosched_mma_m16n8k16<T>(c, qa[s][0], ROWS > 1 ? qb[s][0] : 0u, qa[s][1], ROWS > 1 ? qb[s][1] : 0u, b0, b1);
          }
          const int t = tile0 + u * 16 + 8 * nt + 2 * t4;
          #pragma unroll
          for (int i = 0; i < 2 * ROWS; ++i) {
            sc[u][nt][i] = t + (i & 1) < end ? c[i] * SCALE_LOG2E : autosched_pd_neg_inf();
            top[i / 2] = fmaxf(top[i / 2], sc[u][nt][i]);
          }
        }
      }
      float keep[2];
      #pragma unroll
      for (int r = 0; r < ROWS; ++r) {  // the row's maximum over its quad
        top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 1));
        top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 2));
        keep[r] = autosched_pd_weight(mrow[r], top[r]);
        lrow[r] *= keep[r];
        mrow[r] = top[r];
      }
      #pragma unroll
      for (int j = 0; j < NT; ++j) {
        o[j][0] *= keep[0]; o[j][1] *= keep[0];
        if (ROWS > 1) { o[j][2] *= keep[1]; o[j][3] *= keep[1]; }
      }
      #pragma unroll
      for (int u = 0; u < TPS; ++u) {
        float p[2][4];
        #pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          #pragma unroll
          for (int i = 0; i < 2 * ROWS; ++i) {
            p[nt][i] = autosched_pd_weight(sc[u][nt][i], mrow[i / 2]);
            lrow[i / 2] += p[nt][i];
          }
        }
        const uint32_t pa0 = autosched_pack<T>(p[0][0], p[0][1]), pa1 = ROWS > 1 ? autosched_pack<T>(p[0][2], p[0][3]) : 0u;
        const uint32_t pa2 = autosched_pack<T>(p[1][0], p[1][1]), pa3 = ROWS > 1 ? autosched_pack<T>(p[1][2], p[1][3]) : 0u;
        #pragma unroll
        for (int j = 0; j < NT; ++j) {  // element g * D/8 + j of V rows 2 t4 + {0, 1} and + {8, 9}
          const unsigned sel = j % 2 ? 0x7632u : 0x5410u;
          const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&vr[u][0][j / 8]);
          const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&vr[u][1][j / 8]);
          const uint32_t* v2 = reinterpret_cast<const uint32_t*>(&vr[u][2][j / 8]);
          const uint32_t* v3 = reinterpret_cast<const uint32_t*>(&vr[u][3][j / 8]);
          const int wd = (j % 8) / 2;
          const uint32_t b0 = __byte_perm(v0[wd], v1[wd], sel), b1 = __byte_perm(v2[wd], v3[wd], sel);
          if (ROWS > 1) {
            autosched_mma_m16n8k16<T>(o[j], pa0, pa1, pa2, pa3, b0, b1);
          } else {  // rows g + 8 are zero: their accumulators live only for the instruction
            float c[4] = {o[j][0], o[j][1], 0.f, 0.f};
            autosched_mma_m16n8k16<T>(c, pa0, 0u, pa2, 0u, b0, b1);
            o[j][0] = c[0]; o[j][1] = c[1];
          }
        }
      }
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
      lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {  // output columns n = 2 t4 + {0, 1} of every n-tile j
      const int h = g + 8 * r;
      if (h < G) {
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
          part_o[warp][h][(2 * t4) * (D / 8) + j] = o[j][2 * r];
          part_o[warp][h][(2 * t4 + 1) * (D / 8) + j] = o[j][2 * r + 1];
        }
        if (t4 == 0) { part_ml[warp][h][0] = mrow[r]; part_ml[warp][h][1] = lrow[r]; }
      }
    }
  } else {
    float q[G][8], o[G][8], m[G], l[G];
    #pragma unroll
    for (int h = 0; h < G; ++h) {
      uint4 raw = *reinterpret_cast<const uint4*>(Q + ((size_t)seq * H + kvh * G + h) * D + sub * 8);
      autosched_unpack8<T>(raw, q[h]);
      #pragma unroll
      for (int j = 0; j < 8; ++j) { q[h][j] *= SCALE_LOG2E; o[h][j] = 0.f; }
      m[h] = autosched_pd_neg_inf(); l[h] = 0.f;
    }
    __syncthreads();
    for (int base = begin; base < end; base += NG * UNROLL) {
      uint4 kr[UNROLL], vr[UNROLL];
      bool live[UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {  // every load of the step first: bytes in flight
        const int t = base + u * NG + gid;
        live[u] = t < end;
        if (live[u]) {
          const size_t row = ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh;
          kr[u] = autosched_ld_stream_v4(K + row * D + sub * 8);
          vr[u] = autosched_ld_stream_v4(V + row * D + sub * 8);
        }
      }
      float s[UNROLL][G];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float k[8];
        autosched_unpack8<T>(kr[u], k);
        #pragma unroll
        for (int h = 0; h < G; ++h) {
          float x = 0.f;
          #pragma unroll
          for (int j = 0; j < 8; ++j) x += q[h][j] * k[j];
          #pragma unroll
          for (int off = TG / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
          s[u][h] = live[u] ? x : autosched_pd_neg_inf();
        }
      }
      #pragma unroll
      for (int h = 0; h < G; ++h) {
        float top = m[h];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) top = fmaxf(top, s[u][h]);
        const float keep = autosched_pd_weight(m[h], top);
        l[h] *= keep;
        #pragma unroll
        for (int j = 0; j < 8; ++j) o[h][j] *= keep;
        m[h] = top;
      }
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float v[8];
        autosched_unpack8<T>(vr[u], v);
        #pragma unroll
        for (int h = 0; h < G; ++h) {
          const float p = autosched_pd_weight(s[u][h], m[h]);
          l[h] += p;
          #pragma unroll
          for (int j = 0; j < 8; ++j) o[h][j] += p * (live[u] ? v[j] : 0.f);
        }
      }
    }
    // The warp's token groups meet by shuffles (same sub-lane, other groups).
    #pragma unroll
    for (int off = TG; off < 32; off <<= 1) {
      #pragma unroll
      for (int h = 0; h < G; ++h) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m[h], off);
        const float l2 = __shfl_xor_sync(0xffffffffu, l[h], off);
        const float top = fmaxf(m[h], m2);
        const float a = autosched_pd_weight(m[h], top), b = autosched_pd_weight(m2, top);
        l[h] = l[h] * a + l2 * b;
        #pragma unroll
        for (int j = 0; j < 8; ++j) o[h][j] = o[h][j] * a + __shfl_xor_sync(0xffffffffu, o[h][j], off) * b;
        m[h] = top;
      }
    }
    if (lane < TG) {
      #pragma unroll
      for (int h = 0; h < G; ++h) {
        #pragma unroll
        for (int j = 0; j < 8; ++j) part_o[warp][h][sub * 8 + j] = o[h][j];
        if (lane == 0) { part_ml[warp][h][0] = m[h]; part_ml[warp][h][1] = l[h]; }
      }
    }
  }
  __syncthreads();
  // The warps meet in shared memory: each thread merges elements of the CTA's G x D output.
  for (int e = tid; e < G * D; e += THREADS) {
    const int h = e / D, c = e % D;
    float top = autosched_pd_neg_inf();
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, part_ml[w][h][0]);
    float sum = 0.f, acc = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      const float a = autosched_pd_weight(part_ml[w][h][0], top);
      sum += part_ml[w][h][1] * a;
      acc += part_o[w][h][c] * a;
    }
    if (SPLIT == 1) {
      O[((size_t)seq * H + kvh * G + h) * D + c] = autosched_dtype<T>::from_float(acc / sum);
    } else {
      fin_o[h][c] = acc;
      if (c == 0) { fin_ml[h][0] = top; fin_ml[h][1] = sum; }
    }
  }
  if (SPLIT > 1) {
    // The cluster's CTAs meet in the first one's registers through distributed shared memory.
    autosched_cluster_sync();
    if (rank == 0) {
      for (int e = tid; e < G * D; e += THREADS) {
        const int h = e / D, c = e % D;
        float mr[SPLIT], lr[SPLIT], orr[SPLIT];
        float top = autosched_pd_neg_inf();
        #pragma unroll
        for (int r = 0; r < SPLIT; ++r) {
          mr[r] = autosched_remote_f32(&fin_ml[h][0], r);
          lr[r] = autosched_remote_f32(&fin_ml[h][1], r);
          orr[r] = autosched_remote_f32(&fin_o[h][c], r);
          top = fmaxf(top, mr[r]);
        }
        float sum = 0.f, acc = 0.f;
        #pragma unroll
        for (int r = 0; r < SPLIT; ++r) {
          const float a = autosched_pd_weight(mr[r], top);
          sum += lr[r] * a;
          acc += orr[r] * a;
        }
        O[((size_t)seq * H + kvh * G + h) * D + c] = autosched_dtype<T>::from_float(acc / sum);
      }
    }
    // The other CTAs' shared memory stays until the first has read it.
    autosched_cluster_sync();
  }
}

// The entry point NAME(Q, K, V, table, lens, O, smem, pair, rank[, ring, k_map, v_map]) that the TIRx launch
// calls, for element type T and config C.
#define AUTOSCHED_PAGED_DECODE(NAME, T, C)                                                                  \
  __device__ __forceinline__ void NAME(const T* __restrict__ Q, const T* __restrict__ K,                    \
      const T* __restrict__ V, const int* __restrict__ table, const int* __restrict__ lens,                \
      T* __restrict__ O, float* smem, int pair, int rank) {                                                 \
    autosched_paged_decode<T, C>(Q, K, V, table, lens, O, smem, pair, rank, nullptr, 0ull, 0ull);           \
  }
#define AUTOSCHED_PAGED_DECODE_TMA(NAME, T, C)                                                              \
  __device__ __forceinline__ void NAME(const T* __restrict__ Q, const T* __restrict__ K,                    \
      const T* __restrict__ V, const int* __restrict__ table, const int* __restrict__ lens,                \
      T* __restrict__ O, float* smem, int pair, int rank, void* ring, unsigned long long k_map,             \
      unsigned long long v_map) {                                                                           \
    autosched_paged_decode<T, C>(Q, K, V, table, lens, O, smem, pair, rank, ring, k_map, v_map);            \
  }

#endif  // AUTOSCHED_PAGED_DECODE_CUH
