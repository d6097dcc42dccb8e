"""Our decode attention in the calling convention of TVM's paged KV cache (``kv_cache_decode``) and the
dispatch that puts it in a generation build in place of TVM's ``batch_decode_paged_kv``.

Without a GPU: the body, compiled for the host and run CTA by CTA (``test_gpu_spaces``' shim), matches a
float64 reference on the runtime's own layout (shuffled pages in CSR form, the last page's length, NaN in
every slot no sequence owns, a sequence without pages); the TIRx kernel compiles for sm_90a without spills;
a build for ``cuda:sm_90`` names it for the decode role and links it, a CPU build keeps TVM's.
On the GPU (``-m gpu``): the kernel against float64 and against TVM's kernel, and a tiny fp16 model's greedy
tokens against transformers' and against the build with TVM's kernel."""

from __future__ import annotations

import math
import shutil

import pytest

from .nvcc import host_output, run_on_host
from .test_gpu_spaces import HOST_SHIM, _host_body

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")

PAGE = 16
EMPTY_LSE = -5e4  # what TVM's kernel writes for a sequence without tokens (its initial max, a sum of 1)


def decode_case(contexts: list[int], h: int, hkv: int, d: int, dtype: str, seed: int = 0, spare_pages: int = 3):
    """Inputs in the runtime's convention: (q [b, h, d], pages [n, 2, hkv, PAGE, d], indptr [b + 1],
    indices, last_len [b], sm_scale), torch tensors on the CPU. Each sequence's pages are a shuffled subset;
    rows past a sequence's end and pages nobody owns hold NaN, so that reading them shows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    counts = [-(-c // PAGE) for c in contexts]
    total = sum(counts) + spare_pages
    pages = torch.full((total, 2, hkv, PAGE, d), float("nan"), dtype=dt)
    order = torch.randperm(total, generator=gen).tolist()
    indptr, indices, last_len = [0], [], []
    for ctx, n in zip(contexts, counts):
        own = order[:n]
        order = order[n:]
        for i, page in enumerate(own):
            rows = min(PAGE, ctx - i * PAGE)
            pages[page, :, :, :rows] = torch.randn((2, hkv, rows, d), generator=gen).to(dt)
        indices += own
        indptr.append(indptr[-1] + n)
        last_len.append(ctx - (n - 1) * PAGE if n else 0)
    q = torch.randn((len(contexts), h, d), generator=gen).to(dt)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return q, pages, as_int(indptr), as_int(indices), as_int(last_len), 1.0 / math.sqrt(d)


def reference(q, pages, indptr, indices, last_len, sm_scale):
    """(output [b, h, d], lse [b, h] in base 2) in float64; zeros and -5e4 for a sequence without pages."""
    import torch

    b, h, d = q.shape
    hkv, page = pages.shape[2], pages.shape[3]
    out = torch.zeros((b, h, d), dtype=torch.float64)
    lse = torch.full((b, h), EMPTY_LSE, dtype=torch.float64)
    for i in range(b):
        own = indices[int(indptr[i]):int(indptr[i + 1])].long()
        if len(own) == 0:
            continue
        ctx = (len(own) - 1) * page + int(last_len[i])
        kv = pages[own].double()  # [n, 2, hkv, page, d]
        k = kv[:, 0].permute(0, 2, 1, 3).reshape(-1, hkv, d)[:ctx]  # [ctx, hkv, d]
        v = kv[:, 1].permute(0, 2, 1, 3).reshape(-1, hkv, d)[:ctx]
        for head in range(h):
            kvh = head // (h // hkv)
            s = (k[:, kvh] @ q[i, head].double()) * sm_scale
            out[i, head] = torch.softmax(s, 0) @ v[:, kvh]
            lse[i, head] = torch.logsumexp(s, 0) / math.log(2)
    return out, lse


def check(out, lse, ref_out, ref_lse, dtype: str) -> None:
    import torch

    tol = 1e-2 if dtype == "bfloat16" else 5e-3
    err = (out.double().cpu() - ref_out).abs().max().item() / max(ref_out.abs().max().item(), 1e-6)
    assert err < tol, f"output: relative error {err}"
    lse_err = (lse.double().cpu() - ref_lse).abs().max().item()
    assert lse_err < 1e-3, f"log-sum-exp (base 2): error {lse_err}"
    assert torch.isfinite(out.float()).all()


# --- the body on the host (nvcc) ----------------------------------------------------------------------------

HOST_CASES = [
    # (contexts, h, hkv, d, dtype, split, spread_split, warps, unroll, spread[, warps a pair where spread])
    ([150, 1, 0, 37], 8, 2, 128, "float16", 4, 2, 4, 2, 0),  # GQA 4:1, a sequence without pages, one of one token
    ([70, 33], 4, 4, 64, "bfloat16", 1, 1, 2, 4, 0),  # MHA, no split
    ([16, 100, 17], 4, 2, 32, "float16", 8, 2, 2, 1, 0),  # head dim 32, more CTAs than pages
    ([150, 0, 37], 8, 2, 128, "float16", 4, 4, 4, 2, 1),  # spread: 6 pairs over 2 clusters of 4, 2 CTAs spare
    ([150, 0, 37, 5, 90], 4, 1, 128, "float16", 8, 2, 4, 2, 1),  # spread in clusters of 2: 5 pairs, 1 CTA spare
    ([300, 1, 37], 8, 2, 128, "float16", 2, 2, 16, 2, 0),  # GQA's default 16 warps, more warps than pages
    # fill: 4 pairs a CTA of 16 warps; 10 pairs in 3 CTAs (the last with 2 spare pairs) and a spare CTA
    ([150, 0, 37, 5, 90], 8, 2, 128, "float16", 8, 2, 16, 2, 1, 4),
    ([70, 33, 300], 4, 1, 64, "bfloat16", 4, 2, 16, 4, 1, 8),  # fill: 2 pairs a CTA, one pair spare
]


@needs_nvcc
@pytest.mark.parametrize("case", HOST_CASES,
                         ids=["gqa4-d128-split4", "mha-d64-bf16", "d32-split8", "spread", "spread2-of-split8", "gqa4-16-warps",
                              "fill-4-warps-a-pair", "fill-8-warps-a-pair"])
def test_kv_cache_decode_body_matches_float64_on_the_host(case, tmp_path):
    """The body, compiled for the host by nvcc and run with one thread per CUDA thread (each cluster's CTAs
    together), against the float64 reference: output and base-2 log-sum-exp; split (the cluster's CTAs share a
    pair's pages) and spread (each CTA takes a pair of its own)."""
    import torch

    from autosched.search_spaces.templates.kv_cache_decode import body_source, smem_floats

    contexts, h, hkv, d, dtype, split, spread_split, warps, unroll, spread, *fill = case
    per_pair = fill[0] if fill else warps
    q, pages, indptr, indices, last_len, sm_scale = decode_case(contexts, h, hkv, d, dtype)
    config = {"H": h, "HKV": hkv, "G": h // hkv, "D": d, "PAGE": PAGE, "WARPS": warps, "UNROLL": unroll,
              "SPLIT": split, "SPREAD_SPLIT": spread_split, "FILL": int(bool(fill))}
    size = spread_split if spread else split  # the cluster the launch chooses
    body = _host_body(body_source("kv_decode_body", dtype, config)).replace("__ldg(", "*(")
    for name, tensor in (("q", q), ("pages", pages), ("indptr", indptr), ("indices", indices), ("last", last_len)):
        (tmp_path / f"{name}.bin").write_bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    scalar = "half" if dtype == "float16" else "nv_bfloat16"
    words = smem_floats(h // hkv, d, warps)
    program = HOST_SHIM + body + f"""
template <class T> std::vector<T> load(const char* name) {{
  FILE* f = fopen(name, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<T> data(n / sizeof(T)); fread(data.data(), 1, n, f); fclose(f); return data;
}}
int main() {{
  auto q = load<{scalar}>("q.bin"); auto pages = load<{scalar}>("pages.bin");
  auto indptr = load<int>("indptr.bin"); auto indices = load<int>("indices.bin"); auto last = load<int>("last.bin");
  std::vector<{scalar}> out(q.size());
  std::vector<float> lse(q.size() / {d}, 12345.f);
  const int threads = {warps} * 32, split = {size};
  host_warps_per_cta = {warps};
  const int pairs = {len(contexts) * hkv}, spread = {spread}, pair_warps = {per_pair};
  const int ctas = (pairs + {warps} / pair_warps - 1) / ({warps} / pair_warps);  // spread: pairs a CTA
  for (int cl = 0; cl < (spread ? (ctas + split - 1) / split : pairs); ++cl) {{  // one cluster at a time
    std::barrier<> cluster(threads * split);
    host_cluster_barrier = &cluster;
    std::vector<std::vector<float>> smem(split, std::vector<float>({words}, -1.f));
    host_block_barriers.clear(); host_warp_barriers.clear(); host_smem.clear();
    for (int r = 0; r < split; ++r) {{
      host_block_barriers.push_back(new std::barrier<>(threads));
      host_smem.push_back(smem[r].data());
      for (int w = 0; w < {warps}; ++w) host_warp_barriers.push_back(new std::barrier<>(32));
    }}
    std::vector<std::thread> pool;
    for (int t = 0; t < threads * split; ++t)
      pool.emplace_back([&, t] {{
        host_rank = t / threads;
        host_thread.x = t % threads;
        kv_decode_body(q.data(), pages.data(), indptr.data(), indices.data(), last.data(), out.data(), lse.data(),
                       host_smem[host_rank], cl, host_rank, pairs, spread, pair_warps, {sm_scale!r}f);
      }});
    for (auto& th : pool) th.join();
    for (auto* b : host_block_barriers) delete b;
    for (auto* b : host_warp_barriers) delete b;
  }}
  FILE* f = fopen("out.bin", "wb"); fwrite(out.data(), sizeof({scalar}), out.size(), f); fclose(f);
  f = fopen("lse.bin", "wb"); fwrite(lse.data(), sizeof(float), lse.size(), f); fclose(f);
  return 0;
}}
"""
    run_on_host(tmp_path, program)
    out = host_output(tmp_path, "out", q.dtype, q.shape)
    lse = host_output(tmp_path, "lse", torch.float32, q.shape[:2])
    ref_out, ref_lse = reference(q, pages, indptr, indices, last_len, sm_scale)
    check(out, lse, ref_out, ref_lse, dtype)
    empty = [i for i, c in enumerate(contexts) if c == 0]
    assert (out[empty] == 0).all() and (lse[empty] == EMPTY_LSE).all()


# --- the TIRx kernel, compiled for sm_90a ---------------------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize("h,hkv,d,dtype", [(32, 8, 128, "float16"), (32, 32, 128, "float16"), (32, 4, 128, "bfloat16"),
                                           (8, 1, 256, "bfloat16"), (4, 2, 32, "float16"), (16, 16, 64, "bfloat16")])
