"""nvcc's verdict on CUDA source, for the tests that check without a GPU that every GPU space and template
produces code the CUDA compiler accepts for its architecture, and how many registers it takes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass


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
