"""WMMA tensor-core intrinsics for tensorize, registered on demand for the dtypes a schedule needs.

TVM 0.27 registers its CUDA intrinsics all at once when ``tvm.s_tir.tensor_intrin.cuda`` is imported
(hundreds of functions of TVMScript parsed, in every process that schedules) and has none for
bfloat16. The generators below follow TVM's own (``tvm/s_tir/tensor_intrin/cuda.py``, Apache-2.0), made
dtype-generic; :func:`wmma_intrins` registers the five intrinsics of one configuration the first time it
is asked for, under names of our own.
"""

from __future__ import annotations

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.tirx import Cast, IntImm

M = N = K = 16
_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def _fragment_index(buffer, stride, m_dim, n_dim):
    frag_m = buffer.elem_offset // stride // m_dim
    frag_n = buffer.elem_offset % stride // n_dim
    return frag_m * (stride // n_dim) + frag_n


def _load(dtype: str, scope: str, is_b: bool, col_major: bool):
    frag_scope = f"wmma.matrix_{'b' if is_b else 'a'}"
    layout = "col_major" if col_major else "row_major"
    rows, cols = (K, N) if is_b else (M, K)
    if col_major:
        rows, cols = cols, rows

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (rows, cols), dtype, align=64, offset_factor=cols, scope=scope)
        C = T.match_buffer(c, (rows, cols), dtype, align=64, offset_factor=cols, scope=frag_scope)
        with T.sblock("root"):
            T.reads(A[0:rows, 0:cols])
            T.writes(C[0:rows, 0:cols])
            for i, j in T.grid(rows, cols):
                with T.sblock("load"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s1 = T.int32()
        s0 = T.int32()
        d1 = T.int32()
        d0 = T.int32()
        A = T.match_buffer(a, (rows, cols), dtype, align=64, offset_factor=cols, scope=scope, strides=[s1, s0])
        C = T.match_buffer(c, (rows, cols), dtype, align=64, offset_factor=cols, scope=frag_scope, strides=[d1, d0])
        with T.sblock("root"):
            T.reads(A[0:rows, 0:cols])
            T.writes(C[0:rows, 0:cols])
            T.evaluate(T.tvm_load_matrix_sync(C.data, M, N, K, _fragment_index(C, d1, rows, cols),
                                              A.access_ptr("r", ptr_type=dtype), s1, layout, dtype="void"))

    return desc, impl


def _fill(dtype: str):
    zero = IntImm("int32", 0).astype(dtype)

    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (M, N), dtype, align=64, offset_factor=N, scope="wmma.accumulator")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("init"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = zero

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        d1 = T.int32()
        d0 = T.int32()
        C = T.match_buffer(c, (M, N), dtype, align=64, offset_factor=N, scope="wmma.accumulator", strides=[d1, d0])
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:M, 0:N])
            T.evaluate(T.tvm_fill_fragment(C.data, M, N, K, _fragment_index(C, d1, M, N), T.float32(0), dtype="void"))

    return desc, impl


