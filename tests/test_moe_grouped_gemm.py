"""The mixture-of-experts grouped GEMM (``moe_grouped_gemm``: a prefill's routed rows sorted by expert) and its
sm_90 space, and the decoder's use of it in a CUDA build's prefill chunks.

Without a GPU: the workload's reference against float64 numpy; the CPU ``moe_matmul`` space computes it and
``autosched tune`` tunes it on the CPU; the body of ``cuda/moe_grouped_gemm.cuh``, compiled for the host and
run CTA by CTA with one thread per CUDA thread (``test_gpu_spaces``' shim, ldmatrix as ``test_kv_cache_prefill``
emulates it), against float64 (experts with no rows, rows and columns no tile divides, k past the last full
step, one expert with every row); every point compiles for sm_90a without spills; the decoder's sorted path
(gather, grouped products, scatter back) gives transformers' tokens on the CPU; a ``cuda:sm_90`` build of a tiny
Mixtral puts the grouped GEMM, served by this space, in its prefill chunks, and compiles. On the GPU (``-m gpu``): a
Mixtral whose prefill chunk runs on grouped GEMMs gives transformers' tokens; ``test_gpu_run.py`` checks the kernel's
points against float64 at Mixtral's and Qwen3-MoE's prefill shapes."""

from __future__ import annotations

import itertools
import re
import shutil

import pytest

from .helpers import cli
from .nvcc import host_output, run_on_host
from .test_gpu_spaces import HOST_SHIM, _host_body
from .test_kv_cache_prefill import HOST_LDMATRIX

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")


def grouped_case(counts: list[int], n: int, k: int, dtype: str, seed: int = 0):
    """(x [m, k], indptr [e + 1] int32, w [e, n, k]) with ``counts[j]`` rows for expert j."""
    import torch

    from autosched.workloads import torch_dtype

    g = torch.Generator().manual_seed(seed)
    m, e = sum(counts), len(counts)
    indptr = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32)
    x = torch.randn(m, k, generator=g).to(torch_dtype(dtype))
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5).to(torch_dtype(dtype))
    return x, indptr, w


def test_the_reference_is_each_sorted_rows_expert_product():
    """The float64 reference is, row by row, the row times the weight of the expert whose range holds it (numpy),
    with experts of no rows among them; flops and presets as ``moe_gemm``'s prefill ones."""
    import numpy as np

    from autosched.workloads import get_operator, make_workload

    op = get_operator("moe_grouped_gemm")
    wl = make_workload("moe_grouped_gemm", "m=7,e=4,n=5,k=3")
    x, indptr, w = grouped_case([0, 4, 0, 3], 5, 3, "float32")
    expert = np.repeat(np.arange(4), np.diff(indptr.numpy()))
    want = np.stack([x[i].double().numpy() @ w[expert[i]].double().numpy().T for i in range(7)])
    np.testing.assert_allclose(op.reference(wl, [x, indptr, w])[0].numpy(), want, rtol=1e-12)
    import torch

    ins = op.make_inputs(wl, torch.Generator().manual_seed(0), "cpu")
    assert ins[1].dtype == torch.int32 and int(ins[1][0]) == 0 and int(ins[1][-1]) == 7
    assert (ins[1][1:] >= ins[1][:-1]).all()
    assert op.flops(wl) == 2 * 7 * 5 * 3
    assert op.preset("mixtral-8x7b-gate-up-prefill").shape == {"m": 1024, "e": 8, "n": 28672, "k": 4096}


def test_the_cpu_space_computes_the_grouped_gemm():
    """``moe_matmul`` serves the workload on the CPU (the expert of each row found from the offsets): its default
    point against the reference, fp32 and fp16, one expert too."""
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    from .helpers import check_point

    target = parse_target("llvm")
    for shape, dtype in (("m=37,e=5,n=48,k=40", "float32"), ("m=20,e=3,n=32,k=16", "float16"),
                         ("m=9,e=1,n=16,k=8", "float32")):
        task = Task.from_workload(make_workload("moe_grouped_gemm", shape, dtype))
        space = task.space(target)
        assert space.name == "moe_matmul"
        assert check_point(task, space, space.default(), target) < (1e-5 if dtype == "float32" else 4e-3)


