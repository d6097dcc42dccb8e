// kv_cache_prefill: prefill attention in the calling convention of TVM's paged KV cache runtime, as device
// functions that run one thread's share of a CTA (search_spaces/templates/kv_cache_prefill.py generates
// their config structs and the TIRx launches around them): over a prefill's new tokens (the function the
// cache calls for "prefill over new tokens (ragged)", in place of TVM's batch_prefill_ragged_kv) and over
// the cached pages ("prefill over cached pages", in place of batch_prefill_paged_kv).
//
// The runtime's buffers: Q and O [total_q, H, D]; lse [total_q, H], float32, base 2: log2 of the sum of
// 2^(scores · sm_scale · log2(e)); the queries of each sequence in CSR form (q_indptr [batch + 1]). The keys
// and values: ragged, K and V [total_kv, HKV, D] with kv_indptr [batch + 1]; paged, pages [num_pages, 2 (K,
// V), HKV, PAGE, D] with each sequence's pages in CSR form (page_indptr [batch + 1] into indices) and
// last_len [batch], the tokens of its last page. Causal: a sequence's queries are the last tokens of its kv
// range, so its query token i of qlen sees kv token j <= kvlen - qlen + i.
//
// FlashAttention-2 on mma.sync: one CTA per (tile of C::BM rows, K/V head, sequence), a row being one
// (query token, query head of the K/V head's GQA group) pair, token-major as TVM's kernel orders them, so
// that the group's heads share every K/V tile. Each warp owns 16 rows: Q's fragments stay in registers,
// S = Q·K^T and O += P·V run on tensor cores (ldmatrix from XOR-swizzled shared memory, fp32 accumulators),
// the online softmax runs in base 2 on the S accumulators, and P goes to the second product straight from
// them. K/V tiles of C::BN tokens are double-buffered by cp.async: the next tile loads while this one is used.
#ifndef AUTOSCHED_KV_CACHE_PREFILL_CUH
#define AUTOSCHED_KV_CACHE_PREFILL_CUH

#include "common.cuh"

// Four 8x8 matrices by ldmatrix, each lane naming one row by a generic pointer into shared memory.
__device__ __forceinline__ void autosched_kvp_ldmatrix_x4(uint32_t* r, const void* row, bool trans) {
  autosched_ldmatrix_x4(r, static_cast<unsigned>(__cvta_generic_to_shared(row)), trans);
}

