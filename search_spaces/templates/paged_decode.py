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

On CUDA cores a GQA group costs 2·G·D FMAs per token, so at G = 8 the kernel is issue-bound where at
G = 1 it streams at the copy bandwidth. The ``mma`` knob (groups of 2-16 heads,
head dim 64 or 128) takes QKᵀ and PV to tensor cores instead: ``mma.sync`` m16n8k16 with the group's
heads as M, 16-token tiles, the scores' accumulators reused as PV's A fragment (``cuda/paged_decode.cuh``, the MMA loops).
That loop holds 178 registers a thread at G = 8 and d = 128 (nvcc 13), so one 8-warp CTA fills an SM;
``ctas_per_sm`` caps them (``__launch_bounds__``) for 2 to 4 CTAs per SM, trading spills for more warps
with loads in flight.

Those loops keep the bytes in flight in registers, which caps them well below the copy bandwidth at
G = 8. The
``tma_stages`` knob (groups of 2-8 heads) takes the loads off the registers: a producer warp asks the copy
engine for whole pages (tensor maps) into a ring of 4-16 pages in shared memory, and the consumer warps take
the products transposed, keys as M and the group's heads as N, so that no tensor-core row is idle (see
``cuda/paged_decode.cuh``, the TMA loop): the fastest loop at G = 4 and 8 (BENCHMARKS.md, GPU kernels),
and the default for those groups.
"""

from __future__ import annotations

import math

from autosched.target import device_facts

from .._knobs import Knob, Point
from ._hopper import CUDA_SCALAR, HOPPER_ARCHS, SMEM_LIMIT, HopperTemplate, config_struct, cuda_file

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

MIN_REGISTER_CAP = 128  # ctas_per_sm's lowest cap: there GQA 8:1's tensor-core loop spills 160 bytes (nvcc 13)
MMA_MAX_GROUP = 16  # query heads per K/V head on the M side of m16n8k16


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


# The main loops of cuda/paged_decode.cuh (the config's LOOP).
CUDA_CORES, MMA, MMA_RING, TMA = 0, 1, 2, 3


def body_config(h: int, hkv: int, d: int, page: int, pps: int, p: Point) -> dict:
    """The compile-time constants of point ``p``'s kernel body (``cuda/paged_decode.cuh``'s config struct)."""
    stages = p.get("tma_stages", 0)
    loop = TMA if stages else MMA_RING if ring_stages(p) else MMA if p.get("mma", False) else CUDA_CORES
    return {"SCALE_LOG2E": 1.4426950408889634 / math.sqrt(d), "H": h, "HKV": hkv, "G": h // hkv, "D": d,
            "PAGE": page, "PPS": pps, "WARPS": p["warps"], "UNROLL": p["unroll"], "SPLIT": p["split"],
            # the TMA loop's producer warp comes on top
            "THREADS": 32 * (p["warps"] + (1 if stages else 0)), "LOOP": loop, "PREFETCH": p.get("prefetch", 0),
            "STAGES": stages}


def body_source(name: str, dtype: str, config: dict) -> str:
    """The kernel's body as the device function ``name`` (Q, K, V, table, lens, O, smem, pair, rank, and with
    the TMA loop ring, k_map, v_map): ``cuda/paged_decode.cuh`` for the constants of ``config``."""
    entry = "AUTOSCHED_PAGED_DECODE_TMA" if config["LOOP"] == TMA else "AUTOSCHED_PAGED_DECODE"
    return (cuda_file("paged_decode.cuh") + config_struct(f"{name}_config", config)
            + f"{entry}({name}, {CUDA_SCALAR[dtype]}, {name}_config)\n")


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
    source = body_source(name, dtype, body_config(h, hkv, d, page, pps, p))
    pairs = b * hkv
    ctas_per_sm = p["ctas_per_sm"]
    ring_words = tma_ring_words(d, page, stages)
    words = ring_words + smem_floats(h // hkv, d, warps, pps, split, ring_stages(p))

    def launch_ids():  # (the (sequence, K/V head) pair, the CTA's rank among the pair's split)
        if split == 1:
            return T.cta_id([pairs]), 0
        return T.cluster_id([pairs]), T.cta_id_in_cluster([split])

    kv_shape = (b * pps, page, hkv, d)
    align = 1024 if stages else 16
    # The TMA loop's maps: K and V as [pages · page rows, hkv heads, d], boxes of 64 columns x 1 head x a page.
    kv_map = (d, hkv, b * pps * page, d * 2, hkv * d * 2, 64, 1, page, 1, 1, 1)

    # fmt: off
    @T.prim_func
    def main(Q: T.Buffer((b, h, d), dtype, align=16), K: T.Buffer(kv_shape, dtype, align=16),
             V: T.Buffer(kv_shape, dtype, align=16), table: T.Buffer((b, pps), "int32"),
             lens: T.Buffer((b,), "int32"), O: T.Buffer((b, h, d), dtype, align=16)):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        if stages > 0:
            K_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.tensormap_encode_tiled(K_map, K.data, *kv_map, descriptor_dtype=dtype, rank=3, swizzle=3)
            V_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.tensormap_encode_tiled(V_map, V.data, *kv_map, descriptor_dtype=dtype, rank=3, swizzle=3)
        T.device_entry()
        pair, rank = launch_ids()
        tx = T.thread_id([threads])  # noqa: F841 (declares the block's threads)
        if ctas_per_sm > 1:  # __launch_bounds__'s minimum: nvcc caps the registers for that many CTAs
            T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", ctas_per_sm)
        # The TMA loop's ring first (128-byte swizzle wants 1024-byte aligned boxes), its mbarriers, then the floats.
        smem = T.alloc_buffer((words,), "float32", scope="shared.dyn", align=align)
        if stages > 0:
            T.cuda.func_call(name, Q.access_ptr("r"), K.access_ptr("r"), V.access_ptr("r"), table.access_ptr("r"),
                             lens.access_ptr("r"), O.access_ptr("w"), smem.access_ptr("rw", offset=ring_words), pair,
                             rank, smem.access_ptr("rw"), T.address_of(K_map), T.address_of(V_map), source_code=source)
        else:
            T.cuda.func_call(name, Q.access_ptr("r"), K.access_ptr("r"), V.access_ptr("r"), table.access_ptr("r"),
                             lens.access_ptr("r"), O.access_ptr("w"), smem.access_ptr("rw"), pair, rank,
                             source_code=source)
    # fmt: on
    return main


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
        return shape is not None and shape["d"] in (64, 128, 256) and shape["dtype"] in CUDA_SCALAR

    def __init__(self, func, target, hints=None):
        super().__init__(func, target, hints)
        self.shape = self.taken(_shape(func), "the paged_decode_attention workload's")
        self.sms = device_facts(target).sms
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
            # The TMA loop in one wave: the largest split whose CTAs fit one per SM (faster than the
            # registers' loop at GQA 8:1 and 4:1 on the H200), the deepest ring.
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
                p["ctas_per_sm"], ctas / (self.sms * p["ctas_per_sm"]), p.get("tma_stages", 0)]


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