@pytest.mark.slow
def test_autosched_tunes_the_grouped_gemm_on_the_cpu(tmp_path):
    """``autosched tune moe_grouped_gemm`` on the CPU measures correct candidates and keeps a best record."""
    import json

    db = str(tmp_path / "t.db")
    out = json.loads(cli("tune", "moe_grouped_gemm", "--shape", "m=48,e=4,n=64,k=64", "--trials", "6", "--db", db,
                         "-q", "--format", "json").stdout)
    assert out["trials"] == 6 and not out["failures"] and out["space"].startswith("moe_matmul@"), out
    assert out["record_id"] is not None and out["best_point"]


# --- the body on the host (nvcc) ----------------------------------------------------------------------------

HOST_CASES = [
    # (rows per expert, n, k, dtype, point)
    ([0, 37, 0, 70, 5], 96, 136, "float16", {"block_m": 32, "block_n": 64, "stages": 3, "warps": 4}),  # empty experts
    ([0, 0, 150], 40, 64, "bfloat16", {"block_m": 64, "block_n": 32, "stages": 2, "warps": 8}),  # one expert, all rows
    ([3, 129, 1, 0], 130, 200, "float16", {"block_m": 128, "block_n": 128, "stages": 4, "warps": 4}),  # columns past n
]


def run_body_on_the_host(tmp_path, x, indptr, w, point: dict):
    """The body of ``point`` for these inputs, compiled for the host by nvcc and run with one thread per CUDA
    thread, every CTA of the launch (spare ones included) one after the other: Y [m, n] (NaN where not written)."""
    import torch

    from autosched.search_spaces.templates.moe_grouped_gemm import body_source, slots, smem_elements

    m, k = x.shape
    e, n, _ = w.shape
    dtype = "float16" if x.dtype == torch.float16 else "bfloat16"
    scalar = "half" if dtype == "float16" else "nv_bfloat16"
    body = body_source("gg_body", m, e, n, k, dtype, point)
    body = re.sub(r"__device__ __forceinline__ void autosched_gg_ldmatrix_x4\(.*?\n}\n", "", body, flags=re.S)
    body = _host_body(body).replace("autosched_gg_ldmatrix_x4(", "host_gg_ldmatrix_x4(")
    for name, tensor in (("x", x), ("indptr", indptr), ("w", w)):
        (tmp_path / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    ctas = slots(m, e, point["block_m"]) * -(-n // point["block_n"])
    warps = point["warps"]
    threads = 32 * warps
    program = HOST_SHIM + HOST_LDMATRIX + """
inline void host_gg_ldmatrix_x4(uint32_t* r, const void* row) { host_ldmatrix_x4(r, row, false); }
""" + body + f"""
template <class T> std::vector<T> load(const char* name) {{
  FILE* f = fopen(name, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<T> data(n / sizeof(T)); fread(data.data(), 1, n, f); fclose(f); return data;
}}
int main() {{
  auto x = load<{scalar}>("x.bin");
  auto indptr = load<int>("indptr.bin");
  auto w = load<{scalar}>("w.bin");
  std::vector<{scalar}> y({m * n}, {scalar}(NAN));
  host_warps_per_cta = {warps};
  for (int cta = 0; cta < {ctas}; ++cta) {{
    std::vector<{scalar}> smem({smem_elements(point["block_m"], point["block_n"], point["stages"])});
    host_block_barriers.assign(1, new std::barrier<>({threads}));
    host_warp_barriers.clear();
    for (int i = 0; i < {warps}; ++i) host_warp_barriers.push_back(new std::barrier<>(32));
    std::vector<std::thread> pool;
    for (int t = 0; t < {threads}; ++t)
      pool.emplace_back([&, t] {{
        host_rank = 0;
        host_thread.x = t;
        gg_body(x.data(), indptr.data(), w.data(), y.data(), smem.data(), cta);
      }});
    for (auto& th : pool) th.join();
    delete host_block_barriers[0];
    for (auto* b : host_warp_barriers) delete b;
  }}
  FILE* f = fopen("y.bin", "wb"); fwrite(y.data(), sizeof({scalar}), y.size(), f); fclose(f);
  return 0;
}}
"""
    run_on_host(tmp_path, program, timeout=600)
    return host_output(tmp_path, "y", x.dtype, (m, n))


@needs_nvcc
@pytest.mark.parametrize("case", HOST_CASES, ids=["empty-experts-k-tail", "one-expert-bf16", "wide-tiles-n-tail"])
def test_grouped_gemm_body_matches_float64_on_the_host(case, tmp_path):
    """Every row of Y written (no NaN left), each equal to its float64 product to the dtype's rounding."""
    from autosched.workloads import get_operator, make_workload

    counts, n, k, dtype, point = case
    x, indptr, w = grouped_case(counts, n, k, dtype)
    y = run_body_on_the_host(tmp_path, x, indptr, w, point)
    assert not y.isnan().any()
    wl = make_workload("moe_grouped_gemm", {"m": sum(counts), "e": len(counts), "n": n, "k": k}, dtype)
    ref = get_operator("moe_grouped_gemm").reference(wl, [x, indptr, w])[0]
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < (4e-3 if dtype == "float16" else 3e-2), err


# --- the TIRx kernel, compiled for sm_90a ---------------------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize("shape,dtype", [("m=1024,e=8,n=28672,k=4096", "float16"),
                                         ("m=4096,e=128,n=1536,k=2048", "bfloat16"),
                                         ("m=70,e=4,n=130,k=200", "float16")],
                         ids=["mixtral-gate-up", "qwen3-moe-gate-up", "odd"])
