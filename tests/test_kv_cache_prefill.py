"""Our ragged prefill attention in the calling convention of TVM's paged KV cache (``kv_cache_prefill``) and
the dispatch that puts it in a generation build in place of TVM's ``batch_prefill_ragged_kv``.

Without a GPU: the body, compiled for the host and run CTA by CTA (``test_gpu_spaces``' shim, with ldmatrix
emulated), matches a float64 reference of ragged causal GQA attention and its base-2 log-sum-exp (sequences
of 1 token and of lengths no tile divides, more keys than queries, rows that see no key, NaN past the last
sequence's keys); the TIRx kernel compiles for sm_90a without spills; a build for ``cuda:sm_90`` names it for
the ragged prefill role. On the GPU (``-m gpu``): the kernel against float64 and against TVM's kernel."""

from __future__ import annotations

import math
import re
import shutil

import pytest

from .nvcc import host_output, run_on_host
from .test_gpu_spaces import HOST_SHIM, _host_body

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")

EMPTY_LSE = -5e4  # what TVM's kernel writes for a row that sees no key (its initial max, a sum of 1)


def prefill_case(q_lens: list[int], kv_lens: list[int], h: int, hkv: int, d: int, dtype: str, seed: int = 0,
                 spare_kv: int = 5):
    """Inputs in the runtime's convention: (q [total_q, h, d], q_indptr [b + 1], k, v [total_kv + spare, hkv,
    d], kv_indptr [b + 1], sm_scale), torch tensors on the CPU. Keys past the last sequence's hold NaN, so
    that reading them shows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    total_q, total_kv = sum(q_lens), sum(kv_lens)
    q = torch.randn((total_q, h, d), generator=gen).to(dt)
    k = torch.full((total_kv + spare_kv, hkv, d), float("nan"), dtype=dt)
    v = torch.full((total_kv + spare_kv, hkv, d), float("nan"), dtype=dt)
    k[:total_kv] = torch.randn((total_kv, hkv, d), generator=gen).to(dt)
    v[:total_kv] = torch.randn((total_kv, hkv, d), generator=gen).to(dt)
    indptr = lambda lens: torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)  # noqa: E731
    return q, indptr(q_lens), k, v, indptr(kv_lens), 1.0 / math.sqrt(d)


def reference(q, q_indptr, k, v, kv_indptr, sm_scale, causal: bool = True):
    """(output [total_q, h, d], lse [total_q, h] in base 2) in float64; query i of a sequence of qlen queries
    and kvlen keys sees key j <= kvlen - qlen + i when causal; zeros and -5e4 for a row that sees no key."""
    import torch

    total, h, d = q.shape
    group = h // k.shape[1]
    out = torch.zeros((total, h, d), dtype=torch.float64)
    lse = torch.full((total, h), EMPTY_LSE, dtype=torch.float64)
    for b in range(len(q_indptr) - 1):
        qs, qe, ks, ke = int(q_indptr[b]), int(q_indptr[b + 1]), int(kv_indptr[b]), int(kv_indptr[b + 1])
        qlen, kvlen = qe - qs, ke - ks
        if qlen == 0 or kvlen == 0:  # no key: the rows keep zeros and -5e4
            continue
        kk = k[ks:ke].double().repeat_interleave(group, dim=1)  # [kvlen, h, d]
        vv = v[ks:ke].double().repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[qs:qe].double(), kk) * sm_scale  # [h, qlen, kvlen]
        if causal:
            seen = torch.arange(kvlen)[None, :] <= (kvlen - qlen + torch.arange(qlen))[:, None]
            s = s.masked_fill(~seen, float("-inf"))
        live = torch.isfinite(s).any(-1)  # [h, qlen]
        p = torch.softmax(s, -1).nan_to_num(0.0)
        o = torch.einsum("hij,jhd->ihd", p, vv)
        out[qs:qe] = torch.where(live.T[..., None], o, torch.zeros_like(o))
        lse[qs:qe] = torch.where(live, torch.logsumexp(s, -1) / math.log(2), torch.full_like(s[..., 0], EMPTY_LSE)).T
    return out, lse


def check(out, lse, ref_out, ref_lse, dtype: str) -> None:
    import torch

    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    tol = 2e-2 if dtype == "bfloat16" else 5e-3  # P is rounded to the input type for the second product
    err = (out.double().cpu() - ref_out).abs().max().item() / max(ref_out.abs().max().item(), 1e-6)
    assert err < tol, f"output: relative error {err}"
    lse_err = (lse.double().cpu() - ref_lse).abs().max().item()
    assert lse_err < 1e-3 * max(1.0, ref_lse.abs().max().item() / 100), f"log-sum-exp (base 2): error {lse_err}"


# --- the body on the host (nvcc) ----------------------------------------------------------------------------

# ldmatrix on the host: each lane posts its row's address, then takes its registers by the PTX ISA's layout
# (lane l: row l / 4, columns 2 (l % 4) + {0, 1} of each matrix; transposed: those of the transpose).
HOST_LDMATRIX = r"""
using std::max;
static const uint16_t* host_ldmatrix_rows[512][32];
inline void host_ldmatrix_x4(uint32_t* r, const void* row, bool trans) {
  const int w = host_rank * host_warps_per_cta + host_thread.x / 32, l = host_thread.x % 32;
  host_warp_barriers[w]->arrive_and_wait();
  host_ldmatrix_rows[w][l] = static_cast<const uint16_t*>(row);
  host_warp_barriers[w]->arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    const uint16_t* const* rows = host_ldmatrix_rows[w] + 8 * i;
    const uint16_t lo = trans ? rows[2 * (l % 4)][l / 4] : rows[l / 4][2 * (l % 4)];
    const uint16_t hi = trans ? rows[2 * (l % 4) + 1][l / 4] : rows[l / 4][2 * (l % 4) + 1];
    r[i] = lo | (uint32_t)hi << 16;
  }
  host_warp_barriers[w]->arrive_and_wait();
}
"""

HOST_CASES = [
    # (q_lens, kv_lens, h, hkv, d, dtype, causal)
    ([1, 70, 33], [1, 70, 33], 4, 2, 64, "float16", 1),  # GQA 2:1, one token, lengths no tile divides
    ([5, 40, 10], [20, 40, 4], 2, 2, 128, "bfloat16", 1),  # MHA d128: more keys than queries, rows without keys
    ([17, 3], [130, 3], 4, 1, 64, "float16", 0),  # GQA 4:1, not causal, keys over three tiles
    ([1, 131], [1, 131], 8, 2, 128, "float16", 1),  # Llama's grouping (4:1) and head dim, tiles of 16 tokens
]


def _run_body_on_the_host(tmp_path, body: str, dtype: str, d: int, ctas: int, inputs: dict, call: str):
    """Runs ``body`` (a device function of ``body_source``) on the host with one thread per CUDA thread, one
    CTA at a time, every CTA of the launch: ``inputs`` (name: torch tensor, its C++ type's vector named so in
    ``call``), ``call`` the body's call with ``out``, ``lse``, ``smem`` and ``cta`` in scope. (output, lse)."""
    import torch

    from autosched.search_spaces.templates.kv_cache_prefill import BLOCK_M, smem_elements

    body = re.sub(r"__device__ __forceinline__ void autosched_kvp_ldmatrix_x4\(.*?\n}\n", "", body, flags=re.S)
    body = _host_body(body).replace("autosched_kvp_ldmatrix_x4(", "host_ldmatrix_x4(").replace("__ldg(", "*(")
    scalar = "half" if dtype == "float16" else "nv_bfloat16"
    loads = []
    for name, tensor in inputs.items():
        (tmp_path / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        loads.append(f'auto {name} = load<{"int" if tensor.dtype == torch.int32 else scalar}>("{name}.bin");')
    q = inputs["q"]
    program = HOST_SHIM + HOST_LDMATRIX + body + f"""
template <class T> std::vector<T> load(const char* name) {{
  FILE* f = fopen(name, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<T> data(n / sizeof(T)); fread(data.data(), 1, n, f); fclose(f); return data;
}}
int main() {{
  {" ".join(loads)}
  std::vector<{scalar}> out(q.size(), {scalar}(NAN));
  std::vector<float> lse(q.size() / {d}, NAN);
  const int threads = {BLOCK_M // 16} * 32;
  host_warps_per_cta = {BLOCK_M // 16};
  for (int cta = 0; cta < {ctas}; ++cta) {{
    std::vector<{scalar}> smem({smem_elements(d)});
    host_block_barriers.assign(1, new std::barrier<>(threads));
    host_warp_barriers.clear();
    for (int w = 0; w < {BLOCK_M // 16}; ++w) host_warp_barriers.push_back(new std::barrier<>(32));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {{
        host_rank = 0;
        host_thread.x = t;
        {call};
      }});
    for (auto& th : pool) th.join();
    delete host_block_barriers[0];
    for (auto* b : host_warp_barriers) delete b;
  }}
  FILE* f = fopen("out.bin", "wb"); fwrite(out.data(), sizeof({scalar}), out.size(), f); fclose(f);
  f = fopen("lse.bin", "wb"); fwrite(lse.data(), sizeof(float), lse.size(), f); fclose(f);
  return 0;
}}
"""
    run_on_host(tmp_path, program, timeout=600)
    out = host_output(tmp_path, "out", q.dtype, q.shape)
    lse = host_output(tmp_path, "lse", torch.float32, q.shape[:2])
    return out, lse


def _launch_ctas(total_q: int, batch: int, h: int, hkv: int) -> int:
    from autosched.search_spaces.templates.kv_cache_prefill import BLOCK_M

    return (-(-total_q * (h // hkv) // BLOCK_M) + batch) * hkv  # the launch's grid


@needs_nvcc
@pytest.mark.parametrize("case", HOST_CASES, ids=["gqa2-d64-causal", "mha-d128-bf16-shifted", "gqa4-noncausal",
                                                  "gqa4-d128-causal"])
def test_kv_cache_prefill_body_matches_float64_on_the_host(case, tmp_path):
    """The body over the new tokens, compiled for the host by nvcc and run with one thread per CUDA thread, one
    CTA at a time (every CTA of the launch, the spare ones included), against the float64 reference: output
    and base-2 log-sum-exp."""
    from autosched.search_spaces.templates.kv_cache_prefill import BLOCK_M, BLOCK_N, body_source

    q_lens, kv_lens, h, hkv, d, dtype, causal = case
    q, q_indptr, k, v, kv_indptr, sm_scale = prefill_case(q_lens, kv_lens, h, hkv, d, dtype)
    config = {"H": h, "HKV": hkv, "G": h // hkv, "D": d, "BM": BLOCK_M, "BN": BLOCK_N}
    out, lse = _run_body_on_the_host(
        tmp_path, body_source("kv_prefill_body", dtype, config), dtype, d, _launch_ctas(len(q), len(q_lens), h, hkv),
        {"q": q, "qi": q_indptr, "k": k, "v": v, "ki": kv_indptr},
        f"kv_prefill_body(q.data(), qi.data(), k.data(), v.data(), ki.data(), out.data(), lse.data(), smem.data(), "
        f"cta, {len(q_lens)}, {causal}, {sm_scale!r}f)")
    ref_out, ref_lse = reference(q, q_indptr, k, v, kv_indptr, sm_scale, bool(causal))
    check(out, lse, ref_out, ref_lse, dtype)
    assert ((ref_lse == EMPTY_LSE) == (lse == EMPTY_LSE)).all()


def paged_case(q_lens: list[int], kv_lens: list[int], h: int, hkv: int, d: int, dtype: str, seed: int = 0):
    """Inputs over the cache's pages: (q, q_indptr, pages, page_indptr, indices, last_len, sm_scale) in the
    runtime's convention (shuffled pages, NaN in every slot no sequence owns), and the same keys and values
    gathered in the ragged form (k, v, kv_indptr) for the reference."""
    import torch

    from .test_kv_cache_decode import decode_case

    _, pages, page_indptr, indices, last_len, sm_scale = decode_case(kv_lens, h, hkv, d, dtype, seed=seed)
    q = torch.randn((sum(q_lens), h, d), generator=torch.Generator().manual_seed(seed + 1)).to(getattr(torch, dtype))
    rows = lambda part: torch.cat([pages[indices[int(page_indptr[i]):int(page_indptr[i + 1])].long(), part]  # noqa: E731
                                   .permute(0, 2, 1, 3).reshape(-1, hkv, d)[:n] for i, n in enumerate(kv_lens)])
    as_indptr = lambda lens: torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)  # noqa: E731
    return (q, as_indptr(q_lens), pages, page_indptr, indices, last_len, sm_scale), (rows(0), rows(1), as_indptr(kv_lens))


PAGED_HOST_CASES = [
    # (q_lens, kv_lens, h, hkv, d, dtype, causal)
    ([5, 5, 5], [544, 17, 0], 8, 2, 128, "float16", 0),  # a verify step: 5 tokens over the cached ones, one empty
    ([3, 70], [40, 16], 2, 2, 64, "bfloat16", 1),  # causal, more queries than keys: rows without keys
    ([1, 40], [130, 1], 4, 1, 64, "float16", 0),  # GQA 4:1, pages ending mid-page, keys over three tiles
]


@needs_nvcc
@pytest.mark.parametrize("case", PAGED_HOST_CASES, ids=["verify-gqa4-d128", "mha-bf16-causal", "gqa4-d64"])
def test_kv_cache_prefill_paged_body_matches_float64_on_the_host(case, tmp_path):
    """The body over the cached pages (the runtime's layout: shuffled pages, the last page's length), on the
    host as above, against the float64 reference of the same keys and values gathered from the pages."""
    from autosched.search_spaces.templates.kv_cache_prefill import BLOCK_M, BLOCK_N, body_source

    q_lens, kv_lens, h, hkv, d, dtype, causal = case
    (q, q_indptr, pages, page_indptr, indices, last_len, sm_scale), ragged = paged_case(q_lens, kv_lens, h, hkv, d,
                                                                                         dtype)
    config = {"H": h, "HKV": hkv, "G": h // hkv, "D": d, "BM": BLOCK_M, "BN": BLOCK_N, "PAGE": pages.shape[3]}
    out, lse = _run_body_on_the_host(
        tmp_path, body_source("kv_prefill_body", dtype, config), dtype, d, _launch_ctas(len(q), len(q_lens), h, hkv),
        {"q": q, "qi": q_indptr, "pages": pages, "pi": page_indptr, "idx": indices, "last": last_len},
        f"kv_prefill_body(q.data(), qi.data(), pages.data(), pi.data(), idx.data(), last.data(), out.data(), "
        f"lse.data(), smem.data(), cta, {len(q_lens)}, {causal}, {sm_scale!r}f)")
    ref_out, ref_lse = reference(q, q_indptr, *ragged, sm_scale, bool(causal))
    check(out, lse, ref_out, ref_lse, dtype)
    assert ((ref_lse == EMPTY_LSE) == (lse == EMPTY_LSE)).all()


# --- the TIRx kernel, compiled for sm_90a ---------------------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize("h,hkv,d,dtype", [(32, 8, 128, "float16"), (32, 8, 128, "bfloat16"), (32, 32, 128, "float16"),
                                           (8, 2, 64, "float16")])
def test_kv_cache_prefill_compiles_for_sm90a_without_spills(h, hkv, d, dtype):
    """TVM's TIRx pipeline makes the launches of both kernels, over the new tokens and over the cached pages
    (the host-side check of ``rotary_mode``, a grid over the query tiles of every sequence and K/V head), and
    nvcc compiles them for sm_90a without spills."""
    import tvm

    from autosched.cuda_tools import cuda_source
    from autosched.generation.attention import CODEGEN
    from autosched.search_spaces.templates.kv_cache_prefill import (
        kv_cache_prefill_kernel,
        kv_cache_prefill_paged_kernel,
    )
    from autosched.target import parse_target

    from .nvcc import nvcc_compile

    sm90 = parse_target("cuda:sm_90", require_device=False)
    for kernel in (kv_cache_prefill_kernel(h, hkv, d, dtype), kv_cache_prefill_paged_kernel(h, hkv, d, dtype)):
        name = str(kernel.attrs["global_symbol"])
        mod = tvm.IRModule({name: kernel})
        hopper = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
        with hopper:
            lowered = str(tvm.tirx.get_tir_pipeline("tirx")[0](tvm.tirx.transform.BindTarget(hopper)(mod)))
        assert "rotary_mode == 0" in lowered
        report = nvcc_compile(cuda_source(mod, sm90, {}, CODEGEN), "sm_90a")
        assert report.ok and report.spills == 0, (name, report.log[-2000:])


def test_the_prefill_kernel_refuses_what_it_cannot_serve():
    from autosched.search_spaces.templates.kv_cache_prefill import kv_cache_prefill_kernel, unsupported

    assert unsupported(32, 8, 128, "float16") is None and unsupported(32, 32, 64, "bfloat16") is None
    assert "head dim 96" in unsupported(32, 8, 96, "float16")
    assert "float32" in unsupported(32, 8, 128, "float32")
    assert "6 query heads over 4" in unsupported(6, 4, 128, "float16")
    with pytest.raises(ValueError, match="head dim 256"):
        kv_cache_prefill_kernel(8, 8, 256, "float16")
    assert "page size 32" in unsupported(32, 8, 128, "float16", page=32)


def _run(executable, name: str, inputs, causal: int, device):
    """Calls a kernel of the runtime's ragged prefill signature (inputs as :func:`prefill_case` gives them) or
    of its paged one (as :func:`paged_case` does) on ``device``: (output, lse) as torch tensors on the CPU."""
    import torch
    import tvm

    *tensors, sm_scale = inputs
    q, q_indptr = tensors[:2]
    on = "cuda" if device.dlpack_device_type() == 2 else "cpu"
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=on)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=on)
    q_rope_position = torch.zeros(q.shape[0], dtype=torch.int32)  # unread at rotary_mode 0
    k_rope_pos_offset = torch.zeros(len(q_indptr) - 1, dtype=torch.int32)
    ragged = len(tensors) == 5  # q, q_indptr, k, v, kv_indptr (paged: q, q_indptr, pages, indptr, indices, last)
    tensors += [q_rope_position, k_rope_pos_offset] if ragged else [k_rope_pos_offset, q_rope_position]
    args = [tvm.runtime.from_dlpack(t.to(on).contiguous()) for t in tensors]
    args += [tvm.runtime.from_dlpack(out), tvm.runtime.from_dlpack(lse)]
    executable[name](*args, causal, 0, 1.0, 10000.0, sm_scale)
    if on == "cuda":
        torch.cuda.synchronize()
    return out.cpu(), lse.cpu()


@pytest.mark.slow
def test_the_reference_is_tvms_convention_by_its_cpu_kernel():
    """TVM's own ragged prefill for the CPU (the same convention as its GPU kernel) on the host cases' inputs:
    its output and base-2 log-sum-exp are the float64 reference's, causal and not, with more keys than
    queries (rows that see no key aside: TVM's CPU kernel leaves them unnormalised)."""
    import tvm
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_ragged_cpu

    shifted = ([5, 40, 1], [20, 40, 9], 4, 2, 64, "float16", 1)  # more keys than queries, causal
    for q_lens, kv_lens, h, hkv, d, dtype, causal in [*HOST_CASES, shifted]:
        if dtype != "float16":
            continue  # fp16 is enough for the convention
        kernel = _attention_prefill_ragged_cpu(hkv, h, d, d, dtype, {})
        executable = tvm.compile(tvm.IRModule({"main": kernel}), target={"kind": "llvm"})
        inputs = prefill_case(q_lens, kv_lens, h, hkv, d, dtype, spare_kv=0)
        out, lse = _run(executable, "main", inputs, causal, tvm.cpu())
        ref_out, ref_lse = reference(*inputs, causal=bool(causal))
        check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.slow
def test_the_paged_reference_is_tvms_convention_by_its_cpu_kernel():
    """TVM's own paged prefill for the CPU (the convention of its GPU kernel) on the paged host cases' inputs
    whose every row sees a key: its output and base-2 log-sum-exp are the float64 reference's."""
    import tvm
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu

    for q_lens, kv_lens, h, hkv, d, _, causal in [([5, 5], [544, 17], 8, 2, 128, "float16", 0),
                                                  ([3, 20], [40, 30], 2, 2, 64, "float16", 1)]:
        kernel = _attention_prefill_cpu(hkv, h, d, "float16", False, {})
        executable = tvm.compile(tvm.IRModule({"main": kernel}), target={"kind": "llvm"})
        inputs, ragged = paged_case(q_lens, kv_lens, h, hkv, d, "float16")
        out, lse = _run(executable, "main", inputs, causal, tvm.cpu())
        ref_out, ref_lse = reference(inputs[0], inputs[1], *ragged, inputs[-1], causal=bool(causal))
        check(out, lse, ref_out, ref_lse, "float16")


# --- on the GPU -----------------------------------------------------------------------------------------------

def _gpu_kernel(func, codegen: dict | None, paged: bool = False):
    """A kernel of the runtime's ragged (or ``paged``) prefill signature compiled for this machine's GPU:
    call(inputs, causal) -> (output, lse) as torch tensors on the CPU."""
    import tvm

    from autosched.target import compile_module, parse_target

    name = str(func.attrs["global_symbol"])
    executable = compile_module(tvm.IRModule({name: func}), parse_target("cuda"), {}, codegen)
    if paged:  # the cache calls it without the causal mask (the cached tokens precede every query)
        return lambda inputs, causal=0: _run(executable, name, inputs, causal, tvm.cuda())
    return lambda inputs, causal=1: _run(executable, name, inputs, causal, tvm.cuda())


# (q_lens, kv_lens): the runtime's own (keys are the queries), a single token, lengths no tile divides, one
# long prompt, 16 prompts of 512 (the packed prefill), and more keys than queries.
GPU_BATCHES = [([1], [1]), ([512], [512]), ([1, 17, 64, 65, 200, 3], [1, 17, 64, 65, 200, 3]),
               ([512] * 16, [512] * 16), ([1 + (37 * i) % 300 for i in range(8)], [1 + (37 * i) % 300 for i in range(8)]),
               ([5, 100, 1], [40, 300, 77])]


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv,d,dtype", [(32, 8, 128, "float16"), (32, 32, 128, "float16"), (32, 8, 128, "bfloat16"),
                                           (32, 32, 128, "bfloat16"), (16, 4, 64, "float16")])