def test_kv_cache_decode_compiles_for_sm90a_without_spills(h, hkv, d, dtype):
    """The kernel at its default split, unroll and warps: TVM's TIRx pipeline makes its launch (a cluster of
    ``split`` CTAs per (sequence, K/V head), the host-side check of ``rotary_mode``), and nvcc compiles it for
    sm_90a without spills."""
    import tvm

    from autosched.cuda_tools import cuda_source
    from autosched.generation.attention import CODEGEN
    from autosched.search_spaces.templates.kv_cache_decode import default_split, kv_cache_decode_kernel
    from autosched.target import parse_target

    from .nvcc import nvcc_compile

    sm90 = parse_target("cuda:sm_90", require_device=False)
    kernel = kv_cache_decode_kernel(h, hkv, d, dtype)
    name = str(kernel.attrs["global_symbol"])
    mod = tvm.IRModule({name: kernel})
    hopper = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with hopper:
        lowered = str(tvm.tirx.get_tir_pipeline("tirx")[0](tvm.tirx.transform.BindTarget(hopper)(mod)))
    assert "rotary_mode == 0" in lowered
    if default_split(hkv) > 1:
        assert 'T.launch_thread("clusterCtaIdx.x"' in lowered
    report = nvcc_compile(cuda_source(mod, sm90, {}, CODEGEN), "sm_90a")
    assert report.ok and report.spills == 0, report.log[-2000:]