def _store(dtype: str, scope: str):
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (M, N), dtype, align=64, offset_factor=N, scope="wmma.accumulator")
        C = T.match_buffer(c, (M, N), dtype, align=64, offset_factor=N, scope=scope)
        with T.sblock("root"):
            T.reads(A[0:M, 0:N])
            T.writes(C[0:M, 0:N])
            for i, j in T.grid(M, N):
                with T.sblock("store"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s1 = T.int32()
        s0 = T.int32()
        d1 = T.int32()
        d0 = T.int32()
        A = T.match_buffer(a, (M, N), dtype, align=64, offset_factor=N, scope="wmma.accumulator", strides=[d1, d0])
        C = T.match_buffer(c, (M, N), dtype, align=64, offset_factor=N, scope=scope, strides=[s1, s0])
        with T.sblock("root"):
            T.reads(A[0:M, 0:N])
            T.writes(C[0:M, 0:N])
            T.evaluate(T.tvm_store_matrix_sync(A.data, M, N, K, _fragment_index(A, d1, M, N),
                                               C.access_ptr("w", ptr_type=dtype), s1, "row_major", dtype="void"))

    return desc, impl


def _sync(in_dtype: str, out_dtype: str, b_transposed: bool):
    def cast(v):
        return Cast(out_dtype, v) if in_dtype != out_dtype else v

    b_shape = (N, K) if b_transposed else (K, N)

    def b_index(vk, vj):
        return (vj, vk) if b_transposed else (vk, vj)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (M, K), in_dtype, align=64, offset_factor=K, scope="wmma.matrix_a")
        B = T.match_buffer(b, b_shape, in_dtype, align=64, offset_factor=b_shape[1], scope="wmma.matrix_b")
        C = T.match_buffer(c, (M, N), out_dtype, align=64, offset_factor=N, scope="wmma.accumulator")
        with T.sblock("root"):
            T.reads(C[0:M, 0:N], A[0:M, 0:K], B[0:b_shape[0], 0:b_shape[1]])
            T.writes(C[0:M, 0:N])
            for i, j, k in T.grid(M, N, K):
                with T.sblock(""):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    b0, b1 = T.meta_var(b_index(vk, vj))
                    C[vi, vj] = C[vi, vj] + cast(A[vi, vk]) * cast(B[b0, b1])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        a1 = T.int32()
        a0 = T.int32()
        b1 = T.int32()
        b0 = T.int32()
        c1 = T.int32()
        c0 = T.int32()
        A = T.match_buffer(a, (M, K), in_dtype, align=64, offset_factor=K, scope="wmma.matrix_a", strides=[a1, a0])
        B = T.match_buffer(b, b_shape, in_dtype, align=64, offset_factor=b_shape[1], scope="wmma.matrix_b",
                           strides=[b1, b0])
        C = T.match_buffer(c, (M, N), out_dtype, align=64, offset_factor=N, scope="wmma.accumulator", strides=[c1, c0])
        with T.sblock("root"):
            T.reads(C[0:M, 0:N], A[0:M, 0:K], B[0:b_shape[0], 0:b_shape[1]])
            T.writes(C[0:M, 0:N])
            T.evaluate(T.tvm_mma_sync(C.data, _fragment_index(C, c1, M, N), A.data, _fragment_index(A, a1, M, K),
                                      B.data, _fragment_index(B, b1, b_shape[0], b_shape[1]), C.data,
                                      _fragment_index(C, c1, M, N), dtype="void"))

    return desc, impl


def _register(name: str, make) -> str:
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *make())
    return name


def wmma_intrins(in_dtype: str, out_dtype: str, b_transposed: bool, load_scope: str = "shared.dyn",
                 store_scope: str = "shared.dyn") -> dict[str, str]:
    """Names of the load_a, load_b, compute, init and store intrinsics of one WMMA configuration,
    registering them the first time. ``in_dtype``: float16 or bfloat16; ``out_dtype``: float32 or float16."""
    if in_dtype not in ("float16", "bfloat16") or out_dtype not in ("float32", "float16"):
        raise ValueError(f"no WMMA intrinsic for {in_dtype} -> {out_dtype}")
    i, o = _SHORT[in_dtype], _SHORT[out_dtype]
    ls, ss = load_scope.replace(".", "_"), store_scope.replace(".", "_")
    trans = "_trans" if b_transposed else ""
    return {
        "load_a": _register(f"autosched_wmma_load_{i}_a_{ls}", lambda: _load(in_dtype, load_scope, False, False)),
        "load_b": _register(f"autosched_wmma_load_{i}_b{trans}_{ls}",
                            lambda: _load(in_dtype, load_scope, True, b_transposed)),
        "compute": _register(f"autosched_wmma_sync_{i}{i}{o}{trans}", lambda: _sync(in_dtype, out_dtype, b_transposed)),
        "init": _register(f"autosched_wmma_fill_{o}", lambda: _fill(out_dtype)),
        "store": _register(f"autosched_wmma_store_{o}_{ss}", lambda: _store(out_dtype, store_scope)),
    }