def test_kv_cache_prefill_matches_float64_on_the_gpu(h, hkv, d, dtype):
    """Our kernel on ragged batches (1 to 16 sequences of 1 to 512 tokens), causal and not: output and
    base-2 log-sum-exp against float64."""
    from autosched.generation.attention import CODEGEN
    from autosched.search_spaces.templates.kv_cache_prefill import kv_cache_prefill_kernel

    kernel = _gpu_kernel(kv_cache_prefill_kernel(h, hkv, d, dtype), CODEGEN)
    for seed, (q_lens, kv_lens) in enumerate(GPU_BATCHES):
        inputs = prefill_case(q_lens, kv_lens, h, hkv, d, dtype, seed=seed)
        for causal in (1, 0) if sum(q_lens) <= 2048 else (1,):  # the float64 reference of 16 x 512 once
            out, lse = kernel(inputs, causal)
            ref_out, ref_lse = reference(*inputs, causal=bool(causal))
            check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv,dtype", [(32, 8, "float16"), (32, 32, "float16"), (32, 8, "bfloat16")])
def test_kv_cache_prefill_agrees_with_tvms_kernel_on_the_gpu(h, hkv, dtype):
    """The same causal inputs through TVM's ``batch_prefill_ragged_kv`` (d 128): the two outputs and
    log-sum-exps agree (the convention the cache's merge reads), and both match float64."""
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_ragged

    from autosched.generation.attention import CODEGEN
    from autosched.search_spaces.templates.kv_cache_prefill import kv_cache_prefill_kernel
    from autosched.target import parse_target

    d = 128
    ours = _gpu_kernel(kv_cache_prefill_kernel(h, hkv, d, dtype), CODEGEN)
    theirs = _gpu_kernel(_attention_prefill_ragged(hkv, h, d, d, dtype, {}, parse_target("cuda").tvm_target()), None)
    for seed, q_lens in enumerate([[1, 40, 333], [512] * 4, [7, 64, 129]]):
        inputs = prefill_case(q_lens, q_lens, h, hkv, d, dtype, seed=seed)
        ref_out, ref_lse = reference(*inputs)
        mine, tvms = ours(inputs), theirs(inputs)
        for out, lse in (mine, tvms):
            check(out, lse, ref_out, ref_lse, dtype)
        assert (mine[1] - tvms[1]).abs().max().item() < 2e-3