// Element offset of 16-byte chunk `chunk` of row `row` in a tile of D-element rows: chunks XOR-swizzled by
// the row, so that the 8 rows an ldmatrix reads at one column fall in 8 different bank groups.
template <int D> __device__ __forceinline__ int autosched_kvp_at(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

// The keys and values of the new tokens: a sequence's token j is row kv_indptr[seq] + j of K and of V.
template <typename T, int HKV, int D> struct autosched_kvp_ragged {
  const T* __restrict__ K;
  const T* __restrict__ V;
  const int* __restrict__ kv_indptr;
  __device__ __forceinline__ int first(int seq) const { return kv_indptr[seq]; }
  __device__ __forceinline__ int length(int seq) const { return kv_indptr[seq + 1] - kv_indptr[seq]; }
  __device__ __forceinline__ size_t at(int first, int j, int kvh) const {
    return ((size_t)(first + j) * HKV + kvh) * D;
  }
  __device__ __forceinline__ const T* k(size_t at) const { return K + at; }
  __device__ __forceinline__ const T* v(size_t at) const { return V + at; }
};

// The keys and values in the cache's pages: a sequence's token j is row j % PAGE of its page j / PAGE
// (page_indptr[seq] indexes the sequence's page numbers), K of head kvh at (2 page · HKV + kvh) · PAGE · D,
// V HKV · PAGE · D further.
template <typename T, int HKV, int D, int PAGE> struct autosched_kvp_paged {
  const T* __restrict__ pages;
  const int* __restrict__ page_indptr;
  const int* __restrict__ indices;
  const int* __restrict__ last_len;
  __device__ __forceinline__ int first(int seq) const { return page_indptr[seq]; }
  __device__ __forceinline__ int length(int seq) const {
    const int n = page_indptr[seq + 1] - page_indptr[seq];
    return n > 0 ? (n - 1) * PAGE + last_len[seq] : 0;
  }
  __device__ __forceinline__ size_t at(int first, int j, int kvh) const {
    return ((size_t)__ldg(indices + first + j / PAGE) * 2 * HKV + kvh) * PAGE * D + (j % PAGE) * D;
  }
  __device__ __forceinline__ const T* k(size_t at) const { return pages + at; }
  __device__ __forceinline__ const T* v(size_t at) const { return pages + at + (size_t)HKV * PAGE * D; }
};

template <typename T, class C, class KV>
__device__ __forceinline__ void autosched_kv_cache_prefill(const T* __restrict__ Q, const int* __restrict__ q_indptr,
    const KV& kv, T* __restrict__ O, float* __restrict__ lse, T* smem, int cta, int batch, int causal,
    float sm_scale) {
  constexpr int H = C::H, HKV = C::HKV, G = C::G, D = C::D, BM = C::BM, BN = C::BN;
  constexpr int WARPS = BM / 16, THREADS = WARPS * 32, CHUNKS = D / 8;
  static_assert(D % 64 == 0 && BN % 16 == 0 && BM % 16 == 0 && BN * CHUNKS % THREADS == 0 && BM * CHUNKS % THREADS == 0,
                "head dims of 64s, tiles of 16s");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // The CTA's sequence and tile: slots count the sequences' tiles in order; within a sequence the last
  // tile (the most keys under causal masking) takes the first slot, so that long tiles start early.
  const int kvh = cta % HKV;
  int slot = cta / HKV, seq = 0, tiles = 0;
  for (; seq < batch; ++seq) {
    tiles = ((q_indptr[seq + 1] - q_indptr[seq]) * G + BM - 1) / BM;
    if (slot < tiles) break;
    slot -= tiles;
  }
  if (seq >= batch) return;  // a spare CTA: the launch counts one more tile per sequence than may be needed
  const int first = (tiles - 1 - slot) * BM;  // the tile's first row
  const int q0 = q_indptr[seq], qlen = q_indptr[seq + 1] - q0;
  const int k0 = kv.first(seq), kvlen = kv.length(seq);
  const int shift = kvlen - qlen;  // query token t sees kv tokens j < shift + t + 1
  auto visible = [&](int row) {    // keys a row sees (rows past the sequence: any bound, they are not stored)
    return causal ? max(0, min(kvlen, shift + (first + row) / G + 1)) : kvlen;
  };
  const int kv_end = visible(min(BM - 1, qlen * G - 1 - first));  // the tile's last row sees the most
  const int unmasked = visible(0);                                 // keys every row of the tile sees
  const int kv_tiles = (kv_end + BN - 1) / BN;
  T* sq = smem;
  T* sk = smem + BM * D;           // [2][BN][D]
  T* sv = smem + (BM + 2 * BN) * D;  // [2][BN][D]

  #pragma unroll
  for (int it = 0; it < BM * CHUNKS / THREADS; ++it) {
    const int i = it * THREADS + tid, r = i / CHUNKS, c = i % CHUNKS, t = (first + r) / G;
    const bool ok = t < qlen;
    const T* src = ok ? Q + ((size_t)(q0 + t) * H + kvh * G + (first + r) % G) * D + c * 8 : Q;
    autosched_cp_async(sq + autosched_kvp_at<D>(r, c), src, ok);
  }
  auto load_kv = [&](int tile, int buf) {  // rows past the sequence's keys are zeros (never read from global)
    const int base = tile * BN;
    #pragma unroll
    for (int it = 0; it < BN * CHUNKS / THREADS; ++it) {
      const int i = it * THREADS + tid, r = i / CHUNKS, c = i % CHUNKS;
      const bool ok = base + r < kv_end;
      const size_t at = ok ? kv.at(k0, base + r, kvh) + c * 8 : 0;  // no page lookup past the keys
      autosched_cp_async(sk + buf * BN * D + autosched_kvp_at<D>(r, c), kv.k(at), ok);
      autosched_cp_async(sv + buf * BN * D + autosched_kvp_at<D>(r, c), kv.v(at), ok);
    }
  };
  if (kv_tiles > 0) load_kv(0, 0);
  autosched_cp_async_commit();
  autosched_cp_async_wait<0>();
  __syncthreads();

  // Q's A fragments (16 rows x 16 columns a step): matrices (rows 0-7, 8-15) x (columns 0-7, 8-15).
  uint32_t qf[D / 16][4];
  #pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    autosched_kvp_ldmatrix_x4(qf[kk], sq + autosched_kvp_at<D>(warp * 16 + lane % 8 + 8 * (lane / 8 % 2),
                                                                2 * kk + lane / 16), false);
  // The lane's accumulator rows: warp * 16 + lane / 4 (r = 0) and 8 below it (r = 1).
  const int row0 = warp * 16 + lane / 4;
  const int limit[2] = {visible(row0), visible(row0 + 8)};
  const float scale = sm_scale * 1.4426950408889634f;  // log2(e): the softmax in base 2
  float o[D / 8][4], m[2], l[2];
  #pragma unroll
  for (int nb = 0; nb < D / 8; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.f;
  m[0] = m[1] = autosched_neg_inf();
  l[0] = l[1] = 0.f;

  for (int j = 0; j < kv_tiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < kv_tiles) load_kv(j + 1, buf ^ 1);
    autosched_cp_async_commit();  // empty on the last tile: the wait below still leaves this tile's group done
    autosched_cp_async_wait<1>();
    __syncthreads();
    const T* k = sk + buf * BN * D;
    const T* v = sv + buf * BN * D;
    // S = Q K^T: K's rows are B's columns; matrices (keys 0-7 | 8-15) x (columns 0-7 | 8-15).
    float s[BN / 8][4];
    #pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      #pragma unroll
      for (int nb2 = 0; nb2 < BN / 16; ++nb2) {
        uint32_t b[4];
        autosched_kvp_ldmatrix_x4(b, k + autosched_kvp_at<D>(nb2 * 16 + lane % 8 + 8 * (lane / 16),
                                                             2 * kk + lane / 8 % 2), false);
        autosched_mma_m16n8k16<T>(s[2 * nb2], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b[0], b[1]);
        autosched_mma_m16n8k16<T>(s[2 * nb2 + 1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b[2], b[3]);
      }
    }
    // Scale, mask (only tiles that reach past the keys every row sees), online softmax in base 2.
    const bool masked = (j + 1) * BN > unmasked;
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      float top = m[r];
      #pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = j * BN + nb * 8 + 2 * (lane % 4) + e;
          float x = s[nb][2 * r + e] * scale;
          if (masked && col >= limit[r]) x = autosched_neg_inf();
          s[nb][2 * r + e] = x;
          top = fmaxf(top, x);
        }
      }
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      const float base = top == autosched_neg_inf() ? 0.f : top;  // a row that sees no key yet
      const float keep = exp2f(m[r] - base);
      m[r] = top;
      l[r] *= keep;
      #pragma unroll
      for (int nb = 0; nb < D / 8; ++nb) { o[nb][2 * r] *= keep; o[nb][2 * r + 1] *= keep; }
      #pragma unroll
      for (int nb = 0; nb < BN / 8; ++nb) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2f(s[nb][2 * r + e] - base);
          s[nb][2 * r + e] = p;
          l[r] += p;  // the lane's share of the row; the four lanes of a row meet at the end
        }
      }
    }
    // O += P V: two n8 accumulator tiles of P are one k16 A fragment; V's rows are keys (k), so ldmatrix
    // transposes them into B fragments, matrices (keys 0-7 | 8-15) x (columns 0-7 | 8-15).
    #pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t a0 = autosched_pack<T>(s[2 * kk][0], s[2 * kk][1]);
      const uint32_t a1 = autosched_pack<T>(s[2 * kk][2], s[2 * kk][3]);
      const uint32_t a2 = autosched_pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      const uint32_t a3 = autosched_pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      #pragma unroll
      for (int nb2 = 0; nb2 < D / 16; ++nb2) {
        uint32_t b[4];
        autosched_kvp_ldmatrix_x4(b, v + autosched_kvp_at<D>(kk * 16 + lane % 8 + 8 * (lane / 8 % 2),
                                                             2 * nb2 + lane / 16), true);
        autosched_mma_m16n8k16<T>(o[2 * nb2], a0, a1, a2, a3, b[0], b[1]);
        autosched_mma_m16n8k16<T>(o[2 * nb2 + 1], a0, a1, a2, a3, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this buffer before the next iteration refills it
  }

  // A row that sees no key gives what TVM's kernel gives: an output of zeros and a log-sum-exp of -5e4.
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int f = first + row0 + 8 * r, t = f / G;
    if (t >= qlen) continue;
    const size_t row = (size_t)(q0 + t) * H + kvh * G + f % G;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    #pragma unroll
    for (int nb = 0; nb < D / 8; ++nb)
      *reinterpret_cast<uint32_t*>(O + row * D + nb * 8 + 2 * (lane % 4)) =
          autosched_pack<T>(o[nb][2 * r] * inv, o[nb][2 * r + 1] * inv);
    if (lane % 4 == 0) lse[row] = l[r] > 0.f ? m[r] + log2f(l[r]) : -5e4f;
  }
}

