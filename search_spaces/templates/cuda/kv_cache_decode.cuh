// kv_cache_decode: decode attention in the calling convention of TVM's paged KV cache runtime (the
// function the cache calls for "decode over cached pages", in place of TVM's batch_decode_paged_kv), as a
// device function that runs one thread's share of a CTA (search_spaces/templates/kv_cache_decode.py
// generates its config struct and the TIRx launch around it).
//
// The runtime's buffers: Q and O [batch, H, D]; pages [num_pages, 2 (K, V), HKV, PAGE, D]; the sequences'
// pages in CSR form (indptr [batch + 1] into indices); last_len [batch], the tokens used in each sequence's
// last page; lse [batch, H], float32, base 2: log2 of the sum of 2^(scores · sm_scale · log2(e)).
//
// One cluster of C::SPLIT CTAs per (sequence, K/V head): each CTA takes an equal share of the sequence's
// pages (with enough (sequence, head) pairs to fill the GPU, `spread`, clusters of C::SPREAD_SPLIT CTAs,
// each taking a pair of its own, instead, or with C::FILL, where the pairs are many, C::WARPS / pair_warps
// pairs of their own, pair_warps warps each, as the launch chooses); each warp takes tokens in steps of
// (32 / (D / 8)) tokens, a row of K and of V read by D / 8 lanes,
// 16 bytes each, C::UNROLL steps of loads issued before any arithmetic; the GQA group's C::G query heads
// share every row read. Online softmax in registers, in base 2 with the scale folded into Q. The warps
// merge in shared memory, the cluster's CTAs in the first CTA through distributed shared memory.
#ifndef AUTOSCHED_KV_CACHE_DECODE_CUH
#define AUTOSCHED_KV_CACHE_DECODE_CUH

#include "common.cuh"

// exp2(m - top) that is 0 for an empty state.
__device__ __forceinline__ float autosched_kvd_weight(float m, float top) {
  return m == autosched_neg_inf() ? 0.f : exp2f(m - top);
}

// A sequence's page number `i` (read-only path: the table is written before the kernel).
__device__ __forceinline__ int autosched_kvd_page(const int* __restrict__ indices, int i) {
  return __ldg(indices + i);
}