# (q_lens, kv_lens) over cached pages: verify steps (5 tokens over a prompt's cache, batch 1 and 16, one
# sequence without a cache), a chunked prefill (512 over 512) and lengths no tile or page divides.
GPU_PAGED_BATCHES = [([5], [544]), ([5] * 16, [544 + 7 * i for i in range(16)]), ([5, 5, 1], [100, 0, 33]),
                     ([512], [512]), ([1 + (37 * i) % 300 for i in range(8)], [(53 * i) % 600 for i in range(8)])]


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv,d,dtype", [(32, 8, 128, "float16"), (32, 32, 128, "float16"), (32, 8, 128, "bfloat16"),
                                           (16, 4, 64, "float16")])
def test_kv_cache_prefill_paged_matches_float64_on_the_gpu(h, hkv, d, dtype):
    """Our kernel over cached pages (the runtime's layout, shuffled), not causal as the cache calls it and
    causal: output and base-2 log-sum-exp against float64."""
    from autosched.generation.attention import CODEGEN
    from autosched.search_spaces.templates.kv_cache_prefill import kv_cache_prefill_paged_kernel

    kernel = _gpu_kernel(kv_cache_prefill_paged_kernel(h, hkv, d, dtype), CODEGEN, paged=True)
    for seed, (q_lens, kv_lens) in enumerate(GPU_PAGED_BATCHES):
        inputs, ragged = paged_case(q_lens, kv_lens, h, hkv, d, dtype, seed=seed)
        for causal in (0, 1):
            out, lse = kernel(inputs, causal)
            ref_out, ref_lse = reference(inputs[0], inputs[1], *ragged, inputs[-1], causal=bool(causal))
            check(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv,dtype", [(32, 8, "float16"), (32, 32, "float16")])
def test_kv_cache_prefill_paged_agrees_with_tvms_kernel_on_the_gpu(h, hkv, dtype):
    """The same inputs through TVM's ``batch_prefill_paged_kv`` (d 128, not causal, as the cache calls it):
    the two outputs and log-sum-exps agree (the convention the cache's merge reads), and both match float64."""
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill

    from autosched.generation.attention import CODEGEN
    from autosched.search_spaces.templates.kv_cache_prefill import kv_cache_prefill_paged_kernel
    from autosched.target import parse_target

    d = 128
    ours = _gpu_kernel(kv_cache_prefill_paged_kernel(h, hkv, d, dtype), CODEGEN, paged=True)
    theirs = _gpu_kernel(_attention_prefill(hkv, h, d, dtype, False, {}, parse_target("cuda").tvm_target()), None,
                         paged=True)
    for seed, (q_lens, kv_lens) in enumerate([([5], [544]), ([5] * 4, [40, 333, 17, 100]), ([64, 7], [512, 130])]):
        inputs, ragged = paged_case(q_lens, kv_lens, h, hkv, d, dtype, seed=seed)
        ref_out, ref_lse = reference(inputs[0], inputs[1], *ragged, inputs[-1], causal=False)
        mine, tvms = ours(inputs), theirs(inputs)
        for out, lse in (mine, tvms):
            check(out, lse, ref_out, ref_lse, dtype)
        assert (mine[1] - tvms[1]).abs().max().item() < 2e-3
