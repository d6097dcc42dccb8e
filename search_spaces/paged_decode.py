"""Decode attention over a paged KV cache on sm_90: a flash-decoding kernel as a template space.

One query token per sequence; the cost is reading K and V once. The kernel (a CUDA body inside a TIRx
launch) is built for that:

* one CTA per (sequence, K/V head), so a GQA group's query heads share every K and V row read;
* a row of K (and of V) is read by ``d / 8`` lanes, 16 bytes each, through the read-only path; a warp
  takes 32·8/d tokens per step and issues ``unroll`` steps of K and V loads before any arithmetic, so
  that enough bytes are in flight to cover the memory latency;
* online softmax in registers (exp2 with the scale folded in, one rescale per ``unroll`` steps), partial
  outputs of 8 elements per lane, then merged within the warp by shuffles and across the warps in
  shared memory;
* with few sequences (``split`` > 1) the pages of a sequence are split between the CTAs of a thread-block
  cluster, and the first CTA merges the others' (max, sum, output) through distributed shared memory:
  no second kernel and no workspace in global memory.

On CUDA cores a GQA group costs 2·G·D FMAs per token, so at G = 8 the kernel is issue-bound (33% of the
copy bandwidth on the H200) where at G = 1 it streams at 96%. The ``mma`` knob (groups of 2-16 heads,
head dim 64 or 128) takes QKᵀ and PV to tensor cores instead: ``mma.sync`` m16n8k16 with the group's
heads as M, 16-token tiles, the scores' accumulators reused as PV's A fragment (see ``_mma_loop``).
That loop holds 178 registers a thread at G = 8 and d = 128 (nvcc 13), so one 8-warp CTA fills an SM;
``ctas_per_sm`` caps them (``__launch_bounds__``) for 2 to 4 CTAs per SM, trading spills for more warps
with loads in flight.

Those loops keep the bytes in flight in registers, and stop at 70% of the copy bandwidth at G = 8. The
``tma_stages`` knob (groups of 2-8 heads) takes the loads off the registers: a producer warp asks the copy
engine for whole pages (tensor maps) into a ring of 4-16 pages in shared memory, and the consumer warps take
the products transposed, keys as M and the group's heads as N, so that no tensor-core row is idle (see
``_tma_loop``): 81-84% of the copy bandwidth at G = 8, 94% at G = 4 (H200), and the default for those groups.
"""

from __future__ import annotations

import math

from ._knobs import Knob, Point
from .hopper_gemm import CLUSTER_SYNC, CLUSTER_SYNC_SOURCE, HOPPER_ARCHS, SMEM_LIMIT, HopperTemplate
from .int4_gemv import STREAM_LOAD, STREAM_LOAD_SOURCE

MIN_REGISTER_CAP = 128  # ctas_per_sm's lowest cap: there GQA 8:1's tensor-core loop spills 160 bytes (nvcc 13)
MMA_MAX_GROUP = 16  # query heads per K/V head on the M side of m16n8k16
_CUDA = {"float16": ("half", "__half2", "__half22float2", "__float2half_rn"),
         "bfloat16": ("nv_bfloat16", "__nv_bfloat162", "__bfloat1622float2", "__float2bfloat16_rn")}