def test_grouped_gemm_compiles_for_sm90a_without_spills(shape, dtype):
    """The space serves the workload on sm_90 (its default for Mixtral's ~128 rows per expert: tiles of 128
    rows; for Qwen3-MoE's ~32: of 32), and its default and largest-tile points compile without spills."""
    from autosched.cuda_tools import cuda_source
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    from .nvcc import nvcc_compile

    sm90 = parse_target("cuda:sm_90", require_device=False)
    space = Task.from_workload(make_workload("moe_grouped_gemm", shape, dtype)).space(sm90)
    assert space.name == "moe_grouped_gemm"
    points = [space.default()] + [p for p in ({"block_m": 128, "block_n": 128, "stages": 4, "warps": 4},
                                              {"block_m": 128, "block_n": 128, "stages": 3, "warps": 8},
                                              {"block_m": 32, "block_n": 32, "stages": 2, "warps": 4})
                                  if space.validate(p) is None]
    for point in points:
        report = nvcc_compile(cuda_source(space.apply(point), sm90, space.build_config(point), space.codegen),
                              "sm_90a")
        assert report.ok and report.spills == 0, (point, report.log[-2000:])


def test_the_grouped_space_declines_what_it_cannot_serve():
    """fp32, odd k, older GPUs: no grouped GEMM space (the decoder keeps ``moe_gemm`` there); the CPU space
    serves every one."""
    from autosched.errors import SpaceError
    from autosched.target import parse_target
    from autosched.task import Task
    from autosched.workloads import make_workload

    sm90 = parse_target("cuda:sm_90", require_device=False)
    sm80 = parse_target("cuda:sm_80", require_device=False)
    space = Task.from_workload(make_workload("moe_grouped_gemm", "m=256,e=8,n=512,k=512", "float16")).space(sm90)
    assert space.default() == {"block_m": 32, "block_n": 64, "stages": 3, "warps": 4}
    assert space.validate({"block_m": 128, "block_n": 128, "stages": 4, "warps": 8}) is None
    assert "an mma tile is 16" in space.validate({"block_m": 32, "block_n": 64, "stages": 3, "warps": 8})
    for shape, dtype, target in (("m=64,e=4,n=64,k=64", "float32", sm90), ("m=64,e=4,n=64,k=60", "float16", sm90),
                                 ("m=64,e=4,n=64,k=64", "float16", sm80)):
        task = Task.from_workload(make_workload("moe_grouped_gemm", shape, dtype))
        with pytest.raises(SpaceError):
            task.space(target)
        assert task.space(parse_target("llvm")).name == "moe_matmul"