// The entry point NAME(Q, q_indptr, K, V, kv_indptr, O, lse, smem, cta, batch, causal, sm_scale) that the
// TIRx launch calls, for element type T and config C: over the new tokens.
#define AUTOSCHED_KV_CACHE_PREFILL(NAME, T, C)                                                              \
  __device__ __forceinline__ void NAME(const T* __restrict__ Q, const int* __restrict__ q_indptr,            \
      const T* __restrict__ K, const T* __restrict__ V, const int* __restrict__ kv_indptr, T* __restrict__ O, \
      float* __restrict__ lse, T* smem, int cta, int batch, int causal, float sm_scale) {                   \
    const autosched_kvp_ragged<T, C::HKV, C::D> kv{K, V, kv_indptr};                                         \
    autosched_kv_cache_prefill<T, C>(Q, q_indptr, kv, O, lse, smem, cta, batch, causal, sm_scale);           \
  }

// The entry point NAME(Q, q_indptr, pages, page_indptr, indices, last_len, O, lse, smem, cta, batch, causal,
// sm_scale): over the cached pages.
#define AUTOSCHED_KV_CACHE_PREFILL_PAGED(NAME, T, C)                                                        \
  __device__ __forceinline__ void NAME(const T* __restrict__ Q, const int* __restrict__ q_indptr,            \
      const T* __restrict__ pages, const int* __restrict__ page_indptr, const int* __restrict__ indices,    \
      const int* __restrict__ last_len, T* __restrict__ O, float* __restrict__ lse, T* smem, int cta,        \
      int batch, int causal, float sm_scale) {                                                               \
    const autosched_kvp_paged<T, C::HKV, C::D, C::PAGE> kv{pages, page_indptr, indices, last_len};           \
    autosched_kv_cache_prefill<T, C>(Q, q_indptr, kv, O, lse, smem, cta, batch, causal, sm_scale);           \
  }

#endif  // AUTOSCHED_KV_CACHE_PREFILL_CUH
