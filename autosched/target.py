"""Targets: what autosched compiles for, and what identifies a device in the database.

``--target llvm`` means this machine's CPU (its LLVM name, e.g. ``znver4``, and its core count);
``--target cuda`` means the first CUDA GPU. ``kind:arch`` pins the architecture, e.g. ``cuda:sm_90``
to generate code for a GPU this machine does not have. What a kernel's launch shape depends on in a GPU (its
multiprocessors, shared memory, L2) comes from :func:`device_facts`: the GPU's own, or a table by architecture
where there is none.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from . import fastmath
from .errors import DeviceError, UsageError

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).


@dataclass(frozen=True)
class KindFacts:
    """What differs between target kinds, in one place: ``gpu`` (kernels bind threads, are timed with
    CUDA events and get dlight's default schedules), and the device type TVM and torch name it by."""

    gpu: bool
    device: str


KIND_FACTS = {"llvm": KindFacts(gpu=False, device="cpu"), "cuda": KindFacts(gpu=True, device="cuda")}
KINDS = tuple(KIND_FACTS)
KIND_ALIASES = {"cpu": "llvm", "llvm": "llvm", "cuda": "cuda", "gpu": "cuda", "nvidia": "cuda"}
DEFAULT_CUDA_ARCH = "sm_90"


@dataclass(frozen=True)
class DeviceFacts:
    """What a kernel's launch shape may depend on in the GPU that runs it: its multiprocessors (``sms``), the
    shared memory one block may opt into (``shared_memory``, bytes) and its L2 (``l2_bytes``); ``source``:
    "device" (read off the GPU), "table" (:data:`CUDA_ARCH_FACTS`, no GPU at hand) or "unknown" (an
    architecture the table lacks: no SMs or L2 known, the shared memory every block has without opting in)."""

    sms: int
    shared_memory: int
    l2_bytes: int
    source: str = "table"


# Each architecture's facts where code is generated without its GPU (``--target cuda:sm_90`` on a machine
# without one): those of the data-centre GPU of the architecture named beside it. A GPU that is at hand gives
# its own (:func:`device_facts`); ``sm_90a`` is ``sm_90``.
CUDA_ARCH_FACTS = {
    "sm_80": DeviceFacts(sms=108, shared_memory=166912, l2_bytes=40 << 20),  # A100
    "sm_86": DeviceFacts(sms=84, shared_memory=101376, l2_bytes=6 << 20),  # A40
    "sm_89": DeviceFacts(sms=142, shared_memory=101376, l2_bytes=96 << 20),  # L40S
    "sm_90": DeviceFacts(sms=132, shared_memory=232448, l2_bytes=50 << 20),  # H100 SXM (the H200: its SMs, 60 MB L2)
}
UNKNOWN_ARCH_FACTS = DeviceFacts(sms=0, shared_memory=49152, l2_bytes=0, source="unknown")


def arch_facts(arch: str) -> DeviceFacts:
    """:data:`CUDA_ARCH_FACTS`' row for ``arch`` (an architecture-specific ``sm_90a`` is ``sm_90``), else
    :data:`UNKNOWN_ARCH_FACTS`."""
    match = re.fullmatch(r"(sm_\d+)[a-z]?", arch)
    return CUDA_ARCH_FACTS.get(match.group(1) if match else arch, UNKNOWN_ARCH_FACTS)


@dataclass(frozen=True)
class TargetSpec:
    """A compilation target plus the facts that decide whether a tuned record applies to it."""

    kind: str
    arch: str  # LLVM mcpu (e.g. znver4) or CUDA sm_XY
    device_name: str  # CPU model or GPU name; "" when generating code without the device
    num_cores: int  # CPU threads, or CUDA multiprocessors
    max_shared_memory: int = 0  # CUDA: opt-in shared memory per block, bytes
    tvm_version: str = ""
    driver_version: str = ""

    @property
    def is_gpu(self) -> bool:
        return KIND_FACTS[self.kind].gpu

    @property
    def match_key(self) -> str:
        """Records are reused only between targets with the same match key."""
        return f"{self.kind}/{self.arch}/{self.device_name}/{self.num_cores}"

    @property
    def label(self) -> str:
        name = f" ({self.device_name})" if self.device_name else ""
        return f"{self.kind}:{self.arch}{name}"

    def tvm_target(self, opt_level: int = 3):
        """``opt_level``: LLVM's optimisation level of CPU code (:func:`cpu_build_opt_level`)."""
        import tvm

        if self.kind == "llvm":
            fastmath.install()  # vectorisable exp for every kernel compiled for this CPU
            level = {} if opt_level == 3 else {"opt-level": opt_level}  # 3: LLVM's default, the target unchanged
            return tvm.target.Target({"kind": "llvm", "mcpu": self.arch, "num-cores": self.num_cores, **level})
        return tvm.target.Target({
            "kind": "cuda", "arch": self.arch, "max_threads_per_block": 1024, "max_num_threads": 1024,
            "thread_warp_size": 32, "registers_per_block": 65536,
            # Static shared memory per block; larger tiles use dynamic shared memory (shared.dyn).
            "max_shared_memory_per_block": 49152,
            "host": {"kind": "llvm", "mcpu": host_cpu_name()},
        })

    def device(self):
        import tvm

        return tvm.device(KIND_FACTS[self.kind].device, 0)

    @property
    def torch_device(self) -> str:
        return KIND_FACTS[self.kind].device

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> TargetSpec:
        if isinstance(data, str):
            data = json.loads(data)
        return cls(**data)


@lru_cache(maxsize=None)
def host_cpu_name() -> str:
    import tvm

    return str(tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_threads() -> int:
    """Threads TVM's runtime uses: TVM_NUM_THREADS if set, else the usable cores."""
    if os.environ.get("TVM_NUM_THREADS", "").isdigit():
        return int(os.environ["TVM_NUM_THREADS"])
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def use_all_cpu_threads() -> None:
    """Let TVM's CPU thread pool use every usable CPU (see :func:`_cpu_threads`): TVM otherwise counts
    physical cores, which on SMT or virtual machines is often half the CPUs one may use (one thread on a
    2-CPU VM, half the speed). Takes effect only before the first kernel runs in this process; worker
    processes inherit it. Everything that runs CPU kernels (tuning, ``run``, ``generate``) calls it."""
    os.environ.setdefault("TVM_NUM_THREADS", str(_cpu_threads()))


def parse_target(text: str, require_device: bool = True) -> TargetSpec:
    """Turn ``llvm``, ``cuda`` or ``kind:arch`` into a :class:`TargetSpec`.

    Args:
        text: the user's target string.
        require_device: if true, a CUDA target needs a visible GPU (to tune or run on it); if false,
            code can be generated for ``cuda`` without one (architecture ``sm_90`` unless given).
    """
    import tvm

    kind, _, arch = text.strip().partition(":")
    kind = KIND_ALIASES.get(kind.lower())
    if kind is None:
        raise UsageError(f"unknown target '{text}'; use one of: llvm (this CPU), cuda (first GPU), "
                         "or kind:arch such as cuda:sm_90")
    version = tvm.__version__
    if kind == "llvm":
        use_all_cpu_threads()
        return TargetSpec("llvm", arch or host_cpu_name(), _cpu_model(), _cpu_threads(), tvm_version=version,
                          driver_version=platform.release())
    dev = tvm.cuda(0)
    if not dev.exist:
        if require_device:
            raise DeviceError("no CUDA GPU is visible (tvm.cuda(0) does not exist): tune with --target llvm, "
                              "or run on a machine with an NVIDIA GPU and its driver")
        if arch and not arch.startswith("sm_"):
            raise UsageError(f"CUDA architecture '{arch}' should look like sm_90")
        arch = arch or DEFAULT_CUDA_ARCH
        return TargetSpec("cuda", arch, "", 0, arch_facts(arch).shared_memory, version, "")
    detected = "sm_" + dev.compute_version.replace(".", "")
    if arch and arch != detected and require_device:
        raise UsageError(f"target asks for {arch} but the GPU ({dev.device_name}) is {detected}")
    return TargetSpec("cuda", arch or detected, str(dev.device_name), int(dev.multi_processor_count),
                      _cuda_optin_shared_memory(detected), version, _cuda_driver_version())


def _cuda_optin_shared_memory(arch: str) -> int:
    # Opt-in dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), by architecture: TVM's
    # device API gives the 48 KB a block has without opting in, not this.
    return arch_facts(arch).shared_memory


def device_facts(target: TargetSpec) -> DeviceFacts:
    """The multiprocessors, opt-in shared memory per block and L2 of the GPU ``target`` compiles for: the GPU's
    own where :func:`parse_target` found one (``num_cores`` is its ``multi_processor_count``,
    ``max_shared_memory`` its opt-in shared memory, and its ``l2_cache_size_bytes`` is read while it is here),
    else :func:`arch_facts` for the target's architecture (:data:`UNKNOWN_ARCH_FACTS` for a kind other than
    CUDA). Spaces and kernels that size their grids or splits by the SMs take them from here, and a record keeps
    the SMs and shared memory it was tuned under in its target (the database's ``targets`` row)."""
    if target.kind != "cuda":
        return UNKNOWN_ARCH_FACTS
    table = arch_facts(target.arch)
    if not target.num_cores:
        return table
    return DeviceFacts(target.num_cores, target.max_shared_memory or table.shared_memory,
                       _l2_bytes(target.device_name) or table.l2_bytes, "device")


@lru_cache(maxsize=None)
def _l2_bytes(device_name: str) -> int:
    """The L2 of the first GPU if it is ``device_name``, else 0 (a target of another machine's GPU)."""
    import tvm

    dev = tvm.cuda(0)
    if not dev.exist or str(dev.device_name) != device_name:
        return 0
    try:
        return int(dev.l2_cache_size_bytes or 0)
    except Exception:  # noqa: BLE001 - a runtime without the attribute: the table's
        return 0


def _cuda_driver_version() -> str:
    """The NVIDIA driver's version as nvidia-smi prints it, else the CUDA driver API version."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    import tvm

    return f"cuda-api {tvm.cuda(0).driver_version}"


CPU_OPT_LEVEL_VARIABLE = "AUTOSCHED_CPU_OPT_LEVEL"


def cpu_build_opt_level() -> int:
    """LLVM's optimisation level for a model's CPU build: ``$AUTOSCHED_CPU_OPT_LEVEL`` (0-3), 3 by default. A
    lower level builds faster and runs slower: for checking what a model computes, not for timing it. Tuned
    candidates are always compiled at 3, as they are timed."""
    text = os.environ.get(CPU_OPT_LEVEL_VARIABLE, "3")
    if text.strip() not in ("0", "1", "2", "3"):
        raise UsageError(f"${CPU_OPT_LEVEL_VARIABLE} is '{text}'; set it to 0, 1, 2 or 3 (LLVM's optimisation "
                         "level of a model's CPU build), or unset it for 3")
    return int(text)


def compile_module(mod, target: TargetSpec, config: dict | None = None, codegen: dict | None = None,
                   relax_pipeline=None):
    """``tvm.compile`` for ``target`` under the pass options a space asked for (see Space.build_config)
    and its code generation (``Space.codegen``: TIRx kernels take ``tir_pipeline="tirx"`` and the
    architecture-specific target ``sm_90a``, whose wgmma and setmaxnreg plain ``sm_90`` lacks).
    ``relax_pipeline``: the Relax passes of a model's build (TVM's default for the target if None); a model's
    CPU code is compiled at :func:`cpu_build_opt_level`."""
    import tvm

    codegen = codegen or {}
    if "arch" in codegen:
        target = dataclasses.replace(target, arch=codegen["arch"])
    opt_level = cpu_build_opt_level() if relax_pipeline is not None and target.kind == "llvm" else 3
    with tvm.transform.PassContext(opt_level=3, config=config or {}):
        return tvm.compile(mod, target=target.tvm_target(opt_level), relax_pipeline=relax_pipeline or "default",
                           tir_pipeline=codegen.get("tir_pipeline", "default"))


def default_gpu_schedule(mod, target: TargetSpec):
    """``mod`` with every kernel not yet scheduled given TVM's own default GPU schedule (dlight): what a
    GPU kernel that no tuned record serves is built with."""
    from tvm.s_tir import dlight as dl

    with target.tvm_target():
        return dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(), dl.gpu.Reduction(),
                                       dl.gpu.GeneralReduction(), dl.gpu.RMSNorm(), dl.gpu.Fallback())(mod)
