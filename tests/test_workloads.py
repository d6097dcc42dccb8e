"""Operators: input validation, and every unscheduled definition against its torch reference."""

from __future__ import annotations

import pytest
import torch

from autosched.errors import UsageError
from autosched.task import Task
from autosched.workloads import get_operator, list_operators, make_workload, parse_shape

from .helpers import check_point

# Awkward sizes on purpose: primes and odd numbers that no tile divides.
SMALL_CASES = [
    ("gemm", "m=33,n=65,k=17", "float32", ""),
    ("gemm", "m=7,n=40,k=31", "float16", "bias=1,act=gelu"),
    ("gemm", "m=8,n=16,k=32", "bfloat16", "act=silu"),
    ("batch_matmul", "b=3,m=17,n=9,k=31", "float32", ""),
    ("dequant_gemm", "m=3,n=40,k=100", "float16", "bits=4,group=32"),
    ("dequant_gemm", "m=2,n=24,k=64", "float32", "bits=8,group=32,bias=1"),
    ("dequant_gemm", "m=3,n=40,k=100", "float16", "bits=4,group=32,zeros=1,bias=1"),  # zero points, a short group
    ("dequant_gemm", "m=2,n=24,k=64", "float16", "bits=8,group=64,fmt=e4m3"),  # float8 E4M3 codes, per channel
    ("dequant_gemm", "m=3,n=40,k=100", "bfloat16", "bits=8,group=100,fmt=e4m3,bias=1"),
    ("rmsnorm", "m=7,n=100", "float16", ""),
    ("add_rmsnorm", "m=3,n=64", "float16", ""),
    ("softmax", "m=5,n=77", "float32", ""),
    ("rope", "b=2,s=9,h=3,d=16", "float16", ""),
    ("attention", "b=1,h=4,s=19,d=16,hkv=2", "float16", "causal=1"),
    ("attention", "b=2,h=2,s=8,d=8", "float32", "causal=0"),
    ("attention_bshd", "b=2,h=4,s=19,d=16,hkv=2", "float16", "causal=1"),
    ("swiglu_gemm", "m=5,n=24,k=40", "float16", ""),
    # float8 E4M3 activations and weights, per-token and per-channel scales (every code in row 0 of A and W)
    ("fp8_gemm", "m=3,n=40,k=300", "float16", ""),
    ("fp8_gemm", "m=5,n=7,k=33", "bfloat16", "bias=1,act=silu"),
    # per-token E4M3 quantisation: a zero row, a row past 448 into the subnormals, a row of ties (rows 0-2)
    ("fp8_quant_rows", "m=5,k=97", "float16", ""),
    ("fp8_quant_rows", "m=4,k=40", "bfloat16", ""),
    ("moe_gemm", "m=7,e=3,n=24,k=40", "float16", ""),
    ("moe_grouped_gemm", "m=11,e=4,n=24,k=40", "float16", ""),  # rows sorted by expert, some experts without rows
    ("paged_decode_attention", "b=3,h=4,hkv=2,d=16,ctx=37,page=8", "float16", ""),
]


class _Unscheduled:
    """A space with no knobs whose only point is the function as written."""

    def __init__(self, func):
        self.func = func

    def apply(self, point):
        import tvm

        return tvm.IRModule({"main": self.func})


@pytest.mark.parametrize("op,shape,dtype,attrs", SMALL_CASES)
def test_definition_matches_reference(op, shape, dtype, attrs, cpu_target):
    wl = make_workload(op, shape, dtype, attrs)
    task = Task.from_workload(wl)
    err = check_point(task, _Unscheduled(task.func), {}, cpu_target)
    assert err < get_operator(op).tolerance(wl), f"{wl.key}: relative error {err}"


def test_every_operator_has_counts_and_presets():
    for op in list_operators():
        assert op.shape_keys and op.presets, op.name
        for preset in op.presets:
            wl = make_workload(op.name, preset=preset.name, dtype=op.dtypes[0])
            assert op.flops(wl) > 0 and op.min_bytes(wl) > 0


@pytest.mark.parametrize("op,shape,params", [
    ("gemm", "m=3,n=5,k=7", [(3, 7), (5, 7), (3, 5)]),  # B is stored as [n, k]
    ("rmsnorm", "m=3,n=5", [(3, 5), (5,), (3, 5)]),
    ("softmax", "m=3,n=5", [(3, 5), (3, 5)]),
    ("attention", "b=2,h=3,s=5,d=8", [(2, 3, 5, 8)] * 4),
    ("attention_bshd", "b=2,h=3,s=5,d=8,hkv=1", [(2, 5, 3, 8), (2, 5, 1, 8), (2, 5, 1, 8), (2, 5, 3, 8)]),
])
def test_shape_keys_are_the_kernels_dimensions(op, shape, params):
    """The shape keys the issues name (m, n, k; b, h, s, d) reach the built function's buffers as given."""
    func = get_operator(op).build(make_workload(op, shape, get_operator(op).dtypes[0]))
    assert [tuple(int(x) for x in p.shape) for p in func.params] == params


