// swiglu_gemv's chunk helpers (search_spaces/templates/swiglu_gemv.py explains the kernel): a SwiGLU MLP's gate
// and up projections of a decode step, fp16 or bf16 weights, one lane's 16-byte chunk (8 weights) of a gate row
// and the same chunk of its up row at a time. The helper streams both chunks in (common.cuh's non-coherent load
// without L1 allocation), converts them to fp32 once (common.cuh's autosched_unpack8), then adds each of M
// activation rows' products with them to that row's gate and up accumulators (autosched_swiglu_row). The warp
// sum is int4_gemv.cuh's; SiLU(gate) * up is the kernel's, after it. swiglu_gemv.py names each helper per point,
// with a gate and an up accumulator parameter per row.
#ifndef AUTOSCHED_SWIGLU_GEMV_CUH
#define AUTOSCHED_SWIGLU_GEMV_CUH

#include "common.cuh"

// 8 weights of T (16 bytes, read once) as floats.
template <typename T> __device__ __forceinline__ void autosched_swiglu_unpack(const void* wp, float (&w)[8]) {
  const uint4 v = autosched_ld_stream_v4(wp);
  autosched_unpack8<T>(v, w);
}

// One activation row's products with a gate chunk and an up chunk (k order), in fp32, added to its accumulators.
template <typename T>
__device__ __forceinline__ void autosched_swiglu_row(float& gate, float& up, const float (&wg)[8],
                                                     const float (&wu)[8], const void* xp, int i, int row_bytes) {
  const uint4 a = *reinterpret_cast<const uint4*>(static_cast<const char*>(xp) + i * row_bytes);
  float x[8];
  autosched_unpack8<T>(a, x);
  float g = 0.f, u = 0.f;
  #pragma unroll
  for (int t = 0; t < 8; ++t) {
    g += x[t] * wg[t];  // one FMA per weight
    u += x[t] * wu[t];
  }
  gate += g;
  up += u;
}

#endif  // AUTOSCHED_SWIGLU_GEMV_CUH
