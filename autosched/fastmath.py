"""A vectorisable ``exp`` for CPU kernels.

TVM lowers ``exp`` on LLVM targets to the ``llvm.exp`` intrinsic, which LLVM turns into one libm call
per lane: a vectorised softmax then runs at scalar speed. This registers, for float32 on LLVM targets,
the range reduction and degree-5 polynomial of Cephes' ``expf`` (the same as TVM's own
``topi.fast_exp``; relative error about 1e-7), built from plain arithmetic that LLVM vectorises.
It applies to every LLVM kernel compiled after :func:`install` runs in the process: tuned, untuned and
baseline kernels alike, so comparisons stay fair.
"""

from __future__ import annotations

from autosched.tvm_adapter import register_llvm_lowering

# Deferred imports: tvm (imported where used: `autosched --help` stays fast).

_INSTALLED = False


def _fast_exp(op):
    from tvm import tirx

    x = op.args[0]
    dtype = str(x.ty)
    if not dtype.startswith("float32"):
        return tirx.call_llvm_pure_intrin(dtype, "llvm.exp", tirx.const(1, "uint32"), x)
    lanes = dtype[len("float32"):]  # "" or "x16"
    int_dtype = "int32" + lanes

    def c(value):
        return tirx.const(value, dtype)

    x = tirx.max(tirx.min(x, c(88.3762626647950)), c(-88.3762626647949))
    n = tirx.floor(x * c(1.44269504088896341) + c(0.5))
    r = x - n * c(0.693359375) - n * c(-2.12194440e-4)
    p = c(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + c(coef)
    y = p * r * r + r + c(1.0)
    # 2^n by building the float's exponent bits directly.
    two_n = tirx.reinterpret(dtype, tirx.shift_left(n.astype(int_dtype) + tirx.const(127, int_dtype),
                                                    tirx.const(23, int_dtype)))
    return y * two_n


def install() -> None:
    """Register the fast ``exp`` lowering for LLVM targets (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    register_llvm_lowering("tirx.exp", _fast_exp)
    _INSTALLED = True