@pytest.mark.parametrize("call,message", [
    (lambda: make_workload("gemmm"), "unknown operator 'gemmm'"),
    (lambda: make_workload("gemm", "m=2,x=3"), "no shape key x"),
    (lambda: parse_shape("m=2,,n=3"), "malformed shape item"),
    (lambda: parse_shape("m=two"), "not an integer"),
    (lambda: parse_shape("m=0"), "positive"),
    (lambda: make_workload("gemm", "m=2", "int3"), "unsupported dtype"),
    (lambda: make_workload("gemm", attrs="act=relu"), "not one of"),
    (lambda: make_workload("rope", "d=15"), "even head dimension"),
    (lambda: make_workload("attention", "h=6,hkv=4"), "multiple of KV heads"),
    (lambda: make_workload("gemm", preset="nope"), "no preset"),
    (lambda: make_workload("dequant_gemm", attrs="bits=8,zeros=1"), "zeros=1 .* is for bits=4 only"),
    (lambda: make_workload("dequant_gemm", attrs="bits=4,fmt=e4m3"), "fmt=e4m3 .* is for bits=8 only"),
    (lambda: make_workload("dequant_gemm", attrs="bits=8,fmt=e5m2"), "fmt=e5m2 is not one of int, e4m3"),
    (lambda: make_workload("fp8_gemm", "m=2,n=8,k=16", "float32"), "fp8_gemm does not support dtype float32"),
])
def test_bad_input_is_a_usage_error(call, message):
    with pytest.raises(UsageError, match=message):
        call()


def test_workload_key_round_trip():
    wl = make_workload("dequant_gemm", "m=3,n=40,k=100", "fp16", "bits=4,group=32")
    assert wl.dtype == "float16"
    again = type(wl).from_json(wl.to_json())
    assert again == wl and again.key == wl.key


def test_dequant_gemm_without_zero_points_keeps_its_key_and_function():
    """``zeros`` is unkeyed at 0: such a workload's key (the records' key) and its function are those it had
    before the attribute existed; zeros=1 adds the key item and a uint8 [n, groups] input after the scales."""
    old = "dequant_gemm[m=3,n=40,k=100]:float16;bits=4;group=32;bias=False;act=none"
    assert make_workload("dequant_gemm", "m=3,n=40,k=100", "fp16", "bits=4,group=32").key == old
    assert make_workload("dequant_gemm", "m=3,n=40,k=100", "fp16", "bits=4,group=32,zeros=0").key == old
    wl = make_workload("dequant_gemm", "m=3,n=40,k=100", "fp16", "bits=4,group=32,zeros=1")
    assert wl.key == old + ";zeros=1" and type(wl).from_json(wl.to_json()) == wl
    params = [(tuple(int(x) for x in p.shape), str(p.dtype)) for p in get_operator("dequant_gemm").build(wl).params]
    assert params == [((3, 100), "float16"), ((40, 50), "uint8"), ((40, 4), "float16"), ((40, 4), "uint8"),
                      ((3, 40), "float16")]


def test_dequant_gemm_e4m3_keys_fmt_and_reads_uint8_codes():
    """``fmt`` is unkeyed at "int" (int8 workloads keep their keys and functions); fmt=e4m3 adds the key item and
    reads Wq as uint8 [n, k]."""
    old = "dequant_gemm[m=2,n=24,k=64]:float16;bits=8;group=64;bias=False;act=none"
    assert make_workload("dequant_gemm", "m=2,n=24,k=64", "fp16", "bits=8,group=64,fmt=int").key == old
    wl = make_workload("dequant_gemm", "m=2,n=24,k=64", "fp16", "bits=8,group=64,fmt=e4m3")
    assert wl.key == old + ";fmt=e4m3" and type(wl).from_json(wl.to_json()) == wl
    params = [(tuple(int(x) for x in p.shape), str(p.dtype)) for p in get_operator("dequant_gemm").build(wl).params]
    assert params == [((2, 64), "float16"), ((24, 64), "uint8"), ((24, 1), "float16"), ((2, 24), "float16")]