def smem_floats(g: int, d: int, warps: int, pages: int, split: int, ring: int = 0) -> int:
    """Shared memory the body takes, in 4-byte words: partial results per warp and per CTA, page table,
    then (16-byte aligned) each warp's ring of ``ring`` K/V tiles for the tensor-core loop."""
    words = (warps + 1) * g * (d + 2) + (pages + split - 1) // split + 1
    if not ring:
        return words
    pieces = 2 * (d // 32) + 4 * (d // 64)  # 16-byte pieces per lane per 16-token tile
    return (words + 3) // 4 * 4 + ring * warps * pieces * 32 * 4


def ring_stages(p: Point) -> int:
    """Tiles in each warp's shared-memory ring: tensor-core points unrolled past one tile use a ring."""
    return p["unroll"] if p.get("mma") and p["unroll"] > 1 else 0


def _body_source(name: str, dtype: str, s: dict, mma: bool = False, ring: bool = False, prefetch: int = 0,
                 tma: bool = False) -> str:
    """The kernel's body: one thread's work, for the constants in ``s``; with ``mma``, the main loop's
    products on tensor cores (with ``ring``, fed through shared memory; with ``prefetch``, tiles fetched
    into L2 that many steps ahead); with ``tma``, the transposed tensor-core loop fed by a producer warp's
    TMA loads (``_tma_loop``)."""
    scalar, pair, to_float2, from_float = _CUDA[dtype]
    tma_params = ", void* ring, unsigned long long k_map, unsigned long long v_map" if tma else ""
    consts = "".join(f"  constexpr int {key} = {value};\n" for key, value in s.items())
    head = CLUSTER_SYNC_SOURCE + STREAM_LOAD_SOURCE + (
        # -inf spelled by its bits: INFINITY comes from math.h, which NVRTC (the GPU machine's compiler) may lack.
        "__device__ __forceinline__ float autosched_pd_neg_inf() { return __int_as_float(0xff800000); }\n"
        "__device__ __forceinline__ float autosched_pd_weight(float m, float top) {\n"
        "  return m == autosched_pd_neg_inf() ? 0.f : exp2f(m - top);\n}\n"
        # A float of another CTA of the cluster: the same offset in its shared memory.
        "__device__ __forceinline__ float autosched_pd_remote(const float* local, int rank) {\n"
        "  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(local));\n"
        "  unsigned remote;\n"
        "  float v;\n"
        "  asm volatile(\"mapa.shared::cluster.u32 %0, %1, %2;\" : \"=r\"(remote) : \"r\"(address), \"r\"(rank));\n"
        "  asm volatile(\"ld.shared::cluster.f32 %0, [%1];\" : \"=f\"(v) : \"r\"(remote) : \"memory\");\n"
        "  return v;\n}\n"
        f"__device__ __forceinline__ void autosched_pd_unpack_{dtype}(const uint4& v, float* out) {{\n"
        "  const uint32_t w[4] = {v.x, v.y, v.z, v.w};\n"
        "  #pragma unroll\n"
        "  for (int i = 0; i < 4; ++i) {\n"
        f"    float2 f = {to_float2}(*reinterpret_cast<const {pair}*>(&w[i]));\n"
        "    out[2 * i] = f.x; out[2 * i + 1] = f.y;\n"
        "  }\n}\n"
        f"__device__ __forceinline__ void {name}(const {scalar}* __restrict__ Q, const {scalar}* __restrict__ K,\n"
        f"    const {scalar}* __restrict__ V, const int* __restrict__ table, const int* __restrict__ lens,\n"
        f"    {scalar}* __restrict__ O, float* smem, int pair, int rank{tma_params}) {{\n"
        f"{consts}"
        "  constexpr int TG = D / 8;             // lanes per token row (16 bytes each)\n"
        "  constexpr int TPW = 32 / TG;          // tokens per warp per step\n"
        "  constexpr int NG = WARPS * TPW;       // tokens per CTA per step\n"
        "  // Shared memory (the caller's): the warps' and the CTA's partial results, then the CTA's slice of the\n"
        "  // block table (so that no K/V load waits on a table load).\n"
        "  auto part_o = reinterpret_cast<float (*)[G][D]>(smem);\n"
        "  auto part_ml = reinterpret_cast<float (*)[G][2]>(smem + WARPS * G * D);\n"
        "  auto fin_o = reinterpret_cast<float (*)[D]>(smem + WARPS * G * (D + 2));\n"
        "  auto fin_ml = reinterpret_cast<float (*)[2]>(smem + (WARPS + 1) * G * D + WARPS * G * 2);\n"
        "  int* page_of = reinterpret_cast<int*>(smem + (WARPS + 1) * G * (D + 2));\n"
        "  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;\n"
        "  const int sub = lane % TG, gid = warp * TPW + lane / TG;\n"
        "  const int seq = pair / HKV, kvh = pair % HKV;\n"
        "  const int len = lens[seq];\n"
        "  const int pages = (len + PAGE - 1) / PAGE;\n"
        "  const int first = rank * pages / SPLIT, last = (rank + 1) * pages / SPLIT;\n"
        "  const int begin = first * PAGE, end = min(last * PAGE, len);\n"
        "  for (int i = tid; i < last - first; i += THREADS) page_of[i] = table[seq * PPS + first + i];\n"
    )
    cuda_core_loop = (
        "  float q[G][8], o[G][8], m[G], l[G];\n"
        "  #pragma unroll\n"
        "  for (int h = 0; h < G; ++h) {\n"
        "    uint4 raw = *reinterpret_cast<const uint4*>(Q + ((size_t)seq * H + kvh * G + h) * D + sub * 8);\n"
        f"    autosched_pd_unpack_{dtype}(raw, q[h]);\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < 8; ++j) { q[h][j] *= SCALE_LOG2E; o[h][j] = 0.f; }\n"
        "    m[h] = autosched_pd_neg_inf(); l[h] = 0.f;\n"
        "  }\n"
        "  __syncthreads();\n"
        "  for (int base = begin; base < end; base += NG * UNROLL) {\n"
        "    uint4 kr[UNROLL], vr[UNROLL];\n"
        "    bool live[UNROLL];\n"
        "    #pragma unroll\n"
        "    for (int u = 0; u < UNROLL; ++u) {  // every load of the step first: bytes in flight\n"
        "      const int t = base + u * NG + gid;\n"
        "      live[u] = t < end;\n"
        "      if (live[u]) {\n"
        "        const size_t row = ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh;\n"
        f"        kr[u] = {STREAM_LOAD}(K + row * D + sub * 8);\n"
        f"        vr[u] = {STREAM_LOAD}(V + row * D + sub * 8);\n"
        "      }\n"
        "    }\n"
        "    float s[UNROLL][G];\n"
        "    #pragma unroll\n"
        "    for (int u = 0; u < UNROLL; ++u) {\n"
        "      float k[8];\n"
        f"      autosched_pd_unpack_{dtype}(kr[u], k);\n"
        "      #pragma unroll\n"
        "      for (int h = 0; h < G; ++h) {\n"
        "        float x = 0.f;\n"
        "        #pragma unroll\n"
        "        for (int j = 0; j < 8; ++j) x += q[h][j] * k[j];\n"
        "        #pragma unroll\n"
        "        for (int off = TG / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);\n"
        "        s[u][h] = live[u] ? x : autosched_pd_neg_inf();\n"
        "      }\n"
        "    }\n"
        "    #pragma unroll\n"
        "    for (int h = 0; h < G; ++h) {\n"
        "      float top = m[h];\n"
        "      #pragma unroll\n"
        "      for (int u = 0; u < UNROLL; ++u) top = fmaxf(top, s[u][h]);\n"
        "      const float keep = autosched_pd_weight(m[h], top);\n"
        "      l[h] *= keep;\n"
        "      #pragma unroll\n"
        "      for (int j = 0; j < 8; ++j) o[h][j] *= keep;\n"
        "      m[h] = top;\n"
        "    }\n"
        "    #pragma unroll\n"
        "    for (int u = 0; u < UNROLL; ++u) {\n"
        "      float v[8];\n"
        f"      autosched_pd_unpack_{dtype}(vr[u], v);\n"
        "      #pragma unroll\n"
        "      for (int h = 0; h < G; ++h) {\n"
        "        const float p = autosched_pd_weight(s[u][h], m[h]);\n"
        "        l[h] += p;\n"
        "        #pragma unroll\n"
        "        for (int j = 0; j < 8; ++j) o[h][j] += p * (live[u] ? v[j] : 0.f);\n"
        "      }\n"
        "    }\n"
        "  }\n"
        "  // The warp's token groups meet by shuffles (same sub-lane, other groups).\n"
        "  #pragma unroll\n"
        "  for (int off = TG; off < 32; off <<= 1) {\n"
        "    #pragma unroll\n"
        "    for (int h = 0; h < G; ++h) {\n"
        "      const float m2 = __shfl_xor_sync(0xffffffffu, m[h], off);\n"
        "      const float l2 = __shfl_xor_sync(0xffffffffu, l[h], off);\n"
        "      const float top = fmaxf(m[h], m2);\n"
        "      const float a = autosched_pd_weight(m[h], top), b = autosched_pd_weight(m2, top);\n"
        "      l[h] = l[h] * a + l2 * b;\n"
        "      #pragma unroll\n"
        "      for (int j = 0; j < 8; ++j) o[h][j] = o[h][j] * a + __shfl_xor_sync(0xffffffffu, o[h][j], off) * b;\n"
        "      m[h] = top;\n"
        "    }\n"
        "  }\n"
        "  if (lane < TG) {\n"
        "    #pragma unroll\n"
        "    for (int h = 0; h < G; ++h) {\n"
        "      #pragma unroll\n"
        "      for (int j = 0; j < 8; ++j) part_o[warp][h][sub * 8 + j] = o[h][j];\n"
        "      if (lane == 0) { part_ml[warp][h][0] = m[h]; part_ml[warp][h][1] = l[h]; }\n"
        "    }\n"
        "  }\n"
    )
    tail = (
        "  __syncthreads();\n"
        "  // The warps meet in shared memory: each thread merges elements of the CTA's G x D output.\n"
        "  for (int e = tid; e < G * D; e += THREADS) {\n"
        "    const int h = e / D, c = e % D;\n"
        "    float top = autosched_pd_neg_inf();\n"
        "    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, part_ml[w][h][0]);\n"
        "    float sum = 0.f, acc = 0.f;\n"
        "    for (int w = 0; w < WARPS; ++w) {\n"
        "      const float a = autosched_pd_weight(part_ml[w][h][0], top);\n"
        "      sum += part_ml[w][h][1] * a;\n"
        "      acc += part_o[w][h][c] * a;\n"
        "    }\n"
        "    if (SPLIT == 1) {\n"
        f"      O[((size_t)seq * H + kvh * G + h) * D + c] = {from_float}(acc / sum);\n"
        "    } else {\n"
        "      fin_o[h][c] = acc;\n"
        "      if (c == 0) { fin_ml[h][0] = top; fin_ml[h][1] = sum; }\n"
        "    }\n"
        "  }\n"
        "  if (SPLIT > 1) {\n"
        "    // The cluster's CTAs meet in the first one's registers through distributed shared memory.\n"
        f"    {CLUSTER_SYNC}();\n"
        "    if (rank == 0) {\n"
        "      for (int e = tid; e < G * D; e += THREADS) {\n"
        "        const int h = e / D, c = e % D;\n"
        "        float mr[SPLIT], lr[SPLIT], orr[SPLIT];\n"
        "        float top = autosched_pd_neg_inf();\n"
        "        #pragma unroll\n"
        "        for (int r = 0; r < SPLIT; ++r) {\n"
        "          mr[r] = autosched_pd_remote(&fin_ml[h][0], r);\n"
        "          lr[r] = autosched_pd_remote(&fin_ml[h][1], r);\n"
        "          orr[r] = autosched_pd_remote(&fin_o[h][c], r);\n"
        "          top = fmaxf(top, mr[r]);\n"
        "        }\n"
        "        float sum = 0.f, acc = 0.f;\n"
        "        #pragma unroll\n"
        "        for (int r = 0; r < SPLIT; ++r) {\n"
        "          const float a = autosched_pd_weight(mr[r], top);\n"
        "          sum += lr[r] * a;\n"
        "          acc += orr[r] * a;\n"
        "        }\n"
        f"        O[((size_t)seq * H + kvh * G + h) * D + c] = {from_float}(acc / sum);\n"
        "      }\n"
        "    }\n"
        "    // The other CTAs' shared memory stays until the first has read it.\n"
        f"    {CLUSTER_SYNC}();\n"
        "  }\n"
        "}\n")
    if tma:
        loop = _tma_loop(dtype)
    else:
        loop = _mma_loop(dtype, ring, prefetch) if mma else cuda_core_loop
    return (_mma_helpers(dtype) if mma else "") + (TMA_HELPERS if tma else "") + head + loop + tail


_MMA_TYPES = {"float16": ("f16", "__floats2half2_rn", "__half2"), "bfloat16": ("bf16", "__floats2bfloat162_rn", "__nv_bfloat162")}


def _mma_helpers(dtype: str) -> str:
    """One warp's m16n8k16 tensor-core product (fp32 accumulators), and two floats packed as a pair."""
    ptx, pack, pair = _MMA_TYPES[dtype]
    return (
        f"__device__ __forceinline__ void autosched_pd_mma_{dtype}(float* c, uint32_t a0, uint32_t a1, uint32_t a2,\n"
        "    uint32_t a3, uint32_t b0, uint32_t b1) {\n"
        f"  asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, \"\n"
        "               \"{%8, %9}, {%0, %1, %2, %3};\"\n"
        "               : \"+f\"(c[0]), \"+f\"(c[1]), \"+f\"(c[2]), \"+f\"(c[3])\n"
        "               : \"r\"(a0), \"r\"(a1), \"r\"(a2), \"r\"(a3), \"r\"(b0), \"r\"(b1));\n}\n"
        f"__device__ __forceinline__ uint32_t autosched_pd_pack_{dtype}(float x, float y) {{\n"
        f"  {pair} v = {pack}(x, y);\n"
        "  return *reinterpret_cast<uint32_t*>(&v);\n}\n"
        # 16 bytes into shared memory without registers; zeros where ``valid`` is false (src-size 0).
        "__device__ __forceinline__ void autosched_pd_cp_async(void* dst, const void* src, bool valid) {\n"
        "  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));\n"
        "  asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16, %2;\\n\"\n"
        "               :: \"r\"(address), \"l\"(src), \"r\"(valid ? 16 : 0) : \"memory\");\n}\n"
        # A whole K or V row into the L2 cache by the copy engine, without registers or shared memory.
        "__device__ __forceinline__ void autosched_pd_prefetch_l2(const void* src, int bytes) {\n"
        "  asm volatile(\"cp.async.bulk.prefetch.L2.global [%0], %1;\" :: \"l\"(src), \"r\"(bytes) : \"memory\");\n}\n")


def _mma_loop(dtype: str, ring: bool, prefetch: int = 0) -> str:
    """The main loop with QKᵀ and PV on tensor cores (``mma.sync`` m16n8k16), for GQA groups of 2-16 heads.

    A warp takes tiles of 16 tokens. The group's heads are the M side (rows g and g + 8 of lane's quad
    g = lane / 4; rows past G are zero). Groups of at most 8 heads (``ROWS`` = 1) never keep rows g + 8:
    their output accumulators live only inside each instruction, which frees 32 registers a thread
    (200 to 178 at G = 8, d = 128, for nvcc 13). For QKᵀ the head dimension is permuted so that lane t = lane % 4
    of a quad reads one contiguous quarter of a K row (16-byte loads) and finds in it its B fragments of
    every k-step; Q, loaded once, follows the same order. The scores' accumulators are PV's A fragment
    (FlashAttention-2's register reuse); for PV each lane reads a contiguous eighth of four V rows and
    pairs them by byte permutes. Output column j of n-tile ``nt`` is element (n · D/8 + j) of the head.

    Without ``ring`` a lane loads ``UNROLL`` tiles into registers, then computes; with it, each warp keeps
    a ring of ``UNROLL`` tiles in shared memory filled by ``cp.async`` (every lane reads back only its own
    16-byte pieces, so no barrier is needed), so that more bytes are in flight than registers could hold.

    With ``prefetch`` (tiles in registers only), once a tile's loads are issued the warp asks the L2 for
    its tile ``prefetch`` steps ahead (lanes 0-15 a K row each, 16-31 a V row, by bulk prefetches), so
    that DRAM keeps streaming while the warp waits on its loads and computes; its later loads hit L2."""
    mma, pack = f"autosched_pd_mma_{dtype}", f"autosched_pd_pack_{dtype}"
    head = (
        "  constexpr int KS = D / 16;  // k-steps of QKᵀ\n"
        "  constexpr int KV4 = D / 32;  // 16-byte loads per lane per K row (a quarter row)\n"
        "  constexpr int VV4 = D / 64;  // 16-byte loads per lane per V row (an eighth)\n"
        "  constexpr int NT = D / 8;  // n-tiles of PV\n"
        "  constexpr int ROWS = G > 8 ? 2 : 1;  // accumulator rows in use: g, and g + 8 for groups past 8\n"
        "  const int g = lane / 4, t4 = lane % 4;\n"
        "  uint32_t qa[KS][2], qb[KS][2];  // Q's A fragments: rows g (a0, a2) and g + 8 (a1, a3)\n"
        "  #pragma unroll\n"
        "  for (int s = 0; s < KS; ++s) {\n"
        "    const size_t qrow = (size_t)seq * H + kvh * G;\n"
        "    uint2 ra = make_uint2(0u, 0u), rb = make_uint2(0u, 0u);\n"
        "    if (g < G) ra = *reinterpret_cast<const uint2*>(Q + (qrow + g) * D + t4 * (D / 4) + 4 * s);\n"
        "    if (g + 8 < G) rb = *reinterpret_cast<const uint2*>(Q + (qrow + g + 8) * D + t4 * (D / 4) + 4 * s);\n"
        "    qa[s][0] = ra.x; qa[s][1] = ra.y; qb[s][0] = rb.x; qb[s][1] = rb.y;\n"
        "  }\n"
        "  float o[NT][4], mrow[2], lrow[2];\n"
        "  #pragma unroll\n"
        "  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;\n"
        "  mrow[0] = mrow[1] = autosched_pd_neg_inf(); lrow[0] = lrow[1] = 0.f;\n"
        "  __syncthreads();\n"
    )
    ring_loads = (
        "  constexpr int TPS = 1;  // tiles per step\n"
        "  constexpr int PIECES = 2 * KV4 + 4 * VV4;  // 16-byte pieces per lane per tile\n"
        "  constexpr int RING_OFFSET = ((WARPS + 1) * G * (D + 2) + (PPS + SPLIT - 1) / SPLIT + 1 + 3) / 4 * 4;\n"
        "  uint4* ring = reinterpret_cast<uint4*>(smem + RING_OFFSET) + (size_t)warp * UNROLL * PIECES * 32 + lane;\n"
        "  const int tiles = end - begin > warp * 16 ? (end - begin - warp * 16 + WARPS * 16 - 1) / (WARPS * 16) : 0;\n"
        "  auto issue = [&](int k) {  // the warp's tile k into slot k % UNROLL, as one commit group\n"
        "    if (k < tiles) {\n"
        "      const int base = begin + (warp + k * WARPS) * 16;\n"
        "      uint4* slot = ring + (k % UNROLL) * PIECES * 32;\n"
        "      #pragma unroll\n"
        "      for (int nt = 0; nt < 2; ++nt) {\n"
        "        const int t = base + 8 * nt + g;\n"
        "        const size_t row = t < end ? ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh : 0;\n"
        "        #pragma unroll\n"
        "        for (int i = 0; i < KV4; ++i)\n"
        "          autosched_pd_cp_async(slot + (nt * KV4 + i) * 32, K + row * D + t4 * (D / 4) + 8 * i, t < end);\n"
        "      }\n"
        "      #pragma unroll\n"
        "      for (int r = 0; r < 4; ++r) {\n"
        "        const int t = base + 2 * t4 + (r & 1) + 8 * (r >> 1);\n"
        "        const size_t row = t < end ? ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh : 0;\n"
        "        #pragma unroll\n"
        "        for (int i = 0; i < VV4; ++i)\n"
        "          autosched_pd_cp_async(slot + (2 * KV4 + r * VV4 + i) * 32, V + row * D + g * (D / 8) + 8 * i, t < end);\n"
        "      }\n"
        "    }\n"
        "    asm volatile(\"cp.async.commit_group;\\n\" ::: \"memory\");\n"
        "  };\n"
        "  for (int k = 0; k < UNROLL - 1; ++k) issue(k);\n"
        "  for (int k = 0; k < tiles; ++k) {\n"
        "    issue(k + UNROLL - 1);\n"
        "    asm volatile(\"cp.async.wait_group %0;\\n\" :: \"n\"(UNROLL - 1) : \"memory\");\n"
        "    const int tile0 = begin + (warp + k * WARPS) * 16;\n"
        "    const uint4* slot = ring + (k % UNROLL) * PIECES * 32;\n"
        "    uint4 kr[1][2][KV4], vr[1][4][VV4];\n"
        "    #pragma unroll\n"
        "    for (int i = 0; i < 2 * KV4; ++i) kr[0][i / KV4][i % KV4] = slot[i * 32];\n"
        "    #pragma unroll\n"
        "    for (int i = 0; i < 4 * VV4; ++i) vr[0][i / VV4][i % VV4] = slot[(2 * KV4 + i) * 32];\n"
    )
    direct_loads = (
        "  constexpr int TPS = UNROLL;  // tiles per step\n"
        "  for (int tile0 = begin + warp * TPS * 16; tile0 < end; tile0 += WARPS * TPS * 16) {\n"
        "    uint4 kr[TPS][2][KV4], vr[TPS][4][VV4];\n"
        "    #pragma unroll\n"
        "    for (int u = 0; u < TPS; ++u) {  // every load of the step first: bytes in flight\n"
        "      const int base = tile0 + u * 16;\n"
        "      #pragma unroll\n"
        "      for (int nt = 0; nt < 2; ++nt) {  // K rows base + 8 nt + g: a quarter each\n"
        "        const int t = base + 8 * nt + g;\n"
        "        const size_t row = t < end ? ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh : 0;\n"
        "        #pragma unroll\n"
        "        for (int i = 0; i < KV4; ++i)\n"
        f"          kr[u][nt][i] = t < end ? {STREAM_LOAD}(K + row * D + t4 * (D / 4) + 8 * i) : make_uint4(0u, 0u, 0u, 0u);\n"
        "      }\n"
        "      #pragma unroll\n"
        "      for (int r = 0; r < 4; ++r) {  // V rows base + 2 t4 + {0, 1, 8, 9}: an eighth each\n"
        "        const int t = base + 2 * t4 + (r & 1) + 8 * (r >> 1);\n"
        "        const size_t row = t < end ? ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh : 0;\n"
        "        #pragma unroll\n"
        "        for (int i = 0; i < VV4; ++i)\n"
        f"          vr[u][r][i] = t < end ? {STREAM_LOAD}(V + row * D + g * (D / 8) + 8 * i) : make_uint4(0u, 0u, 0u, 0u);\n"
        "      }\n"
        "    }\n"
    )
    if prefetch:
        direct_loads += (
            "    {  // the warp's tile PREFETCH steps ahead, into L2: a K row per lane 0-15, a V row per lane 16-31\n"
            f"      const int t = tile0 + {prefetch} * WARPS * TPS * 16 + lane % 16;\n"
            "      if (t < end) {\n"
            "        const size_t row = ((size_t)page_of[t / PAGE - first] * PAGE + t % PAGE) * HKV + kvh;\n"
            "        autosched_pd_prefetch_l2((lane < 16 ? K : V) + row * D, D * 2);\n"
            "      }\n"
            "    }\n")
    compute = (
        "    float sc[TPS][2][4];  // scores: rows g (0, 1) and g + 8 (2, 3), tokens 8 nt + 2 t4 + {0, 1}\n"
        "    float top[2] = {mrow[0], mrow[1]};\n"
        "    #pragma unroll\n"
        "    for (int u = 0; u < TPS; ++u) {\n"
        "      #pragma unroll\n"
        "      for (int nt = 0; nt < 2; ++nt) {\n"
        "        float c[4] = {0.f, 0.f, 0.f, 0.f};\n"
        "        #pragma unroll\n"
        "        for (int s = 0; s < KS; ++s) {\n"
        "          const uint4 w = kr[u][nt][s / 2];\n"
        "          const uint32_t b0 = s % 2 ? w.z : w.x, b1 = s % 2 ? w.w : w.y;\n"
        f"          {mma}(c, qa[s][0], ROWS > 1 ? qb[s][0] : 0u, qa[s][1], ROWS > 1 ? qb[s][1] : 0u, b0, b1);\n"
        "        }\n"
        "        const int t = tile0 + u * 16 + 8 * nt + 2 * t4;\n"
        "        #pragma unroll\n"
        "        for (int i = 0; i < 2 * ROWS; ++i) {\n"
        "          sc[u][nt][i] = t + (i & 1) < end ? c[i] * SCALE_LOG2E : autosched_pd_neg_inf();\n"
        "          top[i / 2] = fmaxf(top[i / 2], sc[u][nt][i]);\n"
        "        }\n"
        "      }\n"
        "    }\n"
        "    float keep[2];\n"
        "    #pragma unroll\n"
        "    for (int r = 0; r < ROWS; ++r) {  // the row's maximum over its quad\n"
        "      top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 1));\n"
        "      top[r] = fmaxf(top[r], __shfl_xor_sync(0xffffffffu, top[r], 2));\n"
        "      keep[r] = autosched_pd_weight(mrow[r], top[r]);\n"
        "      lrow[r] *= keep[r];\n"
        "      mrow[r] = top[r];\n"
        "    }\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < NT; ++j) {\n"
        "      o[j][0] *= keep[0]; o[j][1] *= keep[0];\n"
        "      if (ROWS > 1) { o[j][2] *= keep[1]; o[j][3] *= keep[1]; }\n"
        "    }\n"
        "    #pragma unroll\n"
        "    for (int u = 0; u < TPS; ++u) {\n"
        "      float p[2][4];\n"
        "      #pragma unroll\n"
        "      for (int nt = 0; nt < 2; ++nt) {\n"
        "        #pragma unroll\n"
        "        for (int i = 0; i < 2 * ROWS; ++i) {\n"
        "          p[nt][i] = autosched_pd_weight(sc[u][nt][i], mrow[i / 2]);\n"
        "          lrow[i / 2] += p[nt][i];\n"
        "        }\n"
        "      }\n"
        f"      const uint32_t pa0 = {pack}(p[0][0], p[0][1]), pa1 = ROWS > 1 ? {pack}(p[0][2], p[0][3]) : 0u;\n"
        f"      const uint32_t pa2 = {pack}(p[1][0], p[1][1]), pa3 = ROWS > 1 ? {pack}(p[1][2], p[1][3]) : 0u;\n"
        "      #pragma unroll\n"
        "      for (int j = 0; j < NT; ++j) {  // element g * D/8 + j of V rows 2 t4 + {0, 1} and + {8, 9}\n"
        "        const unsigned sel = j % 2 ? 0x7632u : 0x5410u;\n"
        "        const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&vr[u][0][j / 8]);\n"
        "        const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&vr[u][1][j / 8]);\n"
        "        const uint32_t* v2 = reinterpret_cast<const uint32_t*>(&vr[u][2][j / 8]);\n"
        "        const uint32_t* v3 = reinterpret_cast<const uint32_t*>(&vr[u][3][j / 8]);\n"
        "        const int wd = (j % 8) / 2;\n"
        "        const uint32_t b0 = __byte_perm(v0[wd], v1[wd], sel), b1 = __byte_perm(v2[wd], v3[wd], sel);\n"
        f"        if (ROWS > 1) {{\n"
        f"          {mma}(o[j], pa0, pa1, pa2, pa3, b0, b1);\n"
        "        } else {  // rows g + 8 are zero: their accumulators live only for the instruction\n"
        "          float c[4] = {o[j][0], o[j][1], 0.f, 0.f};\n"
        f"          {mma}(c, pa0, 0u, pa2, 0u, b0, b1);\n"
        "          o[j][0] = c[0]; o[j][1] = c[1];\n"
        "        }\n"
        "      }\n"
        "    }\n"
        "  }\n"
        "  #pragma unroll\n"
        "  for (int r = 0; r < ROWS; ++r) {\n"
        "    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);\n"
        "    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);\n"
        "  }\n"
        "  #pragma unroll\n"
        "  for (int r = 0; r < ROWS; ++r) {  // output columns n = 2 t4 + {0, 1} of every n-tile j\n"
        "    const int h = g + 8 * r;\n"
        "    if (h < G) {\n"
        "      #pragma unroll\n"
        "      for (int j = 0; j < NT; ++j) {\n"
        "        part_o[warp][h][(2 * t4) * (D / 8) + j] = o[j][2 * r];\n"
        "        part_o[warp][h][(2 * t4 + 1) * (D / 8) + j] = o[j][2 * r + 1];\n"
        "      }\n"
        "      if (t4 == 0) { part_ml[warp][h][0] = mrow[r]; part_ml[warp][h][1] = lrow[r]; }\n"
        "    }\n"
        "  }\n")
    return head + (ring_loads if ring else direct_loads) + compute


def _tma_loop(dtype: str) -> str:
    """The main loop fed by TMA, for GQA groups of 2-8 heads at head dim 64 or 128: the products transposed.

    The last warp is a *producer*: one lane asks the copy engine for each page of the CTA's share (K and V
    rows of one K/V head, by rank-3 tensor maps over [pages · PAGE, HKV, D], 64 columns a box, 128-byte
    swizzle) into a ring of ``STAGES`` pages, each with a *full* mbarrier that the bytes complete and an
    *empty* one that its consumer releases. So the bytes in flight are the ring's, not the registers'.

    The other ``WARPS`` warps are consumers; warp w takes pages w, w + WARPS, … With the group's heads as N
    (8 columns; heads past G are zero) no tensor-core row is wasted: Sᵀ = K·Qᵀ (m16n8k16, K's tokens as M,
    A fragments by ``ldmatrix`` from the swizzled tile, Qᵀ's B fragments loaded once), then
    Oᵀ += Vᵀ·Pᵀ (D/16 m-tiles; Vᵀ by ``ldmatrix.trans``). The scores' accumulators hold Pᵀ transposed
    for Pᵀ's B fragment, so ``movmatrix.trans`` turns them over in registers. The softmax runs down the
    columns: a head's maximum over the tile's tokens is three shuffles across the lanes of its column."""
    mma, pack = f"autosched_pd_mma_{dtype}", f"autosched_pd_pack_{dtype}"
    return (
        "  constexpr int KS = D / 16;  // k-steps of Sᵀ = K·Qᵀ, and m-tiles of Oᵀ = Vᵀ·Pᵀ\n"
        "  constexpr int HALF_BYTES = PAGE * 128;  // one 64-column box of a page: PAGE rows of 128 bytes\n"
        "  constexpr int TILE_BYTES = (D / 64) * HALF_BYTES;  // a page of K (or of V) for one K/V head\n"
        "  const int g = lane / 4, t4 = lane % 4;\n"
        "  const unsigned ring0 = static_cast<unsigned>(__cvta_generic_to_shared(ring));\n"
        "  const unsigned bars = ring0 + STAGES * 2 * TILE_BYTES;  // full[STAGES], then empty[STAGES]\n"
        "  if (tid == 0) {\n"
        "    for (int st = 0; st < 2 * STAGES; ++st)\n"
        "      asm volatile(\"mbarrier.init.shared::cta.b64 [%0], 1;\" :: \"r\"(bars + 8 * st) : \"memory\");\n"
        "    asm volatile(\"fence.mbarrier_init.release.cluster;\" ::: \"memory\");\n"
        "    asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\");\n"
        "  }\n"
        "  __syncthreads();  // the barriers and the page table: the producer starts at once, while Q loads\n"
        "  const int n = last - first;  // the CTA's pages\n"
        "  if (warp == WARPS) {  // the producer\n"
        "    if (lane == 0) {\n"
        "      for (int i = 0; i < n; ++i) {\n"
        "        const int st = i % STAGES;\n"
        "        if (i >= STAGES) autosched_pd_wait(bars + 8 * (STAGES + st), (i / STAGES - 1) & 1);\n"
        "        const unsigned full = bars + 8 * st, k_tile = ring0 + st * 2 * TILE_BYTES;\n"
        "        asm volatile(\"mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\"\n"
        "                     :: \"r\"(full), \"r\"(2 * TILE_BYTES) : \"memory\");\n"
        "        const int row = page_of[i] * PAGE;\n"
        "        #pragma unroll\n"
        "        for (int h = 0; h < D / 64; ++h) {\n"
        "          autosched_pd_tma(k_tile + h * HALF_BYTES, k_map, 64 * h, kvh, row, full);\n"
        "          autosched_pd_tma(k_tile + TILE_BYTES + h * HALF_BYTES, v_map, 64 * h, kvh, row, full);\n"
        "        }\n"
        "      }\n"
        "    }\n"
        "  } else {\n"
        "    float o[KS][4], mh[2], lh[2];  // Oᵀ rows (head dims) 16 mt + g (0, 1) and + 8 (2, 3); heads 2 t4 + {0, 1}\n"
        "    uint32_t qf[KS][2];  // Qᵀ's B fragments: head g, dims 16 s + 2 t4 + {0, 1} and + 8\n"
        "    #pragma unroll\n"
        "    for (int s = 0; s < KS; ++s) {\n"
        "      const " + _CUDA[dtype][0] + "* qrow = Q + ((size_t)seq * H + kvh * G + g) * D + 16 * s + 2 * t4;\n"
        "      qf[s][0] = g < G ? *reinterpret_cast<const uint32_t*>(qrow) : 0u;\n"
        "      qf[s][1] = g < G ? *reinterpret_cast<const uint32_t*>(qrow + 8) : 0u;\n"
        "      o[s][0] = o[s][1] = o[s][2] = o[s][3] = 0.f;\n"
        "    }\n"
        "    mh[0] = mh[1] = autosched_pd_neg_inf(); lh[0] = lh[1] = 0.f;\n"
        "    for (int i = warp; i < n; i += WARPS) {\n"
        "      const int st = i % STAGES;\n"
        "      autosched_pd_wait(bars + 8 * st, (i / STAGES) & 1);\n"
        "      const unsigned k_tile = ring0 + st * 2 * TILE_BYTES, v_tile = k_tile + TILE_BYTES;\n"
        "      const int t0 = (first + i) * PAGE;  // the page's first token\n"
        "      if (t0 + PAGE > end) {  // rows past the sequence may hold anything: zero V's (0 · NaN is NaN)\n"
        "        for (int c = (end - t0) * 8 * (D / 64) + lane; c < PAGE * 8 * (D / 64); c += 32) {\n"
        "          const int r = c / (8 * (D / 64)) , h = c / 8 % (D / 64);\n"
        "          asm volatile(\"st.shared.v4.u32 [%0], {%1, %1, %1, %1};\"\n"
        "                       :: \"r\"(v_tile + h * HALF_BYTES + r * 128 + c % 8 * 16), \"r\"(0u) : \"memory\");\n"
        "        }\n"
        "        asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\");  // before TMA writes there again\n"
        "        __syncwarp();\n"
        "      }\n"
        "      #pragma unroll\n"
        "      for (int sub = 0; sub < PAGE / 16; ++sub) {\n"
        "        float c[4] = {0.f, 0.f, 0.f, 0.f};  // Sᵀ: tokens g (0, 1) and g + 8 (2, 3); heads 2 t4 + {0, 1}\n"
        "        #pragma unroll\n"
        "        for (int s = 0; s < KS; ++s) {  // matrix lane / 8: tokens + 8 (lane / 8 % 2), columns + 8 (lane / 16)\n"
        "          const int r = sub * 16 + lane % 16, chunk = 2 * s + lane / 16;\n"
        "          uint32_t a[4];\n"
        "          autosched_pd_ldmatrix(a, k_tile + chunk / 8 * HALF_BYTES + r * 128 + ((chunk % 8) ^ (r % 8)) * 16, false);\n"
        f"          {mma}(c, a[0], a[1], a[2], a[3], qf[s][0], qf[s][1]);\n"
        "        }\n"
        "        const int ta = t0 + sub * 16 + g;\n"
        "        float top[2];\n"
        "        #pragma unroll\n"
        "        for (int j = 0; j < 4; ++j) c[j] = (ta + 8 * (j / 2) < end) ? c[j] * SCALE_LOG2E : autosched_pd_neg_inf();\n"
        "        #pragma unroll\n"
        "        for (int j = 0; j < 2; ++j) {  // head 2 t4 + j: its maximum down the column, then the rescale\n"
        "          top[j] = fmaxf(mh[j], fmaxf(c[j], c[j + 2]));\n"
        "          #pragma unroll\n"
        "          for (int off = 4; off < 32; off <<= 1) top[j] = fmaxf(top[j], __shfl_xor_sync(0xffffffffu, top[j], off));\n"
        "          const float keep = autosched_pd_weight(mh[j], top[j]);\n"
        "          lh[j] *= keep;\n"
        "          #pragma unroll\n"
        "          for (int mt = 0; mt < KS; ++mt) { o[mt][j] *= keep; o[mt][j + 2] *= keep; }\n"
        "          mh[j] = top[j];\n"
        "        }\n"
        "        float p[4];\n"
        "        #pragma unroll\n"
        "        for (int j = 0; j < 4; ++j) { p[j] = autosched_pd_weight(c[j], mh[j % 2]); lh[j % 2] += p[j]; }\n"
        f"        const uint32_t b0 = autosched_pd_transpose({pack}(p[0], p[1]));  // Pᵀ: tokens 2 t4 + {{0, 1}}, head g\n"
        f"        const uint32_t b1 = autosched_pd_transpose({pack}(p[2], p[3]));  // tokens 8 + 2 t4 + {{0, 1}}\n"
        "        #pragma unroll\n"
        "        for (int mt = 0; mt < KS; ++mt) {  // matrix lane / 8: head dims + 8 (lane / 8 % 2), tokens + 8 (lane / 16)\n"
        "          const int r = sub * 16 + lane % 8 + 8 * (lane / 16), chunk = 2 * mt + lane / 8 % 2;\n"
        "          uint32_t a[4];\n"
        "          autosched_pd_ldmatrix(a, v_tile + chunk / 8 * HALF_BYTES + r * 128 + ((chunk % 8) ^ (r % 8)) * 16, true);\n"
        f"          {mma}(o[mt], a[0], a[1], a[2], a[3], b0, b1);\n"
        "        }\n"
        "      }\n"
        "      __syncwarp();\n"
        "      if (lane == 0)\n"
        "        asm volatile(\"mbarrier.arrive.shared::cta.b64 _, [%0];\" :: \"r\"(bars + 8 * (STAGES + st)) : \"memory\");\n"
        "    }\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < 2; ++j) {  // a head's sum over its column's lanes\n"
        "      #pragma unroll\n"
        "      for (int off = 4; off < 32; off <<= 1) lh[j] += __shfl_xor_sync(0xffffffffu, lh[j], off);\n"
        "    }\n"
        "    #pragma unroll\n"
        "    for (int j = 0; j < 2; ++j) {\n"
        "      const int h = 2 * t4 + j;\n"
        "      if (h < G) {\n"
        "        #pragma unroll\n"
        "        for (int mt = 0; mt < KS; ++mt) {\n"
        "          part_o[warp][h][16 * mt + g] = o[mt][j];\n"
        "          part_o[warp][h][16 * mt + g + 8] = o[mt][j + 2];\n"
        "        }\n"
        "        if (g == 0) { part_ml[warp][h][0] = mh[j]; part_ml[warp][h][1] = lh[j]; }\n"
        "      }\n"
        "    }\n"
        "  }\n")


TMA_HELPERS = (
    "__device__ __forceinline__ void autosched_pd_wait(unsigned bar, unsigned parity) {\n"
    "  uint32_t done = 0;\n"
    "  do {\n"
    "    asm volatile(\"{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\"\n"
    "                 : \"=r\"(done) : \"r\"(bar), \"r\"(parity) : \"memory\");\n"
    "  } while (!done);\n}\n"
    # A box of a rank-3 tensor map (64 columns, one K/V head, PAGE rows) into shared memory.
    "__device__ __forceinline__ void autosched_pd_tma(unsigned dst, unsigned long long map, int col, int head, int row,\n"
    "    unsigned bar) {\n"
    "  asm volatile(\"cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes\"\n"
    "               \" [%0], [%1, {%2, %3, %4}], [%5];\"\n"
    "               :: \"r\"(dst), \"l\"(map), \"r\"(col), \"r\"(head), \"r\"(row), \"r\"(bar) : \"memory\");\n}\n"
    "__device__ __forceinline__ void autosched_pd_ldmatrix(uint32_t* a, unsigned address, bool trans) {\n"
    "  if (trans)\n"
    "    asm volatile(\"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\"\n"
    "                 : \"=r\"(a[0]), \"=r\"(a[1]), \"=r\"(a[2]), \"=r\"(a[3]) : \"r\"(address) : \"memory\");\n"
    "  else\n"
    "    asm volatile(\"ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\"\n"
    "                 : \"=r\"(a[0]), \"=r\"(a[1]), \"=r\"(a[2]), \"=r\"(a[3]) : \"r\"(address) : \"memory\");\n}\n"
    # An 8x8 matrix of 16-bit pairs (a lane holds row lane / 4, columns 2 (lane % 4) + {0, 1}), transposed.
    "__device__ __forceinline__ uint32_t autosched_pd_transpose(uint32_t x) {\n"
    "  uint32_t y;\n"
    "  asm volatile(\"movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\" : \"=r\"(y) : \"r\"(x));\n"
    "  return y;\n}\n")


def paged_decode_kernel(b: int, h: int, hkv: int, d: int, ctx: int, page: int, dtype: str, p: Point):
    """The TIRx launch of point ``p``'s kernel for the ``paged_decode_attention`` workload's signature."""
    from tvm.script import tirx as T

    warps, unroll, split, mma = p["warps"], p["unroll"], p["split"], p.get("mma", False)
    stages = p.get("tma_stages", 0)
    pps = math.ceil(ctx / page)
    threads = 32 * (warps + (1 if stages else 0))  # the TMA loop's producer warp comes on top
    consts = {"H": h, "HKV": hkv, "G": h // hkv, "D": d, "PAGE": page, "PPS": pps, "WARPS": warps,
              "UNROLL": unroll, "SPLIT": split, "THREADS": threads} | ({"MMA": 1} if mma else {})
    consts |= {"STAGES": stages} if stages else {}
    prefetch = p.get("prefetch", 0)
    name = ("autosched_paged_decode_" + "_".join(f"{k.lower()}{v}" for k, v in consts.items())
            + (f"_prefetch{prefetch}" if prefetch else "") + f"_{dtype}")
    source = _body_source(name, dtype, consts, mma, ring_stages(p) > 0, prefetch, stages > 0).replace(
        "constexpr int D =", f"constexpr float SCALE_LOG2E = {1.4426950408889634 / math.sqrt(d)!r}f;\n  constexpr int D =")
    pairs = b * hkv
    ctas_per_sm = p["ctas_per_sm"]
    ring_words = tma_ring_words(d, page, stages)
    words = ring_words + smem_floats(h // hkv, d, warps, pps, split, ring_stages(p))

    def launch_ids():  # (the (sequence, K/V head) pair, the CTA's rank among the pair's split)
        if split == 1:
            return T.cta_id([pairs]), 0
        return T.cluster_id([pairs]), T.cta_id_in_cluster([split])

    kv_shape = (b * pps, page, hkv, d)
    # The TMA loop's maps: K and V as [pages · page rows, hkv heads, d], boxes of 64 columns x 1 head x a page.
    kv_map = (d, hkv, b * pps * page, d * 2, hkv * d * 2, 64, 1, page, 1, 1, 1)

    # fmt: off
    @T.prim_func
    def main(Q: T.Buffer((b, h, d), dtype, align=16), K: T.Buffer(kv_shape, dtype, align=16),
             V: T.Buffer(kv_shape, dtype, align=16), table: T.Buffer((b, pps), "int32"),
             lens: T.Buffer((b,), "int32"), O: T.Buffer((b, h, d), dtype, align=16)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        T.device_entry()
        pair, rank = launch_ids()
        tx = T.thread_id([threads])  # noqa: F841 (declares the block's threads)
        if ctas_per_sm > 1:  # __launch_bounds__'s minimum: nvcc caps the registers for that many CTAs
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", ctas_per_sm)
        smem = T.alloc_buffer((words,), "float32", scope="shared.dyn", align=16)
        T.cuda.func_call(name, Q.access_ptr("r"), K.access_ptr("r"), V.access_ptr("r"), table.access_ptr("r"),
                         lens.access_ptr("r"), O.access_ptr("w"), smem.access_ptr("rw"), pair, rank,
                         source_code=source)

    @T.prim_func
    def main_tma(Q: T.Buffer((b, h, d), dtype, align=16), K: T.Buffer(kv_shape, dtype, align=16),
                 V: T.Buffer(kv_shape, dtype, align=16), table: T.Buffer((b, pps), "int32"),
                 lens: T.Buffer((b,), "int32"), O: T.Buffer((b, h, d), dtype, align=16)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        K_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(K_map, K.data, *kv_map, descriptor_dtype=dtype, rank=3, swizzle=3)
        V_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(V_map, V.data, *kv_map, descriptor_dtype=dtype, rank=3, swizzle=3)
        T.device_entry()
        pair, rank = launch_ids()
        tx = T.thread_id([threads])  # noqa: F841 (declares the block's threads)
        if ctas_per_sm > 1:
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", ctas_per_sm)
        # The ring first (128-byte swizzle wants 1024-byte aligned boxes), its mbarriers, then the floats.
        smem = T.alloc_buffer((words,), "float32", scope="shared.dyn", align=1024)
        T.cuda.func_call(name, Q.access_ptr("r"), K.access_ptr("r"), V.access_ptr("r"), table.access_ptr("r"),
                         lens.access_ptr("r"), O.access_ptr("w"), smem.access_ptr("rw", offset=ring_words), pair,
                         rank, smem.access_ptr("rw"), T.address_of(K_map), T.address_of(V_map), source_code=source)
    # fmt: on
    return main_tma if stages else main


def tma_ring_words(d: int, page: int, stages: int) -> int:
    """Shared memory of the TMA loop's ring, in 4-byte words: ``stages`` pages of K and V, then a full and
    an empty mbarrier per stage."""
    return stages * (2 * page * d * 2 + 16) // 4


class PagedDecodeSpace(HopperTemplate):
    """``paged_decode_attention`` on sm_90: the flash-decoding kernel above."""

    name = "paged_decode"
    # 2: tensor cores (mma); 3: L2 prefetch; 5: groups of at most 8 heads hold half the accumulators, and
    # CTAs per SM (registers capped for more warps; tried alone as 4 and reverted); 6: the TMA loop
    version = 6
    families = ("paged_attention",)

    @classmethod
    def matches(cls, func) -> bool:
        return _shape(func) is not None

    @classmethod
    def suits(cls, func, target, hints) -> bool:
        if target.arch not in HOPPER_ARCHS or (hints or {}).get("op") != "paged_decode_attention":
            return False
        shape = _shape(func)
        return shape is not None and shape["d"] in (64, 128, 256) and shape["dtype"] in _CUDA

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        shape = _shape(func)
        if shape is None:
            raise ValueError("paged_decode takes the paged_decode_attention workload's functions only")
        self.shape = shape
        self.sms = target.num_cores or 132
        self.knobs = [
            Knob("warps", (2, 4, 8)),
            Knob("unroll", (1, 2, 4, 8)),
            Knob("split", (1, 2, 4, 8)),
            # More resident warps (bytes in flight) for fewer registers: GQA's tensor-core loop takes 178.
            Knob("ctas_per_sm", (1, 2, 3, 4)),
        ]
        if self.tensor_cores_fit():
            self.knobs += [Knob("mma", (False, True), ordered=False), Knob("prefetch", (0, 1, 2))]
        if self.tma_fits():
            # Pages in the TMA loop's ring (0: the loops that load through registers or cp.async).
            self.knobs.append(Knob("tma_stages", (0, 4, 8, 16)))

    def tensor_cores_fit(self) -> bool:
        """GQA groups of 2-16 heads at head dim 64 or 128: the products on tensor cores (m16n8k16)."""
        return 2 <= self.shape["h"] // self.shape["hkv"] <= MMA_MAX_GROUP and self.shape["d"] in (64, 128)

    def tma_fits(self) -> bool:
        """The TMA loop: groups of 2-8 heads (one n-tile) at head dim 64 or 128, pages of whole 16-token
        tiles that one box can hold."""
        s = self.shape
        return 2 <= s["h"] // s["hkv"] <= 8 and s["d"] in (64, 128) and s["page"] % 16 == 0 and s["page"] <= 256

    def check(self, p: Point) -> str | None:
        s = self.shape
        g = s["h"] // s["hkv"]
        pages = math.ceil(s["ctx"] / s["page"])
        stages = p.get("tma_stages", 0)
        if stages and not (p.get("mma") and p["unroll"] == 1 and p.get("prefetch", 0) == 0):
            return "the TMA loop (tma_stages) is a tensor-core loop of its own: mma, unroll 1, no prefetch"
        if stages and stages < p["warps"]:
            # Warp w takes pages w, w + warps, ...: with fewer stages than warps, a warp two laps ahead of a
            # stage's last landing waits on the parity that an older phase already shows, and reads a
            # stale page (the H200 reported an unspecified launch failure at 8 warps, 4 stages).
            return f"a ring of {stages} pages for {p['warps']} consumer warps (tma_stages must be at least warps)"
        smem = 4 * (tma_ring_words(s["d"], s["page"], stages)
                    + smem_floats(g, s["d"], p["warps"], pages, p["split"], ring_stages(p)))
        if smem > SMEM_LIMIT:
            return f"{smem} bytes of shared memory (limit {SMEM_LIMIT})"
        if p.get("prefetch", 0) and not (p.get("mma") and ring_stages(p) == 0):
            return "prefetch feeds the tensor-core loop that holds its tile in registers (mma, unroll 1)"
        if p.get("mma"):
            # Registers per thread, roughly: one tile's K and V pieces (a quarter of two K rows and an eighth
            # of four V rows; further tiles wait in the shared-memory ring), the output's accumulators and
            # Q's fragments.
            regs = s["d"] // 2 + (s["d"] // 2 if g > 8 else s["d"] // 4) + s["d"] // 4 + 40
        else:
            # Registers per thread, roughly: q, o (8 per head), the step's K and V rows (8 each) and scores.
            regs = 16 * g + 8 * p["unroll"] + p["unroll"] * g + 24
        if regs > 200:
            return f"about {regs} registers per thread for {g} heads per group and unroll {p['unroll']}"
        cap = 65536 // (p["ctas_per_sm"] * 32 * (p["warps"] + (1 if stages else 0)))
        if cap < MIN_REGISTER_CAP:
            return (f"{p['ctas_per_sm']} CTAs of {p['warps']} warps per SM leave {cap} registers per thread"
                    f" (at least {MIN_REGISTER_CAP})")
        pairs = s["b"] * s["hkv"]
        resident = max(2, p["ctas_per_sm"]) * self.sms
        if p["split"] > 1 and pairs * p["split"] > resident:
            return f"{pairs} (sequence, head) pairs split {p['split']} ways overfill {resident} resident CTAs"
        if p["split"] > pages:
            return f"split {p['split']} exceeds the {pages} pages of a sequence"
        return None

    def default(self) -> Point:
        # The smallest split that fills the GPU, else the largest that the pages allow.
        pairs = self.shape["b"] * self.shape["hkv"]
        splits = [x for x in (1, 2, 4, 8) if x <= math.ceil(self.shape["ctx"] / self.shape["page"])]
        split = next((x for x in splits if pairs * x >= self.sms), splits[-1])
        extra = {"mma": False, "prefetch": 0} if self.tensor_cores_fit() else {}
        extra |= {"tma_stages": 0} if self.tma_fits() else {}
        extra["ctas_per_sm"] = 1
        if self.tma_fits():
            # The TMA loop in one wave: the largest split whose CTAs fit one per SM (37.98 us at GQA 8:1 where
            # the registers' loop took 44.45, 66.70 at 4:1 against 75.30; H200, same run), the deepest ring.
            one_wave = [x for x in splits if pairs * x <= self.sms] or [1]
            for stages in (16, 8, 4):
                point = {"warps": 4, "unroll": 1, "split": one_wave[-1], "mma": True, "prefetch": 0,
                         "tma_stages": stages, "ctas_per_sm": 1}
                if self.check(point) is None:
                    return point
        for point in ({"warps": 4, "unroll": 4, "split": split}, {"warps": 4, "unroll": 2, "split": split},
                      {"warps": 4, "unroll": 1, "split": split}, {"warps": 4, "unroll": 1, "split": 1}):
            if self.check(point | extra) is None:
                return point | extra
        return super().default()

    def kernel(self, p: Point):
        s = self.shape
        return paged_decode_kernel(s["b"], s["h"], s["hkv"], s["d"], s["ctx"], s["page"], s["dtype"], p)

    def point_features(self, p: Point) -> list[float]:
        """Knobs, the CTAs against the SMs, and the bytes each thread has in flight."""
        s = self.shape
        ctas = s["b"] * s["hkv"] * p["split"]
        return [p["warps"], p["unroll"], p["split"], ctas / self.sms, math.log2(ctas), 32 * p["unroll"] * p["warps"] * 32,
                s["h"] // s["hkv"], s["d"], s["ctx"] / p["split"], float(p.get("mma", False)), p.get("prefetch", 0),
                p["ctas_per_sm"], ctas / (self.sms * p["ctas_per_sm"])]


def _shape(func) -> dict | None:
    """The workload's sizes from Q[b, h, d], K/V[pages, page, hkv, d], table[b, pps], lens[b], O[b, h, d]."""
    params = list(func.params)
    if len(params) != 6:
        return None
    try:
        (b, h, d), (pages, page, hkv, d2), (b2, pps) = ([int(x) for x in params[i].shape] for i in (0, 1, 3))
    except (AttributeError, TypeError, ValueError):
        return None
    if d != d2 or b != b2 or pages != b * pps or h % hkv or str(params[3].dtype) != "int32":
        return None
    return {"b": b, "h": h, "hkv": hkv, "d": d, "page": page, "ctx": pps * page, "dtype": str(params[0].dtype)}