# --- the decoder: a prefill chunk's experts as grouped GEMMs ---------------------------------------------------

def _tiny_mixtral(dtype: str):
    from autosched.generation.decoder import config_from_hf

    from .test_moe import _config

    return config_from_hf(_config("mixtral")[0], dtype)


@pytest.mark.slow
def test_a_build_for_sm_90_runs_a_prefill_chunks_experts_as_grouped_gemms():
    """Built here without a GPU (scheduled, not compiled), a tiny Mixtral (4 experts, top 2) for ``cuda:sm_90``:
    the 64-token prefill chunk's 128 routed rows go through ``moe_grouped_gemm`` (gate/up and down), served by its
    sm_90 space, and no ``moe_gemm``; the decode steps' few rows keep ``moe_gemm`` on ``gpu_moe_matmul``; the
    grouped GEMM's kernel itself compiles in test_grouped_gemm_compiles_for_sm90a_without_spills."""
    from autosched.generation.build import lower_generation, schedule_generation
    from autosched.pipeline.tasks import kernel_calls
    from autosched.target import parse_target

    target = parse_target("cuda:sm_90", require_device=False)
    lowered, _ = lower_generation(_tiny_mixtral("float16"), target, decode_batches=(1, 4), prefill_chunks=(64,))
    _, report, _ = schedule_generation(lowered, None, target)

    def ours(function):
        called = kernel_calls(lowered, lambda name: name == function)
        return {(report.workloads[k]["workload"], report.workloads[k]["space"], report.workloads[k]["schedule"])
                for k in called if k in report.workloads}

    chunk = ours("prefill_t64")
    assert ("moe_grouped_gemm[m=128,e=4,n=192,k=64]:float16", "moe_grouped_gemm", "default point") in chunk
    assert ("moe_grouped_gemm[m=128,e=4,n=64,k=96]:float16", "moe_grouped_gemm", "default point") in chunk
    assert not [w for w, _, _ in chunk if w.startswith("moe_gemm[")]
    for function, rows in (("decode_b1", 2), ("decode_b4", 8)):
        moe = {(w.split(",")[0], space) for w, space, _ in ours(function) if w.startswith("moe")}
        assert moe == {(f"moe_gemm[m={rows}", "gpu_moe_matmul")}, (function, moe)


