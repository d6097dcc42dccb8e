"""What the sm_90 kernel templates share: the ``HopperTemplate`` base class, the machine's limits, the dtype
table's Python side, and the CUDA sources of ``cuda/`` as text for ``T.cuda.func_call(source_code=...)``."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from autosched.target import arch_facts

from .._knobs import InvalidPoint, Point, Space

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

HOPPER_ARCHS = ("sm_90", "sm_90a")
BK = 64  # K elements per stage: one 128-byte swizzle row of fp16/bf16
FP8_BK = 128  # the same row of float8 elements
SMEM_LIMIT = arch_facts("sm_90").shared_memory  # opt-in shared memory per block, the same on every sm_90 GPU
# 32-bit registers a thread of a streaming decode kernel (weights loaded straight into mma.sync fragments) may give
# to its loads in flight, fragments and sums; nvcc adds addresses and indices.
STREAM_REGISTERS = 160
PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
# The element type of each dtype in CUDA; the rest of the table (pairs, conversions) is autosched_dtype<T>
# in cuda/common.cuh.
CUDA_SCALAR = {"float16": "half", "bfloat16": "nv_bfloat16"}
CUDA_DIR = Path(__file__).resolve().parent / "cuda"


@functools.cache
def cuda_file(name: str) -> str:
    """The text of ``cuda/<name>`` with each ``#include "<file>"`` of ours replaced by that file's text, so that
    a kernel's source needs no include path (the GPU machine compiles with NVRTC). Include guards make a
    file that several helpers of one module carry harmless."""
    text = (CUDA_DIR / name).read_text()
    return re.sub(r'^#include "([\w.]+)"\n', lambda m: cuda_file(m.group(1)), text, flags=re.M)


def config_struct(name: str, values: dict) -> str:
    """One line of CUDA: a struct of a kernel's compile-time constants (ints, and floats with an ``f``)."""
    members = "".join(f" static constexpr {'float' if isinstance(v, float) else 'int'} {k} = "
                      f"{f'{v!r}f' if isinstance(v, float) else int(v)};" for k, v in values.items())
    return f"struct {name} {{{members} }};\n"


def device_function(file: str, macro: str, name: str, dtype: str, config: dict) -> str:
    """The source of a body in ``cuda/<file>`` as the device function ``name``: the file, the struct
    ``<name>_config`` of ``config``'s constants, and the file's entry macro instantiated for ``dtype``."""
    return (cuda_file(file) + config_struct(f"{name}_config", config)
            + f"{macro}({name}, {CUDA_SCALAR[dtype]}, {name}_config)\n")


def epilogue_source(dtype: str, act: str) -> tuple[str, str, str]:
    """CUDA helpers of the epilogue: (name of the pair store, name of the single store, source).

    The accumulator pair (a, b) plus its bias pair goes through the activation and is stored as one
    4-byte vector; the single store serves an odd last column (``cuda/hopper.cuh``)."""
    tag = f"{PTX_TYPE[dtype]}_{act}"
    guard = f"AUTOSCHED_EPILOGUE_{tag.upper()}"
    return f"autosched_store2_{tag}", f"autosched_store1_{tag}", (
        cuda_file("hopper.cuh") + f"#ifndef {guard}\n#define {guard}\n"
        f"AUTOSCHED_EPILOGUE({tag}, {CUDA_SCALAR[dtype]}, AUTOSCHED_ACT_{act.upper()})\n#endif\n")


class HopperTemplate(Space):
    """A space whose points are whole TIRx kernels for sm_90a (``kernel``), not schedules of the workload."""

    targets = ("cuda",)
    template = True
    codegen = {"tir_pipeline": "tirx", "arch": "sm_90a"}

    def kernel(self, point: Point):
        raise NotImplementedError

    def apply(self, point: Point):
        import tvm

        point = self.complete(point)
        reason = self.validate(point)
        if reason:
            raise InvalidPoint(reason)
        return tvm.IRModule({"main": self.kernel(point)})


def grouped_raster(tiles_m: int, tiles_n: int, group_m: int):
    """(tile_m, tile_n): a tile number's row and column tile under grouped rasterisation. Tile numbers run
    down a group of group_m tile rows before the next column, so that neighbouring CTAs share A and B
    tiles in L2 (the producer's and the consumers' walk alike)."""
    from tvm.script import tirx as T

    def group_rows(tile):  # the rows of tile's group (the last group may have fewer)
        return T.min(tiles_m - (tile // (group_m * tiles_n)) * group_m, group_m)

    def tile_m(tile):
        return (tile // (group_m * tiles_n)) * group_m + (tile % (group_m * tiles_n)) % group_rows(tile)

    def tile_n(tile):
        return (tile % (group_m * tiles_n)) // group_rows(tile)

    return tile_m, tile_n


def canonical_group_m(p: Point, tiles_m: int) -> Point:
    """Groups of at least the number of row tiles all raster the same way (the kernel takes the minimum)."""
    if tiles_m < 2:
        return {**p, "group_m": 1}
    if p["group_m"] >= tiles_m:
        return {**p, "group_m": min(g for g in (1, 4, 8, 16) if g >= tiles_m or g == 16)}
    return p