def test_the_kernel_refuses_what_it_cannot_serve():
    from autosched.search_spaces.templates.kv_cache_decode import default_split, spreads, unsupported

    assert unsupported(32, 8, 128, "float16", 16) is None
    assert "head dim 80" in unsupported(32, 8, 80, "float16", 16)
    assert "page size 32" in unsupported(32, 8, 128, "float16", 32)
    assert "float32" in unsupported(32, 8, 128, "float32", 16)
    assert "groups of 16" in unsupported(32, 2, 128, "float16", 16)
    # batch 1 fills the SMs at most twice (sm_90's 132 where no GPU is at hand): 32 K/V heads split 8 ways, 64 four
    # ways, at most 8 ways; on a GPU of 114 SMs (an H100 PCIe), 32 K/V heads four ways
    assert (default_split(32), default_split(64), default_split(8), default_split(1)) == (8, 4, 8, 8)
    assert default_split(32, sms=114) == 4
    # From about one pair per SM on (16 sequences x 8 K/V heads), each CTA takes a pair of its own.
    assert spreads(128) and spreads(512) and not spreads(64) and not spreads(32)
    assert spreads(110, sms=114) and not spreads(110)


def test_the_kernel_is_made_for_the_gpus_sms():
    from autosched.search_spaces.templates.kv_cache_decode import kv_cache_decode_kernel

    def symbol(**kwargs):
        return str(kv_cache_decode_kernel(32, 32, 128, "float16", **kwargs).attrs["global_symbol"])

    assert "_split8_" in symbol() and "_split4_" in symbol(sms=114)