@needs_nvcc
@pytest.mark.slow
def test_a_cuda_build_with_grouped_gemms_compiles():
    """The same tiny Mixtral compiled whole for ``cuda:sm_90`` without a GPU (the sort, the offsets, the gathers and
    the grouped GEMMs through TVM's CUDA code generation): the modules of our grouped GEMM compile with nvcc for
    sm_90a without spills."""
    import torch

    from autosched.generation.build import GenerationModel, compile_generation
    from autosched.target import parse_target

    from .nvcc import nvcc_compile
    from .test_moe import _config

    config, cls = _config("mixtral")
    model = cls(config).to(torch.float16).eval()
    target = parse_target("cuda:sm_90", require_device=False)
    gm = GenerationModel("mixtral-tiny", model, _tiny_mixtral("float16"), [])
    executable, _, report = compile_generation(gm, target, None, decode_batches=(2,), prefill_chunks=(64,))
    assert {k["space"] for k in report.workloads.values() if k["workload"].startswith("moe_grouped_gemm[")} == {
        "moe_grouped_gemm"}

    def cuda_sources(module):
        for imported in module.imports:
            if imported.kind == "cuda":
                yield imported.inspect_source()
            yield from cuda_sources(imported)

    ours = [source for source in cuda_sources(executable.mod) if "autosched_moe_grouped_gemm" in source]
    assert len(ours) == 2  # gate/up and down
    for source in ours:
        report = nvcc_compile(source, "sm_90a")
        assert report.ok and report.spills == 0, report.log[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_the_sorted_experts_path_gives_transformers_tokens_on_the_cpu(name, tmp_path, monkeypatch):
    """The grouped path forced on the CPU (sorting, offsets, gathering X, ``moe_grouped_gemm`` on the CPU's
    ``moe_matmul`` space, scattering Y back) in a build with a prefill chunk of 16 tokens (32 or 48 routed rows,
    under the threshold forced too): the greedy tokens of every prompt are transformers' (Mixtral: top 2 of 4;
    Qwen3-MoE: top 3 of 6, not renormalised, a dense layer after the sparse one). The 40-token prompt goes through
    the chunk: un-permuting the rows with the sort's order instead of its inverse fails it."""
    import autosched.generation.linear as linear
    from autosched.generation import Generator

    from .helpers import transformers_greedy
    from .test_moe import MAX_SEQ_LEN, NEW, PROMPTS, _saved

    monkeypatch.setattr(linear, "FORCE_GROUPED_MOE", True)
    monkeypatch.setattr(linear, "GROUPED_MOE_MIN_ROWS", 2)
    model = _saved(name, tmp_path / "hf")
    cli("build", str(tmp_path / "hf"), "--generate", "-o", str(tmp_path / "art"), "--max-seq-len", str(MAX_SEQ_LEN),
        "--max-batch", "2", "--prefill-chunks", "16", "--db", str(tmp_path / "t.db"))
    import json

    kernels = json.loads((tmp_path / "art" / "manifest.json").read_text())["workload_kernels"]
    assert {k["space"] for k in kernels.values() if k["workload"].startswith("moe_grouped_gemm[")} == {"moe_matmul"}
    results = Generator(tmp_path / "art").generate(PROMPTS, NEW)
    for prompt, result in zip(PROMPTS, results):
        assert result.error is None
        assert result.tokens == transformers_greedy(model, prompt, NEW), (name, len(prompt))


# --- on the GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_a_mixtral_prefill_chunk_on_grouped_gemms_matches_transformers_on_the_gpu():
    """A Mixtral of hidden 1024 (8 experts of 2048, top 2, 2 layers) in fp16 on the GPU with a prefill chunk of
    64 tokens (128 routed rows: grouped GEMMs) and a decode batch of 2 (moe_gemm): the greedy tokens of prompts
    that fill a chunk and more are transformers' (fp16, same GPU), or the first difference is a near-tie."""
    from .helpers import assert_gpu_greedy_matches, gpu_generator, random_mixtral_on_gpu

    model = random_mixtral_on_gpu(1024, 2048, 8, 2)
    generator, report = gpu_generator(model, "mixtral-grouped", 256, (2,), prefill_chunks=(64,))
    grouped = [k for k in report.workloads.values() if k["workload"].startswith("moe_grouped_gemm[m=128,")]
    assert len({k["workload"] for k in grouped}) == 2, report.workloads  # gate/up and down
    assert all(k["space"] == "moe_grouped_gemm" for k in grouped), report.workloads
    prompts = [[(37 * i + 11) % 8000 for i in range(70)], [(101 * i + 5) % 8000 for i in range(130)]]
    results = generator.generate(prompts, 8)
    assert_gpu_greedy_matches(model, prompts, results, 8, max_margin=0.1)