def test_e4m3_decoding_of_all_256_codes_is_ml_dtypes_and_torchs():
    """The kernel's integer decoding of E4M3FN (subnormals, -0, 448, the NaN codes 0x7F/0xFF), compiled for the
    CPU, gives ml_dtypes' float8_e4m3fn values, and so does torch's float8_e4m3fn (the reference's)."""
    import ml_dtypes
    import numpy as np
    import tvm
    from tvm import te

    from autosched.workloads.dequant import e4m3_value

    codes = te.placeholder((256,), "uint8", name="codes")
    decode = te.create_prim_func([codes, te.compute((256,), lambda i: e4m3_value(codes[i]), name="value")])
    out = tvm.runtime.empty((256,), "float32", tvm.cpu())
    tvm.compile(decode, target={"kind": "llvm"})(tvm.runtime.tensor(np.arange(256, dtype=np.uint8)), out)
    expected = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.array_equal(out.numpy().astype(np.float64), expected, equal_nan=True)
    from_torch = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(from_torch, expected, equal_nan=True)
    assert expected[1] == 2.0**-9 and expected[0x7E] == 448 and np.isnan(expected[[0x7F, 0xFF]]).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_gemm_definition_decodes_every_code_exactly_on_the_cpu(dtype, cpu_target):
    """fp8_gemm's TE definition, compiled for the CPU as written, against its float64 reference (A and W decoded
    through torch.float8_e4m3fn) element by element: products of codes that include every finite E4M3FN code
    (subnormals from 2^-9, ±0, ±448) are exact in fp32, so each output is the reference rounded to the output
    dtype, within a unit or so of its last place. A single code at a time (one-hot rows) checks each code's
    value on its own, where a wrong subnormal could hide in a sum."""
    import numpy as np
    import tvm

    from autosched.workloads.fp8 import FINITE_CODES

    op = get_operator("fp8_gemm")
    wl = make_workload("fp8_gemm", "m=4,n=6,k=254", dtype, "bias=1")
    inputs = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    assert inputs[0][0].tolist() == FINITE_CODES and inputs[1][0].tolist() == FINITE_CODES[::-1]
    assert {0x01, 0x07, 0x7E, 0x80, 0x81, 0xFE} <= set(inputs[0][0].tolist())  # subnormals, -0, ±448
    executable = tvm.compile(Task.from_workload(wl).func, target=cpu_target.tvm_target())

    def run(ins):
        out = torch.full((4, 6), float("nan"), dtype=getattr(torch, dtype))
        executable(*[tvm.runtime.from_dlpack(t.contiguous()) for t in (*ins, out)])
        return out.double()

    ulp = 2.0 ** (-10 if dtype == "float16" else -7)
    ref = op.reference(wl, inputs)[0]
    assert torch.allclose(run(inputs), ref, rtol=ulp, atol=1e-6), (run(inputs) - ref).abs().max()
    # One-hot: A[0] = code c at column j, W[0] = 1.0 (0x38) at column j, unit scales, no bias: C[0, 0] = e4m3(c).
    codes = torch.tensor(FINITE_CODES, dtype=torch.uint8)
    one = torch.zeros(4, 254, dtype=torch.uint8)
    values = []
    for c in codes.tolist():
        a = one.clone()
        a[0, 7] = c
        w = torch.zeros(6, 254, dtype=torch.uint8)
        w[0, 7] = 0x38
        out = run([a, w, torch.ones(4), torch.ones(6), torch.zeros(6, dtype=getattr(torch, dtype))])
        values.append(float(out[0, 0]))
    expected = codes.view(torch.float8_e4m3fn).to(getattr(torch, dtype)).double().tolist()
    assert np.array_equal(values, expected)


def test_fp8_gemm_reads_uint8_codes_and_float32_scales():
    """The kernel's parameters: A[m, k] and W[n, k] uint8, scale_a[m] and scale_w[n] float32, optional bias[n]
    and C[m, n] of the workload's dtype; C = (A·Wᵀ)·scale_a·scale_w in the reference."""
    wl = make_workload("fp8_gemm", "m=3,n=5,k=32", "bf16", "bias=1")
    params = [(tuple(int(x) for x in p.shape), str(p.dtype)) for p in get_operator("fp8_gemm").build(wl).params]
    assert params == [((3, 32), "uint8"), ((5, 32), "uint8"), ((3,), "float32"), ((5,), "float32"), ((5,), "bfloat16"),
                      ((3, 5), "bfloat16")]
    assert wl.key == "fp8_gemm[m=3,n=5,k=32]:bfloat16;bias=True;act=none"