# --- the dispatch in a generation build ---------------------------------------------------------------------

def test_the_decode_kernel_chooses_its_cluster_at_launch():
    """One kernel serves every batch of a cache: at batch 1 a cluster of 8 CTAs splits each (sequence, K/V
    head) pair; where a step's pairs fill the GPU, clusters of 2 each take pairs whole. The cluster's size is a
    launch parameter chosen from the step's pairs; without GQA the registers are bounded for 4 CTAs an SM."""
    import tvm

    from autosched.search_spaces.templates.kv_cache_decode import default_config, kv_cache_decode_kernel

    assert default_config(1, 32, 128) == {"split": 8, "spread_split": 2, "warps": 8, "unroll": 4, "blocks": 4,
                                          "fill": False}
    assert default_config(4, 8, 128) == {"split": 8, "spread_split": 2, "warps": 16, "unroll": 2, "blocks": None,
                                         "fill": True}
    assert default_config(8, 4, 128)["warps"] == 8  # 16 warps' partials of 8 heads would not fit 48 KB
    kernel = kv_cache_decode_kernel(32, 32, 128, "float16")
    assert str(kernel.attrs["global_symbol"]).endswith("_split8_spread2_warps8_unroll4_blocks4_float16")
    hopper = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with hopper:
        lowered = str(tvm.tirx.get_tir_pipeline("tirx")[0](tvm.tirx.transform.BindTarget(hopper)(
            tvm.IRModule({"main": kernel}))))
    # 32 K/V heads: from batch 4 on (128 pairs, nine tenths of 132 SMs or more) clusters of 2, below of 8.
    assert "T.Select(4 <= B, 2, 8)" in lowered and 'T.launch_thread("clusterCtaIdx.x"' in lowered


@needs_nvcc
@pytest.mark.slow
def test_the_spread_kernel_fits_four_ctas_an_sm_without_spills():
    """Without GQA: ``__launch_bounds__(256, 4)``, and nvcc fits the body in 64 registers without spilling."""
    import tvm

    from autosched.cuda_tools import cuda_source
    from autosched.generation.attention import CODEGEN
    from autosched.search_spaces.templates.kv_cache_decode import kv_cache_decode_kernel
    from autosched.target import parse_target

    from .nvcc import nvcc_compile

    kernel = kv_cache_decode_kernel(32, 32, 128, "float16")
    name = str(kernel.attrs["global_symbol"])
    assert name.endswith("_warps8_unroll4_blocks4_float16")
    source = cuda_source(tvm.IRModule({name: kernel}), parse_target("cuda:sm_90", require_device=False), {}, CODEGEN)
    assert "__launch_bounds__(256, 4)" in source
    report = nvcc_compile(source, "sm_90a")
    assert report.ok and report.spills == 0, report.log[-2000:]


def _tiny(head_dim: int = 64, **overrides):
    from autosched.generation.decoder import DecoderConfig

    heads = 4
    fields = dict(family="llama", vocab=256, hidden=heads * head_dim, heads=heads, kv_heads=2, head_dim=head_dim,
                  layers=1, mlp=128, rotary_dim=head_dim, dtype="float16")
    return DecoderConfig(**(fields | overrides))


