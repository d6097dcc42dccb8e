// autosched's CUDA helper library for the sm_90 kernel templates: the dtype table, loads, bulk copies,
// mbarrier waits, tensor-core fragments and packing. Every function is inlined into its caller.
// The guard lets several kernels of one module each carry this file (TVM emits a source once per name).
#ifndef AUTOSCHED_COMMON_CUH
#define AUTOSCHED_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifndef __CUDACC_RTC__  // NVRTC: TVM's preamble defines the fixed-width types
#include <cstdint>
#endif

// The dtype table: each 16-bit type, its pair and conversions (splat: one float to both halves).
template <typename T> struct autosched_dtype;
template <> struct autosched_dtype<half> {
  using pair = __half2;
  static __device__ __forceinline__ float2 to_float2(pair v) { return __half22float2(v); }
  static __device__ __forceinline__ pair pack(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ half from_float(float a) { return __float2half_rn(a); }
  static __device__ __forceinline__ pair splat(float a) { return __float2half2_rn(a); }
};
template <> struct autosched_dtype<nv_bfloat16> {
  using pair = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(pair v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ pair pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ nv_bfloat16 from_float(float a) { return __float2bfloat16_rn(a); }
  static __device__ __forceinline__ pair splat(float a) { return __float2bfloat162_rn(a); }
};

// Two floats as one 32-bit register of two T.
template <typename T> __device__ __forceinline__ uint32_t autosched_pack(float x, float y) {
  typename autosched_dtype<T>::pair v = autosched_dtype<T>::pack(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 16 bytes of T (8 elements) as floats.
template <typename T> __device__ __forceinline__ void autosched_unpack8(const uint4& v, float* out) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = autosched_dtype<T>::to_float2(*reinterpret_cast<const typename autosched_dtype<T>::pair*>(&w[i]));
    out[2 * i] = f.x; out[2 * i + 1] = f.y;
  }
}

// Loads 16 bytes that are read once (weights, a KV cache) without allocating them in L1; not volatile, so
// that the compiler may issue an unrolled loop's loads ahead of its arithmetic.
__device__ __forceinline__ uint4 autosched_ld_stream_v4(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// -inf by its bits (NVRTC may lack math.h's INFINITY).
__device__ __forceinline__ float autosched_neg_inf() { return __int_as_float(0xff800000); }

// 16 bytes into shared memory without registers; zeros where `valid` is false (src-size 0).
__device__ __forceinline__ void autosched_cp_async(void* dst, const void* src, bool valid) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(address), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// Closes the thread's group of cp.async copies issued since the last; waits until at most N groups are open.
__device__ __forceinline__ void autosched_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void autosched_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// Bytes into the L2 cache by the copy engine, without registers or shared memory.
__device__ __forceinline__ void autosched_prefetch_l2(const void* src, int bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(src), "r"(bytes) : "memory");
}

// One thread's bulk copies from global into shared memory (the copy engine: no register or instruction per
// byte), completing on an mbarrier that the thread initialises and arms for their bytes.
__device__ __forceinline__ void autosched_bulk_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void autosched_bulk_copy(void* dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// A box of a rank-3 tensor map into shared memory, completing on mbarrier `bar`.
__device__ __forceinline__ void autosched_tma_3d(unsigned dst, unsigned long long map, int x, int y, int z,
    unsigned bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];"
               :: "r"(dst), "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar) : "memory");
}

// Waits until the mbarrier at shared address `bar` has completed the phase of parity `parity`.
__device__ __forceinline__ void autosched_mbarrier_wait(unsigned bar, unsigned parity) {
  uint32_t done = 0;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// Every thread of the cluster, with release/acquire semantics and a memory clobber, so that nvcc keeps
// shared-memory accesses on their side of it.
__device__ __forceinline__ void autosched_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A float of another CTA of the cluster: the same offset in its shared memory.
__device__ __forceinline__ float autosched_remote_f32(const float* local, int rank) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// One warp's m16n8k16 tensor-core product, fp32 accumulators.
template <typename T> __device__ __forceinline__ void autosched_mma_m16n8k16(float* c, uint32_t a0, uint32_t a1,
    uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void autosched_mma_m16n8k16<half>(float* c, uint32_t a0, uint32_t a1,
    uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void autosched_mma_m16n8k16<nv_bfloat16>(float* c, uint32_t a0, uint32_t a1,
    uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8x8 matrices of 16-bit elements from shared memory, transposed or not.
__device__ __forceinline__ void autosched_ldmatrix_x4(uint32_t* a, unsigned address, bool trans) {
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(address) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(address) : "memory");
}

// An 8x8 matrix of 16-bit pairs (a lane holds row lane / 4, columns 2 (lane % 4) + {0, 1}), transposed.
__device__ __forceinline__ uint32_t autosched_transpose_8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

#endif  // AUTOSCHED_COMMON_CUH