def test_paged_decode_reference_masks_by_length():
    """The reference honours seq_lens: changing keys past a sequence's length changes nothing."""
    wl = make_workload("paged_decode_attention", "b=2,h=2,d=8,ctx=20,page=4")
    op = get_operator(wl.op)
    ins = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    ref = op.reference(wl, ins)[0]
    short = op.seq_lens(wl)[1]
    table = ins[3]
    k = ins[1].clone()
    last_page = table[1, short // 4 + 1]
    k[last_page] += 100.0
    ref2 = op.reference(wl, [ins[0], k] + ins[2:])[0]
    assert torch.allclose(ref[1], ref2[1])


def test_e4m3_encoding_of_every_half_and_of_float32_values_is_ml_dtypes():
    """e4m3_code (integer arithmetic on float32 bits), compiled for the CPU, on every finite float16 value and on
    random float32 ones from 2^-20 to 2^12: ml_dtypes' float8_e4m3fn of the value clamped to ±448 (nearest, ties
    to even, subnormals from 2^-9, -0 kept), bit for bit."""
    import ml_dtypes
    import numpy as np
    import tvm
    from tvm import te

    from autosched.workloads.fp8 import e4m3_code

    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)].astype(np.float32)
    rng = np.random.default_rng(0)
    floats = (rng.choice([-1, 1], 50000) * np.exp2(rng.uniform(-20, 12, 50000))).astype(np.float32)
    ties = np.array([17, -19, 2.5 * 2**-9, 464, -464, 449, 2**-10, 3 * 2**-11, 0.0, -0.0], np.float32)
    values = np.concatenate([halves, floats, ties])
    x = te.placeholder((len(values),), "float32", name="x")
    encode = te.create_prim_func([x, te.compute(x.shape, lambda i: e4m3_code(x[i]), name="code")])
    out = tvm.runtime.empty((len(values),), "uint8", tvm.cpu())
    tvm.compile(encode, target={"kind": "llvm"})(tvm.runtime.tensor(values), out)
    expected = np.clip(values, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    expected[np.signbit(values) & (expected == 0)] = 0x80  # ml_dtypes keeps -0's sign; a clip of -0 too
    bad = np.flatnonzero(out.numpy() != expected)
    assert bad.size == 0, [(float(values[i]), int(out.numpy()[i]), int(expected[i])) for i in bad[:8]]
    assert out.numpy()[-10:].tolist() == [0x58, 0xDA, 0x02, 0x7E, 0xFE, 0x7E, 0x00, 0x01, 0x00, 0x80]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_quant_rows_on_the_rows_space_gives_the_float64_codes_and_scales(dtype, cpu_target):
    """fp8_quant_rows scheduled by the CPU's rows space (its default and a scalar point) on rows with a zero row
    (scale 0, codes ±0, no NaN), values past 448 with others in E4M3's subnormal range, and exact ties: each of
    those rows' codes is the float64 reference's, bit for bit, the scales within float32's rounding; the checker
    accepts a code one step off only at a tie (random rows may hold one: bfloat16's 0.2519 / 0.005997 lies
    within float32's rounding of 42, halfway between E4M3's 40 and 44)."""
    import tvm

    op = get_operator("fp8_quant_rows")
    wl = make_workload("fp8_quant_rows", "m=6,k=200", dtype)
    task = Task.from_workload(wl)
    space = task.space(cpu_target)
    assert space.name == "rows"
    inputs = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    codes, scale = op.reference(wl, inputs)
    assert scale[0] == 0 and not (codes[0] & 0x7F).any() and (codes[0, 1::2] == 0x80).all()  # ±0 row: ±0 codes
    assert codes[1, :2].tolist() == [0x7E, 0xFE]  # 1000 and -999 -> ±448
    assert ((codes[1] & 0x7F) < 8).sum() > 10  # subnormal codes
    for point in (space.default(), {**space.default(), "vector": 1, "rfactor": False}):
        out = [torch.full((6, 200), 0xFF, dtype=torch.uint8), torch.full((6,), float("nan"))]
        executable = tvm.compile(space.apply(space.canonical(point)), target=cpu_target.tvm_target())
        executable(*[tvm.runtime.from_dlpack(t) for t in (*inputs, *out)])
        assert torch.equal(out[0][:3], codes[:3])  # the zero, wide and tie rows: bit for bit
        # Random rows: the same codes, but where X / scale lies within float32's rounding of a tie between two
        # E4M3 values (float64's quotient and the kernel's float32 one round apart): one step, which errors allows.
        assert (out[0] != codes).sum() <= 2
        assert torch.allclose(out[1].double(), scale, rtol=2**-23, atol=0) and not out[1].isnan().any()
        assert op.errors(wl, inputs, out, [codes, scale])[0] == 0
    # One step off: accepted at row 2's ties (17 -> 16 or 18), refused elsewhere; NaN codes: infinite.
    tie, off = codes.clone(), codes.clone()
    tie[2, 0] = 0x59  # 18 for 17 (16: 0x58)
    off[3, 5] = off[3, 5] + 1 if off[3, 5] & 0x7F < 0x7E else off[3, 5] - 1
    assert op.errors(wl, inputs, [tie, scale.float()], [codes, scale])[0] == 0
    assert op.errors(wl, inputs, [off, scale.float()], [codes, scale])[0] == 1
    assert op.errors(wl, inputs, [torch.full_like(codes, 0xFF), scale.float()], [codes, scale])[0] == float("inf")