@pytest.mark.slow
def test_a_build_for_sm90_runs_our_attention_kernels_and_a_cpu_build_keeps_tvms_decode_and_ragged_prefill():
    """``cuda:sm_90``: the cache's decode and prefill kernels are ours (the report names them, TVM's
    PrimFuncs are gone, the executable's function table holds ours as packed functions linked in from their
    own TIRx builds), the sliding-window variants stay TVM's; so are its merge and rotary kernels (in the
    module), which the report does not count as default-scheduled kernels.
    ``llvm``: the decode and ragged prefill stay TVM's; the merge, rotary and paged prefill kernels are ours (the
    last in place of TVM's CPU kernel, under its name)."""
    from autosched.generation.attention import DECODE_ROLE, MERGE_ROLE, PAGED_PREFILL_ROLE, RAGGED_PREFILL_ROLE, ROPE_ROLE
    from autosched.generation.build import lower_generation, schedule_generation
    from autosched.pipeline.build import build_pipeline, compile_separate
    from autosched.target import compile_module, parse_target

    sm90 = parse_target("cuda:sm_90", require_device=False)
    lowered, _ = lower_generation(_tiny(), sm90, (1,))
    scheduled, report, applied = schedule_generation(lowered, None, sm90)
    ours = report.attention[DECODE_ROLE]
    assert ours.startswith("autosched kv_cache_decode (autosched_kv_cache_decode_h4_hkv2_d64_page16_")
    assert "TVM default for the sliding-window variant (batch_decode_paged_kv_sliding_window)" in ours
    ragged = report.attention[RAGGED_PREFILL_ROLE]
    assert ragged == "autosched kv_cache_prefill (autosched_kv_cache_prefill_h4_hkv2_d64_bm64_bn64_float16)"
    paged = report.attention[PAGED_PREFILL_ROLE]
    assert paged == ("autosched kv_cache_prefill (autosched_kv_cache_prefill_paged16_h4_hkv2_d64_bm64_bn64_float16); "
                     "TVM default for the sliding-window variant (batch_prefill_paged_kv_sliding_window)")
    merge, rope = report.attention[MERGE_ROLE], report.attention[ROPE_ROLE]
    assert merge == "autosched kv_cache_merge (autosched_kv_cache_merge_h4_d64_float16)"
    assert rope == "autosched kv_cache_rope (autosched_kv_cache_rope_h4_hkv2_d64_r64_float16)"
    assert ("except ours for decode over cached pages, merge of partial attention, prefill over cached pages, "
            "prefill over new tokens (ragged), rotary embedding and q/k/v split" in report.summary())
    assert not {"autosched_kv_cache_merge_h4_d64_float16", "autosched_kv_cache_rope_h4_hkv2_d64_r64_float16"} & set(
        report.default)
    names = [role.split("(")[1].split(")")[0] for role in (ours, ragged, paged)]
    functions = [gv.name_hint for gv in scheduled.functions]
    assert not {"batch_decode_paged_kv", "batch_prefill_ragged_kv", "batch_prefill_paged_kv"} & set(functions)
    executable = compile_module(scheduled, sm90, {}, relax_pipeline=build_pipeline(sm90))
    executable = compile_separate(executable, applied, sm90)
    for name in names:
        assert name in applied.separate
        assert f'R.ExternFunc("{name}")' in scheduled["create_paged_kv_cache"].script()
        assert f"@{name} packed_func" in executable.as_text()
        assert any(m.kind == "cuda" and name in m.inspect_source()
                   for lib in executable.mod.imports for m in [lib, *lib.imports])

    cpu = parse_target("llvm")
    lowered, _ = lower_generation(_tiny(), cpu, (1,))
    from autosched.generation.attention import dispatch_attention

    _, served, kernels = dispatch_attention(lowered, cpu)
    assert set(served) == {MERGE_ROLE, ROPE_ROLE} and kernels == {}  # the attention kernels stay TVM's
    _, report, _ = schedule_generation(lowered, None, cpu)
    assert report.attention[PAGED_PREFILL_ROLE] == ("autosched cpu_paged_prefill (batch_prefill_paged_kv_cpu); "
                                                    "TVM default (batch_prefill_paged_kv_cpu_sliding_window)")
    assert report.attention[DECODE_ROLE] == ("TVM default (batch_decode_paged_kv_cpu, "
                                             "batch_decode_paged_kv_cpu_sliding_window)")


