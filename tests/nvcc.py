"""nvcc's verdict on CUDA source, for the tests that check without a GPU that every GPU space and template
produces code the CUDA compiler accepts for its architecture, and how many registers it takes; and the host build
of the tests that run a kernel's body on the CPU (one thread per CUDA thread)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NvccReport:
    ok: bool
    log: str
    registers: int | None = None  # most registers of any kernel
    spills: int = 0  # bytes spilled to local memory, summed over kernels
    shared_bytes: int | None = None


def nvcc_compile(source: str, arch: str = "sm_90") -> NvccReport:
    """Compile ``source`` to a cubin for ``arch`` with nvcc and read its resource report."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return NvccReport(False, "nvcc is not on the PATH")
    include = os.environ.get("CUDA_PATH", "/usr/local/cuda") + "/include"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.cu")
        with open(src, "w") as f:
            f.write(source)
        # Architecture-specific targets (sm_90a: wgmma, setmaxnreg) need the -gencode spelling.
        arch_flag = f"-gencode=arch=compute_{arch[3:]},code={arch}" if arch.endswith("a") else f"-arch={arch}"
        cmd = [nvcc, "-cubin", arch_flag, "-O3", "-Xptxas", "-v", "-I", include, "-o",
               os.path.join(tmp, "kernel.cubin"), src]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    smem = [int(x) for x in re.findall(r"(\d+) bytes smem", log)]
    return NvccReport(proc.returncode == 0, log, max(regs) if regs else None, spills, max(smem) if smem else None)


def build_for_host(folder: Path, source: str, exe: str, std: str = "c++20", optimise: str = "-O1") -> None:
    """Compile ``source`` (a file in ``folder``: host C++ that includes CUDA's headers for its types) to the
    program ``exe`` there. The host compiler nvcc itself calls (g++) does it directly when it is on the PATH: for
    a program with no device code nvcc's CUDA front end only adds time (about three times g++'s)."""
    include = os.environ.get("CUDA_PATH", "/usr/local/cuda") + "/include"
    if shutil.which("g++"):
        cmd = ["g++", "-x", "c++", f"-std={std}", optimise, "-pthread", "-I", include,
               "-include", "cuda_runtime.h", "-o", exe, source]
    else:
        cmd = ["nvcc", f"-std={std}", optimise, "-o", exe, source]
    build = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]


def run_on_host(folder: Path, program: str, timeout: int = 300) -> None:
    """Build ``program`` (a kernel's body with a host shim and a ``main`` that reads its inputs from files in
    ``folder`` and writes its outputs there) for the CPU, and run it in ``folder``."""
    (folder / "host.cu").write_text(program)
    build_for_host(folder, "host.cu", "host")
    subprocess.run(["./host"], cwd=folder, check=True, timeout=timeout)


def host_output(folder: Path, name: str, dtype, shape):
    """The output ``name`` (``<name>.bin`` in ``folder``, as the program wrote it) as a torch tensor."""
    import torch

    return torch.frombuffer(bytearray((folder / f"{name}.bin").read_bytes()), dtype=dtype).reshape(shape)
