// The sm_90 TIRx templates' small helpers (hopper_gemm, hopper_dequant, hopper_attention): synchronisation
// across warpgroups and clusters, split-K's partial sums, the epilogue, and attention's register helpers.
// Helpers whose names carry a dtype or activation are made per kernel by the AUTOSCHED_* macros below.
#ifndef AUTOSCHED_HOPPER_CUH
#define AUTOSCHED_HOPPER_CUH

#include "common.cuh"

// Keeps nvcc from moving accumulator reads and writes across the asynchronous wgmma (the inline asm of
// wgmma.wait_group names no registers).
__device__ __forceinline__ void autosched_acc_fence(float& x) { asm volatile("" : "+f"(x) :: "memory"); }

// Ping-pong turns between two consumer warpgroups: named barriers 1 and 2 over both (256 threads). A
// warpgroup syncs on its own barrier to take its turn and arrives on the other's to hand the turn over.
__device__ __forceinline__ void autosched_turn_sync(int id) {
  asm volatile("bar.sync %0, 256;" :: "r"(id) : "memory");
}
__device__ __forceinline__ void autosched_turn_handover(int id) {
  asm volatile("bar.arrive %0, 256;" :: "r"(id) : "memory");
}

// The consumer warpgroups alone (named barrier 1 over `threads`).
__device__ __forceinline__ void autosched_consumers_sync(int threads) {
  asm volatile("bar.sync 1, %0;" :: "r"(threads) : "memory");
}

// (autosched_cluster_sync, the cluster-wide barrier, is common.cuh's.)

// Split-K: a CTA's fp32 partial sum into its shared memory, and the first CTA's add of another CTA's
// (rank's) partial sum through distributed shared memory.
__device__ __forceinline__ void autosched_partial_store(void* base, int index, float x) {
  reinterpret_cast<float*>(base)[index] = x;
}
__device__ __forceinline__ void autosched_partial_add_remote(float& x, void* base, int index, unsigned rank) {
  unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(reinterpret_cast<float*>(base) + index));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  x += v;
}

// TMA multicast: an arrive on the mbarrier `bar` of the cluster's CTA `rank`, through its address in the
// cluster's shared window, with the default CTA-scope release.
__device__ __forceinline__ void autosched_cluster_arrive(void* bar, int rank) {
  unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");
}
// The barriers' initialisation released to the cluster (the other CTA's producer may multicast next).
__device__ __forceinline__ void autosched_barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The epilogue: an accumulator pair through the activation ACT, stored as one 4-byte vector, or one value.
#define AUTOSCHED_ACT_NONE 0
#define AUTOSCHED_ACT_SILU 1
#define AUTOSCHED_ACT_GELU 2
template <int ACT> __device__ __forceinline__ float autosched_act(float x) {
  if constexpr (ACT == AUTOSCHED_ACT_SILU) return x / (1.0f + __expf(-x));
  else if constexpr (ACT == AUTOSCHED_ACT_GELU) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
  else return x;
}
template <typename T, int ACT> __device__ __forceinline__ void autosched_store2(T* p, float a, float b) {
  *reinterpret_cast<typename autosched_dtype<T>::pair*>(p) = autosched_dtype<T>::pack(autosched_act<ACT>(a), autosched_act<ACT>(b));
}
template <typename T, int ACT> __device__ __forceinline__ void autosched_store1(T* p, float a) {
  *p = autosched_dtype<T>::from_float(autosched_act<ACT>(a));
}
// autosched_store2_TAG(p, a, b) and autosched_store1_TAG(p, a) of element type T and activation ACT.
#define AUTOSCHED_EPILOGUE(TAG, T, ACT)                                                                      \
  __device__ __forceinline__ void autosched_store2_##TAG(T* p, float a, float b) { autosched_store2<T, ACT>(p, a, b); } \
  __device__ __forceinline__ void autosched_store1_##TAG(T* p, float a) { autosched_store1<T, ACT>(p, a); }

// Attention's register helpers: the quad (row) reductions over warp shuffles, exp2, and per dtype (TAG)
// two floats packed into one register of two T, and such a pair stored.
__device__ __forceinline__ float autosched_quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float autosched_quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1); return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float autosched_exp2(float x) {
  float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
#define AUTOSCHED_ATTENTION_PAIR(TAG, T)                                                                     \
  __device__ __forceinline__ unsigned int autosched_pack_##TAG(float a, float b) { return autosched_pack<T>(a, b); } \
  __device__ __forceinline__ void autosched_store_pair_##TAG(T* p, float a, float b) {                       \
    *reinterpret_cast<typename autosched_dtype<T>::pair*>(p) = autosched_dtype<T>::pack(a, b);               \
  }

#endif  // AUTOSCHED_HOPPER_CUH