@pytest.mark.slow
def test_the_dispatch_names_tvms_kernel_as_the_fallback_with_the_reason():
    from autosched.generation.attention import DECODE_ROLE, MERGE_ROLE, RAGGED_PREFILL_ROLE, ROPE_ROLE, dispatch_attention
    from autosched.generation.build import lower_generation
    from autosched.target import parse_target

    sm90 = parse_target("cuda:sm_90", require_device=False)
    lowered, _ = lower_generation(_tiny(head_dim=16), sm90, ())
    mod, served, kernels = dispatch_attention(lowered, sm90)
    assert served[DECODE_ROLE] == "TVM default (batch_decode_paged_kv): ours does not serve head dim 16 (one of 32, 64, 128, 256)"
    assert served[RAGGED_PREFILL_ROLE] == "TVM default (batch_prefill_ragged_kv): ours does not serve head dim 16 (64 or 128)"
    assert not kernels and "batch_decode_paged_kv" in {gv.name_hint for gv in mod.functions}
    # the merge and rotary kernels are plain TIR for any head dim and any CUDA architecture
    assert served[MERGE_ROLE].startswith("autosched kv_cache_merge (autosched_kv_cache_merge_h4_d16_")
    sm80 = parse_target("cuda:sm_80", require_device=False)
    lowered, _ = lower_generation(_tiny(), sm80, ())
    mod, served, kernels = dispatch_attention(lowered, sm80)
    assert "target cuda:sm_80 (sm_90 only)" in served[DECODE_ROLE] and not kernels
    assert "target cuda:sm_80 (sm_90 only)" in served[RAGGED_PREFILL_ROLE]
    assert served[ROPE_ROLE].startswith("autosched kv_cache_rope (")


# --- on the GPU -----------------------------------------------------------------------------------------------

def _gpu_kernel(func, codegen: dict | None):
    """A decode kernel of the runtime's signature compiled for this machine's GPU: call(inputs, h, d) ->
    (output, lse) as torch tensors on the CPU."""
    import torch
    import tvm

    from autosched.target import compile_module, parse_target

    name = str(func.attrs["global_symbol"])
    executable = compile_module(tvm.IRModule({name: func}), parse_target("cuda"), {}, codegen)

    def call(inputs, h: int, d: int):
        q, pages, indptr, indices, last_len, sm_scale = (x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs)
        b = q.shape[0]
        out = torch.full((b, h, d), float("nan"), dtype=q.dtype, device="cuda")
        lse = torch.full((b, h), float("nan"), dtype=torch.float32, device="cuda")
        rope_offsets = torch.zeros(b, dtype=torch.int32, device="cuda")  # unread at rotary_mode 0
        args = [q, pages, indptr, indices, last_len, rope_offsets, rope_offsets.clone(), out, lse]
        executable[name](*(tvm.runtime.from_dlpack(t.contiguous()) for t in args), 0, 1.0, 10000.0, sm_scale)
        torch.cuda.synchronize()
        return out.cpu(), lse.cpu()

    return call


# The last two: with 32:8 heads, 160 and 320 pairs, which the default kernel serves 8 and 4 warps a pair (fill).
GPU_BATCHES = [[1], [600], [5, 16, 17, 300], [1 + (37 * i) % 600 for i in range(16)],
               [1 + (29 * i) % 200 for i in range(20)], [(53 * i) % 300 for i in range(40)]]


@pytest.mark.gpu
@pytest.mark.parametrize("h,hkv", [(32, 8), (32, 32)], ids=["gqa32-8", "mha32"])
def test_kv_cache_decode_matches_float64_on_the_gpu(h, hkv):
    """Our kernel (default knobs) on random pages in the runtime's layout, batches of 1 to 40 sequences of
    0 to 600 tokens, d 128, fp16: output and base-2 log-sum-exp against float64."""
    from autosched.generation.attention import CODEGEN
    from autosched.search_spaces.templates.kv_cache_decode import kv_cache_decode_kernel

    kernel = _gpu_kernel(kv_cache_decode_kernel(h, hkv, 128, "float16"), CODEGEN)
    for seed, contexts in enumerate(GPU_BATCHES):
        inputs = decode_case(contexts, h, hkv, 128, "float16", seed=seed)
        out, lse = kernel(inputs, h, 128)
        ref_out, ref_lse = reference(*inputs)
        check(out, lse, ref_out, ref_lse, "float16")