template <typename T, class C>
__device__ __forceinline__ void autosched_kv_cache_decode(const T* __restrict__ Q, const T* __restrict__ pages,
    const int* __restrict__ indptr, const int* __restrict__ indices, const int* __restrict__ last_len,
    T* __restrict__ O, float* __restrict__ lse, float* smem, int cluster, int rank, int pairs, int spread,
    int pair_warps, float sm_scale) {
  constexpr int H = C::H, HKV = C::HKV, G = C::G, D = C::D, PAGE = C::PAGE;
  constexpr int WARPS = C::WARPS, UNROLL = C::UNROLL, SPLIT = C::SPLIT, THREADS = WARPS * 32;
  constexpr int TG = D / 8;     // lanes per token row (16 bytes each)
  constexpr int TPW = 32 / TG;  // tokens per warp per step
  constexpr size_t HEAD = (size_t)PAGE * D;  // elements of one head's K (or V) in a page
  static_assert(D % 8 == 0 && 32 % TG == 0, "head dim: 8 to 256, a power of two");
  // Shared memory: each warp's partial results, then the CTA's (read by the cluster's first CTA).
  auto part_o = reinterpret_cast<float (*)[G][D]>(smem);
  auto part_ml = reinterpret_cast<float (*)[G][2]>(smem + WARPS * G * D);
  auto fin_o = reinterpret_cast<float (*)[D]>(smem + WARPS * G * (D + 2));
  auto fin_ml = reinterpret_cast<float (*)[2]>(smem + (WARPS + 1) * G * D + WARPS * G * 2);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // Split: the cluster's pair, the CTA's share of its pages. Spread: the CTA's own pairs (one, or one for each
  // pair_warps warps), all their pages, in clusters of C::SPREAD_SPLIT (both chosen at launch).
  const bool alone = SPLIT == 1 || spread;
  // Warps per pair, and the thread's pair in the CTA (compile-time constants without C::FILL: its registers).
  const int pw = C::FILL && alone ? pair_warps : WARPS;
  const int slot = C::FILL ? warp / pw : 0, pthreads = pw * 32, ptid = C::FILL ? tid % pthreads : tid;
  const int ng = pw * TPW;  // tokens per pair per step
  const int sub = lane % TG, gid = (warp % pw) * TPW + lane / TG;
  const int first_pair = alone ? (cluster * (SPLIT == 1 ? 1 : C::SPREAD_SPLIT) + rank) * (WARPS / pw) : cluster;
  if (first_pair >= pairs) return;  // the last cluster's spare CTAs (spread only: no cluster barrier then)
  const int pair = first_pair + slot;
  const bool own = !C::FILL || pair < pairs;  // a CTA's last pairs may be spare: they wait at its barrier, no more
  const int parts = alone ? 1 : SPLIT, part = alone ? 0 : rank;
  const int seq = own ? pair / HKV : 0, kvh = pair % HKV;
  const int p0 = indptr[seq], npages = own ? indptr[seq + 1] - p0 : 0;
  const int len = npages > 0 ? (npages - 1) * PAGE + last_len[seq] : 0;
  const int first = part * npages / parts, last = (part + 1) * npages / parts;
  const int begin = first * PAGE, end = min(last * PAGE, len);
  const float scale = sm_scale * 1.4426950408889634f;  // log2(e): the softmax in base 2
  // K of head kvh in page p is at pages + (2 p · HKV + kvh) · HEAD, V HKV · HEAD further.
  const T* kbase = pages + (size_t)kvh * HEAD + sub * 8;

  float q[G][8], o[G][8], m[G], l[G];
  #pragma unroll
  for (int h = 0; h < G; ++h) {
    const uint4 raw = *reinterpret_cast<const uint4*>(Q + ((size_t)seq * H + kvh * G + h) * D + sub * 8);
    autosched_unpack8<T>(raw, q[h]);
    #pragma unroll
    for (int j = 0; j < 8; ++j) { q[h][j] *= scale; o[h][j] = 0.f; }
    m[h] = autosched_neg_inf(); l[h] = 0.f;
  }
  // The page numbers of the first step's tokens; each step then reads the next step's while its K and V
  // loads are in flight.
  int pg[UNROLL];
  #pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int t = begin + u * ng + gid;
    pg[u] = t < end ? autosched_kvd_page(indices, p0 + t / PAGE) : 0;
  }
  for (int base = begin; base < end; base += ng * UNROLL) {
    uint4 kr[UNROLL], vr[UNROLL];
    bool live[UNROLL];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // every load of the step first: bytes in flight
      const int t = base + u * ng + gid;
      live[u] = t < end;
      kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
      if (live[u]) {
        const T* row = kbase + ((size_t)pg[u] * 2 * HKV) * HEAD + (t % PAGE) * D;
        kr[u] = autosched_ld_stream_v4(row);
        vr[u] = autosched_ld_stream_v4(row + HKV * HEAD);
      }
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + (UNROLL + u) * ng + gid;
      pg[u] = t < end ? autosched_kvd_page(indices, p0 + t / PAGE) : 0;
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
        s[u][h] = live[u] ? x : autosched_neg_inf();
      }
    }
    #pragma unroll
    for (int h = 0; h < G; ++h) {
      float top = m[h];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) top = fmaxf(top, s[u][h]);
      const float keep = autosched_kvd_weight(m[h], top);
      l[h] *= keep;
      #pragma unroll
      for (int j = 0; j < 8; ++j) o[h][j] *= keep;
      m[h] = top;
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float v[8];
      autosched_unpack8<T>(vr[u], v);  // zeros where the token is not live
      #pragma unroll
      for (int h = 0; h < G; ++h) {
        const float p = autosched_kvd_weight(s[u][h], m[h]);
        l[h] += p;
        #pragma unroll
        for (int j = 0; j < 8; ++j) o[h][j] += p * v[j];
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
      const float a = autosched_kvd_weight(m[h], top), b = autosched_kvd_weight(m2, top);
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
  __syncthreads();
  // The warps meet in shared memory: each thread merges elements of the CTA's G x D output. A sequence
  // without tokens gives what TVM's kernel gives: an output of zeros and a log-sum-exp of -5e4.
  for (int e = ptid; own && e < G * D; e += pthreads) {
    const int h = e / D, c = e % D;
    float top = autosched_neg_inf();
    for (int w = slot * pw; w < (slot + 1) * pw; ++w) top = fmaxf(top, part_ml[w][h][0]);
    float sum = 0.f, acc = 0.f;
    for (int w = slot * pw; w < (slot + 1) * pw; ++w) {
      const float a = autosched_kvd_weight(part_ml[w][h][0], top);
      sum += part_ml[w][h][1] * a;
      acc += part_o[w][h][c] * a;
    }
    if (alone) {
      const size_t row = (size_t)seq * H + kvh * G + h;
      O[row * D + c] = autosched_dtype<T>::from_float(sum > 0.f ? acc / sum : 0.f);
      if (c == 0) lse[row] = sum > 0.f ? top + log2f(sum) : -5e4f;
    } else {
      fin_o[h][c] = acc;
      if (c == 0) { fin_ml[h][0] = top; fin_ml[h][1] = sum; }
    }
  }
  if (SPLIT > 1 && !alone) {
    // The cluster's CTAs meet in the first one through distributed shared memory.
    autosched_cluster_sync();
    if (rank == 0) {
      for (int e = tid; e < G * D; e += THREADS) {
        const int h = e / D, c = e % D;
        float mr[SPLIT], lr[SPLIT], orr[SPLIT];
        float top = autosched_neg_inf();
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
          const float a = autosched_kvd_weight(mr[r], top);
          sum += lr[r] * a;
          acc += orr[r] * a;
        }
        const size_t row = (size_t)seq * H + kvh * G + h;
        O[row * D + c] = autosched_dtype<T>::from_float(sum > 0.f ? acc / sum : 0.f);
        if (c == 0) lse[row] = sum > 0.f ? top + log2f(sum) : -5e4f;
      }
    }
    // The other CTAs' shared memory stays until the first has read it.
    autosched_cluster_sync();
  }
}

// The entry point NAME(Q, pages, indptr, indices, last_len, O, lse, smem, cluster, rank, pairs, spread,
// pair_warps, sm_scale) that the TIRx launch calls, for element type T and config C.
#define AUTOSCHED_KV_CACHE_DECODE(NAME, T, C)                                                              \
  __device__ __forceinline__ void NAME(const T* __restrict__ Q, const T* __restrict__ pages,              \
      const int* __restrict__ indptr, const int* __restrict__ indices, const int* __restrict__ last_len,   \
      T* __restrict__ O, float* __restrict__ lse, float* smem, int cluster, int rank, int pairs, int spread, \
      int pair_warps, float sm_scale) {                                                                    \
    autosched_kv_cache_decode<T, C>(Q, pages, indptr, indices, last_len, O, lse, smem, cluster, rank, pairs, \
                                    spread, pair_warps, sm_scale);                                        \
  }

#endif  // AUTOSCHED_KV_CACHE_DECODE_CUH