@pytest.mark.gpu
def test_kv_cache_decode_agrees_with_tvms_kernel_on_the_gpu():
    """The same inputs through TVM's ``batch_decode_paged_kv`` (GQA 32:8, d 128, fp16): the two outputs and
    log-sum-exps agree (the convention the cache's merge reads), and both match float64."""
    from tvm.relax.frontend.nn.llm._decode_kernels import _attention_decode

    from autosched.generation.attention import CODEGEN
    from autosched.search_spaces.templates.kv_cache_decode import kv_cache_decode_kernel
    from autosched.target import parse_target

    h, hkv, d = 32, 8, 128
    inputs = decode_case([1, 40, 333], h, hkv, d, "float16", seed=7)
    ours = _gpu_kernel(kv_cache_decode_kernel(h, hkv, d, "float16"), CODEGEN)(inputs, h, d)
    tvm_kernel = _attention_decode(hkv, h, d, "float16", False, {}, parse_target("cuda").tvm_target())
    theirs = _gpu_kernel(tvm_kernel, None)(inputs, h, d)
    ref_out, ref_lse = reference(*inputs)
    for out, lse in (ours, theirs):
        check(out, lse, ref_out, ref_lse, "float16")
    assert (ours[1] - theirs[1]).abs().max().item() < 1e-3


@pytest.mark.gpu
def test_tiny_fp16_model_generates_with_our_decode_attention(tmp_path, monkeypatch):
    """A tiny fp16 Llama (head dim 64, GQA 4:2) built for the GPU: the manifest names our kernels for the
    decode and ragged prefill roles, and its greedy tokens over prompts of 1 to 300 tokens are transformers'
    on the same GPU and the tokens of the same build on TVM's attention kernels, or the first difference is
    a near-tie of transformers' logits (margin under 0.05)."""
    import json

    import torch

    from autosched.generation import Generator
    from autosched.generation import attention as dispatch

    from .helpers import cli
    from .test_generation import _saved_model

    monkeypatch.setattr("autosched.examples.hf.TINY", {"hidden": 256, "heads": 4, "kv_heads": 2, "mlp": 256,
                                                       "vocab": 512})
    model = _saved_model("llama", tmp_path / "hf")
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    prompts = [[7], [(5 * i + 3) % 512 for i in range(17)], [(11 * i + 1) % 512 for i in range(150)],
               [(13 * i + 2) % 512 for i in range(300)]]
    flags = ["--target", "cuda", "--dtype", "float16", "--max-seq-len", "512", "--max-batch", "4"]
    cli("build", str(tmp_path / "hf"), "--generate", "-o", str(tmp_path / "ours"), "--db", str(tmp_path / "t.db"),
        *flags)
    manifest = json.loads((tmp_path / "ours" / "manifest.json").read_text())
    assert manifest["attention"][dispatch.DECODE_ROLE].startswith("autosched kv_cache_decode")
    assert manifest["attention"][dispatch.RAGGED_PREFILL_ROLE].startswith("autosched kv_cache_prefill")
    monkeypatch.setattr(dispatch, "ARCHS", ())  # the dispatch refuses every target: TVM's kernel
    cli("build", str(tmp_path / "hf"), "--generate", "-o", str(tmp_path / "tvm"), "--db", str(tmp_path / "t.db"),
        *flags)
    manifest = json.loads((tmp_path / "tvm" / "manifest.json").read_text())
    assert manifest["attention"][dispatch.DECODE_ROLE].startswith("TVM default")
    ours = Generator(tmp_path / "ours").generate(prompts, 16)
    theirs_tvm = Generator(tmp_path / "tvm").generate(prompts, 16)
    model = model.to("cuda", torch.float16)
    for prompt, mine, tvms in zip(prompts, ours, theirs_tvm):
        assert mine.error is None and mine.tokens  # fewer than 16 if a stop token came
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        hf = out.sequences[0, len(prompt):].tolist()
        # Against transformers; then against TVM's kernel over the tokens where ours and transformers' agree
        # (transformers' logits are those of that prefix).
        agree = next((i for i, (a, b) in enumerate(zip(mine.tokens, hf)) if a != b), 16)
        for other, upto in ((hf, 16), (tvms.tokens, agree)):
            diff = next((i for i, (a, b) in enumerate(zip(mine.tokens[:upto], other)) if a != b), None)
            if diff is not None:
                top = out.scores[diff][0].float().topk(2).values
                assert float(top[0] - top[1]) < 0.05, f"prompt of {len(prompt)}: token {diff} differs away from a near-tie"
